"""Under the Comfy Compiler (ComfyUI v0.34 on) the pack keeps no tensor made inside a block's malloc-graph scope:
everything it keeps past a block call (plans, merge weights, rotation counts, the tables derived from a plan) is
made under the host's ``pause_malloc_graph()`` (nodes/runtime/malloc_graph.py). And a block the host replays
from a CUDA graph runs unmerged, said once in the log and the stats.

The host is a stand-in of our own (malloc_graph_host.py, after the public comfy/model_prefetch.py at 03fb330),
installed as ``comfy.model_prefetch``; the model is FLUX_TINY with its blocks run inside the graph as Qwen-Image
2.1's later model file runs its blocks. Two prompts in a row, as the crash reports had it on the second.
"""
import contextlib
import gc
import logging

import pytest
import torch

import malloc_graph_host
from dit_checks import dit_patches, toma_patched
from toma_bench import comfy_host, models, sampling

pytestmark = [pytest.mark.comfy,
              pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

HW = (16, 24)  # 8 x 12 tokens
FLUX_BLOCKS = [("double_blocks", "double_block"), ("single_blocks", "single_block")]
# ToMA's settings that keep the most past a block: plans per block with shared destinations and rotation (counts
# kept across builds), keys/values with proportional attention (log mass and destination rows derived from a plan)
SETTINGS = [{"scope": "block"}, {"scope": "keys/values", "proportional_attention": True, "plan_per_block": True,
                                 "shared_destinations": True, "rotation": "on", "reuse": 2},
            {"node": "DiToPatchModel", "ratio": 0.5, "matching_interval": 2}]
IDS = ["block", "keys-values", "dito"]


@pytest.fixture(scope="module")
def flux(pack):
    return models.build_flux(seed=3)


def prompt(model, seed):
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 16, seed)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, *HW), steps=4, scheduler="simple", seed=seed)


def two_prompts(pack, flux, host, settings):
    """The rogues of two prompts in a row through the ToMA node with ``settings``: ours (made in the pack's
    code) and the others; the runtime."""
    node = settings.get("node")
    if node is None:
        patched, runtime = toma_patched(pack, flux, **settings)
    else:
        (patched,) = pack.nodes.NODE_CLASS_MAPPINGS[node]().patch(flux, **{k: v for k, v in settings.items()
                                                                           if k != "node"})
        runtime = pack.nodes.runtime.runtime_of(patched)
    model = malloc_graph_host.blocks_in_graph(patched, host, FLUX_BLOCKS)
    for seed in (0, 1):
        prompt(model, seed)
    gc.collect()
    rogues = host.rogues()
    return [r for r in rogues if r.made_by.startswith(("nodes/", "toma_core/"))], rogues, runtime


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_nothing_of_ours_outlives_its_block_scope(pack, flux, monkeypatch, settings):
    with malloc_graph_host.installed(monkeypatch) as host:
        ours, rogues, runtime = two_prompts(pack, flux, host, settings)
    summary = runtime.summary()
    assert host.graphs == 8 and summary["levels"], "the blocks ran in the graph, and they merged"
    assert not ours, "\n".join(f"{r.made_by}: {r.op} {r.shape} in {r.scope}" for r in ours[:20])
    assert not rogues, "\n".join(f"{r.made_by}: {r.op} {r.shape} in {r.scope}" for r in rogues[:20])


@pytest.mark.parametrize("settings", SETTINGS, ids=IDS)
def test_without_the_pause_the_recorder_finds_ours(pack, flux, monkeypatch, settings):
    """The test above can fail: with the pack's pause a null context, what the pack keeps is found."""
    monkeypatch.setattr(pack.nodes.runtime.malloc_graph, "kept_past_block", contextlib.nullcontext)
    pack.nodes.runtime.malloc_graph.install()
    try:
        with malloc_graph_host.installed(monkeypatch) as host:
            ours, _, _ = two_prompts(pack, flux, host, settings)
    finally:
        monkeypatch.undo()
        pack.nodes.runtime.malloc_graph.install()
    assert ours
    assert any("merge_runtime.py" in r.made_by or "toma_core/" in r.made_by for r in ours)


def test_a_block_the_host_replays_from_a_cuda_graph_runs_unmerged_said_once(pack, flux, monkeypatch, caplog):
    """Every merged block holds a captured graph (as prefetch_queue_pop leaves a block it captured): the run is
    the unpatched model's, bit for bit, and the log and the stats say why, the log once over two prompts."""
    patched, runtime = toma_patched(pack, flux, scope="block")
    dm = flux.model.diffusion_model
    graphed = pack.nodes.runtime.malloc_graph.GRAPHED
    assert not torch.equal(prompt(patched, 0), prompt(flux, 0))
    assert graphed not in runtime.summary()["unmerged"]
    for block in [*dm.double_blocks, *dm.single_blocks]:
        monkeypatch.setattr(block, "_comfy_graph", {"graph": None, "signature": None}, raising=False)
    with malloc_graph_host.installed(monkeypatch), caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        assert torch.equal(prompt(patched, 1), prompt(flux, 1))
        summary = runtime.summary()
        assert torch.equal(prompt(patched, 2), prompt(flux, 2))
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ToMA: ToMA runs blocks unmerged that ComfyUI captures")
    steps, merged_blocks = 4, len(dit_patches(patched))  # FLUX_TINY: 4 of its 5 blocks
    assert summary["unmerged"] == {graphed: steps * merged_blocks} and not summary["levels"]
