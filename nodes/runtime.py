"""Per-patched-model state while sampling: which step we are at, which plans are cached, what it cost;
and how a MODEL leads to its runtime.

The runtime is the only owner of run boundaries and of the plan cache; the strategy
(``toma_core.strategies``) builds plans, and its schedule says when.

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
import math
import time
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from ..toma_core import RunClock
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


def grid_in_words(grid) -> str:
    """(h, w) or (frames, h, w) -> "a 1x1 token grid (1 token)", "a 3-frame 4x4 token grid (48 tokens)"."""
    *frames, h, w = grid
    tokens = math.prod(grid)
    depth = f"{frames[0]}-frame " if frames else ""
    return f"a {depth}{h}x{w} token grid ({tokens} token{'s' if tokens != 1 else ''})"


def batch_key(x, transformer_options):
    """The batch layout of a block call, part of every plan key: plans are never shared between calls
    with other rows (cond and uncond batched together, or split when memory is short)."""
    return (x.shape[0], tuple(transformer_options.get("cond_or_uncond") or ()))


@dataclass
class LevelStats:
    tokens: int = 0
    merged_tokens: int = 0
    steps: set = field(default_factory=set)
    details: dict = field(default_factory=dict)  # what the adapter knows of the level (UNet: downsample)


class MergeRuntime:
    """Step tracking, plan cache and cost accounting for one patched model."""

    def __init__(self, strategy, model_sampling):
        self.strategy = strategy
        self.model_sampling = model_sampling  # the patch-time schedule, for runs no hook announced
        self.name = strategy.name
        self.clock = RunClock()
        self.plans: dict = {}
        self.group_destinations: dict = {}  # (group, grid, batch) -> (step, destinations) where blocks share them
        self.generators: dict = {}  # device -> the run's generator, advanced by every plan built
        self.failed: set = set()
        self.levels: dict[str, LevelStats] = {}
        self.idle: set[str] = set()  # why this run merges nothing (strategy.merges_nothing), for the stats
        self.left_to: dict[str, dict] = {}  # level -> {node, why}: the other node that took it (leave)
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
        self.group_destinations.clear()
        self.generators.clear()
        self.failed.clear()
        self.levels.clear()
        self.idle.clear()
        self.left_to.clear()
        self.records.clear()
        self.stage_clock.reset()
        self.strategy.schedule.reset()
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
    def plan(self, group, block, grid, x, features, transformer_options, level: str, **details):
        """The plan for this block call, or None to run it unmerged.

        group: the block group (UNet level, DiT block group) whose blocks share one plan per step where
        the strategy shares plans; block: this block, for strategies that match per block. grid: the
        token grid (h, w). x: the block's tokens (B, N, C), whose batch layout is part of the plan key.
        features: zero-argument callable returning the (B, N, C) features that decide similarity (called
        only when a plan is built). level: the level's name in stats, logs and the merge map; details:
        more about it for the stats (UNet: downsample)."""
        rows = batch_key(x, transformer_options)
        key = (group if self.strategy.shares_plans else block, tuple(grid), rows)
        if key in self.failed:
            return None
        where = self.locate(transformer_options)
        if where is None:
            return None
        step, progress, total = where
        idle = self.strategy.merges_nothing(grid)
        if idle is not None:
            self.notice("%s merges nothing: %s", self.name, idle)
            self.idle.add(idle)
            return None
        decision = self.strategy.schedule.decide(step, progress, key, total)
        if not decision.merge:
            return None
        plan = cached = self.plans.get(key)
        if cached is None or decision.new_destinations or decision.new_weights:
            self.stage_clock.use(transformer_options["sigmas"].device)
            try:
                with self.stage_clock.timing("select"):
                    given = None if cached is None or decision.new_destinations else getattr(cached, "destinations", None)
                    shared = (group, tuple(grid), rows) if getattr(self.strategy, "shares_destinations", False) else None
                    if given is None and shared is not None and self.group_destinations.get(shared, (None,))[0] == step:
                        given = self.group_destinations[shared][1]  # another block of the group chose them this step
                    feats = features()
                    plan = self.strategy.build(feats, grid, self.generator(feats.device), given)
                    if shared is not None and given is None and hasattr(plan, "destinations"):
                        self.group_destinations[shared] = (step, plan.destinations)
            except Exception:  # never crash mid-sampling: run this block unmerged from now on
                self.failed.add(key)
                self.notice("%s leaves %s unmerged: it could not build a merge plan for %s (the error is in "
                            "the debug log)", self.name, level, grid_in_words(grid))
                log.debug("ToMA: %s could not build a plan for %s", self.name, level, exc_info=True)
                return None
            self.plans[key] = plan
            self.record(level, step, grid, plan)
        stats = self.levels.setdefault(level, LevelStats())
        stats.tokens, stats.merged_tokens = math.prod(grid), plan.num_merged
        stats.steps.add(step)
        stats.details = details
        return plan

    def leave(self, level: str, transformer_options, taker, why: str = "changed its tokens first") -> str:
        """Note that another node took ``level`` in this model call, for the run's stats; ``taker()``
        names that node, asked once per level and run; ``why``: what that node did, in words ("changed
        its tokens first": a UNet level; "took its blocks": DiT blocks of a token merge node nearer the
        sampler). The name."""
        self.locate(transformer_options)  # the run reports even if no level of it merged
        if level not in self.left_to:
            self.left_to[level] = {"node": taker(), "why": why}
        return self.left_to[level]["node"]

    def generator(self, device) -> torch.Generator:
        """The run's generator on ``device``, seeded with the strategy's seed at the run's first build."""
        if device not in self.generators:
            # the meta device has no generator: plans built there (the cost model, toma_bench.costmodel,
            # records real-size models on it) draw their random numbers on the CPU
            where = "cpu" if device.type == "meta" else device
            self.generators[device] = torch.Generator(device=where).manual_seed(self.strategy.seed)
        return self.generators[device]

    def record(self, level_name, step, hw, plan):
        """Keep what the merge map needs of a newly built plan: one record per level and step."""
        records = self.records.setdefault(level_name, [])
        if records and records[-1].step == step:
            return
        try:
            records.append(record_plan(plan, step, hw, self.strategy))
        except Exception:  # the map is a diagnostic: never let it break sampling
            log.exception("ToMA: could not record the plan of %s for the merge map", level_name)

    def timed(self, kind, fn, x):
        with self.stage_clock.timing(kind):
            return fn(x)

    def summary(self) -> dict:
        wall = None if self.run_started is None else time.perf_counter() - self.run_started
        return {
            "method": self.name,
            "levels": {k: {"tokens": v.tokens, "merged_tokens": v.merged_tokens, "steps": len(v.steps),
                           **v.details} for k, v in sorted(self.levels.items())},
            "nothing_merges": sorted(self.idle),
            "left_to": dict(sorted(self.left_to.items())),
            "seconds": self.stage_clock.seconds(),
            "clock": self.stage_clock.kind,
            "wall_seconds": wall,
        }


# -- MODEL -> runtime ---------------------------------------------------------------------------
# ``model_options`` is deep-copied whenever ComfyUI clones a patcher (docs/architecture.md, "patches are
# deep-copied"), so the MODEL carries only a string: ``model_options["transformer_options"]["comfyui_toma"]``
# is a registry id, and ``RUNTIMES`` maps ids to live runtimes. The registry holds them weakly: a runtime
# lives exactly as long as the patches of some model refer to it, and a string survives any number of
# clones (every clone of a patched model shares its runtime, see ``MergeRuntime.__deepcopy__``).
OPTIONS_KEY = "comfyui_toma"
RUNTIMES: "weakref.WeakValueDictionary[str, MergeRuntime]" = weakref.WeakValueDictionary()
STACK_KEY = "comfyui_toma_stack"  # ids of every token merge node's runtime on this MODEL, in patch order


OWNERS_KEY = "comfyui_toma_owners"  # what the MODEL's object patches reach only weakly, held by the MODEL


def hold(model, owner) -> None:
    """Keep ``owner`` (an adapter's patch state, and through it the runtime) alive exactly as long as
    ``model`` or a clone of it. Object patches stay applied to the shared BaseModel after sampling (even
    after the patched MODEL is gone, until another clone loads), so they reach their owner through a weak
    reference, and the MODEL's ``model_options`` hold it instead (clones share it: owners return
    themselves from ``__deepcopy__``)."""
    options = model.model_options.setdefault("transformer_options", {})
    options[OWNERS_KEY] = list(options.get(OWNERS_KEY, ())) + [owner]


def attach_runtime(model, runtime) -> str:
    """Register ``runtime`` and write its id into the patched ``model``'s transformer_options."""
    runtime_id = f"{runtime.name}-{uuid.uuid4().hex}"
    RUNTIMES[runtime_id] = runtime
    options = model.model_options.setdefault("transformer_options", {})
    options[OPTIONS_KEY] = runtime_id
    options[STACK_KEY] = list(options.get(STACK_KEY, ())) + [runtime_id]
    return runtime_id


NOT_PATCHED = ("model: this MODEL was not patched by a ToMA, ToMeSD or CA-ToMe node of this pack (or it was "
               "patched with ratio 0, or the model family is not supported), so there are no merge plans to "
               "show; connect the MODEL output of the token merge node")


def runtime_of(model):
    """The runtime of the token merge node nearest the sampler on ``model`` (or on a model it was cloned
    from)."""
    options = getattr(model, "model_options", None) or {}
    runtime_id = options.get("transformer_options", {}).get(OPTIONS_KEY)
    runtime = RUNTIMES.get(runtime_id) if runtime_id is not None else None
    if runtime is None:
        raise ValueError(NOT_PATCHED)
    return runtime


def runtimes_of(model) -> list:
    """The runtimes of every token merge node on ``model``, the one nearest the sampler first."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options", {})
    runtimes = [RUNTIMES.get(i) for i in reversed(options.get(STACK_KEY, ()))]
    runtimes = [r for r in runtimes if r is not None]
    if not runtimes:
        raise ValueError(NOT_PATCHED)
    return runtimes
