"""ToMA on Chroma and Chroma Radiance: random-weight models built from ComfyUI's own classes (2 double and
3 single blocks, width 64) sampled through ComfyUI's sampler.

Chroma latents are Flux latents (B, 16, H, W) at 1/4 of the real sizes (1024x1024 -> 32x32, 832x1216 ->
26x38, and an odd 27x39 whose 14x20 token grid no window of 4 divides); Chroma Radiance samples pixels,
16x16 per token.
"""
import pytest
import torch

from toma_bench import comfy_host, dit_checks, models
from toma_bench.metrics import relative_l2

CURRENT_ONLY = ("Chroma exists only in current ComfyUI (set COMFYUI_PATH, e.g. to the .comfyui-current made by "
                "tests/setup_current.sh)")
pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=CURRENT_ONLY)]

SIZES = {"1024x1024": (32, 32), "832x1216": (26, 38), "odd": (27, 39)}
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


def test_node_patches_a_clone_and_leaves_the_input_alone(pack, chroma):
    # Flux's fractions: the first of 2 double blocks (2 * 5/19 rounds to 1) and none of 3 single blocks skip
    dit_checks.check_input_model_unchanged(pack, chroma, lambda m: sample(m, SIZES["odd"]),
                                           {("double_block", 1), ("single_block", 0), ("single_block", 1),
                                            ("single_block", 2)})


def test_ratio_zero_is_identical_to_unpatched(pack, chroma):
    dit_checks.check_ratio_zero_identical(pack, chroma, lambda m: sample(m, SIZES["odd"], batch=2))


# every pair of (size, batch size, text length) values occurs once: 6 runs instead of the 12 of a full grid
PAIRWISE = [("1024x1024", 1, 77), ("1024x1024", 2, 512), ("832x1216", 1, 512), ("832x1216", 2, 77),
            ("odd", 1, 77), ("odd", 2, 512)]


@pytest.mark.parametrize("size,batch,tokens", PAIRWISE)
def test_half_ratio_merges_both_block_groups(pack, chroma, size, batch, tokens):
    """Ratio 0.5 changes the output but stays within 15% of the unpatched one (measured: 6.7-6.8%; all
    5 blocks but the first double block merge), and the stats report the token grid of each block group
    with half of it merged."""
    hw = SIZES[size]
    h, w = -(-hw[0] // 2), -(-hw[1] // 2)
    out, reference = dit_checks.check_half_ratio_merges(dit_checks.toma_patched(pack, chroma), chroma,
                                                        lambda m: sample(m, hw, batch, tokens),
                                                        [f"double {h}x{w}", f"single {h}x{w}"], h * w, bound=0.15)
    assert relative_l2(out, reference) > 1e-3


def test_merging_into_every_token_reproduces_the_unpatched_model(pack, chroma):
    """Window 2 and ratio 0.1 keep every token of a window as a destination: merging only permutes the
    image tokens; with each token's own RoPE row the output matches the unpatched model (pe gather,
    unmerge order, batch rows and CFG batches together; Chroma's per-block modulation slices pass
    through untouched)."""
    patched, runtime = dit_checks.toma_patched(pack, chroma, ratio=0.1, window=2)
    dit_checks.check_merging_only_permutes(patched, chroma, lambda m: sample(m, SIZES["odd"], batch=2, cfg=2.0))
    assert sorted(runtime.summary()["levels"]) == ["double 14x20", "single 14x20"]


def test_attention_scope_merges_only_the_double_blocks_attention(pack, chroma):
    """Scope "attention" on Chroma's double blocks (text first, in-place block updates): with every token
    a destination the output matches the unpatched model; at ratio 0.5 it stays close and differs from
    the whole-block merge."""
    exact, _ = dit_checks.toma_patched(pack, chroma, ratio=0.1, window=2, scope="attention")
    dit_checks.check_merging_only_permutes(exact, chroma, lambda m: sample(m, SIZES["odd"], batch=2, cfg=2.0))
    def run(m):
        return sample(m, SIZES["odd"])

    out, _ = dit_checks.check_half_ratio_merges(dit_checks.toma_patched(pack, chroma, scope="attention"), chroma,
                                                run, ["double 14x20", "single 14x20"], 14 * 20, bound=0.15)
    assert relative_l2(out, run(dit_checks.toma_patched(pack, chroma, scope="block")[0])) > 1e-4


LORA_KEY = "diffusion_model.single_blocks.2.linear2.weight"  # inside a merged block


@pytest.mark.parametrize("order", ["lora-then-toma", "toma-then-lora"])
def test_lora_patches_still_apply(pack, chroma, order):
    dit_checks.check_lora_either_order(pack, chroma, lambda m: sample(m, SIZES["odd"]), LORA_KEY, order)


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
                                                        ["double 13x9", "single 13x9"], 117, bound=0.25)
    assert relative_l2(out, unpatched) > 1e-3
