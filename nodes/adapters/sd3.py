"""Adapter for SD3/SD3.5 (MMDiT): the joint blocks merge their image tokens like Flux's double blocks
(nodes/adapters/dit.py), skipping the same fraction of the first blocks. SD3 adds its position embedding
once at the input, so nothing positional reaches the blocks.

Token grid: SD3 has no DIFFUSION_MODEL executor, so an APPLY_MODEL wrapper (around
``BaseModel._apply_model``, same latent size) reads the latent.
"""
from .. import placement
from .dit import SKIP_FRACTION, BlockGroup, DiTPatch, layout_wrapper, patch_blocks

FAMILY = "SD3/SD3.5"


def supports(model) -> bool:
    try:
        from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    except ImportError:  # the March-2024 tree
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, MMDiT) and hasattr(dm, "joint_blocks")


def patch(model, runtime, levels=None, scope=None):
    """The patched clone (``levels`` and ``scope`` are UNet notions: a DiT has one token grid)."""
    placement.resolve(scope or placement.AUTO, FAMILY, (placement.BLOCK,), placement.BLOCK)
    dm = model.model.diffusion_model
    groups = [BlockGroup("double_block", "double", len(dm.joint_blocks), DiTPatch(runtime).double_block,
                         SKIP_FRACTION["double"])]
    stash = layout_wrapper("APPLY_MODEL", getattr(model.model, "_apply_model", None), dm.patch_size, model)
    return patch_blocks(model, runtime, FAMILY, groups, stash)
