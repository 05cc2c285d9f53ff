"""The checks DiT tests make, written once: the conformance table (tests/test_family_conformance.py) runs
them for every family, and the family test files call them for what is a family's own, each with its own
model, its own ``sample`` and its expectations.

``pack`` is the loaded node pack (the tests' ``pack`` fixture); ``sample`` is a callable that takes a
MODEL and returns the sampled latent, the family's inputs bound in (``lambda m: sample(m, batch=2)``).
ComfyUI must already be imported (comfy_host.import_comfy), as for sampling.
"""
import copy
import logging

import torch

from toma_bench import compiling
from toma_bench.metrics import relative_l2

# merge paths of a ToMA run, a graph each under torch.compile: the first call (its plan keys new), calls
# building plans, calls reusing them, calls merging nothing (docs/architecture.md, "Under torch.compile")
MAX_GRAPHS = 4
WRAPPER = "comfyui_toma"  # the pack's wrapper key on a ModelPatcher
LOGGER = "ComfyUI-ToMA"


def toma_patched(pack, model, ratio=0.5, window=4, reuse=5, **advanced):
    """(``model`` patched by the Advanced ToMA node, its runtime): scope "auto" and a merge on every step
    unless ``advanced`` (None values dropped) says otherwise. (The basic node adds its kind's start and
    step schedule, placement.PRESETS: test_dit_attention_scope checks it against this.)"""
    nodes = pack.nodes.toma_nodes
    advanced = {k: v for k, v in advanced.items() if v is not None}
    (patched,) = nodes.ToMAPatchModelAdvanced().patch(model, ratio, window, reuse, **advanced)
    return patched, pack.nodes.runtime.runtime_of(patched)


def dit_patches(model) -> dict:
    """The block replacements on ``model``: {(kind, index): patch}."""
    return model.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})


def patch_points(model) -> set:
    """What patches ``model``'s blocks: its "dit" replace patches ((kind, index)) and its object-patched
    diffusion model attributes ("diffusion_model.layers.1.forward")."""
    return set(dit_patches(model)) | {k for k in model.object_patches if k.startswith("diffusion_model.")}


def check_input_model_unchanged(pack, model, sample, expected, where="diffusion_model"):
    """The ToMA node (ratio 0.5) patches a clone: exactly the ``expected`` patch points (patch_points)
    and the wrapper at ``where`` on the clone only; sampling the clone leaves the input's options,
    wrappers, object patches and output as they were. Returns the patched clone."""
    before_options, before_wrappers = copy.deepcopy(model.model_options), copy.copy(model.wrappers)
    before_objects, before = dict(model.object_patches), sample(model)
    patched, _ = toma_patched(pack, model)
    assert patched is not model
    assert patch_points(patched) == set(expected)
    assert patched.get_wrappers(where, WRAPPER) and not model.get_wrappers(where, WRAPPER)
    sample(patched)
    assert model.model_options == before_options and model.wrappers == before_wrappers
    assert dict(model.object_patches) == before_objects
    assert torch.equal(sample(model), before)
    return patched


def check_ratio_zero_identical(pack, model, sample, advanced=None):
    """Ratio 0 through the ToMA node and through the Advanced node (given ``advanced``, by default every
    level at block scope) samples exactly the unpatched output."""
    nodes = pack.nodes.toma_nodes
    advanced = {"scope": "block", "levels": "all"} if advanced is None else advanced
    reference = sample(model)
    for node in (nodes.ToMAPatchModel().patch(model, 0.0, 4, 5)[0],
                 nodes.ToMAPatchModelAdvanced().patch(model, 0.0, 4, 5, **advanced)[0]):
        assert torch.equal(sample(node), reference)


# The least relative L2 change ratio 0.5 makes on a tiny random model over 2 steps, where its merges reach the
# model: 1e-4, a sixth of the least measured in the conformance table (6.2e-4, HunyuanVideo at one latent frame;
# every other row and case 1.1e-3 or more, in ComfyUI v0.3.75). A change near float rounding (issue 42:
# 2.45e-6 on HunyuanVideo 1.5, with the log saying 3 of 4 blocks merge) is a merge that did not reach the model.
MERGED_FLOOR = 1e-4


def check_half_ratio_merges(patched, model, sample, levels, tokens, bound=0.1, steps=2, floor=MERGED_FLOOR):
    """``patched`` = (model, runtime) at ratio 0.5: same shape, finite, changed by more than ``floor`` and
    less than ``bound`` (relative L2); no block call ran unmerged (the run report's ``unmerged`` is empty:
    the merged path, the attention override included, ran wherever the node merges); the stats name exactly
    ``levels``, each with ``tokens`` tokens over ``steps`` steps and half of them merged (rounding per edge
    window: within 1/16)."""
    patched, runtime = patched
    out, reference = sample(patched), sample(model)
    assert out.shape == reference.shape and torch.isfinite(out).all()
    change = relative_l2(out, reference)
    assert floor < change < bound, (f"ratio 0.5 changed the output by {change:.3g} (relative L2), "
                                     f"not in ({floor}, {bound})")
    assert not runtime.report().unmerged, runtime.report().unmerged
    stats = runtime.summary()["levels"]
    assert sorted(stats) == sorted(levels)
    for level in stats.values():
        assert level["tokens"] == tokens and level["steps"] == steps
        assert abs(level["merged_tokens"] - tokens / 2) <= tokens / 16
    return out, reference


def check_merging_only_permutes(patched, model, sample):
    """Where every token of a window is a destination merging only permutes: the output matches the
    unpatched model's (relative L2 below 1e-5)."""
    out = sample(patched)
    assert relative_l2(out, sample(model)) < 1e-5
    return out


def lora_clone(model, key, seed=7):
    """A clone of ``model`` with a LoRA-like diff on ``key``, as LoraLoader makes. The diff's scale (half
    the init bound 1/sqrt(fan_in)) comes from the weight's shape, never its values: a weight patch stays
    applied to the shared model after sampling."""
    shape = model.model.state_dict()[key].shape
    diff = 0.5 * shape[1] ** -0.5 * torch.rand(shape, generator=torch.Generator().manual_seed(seed))
    clone = model.clone()
    assert set(clone.add_patches({key: (diff,)})) == {key}
    return clone


def check_no_state_leak(pack, patched, runtime, sample, other, grid):
    """A run never reuses what the run before it left: ``sample`` gives the same output after ``other``
    (a run on another grid), the first plan of each level is a new one with the same destinations, the
    plans are keyed by ``grid`` only and no layout stays in the model's options."""
    first = sample(patched)
    first_plans = {level: stats.records[0].plan.destinations for level, stats in runtime.report().levels.items()}
    assert first_plans
    other(patched)
    assert torch.equal(sample(patched), first)
    report = runtime.report()
    assert set(report.levels) == set(first_plans)
    for level, destinations in first_plans.items():
        again = report.levels[level].records[0].plan.destinations
        assert again is not destinations and torch.equal(again, destinations)
    assert {key.level.grid for key in report.plans} == {grid}
    assert pack.nodes.adapters.layout.LAYOUT_KEY not in patched.model_options.get("transformer_options", {})


def spy(seen, add=1.0, passes=()):
    """A stand-in for a block (``{"original_block": spy(seen)}``): records its inputs in ``seen``,
    returns img + ``add`` (img as is when None) and the ``passes`` inputs as given."""
    def block(inputs):
        seen.update(inputs)
        out = {"img": inputs["img"] if add is None else inputs["img"] + add}
        out.update({k: inputs[k] for k in passes})
        return out
    return block


def check_update_on_every_token(out, image_in, add=1.0):
    """Rows of U sum to 1: an update of ``add`` on the merged tokens comes back as ``add`` on every
    token, full length."""
    assert out.shape == image_in.shape
    assert torch.allclose(out, image_in + add, atol=1e-5)


def check_unet_baseline_leaves_unpatched(pack, model, node, caplog):
    """The UNet-only baselines (ToMeSD, CA-ToMe) return a DiT as it is and say why."""
    before = copy.deepcopy(model.model_options)
    cls = pack.nodes.toma_nodes.NODE_CLASS_MAPPINGS[node]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = cls().patch(model, 0.5)[0] if node == "ToMeSDPatchModel" else cls().patch(model, 0.7)[0]
    assert out is model and model.model_options == before
    assert "UNet baseline" in caplog.text


def check_comes_back_unpatched(pack, model, caplog, why):
    """The ToMA node returns ``model`` itself, its options unchanged, and logs ``why``."""
    before = copy.deepcopy(model.model_options)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        out = pack.nodes.toma_nodes.ToMAPatchModel().patch(model, 0.5, 4, 5)[0]
    assert out is model and model.model_options == before
    assert why in caplog.text


def check_compiles_clean(pack, patched, sample, backend="eager", unpatched=None):
    """``patched`` sampled eagerly, then twice compiled: no graph break, no frame skipped, at most
    MAX_GRAPHS graphs in the first run, none in the second; the eager output and the same plans.

    ``unpatched``: the compile_count of a model that breaks the graph by itself, outside its blocks; then
    ``patched`` breaks it only where and as often as that model does, leaves no more frames to eager, and adds
    at most a graph per merge path beyond the first."""
    runtime = pack.nodes.runtime.runtime_of(patched)
    with compiling.constant_free_memory():
        eager = sample(patched)
        eager_report = runtime.report()
        model = compiling.compiled(patched, backend=backend)
        with compiling.counting() as first:
            out = sample(model)
        report = runtime.report()
        with compiling.counting(fresh=False) as second:
            again = sample(model)
    assert report.levels, "nothing merged: the count would prove nothing"
    if unpatched is None:
        assert first.clean() and 1 <= first.graphs <= MAX_GRAPHS, str(first)
    else:
        compared = f"patched: {first}\nunpatched: {unpatched}"
        assert first.graph_breaks == unpatched.graph_breaks, compared
        assert first.frames_skipped <= unpatched.frames_skipped, compared
        assert unpatched.graphs <= first.graphs <= unpatched.graphs + MAX_GRAPHS - 1, compared
    assert second.graphs == 0 and not second.recompiles and second.clean(), str(second)
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    assert torch.equal(again, out)
    assert {level: (s.tokens, s.merged_tokens, s.steps) for level, s in report.levels.items()} == \
           {level: (s.tokens, s.merged_tokens, s.steps) for level, s in eager_report.levels.items()}
    for key, plan in eager_report.plans.items():
        if hasattr(plan, "destinations"):
            assert torch.equal(report.plans[key].destinations, plan.destinations), key
    return first, report


def compile_count(model, sample, backend="eager"):
    """What dynamo does (compiling.DynamoCount) while ``model``, compiled as check_compiles_clean compiles it,
    samples once."""
    with compiling.constant_free_memory(), compiling.counting() as count:
        sample(compiling.compiled(model, backend=backend))
    return count


def attention_lengths(model):
    """(``model`` with an attention override of its own that records (query, key) lengths of every attention
    call, the list they go to): the pack's override chains to it, so it sees what the attention runs on."""
    seen = []

    def record(func, q, k, v, heads, *args, **kwargs):
        axis = 2 if kwargs.get("skip_reshape") or (len(args) > 2 and args[2]) else 1
        seen.append((q.shape[axis], k.shape[axis]))
        return func(q, k, v, heads, *args, **kwargs)

    counted = model.clone()
    counted.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = record
    return counted, seen


def assert_keys_merged(unpatched, patched, tokens):
    """The (query, key) lengths of a patched run's attention calls against the unpatched run's: some call sees
    fewer keys, each such call half the grid's ``tokens`` fewer (within 1/16: rounding per edge window)."""
    assert len(patched) == len(unpatched)
    fewer = [full - merged for (_, full), (_, merged) in zip(unpatched, patched) if merged != full]
    assert fewer and all(abs(f - tokens / 2) <= tokens / 16 for f in fewer), fewer
