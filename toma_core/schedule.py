"""When to merge, and when to recompute destinations or merge weights (pattern reuse).

The step index always comes from the sampler's sigmas, never from counting model calls: samplers call
the model a varying number of times per step (CFG batches split for memory, multi-stage solvers), so a
call counter drifts. ``RunClock`` turns the current sigma (and the run's sigma schedule where the host
gives one) into a step index.
"""
from dataclasses import dataclass, field
from typing import Hashable, Sequence


def _check_fraction(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def _check_interval(name: str, value: int) -> int:
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value}")
    return int(value)


@dataclass(frozen=True)
class StepDecision:
    merge: bool
    new_destinations: bool
    new_weights: bool


@dataclass
class ReuseSchedule:
    """Per block group: merge inside [start_percent, end_percent) of the schedule, on every
    ``merge_every``-th step (steps 0, k, 2k, ...; the others run unmerged, as the official Flux run merges
    every 3rd step); recompute destinations every ``reuse_interval`` steps and the merge weights every
    ``weights_interval`` steps (in between, reuse the last ones). A group is any hashable, e.g. (resolution level, batch layout); the first block of a
    group in a step gets the recompute decision, later blocks of that step reuse its plan."""

    start_percent: float = 0.0
    end_percent: float = 1.0
    reuse_interval: int = 5
    weights_interval: int = 1
    merge_every: int = 1
    _last: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        _check_fraction("start_percent", self.start_percent)
        _check_fraction("end_percent", self.end_percent)
        if self.start_percent > self.end_percent:
            raise ValueError(f"start_percent ({self.start_percent}) must not exceed end_percent ({self.end_percent})")
        _check_interval("reuse_interval", self.reuse_interval)
        _check_interval("weights_interval", self.weights_interval)
        _check_interval("merge_every", self.merge_every)

    def reset(self) -> None:
        """Forget every group's plan history; called at the start of each sampling run."""
        self._last.clear()

    def in_window(self, progress: float) -> bool:
        """progress: fraction of the schedule done at this step, in [0, 1)."""
        return self.start_percent <= progress and (progress < self.end_percent or self.end_percent >= 1.0)

    def decide(self, step: int, progress: float, group: Hashable, total: int | None = None) -> StepDecision:
        if not self.in_window(progress) or step % self.merge_every:
            return StepDecision(False, False, False)
        last = self._last.get(group)
        if last is None or step < last[0] or step - last[0] >= self.reuse_interval:
            self._last[group] = (step, step)
            return StepDecision(True, True, True)
        if step - last[1] >= self.weights_interval:
            self._last[group] = (last[0], step)
            return StepDecision(True, False, True)
        return StepDecision(True, False, False)


class EveryCall:
    """ToMeSD's schedule: merge in every block call, with a new plan each time."""

    def reset(self) -> None:
        """Nothing to forget: no decision depends on an earlier one."""

    def decide(self, step: int, progress: float, group: Hashable, total: int | None = None) -> StepDecision:
        return StepDecision(True, True, True)


def step_from_sigmas(sigma: float, sample_sigmas: Sequence[float]) -> int:
    """Index of the step whose sigma is ``sigma`` in a schedule of steps+1 sigmas; for sigmas between
    schedule points (multi-stage solvers), the step whose interval contains it."""
    sched = [float(s) for s in sample_sigmas]
    for i, s in enumerate(sched[:-1]):
        if abs(s - sigma) <= 1e-4 * max(abs(s), 1e-8):
            return i
    above = sum(1 for s in sched[:-1] if s > sigma)
    return max(above - 1, 0)


@dataclass
class RunClock:
    """Step index of each model call in one sampling run, from the sigma the model is called at.

    A run begins only when the host says so (``begin``): samplers evaluate rising sigmas inside one run
    (ancestral and second-order solvers go back up to the next step's sigma), so a sigma never starts a
    run. With the run's schedule (steps+1 sigmas) the step is its index there, intermediate sigmas of
    multi-stage solvers belong to the step whose interval holds them, and the total is known. Without it
    the step is the number of distinct sigmas seen before this one in the run (a second solver stage then
    counts as a step of its own).
    """

    schedule: tuple[float, ...] | None = None
    _seen: dict = field(default_factory=dict, repr=False)

    def begin(self, sample_sigmas: Sequence[float] | None = None) -> None:
        self.schedule = None if sample_sigmas is None else tuple(float(s) for s in sample_sigmas)
        self._seen = {}

    @property
    def total(self) -> int | None:
        return None if self.schedule is None else len(self.schedule) - 1

    def step(self, sigma: float) -> int:
        sigma = float(sigma)
        if self.schedule is not None:
            return step_from_sigmas(sigma, self.schedule)
        return self._seen.setdefault(sigma, len(self._seen))
