"""Token merging stacked with the nodes users combine it with, and run by every sampler ComfyUI lists.

The model is SD1.5's full UNet layout (attention at 1/1, 1/2, 1/4 and in the middle block at 1/8, as
SAG expects) at width 32, on a 16x16 latent: a step takes milliseconds, so the matrix below runs each
stack in both orders. Works against the pinned ComfyUI and a current one (COMFYUI_PATH); nodes a tree
lacks (PAG, EasyCache) are skipped there with the reason.
"""
import logging

import pytest
import torch

from toma_bench import models, sampling
from toma_bench.metrics import relative_l2

pytestmark = pytest.mark.comfy

LOGGER = "ComfyUI-ToMA"
TINY = dict(models.SD15_FULL, model_channels=32, num_heads=4)
SHAPE = (1, 16, 16)  # latent (batch, h, w): 16x16 tokens at 1/1, 2x2 in the middle block
TOMA = {"ratio": 0.5, "window_size": 2, "reuse_interval": 2}


@pytest.fixture(scope="module")
def unet(pack):
    return models.build_unet("sd15", seed=3, config=TINY)


def run_node(name, **inputs):
    """Node ``name`` of ComfyUI or of the pack (V1 class or V3 ComfyNode), with the defaults of the
    inputs not given."""
    from toma_bench import comfy_host
    import nodes  # ComfyUI's nodes.py

    mappings = {**nodes.NODE_CLASS_MAPPINGS, **comfy_host.load_pack().nodes.NODE_CLASS_MAPPINGS}
    if name not in mappings:
        pytest.skip(f"{name} is not in this ComfyUI")
    cls = mappings[name]
    for key, spec in cls.INPUT_TYPES().get("required", {}).items():
        if key not in inputs:
            options = spec[1] if len(spec) > 1 else {}
            if "default" in options:
                inputs[key] = options["default"]
            else:  # a combo: its first choice (V3 nodes list them under "options")
                inputs[key] = (spec[0] if isinstance(spec[0], (list, tuple)) else options["options"])[0]
    if hasattr(cls, "define_schema"):
        out = cls.execute(**inputs)
        return out.args[0] if hasattr(out, "args") else out[0]
    return getattr(cls(), cls.FUNCTION)(**inputs)[0]


def toma(model, **inputs):
    node = "ToMAPatchModelAdvanced" if set(inputs) - set(TOMA) else "ToMAPatchModel"
    return run_node(node, model=model, **dict(TOMA, **inputs))


def sample(model, *, steps=2, **options):
    """sampling.sample on a zero latent of SHAPE. The global RNGs are seeded too: HyperTile and ToMe draw
    from them, and two runs of one stack must draw alike."""
    conditioning = models.conditioning("sd15", 1, height=8 * SHAPE[1], width=8 * SHAPE[2])
    return sampling.sample(model, conditioning, torch.zeros(SHAPE[0], 4, *SHAPE[1:]), steps=steps, global_rngs=True,
                           **options)


def runtime_of(pack, model):
    return pack.nodes.runtime.runtime_of(model)


def merged_levels(pack, model) -> dict[str, dict]:
    return runtime_of(pack, model).summary()["levels"]


def toma_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


# -- the interop matrix ----------------------------------------------------------------------------------
def lora(model):
    key = "diffusion_model.input_blocks.1.1.transformer_blocks.0.attn1.to_v.weight"
    weight = model.model.state_dict()[key]
    clone = model.clone()
    clone.add_patches({key: (0.1 * weight.abs().max() * torch.rand(weight.shape, generator=torch.Generator()
                                                                     .manual_seed(4)),)})
    return clone


# name -> (how the other node patches a model, sampling arguments it needs, whether it changes the tokens
# or replaces the attention of a level ToMA merges with levels "all", so ToMA must say it steps aside there)
OTHERS = {
    "HyperTile": (lambda m: run_node("HyperTile", model=m, tile_size=64, swap_size=1, max_depth=0), {}, True),
    "ToMe": (lambda m: run_node("TomePatchModel", model=m, ratio=0.5), {}, True),
    "ToMA": (lambda m: toma(m, ratio=0.75, window_size=4), {}, True),
    "SAG": (lambda m: run_node("SelfAttentionGuidance", model=m, scale=0.5, blur_sigma=2.0), {"cfg": 2.0}, True),
    "PAG": (lambda m: run_node("PerturbedAttentionGuidance", model=m, scale=2.0), {"cfg": 2.0}, True),
    "FreeU_V2": (lambda m: run_node("FreeU_V2", model=m), {}, False),
    "DeepShrink": (lambda m: run_node("PatchModelAddDownscale", model=m, block_number=3, downscale_factor=2.0,
                                      end_percent=0.6), {}, False),
    "ModelSamplingDiscrete": (lambda m: run_node("ModelSamplingDiscrete", model=m, sampling="v_prediction",
                                                 zsnr=True), {}, False),
    "EasyCache": (lambda m: run_node("EasyCache", model=m, reuse_threshold=0.2, start_percent=0.0,
                                     end_percent=1.0), {"steps": 4}, False),
    "LoRA": (lora, {}, False),
}


@pytest.mark.parametrize("ratio", [0.0, 0.5])
@pytest.mark.parametrize("order", ["other-then-toma", "toma-then-other"])
@pytest.mark.parametrize("other", list(OTHERS))
def test_stacks_sample_in_both_orders(pack, unet, other, order, ratio, caplog):
    apply_other, sampling, steps_aside_somewhere = OTHERS[other]
    inputs = {"ratio": ratio, "levels": "all"}
    without_toma = apply_other(unet)
    stacked = toma(apply_other(unet), **inputs) if order == "other-then-toma" else apply_other(toma(unet, **inputs))

    out = sample(stacked, **sampling)

    assert torch.isfinite(out).all()
    if ratio == 0:
        assert torch.equal(out, sample(without_toma, **sampling))
        return
    merged = merged_levels(pack, stacked)
    assert merged, "ToMA merged nothing in this stack"
    assert all(level["merged_tokens"] < level["tokens"] for level in merged.values())
    steps_aside = [m for m in toma_warnings(caplog) if "unmerged" in m]
    if steps_aside_somewhere:
        assert steps_aside, "ToMA must say where it leaves another node's tokens or attention alone"
    else:
        assert not steps_aside


def test_another_patch_keeps_its_level_and_toma_merges_the_others(pack, unet, caplog):
    """HyperTile tiles 1/1 (max_depth 0); ToMA keeps to the levels HyperTile leaves alone, whichever node
    comes first, and the stack's output does not depend on the order."""
    hypertile = OTHERS["HyperTile"][0]
    first = toma(hypertile(unet), levels="all")
    second = hypertile(toma(unet, levels="all"))

    a, b = sample(first), sample(second)

    assert torch.equal(a, b)
    for stacked in (first, second):
        assert set(merged_levels(pack, stacked)) == {"8x8 (1/2)", "4x4 (1/4)", "2x2 (1/8)"}
    assert any("16x16 (1/1) unmerged" in m for m in toma_warnings(caplog))


# (other node, how the stats name it, order): a second ToMA node takes the level only from nearer the sampler
TAKERS = [(other, named, order) for other, named in [("HyperTile", "HyperTile"), ("ToMe", "TomePatchModel")]
          for order in ("other-then-toma", "toma-then-other")] + \
         [("ToMA", "the ToMA node nearer the sampler", "toma-then-other")]


@pytest.mark.parametrize("other, named, order", TAKERS)
def test_stats_name_the_node_that_took_the_default_level(pack, unet, sent, other, named, order):
    """On the default level (1/1) the other node changes the tokens first: the stats line names it
    instead of blaming the levels or start/end percent."""
    apply_other = OTHERS[other][0]
    patched = (toma(apply_other(unet), unique_id="9") if order == "other-then-toma"
               else apply_other(toma(unet, unique_id="9")))

    sample(patched)

    (lines,) = [data["lines"] for _, data, _ in sent if data["node"] == "9"]
    assert lines[0] == f"16x16 (1/1): left to {named}, which changed its tokens first"
    assert not any("no step merged" in line for line in lines)


def test_two_toma_nodes_the_one_nearer_the_sampler_wins_where_both_merge(pack, unet):
    inner = toma(unet, ratio=0.75, levels="1,2")
    outer = toma(inner, ratio=0.25, levels="1")

    sample(outer)

    assert set(merged_levels(pack, outer)) == {"16x16 (1/1)"}
    assert merged_levels(pack, outer)["16x16 (1/1)"]["merged_tokens"] == 192  # 0.25 of 256 merged away
    assert set(merged_levels(pack, inner)) == {"8x8 (1/2)"}  # the inner node keeps the level left to it
    # the merge map of the stack shows both: 1/1 from the outer node, 1/2 from the inner one
    merge_map = pack.nodes.NODE_CLASS_MAPPINGS["ToMAMergeMap"]()
    latent = {"samples": torch.zeros(1, 4, *SHAPE[1:])}
    for level in (0, 1):
        (picture,) = merge_map.draw(outer, latent, level=level)
        assert picture.shape == (1, 8 * SHAPE[1], 8 * SHAPE[2], 3)
    with pytest.raises(ValueError, match=r"1 = 8x8 \(1/2\)"):
        merge_map.draw(outer, latent, level=2)


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_sag_block_is_left_alone(pack, unet, scope, caplog):
    """SAG replaces the middle block's self-attention (1/8 here, where output blocks 0-2 also attend)."""
    sag = OTHERS["SAG"][0]
    stacked = sag(toma(unet, levels="all", scope=scope))

    out = sample(stacked, cfg=2.0)

    assert torch.isfinite(out).all()  # SAG reshapes the attention it records to the full token grid
    assert "4x4 (1/4)" in merged_levels(pack, stacked)
    assert any("unmerged" in m and "replace" in m for m in toma_warnings(caplog))


@pytest.mark.parametrize("scope", ["attention", "block"])
def test_identity_merge_equals_unpatched(pack, unet, scope):
    """Window 2 at ratio 0.1: every token is a destination, so merging only permutes the tokens and
    changes nothing (the March-2024 block adds its attention outputs in place: the block scope must not
    lose them). Window 1 would merge nothing at all (it says so: test_merge_map)."""
    reference = sample(unet, steps=1)
    patched = toma(unet, ratio=0.1, window_size=2, scope=scope, levels="all")

    out = sample(patched, steps=1)

    assert len(merged_levels(pack, patched)) == 4
    assert relative_l2(out, reference) < 1e-5


def test_model_sampling_is_read_from_the_model_being_sampled(pack, unet):
    """A model sampling node after ToMA changes the noise schedule ToMA's start/end percent refer to."""
    progress_of_sigma = pack.nodes.runtime.steps.progress_of_sigma
    def model_sampling_of(m):  # the noise schedule m samples with (a model sampling node: an object patch)
        return pack.nodes.host.original_attr(m, "model_sampling")
    def patch_sampling(m):
        return run_node("ModelSamplingDiscrete", model=m, sampling="lcm", zsnr=True)

    inputs = {"levels": "1", "end_percent": 0.37}
    before = toma(patch_sampling(unet), **inputs)
    after = patch_sampling(toma(unet, **inputs))
    for stacked in (before, after):
        sample(stacked, steps=6)
        sigmas = runtime_of(pack, stacked).report().schedule  # the run's sigmas, as the sampler handed them over
        expected = sum(progress_of_sigma(model_sampling_of(patch_sampling(unet)), s) < 0.37 for s in sigmas[:-1])
        patch_time = sum(progress_of_sigma(model_sampling_of(unet), s) < 0.37 for s in sigmas[:-1])
        assert expected != patch_time  # the test tells the two schedules apart
        assert merged_levels(pack, stacked)["16x16 (1/1)"]["steps"] == expected


# -- the sampler clock ------------------------------------------------------------------------------------
class RunLog:
    """Records the runtime's run starts, run ends and model calls (first block call of each), and the
    stats each run reports."""

    def __init__(self, runtime):
        self.events = []
        self.summaries = []
        begin, end, locate = runtime.begin_run, runtime.end_run, runtime.locate

        def logged_locate(options):
            if self.events[-1:] != ["call"]:
                self.events.append("call")
            return locate(options)

        runtime.begin_run = lambda *a, **k: (self.events.append("begin"), begin(*a, **k))[1]
        runtime.end_run = lambda: (self.events.append("end"), end())[1]
        runtime.locate = logged_locate
        runtime.run_listeners.append(self.summaries.append)

    def spurious_starts(self) -> int:
        """Run starts after the model already ran in the same run (no end in between)."""
        return sum(1 for before, now in zip(self.events, self.events[1:]) if now == "begin" and before == "call")


# Samplers that pick their own evaluation times instead of the schedule's: they may leave schedule
# intervals without a model call.
OWN_TIMES = {"dpm_fast", "dpm_adaptive"}


def test_every_sampler_gives_one_run_and_its_steps(pack, unet):
    import comfy.samplers

    steps, failures = 4, {}
    for sampler in comfy.samplers.KSampler.SAMPLERS:
        patched = toma(unet, levels="1", reuse_interval=1)
        runs = RunLog(runtime_of(pack, patched))
        for _ in range(2):
            out = sample(patched, steps=steps, cfg=2.0, sampler=sampler)
        merged_steps = [s["levels"].get("16x16 (1/1)", {}).get("steps") for s in runs.summaries]
        expected = merged_steps[-1] if sampler in OWN_TIMES and 1 <= (merged_steps[-1] or 0) <= steps else steps
        if (not torch.isfinite(out).all() or runs.spurious_starts() or len(runs.summaries) != 2
                or merged_steps != [expected, expected]):
            failures[sampler] = {"finite": bool(torch.isfinite(out).all()), "steps": merged_steps,
                                 "events": " ".join(runs.events)}

    assert not failures


def test_ksampler_advanced_split_runs(pack, unet):
    import nodes  # ComfyUI's nodes.py

    patched = toma(unet, levels="1")
    positive, negative = models.conditioning("sd15", 1, height=128, width=128)
    latent = {"samples": torch.zeros(SHAPE[0], 4, *SHAPE[1:])}
    sampler = nodes.KSamplerAdvanced()

    (half,) = sampler.sample(patched, "enable", 0, 6, 2.0, "euler", "normal", positive, negative, latent,
                             0, 3, "enable")
    first = merged_levels(pack, patched)["16x16 (1/1)"]["steps"]
    (done,) = sampler.sample(patched, "disable", 0, 6, 2.0, "euler", "normal", positive, negative, half,
                             3, 10000, "disable")

    assert torch.isfinite(done["samples"]).all()
    assert first == 3
    assert merged_levels(pack, patched)["16x16 (1/1)"]["steps"] == 3
