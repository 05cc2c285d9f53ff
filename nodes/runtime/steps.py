"""Where a model call is in its sampling run: its sigma -> (step, progress, total).

Host syncs: none where the sampler reports its steps (current ComfyUI: the pack's SAMPLER_SAMPLE wrapper
hands the sampler a callback, which k-diffusion samplers call with the index of each step they finish):
the step is then a host-side count, and its progress comes from the run's schedule, read once per run
from the sampler's own (CPU) sigmas. Otherwise the step is read once per model call (one ``float`` of
the call's sigma tensor, a device-to-host sync on a GPU, cached by the tensor's identity for the block
calls that follow).
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
    """Steps of one sampling run at a time (``begin``), by the steps the sampler reports (``follow_reports``,
    ``report``) or else by the sigmas of its model calls (``locate``). ``model_sampling``: the patch-time
    noise schedule, for runs whose host names none."""

    # Model calls without a step report after which a sampler that said it would report is taken not to
    # (a step takes 1-4 model calls: CFG split into cond and uncond, two-stage solvers)
    SILENT_CALLS = 32

    def __init__(self, model_sampling):
        self.clock = RunClock()
        self.model_sampling = model_sampling
        self._run_sampling = None  # model_sampling of the current run
        self._progress: dict = {}  # sigma -> progress under _run_sampling
        self._located = (None, None)  # (sigma tensor of the last model call, its Where)
        self.reported: int | None = None  # the step of the coming model calls, as the sampler reports it
        self._silent = 0  # model calls located since the last report
        self._told_total: int | None = None  # the run's steps where the host told them without a schedule

    @property
    def schedule(self) -> tuple | None:
        return self.clock.schedule

    @property
    def total(self) -> int | None:
        return self.clock.total if self.clock.total is not None else self._told_total

    def tell_total(self, total: int) -> None:
        """The run's step count, where the host gives no schedule of sigmas but says it (``MergeRuntime.learn_total``)."""
        self._told_total = int(total)

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
        self.reported, self._silent = None, 0
        self._told_total = None

    def follow_reports(self) -> None:
        """The sampler of this run will report each step it finishes (``report``): locate model calls by
        those reports, without reading their sigmas. Needs the run's schedule (for progress and total)."""
        if self.clock.total:
            self.reported, self._silent = 0, 0

    def report(self, step: int) -> None:
        """The sampler finished ``step``: the model calls that follow belong to the next one."""
        if self.reported is not None:
            self.reported, self._silent = step + 1, 0

    def silent(self) -> bool:
        """Whether the sampler stopped reporting steps although it was to (``SILENT_CALLS`` model calls
        without a report); the calls are then located by their sigmas again."""
        return self.reported is not None and self._silent >= self.SILENT_CALLS

    def stop_following(self) -> None:
        self.reported = None

    def located(self, sigmas) -> bool:
        """Whether ``sigmas`` is the sigma tensor of the model call located last (a later block of it)."""
        return sigmas is self._located[0]

    def locate(self, sigmas) -> Where:
        """The Where of the model call whose sigma tensor is ``sigmas``."""
        if sigmas is self._located[0]:
            return self._located[1]
        if self.reported is not None:
            self._silent += 1
            step = min(self.reported, self.clock.total - 1)
            where = Where(step, self._progress[self.clock.schedule[step]], self.clock.total)
            self._located = (sigmas, where)
            return where
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
