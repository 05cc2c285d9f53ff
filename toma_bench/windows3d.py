"""Windows over video frames: how much merging across neighbouring frames keeps, at the same ratio.

    python -m toma_bench.windows3d [--image PATH] [--clips 4] [--frames 8] [--size 32] [--threads N]

Frames of a video are redundant, so a window that spans a few frames should find, for most tokens, a
near twin among its destinations. This measures it at engine level, on synthetic videos: a photo seen
by a camera that pans (and zooms) over ``--frames`` frames of ``--size`` x ``--size`` tokens, each token
an 8 x 8-pixel RGB patch embedded to C = 64 channels by a fixed seeded random linear map and layer-normed
(ToMA plans from the block's normalised input). For each window (side ``window_size`` in tokens, ``temporal_window``
frames) and ratio it reports, averaged over ``--clips`` clips (random start and direction, seeded):

- ``recon``: relative L2 error of unmerge(merge(x)) against x;
- ``attn``: relative L2 error of unmerge(attention(merge(x))) against attention(x), a self-attention
  with seeded random q/k/v projections (4 heads of 16) over all frames' tokens at once, as video
  DiTs attend;
- ``select``: CPU milliseconds to build one plan with new destinations at ratio 0.5 (median over clips).

Windows of 4 x 4 x 4 and 1 x 8 x 8 tokens hold the same 64 tokens, so their rows compare merging across
time with merging over a wider patch of one frame at the same window size.
"""
import argparse
import importlib.util
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from toma_core.plan import DEFAULT_TAU, plan_tiles

from . import run
from .metrics import relative_l2
from .tables import format_table

PATCH = 8  # pixels per token side
CHANNELS = 64
HEADS = 4
WINDOWS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]  # (tile, temporal_window)
RATIOS = (0.25, 0.5, 0.75)
# (name, pan in tokens per frame, zoom per frame): the crop shrinks by the zoom factor every frame
MOTIONS = [("slow pan + zoom in", 0.25, 0.01), ("fast pan", 1.0, 0.0)]
# photos bundled with packages of the dev environment, first found is used: (package, path inside it)
BUNDLED_PHOTOS = [("skimage", "data/astronaut.png"), ("sklearn", "datasets/images/china.jpg"),
                  ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg")]


def bundled_photo() -> Path | None:
    """Path of the first photo of BUNDLED_PHOTOS that is installed (without importing its package)."""
    for package, relative in BUNDLED_PHOTOS:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            if (Path(root) / relative).is_file():
                return Path(root) / relative
    return None


def render_clip(photo: Image.Image, frames: int, pixels: int, start: tuple[float, float],
                velocity: tuple[float, float], zoom: float) -> torch.Tensor:
    """(frames, 3, pixels, pixels) in [-1, 1]: crops of ``photo`` whose centre moves by ``velocity``
    pixels and whose side shrinks by (1 + zoom) per frame, resampled (bicubic) to ``pixels`` a side."""
    out = []
    for k in range(frames):
        cx, cy = start[0] + k * velocity[0], start[1] + k * velocity[1]
        half = pixels / 2 / (1.0 + zoom) ** k
        img = photo.resize((pixels, pixels), Image.BICUBIC, box=(cx - half, cy - half, cx + half, cy + half))
        rgb = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(pixels, pixels, 3)
        out.append(rgb.permute(2, 0, 1).float() / 127.5 - 1.0)
    return torch.stack(out)


def random_clips(photo: Image.Image, count: int, frames: int, size: int, pan: float, zoom: float,
                 generator: torch.Generator) -> list[torch.Tensor]:
    """``count`` clips of (frames, 3, size*PATCH, size*PATCH): random direction, start so that every
    crop stays inside the photo."""
    pixels = size * PATCH
    speed = pan * PATCH
    clips = []
    for _ in range(count):
        angle = float(torch.rand((), generator=generator)) * 2 * math.pi
        velocity = (speed * math.cos(angle), speed * math.sin(angle))
        travel = [abs(v) * (frames - 1) for v in velocity]
        room = [photo.size[i] - pixels - travel[i] for i in range(2)]
        if min(room) < 0:
            raise ValueError(f"photo {photo.size} too small for {frames} frames of {pixels} px at {pan} token/frame")
        corner = [float(torch.rand((), generator=generator)) * room[i] for i in range(2)]
        start = tuple(corner[i] + pixels / 2 + (travel[i] if velocity[i] < 0 else 0.0) for i in range(2))
        clips.append(render_clip(photo, frames, pixels, start, velocity, zoom))
    return clips


def embed(clip: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """(frames, 3, H, W) -> (1, frames*h*w, C) layer-normed tokens, raster order (frame, row, column);
    projection: (3*PATCH*PATCH, C)."""
    frames, _, H, W = clip.shape
    h, w = H // PATCH, W // PATCH
    patches = clip.view(frames, 3, h, PATCH, w, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3 * PATCH * PATCH)
    tokens = patches @ projection
    return F.layer_norm(tokens, (tokens.shape[-1],))[None]


def attention(x: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """(B, N, C) -> (B, N, C): softmax self-attention, q/k/v = x @ qkv[i] split into HEADS heads."""
    B, N, C = x.shape
    q, k, v = ((x @ w).view(B, N, HEADS, C // HEADS).transpose(1, 2) for w in qkv)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C)


def measure(videos: list[torch.Tensor], thw: tuple[int, int, int], qkv: torch.Tensor) -> dict:
    """{(tile, temporal_window): {"recon": {ratio: mean error}, "attn": {...}, "select": ms}} over ``videos``
    ((1, frames*h*w, C) each, thw = (frames, h, w))."""
    fulls = [attention(x, qkv) for x in videos]
    results = {}
    for tile, temporal_window in WINDOWS:
        recon = {r: [] for r in RATIOS}
        attn = {r: [] for r in RATIOS}
        select = []
        for x, full in zip(videos, fulls):
            for ratio in RATIOS:
                start = time.process_time()
                plan = plan_tiles(x, thw, tile, ratio, generator=torch.Generator().manual_seed(0),
                                  temporal_window=temporal_window)
                if ratio == 0.5:
                    select.append(1000 * (time.process_time() - start))
                recon[ratio].append(relative_l2(plan.unmerge(plan.merge(x)), x))
                attn[ratio].append(relative_l2(plan.unmerge(attention(plan.merge(x), qkv)), full))
        results[tile, temporal_window] = {"recon": {r: statistics.fmean(e) for r, e in recon.items()},
                                      "attn": {r: statistics.fmean(e) for r, e in attn.items()},
                                      "select": statistics.median(select)}
    return results


def window_table(results: dict) -> str:
    head = (["window", "tokens"] + [f"recon {r}" for r in RATIOS] + [f"attn {r}" for r in RATIOS]
            + ["select ms"])
    rows = []
    for (tile, temporal_window), res in results.items():
        rows.append([f"{temporal_window}x{tile}x{tile}", str(temporal_window * tile * tile)]
                    + [f"{res['recon'][r]:.3f}" for r in RATIOS] + [f"{res['attn'][r]:.3f}" for r in RATIOS]
                    + [f"{res['select']:.0f}"])
    return format_table(head, rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m toma_bench.windows3d", description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", type=Path, default=None,
                    help="photo to film (default: the first photo found of " +
                         ", ".join(f"{p}/{r}" for p, r in BUNDLED_PHOTOS) + ")")
    ap.add_argument("--clips", type=int, default=4, help="clips per motion (random start and direction)")
    ap.add_argument("--frames", type=int, default=8, help="frames per clip")
    ap.add_argument("--size", type=int, default=32, help="tokens per frame side")
    run.common_arguments(ap, devices=None)
    args = ap.parse_args(argv)
    path = args.image or bundled_photo()
    if path is None:
        ap.error("no bundled photo found; pass --image PATH")
    for name in ("clips", "frames", "size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    run.set_threads(args.threads)
    photo = Image.open(path).convert("RGB")
    thw = (args.frames, args.size, args.size)
    generator = torch.Generator().manual_seed(0)
    projection = torch.randn(3 * PATCH * PATCH, CHANNELS, generator=generator) / (3 * PATCH * PATCH) ** 0.5
    qkv = torch.randn(3, CHANNELS, CHANNELS, generator=generator) / CHANNELS ** 0.5
    print(run.header("python -m toma_bench.windows3d", argv, "CPU"))
    print(f"photo {path} ({photo.size[0]}x{photo.size[1]}); {args.clips} clips of {args.frames} frames x "
          f"{args.size}x{args.size} tokens ({PATCH}x{PATCH}-pixel patches), C={CHANNELS}; tau {DEFAULT_TAU:g}; "
          f"errors: mean relative L2 over clips; window = temporal_window x window_size x window_size")
    with torch.inference_mode():
        for name, pan, zoom in MOTIONS:
            clips = random_clips(photo, args.clips, args.frames, args.size, pan, zoom, generator)
            videos = [embed(clip, projection) for clip in clips]
            print(f"\n{name}: {pan} token/frame" + (f", zoom {100 * zoom:g}%/frame" if zoom else ""))
            print(window_table(measure(videos, thw, qkv)))


if __name__ == "__main__":
    main()
