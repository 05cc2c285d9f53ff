"""Real-architecture ComfyUI models with seeded random weights (no weights can be downloaded here).

Weights follow PyTorch's default initialisation (kaiming-uniform linear/conv, unit norms), drawn from a
seeded ``torch.Generator``: activations stay O(1), so merging errors show up instead of hiding under a
tiny init. ComfyUI must already be importable with the CPU selected (see tests/comfy_host.py); this module
imports comfy lazily.
"""
import math

import torch

# SD1.5 widths (detected as SD15 by CheckpointLoaderSimple: model_channels 320, context 768, conv proj)
# with a small depth so a CPU step takes about a second at 512x512. Full SD1.5 is channel_mult [1,2,4,4],
# num_res_blocks 2, one transformer per attention block.
SD15_SMALL = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "in_channels": 4, "out_channels": 4, "model_channels": 320,
    "num_res_blocks": [1, 1, 1], "channel_mult": [1, 2, 4],
    "transformer_depth": [1, 1, 1], "transformer_depth_output": [1, 1, 1, 1, 1, 1],
    "transformer_depth_middle": 1, "context_dim": 768, "num_heads": 8,
    "use_linear_in_transformer": False, "adm_in_channels": None,
    "use_temporal_resblock": False, "use_temporal_attention": False,
}
SD15_FULL = dict(SD15_SMALL, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1])

# SDXL architecture: attention at 1/2 (2 layers per block) and 1/4 (10 layers) of the latent, none at
# full resolution. SDXL_SMALL keeps the widths and levels with 1 layer per block for CPU runs.
SDXL_FULL = {
    "use_checkpoint": False, "image_size": 32, "use_spatial_transformer": True, "legacy": False,
    "in_channels": 4, "out_channels": 4, "model_channels": 320, "num_res_blocks": [2, 2, 2],
    "channel_mult": [1, 2, 4], "transformer_depth": [0, 0, 2, 2, 10, 10],
    "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10], "transformer_depth_middle": 10,
    "context_dim": 2048, "num_head_channels": 64, "use_linear_in_transformer": True,
    "adm_in_channels": 2816, "num_classes": "sequential", "use_temporal_resblock": False,
    "use_temporal_attention": False,
}
SDXL_SMALL = dict(SDXL_FULL, num_res_blocks=[1, 1, 1], transformer_depth=[0, 1, 1],
                  transformer_depth_output=[0, 0, 1, 1, 1, 1], transformer_depth_middle=1)


def init_weights_(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """PyTorch's default init for every parameter, from a seeded generator (ComfyUI creates its layers
    uninitialised, trap T4)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) gives exactly this bound
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias") and "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape).uniform_(-0.1, 0.1, generator=g))
    return module


def build_unet(arch: str = "sd15", seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None):
    """A ComfyUI ModelPatcher around a random-weight UNet: arch "sd15" or "sdxl" (config overrides)."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    family = {"sd15": (comfy.supported_models.SD15, SD15_SMALL), "sdxl": (comfy.supported_models.SDXL, SDXL_SMALL)}
    cls, default = family[arch]
    cfg = cls(dict(config or default))
    cfg.set_inference_dtype(dtype, None)
    base = cfg.get_model({})
    init_weights_(base, seed)
    base.to(dtype)
    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())


def conditioning(arch: str, batch: int = 1, tokens: int = 77, seed: int = 0, height: int = 1024, width: int = 1024):
    """(positive, negative) CONDITIONING lists for ``arch``, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    dim = {"sd15": 768, "sdxl": 2048}[arch]
    extra = {}
    if arch == "sdxl":
        extra = {"width": width, "height": height}

    def cond():
        opts = dict(extra)
        if arch == "sdxl":
            opts["pooled_output"] = torch.randn(batch, 1280, generator=g)
        return [[torch.randn(batch, tokens, dim, generator=g), opts]]

    return cond(), cond()


def structured_latent(batch: int, height: int, width: int, seed: int = 0, channels: int = 4) -> torch.Tensor:
    """A smooth latent (sums of low-frequency waves), the kind an image encodes to, not white noise."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.linspace(0, 1, height)[:, None]
    xs = torch.linspace(0, 1, width)[None, :]
    out = torch.zeros(batch, channels, height, width)
    for b in range(batch):
        for c in range(channels):
            for _ in range(4):
                fy, fx, phase = (torch.rand(3, generator=g) * torch.tensor([4.0, 4.0, 6.28])).tolist()
                out[b, c] += torch.sin(2 * math.pi * (fy * ys + fx * xs) + phase)
    return out / 2


def save_sd15_checkpoint(path, seed: int = 0, config: dict | None = None) -> None:
    """Write a random-weight UNet checkpoint that ComfyUI's CheckpointLoaderSimple detects as SD1.5
    (widths 320/768; any depth). UNet weights only: ComfyUI then has no CLIP (use a CONDITIONING node)."""
    import safetensors.torch

    model = build_unet("sd15", seed, torch.float16, config)
    sd = {f"model.diffusion_model.{k}": v.contiguous()
          for k, v in model.model.diffusion_model.state_dict().items()}
    safetensors.torch.save_file(sd, str(path))
