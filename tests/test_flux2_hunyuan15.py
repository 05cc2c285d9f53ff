"""ToMA on Flux.2 and HunyuanVideo 1.5 (ComfyUI v0.3.75, Nov 2025, and later: tests/setup_newest.sh).
ComfyUI builds them from the Flux and HunyuanVideo classes, so the Flux and HunyuanVideo adapters serve
them; these tests hold what is their own: Flux.2's global modulation, 4-axis RoPE, patch 1 and reference
images (their tokens follow the image and never merge), HunyuanVideo 1.5's SigLIP vision tokens (before
the text, never merged), its concatenated image-to-video channels and the distilled super-resolution model.

Random-weight models from ComfyUI's own classes at tiny widths, sampled through ComfyUI's sampler.
"""
import types

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

NEWEST_ONLY = ("{} exists only in ComfyUI v0.3.75 (Nov 2025) and later: bash tests/setup_newest.sh, then "
               "COMFYUI_PATH=.comfyui-newest")
FLUX2_HW = (13, 19)  # Flux.2 latents (128 channels), one token per pixel
VIDEO = (3, 7, 9)  # HunyuanVideo 1.5 latent frames x H x W (patch 1)
SIGLIP_TOKENS = 9


def require(name):
    import comfy.supported_models

    if not hasattr(comfy.supported_models, name):
        pytest.skip(NEWEST_ONLY.format(name))


@pytest.fixture(scope="module")
def flux2(pack):
    require("Flux2")
    return models.build_flux2(seed=51)


@pytest.fixture(scope="module")
def hunyuan15(pack):
    require("HunyuanVideo15")
    return {"t2v": models.build_hunyuan_video15(seed=52), "sr": models.build_hunyuan_video15(seed=53, sr=True)}


def sample_flux2(model, hw=FLUX2_HW, batch=1, cfg=1.0, reference=None, seed=0):
    options = {"guidance": 4.0, "pooled_output": None}  # Flux.2 has no pooled text vector
    if reference is not None:
        options["reference_latents"] = [reference]
    conditioning = models.text_conditioning(models.FLUX2_TINY["context_in_dim"], 1, 40, seed, **options)
    return sampling.sample(model, conditioning, torch.zeros(batch, 128, *hw), steps=2, cfg=cfg, scheduler="simple",
                           seed=seed)


def sample_hunyuan15(model, variant="t2v", batch=1, cfg=1.0, seed=0):
    """T2V; "i2v": the input image's latent and SigLIP tokens as HunyuanVideo15ImageToVideo gives them;
    "sr": the distilled super-resolution model given a low-resolution latent."""
    g = torch.Generator().manual_seed(60 + seed)
    frames, h, w = VIDEO
    options = {"pooled_output": None}  # HunyuanVideo 1.5 has no pooled text vector
    if variant == "i2v":
        options["concat_latent_image"] = torch.randn(1, 32, frames, h, w, generator=g)
        options["concat_mask"] = torch.ones(1, 1, frames, h, w)
        options["clip_vision_output"] = types.SimpleNamespace(
            last_hidden_state=torch.randn(1, SIGLIP_TOKENS, models.HUNYUAN_VIDEO15_TINY["vision_in_dim"], generator=g))
    if variant == "sr":
        options["concat_latent_image"] = torch.randn(1, 66, frames, h, w, generator=g)
    conditioning = models.text_conditioning(models.HUNYUAN_VIDEO15_TINY["context_in_dim"], 1, 30, seed, **options)
    return sampling.sample(model, conditioning, torch.zeros(batch, 32, frames, h, w), steps=2, cfg=cfg,
                           scheduler="simple", seed=seed)


@pytest.mark.parametrize("scope", ["block", "attention"])
def test_flux2_merging_into_every_token_reproduces_the_unpatched_model(pack, flux2, scope):
    """Every token a destination: the global modulation pair and the 4-axis RoPE rows follow, in both
    placements, with a reference image (its tokens after the image's) and CFG batches."""
    reference = models.structured_latent(1, 10, 12, seed=4, channels=128)
    patched, runtime = dit_checks.toma_patched(pack, flux2, ratio=0.1, window=2, scope=scope)
    dit_checks.check_merging_only_permutes(patched, flux2, lambda m: sample_flux2(m, batch=2, cfg=2.0,
                                                                                 reference=reference))
    assert sorted(runtime.summary()["levels"]) == ["joint 13x19", "two-stream 13x19"]


def test_flux2_reference_tokens_stay_unmerged(pack, flux2):
    """With a reference image at ratio 0.5 only the image grid is counted and merged."""
    reference = models.structured_latent(1, 10, 12, seed=4, channels=128)
    patched, runtime = dit_checks.toma_patched(pack, flux2)
    out = sample_flux2(patched, reference=reference)
    assert torch.isfinite(out).all() and relative_l2(out, sample_flux2(flux2, reference=reference)) < 0.25
    assert {k: (v["tokens"], v["merged_tokens"]) for k, v in runtime.summary()["levels"].items()} == {
        "two-stream 13x19": (247, 124), "joint 13x19": (247, 124)}


# -- HunyuanVideo 1.5 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["t2v", "i2v", "sr"])
def test_hunyuan15_ratio_zero_is_identical_to_unpatched(pack, hunyuan15, variant):
    model = hunyuan15["sr" if variant == "sr" else "t2v"]
    dit_checks.check_ratio_zero_identical(pack, model, lambda m: sample_hunyuan15(m, variant, batch=2))


@pytest.mark.parametrize("variant", ["t2v", "i2v", "sr"])
def test_hunyuan15_merging_into_every_token_reproduces_the_unpatched_model(pack, hunyuan15, variant):
    """Every token a destination: SigLIP and text tokens (before the video in the text stream), the
    concatenated image channels and the super-resolution inputs pass; the output is the unpatched one."""
    model = hunyuan15["sr" if variant == "sr" else "t2v"]
    patched, runtime = dit_checks.toma_patched(pack, model, ratio=0.1, window=2, temporal_window=1)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample_hunyuan15(m, variant, batch=2, cfg=2.0))
    assert sorted(runtime.summary()["levels"]) == ["two-stream 3x7x9"]



# Issue 46 part 6: its model (HUNYUAN_VIDEO15_BYT5_TINY, weights by models.normal_init_) and inputs
ISSUE46_LATENT = (32, 3, 13, 19)


def sample_issue46(model):
    config = models.HUNYUAN_VIDEO15_BYT5_TINY
    g = torch.Generator().manual_seed(46)
    conditioning = models.text_conditioning(
        config["context_in_dim"], 1, 16, 0, pooled_output=None,
        conditioning_byt5small=torch.randn(1, 8, models.BYT5_WIDTH, generator=g),
        clip_vision_output=types.SimpleNamespace(last_hidden_state=torch.randn(1, 9, config["vision_in_dim"],
                                                                               generator=g)))
    return sampling.sample(model, conditioning, torch.zeros(1, *ISSUE46_LATENT), steps=2, scheduler="simple")


def unit_qk_init_(module, seed):
    """Issue 46's draw with every norm scale 1 (the QK-norms' too, as the other builders leave them)."""
    models.normal_init_(module, seed)
    models._unit_norm_scales_(module)


def test_near_uniform_attention_makes_proportional_merges_exact(pack, monkeypatch):
    """Issue 46 part 6: on its model ratio 0.5 with proportional attention changed the output by 2.5e-6. The merge
    runs (the attention sees half the grid's keys fewer); the weights make it exact: their QK-norm scales are near
    0.01, so every attention map is near uniform, and a near-uniform map over merged keys each weighted by its
    group's size is the unmerged map. Without proportional attention, or with unit QK-norm scales, the same merge
    changes the output by far more than the conformance floor. A merge that never reaches the attention leaves the
    stats as they were, and the keys the attention sees catch it."""
    require("HunyuanVideo15")
    config, tokens = models.HUNYUAN_VIDEO15_BYT5_TINY, ISSUE46_LATENT[1] * ISSUE46_LATENT[2] * ISSUE46_LATENT[3]
    issue = models.build_hunyuan_video15(seed=52, config=config, init=models.normal_init_)
    # the QK-norms' scales: RMSNorm's ``scale`` (v0.3.75), core's operations.RMSNorm's ``weight`` (v0.33.0)
    scales = [p for name, p in issue.model.diffusion_model.named_parameters()
              if name.endswith(("query_norm.scale", "key_norm.scale", "query_norm.weight", "key_norm.weight"))]
    assert scales and max(float(p.detach().abs().max()) for p in scales) < 0.05
    counted, seen = dit_checks.attention_lengths(issue)
    reference = sample_issue46(counted)
    unpatched = list(seen)

    def change(model, **options):
        seen.clear()
        patched, runtime = dit_checks.toma_patched(pack, model, scope="keys/values", **options)
        out = sample_issue46(patched)
        assert runtime.summary()["levels"] and not runtime.report().unmerged
        measured = relative_l2(out, reference if model is counted else sample_issue46(model))
        print(f"issue 46 part 6: {'issue weights' if model is counted else 'unit QK-norm scales'}, {options}: "
              f"relative change {measured:.3g}")  # the notebook's figures (pytest -s)
        return measured

    assert change(counted, proportional_attention=True) < dit_checks.MERGED_FLOOR
    dit_checks.assert_keys_merged(unpatched, seen, tokens)
    assert change(counted) > 10 * dit_checks.MERGED_FLOOR
    unit = models.build_hunyuan_video15(seed=52, config=config, init=unit_qk_init_)
    assert change(unit, proportional_attention=True) > 10 * dit_checks.MERGED_FLOOR

    def unmerged_call(self, func, q, k, v, heads, *args, **kwargs):  # a merge that never reaches the attention
        self.served = True
        return self.attend(func, q, k, v, heads, *args, **kwargs)

    monkeypatch.setattr(pack.nodes.adapters.attention_override.MergedKeysValues, "__call__", unmerged_call)
    assert change(counted, proportional_attention=True) < dit_checks.MERGED_FLOOR
    with pytest.raises(AssertionError):
        dit_checks.assert_keys_merged(unpatched, seen, tokens)
