"""UNet benchmark: speed and fidelity of ToMA, ToMeSD, CA-ToMe and ComfyUI's TomePatchModel, side by side.

    python -m toma_bench [--arch sd15,sdxl] [--device cpu|cuda] [--steps N] [--repeats R]
                         [--ratios 0.25,0.5,0.75] [--thresholds 0.7] [--threads T] [--quick] [--sweep]

Every variant is a MODEL patched by its node (the pack's nodes; ComfyUI's own ``TomePatchModel``) from one
random-weight UNet (toma_bench.models), and runs the same short img2img job through
``comfy.sample.sample``: a structured latent, seeded noise, euler, CFG (one model call per step on a
batch of 2: cond and uncond). A ``model_function_wrapper`` installed before patching times every model
call (``apply_model``, with a device synchronize on CUDA), so a step's latency is the UNet forward alone,
merging included, without the sampler's bookkeeping. Per run, latency = forward time / steps, which
amortises the steps that select destinations. Runs go round-robin over the variants, ``--repeats`` times;
the table gives the median. Fidelity to the unpatched model, from the first repeat (runs are
deterministic): the relative L2 error of the first step's noise prediction (eps of a structured latent
noised to the first sigma; every variant sees the same input there) and the PSNR of the final latent.
"""
import argparse
import contextlib
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import comfy_host, models, sampling
from .metrics import psnr, relative_l2
from .tables import format_cell, format_table

REPO = Path(__file__).resolve().parent.parent

SAMPLER, SCHEDULER, CFG, DENOISE = "euler", "normal", 5.0, 0.6
LATENT_SIDE = {"sd15": 64, "sdxl": 128}  # 512x512 and 1024x1024 images
SEED = 0
QK_GAIN = 3.0  # see sharpen_self_attention_

# (device, mode, arch) -> (steps, timing passes, ratios). CPU runs are sized for a 2-core machine: a
# SD15_SMALL step at 512x512 costs about 5 s there, an SDXL_SMALL step at 1024x1024 about 25 s.
DEFAULTS = {
    ("cpu", "full", "sd15"): (3, 1, "0.25,0.5,0.75"),
    ("cpu", "full", "sdxl"): (2, 1, "0.5"),
    ("cpu", "quick", "sd15"): (2, 1, "0.5"),
    ("cpu", "quick", "sdxl"): (1, 1, "0.5"),
    ("cpu", "sweep", "sd15"): (10, 1, "0.5"),
    ("cpu", "sweep", "sdxl"): (5, 1, "0.5"),
    ("cuda", "full", "sd15"): (20, 3, "0.25,0.5,0.75"),
    ("cuda", "full", "sdxl"): (20, 3, "0.25,0.5,0.75"),
    ("cuda", "quick", "sd15"): (10, 1, "0.5"),
    ("cuda", "quick", "sdxl"): (10, 1, "0.5"),
    ("cuda", "sweep", "sd15"): (20, 3, "0.5"),
    ("cuda", "sweep", "sdxl"): (20, 3, "0.5"),
}


# -- setup --------------------------------------------------------------------------------------------
def import_host(device: str, sdpa: bool):
    """ComfyUI (attention backend fixed for the process) and the pack, as (comfy nodes module, pack)."""
    comfy_host.import_comfy(pytorch_attention=sdpa, cpu=device == "cpu")
    pack = comfy_host.load_pack()
    import nodes as comfy_nodes  # ComfyUI's nodes.py (import_comfy put its tree first on sys.path)

    return comfy_nodes, pack


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


def sharpen_self_attention_(diffusion_model, gain: float) -> None:
    """Scale to_q and to_k of every self-attention by ``gain`` (logits by gain^2). With random weights the
    logits have a std of about 0.35 and every token attends almost uniformly to all others (softmax entropy
    99% of the maximum): self-attention then returns about the same mean for every token, which merging
    preserves, so every merging method would look harmless. Trained UNets attend selectively."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    with torch.no_grad():
        for block in diffusion_model.modules():
            if isinstance(block, BasicTransformerBlock):
                block.attn1.to_q.weight.mul_(gain)
                block.attn1.to_k.weight.mul_(gain)


# -- variants -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    family: str  # "unpatched", "ToMA attention", "ToMA block", "ToMeSD", "CA-ToMe", "ComfyUI Tome"
    setting: str  # what the family's knob is set to, e.g. "r=0.5", "t=0.7"
    patch: Callable  # base MODEL -> patched MODEL

    @property
    def label(self) -> str:
        return f"{self.family} {self.setting}".strip()


def builtin_tome(comfy_nodes, model, ratio: float):
    """ComfyUI's TomePatchModel, found in its NODE_CLASS_MAPPINGS (V1 ``patch`` in older ComfyUI, V3
    ``execute`` returning a NodeOutput in current ComfyUI)."""
    cls = comfy_nodes.NODE_CLASS_MAPPINGS["TomePatchModel"]
    if hasattr(cls, "define_schema"):
        out = cls.execute(model=model, ratio=ratio)
        return out.args[0] if hasattr(out, "args") else out[0]
    return getattr(cls(), cls.FUNCTION)(model, ratio)[0]


def toma_variant(toma_nodes, ratio, scope="attention", window=None, reuse=None, levels="auto", setting=None):
    window = toma_nodes.DEFAULT_WINDOW if window is None else window
    reuse = toma_nodes.DEFAULT_REUSE if reuse is None else reuse
    node = toma_nodes.ToMAPatchModelAdvanced()
    return Variant(f"ToMA {scope}", setting or f"r={ratio:g}",
                   lambda m: node.patch(m, ratio, window, reuse, scope=scope, levels=levels)[0])


def comparison_variants(arch, ratios, thresholds, pack, comfy_nodes) -> list[Variant]:
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
    out.append(Variant("ComfyUI Tome", f"r={mid:g}", lambda m: builtin_tome(comfy_nodes, m, mid)))
    return out


def sweep_variants(ratio, pack) -> list[Variant]:
    """ToMA settings for choosing the node's defaults, one knob at a time around window 4, reuse 5, levels
    auto, scope attention: window 2/4/8, reuse 1/3/5/10, levels auto+next, scope block."""
    tn = pack.nodes.toma_nodes
    out = [Variant("unpatched", "", lambda m: m)]
    out += [toma_variant(tn, ratio, "attention", w, 5, setting=f"w={w} reuse=5") for w in (2, 4, 8)]
    out += [toma_variant(tn, ratio, "attention", 4, r, setting=f"w=4 reuse={r}") for r in (1, 3, 10)]
    out.append(toma_variant(tn, ratio, "attention", 4, 5, "auto+next", "w=4 reuse=5 auto+next"))
    out.append(toma_variant(tn, ratio, "block", 4, 5, setting="w=4 reuse=5"))
    return out


# -- pass 1: one sampling run per variant -----------------------------------------------------------------
@dataclass
class Recording:
    """What the model_function_wrapper keeps of one sampling run: every UNet call's arguments (to replay
    it in the timing pass) and the first call's noise prediction."""

    calls: list = field(default_factory=list)  # (x, sigma, c) per UNet call
    first_eps: torch.Tensor | None = None


def recording_wrapper(holder: list):
    """A model_function_wrapper recording into ``holder[0]``. A plain closure: ComfyUI deep-copies
    model_options when it clones a patcher, and a function survives that as itself."""

    def wrapper(apply_model, args):
        x, sigma, c = args["input"], args["timestep"], args["c"]
        out = apply_model(x, sigma, **c)
        rec = holder[0]
        if rec is not None:
            rec.calls.append((x, sigma, c))
            if rec.first_eps is None:  # EPS models: denoised = x - eps * sigma
                rec.first_eps = ((x - out) / sigma.view(-1, 1, 1, 1)).double().cpu()
        return out

    return wrapper


def sample(model, job: Job, holder: list) -> tuple[torch.Tensor, Recording]:
    """Run ``job`` on ``model``: (final latent, recording). On the CPU, with one CFG batch (one_cfg_batch).
    The global RNGs are seeded for the run (ComfyUI's TomePatchModel draws its destinations from them)."""
    holder[0] = Recording()
    with contextlib.nullcontext() if job.device == "cuda" else one_cfg_batch():
        final = sampling.sample(model, (job.positive, job.negative), job.latent, steps=job.steps, cfg=CFG,
                                sampler=SAMPLER, scheduler=SCHEDULER, denoise=DENOISE, seed=SEED, noise=job.noise,
                                global_rngs=True)
    rec, holder[0] = holder[0], None
    return final.float().cpu(), rec


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
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    model.model.apply_model(x, sigma, **c)
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


def find_runtime(pack):
    """model -> its MergeRuntime (through the id the pack's nodes write into transformer_options), or None."""
    def runtime_of(model):
        try:
            return pack.nodes.runtime.runtime_of(model)
        except ValueError:
            return None

    return runtime_of


@dataclass
class Row:
    arch: str
    variant: Variant
    step_ms: float  # wall time of the UNet calls of a step, median over repeats
    cpu_step_ms: float  # process CPU time of the same
    speedup: float  # median over repeats of unpatched / variant wall time
    cpu_speedup: float  # the same from the process's CPU time (robust on a shared machine)
    shares: dict | None  # select/merge/unmerge seconds of the MergeRuntime / UNet wall time, median
    merged_fraction: float | None  # tokens removed at the merged levels (mean over levels)
    eps_rel_l2: float
    psnr_db: float
    calls_per_step: float
    batch: int

    @property
    def merge_share(self) -> float | None:
        return None if self.shares is None else sum(self.shares.values())


def measure(job: Job, variants: list[Variant], base, repeats: int, sync, pack, progress=print) -> list[Row]:
    """Pass 1 samples each variant once (fidelity, and the calls to replay; also the warm-up). Pass 2
    replays the recorded calls ``repeats`` times, call by call across the variants (step 0 of every
    variant, then step 1, ...), so a slow spell of a shared machine hits every variant alike.
    Rows follow ``variants``; the first is the reference."""
    holder = [None]
    recorded = base.clone()
    recorded.set_model_unet_function_wrapper(recording_wrapper(holder))
    patched = [v.patch(recorded) for v in variants]
    runtime_of = find_runtime(pack)
    start = time.perf_counter()
    finals, recordings, removed = [], [], []
    for model in patched:
        final, rec = sample(model, job, holder)
        finals.append(final)
        recordings.append(rec)
        runtime = runtime_of(model)
        removed.append(statistics.mean(1 - v.merged_tokens / v.tokens for v in runtime.levels.values())
                       if runtime is not None and runtime.levels else None)
    progress(f"  {job.arch} sampling pass: {time.perf_counter() - start:.0f} s")
    n_calls = len(recordings[0].calls)
    if any(len(rec.calls) != n_calls for rec in recordings):
        raise RuntimeError(f"variants made different numbers of UNet calls: {[len(r.calls) for r in recordings]}")
    wall = [[0.0] * repeats for _ in variants]
    cpu = [[0.0] * repeats for _ in variants]
    shares = [[None] * repeats for _ in variants]
    for rep in range(repeats):
        start = time.perf_counter()
        for k in range(n_calls):
            for i, (model, rec) in enumerate(zip(patched, recordings)):
                w, c = timed_call(model, rec.calls[k], sync)
                wall[i][rep] += w
                cpu[i][rep] += c
        for i, model in enumerate(patched):  # a runtime's seconds cover its current run: this repeat
            runtime = runtime_of(model)
            if runtime is not None:
                shares[i][rep] = {k: v / wall[i][rep] for k, v in runtime.stage_clock.seconds().items()}
        progress(f"  {job.arch} timing repeat {rep + 1}/{repeats}: {time.perf_counter() - start:.0f} s "
                 f"(unpatched {1000 * wall[0][rep] / job.steps:.0f} ms/step)")
    rows = []
    for i, variant in enumerate(variants):
        share = None
        if shares[i][0] is not None:
            share = {k: statistics.median(s[k] for s in shares[i]) for k in shares[i][0]}
        rows.append(Row(job.arch, variant, 1000 * statistics.median(wall[i]) / job.steps,
                        1000 * statistics.median(cpu[i]) / job.steps,
                        statistics.median(u / v for u, v in zip(wall[0], wall[i])),
                        statistics.median(u / v for u, v in zip(cpu[0], cpu[i])),
                        share, removed[i], relative_l2(recordings[i].first_eps, recordings[0].first_eps),
                        psnr(finals[i], finals[0]), len(recordings[i].calls) / job.steps,
                        max(c[0].shape[0] for c in recordings[i].calls)))
    return rows


# -- output -------------------------------------------------------------------------------------------
def variant_table(rows: list[Row]) -> str:
    head = ["arch", "variant", "ms/step", "cpu ms", "speedup", "cpu speedup", "merge cost", "sel/mrg/unm", "removed", "eps relL2", "PSNR dB"]
    lines = []
    for r in rows:
        shares = "-" if r.shares is None else "/".join(f"{100 * r.shares[k]:.1f}" for k in ("select", "merge", "unmerge"))
        lines.append([r.arch, r.variant.label, f"{r.step_ms:.0f}", f"{r.cpu_step_ms:.0f}", f"{r.speedup:.3f}x", f"{r.cpu_speedup:.3f}x",
                      format_cell(r.merge_share and 100 * r.merge_share, "{:.1f}%"), shares,
                      format_cell(r.merged_fraction and 100 * r.merged_fraction, "{:.0f}%"),
                      f"{r.eps_rel_l2:.4f}", "inf" if math.isinf(r.psnr_db) else f"{r.psnr_db:.1f}"])
    return format_table(head, lines, left=2)


FAMILY_STYLE = {"ToMA attention": ("C0", "o"), "ToMA block": ("C1", "s"), "ToMeSD": ("C2", "^"),
                "CA-ToMe": ("C3", "v"), "ComfyUI Tome": ("C4", "D")}


def plot(rows: list[Row], path: Path, title: str) -> None:
    """Speedup vs PSNR of the final latent, one panel per architecture, a line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    archs = list(dict.fromkeys(r.arch for r in rows))
    fig, axes = plt.subplots(1, len(archs), figsize=(4.2 * len(archs), 3.4), squeeze=False)
    for ax, arch in zip(axes[0], archs):
        for family, (color, marker) in FAMILY_STYLE.items():
            pts = sorted((r.speedup, r.psnr_db, r.variant.setting) for r in rows if r.arch == arch and r.variant.family == family)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker, label=family, lw=1, ms=5)
            for x, y, s in pts:
                ax.annotate(s.split("=")[-1], (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
        ax.axvline(1.0, color="0.6", lw=0.8, ls="--")
        ax.set_title(arch.upper(), fontsize=9)
        ax.set_xlabel("speedup vs unpatched (x)", fontsize=8)
        ax.set_ylabel("PSNR of final latent vs unpatched (dB)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda runs fp16 with the full configs")
    ap.add_argument("--config", choices=["auto", "small", "full"], default="auto",
                    help="UNet size: auto = small on CPU (SD15_SMALL, SDXL_SMALL), full on CUDA")
    ap.add_argument("--steps", type=int, default=None, help="sampler steps per run (default: see DEFAULTS)")
    ap.add_argument("--repeats", type=int, default=None, help="timing passes over all variants (default: see DEFAULTS)")
    ap.add_argument("--ratios", default=None, help="ToMA/ToMeSD ratios, comma list (default: see DEFAULTS)")
    ap.add_argument("--thresholds", default="0.7", help="CA-ToMe similarity thresholds (default 0.7)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    ap.add_argument("--attention", choices=["sdpa", "sub-quad"], default="sdpa",
                    help="ComfyUI attention backend (fixed for the process)")
    ap.add_argument("--qk-gain", type=float, default=QK_GAIN,
                    help=f"scale of to_q and to_k of every self-attention (default {QK_GAIN:g}; 1 = as built)")
    ap.add_argument("--quick", action="store_true", help="SD1.5 only, ratio 0.5, 2 steps (~2 min on a quiet 2-core CPU)")
    ap.add_argument("--sweep", action="store_true", help="ToMA settings sweep for the node defaults instead")
    ap.add_argument("--plot", default=str(REPO / "docs" / "unet_speed_fidelity.png"),
                    help="PNG path for the speed-vs-fidelity plot ('' for none)")
    args = ap.parse_args(argv)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    if not archs or any(a not in LATENT_SIDE for a in archs):
        raise SystemExit(f"--arch must be a comma list of sd15, sdxl, got {args.arch!r}")
    if args.quick and args.arch == ap.get_default("arch"):
        archs = ["sd15"]
    thresholds = parse_floats("thresholds", args.thresholds, -1.0, 1.0)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    comfy_nodes, pack = import_host(args.device, args.attention == "sdpa")
    logging.getLogger().setLevel(logging.WARNING)  # after ComfyUI's basicConfig(INFO): no per-run chatter
    full = args.config == "full" or (args.config == "auto" and cuda)
    dtype = torch.float16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mode = "sweep" if args.sweep else "quick" if args.quick else "full"
    threads = torch.get_num_threads()
    device_name = torch.cuda.get_device_name() if cuda else f"CPU, {threads} thread{'s' if threads > 1 else ''}"
    print(f"torch {torch.__version__}; {device_name}; {str(dtype).removeprefix('torch.')}; attention "
          f"{args.attention}; ComfyUI {'current' if comfy_host.is_current_comfy() else 'March 2024'}; {SAMPLER}/{SCHEDULER} "
          f"img2img denoise {DENOISE}, cfg {CFG}; self-attention q/k gain {args.qk_gain:g}", flush=True)

    rows = []
    with torch.inference_mode():
        for arch in archs:
            config_name = f"{arch.upper()}_{'FULL' if full else 'SMALL'}"
            steps, repeats, ratios = DEFAULTS[args.device, mode, arch]
            steps, repeats = args.steps or steps, args.repeats or repeats
            ratios = parse_floats("ratios", args.ratios or ratios, 0.0, 0.9)
            job = make_job(arch, config_name, steps, args.device)
            base = models.build_unet(arch, seed=SEED, dtype=dtype, config=getattr(models, config_name))
            sharpen_self_attention_(base.model.diffusion_model, args.qk_gain)
            if args.sweep:
                variants = sweep_variants(ratios[0], pack)
            else:
                variants = comparison_variants(arch, ratios, thresholds, pack, comfy_nodes)
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
    if args.plot and not args.sweep:
        title = f"{device_name}, attention {args.attention}, img2img {steps} steps (docs/benchmarks.md)"
        plot(rows, Path(args.plot), title)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
