"""ToMA with an attention backend set on the model, before or after the node: core's "Model Attention Backend"
node (ComfyUI v0.33.0, comfy_extras/nodes_model_advanced.py) and SageAttention set the way the tree sets a
backend. Both go through ``ModelPatcher.set_model_optimized_attention``, which replaces the model's
``transformer_options["optimized_attention_override"]``; ToMA's attention overrides are set per block call in
the block's own copy of the options and chain to whatever override the model has, so whichever comes first,
ToMA merges and the backend runs the merged attention. Also: ToMA's overrides carry the override-chain
contract of later trees (``attention_preprocess_v1``), checked with toma_bench.attention_chain's audit.

Tiny random-weight models through ComfyUI's sampler: Wan 2.1 (video default: keys and values merged inside
the attention, proportional), Flux (image default: whole blocks, no override of ours; scope attention: merged
joint attention) and an SD1.5 UNet (its attention modules merge their own input).
"""
import inspect
from dataclasses import dataclass

import pytest
import torch

import dit_checks
from toma_bench import attention_chain, comfy_host, models, sampling
from toma_bench.metrics import relative_l2

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

NO_BACKEND_NODE = ("this ComfyUI has no Model Attention Backend node (ModelPatcher.set_model_optimized_attention: "
                   "ComfyUI v0.33.0 on, bash tests/setup_2026.sh)")
NO_OVERRIDE = "this ComfyUI's attention functions take no override (comfy.ldm.modules.attention.wrap_attn)"


@dataclass(frozen=True)
class Case:
    """A model (``build``, ``sample``) and how ToMA is put on it: the basic node at its defaults, or the
    Advanced node at ratio 0.5 with ``advanced`` inputs. ``override``: whether ToMA merges inside the attention
    call through an override of its own (which then chains to the backend's)."""

    build: object
    sample: object
    advanced: dict | None = None
    override: bool = False

    def toma(self, pack, model):
        if self.advanced is None:
            (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(model, -1, 0, 5)
            return patched, pack.nodes.runtime.runtime_of(patched)
        return dit_checks.toma_patched(pack, model, **self.advanced)


def sample_wan(model):
    return sampling.sample(model, models.wan_conditioning(models.WAN_TINY, 1, 40, 0), torch.zeros(1, 16, 5, 13, 19),
                           steps=2, cfg=1.0, scheduler="simple", seed=0)


def sample_flux(model):
    return sampling.sample(model, models.dit_conditioning("flux", models.FLUX_TINY, 1, 40, 0),
                           torch.zeros(1, 16, 27, 39), steps=2, cfg=1.0, scheduler="simple", seed=0)


def sample_sd15(model):
    return sampling.sample(model, models.conditioning("sd15", 1, height=256, width=256), torch.zeros(1, 4, 32, 32),
                           steps=1, cfg=1.0, seed=0)


CASES = {
    "wan-default": Case(lambda: models.build_wan("t2v", seed=1), sample_wan, override=True),
    "flux-default": Case(lambda: models.build_flux(seed=1), sample_flux),
    "flux-attention": Case(lambda: models.build_flux(seed=1), sample_flux, {"scope": "attention"}, override=True),
    "sd15-default": Case(lambda: models.build_unet("sd15", seed=3, config=models.SD15_SMALL), sample_sd15),
}


@pytest.fixture(scope="module")
def built():
    patchers = {}
    yield patchers
    patchers.clear()


@pytest.fixture
def case(request, pack, built):
    """(Case, its ModelPatcher built once)."""
    name = request.param
    if name not in built:
        built[name] = CASES[name].build()
    return CASES[name], built[name]


@pytest.fixture
def attention(pack):
    import comfy.ldm.modules.attention as attention

    if not hasattr(attention, "wrap_attn"):
        pytest.skip(NO_OVERRIDE)
    return attention


@pytest.fixture
def backend_node(attention):
    nodes_model_advanced = pytest.importorskip("comfy_extras.nodes_model_advanced")
    if not hasattr(nodes_model_advanced, "ModelAttentionBackend"):
        pytest.skip(NO_BACKEND_NODE)
    return nodes_model_advanced.ModelAttentionBackend()


class Recorder:
    """Stands in for an attention function: records the key length and the override of every call it runs
    (the options' ``optimized_attention_override``, ToMA's where ToMA merges inside the call), then runs
    ``function``."""

    def __init__(self, function):
        self.function, self.keys, self.overrides = function, [], []

    def __call__(self, q, k, v, heads, *args, **kwargs):
        self.record(k, kwargs)
        return self.function(q, k, v, heads, *args, **kwargs)

    def record(self, k, kwargs, token_axis=None):
        axis = token_axis if token_axis is not None else 2 if kwargs.get("skip_reshape") else 1
        self.keys.append(k.shape[axis])
        self.overrides.append((kwargs.get("transformer_options") or {}).get("optimized_attention_override"))


def check_merges_under(pack, case, with_backend, recorder):
    """ToMA on ``model`` under the backend ``with_backend`` (MODEL -> MODEL) put after ToMA and before it: both
    orders give the same output, changed from the backend's unpatched output as ToMA alone changes the
    model's (within a factor 2: another attention function rounds otherwise, and a near tie in choosing
    destinations may fall the other way), the stats say every block call merged, and the backend ran every
    attention call, on fewer keys."""
    spec, model = case
    toma, _ = spec.toma(pack, model)
    alone = relative_l2(spec.sample(toma), spec.sample(model))
    recorder.keys.clear()
    plain = spec.sample(with_backend(model))
    calls, unmerged_keys = len(recorder.keys), sum(recorder.keys)
    assert calls, "the backend ran no attention call of the unpatched model"
    outs = {}
    for order in ("after", "before"):
        if order == "after":
            patched, runtime = spec.toma(pack, model)
            patched = with_backend(patched)
        else:
            patched, runtime = spec.toma(pack, with_backend(model))
        recorder.keys.clear()
        outs[order] = spec.sample(patched)
        change = relative_l2(outs[order], plain)
        assert max(dit_checks.MERGED_FLOOR, alone / 2) < change < 2 * alone, (order, change, alone)
        assert not runtime.report().unmerged, (order, runtime.report().unmerged)
        assert any(level["merged_tokens"] < level["tokens"] for level in runtime.summary()["levels"].values()), order
        assert len(recorder.keys) == calls and sum(recorder.keys) < unmerged_keys, order
    assert torch.equal(outs["after"], outs["before"])


every_case = pytest.mark.parametrize("case", sorted(CASES), indirect=True)


@every_case
def test_toma_merges_with_core_attention_backend_node_after_or_before_it(pack, case, backend_node, attention,
                                                                       monkeypatch):
    """Core's Model Attention Backend node ("pytorch attention", the backend every tree has; the recorder
    stands in for the function it looks up) after ToMA and before it."""
    recorder = Recorder(attention.get_attention_function("pytorch"))
    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "pytorch", recorder)
    check_merges_under(pack, case, lambda m: backend_node.patch(m, "pytorch attention")[0], recorder)


def sage_standin(recorder):
    """A stand-in for the sageattention package's ``sageattn`` kernel (not installed here): its call signature
    as ComfyUI's ``attention_sage`` calls it (layouts "HND" (B, H, L, D) and "NHD" (B, L, H, D), ``sm_scale``,
    ``attn_mask``), computed by PyTorch's SDPA and recorded."""
    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, attn_mask=None):
        nhd = tensor_layout == "NHD"
        recorder.record(k, {}, token_axis=1 if nhd else 2)
        if nhd:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                               scale=sm_scale)
        return out.transpose(1, 2) if nhd else out
    return sageattn


@every_case
def test_toma_merges_with_sage_attention_set_as_the_backend(pack, case, attention, monkeypatch):
    """SageAttention as ComfyUI selects it: the tree's own ``attention_sage`` registered as "sage" (what the
    tree does when the package imports), its kernel a stand-in, set on the model as the backend node sets one
    (``set_model_optimized_attention``), after ToMA and before it. (The backend node itself lists only PyTorch
    and Comfy Kitchen attention in v0.33.0.)"""
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher.ModelPatcher, "set_model_optimized_attention"):
        pytest.skip(NO_BACKEND_NODE)
    if not hasattr(attention, "attention_sage"):
        pytest.skip("this ComfyUI has no SageAttention backend (comfy.ldm.modules.attention.attention_sage)")
    recorder = Recorder(None)
    kernel = sage_standin(recorder)
    monkeypatch.setattr(attention, "sageattn", kernel, raising=False)
    monkeypatch.setattr(attention, "SAGE_ATTENTION_SUPPORTS_MASK", "attn_mask" in inspect.signature(kernel).parameters)
    monkeypatch.setattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", dict(attention.REGISTERED_ATTENTION_FUNCTIONS))
    attention.REGISTERED_ATTENTION_FUNCTIONS.pop("sage", None)
    attention.register_attention_function("sage", attention.attention_sage)

    def with_sage(model):
        clone = model.clone()
        clone.set_model_optimized_attention(attention.get_attention_function("sage"))
        return clone

    check_merges_under(pack, case, with_sage, recorder)


OVERRIDE_CASES = sorted(name for name, spec in CASES.items() if spec.override)


@pytest.mark.parametrize("case", OVERRIDE_CASES, indirect=True)
def test_the_overrides_carry_the_chain_contract(pack, case, attention):
    """The audit of later trees (toma_bench.attention_chain, following comfy_extras/sparse_attention_history.py)
    identifies ToMA's override as a preprocessing step, its transform the code it runs, over the override the
    model had (here an unmarked one of the test's own: an audit names it the provider). That unmarked override,
    met alone, fails the audit: "an unknown optimized-attention override"."""
    spec, model = case
    recorder = Recorder(None)

    def unmarked(func, q, k, v, heads, *args, **kwargs):
        recorder.record(k, kwargs)
        return func(q, k, v, heads, *args, **kwargs)

    base = model.clone()
    base.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = unmarked
    patched, _ = spec.toma(pack, base)
    spec.sample(patched)
    ours = [o for o in recorder.overrides if o is not unmarked and o is not None]
    assert ours, "no attention call came through an override of ToMA's"
    overrides = pack.nodes.adapters.attention_override
    kinds = {overrides.MergedKeysValues, overrides.MergedAttention}
    for override in ours:
        assert type(override) in kinds
        found = attention_chain.audit(override)
        assert found.preprocessing
        assert found.transforms == (attention_chain.callable_identity(type(override).transform),)
        assert found.provider == attention_chain.callable_identity(unmarked)
    unknown = attention_chain.audit(unmarked)
    assert not unknown.preprocessing and unknown.provider == attention_chain.callable_identity(unmarked)


def test_the_audit_stand_in_walks_chains_as_the_later_trees_do():
    """Pairs chain outermost first down to the provider; None is ComfyUI's own attention; a contract that is not
    a pair is invalid; an override met twice is a cycle."""
    def step(q, k, v, heads, **kwargs):
        return q, k, v

    def provider(func, *args, **kwargs):
        return func(*args, **kwargs)

    def outer(func, *args, **kwargs):
        return provider(func, *args, **kwargs)

    def inner(func, *args, **kwargs):
        return func(*args, **kwargs)

    outer.attention_preprocess_v1 = (step, inner)
    inner.attention_preprocess_v1 = (provider, None)
    found = attention_chain.audit(outer)
    assert found.preprocessing and found.provider == attention_chain.DEFAULT_PROVIDER
    assert found.transforms == (attention_chain.callable_identity(step), attention_chain.callable_identity(provider))
    inner.attention_preprocess_v1 = step
    assert attention_chain.audit(outer).problem == "invalid"
    inner.attention_preprocess_v1 = (step, outer)
    assert attention_chain.audit(outer).problem == "cyclic" and not attention_chain.audit(outer).preprocessing
