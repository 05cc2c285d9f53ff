"""Qwen-Image 2.1's model file as later versions have it: the stand-in (toma_bench.qwen_image21_first follows the
first version, b806797) with what changed, in classes of its own, so that either version can be built
(``qwen_image21.build(follows=...)``; the newest is the default and what ``installed()`` puts at
comfy.ldm.qwen_image21.model).

Read from public copies of Comfy-Org/ComfyUI's comfy/ldm/qwen_image21/model.py, one file at a time: zoidypuh/ComfyUI
at f737b1d5fe4f44cb5bc1b9d0414a8c49cf0ed8e8 (prefix pass, in-place residual, malloc-graph bracketing) and, the
newest, feffi/ComfyUI at FOLLOWS (the same with PR #16519's Fun ControlNet merged: its control classes, the "dit"
replace patch's args carrying ``mod``, ``attn_fn`` and ``prefix_len``, the block's cached keys released inside its
allocation scope). Our code, written after that structure:

- The prefix cache is filled by a pass of each block over the prefix alone (its own block-causal attention over
  the text and reference segments, under ``pause_malloc_graph``); the target's rows then run by themselves from the
  first step on, attending to [the prefix's keys just stored, the target] (``prefix_cached_attention``): the blocks
  see ``prefix_len`` 0 on every step where the cache is on.
- A block adds its residual into its input in place (``addcmul_`` on the rows of each modulation), and clamps
  float16 in place.
- The blocks run between ``malloc_graph_begin`` and ``malloc_graph_end``, each after ``prefetch_queue_pop(...,
  malloc_scope="block")`` (the Comfy Compiler, v0.34 on); here only where ``comfy.model_prefetch`` has those
  functions (looked up at each call, so a test's stand-in of the API is honoured): ComfyUI v0.33.0 has none, and
  a CPU run never enters a graph.
- ``QwenImage21FunControl``: the Fun ControlNet's branch (core's ``QwenImage21FunControlPatch`` in
  comfy_extras/nodes_model_patch.py drives it: a stream of block copies started from the embedded sequence, a skip
  added after every other base block, through "dit" replace patches, which turn the prefix cache off).
"""
import contextlib

import torch
import torch.nn as nn

from . import qwen_image21_first as first
from .qwen_image21_first import (ComfyAttention, PrefixCache, _modulated_norm, _split_rows,  # noqa: F401
                           attention, block_causal_attention, prefix_cache_key, prefix_cached_attention)
# (names the real module has, which packs import from it: block_causal_attention, _split_rows, ...)

FOLLOWS = "dd85c0c61865080444635c1ab2264f64cd8013ce"  # feffi/ComfyUI, comfy/ldm/qwen_image21/model.py


try:
    import comfy.model_prefetch as model_prefetch
except ImportError:  # a tree before the prefetch queues
    model_prefetch = None


def host_prefetch(name: str):
    """``comfy.model_prefetch``'s function ``name``, or None where the host has no such function (v0.33.0 has no
    malloc graph) or no such module; read at each call (a plain attribute read, which torch.compile traces)."""
    return getattr(model_prefetch, name, None)


def pause_malloc_graph():
    """``comfy.model_prefetch.pause_malloc_graph()`` where the host has it, else a context that does nothing."""
    pause = host_prefetch("pause_malloc_graph")
    return pause() if pause is not None else contextlib.nullcontext()


def _gated_residual_(x, y, gate, prefix_len):
    """x += y * gate, in place: the target's rows with its gate, the prefix's with the t = 0 one."""
    prefix_gate, target_gate = gate
    x[:, prefix_len:].addcmul_(y[:, prefix_len:], target_gate)
    if prefix_len:
        x[:, :prefix_len].addcmul_(y[:, :prefix_len], prefix_gate)
    return x


class QwenImage21TransformerBlock(first.QwenImage21TransformerBlock):
    """The block with its residual added into its input in place."""

    def forward(self, x, mod, pe, attn_fn, prefix_len, transformer_options={}):
        scale1, gate1, scale2, gate2, zero = mod
        x = _gated_residual_(x, self.attn(_modulated_norm(self.img_norm1, x, scale1, prefix_len, zero), pe, attn_fn,
                                          prefix_len, transformer_options), gate1, prefix_len)
        x = _gated_residual_(x, self.img_mlp(_modulated_norm(self.img_norm2, x, scale2, prefix_len, zero)), gate2,
                             prefix_len)
        if x.dtype == torch.float16:
            x.clamp_(-65504, 65504)
        return x


class QwenImage21FunControlBlock(QwenImage21TransformerBlock):
    def __init__(self, dim, num_attention_heads, attention_head_dim, mlp_ratio=3, eps=1e-6, fused_mlp=True,
                 first=False, dtype=None, device=None, operations=None):
        super().__init__(dim, num_attention_heads, attention_head_dim, mlp_ratio, eps, fused_mlp, dtype=dtype,
                         device=device, operations=operations)
        if first:
            self.before_proj = operations.Linear(dim, dim, dtype=dtype, device=device)
        self.after_proj = operations.Linear(dim, dim, dtype=dtype, device=device)


class QwenImage21FunControl(nn.Module):
    """The Fun ControlNet's branch (VACE-like): block copies over a stream started from the embedded sequence with
    the control latents in the target's rows; each step's skip is added after one base block."""

    def __init__(self, num_blocks=16, control_in_dim=129, inner_dim=4096, attention_head_dim=128, mlp_ratio=3,
                 eps=1e-6, fused_mlp=True, dtype=None, device=None, operations=None):
        super().__init__()
        self.control_img_in = operations.Linear(control_in_dim, inner_dim, dtype=dtype, device=device)
        self.control_blocks = nn.ModuleList([
            QwenImage21FunControlBlock(inner_dim, inner_dim // attention_head_dim, attention_head_dim, mlp_ratio, eps,
                                       fused_mlp, first=i == 0, dtype=dtype, device=device, operations=operations)
            for i in range(num_blocks)])

    def init_stream(self, x, control, prefix_len):
        joint = torch.zeros_like(x)
        joint[:, prefix_len:] = self.control_img_in(control)
        return self.control_blocks[0].before_proj(joint) + x

    def step(self, index, c, mod, pe, attn_fn, prefix_len, transformer_options={}):
        block = self.control_blocks[index]
        c = block(c, mod, pe, attn_fn, prefix_len, transformer_options)
        return c, block.after_proj(c)


VERSIONS = (first.FOLLOWS, FOLLOWS)  # the commits of the model file the stand-in can follow, oldest first


def check_version(follows: str | None) -> None:
    if follows is not None and follows not in VERSIONS:
        raise ValueError(f"follows must be one of {', '.join(VERSIONS)} (or None: the newest), got {follows!r}")


class QwenImage21Transformer2DModel(first.QwenImage21Transformer2DModel):
    """The model with the prefix pass, the in-place blocks and the malloc-graph bracketing; ``follows`` (a
    ``unet_config`` entry only the stand-in has) = first.FOLLOWS builds the first version's blocks and forward
    instead, under this one class, the one the family's declaration names."""

    def __init__(self, *args, follows=None, **kwargs):
        check_version(follows)
        self.follows = follows or FOLLOWS
        self.block_class = first.QwenImage21TransformerBlock if self.follows == first.FOLLOWS else QwenImage21TransformerBlock
        super().__init__(*args, **kwargs)

    def _forward(self, x, timesteps, context, ref_latents=None, image_slots=None, transformer_options={}, **kwargs):
        if self.follows == first.FOLLOWS:
            return super()._forward(x, timesteps, context, ref_latents, image_slots, transformer_options, **kwargs)
        B, _, H, W = x.shape
        dtype = x.dtype
        ref_latents, image_slots = list(ref_latents or []), list(image_slots or [])
        hidden_states, pe, segments, prefix_len, temb, mod, patches, blocks_replace, cache, cached = self._start(
            x, timesteps, context, ref_latents, image_slots, transformer_options)
        if cache is not None and not cached:  # the prefix runs by itself, block by block, to fill the cache
            prefix_states, hidden_states = hidden_states[:, :prefix_len], hidden_states[:, prefix_len:]
            prefix_pe, pe = pe[:, :prefix_len], pe[:, prefix_len:]
            prefix_len = 0

        transformer_options["total_blocks"] = len(self.transformer_blocks)
        transformer_options["block_type"] = "single"
        graph_begin, graph_end = host_prefetch("malloc_graph_begin"), host_prefetch("malloc_graph_end")
        queue = None
        if graph_begin is not None:
            queue = host_prefetch("make_prefetch_queue")(list(self.transformer_blocks), x.device, transformer_options)
            graph_begin(x.device)
        for i, block in enumerate(self.transformer_blocks):
            if graph_begin is not None:
                host_prefetch("prefetch_queue_pop")(queue, x.device, block, dtype, malloc_scope="block")
            transformer_options["block_index"] = i
            if cache is not None:
                if not cached:
                    with pause_malloc_graph():
                        prefix_attn = block_causal_attention(segments[:-1], transformer_options, cache, i,
                                                             prefix_states.shape[1])
                        prefix_states = block(prefix_states, mod, prefix_pe, prefix_attn, prefix_states.shape[1],
                                              transformer_options)
                prefix_k, prefix_v = cache.take(i, x.device, dtype, B).unbind(1)
                if cached:
                    cache.prefetch(i + 1, x.device, dtype)
                attn_fn = prefix_cached_attention(prefix_k, prefix_v, transformer_options)
            else:
                attn_fn = block_causal_attention(segments, transformer_options, cache, i, prefix_len)
            if ("single_block", i) in blocks_replace:
                def block_wrap(args, block=block, attn_fn=attn_fn):
                    return {"img": block(args["img"], mod, args["pe"], attn_fn, prefix_len, args["transformer_options"])}
                args = {"img": hidden_states, "vec": temb, "pe": pe, "mod": mod, "attn_fn": attn_fn,
                        "prefix_len": prefix_len, "transformer_options": transformer_options}
                hidden_states = blocks_replace[("single_block", i)](args, {"original_block": block_wrap})["img"]
            else:
                hidden_states = block(hidden_states, mod, pe, attn_fn, prefix_len, transformer_options)
            for p in patches.get("single_block", []):
                hidden_states = p({"img": hidden_states, "x": x, "block_index": i,
                                   "transformer_options": transformer_options})["img"]
            if cache is not None:  # the cached keys released inside the block's allocation scope
                del attn_fn, prefix_k, prefix_v

        if graph_begin is not None:
            host_prefetch("prefetch_queue_pop")(queue, x.device, None, malloc_scope="block")
            graph_end()
        hidden_states = self.proj_out(self.norm_out(hidden_states[:, prefix_len:], temb[:-1]))
        return hidden_states.transpose(1, 2).reshape(B, self.out_channels, H, W)
