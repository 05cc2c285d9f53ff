"""Per-patched-model state while sampling: which step we are at, which plans are cached, what it cost.

One ``MergeRuntime`` lives in the closures of one patched MODEL (closures are shared, not deep-copied,
when ComfyUI clones a patcher). It never holds on to anything across sampling runs: the run-start hook
the adapter installs (``install_run_hooks``) calls ``begin_run``, which clears every cache and takes the
run's sigma schedule and noise schedule (``model_sampling``) from the model being sampled. A model call
outside any hooked run (a host without run hooks) starts a run of its own.

Host syncs: the step is read once per model call (one ``float`` of the call's sigma tensor, cached by the
tensor's identity for the block calls that follow); the schedule's sigmas and their progress are read
once per run.
"""
import logging
import time
from dataclasses import dataclass, field

import torch

from ..toma_core import CATOME_CONFIG3, ReuseSchedule, RunClock, catome_checkpoints, catome_plan, plan_tiles, tomesd_plan
from .live_stats import StageClock
from .plan_records import record_plan

log = logging.getLogger("ComfyUI-ToMA")


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


def batch_key(x, transformer_options):
    """The batch layout of a block call, part of every plan key: plans are never shared between calls
    with other rows (cond and uncond batched together, or split when memory is short)."""
    return (x.shape[0], tuple(transformer_options.get("cond_or_uncond") or ()))


@dataclass
class ToMAMethod:
    """ToMA: one plan per block group (level) and batch layout, shared by the group's blocks in a step,
    destinations and weights reused per the schedule."""

    ratio: float
    tile: int
    schedule: ReuseSchedule
    tau: float
    exact: bool
    seed: int = 0
    shared_per_level = True

    def plan(self, cached, features, hw, step, progress, total, group):
        decision = self.schedule.decide(step, progress, group)
        if not decision.merge:
            return None
        if cached is not None and not decision.new_destinations and not decision.new_weights:
            return cached
        x = features()
        if cached is not None and not decision.new_destinations:
            return plan_tiles(x, hw, self.tile, self.ratio, self.tau, self.exact,
                              destinations=getattr(cached, "destinations", None))
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        return plan_tiles(x, hw, self.tile, self.ratio, self.tau, self.exact, generator=gen)


@dataclass
class ToMeSDMethod:
    """ToMeSD: a fresh bipartite matching in every merged block call, as the tomesd package does."""

    ratio: float
    sx: int
    sy: int
    seed: int
    shared_per_level = False

    def plan(self, cached, features, hw, step, progress, total, group):
        x = features()
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        return tomesd_plan(x, hw, self.ratio, self.sx, self.sy, generator=gen)


@dataclass
class CAToMeMethod:
    """CA-ToMe: per block, threshold matching recomputed at the checkpoint steps (CONFIG 3 rescaled to the
    run's steps), reused in between. Without the run's schedule (older ComfyUI) a checkpoint is any step
    whose progress passes one of the config's fractions."""

    threshold: float
    sx: int
    sy: int
    seed: int
    checkpoints: tuple = CATOME_CONFIG3
    _progress_seen: dict = field(default_factory=dict)
    shared_per_level = False

    def is_checkpoint(self, step, progress, total, group) -> bool:
        if total is not None:
            return step in catome_checkpoints(total, self.checkpoints)
        last = self._progress_seen.get(group)
        self._progress_seen[group] = progress
        marks = [s / 50 for s in self.checkpoints]
        return last is None or any(last < m <= progress for m in marks)

    def plan(self, cached, features, hw, step, progress, total, group):
        if cached is not None and not self.is_checkpoint(step, progress, total, group):
            return cached
        x = features()
        gen = torch.Generator(device=x.device).manual_seed(self.seed)
        return catome_plan(x, hw, self.threshold, self.sx, self.sy, generator=gen)

    def reset(self):
        self._progress_seen.clear()


@dataclass
class LevelStats:
    tokens: int = 0
    merged_tokens: int = 0
    steps: set = field(default_factory=set)


class MergeRuntime:
    """Step tracking, plan cache and cost accounting for one patched model."""

    def __init__(self, method, model_sampling, name: str):
        self.method = method
        self.model_sampling = model_sampling  # the patch-time schedule, for runs no hook announced
        self.name = name
        self.clock = RunClock()
        self.plans: dict = {}
        self.failed: set = set()
        self.levels: dict[str, LevelStats] = {}
        self.stage_clock = StageClock(("select", "merge", "unmerge"))
        self.records: dict[str, list] = {}  # level name -> PlanRecords of this run, in step order
        self.run_started = None
        self.run_listeners = []
        self.notices: set = set()  # messages already logged (once per patched model)
        self._in_run = False  # begin_run seen, end_run not yet
        self._unreported = False  # the model ran since the last end_run
        self._run_sampling = None  # model_sampling of the current run
        self._progress: dict = {}  # sigma -> progress under _run_sampling
        self._located = (None, None)  # (sigma tensor of the last model call, its (step, progress, total))

    def __deepcopy__(self, memo):
        # ComfyUI deep-copies model_options (and the bound patch methods in it) on every clone
        # (docs/architecture.md, "patches are deep-copied"); all clones of a patched model must share one
        # runtime, or resets and stats reach a stale copy.
        return self

    def notice(self, message: str, *args) -> None:
        """Log ``message`` once per patched model (a block call repeats it every step otherwise)."""
        if message in self.notices:
            return
        self.notices.add(message)
        log.warning("ToMA: " + message, *args)

    # -- run boundaries -------------------------------------------------------------------------
    def begin_run(self, schedule=None, model_sampling=None):
        """A clean slate for a sampling run. ``schedule``: the run's sigmas (steps+1 floats) where the
        host hands them over; ``model_sampling``: the noise schedule of the model being sampled (model
        sampling nodes may sit before or after the merge node), else the patch-time one."""
        self.plans.clear()
        self.failed.clear()
        self.levels.clear()
        self.records.clear()
        self.stage_clock.reset()
        getattr(self.method, "schedule", None) and self.method.schedule.reset()
        hasattr(self.method, "reset") and self.method.reset()
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
        self._in_run = True
        self.run_started = time.perf_counter()

    def end_run(self):
        """Report the run to the listeners, once (some samplers signal the end twice)."""
        self._in_run = False
        if not self._unreported:
            return
        self._unreported = False
        summary = self.summary()
        self.run_started = None
        for listener in self.run_listeners:
            try:
                listener(summary)
            except Exception:  # a stats listener must never break sampling
                log.exception("ToMA: stats listener failed")

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        """Current ComfyUI's OUTER_SAMPLE wrapper, around ``CFGGuider.outer_sample(noise, latent_image,
        sampler, sigmas, ...)``: a clean slate for every sampling run, with the run's sigmas and the
        sampled model's noise schedule; stats at its end."""
        sigmas = kwargs.get("sigmas", args[3] if len(args) > 3 else None)
        patcher = getattr(getattr(executor, "class_obj", None), "model_patcher", None)
        model_sampling = patcher.get_model_object("model_sampling") if patcher is not None else None
        self.begin_run(None if sigmas is None else [float(s) for s in sigmas.tolist()], model_sampling)
        try:
            return executor(*args, **kwargs)
        finally:
            self.end_run()

    # -- step ---------------------------------------------------------------------------------
    def locate(self, transformer_options):
        """(step, progress, total) of the current model call, from the sampler's sigmas."""
        sigmas = transformer_options.get("sigmas")
        if sigmas is None:
            return None
        if sigmas is self._located[0]:  # a later block of the same model call
            return self._located[1]
        self._unreported = True
        if not self._in_run:
            schedule = transformer_options.get("sample_sigmas")
            self.begin_run(None if schedule is None else schedule.tolist())
        sigma = float(sigmas.flatten()[0])
        step = self.clock.step(sigma)
        if self.clock.schedule is not None:
            progress = self._progress[self.clock.schedule[step]]
        else:
            progress = self._progress.get(sigma)
            if progress is None:
                progress = self._progress[sigma] = progress_of_sigma(self._run_sampling, sigma)
        where = (step, progress, self.clock.total)
        self._located = (sigmas, where)
        return where

    # -- plans --------------------------------------------------------------------------------
    def plan(self, key, features, hw, transformer_options, level_name: str):
        """The plan for this call, or None to run unmerged. ``features`` is a zero-argument callable
        returning the (B, N, C) features that decide similarity (only called when a plan is built)."""
        if key in self.failed:
            return None
        where = self.locate(transformer_options)
        if where is None:
            return None
        step, progress, total = where
        cached = self.plans.get(key)
        self.stage_clock.use(transformer_options["sigmas"].device)
        start = self.stage_clock.start()
        try:
            plan = self.method.plan(cached, features, hw, step, progress, total, key)
        except Exception as e:  # never crash mid-sampling: run this block unmerged from now on
            log.warning("ToMA: merging disabled for %s (%s: %s)", key, type(e).__name__, e)
            self.failed.add(key)
            return None
        if plan is None:
            return None
        if plan is not cached:
            self.stage_clock.stop("select", start)
            self.plans[key] = plan
            self.record(level_name, step, hw, plan)
        stats = self.levels.setdefault(level_name, LevelStats())
        stats.tokens, stats.merged_tokens = hw[0] * hw[1], plan.num_merged
        stats.steps.add(step)
        return plan

    def record(self, level_name, step, hw, plan):
        """Keep what the merge map needs of a newly built plan: one record per level and step."""
        records = self.records.setdefault(level_name, [])
        if records and records[-1].step == step:
            return
        try:
            records.append(record_plan(plan, step, hw, self.method))
        except Exception:  # the map is a diagnostic: never let it break sampling
            log.exception("ToMA: could not record the plan of %s for the merge map", level_name)

    def timed(self, kind, fn, x):
        start = self.stage_clock.start()
        out = fn(x)
        self.stage_clock.stop(kind, start)
        return out

    def summary(self) -> dict:
        wall = None if self.run_started is None else time.perf_counter() - self.run_started
        return {
            "method": self.name,
            "levels": {k: {"tokens": v.tokens, "merged_tokens": v.merged_tokens, "steps": len(v.steps)}
                       for k, v in sorted(self.levels.items())},
            "seconds": self.stage_clock.seconds(),
            "clock": self.stage_clock.kind,
            "wall_seconds": wall,
        }
