"""A stand-in of Qwen-Image 2.1 for ComfyUI trees that lack it: its diffusion model, its BaseModel, its
supported_models config and its latent format, under the names and call signatures ComfyUI gives them, so the
pack's adapter meets it as it would meet the real one.

Qwen-Image 2.1 arrived in ComfyUI v0.37.0 (PR #16400). No tree that has it can be fetched whole here, so this
follows Comfy-Org/ComfyUI's files read one at a time, each the one version the index holds:
comfy/ldm/qwen_image21/model.py at b806797696c10b92c8db8687b8842acf34db8d97 (the model's first version; the newest
read, which ``installed()`` puts in place and ``build`` makes by default, is qwen_image21_later's),
comfy/model_base.py at 094c74c1b7f9cd5cdd9015741e8eb26acff1142a (``QwenImage21``),
comfy/supported_models.py at 01f03bbdc7df9462d3fc4c0918f80049333450f3 (``QwenImage21``), comfy/latent_formats.py
(``QwenImage21``: 64 channels at /16) and comfy/ldm/modules/attention.py at 05080f6022b2572df36a0aa6bcba413209c3d265
(``ComfyAttention``, ``wrap_attn``'s ``preferred_attention``). It is our code, written after that structure:

- 32 single-stream blocks over one sequence [text with the reference images spliced in at their slots, target];
  one modulation shared by every block, the prefix rows (text, references) modulated from t = 0.
- The block's attention computes q, k, v as (B, N, H, D) and hands them to ``attn_fn(q, k, v, heads,
  preferred_attention=ComfyAttention())``, a closure the model makes per block: ``block_causal_attention`` (text
  segments causal, each image segment attends to everything before its end; it also fills the prefix cache) or,
  once the cache is filled, ``prefix_cached_attention`` (target queries over [cached prefix keys, target keys]).
- ``attn1_patch``: patches get q, k, v (B, H, N, D) before RoPE, the RoPE table (1, 1, N, ...) and
  ``extra_options["img_slice"] = [prefix_len, N]``; with patches present the block leaves the fused
  RMSNorm + RoPE kernel for the plain path.
- The prefix cache (the ``QwenImage21Cache`` node sets ``transformer_options["qwen_image21_cache"] = {"device":
  "auto" | "gpu" | "cpu" | "off", "dtype": ...}``): the prefix's keys and values of every block, stored at the
  first step of a sampling run (``model_base.QwenImage21.current_patcher``, set by ModelPatcher.pre_run, resets
  it), keyed by the prompt, the references and the target size; later steps run the target rows only. Off
  while anything hooks the blocks ("dit" replace patches, ``post_input``, ``single_block``, ``attn1_patch``):
  a cached step would show them another sequence.

Where the host differs: ComfyUI v0.33.0's attention functions take no ``preferred_attention`` and its attention
module has no ``ComfyAttention``; ``attention`` below gives the later trees' order (an
``optimized_attention_override`` first, then the preferred function, then ComfyUI's). The later cache class
(``PoseBranchCache`` with ``select(key, create)``) is ``PrefixCache`` here, storing in the model's dtype (the
real one can also store int8 or int4: ToMA never touches the stored prefix). The latent format's per-channel
mean and scale are identity here (data, not structure).

``installed()`` puts these classes where ComfyUI's own would be (comfy.ldm.qwen_image21.model,
comfy.model_base.QwenImage21, comfy.supported_models.QwenImage21, comfy.latent_formats.QwenImage21) in a tree
that lacks them, and leaves a tree that has them alone. Import this module once ComfyUI is importable
(comfy_host.import_comfy).
"""
import contextlib
import sys
import types

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_management
import comfy.ops
import comfy.patcher_extension
import comfy.quant_ops
import comfy.rmsnorm
import comfy.supported_models
import comfy.supported_models_base
import comfy.utils
import torch
from . import qwen_image21_later
# the first version's names, as tests read them from the stand-in's module
from .qwen_image21_first import (FOLLOWS, ComfyAttention, QwenImage21Transformer2DModel,  # noqa: F401
                                 block_causal_attention)

MODULE = "comfy.ldm.qwen_image21.model"  # where ComfyUI keeps the model

# The real model's sizes (supported_models + the model's defaults): 7B, 32 blocks of 32 heads x 128, Qwen3-VL-8B text
# (4096), 64 latent channels at /16, one token per latent pixel.
FULL = {"image_model": "qwen_image21", "in_channels": 64, "out_channels": 64, "num_layers": 32,
        "attention_head_dim": 128, "num_attention_heads": 32, "context_in_dim": 4096, "mlp_ratio": 3,
        "axes_dims_rope": (16, 56, 56)}
# Tiny, for tests: 6 blocks (the first never merges, as Flux's single blocks' 5/38), 2 heads x 16, text of 32.
TINY = dict(FULL, num_layers=6, attention_head_dim=16, num_attention_heads=2, context_in_dim=32,
            axes_dims_rope=(4, 6, 6))

# Random init leaves the tiny model's gates (tanh of the shared modulation) near 0.02, so each block's update all but
# vanishes under the residual and merging could not show; scaled by 10 they are near 0.2.
MODULATION_GAIN = 10.0


# -- attention: ComfyUI's, with the later trees' preferred_attention ------------------------------------------------



class QwenImage21Latent(comfy.latent_formats.LatentFormat):
    """``latent_formats.QwenImage21``: 64 channels at 1/16 of the picture (the real one normalises each channel by
    a mean and a scale; identity here)."""

    def __init__(self):
        self.latent_channels = 64
        self.spacial_downscale_ratio = 16


class QwenImage21Base(comfy.model_base.QwenImage):
    """``model_base.QwenImage21``: Qwen-Image's conditioning (text, reference latents) plus ``image_slots``; the
    prefix cache lives for one sampling run, reset whenever the patcher running the model is set (pre_run,
    cleanup), and off while hooks can patch weights mid-run."""

    def __init__(self, model_config, model_type=comfy.model_base.ModelType.FLUX, device=None):
        super().__init__(model_config, model_type, device=device, unet_model=model_module().QwenImage21Transformer2DModel)

    @property
    def current_patcher(self):
        return self._current_patcher

    @current_patcher.setter
    def current_patcher(self, patcher):
        self._current_patcher = patcher
        diffusion_model = getattr(self, "diffusion_model", None)
        if diffusion_model is not None:
            diffusion_model.current_patcher = patcher
            diffusion_model.reset_prefix_cache(patcher is not None and len(patcher.hook_patches) == 0)

    def extra_conds(self, **kwargs):
        out = super().extra_conds(**kwargs)
        image_slots = kwargs.get("image_slots", None)
        if image_slots is not None:
            out["image_slots"] = comfy.conds.CONDConstant(image_slots)
        return out


class QwenImage21Config(comfy.supported_models_base.BASE):
    """``supported_models.QwenImage21`` (without its Qwen3-VL text encoder: tests condition with embeddings)."""

    unet_config = {"image_model": "qwen_image21"}
    sampling_settings = {"multiplier": 1.0, "shift": 0.69}
    memory_usage_factor = 6.0
    unet_extra_config = {}
    latent_format = QwenImage21Latent
    supported_inference_dtypes = [torch.bfloat16, torch.float32]
    vae_key_prefix = ["vae."]
    text_encoder_key_prefix = ["text_encoders."]

    def get_model(self, state_dict, prefix="", device=None):
        return QwenImage21Base(self, device=device)

    def clip_target(self, state_dict={}):
        return None


# where each stand-in goes when a tree lacks ComfyUI's own: (module, attribute, stand-in)
PLACES = (("comfy.latent_formats", "QwenImage21", QwenImage21Latent),
          ("comfy.model_base", "QwenImage21", QwenImage21Base),
          ("comfy.supported_models", "QwenImage21", QwenImage21Config))


def host_has_it() -> bool:
    """Whether this ComfyUI has Qwen-Image 2.1 of its own (v0.37.0 on)."""
    return hasattr(comfy.supported_models, "QwenImage21")


@contextlib.contextmanager
def installed():
    """Qwen-Image 2.1 in this ComfyUI while open: ComfyUI's own where the tree has it, else this stand-in, put
    where ComfyUI keeps its classes (and taken out again after). Yields the module of the diffusion model."""
    if host_has_it():
        import importlib
        yield importlib.import_module(MODULE)
        return
    import comfy.ldm

    package = types.ModuleType("comfy.ldm.qwen_image21")
    package.__path__ = []
    package.model = model_module()
    saved = {name: sys.modules.get(name) for name in (package.__name__, MODULE)}
    sys.modules[package.__name__], sys.modules[MODULE] = package, package.model
    setattr(comfy.ldm, PACKAGE_LEAF, package)
    for module, name, stand_in in PLACES:
        setattr(sys.modules[module], name, stand_in)
    try:
        yield sys.modules[__name__]
    finally:
        for module, name, _ in PLACES:
            delattr(sys.modules[module], name)
        delattr(comfy.ldm, PACKAGE_LEAF)
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module



PACKAGE_LEAF = "qwen_image21"  # comfy.ldm's package of the model in trees from v0.37 on


def tree_class(module: str, name: str = "QwenImage21"):
    """The class ``name`` of ComfyUI's ``module`` as the tree (or, inside ``installed()``, the stand-in) has it:
    looked up by name, since trees before v0.37 have none."""
    return vars(sys.modules[module])[name]


def model_module():
    """The stand-in's model module, as ComfyUI's comfy.ldm.qwen_image21.model: qwen_image21_later, whose model
    class builds either version (its ``follows``)."""
    return qwen_image21_later


def build(seed: int = 0, dtype: torch.dtype = torch.float32, config: dict | None = None, device=None,
          follows: str | None = None):
    """A ComfyUI ModelPatcher around a random-weight Qwen-Image 2.1 (TINY unless ``config``), built from
    ``comfy.supported_models.QwenImage21`` as ComfyUI builds a checkpoint of it: the tree's own class, or inside
    ``installed()`` the stand-in, whose model file follows the commit ``follows`` (model_module; a tree with a
    Qwen-Image 2.1 of its own builds that). The shared modulation's weights are scaled up by MODULATION_GAIN."""
    from . import models

    model_module().check_version(follows)
    config, model_config = dict(config or TINY), tree_class("comfy.supported_models")
    if model_config is QwenImage21Config:
        config["follows"] = follows
    base = models._random_dit(model_config(config), seed, dtype, device)
    with torch.no_grad():
        base.diffusion_model.modulation[1].weight.mul_(MODULATION_GAIN)
    return models._patcher(base)


def missing() -> str | None:
    """Why the stand-in cannot run in this ComfyUI, or None: it calls the fused kernels Qwen-Image 2.1 calls
    (comfy-kitchen's RMSNorm + RoPE and AdaLN through comfy.quant_ops, comfy.ops.linear_input_act), which ComfyUI
    v0.33.0 has."""
    kitchen = getattr(comfy.quant_ops, "ck", None)
    lacking = [name for name, there in (("comfy.quant_ops.ck.rms_rope", hasattr(kitchen, "rms_rope")),
                                        ("comfy.quant_ops.ck.adaln", hasattr(kitchen, "adaln")),
                                        ("comfy.ops.linear_input_act", hasattr(comfy.ops, "linear_input_act")))
               if not there]
    return f"the Qwen-Image 2.1 stand-in needs {', '.join(lacking)} (ComfyUI v0.33.0 on)" if lacking else None
