"""Krea 2 (its declaration: KREA2 in families.py; ComfyUI's ``SingleStreamDiT``, v0.33.0 on): every block is one
joint sequence [text, image, reference images], and its image tokens merge (docs/architecture.md, "DiT adapters",
says how).

Layout: the blocks are called directly (no "dit" hook), so each block's ``forward(x, vec, freqs, mask,
timestep_zero_index, transformer_options)`` is object-patched, as NextDiT's layers are. ``x`` (B, L, C) is
[text, image, references]; ``freqs`` (B, 1, L, ...) one RoPE row per token (Flux's layout), a merged token taking
its destination's; ``vec`` one modulation per sample. Reference images (Krea 2's style reference, when the
conditioning names a reference method) follow the image and stay whole; with the "index_timestep_zero" method
they get their own modulation from ``timestep_zero_index`` on, which moves back by the tokens the merge removed.
Attention goes through ComfyUI's ``optimized_attention_masked`` (grouped key-value heads repeated before it), so
scope keys/values merges the keys and values there.

Which blocks: one group of whole layers over the joint sequence, like Flux's single blocks, so the first 5/38
never merge: 4 of the 28 blocks.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward(x, timesteps, context, attention_mask,
ref_latents, transformer_options, **kwargs)``, which sees the latent (B, 16, 1, H, W) (Wan 2.1's latent format,
one frame) and the reference latents, patched 2 x 2.
"""
from .dit import POSITIONS, DiTPatch, forward_mismatch
from .layout import JOINT, LAYOUT_KEY, ImageLayout, LayoutStash, joint_index, take_rows

# What SingleStreamDiT passes its blocks first, in order: the patched forward passes them on.
BLOCK_PARAMETERS = ("x", "vec", "freqs", "mask", "timestep_zero_index")


class Krea2LayoutStash(LayoutStash):
    """The image layout of a Krea 2 call: the grid, then the reference images the model packs (only where the
    call names a reference method, its own default or the conditioning's)."""

    def __init__(self, target, patch_size, runtime=None):
        super().__init__(target, patch_size, runtime)
        self.default_ref_method = getattr(target.__self__, "default_ref_method", None)

    def layout(self, call: dict) -> ImageLayout | None:
        method = (call.get("kwargs") or {}).get("ref_latents_method", self.default_ref_method)
        return super().layout(call if method is not None else {**call, "ref_latents": None})


class Krea2Patch(DiTPatch):
    """The object-patched forward of Krea 2's blocks."""

    def block_forward(self, original, block=None):
        """A forward for the block ``block`` (its identity, for per-block plans) whose unpatched forward is
        ``original`` (bound): [text, image, references] with the image grid merged; a call the layout does not
        account for runs unpatched, counted."""
        patch = self

        def forward(layer, x, vec, freqs, mask=None, timestep_zero_index=None, transformer_options={}):
            def run(args):
                # the block's own options: with scope keys/values they carry the attention override
                return {"img": original(args["img"], vec, args["pe"], mask,
                                        args.get("timestep_zero_index", timestep_zero_index),
                                        transformer_options=args.get("transformer_options", transformer_options))}

            args = {"img": x, "pe": freqs, "attn_mask": mask, "timestep_zero_index": timestep_zero_index,
                    "transformer_options": transformer_options}
            options = patch.call_options(args)
            if options is None:
                return run(args)["img"]
            layout = options[LAYOUT_KEY]
            if not patch.tokens_fit(min(x.shape[1], layout.total), layout.total, options):
                return run(args)["img"]
            txt_len = x.shape[1] - layout.total
            if mask is not None:  # SingleStreamDiT passes none; a key mask would need its columns cut too
                patch.runtime.unmerged(POSITIONS, "Krea 2: blocks given an attention mask run unmerged")
                return run(args)["img"]
            if not patch.positions_fit_or_count(args, JOINT, txt_len, layout):
                return run(args)["img"]
            return patch.merged_call(JOINT, patch.with_options(args, options), run, txt_len, txt_len, layout, block)["img"]

        forward.token_merge = (original, self.runtime)  # for a token merge node stacked after this one
        return forward

    def reduced_inputs(self, call) -> dict:
        """The destinations' RoPE rows; the references' own modulation from where they sit in the merged
        sequence."""
        args = call.args
        pe = args["pe"]
        out = {"pe": take_rows(pe, joint_index(call.txt_len, call.layout, call.plan.destination_tokens().to(pe.device)),
                               self.pe_axis)}
        if args.get("timestep_zero_index") is not None:
            out["timestep_zero_index"] = args["timestep_zero_index"] - (call.layout.tokens - call.plan.num_merged)
        return out


def unserved(dm) -> str | None:
    """Why the SingleStreamDiT ``dm`` is not served, or None: its blocks must take what the patched forward
    passes on (forward_mismatch)."""
    return forward_mismatch(type(dm.blocks[0]).forward, BLOCK_PARAMETERS)

