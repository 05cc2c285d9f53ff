"""ToMA Token Merge (WanVideoWrapper) on kijai's ComfyUI-WanVideoWrapper, its real code from mirrors read at test
time (toma_bench/wanvideo_wrapper.py; skipped with the reason where there is none, or where this ComfyUI cannot
load it): a tiny WanModel built by the wrapper's own classes, sampled by its own WanVideoSampler on the CPU with
sdpa, on kijai's code to 2026-05-24 and of 2026-02-01. The wrapper's test-only requirements are in
tests/requirements-wanvideowrapper.txt (tests/setup_2026.sh installs them).

The stand-in tests at the end run everywhere: a WanModel of the signatures the node relies on, and the same with
each of them renamed (what a change of the wrapper would look like), which the node must refuse, saying what.
"""
import copy
import functools
import importlib.util
import inspect
import itertools
import logging
import re
import tempfile
import types
from pathlib import Path

import pytest
import torch

from toma_bench import wanvideo_wrapper as ww
from toma_bench.compiling import DynamoCount
from toma_bench.metrics import relative_l2

MIRRORS_2026 = ("wanvideowrapper", "wanvideowrapper-2026-02")
NODE = "ToMAWanVideoWrapper"
TOKENS, MERGED = 48, 24  # the tiny latent's 3x4x4 tokens, and what ratio 0.5 leaves of them
TEXT_TOKENS = ww.TinyConfig().text_len  # the wrapper pads the prompt to its text_len


def loaded(name: str):
    reason = ww.missing(name)
    if reason:
        pytest.skip(reason)
    try:
        return ww.load(name)
    except ImportError as e:  # this ComfyUI lacks what the wrapper imports (the pinned March-2024 tree)
        pytest.skip(f"this ComfyUI cannot load the wrapper of {name}: {e}")


@pytest.fixture(scope="module", params=MIRRORS_2026)
def wrapper(request, pack):
    return loaded(request.param)


@pytest.fixture
def node(pack):
    return pack.nodes.NODE_CLASS_MAPPINGS[NODE]()


def patch_of(model):
    return model.model_options["comfyui_toma_wanvideowrapper"][-1]


def report_of(model):
    return patch_of(model).runtime.report()


@pytest.fixture
def attention_calls(wrapper, monkeypatch):
    """(queries, keys) of every call of the wrapper's attention() from its self-attention module (a spy
    that calls the real one; installed before the node is patched, so the node's own calls go through it)."""
    forward = wrapper.module("wanvideo.modules.model").WanSelfAttention.forward
    real = forward.__globals__["attention"]
    calls = []

    @functools.wraps(real)  # its signature: the node checks the parameters of the attention() it calls
    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[1], k.shape[1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setitem(forward.__globals__, "attention", spy)
    return calls


def test_ratio_zero_is_bit_identical_to_the_node_absent(wrapper, node):
    model = ww.tiny_model(wrapper)
    base = ww.sample(wrapper, model)
    (zero,) = node.patch(model, 0.0, 0, 5)
    assert "comfyui_toma_wanvideowrapper" not in zero.model_options["transformer_options"]
    assert torch.equal(ww.sample(wrapper, zero), base)


@pytest.mark.parametrize("proportional", [True, False])
def test_half_ratio_merges_keys_and_values_and_stays_close(wrapper, node, attention_calls, proportional):
    model = ww.tiny_model(wrapper)
    base = ww.sample(wrapper, model)
    attention_calls.clear()
    (patched,) = node.patch(model, 0.5, 0, 5, proportional_attention=proportional)
    out = ww.sample(wrapper, patched)
    self_attention = [keys for queries, keys in attention_calls if keys != TEXT_TOKENS]
    model_calls = 3 * 2  # 3 steps, cond and uncond
    assert all(queries == TOKENS for queries, _ in attention_calls)
    # block 0 of 4 never merges (5/38 of them, rounded); blocks 1-3 see the merged keys
    assert sorted(self_attention) == sorted([TOKENS] * model_calls + [MERGED] * 3 * model_calls)
    change = relative_l2(out, base)
    assert 0 < change < 0.05
    report = report_of(patched)
    (level,) = report.levels
    assert (level.group, level.grid) == ("video", (3, 4, 4))
    stats = report.levels[level]
    assert (stats.tokens, stats.merged_tokens, sorted(stats.steps)) == (TOKENS, MERGED, [0, 1, 2])
    assert report.steps == 3 and "at most 8" in report.short_run and report.unmerged == {}


def test_stats_reach_the_node_and_the_merge_map_draws_the_run(wrapper, pack, node, sent):
    (patched,) = node.patch(ww.tiny_model(wrapper), 0.5, 0, 5, unique_id="7")
    samples = ww.sample(wrapper, patched)
    stats = [data for event, data, _ in sent if event == "comfyui_toma.stats"]
    assert stats and all(data["node"] == "7" for data in stats)
    # each model call of the last step reports (the sampler's last call is not known as such): the last, whole
    assert "video 3x4x4: 48 -> 24 tokens, 3 steps merged" in stats[-1]["lines"]
    assert "s sampling" in stats[-1]["lines"][-1] and "a 3-step run" in stats[-1]["summary"]["short_run"]
    merge_map = pack.nodes.NODE_CLASS_MAPPINGS["ToMAMergeMapWanVideoWrapper"]()
    (picture,) = merge_map.draw(patched, {"samples": samples[None]}, level=0, step=-1)
    assert picture.shape == (1, 8 * 8, 8 * 8, 3)
    with pytest.raises(ValueError, match="ToMA Token Merge \\(WanVideoWrapper\\)"):
        merge_map.draw(ww.tiny_model(wrapper), {"samples": samples[None]})


def test_with_the_wrappers_teacache(wrapper, node, caplog):
    """TeaCache skips the blocks of whole model calls inside WanModel.forward: ToMA merges exactly the steps
    whose blocks still ran."""
    cache = wrapper.node("WanVideoTeaCache")
    cache_args = cache.process(rel_l1_thresh=0.5, start_step=1, end_step=-1, cache_device="main_device",
                               use_coefficients=False)[0]
    (patched,) = node.patch(ww.tiny_model(wrapper), 0.5, 0, 5)
    with caplog.at_level(logging.INFO):
        ww.sample(wrapper, patched, steps=4, cache_args=cache_args)
    skipped = [set(map(int, re.findall(r"\d+", r.message.split("steps:")[1])))
               for r in caplog.records if "TeaCache skipped:" in r.message]
    assert len(skipped) == 2  # cond and uncond
    ran = set(range(4)) - (skipped[0] & skipped[1])
    assert 1 <= len(ran) < 4  # TeaCache did skip steps, and some ran
    (stats,) = report_of(patched).levels.values()
    assert stats.steps == ran


def mag_cache(wrapper, model):
    """MagCache skipping steps 2 and 3 of 5 (calls in its range after the first, while the error accumulated from the
    magnitude ratios stays under the threshold, at most K in a row): the tiny model has no calibrated ratios (the
    loader sets a checkpoint's), so it gets a constant one."""
    model.model.diffusion_model.magcache_ratios = [0.99] * 100  # read at step * (len / 2) / total_steps (50)
    return wrapper.node("WanVideoMagCache").setargs(magcache_thresh=0.05, magcache_K=2, start_step=1, end_step=-1,
                                                    cache_device="main_device")[0]


def easy_cache(wrapper, model):
    """EasyCache skipping while the latent's accumulated relative change stays under the threshold."""
    return wrapper.node("WanVideoEasyCache").setargs(easycache_thresh=0.05, start_step=1, end_step=-1,
                                                     cache_device="main_device")[0]


@pytest.mark.parametrize("name,cache", [("MagCache", mag_cache), ("EasyCache", easy_cache)])
def test_with_the_wrappers_magcache_and_easycache(wrapper, node, caplog, name, cache):
    """MagCache and EasyCache skip the blocks of whole model calls inside WanModel.forward, as TeaCache does (the
    sampler's cache report logs the skipped steps per prediction): ToMA merges exactly the steps whose blocks ran."""
    model = ww.tiny_model(wrapper)
    cache_args = cache(wrapper, model)
    (patched,) = node.patch(model, 0.5, 0, 5)
    steps = 5
    with caplog.at_level(logging.INFO):
        out = ww.sample(wrapper, patched, steps=steps, cache_args=cache_args)
    skipped = [set(map(int, re.findall(r"\d+", r.message.split("steps:")[1])))
               for r in caplog.records if f"{name} skipped:" in r.message]
    assert len(skipped) == 2  # cond and uncond
    ran = set(range(steps)) - (skipped[0] & skipped[1])
    assert 1 <= len(ran) < steps  # the cache did skip steps, and some ran
    assert torch.isfinite(out).all()
    (stats,) = report_of(patched).levels.values()
    assert stats.steps == ran and stats.merged_tokens == MERGED


def recorded_calls(model) -> list:
    """The keyword arguments of every WanModel.forward call of ``model``, recorded by a generic (*args, **kwargs)
    instance-level forward installed before the node (which wraps it, as it would any other extension's)."""
    dm = model.model.diffusion_model
    calls = []

    def recorder(*args, **kwargs):
        calls.append(dict(kwargs))
        return type(dm).forward(dm, *args, **kwargs)

    dm.forward = recorder
    return calls


def test_a_forward_wrapped_before_the_node_still_merges(wrapper, node):
    """The node binds a call's arguments as the WanModel's own forward takes them, not as a wrapper installed on
    the model before it does (here one of (*args, **kwargs))."""
    model = ww.tiny_model(wrapper)
    (reference,) = node.patch(model, 0.5, 0, 5)
    expected = ww.sample(wrapper, reference)
    wrapped = ww.tiny_model(wrapper)
    calls = recorded_calls(wrapped)
    (patched,) = node.patch(wrapped, 0.5, 0, 5)
    assert torch.equal(ww.sample(wrapper, patched), expected)
    assert len(calls) == 3 * 2
    (stats,) = report_of(patched).levels.values()
    assert stats.merged_tokens == MERGED and stats.steps == {call["current_step"] for call in calls}


def test_batched_cfg_merges_cond_and_uncond_in_one_call(wrapper, node):
    """Batched CFG: cond and uncond in one WanModel.forward call of batch 2 (two latents, both prompts). The
    sampler's own batched_cfg path fails in the wrapper's code with or without the node (it concatenates a t2v
    model's clip_fea of None and passes is_uncond twice), so the test makes the call it means to make, from the
    arguments of a real step's cond and uncond calls, in a run of its own: it merges with a plan per batch entry,
    each as the unbatched ToMA call's."""
    model = ww.tiny_model(wrapper)
    calls = recorded_calls(model)
    (patched,) = node.patch(model, 0.5, 0, 5)
    ww.sample(wrapper, patched, steps=1)  # loads the weights and records the step's calls
    cond, uncond = calls
    dm = model.model.diffusion_model

    def run(arguments, merging=True):  # a run of its own (the sampler deep-copies the options per run)
        options = copy.deepcopy(patched.model_options["transformer_options"]) if merging else {}
        return dm.forward(**dict(arguments, transformer_options=options, pred_id=None))[0]

    batched = dict(cond, x=cond["x"] * 2, context=cond["context"] + uncond["context"])
    with torch.no_grad():
        (merged_cond,), (merged_uncond,) = run(cond), run(uncond)
        merged_batched = run(batched)
        report = report_of(patched)
        plain_batched = run(batched, merging=False)
    assert len(merged_batched) == 2
    for out, alone, plain in zip(merged_batched, (merged_cond, merged_uncond), plain_batched):
        assert relative_l2(out, alone) < 1e-4 and relative_l2(out, plain) > 0
    assert {key.rows for key in report.plans} == {(2, ("cond+uncond", 0))}
    (stats,) = report.levels.values()
    assert (stats.merged_tokens, stats.steps) == (MERGED, {0}) and report.unmerged == {}


def tiny_lora(path: Path, rank: int = 4) -> Path:
    """A seeded random LoRA (lora_A/lora_B) on every block's self-attention q, k, v and o, as a safetensors file."""
    from safetensors.torch import save_file

    config = ww.TinyConfig()
    generator = torch.Generator().manual_seed(5)
    sd = {}
    for block, name in itertools.product(range(config.layers), "qkvo"):
        prefix = f"diffusion_model.blocks.{block}.self_attn.{name}"
        sd[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(rank, config.dim, generator=generator)
        sd[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(config.dim, rank, generator=generator)
    save_file(sd, str(path))
    return path


def test_on_a_lora_model(wrapper, node, tmp_path):
    """The wrapper's unmerged LoRAs (WanVideoLoraSelect with merge_loras off, WanVideoSetLoRAs): the sampler
    replaces the blocks' Linear layers by its CustomLinear applying the LoRA on the fly. Ratio 0 is the LoRA model
    bit for bit; merging, the LoRA still acts (in q, k, v and the o the node's proportional attention applies)."""
    loras = wrapper.node("WanVideoLoraSelect").getlorapath(lora=str(tiny_lora(tmp_path / "tiny_lora.safetensors")),
                                                           strength=1.0, unique_id=None, merge_loras=False)[0]
    model = ww.tiny_model(wrapper)
    lora_model = wrapper.node("WanVideoSetLoRAs").setlora(model, loras)[0]
    assert lora_model.patches
    plain = ww.sample(wrapper, model)
    base = ww.sample(wrapper, lora_model)
    assert not torch.equal(base, plain)
    (zero,) = node.patch(lora_model, 0.0, 0, 5)
    assert torch.equal(ww.sample(wrapper, zero), base)
    (patched,) = node.patch(lora_model, 0.5, 0, 5)
    out = ww.sample(wrapper, patched)
    assert 0 < relative_l2(out, base) < relative_l2(base, plain)  # closer to the LoRA model than the LoRA is to the plain
    (stats,) = report_of(patched).levels.values()
    assert stats.merged_tokens == MERGED and len(stats.steps) == 3


@pytest.mark.parametrize("end_percent", [1.0, 0.5])
def test_phantom_reference_frames_run_unmerged_and_are_named(wrapper, pack, node, end_percent):
    """Phantom (WanVideoPhantomEmbeds): the calls given its subject frames (phantom_ref: cond, uncond and the
    phantom CFG pass) run unmerged, each counted per merged block under the input's name; calls past its
    end_percent merge. With Phantom on every step the result is the model's without the node."""
    reference = {"samples": torch.randn(1, 16, 1, 8, 8, generator=torch.Generator().manual_seed(3))}
    embeds = wrapper.node("WanVideoPhantomEmbeds").process(num_frames=9, phantom_cfg_scale=5.0,
                                                           phantom_start_percent=0.0, phantom_end_percent=end_percent,
                                                           phantom_latent_1=reference)[0]
    model = ww.tiny_model(wrapper)
    calls = recorded_calls(model)
    base = ww.sample(wrapper, model, steps=4, image_embeds=embeds)
    calls.clear()
    (patched,) = node.patch(model, 0.5, 0, 5)
    out = ww.sample(wrapper, patched, steps=4, image_embeds=embeds)
    given = [call["current_step"] for call in calls if call.get("phantom_ref") is not None]
    without = {call["current_step"] for call in calls} - set(given)
    assert given and (without if end_percent < 1 else not without)
    report = report_of(patched)
    name = f"{pack.nodes.adapters.wan_video_wrapper.UNMERGED_INPUTS['phantom_ref']} (phantom_ref)"
    assert report.unmerged == {name: len(patch_of(patched).blocks) * len(given)}
    assert {step for stats in report.levels.values() for step in stats.steps} == without
    if not without:
        assert torch.equal(out, base) and not report.levels


def test_with_the_wrappers_block_swap(wrapper, node):
    model = ww.tiny_model(wrapper)
    swap = wrapper.node("WanVideoBlockSwap").setargs(blocks_to_swap=2, offload_img_emb=False, offload_txt_emb=False,
                                                      use_non_blocking=False, vace_blocks_to_swap=0, prefetch_blocks=0,
                                                      block_swap_debug=False)[0]
    swapped = wrapper.node("WanVideoSetBlockSwap").loadmodel(model, swap)[0]
    (merged_swapped,) = node.patch(swapped, 0.5, 0, 5)
    (merged,) = node.patch(model, 0.5, 0, 5)
    assert torch.equal(ww.sample(wrapper, merged_swapped), ww.sample(wrapper, merged))
    (stats,) = report_of(merged_swapped).levels.values()
    assert stats.merged_tokens == MERGED and len(stats.steps) == 3


def test_compiled_blocks_add_no_graph_break(wrapper, node):
    """The wrapper's torch.compile of each block (backend eager: dynamo traces, nothing is generated): the merged
    blocks break no graph the wrapper's own blocks do not, nothing is left to eager, the result is the eager
    one, and a second run compiles nothing new."""
    model = ww.tiny_model(wrapper)
    (eager,) = node.patch(model, 0.5, 0, 5)
    reference = ww.sample(wrapper, eager)
    settings = wrapper.node("WanVideoTorchCompileSettings")
    compile_args = settings.set_args(backend="eager", fullgraph=False, mode="default", dynamic=False,
                                     dynamo_cache_size_limit=64, compile_transformer_blocks_only=True)[0]
    compiled_model = ww.tiny_model(wrapper)
    compiled_model.model["compile_args"] = compile_args
    with DynamoCount() as plain:
        ww.sample(wrapper, compiled_model)
    (patched,) = node.patch(compiled_model, 0.5, 0, 5)
    with DynamoCount(fresh=False) as merging:
        out = ww.sample(wrapper, patched)
    assert merging.graph_breaks.keys() <= plain.graph_breaks.keys() and merging.breaks <= plain.breaks
    assert merging.frames_skipped == 0 and 0 < merging.graphs <= 4 * 3 + 1  # <= 4 per merged block, 1 unmerged
    assert torch.equal(out, reference)
    with DynamoCount(fresh=False) as again:
        ww.sample(wrapper, patched)
    assert (again.graphs, again.breaks, again.frames_skipped) == (0, 0, 0)


def test_two_samplers_with_and_without_the_node_leave_each_other_alone(wrapper, node):
    """Clones share one WanModel: the node's wrappers stay on it, inert for a clone without the node's key; the
    node's own runs start clean (the same seed, the same result)."""
    model = ww.tiny_model(wrapper)
    before = ww.sample(wrapper, model)
    (patched,) = node.patch(model, 0.5, 0, 5)
    first = ww.sample(wrapper, patched)
    between = ww.sample(wrapper, model.clone())
    second = ww.sample(wrapper, patched)
    after = ww.sample(wrapper, model)
    assert torch.equal(before, between) and torch.equal(before, after)
    assert torch.equal(first, second) and not torch.equal(first, before)
    (patched_again,) = node.patch(patched, 0.5, 0, 5)  # a second node on the same clone: the nearer one merges
    ww.sample(wrapper, patched_again)
    assert report_of(patched_again).levels and "replaces the ToMA (WanVideoWrapper) node" in \
        report_of(patched_again).caveats[0]


def test_context_windows_plan_each_window_on_its_own(wrapper, node):
    """The wrapper's context windows: several model calls a step on windows of the video, each window (the n-th
    call of a role in its step) with plans of its own."""
    options = wrapper.node("WanVideoContextOptions")
    context = getattr(options, options.FUNCTION)(context_schedule="uniform_standard", context_frames=9,
                                                   context_stride=4, context_overlap=4, freenoise=False,
                                                   verbose=False)[0]
    (patched,) = node.patch(ww.tiny_model(wrapper), 0.5, 0, 5)
    embeds = ww.empty_embeds(wrapper, frames=17)  # 5 latent frames, windows of 3
    ww.sample(wrapper, patched, steps=2, image_embeds=embeds, context_options=context)
    report = report_of(patched)
    assert [level.grid for level in report.levels] == [(3, 4, 4)]
    windows = {role: {window for key in report.plans for r, window in [key.rows[1]] if r == role}
               for role in ("cond", "uncond")}
    assert windows["cond"] == windows["uncond"] and len(windows["cond"]) >= 2
    plans = {key.rows: plan for key, plan in report.plans.items() if key.block == 1}
    first, second = plans[(1, ("cond", 0))], plans[(1, ("cond", 1))]
    assert not torch.equal(first.destination_tokens(), second.destination_tokens()) or \
        not torch.equal(first.log_mass, second.log_mass)  # built from each window's own tokens


def sdpa_standing_in_for_sage(head_dim: int, seen: list):
    """What the wrapper's SageAttention kernels compute, in its layout (NHD), on the CPU; it refuses other head
    dims than the model's, as sage's 64/128-only kernels refuse a padded head."""

    def sage(q, k, v, tensor_layout="NHD", **kwargs):
        assert q.shape[-1] == k.shape[-1] == head_dim, "a padded head reached the sage kernel"
        seen.append(k.shape[1])
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return sage


def test_proportional_attention_is_off_under_sage_and_says_so_once(wrapper, node, monkeypatch, caplog):
    attention = wrapper.module("wanvideo.modules.attention")
    seen = []
    monkeypatch.setattr(attention, "sageattn_func", sdpa_standing_in_for_sage(16, seen))
    model = ww.tiny_model(wrapper)
    sage = wrapper.node("WanVideoSetAttentionModeOverride").getmodelpath(model, "sageattn", 0, 10000, False)[0]
    (patched,) = node.patch(sage, 0.5, 0, 5)
    with caplog.at_level(logging.WARNING):
        ww.sample(wrapper, patched)
        ww.sample(wrapper, patched)
    said = [r.message for r in caplog.records if "proportional attention is off under SageAttention" in r.message]
    assert len(said) == 1
    assert any("sageattn" in caveat for caveat in report_of(patched).caveats)
    assert MERGED in seen and TOKENS in seen  # merged keys reached sage, unpadded


def test_ultravico_attention_runs_unmerged_and_says_why(wrapper, node, monkeypatch):
    attention = wrapper.module("wanvideo.modules.attention")
    seen = []
    sage = sdpa_standing_in_for_sage(16, seen)
    monkeypatch.setattr(attention, "sageattn_func_ultravico", lambda qkv, **kwargs: sage(*qkv))
    model = ww.tiny_model(wrapper)
    ultravico = wrapper.node("WanVideoSetAttentionModeOverride").getmodelpath(model, "sageattn_ultravico", 0, 10000,
                                                                             False)[0]
    base = ww.sample(wrapper, ultravico)
    (patched,) = node.patch(ultravico, 0.5, 0, 5)
    assert torch.equal(ww.sample(wrapper, patched), base)
    report = report_of(patched)
    assert not report.levels
    assert report.unmerged == {"UltraViCo attention (sageattn_ultravico)": 3 * 3 * 2}  # 3 blocks, 3 steps, cfg


def test_the_march_2025_wrapper_is_refused_with_its_model_unchanged(pack, node, caplog):
    """kijai's own repository as mirrored (March 2025): its WanModel.forward takes no transformer_options. Its
    model comes back as it was given, with nothing installed on it (that code cannot sample on a CPU: its
    sampler autocasts to bfloat16 and its time embedding asserts float32)."""
    old = loaded("wanvideowrapper-2025-03")
    model = ww.tiny_model(old)
    dm = model.model.diffusion_model
    with caplog.at_level(logging.WARNING):
        (same,) = node.patch(model, 0.5, 0, 5)
    assert same is model
    assert any("takes no transformer_options" in r.message for r in caplog.records)
    assert "forward" not in vars(dm) and "_comfyui_toma_hooks" not in vars(dm)
    assert all("forward" not in vars(block.self_attn) for block in dm.blocks)


def test_bad_input_names_the_input(wrapper, node):
    with pytest.raises(ValueError, match="ratio"):
        node.patch(ww.tiny_model(wrapper), 0.95, 0, 5)
    with pytest.raises(ValueError, match="temporal_window"):
        node.patch(ww.tiny_model(wrapper), 0.5, 0, 5, temporal_window=0)


# -- the stand-in: the signatures the node relies on, without the wrapper ------------------------------------------

FORWARD = ("self, x, t, context, seq_len, is_uncond=False, current_step_percentage=0.0, current_step=0, "
           "last_step=0, total_steps=50, clip_fea=None, y=None, transformer_options={}")
SELF_ATTENTION = "self, q, k, v, seq_lens, transformer_options={}, attention_mode_override=None, frame_tokens=1536"


def module_of(source: str) -> dict:
    """The namespace of a module made of ``source``, imported from a file as the wrapper's modules are (no exec:
    the registry's security check refuses it anywhere in the folder)."""
    with tempfile.TemporaryDirectory(prefix="wan_stand_in_") as folder:
        path = Path(folder) / "stand_in.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"wan_stand_in_{next(STAND_INS)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return vars(module)


STAND_INS = itertools.count()


def stand_in(forward: str = FORWARD, self_attention: str = SELF_ATTENTION, attribute: str = "attention_mode"):
    """A WANVIDEOMODEL-like patcher around a WanModel of the given signatures (2026's by default): blocks with a
    self_attn module (num_heads, attention_mode, o) and a module-level attention() as the wrapper's. Layers are
    ComfyUI's ops (comfy.ops), as a pack's modules are built (comfy-test lint refuses torch.nn layers anywhere in
    the pack); o is only looked for here, never called."""
    import comfy.ops  # importable once the pack fixture has loaded the pack into a ComfyUI

    namespace = module_of(f"def attention(q, k, v, q_lens=None, k_lens=None, attention_mode='sdpa', heads=1, "
                          f"frame_tokens=1536, transformer_options={{}}): return q\n"
                          f"def attention_forward({self_attention}): return attention(q, k, v)\n"
                          f"def model_forward({forward}): return x\n")

    class SelfAttention(torch.nn.Module):
        forward = namespace["attention_forward"]

        def __init__(self):
            super().__init__()
            self.num_heads, self.o = 2, comfy.ops.disable_weight_init.Linear(4, 4)
            setattr(self, attribute, "sdpa")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = SelfAttention()

    class WanModel(torch.nn.Module):
        forward = namespace["model_forward"]

        def __init__(self):
            super().__init__()
            self.patch_size = (1, 2, 2)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(4))

    def clone():
        return types.SimpleNamespace(model=patcher.model, model_options={"transformer_options": {}}, clone=clone)

    patcher = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=WanModel()),
                                    model_options={"transformer_options": {}}, clone=clone)
    return patcher


def renamed(signature: str, name: str) -> str:
    return re.sub(rf"\b{name}\b", f"{name}_renamed", signature)


def test_the_stand_in_of_2026_is_patched(node):
    model = stand_in()
    (patched,) = node.patch(model, 0.5, 0, 5)
    assert patched is not model and "comfyui_toma_wanvideowrapper" in patched.model_options["transformer_options"]
    dm = model.model.diffusion_model
    assert "forward" in vars(dm) and all("forward" in vars(block.self_attn) for block in dm.blocks)


@pytest.mark.parametrize("name", ["x", "seq_len", "is_uncond", "current_step", "current_step_percentage",
                                  "last_step", "transformer_options"])
def test_a_renamed_forward_argument_is_refused(node, caplog, name):
    model = stand_in(forward=renamed(FORWARD, name))
    with caplog.at_level(logging.WARNING):
        (same,) = node.patch(model, 0.5, 0, 5)
    assert same is model and "forward" not in vars(model.model.diffusion_model)
    assert any(name in r.message and "cannot be merged" in r.message for r in caplog.records)


@pytest.mark.parametrize("change", ["q", "seq_lens", "attention_mode"])
def test_a_renamed_self_attention_is_refused(node, caplog, change):
    model = stand_in(self_attention=renamed(SELF_ATTENTION, change)) if change != "attention_mode" else \
        stand_in(attribute="mode")
    with caplog.at_level(logging.WARNING):
        (same,) = node.patch(model, 0.5, 0, 5)
    assert same is model
    assert any("self_attn" in r.message and "cannot be merged" in r.message for r in caplog.records)


def test_the_stand_in_has_the_signatures_of_the_real_code(wrapper, pack):
    """The stand-in above keeps what the node reads of the real 2026 code: its parameter names."""
    module = wrapper.module("wanvideo.modules.model")
    adapter = pack.nodes.adapters.wan_video_wrapper
    real = inspect.signature(module.WanModel.forward).parameters
    assert set(adapter.FORWARD_PARAMETERS) <= set(real)
    attention = list(inspect.signature(module.WanSelfAttention.forward).parameters)
    assert tuple(attention[1:5]) == adapter.SELF_ATTENTION_PARAMETERS
    assert adapter.attention_function(ww.tiny_model(wrapper).model.diffusion_model) is not None


def test_a_per_frame_timestep_keeps_the_first_frame_whole(pack):
    layout = pack.nodes.adapters.wan_video_wrapper.call_layout
    x = [torch.zeros(16, 3, 8, 8)]
    assert layout({"x": x, "seq_len": 48, "t": torch.zeros(1)}, (1, 2, 2)) == (0, (3, 4, 4), 48)
    assert layout({"x": x, "seq_len": 48, "t": torch.zeros(1, 3)}, (1, 2, 2)) == (16, (2, 4, 4), 48)
    assert layout({"x": x, "seq_len": 40, "t": torch.zeros(1)}, (1, 2, 2)) is None  # more tokens than seq_len
