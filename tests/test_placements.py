"""Placements (nodes/placement.py: the Advanced node's scope), per-block plans and proportional attention,
sampled with ComfyUI's own sampler on the SD1.5-width random-weight UNet (toma_bench.models.SD15_SMALL),
in the pinned tree and in current ComfyUI (COMFYUI_PATH); the DiT fallback in current ComfyUI only."""
import logging

import pytest
import torch

from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = pytest.mark.comfy
SHAPE = (1, 32, 32)
UNET_SCOPES = ("attention", "keys/values", "queries", "block")
SETTINGS = [(scope, proportional) for scope in UNET_SCOPES for proportional in (False, True)
            if not proportional or scope in ("attention", "keys/values")]
IDS = [f"{s}{'-proportional' if p else ''}" for s, p in SETTINGS]


def sample(model, steps=2, cfg=5.0):
    latent = torch.zeros(SHAPE[0], 4, *SHAPE[1:])
    return sampling.sample(model, models.conditioning("sd15", 1, height=256, width=256), latent, steps=steps, cfg=cfg)


def advanced(pack, model, scope, proportional=False, ratio=0.5, window_size=4, **inputs):
    node = pack.nodes.NODE_CLASS_MAPPINGS["ToMAPatchModelAdvanced"]()
    return node.patch(model, ratio, window_size, 5, scope=scope, proportional_attention=proportional, **inputs)[0]


@pytest.fixture(scope="module")
def sd15(pack):
    model = models.build_unet("sd15", seed=0)
    return model, sample(model)


@pytest.mark.parametrize("scope, proportional", SETTINGS, ids=IDS)
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, sd15, scope, proportional):
    """Window 2 at ratio 0.1 keeps every token a destination: merging only permutes the tokens, every
    merged key stands for one token (log mass 0), so every placement gives the unpatched output."""
    model, reference = sd15
    patched = advanced(pack, model, scope, proportional, ratio=0.1, window_size=2)
    assert relative_l2(sample(patched), reference) < 1e-5
    assert pack.nodes.runtime.runtime_of(patched).summary()["levels"]  # it did merge (a permutation)


@pytest.mark.parametrize("scope, proportional", SETTINGS, ids=IDS)
def test_half_ratio_merges_the_full_resolution_level(pack, sd15, scope, proportional):
    model, reference = sd15
    patched = advanced(pack, model, scope, proportional)
    out = sample(patched)
    levels = pack.nodes.runtime.runtime_of(patched).summary()["levels"]
    assert [(v["downsample"], v["tokens"], v["merged_tokens"]) for v in levels.values()] == [(1, 1024, 512)]
    assert 0 < relative_l2(out, reference) < 0.25


@pytest.mark.parametrize("scope", ["attention", "keys/values"])
def test_proportional_attention_changes_what_merged_keys_weigh(pack, sd15, scope):
    model, _ = sd15
    plain, weighed = (sample(advanced(pack, model, scope, p)) for p in (False, True))
    assert relative_l2(weighed, plain) > 1e-4


def test_proportional_attention_with_scope_block_is_said_not_honoured(pack, sd15, caplog):
    """Whole blocks run their own attention on merged tokens: proportional attention is not honoured there,
    and the log (once) and every run's stats say so; the output is scope block's without it."""
    model, _ = sd15
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        patched = advanced(pack, model, "block", True)
    out = sample(patched)
    said = [r.getMessage() for r in caplog.records if "proportional attention is not honoured" in r.getMessage()]
    assert len(said) == 1
    assert any("proportional attention is not honoured" in c for c in
               pack.nodes.runtime.runtime_of(patched).summary()["caveats"])
    assert torch.equal(out, sample(advanced(pack, model, "block")))


def test_keys_values_attend_with_full_queries_over_merged_keys(pack, sd15, monkeypatch):
    """The self-attention at 1/1 runs 1024 queries over 512 keys; "queries" the other way round."""
    import comfy.ldm.modules.attention as attention

    model, _ = sd15
    seen = []
    original = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[-2], k.shape[-2]))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "optimized_attention", attention.attention_pytorch)
    for scope, expected in (("keys/values", (1024, 512)), ("queries", (512, 1024)), ("attention", (512, 512))):
        seen.clear()
        sample(advanced(pack, model, scope), steps=1, cfg=1.0)
        assert expected in seen and (1024, 1024) not in seen, (scope, seen)


def test_plans_per_block_are_built_by_each_block(pack, sd15):
    model, _ = sd15
    shared, own = (advanced(pack, model, "attention", plan_per_block=p) for p in (False, True))
    counts = []
    for patched in (shared, own):
        sample(patched, steps=1, cfg=1.0)
        counts.append(len(pack.nodes.runtime.runtime_of(patched).report().plans))
    blocks_at_full_resolution = 3  # SD15_SMALL: 1 input, 2 output blocks hold attention at 1/1
    assert counts == [1, blocks_at_full_resolution]


def test_shared_destinations_select_once_per_level_and_weigh_per_block(pack, sd15):
    """With shared_destinations every block of a level merges into the destinations its first block chose,
    with weights of its own; without plan_per_block the input changes nothing."""
    model, _ = sd15
    own, shared = (advanced(pack, model, "keys/values", plan_per_block=True, shared_destinations=s) for s in (False, True))
    plans = []
    for patched in (own, shared):
        sample(patched, steps=1, cfg=1.0)
        plans.append(list(pack.nodes.runtime.runtime_of(patched).report().plans.values()))
    assert len(plans[0]) == len(plans[1]) == 3
    assert len(pack.nodes.runtime.runtime_of(shared).report().shared_destinations) == 1  # the one level, 1/1
    first, *others = plans[1]
    for plan in others:
        assert torch.equal(plan.destinations, first.destinations)
        assert not torch.equal(plan.merge_weights, first.merge_weights)
    assert not torch.equal(plans[0][1].destinations, plans[0][2].destinations)  # each block its own
    level = advanced(pack, model, "keys/values", shared_destinations=True)
    assert pack.nodes.runtime.runtime_of(level).strategy == pack.nodes.runtime.runtime_of(
        advanced(pack, model, "keys/values")).strategy


def test_each_kind_of_unet_gets_its_preset_and_the_basic_node_is_advanced_auto(pack, sd15):
    """SD1.x (attention at 1/1) and SDXL (none there) are told apart; the basic node samples exactly as the
    Advanced node with scope "auto" and the preset's weights interval and start."""
    nodes, placement = pack.nodes.toma_nodes, pack.nodes.placement
    model, _ = sd15
    sdxl = models.build_unet("sdxl", seed=0)
    assert nodes.preset_of(model) is placement.PRESETS["sd1"] and nodes.preset_of(sdxl) is placement.PRESETS["sdxl"]
    preset = placement.PRESETS["sd1"]
    basic = pack.nodes.NODE_CLASS_MAPPINGS["ToMAPatchModel"]().patch(model, 0.5, 4, 5)[0]
    auto = advanced(pack, model, "auto", levels=preset.levels, weights_interval=preset.weights_interval,
                    start_percent=preset.start_percent, merge_every=preset.merge_every)
    runtime = pack.nodes.runtime.runtime_of(basic)
    assert runtime.strategy == pack.nodes.runtime.runtime_of(auto).strategy
    where = runtime.placement
    assert where == pack.nodes.runtime.runtime_of(auto).placement
    assert (where.plan_per_block, where.shared_destinations, where.proportional) == (
        preset.plan_per_block, preset.plan_per_block and preset.shared_destinations, preset.proportional)
    assert torch.equal(sample(basic), sample(auto))


def test_scope_outside_the_choices_is_refused_naming_it(pack, sd15):
    with pytest.raises(ValueError, match="scope must be one of"):
        advanced(pack, sd15[0], "values")


@pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)
@pytest.mark.parametrize("scope", ["queries"])  # keys/values: every DiT but SD3 (tests/test_family_conformance.py)
def test_a_dit_falls_back_to_its_default_placement_and_says_so(pack, scope, caplog):
    model = models.build_flux(seed=0)
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        patched = advanced(pack, model, scope)
    assert any(f"cannot merge with scope {scope}" in r.getMessage() and "it uses block" in r.getMessage()
               for r in caplog.records)
    default = advanced(pack, model, "block")
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, 0)
    latent = torch.zeros(1, 16, 16, 16)
    assert torch.equal(sampling.sample(patched, conditioning, latent, steps=1),
                       sampling.sample(default, conditioning, latent, steps=1))


def test_the_placement_is_settled_once_from_the_inputs_and_the_kind(pack, caplog):
    """placement.settle: scope "auto" takes the kind's placement and fixes (a ToMA preset) or the family's
    fallback (a baseline); a scope the family does not honour falls back, said in the log; proportional
    attention asked for with a scope that keeps keys out of the attention call's merging is turned off with
    its caveat, written once for every adapter; rotation "auto" is the kind's; the short-run schedule comes
    with the kind's placement only."""
    placement, core = pack.nodes.placement, pack.toma_core
    unet, sd3 = pack.nodes.adapters.unet, pack.nodes.adapters.families.SD3
    sd1, video = placement.PRESETS["sd1"], placement.PRESETS["video"]
    schedule = core.ReuseSchedule(reuse_interval=5)

    auto = placement.settle(unet, "auto", sd1, schedule=schedule)
    assert (auto.scope, auto.plan_per_block, auto.shared_destinations, auto.proportional, auto.rotation,
            auto.caveats) == (sd1.scope, True, True, True, 0.0, ())
    assert placement.settle(unet, "auto").scope == unet.fallback == placement.ATTENTION
    chosen = placement.settle(unet, "attention", sd1, proportional=True, shared_destinations=True, rotation="on")
    assert (chosen.proportional, chosen.plan_per_block, chosen.shared_destinations, chosen.rotation) == (
        True, False, False, core.ROTATION_STRENGTH)
    for scope, why in (("block", "the blocks run their own attention"), ("queries", "the keys stay whole")):
        settled = placement.settle(unet, scope, sd1, proportional=True)
        assert not settled.proportional and settled.scope == scope
        assert settled.caveats == (f"proportional attention is not honoured on {unet.name} with scope {scope} "
                                   f"({placement.KEYS_WHOLE[scope]}): use scope attention or keys/values",)
        assert why in settled.caveats[0]

    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        fallen = placement.settle(sd3, "keys/values", proportional=True)
    assert fallen.scope == placement.BLOCK and not fallen.proportional
    assert any("SD3/SD3.5 cannot merge with scope keys/values" in r.getMessage() for r in caplog.records)
    assert fallen.caveats == ("proportional attention is not honoured on SD3/SD3.5 with scope block (the blocks run "
                              "their own attention on merged tokens)",)  # SD3 offers no other scope

    assert placement.settle(sd3, "auto", video, schedule=schedule).schedule.short_run == video.short_run
    assert placement.settle(sd3, "block", video, schedule=schedule).schedule.short_run is None
    assert placement.settle(sd3, "block", video, rotation="auto").rotation == core.ROTATION_STRENGTH
    assert placement.settle(sd3, "block", rotation="auto").rotation == 0.0


def test_the_adapter_and_the_runtime_read_the_placement_the_node_settled(pack, sd15, monkeypatch):
    """The node settles once: the adapter is handed the runtime's own Placement, and per-block plans
    become per-block plan keys through it (the strategy carries no placement)."""
    model, _ = sd15
    unet = pack.nodes.adapters.unet
    handed = []
    monkeypatch.setattr(unet, "patch", lambda m, runtime, where, patch=unet.patch: (
        handed.append((runtime, where)), patch(m, runtime, where))[1])
    patched = advanced(pack, model, "keys/values", True, plan_per_block=True)
    ((runtime, where),) = handed
    assert runtime is pack.nodes.runtime.runtime_of(patched) and where is runtime.placement
    assert where.plan_per_block and where.proportional and where.scope == "keys/values"
    assert not any(hasattr(runtime.strategy, name) for name in ("proportional", "shares_plans", "shares_destinations"))
    sample(patched)
    assert {key.block is not None for key in runtime.report().plans} == {True}
