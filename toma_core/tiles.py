"""Local windows of a raster token grid: tiles of an image, or tiles spanning a few frames of a video.

A grid of ``frames`` x h x w tokens (raster order: frame-major, then row, then column; an image is one
frame) is cut into non-overlapping windows ("tiles") of ``temporal_window`` x ``window_size`` x
``window_size`` tokens. Windows come in raster order (frame window, then tile row, then tile column),
tokens inside a window in raster order too. When a side is not a multiple of its window side the grid
is padded at the end of that axis (last frames, bottom, right) with masked tokens, so every real token
belongs to exactly one window and all windows have the same shape (one batched matmul serves them all).
With one frame per window the windows are exactly the 2-D tiles of each frame.

A ``Slab`` of a grid is a contiguous run of its raster tokens: what one rank holds under sequence
parallelism (raylight's USP cuts the token sequence into one slab per GPU). Its windows (``SlabGrid``) are
the grid's own windows cut to the slab: every window holding a token of the slab, with the slots of its
other tokens as padding. A slab may start and end anywhere, mid-row or mid-frame; where its bounds fall
between windows it is tiled exactly as the whole grid is there.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .memory import made_kept


@dataclass(frozen=True)
class TileGrid:
    """Geometry of the tiling of a ``frames`` x ``h`` x ``w`` grid into ``temporal_window`` x ``window_size`` x
    ``window_size`` windows ("tiles"; ``frames`` = ``temporal_window`` = 1 is an image cut into 2-D tiles)."""

    h: int
    w: int
    window_size: int
    frames: int = 1
    temporal_window: int = 1

    def __post_init__(self):
        if self.h < 1 or self.w < 1:
            raise ValueError(f"token grid must be at least 1x1, got {self.h}x{self.w}")
        if self.window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {self.window_size}")
        if self.frames < 1:
            raise ValueError(f"frames must be >= 1 (an image is 1 frame), got {self.frames}")
        if self.temporal_window < 1:
            raise ValueError(f"temporal_window must be >= 1 (1 = 2-D tiles in each frame), got {self.temporal_window}")

    @property
    def rows(self) -> int:
        return -(-self.h // self.window_size)

    @property
    def cols(self) -> int:
        return -(-self.w // self.window_size)

    @property
    def frame_windows(self) -> int:
        """Windows along the frame axis."""
        return -(-self.frames // self.temporal_window)

    @property
    def num_tiles(self) -> int:
        return self.frame_windows * self.rows * self.cols

    @property
    def tile_size(self) -> int:
        return self.temporal_window * self.window_size * self.window_size

    @property
    def num_tokens(self) -> int:
        return self.frames * self.h * self.w

    @property
    def padded(self) -> bool:
        return (self.frame_windows * self.temporal_window != self.frames or self.rows * self.window_size != self.h
                or self.cols * self.window_size != self.w)

    def _window_axes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded frame, row and column of every slot, as aranges shaped to broadcast to
        (frame windows, temporal_window, rows, window_size, cols, window_size)."""
        f, t = self.temporal_window, self.window_size
        frame = torch.arange(self.frame_windows * f).view(-1, f, 1, 1, 1, 1)
        row = torch.arange(self.rows * t).view(1, 1, -1, t, 1, 1)
        col = torch.arange(self.cols * t).view(1, 1, 1, 1, -1, t)
        return frame, row, col

    def _to_slots(self, per_position: torch.Tensor) -> torch.Tensor:
        """(frame windows, temporal_window, rows, window_size, cols, window_size) -> (T, S) in window and slot order."""
        return per_position.permute(0, 2, 4, 1, 3, 5).reshape(self.num_tiles, self.tile_size)

    @property
    def valid(self) -> torch.Tensor:
        """(T, S) bool: which tile slots hold a real token (False only for padding); made on every read
        (``grid_on`` keeps it per device: a functools.cached_property's lock cannot be traced by
        torch.compile)."""
        frame, row, col = self._window_axes()
        return self._to_slots((frame < self.frames) & (row < self.h) & (col < self.w))

    @property
    def tile_origin(self) -> torch.Tensor:
        """(T, S) long: raster index in the frames x h x w grid of each tile slot; a padding slot names
        the nearest real token (for positions of tokens)."""
        frame, row, col = self._window_axes()
        raster = (frame.clamp(max=self.frames - 1) * self.h + row.clamp(max=self.h - 1)) * self.w
        return self._to_slots(raster + col.clamp(max=self.w - 1))


class Slab(NamedTuple):
    """The raster tokens [begin, end) of a token grid of ``shape`` ((h, w) or (frames, h, w)): one rank's
    slab under sequence parallelism. ``extra``: destinations its plan keeps beyond the ratio's
    (plan.kept_per_tile), so that the slabs of every rank merge to as many tokens (plan.slab_extras)."""

    shape: tuple
    begin: int
    end: int
    extra: int = 0


@dataclass(frozen=True)
class SlabGrid:
    """The windows of ``grid`` cut to its raster tokens [begin, end) (a ``Slab``): those holding a token
    of the slab, in the grid's window order, each with the slots of its tokens outside the slab as
    padding (never a destination, no weight), so every token of the slab merges inside its own window.
    ``extra``: as Slab's. Offers what plans read of a TileGrid (``valid``, ``tile_origin``, sizes), with
    raster indices counted from ``begin``; tokens go in and out of the windows by a gather each way (a
    window's tokens are no run of the slab)."""

    grid: TileGrid
    begin: int
    end: int
    extra: int = 0

    def __post_init__(self):
        if not 0 <= self.begin < self.end <= self.grid.num_tokens:
            raise ValueError(f"a slab is a non-empty run of the grid's {self.grid.num_tokens} tokens, got "
                             f"[{self.begin}, {self.end})")
        if self.extra < 0:
            raise ValueError(f"extra destinations must be >= 0, got {self.extra}")

    @property
    def window_size(self) -> int:
        return self.grid.window_size

    @property
    def temporal_window(self) -> int:
        return self.grid.temporal_window

    @property
    def tile_size(self) -> int:
        return self.grid.tile_size

    @property
    def num_tokens(self) -> int:
        return self.end - self.begin

    @property
    def num_tiles(self) -> int:
        return slab_windows(self)[0].shape[0]

    @property
    def padded(self) -> bool:
        return not bool(slab_windows(self)[0].all())

    @property
    def valid(self) -> torch.Tensor:
        """(T, S) bool: which slots hold a token of the slab."""
        return slab_windows(self)[0]

    @property
    def tile_origin(self) -> torch.Tensor:
        """(T, S) long: index in the slab of each slot's token; a padding slot names a token of the slab."""
        return slab_windows(self)[1]


@lru_cache(maxsize=256)
def slab_windows(slab: SlabGrid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid (T, S), tile_origin (T, S), slot (N,)) of ``slab`` on the CPU, from its grid's windows: which
    slots hold a token of the slab, each slot's token (counted from ``begin``), and each token's slot in the
    flattened (T * S) windows (the gather that takes the windows back to raster order)."""
    origin = slab.grid.tile_origin
    inside = slab.grid.valid & (origin >= slab.begin) & (origin < slab.end)
    tiles = inside.any(1).nonzero().squeeze(1)
    inside, origin = inside[tiles], (origin[tiles] - slab.begin).clamp(0, slab.num_tokens - 1)
    slot = torch.empty(slab.num_tokens, dtype=torch.long)
    slot[origin[inside]] = torch.arange(inside.numel()).view(inside.shape)[inside]
    return inside, origin, slot


def token_grid(shape, window_size: int, temporal_window: int = 1) -> "TileGrid | SlabGrid":
    """The TileGrid of a token grid ``shape`` = (h, w) or (frames, h, w), or the SlabGrid of a ``Slab`` of
    one. A window spans at most the frames there are: padding frames would cost selection time and
    change nothing (an image, or a one-frame video, plans exactly as with 2-D tiles whatever
    ``temporal_window`` says)."""
    if isinstance(shape, Slab):
        return SlabGrid(token_grid(shape.shape, window_size, temporal_window), shape.begin, shape.end, shape.extra)
    if temporal_window < 1:
        raise ValueError(f"temporal_window must be >= 1 (1 = 2-D tiles in each frame), got {temporal_window}")
    if len(shape) == 2:
        return TileGrid(shape[0], shape[1], window_size)
    if len(shape) == 3:
        return TileGrid(shape[1], shape[2], window_size, frames=shape[0],
                        temporal_window=min(temporal_window, shape[0]))
    raise ValueError(f"token grid must be (h, w) or (frames, h, w), got {tuple(shape)}")


@lru_cache(maxsize=256)
@made_kept
def grid_on(grid: TileGrid, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid, tile_origin) of ``grid`` (a TileGrid or SlabGrid) on ``device``, copied there once per (grid,
    device): a copy from the host inside a block call would make the host wait for the device on every
    call."""
    return grid.valid.to(device), grid.tile_origin.to(device)


@lru_cache(maxsize=256)
@made_kept
def slots_on(slab: SlabGrid, device: torch.device) -> torch.Tensor:
    """``slab_windows``' slot of each token of ``slab``, on ``device`` (copied once)."""
    return slab_windows(slab)[2].to(device)


def tile_tokens(x: torch.Tensor, grid: TileGrid, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, frames*h*w, C) raster tokens -> (B, T, S, C) tiles (in ``dtype``, default x's); padding slots are
    zeros. Without padding, one copy reorders and converts at once. A SlabGrid's windows are gathered."""
    B, N, C = x.shape
    if isinstance(grid, SlabGrid):
        if N != grid.num_tokens:
            raise ValueError(f"expected the slab's {grid.num_tokens} tokens, got {N}")
        valid, origin = grid_on(grid, x.device)
        tiles = x.index_select(1, origin.view(-1)).view(B, *origin.shape, C)
        return tiles.to(dtype or x.dtype).masked_fill_(~valid[None, :, :, None], 0)
    if N != grid.num_tokens:
        raise ValueError(f"expected {grid.frames}x{grid.h}x{grid.w}={grid.num_tokens} tokens, got {N}")
    f, t = grid.temporal_window, grid.window_size
    g = x.view(B, grid.frames, grid.h, grid.w, C)
    if grid.padded:
        g = F.pad(g, (0, 0, 0, grid.cols * t - grid.w, 0, grid.rows * t - grid.h,
                      0, grid.frame_windows * f - grid.frames))
    g = g.view(B, grid.frame_windows, f, grid.rows, t, grid.cols, t, C).permute(0, 1, 3, 5, 2, 4, 6, 7)
    if dtype is None or dtype == x.dtype:
        return g.reshape(B, grid.num_tiles, grid.tile_size, C)
    out = x.new_empty(B, grid.num_tiles, grid.tile_size, C, dtype=dtype)
    out.view(g.shape).copy_(g)
    return out


def untile_tokens(tiles: torch.Tensor, grid: TileGrid) -> torch.Tensor:
    """(B, T, S, C) tiles -> (B, frames*h*w, C) raster tokens (a SlabGrid: the slab's); padding slots are
    dropped."""
    B, T, S, C = tiles.shape
    if isinstance(grid, SlabGrid):
        return tiles.reshape(B, T * S, C).index_select(1, slots_on(grid, tiles.device))
    f, t = grid.temporal_window, grid.window_size
    g = tiles.view(B, grid.frame_windows, grid.rows, grid.cols, f, t, t, C).permute(0, 1, 4, 2, 5, 3, 6, 7)
    g = g.reshape(B, grid.frame_windows * f, grid.rows * t, grid.cols * t, C)
    if grid.padded:
        g = g[:, : grid.frames, : grid.h, : grid.w]
    return g.reshape(B, grid.num_tokens, C)
