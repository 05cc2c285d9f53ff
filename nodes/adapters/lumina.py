"""Lumina 2 and Z-Image (Turbo and base; their declaration: LUMINA in families.py): ComfyUI builds both
from Lumina 2's NextDiT (Z-Image with its own modulation, RoPE and token padding). The main layers merge
their image tokens; text never merges.

Interception: NextDiT calls its layers directly, with no "dit" block-replace hook, so each main layer's
``forward`` is object-patched through the ModelPatcher (as the UNet blocks are, nodes/adapters/unet.py):
the patch merges, runs the layer's own forward on the shorter sequence and unmerges its update
(``DiTPatch.merged_call``, nodes/adapters/dit.py). Parameters a newer NextDiT adds after the four
positional ones (ComfyUI of 2026: ``timestep_zero_index``, per-token modulation for Z-Image's reference
images) are passed on, and a call that sets one runs unmerged, with a log message; a layer whose forward
takes its inputs otherwise is another NextDiT: the model comes back unpatched, with a log message.
Stacked, the token merge node nearer the sampler patches each layer in place of an earlier one's patch.

Layout: a main layer sees [caption, image, padding] (B, L, C): the refined caption tokens (Z-Image pads
them to a multiple of 32 with a learned token), the image grid ceil(H/2) x ceil(W/2) in raster order,
then Z-Image's padding of the image tokens to a multiple of 32; caption and padding never merge. The
RoPE table ``freqs_cis`` (B, L, 1, d/2, 2, 2) has its tokens along dim 1; a merged token takes its
destination's row. The modulation is per sample (``adaln_input`` (B, C')), so it passes unchanged. Lumina
2 in ComfyUI before Z-Image packs each row's caption by its own length (``attention_mask``) and hands the
layers a key mask (B, L), cut here to the merged rows; a batch whose rows' captions differ in length has
its image at a different place in each row, and runs unmerged (logged).

Which blocks: the context and noise refiners (text only and image only, before the joint sequence)
never merge. The main layers are whole transformer layers over one joint sequence, like Flux's single
blocks, so the first 5/38 of them never merge: 4 of Z-Image's 30, 3 of Lumina 2's 26.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward(x, timesteps, context, num_tokens,
attention_mask, **kwargs)``, which sees the latent (B, 16, H, W).
"""

import torch

from .dit import POSITIONS, DiTPatch, forward_mismatch
from .layout import (JOINT, LAYOUT_KEY, ImageLayout, LayoutStash, joint_index, patched_side, take_rows,
                     take_sequence)

PE_TOKEN_AXIS = 1
# What NextDiT passes its main layers first, in order, and by name: the patched forward passes them on.
LAYER_PARAMETERS = ("x", "x_mask", "freqs_cis", "adaln_input")


class NextDiTLayoutStash(LayoutStash):
    """The image layout of a NextDiT call: the grid, then Z-Image's padding tokens; None (logged) when
    the rows' captions differ in length."""

    def __init__(self, target, patch_size, runtime):
        super().__init__(target, patch_size, runtime)
        owner = target.__self__  # NextDiT, or the BaseModel around it (read_outside)
        self.pad_multiple = getattr(getattr(owner, "diffusion_model", owner), "pad_tokens_multiple", None)

    def layout(self, call: dict) -> ImageLayout | None:
        x, mask = call.get("x"), call.get("attention_mask")
        if not torch.is_tensor(x) or x.dim() != 4:
            return None
        if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] > 1:
            lengths = mask.sum(1)
            if not bool((lengths == lengths[0]).all()):  # once per model call, not per layer
                self.runtime.notice("Lumina 2 / Z-Image: the batch rows' captions differ in length, which puts their "
                                    "image tokens at different places; those model calls run unmerged")
                return None
        h, w = patched_side(x.shape[-2], self.patch), patched_side(x.shape[-1], self.patch)
        return ImageLayout(h, w, (-(h * w)) % self.pad_multiple if self.pad_multiple else 0)


class NextDiTPatch(DiTPatch):
    """The object-patched forward of NextDiT's main layers."""

    def layer_forward(self, original, block=None):
        """A forward for the layer ``block`` (its identity, for per-block plans) whose unpatched forward is
        ``original`` (bound): [caption, image, padding] with the image grid merged; a call the layout does
        not account for runs unpatched."""
        patch = self

        def forward(layer, x, x_mask=None, freqs_cis=None, adaln_input=None, transformer_options={}, **newer):
            def run(args):
                # the layer's own options: with scope keys/values they carry the attention override
                return {"img": original(args["img"], args["attn_mask"], args["pe"], adaln_input,
                                        transformer_options=args.get("transformer_options", transformer_options),
                                        **newer)}

            options = patch.call_options({"transformer_options": transformer_options})
            layout = None if options is None else options[LAYOUT_KEY]
            given = sorted(name for name, value in newer.items() if value is not None)
            if given:
                patch.runtime.unmerged("inputs ToMA does not merge", "Lumina 2 / Z-Image: layers given %s, which "
                                       "ToMA does not merge, run unmerged", ", ".join(given))
            if given or layout is None or not patch.tokens_fit(min(x.shape[1], layout.total), layout.total, options):
                return run({"img": x, "attn_mask": x_mask, "pe": freqs_cis})["img"]
            txt_len = x.shape[1] - layout.total
            if not layer_inputs_fit(x_mask, freqs_cis, x.shape[1]):
                patch.runtime.unmerged(POSITIONS, "Lumina 2 / Z-Image: a layer's mask or RoPE table does not cover "
                                       "its tokens as ToMA expects; those layers run unmerged")
                return run({"img": x, "attn_mask": x_mask, "pe": freqs_cis})["img"]

            args = {"img": x, "attn_mask": x_mask, "pe": freqs_cis, "transformer_options": transformer_options}
            return patch.merged_call(JOINT, patch.with_options(args, options), run, txt_len, txt_len, layout, block)["img"]

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def reduced_inputs(self, call) -> dict:
        """RoPE rows and key-mask columns of the merged sequence [caption, destinations, padding]."""
        pe, mask = call.args["pe"], call.args["attn_mask"]
        index = joint_index(call.txt_len, call.layout, call.plan.destination_tokens().to(pe.device))
        return {"pe": take_rows(pe, index, PE_TOKEN_AXIS),
                "attn_mask": take_sequence(mask, index, -1, call.txt_len + call.layout.total)}


def layer_inputs_fit(mask, pe, full: int) -> bool:
    """Whether the RoPE rows and the key mask, if any, cover exactly the ``full`` tokens."""
    return (torch.is_tensor(pe) and pe.dim() > PE_TOKEN_AXIS and pe.shape[PE_TOKEN_AXIS] == full
            and (mask is None or mask.shape[-1] == full))


def layer_parameters_fit(forward) -> bool:
    """Whether a NextDiT layer ``forward`` (unbound) takes LAYER_PARAMETERS first and
    ``transformer_options`` by name, and nothing else it must be given."""
    return forward_mismatch(forward, LAYER_PARAMETERS) is None


def unserved(dm) -> str | None:
    """Why the NextDiT ``dm`` is not served, or None: its main layers must take what the patched forward
    passes on (forward_mismatch)."""
    return forward_mismatch(type(dm.layers[0]).forward, LAYER_PARAMETERS)
