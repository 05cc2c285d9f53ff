"""MiniMax-H3 (its declaration: MINIMAX_H3 in families.py; ComfyUI's ``MiniMaxH3Model``, the joint video+audio
DiT, and its 8-step distilled variant, the same class): every block merges the video rows of its packed
sequence (docs/architecture.md, "DiT adapters", says how).

Layout: one packed sequence per call, without a batch axis: ``img`` is (S, C), the rows
[text | keyframe or reference rows | audio | video] of the call's ``PackedLayout`` (its ``segments``: (start,
stop, kind), the target video always last). Only the video, the latent_t x h x w grid of 2x2 patches in
raster order, merges; the text, the audio, the keyframe ("cond", "cond_audio") and reference ("ref_img",
"ref_audio") rows lead it and stay whole. The model takes batch 1 only (its ``_forward`` says so); CFG's cond
and uncond are separate calls (their conditioning payloads never concatenate), each its own plan.

Per-token inputs of a block: ``rope_freqs`` (1, S, 1, rot/2, 2, 2), one rotation row per row of the sequence,
and ``mod_segments`` [(start, stop, modulation row)], contiguous over the sequence, the video's the last one
(its row one index, or one per video row where a denoise mask gives rows their own timestep). With scope
"keys/values" (the video kind's default) the block runs whole and only its self-attention's keys and values
come from merged video rows, so none of them changes; with scope "block" a merged row takes its destination's
rotation and modulation rows, and the video segment ends where the merged rows do.

Which blocks: one group of whole layers over the packed sequence, like Wan's blocks, so the first 5/38 never
merge (the paper's 5 of Flux's 38 single blocks): 7 of the 50 blocks.

Token grid: read at ``BaseModel._apply_model`` (APPLY_MODEL), outside the diffusion model: the packed latent's
``latent_shapes`` ([video, audio]), the refined text ``c_crossattn`` and the payload, whose ``layout`` ComfyUI
builds once per run (``MiniMaxH3.extra_conds``); where it is missing or of another shape, the model builds one
from the call and so does the stash, with the model's own class. Not inside it: the model's ``forward`` and
``_forward`` read the timestep on the host (``float``), which breaks the graph under torch.compile, and a
DIFFUSION_MODEL wrapper between them would add breaks and frames left to eager around each of those.
"""
import importlib

import torch

from .dit import TOKEN_COUNT, DiTPatch
from .layout import ImageLayout, LayoutStash, patched_side, sequence_index, take_rows

VIDEO_SEGMENT = "video"  # PackedLayout's kind of the target video rows


class PackedLayoutStash(LayoutStash):
    """The video grid of a MiniMax-H3 call, read from its packed layout at ``BaseModel._apply_model``: every row
    before the video leads it unmerged. ``target``: the model's bound ``_apply_model``; ``patch_size`` the
    diffusion model's (t, h, w) patch."""

    def __init__(self, target, patch_size, runtime=None):
        super().__init__(target, tuple(patch_size), runtime)
        module = importlib.import_module(type(target.__self__.diffusion_model).__module__)
        self.packed_layout = getattr(module, "PackedLayout", None)

    def packed(self, call: dict, video, audio):
        """The call's PackedLayout: the payload's where it has the call's signature, else the one the model
        builds from the call (None without a text context or the model's class)."""
        context, payload = call.get("c_crossattn"), call.get("minimax_payload") or {}
        if not torch.is_tensor(context) or context.dim() != 3:
            return None
        t, h, w = (patched_side(side, p) * p for side, p in zip(video[2:], self.patch))
        signature = (context.shape[1], t, h, w, audio[-1])
        layout = payload.get("layout")
        if getattr(layout, "signature", None) == signature:
            return layout
        if self.packed_layout is None:
            return None
        return self.packed_layout(*signature, keyframes=payload.get("keyframes"), refs=payload.get("refs"))

    def layout(self, call: dict) -> ImageLayout | None:
        shapes = call.get("latent_shapes")  # [video (1, C, T, H, W), audio (1, C, 2, T)] of the packed latent
        if not isinstance(shapes, (list, tuple)) or len(shapes) < 2 or len(shapes[0]) != 5 or shapes[0][0] != 1:
            return None  # no audio stream, or a batch the model itself refuses
        video, audio = shapes[0], shapes[1]
        packed = self.packed(call, video, audio)
        segments = getattr(packed, "segments", None) or []
        frames, h, w = (patched_side(side, p) for side, p in zip(video[2:], self.patch))
        last = segments[-1] if segments else None
        if last is None or last[2] != VIDEO_SEGMENT or last[1] - last[0] != frames * h * w:
            return None
        return ImageLayout(h, w, packed.seq_len - last[1], frames, last[0])


class PackedPatch(DiTPatch):
    """The "dit" double_block patches of one patched MiniMax-H3 clone: the packed rows (S, C) with the video
    grid merged, the rows before it whole."""

    def packed_block(self, args: dict, extras: dict, block=None) -> dict:
        """A block call on the packed sequence, served as a one-row batch (1, S, C) by ``DiTPatch.block``."""
        run, rows = extras["original_block"], args["img"]
        if not torch.is_tensor(rows) or rows.dim() != 2:
            self.runtime.unmerged(TOKEN_COUNT, "MiniMax-H3: a block call's rows are not one packed (S, C) sequence; "
                                  "it runs unmerged")
            return run(args)

        def run_packed(batched: dict) -> dict:
            return {"img": run({**batched, "img": batched["img"][0]})["img"][None]}

        out = self.block({**args, "img": rows[None]}, {**extras, "original_block": run_packed}, block)
        return {"img": out["img"][0]}

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        """Whether the rotation table has a row per row of the sequence and the last modulation segment is the
        video's."""
        rope, segments = args.get("rope_freqs"), args.get("mod_segments")
        if not (torch.is_tensor(rope) and rope.dim() > 1 and rope.shape[1] == layout.total):
            return False
        if not isinstance(segments, (list, tuple)) or not segments:
            return False
        begin, end, row = segments[-1]
        return (begin, end) == (layout.lead, layout.total) and (not torch.is_tensor(row)
                                                                or row.shape[-1] == layout.tokens)

    def reduced_inputs(self, call) -> dict:
        """The destinations' rotation rows; the video's modulation segment cut to the merged rows (per-row
        modulation: the destinations' rows)."""
        args, layout, plan = call.args, call.layout, call.plan
        rope = args["rope_freqs"]
        destinations = plan.destination_tokens().to(rope.device)
        index = sequence_index(layout.lead, layout.tokens, layout.total, destinations)
        *before, (begin, _, row) = args["mod_segments"]
        if torch.is_tensor(row):
            row = row[destinations[0].to(row.device)]
        return {"rope_freqs": take_rows(rope, index, 1), "mod_segments": [*before, (begin, begin + plan.num_merged, row)]}
