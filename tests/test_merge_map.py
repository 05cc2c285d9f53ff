"""ToMA Merge Map and live stats: plan records, the picture, finding the runtime from a MODEL, run ends.

The records and the picture are checked on small plans whose groups are known by construction; the node
and the run hooks on a tiny random UNet sampled in-process (pinned tree, or COMFYUI_PATH).
"""
import logging
import sys
import types

import pytest
import torch

from toma_bench import models, sampling

LATENT = (24, 16)  # non-square: 24 rows, 16 columns of latent pixels
STEPS = 3
# SD1.5 layout at toy width: transformer blocks at 1/1 and 1/2, a few ms per step on CPU.
TINY_UNET = {"model_channels": 32, "num_heads": 2, "channel_mult": [1, 2], "num_res_blocks": [1, 1],
             "transformer_depth": [1, 1], "transformer_depth_output": [1, 1, 1, 1], "transformer_depth_middle": 1}


@pytest.fixture(scope="module")
def mm(pack):
    """The pack's merge map module."""
    return pack.nodes.merge_map


@pytest.fixture(scope="module")
def unet(pack):
    """A tiny random SD1.5-layout ModelPatcher."""
    return models.build_unet("sd15", seed=0, config=dict(models.SD15_SMALL, **TINY_UNET))


def sample(model, hw=LATENT, steps=STEPS, seed=0):
    """Sample ``model`` in-process; the LATENT dict a KSampler would output."""
    conditioning = models.conditioning("sd15", batch=1, tokens=8, seed=seed)
    return {"samples": sampling.sample(model, conditioning, torch.zeros(1, 4, *hw), steps=steps, cfg=5.0, seed=seed)}


def column_classes(h, w, tile):
    """(1, h*w, 2) one-hot features: the left half of each tile is class 0, the right half class 1."""
    xs = torch.arange(w).repeat(h)
    right = (xs % tile) >= tile // 2
    return torch.stack([~right, right], dim=-1).float()[None]


def expected_column_groups(h, w, tile):
    """Raster group of each token when each tile keeps its top-left and top-right tokens as destinations:
    a token joins the destination of its own half, in its tile's top row."""
    ys, xs = torch.arange(h).repeat_interleave(w), torch.arange(w).repeat(h)
    top = (ys // tile) * tile
    half = (xs // tile) * tile + (xs % tile >= tile // 2) * (tile // 2)
    return top * w + half


def known_plan(pack, h=4, w=6, tile=2):
    """A ToMA plan on a non-square grid whose groups are known: destinations = the top row of each tile."""
    core = pack.toma_core
    grid = core.TileGrid(h, w, tile)
    top_row = torch.arange(tile).repeat(grid.num_tiles, 1)  # in-tile indices 0..tile-1: the tile's top row
    plan = core.plan_tiles(column_classes(h, w, tile), (h, w), tile, 1 - 1 / tile, destinations=top_row[None])
    return plan, expected_column_groups(h, w, tile)


# -- records ---------------------------------------------------------------------------------------
def test_toma_record_groups_are_the_argmax_destination(pack):
    plan, expected = known_plan(pack)

    record = pack.nodes.runtime.records.record_plan(plan, step=3, grid=(4, 6))

    assert (record.step, record.h, record.w, record.window) == (3, 4, 6, (2, 2))
    assert record.groups.dtype == torch.int32 and record.groups.device.type == "cpu"
    assert torch.equal(record.groups.long(), expected)
    assert sorted(record.kept.tolist()) == sorted(set(expected.tolist()))


def test_toma_record_on_random_features_matches_most_similar_destination(pack):
    core = pack.toma_core
    h, w, tile = 10, 7, 4  # padded edge tiles
    x = torch.randn(2, h * w, 16, generator=torch.Generator().manual_seed(1))
    plan = core.plan_tiles(x, (h, w), tile, 0.5, generator=torch.Generator().manual_seed(2))

    record = pack.nodes.runtime.records.record_plan(plan, 0, (h, w))

    xn = torch.nn.functional.normalize(x[0], dim=-1)
    kept = record.kept.long()
    def tile_of(i):
        return i // w // tile, i % w // tile

    for token in range(h * w):
        candidates = [int(k) for k in kept if tile_of(int(k)) == tile_of(token)]
        best = max(candidates, key=lambda k: float(xn[k] @ xn[token]))
        assert int(record.groups[token]) == best, f"token {token}"


def test_bipartite_record(pack):
    core = pack.toma_core
    h, w = 6, 8
    x = torch.randn(1, h * w, 8, generator=torch.Generator().manual_seed(3))
    plan = core.tomesd_plan(x, (h, w), 0.25, generator=torch.Generator().manual_seed(4))
    method = types.SimpleNamespace(sx=2, sy=2)

    record = pack.nodes.runtime.records.record_plan(plan, 1, (h, w), method)

    groups = record.groups.long()
    src, dst = plan.src_index[0], plan.dst_index[0]
    moved = src[plan.merged[0]]
    assert torch.equal(groups[moved], dst[plan.target[0]])
    stay = torch.ones(h * w, dtype=torch.bool)
    stay[moved] = False
    assert torch.equal(groups[stay], torch.arange(h * w)[stay])
    assert record.kept.numel() == plan.num_merged and record.window == (2, 2)


# -- picture ---------------------------------------------------------------------------------------
def token_pixel(y, x, px):
    """A pixel of token (y, x) off its centre dot and off window borders (its cell's last corner)."""
    return y * px + px - 1, x * px + px - 1


def test_map_colours_match_recorded_groups(pack, mm):
    plan, expected = known_plan(pack)
    record = pack.nodes.runtime.records.record_plan(plan, 0, (4, 6))
    px = 8

    picture = mm.render_record(record, 4 * px, 6 * px)

    assert picture.shape == (32, 48, 3) and picture.dtype == torch.float32
    colours = mm.group_colours(expected)
    seen = {}
    for token in range(24):
        y, x = divmod(token, 6)
        pixel = picture[token_pixel(y, x, px)]
        assert torch.allclose(pixel, colours[token]), f"token {token}"
        seen.setdefault(int(expected[token]), pixel)
    distinct = {tuple(c.tolist()) for c in seen.values()}
    assert len(distinct) == len(seen), "two groups share a colour"
    for k in record.kept.tolist():  # dark dot in the middle of each kept token
        y, x = divmod(k, 6)
        assert torch.allclose(picture[y * px + px // 2, x * px + px // 2], colours[k] * 0.3)
    # tile borders (tiles of 2x2 tokens = 16 px): black lines where a tile starts, none inside tiles
    assert torch.all(picture[16] == 0) and torch.all(picture[:, 16] == 0) and torch.all(picture[:, 32] == 0)
    black = torch.all(picture == 0, dim=-1)
    assert black[8].nonzero().flatten().tolist() == [16, 32] and black[:, 8].nonzero().flatten().tolist() == [16]


def test_map_greys_tokens_nothing_was_merged_into(pack, mm):
    core = pack.toma_core
    h, w = 6, 8
    x = torch.randn(1, h * w, 8, generator=torch.Generator().manual_seed(5))
    plan = core.tomesd_plan(x, (h, w), 0.2, generator=torch.Generator().manual_seed(6))
    record = pack.nodes.runtime.records.record_plan(plan, 0, (h, w), types.SimpleNamespace(sx=2, sy=2))
    px = 5

    picture = mm.render_record(record, h * px, w * px)

    sizes = torch.bincount(record.groups.long(), minlength=h * w)
    grey = torch.tensor([mm.SINGLE_GREY] * 3)
    assert 0 < int((sizes == 1).sum()) < h * w, "the plan should have tokens alone and merged groups"
    for token in range(h * w):
        y, x = divmod(token, w)
        alone = bool(sizes[record.groups[token]] == 1)
        assert torch.allclose(picture[token_pixel(y, x, px)], grey) == alone, f"token {token}"


def test_map_over_image_blends_and_resizes(pack, mm):
    plan, _ = known_plan(pack)
    record = pack.nodes.runtime.records.record_plan(plan, 0, (4, 6))
    image = torch.full((3, 5, 3), 0.2)  # any size: resized to the map

    alone = mm.render_record(record, 32, 48)
    blended = mm.render_record(record, 32, 48, image, opacity=0.25)

    border = blended == 0
    assert torch.allclose(blended[~border], (0.25 * alone + 0.75 * 0.2)[~border])


# -- the node on a sampled model --------------------------------------------------------------------
def test_merge_map_node_shows_recorded_plans_of_non_square_run(pack, mm, unet, sent):
    base = unet
    patched = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(
        base, 0.5, 4, 2, levels="all", weights_interval=2, unique_id="12")[0]

    latent = sample(patched.clone())  # samplers may clone the MODEL they get

    levels = pack.nodes.runtime.runtime_of(patched).report().levels
    merged = mm.merged_levels(levels)
    assert [(level.grid, level.downsample) for level in merged] == [((24, 16), 1), ((12, 8), 2)]
    assert [r.step for r in levels[merged[0]].records] == [0, 2]  # rebuilt only at reuse steps
    node = mm.ToMAMergeMap()
    for level, (h, w) in enumerate([(24, 16), (12, 8)]):
        for step, recorded in [(-1, 2), (0, 0), (1, 0)]:  # step 1 reuses the plan built at step 0
            image, = node.draw(patched, latent, level, step)
            assert image.shape == (1, 8 * LATENT[0], 8 * LATENT[1], 3)
            record = next(r for r in levels[merged[level]].records if r.step == recorded)
            assert (record.h, record.w) == (h, w)
            assert torch.equal(image[0], mm.render_record(record, 8 * LATENT[0], 8 * LATENT[1]))
    # one stats message for the run, for the patch node, to the client that queued the prompt
    assert len(sent) == 1
    event, data, sid = sent[0]
    assert (event, data["node"], data["prompt_id"], sid) == ("comfyui_toma.stats", "12", "prompt-1", "client-1")
    assert data["lines"][0] == f"24x16 (1/1): 384 -> 192 tokens, {STEPS} steps merged"
    assert data["lines"][1] == f"12x8 (1/2): 96 -> 48 tokens, {STEPS} steps merged"
    assert data["lines"][2].startswith("select ") and data["lines"][2].endswith(" s sampling")
    assert data["text"] == "\n".join(data["lines"])


def test_each_run_reports_once_and_starts_clean(pack, mm, unet, sent):
    base = unet
    patched = pack.nodes.toma_nodes.ToMAPatchModel().patch(base, 0.5, 4, 5, unique_id="3")[0]

    sample(patched, hw=(16, 16), steps=2)
    latent = sample(patched, hw=(8, 16), steps=2, seed=1)

    assert [data["lines"][0].split(":")[0] for _, data, _ in sent] == ["16x16 (1/1)", "8x16 (1/1)"]
    runtime = pack.nodes.runtime.runtime_of(patched)
    assert [level.grid for level in runtime.report().levels] == [(8, 16)], "records of the previous run leaked"
    assert mm.ToMAMergeMap().draw(patched, latent, 0, -1)[0].shape == (1, 64, 128, 3)
    runtime.end_run()  # a second end signal without a model call in between (SamplerCustom's x0 output)
    assert len(sent) == 2


@pytest.mark.parametrize("inputs, why", [
    ({"window_size": 1}, "window_size 1: each window holds a single token, with nothing to merge into it"),
    ({"start_percent": 0.4, "end_percent": 0.4}, "start_percent equals end_percent (0.4): no step lies between them"),
])
def test_inputs_that_merge_nothing_say_so_once_in_the_log_and_the_stats(pack, unet, sent, caplog, inputs, why):
    args = {"ratio": 0.5, "window_size": 4, "reuse_interval": 5, "unique_id": "7", **inputs}
    patched = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(unet, **args)[0]

    with caplog.at_level(logging.INFO, logger="ComfyUI-ToMA"):
        sample(patched, steps=2)
        sample(patched, steps=2)

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"ToMA: ToMA merges nothing: {why}"]
    assert [data["lines"][0] for _, data, _ in sent] == [f"nothing merges: {why}"] * 2
    assert pack.nodes.runtime.runtime_of(patched).report().levels == {}


def test_merge_map_supports_tomesd(pack, mm, unet):
    base = unet
    patched = pack.nodes.toma_nodes.ToMeSDPatchModel().patch(base, 0.5, 1, 2, 2, 0)[0]

    latent = sample(patched, steps=2)

    image, = mm.ToMAMergeMap().draw(patched, latent, 0, 1)
    (stats,) = pack.nodes.runtime.runtime_of(patched).report().levels.values()
    record = stats.records[-1]
    assert record.step == 1 and record.window == (2, 2)
    assert torch.equal(image[0], mm.render_record(record, 192, 128))


def test_merge_map_errors_name_the_problem(pack, mm, unet):
    base = unet
    node = mm.ToMAMergeMap()
    latent = {"samples": torch.zeros(1, 4, *LATENT)}

    with pytest.raises(ValueError, match="not patched by a ToMA"):
        node.draw(base, latent, 0, -1)
    ratio0 = pack.nodes.toma_nodes.ToMAPatchModel().patch(base, 0.0, 4, 5)[0]
    with pytest.raises(ValueError, match="not patched by a ToMA"):
        node.draw(ratio0, latent, 0, -1)
    patched = pack.nodes.toma_nodes.ToMAPatchModel().patch(base, 0.5, 4, 5)[0]
    with pytest.raises(ValueError, match="run a sampler with this MODEL first"):
        node.draw(patched, latent, 0, -1)

    sample(patched, steps=2)

    with pytest.raises(ValueError, match=r"level must be between 0 and 0 .*0 = 24x16 \(1/1\)"):
        node.draw(patched, latent, 1, -1)
    with pytest.raises(ValueError, match="step 5 was not merged.*merged steps: 0-1"):
        node.draw(patched, latent, 0, 5)
    with pytest.raises(ValueError, match="does not fit a 16x24 latent"):
        node.draw(patched, {"samples": torch.zeros(1, 4, 16, 24)}, 0, -1)
    with pytest.raises(ValueError, match="opacity must be between 0.0 and 1.0"):
        node.draw(patched, latent, 0, -1, None, 1.5)


def test_node_declares_tooltips_and_category(mm):
    node = mm.ToMAMergeMap
    inputs = node.INPUT_TYPES()
    for section in ("required", "optional"):
        for name, (_, options) in inputs[section].items():
            assert options.get("tooltip"), f"{name} has no tooltip"
    assert node.CATEGORY == "model_patches/token_merging" and node.RETURN_TYPES == ("IMAGE",)
    assert mm.NODE_DISPLAY_NAME_MAPPINGS["ToMAMergeMap"] == "ToMA Merge Map"


def test_stats_are_silent_without_a_server(pack, monkeypatch):
    monkeypatch.delitem(sys.modules, "server", raising=False)
    send = pack.nodes.live_stats.stats_sender("1")
    send({"method": "ToMA", "levels": {}, "seconds": {"select": 0.0}, "wall_seconds": 1.0})  # must not raise
    assert pack.nodes.live_stats.stats_lines({"method": "ToMA", "levels": {}, "seconds": {}, "wall_seconds": None}) \
        == ["no step merged (no matching level or outside start/end percent)"]
