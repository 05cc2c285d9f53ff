"""DiTo, after "Rethinking Token Reduction for Diffusion Models via Output-Similarity-Awareness" (Lee, Lee and
Kim, arXiv 2605.22011, May 2026). No code of the paper is public; this is built from its abstract and its
speed table, the only parts of its text found, and every choice the text leaves open is listed below.

What the text says, and how it is built here:
- Token correspondences come from the similarity of *outputs*, not inputs: merging two tokens costs what
  their outputs differ (unmerging copies one output to both), and output similarity is "consistently
  preserved across adjacent timesteps". Correspondences are set at a *matching* timestep and reused over
  the *reduction* timesteps after it. Here a plan key (one block) runs unmerged at its matching step
  (``MatchingPlan``: merge and unmerge are the identity), sees its own output there, and matches on it; the
  following steps merge by that matching (``DiToPlan``) until the next matching step.
- The matching interval comes from a Pair Match Ratio (PMR): ``pair_match_ratio`` measures it, the share of
  merged (source, destination) pairs of one matching that another matching keeps; ``interval_from_pmr``
  chooses the longest interval whose PMR stays above a threshold. A run uses a fixed ``interval``.
- A selection-frequency penalty keeps the reuse from approximating the same tokens again and again
  (blocking artifacts): a source's matching score is lowered by ``penalty`` times the number of earlier
  matchings of its plan key in the run that merged it away (``match_outputs``).

Assumptions (the text leaves these open):
1. The matching is ToMeSD's bipartite soft matching (one destination per sy x sx cell at a random place,
   each source to its most cosine-similar destination, the r best sources averaged in; ``r = int(N *
   ratio)``): the paper's "pairs" and its baselines suggest it. The cells are drawn anew at each matching.
2. A matching step runs the block unmerged: output similarity needs outputs that merging has not made
   equal. Reduction steps reuse the correspondences, merge with averages and unmerge by copies.
3. "Output" is what the merge approximates: the block's update (output minus input) when whole blocks run
   merged, the attention's output where only attention runs merged.
4. Correspondences are per block (each block matches on its own output), per batch row.
5. The interval is a node input (default 5 steps); the PMR rule that sets it in the paper is not known, so
   ``interval_from_pmr`` (longest interval with PMR >= threshold) is this module's reading, for calibrating
   it offline: choosing it inside a run would read the PMR back from the device.
6. The penalty counts how often each token was merged away (a "selected" source) at the key's earlier
   matchings in the run, in units of cosine similarity; reset when a run starts.
7. A video grid (frames, h, w) is matched as frames * h rows of w tokens.
"""
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .baselines import BipartitePlan, grid_destinations
from .memory import kept
from .plan import IdentityPlan
from .schedule import Schedule, StepDecision, check_fraction, check_interval

MATCHING, MATCHED, REDUCING = "matching", "matched", "reducing"


@dataclass(frozen=True)
class MatchState:
    """What one DiTo plan of a key hands the next (the runtime passes a plan's ``destinations`` to the next
    build of its key): ``counts`` (B, N) fp32, how many of the key's matchings so far merged each token away;
    ``plan`` the correspondences of the last matching (a DiToPlan), None before the first; ``phase``:
    MATCHING (a matching plan that has seen no output yet), MATCHED (matched, not yet used: the next build
    merges by it), REDUCING (in use: the next build matches again)."""

    counts: torch.Tensor
    plan: "DiToPlan | None"
    phase: str


def raster_rows(grid) -> tuple[int, int]:
    """(rows, columns) of the 2-D layout a grid is matched in: (h, w), or (frames * h, w) for a video."""
    return (grid[0], grid[1]) if len(grid) == 2 else (grid[0] * grid[1], grid[2])


@dataclass
class DiToPlan(BipartitePlan):
    """A bipartite plan (``BipartitePlan``: [unmerged sources | destinations]) with what DiT adapters ask of a
    plan besides merge and unmerge: each merged token's raster position and the log of the tokens it stands
    for; ``state``: the key's state while this plan is in use."""

    state: MatchState | None = None

    @property
    def destinations(self) -> MatchState:
        return MatchState(self.state.counts, self, REDUCING)

    def destination_tokens(self) -> torch.Tensor:
        """(B, N') long raster index of each merged token's position: a kept source's own, a destination's."""
        B = self.unmerged.shape[0]
        kept = self.src_index[0][self.unmerged]
        return torch.cat([kept, self.dst_index.expand(B, -1)], dim=1)

    @property
    def log_mass(self) -> torch.Tensor:
        """(B, N') fp32: log of how many tokens each merged token stands for (proportional attention)."""
        B = self.unmerged.shape[0]
        mass = torch.ones(B, self.dst_index.shape[1], device=self.target.device).scatter_add_(
            1, self.target, torch.ones(self.target.shape, device=self.target.device))
        return torch.cat([mass.new_zeros(B, self.unmerged.shape[1]), mass.log()], dim=1)


def match_outputs(outputs: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor, r: int,
                  counts: torch.Tensor, penalty: float) -> tuple[DiToPlan, torch.Tensor]:
    """Match on ``outputs`` (B, N, C): every source to its most cosine-similar destination, the ``r`` sources
    of highest score minus ``penalty`` * ``counts`` (B, N, per raster token) merged. Returns the plan and the
    counts with those sources added. Batched, its sizes from the shapes: nothing read from the device."""
    xn = F.normalize(outputs.float(), dim=-1, eps=1e-6)
    scores = xn.index_select(1, src_index[0]) @ xn.index_select(1, dst_index[0]).transpose(1, 2)
    best, target = scores.max(dim=-1)
    B = outputs.shape[0]
    src_raster = src_index.expand(B, -1)
    score = best - penalty * counts.gather(1, src_raster) if penalty else best
    order = score.argsort(dim=-1, descending=True)
    merged, unmerged = order[:, :r], order[:, r:]
    counts = counts.scatter_add(1, src_raster.gather(1, merged), counts.new_ones(merged.shape))
    return DiToPlan(outputs.shape[1], src_index, dst_index, unmerged, merged, target.gather(1, merged)), counts


class MatchingPlan(IdentityPlan):
    """A matching step's plan: the block runs unmerged (merge and unmerge return their input), and the output
    it unmerges is matched on (``match_outputs``), on the cells drawn for this matching; ``destinations``
    then holds the new correspondences for the reduction steps that follow. Seeing the output again (a second
    model call in the step) matches again from the same counts."""

    def __init__(self, grid, batch: int, device, src_index, dst_index, r: int, counts, penalty: float):
        self.grid, self.batch_size, self.device, self.num_merged = grid, batch, device, counts.shape[1]
        self.src_index, self.dst_index, self.r, self.penalty = src_index, dst_index, r, penalty
        self.counts = counts  # the key's counts before this matching
        self.state = MatchState(counts, None, MATCHING)

    @property
    def destinations(self) -> MatchState:
        return self.state

    def observe(self, output: torch.Tensor) -> None:
        with kept():  # the matching is kept for the reduction steps (toma_core.memory)
            plan, counts = match_outputs(output, self.src_index, self.dst_index, self.r, self.counts, self.penalty)
        plan.state = MatchState(counts, None, MATCHED)
        self.state = MatchState(counts, plan, MATCHED)

    def unmerge(self, y: torch.Tensor) -> torch.Tensor:
        self.observe(y)
        return y

    def unmerge_update(self, x: torch.Tensor, merged_input: torch.Tensor, merged_output: torch.Tensor) -> torch.Tensor:
        self.observe(merged_output - merged_input)
        return merged_output


def pair_match_ratio(a: BipartitePlan, b: BipartitePlan) -> torch.Tensor:
    """(B,) fp32: the share of ``a``'s merged (source, destination) pairs that ``b`` merges too, two matchings
    on the same cells (the Pair Match Ratio). A device tensor: read it back outside a model call."""
    if not (torch.equal(a.src_index, b.src_index) and torch.equal(a.dst_index, b.dst_index)):
        raise ValueError("pair_match_ratio compares matchings on the same cells (src_index and dst_index)")
    Ns = a.src_index.shape[1]

    def pairs(p):
        B = p.merged.shape[0]
        out = torch.zeros(B, Ns, dtype=torch.long, device=p.merged.device) - 1
        return out.scatter_(1, p.merged, p.target)

    pa, pb = pairs(a), pairs(b)
    return ((pa == pb) & (pa >= 0)).sum(1).float() / max(a.merged.shape[1], 1)


def interval_from_pmr(ratios, threshold: float) -> int:
    """The matching interval from measured Pair Match Ratios: ``ratios[k - 1]`` is the PMR between the
    matching of a step and that of k steps later (k = 1, 2, ...); the interval is the largest k whose PMR
    (and every shorter one's) is at least ``threshold``, plus the matching step itself, at least 2."""
    check_fraction("threshold", threshold)
    k = 0
    for value in ratios:
        if float(value) < threshold:
            break
        k += 1
    return max(2, k + 1)


@dataclass
class MatchingSchedule(Schedule):
    """DiTo's schedule per plan key: inside [start_percent, end_percent) of the schedule, a matching step every
    ``interval`` steps (the key's first step, then every ``interval`` steps after it), reduction steps in
    between. Decisions, as (merge, new destinations, new weights): a key's first matching (True, True, True),
    a new plan with nothing carried; a later matching and the first reduction step after a matching (True,
    False, True), a new plan built from the last one's state (``MatchState``); other steps reuse the plan."""

    interval: int = 5
    start_percent: float = 0.0
    end_percent: float = 1.0
    _last: dict = field(default_factory=dict, repr=False)  # group -> (matching step, reduction plan built)

    def __post_init__(self):
        check_interval("interval", self.interval)
        if self.interval < 2:
            raise ValueError(f"interval must be at least 2 (a matching step, then reduction steps), got {self.interval}")
        check_fraction("start_percent", self.start_percent)
        check_fraction("end_percent", self.end_percent)
        if self.start_percent > self.end_percent:
            raise ValueError(f"start_percent ({self.start_percent}) must not exceed end_percent ({self.end_percent})")

    def reset(self) -> None:
        self._last.clear()

    def forget(self, group) -> None:
        self._last.pop(group, None)

    def decide(self, step: int, progress: float, group, total: int | None = None) -> StepDecision:
        inside = self.start_percent <= progress and (progress < self.end_percent or self.end_percent >= 1.0)
        if not inside:
            return StepDecision(False, False, False)
        last = self._last.get(group)
        if last is None or step < last[0] or step - last[0] >= self.interval:
            self._last[group] = (step, False)
            return StepDecision(True, last is None or step < last[0], True)
        if step > last[0] and not last[1]:
            self._last[group] = (last[0], True)
            return StepDecision(True, False, True)
        return StepDecision(True, False, False)


def dito_plan(features: torch.Tensor, grid, ratio: float, penalty: float, sx: int = 2, sy: int = 2,
              given: MatchState | None = None, seed: torch.Tensor | None = None, generator=None):
    """The next DiTo plan of a key whose last plan handed on ``given`` (None: the key's first): a MatchingPlan
    (its first, or after a reduction plan), or the reduction plan the last matching made. ``features`` (B, N,
    C) gives the batch, the device and the token count; ``seed`` or ``generator`` draws the matching's cells.
    ValueError where a matching plan saw no output (a scope that unmerges nothing)."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    if given is not None and given.phase == MATCHED:
        plan = given.plan
        if (plan.src_index.device != features.device or plan.unmerged.shape[0] != features.shape[0]
                or plan.num_tokens != features.shape[1]):
            raise ValueError("DiTo's correspondences do not fit this block call's tokens")
        return plan
    if given is not None and given.phase == MATCHING:
        raise ValueError("DiTo's matching step saw no output to match on (its block unmerged nothing: DiTo needs "
                         "scope block or attention)")
    B, N = features.shape[:2]
    counts = features.new_zeros(B, N, dtype=torch.float32) if given is None else given.counts
    src_index, dst_index = grid_destinations(raster_rows(grid), sx, sy, generator, features.device, seed)
    r = min(int(N * ratio), src_index.shape[1])
    return MatchingPlan(grid, B, features.device, src_index, dst_index, r, counts, penalty)
