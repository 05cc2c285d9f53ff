"""ToMA on LTX-Video: a random-weight model built from ComfyUI's own classes, sampled through ComfyUI's
sampler (image-to-video through a noise mask, keyframe guides, every RoPE layout), and the block patch
checked row by row with a spy in place of the block; the checks every DiT family passes are in
tests/test_family_conformance.py.

Latents are tiny: 7x11 (odd and non-square; patch size 1, so as many tokens), 5 latent frames. Text: 128
tokens (the shortest LTX-Video's T5 tokenizer gives).
"""
import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models
from dit_checks import toma_patched
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(),
                                 reason="LTX-Video exists only in current ComfyUI (set COMFYUI_PATH, e.g. to the "
                                        ".comfyui-current made by tests/setup_current.sh)")]

SIZES = {"odd": (7, 11)}  # latent H x W = tokens
CONFIG = models.LTXV_TINY
CHANNELS = CONFIG["in_channels"]


@pytest.fixture(scope="module")
def model(pack):
    """Built once; tests only ever patch clones of it."""
    return models.build_ltxv(seed=1)


def sample(model, frames=5, size="odd", batch=1, tokens=128, steps=2, cfg=1.0, seed=0, first_frame=None,
           guide=None, **extra):
    """comfy.sample.sample on a zero latent. ``first_frame`` (1, C, 1, H, W): image-to-video as
    LTXVImgToVideo sets it up (the first latent frame replaced, a noise mask of 0 over it). ``guide``
    (1, C, 1, H, W): a keyframe guide as LTXVAddGuide appends it (one more latent frame, mask 0, its
    pixel positions in ``keyframe_idxs`` naming video frame 8)."""
    import comfy.sample

    h, w = SIZES[size]
    latent = torch.zeros(batch, CHANNELS, frames, h, w)
    mask = None
    if first_frame is not None:
        latent[:, :, :1] = first_frame
        mask = torch.ones(batch, 1, frames, 1, 1)
        mask[:, :, 0] = 0.0
    if guide is not None:
        from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords
        from comfy_extras.nodes_lt import LTXVAddGuide

        latent = torch.cat([latent, guide.expand(batch, -1, -1, -1, -1)], 2)
        mask = torch.cat([torch.ones(batch, 1, frames, 1, 1) if mask is None else mask,
                          torch.zeros(batch, 1, 1, 1, 1)], 2)
        # the node's own patchifier: ComfyUI v0.33.0's keeps each token's [start, end] (one more dimension)
        coords = latent_to_pixel_coords(LTXVAddGuide.PATCHIFIER.patchify(guide)[1], (8, 32, 32))
        coords[:, 0] += 8
        extra["keyframe_idxs"] = coords
    positive, negative = models.video_conditioning("ltxv", CONFIG, batch, tokens, seed, **extra)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               seed=seed, disable_pbar=True, noise_mask=mask)


def image_latent(size, seed=3):
    """A smooth latent frame (1, C, 1, H, W), the kind an image encodes to."""
    return models.structured_latent(1, *SIZES[size], seed=seed, channels=CHANNELS)[:, :, None]


VARIANTS = {
    "text-to-video": {},
    "image-to-video": {"first_frame": image_latent("odd")},
    "keyframe guide": {"guide": image_latent("odd", seed=4)},
}


@pytest.mark.parametrize("temporal_window", [1, 2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, model, variant, temporal_window):
    """Windows of 2 x 2 tokens (over 1 or 2 frames) at ratio 0.05 keep every token of a window as a
    destination: merging only permutes the video tokens (window-major). Attention does not care about
    order as long as each token keeps its own RoPE row and its own timestep, so the output matches the
    unpatched model: this checks the pe gather, the unmerge order, batch rows and CFG batches, and with
    a noise mask (image-to-video, guides) the per-token modulation rows; a guide's tokens keep their own
    positions after the video."""
    inputs = VARIANTS[variant]
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, temporal_window=temporal_window)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, batch=2, cfg=2.0, **inputs))
    # the noise mask gives per-token timesteps: the first frame then leads unmerged
    frames = 5 if variant == "text-to-video" else 4
    assert list(runtime.summary()["levels"]) == [f"video {frames}x7x11"]


@pytest.mark.parametrize("variant", ["image-to-video", "keyframe guide"])
def test_conditioned_frames_stay_unmerged(pack, model, variant):
    """At ratio 0.5 the first latent frame (per-token timesteps) and the guide frame stay whole: only
    the other frames' grid merges; the output is finite and keeps the conditioning frame."""
    inputs = VARIANTS[variant]
    patched, runtime = toma_patched(pack, model)
    out = sample(patched, **inputs)
    reference = sample(model, **inputs)
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.1
    kept = 0 if variant == "image-to-video" else -1
    assert torch.allclose(out[:, :, kept], reference[:, :, kept])
    assert {k: v["tokens"] for k, v in runtime.summary()["levels"].items()} == {"video 4x7x11": 308}


def spied_block_call(pack, model, layout, batch, vec, pe, text_mask, seed):
    """A spy in place of an LTX-Video block, called through the block patch with random video tokens
    (batch, layout.total, C) and text (batch, 9, C), and the given ``vec``, ``pe`` and text mask: (the
    block's arguments, what the spy saw, the patch's output, the destinations of the plan it built)."""
    lt = pack.nodes.adapters.ltxv
    layouts = pack.nodes.adapters.layout
    C = model.model.diffusion_model.inner_dim
    g = torch.Generator().manual_seed(seed)
    args = {"img": torch.randn(batch, layout.total, C, generator=g), "txt": torch.randn(batch, 9, C, generator=g),
            "attention_mask": text_mask, "vec": vec, "pe": pe,
            "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}}
    _, runtime = toma_patched(pack, model)
    seen = {}
    out = lt.LTXVPatch(runtime).block(dict(args), {"original_block": dit_checks.spy(seen)})
    (plan,) = runtime.report().plans.values()
    return args, seen, out, plan.destination_tokens()


@pytest.mark.parametrize("per_token", [False, True])
def test_merged_block_call_gets_destination_rows(pack, model, per_token):
    """A spy in place of the block sees: each merged video token with the RoPE rows (cos and sin) of its
    destination, the first frame's rows (per-token timesteps) and the guide rows untouched, per-token
    modulation rows gathered the same way (a shared one passed as is), the text and its cross-attention
    mask untouched; the patch returns full-length tokens with the block's update on every token."""
    layouts = pack.nodes.adapters.layout
    frames, h, w, guide, batch = 3, 3, 4, 12, 2
    lead = h * w if per_token else 0
    layout = layouts.ImageLayout(h, w, guide, frames - lead // (h * w), lead)
    N, C = frames * h * w + guide, model.model.diffusion_model.inner_dim
    rows = torch.arange(N, dtype=torch.float32)
    vec = (rows.view(1, N, 1).expand(batch, N, 6 * C) if per_token
           else torch.randn(batch, 1, 6 * C, generator=torch.Generator().manual_seed(5)))
    pe = (rows.view(1, N, 1).expand(batch, N, C), -rows.view(1, N, 1).expand(batch, N, C))
    args, seen, out, destinations = spied_block_call(pack, model, layout, batch, vec, pe,
                                                     torch.zeros(batch, 1, 1, 9), seed=6)
    n_video, n = layout.tokens, destinations.shape[1]
    assert n < n_video and seen["img"].shape[1] == N - (n_video - n)
    assert seen["txt"] is args["txt"] and seen["attention_mask"] is args["attention_mask"]
    for b in range(batch):
        kept = torch.cat([torch.arange(lead), lead + destinations[b], torch.arange(lead + n_video, N)]).float()
        assert torch.equal(seen["pe"][0][b, :, 0], kept) and torch.equal(seen["pe"][1][b, :, 0], -kept)
        if per_token:
            assert torch.equal(seen["vec"][b, :, 0], kept)
    if not per_token:
        assert seen["vec"] is vec
    # a +1 update on merged tokens is +1 on every video token; the rest get +1 as is
    dit_checks.check_update_on_every_token(out["img"], args["img"])


@pytest.mark.parametrize("node", ["ToMeSDPatchModel", "CAToMePatchModel"])
def test_unet_baselines_leave_ltxv_unpatched(pack, model, node, caplog):
    dit_checks.check_unet_baseline_leaves_unpatched(pack, model, node, caplog)


def test_a_model_without_the_latent_wrapper_comes_back_unpatched(pack, caplog):
    """An LTX-Video whose forward runs no DIFFUSION_MODEL executor (older ComfyUI) gives the blocks no
    video grid: the node returns it unpatched and says why."""
    bare = models.build_ltxv(seed=8)
    bare.model.diffusion_model._forward = None
    dit_checks.check_comes_back_unpatched(pack, bare, caplog, "no model wrapper")


def test_real_latent_with_tiny_width(pack):
    """LTX-Video's own example size, 97 frames of 768x512 (a 13 x 16 x 24 latent, as many tokens), one
    step, tiny widths: half of the grid merges, windows padded at the last frame."""
    import comfy.sample

    config = dict(CONFIG, cross_attention_dim=32, attention_head_dim=16, num_attention_heads=2, num_layers=1)
    small = models.build_ltxv(seed=9, config=config)
    patched, runtime = toma_patched(pack, small)
    positive, negative = models.video_conditioning("ltxv", config, 1, 128, 0)
    noise = torch.randn(1, CHANNELS, 13, 16, 24, generator=torch.Generator().manual_seed(0))
    out = comfy.sample.sample(patched, noise, 1, 1.0, "euler", "simple", positive, negative, torch.zeros(noise.shape),
                              seed=0, disable_pbar=True)
    assert out.shape == noise.shape and torch.isfinite(out).all()
    (stats,) = runtime.summary()["levels"].values()
    assert list(runtime.summary()["levels"]) == ["video 13x16x24"]
    assert stats["tokens"] == 4992 and abs(stats["merged_tokens"] - 2496) <= 100


@pytest.mark.parametrize("rope", ["cos-sin", "table", "cos-sin-split", "cos-sin-unsplit"])
def test_every_rope_layout_gets_destination_rows(pack, model, rope):
    """LTX-Video's pe has been (cos, sin), each (B, N, D) (until Oct 2025); one (B, 1, N, D/2, 2, 2) table
    as Flux's (Nov 2025: it used to leave every block unmerged, silently); (cos, sin, split) (2026), with
    per-head (B, heads, N, D/2) tables when split (it used to crash the patch: a bool has no shape).
    Merged tokens get their destinations' rows along the right axis; the flag passes as it is."""
    layouts = pack.nodes.adapters.layout
    frames, h, w, batch, heads = 2, 3, 4, 2, 4
    layout = layouts.ImageLayout(h, w, frames=frames)
    N, C = frames * h * w, model.model.diffusion_model.inner_dim
    rows = torch.arange(N, dtype=torch.float32)
    per_head = rows.view(1, 1, N, 1).expand(batch, heads, N, 8)
    pe, axis = {"cos-sin": ((rows.view(1, N, 1).expand(batch, N, C), -rows.view(1, N, 1).expand(batch, N, C)), 1),
                "table": (rows.view(1, 1, N, 1, 1, 1).expand(batch, 1, N, 8, 2, 2), 2),
                "cos-sin-split": ((per_head, -per_head, True), 2),
                "cos-sin-unsplit": ((rows.view(1, N, 1).expand(batch, N, C), -rows.view(1, N, 1).expand(batch, N, C),
                                     False), 1)}[rope]
    vec = torch.randn(batch, 1, 6 * C, generator=torch.Generator().manual_seed(8))
    args, seen, out, destinations = spied_block_call(pack, model, layout, batch, vec, pe, None, seed=7)
    assert seen["img"].shape[1] == destinations.shape[1] < N
    tables = [seen["pe"]] if torch.is_tensor(pe) else [t for t in seen["pe"] if torch.is_tensor(t)]
    if not torch.is_tensor(pe):
        assert seen["pe"][2:] == pe[2:]
    for b in range(batch):
        first_rows = tables[0][b].movedim(axis - 1, 0).flatten(1)[:, 0]
        assert torch.equal(first_rows, destinations[b].float())
    dit_checks.check_update_on_every_token(out["img"], args["img"])


def test_a_block_given_a_video_audio_pair_runs_unmerged(pack, model):
    """LTX-2's blocks get img = (video, audio): a patch that finds one there hands the call on as it is."""
    lt = pack.nodes.adapters.ltxv
    layouts = pack.nodes.adapters.layout
    pair = (torch.zeros(1, 12, 8), torch.zeros(1, 5, 8))
    args = {"img": pair, "transformer_options": {"sigmas": torch.tensor([1.0]),
                                                  layouts.LAYOUT_KEY: layouts.ImageLayout(3, 4, frames=1)}}
    _, runtime = toma_patched(pack, model)
    out = lt.LTXVPatch(runtime).block(args, {"original_block": lambda a: {"img": a["img"]}})
    assert out["img"] is pair and not runtime.report().plans

