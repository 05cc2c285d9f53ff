"""ToMA on HunyuanVideo: a random-weight model built from ComfyUI's own classes, sampled through ComfyUI's
sampler (image-to-video v2 with its first-frame modulation, a "custom" reference latent, a text mask,
the attention placement), and the block patch checked row by row with a spy in place of the block; the
checks every DiT family passes are in tests/test_family_conformance.py.

Latents are tiny: 14x22 (7x11 tokens: odd and non-square), 5 latent frames.
"""
import logging
import types

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models
from dit_checks import toma_patched
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(),
                                 reason="HunyuanVideo exists only in current ComfyUI (set COMFYUI_PATH, e.g. to "
                                        "the .comfyui-current made by tests/setup_current.sh)")]

SIZES = {"odd": (14, 22)}  # latent H x W; tokens ceil(H/2) x ceil(W/2)
CONFIG = models.HUNYUAN_VIDEO_TINY


@pytest.fixture(scope="module")
def model(pack):
    """Built once; tests only ever patch clones of it."""
    return models.build_hunyuan_video(seed=1)


def sample(model, frames=5, size="odd", batch=1, tokens=77, steps=2, cfg=1.0, seed=0, first_frame=None,
           text_mask=None, **extra):
    """comfy.sample.sample on a zero latent, or with ``first_frame`` (B, 16, 1, H, W) as the first latent
    frame kept by a noise mask (image-to-video v2 with ``guiding_frame_index=0``)."""
    import comfy.sample

    positive, negative = models.video_conditioning("hunyuan_video", CONFIG, batch, tokens, seed, text_mask, **extra)
    latent = torch.zeros(batch, 16, frames, *SIZES[size])
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    mask = None
    if first_frame is not None:
        latent[:, :, :1] = first_frame
        mask = torch.ones(1, 1, frames, *SIZES[size])
        mask[:, :, 0] = 0.0
    return comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               seed=seed, disable_pbar=True, noise_mask=mask)


def image_latent(size, seed=3):
    """A smooth first frame (1, 16, 1, H, W), the kind an image encodes to."""
    return models.structured_latent(1, *SIZES[size], seed=seed, channels=16)[:, :, None]


# variant -> sampling inputs. The image-to-video modes run one row without CFG, as their workflows do:
# ComfyUI's HunyuanVideo serves them for one row per model call only (v2 adds the guidance embedding and
# its per-range modulation for one row, a reference latent's positions are written into a broadcast view).
VARIANTS = {
    "text-to-video": {"batch": 2, "cfg": 2.0},
    "image-to-video v2": {"first_frame": image_latent("odd"), "guiding_frame_index": 0},
    "reference latent": {"ref_latent": image_latent("odd", seed=4)},
}


@pytest.mark.parametrize("temporal_window", [1, 2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, model, variant, temporal_window):
    """Windows of 2 x 2 tokens (over 1 or 2 frames) at ratio 0.05 keep every token of a window as a
    destination: merging only permutes the video tokens (window-major). Attention does not care about
    order as long as each token keeps its own RoPE row and its own modulation, so the output matches the
    unpatched model: this checks the pe gather, the unmerge order, batch rows and CFG batches, and for
    image-to-video v2 that the first frame's tokens still get their own modulation vector (they lead the
    merged sequence unmerged and the modulation ranges are moved onto it), for a reference latent that
    its tokens keep their rows."""
    inputs = VARIANTS[variant]
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, temporal_window=temporal_window)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, **inputs))
    frames = 4 if "first_frame" in inputs else 5  # image-to-video v2: the first frame leads unmerged
    assert sorted(runtime.summary()["levels"]) == [f"joint {frames}x7x11", f"two-stream {frames}x7x11"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_block_scope_merging_into_every_token_reproduces_the_unpatched_model(pack, model, variant):
    """Scope "block" with every token a destination: the merged blocks see their video tokens permuted,
    each with its own RoPE row, mask column and modulation, wherever this ComfyUI puts the text in the
    joint sequence (read from the model: test_the_joint_order_is_the_patched_models_own), so the output is
    the unpatched model's."""
    inputs = VARIANTS[variant]
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, temporal_window=1, scope="block")
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, **inputs))
    frames = 4 if "first_frame" in inputs else 5
    assert sorted(runtime.summary()["levels"]) == [f"joint {frames}x7x11", f"two-stream {frames}x7x11"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_attention_scope_merging_into_every_token_reproduces_the_unpatched_model(pack, model, variant):
    """Scope "attention": the double blocks run at full length and only their joint attention ([lead,
    video, txt] or [txt, lead, video]: the model's order) merges the video rows; with every token a destination that only
    permutes, so the output matches the unpatched model, lead tokens and modulation ranges included; a
    text mask (one key row) is cut to the merged sequence."""
    inputs = VARIANTS[variant]
    mask = torch.ones(1, 77, dtype=torch.long)
    mask[:, 47:] = 0
    if variant == "text-to-video":
        inputs = {"text_mask": mask}  # ComfyUI's HunyuanVideo takes a text mask for batch 1
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, scope="attention")
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, **inputs))
    frames = 4 if "first_frame" in inputs else 5
    assert sorted(runtime.summary()["levels"]) == [f"joint {frames}x7x11", f"two-stream {frames}x7x11"]


def test_attention_scope_half_ratio_keeps_the_first_frame(pack, model):
    """Image-to-video v2, scope "attention", ratio 0.5: close to the unpatched output, the input frame kept,
    and not the whole-block result."""
    first = image_latent("odd")
    patched, _ = toma_patched(pack, model, scope="attention")
    out = sample(patched, first_frame=first, guiding_frame_index=0)
    reference = sample(model, first_frame=first, guiding_frame_index=0)
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.1
    assert torch.allclose(out[:, :, 0], reference[:, :, 0])
    block, _ = toma_patched(pack, model, scope="block")
    assert relative_l2(out, sample(block, first_frame=first, guiding_frame_index=0)) > 1e-4


def test_image_to_video_keeps_the_first_frame_unmerged(pack, model):
    """Image-to-video v2 at ratio 0.5: only the 4 generated latent frames merge, the first (the input
    image, with its own modulation) stays whole; the output is finite and keeps the input frame."""
    first = image_latent("odd")
    patched, runtime = toma_patched(pack, model)
    out = sample(patched, first_frame=first, guiding_frame_index=0)
    reference = sample(model, first_frame=first, guiding_frame_index=0)
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.1
    assert torch.allclose(out[:, :, 0], reference[:, :, 0])
    levels = runtime.summary()["levels"]
    assert {k: v["tokens"] for k, v in levels.items()} == {"two-stream 4x7x11": 308, "joint 4x7x11": 308}


def test_merge_map_draws_the_first_frame_of_the_video_grid(pack, model):
    """Plans are recorded on the video grid (frames, h, w); the merge map draws its first latent frame
    over the latent's h x w, for both block groups."""
    patched, runtime = toma_patched(pack, model)
    samples = sample(patched)
    mm = pack.nodes.merge_map
    levels = runtime.report().levels
    assert [level.label for level in mm.merged_levels(levels)] == ["two-stream 5x7x11", "joint 5x7x11"]
    for level, name in enumerate(mm.merged_levels(levels)):
        record = levels[name].records[-1]
        assert (record.frames, record.h, record.w) == (5, 7, 11) and record.groups.numel() == 385
        image, = mm.ToMAMergeMap().draw(patched, {"samples": samples}, level, -1)
        assert image.shape == (1, 8 * 14, 8 * 22, 3) and torch.isfinite(image).all()


def test_text_mask_columns_follow_the_merged_sequence(pack, model):
    """A text mask (the last 30 of 77 text tokens masked, batch 1 as ComfyUI's HunyuanVideo takes it)
    reaches the blocks as one key row (1, 1, L) over [video, text]: cut to the merged sequence, the run
    that merges into every token (windows of 2 frames x 2 x 2, ratio 0.05) still matches the unpatched
    model, and ratio 0.5 runs."""
    mask = torch.ones(1, 77, dtype=torch.long)
    mask[:, 47:] = 0
    exact, _ = toma_patched(pack, model, ratio=0.05, window=2)
    dit_checks.check_merging_only_permutes(exact, model, lambda m: sample(m, text_mask=mask))
    assert not torch.equal(sample(model, text_mask=mask), sample(model))  # the mask matters
    half, _ = toma_patched(pack, model)
    assert torch.isfinite(sample(half, text_mask=mask)).all()


def _block_call(pack, model, frames, h, w, txt_len, lead_frames, batch=2, video_first=True):
    """Inputs of one HunyuanVideo block call built the way HunyuanVideo builds them: pe from
    (frame, row, col) ids of the video and zeros for the text, in the joint order (``video_first``:
    [video, txt], else [txt, video]), a text mask as one key row, and image-to-video v2 modulation ranges
    when the first ``lead_frames`` frame leads unmerged."""
    layouts = pack.nodes.adapters.layout
    dm = model.model.diffusion_model
    g = torch.Generator().manual_seed(6)
    t, r, c = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    video_ids, txt_ids = torch.stack([t, r, c], -1).view(-1, 3).float(), torch.zeros(txt_len, 3)
    ids = torch.cat([video_ids, txt_ids] if video_first else [txt_ids, video_ids])
    n_img, C = frames * h * w, dm.hidden_size
    L = n_img + txt_len
    lead = lead_frames * h * w
    layout = layouts.ImageLayout(h, w, frames=frames - lead_frames, lead=lead)
    args = {"img": torch.randn(batch, n_img, C, generator=g), "txt": torch.randn(batch, txt_len, C, generator=g),
            "vec": torch.randn(batch, 2, C, generator=g), "pe": dm.pe_embedder(ids[None].expand(batch, -1, -1)),
            "attention_mask": torch.arange(L, dtype=torch.float32).view(1, 1, L),
            "modulation_dims_img": [(0, h * w, 0), (h * w, None, 1)],
            "modulation_dims_txt": [(0, None, 1)],
            "transformer_options": {"sigmas": torch.tensor([1.0]), layouts.LAYOUT_KEY: layout}}
    return args, lambda rows: dm.pe_embedder(ids[rows][None])[0, 0]


def test_the_joint_order_is_the_patched_models_own(pack, model):
    """ComfyUI v0.3.x builds HunyuanVideo's double blocks with ``flipped_img_txt`` (joint sequences
    [video, txt]); from v0.33.0 they have no such flag and the text comes first, as in Flux. The patch
    reads the order from the model it patches, never from the ComfyUI version."""
    hv = pack.nodes.adapters.hunyuan_video
    dm = model.model.diffusion_model
    flipped = [getattr(block, "flipped_img_txt", None) for block in dm.double_blocks]
    assert hv.video_first(dm) == (flipped[0] is True) and len(set(flipped)) == 1
    _, runtime = toma_patched(pack, model)
    patch = hv.HunyuanVideoPatch(runtime)
    patch.read_model(dm)
    assert patch.image_first == hv.video_first(dm)


@pytest.mark.parametrize("video_first", [True, False], ids=["video-first", "text-first"])
@pytest.mark.parametrize("block", ["double", "single"])
def test_merged_block_call_gets_destination_rows_and_moved_ranges(pack, model, block, video_first):
    """A spy in place of the block sees, in either joint order (the patch told it by ``read_model``):
    the first frame's rows (image-to-video v2) untouched and in front of the video, each merged video token
    with the RoPE of its destination's (frame, row, col), text rows untouched, the mask's key columns cut to
    the same rows, modulation ranges moved onto the merged sequence; the patch returns full-length tokens
    with the block's update unmerged onto every token."""
    hv = pack.nodes.adapters.hunyuan_video
    frames, h, w, txt_len = 3, 3, 4, 5
    args, rope_of = _block_call(pack, model, frames, h, w, txt_len, lead_frames=1, video_first=video_first)
    lead, n_video = h * w, (frames - 1) * h * w
    start = 0 if video_first else txt_len  # where the image tokens start in the joint sequence
    # ranges after the video move back: use one that ends at the video's end and one over the text; a double
    # block's ranges cover its image stream, a single block's the joint sequence
    key = "modulation_dims_img" if block == "double" else "modulation_dims"
    at = 0 if block == "double" else start
    args[key] = [(0, at + lead, 0), (at + lead, at + lead + n_video, 1), (at + lead + n_video, None, 1)]
    _, runtime = toma_patched(pack, model)
    patch, seen = hv.HunyuanVideoPatch(runtime), {}
    patch.read_model(types.SimpleNamespace(double_blocks=[types.SimpleNamespace(flipped_img_txt=True)] if video_first
                                           else [types.SimpleNamespace()]))
    spy = dit_checks.spy(seen, passes=("txt",) if block == "double" else ())
    if block == "double":
        out = patch.double_block(dict(args), {"original_block": spy})
        image_in = args["img"]
    else:
        joint = torch.cat([args["img"], args["txt"]] if video_first else [args["txt"], args["img"]], 1)
        single = {k: v for k, v in args.items() if k not in ("txt", "modulation_dims_img", "modulation_dims_txt")}
        out = patch.single_block({**single, "img": joint}, {"original_block": spy})
        image_in = joint
    (plan,) = runtime.report().plans.values()
    destinations = plan.destination_tokens()
    n = destinations.shape[1]
    assert n < n_video and seen["img"].shape[1] == image_in.shape[1] - (n_video - n)
    assert seen[key] == [(0, at + lead, 0), (at + lead, at + lead + n, 1), (at + lead + n, None, 1)]
    pe, L = seen["pe"], lead + n_video + txt_len
    video = start + lead  # the video's first row in the joint sequence
    for b in range(2):
        video_rows = video + destinations[b]
        assert torch.equal(pe[b, 0, :video], rope_of(torch.arange(video)))
        assert torch.allclose(pe[b, 0, video:video + n], rope_of(video_rows))
        assert torch.equal(pe[b, 0, video + n:], rope_of(torch.arange(video + n_video, L)))
        kept = torch.cat([torch.arange(video), video_rows, torch.arange(video + n_video, L)])
        assert torch.equal(seen["attention_mask"][b, 0], kept.float())
    # a +1 update on merged tokens is +1 on every video token; the rest get +1 as is
    dit_checks.check_update_on_every_token(out["img"], image_in)


def test_a_modulation_range_inside_the_video_leaves_the_block_unmerged(pack, model, caplog):
    hv = pack.nodes.adapters.hunyuan_video
    args, _ = _block_call(pack, model, 3, 3, 4, 5, lead_frames=1)
    args["modulation_dims_img"] = [(0, 20, 0), (20, None, 1)]  # 20: inside the video after 12 lead tokens
    _, runtime = toma_patched(pack, model)
    seen = {}
    with caplog.at_level(logging.WARNING, logger=dit_checks.LOGGER):
        hv.HunyuanVideoPatch(runtime).double_block(dict(args), {"original_block": dit_checks.spy(seen, None, ("txt",))})
    assert seen["img"] is args["img"] and not runtime.report().plans
    assert "split the video grid" in caplog.text


def test_hunyuan_image_latents_merge_as_an_image(pack):
    """HunyuanImage 2.1 is the same class on image latents (B, C, H, W) with a 2-D patch: the grid is
    h x w, and merging into every token (window 2, ratio 0.05) matches the unpatched model."""
    import comfy.sample

    config = dict(CONFIG, patch_size=[1, 1], axes_dim=[8, 8], vec_in_dim=None, guidance_embed=False)
    image_model = models.build_hunyuan_video(seed=7, config=config, image=True)
    positive, negative = models.video_conditioning("hunyuan_video", config, 1, 77, 0)
    noise = torch.randn(1, 16, 7, 9, generator=torch.Generator().manual_seed(0))

    def run(m):
        return comfy.sample.sample(m, noise, 2, 1.0, "euler", "simple", positive, negative, torch.zeros(1, 16, 7, 9),
                                   seed=0, disable_pbar=True)

    patched, runtime = toma_patched(pack, image_model, ratio=0.05, window=2)
    dit_checks.check_merging_only_permutes(patched, image_model, run)
    assert sorted(runtime.summary()["levels"]) == ["joint 7x9", "two-stream 7x9"]


@pytest.mark.parametrize("node", ["ToMeSDPatchModel", "CAToMePatchModel"])
def test_unet_baselines_leave_hunyuan_video_unpatched(pack, model, node, caplog):
    dit_checks.check_unet_baseline_leaves_unpatched(pack, model, node, caplog)


def test_a_model_without_the_latent_wrapper_comes_back_unpatched(pack, caplog):
    """A HunyuanVideo whose forward runs no DIFFUSION_MODEL executor (older ComfyUI) gives the blocks no
    video grid: the node returns it unpatched and says why."""
    bare = models.build_hunyuan_video(seed=8)
    bare.model.diffusion_model._forward = None
    dit_checks.check_comes_back_unpatched(pack, bare, caplog, "no model wrapper")


def test_real_latent_with_tiny_width(pack):
    """A real latent size, 17 frames of 512x320 (5 x 40 x 64 latent -> 5 x 20 x 32 tokens), one step,
    tiny widths: every block group merges half of the grid, windows padded at the grid's edges."""
    import comfy.sample

    config = dict(CONFIG, hidden_size=32, num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[4, 6, 6])
    small = models.build_hunyuan_video(seed=9, config=config)
    patched, runtime = toma_patched(pack, small)
    positive, negative = models.video_conditioning("hunyuan_video", config, 1, 77, 0)
    noise = torch.randn(1, 16, 5, 40, 64, generator=torch.Generator().manual_seed(0))
    out = comfy.sample.sample(patched, noise, 1, 1.0, "euler", "simple", positive, negative, torch.zeros(noise.shape),
                              seed=0, disable_pbar=True)
    assert out.shape == noise.shape and torch.isfinite(out).all()
    levels = runtime.summary()["levels"]
    assert sorted(levels) == ["joint 5x20x32", "two-stream 5x20x32"]
    assert all(v["tokens"] == 3200 and abs(v["merged_tokens"] - 1600) <= 100 for v in levels.values())
