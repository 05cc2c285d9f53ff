"""The step caches on the fronts (toma_bench.step_caches): which calls ran, counted in a proxy-like run, and the
cost model pricing the run that happened (the real-size model called at the steps that ran, a skipped step
priced at what the cache computes instead, a stack with ToMA priced call by call).

The pricing runs in a subprocess (tests/cache_pricing_probe.py: the cost model needs ComfyUI imported with
PyTorch attention, which the in-process fixture does not choose) on a tiny Flux, so it needs a tree with Flux
(COMFYUI_PATH); the counting needs core's EasyCache and LazyCache (v0.3.64 and later).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toma_bench import comfy_host, models, sampling, step_caches
from toma_bench.gpuclock import PROFILES, call_cost
from toma_bench.oprecord import Op

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]
H200 = PROFILES["h200"]


@pytest.fixture(scope="module")
def probe():
    done = subprocess.run([sys.executable, str(REPO / "tests" / "cache_pricing_probe.py")], env=dict(os.environ),
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def seconds(ops) -> float:
    return call_cost([Op(*op) for op in ops], H200, "pipelined", "eager", fuse=False).seconds


@pytest.mark.parametrize("cache", step_caches.NAMES)
def test_a_run_with_k_of_n_calls_skipped_costs_the_calls_that_ran_and_what_the_cache_computes(probe, cache):
    ran = probe["ran"]
    unpatched, cached = probe["variants"]["unpatched"], probe["variants"][cache]
    assert len(cached["ops"]) == len(ran)  # a recorded entry per step, skipped or not
    for step, did in enumerate(ran):
        if did:  # the model's call, then the cache's bookkeeping
            assert cached["ops"][step] == unpatched["ops"][step] + probe[cache]["ran"]
        else:
            assert cached["ops"][step] == probe[cache]["skipped"]
    expected = (sum(seconds(unpatched["ops"][i] + probe[cache]["ran"]) for i, did in enumerate(ran) if did)
                + ran.count(False) * seconds(probe[cache]["skipped"]))
    assert sum(cached["call_seconds"]) == pytest.approx(expected, rel=1e-9)
    assert cached["speed_up"] == pytest.approx(sum(unpatched["call_seconds"]) / expected, rel=1e-9)
    # a skipped step is not free, and is far cheaper than a call: the speed-up is below n / (n - k), near it
    bound = len(ran) / sum(ran)
    assert 0.9 * bound < cached["speed_up"] < bound


@pytest.mark.parametrize("cache", step_caches.NAMES)
def test_a_stack_prices_tomas_calls_at_the_steps_that_ran(probe, cache):
    ran = probe["ran"]
    toma, stack = probe["variants"]["ToMA"], probe["variants"][f"{cache} + ToMA"]
    for step, did in enumerate(ran):
        assert stack["ops"][step] == (toma["ops"][step] + probe[cache]["ran"] if did else probe[cache]["skipped"])
    base = sum(probe["variants"]["unpatched"]["call_seconds"])
    expected = (sum(seconds(toma["ops"][i] + probe[cache]["ran"]) for i, did in enumerate(ran) if did)
                + ran.count(False) * seconds(probe[cache]["skipped"]))
    assert stack["speed_up"] == pytest.approx(base / expected, rel=1e-9)
    # the two multiply, but for the skipped steps' own cost, which ToMA does not shrink (on this tiny model a
    # skipped step is a few percent of a call)
    product = toma["speed_up"] * probe["variants"][cache]["speed_up"]
    assert stack["speed_up"] == pytest.approx(product, rel=0.06)
    assert stack["speed_up"] > toma["speed_up"]


def test_a_mask_for_another_number_of_steps_is_refused(probe):
    assert "4 calls ran in the proxy run, for a run of 6 steps" in probe["short_mask"]


def test_what_each_cache_computes_instead_of_a_call(probe):
    kernels = {cache: [op for op in probe[cache]["skipped"] if op[4]] for cache in step_caches.NAMES}
    # core caches: the change measure on every 8th row and column, the decision read back, the cached add
    assert [op[0] for op in kernels["LazyCache"]][-1] == "add"
    assert sum(op[5] for op in probe["LazyCache"]["skipped"]) == 3  # start, end, decision
    # TeaCache: the first block's modulation (a linear) and its rel. L1 read back; MagCache no linear of its own
    tea, mag = [op[0] for op in kernels["TeaCache"]], [op[0] for op in kernels["MagCache"]]
    assert tea.count("addmm") + tea.count("mm") > mag.count("addmm") + mag.count("mm")
    assert sum(op[5] for op in probe["TeaCache"]["skipped"]) == 1
    assert sum(op[5] for op in probe["MagCache"]["skipped"]) == 0


# -- counting which calls ran in a sampling run --------------------------------------------------------
@pytest.fixture(scope="module")
def flux(pack):
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "Flux"):
        pytest.skip("no Flux in this ComfyUI")
    return models.build_flux(seed=1)


def sample(model, steps=10):
    step_caches.clear_state(model)
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, 0)
    calls = []
    hook = model.model.diffusion_model.double_blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with step_caches.counted(model) as (ran, callback):
            out = sampling.sample(model, conditioning, torch.zeros(1, 16, 16, 16), steps=steps, scheduler="simple",
                                  callback=callback)
    finally:
        hook.remove()
    return out, ran, len(calls)


@pytest.mark.parametrize("cache, threshold", [("LazyCache", 1.0), ("EasyCache", 1.0), ("TeaCache", 2.0)])
def test_the_count_marks_the_steps_whose_blocks_ran(flux, cache, threshold):
    try:
        cached = step_caches.apply(cache, flux, threshold, "flux")
    except step_caches.CacheMissing as why:
        pytest.skip(str(why))
    _, ran, first_block_calls = sample(cached)
    assert len(ran) == 10
    assert not all(ran), f"{cache} at {threshold} skipped nothing on the tiny Flux"
    assert ran[0]  # the first call, which every cache compares with
    if cache in step_caches.CORE:
        assert ran[1]  # before their start, 0.15
    assert sum(ran) == first_block_calls  # counted at the last block, checked at the first
    _, alone, calls = sample(flux)
    assert alone == [True] * 10 and calls == 10


def test_stacked_puts_toma_after_the_cache_and_prices_toma_alone(pack, flux):
    toma = lambda m: pack.nodes.toma_nodes.ToMAPatchModel().patch(m, 0.5, 4, 5)[0]  # noqa: E731
    stacked = step_caches.Stacked("LazyCache", 0.5, "flux", toma)
    model = stacked(flux)
    assert "easycache" in model.model_options["transformer_options"]  # the cache's holder, where ToMA sees it
    assert model.get_wrappers("predict_noise", "lazycache")
    priced = stacked.cost_patch(flux)
    # the priced model runs every call (the cost model skips the calls itself), under the cache's own key, so the node
    # finds the cache there as it did in the proxy run; the proxy's model keeps the cache's wrapper
    assert priced.get_wrappers("predict_noise", "lazycache") == [step_caches.passes_through]
    assert step_caches.passes_through not in model.get_wrappers("predict_noise", "lazycache")
    assert "easycache" in priced.model_options["transformer_options"]


@pytest.mark.parametrize("name", ["TeaCache", "MagCache"])
def test_beside_a_pack_cache_the_priced_model_shows_the_cache_without_its_forward(pack, flux, name):
    """The priced model of a pack cache's stack carries the cache's options (so the node finds the cache and
    steps aside there, as in the proxy run: priced as merging nothing) and not its forward wrapper (the cost
    model skips the calls itself)."""
    toma = lambda m: pack.nodes.toma_nodes.ToMAPatchModel().patch(m, 0.5, 4, 5)[0]  # noqa: E731
    stacked = step_caches.Stacked(name, 0.06 if name == "MagCache" else 0.4, "flux", toma)
    try:
        assert "model_function_wrapper" in stacked(flux).model_options
    except step_caches.CacheMissing as why:
        pytest.skip(str(why))
    priced = stacked.cost_patch(flux)
    assert "model_function_wrapper" not in priced.model_options
    options = priced.model_options["transformer_options"]
    assert pack.nodes.runtime.step_caches.find(options).kind == name


def test_bad_cache_input_is_named():
    with pytest.raises(ValueError, match="one of EasyCache"):
        step_caches.check("FooCache", 0.2)
    with pytest.raises(ValueError, match="LazyCache threshold"):
        step_caches.Stacked("LazyCache", 0.0, "flux")
