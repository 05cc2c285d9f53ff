"""Qwen-Image 2.1's own checks (the shared ones are its row in test_family_conformance.py): its prefix, text with
reference images spliced in, stays whole and its keys and values, cached by the model across a run's steps, are
never merged; the cache keeps working beside ToMA; the target's queries attend to [prefix, merged target]; the
stand-in keeps what the adapter relies on of ComfyUI's model (names, signatures, attn_fn with preferred_attention,
attn1_patch's img_slice).

They run on ComfyUI's own Qwen-Image 2.1 where the tree has it (v0.37.0 on), else on toma_bench's stand-in, which
needs ComfyUI v0.33.0's fused kernels: in older trees they skip, saying why. The stand-in runs every check at both
versions of the model file it follows (the first, b806797, and the newest read: a pass over the prefix alone fills
the cache, blocks add their residual in place, the malloc graph brackets them, a FunControl branch).
"""
import importlib
import inspect
import itertools

import dit_checks
import pytest
import torch

from toma_bench import comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

SIZE = (13, 19)  # latent pixels: 13 x 19 target tokens (one a latent pixel)
TEXT = 11
REFERENCE = (5, 7)  # a reference latent's size


@pytest.fixture(scope="module")
def q21(pack):
    """The stand-in's module, Qwen-Image 2.1 installed while this module runs (ComfyUI's own where it has it)."""
    try:
        module = importlib.import_module("toma_bench.qwen_image21")
    except ImportError as e:
        pytest.skip(f"toma_bench.qwen_image21 does not import in this ComfyUI ({e})")
    if module.missing():
        pytest.skip(module.missing())
    with module.installed():
        yield module


# the versions of the model file the stand-in follows: the first (b806797) and the newest read
VERSIONS = ("b806797696c10b92c8db8687b8842acf34db8d97", "dd85c0c61865080444635c1ab2264f64cd8013ce")


@pytest.fixture(scope="module", params=VERSIONS, ids=["first", "newest"])
def model(q21, request):
    """The model at each version of its file (ComfyUI's own, once, where the tree has it)."""
    torch.set_num_threads(1)
    if q21.host_has_it() and q21.tree_class("comfy.supported_models") is not q21.QwenImage21Config:
        if request.param != VERSIONS[-1]:
            pytest.skip("this ComfyUI has a Qwen-Image 2.1 of its own: its version alone")
        return q21.build(seed=91)
    return q21.build(seed=91, follows=request.param)


def conditioning(q21, references=False, **options):
    if references:
        g = torch.Generator().manual_seed(5)
        options["reference_latents"] = [torch.randn(1, 64, *REFERENCE, generator=g)]
    return models.text_conditioning(q21.TINY["context_in_dim"], 1, TEXT, 0, **options)


def sample(q21, model, references=False, steps=3, cache=True, **options):
    if not cache:
        model = model.clone()
        model.model_options.setdefault("transformer_options", {})["qwen_image21_cache"] = {"device": "off"}
    return sampling.sample(model, conditioning(q21, references, **options), torch.zeros(1, 64, *SIZE), steps=steps,
                           scheduler="simple")


def recorded(model):
    """(a clone of ``model`` whose attention calls record their (query, key) lengths, the list of them): an
    attention override of its own, which the stand-in's attention functions honour as ComfyUI's do."""
    seen = []

    def record(func, q, k, v, heads, *args, **kwargs):
        seen.append((q.shape[1], k.shape[1]))
        return func(q, k, v, heads, *args, **kwargs)

    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = record
    return clone, seen


def cache_steps(model, run):
    """[whether each model call of ``run`` found its prefix cached]: read from the diffusion model's cache selection."""
    dm, found = model.model.diffusion_model, []
    original = dm.select_prefix_cache

    def select(*args, **kwargs):
        out = original(*args, **kwargs)
        found.append(out[1])
        return out

    dm.select_prefix_cache = select
    try:
        run()
    finally:
        del dm.select_prefix_cache
    return found


def test_the_adapter_finds_it_by_its_class_and_blocks(pack, q21, model):
    """Model detection's classes (supported_models, model_base, the diffusion model under
    comfy.ldm.qwen_image21.model) give the Qwen-Image 2.1 family; its blocks take what the patched forward passes."""

    families = pack.nodes.adapters.families
    assert isinstance(model.model, q21.tree_class("comfy.model_base"))
    assert isinstance(model.model.model_config, q21.tree_class("comfy.supported_models"))
    assert type(model.model.diffusion_model) is importlib.import_module(q21.MODULE).QwenImage21Transformer2DModel
    assert pack.nodes.adapters.adapter_for(model) is families.QWEN_IMAGE21
    assert families.QWEN_IMAGE21.unserved(model.model.diffusion_model) is None
    forward = inspect.signature(type(model.model.diffusion_model)._forward).parameters
    assert list(forward)[1:6] == ["x", "timesteps", "context", "ref_latents", "image_slots"]


@pytest.mark.parametrize("references", [False, True], ids=["text", "references"])
def test_the_prefix_cache_works_unpatched_and_with_toma(q21, pack, model, references):
    """The model caches its prefix from the second step on, with and without ToMA (its blocks are object-patched,
    no hook that would switch the cache off); the cache changes nothing (the same output with it off), and ToMA
    merges the target the same with the cache as without it: the cached prefix is the unpatched model's."""
    plain = []
    unpatched = sample(q21, model, references)
    assert cache_steps(model, lambda: plain.append(sample(q21, model, references))) == [False, True, True]
    assert torch.equal(plain[0], unpatched)
    assert relative_l2(sample(q21, model, references, cache=False), unpatched) < 1e-6
    patched, runtime = dit_checks.toma_patched(pack, model)
    merged = []
    assert cache_steps(model, lambda: merged.append(sample(q21, patched, references))) == [False, True, True]
    assert relative_l2(sample(q21, patched, references, cache=False), merged[0]) < 1e-6
    assert 0 < relative_l2(merged[0], unpatched) < 0.25
    assert runtime.summary()["levels"]["joint 13x19"]["merged_tokens"] == 124
    assert not runtime.report().unmerged


def test_cached_keys_and_values_are_the_unpatched_models(q21, pack, model):
    """After a ToMA run the prefix cache holds, for every block, the keys and values the unpatched model stores:
    the prefix (text and reference rows) is never merged."""
    dm = model.model.diffusion_model

    def stored(m):
        entries = {}
        original = dm.select_prefix_cache

        def select(*args, **kwargs):
            cache, cached = original(*args, **kwargs)
            if cache is not None and "put" not in vars(cache):
                put = cache.put
                cache.put = lambda i, kv: (entries.__setitem__(i, kv.clone()), put(i, kv))[1]
            return cache, cached

        dm.select_prefix_cache = select
        try:
            sample(q21, m, references=True, steps=1)
        finally:
            del dm.select_prefix_cache
        return [entries[i] for i in range(len(dm.transformer_blocks))]

    plain = stored(model)
    for scope in ("block", "keys/values"):
        merged = stored(dit_checks.toma_patched(pack, model, scope=scope)[0])
        assert all(torch.equal(a, b) for a, b in zip(plain, merged)), scope


@pytest.mark.parametrize("scope", ["block", "keys/values"])
def test_the_target_attends_to_the_prefix_and_the_merged_target(q21, pack, model, scope):
    """Every attention call of a merged block has the whole prefix among its keys and the merged target after it:
    on the first step (block-causal: the text segment as unpatched, the target's queries over [prefix, target]) and
    on cached steps (the target's queries over [cached prefix, target]); scope block merges the queries too,
    keys/values only the keys."""
    prefix = TEXT + REFERENCE[0] * REFERENCE[1]
    tokens = SIZE[0] * SIZE[1]
    counted, seen = recorded(model)
    sample(q21, counted, references=True)
    unpatched = list(seen)
    seen.clear()
    patched, runtime = dit_checks.toma_patched(pack, counted, scope=scope)
    sample(q21, patched, references=True)
    (kept,) = {plan.num_merged for plan in runtime.report().plans.values()}
    target_calls = [(q, k) for q, k in unpatched if q == tokens]
    assert target_calls and all(k == prefix + tokens for _, k in target_calls)
    changed = [(q, k) for (q, k), before in zip(seen, unpatched) if (q, k) != before]
    assert changed and all(k == prefix + kept for _, k in changed)
    assert all(q == (tokens if scope == "keys/values" else kept) for q, _ in changed)
    assert [q for q, _ in seen if q < tokens and (q, _) not in changed] == [q for q, _ in unpatched if q < tokens]


def test_every_token_a_destination_reproduces_the_model_with_references_and_image_slots(q21, pack, model):
    """A reference spliced into the text at a slot (image_slots): with every token a destination, ToMA's output is
    the unpatched model's, the prefix cache on."""
    options = {"image_slots": [4]}
    exact = dict(ratio=0.1, window=2)
    for scope in ("block", "keys/values"):
        patched, runtime = dit_checks.toma_patched(pack, model, scope=scope, **exact)
        dit_checks.check_merging_only_permutes(patched, model, lambda m: sample(q21, m, True, **options))
        assert list(runtime.summary()["levels"]) == ["joint 13x19"]


def test_the_block_hands_attn_fn_a_preferred_attention_and_attn1_patch_its_image_slice(q21, model):
    """What the adapter relies on of the model's block: ``attn_fn(q, k, v, heads, preferred_attention=...)`` with
    (B, L, H, D) tensors and a ComfyAttention; ``attn1_patch`` gets (B, H, L, D) before RoPE and
    ``img_slice = [prefix_len, L]``, and its presence switches the prefix cache off."""
    block = model.model.diffusion_model.transformer_blocks[0]
    calls = []

    def attn_fn(q, k, v, heads, **kwargs):
        calls.append((q.shape, kwargs))
        return q.flatten(2)

    dim = model.model.diffusion_model.inner_dim
    x = torch.randn(1, 9, dim)
    pe = model.model.diffusion_model.pe_embedder(torch.zeros(1, 9, 3)).transpose(1, 2)
    mod = tuple((torch.zeros(1, 1, dim), torch.zeros(1, 1, dim)) for _ in range(4)) + (torch.zeros(1, 1, dim),)
    block(x, mod, pe, attn_fn, 4, {})
    heads = q21.TINY["num_attention_heads"]
    ((shape, kwargs),) = calls
    assert shape == (1, 9, heads, dim // heads)
    assert isinstance(kwargs["preferred_attention"], q21.ComfyAttention)
    seen = []

    def patch(q, k, v, pe=None, attn_mask=None, extra_options=None):
        seen.append((q.shape, extra_options["img_slice"]))
        return {}

    block(x, mod, pe, attn_fn, 4, {"patches": {"attn1_patch": [patch]}})
    assert seen == [((1, heads, 9, dim // heads), [4, 9])]
    steps = cache_steps(model, lambda: sampling.sample(
        patched_with(model, patch), conditioning(q21), torch.zeros(1, 64, *SIZE), steps=2, scheduler="simple"))
    assert steps == []  # never looked up: hooked blocks see the whole sequence every step


def patched_with(model, patch):
    clone = model.clone()
    clone.set_model_attn1_patch(patch)
    return clone


def test_a_pass_over_the_prefix_alone_runs_as_it_is(q21, pack, model):
    """Later trees (ComfyUI PR #16519) fill the cache in a pass of each block over the prefix alone: the patched
    forward runs it unpatched, counting nothing."""
    patched, runtime = dit_checks.toma_patched(pack, model)
    key = "diffusion_model.transformer_blocks.3.forward"
    forward = patched.object_patches[key]
    dm = model.model.diffusion_model
    x = torch.randn(1, 7, dm.inner_dim)
    pe = dm.pe_embedder(torch.arange(7.0)[:, None].expand(7, 3)[None]).transpose(1, 2)
    mod = tuple((torch.rand(1, 1, dm.inner_dim), torch.rand(1, 1, dm.inner_dim)) for _ in range(4)) + (
        torch.zeros(1, 1, dm.inner_dim),)
    segments = [(0, 7, torch.ones(7, 7, dtype=torch.bool).tril())]
    attn = q21.block_causal_attention(segments, {})
    block = dm.transformer_blocks[3]
    assert torch.equal(forward(x, mod, pe, attn, 7, {}), block(x, mod, pe, attn, 7, {}))
    assert not runtime.report().unmerged


def sparse_kernel(q, k, v, tau, scale=None):
    raise AssertionError("the sparse stand-in ran its kernel on a call of Qwen-Image 2.1")


def test_beside_core_sparse_attention_toma_merges_and_says_why(q21, pack, model, sent):
    """Core's Model Sparse Attention (toma_bench's stand-in of its protocol) runs every attention call of this
    model dense: its queries and keys differ in length. ToMA merges beside it, and its stats say why."""
    from toma_bench import sparse_attention

    if sparse_attention.protocol_missing():
        pytest.skip(sparse_attention.protocol_missing())
    patched, runtime = dit_checks.toma_patched(pack, model, unique_id="toma")
    sparse = sparse_attention.SparseAttention(kernel=sparse_kernel, min_tokens=64, head_dim=None)
    sample(q21, sparse.apply(patched))
    assert runtime.summary()["levels"]["joint 13x19"]["merged_tokens"] > 0
    assert sparse.calls and not sparse.sparse_calls()
    lines = [line for _, data, _ in sent if data.get("node") == "toma" for line in data["lines"]]
    assert any("runs Qwen-Image 2.1's attention dense" in line for line in lines)


# -- what the newest version of the model file changed (issue 46 part 3) --------------------------------------------

@pytest.fixture(scope="module")
def versions(q21):
    """{version: the model at that version of its file}, both from one seed (the stand-in's versions only)."""
    if q21.tree_class("comfy.supported_models") is not q21.QwenImage21Config:
        pytest.skip("this ComfyUI has a Qwen-Image 2.1 of its own: the stand-in's versions are not built")
    return {version: q21.build(seed=92, follows=version) for version in VERSIONS}


def block_calls(model):
    """(a context recording each block call of ``model`` as (block, x's rows, prefix_len, whether it returned its
    own input), the list)."""
    import contextlib

    calls, handles = [], []

    @contextlib.contextmanager
    def recording():
        for i, block in enumerate(model.model.diffusion_model.transformer_blocks):
            handles.append(block.register_forward_hook(
                lambda module, args, out, i=i: calls.append((i, args[0].shape[1], args[4], out is args[0]))))
        try:
            yield calls
        finally:
            for handle in handles:
                handle.remove()
            handles.clear()
    return recording()


def test_the_newest_version_fills_the_cache_in_a_prefix_pass_and_toma_merges_as_on_the_first(q21, pack, versions):
    """The newest model file runs each block over the prefix alone to fill the cache, then the target's rows alone
    (prefix_len 0) from the first step; its blocks add their residual into their input in place. Through a whole
    3-step run with the prefix cache on, ToMA merges the target at either version and samples the same latent at
    both (block and keys/values)."""
    prefix, tokens = TEXT + REFERENCE[0] * REFERENCE[1], SIZE[0] * SIZE[1]
    newest, first = versions[VERSIONS[-1]], versions[VERSIONS[0]]
    with block_calls(newest) as calls:
        sample(q21, newest, references=True, steps=1)
    blocks = len(newest.model.diffusion_model.transformer_blocks)
    assert sorted(calls) == sorted([(i, prefix, prefix, True) for i in range(blocks)] +
                                   [(i, tokens, 0, True) for i in range(blocks)])
    with block_calls(first) as calls:
        sample(q21, first, references=True, steps=1)
    assert calls == [(i, prefix + tokens, prefix, False) for i in range(blocks)]
    for scope in ("block", "keys/values"):
        outs = []
        for model in (first, newest):
            patched, runtime = dit_checks.toma_patched(pack, model, scope=scope)
            assert cache_steps(model, lambda: outs.append(sample(q21, patched, references=True))) == [False, True, True]
            assert runtime.summary()["levels"]["joint 13x19"]["steps"] == 3
            assert runtime.summary()["levels"]["joint 13x19"]["merged_tokens"] == 124
            assert not runtime.report().unmerged
        assert relative_l2(outs[1], outs[0]) < 1e-6 and 0 < relative_l2(outs[1], sample(q21, newest, True)) < 0.25


def test_the_malloc_graph_brackets_the_blocks_and_toma_merges_inside_it(q21, pack, versions, monkeypatch):
    """Where comfy.model_prefetch has the malloc-graph API (the Comfy Compiler, v0.34 on; here a recording stand-in
    of it), the newest model runs its blocks between malloc_graph_begin and malloc_graph_end, each after
    prefetch_queue_pop(..., malloc_scope="block"), the prefix pass under pause_malloc_graph; ToMA merges the same
    inside it. Without the API (ComfyUI v0.33.0) the model calls none of it."""
    import contextlib

    import comfy.model_prefetch

    events = []

    @contextlib.contextmanager
    def pause(sync=False):
        events.append("pause")
        yield
        events.append("resume")

    def pop(queue, device, module, dtype=None, malloc_scope=None, **kwargs):
        events.append(("pop", module is None, malloc_scope))

    model = versions[VERSIONS[-1]]
    patched, runtime = dit_checks.toma_patched(pack, model)
    without = sample(q21, patched, references=True, steps=2)
    api = {"malloc_graph_begin": lambda device: events.append("begin"), "malloc_graph_end": lambda: events.append("end"),
           "pause_malloc_graph": pause, "make_prefetch_queue": lambda queue, device, options: None,
           "prefetch_queue_pop": pop}
    for name, function in api.items():
        monkeypatch.setattr(comfy.model_prefetch, name, function, raising=False)
    with block_calls(model) as calls:
        out = sample(q21, patched, references=True, steps=2)
    blocks = len(model.model.diffusion_model.transformer_blocks)
    fill = ["begin"] + [e for _ in range(blocks) for e in (("pop", False, "block"), "pause", "resume")]
    cached = ["begin"] + [("pop", False, "block")] * blocks
    expected = fill + [("pop", True, "block"), "end"] + cached + [("pop", True, "block"), "end"]
    # ToMA pauses the graph too, around what it keeps past a block (its plans: nodes/runtime/malloc_graph.py), so the
    # model's own order is read with every pause taken out; the pauses nest, and the prefix pass pauses right after
    # each block's pop
    assert [e for e in events if e not in ("pause", "resume")] == [e for e in expected if e not in ("pause", "resume")]
    depths = list(itertools.accumulate((e == "pause") - (e == "resume") for e in events))
    assert min(depths) >= 0 and depths[-1] == 0
    filling = events[:events.index("end")]
    assert all(filling[i + 1] == "pause" for i, e in enumerate(filling) if e == ("pop", False, "block"))
    assert events.count("pause") > blocks  # the model's prefix pass, and ToMA's plans
    assert len(calls) == 3 * blocks and torch.equal(out, without)
    assert runtime.summary()["levels"]["joint 13x19"]["merged_tokens"] == 124 and not runtime.report().unmerged


class FunControlDriver:
    """What core's QwenImage21FunControlPatch does with the model's FunControl branch (comfy_extras/
    nodes_model_patch.py, PR #16519): a "dit" replace patch on every other block that keeps the first one's input,
    starts the control stream from it after that block, steps the stream with the block's own ``mod``, ``pe``,
    ``attn_fn`` and ``prefix_len`` (the args the newest model passes) and adds its skip to the block's output."""

    def __init__(self, control, tokens, strength=1.0):
        self.control, self.tokens, self.strength = control, tokens, strength
        self.layers = list(range(0, 2 * len(control.control_blocks), 2))
        self.pristine = self.stream = None
        self.streams = []  # the rows of the stream at each step of the branch

    def __call__(self, args, extra):
        index = self.layers.index(args["transformer_options"]["block_index"])
        if index == 0:
            self.pristine = args["img"].clone()  # the base block adds into its input in place
        out = extra["original_block"](args)
        if index == 0:
            self.stream = self.control.init_stream(self.pristine, self.tokens, args["prefix_len"])
        self.stream, skip = self.control.step(index, self.stream, args["mod"], args["pe"], args["attn_fn"],
                                              args["prefix_len"], args["transformer_options"])
        self.streams.append(self.stream.shape[1])
        out["img"].add_(skip, alpha=self.strength)
        return out

    def apply(self, model):
        clone = model.clone()
        for layer in self.layers:
            clone.set_model_patch_replace(self, "dit", "single_block", layer)
        return clone


def test_beside_the_fun_control_branch_toma_merges_the_base_blocks(q21, pack, versions):
    """The newest file's FunControl branch, driven as core drives it: its "dit" replace patches turn the prefix cache
    off and its control blocks run on the whole sequence with the base block's arguments. ToMA (its blocks
    object-patched) merges the base blocks' target beside it, ratio 0 samples as the branch alone, and the branch's
    stream keeps every row."""
    import comfy.ops

    from toma_bench import models

    later = importlib.import_module(q21.MODULE)
    dm = versions[VERSIONS[-1]].model.diffusion_model
    control = later.QwenImage21FunControl(num_blocks=3, inner_dim=dm.inner_dim, attention_head_dim=q21.TINY["attention_head_dim"],
                                          operations=comfy.ops.disable_weight_init)
    models.init_weights_(control, seed=5)
    tokens = torch.randn(1, SIZE[0] * SIZE[1], 129, generator=torch.Generator().manual_seed(6))
    model = versions[VERSIONS[-1]]
    driver = FunControlDriver(control, tokens)
    alone = driver.apply(model)
    out = sample(q21, alone)
    assert relative_l2(out, sample(q21, model)) > 1e-3
    assert cache_steps(model, lambda: sample(q21, alone)) == []
    assert set(driver.streams) == {TEXT + SIZE[0] * SIZE[1]}
    dit_checks.check_ratio_zero_identical(pack, alone, lambda m: sample(q21, m))
    patched, runtime = dit_checks.toma_patched(pack, alone)
    assert 0 < relative_l2(sample(q21, patched), out) < 0.25
    assert runtime.summary()["levels"]["joint 13x19"]["merged_tokens"] == 124 and not runtime.report().unmerged


def test_a_few_step_run_says_once_what_toma_does_there(q21, pack, model, caplog):
    """A run of 4 to 8 steps (a turbo LoRA's) logs once per patched model what ToMA does at few steps; a run of 9
    steps does not."""
    notice = pack.nodes.adapters.qwen_image21.FEW_STEPS_NOTICE.split("%d")[0]
    patched, _ = dit_checks.toma_patched(pack, model)
    with caplog.at_level("WARNING", logger=dit_checks.LOGGER):
        sample(q21, patched, steps=9)
        assert not [r for r in caplog.records if r.getMessage().startswith("ToMA: " + notice)]
        sample(q21, patched, steps=4)
        sample(q21, patched, steps=6)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ToMA: " + notice)]
    assert said == ["ToMA: " + pack.nodes.adapters.qwen_image21.FEW_STEPS_NOTICE % 4]
