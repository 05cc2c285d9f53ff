"""Never silently unmerged: every path where a block call the node would merge runs unmerged counts its
reason in the run report (``RunReport.unmerged``, the summary's "unmerged"), says it once in the log and
shows it in the live stats.

DiT paths are walked on a tiny Wan's block patch, called as WanModel calls it (tests/test_wan.py builds the
same inputs); the UNet's "another patch's tokens" by sampling a tiny SD1.5 under ComfyUI's ToMe.
"""
import logging

import pytest
import torch

import dit_checks
from test_stacking import run_node
from toma_bench import comfy_host, models, sampling

LOGGER = dit_checks.LOGGER
current_only = pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture(scope="module")
def wan(pack):
    if not comfy_host.has_current_comfy():
        pytest.skip(comfy_host.CURRENT_ONLY)
    return models.build_wan("t2v", seed=5)


def wan_call(pack, wan, layout, tokens=None, options=True):
    """(block args, WanPatch, runtime) for one call of a merged Wan block over ``layout``: its tokens
    (``tokens`` of them: the layout's unless given) and RoPE rows; ``options``: whether the call carries
    transformer_options with the layout and the step's sigma."""
    layouts = pack.nodes.adapters.layout
    dm = wan.model.diffusion_model
    frames = layout.total // (layout.h * layout.w)
    pe = dm.rope_encode(frames, 2 * layout.h, 2 * layout.w)
    tokens = pe.shape[1] if tokens is None else tokens
    g = torch.Generator().manual_seed(4)
    args = {"img": torch.randn(1, tokens, dm.dim, generator=g), "txt": torch.randn(1, 9, dm.dim, generator=g),
            "vec": torch.randn(1, 1, 6, dm.dim, generator=g), "pe": pe[:, :tokens]}
    if options:
        args["transformer_options"] = {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}
    _, runtime = dit_checks.toma_patched(pack, wan, temporal_window=2)
    runtime.begin_run()
    return args, pack.nodes.adapters.wan.WanPatch(runtime), runtime


def run_twice(patch, args):
    """Call the patched block twice; (outputs, what the block saw each time)."""
    seen, outs = [], []
    for _ in range(2):
        outs.append(patch.block(dict(args), {"original_block": lambda a: seen.append(a["img"]) or {"img": a["img"]}}))
    return outs, seen


def check_unmerged(runtime, caplog, reason, args, outs, seen, calls=2):
    """The calls ran unmerged (the block saw the full tokens, the output is the input), counted under
    ``reason`` in the report and its summary, and logged once."""
    assert all(torch.equal(s, args["img"]) for s in seen) and all(torch.equal(o["img"], args["img"]) for o in outs)
    assert runtime.report().unmerged == {reason: calls}
    assert runtime.summary()["unmerged"] == {reason: calls}
    assert not runtime.report().plans
    said = warnings(caplog)
    assert len(said) == 1 and "unmerged" in said[0]


@current_only
def test_a_call_without_a_layout(pack, wan, caplog):
    dit = pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    layout = layouts.ImageLayout(h=4, w=5, frames=3)
    args, patch, runtime = wan_call(pack, wan, layout, options=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, dit.NO_LAYOUT, args, outs, seen)


@current_only
def test_more_tokens_than_the_layout(pack, wan, caplog):
    """Another patch's tokens: the block has tokens its layout does not account for."""
    dit = pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3, extra=20))
    args["transformer_options"][layouts.LAYOUT_KEY] = layouts.ImageLayout(h=4, w=5, frames=3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, dit.TOKEN_COUNT, args, outs, seen)


@current_only
def test_positions_that_do_not_fit(pack, wan, caplog):
    dit = pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3))
    args["pe"] = args["pe"][:, :-1]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, dit.POSITIONS, args, outs, seen)


@current_only
def test_a_sequence_parallel_slab(pack, wan, caplog):
    """Fewer tokens than the layout: a slab of the sequence (raylight) whose rank no xfuser group names; the model
    call steps aside."""
    dit = pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3), tokens=30)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, dit.SLAB, args, outs, seen)
    assert "steps aside" in warnings(caplog)[0]


@current_only
def test_a_call_without_a_sampling_step(pack, wan, caplog):
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3))
    del args["transformer_options"]["sigmas"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, "no sampling step", args, outs, seen)


@current_only
def test_a_plan_that_cannot_be_built(pack, wan, caplog, monkeypatch):
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3))

    def broken(*a, **k):
        raise RuntimeError("no plan here")

    monkeypatch.setattr(type(runtime.strategy), "build", broken)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        outs, seen = run_twice(patch, args)
    check_unmerged(runtime, caplog, "no plan", args, outs, seen)


@current_only
def test_the_reasons_reset_with_each_run_and_log_once_per_model(pack, wan, caplog):
    dit = pack.nodes.adapters.dit
    layouts = pack.nodes.adapters.layout
    args, patch, runtime = wan_call(pack, wan, layouts.ImageLayout(h=4, w=5, frames=3), options=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run_twice(patch, args)
        runtime.begin_run()
        assert runtime.report().unmerged == {}
        run_twice(patch, args)
    assert runtime.report().unmerged == {dit.NO_LAYOUT: 2}
    assert len(warnings(caplog)) == 1


def test_another_patchs_tokens_on_a_unet_are_counted_and_shown(pack, sent, caplog):
    """ComfyUI's ToMe changes the 1/1 tokens before ToMA's merge: the stats count those block calls."""
    unet = models.build_unet("sd15", seed=3, config=dict(models.SD15_FULL, model_channels=32, num_heads=4))
    toma = run_node("ToMAPatchModel", model=unet, ratio=0.5, window_size=2, reuse_interval=2, unique_id="7")
    stacked = run_node("TomePatchModel", model=toma, ratio=0.5)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        sampling.sample(stacked, models.conditioning("sd15", 1, height=128, width=128), torch.zeros(1, 4, 16, 16),
                        steps=2, global_rngs=True)
    unmerged = pack.nodes.runtime.runtime_of(stacked).summary()["unmerged"]
    assert set(unmerged) == {pack.nodes.adapters.unet.OTHER_TOKENS} and unmerged[pack.nodes.adapters.unet.OTHER_TOKENS] > 0
    (lines,) = [data["lines"] for _, data, _ in sent if data["node"] == "7"]
    assert any(line.startswith("ran unmerged: another patch's tokens (") for line in lines)
    assert sum("changed its tokens or keys first" in m for m in warnings(caplog)) == 1


def test_live_stats_show_the_reasons(pack):
    summary = {"levels": {}, "left_to": {}, "nothing_merges": [], "unmerged": {"no token layout": 3,
                                                                                "positions do not fit": 1},
               "seconds": {}, "wall_seconds": None}
    assert pack.nodes.live_stats.stats_lines(summary) == ["ran unmerged: no token layout (3 block calls)",
                                                          "ran unmerged: positions do not fit (1 block call)"]
