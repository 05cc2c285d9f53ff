"""Per-patched-model state while sampling: the run, the plan cache, the stats.

The runtime is the only owner of run boundaries and of the plan cache; the strategy
(``toma_core.strategies``) builds plans, and its schedule says when. ``plan()`` is the one place that
composes them: locate the call (``StepLocator``) -> decide (the schedule) -> cache -> build -> record.

One ``MergeRuntime`` lives in the options of one patched MODEL (see ``registry``). It never holds on to
anything across sampling runs: the run-start hook the adapter installs (``install_run_hooks``) calls
``begin_run``, which clears every cache and takes the run's sigma schedule and noise schedule
(``model_sampling``) from the model being sampled. A model call outside any hooked run (a host without
run hooks) starts a run of its own.
"""
import contextlib
import logging
import time

import torch

from ...toma_core.selection import draw_seed, seed_stream
from ..host import sparse_attention_min_tokens
from .levels import Level, LeftTo, LevelStats, PlanKey, RunReport, batch_key, grid_in_words
from .pace import ENV, REASON, HostPace
from .records import record_plan
from .stages import StageClock
from .step_caches import CacheStack
from .steps import StepLocator, Where

log = logging.getLogger("ComfyUI-ToMA")
FRESH = "a plan key not seen yet"  # the schedule's group for the decision a new key gets
NO_MERGE = (False, False, False)  # a decision (merge, new destinations, new weights) that runs a block unmerged


class ModelCall:
    """What the runtime settled for one model call before the model runs (``MergeRuntime.begin_call``),
    and what the call merged, applied to the run's stats after it (``MergeRuntime.end_call``).

    Under torch.compile the block calls are traced: everything they read from here becomes a guard of the
    graph, so they read only ``decisions`` (a few distinct values over a run: one graph per merge path)
    and never the step, which changes every call; what they write (``merged``, ``built``, ``decisions``)
    is replayed after the graph. The call's random seed (``seed``) is drawn here too, for the same reason:
    a generator cannot be used in traced code, a seed tensor is a graph input like any other. So are the
    counts of rotating destinations (``chosen``): the earlier builds' counts, handed in as tensors, so that a
    rebuild traces no new graph; the updated counts of the plans built (``counted``) are kept after the call."""

    def __init__(self, where: Where, decisions: dict, fresh: tuple[bool, bool, bool], seed: torch.Tensor | None,
                 chosen: dict | None = None, device: torch.device | None = None):
        self.where = where  # host side only: never read in a block call
        self.device = device  # where the call's tensors are (host side only)
        self.decisions = decisions  # PlanKey -> (merge, new destinations, new weights)
        self.fresh = fresh  # the decision of a plan key this run has not seen yet
        self.seed = seed  # int64 scalar from the run's generator, for a strategy that draws_seed
        self.chosen = {} if chosen is None else chosen  # counts key -> (B, T, S) counts of the earlier builds
        self.counted: dict = {}  # counts key -> the counts of the plan built in this call (MergePlan.chosen)
        self.compiled = False  # whether the diffusion model runs under torch.compile (compiled_model)
        self.seeds_taken = 0  # plans built from it in this call: each takes the next stream of it
        self.first_seen: list = []  # such keys, handed to the schedule after the call
        self.merged: dict = {}  # Level -> merged tokens of the plans used in this call
        self.built: list = []  # (Level, plan) built in this call, for the merge map
        self.shared: dict = {}  # (Level, rows) -> destinations a level's first block chose in this call
        self.unmerged: dict = {}  # reason -> block calls of this call run unmerged (MergeRuntime.unmerged)
        self.notices: dict = {}  # reason -> (message, args) of its first block call here, logged after the call


def compiled_model(apply_model, transformer_options) -> bool:
    """Whether the diffusion model behind ``apply_model`` (an APPLY_MODEL wrapper's executor, or the bound
    ``BaseModel.apply_model``) runs under torch.compile: current ComfyUI's TorchCompileModel swaps the
    compiled module in from an APPLY_MODEL wrapper keyed "torch.compile"; older trees object-patch
    ``diffusion_model`` with it (a compiled module keeps the original as ``_orig_mod``)."""
    if "torch.compile" in transformer_options.get("wrappers", {}).get("apply_model", {}):
        return True
    base_model = getattr(apply_model, "class_obj", None) or getattr(apply_model, "__self__", None)
    return hasattr(getattr(base_model, "diffusion_model", None), "_orig_mod")


class MergeRuntime:
    """Step location, plan cache and stats for one patched model."""

    def __init__(self, strategy, model_sampling, placement, pace: HostPace | None = None):
        self.strategy = strategy
        self.placement = placement  # where the node merges (placement.Placement): plans per block, shared destinations
        self.pace = pace  # the rule that stops merging for a run where the host sets the pace (None: no rule)
        self.name = strategy.name
        self.stack = CacheStack(strategy)  # a step cache on the model being sampled, and the strategy beside it
        self.steps = StepLocator(model_sampling)
        self.stages = StageClock(("select", "merge", "unmerge"))
        self.run_listeners = []  # called with summary() when a run ends (the live stats)
        self.notices: set = set()  # messages already logged (once per patched model)
        # the transformer_options of the model call under way, stashed by the DiT adapters' model-call wrapper
        # (adapters.layout.LayoutStash) for blocks called without them (a cache node's own forward_orig)
        self.model_call: dict | None = None
        self.caveats: list[str] = []  # what the patched model does otherwise than its node asks (caveat)
        # the min_tokens of core's Model Sparse Attention node where the model being sampled has it (None: it
        # has not), read at each run's start (host.sparse_attention_min_tokens)
        self.sparse_min_tokens: int | None = None
        # (MODEL being sampled) -> why it merges nothing, or None: asked at each run's start, said as a caveat
        self.run_checks: list = []
        self._plans: dict[PlanKey, object] = {}
        self._shared: dict = {}  # (level, rows) -> the destinations a level's blocks share, chosen last
        # rotating destinations (the strategy's rotation), on the device, by counts key (a PlanKey, or (level,
        # rows) where a level shares destinations): how often each window slot was a destination this run; the
        # last build's destinations as 0/1; the destinations kept from the previous build of their key, and
        # all rebuilt, summed (read at report time)
        self._chosen: dict = {}
        self._last_chosen: dict = {}
        self._kept: torch.Tensor | None = None
        self._generators: dict = {}  # device -> the run's generator, advanced by every plan built
        self._keys: list[PlanKey] = []  # plan keys seen this run, in order: each call decides them first
        self._call: ModelCall | None = None  # the model call running now, where a host hook announced it
        self._loose = None  # (sigma tensor, ModelCall) of a call no host hook announced
        self._failed: set[PlanKey] = set()
        self._levels: dict[Level, LevelStats] = {}
        self._idle: set[str] = set()  # why this run merges nothing (strategy.merges_nothing)
        self._left_to: dict[Level, LeftTo] = {}  # levels another node took (leave)
        self._unmerged: dict[str, int] = {}  # reason -> block calls this run left unmerged (unmerged)
        self._run_started = None
        self._short_run = None  # how this run's schedule adapted to its few steps, in words
        self._in_run = False  # begin_run seen, end_run not yet
        self._unreported = False  # the model ran since the last end_run
        for message in placement.caveats:
            self.caveat(message)

    def __deepcopy__(self, memo):
        # ComfyUI deep-copies model_options (and the bound patch methods in it) on every clone
        # (docs/architecture.md, "patches are deep-copied"); all clones of a patched model must share one
        # runtime, or resets and stats reach a stale copy.
        return self

    def notice(self, message: str, *args, key=None) -> None:
        """Log ``message`` once per patched model (a block call repeats it every step otherwise); once per
        ``key`` where given (default: the message)."""
        key = message if key is None else key
        if key in self.notices:
            return
        self.notices.add(key)
        log.warning("ToMA: " + message, *args)

    def unmerged(self, reason: str, message: str, *args) -> None:
        """Count a block call that runs unmerged although the node would merge it, under ``reason`` (a few
        words: the key of the run report's ``unmerged``), and log ``message % args`` (saying that it runs
        unmerged, and why) the first time the patched model meets that reason. A host-side count, no tensor
        read: safe in a model call."""
        self._unreported = True  # a run whose blocks all ran unmerged still reports why
        if self._call is None:
            self._unmerged[reason] = self._unmerged.get(reason, 0) + 1
            self.notice(message, *args, key=("unmerged", reason))
            return
        # counted and its notice kept in the model call under way, both handed on after it (end_call): the
        # run's counts and the notices said so far, read or written in a block call, would be guards of a
        # compiled graph that fail on later calls, and a log call there breaks the graph
        self._call.unmerged[reason] = self._call.unmerged.get(reason, 0) + 1
        self._call.notices.setdefault(reason, (message, args))

    def caveat(self, message: str) -> None:
        """Log ``message`` once and keep it for every later run's stats: something the node asks for that this
        patched model does not do (said when patching, or when a model call first meets it; a host-side
        list, no tensor read)."""
        if message not in self.caveats:
            self.caveats.append(message)
            log.warning("ToMA: %s: %s", self.name, message)

    # -- run boundaries -------------------------------------------------------------------------
    def begin_run(self, schedule=None, model_sampling=None):
        """A clean slate for a sampling run (``StepLocator.begin`` says what the arguments are)."""
        for cache in (self._plans, self._shared, self._generators, self._failed, self._levels, self._idle,
                      self._left_to, self._unmerged, self._keys, self._chosen, self._last_chosen):
            cache.clear()
        self._call = self._loose = self._kept = None
        self.stages.reset()
        self.strategy = self.stack.begin_run()
        self.strategy.schedule.reset()
        if self.pace is not None:
            self.pace.reset()
        self.steps.begin(schedule, model_sampling)
        self._short_run = self.short_run_in_words(self.steps.total)
        if self._short_run is not None:
            self.notice("%s", self._short_run)
        self._in_run = True
        self._run_started = time.perf_counter()

    def end_run(self):
        """Report the run to the listeners, once (some samplers signal the end twice)."""
        self._in_run = False
        self._flush_loose()
        if self.report_run():
            self._run_started = None

    def report_run(self) -> bool:
        """Send the run's stats to the listeners where the model ran since they were last sent (whether it
        did), the run going on: for a host that cannot tell its run's last model call (kijai's WanVideoSampler:
        each call of its last step reports)."""
        if not self._unreported:
            return False
        self._unreported = False
        summary = self.summary()
        for listener in self.run_listeners:
            try:
                listener(summary)
            except Exception:  # a stats listener must never break sampling
                log.exception("ToMA: stats listener failed")
        return True

    def outer_sample_wrapper(self, executor, *args, **kwargs):
        """Current ComfyUI's OUTER_SAMPLE wrapper, around ``CFGGuider.outer_sample(noise, latent_image,
        sampler, sigmas, ...)``: a clean slate for every sampling run, with the run's sigmas and the
        sampled model's noise schedule; stats at its end."""
        sigmas = kwargs.get("sigmas", args[3] if len(args) > 3 else None)
        patcher = getattr(getattr(executor, "class_obj", None), "model_patcher", None)
        model_sampling = patcher.get_model_object("model_sampling") if patcher is not None else None
        self.sparse_min_tokens = None if patcher is None else sparse_attention_min_tokens(patcher)
        for check in self.run_checks if patcher is not None else ():
            why = check(patcher)
            if why:
                self.caveat(why)
        self.begin_run(None if sigmas is None else [float(s) for s in sigmas.tolist()], model_sampling)
        try:
            return executor(*args, **kwargs)
        finally:
            self.end_run()

    def sampler_sample_wrapper(self, executor, *args, **kwargs):
        """Current ComfyUI's SAMPLER_SAMPLE wrapper, around ``Sampler.sample(guider, sigmas, extra_args,
        callback, ...)`` inside the run: the sampler gets a callback that reports each finished step to the
        step locator (then the preview's callback, where there is one), so model calls are located without
        reading their sigma tensors (a device-to-host sync each on a GPU)."""
        callback = kwargs.get("callback", args[3] if len(args) > 3 else None)

        def report_step(step, *rest):
            self.steps.report(step)
            if callback is not None:
                return callback(step, *rest)

        if "callback" in kwargs or len(args) <= 3:
            kwargs["callback"] = report_step
        else:
            args = args[:3] + (report_step,) + args[4:]
        self.steps.follow_reports()
        return executor(*args, **kwargs)

    def learn_total(self, total: int) -> None:
        """The run's step count, for a host that tells it only once the run is under way (kijai's
        WanVideoSampler: the step and the fraction of steps done that each model call is given, from step 1
        on): the report's steps, and the short-run rule, said once, where it applies."""
        if self.steps.total is not None:
            return
        self.steps.tell_total(total)
        self._short_run = self.short_run_in_words(total)
        if self._short_run is not None:
            self.notice("%s", self._short_run)

    def short_run_in_words(self, total: int | None) -> str | None:
        """How the strategy's schedule adapts to a run of ``total`` steps (its ``short_run``), in words;
        None where it does not."""
        schedule = self.strategy.schedule
        if not getattr(schedule, "is_short", lambda total: False)(total):
            return None
        return (f"a {total}-step run (at most {schedule.short_run.steps}) merges "
                f"{schedule.short_run.in_words()}")

    def locate(self, transformer_options) -> Where | None:
        """Where the current model call is in its run, from the sampler's sigmas (a call outside any
        announced run begins one)."""
        sigmas = transformer_options.get("sigmas")
        if sigmas is None:
            return None
        if not self.steps.located(sigmas):
            self._unreported = True
            if not self._in_run:
                schedule = transformer_options.get("sample_sigmas")
                self.begin_run(None if schedule is None else schedule.tolist())
            if self.steps.silent():
                self.steps.stop_following()
                self.caveat(f"the sampler reported no step in {self.steps.SILENT_CALLS} model calls: from then "
                            "on each model call's step is read from its sigma (one device read per model call)")
        return self.steps.locate(sigmas)

    def around_model_call(self, apply_model, *args, **kwargs):
        """Around one call of the model (``BaseModel.apply_model(x, t, ..., transformer_options)``): the
        step is located and the plan decisions made before the model runs, outside the diffusion model
        that torch.compile traces (ComfyUI's TorchCompileModel compiles only that); the stats are
        updated after it."""
        options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
        x = kwargs.get("x", args[0] if args else None)
        call = None if options is None else self.begin_call(options, getattr(x, "shape", (None,))[0])
        if call is not None:
            call.compiled = compiled_model(apply_model, options)
        under_compile = getattr(self.strategy, "under_compile", None)
        if call is not None and under_compile and call.compiled:
            self.caveat(f"under torch.compile {under_compile}")
        return self.run_call(call, apply_model, *args, **kwargs)

    @property
    def compiled_call(self) -> bool:
        """Whether the model call under way runs its diffusion model under torch.compile (a host-side flag
        set before the model runs: constant over a compiled run, so a guard that never fails)."""
        return self._call is not None and self._call.compiled

    def run_call(self, call: ModelCall | None, model, /, *args, **kwargs):
        """``model(*args, **kwargs)`` as the model call ``call`` (None: a call the host did not locate): its
        block calls read the decisions settled for it, and what it merged reaches the stats after it."""
        self._call = call
        # the call's start on the device, where the host-pace rule judges it (eager only: pace.py says why)
        device = None if call is None else call.device
        started = None if self.pace is None or call is None or call.compiled else self.pace.start(device)
        try:
            out = model(*args, **kwargs)
            if started is not None:  # the host is done issuing the call
                self.pace.finish(started, device, bool(call.merged))
            return out
        finally:
            self._call = None
            if call is not None:
                self.end_call(call)

    def apply_model_wrapper(self, executor, *args, **kwargs):
        """Current ComfyUI's APPLY_MODEL wrapper: ``around_model_call``."""
        return self.around_model_call(executor, *args, **kwargs)

    def begin_call(self, transformer_options, batch: int | None) -> ModelCall | None:
        """Locate a model call and decide, for every plan key this run has seen with the call's batch
        layout, whether it merges and what it rebuilds (the schedule's decision, as its first block
        would take it)."""
        where = self.locate(transformer_options)
        if where is None:
            return None
        self.strategy = self.stack.settle(transformer_options, self.strategy)  # a run's first call: a step cache?
        return self.call_at(where, transformer_options["sigmas"].device, batch,
                            tuple(transformer_options.get("cond_or_uncond") or ()))

    def call_at(self, where: Where, device, batch: int | None, layout: tuple) -> ModelCall:
        """``begin_call`` for a model call located at ``where`` on ``device``, whose blocks see ``batch`` rows in
        the ``layout`` their plan keys name (``cond_or_uncond``): for a host whose model calls say their own
        step (kijai's WanVideoSampler), as for calls located by their sigmas."""
        self._unreported = True
        self.stages.use(device)
        paced = self.paced_by_host()  # the rest of the run runs unmerged: no plan is built or used, no seed drawn
        generator = self.generator(device)  # made here: a generator cannot be made (nor used) in traced code
        seed = draw_seed(generator).to(device) if getattr(self.strategy, "draws_seed", False) and not paced else None
        decisions = {}
        for key in self._keys:
            if key.rows == (batch, layout) and key not in self._failed:
                decisions[key] = NO_MERGE if paced else self.decide(where, key)
        fresh = NO_MERGE if paced else self.decide(where, FRESH)
        self.strategy.schedule.forget(FRESH)
        chosen = {key: counts for key, counts in self._chosen.items() if key[-1] == (batch, layout)}
        return ModelCall(where, decisions, fresh, seed, chosen, device)

    def paced_by_host(self) -> bool:
        """Whether the host sets this run's pace, so the model call beginning now runs unmerged: the previous
        merged call judged (``HostPace.judge``, no wait), and the rule's stop said once in the log."""
        if self.pace is None:
            return False
        if self.pace.judge():
            self.notice("%s runs the rest of the run unmerged: %s (the GPU waited for the host's kernels in the "
                        "first %d model calls that merged, so merging would only add kernels); %s=off keeps merging",
                        self.name, REASON, self.pace.stopped_after, ENV, key=("unmerged", REASON))
        if self.pace.stopped:
            self._unreported = True
            self.pace.unmerged_calls += 1
        return self.pace.stopped

    def decide(self, where: Where, key: PlanKey) -> tuple[bool, bool, bool]:
        """The schedule's decision for ``key`` at ``where``, as (merge, new destinations, new weights)."""
        d = self.strategy.schedule.decide(where.step, where.progress, key, where.total)
        return d.merge, d.new_destinations, d.new_weights

    def end_call(self, call: ModelCall) -> None:
        """What a model call merged, into the run's stats and the merge map's records; the plan keys it
        saw first, to the schedule (decided as they were in the call: as new groups)."""
        for key in call.first_seen:
            self.decide(call.where, key)
            self._keys.append(key)
        for reason, count in call.unmerged.items():
            self._unmerged[reason] = self._unmerged.get(reason, 0) + count
        for reason, (message, args) in call.notices.items():
            self.notice(message, *args, key=("unmerged", reason))
        for level, merged in call.merged.items():
            stats = self._levels.setdefault(level, LevelStats())
            stats.tokens, stats.merged_tokens = level.tokens, merged
            stats.steps.add(call.where.step)
        for level, plan in call.built:
            self.record(level, call.where.step, plan)
        for key, counts in call.counted.items():
            self.count_rotation(key, counts)
        call.merged, call.built, call.first_seen, call.unmerged, call.notices = {}, [], [], {}, {}
        call.counted = {}

    def count_rotation(self, key, counts: torch.Tensor) -> None:
        """Keep the counts of rotating destinations a plan of counts key ``key`` was built with, for the key's
        next build, and add to the run's sums the destinations it kept from the key's previous build: a few
        kernels after the model call, on the device (read only by ``report``)."""
        previous = self._chosen.get(key)
        chosen = counts if previous is None else counts - previous  # this build's destinations, 0/1
        last = self._last_chosen.get(key)
        if last is not None:
            kept = torch.stack([(chosen * last).sum(), chosen.sum()])
            self._kept = kept if self._kept is None else self._kept + kept
        self._chosen[key], self._last_chosen[key] = counts, chosen

    def _loose_call(self, transformer_options) -> ModelCall | None:
        """The ModelCall of a block call no host hook announced (a model called outside ComfyUI's sampler,
        a host without the hook): one per sigma tensor, as the sampler hands each model call its own."""
        sigmas = transformer_options.get("sigmas")
        if sigmas is None:
            return None
        if self._loose is not None and self._loose[0] is sigmas:
            return self._loose[1]
        self._flush_loose()
        x_batch = None  # the batch is read from the block's tokens by plan()
        call = self.begin_call(transformer_options, x_batch)
        self._loose = None if call is None else (sigmas, call)
        return call

    def _flush_loose(self) -> None:
        if self._loose is not None:
            self.end_call(self._loose[1])

    # -- plans --------------------------------------------------------------------------------
    def plan(self, level: Level, block, x, features, transformer_options):
        """The plan for this block call, or None to run it unmerged.

        level: where the call's tokens are (its group's token grid); its blocks share one plan per step
        where the strategy shares plans. block: this block, for strategies that plan per block. x: the
        block's tokens (B, N, C), whose batch layout is part of the plan key. features: zero-argument
        callable returning the (B, N, C) features that decide similarity (called only when a plan is
        built)."""
        rows = batch_key(x, transformer_options)
        key = self.plan_key(level, block, rows)
        if key in self._failed:
            self.unmerged("no plan", "%s leaves %s unmerged: it could not build a merge plan", self.name, level)
            return None
        call = self._call if self._call is not None else self._loose_call(transformer_options)
        if call is None:
            self.unmerged("no sampling step", "%s leaves %s unmerged: its model call carries no sigmas, so its "
                          "sampling step is unknown", self.name, level)
            return None
        idle = self.strategy.merges_nothing(level.grid)
        if idle is not None:
            self.notice("%s merges nothing: %s", self.name, idle)
            self._idle.add(idle)
            return None
        decision = call.decisions.get(key)
        if decision is None:  # a key this run has not seen
            decision = call.decisions[key] = call.fresh
            call.first_seen.append(key)
        merge, new_destinations, new_weights = decision
        if not merge:
            return None
        # a plan with new destinations needs nothing of the cached one: not reading it keeps the traced block
        # call of a run's first build and of its later ones the same graph (blocks compiled one by one)
        plan = cached = None if new_destinations else self._plans.get(key)
        if cached is None or new_weights:
            try:
                with self.stage("select"):
                    given = None if cached is None else getattr(cached, "destinations", None)
                    plan = self.build(call, level, rows, features, given, key)
            except Exception:  # never crash mid-sampling: run this block unmerged from now on
                self._failed.add(key)
                self.unmerged("no plan", "%s leaves %s unmerged: it could not build a merge plan for %s (the error "
                              "is in the debug log)", self.name, level, grid_in_words(level.grid))
                log.debug("ToMA: %s could not build a plan for %s", self.name, level, exc_info=True)
                return None
            self._plans[key] = plan
            call.built.append((level, plan))
            call.decisions[key] = (True, False, False)  # later blocks of the key in this call reuse it
        call.merged[level] = plan.num_merged
        return plan

    def plan_key(self, level: Level, block, rows: tuple) -> PlanKey:
        """The key of the plan ``block`` uses at ``level`` for calls of batch layout ``rows`` (``batch_key``)."""
        return PlanKey(level, block if self.placement.plan_per_block else None, rows)

    def expect(self, call: ModelCall, keys) -> None:
        """Settle before the model runs the decisions of plan ``keys`` this call's blocks will ask for that the run
        has not seen (``plan`` takes them inside the block call otherwise): where each block is compiled on its
        own (kijai's WanVideoWrapper), a block then traces one path per decision, none more for the run's first
        call."""
        for key in keys:
            if key not in call.decisions and key not in self._failed:
                call.decisions[key] = call.fresh
                call.first_seen.append(key)
            counted = self.counts_key(key)
            if getattr(self.strategy, "rotation", 0) and counted not in call.chosen:  # zeros: a first build too
                call.chosen[counted] = self.strategy.first_counts(key.level.shape, key.rows[0], call.device)

    def build(self, call: ModelCall, level: Level, rows: tuple, features, given, key: PlanKey):
        """A new plan for ``level`` with the ``given`` destinations (None: choose them); where the
        strategy shares destinations within a level, the first block of a call that chooses new ones
        chooses them for all. A strategy that rotates destinations is given the counts of the earlier
        builds of the plan key (of the level, where it shares destinations) in the call (``ModelCall.chosen``), and the plan's updated
        counts are kept after it."""
        shared = (level, rows) if self.placement.shared_destinations else None
        if given is None and shared is not None and shared in call.shared:
            given = call.shared[shared]  # another block of the level chose them in this call
        feats = features()
        rotates = given is None and getattr(self.strategy, "rotation", 0)
        counted = self.counts_key(key)
        extra = {"chosen": call.chosen.get(counted)} if rotates else {}
        if call.seed is None:
            plan = self.strategy.build(feats, level.shape, self.generator(feats.device), given, **extra)
        else:  # the next stream of the call's seed, where the block's tokens are (a no-op on one device)
            seed = seed_stream(call.seed, call.seeds_taken).to(feats.device)
            call.seeds_taken += 1
            plan = self.strategy.build(feats, level.shape, None, given, seed=seed, **extra)
        if shared is not None and given is None and hasattr(plan, "destinations"):
            call.shared[shared] = self._shared[shared] = plan.destinations
        if rotates and getattr(plan, "chosen", None) is not None:
            call.counted[counted] = plan.chosen
        return plan

    def counts_key(self, key: PlanKey) -> tuple:
        """What rotation counts are kept by for the plans of ``key``: the key, or (level, rows) where the
        blocks of a level share destinations (its first block chooses them for all)."""
        if self.placement.shared_destinations:
            return (key.level, key.rows)
        return key

    def leave(self, level: Level, transformer_options, taker, why: str = "changed its tokens first") -> str:
        """Note that another node took ``level`` in this model call, for the run's stats; ``taker()``
        names that node, asked once per level and run; ``why``: what that node did, in words ("changed
        its tokens first": a UNet level; "took its blocks": DiT blocks of a token merge node nearer the
        sampler). The name."""
        if self._call is None:  # announced calls were located before the model ran
            self._loose_call(transformer_options)  # the run reports even if no level of it merged
        if level not in self._left_to:
            self._left_to[level] = LeftTo(taker(), why)
        return self._left_to[level].node

    def merges(self, level: Level) -> bool:
        """Whether this run merged ``level`` so far, the model call under way included (its merges reach
        the run's stats only after the call: end_call)."""
        calls = (self._call, self._loose[1] if self._loose is not None else None)
        return level in self._levels or any(call is not None and level in call.merged for call in calls)

    def generator(self, device) -> torch.Generator:
        """The run's generator on ``device``, seeded with the strategy's seed at the run's first model call
        (a strategy that ``draws_seed`` draws one seed from it per model call, the others draw from it in
        every build)."""
        if device not in self._generators:
            # the meta device has no generator: plans built there (the cost model, toma_bench.costmodel,
            # records real-size models on it) draw their random numbers on the CPU
            where = "cpu" if device.type == "meta" else device
            self._generators[device] = torch.Generator(device=where).manual_seed(self.strategy.seed)
        return self._generators[device]

    def record(self, level: Level, step: int, plan) -> None:
        """Keep what the merge map needs of a newly built plan: one record per level and step (none of a
        rank's slab: the map draws whole grids)."""
        records = self._levels.setdefault(level, LevelStats()).records
        if level.slab is not None or (records and records[-1].step == step):
            return
        try:
            rotation = getattr(self.strategy, "rotation", 0) and records
            records.append(record_plan(plan, step, level.grid, self.strategy, records[-1] if rotation else None))
        except Exception:  # the map is a diagnostic: never let it break sampling
            log.exception("ToMA: could not record the plan of %s for the merge map", level)

    def stage(self, kind: str):
        """Time the block as the merging stage ``kind`` ("select", "merge", "unmerge"); untimed while
        torch.compile traces it (a clock read there would break the graph, and inside a compiled graph
        there is no stage to time: the stats say the stages went untimed)."""
        if torch.compiler.is_compiling():
            self.stages.untimed = True
            return contextlib.nullcontext()
        return self.stages.timing(kind)

    # -- reading ------------------------------------------------------------------------------
    def report(self) -> RunReport:
        """What this runtime knows of its current (or last) run (a snapshot; reading the stage times
        waits for the device)."""
        self._flush_loose()
        wall = None if self._run_started is None else time.perf_counter() - self._run_started
        kept = None
        if self._kept is not None and self._kept.device.type != "meta":  # the cost model's plans hold no values
            same, rebuilt = self._kept.tolist()
            kept = same / rebuilt if rebuilt else None
        return RunReport(
            method=self.name, steps=self.steps.total, schedule=self.steps.schedule, short_run=self._short_run,
            levels={level: LevelStats(s.tokens, s.merged_tokens, set(s.steps), list(s.records))
                    for level, s in self._levels.items()},
            plans=dict(self._plans), shared_destinations=dict(self._shared),
            left_to=dict(self._left_to), nothing_merges=tuple(sorted(self._idle)), failed=frozenset(self._failed),
            unmerged=dict(self._unmerged),
            seconds=self.stages.seconds(), clock=self.stages.kind, wall_seconds=wall, caveats=tuple(self.caveats),
            untimed=self.stages.untimed, host_paced=None if self.pace is None else self.pace.summary(),
            rotation=float(getattr(self.strategy, "rotation", 0.0)), destinations_kept=kept,
            step_cache=self.stack.summary())

    def summary(self) -> dict:
        """The report as JSON (``RunReport.summary``), what the run listeners get."""
        return self.report().summary()
