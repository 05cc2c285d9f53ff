"""What the model kind's preset (nodes/placement.PRESETS) decides for the nodes: the ratio behind the ratio
input's -1 ("auto", its default), and the schedule of short runs (``Preset.short_run``), which the
runtime applies from the step count of the run's sigmas. Sampled with ComfyUI's own sampler on the
random-weight UNet (both trees: the March-2024 tree hands the run's sigmas to no hook, current ComfyUI
to its OUTER_SAMPLE wrapper) and on the tiny Flux build (current ComfyUI)."""
import dataclasses
import logging

import pytest
import torch

from toma_bench import comfy_host, models, sampling

pytestmark = pytest.mark.comfy


def sample_unet(model, steps):
    latent = torch.zeros(1, 4, 32, 32)
    return sampling.sample(model, models.conditioning("sd15", 1, height=256, width=256), latent, steps=steps, cfg=1.0)


def sample_flux(model, steps):
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 77, 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, 16, 16), steps=steps, scheduler="simple")


@pytest.fixture(scope="module")
def sd15(pack):
    return models.build_unet("sd15", seed=0)


def strategy_of(pack, patched):
    return pack.nodes.runtime.runtime_of(patched).strategy


def test_ratio_auto_is_the_kinds_ratio(pack, sd15, monkeypatch):
    """The ratio input's default is -1, "auto": both nodes merge at the preset's ratio, whatever it is;
    a ratio set on the node wins."""
    nodes, placement = pack.nodes.toma_nodes, pack.nodes.placement
    for node in ("ToMAPatchModel", "ToMAPatchModelAdvanced"):
        assert pack.nodes.NODE_CLASS_MAPPINGS[node].INPUT_TYPES()["required"]["ratio"][1]["default"] == -1
    monkeypatch.setitem(placement.PRESETS, "sd1", dataclasses.replace(placement.PRESETS["sd1"], ratio=0.6))
    basic = nodes.ToMAPatchModel().patch(sd15, nodes.DEFAULT_RATIO, nodes.DEFAULT_WINDOW, nodes.DEFAULT_REUSE)[0]
    assert strategy_of(pack, basic).ratio == 0.6
    for scope in ("auto", "block"):
        auto = nodes.ToMAPatchModelAdvanced().patch(sd15, -1, 0, 5, scope=scope)[0]
        assert strategy_of(pack, auto).ratio == 0.6
    assert strategy_of(pack, nodes.ToMAPatchModel().patch(sd15, 0.3, 0, 5)[0]).ratio == 0.3
    assert nodes.ToMAPatchModel().patch(sd15, 0.0, 0, 5)[0].model_options == sd15.clone().model_options


def test_rotation_auto_is_the_kinds_choice(pack, sd15, monkeypatch):
    """The rotation input's "auto" (its default; the basic node has no such input) rotates destinations at
    ROTATION_STRENGTH where the kind's preset says so, and not where it does not; "on" and "off" win. The
    input is optional, after every other, so a workflow saved before it still loads."""
    nodes, placement = pack.nodes.toma_nodes, pack.nodes.placement
    spec = nodes.ToMAPatchModelAdvanced.INPUT_TYPES()
    assert list(spec["optional"])[-1] == "rotation" and spec["optional"]["rotation"][1]["default"] == "auto"
    strength = pack.toma_core.ROTATION_STRENGTH
    for preset_rotates in (False, True):
        monkeypatch.setitem(placement.PRESETS, "sd1", dataclasses.replace(placement.PRESETS["sd1"],
                                                                          rotation=preset_rotates))
        expected = strength if preset_rotates else 0.0
        basic = nodes.ToMAPatchModel().patch(sd15, -1, 0, 5)[0]
        assert strategy_of(pack, basic).rotation == expected
        advanced = nodes.ToMAPatchModelAdvanced()
        assert strategy_of(pack, advanced.patch(sd15, -1, 0, 5)[0]).rotation == expected
        assert strategy_of(pack, advanced.patch(sd15, -1, 0, 5, rotation="on")[0]).rotation == strength
        assert strategy_of(pack, advanced.patch(sd15, -1, 0, 5, rotation="off")[0]).rotation == 0.0
    assert not hasattr(strategy_of(pack, nodes.ToMeSDPatchModel().patch(sd15, 0.5)[0]), "rotation")


@pytest.mark.parametrize("ratio", [-0.5, -1.5])
def test_a_negative_ratio_other_than_auto_is_refused(pack, sd15, ratio):
    with pytest.raises(ValueError, match="ratio must be"):
        pack.nodes.toma_nodes.ToMAPatchModel().patch(sd15, ratio, 0, 5)


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_each_dit_kind_gets_its_ratio(pack):
    nodes, placement = pack.nodes.toma_nodes, pack.nodes.placement
    for model, kind in ((models.build_flux(seed=0), "dit"), (models.build_wan("t2v", seed=0), "video")):
        basic = nodes.ToMAPatchModel().patch(model, nodes.DEFAULT_RATIO, nodes.DEFAULT_WINDOW, nodes.DEFAULT_REUSE)[0]
        assert strategy_of(pack, basic).ratio == placement.PRESETS[kind].ratio


def merged_steps(pack, patched) -> dict:
    """{level label: steps merged} and the run's short-run words, of the last run."""
    summary = pack.nodes.runtime.runtime_of(patched).report()
    return {str(level): sorted(s.steps) for level, s in summary.levels.items()}, summary.short_run


def test_a_short_run_follows_the_presets_short_run_schedule(pack, sd15, monkeypatch, caplog):
    """A preset that merges from 50% of the schedule, and in runs of at most 4 steps from the first step
    with a new plan every step: the basic node follows it by the run's step count, says so once in the log
    and in the run's report; a longer run and the Advanced node's explicit scopes keep the long schedule."""
    nodes, placement, toma_core = pack.nodes.toma_nodes, pack.nodes.placement, pack.toma_core
    short = toma_core.ShortRun(4, start_percent=0.0, reuse_interval=1)
    monkeypatch.setitem(placement.PRESETS, "sd1", dataclasses.replace(
        placement.PRESETS["sd1"], start_percent=0.5, short_run=short))
    basic = nodes.ToMAPatchModel().patch(sd15, 0.5, 0, 5)[0]
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        sample_unet(basic, 4)
        levels, words = merged_steps(pack, basic)
        plans = pack.nodes.runtime.runtime_of(basic).report().levels
        sample_unet(basic, 4)
    assert levels == {"32x32 (1/1)": [0, 1, 2, 3]}
    assert words == "a 4-step run (at most 4) merges from 0% of the schedule, plans reused for at most 1 step"
    assert [r.step for level in plans.values() for r in level.records] == [0, 1, 2, 3]  # a new plan each step
    assert sum(words in r.getMessage() for r in caplog.records) == 1
    sample_unet(basic, 6)
    levels, words = merged_steps(pack, basic)
    assert words is None and levels["32x32 (1/1)"][0] >= 2  # from 50% on
    explicit = nodes.ToMAPatchModelAdvanced().patch(sd15, 0.5, 0, 5, scope="keys/values", start_percent=0.5)[0]
    sample_unet(explicit, 4)
    assert merged_steps(pack, explicit)[1] is None and merged_steps(pack, explicit)[0]["32x32 (1/1)"][0] >= 1


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
def test_the_dit_presets_short_run_changes_a_few_step_run(pack):
    """The image-DiT preset's short-run schedule is in force: a 4-step run through the basic node samples
    as the Advanced node with the short run's settings spelled out, and not as the long schedule."""
    nodes, placement = pack.nodes.toma_nodes, pack.nodes.placement
    preset = placement.PRESETS["dit"]
    assert preset.short_run is not None and preset.short_run.steps >= 4
    flux = models.build_flux(seed=1)
    basic = nodes.ToMAPatchModel().patch(flux, -1, 0, 5)[0]
    timing = strategy_of(pack, basic).schedule.timing(4)
    spelled = nodes.ToMAPatchModelAdvanced().patch(
        flux, preset.ratio, preset.window_size, timing.reuse_interval, scope=preset.scope,
        start_percent=timing.start_percent, merge_every=timing.merge_every,
        weights_interval=timing.weights_interval, plan_per_block=preset.plan_per_block,
        shared_destinations=preset.shared_destinations, proportional_attention=preset.proportional)[0]
    long = nodes.ToMAPatchModelAdvanced().patch(
        flux, preset.ratio, preset.window_size, 5, scope=preset.scope, start_percent=preset.start_percent,
        merge_every=preset.merge_every, weights_interval=preset.weights_interval,
        plan_per_block=preset.plan_per_block, shared_destinations=preset.shared_destinations,
        proportional_attention=preset.proportional)[0]
    out = sample_flux(basic, 4)
    assert torch.equal(out, sample_flux(spelled, 4))
    assert not torch.equal(out, sample_flux(long, 4))
    assert pack.nodes.runtime.runtime_of(basic).report().short_run.startswith("a 4-step run")
