"""A DiT block another node replaced stays as that node left it (two token merge nodes stacked on a DiT:
tests/test_family_conformance.py).
"""
import logging

import pytest
import torch

import dit_checks
from toma_bench import comfy_host, models, sampling

pytestmark = [pytest.mark.comfy, pytest.mark.skipif(not comfy_host.has_current_comfy(), reason=comfy_host.CURRENT_ONLY)]

LOGGER = "ComfyUI-ToMA"


@pytest.fixture(scope="module")
def flux(pack):
    return models.build_flux(seed=31)


def sample(model):
    conditioning = models.dit_conditioning("flux", models.FLUX_TINY, 1, 77, 0)
    return sampling.sample(model, conditioning, torch.zeros(1, 16, 13, 19), steps=2, scheduler="simple")


def test_a_block_another_node_replaced_stays_as_it_left_it(pack, flux, caplog):
    """A "dit" replace patch of another node (a skip-layer or caching node) keeps its block: ToMA merges
    the others and says which it left."""
    model = flux.clone()
    calls = []

    def other_node(args, extras):
        calls.append(args["img"].shape[1])
        return extras["original_block"](args)

    model.set_model_patch_replace(other_node, "dit", "single_block", 1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        patched, runtime = dit_checks.toma_patched(pack, model)
    sample(patched)

    assert dit_checks.dit_patches(patched)[("single_block", 1)] is not None
    assert calls and set(calls) == {77 + 7 * 10}  # the other node's block saw every token, none merged
    assert sorted(runtime.summary()["levels"]) == ["joint 7x10", "two-stream 7x10"]
    assert "single_block 1 left unmerged (already patched by another node)" in caplog.text
