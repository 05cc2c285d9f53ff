"""LTX-Video (its declaration: LTXV in families.py; 0.9.x, 2B and 13B; text-to-video, image-to-video,
keyframe guides): its transformer blocks merge their video tokens (docs/architecture.md, "DiT adapters", says how).

Layout: an LTX-Video block sees only video tokens ``img`` (B, N, C): self-attention with 3-D RoPE
``pe`` = (cos, sin), each (B, N, D), then cross-attention to the text ``txt`` (keys only: the text and
its ``attention_mask`` (B, 1, 1, L) are left as they are; text is never merged), then the MLP. Merged
tokens take their destinations' RoPE rows. Keyframe guides (LTXVAddGuide) are latent frames appended to
the video with their own positions (``keyframe_idxs``): their tokens follow the video and stay unmerged.

Per-token timesteps: with a noise mask (image-to-video, guides replacing frames) ComfyUI gives every
token its own timestep, so the modulation ``vec`` is (B, N, 6C) instead of (B, 1, 6C). The first
latent frame then stays unmerged (image-to-video conditions it: timestep 0, clean image), and every
merged token takes its destination's modulation row; windows of one frame (ToMA's temporal_window 1)
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
marks per-head (B, heads, N, D/2) tables. Anything else runs the blocks unmerged, with a log message.

LTX-2 (``LTXAVModel``, an LTXVModel subclass, ComfyUI of 2026; its declaration: LTX2 in families.py) hands
its blocks a (video, audio) pair. The video tokens merge as LTX-Video's do (windows over frames, guides
and a first frame with its own timestep whole); the audio tokens and the text never merge. Per stream a
block gets its own RoPE table and timesteps; the video's (``v_pe``, the temporal ``v_cross_pe`` of the
audio-video cross-attention, ``v_timestep`` and the two cross-attention timesteps) are cut to the merged
rows, a merged token taking its destination's; the video timesteps may be a ``CompressedTimestep`` (one
row per latent frame), whose merged rows are the frames of the destinations. The audio's pass as they
are. The cross-attention between the streams:
- audio-to-video (video queries, audio keys): the merged video queries attend to every audio token, as
  any per-token layer runs on merged tokens;
- video-to-audio (audio queries, video keys): the audio queries attend to the full video, not to the
  merged tokens. Its ``forward`` is object-patched (``DiTPatch.companions``): the merged video keys' input
  is unmerged (U, as a block's output is) and each video token keeps its own temporal RoPE row. Merged
  keys would weigh a destination standing for k tokens as one token (proportional attention would need a
  bias the block cannot pass) and give each token its destination's time. Unmerged, the audio stream is
  exact wherever the merge is (every token its own destination), its keys and values cost the full
  video's projections in that one attention, which is small beside the video's own.
"""
from dataclasses import dataclass

import torch

from .dit import TOKEN_COUNT, DiTPatch
from .layout import (LAYOUT_KEY, VIDEO, ImageLayout, LayoutStash, patched_side, sequence_index, splice, take_rows,
                     take_sequence)

VIDEO_KEYS = "comfyui_toma_ltx2_video_keys"  # the block's own transformer_options: VideoKeys for its v2a attention
# LTX-2's video inputs besides the tokens: RoPE tables (tokens on rope_token_axis) and timesteps (tokens on dim 1)
V_TABLES = ("v_pe", "v_cross_pe")
V_TIMESTEPS = ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")


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
        # outside the diffusion model (DiTFamily.read_outside) the call has the sigma instead; its per-token
        # timesteps are then made from the denoise mask (LTXV.process_timestep)
        timestep = call.get("timestep")
        lead = h * w if per_token(timestep) or (timestep is None and torch.is_tensor(call.get("denoise_mask"))) else 0
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


class LTX2LayoutStash(LTXVLayoutStash):
    """The video grid of an LTX-2 call, whose latent is [video, audio]."""

    def layout(self, call: dict) -> ImageLayout | None:
        x = call.get("x")
        if isinstance(x, (list, tuple)) and x:
            return super().layout({**call, "x": x[0]})
        return super().layout(call)


@dataclass(frozen=True)
class VideoKeys:
    """What the video-to-audio attention of a merged block call needs to see the full video: the plan,
    where the grid's merged tokens sit (``lead``), the merged video length and the full ``v_cross_pe``."""

    plan: object
    lead: int
    length: int
    cross_pe: object


class LTX2Patch(LTXVPatch):
    """The block patch for LTX-2's (video, audio) pair: the video merged, the audio whole; the
    video-to-audio attention's forward unmerges its video keys."""

    companions = ("video_to_audio_attn",)

    def av_block(self, args: dict, extras: dict, block=None) -> dict:
        run, pair = extras["original_block"], args["img"]
        options = self.call_options(args, extras)
        if options is None:
            return run(args)
        layout = options[LAYOUT_KEY]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not torch.is_tensor(pair[0]):
            self.runtime.unmerged(TOKEN_COUNT, "LTX-2: a block call's tokens are not a (video, audio) pair; it runs unmerged")
            return run(args)
        if (not self.tokens_fit(pair[0].shape[1], layout.total, options)
                or not self.positions_fit_or_count(args, VIDEO, 0, layout)):
            return run(args)
        passed = isinstance(args.get("transformer_options"), dict)
        self.whole_blocks_unless(passed)
        args = self.with_options(args, options)
        vx, ax = pair
        audio = []

        def run_video(video_args):
            out_vx, out_ax = run({**video_args, "img": (video_args["img"], ax)})["img"]
            audio.append(out_ax)
            return {"img": out_vx}

        out = self.merged_call(VIDEO, {**args, "img": vx}, run_video, layout.lead, 0, layout, block, passed)
        return {"img": (out["img"], audio[-1])}

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether the video's RoPE tables and timesteps cover its tokens."""
        if (all(tables_fit({"pe": args.get(key)}, layout) for key in V_TABLES)
                and all(timestep_rows(args.get(key)) in (None, 1, layout.total) for key in V_TIMESTEPS)):
            return True
        self.runtime.notice("LTX-2: a block's video RoPE tables or timesteps do not cover its %d video tokens as "
                            "ToMA expects; those blocks run unmerged", layout.total)
        return False

    def reduced_inputs(self, call) -> dict:
        """The video's RoPE and timestep rows of the destinations; VideoKeys for the v2a attention."""
        layout, plan, args = call.layout, call.plan, call.args
        index = sequence_index(layout.lead, layout.tokens, layout.total, plan.destination_tokens().to(args["img"].device))
        out = {key: tuple(take_rows(t, index, rope_token_axis(args[key])) if torch.is_tensor(t) else t
                          for t in args[key]) for key in V_TABLES if args.get(key) is not None}
        out.update({key: merged_timestep(args[key], index, layout.total) for key in V_TIMESTEPS if args.get(key) is not None})
        keys = VideoKeys(plan, layout.lead, layout.total - layout.tokens + plan.num_merged, args.get("v_cross_pe"))
        out["transformer_options"] = {**args["transformer_options"], VIDEO_KEYS: keys}
        return out

    def companion_forward(self, name: str, original):
        """The video-to-audio attention's forward around its unpatched ``original`` (bound): in a merged
        block call, the merged video ``context`` unmerged and the full ``v_cross_pe`` as its keys' RoPE."""
        patch = self

        def forward(attn, x, context=None, mask=None, pe=None, k_pe=None, transformer_options={}):
            keys = (transformer_options or {}).get(VIDEO_KEYS)
            if keys is None or not torch.is_tensor(context) or context.shape[1] != keys.length:
                return original(x, context, mask, pe, k_pe, transformer_options=transformer_options)
            end = keys.lead + keys.plan.num_merged
            with patch.runtime.stages.stage("unmerge"):
                full = splice(context, [(keys.lead, end)], [keys.plan.unmerge(context[:, keys.lead:end])])
            return original(x, full, mask, pe, keys.cross_pe, transformer_options=transformer_options)

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward


def timestep_rows(timestep) -> int | None:
    """Token rows of an LTX-2 timestep: a (B, L, D) tensor's L, a CompressedTimestep's frames times
    patches per frame (duck-typed: its class lives in the model's module); None where there is none."""
    if timestep is None:
        return None
    if hasattr(timestep, "patches_per_frame") and hasattr(timestep, "data"):
        return timestep.num_frames * timestep.patches_per_frame if timestep.patches_per_frame > 1 else timestep.data.shape[1]
    return timestep.shape[1] if torch.is_tensor(timestep) and timestep.dim() == 3 else -1


def merged_timestep(timestep, index: torch.Tensor, total: int):
    """The rows ``index`` of a per-token timestep (a CompressedTimestep's per-frame rows: the frames of
    the destinations, as a (B, L', D) tensor); one shared row passes as it is."""
    if hasattr(timestep, "patches_per_frame"):
        if timestep.patches_per_frame > 1:
            return take_rows(timestep.data, index // timestep.patches_per_frame, 1)
        return timestep if timestep.data.shape[1] == 1 else take_rows(timestep.data, index, 1)
    return take_sequence(timestep, index, 1, total)
