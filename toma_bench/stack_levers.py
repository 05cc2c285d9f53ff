"""ToMA stacked with a step cache, lever by lever (issue 45 part 2): calls run, modelled speed and PSNR of each.

A VARIANT is a cache, then optionally ToMA, then optionally levers, joined by "+" (e.g. "lc0.3", "lc0.5+r0.3",
"lc0.3+r0.3+calls+fixed", "tc0.4+node"). Cache, applied by toma_bench.step_caches: "unpatched" (none) |
"lc<threshold>" core's LazyCache | "ec<threshold>" core's EasyCache (both start 0.15, end 0.95) | "tc<threshold>"
TeaCache (welltop-cn's, "flux" coefficients, start 0, end 1) | "mc<threshold>" MagCache (Zehong-Ma's, "flux" ratios,
retention 0.2, K 2), both from their mirrors (toma_bench/pack_source.py). ToMA, patched before the cache: "r<ratio>"
the Advanced node with the basic node's settings of the model's kind (window auto, reuse 5, rotation on), the ratio
set by hand | "node" the basic node as it is (ratio auto: it finds the cache and takes its stack setting). Levers,
after "r<ratio>": "fixed" rotation off | "calls" plans counted by the calls that ran, not by sampler step | "window"
merge only inside the core caches' start/end | "reuseN" reuse interval N | "wgtN" merge weights every N steps |
"corr" the merge error corrected: a call that chooses new destinations runs the model unmerged too and returns that
output, and the calls that reuse its destinations add the difference it measured (MergeErrorCorrection).

Each variant samples the proxy (--arch: flux32, FLUX.1-dev's layout, latent 128x128 = 64x64 tokens; wan32, Wan 2.1's,
clips of 4 frames of latent 64x64 = 32x32 tokens; 4 pictures or clips, 20 steps, euler/simple, cfg 1, seed 0, 1 CPU
thread). Its row: calls, the diffusion-model calls whose blocks ran (a forward hook on the last block: every cache
skips it on a call it skips); merged, the calls ToMA merged; modelled, steps / (merged / ToMA's per-call speed-up
(Arch.per_call, of the proxy's real-size model) + calls run unmerged + the correction's unmerged runs), a skipped call
priced at 0; PSNR of the decoded pictures against unpatched (toma_bench.metrics.psnr); ToMA beside the cache, what
the node did beside the cache it found (its stats' step_cache, whole in the JSON rows). The unpatched reference runs
first in the same process, or is read from --reference (written there when it is not there yet).
"""
import argparse
import dataclasses
import json
import logging
import re
import sys
import time
from pathlib import Path

import torch

from . import comfy_host, proxy, run, step_caches
from .metrics import psnr
from .tables import format_cell, format_table

SEED = 0
CACHES = {"lc": "LazyCache", "ec": "EasyCache", "tc": "TeaCache", "mc": "MagCache"}
LEVER, NUMBER = re.compile(r"fixed|calls|window|corr|reuse[1-9]\d*|wgt[1-9]\d*"), re.compile(r"\d+(\.\d*)?|\.\d+")


@dataclasses.dataclass(frozen=True)
class Arch:
    """A proxy the levers run on: ``real``, the real-size model (costmodel.SPECS) its speed is priced on; ``kind``,
    the step caches' name of its family (step_caches.MODEL_TYPE); ``side``, its latent side by default; ``per_call``,
    ToMA's per-call speed-up on ``real`` at each ratio a variant may set, H200 eager, 20 steps, pipelined
    (toma_bench.costmodel, rounded as the levers table prints it): printed by `--arch A --per-call`."""

    real: str
    kind: str
    side: int
    per_call: dict


ARCHES = {
    "flux32": Arch("flux", "flux", 128, {0.5: 1.48, 0.3: 1.29, 0.2: 1.15}),
    "wan32": Arch("wan_720p", "wan", 64, {0.9: 2.52, 0.7: 1.80, 0.5: 1.44, 0.3: 1.20}),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    cache: str | None  # a CACHES value, None: no cache
    threshold: float | None
    ratio: float | None  # ToMA's ratio set by hand; None: the node's own (node) or no ToMA
    node: bool
    levers: tuple[str, ...]


def lever_number(levers: tuple[str, ...], prefix: str, default: int) -> int:
    """N of the lever "<prefix>N" in ``levers`` ("reuse5" -> 5); ``default`` where there is none."""
    return next((int(p[len(prefix):]) for p in levers if p.startswith(prefix)), default)


def parse_variant(name: str, per_call: dict = ARCHES["flux32"].per_call) -> Variant:
    """``name`` as the grammar above reads it, for a proxy whose per-call speed-ups are ``per_call``; ValueError
    naming the variant and the part that is wrong."""
    head, *toma = name.split("+")
    levers, node, cache, threshold, ratio = tuple(toma[1:]), toma[:1] == ["node"], None, None, None

    def refuse(why: str):
        raise ValueError(f"variant {name!r}: {why}")

    def number(text: str, what: str) -> float:
        return float(text) if NUMBER.fullmatch(text) else refuse(f"{what} {text!r} is not a number")

    if head != "unpatched":
        if head[:2] not in CACHES:
            refuse(f"{head!r} is not 'unpatched' nor a cache ({', '.join(CACHES)} followed by a threshold)")
        cache, threshold = CACHES[head[:2]], number(head[2:], "threshold")
        try:
            step_caches.check(cache, threshold)
        except ValueError as why:
            refuse(str(why))
    if toma and not node:
        ratio = number(toma[0][1:], "ratio") if toma[0].startswith("r") else refuse(
            f"ToMA is 'node' or 'r<ratio>', got {toma[0]!r}")
        if ratio not in per_call:
            refuse(f"ratio {ratio:g} has no per-call speed-up (this proxy's are at {', '.join(f'{r:g}' for r in per_call)})")
    if node and levers:
        refuse("'node' takes no levers (it runs as it is)")
    for lever in levers:
        if not LEVER.fullmatch(lever):
            refuse(f"unknown lever {lever!r} (fixed, calls, window, corr, reuseN, wgtN)")
    return Variant(name, cache, threshold, ratio, node, levers)


class CallCounted:
    """A ReuseSchedule counting steps by the model calls that ran (a cache's skipped steps do not advance it)."""

    def __init__(self, inner):
        self.inner, self.index = inner, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self):
        self.index.clear()
        self.inner.reset()

    def decide(self, step, progress, group, total=None):
        counted = self.index.setdefault(step, len(self.index))
        return self.inner.decide(counted, progress, group, total)


def toma_patch(tn, model, ratio: float, levers: tuple[str, ...] = ()):
    """``model`` with ToMA at ``ratio`` through the Advanced node, with the basic node's settings of the model's kind
    and ``levers``' changes to them."""
    kind = tn.preset_of(model)
    # "window": merge only inside the core caches' start/end
    start, end = (step_caches.START, step_caches.END) if "window" in levers else (kind.start_percent, 1.0)
    return tn.ToMAPatchModelAdvanced().patch(
        model, ratio, tn.DEFAULT_WINDOW, lever_number(levers, "reuse", tn.DEFAULT_REUSE), levels=kind.levels,
        weights_interval=lever_number(levers, "wgt", kind.weights_interval), start_percent=start, end_percent=end,
        merge_every=kind.merge_every, rotation="off" if "fixed" in levers else "on")[0]


def with_toma(base, v: Variant, pack):
    tn = pack.nodes.toma_nodes
    if v.node:
        return tn.ToMAPatchModel().patch(base, tn.DEFAULT_RATIO, tn.DEFAULT_WINDOW, tn.DEFAULT_REUSE)[0]
    if v.ratio is None:
        return base
    model = toma_patch(tn, base, v.ratio, v.levers)
    if "calls" in v.levers:
        rt = pack.nodes.runtime.runtime_of(model)
        rt.strategy = dataclasses.replace(rt.strategy, schedule=CallCounted(rt.strategy.schedule))
        rt.stack.own = rt.strategy  # each run begins with the node's own strategy: this one
    return model


class MergeErrorCorrection:
    """The "corr" lever, a DIFFUSION_MODEL wrapper put on after the cache (so inside it: the cache reads the
    corrected output). A model call in which ToMA chooses new destinations runs the diffusion model a second time
    with ToMA idle, returns that unmerged output and keeps the merge error it measured (unmerged - merged); a later
    call that merges with those destinations returns its output plus that error. ``unmerged_runs``: the second runs,
    which the modelled speed prices as whole calls."""

    KEY = "toma_bench.merge_error_correction"

    def __init__(self, runtime):
        self.runtime, self.error, self.unmerged_runs = runtime, None, 0

    def __call__(self, executor, *args, **kwargs):
        call = self.runtime._call  # the model call the runtime located (None: outside a sampling step)
        decisions = (list(call.decisions.values()) or [call.fresh]) if call is not None else []
        merges = any(merge for merge, _, _ in decisions)
        chooses = any(merge and new for merge, new, _ in decisions)
        out = executor(*args, **kwargs)
        if chooses:
            own = self.runtime.strategy
            self.runtime.strategy = dataclasses.replace(own, idle_because="the correction's unmerged run")
            try:
                whole = executor(*args, **kwargs)
            finally:
                self.runtime.strategy = own
            self.error, self.unmerged_runs = whole - out, self.unmerged_runs + 1
            return whole
        return out + self.error if merges and self.error is not None else out

    @classmethod
    def put_on(cls, model, pack):
        """The correction, on ``model`` (a clone) for ToMA's runtime on it; (the model, the correction)."""
        import comfy.patcher_extension

        correction = cls(pack.nodes.runtime.runtime_of(model))
        model = model.clone()
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, cls.KEY, correction)
        return model, correction


def measure(base, v: Variant, pack, args, reference) -> tuple[dict, torch.Tensor]:
    """(the row of variant ``v``, its LATENT samples)."""
    model = with_toma(base, v, pack)
    model = model if v.cache is None else step_caches.apply(v.cache, model, v.threshold, kind=args.arch.kind)
    model, correction = MergeErrorCorrection.put_on(model, pack) if "corr" in v.levers else (model, None)
    dm, calls, started = base.model.diffusion_model, [], time.time()
    hook = step_caches.last_block(dm).register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.inference_mode():
            latent = proxy.sample(model, SEED, args.batch, args.steps, side=args.side).float()
    finally:
        hook.remove()
        step_caches.clear_state(base)
    seconds = time.time() - started
    rt = run.runtime_of(pack, model)
    summary = rt.summary() if rt else None
    step_cache = summary and summary.get("step_cache")
    # "node": the ratio it merged at (beside a cache: its stack setting; None: it stepped aside)
    ratio = (step_cache["ratio"] if step_cache else rt.strategy.ratio) if v.node else v.ratio
    merged = max((lv["steps"] for lv in summary["levels"].values()), default=0) if summary else 0
    per_call = args.arch.per_call[ratio] if ratio else 1.0
    extra = correction.unmerged_runs if correction else 0
    ran = len(calls) - extra  # the correction's unmerged runs pass the last block too
    row = {"variant": v.name, "calls": ran, "merged_calls": merged, "unmerged_runs": extra,
           "modelled": args.steps / (merged / per_call + ran - merged + extra),
           "psnr": None if reference is None else psnr(proxy.latent_to_images(base, latent), reference),
           "seconds": round(seconds, 1), "stack": step_cache}
    return row, latent


def reference_of(path: Path | None, settings: dict) -> torch.Tensor | None:
    """The unpatched LATENT cached at ``path`` for the same settings; None where there is none yet."""
    cached = torch.load(path) if path and path.exists() else {"settings": settings, "latent": None}
    if cached["settings"] != settings:
        raise SystemExit(f"--reference {path}: made with {cached['settings']}, not {settings}")
    return cached["latent"]


def table(rows: list[dict]) -> str:
    return format_table(["variant", "ToMA beside the cache", "calls (merged)", "modelled", "PSNR dB", "seconds"], [
        [r["variant"], (r["stack"] or {}).get("setting", "-"), f"{r['calls']} ({r['merged_calls']})",
         f"{r['modelled']:.2f}x", format_cell(r["psnr"], "{:.2f}"), f"{r['seconds']:.1f}"] for r in rows], left=2)


def per_call_speed_ups(pack, arch: Arch) -> None:
    """Print what ``arch.per_call`` rounds: ToMA's per-call speed-up at each of its ratios, as the variants patch."""
    from . import costmodel
    from .gpuclock import profile

    tn = pack.nodes.toma_nodes
    variants = [costmodel.Variant("unpatched", patch=lambda m: m)] + [costmodel.Variant(
        f"r={r:g}", patch=lambda m, r=r: toma_patch(tn, m, r)) for r in arch.per_call]
    recorded = costmodel.record_model(costmodel.SPECS[arch.real], pack, 20, variants,
                                      progress=lambda line: print(line, file=sys.stderr))
    for row in costmodel.price(recorded, profile("h200"), "pipelined", False, "eager"):
        print(f"{row.label}: {row.speed_up:.4f}x per call")


def parse_args(argv):
    title, grammar = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(prog="python -m toma_bench.stack_levers", description=title, epilog=grammar,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="*", metavar="VARIANT", help="none: the unpatched reference only")
    ap.add_argument("--arch", choices=ARCHES, default="flux32", help="the proxy's layout (default flux32)")
    ap.add_argument("--proxy", type=Path, help="a proxy of --arch's layout (default: the shipped one)")
    ap.add_argument("--side", type=int, help="latent side (default: flux32 128, 64x64 tokens; wan32 64, 32x32)")
    ap.add_argument("--batch", type=int, default=4, help="pictures (default 4)")
    ap.add_argument("--steps", type=int, default=20, help="sampling steps (default 20)")
    ap.add_argument("--reference", type=Path, help="the unpatched samples, read from here or written here")
    ap.add_argument("--out", type=Path, help="also write the settings and rows to this JSON file")
    ap.add_argument("--per-call", action="store_true", help="print the per-call speed-ups of --arch, and stop")
    args = ap.parse_args(argv)
    args.proxy = args.proxy or proxy.PROXY_DIR / proxy.spec_of(args.arch).file
    args.arch = ARCHES[args.arch]
    args.side = args.side or args.arch.side
    try:
        args.variants = [parse_variant(name, args.arch.per_call) for name in args.variants]
    except ValueError as error:
        ap.error(str(error))
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    root = comfy_host.import_comfy(comfy_host.comfy_root(default=comfy_host.CURRENT_TREE), pytorch_attention=True,
                                   extra_nodes=False)
    logging.getLogger().setLevel(logging.WARNING)
    pack = comfy_host.load_pack()
    if args.per_call:
        return per_call_speed_ups(pack, args.arch)
    print(run.header("python -m toma_bench.stack_levers", argv, "CPU", f"ComfyUI tree {root.name}"))
    base = proxy.load(args.proxy)
    settings = dict(proxy=args.proxy.name, side=args.side, batch=args.batch, steps=args.steps, seed=SEED,
                    tree=root.name)
    cached = reference_of(args.reference, settings)
    reference = None if cached is None else proxy.latent_to_images(base, cached)
    variants = args.variants if reference is not None else [parse_variant("unpatched", args.arch.per_call)] + [
        v for v in args.variants if v.name != "unpatched"]  # unpatched first: every PSNR is against its pictures
    rows = []
    for v in variants:
        row, latent = measure(base, v, pack, args, reference)
        if reference is None:  # the unpatched run, first
            reference = proxy.latent_to_images(base, latent)
            if args.reference:
                torch.save({"settings": settings, "latent": latent}, args.reference)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(table(rows), run.footer(), sep="\n")
    if args.out:
        args.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
