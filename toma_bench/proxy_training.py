"""Training and checking the trained proxies (toma_bench.proxy): the data, the objective, the training loop
and the command line.

    python -m toma_bench.proxy_training train --arch sd15|flux|wan [--steps N] [--batch B] [--lr LR] [--seed S]
                                              [--size proxy|tiny] [--out FILE] [--log-every N] [--threads T]
    python -m toma_bench.proxy_training check [--arch sd15,flux,wan] [--out DIR] [--steps 20] [--sampler euler]
                                              [--samples 16] [--threads T]

(``python -m toma_bench.proxy`` runs this command line too, so the commands recorded in the shipped
proxies' metadata still run.)

Data: grayscale crops of the public-domain/CC0 photographs bundled in scikit-image's wheel (short clips
panning over them for Wan). Each model is trained in the parametrisation of its ComfyUI ``model_sampling``,
through ComfyUI's ``apply_model``: the loss is ``((denoised - x0) / sigma)^2``, which is the
epsilon-prediction loss for SD1.x's discrete EPS schedule and the velocity (noise - x0) loss for Flux's and
Wan's rectified flow (CONST). ``heldout_loss(model)`` is the held-out denoising loss.
"""
import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .proxy import (DEFAULT_CHECK_DIR, PROXY_DIR, REPO, SPECS, Spec, arch_of, build, context_tensors, encode, to_luma,
                    latent_to_images, load, read_metadata, sample, spec_of)


# -- data ---------------------------------------------------------------------------------------------
# Photographs bundled in the scikit-image wheel (no download; skimage.data docstrings give the sources):
# public domain (astronaut, rocket, coins: no known copyright) or CC0 (camera, coffee, chelsea, and the
# brick/grass/gravel textures). "chelsea" (a cat) is held out: no training crop comes from it.
TRAIN_IMAGES = ("astronaut", "camera", "coffee", "coins", "rocket", "brick", "grass", "gravel")
HELDOUT_IMAGES = ("chelsea",)
MAX_ZOOM = 3.0  # crops cover 1x to 3x the model's picture side before downscaling
MAX_PAN = 4  # pixels a clip moves per frame at most (one latent pixel)
HELDOUT_CROPS, HELDOUT_SEED = 16, 99
# Fixed noise levels of the held-out loss, as fractions of the schedule from least to most noise.
HELDOUT_LEVELS = (0.02, 0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 0.98)


def source_images(names) -> list[torch.Tensor]:
    """The named scikit-image photographs as grayscale (H, W) tensors in [-1, 1]."""
    try:
        import skimage.data
    except ImportError as e:
        raise RuntimeError("the proxies' pictures come from scikit-image: pip install scikit-image") from e
    out = []
    for name in names:
        pixels = torch.from_numpy(getattr(skimage.data, name)()).float() / 255
        out.append((pixels if pixels.ndim == 2 else to_luma(pixels[..., :3])[..., 0]) * 2 - 1)
    return out


def random_crops(images: list[torch.Tensor], count: int, side: int, generator: torch.Generator) -> torch.Tensor:
    """(count, 1, side, side) crops: a random picture, a random zoom (log-uniform, 1x to MAX_ZOOM, or
    less where the picture is small) downscaled by area averaging, a random position and left-right flip."""
    out = torch.empty(count, 1, side, side)
    for i in range(count):
        img = images[int(torch.randint(len(images), (1,), generator=generator))]
        max_zoom = min(MAX_ZOOM, min(img.shape) / side)
        zoom = math.exp(float(torch.rand((), generator=generator)) * math.log(max_zoom))
        crop_side = min(round(side * zoom), *img.shape)
        top = int(torch.randint(img.shape[0] - crop_side + 1, (1,), generator=generator))
        left = int(torch.randint(img.shape[1] - crop_side + 1, (1,), generator=generator))
        crop = img[top:top + crop_side, left:left + crop_side][None, None]
        crop = F.interpolate(crop, size=(side, side), mode="area")
        if float(torch.rand((), generator=generator)) < 0.5:
            crop = crop.flip(-1)
        out[i] = crop[0]
    return out


def random_clips(images: list[torch.Tensor], count: int, frames: int, side: int,
                 generator: torch.Generator) -> torch.Tensor:
    """(count, 1, frames, side, side) clips panning over the photographs: a random_crops crop of a larger
    canvas, then ``frames`` windows of it that move by a fixed random direction and speed (1 to MAX_PAN
    pixels per frame, rounded to whole pixels): consecutive frames differ by a shift of whole pixels."""
    out = torch.empty(count, 1, frames, side, side)
    for i in range(count):
        angle = float(torch.rand((), generator=generator)) * 2 * math.pi
        speed = 1 + float(torch.rand((), generator=generator)) * (MAX_PAN - 1)
        path = [(round(k * speed * math.sin(angle)), round(k * speed * math.cos(angle))) for k in range(frames)]
        top0, left0 = min(p[0] for p in path), min(p[1] for p in path)
        path = [(top - top0, left - left0) for top, left in path]
        canvas = random_crops(images, 1, side + max(max(p) for p in path), generator)[0, 0]
        for k, (top, left) in enumerate(path):
            out[i, 0, k] = canvas[top:top + side, left:left + side]
    return out


def training_pictures(spec: Spec, images: list[torch.Tensor], count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` random pictures (B, 1, H, W) of the proxy's size, or clips (B, 1, T, H, W) for a video proxy."""
    side = spec.side * spec.block
    if spec.frames:
        return random_clips(images, count, spec.frames, side, generator)
    return random_crops(images, count, side, generator)


def save(model, path: Path, config: dict, training: dict) -> None:
    """The diffusion model's weights in fp16, with arch, ``config`` (the unet_config it was built from)
    and ``training`` as metadata."""
    import safetensors.torch

    sd = {k: v.to(torch.float16).contiguous() for k, v in model.model.diffusion_model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(sd, str(path), metadata={"arch": arch_of(model), "unet_config": json.dumps(config),
                                                         "training": json.dumps(training)})


# -- objective ----------------------------------------------------------------------------------------
def sigmas_at(model, fractions: torch.Tensor) -> torch.Tensor:
    """Noise levels at ``fractions`` (0 = least noise, 1 = most) of the model's schedule: the discrete
    SD1.x timesteps for the UNet, the flow time sigma in (0, 1) for Flux and Wan (unshifted)."""
    sampling = model.model.model_sampling
    if arch_of(model) != "sd15":
        return fractions.clamp(1e-3, 1 - 1e-3)
    index = (fractions * (len(sampling.sigmas) - 1)).round().long()
    return sampling.sigmas[index].float()


def draw_fractions(arch: str, count: int, generator: torch.Generator) -> torch.Tensor:
    """Training noise levels: uniform over the UNet's discrete timesteps (as SD trains); for Flux and Wan a
    logit-normal flow time (as SD3/Flux train) mixed with 20% uniform so the ends of the schedule the
    samplers visit are learnt too."""
    if arch == "sd15":
        return torch.rand(count, generator=generator)
    logit_normal = torch.sigmoid(torch.randn(count, generator=generator))
    uniform = torch.rand(count, generator=generator)
    return torch.where(torch.rand(count, generator=generator) < 0.2, uniform, logit_normal)


def denoising_loss(model, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Per-sample loss of predicting ``x0`` from ``x0`` noised to ``sigma``, through ComfyUI's own
    noise_scaling and apply_model: ((denoised - x0) / sigma)^2, i.e. the squared error of the model's
    native output (epsilon for EPS, velocity noise - x0 for CONST), averaged over the latent."""
    sampling = model.model.model_sampling
    sigma_b = sigma.view(-1, *[1] * (x0.ndim - 1))  # against every element of a picture or clip
    x = sampling.noise_scaling(sigma_b, noise, x0)
    tensors = context_tensors(model)
    kwargs = {k: v.expand(x.shape[0], *v.shape[1:]) for k, v in tensors.items()}
    denoised = model.model.apply_model(x, sigma, **kwargs)
    return (((denoised - x0) / sigma_b) ** 2).flatten(1).mean(dim=1)


def heldout_set(arch: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x0, noise, fractions) of the held-out loss: HELDOUT_CROPS crops (clips for wan) of HELDOUT_IMAGES,
    each at every HELDOUT_LEVELS level with its own fixed noise; model-space latents."""
    spec = spec_of(arch)
    g = torch.Generator().manual_seed(HELDOUT_SEED)
    crops = training_pictures(spec, source_images(HELDOUT_IMAGES), HELDOUT_CROPS, g)
    x0 = encode(crops, spec.block).repeat_interleave(len(HELDOUT_LEVELS), 0)
    fractions = torch.tensor(HELDOUT_LEVELS).repeat(HELDOUT_CROPS)
    return x0, torch.randn(x0.shape, generator=g), fractions


def heldout_loss(model, chunk: int = 32, heldout=None) -> float:
    """Mean held-out denoising loss of ``model`` (see denoising_loss and heldout_set); ``heldout``:
    a heldout_set result to reuse."""
    x0, noise, fractions = heldout or heldout_set(arch_of(model))
    sigma = sigmas_at(model, fractions)
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(x0), chunk):
            total += float(denoising_loss(model, x0[i:i + chunk], noise[i:i + chunk], sigma[i:i + chunk]).sum())
    return total / len(x0)


# -- training -----------------------------------------------------------------------------------------
class CopyInput(torch.nn.Module):
    """Runs ``inner`` on a copy of its input, so an in-place update of the input later leaves the
    tensor that ``inner`` saved for backward intact."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.clone())


# Norms whose input ComfyUI's blocks then update in place (Flux: ``x += ...`` in SingleStreamBlock, ``txt +=
# ...`` twice in DoubleStreamBlock, and ``img += ...`` twice there too since ComfyUI v0.3.75; the March-2024
# SD1.x BasicTransformerBlock: ``x += n`` after norm1 and norm2): made for inference, they break autograd.
IN_PLACE_RESIDUAL_NORMS = ("pre_norm", "txt_norm1", "txt_norm2", "img_norm1", "img_norm2", "norm1", "norm2")


@contextlib.contextmanager
def trainable(dm: torch.nn.Module):
    """While active, ``dm`` can be trained: the IN_PLACE_RESIDUAL_NORMS see copies (no parameters
    move, the outputs are the same), and where the tree has the flag (ComfyUI v0.33.0), ComfyUI is told it
    trains (``model_management.in_training``: its RoPE takes the torch path, comfy-kitchen's kernel has no
    backward)."""
    import comfy.model_management as mm

    swapped = [(block, name, getattr(block, name)) for block in dm.modules() for name in IN_PLACE_RESIDUAL_NORMS
               if isinstance(getattr(block, name, None), torch.nn.Module)]
    for block, name, norm in swapped:
        setattr(block, name, CopyInput(norm))
    flagged = hasattr(mm, "in_training")
    before = getattr(mm, "in_training", None)
    if flagged:
        mm.in_training = True
    try:
        yield dm
    finally:
        for block, name, norm in swapped:
            setattr(block, name, norm)
        if flagged:
            mm.in_training = before


def learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 5% of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(arch: str, config: dict, steps: int, batch: int, lr: float, seed: int = 0, log_every: int = 100,
          progress=print):
    """Train a proxy from its seeded start (build(..., zero_outputs=True)), or from the shipped weights of
    ``spec.init`` (fine-tuning at another size). Returns (ModelPatcher, history): one row per ``log_every``
    steps and at the end, {step, train_loss (mean since the last row), heldout_loss, seconds and
    cpu_seconds (wall and process CPU time of training so far, evaluations excluded)}."""
    spec = spec_of(arch)
    if spec.init:
        model = load(PROXY_DIR / spec_of(spec.init).file)
    else:
        model = build(arch, config, seed, zero_outputs=True)
    dm = model.model.diffusion_model
    params = list(dm.parameters())
    for p in params:  # ComfyUI v0.33.0's ops make inference-only parameters (requires_grad False)
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    images = source_images(TRAIN_IMAGES)
    heldout = heldout_set(arch)
    history, window, seconds, cpu_seconds = [], [], 0.0, 0.0
    with trainable(dm):
        for step in range(steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, steps, lr)
            x0 = encode(training_pictures(spec, images, batch, g), spec.block)
            noise = torch.randn(x0.shape, generator=g)
            sigma = sigmas_at(model, draw_fractions(spec.model_kind, batch, g))
            loss = denoising_loss(model, x0, noise, sigma).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            seconds += time.perf_counter() - start
            cpu_seconds += time.process_time() - cpu_start
            window.append(float(loss.detach()))
            if (step + 1) % log_every == 0 or step + 1 == steps:
                row = {"step": step + 1, "train_loss": sum(window) / len(window),
                       "heldout_loss": heldout_loss(model, heldout=heldout), "seconds": round(seconds, 1),
                       "cpu_seconds": round(cpu_seconds, 1)}
                history.append(row)
                window = []
                progress(f"step {row['step']}/{steps}: train loss {row['train_loss']:.4f}, held-out loss "
                         f"{row['heldout_loss']:.4f}, {row['seconds']:.0f} s ({row['cpu_seconds']:.0f} s CPU)")
    return model, history


def save_grid(images: torch.Tensor, path: Path, columns: int = 4, zoom: int = 2) -> None:
    """ComfyUI IMAGE (B, H, W, 3) -> one PNG grid, each picture ``zoom`` times larger, 2-pixel gaps."""
    from PIL import Image

    b, h, w, _ = images.shape
    rows = -(-b // columns)
    grid = torch.ones(rows * (h + 2) - 2, columns * (w + 2) - 2, 3)
    for i in range(b):
        r, c = divmod(i, columns)
        grid[r * (h + 2):r * (h + 2) + h, c * (w + 2):c * (w + 2) + w] = images[i]
    picture = Image.fromarray((grid * 255).round().byte().numpy())
    path.parent.mkdir(parents=True, exist_ok=True)
    picture.resize((picture.width * zoom, picture.height * zoom), Image.NEAREST).save(path)


# -- command line -------------------------------------------------------------------------------------
def import_comfy() -> Path:
    """ComfyUI on CPU with PyTorch attention: ``$COMFYUI_PATH``, else <repo>/.comfyui-current."""
    from .comfy_host import import_core

    root = import_core("cpu", require_flux=False)
    import logging

    logging.getLogger().setLevel(logging.WARNING)  # no "model_type EPS" line per model built
    return root


def positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"{name} must be a positive integer, got {value}")
    return value


def run_train(args, argv) -> None:
    spec = spec_of(args.arch)
    if args.size not in spec.configs:
        raise SystemExit(f"--size {args.size} is not offered for --arch {args.arch} (it has {', '.join(spec.configs)})")
    config = spec.configs[args.size]
    root = import_comfy()
    out = Path(args.out or PROXY_DIR / spec.file)
    steps, batch, lr = args.steps or spec.steps, args.batch or spec.batch, args.lr or spec.lr
    print(f"training {args.arch} proxy ({args.size}) in ComfyUI {root}: {steps} steps, batch {batch}, "
          f"lr {lr:g}, seed {args.seed}, {torch.get_num_threads()} thread(s), torch {torch.__version__}", flush=True)
    model, history = train(args.arch, config, steps, batch, lr, args.seed, args.log_every,
                           progress=lambda s: print(s, flush=True))
    params = sum(p.numel() for p in model.model.diffusion_model.parameters())
    training = {"steps": steps, "batch": batch, "lr": lr, "seed": args.seed, "size": args.size,
                "parameters": params, "threads": torch.get_num_threads(), "torch": torch.__version__,
                "latent_side": spec.side, "init": spec.init and spec_of(spec.init).file,
                "seconds": history[-1]["seconds"], "cpu_seconds": history[-1]["cpu_seconds"], "history": history,
                "command": "python -m toma_bench.proxy_training " + " ".join(argv),
                "train_images": list(TRAIN_IMAGES), "heldout_images": list(HELDOUT_IMAGES)}
    save(model, out, config, training)
    print(f"saved {out} ({params / 1e6:.2f}M parameters, {out.stat().st_size / 2**20:.1f} MiB)", flush=True)


def format_history(history: list[dict]) -> str:
    """The training log of a proxy file as a markdown table."""
    lines = ["| step | train loss | held-out loss | CPU min | wall min |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['train_loss']:.4f} | {r['heldout_loss']:.4f} | {r['cpu_seconds'] / 60:.1f} | "
              f"{r['seconds'] / 60:.1f} |" for r in history]
    return "\n".join(lines)


def run_check(args) -> None:
    root = import_comfy()
    import comfy.supported_models

    import comfy.samplers

    if args.sampler not in comfy.samplers.KSampler.SAMPLERS:
        raise SystemExit(f"--sampler must be one of ComfyUI's samplers ({', '.join(comfy.samplers.KSampler.SAMPLERS)}), "
                         f"got {args.sampler!r}")
    out_dir = Path(args.out or DEFAULT_CHECK_DIR)
    print(f"ComfyUI {root}; torch {torch.__version__}, {torch.get_num_threads()} thread(s); held-out: "
          f"{HELDOUT_CROPS} crops of {', '.join(HELDOUT_IMAGES)} x {len(HELDOUT_LEVELS)} noise levels")
    for arch in args.arch:
        spec = spec_of(arch)
        if not hasattr(comfy.supported_models, spec.model_class):
            print(f"{arch}: skipped, this ComfyUI has no {spec.model_class} (use current ComfyUI)")
            continue
        path = Path(args.dir) / spec.file
        model = load(path)
        meta = read_metadata(path)
        heldout = heldout_set(arch)
        trained = heldout_loss(model, heldout=heldout)
        seed = meta["training"].get("seed", 0)
        random_init = heldout_loss(build(arch, meta["unet_config"], seed), heldout=heldout)
        start = heldout_loss(build(arch, meta["unet_config"], seed, zero_outputs=True), heldout=heldout)
        params = sum(p.numel() for p in model.model.diffusion_model.parameters())
        training = meta["training"]
        print(f"{arch}: {path.name}, {params / 1e6:.2f}M parameters, trained {training.get('steps')} steps of "
              f"batch {training.get('batch')} ({training.get('cpu_seconds', 0) / 60:.1f} min CPU)")
        print(format_history(training.get("history", [])))
        print(f"  held-out loss: trained {trained:.4f} | random init {random_init:.4f} (trained/random "
              f"{trained / random_init:.3f}) | training start {start:.4f} (trained/start {trained / start:.3f})")
        began = time.perf_counter()
        samples = sample(model, args.seed, args.samples, args.steps, args.sampler, side=spec.side)
        columns = spec.frames or 4  # a clip per row
        grid = out_dir / f"{arch}_samples_{args.sampler}_{args.steps}steps.png"
        save_grid(latent_to_images(model, samples), grid, columns)
        reference = out_dir / f"{arch}_heldout_crops.png"
        crops = heldout[0][::len(HELDOUT_LEVELS)][:args.samples]
        save_grid(latent_to_images(model, model.model.process_latent_out(crops)), reference, columns)
        print(f"  {args.samples} samples, {args.sampler} {args.steps} steps ({spec.scheduler}) from seed "
              f"{args.seed} in {time.perf_counter() - began:.0f} s: {grid} (held-out crops: {reference})", flush=True)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m toma_bench.proxy", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train one proxy and save it (default: the shipped file)")
    tr.add_argument("--arch", required=True, choices=list(SPECS))
    tr.add_argument("--size", choices=["proxy", "tiny"], default="proxy", help="proxy (shipped) or tiny (tests)")
    tr.add_argument("--steps", type=lambda s: positive_int("--steps", s), default=None,
                    help=f"optimizer steps (default {', '.join(f'{a} {s.steps}' for a, s in SPECS.items())})")
    tr.add_argument("--batch", type=lambda s: positive_int("--batch", s), default=None, help="crops per step (default 8)")
    tr.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the arch's)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    tr.add_argument("--log-every", type=lambda s: positive_int("--log-every", s), default=250,
                    help="steps between loss lines (each also evaluates the held-out loss)")
    tr.add_argument("--out", default=None, help="safetensors path (default: toma_bench/proxies/<arch>_proxy.safetensors)")
    tr.add_argument("--threads", type=lambda s: positive_int("--threads", s), default=1, help="torch CPU threads (default 1)")
    ck = sub.add_parser("check", help="held-out loss vs random init, and a PNG grid of samples, per shipped proxy")
    ck.add_argument("--arch", default="sd15,flux,wan", help="comma list of sd15, flux, wan (default all three; flux "
                    "and wan need current ComfyUI, and are skipped elsewhere)")
    ck.add_argument("--dir", default=str(PROXY_DIR), help="folder of the proxies' safetensors (default: the shipped ones)")
    ck.add_argument("--out", default=None, help=f"folder for the PNG grids (default {DEFAULT_CHECK_DIR.relative_to(REPO)})")
    ck.add_argument("--steps", type=lambda s: positive_int("--steps", s), default=20, help="sampler steps (default 20)")
    ck.add_argument("--sampler", default="euler", help="ComfyUI sampler name (default euler)")
    ck.add_argument("--samples", type=lambda s: positive_int("--samples", s), default=16,
                    help="pictures (clips for wan) per grid (default 16)")
    ck.add_argument("--seed", type=int, default=0, help="seed of the sampling noise")
    ck.add_argument("--threads", type=lambda s: positive_int("--threads", s), default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    if args.command == "train" and args.lr is not None and not args.lr > 0:
        ap.error(f"--lr must be positive, got {args.lr}")
    if args.command == "check":
        text, args.arch = args.arch, [a.strip() for a in args.arch.split(",") if a.strip()]
        if not args.arch or any(a not in SPECS for a in args.arch):
            ap.error(f"--arch must be a comma list of {', '.join(SPECS)}, got {text!r}")
    torch.set_num_threads(args.threads)
    if args.command == "train":
        run_train(args, argv)
    else:
        run_check(args)


if __name__ == "__main__":
    main()
