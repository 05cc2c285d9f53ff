"""HiDream-I1 (its declaration: HIDREAM in families.py): double-stream and single-stream blocks merge
their image tokens; text never merges.

Interception: HiDream calls its blocks directly, with no "dit" block-replace hook, so each merged block's
``forward`` (``HiDreamImageBlock.forward(image_tokens, image_tokens_masks, text_tokens, adaln_input,
rope, transformer_options)``) is object-patched through the ModelPatcher, as Lumina 2's layers are
(nodes/adapters/lumina.py); a block that takes its inputs otherwise is another HiDream: the model comes
back unpatched, with a log message.

Layout: a double-stream block sees the image tokens (B, N, C) and, apart, the text tokens (T5 and Llama
tokens, then this block's own Llama-3.1 layer); a single-stream block sees one sequence [image, text,
this block's Llama layer]. Both take the RoPE table ``rope`` (B, L, 1, d/2, 2, 2) over [image, text]
(tokens along dim 1, image first); a merged token takes its destination's row. The modulation is per
sample (``adaln_input`` (B, C)), and the mixture-of-experts feed-forward routes each token by itself, so
both work on merged tokens as they are. The padded-image path (``image_tokens_masks``, a list of
latents) and HiDream-E1's edit image concatenated beside the latent (``image_cond``) run unmerged, with a
log message.

Which blocks: the first 5/19 of the double-stream blocks and 5/38 of the single-stream blocks never
merge (the paper's Flux fractions): 4 of HiDream-I1's 16 double-stream blocks, 4 of its 32 single.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward(x, t, y, context,
encoder_hidden_states_llama3, image_cond, ...)``, which sees the latent (B, 16, H, W), padded to the
patch size 2.
"""
import torch

from .dit import POSITIONS, DiTPatch, forward_mismatch
from .layout import JOINT, LAYOUT_KEY, TWO_STREAM, ImageLayout, LayoutStash, sequence_index, take_rows

ROPE_TOKEN_AXIS = 1
# What HiDream passes its blocks, in order: the patched forward passes them on.
BLOCK_PARAMETERS = ("image_tokens", "image_tokens_masks", "text_tokens", "adaln_input", "rope")


class HiDreamLayoutStash(LayoutStash):
    """The image grid of a HiDream call; None (logged) for HiDream-E1's edit image beside the latent."""

    def layout(self, call: dict) -> ImageLayout | None:
        if call.get("image_cond") is not None:
            self.runtime.notice("HiDream: an edit image concatenated beside the latent (HiDream-E1) is not "
                                "merged; those model calls run unmerged")
            return None
        return super().layout(call)


class HiDreamPatch(DiTPatch):
    """The object-patched forward of HiDream's double-stream and single-stream blocks."""

    image_first = True  # the joint attention of a double-stream block sees [image, text]

    def double_forward(self, original, block=None):
        """A double-stream block's forward around its unpatched ``original`` (bound): image tokens merged,
        the text stream whole; it returns (image, text). ``block``: its identity, for per-block plans."""
        return self.block_forward(original, TWO_STREAM, block)

    def single_forward(self, original, block=None):
        """A single-stream block's forward: [image, text] with the image merged."""
        return self.block_forward(original, JOINT, block)

    def block_forward(self, original, group: str, block=None):
        patch = self

        def forward(module, image_tokens, image_tokens_masks=None, text_tokens=None, adaln_input=None, rope=None,
                    transformer_options={}):
            def run(args):
                # the block's own options: with scope keys/values they carry the attention override
                out = original(args["img"], image_tokens_masks, text_tokens, adaln_input, args["pe"],
                               transformer_options=args.get("transformer_options", transformer_options))
                return {"img": out[0], "txt": out[1]} if group == TWO_STREAM else {"img": out}

            options = patch.call_options({"transformer_options": transformer_options})
            joint = image_tokens.shape[1] + (0 if text_tokens is None else text_tokens.shape[1])
            args = {"img": image_tokens, "pe": rope, "transformer_options": transformer_options}
            layout = None if options is None else options[LAYOUT_KEY]
            if layout is None or not patch.tokens_fit(min(joint, layout.total), layout.total, options):
                out = run(args)
            elif (image_tokens_masks is not None or (group == TWO_STREAM) != (text_tokens is not None)
                  or not torch.is_tensor(rope) or rope.dim() <= ROPE_TOKEN_AXIS or rope.shape[ROPE_TOKEN_AXIS] != joint):
                patch.runtime.unmerged(POSITIONS, "HiDream: a block's masks, text stream or RoPE table do not cover "
                                       "its tokens as ToMA expects; those blocks run unmerged")
                out = run(args)
            else:
                out = patch.merged_call(group, patch.with_options(args, options), run, 0, joint - layout.total, layout, block)
            return (out["img"], out["txt"]) if group == TWO_STREAM else out["img"]

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def reduced_inputs(self, call) -> dict:
        """RoPE rows of the merged sequence [destinations, text]."""
        pe = call.args["pe"]
        full = call.layout.total + call.txt_len
        index = sequence_index(0, call.layout.tokens, full, call.plan.destination_tokens().to(pe.device))
        return {"pe": take_rows(pe, index, ROPE_TOKEN_AXIS)}


def unserved(dm) -> str | None:
    """Why the HiDream ``dm`` is not served, or None: its blocks must take what the patched forward passes
    on (forward_mismatch)."""
    first = next(iter([*dm.double_stream_blocks, *dm.single_stream_blocks]), None)
    return None if first is None else forward_mismatch(type(first).forward, BLOCK_PARAMETERS)
