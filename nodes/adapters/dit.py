"""What every DiT adapter shares: ComfyUI's "dit" block-replace patches around blocks that see the image
tokens of a model call (current ComfyUI only: the March-2024 tree has no DiT).

What runs merged:
- Double-stream blocks (image and text streams apart), in one of two placements (the node's ``scope``):
  - "block": the image stream x (B, N, C) is merged before the block and the block's *update* is
    unmerged onto the full-resolution stream: x + U(block(Mx) - Mx) (``TokenPlan.unmerge_update``).
    Attention and the image MLP run on merged image tokens; the text stream runs in full.
  - "attention" (the paper's placement; Flux, Chroma and HunyuanVideo double blocks): the block runs on
    full-length tokens and only its joint attention sees merged image tokens. The replace patch hands
    the block a copy of its transformer_options with ``optimized_attention_override`` set
    (``MergedAttention``): ComfyUI's attention functions (``wrap_attn``) call it with q, k, v after
    RoPE; it merges their image rows, runs the attention and copies each merged token's output back
    to its sources (U). Projections, modulation and the image MLP run at full resolution. A host
    without attention overrides gets "block", with a log message.
  "auto" is ``placement.DIT_AUTO``. Other families' blocks and all single blocks merge whole blocks.
- Single-stream blocks: the block input is [txt, image, extra]; only the image part is merged, and the
  whole block (attention and the parallel MLP) runs on the shorter sequence, as the official code does.
- Text tokens are never merged, whatever their length (read from the tensors of each call). ``extra``
  tokens after the image (reference images: Flux Kontext, Qwen-Image-Edit) are left unmerged, or, where
  the adapter asks (``merge_references``), each reference grid is merged by a plan of its own.
- Positions: RoPE tables ``pe`` hold per-token rows in the order [txt, image, extra], along the
  adapter's ``pe_axis`` (dim 2 in Flux and Chroma, dim 1 in Qwen-Image); a merged token takes its
  destination's row, and ``attn_mask`` (if any) is sliced the same way.
- Videos (HunyuanVideo, LTX-Video, Wan): the grid is frames x h x w in raster order, merged in windows of
  the strategy's shape; ``lead`` tokens before it (a reference latent, a first frame with its own
  modulation) stay unmerged like ``extra``. Families whose blocks take other per-token tables (per-token
  modulation, masks over keys only, other layouts) override ``DiTPatch.reduced_inputs`` and read their
  layout with a ``LayoutStash`` subclass.

Which blocks: the paper merges Flux double blocks 5-18 of 19 and single blocks 5-37 of 38. Other depths
skip the same fraction of each group (depth * 5/19 double blocks, depth * 5/38 single blocks, rounded
half up). Blocks that already carry a "dit" replace patch from another node are left alone, except the
patches of a token merge node before this one: stacked, the node nearer the sampler merges where both
would (as on UNets), and the earlier node keeps only the blocks left to it. ToMA and DiTo patch DiTs:
ToMeSD and CA-ToMe are UNet baselines.

Plans: one per group (double, single; each merged reference grid a group of its own), token grid and
batch layout, built at a recompute step by the group's first merged block and shared by its later blocks
(the runtime caches, the strategy's schedule says when). Selection features: the block's image input,
layer-normalised without affine, so cosine compares token content rather than the large per-channel
offsets of the residual stream.

Sequence parallelism (raylight's USP over xDiT): each rank's blocks see one contiguous slab of the model
call's tokens, the sequence padded at its end to a multiple of the ranks. Wan's blocks merge their slab
(``DiTPatch.slab_of``, the rank read from xfuser's sequence-parallel group) at scope block: the call's
windows cut to the slab (a window the slab cuts merges its part there, padding is never in a window), one
plan per slab, whole blocks, and as many tokens kept on every rank (``equal_slabs``: the slab that keeps most
at the ratio sets the length, the others keep more), since Ulysses attention exchanges equal slabs. At the
scopes that merge inside a block (keys/values, the video default; feed-forward), other families, and slabs
whose rank no group names, the model call steps aside (counted, said once, with why: SLABS_TAKE_BLOCKS).

Token grid: from the model's own input, stashed in ``transformer_options`` for the block patches by a
wrapper of the call that sees the latent (``LayoutStash``). Latents are padded to the patch size p, so a
side of H latent pixels gives ceil(H / p) tokens: odd and non-square sizes work.
"""
import inspect
import logging
import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from ...toma_core.attention import heads_with_key_bias, padded_head
from ...toma_core.plan import slab_extras
from ...toma_core.tiles import Slab, token_grid
from .. import placement
from ..runtime import Level, MergeRuntime

log = logging.getLogger("ComfyUI-ToMA")

LAYOUT_KEY = "comfyui_toma_image_layout"  # transformer_options key, set and removed by the wrapper
# set in the model call's transformer_options by the first block that sees a sequence-parallel slab it does not
# merge, so its later blocks (a joint sequence whose text share is unknown) step aside too; removed with LAYOUT_KEY
SLAB_KEY = "comfyui_toma_sequence_parallel"
# Why a block call the node would merge runs unmerged (MergeRuntime.unmerged: the run report counts them)
NO_LAYOUT = "no token layout"
TOKEN_COUNT = "token count differs from the layout"
POSITIONS = "positions do not fit"
SLAB = "sequence-parallel slab"
# why Wan's slabs step aside at the scopes that merge inside a block: raylight's attention is xfuser's, which takes
# no attention override (keys/values), and attention over every token exchanges whole slabs (feed-forward); whole
# blocks lose much more of the picture (the Wan proxy at 8 frames, 2 clips: the video default 24.52 dB, whole
# blocks r=0.5 18.99 dB, r=0.75 15.57 dB: docs/notebook.md, "Sequence parallelism"), so they are asked for
SLABS_TAKE_BLOCKS = ("merging slabs takes scope block (whole blocks: xfuser's attention takes no attention override, "
                     "which keys/values needs; whole blocks keep less of the picture, so the Advanced node's scope "
                     "block asks for them)")
SPARSE = "left to core's sparse attention"
FEED_FORWARD_COMPILED = "scope feed-forward under torch.compile"
ATTENTION_OVERRIDE_KEY = "optimized_attention_override"  # ComfyUI's, read by wrap_attn
# The override-chain contract of later ComfyUI trees (comfy_extras/sparse_attention_history.py): an override
# carries ``attention_preprocess_v1 = (transform, previous)``, ``transform(q, k, v, heads, **kwargs)`` giving the
# (q, k, v) it hands to ``previous`` (the override it chains to; None: the attention function). Chain-auditing
# code walks it to name each transform and the provider that runs the attention; an override without it is "an
# unknown optimized-attention override" to them. Ours (MergedAttention, MergedKeysValues) carry it; they also
# change the output after (unmerge, bias channels), which the contract leaves to the override itself.
# Block groups, named by their role (the names plans, stats and the merge map use):
TWO_STREAM = "two-stream"  # image and text in streams of their own, one joint attention (Flux's double blocks)
JOINT = "joint"  # one sequence of text and image tokens (Flux's single blocks, NextDiT's layers)
VIDEO = "video"  # the video tokens alone, the text through cross-attention (Wan's and LTX-Video's blocks)
# Fraction of each role's first blocks never merged: the paper's 5 of Flux's 19 double and 38 single
# blocks; whole layers over the video alone skip as Flux's single blocks do.
SKIP_FRACTION = {TWO_STREAM: 5 / 19, JOINT: 5 / 38, VIDEO: 5 / 38}


@dataclass(frozen=True)
class ImageLayout:
    """The image part of a model call's token sequence: ``lead`` tokens that are never merged (a
    reference latent before the video, a first frame with its own modulation), then the grid that
    merges, in raster order: h x w for an image, ``frames`` x h x w for a video (frame-major; a video
    keeps its 3-D grid even for one frame), followed by ``extra`` tokens: the reference images of Flux
    Kontext or Qwen-Image-Edit (each a grid in raster order, whose (h, w) ``references`` lists in
    sequence order where the stash knows them), LTX-Video keyframe guides."""

    h: int
    w: int
    extra: int = 0
    frames: int | None = None
    lead: int = 0
    references: tuple = ()

    @property
    def grid(self) -> tuple[int, ...]:
        """The token grid plans are built on: (h, w), or (frames, h, w) for a video."""
        return (self.h, self.w) if self.frames is None else (self.frames, self.h, self.w)

    @property
    def name(self) -> str:
        return "x".join(map(str, self.grid))

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def total(self) -> int:
        return self.lead + self.tokens + self.extra


def sequence_parallel_group() -> tuple[int, int] | None:
    """(rank, ranks) of this process in xfuser's sequence-parallel group, over which raylight's USP cuts a
    model call's tokens; None where xfuser is not loaded or has no group. Read from the module raylight
    loaded (the pack never imports xfuser); two host-side calls, no tensor."""
    distributed = sys.modules.get("xfuser.core.distributed")
    try:
        rank, world = int(distributed.get_sequence_parallel_rank()), int(distributed.get_sequence_parallel_world_size())
    except Exception:  # not loaded, or no group initialised
        return None
    return (rank, world) if 0 <= rank < world else None


@dataclass(frozen=True)
class SlabLayout:
    """One rank's slab of a model call's tokens under sequence parallelism, as raylight's USP cuts them:
    the call's sequence [lead, grid, extra] padded at its end to a multiple of ``world`` tokens and cut into
    ``world`` equal runs, ``rank``'s the rank-th. Read by the block patches as an ImageLayout: the slab's
    grid tokens (``tokens``, after ``lead`` tokens of the slab) merge by one plan on the call's windows cut
    to the slab (``grid``: a toma_core Slab, keeping ``extra_kept`` destinations beyond the ratio's so that
    every rank's slab merges to as many tokens); its other tokens (the call's lead and extra tokens,
    raylight's padding: ``extra`` after the grid tokens) stay tokens of their own."""

    layout: ImageLayout
    rank: int
    world: int
    extra_kept: int = 0
    references = ()

    @property
    def total(self) -> int:
        """The slab's tokens: each rank's share of the padded sequence."""
        return -(-self.layout.total // self.world)

    @property
    def begin(self) -> int:
        """The first grid token (raster index) in the slab."""
        return min(max(self.rank * self.total - self.layout.lead, 0), self.layout.tokens)

    @property
    def end(self) -> int:
        return min(max((self.rank + 1) * self.total - self.layout.lead, 0), self.layout.tokens)

    @property
    def lead(self) -> int:
        """Tokens of the slab before its grid tokens."""
        return min(max(self.layout.lead - self.rank * self.total, 0), self.total)

    @property
    def tokens(self) -> int:
        return self.end - self.begin

    @property
    def extra(self) -> int:
        return self.total - self.lead - self.tokens

    @property
    def grid(self) -> Slab:
        return Slab(self.layout.grid, self.begin, self.end, self.extra_kept)

    @property
    def name(self) -> str:
        return f"{self.layout.name} tokens {self.begin}-{self.end}"


@lru_cache(maxsize=64)
def equal_slabs(layout: ImageLayout, world: int, window_size: int, temporal_window: int,
                ratio: float) -> tuple[SlabLayout, ...]:
    """Every rank's SlabLayout of a model call of ``layout`` cut over ``world`` ranks, with the destinations
    each keeps beyond ``ratio``'s so that all merge to as many tokens (toma_core.plan.slab_extras); ValueError
    where a slab cannot (one without grid tokens, or too few)."""
    slabs = [SlabLayout(layout, rank, world) for rank in range(world)]
    if any(s.tokens == 0 for s in slabs):
        raise ValueError("a rank's slab holds no video tokens to merge")
    grids = tuple(token_grid(s.grid, window_size, temporal_window) for s in slabs)
    extras = slab_extras(grids, tuple(s.total - s.tokens for s in slabs), ratio)
    return tuple(SlabLayout(layout, rank, world, extra) for rank, extra in enumerate(extras))


def patched_side(pixels: int, patch: int) -> int:
    """Tokens along one side of a latent of ``pixels`` padded to the patch size."""
    return -(-int(pixels) // patch)


def take_rows(t: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """Per batch row, the rows ``index`` of ``t`` along ``dim``.

    t: (Bt, ..., L, ...) with Bt 1 or B; index: (B, L') long -> (B, ..., L', ...)."""
    B, L = index.shape
    dim = dim % t.dim()
    t = t.expand(B, *t.shape[1:])
    view = [B] + [1] * (t.dim() - 1)
    view[dim] = L
    size = list(t.shape)
    size[dim] = L
    return t.gather(dim, index.view(view).expand(size))


def joint_index(txt_len: int, layout: ImageLayout, destinations: torch.Tensor, references=()) -> torch.Tensor:
    """(B, L') long: for each token of the merged sequence [txt, merged image, extra], the row of the
    full sequence [txt, image, extra] whose position it takes. destinations: (B, N') raster index of
    each merged token's destination (MergePlan.destination_tokens); references: the same for the
    leading grids of ``layout.references`` that were merged by plans of their own (None: kept whole)."""
    if not references:
        return sequence_index(txt_len + layout.lead, layout.tokens, txt_len + layout.total, destinations)
    B, dev = destinations.shape[0], destinations.device
    start = txt_len + layout.lead
    rows, offset = [torch.arange(start, device=dev).expand(B, -1), destinations + start], start + layout.tokens
    for (h, w), merged in zip(layout.references, references):
        rows.append(torch.arange(offset, offset + h * w, device=dev).expand(B, -1) if merged is None
                    else merged + offset)
        offset += h * w
    rows.append(torch.arange(offset, txt_len + layout.total, device=dev).expand(B, -1))
    return torch.cat(rows, dim=1)


def sequence_index(start: int, tokens: int, length: int, destinations: torch.Tensor) -> torch.Tensor:
    """(B, L') long: for each token of a merged sequence, the row of the full sequence of ``length``
    tokens whose position it takes, where the full sequence holds a grid of ``tokens`` tokens from row
    ``start`` on and the merged one holds the grid's merged tokens there instead; rows before and after
    the grid (text, unmerged image tokens) keep their own. destinations: (B, N') raster index of each
    merged token's destination in the grid (MergePlan.destination_tokens)."""
    B, dev = destinations.shape[0], destinations.device
    before = torch.arange(start, device=dev).expand(B, -1)
    after = torch.arange(start + tokens, length, device=dev).expand(B, -1)
    return torch.cat([before, destinations + start, after], dim=1)


def take_sequence(t, index: torch.Tensor, dim: int, length: int):
    """``take_rows`` of ``t`` along ``dim`` where that axis is the full sequence of ``length`` tokens;
    ``t`` itself where it is broadcast along it (size 1: one modulation vector or mask row for every
    token) or None."""
    if t is None or t.shape[dim] != length:
        return t
    return take_rows(t, index, dim)


def merged_positions(args: dict, txt_len: int, layout: ImageLayout, plan, pe_axis: int = 2,
                     reference_plans=()) -> dict:
    """``pe`` (its tokens along ``pe_axis``: Flux (Bp, 1, L, ...), Qwen-Image (Bp, L, 1, ...)) and
    ``attn_mask`` (..., L, L) cut down to the merged sequence; {} when the block has neither (SD3).
    ``reference_plans``: the plans of the leading reference grids (None: kept whole)."""
    pe, mask = args.get("pe"), args.get("attn_mask")
    if pe is None and mask is None:
        return {}
    device = (pe if pe is not None else mask).device
    references = [None if p is None else p.destination_tokens().to(device) for p in reference_plans]
    index = joint_index(txt_len, layout, plan.destination_tokens().to(device), references)
    out = {}
    if pe is not None:
        out["pe"] = take_rows(pe, index, pe_axis)
    if mask is not None:
        mask = mask[None] if mask.dim() == 2 else mask
        out["attn_mask"] = take_rows(take_rows(mask, index, -2), index, -1)
    return out


def positions_fit(args: dict, txt_len: int, layout: ImageLayout, pe_axis: int = 2) -> bool:
    """Whether pe (tokens along ``pe_axis``) and attn_mask cover exactly [txt, image, extra] (another
    patch may have changed them)."""
    full = txt_len + layout.total
    pe, mask = args.get("pe"), args.get("attn_mask")
    pe_fits = pe is None or (pe.dim() > pe_axis and pe.shape[pe_axis] == full)
    return pe_fits and (mask is None or tuple(mask.shape[-2:]) == (full, full))


class LayoutStash:
    """Wrapper of the call that turns the latent into tokens (Flux: DIFFUSION_MODEL, SD3: APPLY_MODEL):
    puts the call's ImageLayout into its transformer_options for the block patches, and takes it out
    again afterwards. ``target`` is the wrapped function, whose signature names the arguments;
    ``patch_size`` the model's; a family whose latent is laid out otherwise overrides ``layout``."""

    def __init__(self, target, patch_size, runtime: MergeRuntime | None = None):
        self.signature = inspect.signature(target)
        self.patch = patch_size
        self.runtime = runtime  # for the notices of families whose calls can lack a layout

    def layout(self, call: dict) -> ImageLayout | None:
        """The call's ImageLayout; None unless the latent is an image: (B, C, H, W), or a single frame
        (B, C, 1, H, W) as Qwen-Image's Wan-VAE latents are."""
        x = call.get("x")
        if not torch.is_tensor(x) or not (x.dim() == 4 or (x.dim() == 5 and x.shape[2] == 1)):
            return None
        refs = tuple((patched_side(r.shape[-2], self.patch), patched_side(r.shape[-1], self.patch))
                     for r in call.get("ref_latents") or ())
        return ImageLayout(patched_side(x.shape[-2], self.patch), patched_side(x.shape[-1], self.patch),
                           sum(h * w for h, w in refs), references=refs)

    def __call__(self, executor, *args, **kwargs):
        try:
            call = self.signature.bind(*args, **kwargs).arguments
        except TypeError:  # a host whose signature changed: blocks find no layout and run unmerged
            return executor(*args, **kwargs)
        # Lumina 2's NextDiT takes transformer_options among its **kwargs
        options = call.get("transformer_options", (call.get("kwargs") or {}).get("transformer_options"))
        # BaseModel._apply_model hands the extra conds (attention_mask, ref_latents, ...) among its **kwargs
        layout = self.layout({**(call.get("kwargs") or {}), **call})
        if not isinstance(options, dict) or layout is None:
            return executor(*args, **kwargs)
        options[LAYOUT_KEY] = layout
        # on the runtime too, for blocks called without transformer_options (TeaCache's and MagCache's own
        # forward_orig); the previous one back after a nested call
        previous = None if self.runtime is None else self.runtime.model_call
        if self.runtime is not None:
            self.runtime.model_call = options
        try:
            return executor(*args, **kwargs)
        finally:
            options.pop(LAYOUT_KEY, None)
            options.pop(SLAB_KEY, None)
            if self.runtime is not None:
                self.runtime.model_call = previous


def splice(seq: torch.Tensor, ranges, parts) -> torch.Tensor:
    """``seq`` (B, L, C) with each of the ascending token ranges [begin, end) replaced by its part."""
    pieces, cursor = [], 0
    for (begin, end), part in zip(ranges, parts):
        pieces += [seq[:, cursor:begin], part]
        cursor = end
    pieces.append(seq[:, cursor:])
    return torch.cat(pieces, 1)


def attention_override_supported() -> bool:
    """Whether this ComfyUI's attention functions call ``transformer_options["optimized_attention_override"]``
    (``wrap_attn``; current ComfyUI)."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return False
    return hasattr(attention, "wrap_attn")


def attention_only(scope: str, family: str) -> bool:
    """Whether double blocks run only their attention on merged tokens for ``scope`` (a resolved
    placement: placement.resolve); "attention" on a host without attention overrides falls back to whole
    blocks, with a log message naming ``family``."""
    return scope == placement.ATTENTION and overrides_attention(scope, family)


def keys_values_only(scope: str, family: str) -> bool:
    """Whether blocks run whole with only the keys and values of their self-attention merged, for ``scope``
    (a resolved placement); "keys/values" on a host without attention overrides falls back to whole
    blocks, with a log message naming ``family``."""
    return scope == placement.KEYS_VALUES and overrides_attention(scope, family)


def overrides_attention(scope: str, family: str) -> bool:
    """Whether this host runs ``scope``, a placement inside the attention call; if not, the log says that
    ``family`` merges whole blocks instead."""
    if attention_override_supported():
        return True
    log.warning("ToMA: this ComfyUI has no attention override (comfy.ldm.modules.attention.wrap_attn); "
                "%s merges whole blocks (scope block) instead of scope %s", family, scope)
    return False


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


class MergedAttention:
    """``transformer_options["optimized_attention_override"]`` for one double-block call: ComfyUI's attention
    functions call it as ``override(func, q, k, v, heads, **kwargs)`` in place of ``func``.

    q, k, v: (B, H, L, D) with RoPE applied, L = ``length``; rows [start, start + tokens) are the image
    grid, merged by ``plan`` on (B, N, H*D) views; ``mask`` is cut to the merged sequence. The output
    (B, L', H*D) comes back with L rows: each merged token's row is copied back onto its sources (U).
    ``previous``: the override another patch had set, called in place of ``func`` (stacked).
    ``proportional``: each merged key weighs as the tokens it stands for (the bias in an extra head
    channel, toma_core.attention). Anything unexpected (another layout, an exception) runs that call
    unmerged."""

    def __init__(self, runtime: MergeRuntime, plan, start: int, tokens: int, length: int, previous=None,
                 proportional: bool = False):
        self.runtime, self.plan, self.previous = runtime, plan, previous
        self.start, self.tokens, self.length = start, tokens, length
        self.proportional = proportional
        self.attention_preprocess_v1 = (self.transform, previous)  # the chain contract (ATTENTION_OVERRIDE_KEY)

    def attend(self, func, *args, **kwargs):
        if self.previous is None:
            return func(*args, **kwargs)
        return self.previous(func, *args, **kwargs)

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
            with self.runtime.stage("merge"):
                mq, mk, mv = self.transform(q, k, v, heads, **kwargs)
                mask = self.merged_mask(kwargs.get("mask"))
            out = self.attend(func, mq, mk, mv, heads, **{**kwargs, "mask": mask})
            with self.runtime.stage("unmerge"):
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
    called in place of ``func`` (stacked). Anything unexpected runs that call unmerged, with a log line."""

    def __init__(self, runtime: MergeRuntime, spans, length: int, proportional: bool = False, previous=None):
        self.runtime, self.spans, self.length = runtime, spans, length
        self.proportional, self.previous = proportional, previous
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
        if self.previous is None:
            return func(*args, **kwargs)
        return self.previous(func, *args, **kwargs)

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
            with self.runtime.stage("merge"):
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


@dataclass(frozen=True)
class MergedSpan:
    """Scope feed-forward's block call under way: its plan, the grid's tokens [start, start + tokens) of its
    sequence of ``length``."""

    plan: object
    start: int
    tokens: int
    length: int


@dataclass(frozen=True)
class BlockCall:
    """One merged block call, as a family's ``DiTPatch.reduced_inputs`` is given it (one value: a new field
    touches no override). ``args``: the block's arguments (full length); ``txt_len``: the text tokens of
    the joint sequence (0 where the text is elsewhere); ``layout``: the call's ImageLayout; ``plan``: the
    image grid's plan; ``reference_plans``: the plans of the leading reference grids of
    ``layout.references`` (None: kept whole; empty for families without reference grids)."""

    args: dict
    txt_len: int
    layout: ImageLayout
    plan: object
    reference_plans: tuple = ()


class DiTPatch:
    """The block patches of one patched DiT clone (signature of ComfyUI's "dit" replace patches:
    ``fn(args, {"original_block": fn}) -> dict`` with full-length tokens in and out).

    A family whose blocks see another layout or other per-token inputs subclasses it and overrides what
    differs: ``fits`` (whether a call's inputs cover its tokens as the family lays them out) and
    ``reduced_inputs`` (those inputs cut to the merged sequence), or the class attributes below.
    attention_only: double blocks run whole on full-length tokens with only their joint attention merged
    (``MergedAttention``). keys_values: every merged block runs whole with only the keys and values of its
    self-attention merged (``MergedKeysValues``). proportional: where keys merge inside the attention call
    (those two), each merged key weighs as the tokens it stands for. feed_forward (scope feed-forward): the
    block runs whole on every token, the submodules it names on merged tokens (``merged_forward``).

    Beside core's Model Sparse Attention node (``MergeRuntime.sparse_min_tokens``), a block whose attention
    sequence has at least that node's ``min_tokens`` runs unmerged unless the scope keeps its attention whole
    (feed-forward): merged tokens would hand the node's kernel queries, keys and values it must run dense
    (keys/values: shapes that differ; the other scopes: fewer tokens than its ``min_tokens``, or not its
    routing's picture). Shorter blocks merge: that node runs them dense (``leaves_attention_to_sparse``).

    Block identity: each block's patch is bound to its block (``family.BlockPatch``, or the object-patched
    forward made for it), which reaches ``MergeRuntime.plan`` as ``block``: with per-block plans each block
    plans for itself (and with shared destinations, to the destinations its group's first block chose)."""

    pe_axis = 2  # the token axis of the RoPE table ``pe`` (Flux, Chroma: (B, 1, L, ...))
    merges_slabs = False  # whether ``block`` merges each rank's slab under sequence parallelism (slab_of)
    merge_references = False  # whether the reference grids of ImageLayout.references merge, each by its own plan
    image_first = False  # the joint sequence is [image, txt] (HunyuanVideo's flipped_img_txt), not [txt, image]
    # submodules of each merged block whose forward is object-patched too (companion_forward makes it)
    companions: tuple[str, ...] = ()

    def __init__(self, runtime: MergeRuntime, attention_only: bool = False, keys_values: bool = False,
                 proportional: bool = False, feed_forward: tuple[str, ...] = ()):
        self.runtime = runtime
        self.attention_only = attention_only
        self.keys_values = keys_values
        self.proportional = proportional
        self.feed_forward = feed_forward  # scope feed-forward: the block's submodules that run merged
        self.taken_from: dict[str, list] = {}  # group -> runtimes of earlier token merge nodes whose blocks this took
        self.around: MergedSpan | None = None  # scope feed-forward: the block call under way's merge

    def read_model(self, dm) -> None:
        """Read from the diffusion model being patched what its blocks' layout depends on (a family whose
        token order differs between ComfyUI trees sets it here; by default nothing does)."""

    def took(self, group: str, previous: MergeRuntime) -> None:
        """Note that blocks of ``group`` patched by the earlier token merge node ``previous`` merge here
        instead: each run that merges the group tells ``previous`` (its stats name this node)."""
        if previous not in self.taken_from.setdefault(group, []):
            self.taken_from[group].append(previous)

    def plan_for(self, group: str, tokens: torch.Tensor, grid: tuple[int, ...], options: dict, block=None):
        """The plan of ``group``'s grid (or a toma_core Slab of it) for this call of ``block`` (its identity:
        per-block plans), or None."""
        level = (Level(group, grid.shape, slab=(grid.begin, grid.end, grid.extra)) if isinstance(grid, Slab)
                 else Level(group, tuple(grid)))
        for previous in self.taken_from.get(group, ()):
            previous.leave(level, options, lambda: f"the {self.runtime.name} node nearer the sampler",
                           "took its blocks")
        return self.runtime.plan(level, block, tokens, lambda: F.layer_norm(tokens, tokens.shape[-1:]), options)

    def pe_axis_of(self, args: dict) -> int:
        """The token axis of this call's RoPE table (a family whose tables changed layout reads it here)."""
        return self.pe_axis

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether the call's per-token inputs (pe, attn_mask) cover exactly its ``txt_len`` text and
        ``layout`` tokens (another patch, or another ComfyUI, may have changed them); ``group``: the
        block group of the call (TWO_STREAM, JOINT, VIDEO)."""
        return positions_fit(args, txt_len, layout, self.pe_axis_of(args))

    def call_options(self, args: dict, extras: dict | None = None) -> dict | None:
        """The transformer_options of the model call a block call belongs to, the layout in them: the
        block's own, else those handed beside ``original_block`` (Wan's copy of forward_orig in TeaCache
        and MagCache), else the model call's, stashed on the runtime by the LayoutStash (a cache node's own
        forward_orig calls the blocks without them); None, counted, where none has a layout."""
        for options in (args.get("transformer_options"), (extras or {}).get("transformer_options"),
                        self.runtime.model_call):
            if isinstance(options, dict) and LAYOUT_KEY in options:
                return options
        self.runtime.unmerged(NO_LAYOUT, "%s runs blocks unmerged that find no token layout, neither in their "
                              "transformer_options nor from their model call (a latent ToMA does not read, or a node "
                              "that replaced the diffusion model's forward)", self.runtime.name)
        return None

    def with_options(self, args: dict, options: dict) -> dict:
        """``args`` with the model call's ``options`` (``call_options``) under the block's own, where the
        caller passed none or others without the layout (an empty default): the merging code reads the
        sampling step from them."""
        own = args.get("transformer_options")
        if own is options:
            return args
        return {**args, "transformer_options": {**options, **own} if isinstance(own, dict) else options}

    def tokens_fit(self, tokens: int, expected: int, options: dict,
                   why: str = "ToMA merges the slabs of Wan's blocks only") -> bool:
        """Whether a block call's ``tokens`` are the ``expected`` ones of its layout; where not, why it runs
        unmerged is counted: fewer is a sequence-parallel slab (raylight's USP gives each rank one contiguous
        slab of the sequence, the last one padded) that this family does not merge (``why``; Wan's blocks
        merge theirs: ``slab_of``), for which ToMA steps aside for the whole model call; more is another
        patch's tokens."""
        if options.get(SLAB_KEY) or tokens < expected:
            options[SLAB_KEY] = True
            self.runtime.unmerged(SLAB, "%s steps aside: the blocks see a slab of their model call's tokens (%d of "
                                  "%d: sequence parallelism, e.g. raylight's USP), and %s; this model runs "
                                  "unmerged", self.runtime.name, tokens, expected, why)
            return False
        if tokens != expected:
            self.runtime.unmerged(TOKEN_COUNT, "%s runs a block unmerged: it has %d tokens where its layout has %d "
                                  "(another patch's tokens)", self.runtime.name, tokens, expected)
            return False
        return True

    def slab_of(self, tokens: int, layout: ImageLayout, options: dict) -> SlabLayout | None:
        """This rank's SlabLayout of a block call holding ``tokens`` of its model call's ``layout.total``, where
        xfuser's sequence-parallel group names the rank and the tokens are its slab as raylight cuts them
        (``equal_slabs``: every rank's slab merging to as many tokens); else None, the call counted and the
        model call's blocks stepping aside (``tokens_fit``), with why."""
        group, strategy = sequence_parallel_group(), self.runtime.strategy
        if not hasattr(strategy, "window_size"):
            why = f"{strategy.name} does not merge sequence-parallel slabs (ToMA's windows do)"
        elif group is None:
            why = "no sequence-parallel group of xfuser names the rank, so ToMA cannot tell which slab this is"
        elif tokens != -(-layout.total // group[1]):
            why = f"they are not one of {group[1]} equal slabs, as raylight cuts them"
        else:
            try:
                return equal_slabs(layout, group[1], strategy.window_size, strategy.temporal_window,
                                   strategy.ratio)[group[0]]
            except ValueError as e:
                why = f"the slabs cannot merge to equal lengths ({e})"
        self.tokens_fit(tokens, layout.total, options, why)
        return None

    def slab_call(self, args: dict, run, slab: SlabLayout, block=None) -> dict:
        """A block call over one rank's ``slab`` at scope block: its grid tokens merged, the block run whole on
        the merged slab (as long on every rank: Ulysses attention exchanges fewer tokens), its update
        unmerged."""
        return self.whole_block_call(VIDEO, args, run, slab.lead, 0, slab, block)

    def positions_fit_or_count(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """``fits``, with the call counted as unmerged where it does not."""
        if self.fits(args, group, txt_len, layout):
            return True
        self.runtime.unmerged(POSITIONS, "%s runs %s blocks unmerged whose per-token inputs (positions, masks, "
                              "modulation) do not cover their tokens as ToMA expects (another patch changed them)",
                              self.runtime.name, group)
        return False

    def whole_blocks_unless(self, passed: bool, double: bool = False) -> None:
        """Say once that blocks called without transformer_options (a cache node's own forward_orig) merge whole
        blocks where the node's scope merges inside their attention (``double``: a double block, which scope
        attention merges there): no attention override would reach it."""
        if not passed and ((self.attention_only and double) or self.keys_values):
            self.runtime.caveat("blocks are called without transformer_options (a cache node's own forward_orig), "
                                "which would drop the attention override; they merge whole blocks (scope block)"
                                + (", without proportional attention" if self.proportional else ""))

    def double_block(self, args: dict, extras: dict, block=None) -> dict:
        """Image stream [lead, image, extra] (B, N + E, C) merged; text stream (B, L, C) or None passes whole."""
        run, img, txt = extras["original_block"], args["img"], args.get("txt")
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout, passed = options[LAYOUT_KEY], isinstance(args.get("transformer_options"), dict)
        txt_len = 0 if txt is None else txt.shape[1]
        if (not self.tokens_fit(img.shape[1], layout.total, options)
                or not self.positions_fit_or_count(args, TWO_STREAM, txt_len, layout)):
            return run(args)
        args = self.with_options(args, options)
        if self.attention_only and passed:
            return self.attention_merged_call(args, run, txt_len, layout, block)
        self.whole_blocks_unless(passed, double=True)
        return self.merged_call(TWO_STREAM, args, run, layout.lead, txt_len, layout, block, passed)

    def single_block(self, args: dict, extras: dict, block=None) -> dict:
        """Joint sequence [txt, lead, image, extra] ([lead, image, extra, txt] with ``image_first``): the
        image part merged, the rest whole."""
        run, x = extras["original_block"], args["img"]
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout = options[LAYOUT_KEY]
        txt_len = x.shape[1] - layout.total
        if (not self.tokens_fit(min(x.shape[1], layout.total), layout.total, options)
                or not self.positions_fit_or_count(args, JOINT, txt_len, layout)):
            return run(args)
        start = layout.lead + (0 if self.image_first else txt_len)
        passed = isinstance(args.get("transformer_options"), dict)
        self.whole_blocks_unless(passed)
        return self.merged_call(JOINT, self.with_options(args, options), run, start, txt_len, layout, block, passed)

    def block(self, args: dict, extras: dict, block=None) -> dict:
        """A block over one sequence of video tokens [lead, video, extra] (B, L, C) (LTX-Video, Wan): the
        grid merged; the text reaches it through cross-attention and passes whole, and a call the layout
        does not account for runs unmerged, counted."""
        run, img = extras["original_block"], args["img"]
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout = options[LAYOUT_KEY]
        if not torch.is_tensor(img):
            self.runtime.unmerged(TOKEN_COUNT, "%s runs a block unmerged whose tokens are not one tensor",
                                  self.runtime.name)
            return run(args)
        if self.merges_slabs and img.shape[1] < layout.total and not options.get(SLAB_KEY):
            if self.keys_values or self.feed_forward:
                self.tokens_fit(img.shape[1], layout.total, options, SLABS_TAKE_BLOCKS)
                return run(args)
            slab = self.slab_of(img.shape[1], layout, options)
            if slab is None or not self.positions_fit_or_count(args, VIDEO, 0, slab):
                return run(args)
            return self.slab_call(self.with_options(args, options), run, slab, block)
        if (not self.tokens_fit(img.shape[1], layout.total, options)
                or not self.positions_fit_or_count(args, VIDEO, 0, layout)):
            return run(args)
        passed = isinstance(args.get("transformer_options"), dict)
        self.whole_blocks_unless(passed)
        return self.merged_call(VIDEO, self.with_options(args, options), run, layout.lead, 0, layout, block, passed)

    def reduced_inputs(self, call: BlockCall) -> dict:
        """The block's per-token inputs besides the tokens (``pe``, ``attn_mask``), cut to the merged
        sequence, once per plan and model call (TokenPlan.derived). A family whose blocks take other per-token
        inputs overrides this."""
        args, pe_axis = call.args, self.pe_axis_of(call.args)
        return call.plan.derived("positions", (call.txt_len, call.layout, pe_axis),
                                 (args.get("pe"), args.get("attn_mask"), *call.reference_plans),
                                 lambda: merged_positions(args, call.txt_len, call.layout, call.plan, pe_axis,
                                                          call.reference_plans))

    def reference_plans(self, group: str, seq: torch.Tensor, begin: int, layout: ImageLayout, options: dict,
                        block=None):
        """[((begin, end), plan or None)] for the reference grids of ``layout`` from ``begin`` in ``seq``."""
        out = []
        for k, (h, w) in enumerate(layout.references if self.merge_references else ()):
            end = begin + h * w
            out.append(((begin, end), self.plan_for(f"{group} reference {k + 1}", seq[:, begin:end], (h, w), options,
                                                    block)))
            begin = end
        return out

    def attention_merged_call(self, args: dict, run, txt_len: int, layout: ImageLayout, block=None) -> dict:
        """Run the double block on its full-length streams with its joint attention on merged image
        tokens: the plan of the grid [lead, lead + tokens) of ``args["img"]`` goes to a MergedAttention
        in the block's own copy of transformer_options, chained to any override already there."""
        img, options = args["img"], args["transformer_options"]
        if self.leaves_attention_to_sparse(txt_len + layout.total):
            return run(args)
        plan = self.plan_for(TWO_STREAM, img[:, layout.lead:layout.lead + layout.tokens], layout.grid, options, block)
        if plan is None:
            return run(args)
        start = layout.lead + (0 if self.image_first else txt_len)
        override = MergedAttention(self.runtime, plan, start, layout.tokens, txt_len + layout.total,
                                   options.get(ATTENTION_OVERRIDE_KEY), self.proportional)
        return run({**args, "transformer_options": {**options, ATTENTION_OVERRIDE_KEY: override}})

    def keys_values_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                         block=None) -> dict:
        """Run the block whole on ``args["img"]`` with the keys and values of its self-attention merged: the
        grid tokens [start, start + layout.tokens) of ``args["img"]`` (and the reference grids after them,
        with ``merge_references``) plan the merge, and a MergedKeysValues in the block's own copy of
        transformer_options (chained to any override already there) applies it inside the attention call,
        whose sequence is the block's text and image tokens ([txt, image] unless ``image_first``)."""
        seq, options, end = args["img"], args["transformer_options"], start + layout.tokens
        plan = self.plan_for(group, seq[:, start:end], layout.grid, options, block)
        if plan is None:
            return run(args)
        references = self.reference_plans(group, seq, end, layout, options, block)
        shift = txt_len if group == TWO_STREAM and not self.image_first else 0  # where the image stream sits
        spans = [(start + shift, layout.tokens, plan)] + [(b + shift, e - b, p) for (b, e), p in references
                                                          if p is not None]
        override = MergedKeysValues(self.runtime, spans, txt_len + layout.total, self.proportional,
                                    options.get(ATTENTION_OVERRIDE_KEY))
        out = run({**args, "transformer_options": {**options, ATTENTION_OVERRIDE_KEY: override}})
        if not override.served:
            self.runtime.unmerged("no self-attention call", "%s blocks called no self-attention over their %d tokens "
                                  "through ComfyUI's attention functions; their keys and values ran unmerged", group,
                                  txt_len + layout.total)
        return out

    def leaves_attention_to_sparse(self, length: int) -> bool:
        """Whether this block call, whose attention runs over ``length`` tokens, runs unmerged because core's
        Model Sparse Attention node takes that attention (see the class docstring); said once in the log and
        the stats, with the calls ToMA merges, and counted."""
        floor = self.runtime.sparse_min_tokens
        if floor is None:
            return False
        if self.feed_forward:
            self.runtime.caveat("core's Model Sparse Attention is on this model: its kernel takes the "
                                "self-attention over every token (scope feed-forward keeps it whole); ToMA merges "
                                f"only the {' and '.join(self.feed_forward)} of each block")
            return False
        self.runtime.caveat(f"core's Model Sparse Attention is on this model: its kernel takes the attention of "
                            f"blocks of at least {floor:,} tokens, which ToMA leaves whole (merged, they would "
                            f"reach it in shapes it runs dense); ToMA merges the blocks of fewer tokens, whose "
                            f"attention that node runs dense")
        if length < floor:
            return False
        self.runtime.unmerged(SPARSE, "%s leaves blocks of %d tokens unmerged to core's sparse attention",
                              self.runtime.name, length)
        return True

    def feed_forward_call(self, group: str, args: dict, run, start: int, layout: ImageLayout, block=None) -> dict:
        """Run the block whole on ``args["img"]``, the submodules ``feed_forward`` names on its grid tokens
        [start, start + layout.tokens) merged (``merged_forward`` reads the plan from ``around``)."""
        if self.runtime.compiled_call:
            self.runtime.unmerged(FEED_FORWARD_COMPILED, "%s: scope feed-forward does not merge under torch.compile "
                                  "(compiled, ComfyUI v0.3.64 traced Wan's feed-forward without its patched forward and "
                                  "ran it unmerged without a word, unlike eager); those blocks run unmerged. Use scope "
                                  "keys/values or block to merge compiled", self.runtime.name)
            return run(args)
        seq, options = args["img"], args["transformer_options"]
        plan = self.plan_for(group, seq[:, start:start + layout.tokens], layout.grid, options, block)
        if plan is None:
            return run(args)
        self.around = MergedSpan(plan, start, layout.tokens, seq.shape[1])
        try:
            return run(args)
        finally:
            self.around = None

    def merged_forward(self, name: str, original):
        """The forward of the block's submodule ``name`` around its unpatched ``original`` (bound), for
        scope feed-forward: in a block call that merges (``around``), its tokens (the first argument, the
        block's sequence) merged, its output unmerged onto every token."""
        patch = self

        def forward(module, x, *args, **kwargs):
            around = patch.around
            if around is None or not torch.is_tensor(x) or x.dim() != 3 or x.shape[1] != around.length:
                return original(x, *args, **kwargs)
            begin, end = around.start, around.start + around.tokens
            with patch.runtime.stage("merge"):
                merged = splice(x, [(begin, end)], [around.plan.merge(x[:, begin:end])])
            y = original(merged, *args, **kwargs)
            stop = begin + around.plan.num_merged
            with patch.runtime.stage("unmerge"):
                return splice(y, [(begin, stop)], [around.plan.unmerge(y[:, begin:stop])])

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def merged_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                    block=None, inside_attention: bool = True) -> dict:
        """Run the block on ``args["img"]`` with its grid tokens [start, start + layout.tokens) merged (and
        the reference grids after them, with ``merge_references``); return the full-length result with
        the block's update of the merged tokens unmerged onto them. ``keys_values``: the block runs whole,
        only its self-attention's keys and values merged (``keys_values_call``), unless ``inside_attention`` is
        false (the block's caller passes no transformer_options, so no override would reach its attention)."""
        attended = args["img"].shape[1] + (txt_len if group == TWO_STREAM else 0)  # the attention's sequence
        if self.leaves_attention_to_sparse(attended):
            return run(args)
        if self.feed_forward:
            return self.feed_forward_call(group, args, run, start, layout, block)
        if self.keys_values and inside_attention:
            return self.keys_values_call(group, args, run, start, txt_len, layout, block)
        return self.whole_block_call(group, args, run, start, txt_len, layout, block)

    def whole_block_call(self, group: str, args: dict, run, start: int, txt_len: int, layout: ImageLayout,
                         block=None) -> dict:
        """``merged_call`` at scope block: the whole block on merged tokens, its update unmerged."""
        seq, options, end = args["img"], args["transformer_options"], start + layout.tokens
        plan = self.plan_for(group, seq[:, start:end], layout.grid, options, block)
        if plan is None:
            return run(args)
        references = self.reference_plans(group, seq, end, layout, options, block)
        spans = [((start, end), plan)] + [(r, p) for r, p in references if p is not None]
        call = BlockCall(args, txt_len, layout, plan, tuple(p for _, p in references))

        with self.runtime.stage("merge"):
            merged = [p.merge(seq[:, b:e]) for (b, e), p in spans]
            inputs = {"img": splice(seq, [r for r, _ in spans], merged), **self.reduced_inputs(call)}
        out = run({**args, **inputs})
        with self.runtime.stage("unmerge"):
            y, ranges, shift = out["img"], [], 0  # where each merged span sits in the shorter output
            for ((b, e), _), m in zip(spans, merged):
                ranges.append((b - shift, b - shift + m.shape[1]))
                shift += e - b - m.shape[1]
            img = splice(y, ranges, [p.unmerge_update(seq[:, b:e], m, y[:, ob:oe])
                                     for ((b, e), p), m, (ob, oe) in zip(spans, merged, ranges)])
        return {**out, "img": img}


OPTIONS_PARAMETER = "transformer_options"


def forward_mismatch(forward, leading: tuple[str, ...]) -> str | None:
    """None where a block ``forward`` (unbound) takes ``leading`` first, ``transformer_options`` by name
    and nothing else it must be given (what an object-patched forward passes on), else why not, in words."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    rest = parameters[len(leading):]
    if (tuple(p.name for p in parameters[:len(leading)]) == leading
            and any(p.name == OPTIONS_PARAMETER for p in rest)
            and all(p.kind is inspect.Parameter.VAR_KEYWORD
                    or (p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL)
                    for p in rest)):
        return None
    return (f"its blocks take ({', '.join(p.name for p in parameters)}), not ({', '.join(leading)}, then "
            f"{OPTIONS_PARAMETER} and optional ones) as ToMA passes them on")


def blocks_after(depth: int, fraction: float) -> range:
    """Indices of the blocks of a group of ``depth`` blocks that merge when the first ``fraction`` of them
    never do (rounded half up)."""
    return range(int(depth * fraction + 0.5), depth)


def merged_blocks(depth: int, group: str) -> range:
    """Indices of the blocks of a group of ``depth`` blocks that merge, at the paper's Flux fractions
    (``group``: TWO_STREAM, JOINT or VIDEO)."""
    return blocks_after(depth, SKIP_FRACTION[group])
