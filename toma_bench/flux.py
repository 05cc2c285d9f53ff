"""Flux-architecture benchmark: ToMA on a random-weight Flux sampled through ComfyUI's own sampler.

    python -m toma_bench.flux [--device auto|cpu|cuda] [--steps 6] [--ratios 0.25,0.5,0.75] [--repeats 3]
                              [--latent 64x64] [--tokens 256] [--window 4] [--reuse 5] [--threads N]

CUDA: FLUX.1-dev widths and depths (hidden 3072, 19 double + 38 single blocks) in bf16, a 128x128 latent
(1024x1024 image, 4096 image tokens) and 512 text tokens. CPU: FLUX_SMALL (hidden 512, 4 double + 8
single blocks) in fp32, a 64x64 latent (1024 image tokens) and 256 text tokens. The weights are random
(nothing can be downloaded here): the speed is that of the architecture, and the fidelity columns say
how far merging moves this model's output, not what it does to images.

Every variant (unpatched, then ToMA at each ratio, patched as the ToMA node does with its defaults)
samples the same img2img job: a structured latent, denoise 0.75, euler, cfg 1. The variants run
interleaved, repeat after repeat, so a slow spell of a shared machine hits all of them alike. Columns:
``step ms``: median time between the sampler's step callbacks over all steps but the first (which
holds the sampler's set-up) of all repeats; ``speed-up``: unpatched step / variant step; ``CPU-time
speed-up`` (CPU runs): the same from the process's CPU time, which a shared machine's other jobs do
not inflate (use one thread there: a descheduled OpenMP thread stalls the others); ``select %``
and ``merge %``: the runtime's own clocks (destination selection; merge + unmerge + position gathers),
in % of the run's wall time; ``rel L2 x0``: relative L2 distance to unpatched of the model's denoised
output at the first step (the model output on a structured latent); ``rel L2 out``: of the sampled
latent. On CUDA the runtime's clocks are CUDA events (nodes.live_stats.StageClock), read after each run.
"""
import argparse
import datetime
import platform
import statistics
import time

import torch

from . import comfy_host, models, sampling
from .cli import resolve_device
from .metrics import relative_l2
from .tables import format_cell, format_table


def toma_variant(pack, model, ratio: float, window: int, reuse: int):
    """(patched clone, list that receives each run's summary)."""
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModel().patch(model, ratio, window, reuse)
    summaries = []
    pack.nodes.runtime.runtime_of(patched).run_listeners.append(summaries.append)
    return patched, summaries


def run_once(model, job: dict, device: str):
    """(wall seconds per step, process CPU seconds per step, first-step denoised output, sampled
    latent) of one sampling run."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    stamps, first = [], []

    def callback(step, x0, x, total):
        sync()
        stamps.append((time.perf_counter(), time.process_time()))
        if step == 0:
            first.append(x0.detach().float().cpu())

    sync()
    start = (time.perf_counter(), time.process_time())
    out = sampling.sample(model, job["conditioning"], job["latent"], steps=job["steps"], scheduler="simple",
                          denoise=0.75, noise=job["noise"], callback=callback)
    wall, cpu = ([b[i] - a[i] for a, b in zip([start] + stamps[:-1], stamps)] for i in (0, 1))
    return wall, cpu, first[0], out.float().cpu()


def variant_table(rows: list[dict]) -> str:
    head = ["variant", "step ms", "speed-up", "CPU-time speed-up", "image tokens", "select %", "merge %",
            "rel L2 x0", "rel L2 out"]
    base, base_cpu = rows[0]["step"], rows[0]["cpu"]
    return format_table(head, [[r["name"], f"{1000 * r['step']:.1f}", f"{base / r['step']:.2f}x",
                                format_cell(r["cpu"] and base_cpu / r["cpu"], "{:.2f}x"), r["tokens"],
                                format_cell(r["select"], "{:.1f}%"), format_cell(r["merge"], "{:.1f}%"),
                                format_cell(r["x0"], "{:.4f}"), format_cell(r["out"], "{:.4f}")] for r in rows])


def merged_tokens(summary: dict) -> str:
    """'double 1024->512, single 1024->512' from a runtime summary."""
    return ", ".join(f"{name.split()[0]} {v['tokens']}->{v['merged_tokens']}"
                     for name, v in summary["levels"].items()) or "none merged"


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.flux", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA when available (full FLUX.1-dev, bf16), else CPU (FLUX_SMALL, fp32)")
    ap.add_argument("--steps", type=int, default=6, help="sampling steps per run (default 6)")
    ap.add_argument("--ratios", default="0.25,0.5,0.75",
                    help="comma-separated ToMA ratios (default 0.25,0.5,0.75)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of every variant (default 3)")
    ap.add_argument("--latent", default=None, help="latent HxW (default 128x128 on CUDA, 64x64 on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="text tokens (default 512 on CUDA, 256 on CPU)")
    ap.add_argument("--window", type=int, default=4,
                    help="side of ToMA's windows in tokens, the nodes' window_size (default 4)")
    ap.add_argument("--reuse", type=int, default=5, help="steps between destination recomputations (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    try:
        args.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    except ValueError:
        ap.error(f"--ratios must be comma-separated numbers in (0, 0.9], got {args.ratios!r}")
    if not args.ratios or not all(0.0 < r <= 0.9 for r in args.ratios):
        ap.error(f"--ratios must be comma-separated numbers in (0, 0.9], got {args.ratios}")
    if args.steps < 2 or args.repeats < 1:
        ap.error("--steps must be >= 2 and --repeats >= 1")
    if not 1 <= args.window <= 32 or args.reuse < 1:
        ap.error("--window must be between 1 and 32 and --reuse >= 1")
    args.device = resolve_device(ap, args.device)
    cuda = args.device == "cuda"
    try:
        args.latent = tuple(int(v) for v in (args.latent or ("128x128" if cuda else "64x64")).lower().split("x"))
        assert len(args.latent) == 2 and min(args.latent) >= 2
    except (ValueError, AssertionError):
        ap.error(f"--latent must be HxW with sides >= 2, got {args.latent!r}")
    args.tokens = args.tokens or (512 if cuda else 256)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    comfy_host.import_core(args.device)
    pack = comfy_host.load_pack()
    cuda = args.device == "cuda"
    config, dtype = (models.FLUX_FULL, torch.bfloat16) if cuda else (models.FLUX_SMALL, torch.float32)
    built = time.perf_counter()
    model = models.build_flux(seed=0, dtype=dtype, config=config, device="cuda" if cuda else None)
    built = time.perf_counter() - built
    H, W = args.latent
    job = {"steps": args.steps, "conditioning": models.dit_conditioning("flux", config, 1, args.tokens, seed=0),
           "latent": models.structured_latent(1, H, W, seed=0, channels=16),
           "noise": sampling.seeded_noise((1, 16, H, W), 0)}
    variants = [("unpatched", model, None)]
    for ratio in args.ratios:
        patched, summaries = toma_variant(pack, model, ratio, args.window, args.reuse)
        variants.append((f"ToMA {ratio:g}", patched, summaries))

    steps = {name: [] for name, _, _ in variants}
    cpu_steps = {name: [] for name, _, _ in variants}
    outputs = {}
    with torch.inference_mode():
        run_once(model, dict(job, steps=2), args.device)  # warm-up: loading, kernels, allocator
        for _ in range(args.repeats):
            for name, m, _ in variants:
                wall, cpu, x0, out = run_once(m, job, args.device)
                steps[name] += wall[1:]
                cpu_steps[name] += cpu[1:]
                outputs.setdefault(name, (x0, out))

    rows = []
    ref_x0, ref_out = outputs["unpatched"]
    for name, _, summaries in variants:
        row = {"name": name, "step": statistics.median(steps[name]), "tokens": "all", "select": None,
               "cpu": None if cuda else statistics.median(cpu_steps[name]),
               "merge": None, "x0": None, "out": None}
        if summaries:
            timed = [s for s in summaries if s.get("wall_seconds")]
            row["tokens"] = merged_tokens(summaries[-1])
            def share(kinds):
                return 100 * statistics.median(sum(s["seconds"][k] for k in kinds) / s["wall_seconds"] for s in timed)

            row["select"], row["merge"] = share(["select"]), share(["merge", "unmerge"])
            x0, out = outputs[name]
            row["x0"], row["out"] = relative_l2(x0, ref_x0), relative_l2(out, ref_out)
        rows.append(row)

    dm = model.model.diffusion_model
    where = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; {platform.node()}; torch "
          f"{torch.__version__}; {where}")
    print(f"Flux architecture: hidden {dm.hidden_size}, {len(dm.double_blocks)} double + {len(dm.single_blocks)} "
          f"single blocks, {str(dtype).removeprefix('torch.')}, random weights (built in {built:.0f} s)")
    print(f"latent {H}x{W} ({-(-H // 2) * -(-W // 2)} image tokens), {args.tokens} text tokens, {args.steps} "
          f"euler steps at denoise 0.75, window {args.window}, reuse {args.reuse}; {args.repeats} interleaved "
          f"repeats, median of {len(steps['unpatched'])} steps per variant")
    print(variant_table(rows))


if __name__ == "__main__":
    main()
