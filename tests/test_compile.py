"""ToMA under torch.compile, as ComfyUI's TorchCompileModel compiles a model (toma_bench.compiling): no
graph break, no frame left to eager, at most one graph per merge path in a run (docs/architecture.md,
"Under torch.compile"), no new graph in a second run, the eager output and the same plans; ToMeSD too
(its random cells hashed from a seed drawn before the model call).

Dynamo's backend "eager" traces without generating code (cheap on the CPU) and finds every break and
recompile the other backends would; one case runs "aot_eager". ComfyUI's sub-quadratic CPU attention asks
psutil for the free memory in every call, a graph break of its own in every model: the tests hold that
figure constant (compiling.constant_free_memory), as SDPA on a GPU asks nothing. The DiT families' rows
are in tests/test_family_conformance.py.
"""
import pytest
import torch

import dit_checks
from toma_bench import models, sampling

pytestmark = pytest.mark.comfy

UNET_TINY = dict(models.SD15_SMALL, model_channels=32, num_heads=2)
STEPS = 6  # the default reuse interval is 5: steps 0 and 5 choose destinations, the others refresh weights


@pytest.fixture(scope="module")
def unet():
    return models.build_unet("sd15", 0, config=UNET_TINY)


def sample_unet(model):
    conditioning = models.conditioning("sd15", 1, height=128, width=128)
    return sampling.sample(model, conditioning, torch.zeros(1, 4, 16, 16), steps=STEPS, cfg=2.0)


def test_unet_basic_node_compiles_clean(pack, unet):
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(unet, 0.5, 4, 5)
    _, report = dit_checks.check_compiles_clean(pack, patched, sample_unet)
    assert report.untimed, "stages inside the graph are not timed, and the report says so"


@pytest.mark.parametrize("scope", ["attention", "keys/values", "queries", "block"])
def test_unet_scopes_compile_clean(pack, unet, scope):
    node = pack.nodes.toma_nodes.ToMAPatchModelAdvanced()
    (patched,) = node.patch(unet, 0.5, 4, 5, scope=scope, levels="all", proportional_attention=scope != "block")
    dit_checks.check_compiles_clean(pack, patched, sample_unet)


def test_aot_eager_backend_compiles_clean(pack, unet):
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(unet, 0.5, 4, 5)
    dit_checks.check_compiles_clean(pack, patched, sample_unet, backend="aot_eager")


def test_unet_stochastic_selection_compiles_clean(pack, unet):
    # window_size 16 on the 16x16 latent's first level: one window of 256 tokens, above the exact greedy's
    # 64, so destinations are chosen by stochastic greedy (its random keys come from a seed drawn before
    # the model call, toma_core.selection)
    node = pack.nodes.toma_nodes.ToMAPatchModelAdvanced()
    (patched,) = node.patch(unet, 0.9, 16, 5)  # 26 picks of 256: a short trace
    first, report = dit_checks.check_compiles_clean(pack, patched, sample_unet)
    assert any(level.tokens > 64 for level in report.levels), "no window over 64 tokens: no stochastic selection"


def test_tomesd_compiles_clean(pack, unet):
    """ToMeSD's random cells come from the model call's seed, drawn before the call (a generator in a block
    call breaks the graph): compiled, every block call builds the plan the eager run builds, on the levels
    1/1 and 1/2."""
    (patched,) = pack.nodes.toma_nodes.ToMeSDPatchModel().patch(unet, 0.5, 2)
    runtime = pack.nodes.runtime.runtime_of(patched)
    sample_unet(patched)
    eager = runtime.report().plans
    _, report = dit_checks.check_compiles_clean(pack, patched, sample_unet)
    assert len({key.level for key in report.plans}) == 2 and report.plans.keys() == eager.keys()
    for key, plan in report.plans.items():
        assert torch.equal(plan.dst_index, eager[key].dst_index), key


def test_catome_says_what_it_does_under_compile(pack, unet, caplog):
    """CA-ToMe's merged length depends on the data (it cannot compile in one graph): where the model is
    compiled, the log and the stats say so, once; an eager run says nothing of it."""
    from toma_bench import compiling

    (patched,) = pack.nodes.toma_nodes.CAToMePatchModel().patch(unet, 0.5, max_downsample=2)
    runtime = pack.nodes.runtime.runtime_of(patched)
    with compiling.constant_free_memory():
        sample_unet(patched)
        assert not any("torch.compile" in c for c in runtime.summary()["caveats"])
        sample_unet(compiling.compiled(patched))
    said = [c for c in runtime.summary()["caveats"] if "torch.compile" in c]
    assert len(said) == 1 and "breaks the graph" in said[0]
    assert caplog.text.count("under torch.compile") == 1
