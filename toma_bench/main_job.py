"""The main job: the shipped comparison workflow (unpatched vs ToMA vs ToMeSD, one seed) in a real
headless ComfyUI, driven over its HTTP API, with a table of sampling times and a side-by-side picture.

    bash tests/setup_host.sh && .venv/bin/python -m toma_bench.main_job
    .venv/bin/python -m toma_bench.main_job --comfyui ~/ComfyUI --ckpt v1-5-pruned-emaonly.safetensors

It starts ComfyUI's own ``main.py --cpu`` (the pinned test tree, or ``--comfyui DIR`` / COMFYUI_PATH)
with this pack installed, on a free port of 127.0.0.1, and stops it by its pid at the end. The model is
a random-weight SD1.5-width checkpoint written once into ``.cache/main_job/`` (or ``--ckpt``). Each
method runs as its own prompt (ComfyUI caches node outputs, so a shared graph would time only the first
branch) after one warm-up prompt that loads everything; the time of a run is the wall time of its KSampler
node, read from the websocket's ``executing`` messages. It uses the same server helpers as the tests
(toma_bench/server.py, toma_bench/comfy_host.py).
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from statistics import median
from typing import NamedTuple

from . import comfy_host, models, server
from .tables import format_table

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "main_job"
WORKFLOW = "sd15_compare_api.json"
LABELS = {"unpatched": "unpatched", "toma": "ToMA", "tomesd": "ToMeSD"}  # SaveImage prefix -> table label
TEXT_ENCODER_PREFIXES = ("cond_stage_model.", "conditioner.", "text_encoders.")  # SD1.x/2.x, SDXL, SD3-style


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m toma_bench.main_job", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--comfyui", metavar="DIR", help="ComfyUI tree to run (default: $COMFYUI_PATH, else the "
                   "pinned test tree .comfyui/ made by tests/setup_host.sh)")
    p.add_argument("--ckpt", metavar="NAME_OR_PATH", help="an SD1.x/SD2.x checkpoint: a file path, or a name in "
                   "the tree's models/checkpoints or --models-dir (default: a random-weight SD1.5-width model)")
    p.add_argument("--models-dir", metavar="DIR", help="a ComfyUI-style models folder to add (its checkpoints/)")
    p.add_argument("--size", type=int, default=512, help="image width and height in pixels (default 512)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=7.0)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--repeats", type=int, default=1, help="timed runs per method; repeat r uses seed+r "
                   "(a new seed defeats ComfyUI's cache) and the table shows the median")
    p.add_argument("--attention", choices=["sdpa", "default"], default="sdpa",
                   help="sdpa: --use-pytorch-cross-attention (default); default: ComfyUI's CPU default "
                        "(sub-quadratic on CPU, about 3x slower per attention call at 512x512)")
    p.add_argument("--threads", type=int, help="CPU threads of the server (OMP_NUM_THREADS; default: torch's "
                   "choice). 1 gives steadier times on a machine busy with other jobs")
    p.add_argument("--output", metavar="DIR", help="where images and the picture go (default: "
                   "output/main_job/<time>)")
    p.add_argument("--write-checkpoint", metavar="PATH", help=argparse.SUPPRESS)  # used by default_checkpoint
    return p.parse_args(argv)


# -- model ------------------------------------------------------------------------------------------

def default_unet_config() -> dict:
    """SD1.5's widths (320 channels, 768-wide text context, so ComfyUI detects SD1.5) on its two
    highest-resolution levels, one block each: where token merging acts, at a CPU-friendly 107M params."""
    return dict(models.SD15_SMALL, channel_mult=[1, 2], num_res_blocks=[1, 1], transformer_depth=[1, 1],
                transformer_depth_output=[1, 1, 1, 1])


def default_checkpoint() -> Path:
    """The random-weight default checkpoint (default_unet_config + a tiny VAE, no CLIP), written on first
    use. Its name carries a hash of the config, so a changed config makes a new file."""
    config = default_unet_config()
    digest = hashlib.sha256(json.dumps([config, "taesd", 0], sort_keys=True).encode()).hexdigest()[:10]
    path = CACHE / f"toma-random-sd15-{digest}.safetensors"
    if not path.is_file():
        print(f"[main-job] writing the random-weight SD1.5-width checkpoint {path} (once)", flush=True)
        CACHE.mkdir(parents=True, exist_ok=True)
        partial = path.with_name("partial-" + path.name)
        # In a child process: the builder imports ComfyUI (its model classes), which this process never needs.
        child = subprocess.run([sys.executable, "-m", "toma_bench.main_job", "--write-checkpoint", str(partial)],
                               cwd=REPO, capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"[main-job] could not write the checkpoint:\n{child.stdout}{child.stderr}")
        partial.replace(path)
    return path


def write_checkpoint(path: str) -> None:
    comfy_host.import_comfy()
    models.save_sd15_checkpoint(path, seed=0, config=default_unet_config(), vae=True)


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
    """The comparison graph on the chosen checkpoint, size and sampler settings."""
    graph = server.set_inputs(graph, "CheckpointLoaderSimple", ckpt_name=ckpt_name)
    graph = server.set_inputs(graph, "EmptyLatentImage", width=size, height=size)
    graph = server.set_inputs(graph, "KSampler", steps=steps, cfg=cfg)
    return graph if text_encoder else server.use_test_conditioning(graph)


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

def progress_printer(label: str, started: float):
    """on_message callback: one line per sampler step."""
    def show(kind, data):
        if kind == "progress":
            print(f"  {label:<10} step {data['value']:>3}/{data['max']:<3} {time.perf_counter() - started:7.1f} s",
                  flush=True)
    return show


def attention_line(log: Path) -> str:
    """ComfyUI's own log line naming the cross-attention backend it picked."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if re.search(r"cross attention|Using .*attention", line)]
    return lines[0] if lines else "(ComfyUI did not log its attention backend)"


class Timing(NamedTuple):
    sampling: float  # wall seconds of the KSampler node
    prompt: float  # wall seconds of the whole prompt (sampling, VAE decode, save)
    cpu: float  # CPU seconds the server process spent on the prompt (steadier than wall time on a busy machine)


def server_cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def timed_runs(client, graph: dict, seed: int, repeats: int) -> tuple[dict, dict]:
    """Warm up once, then run each branch ``repeats`` times as its own prompt.

    Returns ({label: [Timing, ...]}, {label: images of the first repeat}).
    """
    started = time.perf_counter()
    warm_seed = seed + repeats  # a seed no timed run uses, so no timed KSampler is served from the cache
    print(f"[main-job] warm-up: all branches, 1 step, seed {warm_seed} (loads the model; not timed)", flush=True)
    client.run(with_seed(server.set_inputs(graph, "KSampler", steps=1), warm_seed))
    print(f"[main-job] warm-up done in {time.perf_counter() - started:.1f} s", flush=True)
    parts = branches(graph)
    seconds = {label: [] for label in parts}
    images = {}
    for r in range(repeats):
        order = list(parts)[r % len(parts):] + list(parts)[:r % len(parts)]  # rotate: no method always first
        for label in order:
            part, sampler = parts[label]
            name = LABELS.get(label, label)
            print(f"[main-job] run {r + 1}/{repeats}: {name} (seed {seed + r})", flush=True)
            cpu = server_cpu_seconds(client.pid)
            run = client.run(with_seed(part, seed + r), on_message=progress_printer(name, time.perf_counter()))
            cpu = server_cpu_seconds(client.pid) - cpu
            seconds[label].append(Timing(run.node_seconds()[sampler], run.seconds, cpu))
            if r == 0:
                images[label] = [client.view(**image) for image in run.images()]
    return seconds, images


def mean_abs_difference(a: bytes, b: bytes) -> float:
    """Mean |a - b| over pixels of two PNGs, 0..255."""
    import numpy as np
    from PIL import Image

    x, y = (np.asarray(Image.open(io.BytesIO(p)).convert("RGB"), dtype=np.int16) for p in (a, b))
    return float(np.abs(x - y).mean())


def table(seconds: dict, images: dict) -> str:
    """Per method, medians over repeats: KSampler wall time and its speed-up over unpatched, the whole
    prompt's wall time and server CPU time; and how far the first image is from the unpatched one."""
    sampling = {label: median([t.sampling for t in runs]) for label, runs in seconds.items()}
    head = ["method", "sampling s", "speedup", "prompt s", "prompt CPU s", "mean |diff| vs unpatched"]
    rows = [[LABELS.get(label, label), f"{sampling[label]:.2f}", f"{sampling['unpatched'] / sampling[label]:.2f}x",
             f"{median([t.prompt for t in runs]):.2f}", f"{median([t.cpu for t in runs]):.2f}",
             f"{mean_abs_difference(images[label][0], images['unpatched'][0]):.2f} /255"]
            for label, runs in seconds.items()]
    return format_table(head, rows)


def side_by_side(images: dict, seconds: dict, path: Path) -> None:
    """The first image of each method in a row, each captioned with its method and sampling time."""
    from PIL import Image, ImageDraw

    pictures = [(label, Image.open(io.BytesIO(blobs[0])).convert("RGB")) for label, blobs in images.items()]
    width, height = pictures[0][1].size
    caption = 24
    canvas = Image.new("RGB", (width * len(pictures), height + caption), "white")
    draw = ImageDraw.Draw(canvas)
    for i, (label, picture) in enumerate(pictures):
        canvas.paste(picture, (i * width, caption))
        sampling = median([t.sampling for t in seconds[label]])
        draw.text((i * width + 6, 6), f"{LABELS.get(label, label)}  {sampling:.1f} s sampling", fill="black")
    canvas.save(path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.comfyui:
        os.environ["COMFYUI_PATH"] = str(Path(args.comfyui).expanduser().resolve())
    if args.write_checkpoint:
        write_checkpoint(args.write_checkpoint)
        return 0
    if args.size % 8 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("[main-job] --size must be a multiple of 8; --steps and --repeats at least 1")
    root = comfy_host.comfy_root()
    ckpt = find_checkpoint(args.ckpt, args.models_dir) if args.ckpt else default_checkpoint()
    output = Path(args.output) if args.output else REPO / "output" / "main_job" / time.strftime("%Y%m%d-%H%M%S")
    output.mkdir(parents=True, exist_ok=True)
    text_encoder = has_text_encoder(ckpt)
    graph = configured(server.load_workflow(WORKFLOW), ckpt.name, args.size, args.steps, args.cfg, text_encoder)
    extra = ["--use-pytorch-cross-attention"] if args.attention == "sdpa" else []
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server process
    print(f"[main-job] ComfyUI: {root}\n[main-job] checkpoint: {ckpt}"
          f"{'' if text_encoder else ' (no text encoder: random test conditioning)'}\n"
          f"[main-job] workflow: workflows/{WORKFLOW}, {args.size}x{args.size}, {args.steps} steps, cfg {args.cfg}, "
          f"seed {args.seed}, {args.repeats} timed run(s) per method, "
          f"{args.threads or 'default'} CPU thread(s)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="toma-main-job-"))
    ok = False
    try:
        with server.comfy_server(workdir, *extra, models={"checkpoints": ckpt.parent}) as client:
            print(f"[main-job] server pid {client.pid} at {client.base_url}\n"
                  f"[main-job] attention: {args.attention} -> {attention_line(client.log)}", flush=True)
            seconds, images = timed_runs(client, graph, args.seed, args.repeats)
        for label, blobs in images.items():
            for k, blob in enumerate(blobs):
                (output / f"{label}{'' if k == 0 else f'_{k}'}.png").write_bytes(blob)
        side_by_side(images, seconds, output / "side_by_side.png")
        print("\n" + table(seconds, images) + "\n")
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
