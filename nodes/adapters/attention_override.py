"""The attention overrides of the DiT adapters (scopes "attention" and "keys/values"): ComfyUI's attention
functions call ``transformer_options["optimized_attention_override"]`` with q, k and v after RoPE, and these merge
the image rows there (``MergedAttention``: queries, keys and values, the output unmerged; ``MergedKeysValues``: keys
and values only, nothing to unmerge). docs/architecture.md, "DiT adapters", has the design."""
import torch

from ...toma_core.attention import heads_with_key_bias, padded_head
from ..runtime import MergeRuntime
from .layout import sequence_index, take_rows, take_sequence

ATTENTION_OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's, read by wrap_attn
# The override-chain contract of later ComfyUI trees (comfy_extras/sparse_attention_history.py): an override
# carries ``attention_preprocess_v1 = (transform, previous)``, ``transform(q, k, v, heads, **kwargs)`` giving the
# (q, k, v) it hands to ``previous`` (the override it chains to; None: the attention function). Chain-auditing
# code walks it to name each transform and the provider that runs the attention; an override without it is "an
# unknown optimized-attention override" to them. Ours (MergedAttention, MergedKeysValues) carry it; they also
# change the output after (unmerge, bias channels), which the contract leaves to the override itself.

# The parameters of ComfyUI's attention functions after (q, k, v, heads), in order: positional ones are
# read by these names (Qwen-Image and Lumina 2 pass the mask by position)
ATTENTION_PARAMETERS = ("mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def attention_keywords(args: tuple, kwargs: dict) -> dict | None:
    """The keywords of an attention call given ``args`` after (q, k, v, heads) and ``kwargs``; None where
    the positional ones are more than ATTENTION_PARAMETERS names."""
    if len(args) > len(ATTENTION_PARAMETERS):
        return None
    return {**dict(zip(ATTENTION_PARAMETERS, args)), **kwargs}


def key_mask(mask, index: torch.Tensor, length: int, batch: int):
    """An attention ``mask`` whose last axis is the ``length`` keys cut to the key rows ``index`` (B, L');
    the mask itself where it is None or broadcast over the keys; False where its keys are others (the
    attention call is not the one the plan was made for). A 2-D mask is (queries, keys) unless its first
    axis is the batch (Lumina 2's key mask (B, L))."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    if mask.shape[-1] != length:
        return False
    if mask.dim() == 2 and mask.shape[0] not in (1, batch):
        mask = mask[None]
    return take_rows(mask, index, -1)


def attend(override, func, *args, **kwargs):
    """An attention call of ``override`` (MergedAttention, MergedKeysValues) on to what runs it: the override another
    patch set before ours (``previous``: a backend the user chose, which core too runs in place of a declared one);
    else the attention the model's blocks declare (``declared``: declared_attention.py), which ``wrap_attn`` does not
    hand an override; else ``func``, the global function it hands."""
    if override.previous is not None:
        return override.previous(func, *args, **kwargs)
    return (override.declared or func)(*args, **kwargs)


class MergedAttention:
    """``transformer_options["optimized_attention_override"]`` for one double-block call: ComfyUI's attention
    functions call it as ``override(func, q, k, v, heads, **kwargs)`` in place of ``func``.

    q, k, v: (B, H, L, D) with RoPE applied, L = ``length``; rows [start, start + tokens) are the image
    grid, merged by ``plan`` on (B, N, H*D) views; ``mask`` is cut to the merged sequence. The output
    (B, L', H*D) comes back with L rows: each merged token's row is copied back onto its sources (U).
    ``previous``: the override another patch had set, called in place of ``func`` (stacked); ``declared``: the
    attention the model's blocks declare, called in place of ``func`` otherwise (``attend``). ``proportional``:
    each merged key weighs as the tokens it stands for (the bias in an extra head channel, toma_core.attention).
    Anything unexpected (another layout, an exception) runs that call unmerged."""

    def __init__(self, runtime: MergeRuntime, plan, start: int, tokens: int, length: int, previous=None,
                 proportional: bool = False, declared=None):
        self.runtime, self.plan, self.previous = runtime, plan, previous
        self.start, self.tokens, self.length = start, tokens, length
        self.proportional = proportional
        self.declared = declared
        self.attention_preprocess_v1 = (self.transform, previous)  # the chain contract (ATTENTION_OVERRIDE_KEY)

    def attend(self, func, *args, **kwargs):
        return attend(self, func, *args, **kwargs)

    def fits(self, q, k, v, args: tuple, kwargs: dict) -> bool:
        """Whether this is the joint attention the plan was made for: (B, H, L, D) inputs
        (``skip_reshape``), a (B, L, H*D) output and the mask, if any, passed by name."""
        return (not args and bool(kwargs.get("skip_reshape")) and not kwargs.get("skip_output_reshape")
                and all(t.dim() == 4 and t.shape[2] == self.length for t in (q, k, v)))

    def transform(self, q, k, v, heads, **kwargs):
        """(q, k, v) as this override hands them on (``attention_preprocess_v1``): the image rows merged, with
        ``proportional`` the key bias channels added; the output it gets back is unmerged after."""
        begin, end = self.start, self.start + self.tokens

        def merged(t):
            B, H, _, D = t.shape
            image = t[:, :, begin:end].transpose(1, 2).reshape(B, self.tokens, H * D)
            rows = self.plan.merge(image).view(B, -1, H, D).transpose(1, 2)
            return torch.cat([t[:, :, :begin], rows, t[:, :, end:]], dim=2)

        mq, mk, mv = merged(q), merged(k), merged(v)
        if self.proportional:
            mq, mk, mv = heads_with_key_bias(mq, mk, mv, self.key_bias(mq))
        return mq, mk, mv

    def merged_mask(self, mask):
        if mask is None:
            return None
        index = sequence_index(self.start, self.tokens, self.length, self.plan.destination_tokens().to(mask.device))
        mask = mask[None] if mask.dim() == 2 else mask
        return take_sequence(take_sequence(mask, index, -1, self.length), index, -2, self.length)

    def unmerge(self, out):
        begin, end = self.start, self.start + self.plan.num_merged
        return torch.cat([out[:, :begin], self.plan.unmerge(out[:, begin:end]), out[:, end:]], dim=1)

    def key_bias(self, q) -> torch.Tensor:
        """(B, L') fp32: log of the tokens each key of the merged sequence stands for (0 outside the grid)."""
        B, merged = q.shape[0], self.plan.num_merged
        log_mass = self.plan.log_mass.to(q.device)
        before = log_mass.new_zeros(B, self.start)
        after = log_mass.new_zeros(B, q.shape[2] - self.start - merged)
        return torch.cat([before, log_mass, after], dim=1)

    def __call__(self, func, q, k, v, heads, *args, **kwargs):
        if not self.fits(q, k, v, args, kwargs):
            self.runtime.unmerged("attention call layout", "a double block's attention call does not have the "
                                  "layout ToMA expects; it runs unmerged")
            return self.attend(func, q, k, v, heads, *args, **kwargs)
        try:
            with self.runtime.stages.stage("merge"):
                mq, mk, mv = self.transform(q, k, v, heads, **kwargs)
                mask = self.merged_mask(kwargs.get("mask"))
            out = self.attend(func, mq, mk, mv, heads, **{**kwargs, "mask": mask})
            with self.runtime.stages.stage("unmerge"):
                if self.proportional:
                    d = q.shape[-1]
                    out = out.view(*out.shape[:2], heads, padded_head(d))[..., :d].reshape(*out.shape[:2], heads * d)
                return self.unmerge(out)
        except Exception as e:  # never crash mid-sampling: this attention call runs unmerged
            self.runtime.unmerged("merged attention failed", "merged attention failed (%s); those calls run "
                                  "unmerged", f"{type(e).__name__}: {e}")
            return self.attend(func, q, k, v, heads, *args, **kwargs)


class MergedKeysValues:
    """``transformer_options["optimized_attention_override"]`` for one block call of scope "keys/values": its
    self-attention takes keys and values from merged tokens and queries from every token, so the output
    has every token and nothing is unmerged. ComfyUI's attention functions call it as
    ``override(func, q, k, v, heads, **kwargs)`` in place of ``func``.

    The first attention call whose q, k and v all hold the ``length`` tokens of the block's sequence is its
    self-attention (Wan's and LTX-Video's cross-attention comes after it, with the text's keys); later calls
    pass. Both layouts: (B, H, L, D) with ``skip_reshape`` (Flux, HunyuanVideo, Lumina 2, Qwen-Image from
    v0.3.75) and (B, L, H*D) (Wan, LTX-Video, HiDream, Qwen-Image before). ``spans``: [(begin, tokens,
    plan)], the grids of the sequence that merge (the image or video grid; Qwen-Image-Edit's reference grids
    by plans of their own); every other token (text, leading and extra tokens) stays a key of its own.
    Keys and values alike are merged by the plan (M) from the rotated keys and the values: a merged key is
    the weighted average of its group's keys after RoPE, so with ``proportional`` a group of equal keys
    attends exactly as its tokens did unmerged (a destination's own key would stand for a group it does
    not resemble; measured on the Wan proxy: +0.4 to +0.6 dB with proportional attention, issue 34). A key
    mask is cut to the merged keys at the destinations' columns, never added: fused kernels
    (FlashAttention, SageAttention) still run. ``proportional``: each merged key weighs as the tokens it
    stands for, by the extra-channel form (toma_core.attention). ``previous``: another patch's override,
    called in place of ``func`` (stacked); ``declared``: the blocks' declared attention, else (``attend``).
    Anything unexpected runs that call unmerged, with a log line."""

    def __init__(self, runtime: MergeRuntime, spans, length: int, proportional: bool = False, previous=None,
                 declared=None):
        self.runtime, self.spans, self.length = runtime, spans, length
        self.proportional, self.previous, self.declared = proportional, previous, declared
        self.served = False  # whether the block's self-attention came through (the block checks it after)
        self.attention_preprocess_v1 = (self.transform, previous)  # the chain contract (ATTENTION_OVERRIDE_KEY)

    def transform(self, q, k, v, heads, **kwargs):
        """(q, k, v) as this override hands them on (``attention_preprocess_v1``): keys and values merged, every
        query; with ``proportional`` the key bias channels added (the output's are dropped after)."""
        axis = 2 if kwargs.get("skip_reshape") else 1
        mq, mk, mv = q, self.merged_rows(k, axis), self.merged_rows(v, axis)
        if not self.proportional:
            return mq, mk, mv
        d = q.shape[-1] if axis == 2 else q.shape[-1] // heads
        if axis == 1:
            mq, mk, mv = (t.view(*t.shape[:2], heads, d) for t in (mq, mk, mv))
        mq, mk, mv = heads_with_key_bias(mq, mk, mv, self.key_bias(q.shape[0], q.device), token_axis=axis)
        if axis == 1:
            mq, mk, mv = (t.reshape(*t.shape[:2], -1) for t in (mq, mk, mv))
        return mq, mk, mv

    def attend(self, func, *args, **kwargs):
        return attend(self, func, *args, **kwargs)

    def key_rows(self, device) -> torch.Tensor:
        """(B, L') long: the row of the full sequence whose mask column each merged key takes (a merged
        token: its destination's)."""
        pieces, cursor = [], 0
        for begin, tokens, plan in self.spans:
            destinations = plan.destination_tokens().to(device)
            B = destinations.shape[0]
            pieces += [torch.arange(cursor, begin, device=device).expand(B, -1), destinations + begin]
            cursor = begin + tokens
        pieces.append(torch.arange(cursor, self.length, device=device).expand(B, -1))
        return torch.cat(pieces, dim=1)

    def key_bias(self, batch: int, device) -> torch.Tensor:
        """(B, L') fp32: log of the tokens each merged key stands for (0 for a key of its own)."""
        pieces, cursor = [], 0
        for begin, tokens, plan in self.spans:
            pieces += [torch.zeros(batch, begin - cursor, device=device), plan.log_mass.to(device)]
            cursor = begin + tokens
        pieces.append(torch.zeros(batch, self.length - cursor, device=device))
        return torch.cat(pieces, dim=1)

    def merged_rows(self, v, axis: int):
        """v (keys or values) with each span's rows merged by its plan; ``axis``: the token axis (2: (B, H, L,
        D), 1: (B, L, C))."""
        pieces, cursor = [], 0
        for begin, tokens, plan in self.spans:
            rows = v.narrow(axis, begin, tokens)
            if axis == 2:
                B, H, _, D = v.shape
                merged = plan.merge(rows.transpose(1, 2).reshape(B, tokens, H * D)).view(B, -1, H, D).transpose(1, 2)
            else:
                merged = plan.merge(rows)
            pieces += [v.narrow(axis, cursor, begin - cursor), merged]
            cursor = begin + tokens
        pieces.append(v.narrow(axis, cursor, self.length - cursor))
        return torch.cat(pieces, dim=axis)

    def __call__(self, func, q, k, v, heads, *args, **kwargs):
        keywords = None if self.served else attention_keywords(args, kwargs)
        axis = 2 if keywords is not None and keywords.get("skip_reshape") else 1
        if keywords is None or any(t.dim() != (4 if axis == 2 else 3) or t.shape[axis] != self.length for t in (q, k, v)):
            return self.attend(func, q, k, v, heads, *args, **kwargs)
        self.served = True
        try:
            with self.runtime.stages.stage("merge"):
                mask = keywords.get("mask")
                if mask is not None:
                    mask = key_mask(mask, self.key_rows(k.device), self.length, q.shape[0])
                if mask is False:
                    self.runtime.unmerged("attention call layout", "a self-attention mask does not cover the "
                                          "block's %d tokens; those attention calls run unmerged", self.length)
                    return self.attend(func, q, k, v, heads, *args, **kwargs)
                mq, mk, mv = self.transform(q, k, v, heads, **keywords)
            if "mask" in keywords:
                keywords["mask"] = mask
            out = self.attend(func, mq, mk, mv, heads, **keywords)
            if not self.proportional:
                return out
            d = q.shape[-1] if axis == 2 else q.shape[-1] // heads
            if keywords.get("skip_output_reshape"):  # (B, H, L, e)
                return out[..., :d]
            return out.view(*out.shape[:2], heads, padded_head(d))[..., :d].reshape(*out.shape[:2], heads * d)
        except Exception as e:  # never crash mid-sampling: this attention call runs unmerged
            self.runtime.unmerged("merged attention failed", "keys/values merging failed (%s); those attention "
                                  "calls run unmerged", f"{type(e).__name__}: {e}")
            return self.attend(func, q, k, v, heads, *args, **kwargs)
