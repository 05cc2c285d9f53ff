"""LTX-Video (its declaration: LTXV in families.py; 0.9.x, 2B and 13B; text-to-video, image-to-video,
keyframe guides): its transformer blocks merge their video tokens (nodes/adapters/dit.py says how).

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

RoPE layouts, told apart by what ``pe`` is: (cos, sin), each (B, N, D) (ComfyUI until Oct 2025); one
(B, 1, N, D/2, 2, 2) table as Flux's (from Nov 2025); (cos, sin, split) (2026), where a true ``split``
marks per-head (B, heads, N, D/2) tables. Anything else runs the blocks unmerged, with a log message. LTX-2 (``LTXAVModel``, an LTXVModel subclass) hands its
blocks a [video, audio] pair with its own per-stream tables and compressed timesteps: it comes back
unpatched, with the reason, rather than patched with blocks that would never merge.
"""
import torch

from .dit import DiTPatch, ImageLayout, LayoutStash, patched_side, sequence_index, take_rows, take_sequence

# Subclasses whose blocks take other inputs, and why they are not patched.
REFUSED = {
    "LTXAVModel": "LTX-2's blocks take a [video, audio] pair with per-stream RoPE tables, audio-video "
                  "cross-attention and compressed timesteps, which this version of ToMA does not merge",
}


def unserved(dm) -> str | None:
    """Why the LTXVModel ``dm`` is not served (REFUSED), or None."""
    return REFUSED.get(type(dm).__name__)


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

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether pe and vec cover the tokens (another patch may have changed them, or a newer ComfyUI
        passes something else); where not, the blocks run unmerged, with a log message."""
        if tables_fit(args, layout):
            return True
        self.runtime.notice("LTX-Video: a block's RoPE table or modulation does not cover its %d tokens as ToMA "
                            "expects; those blocks run unmerged", layout.total)
        return False

    def reduced_inputs(self, call) -> dict:
        """RoPE rows and (per-token timesteps) modulation rows of the destinations."""
        layout, plan = call.layout, call.plan
        pe, vec = call.args.get("pe"), call.args.get("vec")
        device = (vec if pe is None else pe[0]).device
        index = sequence_index(layout.lead, layout.tokens, layout.total, plan.destination_tokens().to(device))
        out = {"vec": take_sequence(vec, index, 1, layout.total)}
        if torch.is_tensor(pe):
            out["pe"] = take_rows(pe, index, rope_token_axis(pe))
        elif pe is not None:
            axis = rope_token_axis(pe)
            out["pe"] = tuple(take_rows(t, index, axis) if torch.is_tensor(t) else t for t in pe)
        return out


def tables_fit(args: dict, layout: ImageLayout) -> bool:
    """Whether a block call's pe and vec cover its ``layout`` tokens."""
    pe, vec = args.get("pe"), args.get("vec")
    if pe is not None:
        if not torch.is_tensor(pe) and not isinstance(pe, (tuple, list)):
            return False
        axis, tables = rope_token_axis(pe), rope_tables(pe)
        if not tables or any(t.dim() <= axis or t.shape[axis] != layout.total for t in tables):
            return False
    return vec is None or (torch.is_tensor(vec) and vec.dim() > 1 and vec.shape[1] in (1, layout.total))


def rope_tables(pe) -> list:
    """The tensors of an LTX-Video ``pe``: the table itself, or the tensor items of a tuple."""
    return [pe] if torch.is_tensor(pe) else [t for t in pe if torch.is_tensor(t)]


def rope_token_axis(pe) -> int:
    """The token axis of LTX-Video's RoPE tables: dim 2 of one Flux-layout (B, 1, N, D/2, 2, 2) table and
    of the per-head (B, heads, N, D/2) tables a true ``split`` marks in (cos, sin, split), else dim 1 of
    (cos, sin), each (B, N, D)."""
    if torch.is_tensor(pe):
        return 2
    return 2 if len(pe) > 2 and pe[2] is True else 1


