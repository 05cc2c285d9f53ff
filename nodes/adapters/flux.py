"""Adapter for Flux (dev, schnell, Kontext, Fill): double blocks and single blocks merge their image
tokens (nodes/adapters/dit.py says how).

Double blocks offer both placements (``scope``): "attention" is the official ToMA's, the double-block
MLP at full resolution, with only the joint attention on merged tokens (through ComfyUI's attention
override, so ComfyUI's block forward runs as it is); "block" merges the whole block. The MLP holds 2/3
of the image stream's projection FLOPs (8C^2 of 12C^2 per token), so merging it is most of the
speed-up; docs/benchmarks.md weighs that against fidelity.

Token grid: Flux's DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent and the
Kontext reference latents (their tokens follow the image tokens and stay unmerged).
"""
from .dit import DiTPatch, attention_only, flux_block_groups, image_first, layout_wrapper, patch_blocks

FAMILY = "Flux"


def supports(model) -> bool:
    try:
        from comfy.ldm.flux.model import Flux
    except ImportError:  # the March-2024 tree
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, Flux) and hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks")


def patch(model, runtime, levels=None, scope="auto"):
    """The patched clone (``levels`` is a UNet notion: a DiT has one token grid); ``scope`` places the
    double blocks' merge (dit.attention_only)."""
    dm = model.model.diffusion_model
    blocks = DiTPatch(runtime, attention_only=attention_only(scope, FAMILY), image_first=image_first(dm))
    groups = flux_block_groups(dm, blocks)
    if hasattr(dm, "_forward"):
        stash = layout_wrapper("DIFFUSION_MODEL", dm._forward, dm.patch_size, model)
    else:  # a Flux without the executor around _forward: the same latent reaches BaseModel._apply_model
        stash = layout_wrapper("APPLY_MODEL", getattr(model.model, "_apply_model", None), dm.patch_size, model)
    return patch_blocks(model, runtime, FAMILY, groups, stash)
