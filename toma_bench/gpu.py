"""GPU benchmark: step time, peak memory, merge overhead and host-device syncs of the pack's methods on
real-size SDXL and FLUX.1-dev architectures, in one command on an offline CUDA machine.

    python -m toma_bench.gpu [--budget-s 420] [--out DIR] [--repeats 5] [--models sdxl,flux] [--hardware h200]
                             [--dry-run | --predict-only]

Run it through the kit (see docs/notebook.md, "GPU benchmark in one command"): ``bash toma_bench/gpu_kit/prepare.sh`` here, then
``bash .device/run.sh`` on the GPU machine. Results go to ``DIR`` (default ``$OUT``, else
``./gpu-results``) as ``gpu_bench.md`` and ``gpu_bench.json``, rewritten after every measured run, so
what was measured survives a timeout.

What runs: bf16 weights, PyTorch SDPA attention, batch 1, random weights (nothing can be downloaded) at
the real sizes, sampled through ComfyUI's own sampler (euler), every variant patched by the pack's nodes:
- SDXL (full widths and depths) at 1024x1024 (128x128 latent), CFG 5, so each step is one UNet call on
  the cond and uncond rows: unpatched; the node's default (its SDXL preset); ToMA at ratios 0.25/0.5/0.75
  with levels auto (1/2) and auto+next (1/2 and 1/4) in scopes attention and block, r=0.5 auto attention
  being the earlier default; the keys/values candidate (per-block plans, proportional attention, window
  8, r=0.75); ToMeSD at 0.5 on the 1/2 level.
- FLUX.1-dev (hidden 3072, 19 double + 38 single blocks) at 1024x1024 (4096 image tokens) with 512 text
  tokens, CFG 1: unpatched; the node's default (its image-DiT preset); ToMA at 0.25/0.5/0.75 on the
  double and single blocks (r=0.5 the earlier default), and on the single blocks only.

First, before anything is measured, the cost model (toma_bench.costmodel) records every variant on the
meta device exactly as it will run here and writes its predictions, eager and compiled (the regimes of
toma_bench.gpuclock; "compiled" is inductor with mode None, the host launching every fused kernel, as the
compile pass below runs it; profile from the GPU's name, else h200; ``--hardware`` chooses). ``--predict-only`` stops there (no GPU needed: docs/notebook.md keeps
the kit's predictions, made before any GPU run). After the timed runs, one run of the unpatched model
and of the node's default under torch.profiler gives kernels per model call, device time per op class
and host time per aten op; the profile's free parameters (each op class's efficiency, host microseconds
per op) are fitted on the unpatched run alone, and every merged variant is predicted again with them:
``error %`` is that out-of-sample prediction against the measured speed-up.

Columns: ``step ms`` is the median over interleaved repeats of a run's model-call time divided by its
steps (so the steps that select destinations are amortised), timed with CUDA events around every model
call; ``speed-up`` is unpatched / variant; ``peak GiB`` is torch's peak allocated memory in the run;
``merge %`` is the share of the model-call time spent selecting destinations, merging and unmerging
(the runtime's CUDA-event stage clocks). Sync counts come from one extra run of some variants under
toma_bench.syncs.SyncCounter: the pack's calls that make the host wait for the GPU (reads of device
values, copies from the host), the most in one model call, and the copies among them over the run.

The host pass, before the variants: unpatched SD1.5 (512x512) and SDXL (1024x1024), CFG batch 2, their
diffusion model called directly, eager and replayed from a CUDA graph; with the kernels and views the cost
model records for one call, eager against replayed pins the host's microseconds per kernel-launching op
(the clock's least known number: 25 assumed on a datacenter host). The compile pass, after them, while
the budget lasts: unpatched and the node's default under ComfyUI's own TorchCompileModel code path
(comfy_api.torch_helpers.set_torch_compile_wrapper, inductor), next to the same two eager, with
dynamo's graph and graph-break counts.

``--dry-run`` runs the same code on the CPU at tiny sizes (fp32; no CUDA graph, the compile pass with
dynamo's "eager" backend), to check the kit without a GPU; its numbers mean nothing. Only ComfyUI's core sampling modules are imported, never its nodes.py (which pulls
in PyAV and the API nodes): the kit stays small. A ComfyUI tree without Flux (the pinned March 2024 one)
skips Flux with a note.
"""
import argparse
import dataclasses
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

from . import comfy_host, costmodel, gpuclock, models, run, sampling
from .tables import format_cell

DEFAULT_BUDGET_S = 420  # the kit must finish in 8 minutes on an H100/H200, installs and start-up included
SEED = 0
RATIOS = (0.25, 0.5, 0.75)
WINDOW, REUSE = 4, 5  # of the rows that name the settings (the node's defaults before the presets)


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
class Variant(run.Variant):
    count_syncs: bool = False  # also measured under the SyncCounter
    profiled: bool = False  # also run once under torch.profiler (the node's default; unpatched always is)


def node_default(tn, family: str) -> Variant:
    """The basic ToMA node with its default inputs (the kind's preset, nodes/placement.PRESETS)."""
    return Variant(f"ToMA node default (r=auto, {family} preset)",
                   patch=lambda m: tn.ToMAPatchModel().patch(m, tn.DEFAULT_RATIO, tn.DEFAULT_WINDOW, tn.DEFAULT_REUSE)[0],
                   count_syncs=True, profiled=True)


def sdxl_variants(pack) -> list[Variant]:
    tn = pack.nodes.toma_nodes
    out = [Variant("unpatched", patch=lambda m: m), node_default(tn, "SDXL")]
    for levels in ("auto", "auto+next"):
        for scope in ("attention", "block"):
            for r in RATIOS:
                old = " (the earlier default)" if (r, levels, scope) == (0.5, "auto", "attention") else ""
                out.append(Variant(f"ToMA r={r:g} {levels} {scope}{old}",
                                   patch=lambda m, r=r, levels=levels, scope=scope: tn.ToMAPatchModelAdvanced().patch(
                                       m, r, WINDOW, REUSE, scope=scope, levels=levels)[0],
                                   count_syncs=r == 0.5 and (levels, scope) in {("auto", "attention"),
                                                                               ("auto+next", "block")}))
    # the fidelity fixes' best setting on the SD1.x proxy (docs/notebook.md, "SD1.x-layout proxy: placements"), as a candidate
    out.append(Variant("ToMA r=0.75 keys/values per block proportional window 8",
                       patch=lambda m: tn.ToMAPatchModelAdvanced().patch(m, 0.75, 8, REUSE, scope="keys/values",
                                                                   plan_per_block=True,
                                                                   proportional_attention=True)[0]))
    out.append(Variant("ToMeSD r=0.5 (1/2 level)", patch=lambda m: tn.ToMeSDPatchModel().patch(m, 0.5, 2)[0],
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
    out = [Variant("unpatched", patch=lambda m: m), node_default(tn, "image DiT")]
    for r in RATIOS:
        old = " (the earlier default)" if r == 0.5 else ""
        out.append(Variant(f"ToMA r={r:g} double+single{old}",
                           patch=lambda m, r=r: tn.ToMAPatchModelAdvanced().patch(m, r, WINDOW, REUSE, scope="block")[0],
                           count_syncs=r == 0.5))
    for r in RATIOS:
        out.append(Variant(f"ToMA r={r:g} single only", patch=lambda m, r=r: without_double_blocks(
            tn.ToMAPatchModelAdvanced().patch(m, r, WINDOW, REUSE, scope="block")[0])))
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
        # model -> label -> the cost model's {"ms", "speed_up", "classes"}, written before any measurement
        self.predictions: dict = {}
        self.profiles: dict = {}  # model -> variant -> profile_pass()
        self.host: dict = {}  # model -> host_pass()
        self.compiled: dict = {}  # model -> compile_pass()
        self.fits: dict = {}  # model -> {"parameters", "rows": label -> fitted prediction}
        out.mkdir(parents=True, exist_ok=True)

    def write(self) -> None:
        data = {"meta": self.meta, "predictions": self.predictions,
                "models": {name: {"setup": s["setup"], "rows": [r.as_dict(s["rows"][0]) for r in s["rows"]]}
                           for name, s in self.sections.items()},
                "profiles": self.profiles, "fits": self.fits, "syncs": self.syncs, "host": self.host,
                "compiled": self.compiled, "notes": self.notes}
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
        for name in dict.fromkeys(list(data["predictions"]) + list(data["models"])):
            section = data["models"].get(name, {"setup": "not measured yet", "rows": []})
            predicted = data["predictions"].get(name, {})
            fitted = data["fits"].get(name, {}).get("rows", {})
            measured = {r["variant"]: r for r in section["rows"]}
            lines += [f"## {name}", "", section["setup"], "",
                      f"Predicted: the cost model on the {meta.get('hardware', '?')} profile, written before measuring; "
                      "fitted: the same with its free parameters fitted on the unpatched run's profiler pass; "
                      "error: fitted against measured speed-up (out of sample for every merged variant).", "",
                      "| variant | predicted ms | predicted speed-up | predicted compiled | step ms | speed-up "
                      "| fitted speed-up | error % | peak GiB | merge % | merged tokens | runs |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
            for label in dict.fromkeys(list(predicted) + list(measured)):
                p, r, f = predicted.get(label, {}), measured.get(label, {}), fitted.get(label, {})
                error = (100 * (f["speed_up"] / r["speed_up"] - 1)
                         if f.get("speed_up") and r.get("speed_up") else None)
                compiled = p.get("regimes", {}).get("compiled", {}).get("speed_up")
                cells = [label, format_cell(p.get("ms"), "{:.1f}"), format_cell(p.get("speed_up"), "{:.2f}x"),
                         format_cell(compiled, "{:.2f}x"), format_cell(r.get("step_ms"), "{:.1f}"), format_cell(r.get("speed_up"), "{:.2f}x"),
                         format_cell(f.get("speed_up"), "{:.2f}x"), format_cell(error, "{:+.1f}"),
                         format_cell(r.get("peak_gib"), "{:.2f}"), format_cell(r.get("merge_percent"), "{:.1f}"),
                         r.get("merged_tokens", "-"), r.get("runs", 0)]
                lines.append("| " + " | ".join(map(str, cells)) + " |")
            lines.append("")
            for variant, prof in data["profiles"].get(name, {}).items():
                classes = ", ".join(f"{k} {v:.2f}" for k, v in sorted(prof["device_ms_per_step"].items()))
                lines.append(f"- profiler, {variant}: {prof['kernels_per_call']:.0f} kernels and "
                             f"{prof['aten_ops_per_call']:.0f} aten ops per model call; host {prof['host_ms_per_call']:.1f} "
                             f"ms per call ({prof['host_us_per_op']:.1f} us per op); device ms per step: {classes}")
            if name in data["fits"]:
                params = ", ".join(f"{k} x{v:.2f}" if k != "host_us_per_kernel" else f"{k} = {v:.1f}"
                                   for k, v in data["fits"][name]["parameters"].items())
                lines.append(f"- fitted on the unpatched run: {params}")
            lines.append("")
        if data["host"]:
            lines += ["## The host's cost per op (unpatched, diffusion model called directly)", "",
                      "| model | kernels per call | views per call | eager ms per call | graph-replayed ms per call "
                      "| eager / replayed | host us per kernel (views at 1/5 of it) |", "|---|---:|---:|---:|---:|---:|---|"]
            for name, h in data["host"].items():
                ratio = h["eager_ms"] / h["graph_ms"] if h.get("graph_ms") else None
                lines.append(f"| {name} | {h['kernels_per_call']} | {h['views_per_call']} | {h['eager_ms']:.2f} | "
                             f"{format_cell(h.get('graph_ms'), '{:.2f}')} | {format_cell(ratio, '{:.2f}x')} | "
                             f"{h['host_us_per_kernel']:.1f} ({h['bound']}) |")
            lines.append("")
        if data["compiled"]:
            lines += ["## Under torch.compile (ComfyUI's TorchCompileModel path) next to eager", "",
                      "| model | variant | eager step ms | compiled step ms | eager speed-up | compiled speed-up "
                      "| predicted compiled | graphs | graph breaks |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
            for name, c in data["compiled"].items():
                rows = c["rows"]
                for r in rows:
                    lines.append(f"| {name} | {r['variant']} | {r['eager_ms']:.1f} | {r['compiled_ms']:.1f} | "
                                 f"{rows[0]['eager_ms'] / r['eager_ms']:.2f}x | {rows[0]['compiled_ms'] / r['compiled_ms']:.2f}x | "
                                 f"{format_cell(r.get('predicted_compiled'), '{:.2f}x')} | {r['graphs']} | {r['graph_breaks']} |")
                lines.append(f"- {c['setup']}")
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


# -- the profiler pass and the fit -------------------------------------------------------------------------
KERNEL_CLASSES = (("attention", ("flash", "fmha", "attention", "attn")),
                  ("conv", ("conv", "fprop", "dgrad", "wgrad")),
                  ("gemm", ("gemm", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                            "aten::linear", "aten::matmul")),
                  ("copy", ("copy", "cat", "index", "gather", "scatter", "fill", "memcpy", "memset")))


def kernel_class(name: str) -> str:
    """The cost model's op class of a kernel (CUDA) or top-level aten op (CPU dry run), from its name."""
    lowered = name.lower()
    for cls, marks in KERNEL_CLASSES:
        if any(mark in lowered for mark in marks):
            return cls
    return "elementwise"


def profile_pass(model, scale: Scale, job, cuda: bool) -> dict:
    """One sampling run under torch.profiler: kernels per model call, device milliseconds per op class
    and per step, aten ops the host issued per model call and host microseconds per op (the CPU time of
    the model calls' ranges over their aten ops: an upper bound where a full launch queue made the host
    wait)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    calls = []

    def wrapper(apply_model, args):
        with record_function("toma_bench.model_call"):
            calls.append(1)
            return apply_model(args["input"], args["timestep"], **args["c"])

    probed = model.clone()
    probed.set_model_unet_function_wrapper(wrapper)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sample(probed, scale, job)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    ranges = [e for e in events if e.name == "toma_bench.model_call" and e.device_type.name == "CPU"]
    inside = lambda e: any(r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end
                           for r in ranges)
    top_aten = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("aten::") and inside(e)
                and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    if cuda:
        kernels = [(e.name, e.device_time_total) for e in events if e.device_type.name == "CUDA"]
    else:
        kernels = [(e.name, e.cpu_time_total) for e in top_aten]
    per_class = {}
    for name, us in kernels:
        per_class[kernel_class(name)] = per_class.get(kernel_class(name), 0.0) + us / 1000.0 / scale.steps
    host_us = sum(r.cpu_time_total for r in ranges)
    n_calls = max(1, len(calls))
    return {"model_calls": len(calls), "kernels_per_call": len(kernels) / n_calls,
            "device_ms_per_step": per_class, "aten_ops_per_call": len(top_aten) / n_calls,
            "host_ms_per_call": host_us / 1000.0 / n_calls,
            "host_us_per_op": host_us / max(1, len(top_aten))}


def fitted_profile(hw: gpuclock.Hardware, predicted_classes: dict, measured: dict) -> tuple:
    """``hw`` with its free parameters fitted on the unpatched run's profiler pass: each efficiency
    scaled by predicted / measured device time of its op class, the host's microseconds per kernel
    from the measured host time per aten op. Returns (profile, {parameter: factor or value})."""
    measured_classes = measured["device_ms_per_step"]

    def factor(*classes):
        p = sum(predicted_classes.get(c, 0.0) for c in classes)
        m = sum(measured_classes.get(c, 0.0) for c in classes)
        return p / m if p > 0 and m > 0 else 1.0

    changes = {"gemm_eff": factor("gemm"), "conv_eff": factor("conv"), "attention_eff": factor("attention"),
               "bandwidth_eff": factor("elementwise", "copy")}
    fitted = {k: min(0.99, getattr(hw, k) * f) for k, f in changes.items()}
    fitted["attention_masked_eff"] = min(0.99, hw.attention_masked_eff * changes["attention_eff"])
    fitted["host_us_per_kernel"] = measured["host_us_per_op"]
    return dataclasses.replace(hw, name=hw.name + " (fitted)", **fitted), dict(changes, host_us_per_kernel=measured["host_us_per_op"])


PREDICTED_REGIMES = ("eager", "compiled")  # what the timed runs and the compile pass measure


def priced_rows(recorded, hw, regimes=PREDICTED_REGIMES) -> dict:
    """label -> (ms per step, speed-up, device ms per op class per step) of the recordings on ``hw`` in the
    first of ``regimes``, and ms and speed-up in each of them ("regimes")."""
    priced = {regime: costmodel.price(recorded, hw, "pipelined", sweep=False, regime=regime) for regime in regimes}
    first = priced[regimes[0]]
    return {r.label: {"ms": r.ms_per_step, "speed_up": r.speed_up, "classes": r.class_ms,
                      "regimes": {g: {"ms": priced[g][i].ms_per_step, "speed_up": priced[g][i].speed_up}
                                  for g in regimes}}
            for i, r in enumerate(first)}


# -- one model -------------------------------------------------------------------------------------------
def conditioning(name: str, scale: Scale):
    if name == "sdxl":
        return models.conditioning("sdxl", 1, scale.text_tokens, SEED, 8 * scale.latent[0], 8 * scale.latent[1])
    return models.dit_conditioning("flux", scale.config, 1, scale.text_tokens, SEED)


CHANNELS = {"sdxl": 4, "flux": 16}
MODEL_CONFIGS = {"sdxl": "SDXL", "flux": "Flux"}  # comfy.supported_models


def build(name: str, scale: Scale, cuda: bool):
    device = "cuda" if cuda else None
    if name == "sdxl":
        model = models.build_unet("sdxl", SEED, scale.dtype, scale.config, draw_device=device)
    else:
        model = models.build_flux(SEED, scale.dtype, scale.config, device=device, draw_device=device)
    latent = torch.zeros(1, CHANNELS[name], *scale.latent)
    return model, (conditioning(name, scale), latent, sampling.seeded_noise(latent.shape, SEED))


# -- the cost model's predictions, written before anything is measured ------------------------------------
def hardware_for(device_name: str) -> str:
    """The cost model's profile for a GPU name (h200 where none matches: the kit's target)."""
    lowered = device_name.lower().replace(" ", "")
    for key in ("h200", "h100", "a100", "l40s", "rtx4090", "rtx3090"):
        if key.removeprefix("rtx") in lowered:
            return key
    return "h200"


def spec_of(name: str, scale: Scale):
    """The cost model's Spec of what this benchmark runs for ``name``: the same config, latent, text,
    steps and CFG (bf16 on meta, whatever dtype the run uses)."""
    return costmodel.Spec(name, name, MODEL_CONFIGS[name], scale.config, (1, CHANNELS[name], *scale.latent),
                          lambda: conditioning(name, scale), scale.steps, scale.cfg, unet=name == "sdxl")


def predict(name: str, scale: Scale, variants, pack, log) -> list:
    """The cost model's recordings of ``variants`` of ``name`` as this benchmark runs them (priced by
    priced_rows)."""
    return costmodel.record_model(spec_of(name, scale), pack, scale.steps,
                                  [costmodel.Variant(v.label, patch=v.patch) for v in variants], progress=log,
                                  traced=True)


def sample(model, scale: Scale, job) -> None:
    conditioning, latent, noise = job
    sampling.sample(model, conditioning, latent, steps=scale.steps, cfg=scale.cfg, scheduler="simple", seed=SEED,
                    noise=noise)


def measure_model(name, scale, variants, pack, results: Results, cuda: bool, repeats: int, deadline: float,
                  log, recorded=None, hw=None) -> bool:
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
            for i in run.rotated(len(patched), repeat):
                (v, m), row = patched[i], rows[i]
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sample(m, scale, job)
                seconds = clock.take_seconds()
                row.step_seconds.append(seconds / scale.steps)
                if cuda:
                    row.peak_bytes = max(row.peak_bytes, torch.cuda.max_memory_allocated())
                runtime = run.runtime_of(pack, m)
                if runtime is not None:
                    summary = runtime.summary()
                    row.merged = run.merged_tokens(summary)
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
        profiles = results.profiles.setdefault(name, {})
        for (v, m), row in zip(patched, rows):
            if v.label != "unpatched" and not v.profiled:
                continue
            if time.perf_counter() + last_round / len(patched) * 3 > deadline:
                results.notes.append(f"{name}: no profiler pass for {v.label} (budget)")
                complete = False
                continue
            profiles[v.label] = profile_pass(m, scale, job, cuda)
            results.write()
        if recorded is not None and "unpatched" in profiles:
            predicted = results.predictions[name]["unpatched"]["classes"]
            fitted, parameters = fitted_profile(hw, predicted, profiles["unpatched"])
            results.fits[name] = {"parameters": parameters, "rows": priced_rows(recorded, fitted)}
            results.write()
    return complete


# -- the host pass: eager against a CUDA graph's replay ----------------------------------------------------
HOST_CONFIGS = {"sd15": ("SD15", models.SD15_FULL, 64, 768), "sdxl": ("SDXL", models.SDXL_FULL, 128, 2048)}
HOST_VIEW_SHARE = 0.2  # a view's host time against a kernel's, as the cost model's profiles have it


def host_inputs(name: str, side: int, context_dim: int, dtype, device, adm: int = 0) -> dict:
    """The diffusion model's inputs of one CFG-batched call (cond and uncond), seeded."""
    g = torch.Generator().manual_seed(SEED)
    out = {"x": torch.randn(2, 4, side, side, generator=g), "timesteps": torch.full((2,), 500.0),
           "context": torch.randn(2, 77, context_dim, generator=g)}
    if adm:
        out["y"] = torch.randn(2, adm, generator=g)
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() and k != "timesteps" else v.dtype)
            for k, v in out.items()}


def host_pass(name: str, dry_run: bool, cuda: bool, calls: int, log) -> dict:
    """Unpatched ``name`` ("sd15" or "sdxl"): its diffusion model called ``calls`` times eager and, on CUDA,
    replayed as often from a CUDA graph; the kernels and views of one call from the cost model's recording of
    the same call on the meta device. Host-bound where eager takes longer than the replay: then eager time
    / (kernels + views at HOST_VIEW_SHARE) is the host's microseconds per kernel-launching op."""
    from .oprecord import recording, to_meta

    model_config, config, side, context_dim = HOST_CONFIGS[name]
    if dry_run:
        config = (dict(models.SDXL_SMALL, model_channels=32, num_head_channels=16) if name == "sdxl"
                  else dict(models.SD15_FULL, model_channels=32, num_heads=4))
        side = 16
    dtype = torch.bfloat16 if cuda else torch.float32
    device = torch.device("cuda" if cuda else "cpu")
    model = models.build_unet(name, SEED, dtype, config, draw_device=device if cuda else None)
    dm = model.model.diffusion_model.to(device)
    adm = config.get("adm_in_channels") or 0
    inputs = host_inputs(name, side, context_dim, dtype, device, adm)

    def timed(fn) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - start) / calls

    with torch.inference_mode():
        eager_ms = timed(lambda: dm(**inputs))
        graph_ms, note = None, "no CUDA: no graph replay"
        if cuda:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        dm(**inputs)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    dm(**inputs)
                graph_ms, note = timed(graph.replay), "graph replayed"
            except Exception as e:  # a capture that fails says why in the results
                note = f"CUDA graph capture failed: {type(e).__name__}: {e}"
        spec = costmodel.Spec(name, name, model_config, config, (1, 4, side, side), lambda: None, unet=True)
        meta = costmodel.build_meta(spec).model.diffusion_model
        with recording() as rec, rec.model_call():
            # the meta model is bf16 (costmodel.DTYPE), whatever dtype the timed run used
            meta(**{k: to_meta(v.cpu()).to(costmodel.DTYPE) if v.is_floating_point() and k != "timesteps"
                    else to_meta(v.cpu()) for k, v in inputs.items()})
    ops = rec.calls[0]
    kernels, views = sum(op.kernel for op in ops), sum(not op.kernel for op in ops)
    bound = "host-bound" if graph_ms and eager_ms > 1.1 * graph_ms else "not host-bound: a bound from below"
    result = {"kernels_per_call": kernels, "views_per_call": views, "eager_ms": eager_ms, "graph_ms": graph_ms,
              "host_us_per_kernel": 1000 * eager_ms / (kernels + HOST_VIEW_SHARE * views), "bound": bound,
              "note": note, "calls": calls}
    log(f"[gpu] host pass {name}: {kernels} kernels, {views} views a call; eager {eager_ms:.2f} ms, "
        f"{note}{'' if graph_ms is None else f' {graph_ms:.2f} ms'}")
    del dm, model
    return result


# -- the compile pass: ComfyUI's TorchCompileModel path next to eager ---------------------------------------
def compiled_clone(model, backend: str):
    """A clone of ``model`` compiled as ComfyUI's TorchCompileModel node compiles it, or None where this
    ComfyUI tree has no such path (feature-detected)."""
    try:
        from comfy_api.torch_helpers import set_torch_compile_wrapper
    except ImportError:
        return None
    clone = model.clone()
    set_torch_compile_wrapper(clone, backend=backend)
    return clone


def compile_pass(name, scale, variants, pack, cuda: bool, repeats: int, deadline: float, predicted: dict,
                 log) -> dict | None:
    """Unpatched and the node's default of ``name``, eager and compiled (inductor on CUDA, dynamo's "eager"
    backend in a dry run): median step ms over interleaved runs after one warm-up each (the compile), with
    dynamo's unique graphs and graph breaks of each compiled variant. None where the tree has no
    TorchCompileModel path."""
    import torch._dynamo

    backend = "inductor" if cuda else "eager"
    base, job = build(name, scale, cuda)
    clock = CallClock(cuda)
    base.set_model_unet_function_wrapper(clock.wrapper)
    chosen = [v for v in variants if v.label == "unpatched" or v.profiled]
    rows, runs = [], []
    for v in chosen:
        eager = v.patch(base)
        compiled = compiled_clone(eager, backend)
        if compiled is None:
            return None
        runs.append((v, eager, compiled))
    with torch.inference_mode():
        counts = {}
        for v, eager, compiled in runs:  # warm-up: the compile, the graphs it makes, their breaks
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            sample(compiled, scale, job)
            counters = torch._dynamo.utils.counters
            counts[v.label] = (int(counters["stats"]["unique_graphs"]), sum(counters["graph_break"].values()))
            sample(eager, scale, job)
            clock.take_seconds()
        times = {v.label: ([], []) for v, _, _ in runs}
        for repeat in range(repeats):
            if time.perf_counter() > deadline:
                break
            for v, eager, compiled in runs:
                for k, m in enumerate((eager, compiled)):
                    sample(m, scale, job)
                    times[v.label][k].append(clock.take_seconds() / scale.steps)
    for v, _, _ in runs:
        eager_s, compiled_s = times[v.label]
        if not eager_s:
            return None
        rows.append({"variant": v.label, "eager_ms": 1000 * statistics.median(eager_s),
                     "compiled_ms": 1000 * statistics.median(compiled_s), "runs": len(eager_s),
                     "graphs": counts[v.label][0], "graph_breaks": counts[v.label][1],
                     "predicted_compiled": predicted.get(v.label, {}).get("regimes", {}).get("compiled", {}).get("speed_up")})
    setup = (f"backend {backend} through comfy_api.torch_helpers.set_torch_compile_wrapper; "
             f"{rows[0]['runs']} interleaved runs after one warm-up (the compile)")
    log(f"[gpu] compile pass {name}: " + "; ".join(f"{r['variant']} eager {r['eager_ms']:.1f} ms, compiled "
                                                    f"{r['compiled_ms']:.1f} ms, {r['graphs']} graphs, "
                                                    f"{r['graph_breaks']} breaks" for r in rows))
    return {"setup": setup, "rows": rows}


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
    ap.add_argument("--predict-only", action="store_true",
                    help="write the cost model's predictions for the variants and stop (no GPU needed)")
    ap.add_argument("--hardware", default=None,
                    help="the cost model's profile for the predictions (default: from the GPU's name, else h200)")
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or not set(args.models) <= {"sdxl", "flux"}:
        ap.error(f"--models must be a comma list of sdxl, flux; got {','.join(args.models)!r}")
    args.repeats = args.repeats or (1 if args.dry_run else 5)
    if args.budget_s <= 0 or args.repeats < 1:
        ap.error("--budget-s must be > 0 and --repeats >= 1")
    if not args.dry_run and not args.predict_only and not torch.cuda.is_available():
        ap.error("no CUDA device: this benchmark needs a GPU (--dry-run checks it on the CPU)")
    args.out = Path(args.out or os.environ.get("OUT") or "gpu-results")
    return args



def log(line: str) -> None:
    print(line, flush=True)

def main(argv=None) -> None:
    started = time.perf_counter()
    args = parse_args(argv)
    cuda = not args.dry_run and not args.predict_only
    root = comfy_host.import_core("cuda" if cuda else "cpu", require_flux=False)
    pack = comfy_host.load_pack()
    meta = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "machine": (f"{torch.cuda.get_device_name()}, {platform.node()}" if cuda
                        else "predictions only (no GPU)" if args.predict_only
                        else f"CPU dry run (tiny models), {platform.node()}"),
            "torch": torch.__version__, "python": platform.python_version(), "comfyui": comfy_description(root),
            "budget_s": args.budget_s, "dry_run": args.dry_run, "complete": False}
    hw = gpuclock.profile(args.hardware or hardware_for(torch.cuda.get_device_name() if cuda else "h200"))
    meta["hardware"] = hw.name
    results = Results(args.out, meta)
    results.write()
    deadline = started + args.budget_s
    sizes = scales(args.dry_run)
    todo, complete = list(args.models), True
    if "flux" in todo and not comfy_host.has_flux(root):
        todo.remove("flux")
        results.notes.append(f"flux skipped: this ComfyUI tree ({root}) has no Flux (the pinned March 2024 tree); "
                             "prepare.sh packs the current one when its mirror is at hand")
    variants = {name: sdxl_variants(pack) if name == "sdxl" else flux_variants(pack) for name in todo}
    recordings = {}
    for name in todo:  # every prediction is written before anything is measured
        recordings[name] = predict(name, sizes[name], variants[name], pack, log)
        results.predictions[name] = priced_rows(recordings[name], hw)
        results.write()
    if args.predict_only:
        meta["complete"] = True
        results.write()
        log((results.out / "gpu_bench.md").read_text())
        return
    for name in HOST_CONFIGS:  # the host's cost per op first: seconds, and what the clock needs most
        results.host[name] = host_pass(name, args.dry_run, cuda, 3 if args.dry_run else 20, log)
        results.write()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    # the variants get all but the compile pass's share: a compile of each model and its timed runs
    compile_share = 0.0 if args.dry_run else min(150.0, 0.3 * (deadline - time.perf_counter()))
    variants_deadline = deadline - compile_share
    for i, name in enumerate(todo):
        # each model gets an equal share of what is left, so a slow first model cannot starve the second
        share = (variants_deadline - time.perf_counter()) / (len(todo) - i)
        complete &= measure_model(name, sizes[name], variants[name], pack, results, cuda, args.repeats,
                                  time.perf_counter() + share, log, recordings[name], hw)
        import comfy.model_management

        comfy.model_management.unload_all_models()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    for i, name in enumerate(todo):
        share = (deadline - time.perf_counter()) / (len(todo) - i)
        if share < (5.0 if args.dry_run else 40.0):
            results.notes.append(f"{name}: no compile pass (budget)")
            complete = False
            continue
        compiled = compile_pass(name, sizes[name], variants[name], pack, cuda, args.repeats,
                                time.perf_counter() + share, results.predictions[name], log)
        if compiled is None:
            results.notes.append(f"{name}: no compile pass (this ComfyUI tree has no comfy_api.torch_helpers, or "
                                 "no run fit the budget)")
        else:
            results.compiled[name] = compiled
        results.write()
    meta["complete"] = complete
    meta["elapsed_s"] = time.perf_counter() - started
    results.write()
    log((results.out / "gpu_bench.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
