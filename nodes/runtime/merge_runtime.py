"""Per-patched-model state while sampling: the run, the host's wrappers around it, the stats.

The runtime is the only owner of run boundaries; its plan store (``plans.PlanStore``) holds the plan cache,
the schedule's decisions and rotation's counts; the strategy (``toma_core.strategies``) builds plans, and its
schedule says when. ``plan()`` is the one place that composes them: locate the call (``StepLocator``) ->
decide (the schedule, through the store) -> cache -> build -> record. A model call's state is a ``ModelCall``
(``model_call``).

One ``MergeRuntime`` lives in the options of one patched MODEL (see ``registry``). It never holds on to
anything across sampling runs: the run-start hook the adapter installs (``install_run_hooks``) calls
``begin_run``, which clears every cache and takes the run's sigma schedule and noise schedule
(``model_sampling``) from the model being sampled. A model call outside any hooked run (a host without
run hooks) starts a run of its own.
"""
import logging
import time

from ..host import sparse_attention_min_tokens
from . import malloc_graph
from .levels import Level, LeftTo, LevelStats, RunReport, batch_key, grid_in_words
from .model_call import ModelCall, compiled_model
from .pace import HostPace
from .plans import PlanStore
from .records import keep_record
from .stages import StageClock
from .step_caches import CacheStack
from .steps import StepLocator, Where

log = logging.getLogger("ComfyUI-ToMA")


class MergeRuntime:
    """The run, the host's wrappers around it and its stats, for one patched model; its plans are in
    ``plans`` (a PlanStore)."""

    def __init__(self, strategy, model_sampling, placement, pace: HostPace | None = None,
                 stack_kind: str | None = None):
        self.strategy = strategy
        # where and how the node merges (placement.Placement), as settled once: read by the plan store (plans per
        # block, shared destinations, rotation) and by the adapters (the scope, sequence-parallel slabs)
        self.placement = placement
        self.pace = pace  # the rule that stops merging for a run where the host sets the pace (None: no rule)
        self.name = strategy.name
        # a step cache on the model being sampled, and the strategy beside it (stack_kind: the kind of model whose
        # stack setting the node takes; None: it merges as set)
        self.stack = CacheStack(strategy, stack_kind)
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
        self.plans = PlanStore(strategy, placement)  # the plan cache, the reuse decisions, rotation's counts
        self._call: ModelCall | None = None  # the model call running now, where a host hook announced it
        self._loose = None  # (sigma tensor, ModelCall) of a call no host hook announced
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
            # the pack's prefix, then the method's name unless it is the same ("ToMA: ToMA: ..." read twice)
            log.warning("ToMA: %s", message if self.name == "ToMA" else f"{self.name}: {message}")

    # -- run boundaries -------------------------------------------------------------------------
    def begin_run(self, schedule=None, model_sampling=None):
        """A clean slate for a sampling run (``StepLocator.begin`` says what the arguments are)."""
        for cache in (self._levels, self._idle, self._left_to, self._unmerged):
            cache.clear()
        self.strategy = self.plans.use(self.stack.begin_run())  # every run begins with the node's own strategy
        self.plans.clear()
        self._call = self._loose = None
        self.stages.reset()
        if self.pace is not None:
            self.pace.reset()
        self.steps.begin(schedule, model_sampling)
        self._short_run = self.plans.short_run(self.steps.total)
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
        self._short_run = self.plans.short_run(total)
        if self._short_run is not None:
            self.notice("%s", self._short_run)

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
        """Around one call of the model (``BaseModel.apply_model(x, t, ..., transformer_options)``; current
        ComfyUI's APPLY_MODEL wrapper, ``apply_model`` its executor): the
        step is located and the plan decisions made before the model runs, outside the diffusion model
        that torch.compile traces (ComfyUI's TorchCompileModel compiles only that); the stats are
        updated after it."""
        options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
        x = kwargs.get("x", args[0] if args else None)
        call = None if options is None else self.begin_call(options, getattr(x, "shape", (None,))[0])
        if call is not None:
            call.compiled = compiled_model(apply_model, options)
        if call is not None and self.strategy.under_compile and call.compiled:
            self.caveat(f"under torch.compile {self.strategy.under_compile}")
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

    def begin_call(self, transformer_options, batch: int | None) -> ModelCall | None:
        """Locate a model call and decide, for every plan key this run has seen with the call's batch
        layout, whether it merges and what it rebuilds (the schedule's decision, as its first block
        would take it)."""
        where = self.locate(transformer_options)
        if where is None:
            return None
        # a run's first call: beside a step cache the node may merge otherwise (step_caches.py)
        self.strategy = self.plans.use(self.stack.settle(transformer_options, self.strategy, self.steps.total))
        return self.call_at(where, transformer_options["sigmas"].device, batch,
                            tuple(transformer_options.get("cond_or_uncond") or ()))

    def call_at(self, where: Where, device, batch: int | None, layout: tuple) -> ModelCall:
        """``begin_call`` for a model call located at ``where`` on ``device``, whose blocks see ``batch`` rows in
        the ``layout`` their plan keys name (``cond_or_uncond``): for a host whose model calls say their own
        step (kijai's WanVideoSampler), as for calls located by their sigmas."""
        self._unreported = True
        self.stages.use(device)
        # where the host sets the run's pace, the rest of the run runs unmerged: no plan is built or used
        paced = self.pace is not None and self.pace.stops(self.notice, self.name)
        return self.plans.call(where, device, batch, layout, paced)

    def end_call(self, call: ModelCall) -> None:
        """What a model call merged, into the run's stats and the merge map's records; what it leaves the plan
        store (``PlanStore.after_call``: the keys it saw first, the rotation counts of its builds)."""
        self.plans.after_call(call)
        for reason, count in call.unmerged.items():
            self._unmerged[reason] = self._unmerged.get(reason, 0) + count
        for reason, (message, args) in call.notices.items():
            self.notice(message, *args, key=("unmerged", reason))
        for level, merged in call.merged.items():
            stats = self._levels.setdefault(level, LevelStats())
            stats.tokens, stats.merged_tokens = level.tokens, merged
            stats.steps.add(call.where.step)
        for level, plan in call.built:
            keep_record(self._levels.setdefault(level, LevelStats()).records, level, call.where.step, plan,
                        self.strategy, self.plans.rotation)
        call.merged, call.built, call.first_seen, call.unmerged, call.notices = {}, [], [], {}, {}
        call.counted = {}

    def _loose_call(self, transformer_options) -> ModelCall | None:
        """The ModelCall of a block call no host hook announced (a model called outside ComfyUI's sampler,
        a host without the hook): one per sigma tensor, as the sampler hands each model call its own."""
        sigmas = transformer_options.get("sigmas")
        if sigmas is None:
            return None
        if self._loose is not None and self._loose[0] is sigmas:
            return self._loose[1]
        with malloc_graph.kept_past_block():  # in a block call: the call's seed and the previous call's counts are kept
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
        key = self.plans.key(level, block, rows)
        if key in self.plans.failed:
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
        plan = cached = None if new_destinations else self.plans.by_key.get(key)
        if cached is None or new_weights:
            try:  # the plan outlives the block call: made outside the host's malloc graph (malloc_graph.py)
                with self.stages.stage("select"), malloc_graph.kept_past_block():
                    given = None if cached is None else getattr(cached, "destinations", None)
                    plan = self.plans.build(call, level, rows, features, given, key)
            except Exception:  # never crash mid-sampling: run this block unmerged from now on
                self.plans.failed.add(key)
                self.unmerged("no plan", "%s leaves %s unmerged: it could not build a merge plan for %s (the error "
                              "is in the debug log)", self.name, level, grid_in_words(level.grid))
                log.debug("ToMA: %s could not build a plan for %s", self.name, level, exc_info=True)
                return None
            self.plans.keep(call, level, key, plan)
        call.merged[level] = plan.num_merged
        return plan

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

    # -- reading ------------------------------------------------------------------------------
    def report(self) -> RunReport:
        """What this runtime knows of its current (or last) run (a snapshot; reading the stage times
        waits for the device)."""
        self._flush_loose()
        wall = None if self._run_started is None else time.perf_counter() - self._run_started
        return RunReport(
            method=self.name, steps=self.steps.total, schedule=self.steps.schedule, short_run=self._short_run,
            levels={level: LevelStats(s.tokens, s.merged_tokens, set(s.steps), list(s.records))
                    for level, s in self._levels.items()},
            plans=dict(self.plans.by_key), shared_destinations=dict(self.plans.shared),
            left_to=dict(self._left_to), nothing_merges=tuple(sorted(self._idle)), failed=frozenset(self.plans.failed),
            unmerged=dict(self._unmerged),
            seconds=self.stages.seconds(), clock=self.stages.kind, wall_seconds=wall, caveats=tuple(self.caveats),
            untimed=self.stages.untimed, host_paced=None if self.pace is None else self.pace.summary(),
            rotation=float(self.plans.rotation), destinations_kept=self.plans.destinations_kept(),
            step_cache=self.stack.summary())

    def summary(self) -> dict:
        """The report as JSON (``RunReport.summary``), what the run listeners get."""
        return self.report().summary()
