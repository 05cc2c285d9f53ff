"""Baselines behind the same plan interface (``merge``, ``unmerge``): ToMeSD and CA-ToMe.

ToMeSD (Bolya & Hoffman 2023), as in the ``tomesd`` package: one random destination per sy x sx cell,
every other token is a source; each source is matched to its most cosine-similar destination; the r
best-matched sources are averaged into their destinations; unmerging copies a destination's output back
to its sources. CA-ToMe (Saghatchian et al. 2025) uses the same matching but merges the sources whose
best similarity reaches a threshold, and reuses the matches between checkpoint steps.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .plan import TokenPlan, check_merged_shape
from .schedule import Schedule, StepDecision
from .selection import random_keys

# CA-ToMe's best configuration (paper Table II, "CONFIG 3"): steps of a 50-step run, counted from 1 as
# its reference pipeline counts them, at which the matches are recomputed; other steps reuse the last ones.
CATOME_REFERENCE_STEPS = 50
CATOME_CONFIG3 = (0, 8, 11, 13, 20, 25, 30, 35, 45, 46, 47, 48, 49)


@dataclass
class BipartitePlan(TokenPlan):
    """Index plan of a bipartite merge, shared by both baselines.

    src_index: (1, Ns) raster index of each source; dst_index: (1, Nd) of each destination.
    unmerged: (B, Ns - r) which sources stay; merged: (B, r) which sources merge; target: (B, r) the
    destination (index into dst) each merged source goes to.
    """

    num_tokens: int
    src_index: torch.Tensor
    dst_index: torch.Tensor
    unmerged: torch.Tensor
    merged: torch.Tensor
    target: torch.Tensor

    @property
    def num_merged(self) -> int:
        return self.num_tokens - self.merged.shape[1]

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, C) -> (B, N - r, C): [unmerged sources | destinations averaged with their sources]."""
        B, _, C = x.shape
        src = x.index_select(1, self.src_index[0])
        dst = x.index_select(1, self.dst_index[0])
        keep = src.gather(1, self.unmerged[..., None].expand(B, -1, C))
        moving = src.gather(1, self.merged[..., None].expand(B, -1, C))
        dst = dst.scatter_reduce(1, self.target[..., None].expand(B, -1, C), moving, reduce="mean")
        return torch.cat([keep, dst], dim=1)

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        """(B, N - r, C) -> (B, N, C): every merged source gets a copy of its destination's output."""
        check_merged_shape(y, self.merged.shape[0], self.num_merged)
        B, _, C = y.shape
        n_keep = self.unmerged.shape[1]
        keep, dst = y[:, :n_keep], y[:, n_keep:]
        out = y.new_zeros(B, self.num_tokens, C)
        out[:, self.dst_index[0]] = dst
        src_raster = self.src_index[0]
        out.scatter_(1, src_raster[self.unmerged][..., None].expand(B, -1, C), keep)
        moved = dst.gather(1, self.target[..., None].expand(B, -1, C))
        out.scatter_(1, src_raster[self.merged][..., None].expand(B, -1, C), moved)
        return out


def grid_destinations(
    hw: tuple[int, int], sx: int, sy: int, generator: torch.Generator | None, device=None,
    seed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One destination per sy x sx cell: random inside the cell with a ``seed`` (an int64 scalar tensor,
    hashed by ``selection.random_keys``: traceable, as a block call under torch.compile cannot draw from a
    generator) or a generator, top-left without either. Border rows/columns that do not fill a cell are
    all sources. Returns (src_index, dst_index), raster, both ascending, on ``device`` (default: where the
    seed is or the generator draws, else the CPU).

    Everything is computed where the cells are drawn, and every size is known from the grid shape, so
    nothing is read back from the device (tomesd draws on the device, then sorts indices out on the CPU)."""
    h, w = hw
    hs, ws = h // sy, w // sx
    if seed is not None:
        where = seed.device
        pick = (random_keys(seed, (hs, ws)) * (sy * sx)).long()  # keys in [0, 1): a cell's position, uniform
    elif generator is not None:
        where = generator.device
        pick = torch.randint(sy * sx, (hs, ws), generator=generator, device=where)
    else:
        where = device or "cpu"
        pick = torch.zeros(hs, ws, dtype=torch.long, device=where)
    rows = torch.arange(hs, device=where)[:, None] * sy + pick // sx
    cols = torch.arange(ws, device=where)[None, :] * sx + pick % sx
    dst = (rows * w + cols).flatten().sort().values
    is_dst = torch.zeros(h * w, dtype=torch.uint8, device=where).index_fill_(0, dst, 1)
    # a stable sort of the 0/1 flags lists the sources (0) first, in raster order
    src = is_dst.sort(stable=True).indices[: h * w - hs * ws]
    device = device if device is not None else where
    return src[None].to(device), dst[None].to(device)


def _match(x: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor):
    """Best destination of every source by cosine: (score, target), each (B, Ns)."""
    xn = F.normalize(x.float(), dim=-1, eps=1e-6)
    scores = xn.index_select(1, src_index[0]) @ xn.index_select(1, dst_index[0]).transpose(1, 2)
    return scores.max(dim=-1)


def _bipartite(x, src_index, dst_index, score, target, r) -> BipartitePlan:
    order = score.argsort(dim=-1, descending=True)
    merged, unmerged = order[:, :r], order[:, r:]
    return BipartitePlan(x.shape[1], src_index, dst_index, unmerged, merged, target.gather(1, merged))


def tomesd_plan(
    x: torch.Tensor,
    hw: tuple[int, int],
    ratio: float,
    sx: int = 2,
    sy: int = 2,
    generator: torch.Generator | None = None,
    seed: torch.Tensor | None = None,
) -> BipartitePlan:
    """ToMeSD's bipartite soft matching on x (B, N, C): r = int(N * ratio) sources merged, capped at the
    number of sources (so ratio is capped at 1 - 1/(sx*sy)). Destinations are shared across the batch,
    as in tomesd; ``seed`` (an int64 scalar tensor) or else ``generator`` draws their random position in
    each cell (neither: top-left)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    src_index, dst_index = grid_destinations(hw, sx, sy, generator, x.device, seed)
    score, target = _match(x, src_index, dst_index)
    r = min(int(x.shape[1] * ratio), src_index.shape[1])
    return _bipartite(x, src_index, dst_index, score, target, r)


def catome_plan(
    x: torch.Tensor,
    hw: tuple[int, int],
    threshold: float = 0.7,
    sx: int = 2,
    sy: int = 2,
    generator: torch.Generator | None = None,
) -> BipartitePlan:
    """CA-ToMe's adaptive matching on x (B, N, C): sources whose best cosine similarity to a destination
    is at least ``threshold`` are merged.

    The count varies per row, but attention runs on one (B, N', C) tensor and ComfyUI's attention patches
    cannot pass a per-row mask, so the batch merges min over rows of that count (the reference code takes
    the max, which merges below-threshold sources in some rows). This needs no loop over rows and keeps
    the promise that every merged source clears the threshold in its own row."""
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [-1, 1], got {threshold}")
    src_index, dst_index = grid_destinations(hw, sx, sy, generator, x.device)
    score, target = _match(x, src_index, dst_index)
    # The merged length depends on the data, and the attention that follows needs it as a shape: this is
    # the one read from the device per CA-ToMe plan (built at checkpoint steps only, reused in between).
    r = int((score >= threshold).sum(-1).min())
    return _bipartite(x, src_index, dst_index, score, target, r)


def catome_checkpoints(steps: int, config: tuple[int, ...] = CATOME_CONFIG3,
                       reference_steps: int = CATOME_REFERENCE_STEPS) -> frozenset:
    """The 0-based steps of a ``steps``-step run at which CA-ToMe computes new matches.

    The reference counts steps from 1 (its pipeline passes ``i + 1`` for step ``i``), so a checkpoint c
    of a ``reference_steps`` run is 0-based step c - 1 there; rescaled, it is step round(c * steps /
    reference_steps) - 1. Step 0 always computes: there is nothing to reuse yet."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rescaled = (round(c * steps / reference_steps) - 1 for c in config)
    return frozenset({0} | {min(steps - 1, s) for s in rescaled if s >= 0})


@dataclass
class CheckpointSchedule(Schedule):
    """When CA-ToMe computes new matches (the checkpoint steps) and reuses them (every other step).

    With the run's step count the checkpoints are ``catome_checkpoints``; without it (a host that gives
    no schedule) a step is a checkpoint when its progress passes one of the reference's checkpoint
    fractions since the group's last call."""

    checkpoints: tuple[int, ...] = CATOME_CONFIG3
    reference_steps: int = CATOME_REFERENCE_STEPS
    _progress_seen: dict = field(default_factory=dict, repr=False)

    def reset(self) -> None:
        self._progress_seen.clear()

    def forget(self, group) -> None:
        """Forget one group's history (its next decision is a new group's)."""
        self._progress_seen.pop(group, None)

    def decide(self, step: int, progress: float, group, total: int | None = None) -> StepDecision:
        if total is not None:
            new = step in catome_checkpoints(total, self.checkpoints, self.reference_steps)
        else:
            last = self._progress_seen.get(group)
            self._progress_seen[group] = progress
            marks = [(c - 1) / self.reference_steps for c in self.checkpoints if c >= 1]
            new = last is None or any(last < m <= progress for m in marks)
        return StepDecision(True, new, new)
