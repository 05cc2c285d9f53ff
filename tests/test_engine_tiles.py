"""Tiling of a row-major token grid: exact round trips, layout, padding."""
import pytest
import torch
import torch.nn.functional as F

from toma_core import TileGrid, tile_tokens, token_grid, untile_tokens

GRIDS = [(8, 8), (16, 16), (6, 10), (10, 6), (7, 5), (1, 9), (13, 11), (3, 3)]
TILES = [1, 2, 3, 4, 8, 16]


def reference_tiles(x: torch.Tensor, h: int, w: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit loops: tile (r, c) row-major, slot (i, j) row-major inside; padding is zero / invalid."""
    B, N, C = x.shape
    rows, cols = -(-h // t), -(-w // t)
    out = torch.zeros(B, rows * cols, t * t, C, dtype=x.dtype)
    valid = torch.zeros(rows * cols, t * t, dtype=torch.bool)
    for r in range(rows):
        for c in range(cols):
            for i in range(t):
                for j in range(t):
                    y, xx = r * t + i, c * t + j
                    if y < h and xx < w:
                        out[:, r * cols + c, i * t + j] = x[:, y * w + xx]
                        valid[r * cols + c, i * t + j] = True
    return out, valid


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("hw", GRIDS)
def test_round_trip_is_exact_and_layout_matches_reference(hw, tile):
    h, w = hw
    x = torch.randn(2, h * w, 3, generator=torch.Generator().manual_seed(h * 100 + w))
    grid = TileGrid(h, w, tile)
    tiles = tile_tokens(x, grid)
    assert tiles.shape == (2, grid.num_tiles, tile * tile, 3)
    assert torch.equal(untile_tokens(tiles, grid), x)
    ref, valid = reference_tiles(x, h, w, tile)
    assert torch.equal(tiles, ref)
    assert torch.equal(grid.valid, valid)
    assert int(grid.valid.sum()) == h * w
    assert grid.padded == (h % tile != 0 or w % tile != 0)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("hw", GRIDS)
def test_every_real_token_in_exactly_one_slot(hw, tile):
    h, w = hw
    grid = TileGrid(h, w, tile)
    ids = torch.arange(1, h * w + 1, dtype=torch.float64).view(1, -1, 1)  # 0 would look like padding
    tiles = tile_tokens(ids, grid)[0, ..., 0]
    assert sorted(tiles[grid.valid].long().tolist()) == list(range(1, h * w + 1))
    assert (tiles[~grid.valid] == 0).all()
    # tile_origin names the raster index held by each real slot
    assert torch.equal(grid.tile_origin[grid.valid] + 1, tiles[grid.valid].long())
    assert grid.tile_origin.min() >= 0 and grid.tile_origin.max() < h * w


@pytest.mark.parametrize("hw,tile", [((8, 8), 2), ((16, 8), 4), ((32, 32), 8), ((16, 16), 16)])
def test_divisible_grid_matches_unfold(hw, tile):
    h, w = hw
    B, C = 2, 5
    x = torch.randn(B, h * w, C, generator=torch.Generator().manual_seed(1))
    img = x.transpose(1, 2).reshape(B, C, h, w)
    cols = F.unfold(img, kernel_size=tile, stride=tile)  # (B, C * t * t, T), T in row-major tile order
    ref = cols.view(B, C, tile * tile, -1).permute(0, 3, 2, 1)
    assert torch.equal(tile_tokens(x, TileGrid(h, w, tile)), ref)


def test_strided_inputs_and_extra_dtypes():
    g = torch.Generator().manual_seed(2)
    grid = TileGrid(6, 10, 4)
    base = torch.randn(2, 60, 8, generator=g)
    for x in (base[..., ::2], torch.randn(2, 4, 60, generator=g).transpose(1, 2)):
        assert not x.is_contiguous()
        assert torch.equal(tile_tokens(x, grid), tile_tokens(x.contiguous(), grid))
        assert torch.equal(untile_tokens(tile_tokens(x, grid), grid), x)
    for dtype in (torch.float16, torch.bfloat16):
        x = base.to(dtype)
        assert torch.equal(untile_tokens(tile_tokens(x, grid), grid), x)


def test_grid_validation():
    with pytest.raises(ValueError, match="window_size must be >= 1"):
        TileGrid(4, 4, 0)
    with pytest.raises(ValueError, match="grid"):
        TileGrid(0, 4, 2)
    with pytest.raises(ValueError, match="tokens"):
        tile_tokens(torch.zeros(1, 15, 2), TileGrid(4, 4, 2))


# -- windows over frames: a frames x h x w grid cut into temporal_window x tile x tile windows --------------
VIDEO_GRIDS = [(2, 4, 4), (3, 5, 7), (4, 6, 6), (5, 3, 4), (1, 7, 5)]
TILE_FRAMES = [1, 2, 3, 4, 6]


def reference_windows(x: torch.Tensor, frames: int, h: int, w: int, t: int, f: int):
    """Explicit loops: window (k, r, c) in raster order, slot (a, i, j) in raster order inside; padding
    is zero / invalid / (for the origin) the nearest real token."""
    B, N, C = x.shape
    spans, rows, cols = -(-frames // f), -(-h // t), -(-w // t)
    out = torch.zeros(B, spans * rows * cols, f * t * t, C, dtype=x.dtype)
    valid = torch.zeros(spans * rows * cols, f * t * t, dtype=torch.bool)
    origin = torch.zeros(spans * rows * cols, f * t * t, dtype=torch.long)
    for k in range(spans):
        for r in range(rows):
            for c in range(cols):
                for a in range(f):
                    for i in range(t):
                        for j in range(t):
                            window, slot = (k * rows + r) * cols + c, (a * t + i) * t + j
                            z, y, xx = k * f + a, r * t + i, c * t + j
                            origin[window, slot] = (min(z, frames - 1) * h + min(y, h - 1)) * w + min(xx, w - 1)
                            if z < frames and y < h and xx < w:
                                out[:, window, slot] = x[:, (z * h + y) * w + xx]
                                valid[window, slot] = True
    return out, valid, origin


@pytest.mark.parametrize("temporal_window", TILE_FRAMES)
@pytest.mark.parametrize("tile", [1, 2, 4])
@pytest.mark.parametrize("thw", VIDEO_GRIDS)
def test_video_round_trip_is_exact_and_layout_matches_reference(thw, tile, temporal_window):
    frames, h, w = thw
    x = torch.randn(2, frames * h * w, 3, generator=torch.Generator().manual_seed(frames * 1000 + h * 10 + w))
    grid = TileGrid(h, w, tile, frames=frames, temporal_window=temporal_window)
    tiles = tile_tokens(x, grid)
    assert tiles.shape == (2, grid.num_tiles, temporal_window * tile * tile, 3)
    assert torch.equal(untile_tokens(tiles, grid), x)
    ref, valid, origin = reference_windows(x, frames, h, w, tile, temporal_window)
    assert torch.equal(tiles, ref)
    assert torch.equal(grid.valid, valid)
    assert torch.equal(grid.tile_origin, origin)
    assert int(grid.valid.sum()) == frames * h * w
    assert grid.padded == (frames % temporal_window != 0 or h % tile != 0 or w % tile != 0)


@pytest.mark.parametrize("tile", [1, 2, 3])
@pytest.mark.parametrize("thw", VIDEO_GRIDS)
def test_one_frame_per_window_is_the_2d_tiling_of_each_frame(thw, tile):
    frames, h, w = thw
    x = torch.randn(1, frames * h * w, 4, generator=torch.Generator().manual_seed(5))
    plane = TileGrid(h, w, tile)
    per_frame = torch.cat([tile_tokens(f, plane) for f in x.split(h * w, dim=1)], dim=1)
    video = TileGrid(h, w, tile, frames=frames)
    assert torch.equal(tile_tokens(x, video), per_frame)
    assert torch.equal(video.valid, plane.valid.repeat(frames, 1))
    assert torch.equal(video.tile_origin, torch.cat([plane.tile_origin + k * h * w for k in range(frames)]))


def test_one_frame_grids_are_the_2d_grids():
    assert token_grid((1, 6, 10), 4) == token_grid((6, 10), 4) == TileGrid(6, 10, 4)
    assert token_grid((3, 6, 10), 4, 2) == TileGrid(6, 10, 4, frames=3, temporal_window=2)


def test_video_grid_validation():
    with pytest.raises(ValueError, match="frames must be >= 1"):
        TileGrid(4, 4, 2, frames=0)
    with pytest.raises(ValueError, match="temporal_window must be >= 1"):
        TileGrid(4, 4, 2, frames=3, temporal_window=0)
    with pytest.raises(ValueError, match=r"\(h, w\) or \(frames, h, w\)"):
        token_grid((2, 3, 4, 4), 2)
    with pytest.raises(ValueError, match="2x4x4=32 tokens"):
        tile_tokens(torch.zeros(1, 16, 2), TileGrid(4, 4, 2, frames=2, temporal_window=2))
