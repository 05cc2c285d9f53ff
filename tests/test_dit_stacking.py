"""Two token merge nodes stacked on a DiT (Flux, Wan), and a DiT block another node replaced: the node
nearer the sampler merges where both would, as on UNets (tests/test_stacking.py); a block another node's
"dit" patch replaced stays as that node left it.
"""
import logging

import pytest
import torch

from toma_bench import comfy_host, dit_checks, models, sampling

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

LOGGER = "ComfyUI-ToMA"


@pytest.fixture(scope="module")
def built(pack):
    return {"flux": models.build_flux(seed=31), "wan": models.build_wan("t2v", seed=32)}


def sample(model, arch):
    if arch == "flux":
        conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 77, 0)
        return sampling.sample(model, conditioning, torch.zeros(1, 16, 13, 19), steps=2, scheduler="simple")
    conditioning = models.wan_conditioning(models.WAN_TINY, 1, 77, 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, 3, 12, 16), steps=2, scheduler="simple")


GRIDS = {"flux": ["double 7x10", "single 7x10"], "wan": ["video 3x6x8"]}


@pytest.mark.parametrize("arch", ["flux", "wan"])
def test_two_toma_nodes_the_one_nearer_the_sampler_merges(pack, built, arch, caplog):
    model = built[arch]
    inner, inner_runtime = dit_checks.toma_patched(pack, model, ratio=0.75)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        outer, outer_runtime = dit_checks.toma_patched(pack, inner, ratio=0.25)
    alone, _ = dit_checks.toma_patched(pack, model, ratio=0.25)

    out = sample(outer, arch)

    # the stack is the outer node alone: the inner node's patches are gone from every block it shared
    assert torch.equal(out, sample(alone, arch))
    assert sorted(outer_runtime.summary()["levels"]) == GRIDS[arch]
    assert all(v["merged_tokens"] > v["tokens"] / 2 for v in outer_runtime.summary()["levels"].values())
    assert inner_runtime.summary()["levels"] == {}
    assert set(dit_checks.dit_patches(outer)) == set(dit_checks.dit_patches(inner))
    assert "nearer the sampler, merges" in caplog.text and "in place of the ToMA node before it" in caplog.text
    # the inner node's own model is untouched by the outer node and still merges by itself
    sample(inner, arch)
    assert sorted(inner_runtime.summary()["levels"]) == GRIDS[arch]


def test_a_block_another_node_replaced_stays_as_it_left_it(pack, built, caplog):
    """A "dit" replace patch of another node (a skip-layer or caching node) keeps its block: ToMA merges
    the others and says which it left."""
    model = built["flux"].clone()
    calls = []

    def other_node(args, extras):
        calls.append(args["img"].shape[1])
        return extras["original_block"](args)

    model.set_model_patch_replace(other_node, "dit", "single_block", 1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        patched, runtime = dit_checks.toma_patched(pack, model)
    sample(patched, "flux")

    assert dit_checks.dit_patches(patched)[("single_block", 1)] is not None
    assert calls and set(calls) == {77 + 7 * 10}  # the other node's block saw every token, none merged
    assert sorted(runtime.summary()["levels"]) == GRIDS["flux"]
    assert "single_block 1 left unmerged (already patched by another node)" in caplog.text
