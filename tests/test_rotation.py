"""Destinations that rotate (the Advanced node's ``rotation``; toma_core.plan's ``rotation``): through the
runtime on a tiny random UNet (every tree), successive builds of a plan key share fewer destinations than
without it, the counts live per plan key (per level where a level shares destinations) and start anew each
run, ratio 0 stays the unpatched model, torch.compile traces no graph more for a rebuild, and the stats and
the merge map say so; on the trained Flux proxy at 32x32 tokens (current ComfyUI) it raises the PSNR of the
pictures at the same plan shapes. Each check compares rotation on with off: with it off, each fails."""
import dataclasses

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling

pytestmark = pytest.mark.comfy

UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)
STEPS = 6


@pytest.fixture(scope="module")
def unet():
    return models.build_unet("sd15", 0, config=UNET_TINY)


def sample_unet(model, steps=STEPS):
    conditioning = models.conditioning("sd15", 1, height=128, width=128)
    return sampling.sample(model, conditioning, torch.zeros(1, 4, 16, 16), steps=steps, cfg=2.0)


def patched(pack, model, rotation, ratio=0.5, window=4, reuse=1, **inputs):
    node = pack.nodes.toma_nodes.ToMAPatchModelAdvanced()
    (out,) = node.patch(model, ratio, window, reuse, rotation=rotation, **inputs)
    return out, pack.nodes.runtime.runtime_of(out)


def destination_sets(plan) -> torch.Tensor:
    """(B, T, S) 0/1: the window slots that are destinations of ``plan``."""
    from toma_core.plan import destination_mask
    return destination_mask(plan.destinations, plan.grid.tile_size)


def kept_share(records) -> float:
    """The share of each record's destinations that the record before it kept too, over a level's records."""
    kept = total = 0.0
    for before, after in zip(records, records[1:]):
        now = destination_sets(after.plan)
        kept += float((now * destination_sets(before.plan)).sum())
        total += float(now.sum())
    return kept / total


def test_successive_builds_share_fewer_destinations_with_rotation(pack, unet):
    """New destinations every step on the 1/1 level: without rotation successive builds keep most of the
    earlier destinations; with it few, and the run's stats say how many (the share the records show)."""
    shares = {}
    for rotation in ("off", "on"):
        model, runtime = patched(pack, unet, rotation)
        sample_unet(model)
        report = runtime.report()
        (stats,) = [s for s in report.levels.values() if s.records]
        assert [r.step for r in stats.records] == list(range(STEPS))  # a build at every step
        shares[rotation] = kept_share(stats.records)
        if rotation == "on":
            assert report.rotation == pack.toma_core.ROTATION_STRENGTH == 1.0
            assert report.destinations_kept == pytest.approx(shares["on"], abs=1e-6)
            line = next(line for line in pack.nodes.live_stats.stats_lines(runtime.summary()) if "rotation" in line)
            assert line == f"rotation on (strength 1): {100 * shares['on']:.0f}% of destinations kept from the " \
                           "previous build of the same plan"
        else:
            assert report.destinations_kept is None and runtime.summary()["rotation"] is None
            assert not any("rotation" in line for line in pack.nodes.live_stats.stats_lines(runtime.summary()))
    assert shares["on"] < 0.3 and shares["off"] - shares["on"] > 0.3, shares


def test_a_level_that_shares_destinations_rotates_them_once_per_build(pack, unet):
    """Per-block plans with shared destinations (the SD1.x preset's): the level's first block chooses the
    destinations for all, and the counts are the level's: its blocks keep sharing one set, which rotates."""
    shares = {}
    for rotation in ("off", "on"):
        model, runtime = patched(pack, unet, rotation, scope="keys/values", plan_per_block=True,
                                 shared_destinations=True, levels="all")
        sample_unet(model)
        report = runtime.report()
        for key, plan in report.plans.items():
            assert torch.equal(plan.destinations, report.shared_destinations[(key.level, key.rows)])
        level = max((s for s in report.levels.values() if s.records), key=lambda s: s.tokens)
        shares[rotation] = kept_share(level.records)
    assert shares["off"] - shares["on"] > 0.3, shares


def test_counts_start_anew_each_run_and_ratio_0_is_the_unpatched_model(pack, unet):
    """A second run of a rotating model samples what the first did (counts left over would steer its first
    build elsewhere), and what rotation off samples differs (rotation changed the plans); at ratio 0 the
    patched model samples the unpatched model's latents bit for bit."""
    model, runtime = patched(pack, unet, "on")
    first = sample_unet(model)
    plans = {key: plan.destinations for key, plan in runtime.report().plans.items()}
    assert torch.equal(sample_unet(model), first)
    assert all(torch.equal(plan.destinations, plans[key]) for key, plan in runtime.report().plans.items())
    assert not torch.equal(sample_unet(patched(pack, unet, "off")[0]), first)
    (zero,) = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(unet, 0.0, 4, 1, rotation="on")
    assert torch.equal(sample_unet(zero), sample_unet(unet))


@pytest.mark.parametrize("window", [4, 16], ids=["exact", "stochastic"])
def test_rotation_compiles_clean_and_a_rebuild_traces_no_new_graph(pack, unet, window):
    """Under ComfyUI's TorchCompileModel (dynamo backend "eager"): new destinations every 2 steps, weights
    between, with the counts a tensor input of the graph: no graph break, at most a graph per merge path,
    none new in a second run, the eager run's plans (dit_checks.check_compiles_clean); window 16 selects
    by stochastic greedy."""
    model, _ = patched(pack, unet, "on", ratio=0.9 if window == 16 else 0.5, window=window, reuse=2)
    first, report = dit_checks.check_compiles_clean(pack, model, sample_unet)
    assert report.destinations_kept is not None and report.destinations_kept < 0.5
    assert first.graphs <= 3, str(first)  # the first call, calls choosing destinations, calls refreshing weights


def test_a_grid_the_windows_do_not_tile_traces_one_graph_for_every_later_build(pack, unet):
    """New destinations every step on a grid the windows do not tile (16x16 tokens in 6x6 windows: the engine's
    destination mask is a view that drops a column past each window): the counts every later build is handed
    have one layout, so a compiled run traces its first call and one graph for all the builds after it (a third
    graph, for counts of a second layout, came before the plan store kept them whole)."""
    model, _ = patched(pack, unet, "on", window=6, reuse=1)
    first, report = dit_checks.check_compiles_clean(pack, model, sample_unet)
    assert any(plan.grid.padded for plan in report.plans.values()), "no grid the windows do not tile"
    assert first.graphs == 2 and not any("stride" in reason for reason in first.recompiles), str(first)


def test_the_merge_map_marks_the_destinations_that_rotated_in(pack, unet):
    """With rotation a level's record knows the record before it, and the map gives each kept token that
    record did not keep a white dot; without rotation no record does, and no dot is white."""
    mm = pack.nodes.merge_map
    for rotation in ("off", "on"):
        model, runtime = patched(pack, unet, rotation)
        sample_unet(model)
        (stats,) = [s for s in runtime.report().levels.values() if s.records]
        record = stats.records[-1]
        picture = mm.render_record(record, 64, 64)
        white = (picture == mm.ROTATED_IN).all(-1).sum()
        if rotation == "off":
            assert record.previous is None and white == 0
            continue
        assert record.previous is stats.records[-2]
        assert white > 0
        assert torch.equal(mm.render_record(dataclasses.replace(record, previous=None), 64, 64) == mm.ROTATED_IN,
                           torch.zeros(64, 64, 3, dtype=torch.bool))


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_rotation_raises_the_psnr_of_the_flux_proxy(pack):
    """The trained Flux proxy at 32x32 tokens, whole blocks at ratio 0.5, destinations every 5 of 20 steps,
    2 pictures: rotating the destinations brings the pictures closer to the unpatched ones (measured: +1.4
    dB) at the same plan shapes, hence the same modelled speed."""
    from toma_bench import proxy
    from toma_bench.metrics import psnr

    base = proxy.load(proxy.PROXY_DIR / proxy.SPECS["flux32"].file)

    def pictures(model):
        with torch.inference_mode():
            return proxy.latent_to_images(base, proxy.sample(model, 0, 2, 20, side=64).float())

    reference = pictures(base)
    gained = {rotation: psnr(pictures(patched(pack, base, rotation, reuse=5, scope="block")[0]), reference)
              for rotation in ("off", "on")}
    assert gained["on"] - gained["off"] > 0.7, gained
