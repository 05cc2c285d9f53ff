"""Proportional attention over merged keys, in a form every fused attention kernel runs.

A merged key that stands for m tokens should weigh as m keys in the softmax (ToMe's proportional
attention): its logits get log(m) added. An additive bias would be an attention mask, which makes
PyTorch's SDPA leave FlashAttention for a slower kernel. Instead the bias rides in extra channels of
each head: the queries hold 1 in each, the keys an equal share of log(m), so softmax(q'k'^T / sqrt(d'))
equals softmax(qk^T / sqrt(d) + log m), the queries being pre-scaled by sqrt(d' / d). The values get zeros
in the extra channels, so the output's first d channels of each head are the attention's output. Heads
are padded to a multiple of 8 channels (what fused kernels want), so any attention function that takes
(B, L, heads * d) tensors, or (B, heads, L, d) ones (``skip_reshape``), and scales by 1/sqrt(d) (ComfyUI's
``optimized_attention``) runs it unchanged.
"""
import math

import torch
import torch.nn.functional as F

PAD_TO = 8


def padded_head(d: int) -> int:
    """Channels per head once the bias channel is added: d + 1 rounded up to a multiple of PAD_TO."""
    return -(-(d + 1) // PAD_TO) * PAD_TO


def heads_with_key_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, token_axis: int = 2):
    """(q', k', v') with each head's channels (the last axis) padded to padded_head(d), such that attention
    over them with the usual 1/sqrt(head channels) scale is attention over (q, k, v) with ``bias`` (B, Lk)
    added to every query's logit of each key. q, k, v: per-head tensors, tokens on ``token_axis``:
    (B, H, L, d) (Flux's layout with ``skip_reshape``: 2) or (B, L, H, d) (1). The queries hold 1 in every
    extra channel and the keys an equal share of the bias, so each tensor takes one pad or one cat."""
    d = q.shape[-1]
    e = padded_head(d)
    qh = F.pad(q * math.sqrt(e / d), (0, e - d), value=1.0)
    view = [1] * k.dim()
    view[0], view[token_axis] = bias.shape
    share = (bias * (math.sqrt(e) / (e - d))).to(k.dtype).view(view).expand(*k.shape[:-1], e - d)
    kh = torch.cat([k, share], -1)
    vh = F.pad(v, (0, e - d))
    return qh, kh, vh


def with_key_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, heads: int):
    """``heads_with_key_bias`` for (B, L, heads * d) tensors: q (B, Lq, heads * d); k, v (B, Lk, heads * d)
    -> each (B, L, heads * padded_head(d))."""
    B, Lq, C = q.shape
    Lk = k.shape[1]
    d = C // heads
    qh, kh, vh = heads_with_key_bias(q.view(B, Lq, heads, d), k.view(B, Lk, heads, d), v.view(B, Lk, heads, d),
                                     bias, token_axis=1)
    e = padded_head(d)
    return qh.reshape(B, Lq, heads * e), kh.reshape(B, Lk, heads * e), vh.reshape(B, Lk, heads * e)


def without_padding(out: torch.Tensor, heads: int, d: int) -> torch.Tensor:
    """The (B, L, heads * d) attention output inside ``out`` (B, L, heads * padded_head(d))."""
    B, L, _ = out.shape
    return out.view(B, L, heads, padded_head(d))[..., :d].reshape(B, L, heads * d)
