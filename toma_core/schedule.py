"""When to merge, and when to recompute destinations or merge weights (pattern reuse).

The step index always comes from the sampler's sigmas, never from counting model calls: samplers call
the model a varying number of times per step (CFG batches split for memory, multi-stage solvers), so a
call counter drifts. ``RunClock`` turns the current sigma (and the run's sigma schedule where the host
gives one) into a step index.
"""
from dataclasses import dataclass, field
from typing import Hashable, Sequence


def check_fraction(name: str, value: float) -> float:
    """``value``, a fraction in [0, 1]; else a ValueError naming the input ``name``."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return float(value)


def check_interval(name: str, value: int) -> int:
    """``value``, an integer >= 1; else a ValueError naming the input ``name``."""
    if int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value}")
    return int(value)


@dataclass(frozen=True)
class StepDecision:
    merge: bool
    new_destinations: bool
    new_weights: bool


@dataclass(frozen=True)
class ShortRun:
    """What a schedule does instead in a run of at most ``steps`` steps (distilled models sample in 4 to 8,
    where a plan kept for 5 steps spans most of the run and a step left unmerged is an eighth of it):
    ``start_percent``, ``merge_every`` and ``reuse_interval`` replace the schedule's own (None keeps it)."""

    steps: int = 8
    start_percent: float | None = None
    merge_every: int | None = None
    reuse_interval: int | None = None

    def __post_init__(self):
        check_interval("steps", self.steps)
        if self.start_percent is not None:
            check_fraction("start_percent", self.start_percent)
        for name, value in (("merge_every", self.merge_every), ("reuse_interval", self.reuse_interval)):
            if value is not None:
                check_interval(name, value)

    def in_words(self) -> str:
        """"from 0% of the schedule, on every step, plans reused for at most 1 step"."""
        parts = []
        if self.start_percent is not None:
            parts.append(f"from {self.start_percent:.0%} of the schedule")
        if self.merge_every is not None:
            parts.append("on every step" if self.merge_every == 1 else f"on one step in {self.merge_every}")
        if self.reuse_interval is not None:
            parts.append(f"plans reused for at most {self.reuse_interval} step{'s' if self.reuse_interval > 1 else ''}")
        return ", ".join(parts) or "as in longer runs"


@dataclass(frozen=True)
class Timing:
    """The settings a run's decisions follow (``ReuseSchedule.timing``)."""

    start_percent: float
    merge_every: int
    reuse_interval: int
    weights_interval: int


class Schedule:
    """What every schedule offers the runtime (``decide``, ``reset``, ``forget``, ``is_short``), with the
    defaults of one whose decisions depend on no earlier one and on no run length."""

    def decide(self, step: int, progress: float, group: Hashable, total: int | None = None) -> StepDecision:
        """Whether ``group`` merges at ``step`` (``progress``: the fraction of the schedule done; ``total``: the
        run's steps, None where unknown), and what it rebuilds."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget every group's plan history; called at the start of each sampling run."""

    def forget(self, group: Hashable) -> None:
        """Forget one group's plan history (its next decision is a new group's)."""

    def is_short(self, total: int | None) -> bool:
        """Whether a run of ``total`` steps (None: unknown) follows a short-run rule of the schedule (its
        ``short_run``, where it has one)."""
        return False


@dataclass
class ReuseSchedule(Schedule):
    """Per block group: merge inside [start_percent, end_percent) of the schedule, on every
    ``merge_every``-th step (steps 0, k, 2k, ...; the others run unmerged, as the official Flux run merges
    every 3rd step); recompute destinations every ``reuse_interval`` steps and the merge weights every
    ``weights_interval`` steps (in between, reuse the last ones). A group is any hashable, e.g. (resolution level, batch layout); the first block of a
    group in a step gets the recompute decision, later blocks of that step reuse its plan. ``short_run``:
    what changes in a run whose step count (``total``, where the host gives the run's schedule) is at most
    its ``steps``."""

    start_percent: float = 0.0
    end_percent: float = 1.0
    reuse_interval: int = 5
    weights_interval: int = 1
    merge_every: int = 1
    short_run: ShortRun | None = None
    _last: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        check_fraction("start_percent", self.start_percent)
        check_fraction("end_percent", self.end_percent)
        if self.start_percent > self.end_percent:
            raise ValueError(f"start_percent ({self.start_percent}) must not exceed end_percent ({self.end_percent})")
        check_interval("reuse_interval", self.reuse_interval)
        check_interval("weights_interval", self.weights_interval)
        check_interval("merge_every", self.merge_every)

    def reset(self) -> None:
        """Forget every group's plan history; called at the start of each sampling run."""
        self._last.clear()

    def is_short(self, total: int | None) -> bool:
        """Whether a run of ``total`` steps (None: unknown) follows ``short_run``."""
        return self.short_run is not None and total is not None and total <= self.short_run.steps

    def timing(self, total: int | None = None) -> Timing:
        """The settings of a run of ``total`` steps: the schedule's own, or the short run's where it applies."""
        if not self.is_short(total):
            return Timing(self.start_percent, self.merge_every, self.reuse_interval, self.weights_interval)
        short = self.short_run
        start = self.start_percent if short.start_percent is None else short.start_percent
        every = self.merge_every if short.merge_every is None else short.merge_every
        reuse = self.reuse_interval if short.reuse_interval is None else short.reuse_interval
        return Timing(start, every, reuse, self.weights_interval)

    def in_window(self, progress: float, start_percent: float | None = None) -> bool:
        """progress: fraction of the schedule done at this step, in [0, 1); ``start_percent``: the run's
        (``timing``), default the schedule's own."""
        start = self.start_percent if start_percent is None else start_percent
        return start <= progress and (progress < self.end_percent or self.end_percent >= 1.0)

    def forget(self, group: Hashable) -> None:
        """Forget one group's plan history (its next decision is a new group's)."""
        self._last.pop(group, None)

    def decide(self, step: int, progress: float, group: Hashable, total: int | None = None) -> StepDecision:
        timing = self.timing(total)
        if not self.in_window(progress, timing.start_percent) or step % timing.merge_every:
            return StepDecision(False, False, False)
        last = self._last.get(group)
        if last is None or step < last[0] or step - last[0] >= timing.reuse_interval:
            self._last[group] = (step, step)
            return StepDecision(True, True, True)
        if step - last[1] >= timing.weights_interval:
            self._last[group] = (last[0], step)
            return StepDecision(True, False, True)
        return StepDecision(True, False, False)


class EveryCall(Schedule):
    """ToMeSD's schedule: merge in every block call, with a new plan each time (nothing to reset or forget: no
    decision depends on an earlier one)."""

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
