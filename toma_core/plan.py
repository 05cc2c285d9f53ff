"""ToMA merge plans: attention-like soft assignment of every token to its tile's destinations.

Tiles are the local windows of ``tiles.TileGrid``: 2-D tiles of an image, or windows spanning a few
frames of a video; everything below works per window and never looks at its shape.

For one tile with normalised tokens X (S x C) and destinations Dn (D x C):
    A = softmax(tau * Dn X^T) over the destination axis   (D x S, each column sums to 1)
    M = A / rowsum(A)                                      (merge: each row a weighted average)
    U = A^T                                                (unmerge; = pinv(M) when A is hard)
Merging and unmerging are batched matmuls over (B, T) with tiny D x S matrices: no sort, no scatter.
Gathering the windows out of the raster order, and putting them back, takes a copy each way; where the
launches cost more than the arithmetic (a GPU fed by a host that issues every kernel), a plan also holds
its operators dense, (N' x N) with the window layout folded in, and merges and unmerges in one GEMM each
(``dense_operators``).
"""
import heapq
import struct
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch.compiler import is_compiling

from .memory import kept, made_kept
from .selection import select_by_similarity, unit_similarity, unit_vectors
from .tiles import SlabGrid, TileGrid, grid_on, tile_tokens, token_grid, untile_tokens

DEFAULT_TAU = 1000.0
# Rotating destinations (``plan_tiles``'s ``rotation``): each earlier pick of a token as a destination of the
# same plan key in the run lowers its gain by this much. Successive builds of a key then share ~11% of their
# destinations instead of ~70%, and the merge error, landing elsewhere each time, averages out over steps
# (+0.5 dB on the Flux proxy at 64x64 tokens, +0.85 dB on the Wan proxy at keys/values r=0.75). Strengths
# from 0.25 to 2 measured alike: a facility-location gain is a sum of similarity gains in [0, 1] over a
# window's tokens, so a penalty of a whole token per earlier pick outweighs near-ties and leaves clear
# winners; 1 sits in the middle of that plateau.
ROTATION_STRENGTH = 1.0
# The dense operators' size limits: merged tokens (their GEMM does 2 N' multiply-adds per token channel where
# the window copies move a few bytes, which a GPU's GEMM rate repays up to about a thousand merged tokens)
# and entries per batch row (memory: two N' x N matrices per plan).
DENSE_MAX_MERGED = 1024
DENSE_MAX_ENTRIES = 4096 * 1024


def dense_operators(device: torch.device, merged: int, tokens: int) -> bool:
    """Whether a plan of ``merged`` of ``tokens`` tokens on ``device`` merges and unmerges with dense
    operators: eager on an accelerator (and the meta device, which stands for one), within the size limits.
    A CPU runs kernels as the host issues them: the windowed form's arithmetic is all it pays. Traced code
    (torch.compile) keeps the windowed form too: inductor fuses its copies into the ops around them and
    replays the kernels from a graph, so the dense GEMM's arithmetic would be all the difference."""
    return (device.type != "cpu" and not is_compiling() and merged <= DENSE_MAX_MERGED
            and merged * tokens <= DENSE_MAX_ENTRIES)


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32, as a Python float."""
    return struct.unpack("f", struct.pack("f", value))[0]


def kept_per_tile(grid: "TileGrid | SlabGrid", ratio: float) -> tuple[int, ...]:
    """How many destinations each tile keeps, round((1 - ratio) * real tokens), at least 1, in Python
    integers from the grid's shape alone: plan geometry is settled without a tensor (under torch.compile
    it is a constant of the graph, and nothing is read back from the device). The product is taken in
    float32 and rounded half to even, as ``torch.round`` of a float32 tensor rounds it. A SlabGrid's
    tiles count the tokens of the slab, and its ``extra`` destinations go one at a time to the tile that
    keeps the smallest share of its tokens (the first of equals)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    scale = _float32(1.0 - ratio)
    if isinstance(grid, SlabGrid):
        real = grid.valid.sum(1).tolist()
        return spread(tuple(max(1, round(_float32(n * scale))) for n in real), tuple(real), grid.extra)
    # Along each axis every window but the last spans the whole window, so the tiles of a line repeat one
    # figure and end with another: the tuple is composed from at most eight figures (a few dozen bytecodes
    # for dynamo to trace, whatever the grid's size)
    def line(count: int, whole, last):
        return whole * (count - 1) + last

    def extents(size: int, window: int, count: int) -> tuple[int, int]:
        return window, size - (count - 1) * window

    def tiles_of_row(frames: int, rows: int) -> tuple[int, ...]:
        return line(grid.cols, *((max(1, round(_float32(frames * rows * cols * scale))),)
                                 for cols in extents(grid.w, grid.window_size, grid.cols)))

    def tiles_of_frame_window(frames: int) -> tuple[int, ...]:
        return line(grid.rows, *(tiles_of_row(frames, rows) for rows in extents(grid.h, grid.window_size, grid.rows)))

    return line(grid.frame_windows, *(tiles_of_frame_window(frames)
                                      for frames in extents(grid.frames, grid.temporal_window, grid.frame_windows)))


def spread(kept: tuple[int, ...], real: tuple[int, ...], extra: int) -> tuple[int, ...]:
    """``kept`` destinations per tile with ``extra`` more, one at a time to the tile keeping the smallest
    share of its ``real`` tokens (the first of equals), none beyond its tokens (host-side, once per plan
    geometry)."""
    if extra > sum(real) - sum(kept):
        raise ValueError(f"cannot keep {extra} more destinations: the tiles have {sum(real) - sum(kept)} tokens "
                         "left that are no destinations")
    kept, room = list(kept), [(k / n, t) for t, (k, n) in enumerate(zip(kept, real)) if k < n]
    heapq.heapify(room)
    for _ in range(extra):
        _, t = heapq.heappop(room)
        kept[t] += 1
        if kept[t] < real[t]:
            heapq.heappush(room, (kept[t] / real[t], t))
    return tuple(kept)


@lru_cache(maxsize=64)
def slab_extras(slabs: tuple[SlabGrid, ...], fixed: tuple[int, ...], ratio: float) -> tuple[int, ...]:
    """Destinations each of ``slabs`` keeps beyond the ratio's (SlabGrid.extra) so that every slab, with
    its ``fixed`` tokens that never merge, holds as many tokens merged: as many as the slab that keeps
    most at the ratio (no slab merges more than the ratio asks). Sequence parallelism needs it: Ulysses
    attention exchanges equal slabs between ranks. ValueError where a slab has too few tokens to keep
    that many."""
    kept = [sum(kept_per_tile(s, ratio)) for s in slabs]
    length = max(f + k for f, k in zip(fixed, kept))
    extras = tuple(length - f - k for f, k in zip(fixed, kept))
    for rank, (s, k, e) in enumerate(zip(slabs, kept, extras)):
        if e > s.num_tokens - k:
            raise ValueError(f"slab {rank} ({s.num_tokens} tokens to merge, {fixed[rank]} that never merge) cannot "
                             f"keep {length} tokens as the others do")
    return extras


def destinations_per_tile(grid: TileGrid, ratio: float) -> torch.Tensor:
    """(T,) long: how many destinations each tile keeps, round((1 - ratio) * real tokens), at least 1."""
    return torch.tensor(kept_per_tile(grid, ratio), dtype=torch.long)


@dataclass(frozen=True)
class PlanGeometry:
    """What every plan of one grid and ratio shares, on one device.

    keep: D, the most destinations a tile keeps. valid: (T, S) bool real slots. live_slot: (T, D) bool,
    which destination slots a tile uses. live: (N',) long, which of the T*D slots hold a real merged token;
    None when all do.
    """

    keep: int
    valid: torch.Tensor
    live_slot: torch.Tensor
    live: torch.Tensor | None


@lru_cache(maxsize=256)
@made_kept
def plan_geometry(grid: TileGrid, ratio: float, device: torch.device) -> PlanGeometry:
    """The PlanGeometry of ``grid`` at ``ratio`` on ``device``, from the grid shape alone (Python
    integers) and copied to the device once per (grid, ratio, device), so building a plan reads nothing
    back from the device and copies nothing to it. Under torch.compile (which traces through the cache)
    every figure is a constant of the graph. The slot lists are built a tile at a time (tuples of constants):
    dynamo steps through every bytecode it traces, and a comprehension over every slot was a fifth of what it
    traced in a compiled Flux call."""
    kept = kept_per_tile(grid, ratio)
    D = max(kept)
    live_slot = [(True,) * k + (False,) * (D - k) for k in kept]
    live = None if min(kept) == D else sum((tuple(range(t * D, t * D + k)) for t, k in enumerate(kept)), ())
    return PlanGeometry(D, grid_on(grid, device)[0], torch.tensor(live_slot, device=device),
                        None if live is None else torch.tensor(live, dtype=torch.long, device=device))


@lru_cache(maxsize=256)
@made_kept
def row_offsets(batch: int, tiles: int, tile_size: int, device: torch.device) -> torch.Tensor:
    """(batch, tiles, 1) long: the first row of each tile in a (batch * tiles * tile_size, C) view, made on
    the host and copied to ``device`` once per shape."""
    return torch.arange(0, batch * tiles * tile_size, tile_size).view(batch, tiles, 1).to(device)


def check_merged_shape(y: torch.Tensor, batch: int, tokens: int) -> None:
    """Unmerge only what this plan merged: a tensor of other rows or tokens (another patch's tokens) would
    otherwise be reinterpreted silently."""
    if y.dim() != 3 or tuple(y.shape[:2]) != (batch, tokens):
        raise ValueError(f"unmerge expects (batch {batch}, {tokens} merged tokens, channels), got {tuple(y.shape)}")


class TokenPlan:
    """What every plan (ToMA, identity, ToMeSD/CA-ToMe) offers besides ``merge`` and ``unmerge``."""

    def derived(self, name: str, key, sources: tuple, make):
        """``make()``, made once for as long as it is asked for with an equal ``key`` and the very same
        ``sources`` (identity: the tensors it is derived from): what every block of the plan's group derives
        alike from the model call's tensors (a DiT's positional table cut to the merged tokens) costs one set
        of kernels, not one per block. Traced code (torch.compile) makes it each time: fused there, it is
        cheap, and a cache would guard on tensor identity."""
        if is_compiling():
            return make()
        cache = self.__dict__.setdefault("_derived", {})
        hit = cache.get(name)
        if hit is not None and hit[0] == key and len(hit[1]) == len(sources) and all(
                a is b for a, b in zip(hit[1], sources)):
            return hit[2]
        with kept():  # kept for the plan's later blocks: made outside the host's malloc graph (toma_core.memory)
            value = make()
        cache[name] = (key, sources, value)
        return value

    def unmerge_update(self, x: torch.Tensor, merged_input: torch.Tensor, merged_output: torch.Tensor) -> torch.Tensor:
        """x + U(f(Mx) - Mx): the update a block computed on merged tokens, carried back onto the
        full-resolution stream ``x`` (B, N, C); merged_input = Mx, merged_output = f(Mx), (B, N', C)."""
        return x + self.unmerge(merged_output - merged_input)


@dataclass
class MergePlan(TokenPlan):
    """Merge/unmerge operators for one token grid, one per batch row.

    destinations: (B, T, D) long, index inside the tile of each destination; -1 for a slot the tile
                  does not use (edge tiles keep fewer destinations).
    merge_weights: (B, T, D, S) M, in the dtype of the activations it is applied to.
    unmerge_weights: (B, T, S, D) U.
    live: (N',) long, which of the T*D slots hold a real merged token; None when all do.
    mass: (B, T, D) fp32, how many tokens each destination stands for (the row sums of the soft
          assignment A); None for plans built without it.
    chosen: (B, T, S) fp32, how often each window slot was a destination at the plan key's builds this run,
            this plan's included (rotating destinations: ``plan_tiles``'s ``rotation``); None without rotation
            or where the plan refreshed only the weights of given destinations.
    dense: (M (B, N', N), U (B, N, N')) with the windows folded in: merge and unmerge are one GEMM each (no
           view made per call: each costs the host a few microseconds); None: they go through the windows.
    """

    grid: TileGrid
    destinations: torch.Tensor
    merge_weights: torch.Tensor
    unmerge_weights: torch.Tensor
    live: torch.Tensor | None
    mass: torch.Tensor | None = None
    dense: tuple[torch.Tensor, torch.Tensor] | None = None
    chosen: torch.Tensor | None = None
    _destination_tokens: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _log_mass: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_merged(self) -> int:
        if self.live is not None:
            return self.live.numel()
        return self.destinations.shape[1] * self.destinations.shape[2]

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, N', C)."""
        if self.dense is not None:
            return torch.bmm(self.dense[0], x)
        B, T, D, _ = self.merge_weights.shape
        merged = (self.merge_weights @ tile_tokens(x, self.grid)).view(B, T * D, -1)
        return merged if self.live is None else merged.index_select(1, self.live)

    def unmerge_update(self, x: torch.Tensor, merged_input: torch.Tensor, merged_output: torch.Tensor) -> torch.Tensor:
        if self.dense is None:
            return super().unmerge_update(x, merged_input, merged_output)
        check_merged_shape(merged_output, x.shape[0], self.num_merged)
        return torch.baddbmm(x, self.dense[1], merged_output - merged_input)  # the add in the GEMM

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, N', C) -> (B, N, C)."""
        B, T, D, _ = self.merge_weights.shape
        check_merged_shape(y, B, self.num_merged)
        if self.dense is not None:
            return torch.bmm(self.dense[1], y)
        if self.live is not None:
            y = y.new_zeros(B, T * D, y.shape[-1]).index_copy_(1, self.live, y)
        return untile_tokens(self.unmerge_weights @ y.view(B, T, D, -1), self.grid)

    @property
    def log_mass(self) -> torch.Tensor:
        """(B, N') fp32: log of how many tokens each merged token stands for (proportional attention);
        computed once per plan, which every block of a level and step reuses (kept in a field, not a
        functools.cached_property, whose lock torch.compile cannot trace)."""
        if self._log_mass is None:
            B, T, D = self.mass.shape
            with kept():
                logs = self.mass.clamp_min(1e-6).log().view(B, T * D)
                self._log_mass = logs if self.live is None else logs.index_select(1, self.live)
        return self._log_mass

    def destination_tokens(self) -> torch.Tensor:
        """(B, N') long raster index (in the frames x h x w grid) of each merged token's destination,
        for positional tables; made once per plan, which every block of its group reuses (a DiT's blocks
        each ask for it)."""
        if self._destination_tokens is None:
            B, T, D = self.destinations.shape
            with kept():
                origin = grid_on(self.grid, self.destinations.device)[1]
                raster = origin[torch.arange(T, device=origin.device)[:, None], self.destinations.clamp(min=0)]
                raster = raster.reshape(B, T * D)
                self._destination_tokens = raster if self.live is None else raster.index_select(1, self.live)
        return self._destination_tokens


class IdentityPlan(TokenPlan):
    """The plan for ratio 0: nothing is merged, merge and unmerge return their input unchanged."""

    def __init__(self, grid: TileGrid, batch_size: int, device: torch.device | None = None):
        self.grid, self.batch_size, self.num_merged = grid, batch_size, grid.num_tokens
        self.device = device

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def destination_tokens(self) -> torch.Tensor:
        return torch.arange(self.num_merged, device=self.device).expand(self.batch_size, -1)

    @property
    def log_mass(self) -> torch.Tensor:
        return torch.zeros(self.batch_size, self.num_merged, device=self.device)


def plan_tiles(
    x: torch.Tensor,
    hw: tuple[int, int] | tuple[int, int, int],
    window_size: int,
    ratio: float,
    tau: float = DEFAULT_TAU,
    exact: bool = False,
    destinations: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    temporal_window: int = 1,
    dense: bool | None = None,
    seed: torch.Tensor | None = None,
    rotation: float = 0.0,
    chosen: torch.Tensor | None = None,
) -> "MergePlan | IdentityPlan":
    """Build a ToMA plan from block features.

    x: (B, N, C) features that decide similarity (the block's normalised input), N = h*w row-major, or
    N = frames*h*w (frame-major, then row-major) for a video.
    hw: (h, w) token grid, or (frames, h, w). window_size: a window's side in tokens. temporal_window: frames a window
    spans (1: each frame is tiled on its own, as an image). ratio: fraction of tokens removed, in [0, 1).
    tau: softmax sharpness; large tau makes A hard and U = A^T the exact pseudo-inverse of M.
    exact: unmerge with the true pseudo-inverse of M (fp32), for soft tau.
    destinations: (B, T, D) from an earlier plan of the same grid, to refresh only the weights.
    generator, seed: the stochastic selector's randomness on tiles over 64 tokens: a seed tensor drawn before
    traced code (``selection.draw_seed``), else one drawn from the generator here, else seed 0
    (``selection.stochastic_facility_location``).
    dense: also hold the operators dense (MergePlan.dense); None: as ``dense_operators`` decides.
    rotation: where destinations are chosen here, the strength of rotating them (0: off): each token's gain
    is biased by -rotation * ``chosen`` (B, T, S), how often it was a destination at the plan key's earlier
    builds this run (None: never), and the plan carries the counts with its own destinations added
    (MergePlan.chosen), for the key's next build. Computed on x's device in the same ops as the rest (no
    host sync; a tensor input under torch.compile).
    Weights are computed in fp32 and returned in x's dtype.
    """
    grid = token_grid(hw, window_size, temporal_window)
    if ratio == 0.0:
        return IdentityPlan(grid, x.shape[0], x.device)
    geometry = plan_geometry(grid, float(ratio), x.device)
    valid, live_slot, D = geometry.valid, geometry.live_slot, geometry.keep
    feats = unit_vectors(tile_tokens(x, grid, torch.float32))  # (B, T, S, C) fp32
    B, T, S, C = feats.shape
    counts = None
    if destinations is None:
        if chosen is not None and chosen.shape != (B, T, S):
            raise ValueError(f"chosen {tuple(chosen.shape)} does not fit batch {B} and {grid}")
        bias = None if not rotation or chosen is None else chosen * -float(rotation)
        # a grid without padding has no slot to mask, and one whose tiles all keep D destinations no slot unused
        destinations = select_by_similarity(unit_similarity(feats), D, valid if grid.padded else None,
                                            generator=generator, seed=seed, bias=bias)
        if geometry.live is not None:
            destinations = destinations.masked_fill(~live_slot, -1)
        if rotation:
            counts = destination_mask(destinations, S, grid.padded or geometry.live is not None)
            counts = counts if chosen is None else counts + chosen
    elif destinations.shape[1:] != (grid.num_tiles, D) or destinations.shape[0] != x.shape[0]:
        raise ValueError(f"destinations {tuple(destinations.shape)} do not fit batch {x.shape[0]} and {grid}")
    # Where every tile keeps D destinations (no unused slot -1) and no slot is padding, the masks below
    # change nothing: a weight refresh is then a dozen kernels, each a launch the host pays on a GPU.
    unused = geometry.live is not None
    # gather the destination rows as whole rows of (B*T*S, C): index_select copies rows, gather goes
    # element by element (2-4x slower on CPU)
    rows = (destinations.clamp(min=0) if unused else destinations) + row_offsets(B, T, S, x.device)
    dst = feats.view(B * T * S, C).index_select(0, rows.view(-1)).view(B * T, D, C)
    logits = torch.baddbmm(feats.new_empty(B * T, D, S), dst, feats.view(B * T, S, C).transpose(-1, -2),
                           beta=0, alpha=tau).view(B, T, D, S)
    if unused:
        logits.masked_fill_((destinations < 0)[..., None], float("-inf"))
    A = logits.softmax(dim=-2)
    if grid.padded:
        A = A * valid[None, :, None, :]
    mass = A.sum(-1, keepdim=True)  # >= 1/D for a used destination: its own token weighs most on it
    M = A / (mass.clamp_min(1e-12) if unused else mass)
    # M and U^T in x's dtype in one conversion; U = A^T or pinv(M) are views of it
    weights = torch.stack([M, torch.linalg.pinv(M).transpose(-1, -2) if exact else A]).to(x.dtype)
    merged = T * D if geometry.live is None else geometry.live.numel()
    if dense is None:
        dense = dense_operators(x.device, merged, grid.num_tokens)
    operators = dense_form(grid, weights, geometry.live) if dense else None
    return MergePlan(grid, destinations, weights[0], weights[1].transpose(-1, -2), geometry.live, mass.squeeze(-1),
                     operators, counts)


def destination_mask(destinations: torch.Tensor, tile_size: int, empty_slots: bool = True) -> torch.Tensor:
    """(B, T, D) destinations -> (B, T, S) fp32, 1 at each window slot that is a destination, else 0;
    ``empty_slots``: some slots are -1 (unused or padding: never counted), each sent to a column past the
    window's and cut off (one scatter either way)."""
    B, T, _ = destinations.shape
    if not empty_slots:
        return destinations.new_zeros(B, T, tile_size, dtype=torch.float32).scatter_(-1, destinations, 1.0)
    slots = destinations.masked_fill(destinations < 0, tile_size)
    return destinations.new_zeros(B, T, tile_size + 1, dtype=torch.float32).scatter_(-1, slots, 1.0)[..., :tile_size]


def dense_form(grid: TileGrid, weights: torch.Tensor, live: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(M (B, N', N), U (B, N, N')) from ``weights`` (2, B, T, D, S), M and U^T, each window slot's weight
    moved to the column of its token (a padding slot, whose weights are 0, adds 0 to the token it names),
    the rows of the live slots kept. One scatter (and one row gather where edge tiles keep fewer
    destinations)."""
    _, B, T, D, S = weights.shape
    columns = grid_on(grid, weights.device)[1].view(1, 1, T, 1, S).expand(2, B, T, D, S)
    out = weights.new_zeros(2, B, T, D, grid.num_tokens).scatter_add_(-1, columns, weights).view(2, B, T * D, -1)
    out = out if live is None else out.index_select(2, live)
    return out[0], out[1].transpose(1, 2)
