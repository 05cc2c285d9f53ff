"""Token layouts and sequence helpers of the DiT adapters: where a model call's image (or video) grid lies in a
block's sequence (``ImageLayout``; a sequence-parallel rank's slab, ``SlabLayout``), the wrapper that stashes it
for the blocks (``LayoutStash``), the block groups and which of their blocks merge, and the index helpers that
cut per-token tables (positions, masks) to merged tokens. docs/architecture.md, "DiT adapters", has the design."""
import inspect
import logging
import math
import sys
from dataclasses import dataclass
from functools import lru_cache

import torch

from ...toma_core.plan import slab_extras
from ...toma_core.tiles import Slab, token_grid
from ..runtime import MergeRuntime

log = logging.getLogger("ComfyUI-ToMA")

LAYOUT_KEY = "comfyui_toma_image_layout"  # transformer_options key, set and removed by the wrapper
# set in the model call's transformer_options by the first block that sees a sequence-parallel slab it does not
# merge, so its later blocks (a joint sequence whose text share is unknown) step aside too; removed with LAYOUT_KEY
SLAB_KEY = "comfyui_toma_sequence_parallel"
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



def blocks_after(depth: int, fraction: float) -> range:
    """Indices of the blocks of a group of ``depth`` blocks that merge when the first ``fraction`` of them
    never do (rounded half up)."""
    return range(int(depth * fraction + 0.5), depth)


def merged_blocks(depth: int, group: str) -> range:
    """Indices of the blocks of a group of ``depth`` blocks that merge, at the paper's Flux fractions
    (``group``: TWO_STREAM, JOINT or VIDEO)."""
    return blocks_after(depth, SKIP_FRACTION[group])
