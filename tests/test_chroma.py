"""ToMA on Chroma and Chroma Radiance: random-weight models built from ComfyUI's own classes (2 double and
3 single blocks, width 64) sampled through ComfyUI's sampler.

What is Chroma's own: the attention placement on its double blocks and Radiance's pixel patches; the
checks every DiT family passes are in tests/test_family_conformance.py. Chroma latents are Flux latents
(B, 16, H, W), an odd 27x39 (14x20 tokens); Chroma Radiance samples pixels, 16x16 per token.
"""
import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models
from toma_bench.metrics import relative_l2

CURRENT_ONLY = ("Chroma exists only in current ComfyUI (set COMFYUI_PATH, e.g. to the .comfyui-current made by "
                "tests/setup_current.sh)")
pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=CURRENT_ONLY)]

SIZES = {"odd": (27, 39)}
CONTEXT = models.CHROMA_TINY["context_in_dim"]


@pytest.fixture(scope="module")
def chroma(pack):
    """The Chroma ModelPatcher, built once; tests only ever patch clones of it."""
    return models.build_chroma(seed=21)


def sample(model, hw, batch=1, tokens=77, steps=2, cfg=1.0, seed=0, channels=16):
    import comfy.sample

    # Chroma's T5 encoder gives no pooled vector; guidance is Chroma's default (0)
    positive, negative = models.text_conditioning(CONTEXT, batch, tokens, seed, pooled_output=None)
    latent = torch.zeros(batch, channels, *hw)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               seed=seed, disable_pbar=True)


def test_attention_scope_merges_only_the_double_blocks_attention(pack, chroma):
    """Scope "attention" on Chroma's double blocks (text first, in-place block updates): with every token
    a destination the output matches the unpatched model; at ratio 0.5 it stays close and differs from
    the whole-block merge."""
    exact, _ = dit_checks.toma_patched(pack, chroma, ratio=0.1, window=2, scope="attention")
    dit_checks.check_merging_only_permutes(exact, chroma, lambda m: sample(m, SIZES["odd"], batch=2, cfg=2.0))
    def run(m):
        return sample(m, SIZES["odd"])

    out, _ = dit_checks.check_half_ratio_merges(dit_checks.toma_patched(pack, chroma, scope="attention"), chroma,
                                                run, ["two-stream 14x20", "joint 14x20"], 14 * 20, bound=0.15)
    assert relative_l2(out, run(dit_checks.toma_patched(pack, chroma, scope="block")[0])) > 1e-4


@pytest.fixture(scope="module")
def radiance(pack):
    return models.build_chroma(seed=22, config=models.CHROMA_RADIANCE_TINY)


def test_radiance_merges_its_16_pixel_patch_grid(pack, radiance):
    """Chroma Radiance on a 200x136-pixel image (13x9 tokens of 16x16 pixels, padded): every token a
    destination reproduces the unpatched model; ratio 0.5 merges half of the grid and stays within 25%
    of the unpatched output (measured: 10%)."""
    hw = (200, 136)

    def run(model):
        return sample(model, hw, batch=2, cfg=2.0, channels=3)

    exact, _ = dit_checks.toma_patched(pack, radiance, ratio=0.1, window=2)
    dit_checks.check_merging_only_permutes(exact, radiance, run)
    out, unpatched = dit_checks.check_half_ratio_merges(dit_checks.toma_patched(pack, radiance), radiance, run,
                                                        ["two-stream 13x9", "joint 13x9"], 117, bound=0.25)
    assert relative_l2(out, unpatched) > 1e-3
