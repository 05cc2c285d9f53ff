"""Proportional attention in an extra head channel (toma_core.attention) and the plans' token masses."""
import math

import pytest
import torch

from toma_core import plan_tiles
from toma_core.attention import padded_head, with_key_bias, without_padding


def reference_attention(q, k, v, bias, heads):
    """softmax(q k^T / sqrt(d) + bias) v, head by head, in fp64."""
    B, Lq, C = q.shape
    d = C // heads
    qh, kh, vh = (t.double().view(B, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    logits = qh @ kh.transpose(-1, -2) / math.sqrt(d) + bias.double()[:, None, None, :]
    return (logits.softmax(-1) @ vh).transpose(1, 2).reshape(B, Lq, C)


def plain_attention(q, k, v, heads):
    """What ComfyUI's attention function computes: SDPA over (B, L, heads * d), scaled by the head size."""
    B, Lq, C = q.shape
    d = C // heads
    qh, kh, vh = (t.view(B, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh).transpose(1, 2).reshape(B, Lq, C)


@pytest.mark.parametrize("d", [8, 40, 64, 128])
def test_bias_in_a_channel_equals_an_additive_logit_bias(d):
    g = torch.Generator().manual_seed(d)
    heads, B, Lq, Lk = 3, 2, 7, 5
    q, k, v = (torch.randn(B, L, heads * d, generator=g) for L in (Lq, Lk, Lk))
    bias = torch.rand(B, Lk, generator=g).mul(4).log1p()
    q2, k2, v2 = with_key_bias(q, k, v, bias, heads)
    assert q2.shape == (B, Lq, heads * padded_head(d)) and padded_head(d) % 8 == 0
    out = without_padding(plain_attention(q2, k2, v2, heads), heads, d)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, bias, heads), rtol=1e-4, atol=1e-5)
    # the bias matters: without it the output differs
    assert not torch.allclose(out, plain_attention(q, k, v, heads), atol=1e-3)


def test_zero_bias_is_plain_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 2 * 16, generator=g) for _ in range(3))
    out = without_padding(plain_attention(*with_key_bias(q, k, v, torch.zeros(1, 6), 2), 2), 2, 16)
    torch.testing.assert_close(out, plain_attention(q, k, v, 2), rtol=1e-5, atol=1e-6)


def test_log_mass_counts_the_tokens_each_destination_stands_for():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8 * 8, 16, generator=g)
    plan = plan_tiles(x, (8, 8), 4, 0.5, tau=1000.0)
    mass = plan.log_mass.exp()
    assert mass.shape == (2, plan.num_merged)
    torch.testing.assert_close(mass.sum(-1), torch.full((2,), 64.0), rtol=1e-4, atol=1e-3)  # every token once
    assert (mass >= 0.999).all()  # a destination stands at least for itself
    # edge windows (a 6x6 grid in 4x4 windows) keep fewer destinations: only live slots are returned
    edge = plan_tiles(torch.randn(1, 36, 16, generator=g), (6, 6), 4, 0.5)
    assert edge.log_mass.shape == (1, edge.num_merged)
    torch.testing.assert_close(edge.log_mass.exp().sum(), torch.tensor(36.0), rtol=1e-4, atol=1e-3)


def test_ratio_zero_plan_has_unit_mass():
    plan = plan_tiles(torch.randn(1, 16, 8), (4, 4), 4, 0.0)
    assert torch.equal(plan.log_mass, torch.zeros(1, 16))
