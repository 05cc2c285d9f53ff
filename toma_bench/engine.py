"""Engine micro-benchmark: what merging costs next to the attention it saves.

    python -m toma_bench.engine [--repeats 7] [--device auto|cpu|cuda] [--threads N]

For each input x (B, N, C) it times one SDPA self-attention (q = k = v = x as heads of 64) and, as a
percentage of it: building a plan with new destinations (``select``), refreshing the weights of given
destinations (``weights``), ``merge`` and ``unmerge``, and SDPA at the merged length (``attn N'``).
``saved`` is 100% - attn N'; ``overhead`` is (select + merge + unmerge) / saved, the worst case where
every attention call picks new destinations (in a run they are reused across blocks and steps);
``net`` is saved - select - merge - unmerge. Times are medians over ``--repeats`` after warm-up.
"""
import argparse

import torch
import torch.nn.functional as F

from toma_core.baselines import tomesd_plan
from toma_core.plan import plan_tiles

from . import run
from .tables import format_cell, format_table

SHAPES = [((2, 4096, 640), (64, 64)), ((2, 1024, 1280), (32, 32))]
WINDOWS = (4, 8, 16)  # the nodes' window_size: side of ToMA's square windows, in tokens
RATIO = 0.5
HEAD_DIM = 64


def median_times(fns: dict, repeats: int, device: torch.device) -> dict:
    """Median wall time in seconds of each fn(), after two warm-up calls, the calls interleaved in rounds
    (toma_bench.run), so that a slow spell of the machine hits every measurement alike instead of a few.
    Wall time: on CUDA the process CPU time is the host's launches, not the kernels."""
    sync = run.device_sync(device)
    for fn in fns.values():
        fn(), fn()
    timings = run.interleave(list(fns.values()), repeats, lambda fn: run.timed(fn, sync)[1:])
    return {name: t.median_wall for name, t in zip(fns, timings)}


def attention(x: torch.Tensor) -> torch.Tensor:
    B, N, C = x.shape
    q = x.view(B, N, C // HEAD_DIM, HEAD_DIM).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q)


def bench_shape(shape, hw, device, dtype, repeats):
    """The full-length attention time and rows of (method, {column: seconds or None})."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    gen = torch.Generator(device).manual_seed(0)
    fns, methods = {"attn": lambda: attention(x)}, []
    for window in WINDOWS:
        name = f"ToMA window {window}"
        plan = plan_tiles(x, hw, window, RATIO, generator=gen)
        merged = plan.merge(x)
        fns[name, "select"] = lambda window=window: plan_tiles(x, hw, window, RATIO, generator=gen)
        fns[name, "weights"] = lambda window=window, d=plan.destinations: plan_tiles(x, hw, window, RATIO,
                                                                                     destinations=d)
        fns[name, "merge"] = lambda p=plan: p.merge(x)
        fns[name, "unmerge"] = lambda p=plan, m=merged: p.unmerge(m)
        methods.append((name, merged.shape[1]))
    plan = tomesd_plan(x, hw, RATIO, generator=gen)
    merged = plan.merge(x)
    fns["ToMeSD 2x2", "select"] = lambda: tomesd_plan(x, hw, RATIO, generator=gen)
    fns["ToMeSD 2x2", "merge"] = lambda: plan.merge(x)
    fns["ToMeSD 2x2", "unmerge"] = lambda: plan.unmerge(merged)
    methods.append(("ToMeSD 2x2", merged.shape[1]))
    for n in {n for _, n in methods}:
        fns["attn", n] = lambda n=n: attention(x[:, :n])
    t = median_times(fns, repeats, device)
    rows = [(name, {"select": t[name, "select"], "weights": t.get((name, "weights")), "merge": t[name, "merge"],
                    "unmerge": t[name, "unmerge"], "attn": t["attn", n]}) for name, n in methods]
    return t["attn"], rows


def cost_table(attn_n, rows) -> str:
    """The costs of ``rows`` (from bench_shape) in % of the full-length attention time ``attn_n``."""
    head = ["method", "select", "weights", "merge", "unmerge", "attn N'", "saved", "overhead", "net"]
    lines = []
    for name, t in rows:
        pct = {k: None if v is None else 100 * v / attn_n for k, v in t.items()}
        saved = 100 - pct["attn"]
        cost = pct["select"] + pct["merge"] + pct["unmerge"]
        cells = [pct["select"], pct["weights"], pct["merge"], pct["unmerge"], pct["attn"], saved,
                 100 * cost / saved if saved > 0 else float("inf"), saved - cost]
        lines.append([name] + [format_cell(c, "{:.1f}%") for c in cells])
    return format_table(head, lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toma_bench.engine", description=__doc__.split("\n\n")[0])
    run.common_arguments(ap, device_help="auto: CPU fp32, plus CUDA fp16 when available", repeats_default=7,
                         repeats_help="timed calls per measurement (median)")
    args = ap.parse_args(argv)
    if args.device == "cuda":
        run.resolve_device(ap, args.device)
    run.set_threads(args.threads)
    runs = []
    if args.device in ("auto", "cpu"):
        threads = torch.get_num_threads()
        runs.append((torch.device("cpu"), torch.float32, f"CPU, {threads} thread{'s' * (threads > 1)}"))
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        runs.append((torch.device("cuda"), torch.float16, torch.cuda.get_device_name()))
    print(run.header("python -m toma_bench.engine", argv, " and ".join(name for *_, name in runs),
                     f"ratio {RATIO}; median of {args.repeats}; costs in % of one SDPA self-attention over the full "
                     "input"))
    with torch.inference_mode():
        for device, dtype, name in runs:
            for shape, hw in SHAPES:
                attn_n, rows = bench_shape(shape, hw, device, dtype, args.repeats)
                print(f"\n{name}, {str(dtype).removeprefix('torch.')}, x {tuple(shape)} "
                      f"[{hw[0]}x{hw[1]}], SDPA {1000 * attn_n:.2f} ms")
                print(cost_table(attn_n, rows))


if __name__ == "__main__":
    main()
