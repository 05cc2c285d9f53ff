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
weighs each merged key by the tokens it stands for (toma_core.attention); with "block" it is not honoured,
and the log and the stats say so.
"""
import logging
from dataclasses import dataclass

from ..toma_core import ShortRun

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
    (docs/benchmarks.md, "The defaults, and why", names the row each one came from). ``levels``,
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
# DiTs, video DiTs (toma_nodes.preset_of: the UNet adapter's preset_kind(model), a DiT declaration's video).
PRESETS = {
    # keys/values at window 8 with per-block weights to the level's destinations and proportional attention:
    # at ratio 0.75, 39.3 dB at 10.1% of SD1.5's FLOPs saved, where ComfyUI's ToMe r=0.75 keeps 37.8 dB at 9.6%.
    # No rotating destinations: 38.65 dB against 39.30 at the same speed (issue 40's front)
    "sd1": Preset(KEYS_VALUES, plan_per_block=True, shared_destinations=True, proportional=True, weights_interval=5,
                  window_size=8),
    # attention at 1/2 and 1/4, the first 25% of the schedule unmerged, weights refreshed with the
    # destinations (every 5 steps), ratio 0.85: on the H200 clock of 2026-12-04 (Hopper fitted to published
    # SDXL step times) 1.10x under ComfyUI's compile node and 0.97x eager, 32.07 dB on the SDXL proxy, where
    # ratio 0.75 gave 1.09x, 0.97x and 31.57 dB (docs/benchmarks.md, "Compile as ComfyUI compiles"). Rotating
    # destinations: 32.29 dB at the same speed (0.971x eager against 0.970x; issue 40's front)
    "sdxl": Preset(ATTENTION, ratio=0.85, levels="auto+next", start_percent=0.25, weights_interval=5, rotation=True),
    # whole blocks on every step at ratio 0.5: FLUX.1-dev 1024 1.48x eager and 1.62x graph-replayed on the
    # H200 clock that prices the host (25 us per op), 21.96 dB on the Flux proxy at FLUX's 64x64 tokens; the
    # earlier default (ratio 0.75 from 40% of the schedule) kept 23.02 dB but only 1.37x eager. In runs of up
    # to 8 steps a new plan every step (docs/benchmarks.md, "The defaults, and why"). Rotating destinations at
    # the same speed: 22.53 dB at 64x64 tokens (+0.54), 18.74 dB at 32x32 (+1.41) (issue 40's front)
    "dit": Preset(BLOCK, ratio=0.5, short_run=ShortRun(8, reuse_interval=1), rotation=True),
    # keys and values of the self-attention (queries whole, nothing to unmerge), each merged key its group's
    # average, each block its own plan, proportional attention, every step, ratio 0.9: Wan 2.1 14B 720p 2.52x
    # on the clock that prices the host (15 steps; the earlier default, whole blocks on one step in 2, 1.71x);
    # on the Wan proxy 20.99 dB on 4 clips of 4 frames (the earlier default 21.29: 0.30 dB short) and more
    # than the earlier default at 8 frames (docs/benchmarks.md, "Merged keys: the video default"). In runs
    # of up to 8 steps a new plan every step. Rotating destinations at the same speed: 21.09 dB (+0.10; +0.26 dB
    # at r=0.85, +0.46 at r=0.8) (issue 40's front)
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
