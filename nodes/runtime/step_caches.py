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
import math
from dataclasses import dataclass

from ...toma_core import ToMA

log = logging.getLogger("ComfyUI-ToMA")


@dataclass(frozen=True)
class StepCache:
    """A step cache found on the model: ``kind`` (a key of STACK_SETTINGS) and its own settings as found."""

    kind: str
    settings: dict

    def in_words(self) -> str:
        shown = (f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                 for name, value in self.settings.items())
        return f"{self.kind} ({', '.join(shown)})"


@dataclass(frozen=True)
class StackSetting:
    """What ToMA merges with beside a cache of one kind, where the node's ratio is auto (-1), on the kinds of
    model it was measured on (``model_kinds``: keys of placement.PRESETS; elsewhere the node keeps its own
    setting and says so): ``ratio``, and nothing at all where the cache's threshold is under ``aside_below``:
    there the cache alone keeps far more of the picture than beside ToMA."""

    ratio: float
    aside_below: float | None = None
    model_kinds: tuple[str, ...] = ("dit",)

    def steps_aside(self, cache: StepCache) -> bool:
        threshold = cache.settings.get("threshold")
        known = isinstance(threshold, (int, float))
        return self.aside_below is not None and known and threshold < self.aside_below


# Chosen on the flux32 proxy at 64x64 tokens, 20 steps, against each cache alone (docs/stacking.md, "With a step
# cache"; every lever tried: docs/notebook.md, "ToMA beside a step cache: every lever tried"): image DiTs only, the one kind measured.
# Where a cache alone keeps far more of the picture than ToMA at 0.3 does (27.4 dB), the stack loses it: LazyCache
# at 0.2 keeps 34.2 dB (beside ToMA 28.0), TeaCache at its default 0.4 and MagCache at its default 0.06 38.6 dB
# (beside ToMA at 0.3: 26.0 and 26.1 dB), TeaCache at 0.8 31.3 dB (beside ToMA 27.5); there the node steps aside.
# EasyCache keeps less than ToMA at every threshold (22.2 dB at 0.1; at 0.3 the stack keeps 1 dB more than
# EasyCache alone): it takes the ratio everywhere.
STACK_SETTINGS = {
    "LazyCache": StackSetting(ratio=0.3, aside_below=0.3),
    "EasyCache": StackSetting(ratio=0.3),
    "TeaCache": StackSetting(ratio=0.3, aside_below=1.0),
    "MagCache": StackSetting(ratio=0.3, aside_below=math.inf),  # its node allows at most 0.3
}

# Kinds of model whose fronts beside the caches were measured and chose the node's own setting (docs/stacking.md,
# "With a step cache"): why, in words. On the Wan proxy at 20 steps LazyCache alone keeps 35-46 dB and ToMA at any
# ratio 28 dB or less, so no ratio, rotation, plan count, window or weight interval tried keeps the cache's picture,
# and the node's own setting gives the stack's fastest point (beside LazyCache 0.5: 4.20x at 20.83 dB against
# ToMA's own 2.52x at 21.09). On the SDXL proxy ToMA's call is no faster eager, so beside a cache it adds no speed.
OWN_SETTING_MEASURED = {
    "video": "on video DiTs no lower ratio or lever tried keeps the cache's picture, and its own setting is the "
             "stack's fastest point",
    "sdxl": "on SDXL UNets ToMA adds no speed beside a cache (its call is no faster eager)",
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


class CacheStack:
    """Per runtime: the step cache of the run under way and the strategy the node merges with beside it.

    ``own``: the node's strategy. ``model_kind``: the kind of model (a key of placement.PRESETS) whose stack
    setting the node takes; None: it takes none (a ratio set by hand keeps every setting as set, and the baselines
    run as published: both only say that they found a cache)."""

    def __init__(self, own, model_kind: str | None = None):
        self.own = own
        self.model_kind = model_kind
        self.found: StepCache | None = None
        self.setting_words: str | None = None
        self.ratio: float | None = None  # the ratio the run merges at beside the cache found (None: nothing)
        self._settled = False
        self._said: set = set()
        self._stacked: dict = {}  # the cache found -> the strategy beside it (one object: one compiled graph)

    def begin_run(self):
        """A run begins with the node's own strategy and no cache known; the strategy to sample with."""
        self.found, self.setting_words, self.ratio, self._settled = None, None, None, False
        return self.own

    def settle(self, transformer_options: dict | None, current, total: int | None = None):
        """At a run's first model call: the strategy for the run (``current`` after that call); the cache found,
        and what the node does beside it, said once in the log per patched model and cache setting. ``total``:
        the run's steps, where known: a short run (the node's own few-step rule) keeps the node's own setting,
        since the stack settings were measured at 20 steps and at 8 the stack's ratio makes LazyCache skip
        nothing (docs/stacking.md)."""
        if self._settled:
            return current
        self._settled = True
        self.found = find(transformer_options)
        if self.found is None:
            return current
        short = total if self.own.schedule.is_short(total) else None
        key = (self.found.kind, tuple(sorted(self.found.settings.items())), short)
        if key not in self._stacked:
            self._stacked[key] = self.stacked(self.found, STACK_SETTINGS[self.found.kind], short)
        strategy, self.setting_words, self.ratio = self._stacked[key]
        strategy.schedule.reset()
        message = f"found {self.found.in_words()} on the model: {self.own.name} {self.setting_words}"
        if message not in self._said:
            self._said.add(message)
            log.warning("ToMA: %s", message)
        return strategy

    def stacked(self, cache: StepCache, setting: StackSetting, short: int | None = None) -> tuple:
        """(the strategy beside ``cache`` with the stack ``setting``, what it does in words, the ratio it merges at
        or None); a new schedule, so that the node's own stays untouched. ``short``: the steps of a short run,
        where the node keeps its own setting. A stack setting is only ever taken by
        ToMA at an auto ratio (``model_kind`` set); the own strategy's ratio is shown where it is ToMA's."""
        own_ratio = self.own.ratio if isinstance(self.own, ToMA) else None
        if self.model_kind is None:
            return self.own, "merges with its settings as set", own_ratio
        if short is not None:
            return (self.own, f"merges with its own setting in this {short}-step run (the stack setting is for longer "
                    "runs)", own_ratio)
        if self.model_kind not in setting.model_kinds:
            why = OWN_SETTING_MEASURED.get(self.model_kind, "no stack setting measured for this kind of model yet")
            return self.own, f"merges with its own setting ({why})", own_ratio
        schedule = copy.deepcopy(self.own.schedule)
        if setting.steps_aside(cache):
            why = (f"{cache.kind} at threshold {cache.settings['threshold']:g} keeps far more of the picture alone "
                   "than beside token merging")
            return dataclasses.replace(self.own, schedule=schedule, idle_because=why), f"steps aside: {why}", None
        return (dataclasses.replace(self.own, ratio=setting.ratio, schedule=schedule),
                f"merges at ratio {setting.ratio:g}", setting.ratio)

    def summary(self) -> dict | None:
        """The run's step cache for the stats: the cache, its settings, what the node did beside it, and the
        ratio it merged at (None: nothing); None where there was no cache."""
        if self.found is None:
            return None
        return {"cache": self.found.kind, "settings": dict(self.found.settings), "setting": self.setting_words,
                "ratio": self.ratio, "in_words": f"{self.found.in_words()} found: {self.own.name} {self.setting_words}"}
