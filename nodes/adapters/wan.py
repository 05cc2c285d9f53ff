"""Wan 2.1 / 2.2 video DiTs (their declaration: WAN in families.py): every block merges the video tokens
of its call (the block's update x + U(block(Mx) - Mx), docs/architecture.md, "DiT adapters", says how), in windows that
span frames x rows x columns of the video's token grid.

Served: T2V and I2V/FLF2V 2.1 (CLIP image tokens are part of ``context``, which cross-attention reads
in full), the 2.2 14B high- and low-noise experts (the same class), the 2.2 5B TI2V model, VACE, Camera,
Fun models with a reference latent, Animate, FlowRVS (a plain WanModel), WanDancer (its music injector
runs between the blocks on full-length tokens, as VACE's hints do), SCAIL and SCAIL 2 (reference frames lead
the video in time, the pose tokens follow it: both stay whole). Left unpatched, with a message (REFUSED: S2V,
HuMo, CausalAR, Animate 2).

What a block call sees and what runs merged:
- Tokens: [reference, video, time-concatenated frames, pose]. The reference latent of Fun models
  (``ref_conv``) is prepended, SCAIL's reference frames too (in time, the video's grid); Phantom's subject
  frames (``time_dim_concat``) follow the video as extra frames, SCAIL's pose tokens (their own grid)
  come last. Only the video grid merges; reference and subject tokens, and the text and CLIP tokens of
  cross-attention, never do.
- Positions: ``pe`` holds one 3-D RoPE row per token (dim 1, in the order above); a merged token takes
  its destination's row.
- Modulation: ``vec`` (e0) is per sample, except on the 5B TI2V model in image-to-video, where the
  timestep is per latent frame (the input image's frame at t = 0, from the noise mask) and the block
  spreads e0's rows over the tokens in equal runs (``repeat_e``). Then the first latent frame stays
  unmerged, as HunyuanVideo's and LTX-Video's image-to-video frames do: no merged token mixes two
  timesteps, and every frame's attention to the clean input image stays exact. The other tokens take
  their destination's row (gathered, so the block gets one row per merged token). Why gather rather
  than merge the rows with the plan's weights: a blend of the modulations of two timesteps is the
  modulation of no timestep, the merged token already *is* its destination for RoPE, and a gather costs
  no matmul over 6 x C channels; where the merged frames share one timestep (every built-in node) the
  two agree exactly, and where a noise mask gives later frames other timesteps, a window mixing them
  modulates its merged tokens as their destinations.
- VACE hint blocks and Animate's face adapter run outside the replaced blocks, on full-length tokens.

Which blocks: one group of ``len(blocks)`` blocks (30 in 1.3B and 5B, 40 in 14B). Each Wan block is a
whole transformer layer over one sequence of video tokens, like Flux's single blocks, so the first
5/38 of them never merge (the paper's 5 of Flux's 38 single blocks): 4 of 30, 5 of 40.

Token grid: Wan's DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent (B, C, T, H,
W) padded to the patch (1, 2, 2), the timesteps and the reference latent: T x ceil(H/2) x ceil(W/2)
tokens (less the first frame under per-frame timesteps), passed to the runtime as (frames, h, w).
"""
import importlib
import math

import torch

from .dit import DiTPatch
from .layout import ImageLayout, LayoutStash, patched_side, sequence_index, take_rows

SERVED = ("T2V, I2V, FLF2V, 2.2 14B high/low-noise, 2.2 5B TI2V, VACE, Camera, Fun with reference latent, "
          "Animate, FlowRVS, WanDancer, SCAIL, SCAIL 2")
# Variants whose blocks ComfyUI calls in a way merged tokens cannot follow, and why.
REFUSED = {
    "WanModel_S2V": "its blocks are called without transformer_options, so they can find neither the "
                    "sampling step nor the token grid",
    "HumoWanModel": "its audio cross-attention cuts the video tokens into equal runs per frame, which "
                    "merged tokens do not form",
    "CausalWanModel": "its causal sampler calls its blocks chunk by chunk with KV caches (forward_block), past "
                      "the \"dit\" block patches",
    "WanAnimate2Model": "its self-attention attends frame by frame to the pose branch (queries in runs of h x w "
                        "tokens a frame), which merged tokens do not form",
}


def served_classes() -> tuple:
    """The WanModel classes whose blocks merge (exact classes: a subclass may call its blocks otherwise)."""
    import comfy.ldm.wan.model as wan

    classes = [wan.WanModel] + [getattr(wan, name) for name in ("VaceWanModel", "CameraWanModel")
                                if hasattr(wan, name)]
    classes += [getattr(wan, name) for name in ("SCAILWanModel", "SCAIL2WanModel") if hasattr(wan, name)]
    # Wan 2.2 Animate, WanDancer: absent from older trees
    for module, name in (("comfy.ldm.wan.model_animate", "AnimateWanModel"),
                         ("comfy.ldm.wan.model_wandancer", "WanDancerModel")):
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(classes)


def unserved(dm) -> str | None:
    """Why the WanModel ``dm`` is not served, or None: exact classes only (a subclass may call its blocks
    otherwise)."""
    if type(dm) in served_classes():
        return None
    why = REFUSED.get(type(dm).__name__, "an unknown Wan variant, whose blocks may be called otherwise")
    return f"{why}. Wan variants served: {SERVED}"


def per_frame(timestep) -> bool:
    """Whether the call's timesteps are per latent frame ((B, T): WAN22 from a noise mask) rather than one
    per batch row."""
    return torch.is_tensor(timestep) and timestep.dim() > 1 and timestep.shape[1] > 1


class VideoLayoutStash(LayoutStash):
    """The DIFFUSION_MODEL wrapper around ``WanModel._forward(x, timestep, context, clip_fea,
    time_dim_concat, transformer_options, **kwargs)`` that hands the blocks the call's layout: reference
    tokens (and, under per-frame timesteps, the first frame) lead the grid unmerged, time-concatenated
    frames follow it unmerged. ``target``: that bound method; ``patch_size``: the model's (t, h, w) patch."""

    def __init__(self, target, patch_size, runtime=None):
        super().__init__(target, tuple(patch_size), runtime)
        self.prepends_reference = getattr(target.__self__, "ref_conv", None) is not None
        # SCAIL and SCAIL 2: reference frames before the video in time, pose tokens after everything
        self.pose_branch = getattr(target.__self__, "patch_embedding_pose", None) is not None

    def tokens(self, latent) -> int:
        """Tokens of a (B, C, T, H, W) latent padded to the patch."""
        return math.prod(patched_side(side, p) for side, p in zip(latent.shape[2:], self.patch))

    def layout(self, call: dict) -> ImageLayout | None:
        x = call.get("x")
        if not torch.is_tensor(x) or x.dim() != 5:
            return None
        frames, h, w = (patched_side(side, p) for side, p in zip(x.shape[2:], self.patch))
        concat = call.get("time_dim_concat")
        extra = patched_side(concat.shape[2], self.patch[0]) * h * w if torch.is_tensor(concat) else 0
        reference = (call.get("kwargs") or {}).get("reference_latent")
        lead = 0
        if self.prepends_reference and torch.is_tensor(reference):  # ref_conv: a strided conv, no padding
            lead = (reference.shape[-2] // self.patch[1]) * (reference.shape[-1] // self.patch[2])
        elif self.pose_branch:
            lead = self.tokens(reference) if torch.is_tensor(reference) else 0
            pose = call.get("pose_latents")
            extra += self.tokens(pose) if torch.is_tensor(pose) else 0
        if per_frame(call.get("timestep")):
            lead, frames = lead + h * w, frames - 1
        return ImageLayout(h, w, extra, frames, lead) if frames > 0 else None


def modulation_per_token(vec) -> bool:
    """Whether e0 (B, rows, 6, C) has a token axis (TI2V with per-frame timesteps) rather than one row
    per sample ((B, 6, C) or (B, 1, 6, C))."""
    return torch.is_tensor(vec) and vec.dim() == 4 and vec.shape[1] > 1


def modulation_rows(rows: int, tokens: int, device) -> torch.Tensor:
    """(tokens,) long: the row of an e0 of ``rows`` rows that a Wan block applies to each of ``tokens``
    tokens, as ComfyUI's ``repeat_e`` spreads them: runs of tokens / rows tokens a row, or, when rows do
    not divide the tokens, runs one token longer cut at the end. Arithmetic on the device, where
    ``repeat_e`` on an index tensor would be a data-sized op inside every block call."""
    run = tokens // rows
    if run * rows != tokens:
        run += 1
    return torch.arange(tokens, device=device) // run


class WanPatch(DiTPatch):
    """The "dit" double_block patches of one patched Wan clone: [lead, video, extra] (B, L, C) with the
    video grid merged; context (text and CLIP image tokens) passes whole. Under raylight's sequence
    parallelism each rank merges its slab (DiTPatch.slab_of)."""

    merges_slabs = True

    def fits(self, args: dict, group: str, txt_len: int, layout: ImageLayout) -> bool:
        pe = args.get("pe")
        return torch.is_tensor(pe) and pe.dim() >= 2 and pe.shape[1] == layout.total

    def reduced_inputs(self, call) -> dict:
        """pe (1, L, 1, d/2, 2, 2) and a per-token e0 (B, rows, 6, C) cut to the rows of the merged
        sequence [lead, destinations, extra]."""
        args, layout = call.args, call.layout
        pe, vec = args["pe"], args.get("vec")
        index = sequence_index(layout.lead, layout.tokens, layout.total, call.plan.destination_tokens().to(pe.device))
        inputs = {"pe": take_rows(pe, index, 1)}
        if modulation_per_token(vec):
            row_of_token = modulation_rows(vec.shape[1], args["img"].shape[1], vec.device)
            inputs["vec"] = take_rows(vec, row_of_token[index.to(vec.device)], 1)
        return inputs
