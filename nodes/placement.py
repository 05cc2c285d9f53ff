"""Where merging applies (the Advanced node's ``scope``): one value per interception point, read by the
adapters; what "auto" means per family; the log line when a family cannot honour a placement.

- "attention": the self-attention runs on merged tokens: queries, keys and values come from them and the
  output is unmerged (the paper's placement on UNets; on Flux-layout double blocks, the joint attention).
- "keys/values": queries stay at full resolution, keys and values come from merged tokens; the output
  has every token, so nothing is unmerged (UNets; the self-attention of every DiT but SD3, whose blocks
  otherwise run whole).
- "queries": queries come from merged tokens, keys and values from every token; the output is unmerged
  (ComfyUI ToMe's placement, with ToMA's weights) (UNets).
- "block": the whole transformer block (self-attention, cross-attention, feed-forward) runs on merged
  tokens and its update is unmerged.
- "feed-forward": the self-attention runs over every token; the submodules after it (Wan's cross-attention
  and feed-forward: a family's ``feed_forward``) run on merged tokens, each output unmerged. For core's
  sparse attention, whose kernel takes only q, k and v of every token (docs/benchmarks.md, "Beside core's
  sparse attention").
Where keys are merged inside the attention call ("attention", "keys/values"), ``proportional`` attention
weighs each merged key by the tokens it stands for (toma_core.attention); with another scope it is not
honoured, and the log and the stats say so.

A node settles where it merges once (``settle``): its inputs, the model's kind and what the host can do make a
``Placement``, which the adapter of the model's family and the runtime read: the scope that will run, with its
caveat, the ratio and the windows, so nothing below reads them back from the strategy.
"""
import dataclasses
import logging
from dataclasses import dataclass

from ..toma_core import ROTATION_STRENGTH, ReuseSchedule, ShortRun
from . import host

log = logging.getLogger("ComfyUI-ToMA")

AUTO = "auto"
ATTENTION = "attention"
KEYS_VALUES = "keys/values"
QUERIES = "queries"
BLOCK = "block"
FEED_FORWARD = "feed-forward"
SCOPES = (AUTO, ATTENTION, BLOCK, KEYS_VALUES, QUERIES, FEED_FORWARD)

UNET_PLACEMENTS = (ATTENTION, BLOCK, KEYS_VALUES, QUERIES)
# Where a scope reaches an adapter as "auto" (the nodes resolve it first, with PRESETS below) or cannot be
# honoured: the placement every model of the kind offers.
UNET_AUTO = ATTENTION
DIT_AUTO = BLOCK
KEYS_MERGED = (ATTENTION, KEYS_VALUES)  # where proportional attention applies
# why proportional attention is not honoured with the other scopes
KEYS_WHOLE = {BLOCK: "the blocks run their own attention on merged tokens",
              FEED_FORWARD: "the self-attention keeps every key", QUERIES: "the keys stay whole"}
ROTATIONS = (AUTO, "on", "off")  # the rotation input's choices; auto: the model kind's (Preset.rotation)


def check(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    return scope


def resolve(scope: str, family: str, honoured: tuple, auto: str) -> str:
    """The placement ``family`` uses for ``scope``: ``auto`` for "auto"; a placement the family does not
    honour falls back to ``auto`` with a log line naming both."""
    check(scope)
    if scope == AUTO:
        return auto
    if scope not in honoured:
        log.warning("ToMA: %s cannot merge with scope %s (it offers %s); it uses %s", family, scope,
                    ", ".join(honoured), auto)
        return auto
    return scope


@dataclass(frozen=True)
class Preset:
    """What the basic node, and the Advanced node's scope "auto", use on one kind of model: the placement
    and the fidelity fixes that go with it, chosen from the speed-vs-fidelity fronts on the GPU clock
    (docs/benchmarks.md, "The defaults, and why", names the row each one came from; docs/figures.json holds
    each kind's figures). ``levels``,
    ``weights_interval``, ``start_percent`` and ``merge_every`` are the basic node's; the Advanced node
    shows them as inputs of its own. ``short_run``: how both nodes' schedule changes in runs of few steps
    (distilled models; None: it does not). ``ratio`` and ``window_size`` are what the ratio's -1 and the window's
    0 ("auto", the inputs' defaults) mean on both nodes; ``rotation``, what the rotation input's "auto" means
    (destinations that rotate: toma_core.plan.ROTATION_STRENGTH), on where the fronts show it pays."""

    scope: str
    ratio: float = 0.75
    plan_per_block: bool = False
    shared_destinations: bool = False
    proportional: bool = False
    levels: str = "auto"
    weights_interval: int = 1
    start_percent: float = 0.0
    merge_every: int = 1
    window_size: int = 4  # what the node's window_size 0 ("auto") means
    short_run: ShortRun | None = None
    rotation: bool = False


KIND_NAMES = {"sd1": "SD1.x/SD2.x UNets", "sdxl": "SDXL UNets", "dit": "image DiTs", "video": "video DiTs"}


# Kinds of model: UNets with attention at full resolution (SD1.x/SD2.x), UNets without (SDXL), image
# DiTs, video DiTs (patching.preset_for: the adapter's preset_kind(model), a DiT declaration's from its video).
# Each is the best point found on the speed-vs-fidelity fronts (the GPU clock of the real-size model, the
# PSNR of a trained proxy of the same layout); its figures, with the commands that printed them, are in
# docs/figures.json under the kind's key (tests/test_figures.py keeps its ratio and scope equal to these).
PRESETS = {
    # keys/values at window 8 with per-block weights to the level's destinations and proportional attention:
    # queries stay whole, so little of the picture changes (destinations that rotate cost it here); shared destinations and weights every 5 steps
    # keep the per-block plans' fidelity at a fraction of their kernels
    "sd1": Preset(KEYS_VALUES, plan_per_block=True, shared_destinations=True, proportional=True, weights_interval=5,
                  window_size=8),
    # attention at 1/2 and 1/4 (SDXL has no attention at full resolution), the first 25% of the schedule
    # unmerged to keep the composition, weights refreshed with the destinations (every 5 steps); ratio 0.85
    # is both faster and closer to unpatched than 0.75 on the clock fitted to published SDXL step times
    "sdxl": Preset(ATTENTION, ratio=0.85, levels="auto+next", start_percent=0.25, weights_interval=5, rotation=True),
    # whole blocks on every step at ratio 0.5: on the clock that prices the host, a merged step pays for
    # ToMA's kernels, so merging every step at a lower ratio is faster eager than merging a later part of
    # the schedule at a higher one. In runs of up to 8 steps a new plan every step
    "dit": Preset(BLOCK, ratio=0.5, short_run=ShortRun(8, reuse_interval=1), rotation=True),
    # keys and values of the self-attention (queries whole, nothing to unmerge), each merged key its group's
    # average, each block its own plan, proportional attention, every step, ratio 0.9: video is GPU-bound, so
    # the saved attention is the speed-up, and with merged keys a higher ratio costs little fidelity. In runs
    # of up to 8 steps a new plan every step
    "video": Preset(KEYS_VALUES, ratio=0.9, plan_per_block=True, proportional=True,
                    short_run=ShortRun(8, reuse_interval=1), rotation=True),
}


def values_in_words(name: str) -> list[tuple[object, str]]:
    """(value, "SD1.x/SD2.x UNets, ...") for each value of the presets' field ``name`` ("window_size",
    "ratio"), for the inputs' tooltips."""
    values = {}
    for kind, preset in PRESETS.items():
        values.setdefault(getattr(preset, name), []).append(KIND_NAMES[kind])
    return [(v, " and ".join(names) if len(names) < 3 else ", ".join(names)) for v, names in sorted(values.items())]


def rotation_in_words() -> str:
    """Which kinds of model rotate destinations under the rotation input's "auto", for its tooltip."""
    kinds = [KIND_NAMES[kind] for kind, preset in PRESETS.items() if preset.rotation]
    return f"on for {', '.join(kinds)}, off for the others" if kinds else "off on every kind of model"


def auto_in_words() -> str:
    """What scope "auto" means on each kind of model, for the scope's tooltip."""
    return ", ".join(f"{preset.scope} on {KIND_NAMES[kind]}" for kind, preset in PRESETS.items())


@dataclass(frozen=True)
class Placement:
    """Where and how one node merges on one MODEL, settled once by ``settle`` and read by the adapter of the
    model's family and by the runtime. ``scope``: a placement the family honours (never "auto"); ``levels``:
    the UNet levels input (a DiT has one token grid); ``plan_per_block``: each block call builds its own plan
    (else one plan serves the blocks of a level or block group in a step); ``shared_destinations``: with
    plans per block, the group's first block chooses the destinations for all; ``proportional``: merged
    keys weigh as the tokens they stand for, only where the scope merges keys inside the attention call;
    ``schedule``, ``rotation`` (a strength, 0: off), ``ratio`` and ``windows`` ((window_size, temporal_window);
    None: a method that merges in no windows): ToMA's, which its strategy is built from and sequence-parallel
    slabs merge by (the baselines' stay unset); ``caveats``: what the node asked for and does not get, said once
    in the log and the stats."""

    scope: str
    levels: object = AUTO
    plan_per_block: bool = False
    shared_destinations: bool = False
    proportional: bool = False
    schedule: ReuseSchedule | None = None
    rotation: float = 0.0
    caveats: tuple[str, ...] = ()
    ratio: float = 0.0
    windows: tuple[int, int] | None = None


def proportional_not_honoured(family, scope: str) -> str:
    """The caveat of proportional attention asked for where ``family`` (an adapter) merges with ``scope``,
    which keeps keys out of the attention call's merging (KEYS_WHOLE)."""
    offered = " or ".join(p for p in KEYS_MERGED if p in family.placements)
    return (f"proportional attention is not honoured on {family.name} with scope {scope} ({KEYS_WHOLE[scope]})"
            + (f": use scope {offered}" if offered else ""))


def settle(family, scope: str = AUTO, preset: Preset | None = None, *, levels=AUTO, plan_per_block: bool = False,
           shared_destinations: bool = False, proportional: bool = False, schedule: ReuseSchedule | None = None,
           rotation: str = "off", ratio: float = 0.0, windows: tuple[int, int] | None = None) -> Placement:
    """The Placement of a node's inputs on a model of ``family`` (an adapter: its ``name``, the
    ``placements`` it honours, its ``fallback`` and the scopes it runs through the host's attention override,
    ``needs_attention_override``). With a ``preset`` (ToMA), scope "auto" is the model kind's placement with its
    fixes (plans per block, shared destinations, proportional attention, the short-run schedule) and rotation
    "auto" the kind's choice; without one (the baselines), "auto" is the family's fallback. A scope the family
    does not honour falls back with a log line naming both; one that needs the attention override on a host
    without it (host.attention_override_supported) runs whole blocks, said in the log. The Placement's scope is
    the one that runs, and proportional attention is kept only where it merges keys inside the attention call."""
    check(scope)
    if scope == AUTO and preset is not None:
        scope = preset.scope
        plan_per_block = plan_per_block or preset.plan_per_block
        shared_destinations = shared_destinations or preset.shared_destinations
        proportional = proportional or preset.proportional
        if schedule is not None:
            schedule = dataclasses.replace(schedule, short_run=preset.short_run)
    scope = resolve(scope, family.name, family.placements, family.fallback)
    if scope in family.needs_attention_override and not host.attention_override_supported():
        log.warning("ToMA: this ComfyUI has no attention override (comfy.ldm.modules.attention.wrap_attn); "
                    "%s merges whole blocks (scope block) instead of scope %s", family.name, scope)
        scope = BLOCK
    caveats = ()
    if proportional and scope not in KEYS_MERGED:
        caveats, proportional = (proportional_not_honoured(family, scope),), False
    rotates = (preset is not None and preset.rotation) if rotation == AUTO else rotation == "on"
    return Placement(scope, levels, plan_per_block, plan_per_block and shared_destinations, proportional, schedule,
                     ROTATION_STRENGTH if rotates else 0.0, caveats, ratio, windows)
