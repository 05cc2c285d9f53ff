"""Adapter for LTX-Video (0.9.x, 2B and 13B; text-to-video, image-to-video, keyframe guides): its
transformer blocks merge their video tokens (nodes/adapters/dit.py says how).

Layout: an LTX-Video block sees only video tokens ``img`` (B, N, C): self-attention with 3-D RoPE
``pe`` = (cos, sin), each (B, N, D), then cross-attention to the text ``txt`` (keys only: the text and
its ``attention_mask`` (B, 1, 1, L) are left as they are; text is never merged), then the MLP. Merged
tokens take their destinations' RoPE rows. Keyframe guides (LTXVAddGuide) are latent frames appended to
the video with their own positions (``keyframe_idxs``): their tokens follow the video and stay unmerged.

Per-token timesteps: with a noise mask (image-to-video, guides replacing frames) ComfyUI gives every
token its own timestep, so the modulation ``vec`` is (B, N, 6C) instead of (B, 1, 6C). The first
latent frame then stays unmerged (image-to-video conditions it: timestep 0, clean image), and every
merged token takes its destination's modulation row; windows of one frame (ToMA's tile_frames 1)
never mix frames, so per-frame timesteps (every built-in LTX-Video node) stay exact at any frame; with
windows over several frames, or a spatial noise mask, a window mixing timesteps modulates its merged
tokens as their destinations.

Which blocks: one group of blocks, each a whole transformer layer over one sequence of video tokens,
like Flux's single blocks (and Wan's blocks), so the first 5/38 of them never merge (the paper's 5 of
Flux's 38 single blocks): 4 of the 2B model's 28 blocks, 6 of the 13B model's 48.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent (B, C, T, H, W)
(patch size 1: a T x H x W grid), ``keyframe_idxs`` and the timesteps.
"""
import torch

from .. import placement
from .dit import (LAYOUT_KEY, SKIP_FRACTION, BlockGroup, DiTPatch, ImageLayout, LayoutStash, layout_wrapper,
                  patch_blocks, patched_side, sequence_index, take_rows, take_sequence)

FAMILY = "LTX-Video"


def supports(model) -> bool:
    try:
        from comfy.ldm.lightricks.model import LTXVModel
    except ImportError:  # the March-2024 tree
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, LTXVModel) and hasattr(dm, "transformer_blocks")


def per_token(timestep) -> bool:
    """Whether the call's timesteps are per token ((B, N, 1) from a noise mask) rather than per row."""
    return torch.is_tensor(timestep) and timestep.dim() > 1 and timestep.shape[1] > 1


class LTXVLayoutStash(LayoutStash):
    """The video grid of an LTX-Video call: keyframe guide frames follow it unmerged; with per-token
    timesteps the first latent frame leads it unmerged."""

    def layout(self, call: dict) -> ImageLayout | None:
        x = call.get("x")
        if not torch.is_tensor(x) or x.dim() != 5:
            return None
        frames, h, w = (patched_side(side, p) for side, p in zip(x.shape[2:], self.patch))
        guides = call.get("keyframe_idxs")
        extra = guides.shape[2] if torch.is_tensor(guides) else 0
        if extra % (h * w):  # guides are whole latent frames of the video's size (LTXVAddGuide)
            return None
        frames -= extra // (h * w)
        lead = h * w if per_token(call.get("timestep")) else 0
        frames -= lead // (h * w)
        return ImageLayout(h, w, extra, frames, lead) if frames > 0 else None


class LTXVPatch(DiTPatch):
    """The block patch for [lead, video, guides] tokens with cross-attention to the text."""

    def block(self, args: dict, extras: dict) -> dict:
        run, img = extras["original_block"], args["img"]
        layout = (args.get("transformer_options") or {}).get(LAYOUT_KEY)
        if layout is None or img.shape[1] != layout.total or not self.fits(args, layout):
            return run(args)
        return self.merged_call("video", args, run, layout.lead, 0, layout)

    @staticmethod
    def fits(args: dict, layout: ImageLayout) -> bool:
        """Whether pe and vec cover the tokens (another patch may have changed them)."""
        pe, vec = args.get("pe"), args.get("vec")
        pe_fits = pe is None or (isinstance(pe, (tuple, list)) and all(t.shape[1] == layout.total for t in pe))
        return pe_fits and (vec is None or vec.shape[1] in (1, layout.total))

    def reduced_inputs(self, args: dict, txt_len: int, layout: ImageLayout, plan, reference_plans=()) -> dict:
        """RoPE rows and (per-token timesteps) modulation rows of the destinations."""
        pe, vec = args.get("pe"), args.get("vec")
        device = (vec if pe is None else pe[0]).device
        index = sequence_index(layout.lead, layout.tokens, layout.total, plan.destination_tokens().to(device))
        out = {"vec": take_sequence(vec, index, 1, layout.total)}
        if pe is not None:
            out["pe"] = tuple(take_rows(t, index, 1) for t in pe)
        return out


def patch(model, runtime, levels=None, scope=None):
    """The patched clone (``levels`` and ``scope`` are UNet notions: a DiT has one token grid)."""
    placement.resolve(scope or placement.AUTO, FAMILY, (placement.BLOCK,), placement.BLOCK)
    dm = model.model.diffusion_model
    groups = [BlockGroup("double_block", "video", len(dm.transformer_blocks), LTXVPatch(runtime).block,
                         SKIP_FRACTION["single"])]
    stash = layout_wrapper("DIFFUSION_MODEL", getattr(dm, "_forward", None), dm.patchifier.patch_size, model,
                           LTXVLayoutStash)
    return patch_blocks(model, runtime, FAMILY, groups, stash)
