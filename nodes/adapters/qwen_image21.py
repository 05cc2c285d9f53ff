"""Qwen-Image 2.1 (its declaration: QWEN_IMAGE21 in families.py; ComfyUI v0.37.0 on): every block is one sequence
[prefix, target], and the target's tokens merge (docs/architecture.md, "DiT adapters", says how); the prefix stays whole.

Layout: the prefix is the text with the reference images spliced in at their slots; it is causal (text segments
attend causally, each reference to everything before its end), modulated from t = 0, and its keys and values are
the same at every step, so the model caches them for the sampling run (``prefix_cache``, the QwenImage21Cache
node's options) and from the second step runs the target's rows only. The model switches that cache off while
anything hooks its blocks ("dit" replace patches, ``attn1_patch``, ...), so ToMA hooks none: each block's
``forward(x, mod, pe, attn_fn, prefix_len, transformer_options)`` is object-patched, as Krea 2's blocks are, and
the cache keeps working beside it. ``x`` (B, prefix_len + N, C), with prefix_len 0 on a cached step; ``pe``
(1, L, 1, ...) one RoPE row per token (tokens on dim 1), a merged token taking its destination's; ``mod`` one
modulation per sample (the prefix's row and the target's), which passes whole; ``attn_fn`` the model's attention
closure for the block: block-causal over the whole sequence (it also stores the prefix's keys and values), or,
on a cached step, the target's queries over [cached prefix keys, target keys]. Both take q, k, v (B, L, H, D)
after RoPE and slice the target's queries from row prefix_len on, so a shorter target passes through them: the
prefix's keys and values, cached or not, are never merged, and the target attends to [prefix, merged target].

Scopes: "block" (the default) runs each merged block on [prefix, merged target] and unmerges its update.
"keys/values" runs the block whole and wraps its ``attn_fn`` (``PrefixedKeysValues``): the target's keys and
values merge, its queries and the prefix stay whole. Proportional attention is not honoured there: its extra key
channels would reach the cached prefix keys, which keep the head width. Core's Model Sparse Attention runs every
attention call of this model dense (its queries and keys differ in length: the target's queries see the prefix's
keys too; the text segments' do too), so ToMA merges beside it (said once).

Few steps: a run of at most FEW_STEPS (a turbo LoRA's 4 to 8) is said once per patched model, with what ToMA does
there (FEW_STEPS_NOTICE); the merging is the same as at 40 steps but for the short-run rule (a new plan every step
at scope auto), which the runtime logs beside it.

Which blocks: one group of whole layers over the joint sequence, like Flux's single blocks: 28 of the 32.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward(x, timesteps, context, ref_latents, image_slots,
transformer_options)``, which sees the latent (B, 64, H, W): one token per latent pixel. Later trees (ComfyUI PR
#16519) fill the cache in a pass of each block over the prefix alone (x the prefix, prefix_len its length): that
call has no target and runs as it is, uncounted; the target's rows then run by themselves (prefix_len 0) from the
first step, and each block adds its residual into its input in place (the merged call hands it a merged copy, never
the model's own rows).
"""
import torch

from ..placement import KEYS_VALUES
from .dit import DiTPatch, forward_mismatch
from .layout import JOINT, LAYOUT_KEY, ImageLayout, LayoutStash

# What the model passes its blocks, in order: the patched forward passes them on.
BLOCK_PARAMETERS = ("x", "mod", "pe", "attn_fn", "prefix_len")
PATCH_SIZE = 1  # latent pixels per token (the VAE's 16x16 patches are the latent's 64 channels)
NO_PROPORTIONAL = ("proportional attention is not honoured on Qwen-Image 2.1 with scope keys/values (its extra key "
                   "channels would reach the prefix keys the model caches): merged keys weigh as one")
# A turbo LoRA samples Qwen-Image 2.1 in 4 to 8 steps (its 40 by default): said once per patched model where the run
# has at most this many steps (read from its sigmas; the LoRA itself cannot be told from the weights' patches)
FEW_STEPS = 8
FEW_STEPS_NOTICE = ("Qwen-Image 2.1 in %d steps (a turbo LoRA samples in 4 to 8): the model computes its prefix "
                    "(text, references) once per run from its cache, which ToMA leaves on, and ToMA merges only the "
                    "target, so each step saves what it saves at 40 steps; with fewer steps each merged step's error "
                    "weighs more: if details suffer, lower the ratio (0.3) or start merging later (start_percent)")
BESIDE_SPARSE = ("core's Model Sparse Attention runs Qwen-Image 2.1's attention dense (its queries and keys differ in "
                 "length: the target attends to the prefix too), so ToMA merges its blocks beside it")


class QwenImage21LayoutStash(LayoutStash):
    """The target grid of a Qwen-Image 2.1 call: the latent (B, 64, H, W); the reference latents belong to the
    prefix, which never merges."""

    def layout(self, call: dict) -> ImageLayout | None:
        x = call.get("x")
        if not torch.is_tensor(x) or x.dim() != 4:
            return None
        return ImageLayout(x.shape[-2], x.shape[-1])


class PrefixedKeysValues:
    """A block's ``attn_fn`` with the target's keys and values merged (scope keys/values): called as the model calls
    it, ``(q, k, v, heads, preferred_attention=...)`` with (B, L, H, D) tensors after RoPE, L = ``start`` prefix rows
    + ``tokens`` target rows; it hands ``attn_fn`` the prefix's keys and values whole and the target's merged by
    ``plan`` (M), the queries whole. A call of another length runs as it is, counted."""

    def __init__(self, runtime, attn_fn, start: int, tokens: int, plan):
        self.runtime, self.attn_fn, self.start, self.tokens, self.plan = runtime, attn_fn, start, tokens, plan
        self.served = False

    def merged(self, t):
        B, _, H, D = t.shape
        rows = self.plan.merge(t[:, self.start:].flatten(2)).view(B, -1, H, D)
        return torch.cat([t[:, :self.start], rows], dim=1)

    def __call__(self, q, k, v, heads, preferred_attention=None):
        if self.served or any(t.dim() != 4 or t.shape[1] != self.start + self.tokens for t in (q, k, v)):
            return self.attn_fn(q, k, v, heads, preferred_attention=preferred_attention)
        self.served = True
        with self.runtime.stages.stage("merge"):
            mk, mv = self.merged(k), self.merged(v)
        return self.attn_fn(q, mk, mv, heads, preferred_attention=preferred_attention)


class QwenImage21Patch(DiTPatch):
    """The object-patched forward of Qwen-Image 2.1's blocks."""

    pe_axis = 1

    def read_model(self, dm) -> None:
        if self.proportional and self.scope == KEYS_VALUES:
            self.runtime.caveat(NO_PROPORTIONAL)

    def block_forward(self, original, block=None):
        """A forward for the block ``block`` (its identity, for per-block plans) whose unpatched forward is
        ``original`` (bound): [prefix, target] with the target grid merged; a call the layout does not account for
        runs unpatched, counted."""
        patch = self

        def forward(layer, x, mod, pe, attn_fn, prefix_len, transformer_options={}):
            def run(args):
                return {"img": original(args["img"], mod, args["pe"], args["attn_fn"], prefix_len,
                                        args["transformer_options"])}

            args = {"img": x, "pe": pe, "attn_fn": attn_fn, "transformer_options": transformer_options}
            if prefix_len >= x.shape[1]:  # a pass over the prefix alone: nothing of the target to merge
                return run(args)["img"]
            options = patch.call_options(args)
            if options is None:
                return run(args)["img"]
            total = patch.runtime.steps.total
            if total is not None and total <= FEW_STEPS:
                patch.runtime.notice(FEW_STEPS_NOTICE, total, key=FEW_STEPS_NOTICE)
            layout = options[LAYOUT_KEY]
            if (not patch.tokens_fit(x.shape[1] - prefix_len, layout.total, options)
                    or not patch.positions_fit_or_count(args, JOINT, prefix_len, layout)):
                return run(args)["img"]
            return patch.merged_call(JOINT, patch.with_options(args, options), run, prefix_len, prefix_len, layout,
                                     block)["img"]

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def keys_values_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                         block=None) -> dict:
        """The block whole, its ``attn_fn`` given the target's keys and values merged (PrefixedKeysValues)."""
        seq, options = args["img"], args["transformer_options"]
        plan = self.plan_for(group, seq[:, start:start + layout.tokens], layout.grid, options, block)
        if plan is None:
            return run(args)
        attn_fn = PrefixedKeysValues(self.runtime, args["attn_fn"], start, layout.tokens, plan)
        out = run({**args, "attn_fn": attn_fn})
        if not attn_fn.served:
            self.runtime.unmerged("no self-attention call", "%s blocks called their attention with other than their "
                                  "%d tokens; their keys and values ran unmerged", group, seq.shape[1])
        return out

    def leaves_attention_to_sparse(self, length: int) -> bool:
        """Never: core's sparse attention runs this model's attention dense (see the module docstring)."""
        if self.runtime.sparse_min_tokens is not None:
            self.runtime.caveat(BESIDE_SPARSE)
        return False


def unserved(dm) -> str | None:
    """Why the diffusion model ``dm`` is not served, or None: its blocks must take what the patched forward passes
    on (forward_mismatch)."""
    return forward_mismatch(type(dm.transformer_blocks[0]).forward, BLOCK_PARAMETERS)
