"""The DiT adapter's pure parts (block choice, row gathers, token counts) and its refusals.

These need the pack but no DiT, so they run against the pinned tree and COMFYUI_PATH alike.
"""
import logging
import types

import pytest
import torch

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def layouts(pack):
    return pack.nodes.adapters.layout


def test_skip_rule_reproduces_the_paper_at_flux_depth(layouts):
    # FLUX.1: double blocks 5-18 of 19, single blocks 5-37 of 38 merge
    assert layouts.merged_blocks(19, layouts.TWO_STREAM) == range(5, 19)
    assert layouts.merged_blocks(38, layouts.JOINT) == range(5, 38)


@pytest.mark.parametrize("depth,group,first", [(4, "two-stream", 1), (8, "joint", 1), (24, "two-stream", 6),
                                               (38, "two-stream", 10), (2, "joint", 0), (1, "two-stream", 0)])
def test_skip_rule_scales_with_depth(layouts, depth, group, first):
    blocks = layouts.merged_blocks(depth, group)
    assert blocks == range(first, depth)
    assert abs(first / depth - layouts.SKIP_FRACTION[group]) <= 0.5 / depth


@pytest.mark.parametrize("pixels,patch,tokens", [(128, 2, 64), (27, 2, 14), (1, 2, 1), (9, 3, 3), (10, 3, 4)])
def test_latent_sides_are_padded_to_the_patch(layouts, pixels, patch, tokens):
    assert layouts.patched_side(pixels, patch) == tokens


def test_take_rows_gathers_per_batch_row(layouts):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(1, 3, 10, 4, generator=g)  # shared by the batch, as Flux's pe can be
    index = torch.stack([torch.randperm(10, generator=g)[:6] for _ in range(2)])
    out = layouts.take_rows(table, index, 2)
    assert out.shape == (2, 3, 6, 4)
    for b in range(2):
        assert torch.equal(out[b], table[0][:, index[b]])


def test_joint_index_keeps_text_and_extra_rows(layouts):
    layout = layouts.ImageLayout(h=2, w=3, extra=4)
    destinations = torch.tensor([[0, 4, 5], [1, 2, 3]])
    index = layouts.joint_index(5, layout, destinations)
    expected_extra = list(range(5 + 6, 5 + 10))
    assert index[0].tolist() == [0, 1, 2, 3, 4, 5, 9, 10] + expected_extra
    assert index[1].tolist() == [0, 1, 2, 3, 4, 6, 7, 8] + expected_extra


def test_mask_is_sliced_on_both_axes(layouts, pack):
    """A (B, L, L) mask whose entry (i, j) encodes i and j comes back as the entries of the kept pairs."""
    plan = types.SimpleNamespace(destination_tokens=lambda: torch.tensor([[2, 0], [1, 3]]))
    layout = layouts.ImageLayout(h=2, w=2, extra=1)
    L = 3 + layout.total
    code = torch.arange(L * L, dtype=torch.float32).view(L, L)
    out = layouts.merged_positions({"attn_mask": code}, 3, layout, plan)["attn_mask"]
    index = layouts.joint_index(3, layout, plan.destination_tokens())
    assert out.shape == (2, 6, 6)
    for b in range(2):
        assert torch.equal(out[b], code[index[b]][:, index[b]])


def test_nothing_positional_for_sd3_blocks(layouts):
    plan = types.SimpleNamespace(destination_tokens=lambda: torch.zeros(1, 2, dtype=torch.long))
    assert layouts.merged_positions({"img": None}, 4, layouts.ImageLayout(2, 2), plan) == {}


def test_unsupported_model_is_returned_unpatched_with_a_message(pack, caplog):
    nodes = pack.nodes.toma_nodes
    sampling = types.SimpleNamespace(percent_to_sigma=lambda p: 1.0 - p)
    model = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=torch.nn.Identity(),
                                                              model_sampling=sampling))
    assert pack.nodes.adapters.adapter_for(model) is None
    with caplog.at_level(logging.WARNING, logger="ComfyUI-ToMA"):
        out = nodes.ToMAPatchModel().patch(model, 0.5, 4, 5)[0]
    assert out is model
    assert "not supported" in caplog.text
    assert all(adapter.name in caplog.text for adapter in pack.nodes.adapters.ADAPTERS)
