"""UNet speed benchmark: ToMA, ToMeSD, CA-ToMe and ComfyUI's TomePatchModel at SD1.5 and SDXL widths, side by side.

    python -m toma_bench [--arch sd15,sdxl] [--device cpu|cuda] [--steps N] [--repeats R]
                         [--ratios 0.25,0.5,0.75] [--thresholds 0.7] [--threads T] [--quick]

Speed only. The UNets have random weights (toma_bench.models), so how far a merge moves their output
says nothing about pictures; fidelity is measured on the trained proxies by ``python -m
toma_bench.curves``, and this benchmark gives the speed at real widths beside it.

Every variant is a MODEL patched by its node (the pack's nodes; ComfyUI's own ``TomePatchModel``) from one
random-weight UNet, and runs the same short img2img job through ``comfy.sample.sample``: a structured
latent, seeded noise, euler, CFG (one model call per step on a batch of 2: cond and uncond). A
``model_function_wrapper`` installed before patching records every model call of that run (the
sampling pass, which also warms up). The timing pass then replays the recorded calls (``apply_model``, with a device
synchronize on CUDA) ``--repeats`` times, call by call across the variants (step 0 of every variant,
then step 1, ...), so a slow spell of a shared machine hits every variant alike; a step's time is the
UNet forward alone, merging included, without the sampler's bookkeeping. Per repeat, time per step =
forward time / steps, which amortises the steps that select destinations.

Columns: ``cpu speedup``: median over repeats of unpatched / variant process CPU time, which a shared
machine's other jobs do not inflate (rank by it on a CPU; use one thread there: a descheduled OpenMP
thread stalls the others); ``spread``: the lowest and highest of those per-repeat ratios; ``speedup``:
the same from wall time (the one that counts on CUDA); ``ms/step``, ``cpu ms``: median wall and CPU
time per step; ``merge cost``: the runtime's own select + merge + unmerge clocks in % of the wall time
(``sel/mrg/unm``: each of them); ``removed``: tokens removed at the merged levels.
"""
import argparse
import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch

from . import comfy_host, models, run, sampling
from .run import Variant, comfy_tome
from .tables import format_cell, format_table

SAMPLER, SCHEDULER, CFG, DENOISE = "euler", "normal", 5.0, 0.6
LATENT_SIDE = {"sd15": 64, "sdxl": 128}  # 512x512 and 1024x1024 images
SEED = 0

# (device, mode, arch) -> (steps, timing passes, ratios). CPU runs are sized for a 2-core machine: a
# SD15_SMALL step at 512x512 costs about 5 s there, an SDXL_SMALL step at 1024x1024 about 25 s, and a run
# costs (1 sampling pass + timing passes) x variants x steps of those (less the merged variants' savings):
# sd15 full (10 variants) about 10 min, quick (6) about 4 min; sdxl full (6) about 15 min, quick about 7 min.
DEFAULTS = {
    ("cpu", "full", "sd15"): (3, 3, "0.25,0.5,0.75"),
    ("cpu", "full", "sdxl"): (2, 2, "0.5"),
    ("cpu", "quick", "sd15"): (2, 3, "0.5"),
    ("cpu", "quick", "sdxl"): (1, 2, "0.5"),
    ("cuda", "full", "sd15"): (20, 3, "0.25,0.5,0.75"),
    ("cuda", "full", "sdxl"): (20, 3, "0.25,0.5,0.75"),
    ("cuda", "quick", "sd15"): (10, 3, "0.5"),
    ("cuda", "quick", "sdxl"): (10, 3, "0.5"),
}


# -- setup --------------------------------------------------------------------------------------------
def import_host(device: str, sdpa: bool):
    """ComfyUI (attention backend fixed for the process) and the pack."""
    comfy_host.import_comfy(pytorch_attention=sdpa, cpu=device == "cpu", extra_nodes=False)
    return comfy_host.load_pack()


@dataclass(frozen=True)
class Job:
    """The img2img job every variant of one architecture runs."""

    arch: str
    config_name: str
    latent: torch.Tensor  # (1, 4, s, s) structured latent
    noise: torch.Tensor  # (1, 4, s, s)
    positive: list
    negative: list
    steps: int
    device: str  # "cpu" or "cuda": where ComfyUI runs the model


def make_job(arch: str, config_name: str, steps: int, device: str) -> Job:
    side = LATENT_SIDE[arch]
    latent = models.structured_latent(1, side, side, seed=SEED)
    noise = sampling.seeded_noise(latent.shape, SEED + 1)
    positive, negative = models.conditioning(arch, 1, 77, SEED, height=side * 8, width=side * 8)
    return Job(arch, config_name, latent, noise, positive, negative, steps, device)


# -- variants -----------------------------------------------------------------------------------------
def toma_variant(toma_nodes, ratio, scope="attention", window=None, reuse=None, levels="auto", setting=None):
    window = 4 if window is None else window  # the node's window before "auto" chose one per kind of model
    reuse = toma_nodes.DEFAULT_REUSE if reuse is None else reuse
    node = toma_nodes.ToMAPatchModelAdvanced()
    return Variant(f"ToMA {scope}", setting or f"r={ratio:g}",
                   lambda m: node.patch(m, ratio, window, reuse, scope=scope, levels=levels)[0])


def comparison_variants(arch, ratios, thresholds, pack) -> list[Variant]:
    """The main table: ToMA (scope attention) and ToMeSD at every ratio, ToMA scope block and ComfyUI's
    TomePatchModel at the ratio closest to 0.5, CA-ToMe at every threshold. The ToMe baselines merge the highest-resolution
    attention level, as ToMA's levels "auto" does: 1/1 on SD1.5, 1/2 on SDXL (no attention at 1/1, where
    the baselines' default max_downsample=1 would merge nothing). ComfyUI's node has no such knob."""
    tn = pack.nodes.toma_nodes
    max_down = 1 if arch == "sd15" else 2
    out = [Variant("unpatched", "", lambda m: m)]
    out += [toma_variant(tn, r, "attention") for r in ratios]
    mid = min(ratios, key=lambda r: abs(r - 0.5))
    out.append(toma_variant(tn, mid, "block"))
    out += [Variant("ToMeSD", f"r={r:g}", lambda m, r=r: tn.ToMeSDPatchModel().patch(m, min(r, 0.75), max_down)[0])
            for r in ratios]
    out += [Variant("CA-ToMe", f"t={t:g}", lambda m, t=t: tn.CAToMePatchModel().patch(m, t, max_downsample=max_down)[0])
            for t in thresholds]
    out.append(Variant("ComfyUI Tome", f"r={mid:g}", lambda m: comfy_tome(m, mid)))
    return out


# -- pass 1: one sampling run per variant -----------------------------------------------------------------
def recording_wrapper(holder: list):
    """A model_function_wrapper appending every UNet call's arguments (x, sigma, c) to the list in
    ``holder[0]``, to replay them in the timing pass. A plain closure: ComfyUI deep-copies model_options
    when it clones a patcher, and a function survives that as itself."""

    def wrapper(apply_model, args):
        x, sigma, c = args["input"], args["timestep"], args["c"]
        if holder[0] is not None:
            holder[0].append((x, sigma, c))
        return apply_model(x, sigma, **c)

    return wrapper


def record_calls(model, job: Job, holder: list) -> list:
    """Run ``job`` on ``model``; its UNet calls' arguments. On the CPU, with one CFG batch (one_cfg_batch).
    The global RNGs are seeded for the run (ComfyUI's TomePatchModel draws its destinations from them)."""
    holder[0] = []
    with contextlib.nullcontext() if job.device == "cuda" else one_cfg_batch():
        sampling.sample(model, (job.positive, job.negative), job.latent, steps=job.steps, cfg=CFG, sampler=SAMPLER,
                        scheduler=SCHEDULER, denoise=DENOISE, seed=SEED, noise=job.noise, global_rngs=True)
    calls, holder[0] = holder[0], None
    return calls


@contextlib.contextmanager
def one_cfg_batch():
    """ComfyUI batches cond and uncond into one UNet call only when its memory estimate fits the free
    memory, so on a CPU with a few GB free SDXL at 1024x1024 runs as two calls of batch 1. Report plenty
    of free RAM while sampling, so every CPU runs the same batch of 2, as a GPU does (GPU runs keep
    ComfyUI's own estimate)."""
    import comfy.model_management as mm

    real = mm.get_free_memory
    mm.get_free_memory = lambda *args, **kwargs: max(real(*args, **kwargs), 1 << 40)
    try:
        yield
    finally:
        mm.get_free_memory = real


# -- pass 2: timing, interleaved call by call ----------------------------------------------------------------
def timed_call(model, call, sync) -> tuple[float, float]:
    """(wall, process CPU) seconds of one recorded UNet call replayed on ``model``: ``apply_model`` with the
    sampler's own arguments and transformer_options (patches included). Loading the patcher first applies
    its object patches (scope "block") and is not timed."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    x, sigma, c = call
    _, wall, cpu = run.timed(lambda: model.model.apply_model(x, sigma, **c), sync)
    return wall, cpu


@dataclass
class Row:
    arch: str
    variant: Variant
    step_ms: float  # wall time of the UNet calls of a step, median over repeats
    cpu_step_ms: float  # process CPU time of the same
    speedup: float  # median over repeats of unpatched / variant wall time
    cpu_speedup: float  # the same from the process's CPU time (robust on a shared machine)
    cpu_spread: tuple  # lowest and highest of the per-repeat CPU-time ratios
    shares: dict | None  # select/merge/unmerge seconds of the MergeRuntime / UNet wall time, median
    merged_fraction: float | None  # tokens removed at the merged levels (mean over levels)
    calls_per_step: float
    batch: int

    @property
    def merge_share(self) -> float | None:
        return None if self.shares is None else sum(self.shares.values())


def measure(job: Job, variants: list[Variant], base, repeats: int, sync, pack, progress=print) -> list[Row]:
    """Pass 1 samples each variant once (the calls to replay; also the warm-up). Pass 2
    replays the recorded calls ``repeats`` times, call by call across the variants (step 0 of every
    variant, then step 1, ..., in an order of the variants rotated each repeat), so a slow spell of a
    shared machine hits every variant alike.
    Rows follow ``variants``; the first is the reference."""
    holder = [None]
    recorded = base.clone()
    recorded.set_model_unet_function_wrapper(recording_wrapper(holder))
    patched = [v.patch(recorded) for v in variants]
    start = time.perf_counter()
    recordings, removed = [], []
    for model in patched:
        recordings.append(record_calls(model, job, holder))
        removed.append(run.removed_fraction(pack, model))
    progress(f"  {job.arch} sampling pass: {time.perf_counter() - start:.0f} s")
    n_calls = len(recordings[0])
    if any(len(calls) != n_calls for calls in recordings):
        raise RuntimeError(f"variants made different numbers of UNet calls: {[len(calls) for calls in recordings]}")
    timings = [run.Timings() for _ in variants]
    shares = [[] for _ in variants]
    for rep in range(repeats):
        start = time.perf_counter()
        wall, cpu = [0.0] * len(variants), [0.0] * len(variants)
        for k in range(n_calls):
            for i in run.rotated(len(variants), rep):
                w, c = timed_call(patched[i], recordings[i][k], sync)
                wall[i] += w
                cpu[i] += c
        for i, model in enumerate(patched):  # a runtime's seconds cover its current run: this repeat
            timings[i].add(wall[i], cpu[i])
            runtime = run.runtime_of(pack, model)
            if runtime is not None:
                shares[i].append({k: v / wall[i] for k, v in runtime.summary()["seconds"].items()})
        progress(f"  {job.arch} timing repeat {rep + 1}/{repeats}: {time.perf_counter() - start:.0f} s "
                 f"(unpatched {1000 * wall[0] / job.steps:.0f} ms/step), load {os.getloadavg()[0]:.1f}")
    rows = []
    for i, (variant, t) in enumerate(zip(variants, timings)):
        share = {k: statistics.median(s[k] for s in shares[i]) for k in shares[i][0]} if shares[i] else None
        cpu_speedup, *cpu_spread = t.speedups(timings[0], "cpu")
        rows.append(Row(job.arch, variant, 1000 * t.median_wall / job.steps, 1000 * t.median_cpu / job.steps,
                        t.speedups(timings[0], "wall")[0], cpu_speedup, tuple(cpu_spread),
                        share, removed[i], len(recordings[i]) / job.steps,
                        max(c[0].shape[0] for c in recordings[i])))
    return rows


# -- output -------------------------------------------------------------------------------------------
def variant_table(rows: list[Row]) -> str:
    head = ["arch", "variant", "cpu speedup", "spread", "speedup", "ms/step", "cpu ms", "merge cost", "sel/mrg/unm",
            "removed"]
    lines = []
    for r in rows:
        shares = "-" if r.shares is None else "/".join(f"{100 * r.shares[k]:.1f}" for k in ("select", "merge", "unmerge"))
        lines.append([r.arch, r.variant.label, f"{r.cpu_speedup:.3f}x", f"{r.cpu_spread[0]:.2f}-{r.cpu_spread[1]:.2f}",
                      f"{r.speedup:.3f}x", f"{r.step_ms:.0f}", f"{r.cpu_step_ms:.0f}",
                      format_cell(r.merge_share and 100 * r.merge_share, "{:.1f}%"), shares,
                      format_cell(r.merged_fraction and 100 * r.merged_fraction, "{:.0f}%")])
    return format_table(head, lines, left=2)


# -- main ---------------------------------------------------------------------------------------------
def parse_floats(name: str, text: str, low: float, high: float) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name} must be comma-separated numbers, got {text!r}")
    if not values or any(not low <= v <= high for v in values):
        raise SystemExit(f"--{name} values must be between {low} and {high}, got {text!r}")
    return values


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toma_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sd15,sdxl", help="comma list of sd15, sdxl (default both)")
    ap.add_argument("--config", choices=["auto", "small", "full"], default="auto",
                    help="UNet size: auto = small on CPU (SD15_SMALL, SDXL_SMALL), full on CUDA")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps per run (default: see DEFAULTS)")
    ap.add_argument("--ratios", default=None, help="ToMA/ToMeSD ratios, comma list (default: see DEFAULTS)")
    ap.add_argument("--thresholds", default="0.7", help="CA-ToMe similarity thresholds (default 0.7)")
    ap.add_argument("--attention", choices=["sdpa", "sub-quad"], default="sdpa",
                    help="ComfyUI attention backend (fixed for the process)")
    ap.add_argument("--quick", action="store_true",
                    help="SD1.5 only, ratio 0.5, 2 steps, 3 timing passes (~4 min on a quiet 2-core CPU)")
    run.common_arguments(ap, devices=("cpu", "cuda"), device_default="cpu", device_help="cuda runs fp16 with the full configs",
                         repeats_default=None, repeats_help="timing passes over all variants (default: see DEFAULTS)",
                         threads_help="torch CPU threads (default: all cores)")
    args = ap.parse_args(argv)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or any(a not in LATENT_SIDE for a in archs):
        raise SystemExit(f"--arch must be a comma list of sd15, sdxl, got {args.arch!r}")
    if args.quick and args.arch == ap.get_default("arch"):
        archs = ["sd15"]
    thresholds = parse_floats("thresholds", args.thresholds, -1.0, 1.0)
    cuda = run.resolve_device(ap, args.device) == "cuda"
    run.set_threads(args.threads or os.cpu_count() or 1)
    pack = import_host(args.device, args.attention == "sdpa")
    logging.getLogger().setLevel(logging.WARNING)  # after ComfyUI's basicConfig(INFO): no per-run chatter
    full = args.config == "full" or (args.config == "auto" and cuda)
    dtype = torch.float16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mode = "quick" if args.quick else "full"
    print(run.header("python -m toma_bench", argv, run.device_name(args.device), str(dtype).removeprefix('torch.'),
                     f"attention {args.attention}", f"ComfyUI {'current' if comfy_host.is_current_comfy() else 'March 2024'}",
                     f"{SAMPLER}/{SCHEDULER} img2img denoise {DENOISE}, cfg {CFG}; random weights"), flush=True)

    rows = []
    with torch.inference_mode():
        for arch in archs:
            config_name = f"{arch.upper()}_{'FULL' if full else 'SMALL'}"
            steps, repeats, ratios = DEFAULTS[args.device, mode, arch]
            steps, repeats = args.steps or steps, args.repeats or repeats
            ratios = parse_floats("ratios", args.ratios or ratios, 0.0, 0.9)
            job = make_job(arch, config_name, steps, args.device)
            base = models.build_unet(arch, seed=SEED, dtype=dtype, config=getattr(models, config_name))
            variants = comparison_variants(arch, ratios, thresholds, pack)
            print(f"{arch}: {config_name}, latent {LATENT_SIDE[arch]}x{LATENT_SIDE[arch]}, {steps} steps, "
                  f"{len(variants)} variants, {repeats} timing passes", flush=True)
            start = time.perf_counter()
            arch_rows = measure(job, variants, base, repeats, sync, pack, progress=lambda s: print(s, flush=True))
            print(f"  {arch} done in {time.perf_counter() - start:.0f} s\n\n{variant_table(arch_rows)}\n", flush=True)
            rows += arch_rows
            del base
    odd = [r for r in rows if r.calls_per_step != 1 or r.batch != 2]
    if odd:
        print(f"note: {len(odd)} variants did not run one batch-2 call per step (CFG batch split)")
    print(run.footer())


if __name__ == "__main__":
    main()
