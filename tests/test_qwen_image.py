"""ToMA on Qwen-Image and Qwen-Image-Edit: a random-weight Qwen-Image transformer built from ComfyUI's own
classes (4 double blocks, width 64) sampled through ComfyUI's sampler.

What is Qwen-Image's own: RoPE rows along its token axis, Edit references merged by plans of their own,
the real 128x128 latent of a 1024x1024 image (tiny width, one step); the checks every DiT family passes
are in tests/test_family_conformance.py. Latents are Wan-VAE latents (B, 16, 1, H, W), an odd 27x39.
"""
import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models
from toma_bench.metrics import relative_l2

CURRENT_ONLY = ("Qwen-Image (+Edit) exists only in current ComfyUI (set COMFYUI_PATH, e.g. to the "
                ".comfyui-current made by tests/setup_current.sh)")
pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=CURRENT_ONLY)]

SIZES = {"odd": (27, 39)}
CONTEXT = models.QWEN_IMAGE_TINY["joint_attention_dim"]


@pytest.fixture(scope="module")
def qwen(pack):
    """The Qwen-Image ModelPatcher, built once; tests only ever patch clones of it."""
    return models.build_qwen_image(seed=11)


def sample(model, hw, batch=1, tokens=77, steps=2, cfg=1.0, seed=0):
    import comfy.sample

    positive, negative = models.text_conditioning(CONTEXT, batch, tokens, seed)
    latent = torch.zeros(batch, 16, 1, *hw)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               seed=seed, disable_pbar=True)


def reference_latent(h, w, seed):
    """A Qwen-Image-Edit reference image's latent (1, 16, 1, h, w)."""
    return models.structured_latent(1, h, w, seed=seed, channels=16)[:, :, None]


def test_merged_block_call_gets_destination_positions(pack, qwen):
    """A spy in place of a Qwen-Image block sees: text rows of pe untouched, each merged image token and
    each merged token of the reference grid with the RoPE row of its destination (all along dim 1); the
    patch returns full-length image tokens with the block's update unmerged onto every token."""
    layouts = pack.nodes.adapters.layout
    dm = qwen.model.diffusion_model
    h, w, txt_len, ref = 5, 7, 9, (2, 3)
    n_img, n_ref = h * w, ref[0] * ref[1]
    g = torch.Generator().manual_seed(4)
    ids = torch.randn(2, txt_len + n_img + n_ref, 3, generator=g)  # distinct positions for every row
    pe = dm.pe_embedder(ids).squeeze(1).unsqueeze(2)  # as QwenImageTransformer2DModel._forward builds it
    C = dm.inner_dim
    layout = layouts.ImageLayout(h, w, n_ref, references=(ref,))
    args = {"img": torch.randn(2, n_img + n_ref, C, generator=g), "txt": torch.randn(2, txt_len, C, generator=g),
            "vec": torch.randn(2, C, generator=g), "pe": pe,
            "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}}
    seen = {}
    patched, runtime = dit_checks.toma_patched(pack, qwen)
    out = dit_checks.dit_patches(patched)[("double_block", 1)](dict(args),
                                                              {"original_block": dit_checks.spy(seen, passes=("txt",))})
    plans = {key.level.group: plan for key, plan in runtime.report().plans.items()}
    image_dst = plans["two-stream"].destination_tokens()
    ref_dst = plans["two-stream reference 1"].destination_tokens()
    n, r = image_dst.shape[1], ref_dst.shape[1]
    assert n < n_img and r < n_ref and seen["img"].shape[1] == n + r and seen["pe"].shape[1] == txt_len + n + r
    for b in range(2):
        assert torch.equal(seen["pe"][b, :txt_len], pe[b, :txt_len])
        assert torch.equal(seen["pe"][b, txt_len:txt_len + n], pe[b, txt_len + image_dst[b]])
        assert torch.equal(seen["pe"][b, txt_len + n:], pe[b, txt_len + n_img + ref_dst[b]])
    assert torch.equal(out["txt"], args["txt"])
    dit_checks.check_update_on_every_token(out["img"], args["img"])  # on every image and reference token


@pytest.mark.parametrize("method", ["index", "offset"])
def test_edit_references_merge_by_their_own_plans(pack, qwen, method):
    """Qwen-Image-Edit: two reference latents (odd and non-square) append their tokens after the image
    tokens, placed by either of ComfyUI's methods. In the D = S case the output is the unpatched one (the
    references' RoPE rows follow their tokens); at ratio 0.5 the image and each reference grid merge
    half of their tokens, and the output stays close to the unpatched one."""
    import node_helpers

    references = [reference_latent(20, 14, seed=3), reference_latent(9, 12, seed=4)]

    def run(model):
        import comfy.sample

        positive, negative = models.text_conditioning(CONTEXT, 1, 77, 0, reference_latents=references)
        positive = node_helpers.conditioning_set_values(positive, {"reference_latents_method": method})
        latent = torch.zeros(1, 16, 1, *SIZES["odd"])
        noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
        return comfy.sample.sample(model, noise, 2, 1.0, "euler", "simple", positive, negative, latent, seed=0,
                                   disable_pbar=True)

    unpatched = run(qwen)
    exact, runtime = dit_checks.toma_patched(pack, qwen, ratio=0.1, window=2)
    assert relative_l2(run(exact), unpatched) < 1e-5
    assert sorted(runtime.summary()["levels"]) == ["two-stream 14x20", "two-stream reference 1 10x7",
                                                   "two-stream reference 2 5x6"]
    half_patched, half = dit_checks.toma_patched(pack, qwen)
    out = run(half_patched)
    assert torch.isfinite(out).all() and 1e-4 < relative_l2(out, unpatched) < 0.05
    levels = half.summary()["levels"]
    assert {k: v["tokens"] for k, v in levels.items()} == {"two-stream 14x20": 280, "two-stream reference 1 10x7": 70,
                                                           "two-stream reference 2 5x6": 30}
    assert all(abs(v["merged_tokens"] - v["tokens"] / 2) <= v["tokens"] / 8 for v in levels.values())


def test_real_1024_latent_with_tiny_width(pack):
    """The real latent of a 1024x1024 image (128x128 -> 64x64 tokens), one step, one block of width 32."""
    config = dict(models.QWEN_IMAGE_TINY, num_layers=1, num_attention_heads=2)
    patched, runtime = dit_checks.toma_patched(pack, models.build_qwen_image(seed=12, config=config))
    out = sample(patched, (128, 128), tokens=256, steps=1)
    assert out.shape == (1, 16, 1, 128, 128) and torch.isfinite(out).all()
    assert runtime.summary()["levels"] == {"two-stream 64x64": {"tokens": 4096, "merged_tokens": 2048, "steps": 1,
                                                                "group": "two-stream", "grid": [64, 64]}}


def test_unsupported_family_is_returned_unpatched_with_a_message(pack, caplog):
    """An AuraFlow model, which no adapter serves, comes back as is, with a log message that names every
    supported family."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    config = {"in_channels": 4, "out_channels": 4, "patch_size": 2, "dim": 64, "n_layers": 2, "n_double_layers": 1,
              "n_heads": 4, "global_conddim": 64, "cond_seq_dim": 32, "max_seq": 256}
    aura = comfy.supported_models.AuraFlow(config)
    aura.set_inference_dtype(torch.float32, None)
    model = comfy.model_patcher.ModelPatcher(models.build_base(aura), load_device=mm.get_torch_device(),
                                             offload_device=mm.unet_offload_device())
    dit_checks.check_comes_back_unpatched(pack, model, caplog, "AuraFlow is not supported")
    families = [adapter.name for adapter in pack.nodes.adapters.ADAPTERS]
    assert "Qwen-Image" in families
    assert all(family in caplog.text for family in families)
