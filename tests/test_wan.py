"""ToMA on Wan 2.1/2.2: random-weight WanModels of every variant (ComfyUI's own classes, tiny widths)
sampled through ComfyUI's sampler: what every variant adds; the checks every DiT family passes are in
tests/test_family_conformance.py.

Latents are small video grids: 5 frames of 12x16 (6x8 tokens a frame); the real 480p aspect (60x104)
runs once with one step.
"""
import functools
import logging
import types

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(),
                                 reason="Wan exists only in current ComfyUI (set COMFYUI_PATH, e.g. to the "
                                        ".comfyui-current made by tests/setup_current.sh)")]

SIZES = {"square": (12, 16)}  # latent H x W; tokens ceil(H/2) x ceil(W/2)
SERVED = ("t2v", "i2v", "ti2v", "reference", "vace", "camera", "animate")
CLIP_TOKENS = 257  # CLIP-H penultimate tokens of an I2V image, prepended to the text in cross-attention


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread while this module runs: on tensors this small OpenMP's fork and join cost
    more than they save, and on a shared CPU many times more (5x here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def built(pack):
    """{variant: ModelPatcher}, built once; tests only ever patch clones of them."""
    return {variant: models.build_wan(variant, seed=i + 1) for i, variant in enumerate(SERVED)}


def channels(variant):
    return 48 if variant == "ti2v" else 16


def variant_inputs(variant, batch, frames, hw, seed):
    """(conditioning options, noise mask) that exercise what ``variant`` adds to a plain T2V call."""
    g = torch.Generator().manual_seed(100 + seed)

    def latent(c, t):
        return torch.randn(batch, c, t, *hw, generator=g)

    if variant == "i2v":
        clip = types.SimpleNamespace(penultimate_hidden_states=torch.randn(batch, CLIP_TOKENS, 1280, generator=g))
        return {"clip_vision_output": clip, "concat_latent_image": latent(16, frames)}, None
    if variant == "ti2v":  # the first frame is the given image: its timestep is 0, the others' t
        mask = torch.ones(batch, 1, frames, *hw)
        mask[:, :, 0] = 0.0
        return {}, mask
    if variant == "reference":
        return {"reference_latents": [latent(16, 1)]}, None
    if variant == "phantom":  # subject images as extra latent frames after the video (time_dim_concat)
        return {"time_dim_concat": latent(16, 2)}, None
    if variant == "camera":
        return {"camera_conditions": torch.randn(batch, 24, frames, hw[0] * 8, hw[1] * 8, generator=g)}, None
    if variant == "animate" and frames > 1:
        return {"pose_video_latent": latent(16, frames - 1)}, None
    return {}, None


def sample(model, variant="t2v", frames=5, hw=SIZES["square"], batch=1, tokens=77, steps=2, cfg=1.0, seed=0,
           config=None):
    """A zero latent of ``frames`` x ``hw`` sampled with ``variant``'s inputs (variant_inputs)."""
    options, mask = variant_inputs(variant, batch, frames, hw, seed)
    conditioning = models.wan_conditioning(config or models.WAN_TINY, batch, tokens, seed, **options)
    return sampling.sample(model, conditioning, torch.zeros(batch, channels(variant), frames, *hw), steps=steps,
                           cfg=cfg, scheduler="simple", seed=seed, noise_mask=mask)


# (model patched by the advanced ToMA node, its runtime)
toma_patched = functools.partial(dit_checks.toma_patched, temporal_window=2, weights_interval=1)


def token_grid(frames, hw, variant="t2v"):
    """The grid that merges: TI2V under per-frame timesteps keeps its first (input image) frame whole."""
    return frames - (variant == "ti2v"), -(-hw[0] // 2), -(-hw[1] // 2)


def model_of(built, variant):
    """Phantom is a T2V model given subject frames."""
    return built["t2v" if variant == "phantom" else variant]


@pytest.mark.parametrize("depth,first", [(30, 4), (40, 5), (4, 1)])
def test_first_blocks_skipped_scale_with_depth(pack, depth, first):
    """Wan 2.1 1.3B and 2.2 5B (30 blocks) skip 4, the 14B models (40 blocks) 5."""
    (group,) = pack.nodes.adapters.families.WAN.groups
    assert group.merged(depth) == range(first, depth)


@pytest.mark.parametrize("temporal_window", [1, 2])
@pytest.mark.parametrize("variant", SERVED + ("phantom",))
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, built, variant, temporal_window):
    """Window 2 and ratio 0.05 keep every token of a window (up to 2x2x2 = 8) as a destination: merging
    only permutes the video tokens (window-major, in selection order, across frames when windows span 2).
    Attention does not care about order as long as each token keeps its own RoPE row and, on TI2V, its
    own frame's modulation, so the output matches the unpatched model: this checks the pe and e0
    gathers, the unmerge order, the reference tokens of Fun models, Phantom's subject frames, the CLIP
    context of I2V, batch rows and CFG batches together."""
    model = model_of(built, variant)
    frames = 5 if variant != "ti2v" else 4
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, temporal_window=temporal_window)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(m, variant, frames=frames, batch=2, cfg=2.0))
    levels = runtime.summary()["levels"]
    t, h, w = token_grid(frames, SIZES["square"], variant)
    assert levels == {f"video {t}x{h}x{w}": {"tokens": t * h * w, "merged_tokens": t * h * w, "steps": 2,
                                             "group": "video", "grid": [t, h, w]}}


@pytest.mark.parametrize("variant", ["i2v", "ti2v", "reference", "phantom", "vace", "camera", "animate"])
def test_half_ratio_serves_every_variant(pack, built, variant):
    """At ratio 0.5 each variant samples, changes, and counts only its video grid (never the reference
    tokens of Fun models, Phantom's subject frames, TI2V's input frame, nor the CLIP tokens of I2V)."""
    model = model_of(built, variant)
    patched, runtime = toma_patched(pack, model)
    out = sample(patched, variant, hw=SIZES["square"])
    reference = sample(model, variant, hw=SIZES["square"])
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.1  # measured 0.015-0.036
    t, h, w = token_grid(5, SIZES["square"], variant)
    assert {k: v["tokens"] for k, v in runtime.summary()["levels"].items()} == {f"video {t}x{h}x{w}": t * h * w}


@pytest.mark.parametrize("per_frame_timesteps", [False, True])
@pytest.mark.parametrize("reference,subject_frames", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_layout_of_a_call(pack, built, reference, subject_frames, per_frame_timesteps):
    """What the wrapper reads from a call of _forward: a reference latent (Fun models) leads the grid, and
    so does the first frame under per-frame timesteps; subject frames (Phantom) follow it."""
    dm = built["reference"].model.diffusion_model
    stash = pack.nodes.adapters.wan.VideoLayoutStash(dm._forward, dm.patch_size)
    x = torch.zeros(2, 16, 5, 13, 19)  # 5 frames of 7 x 10 tokens
    call = {"x": x, "timestep": torch.ones(2, 5) if per_frame_timesteps else torch.ones(2),
            "time_dim_concat": torch.zeros(2, 16, subject_frames, 13, 19) if subject_frames else None,
            "kwargs": {"reference_latent": torch.zeros(2, 16, 13, 19)} if reference else {}}
    layout = stash.layout(call)
    lead = 6 * 9 * reference + 70 * per_frame_timesteps  # ref_conv: a stride-2 conv without padding
    assert (layout.lead, layout.grid, layout.extra) == (lead, (5 - per_frame_timesteps, 7, 10), 70 * subject_frames)
    plain = pack.nodes.adapters.wan.VideoLayoutStash(built["t2v"].model.diffusion_model._forward, (1, 2, 2))
    assert plain.layout(call).lead == 70 * per_frame_timesteps  # no ref_conv: a reference latent is not used


def _wan_call(pack, model, layout, batch=2, per_frame_modulation=True):
    """Inputs of one Wan block call built the way WanModel builds them: pe from rope_encode over the
    lead frame (t = 0), the video frames and the extra frames, e0 with one row per frame."""
    dm, wan = model.model.diffusion_model, pack.nodes.adapters.wan
    g = torch.Generator().manual_seed(4)
    frames = layout.total // (layout.h * layout.w)
    pe = dm.rope_encode(frames, 2 * layout.h, 2 * layout.w)  # (1, L, 1, d/2, 2, 2)
    L, C = pe.shape[1], dm.dim
    rows = frames if per_frame_modulation else 1
    args = {"img": torch.randn(batch, L, C, generator=g), "txt": torch.randn(batch, 9, C, generator=g),
            "vec": torch.randn(batch, rows, 6, C, generator=g), "pe": pe,
            "transformer_options": {"sigmas": torch.tensor([1.0]), pack.nodes.adapters.layout.LAYOUT_KEY: layout}}
    return args, wan


@pytest.mark.parametrize("temporal_window", [1, 2])
def test_merged_block_call_gets_destination_rows(pack, built, temporal_window):
    """A spy in place of the Wan block sees: lead and extra tokens (a frame each) untouched with their
    own RoPE rows and modulation; each merged video token with the RoPE row and the e0 row (its frame's)
    of its destination; text whole. The patch returns full-length tokens with the update unmerged onto
    all."""
    model = built["ti2v"]
    layout = pack.nodes.adapters.layout.ImageLayout(h=4, w=5, extra=4 * 5, frames=3, lead=4 * 5)
    args, wan = _wan_call(pack, model, layout)
    _, runtime = toma_patched(pack, model, temporal_window=temporal_window)
    seen = {}
    out = wan.WanPatch(runtime).block(dict(args), {"original_block": dit_checks.spy(seen)})
    (plan,) = runtime.report().plans.values()
    destinations = plan.destination_tokens()  # (B, N') raster index in the 3 x 4 x 5 grid
    n, p = destinations.shape[1], layout.lead
    assert n < layout.tokens and seen["img"].shape[1] == p + n + layout.extra
    assert torch.equal(seen["txt"], args["txt"])
    frame_rows = 20  # tokens per frame: e0 row r covers tokens [20 r, 20 (r + 1))
    for b in range(2):
        kept = torch.cat([torch.arange(p), p + destinations[b], torch.arange(p + 60, p + 80)])
        assert torch.equal(seen["pe"][b], args["pe"][0][kept])
        assert torch.equal(seen["vec"][b], args["vec"][b][kept // frame_rows])
        assert torch.equal(seen["img"][b, :p], args["img"][b, :p])
        assert torch.equal(seen["img"][b, p + n:], args["img"][b, p + 60:])
    assert plan.grid.frames == 3 and plan.grid.temporal_window == temporal_window
    # a +1 update on merged tokens is +1 on every video token
    dit_checks.check_update_on_every_token(out["img"], args["img"])


def test_per_sample_modulation_passes_unchanged(pack, built):
    """T2V/I2V e0 has one row per sample: the block gets it as it is."""
    model = built["t2v"]
    layout = pack.nodes.adapters.layout.ImageLayout(h=4, w=4, frames=2)
    args, wan = _wan_call(pack, model, layout, per_frame_modulation=False)
    _, runtime = toma_patched(pack, model)
    seen = {}
    wan.WanPatch(runtime).block(dict(args), {"original_block": dit_checks.spy(seen, add=None)})
    assert seen["vec"] is args["vec"] and seen["img"].shape[1] < args["img"].shape[1]


@pytest.mark.parametrize("steps,reuse,new_destinations", [(4, 5, [0, 1, 2, 3]), (4, 2, [0, 1, 2, 3]),
                                                        (10, 5, [0, 5]), (10, 2, [0, 2, 4, 6, 8])])
def test_schedule_builds_plans_where_it_should(pack, built, steps, reuse, new_destinations):
    """New merge weights every step, new destinations at the run's first step and then every ``reuse``
    steps, never carried over from the run before; in a run of at most 8 steps (a distilled Wan LoRA's 4)
    the video kind builds a new plan every step, whatever the reuse (Preset.short_run), and says so."""
    model = built["t2v"]
    patched, runtime = toma_patched(pack, model, reuse=reuse)
    for _ in range(2):
        sample(patched, steps=steps)
        report = runtime.report()
        (records,) = [stats.records for level, stats in report.levels.items() if level.label == "video 5x6x8"]
        assert [r.step for r in records] == list(range(steps)) and report.steps == steps
        fresh = [r.step for i, r in enumerate(records)
                 if i == 0 or r.plan.destinations is not records[i - 1].plan.destinations]
        assert fresh == new_destinations
        assert (runtime.summary()["short_run"] is not None) == (steps <= 8)


def test_with_easycache(pack, built, caplog):
    """EasyCache skips whole model calls: ToMA merges exactly the steps the model still runs, with a new plan
    in each (a 4-step run: the video kind's short-run rule)."""
    from comfy_extras.nodes_easycache import EasyCacheNode

    model = built["t2v"]
    toma, runtime = toma_patched(pack, model)
    cached = EasyCacheNode.execute(toma, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0, verbose=False)[0]
    with caplog.at_level(logging.INFO):
        out = sample(cached, steps=4)
    skipped = [r.message for r in caplog.records if "EasyCache - skipped" in r.message]
    assert torch.isfinite(out).all() and skipped
    ran = 4 - int(skipped[-1].split("skipped ")[1].split("/")[0])
    assert 1 <= ran < 4  # EasyCache did skip something, and the model ran
    (records,) = [stats.records for level, stats in runtime.report().levels.items() if level.label == "video 5x6x8"]
    assert len(records) == ran == runtime.summary()["levels"]["video 5x6x8"]["steps"]
    assert records[0].step == 0
    assert all(r.plan.destinations is not q.plan.destinations for q, r in zip(records, records[1:]))


def test_real_480p_latent_with_tiny_width(pack):
    """The latent of a 832x480 video (60x104, 30x52 tokens a frame), 2 latent frames, one step."""
    config = dict(models.WAN_TINY, dim=32, ffn_dim=64, num_layers=2)
    model = models.build_wan("t2v", seed=6, config=config)
    patched, runtime = toma_patched(pack, model)
    out = sample(patched, frames=2, hw=(60, 104), steps=1, config=config)
    assert out.shape == (1, 16, 2, 60, 104) and torch.isfinite(out).all()
    assert runtime.summary()["levels"] == {"video 2x30x52": {"tokens": 3120, "merged_tokens": 1560, "steps": 1,
                                                             "group": "video", "grid": [2, 30, 52]}}


# The Wan variants of ComfyUI v0.33.0 (2026) the Wan declaration serves: FlowRVS is a plain WanModel, WanDancer's
# music injector runs between the blocks on full-length tokens (its music features: 20 frames x 35), SCAIL and
# SCAIL 2 put a reference frame before the video and pose tokens (a grid of their own) after it
SERVED_2026 = ("flow_rvs", "wandancer", "scail", "scail2")
MUSIC_FRAMES, MUSIC_FEATURES = 20, 35


def model_class_or_skip(variant: str) -> None:
    """Skip, saying which tree has it, where this ComfyUI lacks ``variant``'s model class."""
    import comfy.supported_models

    name = models.WAN_VARIANTS[variant][0]
    if not hasattr(comfy.supported_models, name):
        pytest.skip(f"{name} is not in this ComfyUI: bash tests/setup_2026.sh, then COMFYUI_PATH=.comfyui-2026")


def sample_2026(model, variant, batch=1, cfg=1.0, seed=0):
    """A zero latent of 5 frames x 12x16 sampled with ``variant``'s inputs (WanDancer: music features; SCAIL: a
    reference frame and a pose video)."""
    g = torch.Generator().manual_seed(100 + seed)
    options = {}
    if variant == "wandancer":
        options = {"audio_embed": torch.randn(batch, MUSIC_FRAMES, MUSIC_FEATURES, generator=g)}
    if variant in ("scail", "scail2"):  # the pose video at half the size: its grid is not the video's
        options = {"reference_latents": [torch.randn(batch, 16, 1, *SIZES["square"], generator=g)],
                   "pose_video_latent": torch.randn(batch, 16, 5, 6, 8, generator=g)}
    conditioning = models.wan_conditioning(models.WAN_TINY, batch, 77, seed, **options)
    return sampling.sample(model, conditioning, torch.zeros(batch, 16, 5, *SIZES["square"]), steps=2, cfg=cfg,
                           scheduler="simple", seed=seed)


@pytest.mark.parametrize("variant", SERVED_2026)
def test_2026_variants_merge_their_video(pack, variant):
    """FlowRVS, WanDancer, SCAIL and SCAIL 2: the Wan declaration serves them; with every token a destination the
    output is the unpatched model's (batch rows and CFG batches too), at ratio 0.5 it changes a little and the
    stats count only the video grid (never SCAIL's reference frame and pose tokens)."""
    model_class_or_skip(variant)
    model = models.build_wan(variant, seed=31)
    assert pack.nodes.adapters.adapter_for(model) is pack.nodes.adapters.families.WAN
    patched, runtime = toma_patched(pack, model, ratio=0.05, window=2, temporal_window=1)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: sample_2026(m, variant, batch=2, cfg=2.0))
    t, h, w = token_grid(5, SIZES["square"])
    assert list(runtime.summary()["levels"]) == [f"video {t}x{h}x{w}"]
    patched, runtime = toma_patched(pack, model)
    out, reference = sample_2026(patched, variant), sample_2026(model, variant)
    assert torch.isfinite(out).all() and 0.0 < relative_l2(out, reference) < 0.1
    assert {k: v["tokens"] for k, v in runtime.summary()["levels"].items()} == {f"video {t}x{h}x{w}": t * h * w}


@pytest.mark.parametrize("variant,why", [("s2v", "without transformer_options"), ("humo", "equal runs per frame"),
                                         ("causal_ar", "chunk by chunk with KV caches"),
                                         ("animate2", "frame by frame to the pose branch")])
def test_unserved_variants_come_back_unpatched(pack, variant, why, caplog):
    model_class_or_skip(variant)
    model = models.build_wan(variant, seed=9)
    assert pack.nodes.adapters.adapter_for(model) is pack.nodes.adapters.families.WAN
    dit_checks.check_comes_back_unpatched(pack, model, caplog, why)
    assert pack.nodes.adapters.wan.SERVED in caplog.text
