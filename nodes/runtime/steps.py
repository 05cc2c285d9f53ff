"""Where a model call is in its sampling run: its sigma -> (step, progress, total).

Host syncs: the step is read once per model call (one ``float`` of the call's sigma tensor, cached by the
tensor's identity for the block calls that follow); the schedule's sigmas and their progress are read
once per run.
"""
from typing import NamedTuple

from ...toma_core import RunClock


def progress_of_sigma(model_sampling, sigma: float) -> float:
    """Inverse of ComfyUI's ``percent_to_sigma`` (fraction of the model's noise schedule already done),
    found by bisection so it holds for every model_sampling (discrete, flow with shift, ...)."""
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if float(model_sampling.percent_to_sigma(mid)) > sigma:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class Where(NamedTuple):
    step: int
    progress: float  # fraction of the noise schedule done (start/end percent compare with it)
    total: int | None  # the run's steps, where the host gave its schedule


class StepLocator:
    """Steps of one sampling run at a time (``begin``), by the sigmas of its model calls (``locate``).
    ``model_sampling``: the patch-time noise schedule, for runs whose host names none."""

    def __init__(self, model_sampling):
        self.clock = RunClock()
        self.model_sampling = model_sampling
        self._run_sampling = None  # model_sampling of the current run
        self._progress: dict = {}  # sigma -> progress under _run_sampling
        self._located = (None, None)  # (sigma tensor of the last model call, its Where)

    @property
    def schedule(self) -> tuple | None:
        return self.clock.schedule

    @property
    def total(self) -> int | None:
        return self.clock.total

    def begin(self, schedule=None, model_sampling=None) -> None:
        """A new run: ``schedule`` its sigmas where the host hands them over; ``model_sampling`` the noise
        schedule of the model being sampled (model sampling nodes may sit before or after the merge
        node), else the patch-time one."""
        self.clock.begin(schedule)
        run_sampling = model_sampling if model_sampling is not None else self.model_sampling
        if run_sampling is not self._run_sampling:  # progress of a sigma belongs to one noise schedule
            self._progress = {}
        self._run_sampling = run_sampling
        if schedule is not None:  # once per sigma, not per model call (nor per hook call of one run)
            for sigma in self.clock.schedule:
                if sigma not in self._progress:
                    self._progress[sigma] = progress_of_sigma(run_sampling, sigma)
        self._located = (None, None)

    def located(self, sigmas) -> bool:
        """Whether ``sigmas`` is the sigma tensor of the model call located last (a later block of it)."""
        return sigmas is self._located[0]

    def locate(self, sigmas) -> Where:
        """The Where of the model call whose sigma tensor is ``sigmas``."""
        if sigmas is self._located[0]:
            return self._located[1]
        sigma = float(sigmas.flatten()[0])
        step = self.clock.step(sigma)
        if self.clock.schedule is not None:
            progress = self._progress[self.clock.schedule[step]]
        else:
            progress = self._progress.get(sigma)
            if progress is None:
                progress = self._progress[sigma] = progress_of_sigma(self._run_sampling, sigma)
        where = Where(step, progress, self.clock.total)
        self._located = (sigmas, where)
        return where
