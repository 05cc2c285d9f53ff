"""Flux-architecture speed benchmark: ToMA on a random-weight Flux sampled through ComfyUI's own sampler.

    python -m toma_bench.flux [--device auto|cpu|cuda] [--steps 6] [--ratios R,...] [--scopes block,attention]
                              [--merge-every 1,3] [--repeats 3] [--latent 64x64] [--tokens 256] [--window-size 4]
                              [--reuse 5] [--threads N]

Speed only. The weights are random (nothing can be downloaded here): the timings are those of the
architecture, while how far merging moves a random model's output says nothing about pictures.
Fidelity is measured on the trained proxies: ``python -m toma_bench.curves --arch flux``.

CUDA: FLUX.1-dev widths and depths (hidden 3072, 19 double + 38 single blocks) in bf16, a 128x128 latent
(1024x1024 image, 4096 image tokens) and 512 text tokens. CPU: FLUX_SMALL (hidden 512, 4 double + 8
single blocks) in fp32, a 64x64 latent (1024 image tokens) and 256 text tokens.

Variants: unpatched, then ToMA at every ratio with every scope (the Advanced node's ``scope``: "block"
runs whole double blocks on merged tokens, "attention" merges only their attention; single blocks merge
whole either way) and every ``merge_every`` (the Advanced
node's input: merge on steps 0, k, 2k, ... only), patched by ``ToMAPatchModelAdvanced`` with the node's
other defaults. Every variant samples the same img2img job: a structured latent, denoise 0.75, euler,
cfg 1. After one untimed 2-step run of every variant (loading, kernels, allocator), the variants run
interleaved, repeat after repeat, in an order rotated each repeat (toma_bench.run), so a slow spell of a
shared machine hits all of them alike.

Times are of whole runs (every step, the first included), not of steps: with merge_every 3 a run mixes
merged and unmerged steps, and a per-step median would pick one kind. Columns: ``CPU speed-up`` (CPU
runs): median over repeats of unpatched / variant process CPU time of a run, which a shared machine's
other jobs do not inflate (use one thread there: a descheduled OpenMP thread stalls the others);
``spread``: the lowest and highest of those per-repeat ratios; ``speed-up``: the same from wall time
(the one that counts on CUDA); ``run ms``, ``CPU ms``: median wall and CPU time of a run; ``image
tokens``: per merged block, full -> merged; ``select %`` and ``merge %``: the runtime's own clocks
(destination selection; merge + unmerge + position gathers) in % of the run's wall time, CUDA events on
CUDA (nodes.live_stats.StageClock), read after each run.
"""
import argparse
import time
from dataclasses import dataclass

import torch

from . import comfy_host, models, run, sampling
from .tables import format_cell, format_table

SCOPES = ("block", "attention")  # the Advanced node's scope choices that place the merge on a Flux model
MERGE_EVERY_RANGE = (1, 100)  # the Advanced node's merge_every input
RATIO_RANGE = (0.0, 0.9)  # the nodes' ratio input; 0 (no merging) is the unpatched variant already


@dataclass(frozen=True)
class Variant:
    """One model of the table: ToMA's ratio, scope and merge_every; ratio None is the unpatched model."""

    ratio: float | None = None
    scope: str | None = None
    merge_every: int = 1

    @property
    def label(self) -> str:
        if self.ratio is None:
            return "unpatched"
        every = "" if self.merge_every == 1 else f" every {self.merge_every}"
        return f"ToMA {self.scope} r={self.ratio:g}{every}"


def variants_of(ratios, scopes, merge_every) -> list[Variant]:
    """Unpatched, then every scope x merge_every at each ratio, grouped by ratio so variants that remove
    as many tokens sit together."""
    return [Variant()] + [Variant(r, s, k) for r in ratios for s in scopes for k in merge_every]


def patch(pack, model, variant: Variant, window: int, reuse: int):
    """(patched clone, list that receives each run's summary); (model, None) for unpatched."""
    if variant.ratio is None:
        return model, None
    node = pack.nodes.toma_nodes.ToMAPatchModelAdvanced()
    (patched,) = node.patch(model, variant.ratio, window, reuse, scope=variant.scope, merge_every=variant.merge_every)
    summaries = []
    pack.nodes.runtime.runtime_of(patched).run_listeners.append(summaries.append)
    return patched, summaries


def run_once(model, job: dict, device: str) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one sampling run."""
    _, wall, cpu = run.timed(lambda: sampling.sample(model, job["conditioning"], job["latent"], steps=job["steps"],
                                                     scheduler="simple", denoise=0.75, noise=job["noise"]),
                             run.device_sync(device))
    return wall, cpu


def variant_table(rows: list[dict]) -> str:
    head = ["variant", "CPU speed-up", "spread", "speed-up", "run ms", "CPU ms", "image tokens", "select %", "merge %"]
    return format_table(head, [[r["name"], format_cell(r["cpu_speedup"], "{:.2f}x"), format_cell(r["cpu_spread"], "{}"),
                                f"{r['speedup']:.2f}x", f"{1000 * r['wall']:.0f}",
                                format_cell(r["cpu"] and 1000 * r["cpu"], "{:.0f}"), r["tokens"],
                                format_cell(r["select"], "{:.1f}%"), format_cell(r["merge"], "{:.1f}%")] for r in rows])


def block_group(fields: dict) -> str:
    """A level's block group, from its fields in a runtime summary ('two-stream')."""
    return fields["group"]


def comma_list(ap, option: str, text: str, convert, allowed: str, valid) -> list:
    """``text`` split on commas, each item through ``convert`` and checked by ``valid``; an argparse error
    naming ``option`` and what it allows otherwise."""
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except ValueError:
        values = None
    if not values or not all(valid(v) for v in values):
        ap.error(f"{option} must be a comma list of {allowed}, got {text!r}")
    return values


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m toma_bench.flux", description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="sampling steps per run (default 6)")
    ap.add_argument("--ratios", default=None,
                    help="comma-separated ToMA ratios (default 0.25,0.5,0.75 on CUDA; 0.5,0.75 on the CPU, where "
                         "each ratio adds len(scopes) x len(merge-every) runs per repeat)")
    ap.add_argument("--scopes", default="block,attention",
                    help="comma list of the Advanced node's scopes to run: block, attention (default both)")
    ap.add_argument("--merge-every", default="1,3",
                    help="comma list of the Advanced node's merge_every, integers in [1, 100] (default 1,3)")
    ap.add_argument("--latent", default=None, help="latent HxW (default 128x128 on CUDA, 64x64 on CPU)")
    ap.add_argument("--tokens", type=int, default=None, help="text tokens (default 512 on CUDA, 256 on CPU)")
    ap.add_argument("--window-size", type=int, default=4,
                    help="side of ToMA's windows in tokens, the nodes' window_size (default 4)")
    ap.add_argument("--reuse", type=int, default=5, help="steps between destination recomputations (default 5)")
    run.common_arguments(ap, device_help="auto: CUDA when available (full FLUX.1-dev, bf16), else CPU (FLUX_SMALL, fp32)",
                         repeats_default=3, repeats_help="interleaved runs of every variant (default 3)")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        ap.error("--steps must be >= 2 and --repeats >= 1")
    if not 1 <= args.window_size <= 32 or args.reuse < 1:
        ap.error("--window-size must be between 1 and 32 and --reuse >= 1")
    args.device = run.resolve_device(ap, args.device)
    cuda = args.device == "cuda"
    # On a 2-core CPU a FLUX_SMALL run of 6 steps costs about 33 s unpatched and 20-28 s merged: with the
    # default scopes and schedules, 3 ratios (13 variants) take about 16 min at 3 repeats, 2 ratios about 11.
    low, high = RATIO_RANGE
    args.ratios = comma_list(ap, "--ratios", args.ratios or ("0.25,0.5,0.75" if cuda else "0.5,0.75"), float,
                             f"numbers in ({low:g}, {high:g}]", lambda r: low < r <= high)
    args.scopes = comma_list(ap, "--scopes", args.scopes, str, ", ".join(SCOPES), lambda s: s in SCOPES)
    low, high = MERGE_EVERY_RANGE
    args.merge_every = comma_list(ap, "--merge-every", args.merge_every, int, f"integers in [{low}, {high}]",
                                  lambda k: low <= k <= high)
    try:
        args.latent = tuple(int(v) for v in (args.latent or ("128x128" if cuda else "64x64")).lower().split("x"))
        assert len(args.latent) == 2 and min(args.latent) >= 2
    except (ValueError, AssertionError):
        ap.error(f"--latent must be HxW with sides >= 2, got {args.latent!r}")
    args.tokens = args.tokens or (512 if cuda else 256)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run.set_threads(args.threads)
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
    variants = variants_of(args.ratios, args.scopes, args.merge_every)
    patched = [patch(pack, model, v, args.window_size, args.reuse) for v in variants]
    dm = model.model.diffusion_model
    print(run.header("python -m toma_bench.flux", argv, run.device_name(args.device)))
    print(f"Flux architecture: hidden {dm.hidden_size}, {len(dm.double_blocks)} double + {len(dm.single_blocks)} "
          f"single blocks, {str(dtype).removeprefix('torch.')}, random weights (built in {built:.0f} s)")
    print(f"latent {H}x{W} ({-(-H // 2) * -(-W // 2)} image tokens), {args.tokens} text tokens, {args.steps} "
          f"euler steps at denoise 0.75, window {args.window_size}, reuse {args.reuse}; {args.repeats} interleaved "
          f"repeats of {len(variants)} variants, medians of whole runs", flush=True)

    with torch.inference_mode():
        for m, summaries in patched:  # warm-up: loading, kernels, allocator; its summaries are not timed runs
            run_once(m, dict(job, steps=2), args.device)
            if summaries is not None:
                summaries.clear()
        timings = run.interleave(patched, args.repeats, lambda variant: run_once(variant[0], job, args.device))

    rows = []
    for variant, (_, summaries), t in zip(variants, patched, timings):
        row = {"name": variant.label, "wall": t.median_wall, "speedup": t.speedups(timings[0], "wall")[0],
               "cpu": None, "cpu_speedup": None, "cpu_spread": None, "tokens": "all", "select": None, "merge": None}
        if not cuda:  # on CUDA the process CPU time is the host's launches and sync waits, not the model
            cpu_speedup, lowest, highest = t.speedups(timings[0], "cpu")
            row.update(cpu=t.median_cpu, cpu_speedup=cpu_speedup, cpu_spread=f"{lowest:.2f}-{highest:.2f}")
        if summaries:
            row["tokens"] = run.merged_tokens(summaries[-1], block_group, nothing="none merged")
            row["select"], row["merge"] = (run.stage_share(summaries, ["select"]),
                                           run.stage_share(summaries, ["merge", "unmerge"]))
        rows.append(row)

    print(f"{run.footer()}\n")
    print(variant_table(rows))


if __name__ == "__main__":
    main()
