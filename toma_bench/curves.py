"""Speed-vs-fidelity curves on the trained proxies: each method's knob swept, compared at equal speed.

    python -m toma_bench.curves [--arch sd15|sdxl|flux|flux32|wan|wan32] [--set methods|toma|placements|front|fewsteps|sparse]
                                [--setting NAME=VALUE,... ...] [--side N] [--frames N] [--batch 4] [--steps 20]
                                [--repeats 5] [--threads 1] [--hardware h200|...|cpu] [--regimes eager,graphs,compiled,compiled+graphs]
                                [--variants 'PART;...'] [--real MODEL] [--out DIR]

The model is a trained proxy (toma_bench.proxy: ComfyUI's own SD1.x- or SDXL-layout UNet, Flux DiT or
Wan video DiT, trained here on photographs; flux32 and wan32 on 32x32-token grids), so a merge that
damages the model shows in pictures. Every variant is the proxy
patched by the pack's node (or ComfyUI's own ``TomePatchModel``) and draws the same ``--batch`` pictures
from the same seeded noise through ``comfy.sample.sample`` (euler, the proxy's scheduler, cfg 1: the
proxies are unconditional, so one model call per step).

Fidelity, against the unpatched run: PSNR and SSIM of the decoded pictures, relative L2 of the sampled
latents. Runs are deterministic (checked: every timed run must reproduce the first run's latents
bit for bit), so the fidelity columns reproduce to the digit.

Speed, the axis: the cost model's (toma_bench.costmodel) modelled GPU speed-up of the real-size model of
the proxy's family (SD1.5 512x512, SDXL 1024x1024, FLUX.1-dev 1024x1024, Wan 2.1 14B 720p; ``--real``
another costmodel row, e.g. z_image_turbo for few-step runs) patched with the same setting,
for as many steps as the proxy runs, on ``--hardware`` (default h200) in the first of ``--regimes``
(default eager; the others, graph replay and torch.compile, get columns of their own at the end), with the
FLOPs it saves beside it: the speed users get, not that of a 1024-token proxy on a CPU. ``--hardware cpu`` makes the CPU time
the axis again. CPU columns stay: the process CPU time and the wall time of whole sampling runs. After one untimed run per variant
(the fidelity run, which also warms up), ``--repeats`` rounds run every variant once, in an order
rotated each round, so a slow spell of a shared machine hits all of them alike. A variant's speed-up
is the median over rounds of unpatched time / variant time within the round; the spread is the
lowest and highest of those ratios. Rank by CPU time on a shared CPU: other jobs inflate wall time,
not the process's CPU time (use one thread: a descheduled OpenMP thread stalls the others).

Sets (``--set``): ``methods`` sweeps each method's knob (ToMA ratio for both scopes, ToMeSD ratio,
CA-ToMe threshold, ComfyUI's ToMe ratio; on Flux, ToMA's two double-block placements and the
merge-every-k-th-step schedule; on the Wan video proxy, ToMA's windows over 1 and 2 frames); ``toma``
varies ToMA's other settings around the node defaults (window size, reuse interval, levels,
merge-every-k) at ratio 0.5 and 0.75, for choosing the defaults; ``placements`` (UNets) ToMA's
placements and fidelity fixes against the baselines; ``front`` (DiTs) the settings around the DiT
default; ``fewsteps`` (DiTs) start and reuse for few-step runs; ``sparse`` (video proxies, in a ComfyUI with
the protocol of core's Model Sparse Attention node: v0.33.0) that node's stand-in alone over tau and stacked
with ToMA at scope feed-forward (``sparse_front``). On wan, ``--batch`` counts clips.
``--setting`` rows (the Advanced node's inputs by name) replace the set's, or join them where ``--set`` is named
too (``--variants`` then picks among the set's). ``--also-real`` prices the same rows on more real-size models:
a table each, the pictures (and PSNR) the same run's.
Output: a table, a plot (``<out>/curves_<arch>_<set>_<side>.png``: CPU-time speed-up vs PSNR and vs SSIM, a
line per method), a picture grid (``<out>/curves_<arch>_<set>_<side>_samples.png``) and the rows as JSON
(``<out>/curves_<arch>_<set>_<side>.json``, which ``toma_bench.fronts`` plots).
"""
import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
from functools import lru_cache
from pathlib import Path

import torch

from . import comfy_host, costmodel, proxy, run, sampling, sparse_attention, step_caches
from .gpuclock import REGIMES, profile
from .metrics import psnr, relative_l2, ssim
from .tables import format_cell, format_table
from .run import Variant, comfy_tome

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "docs"
SEED = 0


WINDOW = 4  # of the rows that name no window (the node's window before "auto" chose one per kind of model)


def toma(tn, family: str, setting: str, ratio: float, **inputs) -> Variant:
    """ToMA through its Advanced node: the node's defaults but for ``ratio`` and ``inputs``; window 4, scope
    attention and rotation off unless named (the node's defaults before the presets per kind of model, so
    that rows keep their meaning when a preset changes)."""
    node = tn.ToMAPatchModelAdvanced()
    inputs = {"window_size": WINDOW, "reuse_interval": tn.DEFAULT_REUSE, "scope": "attention", "rotation": "off",
              **inputs}
    return Variant(family, setting, lambda m: node.patch(m, ratio, **inputs)[0])


def node_default(tn, ratio: float | None, rotation: str = "auto") -> Variant:
    """The basic ToMA node with its default inputs but ``ratio`` (None: its default too, the model kind's
    ratio): what the model's kind gets by default (nodes/placement.PRESETS). ``rotation`` "on" or "off":
    the same through the Advanced node, with the basic node's settings of the kind and that rotation."""
    setting = "r=auto" if ratio is None else f"r={ratio:g}"
    if rotation != "auto":
        return Variant(f"ToMA node default, rotation {rotation}", setting,
                       costmodel.default_with_rotation(tn, rotation, ratio))
    ratio = tn.DEFAULT_RATIO if ratio is None else ratio
    return Variant("ToMA node default", setting,
                   lambda m: tn.ToMAPatchModel().patch(m, ratio, tn.DEFAULT_WINDOW, tn.DEFAULT_REUSE)[0])


def node_default_rotations(tn) -> list[Variant]:
    """The node default with destinations that rotate and without (whichever the kind's "auto" is)."""
    return [node_default(tn, None, rotation) for rotation in ("off", "on")]


RATIOS = (0.25, 0.5, 0.75)
THRESHOLDS = (0.95, 0.9, 0.8, 0.7, 0.5)


def tomesd(tn, ratio: float, max_downsample: int) -> Variant:
    return Variant("ToMeSD", f"r={ratio:g}", lambda m: tn.ToMeSDPatchModel().patch(m, ratio, max_downsample)[0])


def catome(tn, threshold: float, max_downsample: int) -> Variant:
    return Variant("CA-ToMe", f"t={threshold:g}",
                   lambda m: tn.CAToMePatchModel().patch(m, threshold, max_downsample=max_downsample)[0])


def dito(tn, ratio: float, interval: int = 5, penalty: float = 0.5, family: str = "DiTo") -> Variant:
    """The DiTo Token Merge node (after arXiv 2605.22011: toma_core/dito.py lists what it assumes)."""
    return Variant(family, f"r={ratio:g}", lambda m: tn.DiToPatchModel().patch(m, ratio, interval, penalty)[0])


@lru_cache(maxsize=None)
def tomesd_on_dits_strategy(core):
    """ToMeSD with DiT blocks patched, from the pack's ``core`` (its toma_core, whose classes the pack's
    runtime and merge map know): ``tomesd_plan`` on each merged block's input, its plan as DiTo's (which gives
    a DiT adapter the positions of the merged tokens); a video's frames stacked as rows, as DiTo's."""

    @dataclasses.dataclass(frozen=True)
    class ToMeSDOnDiTs(core.ToMeSD):
        patches_dits = True

        def build(self, features, grid, generator=None, destinations=None, seed=None):
            rows = grid if len(grid) == 2 else (grid[0] * grid[1], grid[2])
            p = core.tomesd_plan(features, rows, self.ratio, self.sx, self.sy, generator=generator, seed=seed)
            return core.DiToPlan(p.num_tokens, p.src_index, p.dst_index, p.unmerged, p.merged, p.target)

    return ToMeSDOnDiTs


def tomesd_on_dits(tn, ratio: float) -> Variant:
    """ToMeSD's matching in DiT blocks, for the fronts only (its node is for UNets): fresh in every block call
    with new random cells, whole blocks merged (scope block)."""

    def patch(m):
        core = importlib.import_module(tn.__name__.rsplit(".", 2)[0] + ".toma_core")
        return tn.apply_strategy(m, tomesd_on_dits_strategy(core)(ratio), scope="block")

    return Variant("ToMeSD (DiT blocks)", f"r={ratio:g}", patch)


def unet_methods(tn, sdxl: bool = False) -> list[Variant]:
    """Each method's knob swept; the ToMe baselines at their best faithful setup: the highest-resolution
    level with attention (max_downsample 1 on SD1.x, 2 on the SDXL layout: where ToMA's levels "auto"
    merges too), one generator per run. ComfyUI's ToMe merges only at 1/1 (its max_downsample is fixed
    at 1), so on the SDXL layout, with no attention there, it merges nothing and is left out."""
    down = 2 if sdxl else 1
    out = [Variant("unpatched", "", lambda m: m)]
    for scope in ("attention", "block"):
        out += [toma(tn, f"ToMA {scope}", f"r={r:g}", r, scope=scope) for r in RATIOS]
    out += [tomesd(tn, r, down) for r in RATIOS]
    out += [catome(tn, t, down) for t in THRESHOLDS]
    if not sdxl:
        out += [Variant("ComfyUI ToMe", f"r={r:g}", lambda m, r=r: comfy_tome(m, r)) for r in RATIOS]
    return out


def toma_settings(tn, arch: str) -> list[Variant]:
    """ToMA's settings one at a time around the node's earlier defaults (attention on UNets, whole blocks
    on DiTs, window 4, reuse 5), at ratios 0.5 and 0.75."""
    out = [Variant("unpatched", "", lambda m: m)]
    unet = proxy.spec_of(arch).model_kind == "sd15"
    scope = "attention" if unet else "block"
    for r in (0.5, 0.75):
        out.append(toma(tn, "ToMA defaults", f"r={r:g}", r, scope=scope))
        out += [toma(tn, f"ToMA window {w}", f"r={r:g}", r, window_size=w, scope=scope) for w in (2, 8)]
        out += [toma(tn, f"ToMA reuse {k}", f"r={r:g}", r, reuse_interval=k, scope=scope) for k in (1, 10)]
        if unet:
            out.append(toma(tn, "ToMA levels auto+next", f"r={r:g}", r, levels="auto+next"))
        out.append(toma(tn, "ToMA merge every 2", f"r={r:g}", r, merge_every=2, scope=scope))
    return out


def placements(tn) -> list[Variant]:
    """ToMA's placements and fidelity fixes (per-block plans, proportional attention, window 8, the first
    20% of the schedule unmerged) against today's placement and the baselines that merge at 1/1."""
    out = [Variant("unpatched", "", lambda m: m)]
    out += [node_default(tn, r) for r in (0.5, 0.75)] + node_default_rotations(tn)
    out += [toma(tn, "ToMA attention", f"r={r:g}", r, scope="attention") for r in RATIOS]
    fixed = {"plan_per_block": True, "proportional_attention": True}
    out.append(toma(tn, "ToMA attention, proportional", "r=0.5", 0.5, proportional_attention=True))
    out.append(toma(tn, "ToMA attention, proportional, window 8", "r=0.75", 0.75, proportional_attention=True,
                    window_size=8))
    out += [toma(tn, "ToMA attention, per block, proportional", f"r={r:g}", r, **fixed) for r in RATIOS]
    for window in (4, 8):
        out += [toma(tn, f"ToMA keys/values, per block, proportional, window {window}", f"r={r:g}", r,
                     scope="keys/values", window_size=window, **fixed) for r in (0.5, 0.75, 0.85)]
    out.append(toma(tn, "ToMA keys/values, proportional, window 8", "r=0.75", 0.75, scope="keys/values",
                    window_size=8, proportional_attention=True))
    out.append(toma(tn, "ToMA keys/values, per block, proportional, window 8, weights every 5", "r=0.75", 0.75,
                    scope="keys/values", window_size=8, weights_interval=5, **fixed))
    out += [toma(tn, "ToMA keys/values, per block, shared destinations, proportional, window 8, weights every 5",
                 f"r={r:g}", r, scope="keys/values", window_size=8, weights_interval=5, shared_destinations=True,
                 **fixed) for r in (0.75, 0.85)]
    out += [toma(tn, "ToMA keys/values, per block, proportional, window 8, start 0.2", f"r={r:g}", r,
                 scope="keys/values", window_size=8, start_percent=0.2, **fixed) for r in (0.75, 0.85)]
    out += [toma(tn, "ToMA queries, per block, window 8", f"r={r:g}", r, scope="queries", window_size=8,
                 plan_per_block=True) for r in (0.5, 0.75)]
    # one plan per level and weights every 5 steps: the fewest kernels a keys/values or attention merge adds,
    # for a host that issues every kernel (December 2026)
    out += [toma(tn, "ToMA keys/values, window 8, weights every 5", f"r={r:g}", r, scope="keys/values", window_size=8,
                 weights_interval=5) for r in (0.75, 0.85)]
    out.append(toma(tn, "ToMA keys/values, proportional, window 8, weights every 5", "r=0.75", 0.75,
                    scope="keys/values", window_size=8, weights_interval=5, proportional_attention=True))
    out.append(toma(tn, "ToMA keys/values, per block, shared destinations, window 8, weights every 5", "r=0.75", 0.75,
                    scope="keys/values", window_size=8, weights_interval=5, plan_per_block=True,
                    shared_destinations=True))
    out += [toma(tn, "ToMA attention, weights every 5", f"r={r:g}", r, weights_interval=5) for r in (0.5, 0.75)]
    out += [Variant("ToMeSD", f"r={r:g}", lambda m, r=r: tn.ToMeSDPatchModel().patch(m, r)[0]) for r in (0.5, 0.75)]
    out += [Variant("ComfyUI ToMe", f"r={r:g}", lambda m, r=r: comfy_tome(m, r)) for r in (0.5, 0.75)]
    return out


def sdxl_placements(tn) -> list[Variant]:
    """On the SDXL layout: today's default (attention at 1/2), the levels below it, whole blocks (where the
    modelled H200 speed is), the fidelity fixes, and the ToMe baselines at 1/2 (ComfyUI's ToMe cannot
    reach 1/2: unet_methods)."""
    out = [Variant("unpatched", "", lambda m: m)]
    nxt, fixed = {"levels": "auto+next"}, {"plan_per_block": True, "proportional_attention": True}
    out += [node_default(tn, r) for r in (0.5, 0.75)] + node_default_rotations(tn)
    out += [toma(tn, "ToMA attention", f"r={r:g}", r, scope="attention") for r in RATIOS]
    out += [toma(tn, "ToMA attention, auto+next", f"r={r:g}", r, **nxt) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA attention, per block, proportional, window 8, auto+next", "r=0.75", 0.75, window_size=8,
                 **nxt, **fixed)]
    # the SDXL default's neighbours on the clock that prices the host (December 2026): fewer weight refreshes
    # (a host that issues every kernel pays each), a later start
    for start in (0.15, 0.25):
        out += [toma(tn, f"ToMA attention, auto+next, start {start:g}, weights every 5", f"r={r:g}", r,
                     start_percent=start, weights_interval=5, **nxt) for r in (0.75, 0.85)]
    out.append(toma(tn, "ToMA attention, auto+next, start 0.25", "r=0.75", 0.75, start_percent=0.25, **nxt))
    out += [toma(tn, "ToMA block, auto+next", f"r={r:g}", r, scope="block", **nxt) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block, window 8, auto+next", f"r={r:g}", r, scope="block", window_size=8, **nxt)
            for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block, auto+next, start 0.2", f"r={r:g}", r, scope="block", start_percent=0.2, **nxt)
            for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block", "r=0.5", 0.5, scope="block")]
    out += [toma(tn, "ToMA keys/values, per block, proportional, window 8", f"r={r:g}", r, scope="keys/values",
                 window_size=8, **fixed) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA keys/values, per block, proportional, window 8, auto+next", f"r={r:g}", r,
                 scope="keys/values", window_size=8, **nxt, **fixed) for r in (0.75, 0.85)]
    out += [toma(tn, "ToMA keys/values, proportional, window 8, auto+next", "r=0.75", 0.75, scope="keys/values",
                 window_size=8, proportional_attention=True, **nxt)]
    shared = {"weights_interval": 5, "shared_destinations": True, **fixed}
    out += [toma(tn, "ToMA keys/values, per block, shared destinations, proportional, window 8, weights every 5, "
                 "auto+next", "r=0.75", 0.75, scope="keys/values", window_size=8, **nxt, **shared)]
    out += [toma(tn, "ToMA block, per block, shared destinations, weights every 5, auto+next", f"r={r:g}", r,
                 scope="block", plan_per_block=True, shared_destinations=True, weights_interval=5, **nxt)
            for r in (0.5, 0.75)]
    out += [tomesd(tn, r, 2) for r in (0.5, 0.75)]
    out += [catome(tn, t, 2) for t in (0.7, 0.5)]
    return out


def dit_front(tn, video: bool) -> list[Variant]:
    """Around the DiT default (whole blocks, window 4, reuse 5, every step from the first): the first 20% of
    the schedule unmerged, window 8, one step in 2, per-block plans; keys/values merging (plain, with
    proportional attention, with per-block plans, with shared destinations); on Flux layouts also the
    attention-only placement; DiTo and ToMeSD's matching in whole blocks beside them. For choosing each DiT
    family's default on the GPU clock."""
    out = [Variant("unpatched", "", lambda m: m)] + node_default_rotations(tn)
    out += [toma(tn, "ToMA block", f"r={r:g}", r, scope="block") for r in RATIOS]
    out += [toma(tn, "ToMA block, start 0.2", f"r={r:g}", r, scope="block", start_percent=0.2) for r in RATIOS]
    out += [toma(tn, "ToMA block, window 8", f"r={r:g}", r, scope="block", window_size=8) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block, window 8, start 0.2", f"r={r:g}", r, scope="block", window_size=8,
                 start_percent=0.2) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block, 1 step in 2", f"r={r:g}", r, scope="block", merge_every=2) for r in (0.5, 0.75)]
    out += [toma(tn, "ToMA block, per block", "r=0.5", 0.5, scope="block", plan_per_block=True)]
    # keys/values: queries whole, nothing unmerged; what proportional attention and per-block plans add
    kv = {"scope": "keys/values"}
    out += [toma(tn, "ToMA keys/values", "r=0.75", 0.75, **kv),
            toma(tn, "ToMA keys/values, proportional", "r=0.75", 0.75, proportional_attention=True, **kv)]
    out += [toma(tn, "ToMA keys/values, per block, proportional", f"r={r:g}", r, plan_per_block=True,
                 proportional_attention=True, **kv) for r in (0.75, 0.9)]
    out += [toma(tn, "ToMA keys/values, per block, shared destinations, proportional", f"r={r:g}", r,
                 plan_per_block=True, shared_destinations=True, proportional_attention=True, **kv) for r in (0.75, 0.9)]
    if not video:
        out += [toma(tn, f"ToMA block, start {p:g}", "r=0.75", 0.75, scope="block", start_percent=p) for p in (0.3, 0.4)]
        out += [toma(tn, "ToMA block, start 0.2, 1 step in 2", "r=0.75", 0.75, scope="block", start_percent=0.2,
                     merge_every=2)]
        out += [toma(tn, "ToMA attention", f"r={r:g}", r, scope="attention") for r in (0.5, 0.75)]
        out += [toma(tn, "ToMA attention, start 0.2", "r=0.75", 0.75, scope="attention", start_percent=0.2)]
    # the other methods on DiTs: DiTo (after arXiv 2605.22011; its default interval 5 and penalty 0.5, and without
    # the penalty), and ToMeSD's matching in the same whole blocks
    out += [dito(tn, r) for r in RATIOS]
    out += [dito(tn, 0.5, penalty=0.0, family="DiTo, no penalty")]
    out += [tomesd_on_dits(tn, r) for r in (0.5, 0.75)]
    return out


def sparse_front(tn) -> list[Variant]:
    """Beside core's Model Sparse Attention (toma_bench.sparse_attention's stand-in: comfy-kitchen's eager
    Sol-Attn behind the node's protocol, dense before 20% of the schedule; min_tokens 0 and any head size, so
    that it takes the proxy's 4096-token, 64-wide attention as it takes Wan 720p's 75,600-token, 128-wide
    one): sparse attention alone over tau, and stacked with ToMA at scope feed-forward (the self-attention
    over every token is the kernel's; the cross-attention and feed-forward merge), the early steps whole. The
    speed axis prices the kernel at the share of key blocks it routed exact on the proxy plus 10%
    (sparse_attention.ROUTING_OVERHEAD)."""
    sa = sparse_attention
    missing = sa.protocol_missing()
    reference = sa.sol_attn_reference()
    if missing or isinstance(reference, str):
        raise SystemExit(f"--set sparse: {missing or reference}")

    class Sparse:
        """A row's patch: ``toma`` (None: none), then the stand-in; its kernel is the row's own (its proxy run
        prices its real-size run), so it tells the row's routed share."""

        def __init__(self, tau: float, toma=None):
            self.tau, self.toma, self.kernel = tau, toma, sa.MeasuredKernel()

        def __call__(self, m):
            stand_in = sa.SparseAttention(self.kernel, tau=self.tau, min_tokens=0, head_dim=None)
            return stand_in.apply(m if self.toma is None else self.toma(m))

    sparse = Sparse

    def feed_forward(ratio: float, start: float):
        node = tn.ToMAPatchModelAdvanced()
        return lambda m: node.patch(m, ratio, WINDOW, tn.DEFAULT_REUSE, scope="feed-forward",
                                    start_percent=start, rotation="off")[0]

    out = [Variant("unpatched", "", lambda m: m)]
    out += [Variant("sparse attention", f"tau={tau:g}", sparse(tau)) for tau in (1.0, 1.3, 1.5)]
    for start, ratios in ((0.2, (0.5, 0.75)), (0.4, (0.25, 0.5, 0.75))):
        out += [Variant(f"ToMA feed-forward, start {start:g} + sparse attention tau 1.3", f"r={r:g}",
                        sparse(1.3, feed_forward(r, start))) for r in ratios]
    return out


# ToMA's rows stacked with a step cache (``--stack-with``): "default" (the basic node's), "R" (the node's settings
# of the model's kind at ratio R, destinations rotating) or "Rfixed" (the same, fixed): node_default
STACK_WITH = "default,0.3,0.2,0.3fixed"


def stack_toma(name: str) -> tuple:
    """``--stack-with``'s "default", "0.3" or "0.3fixed" -> (ratio or None, rotation) for node_default."""
    if name == "default":
        return None, "auto"
    ratio = name.removesuffix("fixed")
    try:
        value = float(ratio)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise ValueError(f"--stack-with: default, a ratio R (0 < R < 1) or Rfixed, got {name!r}")
    return value, "off" if name.endswith("fixed") else "on"


CACHES = "LazyCache=0.1,0.2,0.3,0.5,0.7,1;EasyCache=0.1,0.2,0.3,0.5;TeaCache=0.25,0.4,0.6;MagCache=0.06,0.12,0.24"


def parse_caches(text: str) -> dict:
    """``--caches``'s "LazyCache=0.2,0.5;TeaCache" -> {name: thresholds} (a name alone: its node's default)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, values = part.partition("=")
        if name not in step_caches.NAMES:
            raise ValueError(f"--caches: names are {', '.join(step_caches.NAMES)}, got {name!r}")
        try:
            out[name] = [float(v) for v in values.split(",")] if values else [step_caches.DEFAULT_THRESHOLD[name]]
            for t in out[name]:
                step_caches.check(name, t)
        except ValueError as e:
            raise ValueError(f"--caches: {name}'s thresholds: {e}") from None
    return out


def cache_front(tn, kind: str, caches: dict, stacks: list[str], stacked: list[str] | None = None) -> list[Variant]:
    """The step caches (toma_bench.step_caches) over their thresholds, alone and (those ``stacked`` names,
    default all) stacked with each of the ToMA rows ``stacks`` names (stack_toma; ToMA put after the cache),
    and those ToMA rows alone. A cache
    whose code is not here (core's before late 2025, a pack without a loading mirror, a pack cache on a
    UNet) is left out, and said why."""
    out = [Variant("unpatched", "", lambda m: m)]
    tomas = [node_default(tn, *stack_toma(name)) for name in stacks]
    out += tomas
    for name, thresholds in caches.items():
        try:
            if name in step_caches.PACKED:
                if kind not in step_caches.MODEL_TYPE:
                    raise step_caches.CacheMissing(f"{name} serves DiTs, not a {kind} model")
                step_caches.pack_module(name)
            elif importlib.util.find_spec("comfy_extras.nodes_easycache") is None:
                raise step_caches.CacheMissing(f"{name}: this ComfyUI has no comfy_extras/nodes_easycache.py")
        except step_caches.CacheMissing as why:
            print(f"left out: {why}", flush=True)
            continue
        for t in thresholds:
            out.append(Variant(name, f"t={t:g}", step_caches.Stacked(name, t, kind)))
            out += [Variant(f"{name} + {v.label}", f"t={t:g}", step_caches.Stacked(name, t, kind, v.patch))
                    for v in tomas if stacked is None or name in stacked]
    return out


def setting_values(tn, text: str) -> dict:
    """``--setting``'s "ratio=0.75,scope=block,start_percent=0.3" -> the Advanced node's inputs, each
    converted to its input's type (INT, FLOAT, BOOLEAN true/false, or one of a combo's choices) and
    checked by the node itself when it patches."""
    spec = tn.ToMAPatchModelAdvanced.INPUT_TYPES()
    inputs = {**spec["required"], **spec["optional"]}
    values = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or name not in inputs or name == "model":
            raise ValueError(f"--setting takes name=value pairs of the Advanced node's inputs "
                             f"({', '.join(n for n in inputs if n != 'model')}), got {item!r}")
        kind = inputs[name][0]
        if kind == "BOOLEAN":
            if value not in ("true", "false"):
                raise ValueError(f"--setting: {name} is true or false, got {value!r}")
            values[name] = value == "true"
        elif kind in ("INT", "FLOAT"):
            try:
                values[name] = int(value) if kind == "INT" else float(value)
            except ValueError:
                raise ValueError(f"--setting: {name} is {'an integer' if kind == 'INT' else 'a number'}, "
                                 f"got {value!r}") from None
        else:
            values[name] = value
    if "ratio" not in values:
        raise ValueError(f"--setting needs a ratio, got {text!r}")
    return values


def named_settings(tn, texts: list[str]) -> list[Variant]:
    """The unpatched model, the basic node at its defaults, and each ``--setting``: the Advanced node with
    those inputs (window 4, scope attention and rotation off where not named, as every other ToMA row:
    ``toma``)."""
    out = [Variant("unpatched", "", lambda m: m), node_default(tn, None)]
    for text in texts:
        values = setting_values(tn, text)
        ratio = values.pop("ratio")
        words = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items())
        out.append(toma(tn, f"ToMA {words}".rstrip(), f"r={ratio:g}", ratio, **values))
    return out


def few_steps(tn) -> list[Variant]:
    """For distilled few-step models (Z-Image-Turbo: 8 steps): what start_percent and reuse_interval mean
    when a run has few steps, at ratios 0.5 and 0.75, whole blocks."""
    out = [Variant("unpatched", "", lambda m: m), node_default(tn, 0.75)]
    for r in (0.5, 0.75):
        out += [toma(tn, f"ToMA block, reuse {k}", f"r={r:g}", r, scope="block", reuse_interval=k) for k in (1, 2, 5)]
        out += [toma(tn, f"ToMA block, reuse 2, start {p:g}", f"r={r:g}", r, scope="block", reuse_interval=2,
                     start_percent=p) for p in (0.125, 0.25, 0.4)]
    return out


def video_methods(tn) -> list[Variant]:
    """ToMA on the Wan video proxy (whole blocks merge; the ToMe baselines do not patch DiTs): windows
    over 1 frame (each frame apart, as on images) and over 2 frames (the node's default), at every ratio."""
    out = [Variant("unpatched", "", lambda m: m)]
    for frames in (1, 2):
        out += [toma(tn, f"ToMA {frames}-frame windows", f"r={r:g}", r, temporal_window=frames, scope="block")
                for r in RATIOS]
    return out


def dit_methods(tn) -> list[Variant]:
    """ToMA on Flux: the two double-block placements (whole block merged; attention only, the paper's),
    each every step and every third step (the official Flux run's schedule). Only ToMA patches DiTs."""
    out = [Variant("unpatched", "", lambda m: m)]
    for scope in ("block", "attention"):
        for k in (1, 3):
            family = f"ToMA {scope}" + (f", 1 step in {k}" if k > 1 else "")
            out += [toma(tn, family, f"r={r:g}", r, scope=scope, merge_every=k) for r in RATIOS]
    return out


# -- measuring ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    latent: torch.Tensor
    wall: float
    cpu: float
    calls_ran: tuple  # per step, whether the model's blocks ran (a step cache skips some)


def sample_once(model, args) -> Run:
    step_caches.clear_state(model)
    with sampling.seeded_global_rngs(SEED), step_caches.counted(model) as (ran, callback):
        # (ComfyUI's TomePatchModel draws from the global RNGs)
        latent, wall, cpu = run.timed(lambda: proxy.sample(model, SEED, args.batch, args.steps, side=args.side,
                                                           frames=args.frames, callback=callback))
    return Run(latent.float(), wall, cpu, tuple(ran))


@dataclasses.dataclass
class Row:
    variant: Variant
    cpu: float  # median process CPU seconds of a run
    wall: float  # median wall seconds of a run
    cpu_speedup: float  # median over rounds of unpatched / variant CPU time
    cpu_spread: tuple  # lowest and highest of those ratios
    wall_speedup: float
    removed: float | None
    psnr: float
    ssim: float
    latent_rel_l2: float
    gpu_speedup: float | None = None  # the cost model's, of the real-size model with the same setting
    flops_saved: float | None = None  # % of the real-size model's FLOPs per step
    regime_speedups: dict | None = None  # the cost model's speed-up in each of --regimes
    calls_ran: tuple = ()  # per step, whether the model's blocks ran in the fidelity run


def measure(base, variants: list[Variant], args, pack, progress=print):
    """Rows (in ``variants`` order; the first is the reference) and the fidelity runs' pictures."""
    patched = [v.patch(base) for v in variants]
    first = []
    for v, m in zip(variants, patched):
        first.append(sample_once(m, args))
        progress(f"  {v.label or 'unpatched'}: {first[-1].wall:.1f} s")
    removed = [run.removed_fraction(pack, m) for m in patched]

    def timed_run(i):
        again = sample_once(patched[i], args)
        if not torch.equal(again.latent, first[i].latent) or again.calls_ran != first[i].calls_ran:
            raise RuntimeError(f"{variants[i].label}: a repeat sampled other latents (or ran other model calls) "
                               "than the first run")
        return again.wall, again.cpu

    timings = run.interleave(list(range(len(variants))), args.repeats, timed_run, progress)
    if not args.repeats:  # --repeats 0: the fidelity run's own (untimed-order) seconds
        timings = [run.Timings([x.wall], [x.cpu]) for x in first]
    pictures = [proxy.latent_to_images(base, x.latent) for x in first]
    rows = []
    for i, (v, t) in enumerate(zip(variants, timings)):
        cpu_speedup, *cpu_spread = t.speedups(timings[0], "cpu")
        rows.append(Row(v, t.median_cpu, t.median_wall, cpu_speedup, tuple(cpu_spread),
                        t.speedups(timings[0], "wall")[0], removed[i], psnr(pictures[i], pictures[0]),
                        ssim(pictures[i], pictures[0]), relative_l2(first[i].latent, first[0].latent),
                        calls_ran=first[i].calls_ran))
    return rows, pictures


# The real-size model whose modelled GPU speed is each proxy's speed axis (toma_bench.costmodel.SPECS).
REAL_SIZE = {"sd15": "sd15", "sdxl": "sdxl", "flux": "flux", "flux32": "flux", "wan": "wan_720p", "wan32": "wan_720p"}


def merge_count(row: Row) -> int | None:
    """CA-ToMe's merge count depends on the data, which the meta device has not: the real-size model gets
    the share of its merged level's tokens that the proxy run removed (costmodel.UNET_LEVEL_TOKENS)."""
    if row.variant.family != "CA-ToMe" or row.removed is None:
        return None
    return round(row.removed * costmodel.UNET_LEVEL_TOKENS)


def cost_variant(row: Row) -> costmodel.Variant:
    """What the cost model records for ``row``: its patch; where a step cache ran, the patch inside the
    calls, the cache and the calls it ran in the proxy run (costmodel.Variant)."""
    patch = row.variant.patch
    if isinstance(patch, step_caches.Stacked):
        return costmodel.Variant(row.variant.label, patch=patch.cost_patch, cache=patch.name,
                                 calls_ran=row.calls_ran)
    return costmodel.Variant(row.variant.label, patch=patch, meta_scalar=merge_count(row))


def gpu_clock(rows: list[Row], pack, args, progress=print, real: str | None = None) -> None:
    """Fill each row's modelled GPU speed-up and FLOPs saved: the cost model records the real-size model
    of the proxy's family (``real``: another costmodel row; default ``--real``) patched with the same setting,
    for as many steps as the proxy runs."""
    spec = costmodel.SPECS[real or args.real]
    recorded = costmodel.record_model(spec, pack, args.steps, [cost_variant(r) for r in rows],
                                      progress=progress, traced=any(REGIMES[r].traced for r in args.regimes))
    hw = profile(args.hardware)
    priced = {regime: costmodel.price(recorded, hw, "pipelined", False, regime) for regime in args.regimes}
    for i, row in enumerate(rows):
        first = priced[args.regimes[0]][i]
        row.gpu_speedup, row.flops_saved = first.speed_up, first.flops_saved or 0.0
        row.regime_speedups = {regime: rows_[i].speed_up for regime, rows_ in priced.items()}


# -- output -------------------------------------------------------------------------------------------
def table(rows: list[Row], hardware: str = "GPU", regimes: tuple = ("eager",)) -> str:
    """The rows; the speed-up in the first of ``regimes`` after the label, the others' at the end."""
    more = list(regimes[1:]) if rows and rows[0].regime_speedups else []
    head = ["variant", f"{hardware} speed-up", "FLOPs saved", "PSNR dB", "SSIM", "latent relL2", "removed", "calls",
            "CPU s", "wall s", "CPU speed-up", "spread", "wall speed-up"] + [f"{hardware} {r}" for r in more]
    lines = [[r.variant.label, format_cell(r.gpu_speedup, "{:.3f}x"), format_cell(r.flops_saved, "{:.1f}%"),
              "inf" if math.isinf(r.psnr) else f"{r.psnr:.2f}", f"{r.ssim:.4f}", f"{r.latent_rel_l2:.4f}",
              format_cell(r.removed and 100 * r.removed, "{:.0f}%"), f"{sum(r.calls_ran)}/{len(r.calls_ran)}",
              f"{r.cpu:.2f}", f"{r.wall:.2f}",
              f"{r.cpu_speedup:.3f}x", f"{r.cpu_spread[0]:.2f}-{r.cpu_spread[1]:.2f}", f"{r.wall_speedup:.3f}x"]
             + [f"{r.regime_speedups[regime]:.3f}x" for regime in more]
             for r in rows]
    return format_table(head, lines)


PSNR_TOP = 60.0  # dB: the plot's PSNR axis ends here


def plot(rows: list[Row], path: Path, title: str, speed_axis: str) -> None:
    """Speed-up (the modelled GPU's where rows have it, else CPU time's) vs PSNR and vs SSIM, a line per
    family (its knob's values annotated)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r.variant.family for r in rows[1:]))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, name in ((axes[0], "psnr", f"PSNR of the pictures vs unpatched (dB; above {PSNR_TOP:g} at the top)"),
                             (axes[1], "ssim", "SSIM of the pictures vs unpatched")):
        for k, family in enumerate(families):
            # a variant that merges (almost) nothing has a PSNR far above the rest: shown at the top edge
            pts = sorted((r.cpu_speedup if r.gpu_speedup is None else r.gpu_speedup,
                          min(getattr(r, metric), PSNR_TOP), r.variant.setting) for r in rows
                         if r.variant.family == family)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^vDP*Xh<>"[k % 11], lw=1, ms=4,
                    label=family, color=f"C{k % 10}")
            for x, y, s in pts:
                ax.annotate(s.split("=")[-1], (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6,
                            color=f"C{k % 10}")
        ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
        ax.set_xlabel(f"speed-up vs unpatched, {speed_axis} (x)", fontsize=8)
        ax.set_ylabel(name, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def sample_grid(rows: list[Row], pictures: list[torch.Tensor], path: Path, columns: int = 4,
                every_row: bool = False) -> None:
    """One row per variant at ratio 0.5 (and the unpatched run, and CA-ToMe at 0.7), or per variant
    (``every_row``): its first ``columns`` pictures, labelled."""
    from PIL import Image, ImageDraw

    keep = [i for i, r in enumerate(rows) if every_row or r.variant.setting in ("", "r=0.5", "t=0.7")]
    zoom, label_w = 2, 190
    h, w = pictures[0].shape[1:3]
    canvas = Image.new("RGB", (label_w + columns * (w * zoom + 2), len(keep) * (h * zoom + 2)), "white")
    draw = ImageDraw.Draw(canvas)
    for row, i in enumerate(keep):
        y = row * (h * zoom + 2)
        draw.text((4, y + h * zoom // 2 - 6), rows[i].variant.label or "unpatched", fill="black")
        for c in range(min(columns, pictures[i].shape[0])):
            tile = Image.fromarray((pictures[i][c] * 255).round().byte().numpy())
            canvas.paste(tile.resize((w * zoom, h * zoom), Image.NEAREST), (label_w + c * (w * zoom + 2), y))
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


# -- main ---------------------------------------------------------------------------------------------
def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.curves", description=__doc__.split("\n\n")[0])
    # pictures only: the wan proxy samples clips
    ap.add_argument("--arch", choices=list(proxy.SPECS), default="sd15", help="which trained proxy (default sd15)")
    ap.add_argument("--set", choices=["methods", "toma", "placements", "front", "fewsteps", "sparse", "caches"],
                    default=None,
                    help="methods (the default): every method's knob swept; toma: ToMA's settings around its defaults; "
                         "placements (UNet proxies): ToMA's placements and fidelity fixes against the baselines; "
                         "front (DiT proxies): the settings around the DiT default; fewsteps (DiT proxies): "
                         "start and reuse for few-step runs (use with --steps 8); sparse (video proxies, a ComfyUI "
                         "with the sparse node's protocol: v0.33.0): core's sparse attention alone and stacked with "
                         "ToMA (toma_bench.sparse_attention); caches: the step caches of --caches alone and "
                         "stacked with the ToMA rows of --stack-with (toma_bench.step_caches); with --setting, its "
                         "rows join the settings' (--variants then picks among the set's rows)")
    ap.add_argument("--caches", default=CACHES,
                    help=f"--set caches: 'NAME=T1,T2;NAME...' (a name alone: its node's default threshold; default {CACHES})")
    ap.add_argument("--stack-with", default=STACK_WITH,
                    help="--set caches: comma list of the ToMA rows each cache is stacked with, and that run alone: "
                         "default (the basic node's), R (the node's settings of the model's kind at ratio R, "
                         f"destinations rotating), Rfixed (the same, fixed; default {STACK_WITH})")
    ap.add_argument("--stacked-caches", default=None,
                    help="--set caches: comma list of the caches of --caches that are stacked (default: all)")
    ap.add_argument("--hardware", default="h200",
                    help="the cost model's GPU profile for the speed axis (toma_bench.gpuclock; default h200); "
                         "'cpu': no cost model, the process CPU time is the axis")
    ap.add_argument("--regimes", default="eager",
                    help="comma list of the cost model's regimes (toma_bench.gpuclock.REGIMES: eager, graphs, "
                         "compiled, compiled+graphs; default eager): the first is the speed axis, the others columns at the end")
    ap.add_argument("--variants", default=None,
                    help="';'-separated parts of variant labels (labels hold commas): only those rows (and unpatched) run")
    ap.add_argument("--side", type=int, default=None, help="latent side (default: the proxy's training size)")
    ap.add_argument("--frames", type=int, default=None,
                    help="latent frames of a clip (video proxies; default: the proxy's training clips')")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE,...",
                    help="a ToMA row of the Advanced node's inputs, e.g. ratio=0.75,scope=block,start_percent=0.3 "
                         "(repeatable; window 4, scope attention and rotation off unless named); with --setting the rows are "
                         "the unpatched model, the basic node at its defaults and these, then the rows of --set where "
                         "one is named")
    ap.add_argument("--real", choices=list(costmodel.SPECS), default=None,
                    help="the real-size model of the speed axis (default: the proxy's family, "
                         + ", ".join(f"{a} {m}" for a, m in REAL_SIZE.items()) + ")")
    ap.add_argument("--also-real", default="", metavar="MODEL,...",
                    help="comma list of more real-size models (toma_bench.costmodel.SPECS) to price the same rows "
                         "on: a table each after the first, the same run's pictures (and PSNR) on another speed axis")
    ap.add_argument("--batch", type=int, default=4, help="pictures per run (default 4)")
    ap.add_argument("--steps", type=int, default=20, help="euler steps per run (default 20)")
    run.common_arguments(ap, devices=None, repeats_default=5,
                         repeats_help="timed CPU rounds over all variants (default 5; 0: only the fidelity run's own times)",
                         threads_default=1, threads_help="torch CPU threads (default 1)")
    ap.add_argument("--proxy", default=None, help="proxy safetensors (default: the shipped one for --arch)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the plot and the picture grid ('' for none)")
    args = ap.parse_args(argv)
    spec = proxy.spec_of(args.arch)
    args.side = spec.side if args.side is None else args.side
    args.real = args.real or REAL_SIZE[args.arch]
    if args.frames is not None and not spec.frames:
        ap.error(f"--frames is for the video proxies, not {args.arch}")
    for name in ("side", "batch", "steps", "threads") + (("frames",) if args.frames is not None else ()):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.repeats < 0:
        ap.error(f"--repeats must be at least 0, got {args.repeats}")
    unet = spec.model_kind == "sd15"
    if args.set == "placements" and not unet:
        ap.error("--set placements is for the UNet proxies, sd15 and sdxl (the other placements are UNet-only)")
    if args.set in ("front", "fewsteps") and unet:
        ap.error(f"--set {args.set} is for the DiT proxies (flux, flux32, wan, wan32)")
    if args.set == "sparse" and spec.model_kind != "wan":
        ap.error("--set sparse is for the video proxies (wan, wan32)")
    if args.hardware != "cpu":
        try:
            profile(args.hardware)
        except ValueError as e:
            ap.error(str(e))
    args.regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not args.regimes or any(r not in REGIMES for r in args.regimes):
        ap.error(f"--regimes: comma list of {', '.join(REGIMES)}, got {','.join(args.regimes) or 'none'}")
    args.variants = [v.strip() for v in args.variants.split(";") if v.strip()] if args.variants else None
    args.also_real = [m.strip() for m in args.also_real.split(",") if m.strip()]
    if any(m not in costmodel.SPECS for m in args.also_real):
        ap.error(f"--also-real: comma list of {', '.join(costmodel.SPECS)}, got {','.join(args.also_real)}")
    if args.set is None and not args.setting:
        args.set = "methods"
    try:
        args.caches = parse_caches(args.caches)
    except ValueError as e:
        ap.error(str(e))
    args.stack_with = [v.strip() for v in args.stack_with.split(",") if v.strip()]
    if args.stacked_caches is not None:
        args.stacked_caches = [v.strip() for v in args.stacked_caches.split(",") if v.strip()]
        if any(v not in args.caches for v in args.stacked_caches):
            ap.error(f"--stacked-caches: comma list of the caches of --caches ({', '.join(args.caches)}), "
                     f"got {','.join(args.stacked_caches)}")
    try:
        [stack_toma(v) for v in args.stack_with]
    except ValueError as e:
        ap.error(str(e))
    return args


def command_line(args) -> str:
    """The command that reproduces this run's numbers (every option that changes them)."""
    real = "" if args.real == REAL_SIZE[args.arch] else f" --real {args.real}"
    regimes = "" if args.regimes == ["eager"] else f" --regimes {','.join(args.regimes)}"
    also = f" --also-real {','.join(args.also_real)}" if args.also_real else ""
    variants = f" --variants '{';'.join(args.variants)}'" if args.variants else ""
    frames = "" if args.frames is None else f" --frames {args.frames}"
    rows = "".join(f" --setting {v}" for v in args.setting) + (f" --set {args.set}" if args.set else "")
    if args.set == "caches":
        caches = ";".join(f"{name}={','.join(f'{t:g}' for t in ts)}" for name, ts in args.caches.items())
        rows += f" --caches '{caches}' --stack-with {','.join(args.stack_with)}"
        if args.stacked_caches is not None:
            rows += f" --stacked-caches {','.join(args.stacked_caches)}"
    return (f"python -m toma_bench.curves --arch {args.arch}{rows} --side {args.side}{frames} --batch {args.batch} "
            f"--steps {args.steps} --repeats {args.repeats} --threads {args.threads} --hardware {args.hardware}"
            f"{regimes}{real}{also}{variants}")


def set_rows(tn, args) -> list[Variant]:
    """The rows of ``--set`` on ``--arch``'s proxy (the unpatched model first)."""
    kind = proxy.spec_of(args.arch).model_kind
    if args.set == "toma":
        return toma_settings(tn, args.arch)
    if args.set == "front":
        return dit_front(tn, video=kind == "wan")
    if args.set == "fewsteps":
        return few_steps(tn)
    if args.set == "sparse":
        return sparse_front(tn)
    if args.set == "caches":
        return cache_front(tn, kind, args.caches, args.stack_with, args.stacked_caches)
    if kind == "wan":
        return video_methods(tn)
    if kind == "flux":
        return dit_methods(tn)
    if args.arch == "sdxl":
        return sdxl_placements(tn) if args.set == "placements" else unet_methods(tn, sdxl=True)
    return placements(tn) if args.set == "placements" else unet_methods(tn)


def variants_of(tn, args) -> list[Variant]:
    """The run's rows: the ``--setting`` rows (with the unpatched model and the basic node's default), then
    the rows of ``--set``, each picked by ``--variants`` (the set's alone where both are named)."""
    pick = costmodel.select_variants
    if not args.setting:
        return pick(set_rows(tn, args), args.variants)
    settings = named_settings(tn, args.setting)
    if not args.set:
        return pick(settings, args.variants)
    return settings + pick(set_rows(tn, args), args.variants)[1:]


def json_rows(rows: list[Row], args, also: dict) -> dict:
    """What the plot of several fronts reads (``toma_bench.fronts``): each row's family, setting, modelled
    speed-up on ``--real`` and on each ``--also-real`` model (``also``: model -> rows), and fidelity."""
    models = [args.real, *also]
    return {"command": command_line(args), "arch": args.arch, "side": args.side,
            "frames": args.frames or proxy.spec_of(args.arch).frames,
            "batch": args.batch, "steps": args.steps, "hardware": args.hardware, "regime": args.regimes[0],
            "real": {m: costmodel.SPECS[m].title for m in models},
            "rows": [{"label": r.variant.label, "family": r.variant.family, "setting": r.variant.setting,
                      "speed_up": {args.real: r.gpu_speedup, **{m: rows_[i].gpu_speedup for m, rows_ in also.items()}},
                      "calls_ran": sum(r.calls_ran), "skipped_steps": [i for i, ran in enumerate(r.calls_ran) if not ran],
                      "flops_saved": r.flops_saved, "psnr": None if math.isinf(r.psnr) else r.psnr,
                      "ssim": r.ssim, "latent_rel_l2": r.latent_rel_l2} for i, r in enumerate(rows)]}


def main(argv=None) -> None:
    args = parse_args(argv)
    run.set_threads(args.threads)
    spec = proxy.spec_of(args.arch)
    root = comfy_host.import_comfy(comfy_host.comfy_root(default=comfy_host.CURRENT_TREE), pytorch_attention=True,
                                   extra_nodes=False)
    logging.getLogger().setLevel(logging.WARNING)  # after ComfyUI's basicConfig(INFO): no per-run chatter
    pack = comfy_host.load_pack()
    tn = pack.nodes.toma_nodes
    path = Path(args.proxy or proxy.PROXY_DIR / spec.file)
    base = proxy.load(path)
    kind = spec.model_kind
    try:
        variants = variants_of(tn, args)
    except ValueError as e:
        raise SystemExit(str(e))
    frames = args.frames or spec.frames
    tokens = (args.side // (1 if kind == "sd15" else 2)) ** 2 * (frames or 1)
    print(run.header("python -m toma_bench.curves", argv, "CPU",
                     f"ComfyUI {'current' if comfy_host.is_current_comfy() else 'March 2024'} ({root.name}), SDPA"),
          flush=True)
    print(f"command: {command_line(args)}")
    print(f"{args.arch} proxy {path.name}; {args.batch} {'clips' if spec.frames else 'pictures'} of latent "
          f"{args.side}x{args.side}{f'x{frames} frames' if frames else ''} ({tokens} image "
          f"tokens at full resolution), euler/{spec.scheduler} {args.steps} steps, cfg 1, seed {SEED}; "
          f"{len(variants)} variants, {args.repeats} timed rounds", flush=True)
    with torch.inference_mode():
        rows, pictures = measure(base, variants, args, pack, progress=lambda s: print(s, flush=True))
    print(f"{run.footer()}\n")
    speed_axis = "process CPU time"
    if args.hardware != "cpu":
        gpu_clock(rows, pack, args, progress=lambda s: print(s, flush=True))
        spec_title = costmodel.SPECS[args.real].title
        speed_axis = f"modelled {args.hardware} ({spec_title}, {args.steps} steps, {args.regimes[0]})"
        print(f"\nspeed axis: {speed_axis}; toma_bench.costmodel")
    print(table(rows, args.hardware, tuple(args.regimes)), flush=True)
    also = {}
    for model in args.also_real if args.hardware != "cpu" else ():
        also[model] = [dataclasses.replace(r) for r in rows]
        gpu_clock(also[model], pack, args, progress=lambda s: print(s, flush=True), real=model)
        print(f"\nspeed axis: modelled {args.hardware} ({costmodel.SPECS[model].title}, {args.steps} steps, "
              f"{args.regimes[0]}); toma_bench.costmodel; the same pictures")
        print(table(also[model], args.hardware, tuple(args.regimes)), flush=True)
    kernels = [(r.variant.label, r.variant.patch.kernel) for r in rows if hasattr(r.variant.patch, "kernel")]
    if kernels:
        print("\nkey blocks the sparse kernel routed exact (mean over its proxy calls; priced at this + "
              f"{100 * sparse_attention.ROUTING_OVERHEAD:.0f}% of a dense kernel):")
        for label, kernel in kernels:
            print(f"  {label}: {100 * kernel.share():.1f}% over {len(kernel.shares)} calls")
    if args.out:
        name = "_".join(filter(None, ("settings" if args.setting else "", args.set)))
        stem = Path(args.out) / f"curves_{args.arch}_{name}_{args.side}{'' if args.frames is None else f'x{args.frames}'}"
        plot(rows, stem.with_name(stem.name + ".png"), f"{args.arch} proxy, {args.batch} pictures of latent "
             f"{args.side}x{args.side}, {args.steps} steps, {args.threads} thread(s): {command_line(args)}",
             speed_axis)
        sample_grid(rows, pictures, stem.with_name(stem.name + "_samples.png"), every_row=bool(args.setting))
        stem.with_name(stem.name + ".json").write_text(json.dumps(json_rows(rows, args, also), indent=1) + "\n")
        print(f"\nplot: {stem}.png; pictures: {stem}_samples.png; rows: {stem}.json")


if __name__ == "__main__":
    main()
