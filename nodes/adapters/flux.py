"""Adapter for Flux (dev, schnell, Kontext, Fill): double blocks and single blocks merge their image
tokens (nodes/adapters/dit.py says how).

The official ToMA keeps the double-block MLP at full resolution; doing that here would mean
re-implementing ComfyUI's block forward (modulation, q/k norm, RoPE, flipped layouts) and chasing its
changes. The MLP holds 2/3 of the image stream's projection FLOPs (8C^2 of 12C^2 per token), so merging
it is most of the speed-up; docs/benchmarks.md shows what it costs in fidelity.

Token grid: Flux's DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent and the
Kontext reference latents (their tokens follow the image tokens and stay unmerged).
"""
from .dit import DiTPatch, flux_block_groups, layout_wrapper, patch_blocks

FAMILY = "Flux"


def supports(model) -> bool:
    try:
        from comfy.ldm.flux.model import Flux
    except ImportError:  # the March-2024 tree
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, Flux) and hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks")


def patch(model, runtime, levels=None, scope=None):
    """The patched clone (``levels`` and ``scope`` are UNet notions: a DiT has one token grid)."""
    dm = model.model.diffusion_model
    blocks = DiTPatch(runtime)
    groups = flux_block_groups(dm, blocks)
    if hasattr(dm, "_forward"):
        stash = layout_wrapper("DIFFUSION_MODEL", dm._forward, dm.patch_size, model)
    else:  # a Flux without the executor around _forward: the same latent reaches BaseModel._apply_model
        stash = layout_wrapper("APPLY_MODEL", getattr(model.model, "_apply_model", None), dm.patch_size, model)
    return patch_blocks(model, runtime, FAMILY, groups, stash)
