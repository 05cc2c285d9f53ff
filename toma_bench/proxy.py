"""Trained proxy denoisers, used: their specs, loading, conditioning, sampling, pictures <-> latents.
Training them and checking them (and the command line, ``python -m toma_bench.proxy_training train|check``)
is toma_bench.proxy_training, which uses this module and is never imported by it.

No real diffusion weights can be downloaded here, and random weights denoise nothing, so merging errors
on them say little about pictures. These proxies are ComfyUI's own model classes (an SD1.x-layout
``UNetModel``, a ``Flux`` DiT and a Wan 2.1 video DiT, ``WanModel``) trained for some minutes on a CPU to
denoise grayscale crops of the public-domain/CC0 photographs bundled in scikit-image's wheel (short clips
panning over them for Wan). ComfyUI's samplers turn noise into
pictures with them, so a merge that damages the model shows up in pictures a person can judge.

Pictures become latents by a fixed invertible map, not a VAE: a grayscale crop is cut into p x p pixel
blocks (space-to-depth, p = 2 for the UNet, 4 for Flux), each block's p^2 pixels go through a fixed
seeded orthogonal matrix and a fixed scale, giving the model-space latent (what the diffusion model
sees, after ComfyUI's ``process_latent_in``). The UNet sees 64x64 pictures as 4x32x32 latents, Flux
128x128 pictures as 16x32x32 latents (16x16 tokens), Wan clips of WAN_FRAMES 128x128 frames as
16xWAN_FRAMESx32x32 latents (each frame encoded alone: no temporal compression, unlike Wan's VAE).

Conditioning is fixed (an unconditional denoiser that accepts ComfyUI's normal call): a seeded
text context (and pooled vector for Flux) that ``conditioning()`` returns.

Library use (ComfyUI must already be importable with its device chosen, as for toma_bench.models):
``load_unet()``/``load_flux()``/``load_wan()`` give ModelPatchers; ``conditioning(model)`` their CONDITIONING;
``sample(model, ...)`` LATENT samples from noise; ``latent_to_images``/``images_to_latent`` convert
between LATENT samples and ComfyUI IMAGE tensors.
"""
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import models, sampling

REPO = Path(__file__).resolve().parent.parent
PROXY_DIR = Path(__file__).resolve().parent / "proxies"
DEFAULT_CHECK_DIR = REPO / "test-artifacts" / "proxy-check"

# -- architectures ------------------------------------------------------------------------------------
# SD1.x layout (conv in/out of 4 channels, a transformer with self- and cross-attention after every
# ResBlock of the three levels 1/1, 1/2, 1/4 and in the middle block) at small widths.
# Heads of 32 channels: ComfyUI's SD15 class would force 8 heads (head size 8 at width 64), which CPU
# attention kernels run several times slower and no real SD model has (SD1.5: 40 to 160).
SD15_PROXY = dict(models.SD15_SMALL, model_channels=64, channel_mult=[1, 2, 2], context_dim=64, num_heads=-1,
                  num_head_channels=32)
SD15_TINY = dict(SD15_PROXY, model_channels=32, channel_mult=[1, 1, 1], context_dim=16)  # GroupNorm needs 32 channels
# Flux layout (double-stream then single-stream blocks, 3-axis RoPE, 16 channels, patch 2), small:
# head size 64 as in FLUX.1; no guidance embedding (as FLUX.1 [schnell]), so ComfyUI's default
# guidance value is accepted and ignored.
FLUX_PROXY = dict(models.FLUX_FULL, guidance_embed=False, vec_in_dim=32, context_in_dim=64, hidden_size=128,
                  num_heads=2, depth=2, depth_single_blocks=4, axes_dim=[16, 24, 24])
FLUX_TINY = dict(models.FLUX_TINY, guidance_embed=False)
# Wan 2.1 T2V layout (self-attention with 3-axis RoPE over frames x rows x columns, cross-attention to the
# text, 16 channels, patch (1, 2, 2)), small: head size 64 (RoPE axes 24/20/20), a short narrow text.
WAN_PROXY = dict(models.WAN_1_3B, dim=128, ffn_dim=512, num_heads=2, num_layers=3, text_dim=64, text_len=8)
WAN_TINY = dict(models.WAN_TINY, num_layers=2, text_dim=16, text_len=8)
WAN_FRAMES = 4  # latent (and pixel) frames of a training clip
# SDXL layout (no attention at 1/1; attention at 1/2 and, deeper, at 1/4; linear projections in the
# transformers), scaled down: SDXL's depths 2 and 10 (middle 10) become 1 and 2 (middle 1), its widths
# 320/640/1280 32/64/64 (the proxies share a 32 MB budget). Trained on 64x64 latents, so its levels 1/2
# and 1/4 hold 32x32 and 16x16 tokens (SDXL at 1024x1024: 64x64 and 32x32).
SDXL_PROXY = dict(SD15_PROXY, model_channels=32, channel_mult=[1, 2, 2], transformer_depth=[0, 1, 2],
                  transformer_depth_output=[0, 0, 1, 1, 2, 2], transformer_depth_middle=1,
                  use_linear_in_transformer=True)
SDXL_TINY = dict(SDXL_PROXY, channel_mult=[1, 1, 1], transformer_depth=[0, 1, 1],
                 transformer_depth_output=[0, 0, 1, 1, 1, 1], transformer_depth_middle=1, context_dim=16)


@dataclass(frozen=True)
class Spec:
    """What differs between the proxies."""

    arch: str  # "sd15", "flux" or "wan"
    model_class: str  # class in comfy.supported_models
    configs: dict  # size name -> unet_config
    block: int  # pixels per latent pixel along each side (space-to-depth factor)
    context_tokens: int  # length of the fixed text context
    scheduler: str  # ComfyUI scheduler for samples
    file: str  # shipped weights, in PROXY_DIR
    batch: int  # default training batch
    lr: float  # default peak learning rate
    steps: int  # default training steps (about 25 minutes of one busy CPU core)
    frames: int | None = None  # frames of a clip for a video model (latents (B, C, frames, H, W)); None: pictures
    side: int = 32  # latent pixels per side in training, evaluation and samples
    init: str | None = None  # the proxy (a SPECS key) whose shipped weights training starts from
    kind: str = ""  # the model kind, arch_of()'s answer ("sd15", "flux", "wan"); "": arch itself

    @property
    def model_kind(self) -> str:
        return self.kind or self.arch

    @property
    def channels(self) -> int:
        return self.block * self.block


SPECS = {
    "sd15": Spec("sd15", "SD15", {"proxy": SD15_PROXY, "tiny": SD15_TINY}, 2, 8, "normal",
                 "sd15_proxy.safetensors", 8, 1e-3, 450),
    "flux": Spec("flux", "Flux", {"proxy": FLUX_PROXY, "tiny": FLUX_TINY}, 4, 8, "simple",
                 "flux_proxy.safetensors", 8, 6e-4, 1600),
    "wan": Spec("wan", "WAN21_T2V", {"proxy": WAN_PROXY, "tiny": WAN_TINY}, 4, 8, "simple",
                "wan_proxy.safetensors", 8, 8e-4, 500, frames=WAN_FRAMES),
    "sdxl": Spec("sdxl", "SD15", {"proxy": SDXL_PROXY, "tiny": SDXL_TINY}, 2, 8, "normal",
                 "sdxl_proxy.safetensors", 8, 1e-3, 600, side=64, kind="sd15"),
    # The Flux and Wan proxies fine-tuned on 32x32-token grids (64x64 latents), where a 4x4 window is a
    # sixty-fourth of the picture, not a sixteenth: the same architecture, so arch_of() still says flux/wan.
    "flux32": Spec("flux32", "Flux", {"proxy": FLUX_PROXY}, 4, 8, "simple", "flux32_proxy.safetensors", 8, 3e-4,
                   300, side=64, init="flux", kind="flux"),
    "wan32": Spec("wan32", "WAN21_T2V", {"proxy": WAN_PROXY}, 4, 8, "simple", "wan32_proxy.safetensors", 4, 4e-4,
                  120, frames=WAN_FRAMES, side=64, init="wan", kind="wan"),
}
LATENT_SIDE = 32  # latent side of the 16x16-token proxies (sd15, flux, wan)
CODEC_SEED, CONTEXT_SEED = 1234, 4321
# Model-space latent = DATA_SCALE * orthogonal map of [-1, 1] pixels: the training crops then have an
# RMS of about 1 per latent element, the scale ComfyUI's schedules assume (SD latents after 0.18215).
DATA_SCALE = 2.25


def spec_of(arch: str) -> Spec:
    if arch not in SPECS:
        raise ValueError(f"arch must be one of {', '.join(SPECS)}, got {arch!r}")
    return SPECS[arch]


def arch_of(model) -> str:
    """The model kind, "sd15" (any UNet), "flux" or "wan", of a ModelPatcher built by this module."""
    image_model = model.model.model_config.unet_config.get("image_model")
    return {"flux": "flux", "wan2.1": "wan"}.get(image_model, "sd15")


# -- pictures <-> latents ------------------------------------------------------------------------------
def codec_matrix(channels: int) -> torch.Tensor:
    """The fixed orthogonal (channels x channels) map from a pixel block to latent channels: QR of a
    seeded Gaussian matrix, signs fixed so the factorisation is unique. Every channel mixes every pixel
    of its block, so all channels carry the block's mean, as an SD VAE's channels all carry image content."""
    g = torch.Generator().manual_seed(CODEC_SEED + channels)
    q, r = torch.linalg.qr(torch.randn(channels, channels, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def per_frame(code, x: torch.Tensor) -> torch.Tensor:
    """``code`` (4-D -> 4-D) applied to every frame of a 5-D video tensor (B, C, T, H, W); 4-D passes through."""
    if x.ndim == 4:
        return code(x)
    b, t = x.shape[0], x.shape[2]
    return code(x.transpose(1, 2).flatten(0, 1)).unflatten(0, (b, t)).transpose(1, 2)


def encode(pixels: torch.Tensor, block: int) -> torch.Tensor:
    """Grayscale pictures (B, 1, H, W) in [-1, 1] -> model-space latents (B, block^2, H/block, W/block);
    clips (B, 1, T, H, W) frame by frame -> (B, block^2, T, H/block, W/block)."""
    def code(x):
        x = F.pixel_unshuffle(x, block)
        return DATA_SCALE * torch.einsum("ck,bkhw->bchw", codec_matrix(block * block).to(x), x)

    return per_frame(code, pixels)


def decode(latents: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of ``encode``."""
    def code(x):
        return F.pixel_shuffle(torch.einsum("kc,bkhw->bchw", codec_matrix(block * block).to(x), x / DATA_SCALE), block)

    return per_frame(code, latents)


def latent_to_images(model, samples: torch.Tensor) -> torch.Tensor:
    """LATENT samples (what ``comfy.sample.sample`` returns) -> ComfyUI IMAGE (B, H, W, 3) in [0, 1], gray.
    Video latents (B, C, T, h, w) give every frame as a picture, clip by clip: IMAGE (B * T, H, W, 3)."""
    pixels = decode(model.model.process_latent_in(samples.float()), spec_of(arch_of(model)).block)
    if pixels.ndim == 5:
        pixels = pixels.transpose(1, 2).flatten(0, 1)
    return ((pixels.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1).repeat(1, 1, 1, 3)


def images_to_latent(model, images: torch.Tensor) -> torch.Tensor:
    """ComfyUI IMAGE (B, H, W, C) in [0, 1], C = 1 or 3 (taken to luma) -> LATENT samples for ``model``
    (e.g. for img2img). H and W must be multiples of the proxy's block (2 for sd15, 4 for flux and wan).
    For wan the B pictures are the frames of one clip, as ComfyUI's video nodes take them: (1, C, B, h, w)."""
    gray = images if images.shape[-1] == 1 else to_luma(images)
    pixels = gray.permute(0, 3, 1, 2).float() * 2 - 1
    if spec_of(arch_of(model)).frames:
        pixels = pixels.transpose(0, 1)[None]
    return model.model.process_latent_out(encode(pixels, spec_of(arch_of(model)).block))


def to_luma(rgb: torch.Tensor) -> torch.Tensor:
    """(..., 3) -> (..., 1) with the ITU-R BT.601 weights."""
    return (rgb * torch.tensor([0.299, 0.587, 0.114], dtype=rgb.dtype)).sum(-1, keepdim=True)


# -- models -------------------------------------------------------------------------------------------
def build(arch: str, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, zero_outputs: bool = False):
    """A ModelPatcher of ``arch`` with seeded random weights (toma_bench.models' PyTorch-default init).
    ``zero_outputs``: the training start instead, as LDM and DiT initialise: the last layer of every
    residual branch (ResBlock out conv, SpatialTransformer proj_out; Flux's adaLN modulations; Wan's
    attention and feed-forward output layers) and the output layer at zero, so every block starts as the
    identity and the model predicts 0."""
    import comfy.supported_models

    spec = spec_of(arch)
    if not hasattr(comfy.supported_models, spec.model_class):
        raise RuntimeError(f"this ComfyUI has no {spec.model_class} model (Flux and Wan exist only in current ComfyUI)")
    if spec.model_kind == "flux":
        model = models.build_flux(seed, dtype, config)
    elif spec.model_kind == "wan":
        model = models.build_wan("t2v", seed, dtype, config)
    else:
        model = build_sd15(config, seed, dtype)
    if zero_outputs:
        zero_residual_outputs_(model.model.diffusion_model, spec.model_kind)
    return model


def build_sd15(config: dict, seed: int, dtype: torch.dtype):
    """models.build_unet("sd15", ...) with the head layout of ``config`` (SD15's class overrides it)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    cfg = comfy.supported_models.SD15(dict(config))
    cfg.unet_config.update(num_heads=config["num_heads"], num_head_channels=config["num_head_channels"])
    cfg.set_inference_dtype(dtype, None)
    base = models.build_base(cfg)
    models.init_weights_(base, seed)
    return comfy.model_patcher.ModelPatcher(base.to(dtype), load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def zero_residual_outputs_(dm: torch.nn.Module, arch: str) -> None:
    if arch == "flux":
        from comfy.ldm.flux.layers import Modulation

        layers = [m.lin for m in dm.modules() if isinstance(m, Modulation)]
        layers += [dm.final_layer.adaLN_modulation[-1], dm.final_layer.linear]
    elif arch == "wan":
        # Wan's gates are a parameter plus the time embedding, not a layer of their own: the branch outputs go
        layers = [layer for block in dm.blocks for layer in (block.self_attn.o, block.cross_attn.o, block.ffn[-1])]
        layers.append(dm.head.head)
    else:
        from comfy.ldm.modules.attention import SpatialTransformer
        from comfy.ldm.modules.diffusionmodules.openaimodel import ResBlock

        layers = [m.out_layers[-1] for m in dm.modules() if isinstance(m, ResBlock)]
        layers += [m.proj_out for m in dm.modules() if isinstance(m, SpatialTransformer)]
        layers.append(dm.out[-1])
    with torch.no_grad():
        for layer in layers:
            layer.weight.zero_()
            layer.bias.zero_()


def read_metadata(path: Path) -> dict:
    """A proxy file's metadata: arch, unet_config and training (decoded)."""
    import safetensors

    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if "arch" not in meta:
        raise ValueError(f"{path} is not a proxy written by toma_bench.proxy (no 'arch' metadata)")
    return {"arch": meta["arch"], "unet_config": json.loads(meta["unet_config"]),
            "training": json.loads(meta.get("training", "{}"))}


def load(path: Path, dtype: torch.dtype = torch.float32):
    """A ModelPatcher around the proxy saved at ``path`` (architecture from its metadata)."""
    import safetensors.torch

    meta = read_metadata(path)
    model = build(meta["arch"], meta["unet_config"], dtype=dtype)
    sd = safetensors.torch.load_file(str(path))
    # As ComfyUI loads a checkpoint: the tree's own key conversion first (ComfyUI v0.33.0 names Flux's
    # RMSNorm scale "weight"; the proxies were saved by trees that name it "scale").
    sd = model.model.model_config.process_unet_state_dict(sd)
    model.model.diffusion_model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return model


def load_unet(dtype: torch.dtype = torch.float32, path: Path | None = None):
    """The shipped SD1.x-layout proxy UNet as a ComfyUI ModelPatcher (pinned and current ComfyUI)."""
    return load(Path(path or PROXY_DIR / SPECS["sd15"].file), dtype)


def load_flux(dtype: torch.dtype = torch.float32, path: Path | None = None):
    """The shipped Flux-layout proxy DiT as a ComfyUI ModelPatcher (current ComfyUI only)."""
    return load(Path(path or PROXY_DIR / SPECS["flux"].file), dtype)


def load_wan(dtype: torch.dtype = torch.float32, path: Path | None = None):
    """The shipped Wan 2.1-layout proxy video DiT as a ComfyUI ModelPatcher (current ComfyUI only)."""
    return load(Path(path or PROXY_DIR / SPECS["wan"].file), dtype)


def context_tensors(model) -> dict:
    """The fixed conditioning the proxy was trained with, as ``apply_model`` keywords for a batch of
    1: ``c_crossattn`` (1, tokens, context dim) and, for Flux, the pooled vector ``y`` (1, vec_in_dim)."""
    arch, config = arch_of(model), model.model.model_config.unet_config
    g = torch.Generator().manual_seed(CONTEXT_SEED)
    tokens = spec_of(arch).context_tokens
    if arch == "flux":
        context = torch.randn(1, tokens, config["context_in_dim"], generator=g)
        return {"c_crossattn": context, "y": torch.randn(1, config["vec_in_dim"], generator=g)}
    if arch == "wan":
        return {"c_crossattn": torch.randn(1, tokens, config["text_dim"], generator=g)}
    return {"c_crossattn": torch.randn(1, tokens, config["context_dim"], generator=g)}


def conditioning(model, batch: int = 1):
    """(positive, negative) CONDITIONING for ``model``: both the fixed context it was trained with
    (it is unconditional, so any cfg samples the same pictures)."""
    tensors = context_tensors(model)

    def cond():
        opts = {"pooled_output": tensors["y"].expand(batch, -1)} if "y" in tensors else {}
        return [[tensors["c_crossattn"].expand(batch, -1, -1), opts]]

    return cond(), cond()


# -- sampling -----------------------------------------------------------------------------------------
def sample(model, seed: int = 0, batch: int = 16, steps: int = 20, sampler: str = "euler",
           scheduler: str | None = None, side: int = LATENT_SIDE, frames: int | None = None,
           callback=None) -> torch.Tensor:
    """LATENT samples (batch, C, side, side), for wan clips (batch, C, frames, side, side), drawn from
    seeded noise by ComfyUI's sampler (cfg 1: the proxies are unconditional). ``scheduler``: default
    normal for sd15, simple for flux and wan. ``frames``: latent frames of a clip (default: the proxy's
    training clips'); pictures have none. ``callback``: the sampler's, called after each step."""
    spec = spec_of(arch_of(model))
    if frames is not None and not spec.frames:
        raise ValueError(f"frames is for the video proxies; {arch_of(model)} samples pictures")
    frames = (frames or spec.frames,) if spec.frames else ()
    latent = torch.zeros(batch, spec.channels, *frames, side, side)
    with torch.no_grad():
        return sampling.sample(model, conditioning(model, batch), latent, steps=steps, sampler=sampler,
                               scheduler=scheduler or spec.scheduler, seed=seed, callback=callback)


if __name__ == "__main__":
    # the shipped proxies' metadata record their commands as ``python -m toma_bench.proxy ...``: hand them
    # to the training's command line by running it, not by importing it (the training imports this module)
    import runpy

    runpy.run_module("toma_bench.proxy_training", run_name="__main__", alter_sys=True)
