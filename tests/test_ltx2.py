"""ToMA on LTX-2 (``LTXAVModel``, audio-video): a tiny random-weight model of the real class, its blocks run
through the node's patch; the conformance table's checks for it, and what is LTX-2's own (the audio, the
video-to-audio attention, per-frame compressed timesteps).

Where LTX-2 is, and how its classes are loaded: toma_bench/ltx2_source.py (the February-2026 fork cannot
host the tests; its three comfy/ldm/lightricks files replace the host's while this module runs). The host's
sampler has no LTX-2 latent (a [video, audio] pair), so the model is called as the sampler calls it: the
patched clone loaded, its wrappers in transformer_options, the step's sigma there.

Latents: video 16 channels x frames x 5 x 7 (odd, non-square; patch size 1), audio 8 x 9 x 16 (9 tokens).
"""
import pytest
import torch

import dit_checks
from toma_bench import comfy_host, ltx2_source, models
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

H, W, AUDIO_TOKENS, TEXT = 5, 7, 9, 11
CONFIG = models.LTX2_TINY
EXACT = {"ratio": 0.1, "window": 2, "temporal_window": 1}  # every token of a window a destination
SIGMA = 0.8


@pytest.fixture(scope="module")
def ltx2_classes(pack):
    """The February-2026 comfy.ldm.lightricks modules in sys.modules while this module runs."""
    reason = ltx2_source.missing()
    if reason:
        pytest.skip(reason)
    with ltx2_source.lightricks_modules() as av_model:
        yield av_model


@pytest.fixture(scope="module")
def model(ltx2_classes):
    return models.build_ltx2(seed=3)


def denoise(pack, m, frames=5, batch=1, per_token=False, seed=0):
    """(video (B, 16, frames, H, W), audio (B, 8, 9, 16)) of one model call at SIGMA, as the sampler makes
    it, with every runtime of ``m`` at the start of a run. ``per_token``: per-token timesteps, the first
    latent frame at 0 (image-to-video), which LTX-2 stores per frame (CompressedTimestep); the audio's one."""
    import comfy.model_management
    import comfy.patcher_extension

    g = torch.Generator().manual_seed(seed)
    video = torch.randn(batch, CONFIG["in_channels"], frames, H, W, generator=g)
    audio = torch.randn(batch, 8, AUDIO_TOKENS, 16, generator=g)
    context = torch.randn(batch, TEXT, 2 * CONFIG["caption_channels"], generator=g)
    timestep = torch.full((batch,), SIGMA)
    if per_token:
        timestep = torch.full((batch, frames, H * W), SIGMA)
        timestep[:, 0] = 0.0
        timestep = (timestep.flatten(1), torch.full((batch,), SIGMA))  # (video, audio), as LTX-2's model gets them
    for runtime in runtimes(pack, m):
        runtime.begin_run()
    comfy.model_management.load_models_gpu([m])
    options = dict(m.model_options.get("transformer_options", {}))
    options["wrappers"] = comfy.patcher_extension.merge_nested_dicts({}, m.wrappers)
    options["sigmas"] = torch.full((batch,), SIGMA)
    with torch.no_grad():
        return m.model.diffusion_model([video, audio], timestep, context, None, frame_rate=25,
                                       transformer_options=options)


def runtimes(pack, m) -> list:
    """The runtimes of the token merge nodes on ``m``; none on an unpatched model."""
    try:
        return pack.nodes.runtime.runtimes_of(m)
    except ValueError:
        return []


def flat(outputs):
    return torch.cat([t.flatten(1) for t in outputs], dim=1)


def test_the_adapter_of_ltx2_is_its_declaration(pack, model):
    assert pack.nodes.adapters.adapter_for(model) is pack.nodes.adapters.families.LTX2


def test_ratio_zero_is_identical_to_unpatched(pack, model):
    dit_checks.check_ratio_zero_identical(pack, model, lambda m: flat(denoise(pack, m, batch=2)))


@pytest.mark.parametrize("per_token", [False, True], ids=["one-timestep", "per-token-timesteps"])
def test_merging_into_every_token_reproduces_the_unpatched_model(pack, model, per_token):
    """Every token of a window a destination: video and audio are the unpatched model's (the video-to-audio
    attention sees every video token with its own time either way)."""
    patched, runtime = dit_checks.toma_patched(pack, model, **EXACT)
    dit_checks.check_merging_only_permutes(patched, model, lambda m: flat(denoise(pack, m, batch=2, per_token=per_token)))
    frames = 4 if per_token else 5  # the first frame, with its own timestep, leads unmerged
    assert sorted(runtime.summary()["levels"]) == [f"video {frames}x{H}x{W}"]


@pytest.mark.parametrize("frames, batch, per_token", [(1, 2, False), (5, 1, False), (9, 2, False), (5, 2, True)])
def test_half_ratio_merges_the_video_and_keeps_the_audio_close(pack, model, frames, batch, per_token):
    patched, runtime = dit_checks.toma_patched(pack, model)
    video, audio = denoise(pack, patched, frames, batch, per_token)
    ref_video, ref_audio = denoise(pack, model, frames, batch, per_token)
    assert video.shape == ref_video.shape and audio.shape == ref_audio.shape
    assert torch.isfinite(video).all() and torch.isfinite(audio).all()
    assert 0.0 < relative_l2(video, ref_video) < 0.25
    assert 0.0 < relative_l2(audio, ref_audio) < 0.1
    grid_frames = frames - 1 if per_token else frames
    (level,) = runtime.summary()["levels"].values()
    tokens = grid_frames * H * W
    assert level["tokens"] == tokens and abs(level["merged_tokens"] - tokens / 2) <= tokens / 8


def test_the_audio_attends_to_the_full_video_and_the_video_to_merged_tokens(pack, model):
    """In a merged block (scope block: under the video kind's keys/values scope the keys are projected from
    every token and then cut) the video self-attention's keys come from the merged tokens, the
    video-to-audio attention's from every video token (its context unmerged, each token with its own RoPE
    row)."""
    patched, _ = dit_checks.toma_patched(pack, model, scope="block")
    block = model.model.diffusion_model.transformer_blocks[1]
    seen = {}
    def hook(name):
        def record(module, args, out):
            seen.setdefault(name, args[0].shape[1])
        return record

    hooks = [layer.register_forward_hook(hook(name)) for name, layer in (("video self-attention", block.attn1.to_k), ("video to audio", block.video_to_audio_attn.to_k),
                                 ("audio to video", block.audio_to_video_attn.to_q))]
    try:
        denoise(pack, patched)
    finally:
        for hook in hooks:
            hook.remove()
    tokens = 5 * H * W
    assert seen["video to audio"] == tokens
    assert seen["video self-attention"] < tokens and seen["audio to video"] == seen["video self-attention"]
    assert dit_checks.patch_points(patched) == (
        {("double_block", i) for i in range(3)}
        | {f"diffusion_model.transformer_blocks.{i}.video_to_audio_attn.forward" for i in range(3)})


def test_the_input_model_is_untouched(pack, model):
    before = flat(denoise(pack, model))
    patched, _ = dit_checks.toma_patched(pack, model)
    denoise(pack, patched)
    assert not dit_checks.patch_points(model) and torch.equal(flat(denoise(pack, model)), before)


def test_two_stacked_nodes_the_nearer_merges(pack, model):
    """The nearer node's patches replace the earlier node's, the video-to-audio forwards included: the stack
    denoises as the nearer node alone."""
    node = pack.nodes.toma_nodes.ToMAPatchModel()
    (inner,) = node.patch(model, 0.75, 4, 5)
    (outer,) = node.patch(inner, 0.25, 4, 5)
    (alone,) = node.patch(model, 0.25, 4, 5)
    assert torch.equal(flat(denoise(pack, outer)), flat(denoise(pack, alone)))


def test_keys_values_merges_only_the_video_self_attentions_keys(pack, model):
    """Scope keys/values: every block runs on the full video; only the video self-attention's keys and
    values come from merged tokens (queries whole), the audio and the cross-attentions untouched; every
    token a destination reproduces the unpatched model, ratio 0.5 changes the video a little."""
    seen = []

    def record(func, q, k, v, heads, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return func(q, k, v, heads, *args, **kwargs)

    counted = model.clone()
    counted.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = record
    denoise(pack, counted)
    unpatched = list(seen)
    exact, _ = dit_checks.toma_patched(pack, model, scope="keys/values", **EXACT)
    dit_checks.check_merging_only_permutes(exact, model, lambda m: flat(denoise(pack, m, batch=2)))
    patched, runtime = dit_checks.toma_patched(pack, counted, scope="keys/values")
    seen.clear()
    video, audio = denoise(pack, patched)
    ref_video, ref_audio = denoise(pack, model)
    tokens = 5 * H * W
    assert [q for q, _ in seen] == [q for q, _ in unpatched]
    changed = [(before, after) for (_, before), (_, after) in zip(unpatched, seen) if before != after]
    assert changed and all(before == tokens and after < tokens for before, after in changed)
    assert 0.0 < relative_l2(video, ref_video) < 0.25 and relative_l2(audio, ref_audio) < 0.1
    assert list(runtime.summary()["levels"]) == [f"video 5x{H}x{W}"]
