"""Adapter for Lumina 2 and Z-Image (Turbo and base): ComfyUI builds both from Lumina 2's NextDiT
(Z-Image with its own modulation, RoPE and token padding). The main layers merge their image tokens;
text never merges.

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
import functools
import inspect
import logging
import types

import torch

from .. import placement
from ..host import install_run_hooks, original_attr
from .dit import (LAYOUT_KEY, SKIP_FRACTION, BlockGroup, DiTPatch, ImageLayout, LayoutStash, cannot_patch,
                  joint_index, layout_wrapper, patched_side, take_rows, take_sequence)

log = logging.getLogger("ComfyUI-ToMA")

FAMILY = "Lumina 2 / Z-Image"
PE_TOKEN_AXIS = 1
# What NextDiT passes its main layers first, in order, and by name: the patched forward passes them on.
LAYER_PARAMETERS = ("x", "x_mask", "freqs_cis", "adaln_input")
OPTIONS_PARAMETER = "transformer_options"


def supports(model) -> bool:
    try:
        from comfy.ldm.lumina.model import NextDiT
    except ImportError:  # before Lumina 2 (Feb 2025)
        return False
    dm = getattr(model.model, "diffusion_model", None)
    return isinstance(dm, NextDiT) and hasattr(dm, "layers")


class NextDiTLayoutStash(LayoutStash):
    """The image layout of a NextDiT call: the grid, then Z-Image's padding tokens; None (logged) when
    the rows' captions differ in length."""

    def __init__(self, target, patch_size, runtime):
        super().__init__(target, patch_size)
        self.runtime = runtime
        self.pad_multiple = getattr(target.__self__, "pad_tokens_multiple", None)

    def layout(self, call: dict) -> ImageLayout | None:
        x, mask = call.get("x"), call.get("attention_mask")
        if not torch.is_tensor(x) or x.dim() != 4:
            return None
        if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] > 1:
            lengths = mask.sum(1)
            if not bool((lengths == lengths[0]).all()):  # once per model call, not per layer
                self.runtime.notice("%s: the batch rows' captions differ in length, which puts their image "
                                    "tokens at different places; those model calls run unmerged", FAMILY)
                return None
        h, w = patched_side(x.shape[-2], self.patch), patched_side(x.shape[-1], self.patch)
        return ImageLayout(h, w, (-(h * w)) % self.pad_multiple if self.pad_multiple else 0)


class NextDiTPatch(DiTPatch):
    """The object-patched forward of NextDiT's main layers."""

    def layer_forward(self, original):
        """A forward for a layer whose unpatched forward is ``original`` (bound): [caption, image,
        padding] with the image grid merged; a call the layout does not account for runs unpatched."""
        patch = self

        def forward(layer, x, x_mask=None, freqs_cis=None, adaln_input=None, transformer_options={}, **newer):
            def run(args):
                return {"img": original(args["img"], args["attn_mask"], args["pe"], adaln_input,
                                        transformer_options=transformer_options, **newer)}

            layout = (transformer_options or {}).get(LAYOUT_KEY)
            txt_len = -1 if layout is None else x.shape[1] - layout.total
            given = sorted(name for name, value in newer.items() if value is not None)
            if given:
                patch.runtime.notice("%s: layers given %s, which ToMA does not merge, run unmerged", FAMILY,
                                     ", ".join(given))
            if given or txt_len < 0 or not patch.fits(x_mask, freqs_cis, txt_len + layout.total):
                return run({"img": x, "attn_mask": x_mask, "pe": freqs_cis})["img"]

            args = {"img": x, "attn_mask": x_mask, "pe": freqs_cis, "transformer_options": transformer_options}
            return patch.merged_call("joint", args, run, txt_len, txt_len, layout)["img"]

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    @staticmethod
    def fits(mask, pe, full: int) -> bool:
        """Whether the RoPE rows and the key mask, if any, cover exactly the ``full`` tokens."""
        return (torch.is_tensor(pe) and pe.dim() > PE_TOKEN_AXIS and pe.shape[PE_TOKEN_AXIS] == full
                and (mask is None or mask.shape[-1] == full))

    def reduced_inputs(self, args: dict, txt_len: int, layout, plan, reference_plans=()) -> dict:
        """RoPE rows and key-mask columns of the merged sequence [caption, destinations, padding]."""
        pe, mask = args["pe"], args["attn_mask"]
        index = joint_index(txt_len, layout, plan.destination_tokens().to(pe.device))
        return {"pe": take_rows(pe, index, PE_TOKEN_AXIS),
                "attn_mask": take_sequence(mask, index, -1, txt_len + layout.total)}


def layer_parameters_fit(forward) -> bool:
    """Whether a NextDiT layer ``forward`` (unbound) takes LAYER_PARAMETERS first and
    ``transformer_options`` by name, and nothing else it must be given."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    if tuple(p.name for p in parameters[:len(LAYER_PARAMETERS)]) != LAYER_PARAMETERS:
        return False
    rest = parameters[len(LAYER_PARAMETERS):]
    return (any(p.name == OPTIONS_PARAMETER for p in rest)
            and all(p.kind is inspect.Parameter.VAR_KEYWORD
                    or (p.default is not inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL)
                    for p in rest))


def patch(model, runtime, levels=None, scope=None):
    """The patched clone (``levels`` and ``scope`` are UNet notions: NextDiT has one token grid);
    ``model`` itself, unpatched with a message, where its layers are not the NextDiT layers this adapter
    knows or the host cannot serve it."""
    placement.resolve(scope or placement.AUTO, FAMILY, (placement.BLOCK,), placement.BLOCK)
    dm = model.model.diffusion_model
    name = type(model.model).__name__
    forward = type(dm.layers[0]).forward
    if not layer_parameters_fit(forward):
        log.warning("ToMA: the layers of this %s (%s) take (%s), not (%s, then %s and optional ones) as ToMA "
                    "passes them on; returned unpatched", name, FAMILY,
                    ", ".join(tuple(inspect.signature(forward).parameters)[1:]), ", ".join(LAYER_PARAMETERS),
                    OPTIONS_PARAMETER)
        return model
    stash = layout_wrapper("DIFFUSION_MODEL", getattr(dm, "_forward", None), dm.patch_size, model,
                           functools.partial(NextDiTLayoutStash, runtime=runtime))
    if cannot_patch(model, runtime, FAMILY, stash):
        return model
    group = BlockGroup("layer", "joint", len(dm.layers), None, SKIP_FRACTION["single"])
    blocks = NextDiTPatch(runtime, PE_TOKEN_AXIS)
    m = model.clone()
    retaken = {}
    for i in group.merged():
        key = f"diffusion_model.layers.{i}.forward"
        current = original_attr(m, key)
        earlier = getattr(getattr(current, "__func__", None), "token_merge", None)
        if earlier is not None:  # an earlier token merge node's patch: this node merges in its place
            current, previous = earlier
            retaken.setdefault(previous.name, []).append(f"layer {i}")
        m.add_object_patch(key, types.MethodType(blocks.layer_forward(current), dm.layers[i]))
    m.add_wrapper_with_key(*stash)
    install_run_hooks(m, runtime)
    for previous, layers in retaken.items():
        log.info("ToMA: %s, nearer the sampler, merges %s in place of the %s node before it", runtime.name,
                 ", ".join(layers), previous)
    log.info("ToMA: %s patched on %s (%s): %d of %d layers merge", runtime.name, name, FAMILY,
             len(group.merged()), group.depth)
    return m
