"""GPU benchmark: step time, peak memory, merge overhead and host-device syncs of the pack's methods on
real-size SDXL and FLUX.1-dev architectures, in one command on an offline CUDA machine.

    python -m toma_bench.gpu [--budget-s 420] [--out DIR] [--repeats 5] [--models sdxl,flux] [--dry-run]

Run it through the kit (see docs/benchmarks.md): ``bash tests/device/prepare.sh`` here, then
``bash .device/run.sh`` on the GPU machine. Results go to ``DIR`` (default ``$OUT``, else
``./gpu-results``) as ``gpu_bench.md`` and ``gpu_bench.json``, rewritten after every measured run, so
what was measured survives a timeout.

What runs: bf16 weights, PyTorch SDPA attention, batch 1, random weights (nothing can be downloaded) at
the real sizes, sampled through ComfyUI's own sampler (euler), every variant patched by the pack's nodes:
- SDXL (full widths and depths) at 1024x1024 (128x128 latent), CFG 5, so each step is one UNet call on
  the cond and uncond rows: unpatched; ToMA at ratios 0.25/0.5/0.75 with levels auto (1/2) and auto+next
  (1/2 and 1/4) in scopes attention and block; ToMeSD at 0.5 on the 1/2 level.
- FLUX.1-dev (hidden 3072, 19 double + 38 single blocks) at 1024x1024 (4096 image tokens) with 512 text
  tokens, CFG 1: unpatched; ToMA at 0.25/0.5/0.75 on the double and single blocks (the adapter's
  default), and on the single blocks only.

Columns: ``step ms`` is the median over interleaved repeats of a run's model-call time divided by its
steps (so the steps that select destinations are amortised), timed with CUDA events around every model
call; ``speed-up`` is unpatched / variant; ``peak GiB`` is torch's peak allocated memory in the run;
``merge %`` is the share of the model-call time spent selecting destinations, merging and unmerging
(the runtime's CUDA-event stage clocks). Sync counts come from one extra run of some variants under
toma_bench.syncs.SyncCounter: the pack's calls that make the host wait for the GPU (reads of device
values, copies from the host), the most in one model call, and the copies among them over the run.

``--dry-run`` runs the same code on the CPU at tiny sizes (fp32), to check the kit without a GPU; its
numbers mean nothing. Only ComfyUI's core sampling modules are imported, never its nodes.py (which pulls
in PyAV and the API nodes): the kit stays small. A ComfyUI tree without Flux (the pinned March 2024 one)
skips Flux with a note.
"""
import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import comfy_host, models, sampling
from .tables import format_cell

DEFAULT_BUDGET_S = 420  # the kit must finish in 8 minutes on an H100/H200, installs and start-up included
SEED = 0
RATIOS = (0.25, 0.5, 0.75)
WINDOW, REUSE = 4, 5  # the ToMA node's defaults


@dataclass(frozen=True)
class Scale:
    """What one model is measured at."""

    config: dict
    dtype: torch.dtype
    latent: tuple[int, int]
    text_tokens: int
    steps: int
    cfg: float


def scales(dry_run: bool) -> dict[str, Scale]:
    if dry_run:
        sdxl_tiny = dict(models.SDXL_SMALL, model_channels=32, num_head_channels=16)
        return {"sdxl": Scale(sdxl_tiny, torch.float32, (16, 16), 77, 2, 5.0),
                "flux": Scale(models.FLUX_TINY, torch.float32, (16, 16), 16, 2, 1.0)}
    return {"sdxl": Scale(models.SDXL_FULL, torch.bfloat16, (128, 128), 77, 10, 5.0),
            "flux": Scale(models.FLUX_FULL, torch.bfloat16, (128, 128), 512, 6, 1.0)}


@dataclass(frozen=True)
class Variant:
    label: str
    patch: object  # base MODEL -> patched MODEL
    count_syncs: bool = False  # also measured under the SyncCounter


def sdxl_variants(pack) -> list[Variant]:
    tn = pack.nodes.toma_nodes
    out = [Variant("unpatched", lambda m: m)]
    for levels in ("auto", "auto+next"):
        for scope in ("attention", "block"):
            for r in RATIOS:
                out.append(Variant(f"ToMA r={r:g} {levels} {scope}",
                                   lambda m, r=r, levels=levels, scope=scope: tn.ToMAPatchModelAdvanced().patch(
                                       m, r, WINDOW, REUSE, scope=scope, levels=levels)[0],
                                   count_syncs=r == 0.5 and (levels, scope) in {("auto", "attention"),
                                                                               ("auto+next", "block")}))
    out.append(Variant("ToMeSD r=0.5 (1/2 level)", lambda m: tn.ToMeSDPatchModel().patch(m, 0.5, 2)[0],
                       count_syncs=True))
    return out


def without_double_blocks(m):
    """The patched Flux clone ``m`` with its double-block patches taken out: only single blocks merge."""
    replaced = m.model_options["transformer_options"]["patches_replace"]["dit"]
    for key in [k for k in replaced if k[0] == "double_block"]:
        del replaced[key]
    return m


def flux_variants(pack) -> list[Variant]:
    tn = pack.nodes.toma_nodes
    out = [Variant("unpatched", lambda m: m)]
    for r in RATIOS:
        out.append(Variant(f"ToMA r={r:g} double+single", lambda m, r=r: tn.ToMAPatchModel().patch(m, r, WINDOW, REUSE)[0],
                           count_syncs=r == 0.5))
    for r in RATIOS:
        out.append(Variant(f"ToMA r={r:g} single only",
                           lambda m, r=r: without_double_blocks(tn.ToMAPatchModel().patch(m, r, WINDOW, REUSE)[0])))
    return out


# -- timing ----------------------------------------------------------------------------------------
class CallClock:
    """Times every model call (CUDA events on CUDA, read after the run) and, while ``counter`` is set,
    numbers the calls for a SyncCounter. Its ``wrapper`` is a plain closure, because ComfyUI deep-copies
    model_options (and so any bound method in them) when it clones a patcher."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.calls = []
        self.counter = None
        clock = self

        def wrapper(apply_model, args):
            start = clock.stamp()
            if clock.counter is not None:
                out = clock.counter.model_wrapper(apply_model, args)
            else:
                out = apply_model(args["input"], args["timestep"], **args["c"])
            clock.calls.append((start, clock.stamp()))
            return out

        self.wrapper = wrapper

    def stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def take_seconds(self) -> float:
        """Seconds of the model calls since the last take (waits for the GPU)."""
        if self.cuda:
            torch.cuda.synchronize()
            total = sum(a.elapsed_time(b) for a, b in self.calls) / 1000.0
        else:
            total = sum(b - a for a, b in self.calls)
        self.calls = []
        return total


def merged_tokens(summary: dict | None) -> str:
    if not summary or not summary["levels"]:
        return "all"
    return ", ".join(f"{name.split(' (')[0]} {v['tokens']}->{v['merged_tokens']}" for name, v in summary["levels"].items())


@dataclass
class Row:
    label: str
    step_seconds: list = field(default_factory=list)  # one per run
    peak_bytes: int = 0
    merge_shares: list = field(default_factory=list)
    merged: str = "all"

    def as_dict(self, base: "Row | None") -> dict:
        step = statistics.median(self.step_seconds) if self.step_seconds else None
        base_step = statistics.median(base.step_seconds) if base and base.step_seconds else None
        return {"variant": self.label, "runs": len(self.step_seconds),
                "step_ms": None if step is None else 1000 * step,
                "speed_up": None if step is None or base_step is None else base_step / step,
                "peak_gib": self.peak_bytes / 2**30 if self.peak_bytes else None,
                "merge_percent": 100 * statistics.median(self.merge_shares) if self.merge_shares else None,
                "merged_tokens": self.merged, "step_ms_all": [1000 * s for s in self.step_seconds]}


# -- results -----------------------------------------------------------------------------------------
class Results:
    """Everything measured so far, written to ``out`` as JSON and Markdown after every change."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.meta, self.sections, self.syncs, self.notes = out, meta, {}, [], []
        out.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        data = {"meta": self.meta, "models": {name: {"setup": s["setup"],
                                                     "rows": [r.as_dict(s["rows"][0]) for r in s["rows"]]}
                                              for name, s in self.sections.items()},
                "syncs": self.syncs, "notes": self.notes}
        (self.out / "gpu_bench.json.tmp").write_text(json.dumps(data, indent=1))
        os.replace(self.out / "gpu_bench.json.tmp", self.out / "gpu_bench.json")
        (self.out / "gpu_bench.md.tmp").write_text(self.markdown(data))
        os.replace(self.out / "gpu_bench.md.tmp", self.out / "gpu_bench.md")

    @staticmethod
    def markdown(data: dict) -> str:
        meta = data["meta"]
        lines = ["# ToMA GPU benchmark", "",
                 f"- {meta['date']}; {meta['machine']}; torch {meta['torch']}; Python {meta['python']}",
                 f"- ComfyUI: {meta['comfyui']}; attention: PyTorch SDPA; batch 1; random weights",
                 f"- budget {meta['budget_s']:.0f} s; {'complete' if meta.get('complete') else 'PARTIAL (stopped by the budget or still running)'}"
                 + (f"; finished in {meta['elapsed_s']:.0f} s" if meta.get("elapsed_s") else ""),
                 ""]
        for name, section in data["models"].items():
            lines += [f"## {name}", "", section["setup"], "",
                      "| variant | step ms | speed-up | peak GiB | merge % | merged tokens | runs |",
                      "|---|---:|---:|---:|---:|---|---:|"]
            for r in section["rows"]:
                cells = [r["variant"], format_cell(r["step_ms"], "{:.1f}"), format_cell(r["speed_up"], "{:.2f}x"),
                         format_cell(r["peak_gib"], "{:.2f}"), format_cell(r["merge_percent"], "{:.1f}"),
                         r["merged_tokens"], r["runs"]]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
            lines.append("")
        if data["syncs"]:
            lines += ["## Host-device syncs (toma_bench.syncs, one run each)", "",
                      "| model | variant | model calls | pack host waits per model call (max) | of which copies to the "
                      "device | pack sites |", "|---|---|---:|---:|---:|---|"]
            for s in data["syncs"]:
                sites = "; ".join(f"{n}x {site}" for site, n in s["pack_sites"].items()) or "none"
                lines.append(f"| {s['model']} | {s['variant']} | {s['model_calls']} | {s['max_waits_per_call']} | "
                             f"{s['copies_in_calls']} | {sites} |")
            lines.append("")
        if data["notes"]:
            lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
        return "\n".join(lines)


# -- one model -------------------------------------------------------------------------------------------
def build(name: str, scale: Scale, cuda: bool):
    device = "cuda" if cuda else None
    if name == "sdxl":
        model = models.build_unet("sdxl", SEED, scale.dtype, scale.config, draw_device=device)
        conditioning = models.conditioning("sdxl", 1, scale.text_tokens, SEED, 8 * scale.latent[0], 8 * scale.latent[1])
        channels = 4
    else:
        model = models.build_flux(SEED, scale.dtype, scale.config, device=device, draw_device=device)
        conditioning = models.dit_conditioning("flux", scale.config, 1, scale.text_tokens, SEED)
        channels = 16
    latent = torch.zeros(1, channels, *scale.latent)
    return model, (conditioning, latent, sampling.seeded_noise(latent.shape, SEED))


def sample(model, scale: Scale, job) -> None:
    conditioning, latent, noise = job
    sampling.sample(model, conditioning, latent, steps=scale.steps, cfg=scale.cfg, scheduler="simple", seed=SEED,
                    noise=noise)


def runtime_summary(pack, model) -> dict | None:
    try:
        return pack.nodes.runtime.runtime_of(model).summary()
    except ValueError:  # unpatched
        return None


def measure_model(name, scale, variants, pack, results: Results, cuda: bool, repeats: int, deadline: float,
                  log) -> bool:
    """Measure ``variants`` of model ``name`` into ``results``; False if the deadline cut something short."""
    from .syncs import SyncCounter

    started = time.perf_counter()
    base, job = build(name, scale, cuda)
    clock = CallClock(cuda)
    base.set_model_unet_function_wrapper(clock.wrapper)
    patched = [(v, v.patch(base)) for v in variants]
    dm = base.model.diffusion_model
    h, w = scale.latent
    setup = (f"{type(base.model).__name__}, {sum(p.numel() for p in dm.parameters()) / 1e9:.2f}B parameters, "
             f"{str(scale.dtype).removeprefix('torch.')}; latent {h}x{w} ({8 * h}x{8 * w} px), "
             f"{scale.text_tokens} text tokens, {scale.steps} euler steps, cfg {scale.cfg:g}; window {WINDOW}, "
             f"reuse {REUSE}; built in {time.perf_counter() - started:.0f} s")
    rows = [Row(v.label) for v in variants]
    results.sections[name] = {"setup": setup, "rows": rows}
    results.write()
    log(f"[gpu] {name}: {setup}")
    with torch.inference_mode():
        for (v, m), row in zip(patched, rows):  # warm-up: loading, kernels, allocator, per-grid geometry
            if time.perf_counter() > deadline:
                results.notes.append(f"{name}: the budget ran out during the warm-up")
                results.write()
                return False
            sample(m, scale, job)
            clock.take_seconds()
        last_round, complete = 0.0, True
        for repeat in range(repeats):
            if time.perf_counter() + last_round > deadline:
                results.notes.append(f"{name}: {repeat} of {repeats} repeats fit the budget")
                complete = False
                break
            round_start = time.perf_counter()
            for (v, m), row in zip(patched, rows):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sample(m, scale, job)
                seconds = clock.take_seconds()
                row.step_seconds.append(seconds / scale.steps)
                if cuda:
                    row.peak_bytes = max(row.peak_bytes, torch.cuda.max_memory_allocated())
                summary = runtime_summary(pack, m)
                if summary is not None:
                    row.merged = merged_tokens(summary)
                    row.merge_shares.append(sum(summary["seconds"].values()) / seconds)
                results.write()
            last_round = time.perf_counter() - round_start
            log(f"[gpu] {name}: repeat {repeat + 1}/{repeats} in {last_round:.1f} s")
        for (v, m), row in zip(patched, rows):
            if not v.count_syncs:
                continue
            if time.perf_counter() + last_round / len(patched) * 3 > deadline:
                results.notes.append(f"{name}: no sync count for {v.label} (budget)")
                complete = False
                continue
            counter = SyncCounter(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
            clock.counter = counter
            try:
                with counter:
                    sample(m, scale, job)
            finally:
                clock.counter = None
                clock.take_seconds()
            inside = [e for e in counter.pack_events() if e.model_call is not None]
            results.syncs.append({
                "model": name, "variant": v.label, "model_calls": counter.model_calls,
                "max_waits_per_call": max(counter.per_model_call(inside).values(), default=0),
                "copies_in_calls": sum(e.what == "copy to device" for e in inside),
                "pack_sites": dict(Counter(f"{e.what} {e.op} at {e.site}" for e in counter.pack_events()).most_common(6)),
                "report": counter.report()})
            results.write()
            log(counter.report())
    return complete


def comfy_description(root: Path) -> str:
    commit = root / ".comfyui-commit"
    if commit.is_file():
        return f"{commit.read_text().strip()[:12]} ({root.name})"
    return f"tree at {root.name}" + ("" if comfy_host.has_flux(root) else " (March 2024, no Flux)")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help=f"wall-clock seconds for the whole run, model builds included (default {DEFAULT_BUDGET_S})")
    ap.add_argument("--out", default=None, help="results folder (default: $OUT, else ./gpu-results)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="interleaved runs of every variant, at most (default 5; 1 with --dry-run)")
    ap.add_argument("--models", default="sdxl,flux", help="comma list of sdxl, flux (default both)")
    ap.add_argument("--dry-run", action="store_true", help="tiny models on the CPU: checks the kit, measures nothing")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or not set(args.models) <= {"sdxl", "flux"}:
        ap.error(f"--models must be a comma list of sdxl, flux; got {','.join(args.models)!r}")
    args.repeats = args.repeats or (1 if args.dry_run else 5)
    if args.budget_s <= 0 or args.repeats < 1:
        ap.error("--budget-s must be > 0 and --repeats >= 1")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark needs a GPU (--dry-run checks it on the CPU)")
    args.out = Path(args.out or os.environ.get("OUT") or "gpu-results")
    return args



def log(line: str) -> None:
    print(line, flush=True)

def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    cuda = not args.dry_run
    root = comfy_host.import_core("cuda" if cuda else "cpu", require_flux=False)
    pack = comfy_host.load_pack()
    meta = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "machine": (f"{torch.cuda.get_device_name()}, {platform.node()}" if cuda
                        else f"CPU dry run (tiny models), {platform.node()}"),
            "torch": torch.__version__, "python": platform.python_version(), "comfyui": comfy_description(root),
            "budget_s": args.budget_s, "dry_run": args.dry_run, "complete": False}
    results = Results(args.out, meta)
    results.write()
    deadline = started + args.budget_s
    sizes = scales(args.dry_run)
    todo, complete = list(args.models), True
    if "flux" in todo and not comfy_host.has_flux(root):
        todo.remove("flux")
        results.notes.append(f"flux skipped: this ComfyUI tree ({root}) has no Flux (the pinned March 2024 tree); "
                             "prepare.sh packs the current one when its mirror is at hand")
    for i, name in enumerate(todo):
        # each model gets an equal share of what is left, so a slow first model cannot starve the second
        share = (deadline - time.perf_counter()) / (len(todo) - i)
        variants = sdxl_variants(pack) if name == "sdxl" else flux_variants(pack)
        complete &= measure_model(name, sizes[name], variants, pack, results, cuda, args.repeats,
                                  time.perf_counter() + share, log)
        import comfy.model_management

        comfy.model_management.unload_all_models()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    meta["complete"] = complete
    meta["elapsed_s"] = time.perf_counter() - started
    results.write()
    log((results.out / "gpu_bench.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
