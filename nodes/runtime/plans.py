"""The plan cache of one patched model's run: the plans by key, the schedule's decisions on reusing them, the
run's random draws and rotation's counts.

``PlanStore`` is what ``MergeRuntime.plan`` asks, in this order: the key of a block call's plan (``key``), the
decisions settled for the model call before it ran (``call``, ``expect``), the cached plan or a new one
(``build``), and after the call what it built (``after_call``). It reads the strategy (how a plan is built,
its schedule) and the ``Placement`` (plans per block, shared destinations, rotation), each once, and is
cleared at every run's start (``clear``).
"""
import torch

from ...toma_core.selection import draw_seed, seed_stream
from .levels import Level, PlanKey
from .model_call import ModelCall
from .steps import Where

FRESH = "a plan key not seen yet"  # the schedule's group for the decision a new key gets
NO_MERGE = (False, False, False)  # a decision (merge, new destinations, new weights) that runs a block unmerged
REUSE = (True, False, False)  # the decision of a key whose plan a model call built: its later blocks reuse it


class PlanStore:
    """Plans, their keys and their reuse for one patched model (see the module docstring)."""

    def __init__(self, strategy, placement):
        self.strategy = strategy
        self.schedule = strategy.schedule
        self.per_block = placement.plan_per_block  # each block call plans for itself
        self.shares_destinations = placement.shared_destinations  # a level's first block chooses for all
        # the strength of rotating destinations (0: off), read once from the placement that settled it
        self.rotation = placement.rotation
        self.by_key: dict[PlanKey, object] = {}
        self.shared: dict = {}  # (level, rows) -> the destinations a level's blocks share, chosen last
        # rotating destinations, on the device, by counts key (``counts_key``): how often each window slot was a
        # destination this run; the last build's destinations as 0/1; the destinations kept from the previous
        # build of their key, and all rebuilt, summed (read at report time: ``destinations_kept``)
        self.chosen: dict = {}
        self.last_chosen: dict = {}
        self.kept: torch.Tensor | None = None
        self.generators: dict = {}  # device -> the run's generator, advanced by every plan built
        self.keys: list[PlanKey] = []  # plan keys seen this run, in order: each call decides them first
        self.failed: set[PlanKey] = set()  # keys whose plan could not be built: their blocks run unmerged

    def use(self, strategy):
        """Build and decide with ``strategy`` from now on (the node's own, or the one it takes beside a step cache:
        step_caches.py); ``strategy`` back."""
        self.strategy, self.schedule = strategy, strategy.schedule
        return strategy

    def clear(self) -> None:
        """A clean slate for a sampling run: no plan, decision, draw or count of an earlier run is kept."""
        for cache in (self.by_key, self.shared, self.generators, self.failed, self.keys, self.chosen,
                      self.last_chosen):
            cache.clear()
        self.kept = None
        self.schedule.reset()

    def short_run(self, total: int | None) -> str | None:
        """How the schedule adapts to a run of ``total`` steps (its ``short_run``), in words; None where it
        does not."""
        if not self.schedule.is_short(total):
            return None
        short = self.schedule.short_run
        return f"a {total}-step run (at most {short.steps}) merges {short.in_words()}"

    def key(self, level: Level, block, rows: tuple) -> PlanKey:
        """The key of the plan ``block`` uses at ``level`` for calls of batch layout ``rows`` (``batch_key``)."""
        return PlanKey(level, block if self.per_block else None, rows)

    def counts_key(self, key: PlanKey) -> tuple:
        """What rotation counts are kept by for the plans of ``key``: the key, or (level, rows) where the
        blocks of a level share destinations (its first block chooses them for all)."""
        if self.shares_destinations:
            return (key.level, key.rows)
        return key

    def decide(self, where: Where, key) -> tuple[bool, bool, bool]:
        """The schedule's decision for ``key`` at ``where``, as (merge, new destinations, new weights)."""
        d = self.schedule.decide(where.step, where.progress, key, where.total)
        return d.merge, d.new_destinations, d.new_weights

    def call(self, where: Where, device, batch: int | None, layout: tuple, paced: bool) -> ModelCall:
        """The ModelCall of a model call located at ``where`` on ``device`` whose blocks see ``batch`` rows in
        ``layout``: the decision of every plan key this run has seen with that batch layout, as its first block
        would take it, the decision of a key not seen yet, the call's seed and the rotation counts of its keys.
        ``paced``: the host sets the run's pace, so nothing merges (no plan built or used, no seed drawn)."""
        generator = self.generator(device)  # made here: a generator cannot be made (nor used) in traced code
        seed = draw_seed(generator).to(device) if self.strategy.draws_seed and not paced else None
        decisions = {}
        for key in self.keys:
            if key.rows == (batch, layout) and key not in self.failed:
                decisions[key] = NO_MERGE if paced else self.decide(where, key)
        fresh = NO_MERGE if paced else self.decide(where, FRESH)
        self.schedule.forget(FRESH)
        chosen = {key: counts for key, counts in self.chosen.items() if key[-1] == (batch, layout)}
        return ModelCall(where, decisions, fresh, seed, chosen, device)

    def expect(self, call: ModelCall, keys) -> None:
        """Settle before the model runs the decisions of plan ``keys`` this call's blocks will ask for that the run
        has not seen (``MergeRuntime.plan`` takes them inside the block call otherwise): where each block is
        compiled on its own (kijai's WanVideoWrapper), a block then traces one path per decision, none more for
        the run's first call."""
        for key in keys:
            if key not in call.decisions and key not in self.failed:
                call.decisions[key] = call.fresh
                call.first_seen.append(key)
            counted = self.counts_key(key)
            if self.rotation and counted not in call.chosen:  # zeros: a first build too
                call.chosen[counted] = self.strategy.first_counts(key.level.shape, key.rows[0], call.device)

    def build(self, call: ModelCall, level: Level, rows: tuple, features, given, key: PlanKey):
        """A new plan for ``level`` with the ``given`` destinations (None: choose them); where the
        placement shares destinations within a level, the first block of a call that chooses new ones
        chooses them for all. Where destinations rotate, the build is given the counts of the earlier
        builds of the plan key (of the level, where it shares destinations) in the call (``ModelCall.chosen``),
        and the plan's updated counts are kept after it."""
        shared = (level, rows) if self.shares_destinations else None
        if given is None and shared is not None and shared in call.shared:
            given = call.shared[shared]  # another block of the level chose them in this call
        feats = features()
        rotates = given is None and self.rotation
        counted = self.counts_key(key)
        extra = {"chosen": call.chosen.get(counted)} if rotates else {}
        if call.seed is None:
            plan = self.strategy.build(feats, level.shape, self.generator(feats.device), given, **extra)
        else:  # the next stream of the call's seed, where the block's tokens are (a no-op on one device)
            seed = seed_stream(call.seed, call.seeds_taken).to(feats.device)
            call.seeds_taken += 1
            plan = self.strategy.build(feats, level.shape, None, given, seed=seed, **extra)
        if shared is not None and given is None and hasattr(plan, "destinations"):
            call.shared[shared] = self.shared[shared] = plan.destinations
        if rotates and getattr(plan, "chosen", None) is not None:
            call.counted[counted] = plan.chosen
        return plan

    def keep(self, call: ModelCall, level: Level, key: PlanKey, plan) -> None:
        """Cache ``plan``, built in ``call`` for ``key``: the later blocks of the key in the call reuse it, and
        the call hands it on to the merge map (``ModelCall.built``)."""
        self.by_key[key] = plan
        call.built.append((level, plan))
        call.decisions[key] = REUSE

    def after_call(self, call: ModelCall) -> None:
        """What ``call`` leaves the store: the plan keys it saw first, to the schedule (decided as they were in
        the call: as new groups), and the rotation counts of the plans it built."""
        for key in call.first_seen:
            self.decide(call.where, key)
            self.keys.append(key)
        for key, counts in call.counted.items():
            self.count_rotation(key, counts)

    def count_rotation(self, key, counts: torch.Tensor) -> None:
        """Keep the counts of rotating destinations a plan of counts key ``key`` was built with, for the key's
        next build, and add to the run's sums the destinations it kept from the key's previous build: a few
        kernels after the model call, on the device (read only by ``destinations_kept``)."""
        # a key's first build hands its counts on as a view (the engine's mask drops a column past the window):
        # kept whole, every later build is given counts of one layout, so a compiled block traces no graph for a
        # second layout (a copy at the key's first build only; a no-op on counts already whole)
        counts = counts.contiguous()
        previous = self.chosen.get(key)
        chosen = counts if previous is None else counts - previous  # this build's destinations, 0/1
        last = self.last_chosen.get(key)
        if last is not None:
            kept = torch.stack([(chosen * last).sum(), chosen.sum()])
            self.kept = kept if self.kept is None else self.kept + kept
        self.chosen[key], self.last_chosen[key] = counts, chosen

    def destinations_kept(self) -> float | None:
        """The share of rebuilt destinations that were destinations of their key's previous build too, this
        run (a read from the device); None where nothing was rebuilt, or on the meta device (the cost model's
        plans hold no values)."""
        if self.kept is None or self.kept.device.type == "meta":
            return None
        same, rebuilt = self.kept.tolist()
        return same / rebuilt if rebuilt else None

    def generator(self, device) -> torch.Generator:
        """The run's generator on ``device``, seeded with the strategy's seed at the run's first model call
        (a strategy that ``draws_seed`` draws one seed from it per model call, the others draw from it in
        every build)."""
        if device not in self.generators:
            # the meta device has no generator: plans built there (the cost model, toma_bench.costmodel,
            # records real-size models on it) draw their random numbers on the CPU
            where = "cpu" if device.type == "meta" else device
            self.generators[device] = torch.Generator(device=where).manual_seed(self.strategy.seed)
        return self.generators[device]
