"""The main job: unpatched vs ToMA vs ToMeSD in a real headless ComfyUI, driven over its HTTP API, with a
table of sampling times and a side-by-side picture.

    bash tests/setup_host.sh && .venv/bin/python -m toma_bench.main_job
    ~/ComfyUI/venv/bin/python -m toma_bench.main_job --comfyui ~/ComfyUI --ckpt v1-5-pruned-emaonly.safetensors

It starts ComfyUI's own ``main.py --cpu`` (the pinned test tree, or ``--comfyui DIR`` / COMFYUI_PATH)
with this pack installed, on a free port of 127.0.0.1, on one CPU thread (``--threads``), and stops it by its pid at
the end. The Python that runs the job runs the server: the harness's venv, or a ComfyUI's own Python (the job needs
nothing that ComfyUI does not install). Before starting, it checks the tree's requirements.txt against that Python
and names what is missing (``--install-requirements`` pip-installs it, the installed torch kept).

The default model is the trained SD1.x-layout proxy of toma_bench/proxy.py (``toma_bench/proxies/
sd15_proxy.safetensors``, or ``--proxy FILE``): a small denoiser whose samples are pictures, so the
side-by-side shows what merging changes. It runs through toma_bench/workflows/sd15_proxy_compare_api.json,
the shipped comparison's three branches on the test-only proxy loader and decoder nodes. ``--ckpt`` runs
the shipped workflows/sd15_compare_api.json on an SD1.x/SD2.x checkpoint instead.

After a warm-up run of each method's branch (its own prompt, as timed, from a seed no timed run uses: a
single prompt of all branches at one step left round 1 costlier than the others), the methods run
interleaved: round r runs each method as
its own prompt (ComfyUI caches node outputs, so a shared graph would time only the first branch) from
seed + r, in an order rotated per round so that no method always goes first. A run's times are the wall
time and the server's CPU time of its KSampler node, both read at the websocket's ``executing``
messages. On a busy machine wall times measure the other jobs as much as the method: the job then says
so, and the CPU-time columns are the ones to read. Those hold only on one server thread (the default): with more,
a thread waiting for the others spins, counting CPU time, while they wait for a core, and on a busy 2-core machine
2 threads scattered a run's CPU time from 4.4 to 28.6 s and flipped the headline from 1.16x faster to 4.99x
slower. It uses the same server helpers as the tests
(toma_bench/server.py, toma_bench/comfy_host.py).
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from statistics import median
from typing import NamedTuple

from . import comfy_host, comfy_requirements, proxy, server
from .metrics import psnr
from .tables import format_table

REPO = Path(__file__).resolve().parent.parent
CKPT_WORKFLOW = "sd15_compare_api.json"  # in workflows/, shipped to users
PROXY_WORKFLOW = Path(__file__).resolve().parent / "workflows" / "sd15_proxy_compare_api.json"  # test-only nodes
DEFAULT_PROXY = proxy.PROXY_DIR / proxy.SPECS["sd15"].file
LABELS = {"unpatched": "unpatched", "toma": "ToMA", "tomesd": "ToMeSD"}  # SaveImage prefix -> table label
TEXT_ENCODER_PREFIXES = ("cond_stage_model.", "conditioner.", "text_encoders.")  # SD1.x/2.x, SDXL, SD3-style
# Defaults that differ by model: the proxy was trained on 64x64 pictures and is unconditional (cfg 1
# runs one model call per step); it samples in about a second, so more rounds cost little.
DEFAULTS = {"proxy": {"size": 64, "steps": 20, "cfg": 1.0, "repeats": 5},
            "ckpt": {"size": 512, "steps": 10, "cfg": 7.0, "repeats": 3}}
# A latent pixel of SD1.x models covers 8x8 pixels; one of the proxy covers block x block pixels.
SD_LATENT_BLOCK = 8
PROXY_SIZE_STEP = 16  # proxy pictures: latent side size/2, a multiple of 8 as SD latents of 64-pixel multiples
STARVED_SHARE = 0.75  # a KSampler that got less CPU time than this share of its wall time waited for a core
CPU_TICK = 0.01  # psutil reads CPU times in 10 ms clock ticks
AMPLIFY = 4  # difference panels show |method - unpatched| times this
PANEL = 256  # smaller pictures are enlarged (nearest neighbour) to about this many pixels per side
CAPTION = 30  # pixels above each panel: two lines of Pillow's default font


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m toma_bench.main_job", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfyui", metavar="DIR", help="ComfyUI tree to run (default: $COMFYUI_PATH, else the "
                   "pinned test tree .comfyui/ made by tests/setup_host.sh)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--proxy", metavar="FILE", help="a trained SD1.x-layout proxy file (default: "
                       f"toma_bench/proxies/{DEFAULT_PROXY.name}, written by python -m toma_bench.proxy_training train "
                       "--arch sd15)")
    model.add_argument("--ckpt", metavar="NAME_OR_PATH", help="an SD1.x/SD2.x checkpoint instead of the proxy: "
                       "a file path, or a name in the tree's models/checkpoints or --models-dir")
    p.add_argument("--models-dir", metavar="DIR", help="a ComfyUI-style models folder to add (its checkpoints/)")
    p.add_argument("--size", type=int, help="picture width and height in pixels (default: 64 for the proxy, a "
                   f"multiple of {PROXY_SIZE_STEP}; 512 for --ckpt, a multiple of 8)")
    p.add_argument("--steps", type=int, help="sampler steps (default: 20 for the proxy, 10 for --ckpt)")
    p.add_argument("--cfg", type=float, help="classifier-free guidance scale (default: 1.0 for the proxy, which "
                   "is unconditional; 7.0 for --ckpt)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, help="rounds of timed runs (default: 5 for the proxy, 3 for --ckpt); "
                   "round r runs every method from seed+r (a new seed defeats ComfyUI's cache), the table "
                   "shows medians")
    p.add_argument("--attention", choices=["sdpa", "default"], default="sdpa",
                   help="sdpa: --use-pytorch-cross-attention (default); default: ComfyUI's CPU default "
                        "(sub-quadratic on CPU, about 3x slower per attention call at 512x512)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the server (OMP_NUM_THREADS; default "
                   "1). One thread keeps its CPU times, and so the headline, steady when other jobs share the "
                   "machine; more are faster on a quiet machine, but on a busy one their CPU times scatter too")
    p.add_argument("--install-requirements", action="store_true", help="pip-install what the ComfyUI tree's "
                   "requirements.txt lists and this Python lacks (the installed torch kept) before starting it; "
                   "without it, the job names what is missing and stops")
    p.add_argument("--output", metavar="DIR", help="where images and the picture go (default: "
                   "output/main_job/<time>)")
    args = p.parse_args(argv)
    for name, value in DEFAULTS["ckpt" if args.ckpt else "proxy"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# -- model ------------------------------------------------------------------------------------------

def find_proxy(path: str | None) -> Path:
    """The proxy file (--proxy, else the shipped one); a clear error when it is missing or not SD1.x."""
    candidate = Path(path).expanduser() if path else DEFAULT_PROXY
    if not candidate.is_file():
        raise SystemExit(f"[main-job] no trained proxy at {candidate}: train it with `python -m toma_bench.proxy_training "
                         f"train --arch sd15` (writes toma_bench/proxies/{DEFAULT_PROXY.name}), or pass "
                         "--proxy FILE, or --ckpt for an SD1.x checkpoint")
    arch = proxy.read_metadata(candidate)["arch"]
    if arch != "sd15":
        raise SystemExit(f"[main-job] {candidate} is a {arch} proxy; the comparison graph is SD1.x (--arch sd15)")
    return candidate.resolve()


def find_checkpoint(name_or_path: str, models_dir: str | None) -> Path:
    """The checkpoint file: a path as given, else the name in --models-dir/checkpoints or the tree's own."""
    candidate = Path(name_or_path).expanduser()
    if candidate.is_file():
        return candidate.resolve()
    folders = [Path(models_dir).expanduser() / "checkpoints"] if models_dir else []
    folders.append(comfy_host.comfy_root() / "models" / "checkpoints")
    for folder in folders:
        if (folder / name_or_path).is_file():
            return (folder / name_or_path).resolve()
    raise SystemExit(f"[main-job] checkpoint {name_or_path!r} not found as a file nor in "
                     f"{', '.join(map(str, folders))}")


def has_text_encoder(path: Path) -> bool:
    """Whether a checkpoint carries text-encoder weights (a .safetensors without them needs the test
    conditioning node instead of CLIPTextEncode). Other formats are assumed to have them."""
    if path.suffix != ".safetensors":
        return True
    import safetensors

    with safetensors.safe_open(str(path), framework="pt") as f:
        return any(key.startswith(TEXT_ENCODER_PREFIXES) for key in f.keys())


# -- graphs -----------------------------------------------------------------------------------------

def configured(graph: dict, ckpt_name: str, size: int, steps: int, cfg: float, text_encoder: bool) -> dict:
    """The shipped comparison graph on the chosen checkpoint, size and sampler settings."""
    graph = server.set_inputs(graph, "CheckpointLoaderSimple", ckpt_name=ckpt_name)
    graph = server.set_inputs(graph, "EmptyLatentImage", width=size, height=size)
    graph = server.set_inputs(graph, "KSampler", steps=steps, cfg=cfg)
    return graph if text_encoder else server.use_test_conditioning(graph)


def proxy_configured(path: Path, size: int, steps: int, cfg: float) -> dict:
    """The proxy comparison graph on the proxy file, picture size and sampler settings. EmptyLatentImage
    takes SD pixels (8 per latent pixel); the proxy decodes a latent pixel into block x block pixels."""
    latent_side = size // proxy.SPECS["sd15"].block
    graph = server.set_inputs(json.loads(PROXY_WORKFLOW.read_text()), "ToMAProxyLoader", proxy=str(path))
    graph = server.set_inputs(graph, "EmptyLatentImage", width=latent_side * SD_LATENT_BLOCK,
                              height=latent_side * SD_LATENT_BLOCK)
    return server.set_inputs(graph, "KSampler", steps=steps, cfg=cfg)


def ancestors(graph: dict, node_id: str) -> set[str]:
    """``node_id`` and every node it depends on through links."""
    seen, todo = set(), [node_id]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += [value[0] for value in graph[current]["inputs"].values() if isinstance(value, list)]
    return seen


def branches(graph: dict) -> dict[str, tuple[dict, str]]:
    """{label: (graph of one SaveImage and its ancestors, id of its KSampler)}, in graph order."""
    out = {}
    for save_id, node in graph.items():
        if node["class_type"] == "SaveImage":
            label = node["inputs"]["filename_prefix"].rsplit("/", 1)[-1]
            keep = ancestors(graph, save_id)
            sampler = next(i for i in keep if graph[i]["class_type"] == "KSampler")
            out[label] = ({i: copy.deepcopy(graph[i]) for i in graph if i in keep}, sampler)
    return out


def with_seed(graph: dict, seed: int) -> dict:
    return server.set_inputs(graph, "KSampler", seed=seed)


# -- running ----------------------------------------------------------------------------------------

def interleaved(labels: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, label) in run order: each round runs every label once, the order rotated by one per round,
    so over len(labels) rounds each label runs first, second, ... once (whatever the machine does in the
    first run of a round, no method always gets it)."""
    return [(r, labels[(r + i) % len(labels)]) for r in range(rounds) for i in range(len(labels))]


def server_cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class Timing(NamedTuple):
    wall: float  # wall seconds of the KSampler node
    cpu: float  # CPU seconds the server process spent meanwhile (all its threads)


class RunWatcher:
    """on_message callback of one prompt: stamps the server's CPU time at each ``executing`` message (a
    node starts, or node None: the prompt ended) and prints a sampler step at most every PROGRESS_EVERY
    seconds (a proxy run lasts about a second; a 512-pixel checkpoint run minutes)."""

    PROGRESS_EVERY = 5.0

    def __init__(self, pid: int, name: str):
        self.pid, self.name = pid, name
        self.started = self.shown = time.perf_counter()
        self.cpu_at: list[tuple[str | None, float]] = []  # (node id, server CPU seconds) per executing message

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "executing":
            self.cpu_at.append((data.get("node"), server_cpu_seconds(self.pid)))
        elif kind == "progress" and time.perf_counter() - self.shown >= self.PROGRESS_EVERY:
            self.shown = time.perf_counter()
            print(f"  {self.name:<10} step {data['value']:>3}/{data['max']:<3} {self.shown - self.started:7.1f} s",
                  flush=True)

    def node_cpu_seconds(self, node: str) -> float:
        """Server CPU seconds from ``node``'s executing message to the next one."""
        at = [i for i, (n, _) in enumerate(self.cpu_at) if n == node][0]
        return self.cpu_at[at + 1][1] - self.cpu_at[at][1]


def timed_runs(client, graph: dict, seed: int, repeats: int) -> tuple[dict, dict]:
    """Warm up every branch, then ``repeats`` interleaved rounds of every branch, each run its own prompt.

    The warm-up runs each branch once exactly as the rounds run it (its own prompt, all its steps), so the
    first timed round finds every method's code and model state as the later rounds do.
    Returns ({label: [Timing per round]}, {label: images of round 0}).
    """
    started = time.perf_counter()
    parts = branches(graph)
    warm_seed = seed + repeats  # a seed no timed run uses, so no timed KSampler is served from the cache
    print(f"[main-job] warm-up: each method's branch as timed, seed {warm_seed} (loads the model; not timed)",
          flush=True)
    for part, _ in parts.values():
        client.run(with_seed(part, warm_seed))
    print(f"[main-job] warm-up done in {time.perf_counter() - started:.1f} s", flush=True)
    timings = {label: [] for label in parts}
    images = {}
    for r, label in interleaved(list(parts), repeats):
        part, sampler = parts[label]
        name = LABELS.get(label, label)
        watcher = RunWatcher(client.pid, name)
        run = client.run(with_seed(part, seed + r), on_message=watcher)
        timing = Timing(run.node_seconds()[sampler], watcher.node_cpu_seconds(sampler))
        timings[label].append(timing)
        print(f"[main-job] round {r + 1}/{repeats} {name:<10} seed {seed + r}: KSampler {timing.wall:6.2f} s wall, "
              f"{timing.cpu:6.2f} s CPU", flush=True)
        if r == 0:
            images[label] = [client.view(**image) for image in run.images()]
    return timings, images


def attention_line(log: Path) -> str:
    """ComfyUI's own log line naming the cross-attention backend it picked, without the colour codes and
    level tag ComfyUI v0.33.0 puts before it ("\x1b[32m[INFO]\x1b[0m Using pytorch attention")."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    lines = [re.sub(r"^\[[A-Z]+\]\s*", "", line.strip()) for line in text.splitlines()
             if re.search(r"cross attention|Using .*attention", line)]
    return lines[0] if lines else "(ComfyUI did not log its attention backend)"


# -- judging the machine ----------------------------------------------------------------------------

def busy_warnings(load_before: float, load_after: float, cores: int, threads: int,
                  runs: list[Timing]) -> list[str]:
    """Why the wall times may not measure the methods; empty when the machine looked quiet.

    Busy before: the 1-minute load average left fewer free cores than the server's threads (with half a
    core of slack for the sampling noise of the average). Busy during: the load average at the end,
    which includes the server itself, exceeded the cores. Starved: a KSampler got less CPU time than
    STARVED_SHARE of its wall time, less than one core, whatever its threads: it waited for a core.
    """
    warnings = []
    if load_before > cores - threads + 0.5:
        warnings.append(f"the machine was busy before the job: load average {load_before:.2f} on {cores} cores "
                        f"leaves fewer free cores than the server's {threads} thread(s)")
    if load_after > cores + 0.5:
        warnings.append(f"the machine was busy during the job: load average {load_after:.2f} at the end (this job "
                        f"included) exceeds its {cores} cores")
    starved = [t for t in runs if t.cpu + 2 * CPU_TICK < STARVED_SHARE * t.wall]
    if starved:
        warnings.append(f"{len(starved)} of {len(runs)} runs were starved: their KSampler got less CPU time than "
                        f"{STARVED_SHARE:.0%} of its wall time (it waited for a core)")
    if warnings and threads == 1:
        warnings.append("so the wall-time ratios are unreliable here: read the CPU-time columns (the server's one "
                        "thread counts CPU time only while it works)")
    elif warnings:
        warnings.append(f"so the wall-time ratios are unreliable here, and with {threads} server threads the "
                        "CPU-time columns too (a thread waiting for the others spins, counting CPU time, while they "
                        "wait for a core): run again with --threads 1 (the default)")
    return warnings


# -- results ----------------------------------------------------------------------------------------

def speedup(timings: dict, label: str, field: str) -> tuple[float, float, float]:
    """(ratio of medians, lowest, highest per-round ratio) of unpatched over ``label`` for one Timing field."""
    base = [getattr(t, field) for t in timings["unpatched"]]
    runs = [getattr(t, field) for t in timings[label]]
    per_round = [b / x for b, x in zip(base, runs)]
    return median(base) / median(runs), min(per_round), max(per_round)


def pixels(png: bytes):
    """A PNG as an RGB uint8 array."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def image_psnr(image, reference) -> float:
    """PSNR in dB of two uint8 images, peak 255; inf when identical."""
    import torch

    return psnr(torch.from_numpy(image), torch.from_numpy(reference), peak=255)


def table(timings: dict, images: dict) -> str:
    """Per method, medians over rounds of the KSampler's wall and CPU time, each with its speed-up over
    unpatched (ratio of medians) and the range of the per-round ratios; the PSNR of the round-0 picture
    against the unpatched one."""
    head = ["method", "wall s", "wall speed-up", "rounds", "CPU s", "CPU speed-up", "rounds", "PSNR dB"]
    reference = pixels(images["unpatched"][0])
    rows = []
    for label, runs in timings.items():
        row = [LABELS.get(label, label)]
        for field in ("wall", "cpu"):
            ratio, low, high = speedup(timings, label, field)
            row += [f"{median(getattr(t, field) for t in runs):.2f}", f"{ratio:.2f}x", f"{low:.2f}-{high:.2f}x"]
        row.append("-" if label == "unpatched" else f"{image_psnr(pixels(images[label][0]), reference):.1f}")
        rows.append(row)
    return format_table(head, rows)


def verdict(timings: dict) -> str:
    """The merged methods ranked by CPU time (the server runs on the CPU), each faster or slower."""
    ranked = sorted((speedup(timings, label, "cpu")[0], LABELS.get(label, label)) for label in timings
                    if label != "unpatched")[::-1]
    parts = [f"{name} as fast (1.00x)" if f"{ratio:.2f}" == "1.00" else f"{name} {ratio:.2f}x faster" if ratio > 1
             else f"{name} {1 / ratio:.2f}x slower" for ratio, name in ranked]
    return "by CPU time, against unpatched: " + ", ".join(parts)


def side_by_side(images: dict, timings: dict, path: Path) -> None:
    """Top row: the round-0 picture of each method, captioned with its median KSampler CPU time. Bottom row,
    under each merged method: |method - unpatched| x AMPLIFY with its PSNR; under unpatched, the legend.
    Pictures smaller than PANEL pixels are enlarged, nearest neighbour (each pixel a visible square)."""
    import numpy as np
    from PIL import Image, ImageDraw

    reference = pixels(images["unpatched"][0])
    height, width = reference.shape[:2]
    zoom = max(1, PANEL // width)
    side_w, side_h = width * zoom, height * zoom

    def panel(array):
        return Image.fromarray(array).resize((side_w, side_h), Image.NEAREST)

    canvas = Image.new("RGB", (side_w * len(images), 2 * (side_h + CAPTION)), "white")
    draw = ImageDraw.Draw(canvas)
    for i, label in enumerate(images):
        x, name = i * side_w, LABELS.get(label, label)
        picture = pixels(images[label][0])
        canvas.paste(panel(picture), (x, CAPTION))
        cpu = median(t.cpu for t in timings[label])
        speed = "" if label == "unpatched" else f", speed-up {speedup(timings, label, 'cpu')[0]:.2f}x"
        draw.text((x + 4, 2), f"{name}\nKSampler {cpu:.2f} s CPU{speed}", fill="black")
        top = side_h + CAPTION
        if label == "unpatched":
            draw.text((x + 4, top + 2), f"below: |method - unpatched| x {AMPLIFY}\n(black: no change)", fill="black")
            continue
        difference = np.abs(picture.astype(np.int16) - reference.astype(np.int16)) * AMPLIFY
        canvas.paste(panel(difference.clip(0, 255).astype(np.uint8)), (x, top + CAPTION))
        draw.text((x + 4, top + 2), f"|{name} - unpatched| x {AMPLIFY}\nPSNR {image_psnr(picture, reference):.1f} dB",
                  fill="black")
    canvas.save(path)


def needs_requirements(root: Path, install: bool) -> None:
    """Stop, naming them, when this Python lacks packages the tree at ``root`` needs to start; with ``install``,
    pip-install them instead."""
    lacking = comfy_requirements.missing(root)
    if not lacking:
        return
    if not install:
        raise SystemExit(f"[main-job] ComfyUI at {root} needs what this Python ({sys.executable}) lacks: "
                         f"{', '.join(lacking)} (from its requirements.txt). Run again with --install-requirements "
                         "to pip-install them (the installed torch is kept), or run the job with that ComfyUI's "
                         "own Python")
    print(f"[main-job] installing what ComfyUI at {root} needs into {sys.executable}: {', '.join(lacking)}",
          flush=True)
    comfy_requirements.install(lacking)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.comfyui:
        os.environ["COMFYUI_PATH"] = str(Path(args.comfyui).expanduser().resolve())
    size_step = 8 if args.ckpt else PROXY_SIZE_STEP
    if args.size % size_step or args.size < size_step or args.steps < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit(f"[main-job] --size must be a multiple of {size_step}; --steps, --repeats and --threads "
                         "at least 1")
    root = comfy_host.comfy_root()
    needs_requirements(root, args.install_requirements)
    output = Path(args.output) if args.output else REPO / "output" / "main_job" / time.strftime("%Y%m%d-%H%M%S")
    if args.ckpt:
        model = find_checkpoint(args.ckpt, args.models_dir)
        text_encoder = has_text_encoder(model)
        graph = configured(server.load_workflow(CKPT_WORKFLOW), model.name, args.size, args.steps, args.cfg,
                           text_encoder)
        models = {"checkpoints": model.parent}
        model_line = f"checkpoint {model}{'' if text_encoder else ' (no text encoder: random test conditioning)'}"
        workflow = f"workflows/{CKPT_WORKFLOW}"
    else:
        model = find_proxy(args.proxy)
        training = proxy.read_metadata(model)["training"]
        graph, models = proxy_configured(model, args.size, args.steps, args.cfg), None
        model_line = (f"trained SD1.x-layout proxy {model} ({training.get('size', '?')}, "
                      f"{training.get('steps', '?')} training steps)")
        workflow = PROXY_WORKFLOW.relative_to(REPO).as_posix()
    output.mkdir(parents=True, exist_ok=True)
    extra = ["--use-pytorch-cross-attention"] if args.attention == "sdpa" else []
    threads, cores = args.threads, os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    print(f"[main-job] ComfyUI: {root}\n[main-job] model: {model_line}\n"
          f"[main-job] workflow: {workflow}, {args.size}x{args.size}, {args.steps} steps, cfg {args.cfg}, "
          f"seed {args.seed}, {args.repeats} interleaved round(s), {threads} server CPU thread(s)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="toma-main-job-"))
    ok = False
    try:
        with server.comfy_server(workdir, *extra, models=models, env={"OMP_NUM_THREADS": str(threads)}) as client:
            print(f"[main-job] server pid {client.pid} at {client.base_url}\n"
                  f"[main-job] attention: {args.attention} -> {attention_line(client.log)}", flush=True)
            timings, images = timed_runs(client, graph, args.seed, args.repeats)
        load_after = os.getloadavg()[0]
        for label, blobs in images.items():
            for k, blob in enumerate(blobs):
                (output / f"{label}{'' if k == 0 else f'_{k}'}.png").write_bytes(blob)
        side_by_side(images, timings, output / "side_by_side.png")
        print(f"\n[main-job] settings: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
              f"{load_before:.2f} before, {load_after:.2f} after, {cores} CPU cores; {threads} server thread(s); "
              f"model {model.name}; {args.size}x{args.size}; {args.steps} steps; {args.repeats} round(s)")
        print(f"[main-job] KSampler medians over {args.repeats} round(s); speed-up: unpatched median / method "
              "median; rounds: lowest-highest per-round ratio; PSNR of round 1's picture vs unpatched\n")
        print(table(timings, images) + "\n")
        print(f"[main-job] {verdict(timings)}")
        for warning in busy_warnings(load_before, load_after, cores, threads,
                                     [t for runs in timings.values() for t in runs]):
            print(f"[main-job] WARNING: {warning}")
        print(f"[main-job] images and side_by_side.png in {output}")
        ok = True
    except (server.ServerError, server.PromptRefused) as error:
        print(f"[main-job] FAILED: {error}", file=sys.stderr)
    except Exception:
        traceback.print_exc()
    finally:
        log = workdir / server.LOG_NAME
        if log.is_file():
            shutil.copy(log, output / "comfyui.log")
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"[main-job] {'done' if ok else 'FAILED'}; ComfyUI's log: {output / 'comfyui.log'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
