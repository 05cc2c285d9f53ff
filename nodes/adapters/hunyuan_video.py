"""HunyuanVideo (its declaration: HUNYUAN_VIDEO in families.py; 1.0: text-to-video, image-to-video v1
concat / v2 replace / custom reference, SkyReels) and the models ComfyUI builds from the same class
(HunyuanImage 2.1 and its refiner): double blocks and single blocks merge their video tokens
(docs/architecture.md, "DiT adapters", says how).

Layout: HunyuanVideo is Flux's architecture; the joint attention of a double block and the joint
sequence of a single block are [lead, video, txt] where ComfyUI builds the double blocks with
``flipped_img_txt`` (v0.3.x), and [txt, lead, video], Flux's order, where its blocks have no such flag
(v0.33.0 on): ``video_first`` reads which from the model when it is patched. ``pe`` (B, 1, L, ...) and
the text mask ``attention_mask`` (1, 1, L) (one key row for every query) follow the joint order; the
image stream of a double block is [lead, video] in both. ``lead``: the tokens of a reference latent
(image-to-video "custom": prepended to the video) and, for image-to-video v2, the first latent frame;
they are never merged. Text is never merged.

Image-to-video v2 ("replace", ``guiding_frame_index``): the first latent frame is the input image and its
tokens get another modulation vector, given as ranges over the sequence (``modulation_dims_img``,
``modulation_dims``: [(0, first frame, 0), (first frame, None, 1)]). The first frame stays unmerged, so
no merged token mixes the two modulations, and the ranges are moved onto the merged sequence (a
boundary after the video moves back by the tokens merging removed). A range boundary inside the video
grid (another node's layout) leaves the block unmerged, with a message. The first frame being the
clean input image, keeping it whole also keeps every frame's attention to it exact. With scope
"attention" the double blocks run at full length (only their [lead, video, txt] attention merges the
video rows), so their modulation ranges stay as they are.

Which blocks: HunyuanVideo's 20 double and 40 single blocks are Flux's two groups, so the paper's Flux
fractions apply (SKIP_FRACTION: the first 5 double and 5 single blocks never merge).

Token grid: the DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent (B, C, T, H, W)
(or (B, C, H, W) for HunyuanImage 2.1), the reference latent and ``guiding_frame_index``; the video of
T latent frames patched by (1, 2, 2) is a T x ceil(H/2) x ceil(W/2) grid (the patch embedding pads).
"""
import math

import torch

from .dit import DiTPatch
from .layout import (JOINT, TWO_STREAM, ImageLayout, LayoutStash, patched_side, sequence_index, take_rows,
                     take_sequence)

# The modulation ranges of each block group's call (double block, single block)
MODULATION_KEYS = {TWO_STREAM: "modulation_dims_img", JOINT: "modulation_dims"}


def latent_grid(latent, patch) -> tuple[int, ...]:
    """Tokens along each axis of a latent (B, C, T, H, W) or (B, C, H, W) padded to ``patch``."""
    return tuple(patched_side(side, p) for side, p in zip(latent.shape[2:], patch))


class HunyuanLayoutStash(LayoutStash):
    """The video grid of a HunyuanVideo call: reference-latent tokens and, for image-to-video v2, the
    first latent frame lead; the rest of the video merges."""

    def layout(self, call: dict) -> ImageLayout | None:
        x, patch = call.get("x"), list(self.patch)
        if not torch.is_tensor(x) or x.dim() != len(patch) + 2:
            return None
        if x.dim() == 4:  # HunyuanImage 2.1: an image
            h, w = latent_grid(x, patch)
            return ImageLayout(h, w)
        frames, h, w = latent_grid(x, patch)
        ref = call.get("ref_latent")
        lead = 0 if ref is None else math.prod(latent_grid(ref, patch))
        if call.get("guiding_frame_index") is not None:
            lead, frames = lead + h * w, frames - 1
        return ImageLayout(h, w, frames=frames, lead=lead) if frames > 0 else None


def ranges_fit(ranges, start: int, tokens: int) -> bool:
    """Whether no boundary of the modulation ``ranges`` [(begin, end or None, vector)] falls inside the
    grid [start, start + tokens) (a boundary at either edge is fine)."""
    return all(b is None or b <= start or b >= start + tokens for r in ranges for b in r[:2])


def merged_ranges(ranges, start: int, tokens: int, merged: int):
    """``ranges`` moved onto the merged sequence, where the grid's ``tokens`` tokens from ``start`` on
    are ``merged`` tokens (ranges_fit must hold)."""
    def at(b):
        return b if b is None or b <= start else b - (tokens - merged)
    return [(at(begin), at(end), vector) for begin, end, vector in ranges]


def video_first(dm) -> bool:
    """Whether the joint sequences of HunyuanVideo ``dm`` hold the video before the text: its double blocks
    were built with ``flipped_img_txt`` (ComfyUI v0.3.x: [video, txt] in their attention, and the single
    blocks' sequence too); a block without that attribute concatenates [txt, video] as Flux's does."""
    return any(getattr(block, "flipped_img_txt", False) for block in dm.double_blocks)


class HunyuanVideoPatch(DiTPatch):
    """Double and single block patches for HunyuanVideo's layout, in the joint order of the patched model
    (``read_model``: [lead, video, txt] or [txt, lead, video])."""

    image_first = True  # ComfyUI v0.3.x's order; read_model sets the patched model's own

    def read_model(self, dm) -> None:
        self.image_first = video_first(dm)

    def video_start(self, key: str, txt_len: int, layout: ImageLayout) -> int:
        """Where the video grid starts in the sequence the per-token input ``key`` covers: the image stream
        of a double block (its modulation ranges) or the joint sequence (pe, the mask, a single block's
        modulation ranges)."""
        if key == MODULATION_KEYS[TWO_STREAM] or self.image_first:
            return layout.lead
        return txt_len + layout.lead

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether pe, the mask and the modulation ranges cover exactly the lead, video and text tokens,
        with no range boundary inside the video (another patch may have changed them)."""
        full = layout.total + txt_len
        key = MODULATION_KEYS[group]
        pe, mask, ranges = args.get("pe"), args.get("attention_mask"), args.get(key)
        if pe is not None and (pe.dim() < 3 or pe.shape[2] != full):
            return False
        if mask is not None and (mask.shape[-1] != full or mask.dim() < 2 or mask.shape[-2] not in (1, full)):
            return False
        if ranges is not None and not ranges_fit(ranges, self.video_start(key, txt_len, layout), layout.tokens):
            self.runtime.notice("HunyuanVideo: modulation ranges %s split the video grid; those blocks run "
                                "unmerged", ranges)
            return False
        return True

    def reduced_inputs(self, call) -> dict:
        """pe rows and mask columns of the destinations; modulation ranges moved onto the merged sequence."""
        args, layout, plan = call.args, call.layout, call.plan
        full = layout.total + call.txt_len
        pe, mask = args.get("pe"), args.get("attention_mask")
        out = {key: merged_ranges(args[key], self.video_start(key, call.txt_len, layout), layout.tokens,
                                  plan.num_merged)
               for key in MODULATION_KEYS.values() if args.get(key) is not None}
        if pe is None and mask is None:
            return out
        destinations = plan.destination_tokens().to((pe if pe is not None else mask).device)
        index = sequence_index(self.video_start("pe", call.txt_len, layout), layout.tokens, full, destinations)
        if pe is not None:
            out["pe"] = take_rows(pe, index, 2)
        if mask is not None:
            out["attention_mask"] = take_sequence(take_rows(mask, index, -1), index, -2, full)
        return out
