"""What the merge map reads of a ToMA plan (``toma_core.groups.toma_groups``) on image and video windows."""
import math

import pytest
import torch
import torch.nn.functional as F

from toma_core import plan_tiles, toma_groups


def window_of(raster: int, hw: tuple[int, ...], window_size: int, temporal_window: int) -> tuple[int, int, int]:
    """(frame window, tile row, tile column) of a raster index in a (h, w) or (frames, h, w) grid."""
    h, w = hw[-2:]
    frame, row, col = raster // (h * w), raster // w % h, raster % w
    return frame // temporal_window, row // window_size, col // window_size


@pytest.mark.parametrize("hw,tile,temporal_window", [((10, 7), 4, 1), ((4, 6, 7), 3, 2), ((3, 5, 5), 2, 4)])
def test_every_token_joins_its_most_similar_kept_token_in_its_window(hw, tile, temporal_window):
    x = torch.randn(2, math.prod(hw), 16, generator=torch.Generator().manual_seed(1))
    plan = plan_tiles(x, hw, tile, 0.5, generator=torch.Generator().manual_seed(2), temporal_window=temporal_window)

    groups, kept = toma_groups(plan)

    assert groups.shape == (math.prod(hw),) and kept.numel() == plan.num_merged
    assert torch.equal(kept.sort().values, plan.destination_tokens()[0].sort().values)
    assert torch.equal(groups[kept], kept)  # a kept token is its own group
    xn = F.normalize(x[0], dim=-1)
    by_window = {}
    for k in kept.tolist():
        by_window.setdefault(window_of(k, hw, tile, temporal_window), []).append(k)
    for token in range(math.prod(hw)):
        candidates = by_window[window_of(token, hw, tile, temporal_window)]
        best = max(candidates, key=lambda k: float(xn[k] @ xn[token]))
        assert int(groups[token]) == best, f"token {token}"


def test_video_windows_group_tokens_across_frames():
    # windows of 2 frames: some token of the second frame of a window joins a kept token of the first
    hw = (2, 8, 8)
    x = torch.randn(1, math.prod(hw), 16, generator=torch.Generator().manual_seed(3))
    groups, _ = toma_groups(plan_tiles(x, hw, 4, 0.5, temporal_window=2))
    frame = torch.arange(math.prod(hw)) // 64
    assert (frame[groups] != frame).any()
