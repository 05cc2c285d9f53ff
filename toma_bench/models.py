"""Real-architecture ComfyUI models with seeded random weights (no weights can be downloaded here).

Weights follow PyTorch's default initialisation (kaiming-uniform linear/conv, unit norms), drawn from a
seeded ``torch.Generator``: activations stay O(1), so merging errors show up instead of hiding under a
tiny init. ComfyUI must already be importable with the CPU selected (see comfy_host.import_comfy); this
module imports comfy lazily.
"""
import math
import re

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
# ComfyUI's UNet pops transformer_depth_output from the end, lowest resolution first: the 1/8 level's
# three decoder blocks (no attention) are the last three entries.
SD15_FULL = dict(SD15_SMALL, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
                 transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0],
                 transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0])

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


def init_weights_(module: torch.nn.Module, seed: int, draw_device=None) -> torch.nn.Module:
    """PyTorch's default init for every parameter, from a seeded generator (ComfyUI creates its layers
    uninitialised: docs/architecture.md, pitfalls). The numbers are drawn on the CPU, the same on every
    machine, unless ``draw_device`` names a faster place (a GPU draws FLUX.1-dev's 12B weights in
    seconds, a CPU core takes minutes); the same seed then gives the same model on that kind of device."""
    g = torch.Generator(draw_device or "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) gives exactly this bound
                p.copy_(torch.empty(p.shape, device=g.device).uniform_(-bound, bound, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            elif name.endswith("bias") and "norm" in name:
                p.zero_()
            else:
                p.copy_(torch.empty(p.shape, device=g.device).uniform_(-0.1, 0.1, generator=g))
    return module


def normal_init_(module: torch.nn.Module, seed: int, vector_std: float = 0.01) -> torch.nn.Module:
    """Issue 46's draw (part 6), from a seeded generator: every matrix N(0, 1/fan_in), every parameter named as a
    norm's weight 1, every other vector (biases, and the QK-norms' scales) N(0, vector_std^2). Its QK-norm scales
    near 0.01 shrink every query and key a hundredfold, so each attention map is near uniform: there proportional
    attention reproduces unmerged attention whatever the merge (docs/notebook.md, 2026-12-07). The issue's tree
    named a QK-norm's scale ``scale`` (v0.3.75's Flux-layer RMSNorm); v0.33.0's operations.RMSNorm names it
    ``weight``: either draws as the issue's did."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight") and not name.endswith(("query_norm.weight",
                                                                                    "key_norm.weight")):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * vector_std)
    return module


def build_unet(arch: str = "sd15", seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None,
               draw_device=None):
    """A ComfyUI ModelPatcher around a random-weight UNet: arch "sd15" or "sdxl" (config overrides);
    ``draw_device``: see init_weights_."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models

    family = {"sd15": (comfy.supported_models.SD15, SD15_SMALL), "sdxl": (comfy.supported_models.SDXL, SDXL_SMALL)}
    cls, default = family[arch]
    cfg = cls(dict(config or default))
    cfg.set_inference_dtype(dtype, None)
    base = build_base(cfg)
    init_weights_(base, seed, draw_device)
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


def save_sd15_checkpoint(path, seed: int = 0, config: dict | None = None, vae: bool = False) -> None:
    """Write a random-weight UNet checkpoint that ComfyUI's CheckpointLoaderSimple detects as SD1.5
    (widths 320/768; any depth). No CLIP: ComfyUI then has no text encoder (use a CONDITIONING node).

    ``vae=True`` adds a random TAESD (ComfyUI's tiny autoencoder, 2.4M params, 8x upscale), which both
    trees pick from its ``taesd_decoder.*`` keys: without VAE keys current ComfyUI has no VAE, and the
    full SD1.5 AutoencoderKL (84M params) takes a minute per 512x512 decode on a 2-core CPU."""
    import safetensors.torch

    model = build_unet("sd15", seed, torch.float16, config)
    sd = {f"model.diffusion_model.{k}": v.contiguous()
          for k, v in model.model.diffusion_model.state_dict().items()}
    if vae:
        import comfy.taesd.taesd

        taesd = comfy.taesd.taesd.TAESD()
        init_weights_(taesd.taesd_encoder, seed + 1)  # the conv stacks only: the latent scale (and shift,
        init_weights_(taesd.taesd_decoder, seed + 2)  # current tree) keep their constructor values 1 and 0
        with torch.no_grad():
            taesd.taesd_decoder[-1].bias.fill_(0.5)  # images centred on mid-grey instead of near-black
        sd.update({f"first_stage_model.{k}": v.to(torch.float16).contiguous() for k, v in taesd.state_dict().items()})
    safetensors.torch.save_file(sd, str(path))


# -- DiTs (current ComfyUI only) --------------------------------------------------------------------
# FLUX.1 [dev] widths and depths (schnell: guidance_embed False). Text is T5-XXL (4096), pooled CLIP-L (768).
FLUX_FULL = {
    "image_model": "flux", "guidance_embed": True, "in_channels": 16, "out_channels": 16, "patch_size": 2,
    "vec_in_dim": 768, "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24,
    "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
}
# Reduced width and depth for CPU benchmarks (head size 64 as in Flux; conditioning shapes of the real model).
FLUX_SMALL = dict(FLUX_FULL, hidden_size=512, num_heads=8, depth=4, depth_single_blocks=8, axes_dim=[16, 24, 24])
# Tiny, for tests: both block groups present, a few ms per step on a 16x16 token grid.
FLUX_TINY = dict(FLUX_FULL, vec_in_dim=32, context_in_dim=64, hidden_size=64, num_heads=4, depth=2,
                 depth_single_blocks=3, axes_dim=[4, 6, 6])

# SD3.5-medium-like MMDiT (q/k RMS norm, second self-attention in x_block, last block pre_only), tiny:
# MMDiT fixes hidden = 64 * depth and heads = depth. pos_embed_max_size 96 fits latents up to 192x192.
SD3_TINY = {
    "in_channels": 16, "out_channels": 16, "patch_size": 2, "depth": 2, "input_size": None,
    "adm_in_channels": 32, "context_embedder_config": {"target": "torch.nn.Linear",
                                                       "params": {"in_features": 64, "out_features": 128}},
    "num_patches": 96 * 96, "pos_embed_max_size": 96, "qk_norm": "rms", "pos_embed_scaling_factor": None,
    "x_block_self_attn_layers": [0],
}


def _unit_norm_scales_(module: torch.nn.Module) -> None:
    """Norm scales to 1 (PyTorch's default) where init_weights_ cannot tell them by name (Flux's q/k
    RMSNorm ``scale``, SD3's ``ln_q``/``ln_k`` weights): a 0.1 scale would flatten every attention map."""
    with torch.no_grad():
        for m in module.modules():
            if "Norm" in type(m).__name__:
                for name, p in m.named_parameters(recurse=False):
                    if name in ("weight", "scale"):
                        p.fill_(1.0)


def _patcher(base):
    import comfy.model_management as mm
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device())

# How Python says a constructor lacks fields: "FluxParams.__init__() missing 1 required positional argument:
# 'txt_ids_dims'" (two: "...: 'a' and 'b'", three or more: "...: 'a', 'b', and 'c'").
_MISSING_FIELDS = re.compile(r"(\w+)\.__init__\(\) missing \d+ required (?:positional|keyword-only) arguments?: (.+)")


def build_base(model_config, device=None, unet_model=None):
    """The BaseModel of a ComfyUI ``model_config`` (a supported_models class instance; weights uninitialised, as
    ComfyUI creates them), built as ComfyUI builds a checkpoint of that layout: a field this tree's constructors
    require and ``model_config.unet_config`` leaves out (one a later tree added: ComfyUI v0.33's
    FluxParams.txt_ids_dims, ChromaParams.vec_in_dim, HunyuanVideoParams.meanflow_sum) gets the value ComfyUI's
    model detection (``comfy.model_detection.detect_unet_config``) reads from the state dict of that layout,
    built on the meta device with the field at None; it is added to ``unet_config``. A field detection does not
    give is an error that names it. The test configs therefore hold what makes a layout (widths, depths, which
    parts exist), not each tree's bookkeeping. ``unet_model``: the diffusion model's class, in a plain
    flow-matching BaseModel (LTX-2)."""
    import comfy.model_base

    def build(on):
        if unet_model is None:
            return model_config.get_model({}, device=on)
        return comfy.model_base.BaseModel(model_config, comfy.model_base.ModelType.FLUX, device=on,
                                          unet_model=unet_model)

    config, filled, owner = model_config.unet_config, [], None
    while True:
        try:
            base = build("meta" if filled else device)
            break
        except TypeError as error:
            lack = _MISSING_FIELDS.search(str(error))
            names = re.findall(r"'(\w+)'", lack.group(2)) if lack else []
            if not names or set(names) & set(filled):  # not a lacking field, or one that is not the config's
                raise
            owner = lack.group(1)
            filled += names
            config.update(dict.fromkeys(names))
    if not filled:
        return base
    import comfy.model_detection

    detected = comfy.model_detection.detect_unet_config(base.diffusion_model.state_dict(), "") or {}
    lacking = [name for name in filled if name not in detected]
    if lacking or detected.get("image_model") != config.get("image_model"):
        raise RuntimeError(f"this ComfyUI's {owner} requires {', '.join(filled)}; model detection reads the layout of "
                           f"{type(model_config).__name__}({config.get('image_model')!r}) as "
                           f"{detected.get('image_model')!r} and gives {sorted(set(filled) - set(lacking))}")
    config.update({name: detected[name] for name in filled})
    return build(device)


def _random_dit(model_config, seed: int, dtype: torch.dtype, device=None, draw_device=None, cast: bool = True):
    """The random-weight BaseModel of a ComfyUI ``model_config`` (a supported_models class instance; built by
    build_base): layers in ``dtype``, every parameter drawn from ``seed``, unit norm scales."""
    model_config.set_inference_dtype(dtype, None)
    base = build_base(model_config, device)
    init_weights_(base, seed, draw_device)
    _unit_norm_scales_(base)
    return base.to(dtype) if cast else base



def build_flux(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None,
               draw_device=None):
    """A ComfyUI ModelPatcher around a random-weight Flux (FLUX_TINY unless ``config``; FLUX_FULL is
    FLUX.1-dev). ``device``: where the weights are created (default CPU); weights are drawn on the CPU
    from a seeded generator, so a model is the same on every device, unless ``draw_device`` says
    otherwise (see init_weights_)."""
    import comfy.supported_models

    flux = comfy.supported_models.Flux(dict(config or FLUX_TINY))
    return _patcher(_random_dit(flux, seed, dtype, device, draw_device))


def build_sd3(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight SD3/SD3.5 MMDiT (SD3_TINY unless ``config``). The
    position-embedding table is a buffer ComfyUI leaves uninitialised: it gets SD3's 2-D sin-cos table."""
    import comfy.supported_models
    from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed_torch

    cfg = comfy.supported_models.SD3(dict(config or SD3_TINY))
    cfg.set_inference_dtype(dtype, None)
    base = build_base(cfg, device)
    init_weights_(base, seed)
    _unit_norm_scales_(base)
    dm = base.diffusion_model
    if dm.pos_embed is not None:
        side = dm.pos_embed_max_size
        with torch.no_grad():
            dm.pos_embed.copy_(get_2d_sincos_pos_embed_torch(dm.hidden_size, side, side)[None])
    return _patcher(base.to(dtype))


def dit_conditioning(arch: str, config: dict, batch: int = 1, tokens: int = 256, seed: int = 0,
                     reference_latent: torch.Tensor | None = None):
    """(positive, negative) CONDITIONING for a model built by build_flux ("flux") or build_sd3 ("sd3")
    from ``config``: text (batch, tokens, context dim) and pooled vectors from a seeded generator. Flux
    gets guidance 3.5 and, with ``reference_latent`` (B, 16, h, w), a Kontext reference image."""
    g = torch.Generator().manual_seed(seed)
    if arch == "flux":
        context, pooled = config["context_in_dim"], config["vec_in_dim"]
    elif arch == "sd3":
        context = config["context_embedder_config"]["params"]["in_features"]
        pooled = config["adm_in_channels"]
    else:
        raise ValueError(f"arch must be 'flux' or 'sd3', got {arch!r}")

    def cond():
        opts = {"pooled_output": torch.randn(batch, pooled, generator=g)}
        if arch == "flux":
            opts["guidance"] = 3.5
            if reference_latent is not None:
                opts["reference_latents"] = [reference_latent]
        return [[torch.randn(batch, tokens, context, generator=g), opts]]

    return cond(), cond()


# -- video DiTs (current ComfyUI only) --------------------------------------------------------------
# HunyuanVideo 1.0 widths and depths: text from LLaVA-Llama-3 (4096), pooled CLIP-L (768), patch 1x2x2.
HUNYUAN_VIDEO_FULL = {
    "image_model": "hunyuan_video", "in_channels": 16, "out_channels": 16, "vec_in_dim": 768,
    "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 20,
    "depth_single_blocks": 40, "axes_dim": [16, 56, 56], "theta": 256, "patch_size": [1, 2, 2],
    "qkv_bias": True, "guidance_embed": True, "byt5": False, "meanflow": False,
}
# Tiny, for tests: both block groups present (1 of 2 double, 3 of 3 single blocks merge).
HUNYUAN_VIDEO_TINY = dict(HUNYUAN_VIDEO_FULL, vec_in_dim=32, context_in_dim=64, hidden_size=64, num_heads=4,
                          depth=2, depth_single_blocks=3, axes_dim=[4, 6, 6])

# LTX-Video 0.9 2B: 28 blocks of 32 heads x 64, text from T5-XXL (4096), 128 latent channels.
LTXV_FULL = {"image_model": "ltxv", "in_channels": 128, "cross_attention_dim": 2048, "attention_head_dim": 64,
             "num_attention_heads": 32, "caption_channels": 4096, "num_layers": 28}
# Tiny, for tests (blocks 1-3 of 4 merge); the cross-attention width is the inner width, as in LTX-Video.
LTXV_TINY = dict(LTXV_FULL, cross_attention_dim=64, attention_head_dim=16, num_attention_heads=4,
                 caption_channels=48, num_layers=4)


def build_hunyuan_video(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None,
                        device=None, image: bool = False):
    """A ComfyUI ModelPatcher around a random-weight HunyuanVideo (HUNYUAN_VIDEO_TINY unless ``config``;
    HUNYUAN_VIDEO_FULL is HunyuanVideo 1.0); ``image``: ComfyUI's HunyuanImage 2.1 model around the same
    class (``config`` then needs a 2-D patch_size and vec_in_dim None)."""
    import comfy.supported_models

    family = comfy.supported_models.HunyuanImage21 if image else comfy.supported_models.HunyuanVideo
    return _patcher(_random_dit(family(dict(config or HUNYUAN_VIDEO_TINY)), seed, dtype, device))


def build_ltxv(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight LTX-Video (LTXV_TINY unless ``config``; LTXV_FULL is
    the 2B model)."""
    import comfy.supported_models

    return _patcher(_random_dit(comfy.supported_models.LTXV(dict(config or LTXV_TINY)), seed, dtype, device))


# LTX-2 19B (LTXAVModel, ComfyUI of 2026; its class defaults): 48 blocks, video 32 heads x 128 over 128 latent
# channels, audio 32 heads x 64 over its 8 x 16 audio latent; text from Gemma-3-12B (3840) through LTX-2's
# video and audio connectors, concatenated (2 x 3840).
LTX2_FULL = {"image_model": "ltxav", "in_channels": 128, "audio_in_channels": 128, "cross_attention_dim": 4096,
             "audio_cross_attention_dim": 2048, "attention_head_dim": 128, "audio_attention_head_dim": 64,
             "num_attention_heads": 32, "audio_num_attention_heads": 32, "caption_channels": 3840, "num_layers": 48}
# LTX-2 (LTXAVModel, ComfyUI of 2026), tiny, for tests: 3 blocks (all merge), video 2 heads x 16 over 16 latent
# channels, audio 2 heads x 8 over LTX-2's 8 x 16 audio latent; each cross-attention as wide as its stream.
LTX2_TINY = {"image_model": "ltxav", "in_channels": 16, "audio_in_channels": 128, "cross_attention_dim": 32,
             "audio_cross_attention_dim": 16, "attention_head_dim": 16, "audio_attention_head_dim": 8,
             "num_attention_heads": 2, "audio_num_attention_heads": 2, "caption_channels": 24, "num_layers": 3}


def build_ltx2(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight LTX-2 (LTX2_TINY unless ``config``): the LTXAVModel of
    the ``comfy.ldm.lightricks.av_model`` in sys.modules, in a plain BaseModel (flow matching, as
    LTX-Video's)."""
    import comfy.model_base
    import comfy.supported_models
    from comfy.ldm.lightricks.av_model import LTXAVModel

    model_config = comfy.supported_models.LTXV(dict(config or LTX2_TINY))
    model_config.set_inference_dtype(dtype, None)
    base = build_base(model_config, device, unet_model=LTXAVModel)
    init_weights_(base, seed)
    _unit_norm_scales_(base)
    return _patcher(base.to(dtype))


# Krea 2 (ComfyUI v0.33.0 on) as ComfyUI's model_detection reads it (the class defaults): 28 single-stream blocks of
# 48 query and 12 key-value heads of 128, text from 12 layers of Qwen3-VL-4B (2560) fused, Wan 2.1 latents, patch 2.
KREA2_FULL = {"image_model": "krea2", "features": 6144, "channels": 16, "patch": 2, "layers": 28, "heads": 48,
              "kvheads": 12, "txtlayers": 12, "txtdim": 2560}
# Tiny, for tests: 4 blocks (the first never merges), 4 heads of 16 over 2 key-value heads, 2 text layers of 32.
KREA2_TINY = dict(KREA2_FULL, features=64, layers=4, heads=4, kvheads=2, txtlayers=2, txtdim=32, txtheads=2,
                  txtkvheads=2)


def build_krea2(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight Krea 2 (KREA2_TINY unless ``config``)."""
    import comfy.supported_models

    return _patcher(_random_dit(comfy.supported_models.Krea2(dict(config or KREA2_TINY)), seed, dtype, device))


# MiniMax-H3 (ComfyUI v0.33.0 on) as ComfyUI's model_detection reads it (its class defaults): 50 blocks of 56
# heads x 128, a 2-layer text refiner over Qwen3-VL states (5120), 24-channel video latents patched 1x2x2,
# stereo 32-channel audio latents (2 rows a latent frame), RoPE over (t, h, w) on 96 of each head's 128 channels.
MINIMAX_H3_FULL = {"image_model": "minimax_h3", "num_layers": 50, "token_refiner_num_layers": 2, "hidden_size": 5376,
                   "latents_dim": 24, "audio_latents_dim": 32, "attention_head_dim": 128, "num_attention_heads": 56,
                   "ffn_hidden_size": 14336, "text_dim": 5120, "timestep_input_dim": 256,
                   "time_embed_hidden_size": 5376, "time_embed_dim": 2688, "rope_inv_freq_len": 16}
# Tiny, for tests: 4 blocks (the first never merges), 2 heads x 32 (RoPE on 24 channels), one refiner layer.
MINIMAX_H3_TINY = dict(MINIMAX_H3_FULL, num_layers=4, token_refiner_num_layers=1, hidden_size=64,
                       attention_head_dim=32, num_attention_heads=2, ffn_hidden_size=128, text_dim=48,
                       time_embed_hidden_size=64, time_embed_dim=32, rope_inv_freq_len=4)
MINIMAX_H3_AUDIO_FRAMES = 9  # the tests' audio latent frames (18 packed audio rows)


def build_minimax_h3(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight MiniMax-H3 (MINIMAX_H3_TINY unless ``config``). Its RoPE
    frequencies are a buffer a checkpoint fills and ComfyUI leaves uninitialised: they get base-10000 ones."""
    import comfy.supported_models

    base = _random_dit(comfy.supported_models.MiniMaxH3(dict(config or MINIMAX_H3_TINY)), seed, dtype, device)
    inv_freq = base.diffusion_model.rope.inv_freq
    with torch.no_grad():
        inv_freq.copy_(10000.0 ** (-torch.arange(inv_freq.numel(), dtype=torch.float32) / inv_freq.numel()))
    return _patcher(base)


def minimax_h3_latent(batch: int, frames: int, size, config: dict | None = None,
                      audio_frames: int = MINIMAX_H3_AUDIO_FRAMES):
    """The empty latent ComfyUI's EmptyMiniMaxH3LatentAV gives: a NestedTensor [video (batch, 24, frames, h, w),
    audio (batch, 32, 2, audio_frames)]."""
    import comfy.nested_tensor

    config = config or MINIMAX_H3_TINY
    return comfy.nested_tensor.NestedTensor((torch.zeros(batch, config["latents_dim"], frames, *size),
                                             torch.zeros(batch, config["audio_latents_dim"], 2, audio_frames)))


def video_conditioning(arch: str, config: dict, batch: int = 1, tokens: int = 77, seed: int = 0,
                       text_mask: torch.Tensor | None = None, **extra):
    """(positive, negative) CONDITIONING for a model built by build_hunyuan_video ("hunyuan_video") or
    build_ltxv ("ltxv") from ``config``: text (batch, tokens, context dim) from a seeded generator, the
    pooled vector HunyuanVideo 1.0 needs (none where vec_in_dim is None: HunyuanImage 2.1), the text
    ``attention_mask`` (batch, tokens) of 0/1 (LTX-Video's text encoder always gives one, and its model
    requires it: all ones unless ``text_mask``), and ``extra`` conditioning values (guiding_frame_index,
    ref_latent, keyframe_idxs, frame_rate)."""
    g = torch.Generator().manual_seed(seed)
    if arch == "hunyuan_video":
        context = config["context_in_dim"]
    elif arch == "ltxv":
        context = config["caption_channels"]
    else:
        raise ValueError(f"arch must be 'hunyuan_video' or 'ltxv', got {arch!r}")

    def cond():
        opts = dict(extra)
        if arch == "hunyuan_video" and config["vec_in_dim"] is not None:
            opts["pooled_output"] = torch.randn(batch, config["vec_in_dim"], generator=g)
        if text_mask is not None:
            opts["attention_mask"] = text_mask
        elif arch == "ltxv":
            opts["attention_mask"] = torch.ones(batch, tokens, dtype=torch.long)
        return [[torch.randn(batch, tokens, context, generator=g), opts]]

    return cond(), cond()


# -- Wan 2.1 / 2.2 (current ComfyUI only) ------------------------------------------------------------
# Wan 2.1 T2V 1.3B as ComfyUI detects it (model_detection: heads = dim / 128, patch (1, 2, 2)); umT5-XXL
# text (4096), 16-channel latents (VAE stride 4 x 8 x 8). 14B: dim 5120, ffn 13824, 40 heads, 40 blocks.
WAN_1_3B = {
    "image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 512, "in_dim": 16,
    "dim": 1536, "ffn_dim": 8960, "freq_dim": 256, "text_dim": 4096, "out_dim": 16, "num_heads": 12,
    "num_layers": 30, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
# Reduced width and depth for CPU benchmarks: head size 128 as in Wan, the real text width.
WAN_SMALL = dict(WAN_1_3B, dim=512, ffn_dim=2048, num_heads=4, num_layers=4)
# Tiny, for tests: 4 blocks (the first never merges), head size 32 (RoPE axes 12/10/10).
WAN_TINY = dict(WAN_1_3B, dim=64, ffn_dim=128, num_heads=2, num_layers=4, text_dim=32)
# What each variant changes, and the ComfyUI model config (supported_models) that builds it.
WAN_VARIANTS = {
    "t2v": ("WAN21_T2V", {}),
    "i2v": ("WAN21_I2V", {"model_type": "i2v", "in_dim": 36}),  # 16 noise + 4 mask + 16 image; CLIP-H tokens
    "ti2v": ("WAN22_T2V", {"in_dim": 48, "out_dim": 48}),  # Wan 2.2 5B: 48-channel latents, timestep per frame
    "reference": ("WAN21_T2V", {"in_dim_ref_conv": 16}),  # Fun models: a reference latent prepended
    "vace": ("WAN21_Vace", {"model_type": "vace", "vace_layers": 2, "vace_in_dim": 96}),
    "camera": ("WAN21_Camera", {"model_type": "camera", "in_dim": 32}),
    "animate": ("WAN22_Animate", {"model_type": "animate", "in_dim": 36}),
    "s2v": ("WAN22_S2V", {"model_type": "s2v", "audio_dim": 32, "num_audio_token": 2, "audio_inject_layers": [0, 2]}),
    "humo": ("WAN21_HuMo", {"model_type": "humo"}),
    # ComfyUI v0.33.0 (2026)
    "flow_rvs": ("WAN21_FlowRVS", {"model_type": "flow_rvs"}),  # a plain WanModel (image-to-image flow)
    "wandancer": ("WAN22_WanDancer", {"model_type": "wandancer", "audio_inject_layers": [0, 2]}),  # music-driven
    "causal_ar": ("WAN21_CausalAR_T2V", {}),
    "animate2": ("WAN_Animate2", {"model_type": "animate2"}),
    "scail": ("WAN21_SCAIL", {"model_type": "scail", "in_dim": 20}),  # 16 latent + 4 mask channels
    "scail2": ("WAN21_SCAIL2", {"model_type": "scail2", "in_dim": 20}),
}


def build_wan(variant: str = "t2v", seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None,
              device=None, draw_device=None):
    """A ComfyUI ModelPatcher around a random-weight Wan model of ``variant`` (a key of WAN_VARIANTS), at
    WAN_TINY widths unless ``config`` (WAN_1_3B is Wan 2.1 1.3B); the variant's keys override it.
    ``device`` and ``draw_device`` as in build_flux."""
    import comfy.supported_models

    model_config, changes = WAN_VARIANTS[variant]
    # layers in ``dtype``, but Wan keeps its patch embedding fp32: no cast
    wan = getattr(comfy.supported_models, model_config)({**(config or WAN_TINY), **changes})
    return _patcher(_random_dit(wan, seed, dtype, device, draw_device, cast=False))


def wan_conditioning(config: dict, batch: int = 1, tokens: int = 512, seed: int = 0, **options):
    """(positive, negative) CONDITIONING for a model built by build_wan from ``config``: umT5-like text
    (batch, tokens, text_dim) from a seeded generator, and ``options`` (clip_vision_output,
    reference_latents, ...) on both."""
    g = torch.Generator().manual_seed(seed)

    def cond():
        return [[torch.randn(batch, tokens, config["text_dim"], generator=g), dict(options)]]

    return cond(), cond()


# -- Qwen-Image (+Edit) and Chroma (current ComfyUI only) ---------------------------------------------
# Qwen-Image (20B) widths and depth: 60 double-stream blocks, 24 heads of 128, Qwen2.5-VL text (3584),
# Wan-VAE latents (B, 16, 1, H, W) patchified 2x2 into 64 channels.
QWEN_IMAGE_FULL = {
    "image_model": "qwen_image", "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
    "axes_dims_rope": (16, 56, 56),
}
# Reduced width and depth for CPU benchmarks: Qwen-Image's head size and RoPE axes, 4 heads, 4 blocks (3
# of them merge, as 44 of the real 60 do).
QWEN_IMAGE_SMALL = dict(QWEN_IMAGE_FULL, num_layers=4, num_attention_heads=4)
# Tiny, for tests: 4 blocks (the first never merges), width 64.
QWEN_IMAGE_TINY = dict(QWEN_IMAGE_FULL, num_layers=4, attention_head_dim=16, num_attention_heads=4,
                       joint_attention_dim=64, axes_dims_rope=(4, 6, 6))

# Chroma (FLUX.1-schnell derived, 8.9B): Flux's blocks without the per-block modulation layers; one
# "distilled guidance" approximator makes every block's modulation vectors. T5-XXL text, no pooled vector.
CHROMA_FULL = {
    "image_model": "chroma", "in_channels": 64, "out_channels": 64, "context_in_dim": 4096, "hidden_size": 3072,
    "mlp_ratio": 4.0, "num_heads": 24, "depth": 19, "depth_single_blocks": 38, "axes_dim": [16, 56, 56],
    "theta": 10000, "patch_size": 2, "qkv_bias": True, "in_dim": 64, "out_dim": 3072, "hidden_dim": 5120,
    "n_layers": 5,
}
CHROMA_TINY = dict(CHROMA_FULL, context_in_dim=64, hidden_size=64, num_heads=4, depth=2, depth_single_blocks=3,
                   axes_dim=[4, 6, 6], out_dim=64, hidden_dim=64, n_layers=2)
# Chroma Radiance: the same transformer on 16x16 pixel patches, decoded per patch by a small NeRF head.
CHROMA_RADIANCE_TINY = dict(CHROMA_TINY, image_model="chroma_radiance", in_channels=3, out_channels=3,
                            patch_size=16, nerf_hidden_size=16, nerf_mlp_ratio=2, nerf_depth=1, nerf_max_freqs=4,
                            nerf_tile_size=0, nerf_final_head_type="linear", nerf_embedder_dtype=torch.float32)


def build_qwen_image(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight Qwen-Image transformer (QWEN_IMAGE_TINY unless
    ``config``); the same model serves Qwen-Image-Edit (reference latents in the conditioning)."""
    import comfy.supported_models

    return _patcher(_random_dit(comfy.supported_models.QwenImage(dict(config or QWEN_IMAGE_TINY)), seed, dtype, device))


def build_chroma(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight Chroma (CHROMA_TINY unless ``config``), or Chroma
    Radiance when the config says ``image_model="chroma_radiance"``."""
    import comfy.supported_models

    radiance = (config or {}).get("image_model") == "chroma_radiance"
    cls = comfy.supported_models.ChromaRadiance if radiance else comfy.supported_models.Chroma
    return _patcher(_random_dit(cls(dict(config or CHROMA_TINY)), seed, dtype, device))


def text_conditioning(context_dim: int, batch: int = 1, tokens: int = 256, seed: int = 0, **options):
    """(positive, negative) CONDITIONING of text embeddings (batch, tokens, context_dim) from a seeded
    generator, each with ``options`` (Qwen-Image-Edit: ``reference_latents=[(B, 16, 1, h, w)]``; Chroma:
    ``pooled_output=None``, as its T5 encoder gives)."""
    g = torch.Generator().manual_seed(seed)
    return ([[torch.randn(batch, tokens, context_dim, generator=g), dict(options)]],
            [[torch.randn(batch, tokens, context_dim, generator=g), dict(options)]])


# -- Lumina 2 and Z-Image (NextDiT; Lumina 2 in current ComfyUI, Z-Image from v0.3.75, Nov 2025) -------------
# Lumina 2 as ComfyUI detects it (model_detection): 26 layers of width 2304, 24 query / 8 key-value heads,
# Gemma-2-2B text (2304), patch 2 on Flux latents.
LUMINA2_FULL = {"image_model": "lumina2", "patch_size": 2, "in_channels": 16, "dim": 2304, "cap_feat_dim": 2304,
                "n_layers": 26, "qk_norm": True, "n_heads": 24, "n_kv_heads": 8, "axes_dims": [32, 32, 32],
                "axes_lens": [300, 512, 512], "ffn_dim_multiplier": 4.0}
# Tiny, for tests: 4 main layers (the first never merges), one refiner layer each, grouped key-value heads.
LUMINA2_TINY = dict(LUMINA2_FULL, dim=64, cap_feat_dim=32, n_layers=4, n_refiner_layers=1, n_heads=4,
                    n_kv_heads=2, axes_dims=[4, 6, 6])
# Z-Image (Turbo and base, 6B): 30 layers of width 3840, Qwen3-4B text (2560), Z-Image modulation (its
# timestep embedding is 256 wide, so a model narrower than 256 cannot be built), caption and image tokens
# padded to multiples of 32.
Z_IMAGE_FULL = dict(LUMINA2_FULL, dim=3840, cap_feat_dim=2560, n_layers=30, n_heads=30, n_kv_heads=30,
                    axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0,
                    ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
                    pad_tokens_multiple=32)
Z_IMAGE_TINY = dict(Z_IMAGE_FULL, dim=256, cap_feat_dim=32, n_layers=4, n_refiner_layers=1, n_heads=8,
                    n_kv_heads=8, axes_dims=[8, 12, 12])


def build_nextdit(config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, device=None):
    """A ComfyUI ModelPatcher around a random-weight NextDiT: Z-Image where ``config`` has Z-Image's
    modulation (Z_IMAGE_TINY, Z_IMAGE_FULL), else Lumina 2 (LUMINA2_TINY, LUMINA2_FULL)."""
    import comfy.supported_models

    family = comfy.supported_models.ZImage if config.get("z_image_modulation") else comfy.supported_models.Lumina2
    return _patcher(_random_dit(family(dict(config)), seed, dtype, device))


# -- Flux.2 and HunyuanVideo 1.5 (ComfyUI v0.3.75, Nov 2025, and later) --------------------------------------
# FLUX.2 [dev] as ComfyUI detects it: Flux's blocks with global modulation, 4-axis RoPE, no pooled vector,
# 128-channel latents (the VAE packs 2x2) taken one token per latent pixel (patch 1), Mistral text (15360).
FLUX2_FULL = {
    "image_model": "flux2", "in_channels": 128, "out_channels": 128, "patch_size": 1, "vec_in_dim": None,
    "context_in_dim": 15360, "hidden_size": 6144, "mlp_ratio": 3.0, "num_heads": 48, "depth": 8,
    "depth_single_blocks": 48, "axes_dim": [32, 32, 32, 32], "theta": 2000, "qkv_bias": False, "ops_bias": False,
    "guidance_embed": True, "global_modulation": True, "mlp_silu_act": True, "default_ref_method": "index",
    "ref_index_scale": 10.0,
}
# Tiny, for tests: both block groups present (1 of 2 double, 3 of 3 single blocks merge).
FLUX2_TINY = dict(FLUX2_FULL, context_in_dim=64, hidden_size=64, num_heads=4, depth=2, depth_single_blocks=3,
                  axes_dim=[4, 4, 4, 4])
# HunyuanVideo 1.5 (8.3B): 32-channel latents (VAE stride 4 x 16 x 16) with image and mask channels concatenated
# (32 + 32 + 1), patch 1 x 1 x 1, Qwen2.5-VL text (3584), SigLIP vision tokens (1152) before the text.
HUNYUAN_VIDEO15_FULL = dict(HUNYUAN_VIDEO_FULL, in_channels=65, out_channels=32, vec_in_dim=None,
                            context_in_dim=3584, hidden_size=2048, num_heads=16, depth=54, depth_single_blocks=0,
                            axes_dim=[16, 56, 56], patch_size=[1, 1, 1], guidance_embed=False,
                            use_cond_type_embedding=True, vision_in_dim=1152)
# Tiny, for tests: double blocks only, as in the real model (2 of 3 merge).
HUNYUAN_VIDEO15_TINY = dict(HUNYUAN_VIDEO15_FULL, context_in_dim=64, hidden_size=64, num_heads=4, depth=3,
                            axes_dim=[4, 6, 6], vision_in_dim=32)
# Tiny with every text input the checkpoint has, as model detection builds it (byT5 glyph tokens, the condition-type
# embedding, SigLIP vision tokens before the text), four double blocks (3 merge), Qwen text of width 48: the model
# of issue 42 (the default node barely changed its output in ComfyUI v0.3.75), the conformance table's row.
HUNYUAN_VIDEO15_BYT5_TINY = dict(HUNYUAN_VIDEO15_TINY, context_in_dim=48, depth=4, byt5=True)
BYT5_WIDTH = 1472  # the glyph encoder's width, which ByT5Mapper takes
# The distilled super-resolution model: the low-resolution latent, its mask and more concatenated (98 channels).
HUNYUAN_VIDEO15_SR_TINY = dict(HUNYUAN_VIDEO15_TINY, in_channels=98)


def build_flux2(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight Flux.2 (FLUX2_TINY unless ``config``; FLUX2_FULL is
    FLUX.2 [dev])."""
    import comfy.supported_models

    return _patcher(_random_dit(comfy.supported_models.Flux2(dict(config or FLUX2_TINY)), seed, dtype, device))


def build_hunyuan_video15(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None,
                          device=None, sr: bool = False, init=None):
    """A ComfyUI ModelPatcher around a random-weight HunyuanVideo 1.5 (HUNYUAN_VIDEO15_TINY unless
    ``config``); ``sr``: the distilled super-resolution model (HUNYUAN_VIDEO15_SR_TINY by default); ``init(module,
    seed)`` draws the diffusion model's weights again (normal_init_: issue 46's)."""
    import comfy.supported_models

    if sr:
        family, default = comfy.supported_models.HunyuanVideo15_SR_Distilled, HUNYUAN_VIDEO15_SR_TINY
    else:
        family, default = comfy.supported_models.HunyuanVideo15, HUNYUAN_VIDEO15_TINY
    base = _random_dit(family(dict(config or default)), seed, dtype, device)
    if init is not None:
        init(base.diffusion_model, seed)
    return _patcher(base)


# HiDream-I1 (17B; Full, Dev and Fast share it), as ComfyUI's model_detection reads it: 16 double-stream and 32
# single-stream blocks of 20 heads x 128, a mixture of 4 routed experts (2 active) beside a shared one; text
# from T5-XXL and every layer of Llama-3.1-8B (each block takes one), pooled CLIP-L + CLIP-G (2048).
HIDREAM_FULL = {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16,
                "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
                "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4,
                "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32], "max_resolution": [128, 128],
                "llama_layers": list(range(32)) + [31] * 16}
# HiDream-I1 (17B), tiny, for tests: one double-stream and two single-stream blocks (all of them merge), each
# given its own Llama layer.
HIDREAM_TINY = {"image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1,
                "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                "caption_channels": [32, 32], "text_emb_dim": 32, "num_routed_experts": 4,
                "num_activated_experts": 2, "axes_dims_rope": [8, 4, 4], "max_resolution": [32, 32],
                "llama_layers": [0, 1, 2]}


def build_hidream(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None):
    """A ComfyUI ModelPatcher around a random-weight HiDream (HIDREAM_TINY unless ``config``)."""
    import comfy.supported_models

    return _patcher(_random_dit(comfy.supported_models.HiDream(dict(config or HIDREAM_TINY)), seed, dtype, device))


def hidream_conditioning(config: dict, batch: int = 1, tokens: int = 77, seed: int = 0, llama_layers: int | None = None):
    """(positive, negative) CONDITIONING for a model built by build_hidream from ``config``: T5 tokens
    (batch, tokens, caption_channels[0]), the pooled vector and ``llama_layers`` (batch, tokens,
    caption_channels[1]) Llama-3.1 layers (default one per ``llama_layers`` entry of ``config``; 32 from
    Llama-3.1-8B), from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    t5, llama = config["caption_channels"]
    layers = llama_layers or len(config["llama_layers"])

    def cond():
        return [torch.randn(batch, tokens, t5, generator=g),
                {"pooled_output": torch.randn(batch, config["text_emb_dim"], generator=g),
                 "conditioning_llama3": torch.randn(batch, layers, tokens, llama, generator=g)}]

    return [cond()], [cond()]
