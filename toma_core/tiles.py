"""Local tiles of a row-major token grid.

A grid of h x w tokens is cut into non-overlapping ``tile`` x ``tile`` squares, in row-major tile order,
tokens row-major inside each tile. When h or w is not a multiple of ``tile`` the grid is padded at the
bottom/right with masked tokens, so every real token belongs to exactly one tile and all tiles have the
same shape (one batched matmul serves them all).
"""
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TileGrid:
    """Geometry of the tiling of an ``h`` x ``w`` grid into ``tile`` x ``tile`` tiles."""

    h: int
    w: int
    tile: int

    def __post_init__(self):
        if self.h < 1 or self.w < 1:
            raise ValueError(f"token grid must be at least 1x1, got {self.h}x{self.w}")
        if self.tile < 1:
            raise ValueError(f"tile must be >= 1, got {self.tile}")

    @property
    def rows(self) -> int:
        return -(-self.h // self.tile)

    @property
    def cols(self) -> int:
        return -(-self.w // self.tile)

    @property
    def num_tiles(self) -> int:
        return self.rows * self.cols

    @property
    def tile_size(self) -> int:
        return self.tile * self.tile

    @property
    def num_tokens(self) -> int:
        return self.h * self.w

    @property
    def padded(self) -> bool:
        return self.rows * self.tile != self.h or self.cols * self.tile != self.w

    @cached_property
    def valid(self) -> torch.Tensor:
        """(T, S) bool: which tile slots hold a real token (False only for padding)."""
        t = self.tile
        ys = torch.arange(self.rows * t).view(self.rows, t, 1, 1) < self.h
        xs = torch.arange(self.cols * t).view(1, 1, self.cols, t) < self.w
        return (ys & xs).permute(0, 2, 1, 3).reshape(self.num_tiles, self.tile_size)

    @cached_property
    def tile_origin(self) -> torch.Tensor:
        """(T, S) long: raster index of each tile slot in the padded grid (for positions of tokens)."""
        t = self.tile
        ys = torch.arange(self.rows * t).view(self.rows, t, 1, 1)
        xs = torch.arange(self.cols * t).view(1, 1, self.cols, t)
        idx = ys.clamp(max=self.h - 1) * self.w + xs.clamp(max=self.w - 1)
        return idx.permute(0, 2, 1, 3).reshape(self.num_tiles, self.tile_size)


@lru_cache(maxsize=256)
def grid_on(grid: TileGrid, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, tile_origin) of ``grid`` on ``device``, copied there once per (grid, device): a copy from the
    host inside a block call would make the host wait for the device on every call."""
    return grid.valid.to(device), grid.tile_origin.to(device)


def tile_tokens(x: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """(B, h*w, C) raster tokens -> (B, T, S, C) tiles; padding slots are zeros."""
    B, N, C = x.shape
    if N != grid.num_tokens:
        raise ValueError(f"expected {grid.h}x{grid.w}={grid.num_tokens} tokens, got {N}")
    t = grid.tile
    g = x.view(B, grid.h, grid.w, C)
    if grid.padded:
        g = F.pad(g, (0, 0, 0, grid.cols * t - grid.w, 0, grid.rows * t - grid.h))
    g = g.view(B, grid.rows, t, grid.cols, t, C).permute(0, 1, 3, 2, 4, 5)
    return g.reshape(B, grid.num_tiles, grid.tile_size, C)


def untile_tokens(tiles: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """(B, T, S, C) tiles -> (B, h*w, C) raster tokens; padding slots are dropped."""
    B, T, S, C = tiles.shape
    t = grid.tile
    g = tiles.view(B, grid.rows, grid.cols, t, t, C).permute(0, 1, 3, 2, 4, 5)
    g = g.reshape(B, grid.rows * t, grid.cols * t, C)
    if grid.padded:
        g = g[:, : grid.h, : grid.w]
    return g.reshape(B, grid.num_tokens, C)
