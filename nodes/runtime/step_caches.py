"""Step caches on the model being sampled, and the setting ToMA takes in a stack with one (issue 45).

A step cache skips whole model calls whose output it expects to change little, and reuses the change it
saw last instead. Its skip decision reads the step-to-step change of the model's output, so an error of
merging that changes from call to call reads as change to it: ToMA at its own default makes the cache skip
fewer calls and costs the picture more than the cache does (docs/stacking.md, "With a step cache").

The caches are found by what they put in the options of the model being sampled, never by a version:

- core's EasyCache and LazyCache (comfy_extras/nodes_easycache.py): a wrapper keyed "easycache" or
  "lazycache", and their holder (reuse_threshold, start_percent, end_percent) under transformer_options'
  "easycache";
- TeaCache (welltop-cn/ComfyUI-TeaCache and its forks): its "rel_l1_thresh" and "coefficients";
- MagCache (Zehong-Ma/ComfyUI-MagCache): its "magcache_thresh" and "mag_ratios".

Either node may come first: a cache added after ToMA patched is only in the options once sampling starts,
so the runtime asks at the first model call of each run (``CacheStack.settle``), from that call's
transformer_options, and every run begins with the node's own strategy (``CacheStack.begin_run``): nothing
of a stack reaches a later run without the cache.
"""
import copy
import dataclasses
import logging
from dataclasses import dataclass

log = logging.getLogger("ComfyUI-ToMA")


@dataclass(frozen=True)
class StepCache:
    """A step cache found on the model: ``kind`` (a key of STACK_SETTINGS) and its own settings as found."""

    kind: str
    settings: dict

    def in_words(self) -> str:
        return f"{self.kind} ({', '.join(f'{k} {v:g}' if isinstance(v, float) else f'{k} {v}' for k, v in self.settings.items())})"


@dataclass(frozen=True)
class StackSetting:
    """What ToMA changes in a stack with a cache of one kind: ``ratio`` where the node's ratio is auto (-1),
    and ``plans_by_calls``: the reuse interval counts the model calls that ran, not sampler steps, so a step
    the cache skips does not bring a plan's rebuild (and its new destinations) forward."""

    ratio: float
    plans_by_calls: bool = True

    def in_words(self, ratio_kept: bool) -> str:
        ratio = "ratio as set" if ratio_kept else f"ratio {self.ratio:g}"
        return ratio + (", plans reused over the model calls that ran" if self.plans_by_calls else "")


# Chosen on the flux32 proxy at 64x64 tokens, 20 steps, against LazyCache alone (docs/notebook.md, "ToMA with a
# step cache": every lever tried). EasyCache, TeaCache and MagCache skip by the same kind of rule (accumulated
# relative change of the output, or of its proxy), so they take LazyCache's setting.
STACK_SETTINGS = {
    "LazyCache": StackSetting(ratio=0.3),
    "EasyCache": StackSetting(ratio=0.3),
    "TeaCache": StackSetting(ratio=0.3),
    "MagCache": StackSetting(ratio=0.3),
}


def _core_cache(options: dict, key: str, kind: str) -> StepCache | None:
    wrappers = options.get("wrappers") or {}
    if not any(key in by_key for by_key in wrappers.values() if isinstance(by_key, dict)):
        return None
    holder = options.get("easycache")
    settings = {name: getattr(holder, attr) for name, attr in
                (("threshold", "reuse_threshold"), ("start", "start_percent"), ("end", "end_percent"))
                if isinstance(getattr(holder, attr, None), (int, float))}
    return StepCache(kind, settings)


def _options_cache(options: dict, kind: str, marks: tuple, shown: tuple) -> StepCache | None:
    if not all(mark in options for mark in marks):
        return None
    return StepCache(kind, {name: options[key] for name, key in shown
                            if isinstance(options.get(key), (int, float, str))})


# kind -> how it is found in a model call's transformer_options (the first that finds one wins)
FINDERS = {
    "LazyCache": lambda o: _core_cache(o, "lazycache", "LazyCache"),
    "EasyCache": lambda o: _core_cache(o, "easycache", "EasyCache"),
    "TeaCache": lambda o: _options_cache(o, "TeaCache", ("rel_l1_thresh", "coefficients"),
                                         (("threshold", "rel_l1_thresh"), ("model_type", "model_type"))),
    "MagCache": lambda o: _options_cache(o, "MagCache", ("magcache_thresh", "mag_ratios"),
                                         (("threshold", "magcache_thresh"), ("retention", "retention_ratio"),
                                          ("K", "magcache_K"))),
}


def find(transformer_options: dict | None) -> StepCache | None:
    """The step cache a model call's ``transformer_options`` show, or None."""
    for finder in FINDERS.values():
        found = finder(transformer_options or {})
        if found is not None:
            return found
    return None


class CallCountedSchedule:
    """A schedule whose steps are the model calls that ran in the run, in order (the inner schedule's
    intervals then count calls, not sampler steps); a step seen again (cond and uncond called apart) is the
    same call. The fraction of the schedule done stays the sampler's."""

    def __init__(self, inner):
        self.inner = inner
        self._calls: dict[int, int] = {}

    def __getattr__(self, name):  # is_short, short_run, timing, forget, ...: the inner schedule's
        return getattr(self.inner, name)

    def reset(self) -> None:
        self._calls.clear()
        self.inner.reset()

    def decide(self, step: int, progress: float, group, total: int | None = None):
        call = self._calls.setdefault(step, len(self._calls))
        return self.inner.decide(call, progress, group, total)


class CacheStack:
    """Per runtime: the step cache of the run under way and the strategy ToMA merges with in it.

    ``own``: the node's strategy. ``ratio_auto``: whether the node's ratio is auto (the stack setting may change
    it; a ratio set by hand is kept). ``adapts``: whether the node takes a stack setting at all (ToMA's nodes;
    the baselines run as published, and only say that they found a cache)."""

    def __init__(self, own, adapts: bool = False, ratio_auto: bool = False):
        self.own = own
        self.adapts = adapts
        self.ratio_auto = ratio_auto
        self.found: StepCache | None = None
        self.setting_words: str | None = None
        self.ratio: float | None = None  # the ratio the run merges at beside the cache found
        self._settled = False
        self._said: set = set()
        self._stacked: dict = {}  # cache kind -> the strategy of a stack with it (one object: one compiled graph)

    def begin_run(self):
        """A run begins with the node's own strategy and no cache known; the strategy to sample with."""
        self.found, self.setting_words, self.ratio, self._settled = None, None, None, False
        return self.own

    def settle(self, transformer_options: dict | None, current):
        """At a run's first model call: the strategy for the run (``current`` after that call), the cache found
        said once in the log per patched model and cache kind."""
        if self._settled:
            return current
        self._settled = True
        self.found = find(transformer_options)
        if self.found is None:
            return current
        if self.found.kind not in self._stacked:
            self._stacked[self.found.kind] = self.stacked(STACK_SETTINGS[self.found.kind])
        strategy = self._stacked[self.found.kind]
        strategy.schedule.reset()
        self.setting_words = STACK_SETTINGS[self.found.kind].in_words(ratio_kept=not self.ratio_auto)
        if strategy is self.own:
            self.setting_words = "its own setting (the node takes no stack setting)"
        self.ratio = getattr(strategy, "ratio", None)
        message = f"found {self.found.in_words()} on the model: {self.own.name} merges with {self.setting_words}"
        if (self.found.kind, message) not in self._said:
            self._said.add((self.found.kind, message))
            log.warning("ToMA: %s", message)
        return strategy

    def stacked(self, setting: StackSetting):
        """The node's strategy with the stack ``setting`` (a new schedule, so the node's own stays untouched)."""
        if not self.adapts:
            return self.own
        schedule = copy.deepcopy(self.own.schedule)
        if setting.plans_by_calls:
            schedule = CallCountedSchedule(schedule)
        ratio = setting.ratio if self.ratio_auto else self.own.ratio
        return dataclasses.replace(self.own, ratio=ratio, schedule=schedule)

    def summary(self) -> dict | None:
        """The run's step cache for the stats: the cache, its settings, and the setting ToMA took; None: none."""
        if self.found is None:
            return None
        return {"cache": self.found.kind, "settings": dict(self.found.settings), "setting": self.setting_words,
                "ratio": self.ratio, "in_words": f"with {self.found.in_words()}: {self.setting_words}"}
