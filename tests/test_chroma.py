"""ToMA on Chroma and Chroma Radiance: random-weight models built from ComfyUI's own classes (2 double and
3 single blocks, width 64) sampled through ComfyUI's sampler.

Chroma latents are Flux latents (B, 16, H, W) at 1/4 of the real sizes (1024x1024 -> 32x32, 832x1216 ->
26x38, and an odd 27x39 whose 14x20 token grid no window of 4 divides); Chroma Radiance samples pixels,
16x16 per token.
"""
import copy

import pytest
import torch

import comfy_host
from toma_bench import models

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


def toma_patched(pack, model, ratio=0.5, window=4, reuse=5):
    """(model patched by the ToMA node, its runtime)."""
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(model, ratio, window, reuse)
    return patched, pack.nodes.plan_records.runtime_of(patched)


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def test_node_patches_a_clone_and_leaves_the_input_alone(pack, chroma):
    before_options, before_wrappers = copy.deepcopy(chroma.model_options), copy.copy(chroma.wrappers)
    before = sample(chroma, SIZES["odd"])
    patched, _ = toma_patched(pack, chroma)
    assert patched is not chroma
    dit_patches = patched.model_options["transformer_options"]["patches_replace"]["dit"]
    # Flux's fractions: the first of 2 double blocks (2 * 5/19 rounds to 1) and none of 3 single blocks skip
    assert set(dit_patches) == {("double_block", 1), ("single_block", 0), ("single_block", 1), ("single_block", 2)}
    assert patched.get_wrappers("diffusion_model", "comfyui_toma")
    assert not chroma.get_wrappers("diffusion_model", "comfyui_toma")
    sample(patched, SIZES["odd"])
    assert chroma.model_options == before_options and chroma.wrappers == before_wrappers
    assert torch.equal(sample(chroma, SIZES["odd"]), before)


def test_ratio_zero_is_identical_to_unpatched(pack, chroma):
    nodes = pack.nodes.toma_nodes
    reference = sample(chroma, SIZES["odd"], batch=2)
    for node in (nodes.ToMAPatchModel().patch(chroma, 0.0, 4, 5)[0],
                 nodes.ToMAPatchModelAdvanced().patch(chroma, 0.0, 4, 5, scope="block", levels="all")[0]):
        assert torch.equal(sample(node, SIZES["odd"], batch=2), reference)


# every pair of (size, batch size, text length) values occurs once: 6 runs instead of the 12 of a full grid
PAIRWISE = [("1024x1024", 1, 77), ("1024x1024", 2, 512), ("832x1216", 1, 512), ("832x1216", 2, 77),
            ("odd", 1, 77), ("odd", 2, 512)]


@pytest.mark.parametrize("size,batch,tokens", PAIRWISE)
def test_half_ratio_merges_both_block_groups(pack, chroma, size, batch, tokens):
    """Ratio 0.5 changes the output but stays within 15% of the unpatched one (measured: 6.7-6.8%; all
    5 blocks but the first double block merge), and the stats report the token grid of each block group
    with half of it merged."""
    hw = SIZES[size]
    patched, runtime = toma_patched(pack, chroma)
    out = sample(patched, hw, batch, tokens)
    reference = sample(chroma, hw, batch, tokens)
    assert out.shape == reference.shape and torch.isfinite(out).all()
    assert 1e-3 < relative_error(out, reference) < 0.15
    h, w = -(-hw[0] // 2), -(-hw[1] // 2)
    levels = runtime.summary()["levels"]
    assert sorted(levels) == [f"double {h}x{w}", f"single {h}x{w}"]
    for stats in levels.values():
        assert stats["tokens"] == h * w and stats["steps"] == 2
        assert abs(stats["merged_tokens"] - h * w / 2) <= h * w / 16


def test_merging_into_every_token_reproduces_the_unpatched_model(pack, chroma):
    """Window 2 and ratio 0.1 keep every token of a window as a destination: merging only permutes the
    image tokens; with each token's own RoPE row the output matches the unpatched model (pe gather,
    unmerge order, batch rows and CFG batches together; Chroma's per-block modulation slices pass
    through untouched)."""
    patched, runtime = toma_patched(pack, chroma, ratio=0.1, window=2)
    out = sample(patched, SIZES["odd"], batch=2, cfg=2.0)
    assert relative_error(out, sample(chroma, SIZES["odd"], batch=2, cfg=2.0)) < 1e-5
    assert sorted(runtime.summary()["levels"]) == ["double 14x20", "single 14x20"]


LORA_KEY = "diffusion_model.single_blocks.2.linear2.weight"  # inside a merged block


def lora(model):
    """A clone with a LoRA-like diff on one weight of a merged block, as LoraLoader makes. The diff's
    scale (half the init bound 1/sqrt(fan_in)) comes from the weight's shape, never its values: a weight
    patch stays applied to the shared model after sampling."""
    shape = model.model.state_dict()[LORA_KEY].shape
    diff = 0.5 * shape[1] ** -0.5 * torch.rand(shape, generator=torch.Generator().manual_seed(7))
    clone = model.clone()
    assert set(clone.add_patches({LORA_KEY: (diff,)})) == {LORA_KEY}
    return clone


@pytest.mark.parametrize("order", ["lora-then-toma", "toma-then-lora"])
def test_lora_patches_still_apply(pack, chroma, order):
    """With every token a destination, a LoRA'd model gives the unpatched LoRA'd output, whichever node
    comes first, and not the output without the LoRA."""
    with_lora = sample(lora(chroma), SIZES["odd"])
    assert relative_error(with_lora, sample(chroma, SIZES["odd"])) > 1e-3
    if order == "lora-then-toma":
        stacked, runtime = toma_patched(pack, lora(chroma), ratio=0.1, window=2)
    else:
        exact, runtime = toma_patched(pack, chroma, ratio=0.1, window=2)
        stacked = lora(exact)
    assert relative_error(sample(stacked, SIZES["odd"]), with_lora) < 1e-5
    assert runtime.summary()["levels"]


@pytest.fixture(scope="module")
def radiance(pack):
    return models.build_chroma(seed=22, config=models.CHROMA_RADIANCE_TINY)


def test_radiance_merges_its_16_pixel_patch_grid(pack, radiance):
    """Chroma Radiance on a 200x136-pixel image (13x9 tokens of 16x16 pixels, padded): every token a
    destination reproduces the unpatched model; ratio 0.5 merges half of the grid and stays within 25%
    of the unpatched output (measured: 10%)."""
    hw = (200, 136)
    unpatched = sample(radiance, hw, batch=2, cfg=2.0, channels=3)
    exact, _ = toma_patched(pack, radiance, ratio=0.1, window=2)
    assert relative_error(sample(exact, hw, batch=2, cfg=2.0, channels=3), unpatched) < 1e-5
    half_patched, half = toma_patched(pack, radiance)
    out = sample(half_patched, hw, batch=2, cfg=2.0, channels=3)
    assert out.shape == unpatched.shape and torch.isfinite(out).all()
    assert 1e-3 < relative_error(out, unpatched) < 0.25
    levels = half.summary()["levels"]
    assert sorted(levels) == ["double 13x9", "single 13x9"]
    assert all(v["tokens"] == 117 and abs(v["merged_tokens"] - 58.5) <= 117 / 16 for v in levels.values())
