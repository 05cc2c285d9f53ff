"""Wan-architecture video benchmark: ToMA on a random-weight Wan model sampled through ComfyUI's own sampler.

    python -m toma_bench.video [--device auto|cpu|cuda] [--sizes 480p:3,480p:9,720p:5] [--scale 2]
                               [--steps 3] [--ratios 0.25,0.5,0.75] [--temporal-window 1,2] [--repeats 3]
                               [--tokens 512] [--window-size 4] [--reuse 5] [--threads N]
    python -m toma_bench.video --stack easycache [--stack-steps 10,4] [--sizes 480p:3] [--repeats 3] ...

CUDA: Wan 2.1 1.3B widths and depth (dim 1536, 12 heads of 128, 30 blocks) in bf16, at the real
latents of 832x480 (60x104) and 1280x720 (90x160) video, 9 and 21 latent frames (33 and 81 video
frames). CPU: WAN_SMALL (dim 512, 4 heads of 128, 4 blocks) in fp32, latent sides divided by ``--scale``
(default 2: 30x52 and 45x80), a few latent frames, so that a step takes seconds. The weights are random
(nothing can be downloaded here): the speed is that of the architecture, and the fidelity column says
how far merging moves this model's output, not what it does to a video.

Every variant (unpatched, then ToMA at each ratio and temporal window, patched as the Advanced node
does with its other inputs at their defaults) samples the same video-to-video job: a latent that pans
one latent pixel per frame over smooth structure (the temporal redundancy of real video), denoise
0.75, euler, cfg 1, 512 text tokens. The variants run interleaved, repeat after repeat, in an order
rotated each repeat (toma_bench.run), so a slow spell of a shared machine hits all of them alike. Rows are ranked by CPU time on the CPU (which other jobs on
a shared machine do not inflate) and by wall time on CUDA. Columns:
``step ms`` / ``CPU ms``: median wall / process-CPU time between the sampler's step callbacks over all
steps but the first (which holds the sampler's set-up) of all repeats; ``speed-up`` / ``CPU speed-up``:
unpatched over variant; ``predicted``: the speed-up the token count predicts with no merge cost,
1 / (1 - b m (1 - ((1 - a) r + a r^2))), with r = merged / video tokens, m = merged blocks / blocks,
and b (blocks' share of the step) and a (self-attention's share of a block) timed in a separate
unpatched run that syncs around every block and attention call (the ``unpatched:`` line);
``select %`` / ``merge %``: the runtime's own clocks (destination selection; merge + unmerge + row
gathers) in % of the run's wall time; ``rel L2 x0`` and ``rel L2 v``: relative L2 distance to
unpatched, at the first step, of the denoised latent and of the model's own prediction (the flow
velocity v, with x0 = x - sigma v; x0 keeps most of the input latent, so it moves less).

``--stack easycache`` (a separate mode; the one above is unchanged): whole sampling runs of a
text-to-video job (the same latent size, but denoise 1: from pure noise, euler, simple scheduler, cfg 1)
at each step count of ``--stack-steps`` (default 10 and 4, the latter as Wan distillation-LoRA users
sample), for four variants run interleaved, repeat after repeat: unpatched, ToMA (one ratio and temporal
window, default 0.5 and 2), ComfyUI's EasyCache node at its defaults (reuse_threshold 0.2, start_percent
0.15, end_percent 0.95), and EasyCache on top of ToMA (EasyCache nearer the sampler: ToMA patches the
model, EasyCache wraps the patched model). Columns: ``model calls``: diffusion-model calls that ran (cfg 1:
one per step) and how many EasyCache skipped (it returns the cached output change instead of calling the
model, so ToMA never runs on a skipped step); ``run s`` / ``CPU s``: median wall / process-CPU seconds of
a whole run; speed-ups: unpatched over variant; ``rel L2 final``: relative L2 distance of the sampled
latent to unpatched's.
"""
import argparse
import time

import torch

from . import comfy_host, models, run, sampling, step_caches
from .metrics import relative_l2
from .tables import format_cell, format_table

# Latent H x W of Wan 2.1 videos (VAE stride 8): 832x480 and 1280x720.
ASPECTS = {"480p": (60, 104), "720p": (90, 160)}


def panned_latent(frames: int, height: int, width: int, seed: int = 0, channels: int = 16) -> torch.Tensor:
    """(1, channels, frames, height, width): a smooth latent (models.structured_latent) seen through a
    window that pans one latent pixel per frame, so neighbouring frames share most of their content."""
    wide = models.structured_latent(1, height, width + frames - 1, seed=seed, channels=channels)
    return torch.stack([wide[..., f:f + width] for f in range(frames)], dim=2)


class StepProfile:
    """Time spent in the blocks and in their self-attention during an unpatched run. Every timed call
    is bracketed by device syncs, so this runs on its own, never in the timed runs."""

    def __init__(self, device: str):
        self.sync = run.device_sync(device)
        # CPU: process time, which other jobs on a shared machine do not inflate; CUDA: wall time
        self.clock = time.perf_counter if device == "cuda" else time.process_time
        self.blocks = self.attention = 0.0

    def timed(self, fn, *args, **kwargs):
        self.sync()
        start = self.clock()
        out = fn(*args, **kwargs)
        self.sync()
        return out, self.clock() - start

    def attention_override(self, func, *args, **kwargs):
        """transformer_options["optimized_attention_override"]: self-attention has as many keys as
        queries (the video tokens); cross-attention reads the text."""
        q, k = args[0], args[1]
        if q.shape[1] != k.shape[1]:
            return func(*args, **kwargs)
        out, seconds = self.timed(func, *args, **kwargs)
        self.attention += seconds
        return out

    def block(self, args, extras):
        out, seconds = self.timed(extras["original_block"], args)
        self.blocks += seconds
        return out

    def shares(self, model, job: dict, device: str) -> tuple[float, float]:
        """(blocks' share of a step, self-attention's share of the blocks) over all steps but the first."""
        m = model.clone()
        m.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = self.attention_override
        for i in range(len(model.model.diffusion_model.blocks)):
            m.set_model_patch_replace(self.block, "dit", "double_block", i)
        marks = []
        run_steps(m, job, device, lambda: marks.append((self.clock(), self.blocks, self.attention)))
        (t0, b0, a0), (t1, b1, a1) = marks[0], marks[-1]
        return (b1 - b0) / (t1 - t0), (a1 - a0) / (b1 - b0)


def run_steps(model, job: dict, device: str, on_step=None):
    """(wall seconds per step, process CPU seconds per step, (denoised output, input latent) of the first
    step) of one sampling run; ``on_step`` is called at every step callback, after the device is synced."""
    sync = run.device_sync(device)
    stamps, first = [], []

    def callback(step, x0, x, total):
        sync()
        stamps.append(run.clock())
        if on_step is not None:
            on_step()
        if step == 0:
            first.append((x0.detach().float().cpu(), x.detach().float().cpu()))

    sync()
    start = run.clock()
    sampling.sample(model, job["conditioning"], job["latent"], steps=job["steps"], scheduler="simple", denoise=0.75,
                    noise=job["noise"], callback=callback)
    wall, cpu = ([b[i] - a[i] for a, b in zip([start] + stamps[:-1], stamps)] for i in (0, 1))
    return wall, cpu, first[0]


def predicted_speedup(block_share: float, attention_share: float, merged_blocks: float, kept: float) -> float:
    """The step's speed-up if merged blocks cost what their token count says and merging cost nothing:
    a merged block's linear part (projections, MLP, cross-attention queries) scales with the kept
    fraction ``kept`` of tokens, its self-attention with its square."""
    block = (1 - attention_share) * kept + attention_share * kept ** 2
    return 1.0 / (1.0 - block_share * merged_blocks * (1.0 - block))


def toma_variant(pack, model, ratio: float, temporal_window: int, window_size: int, reuse: int):
    """(patched clone, list that receives each run's summary)."""
    (patched,) = pack.nodes.toma_nodes.ToMAPatchModelAdvanced().patch(model, ratio, window_size, reuse,
                                                                       temporal_window=temporal_window)
    summaries = []
    pack.nodes.runtime.runtime_of(patched).run_listeners.append(summaries.append)
    return patched, summaries


def measure(pack, model, config: dict, args, aspect: str, frames: int) -> tuple[str, list[dict]]:
    """(the size's header line, one row per variant) for one latent size."""
    H, W = (-(-side // args.scale) for side in ASPECTS[aspect])
    job = {"steps": args.steps, "conditioning": models.wan_conditioning(config, 1, args.tokens, seed=0),
           "latent": panned_latent(frames, H, W), "noise": sampling.seeded_noise((1, 16, frames, H, W), 0)}
    blocks = len(model.model.diffusion_model.blocks)
    variants = [("unpatched", model, None)]
    for ratio in args.ratios:
        for temporal in args.temporal_window:
            patched, summaries = toma_variant(pack, model, ratio, temporal, args.window_size, args.reuse)
            variants.append((f"ToMA {ratio:g}, {temporal} frame{'s' if temporal > 1 else ''}", patched, summaries))

    with torch.inference_mode():
        run_steps(model, dict(job, steps=2), args.device)  # warm-up: loading, kernels, allocator
        block_share, attention_share = StepProfile(args.device).shares(model, job, args.device)
        x0s = {}

        def steps_but_first(variant):
            name, m, _ = variant
            wall, cpu, x0 = run_steps(m, job, args.device)
            x0s.setdefault(name, x0)
            return wall[1:], cpu[1:]

        timings = dict(zip((name for name, *_ in variants), run.interleave(variants, args.repeats, steps_but_first)))

    t, h, w = frames, -(-H // 2), -(-W // 2)
    tokens = t * h * w
    clock = "wall time" if args.device == "cuda" else "CPU time"
    header = (f"{aspect} aspect, latent {frames}x{H}x{W} -> {t}x{h}x{w} = {tokens} video tokens; unpatched: blocks "
              f"{100 * block_share:.0f}% of a step, self-attention {100 * attention_share:.0f}% of the blocks "
              f"({clock})")
    rows = []
    for name, _, summaries in variants:
        row = {"name": name, "tokens": f"{tokens}", "wall": timings[name].median_wall,
               "cpu": None if args.device == "cuda" else timings[name].median_cpu,
               "predicted": 1.0, "select": None, "merge": None, "x0": None, "v": None}
        if summaries:
            (level,) = summaries[-1]["levels"].values()
            kept = level["merged_tokens"] / level["tokens"]
            merged = len(pack.nodes.adapters.layout.merged_blocks(blocks, pack.nodes.adapters.layout.VIDEO))
            row["tokens"] = f"{level['tokens']}->{level['merged_tokens']}"
            row["predicted"] = predicted_speedup(block_share, attention_share, merged / blocks, kept)
            row["select"], row["merge"] = (run.stage_share(summaries, ["select"]),
                                           run.stage_share(summaries, ["merge", "unmerge"]))
            (x0, x), (x0_ref, _) = x0s[name], x0s["unpatched"]
            row["x0"] = relative_l2(x0, x0_ref)
            # the prediction itself: x0 = x - sigma v for Wan's flow model, and every variant starts from
            # the same x, so |v - v_ref| / |v_ref| = |x0 - x0_ref| / |x - x0_ref|
            row["v"] = float((x0 - x0_ref).norm() / (x - x0_ref).norm())
        rows.append(row)
    return header, rows


def variant_table(rows: list[dict], device: str) -> str:
    """The rows ranked by CPU time (CPU) or wall time (CUDA), fastest first."""
    base = next(r for r in rows if r["name"] == "unpatched")
    rank = "wall" if device == "cuda" else "cpu"
    head = ["variant", "video tokens", "step ms", "CPU ms", "speed-up", "CPU speed-up", "predicted", "select %",
            "merge %", "rel L2 x0", "rel L2 v"]
    lines = [[r["name"], r["tokens"], f"{1000 * r['wall']:.0f}", format_cell(r["cpu"] and 1000 * r["cpu"], "{:.0f}"),
              f"{base['wall'] / r['wall']:.2f}x", format_cell(r["cpu"] and base["cpu"] / r["cpu"], "{:.2f}x"),
              f"{r['predicted']:.2f}x", format_cell(r["select"], "{:.1f}%"), format_cell(r["merge"], "{:.1f}%"),
              format_cell(r["x0"], "{:.4f}"), format_cell(r["v"], "{:.4f}")]
             for r in sorted(rows, key=lambda r: r[rank])]
    return format_table(head, lines)


STACK_VARIANTS = ("unpatched", "ToMA", "EasyCache", "EasyCache + ToMA")


def easycache(model):
    """ComfyUI's EasyCache node applied to ``model`` with its default inputs (toma_bench.step_caches)."""
    return step_caches.apply("EasyCache", model, kind="wan")


def measure_stack(pack, model, config: dict, args, aspect: str, frames: int) -> tuple[str, list[tuple[int, list[dict]]]]:
    """(the size's header line, [(steps, one row per stack variant)]) for one latent size."""
    H, W = (-(-side // args.scale) for side in ASPECTS[aspect])
    latent = panned_latent(frames, H, W)
    conditioning = models.wan_conditioning(config, 1, args.tokens, seed=0)
    noise = sampling.seeded_noise((1, 16, frames, H, W), 0)
    ratio, temporal = args.ratios[0], args.temporal_window[0]
    toma_model, _ = toma_variant(pack, model, ratio, temporal, args.window_size, args.reuse)
    built = {"unpatched": model, "ToMA": toma_model, "EasyCache": easycache(model),
             "EasyCache + ToMA": easycache(toma_model)}
    names = {"unpatched": "unpatched", "ToMA": f"ToMA {ratio:g}, {temporal} frame{'s' if temporal > 1 else ''}",
             "EasyCache": "EasyCache", "EasyCache + ToMA": f"EasyCache + ToMA {ratio:g}"}

    def sample(m, steps, callback=None):
        return sampling.sample(m, conditioning, latent, steps=steps, scheduler="simple", denoise=1.0, noise=noise,
                               callback=callback)

    runs = [(v, s) for s in args.stack_steps for v in STACK_VARIANTS]
    results = {key: {"calls": [], "out": None} for key in runs}

    def whole_run(key):
        v, steps = key
        with step_caches.counted(built[v]) as (ran, callback):
            out, wall, cpu = run.timed(lambda: sample(built[v], steps, callback), run.device_sync(args.device))
        results[key]["calls"].append(sum(ran))
        if results[key]["out"] is None:
            results[key]["out"] = out.float()
        return wall, cpu

    with torch.inference_mode():
        sample(model, 2)  # warm-up: loading, kernels, allocator
        for key, t in zip(runs, run.interleave(runs, args.repeats, whole_run)):
            results[key]["timings"] = t

    tokens = frames * -(-H // 2) * -(-W // 2)
    header = f"{aspect} aspect, latent {frames}x{H}x{W} = {tokens} video tokens"
    tables = []
    for steps in args.stack_steps:
        ref = results["unpatched", steps]["out"]
        rows = []
        for v in STACK_VARIANTS:
            r = results[v, steps]
            rows.append({"name": names[v], "steps": steps, "calls": sorted(set(r["calls"])),
                         "wall": r["timings"].median_wall, "cpu": r["timings"].median_cpu,
                         "l2": None if v == "unpatched" else relative_l2(r["out"], ref)})
        tables.append((steps, rows))
    return header, tables


def stack_table(rows: list[dict], device: str) -> str:
    """The stack rows ranked by CPU time (CPU) or wall time (CUDA), fastest first."""
    base = next(r for r in rows if r["name"] == "unpatched")
    rank = "wall" if device == "cuda" else "cpu"
    head = ["variant", "model calls", "run s", "CPU s", "speed-up", "CPU speed-up", "rel L2 final"]
    lines = []
    for r in sorted(rows, key=lambda r: r[rank]):
        calls = "/".join(str(c) for c in r["calls"])
        skipped = "/".join(str(r["steps"] - c) for c in r["calls"])
        lines.append([r["name"], f"{calls} of {r['steps']} ({skipped} skipped)", f"{r['wall']:.1f}", f"{r['cpu']:.1f}",
                      f"{base['wall'] / r['wall']:.2f}x", f"{base['cpu'] / r['cpu']:.2f}x",
                      format_cell(r["l2"], "{:.4f}")])
    return format_table(head, lines)


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """'480p:3,720p:5' -> [('480p', 3), ('720p', 5)]."""
    sizes = []
    for item in text.split(","):
        aspect, _, frames = item.strip().partition(":")
        if aspect not in ASPECTS or not frames.isdigit() or int(frames) < 1:
            raise ValueError(item)
        sizes.append((aspect, int(frames)))
    return sizes


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.video", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="comma-separated ASPECT:LATENT_FRAMES, aspects 480p and 720p (default "
                         "480p:9,480p:21,720p:21 on CUDA, 480p:3,480p:9,720p:5 on CPU)")
    ap.add_argument("--scale", type=int, default=None,
                    help="divide the latent sides by this (default 1 on CUDA, 2 on CPU)")
    ap.add_argument("--steps", type=int, default=3, help="sampling steps per run (default 3)")
    ap.add_argument("--stack", choices=["easycache"], default=None,
                    help="separate mode: whole runs of unpatched, ToMA, EasyCache and EasyCache + ToMA")
    ap.add_argument("--stack-steps", default="10,4", help="--stack: comma-separated step counts (default 10,4)")
    ap.add_argument("--ratios", default=None, help="comma-separated ToMA ratios (default 0.25,0.5,0.75; --stack: one ratio, default 0.5)")
    ap.add_argument("--temporal-window", default=None,
                    help="comma-separated temporal windows in frames (default 1,2; --stack: one window, default 2)")
    ap.add_argument("--tokens", type=int, default=512, help="text tokens (default 512, as Wan's umT5 pads to)")
    ap.add_argument("--window-size", type=int, default=4, help="ToMA window side in tokens (default 4)")
    ap.add_argument("--reuse", type=int, default=5, help="steps between destination recomputations (default 5)")
    run.common_arguments(ap, device_help="auto: CUDA when available (Wan 2.1 1.3B, bf16), else CPU (WAN_SMALL, fp32)",
                         repeats_default=3, repeats_help="interleaved runs of every variant (default 3)")
    args = ap.parse_args(argv)
    args.device = run.resolve_device(ap, args.device)
    cuda = args.device == "cuda"
    try:
        args.sizes = parse_sizes(args.sizes or ("480p:9" if cuda else "480p:3") if args.stack else
                                 args.sizes or ("480p:9,480p:21,720p:21" if cuda else "480p:3,480p:9,720p:5"))
    except ValueError as e:
        ap.error(f"--sizes must be ASPECT:FRAMES items with aspects {', '.join(ASPECTS)} and frames >= 1, got {e}")
    try:
        args.ratios = [float(r) for r in (args.ratios or ("0.5" if args.stack else "0.25,0.5,0.75")).split(",")
                       if r.strip()]
        temporal = args.temporal_window or ("2" if args.stack else "1,2")
        args.temporal_window = [int(t) for t in temporal.split(",") if t.strip()]
        args.stack_steps = [int(s) for s in args.stack_steps.split(",") if s.strip()]
    except ValueError:
        ap.error("--ratios, --temporal-window and --stack-steps must be comma-separated numbers")
    if args.stack and (len(args.ratios) != 1 or len(args.temporal_window) != 1):
        ap.error("--stack takes one --ratios value and one --temporal-window value")
    if args.stack and (not args.stack_steps or not all(s >= 2 for s in args.stack_steps)):
        ap.error("--stack-steps must be step counts >= 2")
    if not args.ratios or not all(0.0 < r <= 0.9 for r in args.ratios):
        ap.error(f"--ratios must be in (0, 0.9], got {args.ratios}")
    if not args.temporal_window or not all(1 <= t <= 16 for t in args.temporal_window):
        ap.error(f"--temporal-window must be between 1 and 16, got {args.temporal_window}")
    args.scale = args.scale or (1 if cuda else 2)
    if args.steps < 2 or args.repeats < 1 or args.scale < 1 or args.tokens < 1:
        ap.error("--steps must be >= 2, --repeats, --scale and --tokens >= 1")
    if not 1 <= args.window_size <= 32 or args.reuse < 1:
        ap.error("--window-size must be between 1 and 32 and --reuse >= 1")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run.set_threads(args.threads)
    root = comfy_host.import_core(args.device, require_flux=False)
    if not (root / "comfy" / "ldm" / "wan" / "model.py").is_file():
        raise SystemExit(f"no Wan in the ComfyUI at {root}: set COMFYUI_PATH to a current ComfyUI")
    pack = comfy_host.load_pack()
    cuda = args.device == "cuda"
    config, dtype = (models.WAN_1_3B, torch.bfloat16) if cuda else (models.WAN_SMALL, torch.float32)
    built = time.perf_counter()
    model = models.build_wan("t2v", seed=0, dtype=dtype, config=config, device="cuda" if cuda else None,
                             draw_device="cuda" if cuda else None)
    built = time.perf_counter() - built

    setting = (f"Wan architecture: dim {config['dim']}, {config['num_heads']} heads, {config['num_layers']} blocks, "
               f"{str(dtype).removeprefix('torch.')}, random weights (built in {built:.0f} s); {args.tokens} text tokens, ")
    print(run.header("python -m toma_bench.video", argv, run.device_name(args.device)))
    print(setting + (f"{args.steps} euler steps at denoise 0.75, cfg 1, window {args.window_size}, reuse {args.reuse}; "
                     f"{args.repeats} interleaved repeats, median of {args.repeats * (args.steps - 1)} steps per variant"
                     if not args.stack else
                     f"text-to-video from noise (denoise 1), euler, simple scheduler, cfg 1; {args.stack_steps} steps; "
                     f"ToMA window {args.window_size}, reuse {args.reuse}; EasyCache reuse_threshold 0.2, start_percent "
                     f"0.15, end_percent 0.95; {args.repeats} interleaved repeats, median of {args.repeats} whole runs "
                     "per variant"), flush=True)
    if args.stack:
        for aspect, frames in args.sizes:
            header, tables = measure_stack(pack, model, config, args, aspect, frames)
            for steps, rows in tables:
                print(f"\n{header}, {steps} steps\n{stack_table(rows, args.device)}", flush=True)
        print(f"\n{run.footer()}")
        return
    for aspect, frames in args.sizes:
        header, rows = measure(pack, model, config, args, aspect, frames)
        print(f"\n{header}\n{variant_table(rows, args.device)}", flush=True)
    print(f"\n{run.footer()}")


if __name__ == "__main__":
    main()
