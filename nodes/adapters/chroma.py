"""Adapter for Chroma and Chroma Radiance: Flux's double and single blocks, merged as Flux's are
(nodes/adapters/dit.py; both double-block placements), skipping the same fractions (Chroma keeps Flux's
19 + 38 blocks).

What differs from Flux does not reach the merge: each block's modulation (``vec``) comes from Chroma's
distilled-guidance approximator as per-sample (B, 1, C) slices, not per token, so it passes unchanged;
``pe`` has Flux's layout (B, 1, L, ...), [txt, image]; an ``attn_mask`` (T5 padding, regional prompts)
is cut to the merged rows. Chroma Radiance patchifies pixels 16x16 with a convolution and decodes each
patch with a NeRF head from the full-length tokens the blocks return.

Token grid: Chroma's DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent (pixels for
Radiance); ceil(H / patch) tokens per side. Chroma takes no reference images.
"""
from .dit import DiTPatch, attention_only, flux_block_groups, image_first, layout_wrapper, patch_blocks

FAMILY = "Chroma"


def supports(model) -> bool:
    try:
        from comfy.ldm.chroma.model import Chroma
    except ImportError:  # before Chroma (2025)
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, Chroma) and hasattr(dm, "double_blocks") and hasattr(dm, "single_blocks")


def patch(model, runtime, levels=None, scope="auto"):
    """The patched clone (``levels`` is a UNet notion: a DiT has one token grid); ``scope`` places the
    double blocks' merge (dit.attention_only)."""
    dm = model.model.diffusion_model
    blocks = DiTPatch(runtime, attention_only=attention_only(scope, FAMILY), image_first=image_first(dm))
    groups = flux_block_groups(dm, blocks)
    stash = layout_wrapper("DIFFUSION_MODEL", getattr(dm, "_forward", None), dm.patch_size, model)
    return patch_blocks(model, runtime, FAMILY, groups, stash)
