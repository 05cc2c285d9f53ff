"""What the merge map reads of a ToMA plan (``nodes/plan_records.toma_groups``) on image and video windows."""
import importlib.util
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import toma_core
from toma_core import plan_tiles

NODES = Path(__file__).resolve().parent.parent / "nodes"


@pytest.fixture(scope="module")
def plan_records():
    """nodes/plan_records.py without ComfyUI. It imports only torch and ``..toma_core``, so it is loaded as a
    module of a stand-in package whose ``toma_core`` is the engine these tests import; the ``nodes``
    package body, which imports the ComfyUI node classes, never runs."""
    pack = "toma_engine_test_pack"
    name = f"{pack}.nodes.plan_records"
    spec = importlib.util.spec_from_file_location(name, NODES / "plan_records.py")
    module = importlib.util.module_from_spec(spec)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {pack: types.ModuleType(pack), f"{pack}.nodes": types.ModuleType(f"{pack}.nodes"),
                           f"{pack}.toma_core": toma_core, f"{pack}.toma_core.tiles": toma_core.tiles,
                           name: module}.items():
            mp.setitem(sys.modules, key, value)
        spec.loader.exec_module(module)
        yield module


def window_of(raster: int, hw: tuple[int, ...], tile: int, tile_frames: int) -> tuple[int, int, int]:
    """(frame window, tile row, tile column) of a raster index in a (h, w) or (frames, h, w) grid."""
    h, w = hw[-2:]
    frame, row, col = raster // (h * w), raster // w % h, raster % w
    return frame // tile_frames, row // tile, col // tile


@pytest.mark.parametrize("hw,tile,tile_frames", [((10, 7), 4, 1), ((4, 6, 7), 3, 2), ((3, 5, 5), 2, 4)])
def test_every_token_joins_its_most_similar_kept_token_in_its_window(plan_records, hw, tile, tile_frames):
    x = torch.randn(2, math.prod(hw), 16, generator=torch.Generator().manual_seed(1))
    plan = plan_tiles(x, hw, tile, 0.5, generator=torch.Generator().manual_seed(2), tile_frames=tile_frames)

    groups, kept = plan_records.toma_groups(plan)

    assert groups.shape == (math.prod(hw),) and kept.numel() == plan.num_merged
    assert torch.equal(kept.sort().values, plan.destination_tokens()[0].sort().values)
    assert torch.equal(groups[kept], kept)  # a kept token is its own group
    xn = F.normalize(x[0], dim=-1)
    by_window = {}
    for k in kept.tolist():
        by_window.setdefault(window_of(k, hw, tile, tile_frames), []).append(k)
    for token in range(math.prod(hw)):
        candidates = by_window[window_of(token, hw, tile, tile_frames)]
        best = max(candidates, key=lambda k: float(xn[k] @ xn[token]))
        assert int(groups[token]) == best, f"token {token}"


def test_video_windows_group_tokens_across_frames(plan_records):
    # windows of 2 frames: some token of the second frame of a window joins a kept token of the first
    hw = (2, 8, 8)
    x = torch.randn(1, math.prod(hw), 16, generator=torch.Generator().manual_seed(3))
    groups, _ = plan_records.toma_groups(plan_tiles(x, hw, 4, 0.5, tile_frames=2))
    frame = torch.arange(math.prod(hw)) // 64
    assert (frame[groups] != frame).any()
