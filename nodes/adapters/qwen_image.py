"""Qwen-Image and Qwen-Image-Edit (their declaration: QWEN_IMAGE in families.py): the 60 double-stream
blocks merge their image tokens (docs/architecture.md, "DiT adapters", says how), skipping the first 16, the fraction
Flux skips (nothing specific to Qwen-Image argued for another). Text tokens are never merged.

Positions: Qwen-Image's RoPE table ``pe`` is (B, L, 1, head_dim/2, 2, 2), its tokens along dim 1, in the
order [txt, image, references] of the joint attention; from ComfyUI v0.3.75 (Nov 2025) on it is Flux's
(B, 1, L, head_dim/2, 2, 2), tokens along dim 2. Each call's table says which.

Token grid: the DIFFUSION_MODEL executor runs around ``_forward``, which sees the latent (B, 16, 1, H, W)
and Qwen-Image-Edit's reference latents; a side of H latent pixels gives ceil(H / 2) tokens.

Qwen-Image-Edit appends the reference images' tokens to the image sequence (each reference a grid in
raster order, whichever ``reference_latents_method`` placed its RoPE ids). Each reference grid is merged
by a plan of its own, at the same ratio, rather than left whole: for the same number of tokens kept (the
same speed), that is closer to the unpatched model, since only the image tokens reach the output and
the references act on it through attention alone. Measured (relative L2 of the sampled latent vs the
unpatched model; random-weight Qwen-Image-layout model, 8 blocks of width 256, 24x24-token image, 8 Euler
steps at cfg 2.5, mean of 3 seeds):

    reference          tokens kept      references whole     references by their own plan
    same size          864 of 1152      1.75% (image 0.5)    1.13% (image and reference 0.25)
    twice the area     1440 of 1728     1.75% (image 0.5)    0.96% (image and reference 0.167)

At the node's ratio 0.5, merging the references too (576 and 864 tokens kept instead of 864 and 1440)
measured 1.73% and 1.72%, against 1.75% with the references whole. Merging only the references (0.41% and
0.19% at the same token counts) did better still, but ToMA has one ratio. These are random weights: a
trained edit model that copies detail from its reference may depend more on the reference tokens.
"""
import torch

from .dit import DiTPatch


class QwenImagePatch(DiTPatch):
    """Double-block patches that read the RoPE table's token axis from each call (see Positions); the
    reference grids of Qwen-Image-Edit merge, each by a plan of its own."""

    pe_axis = 1  # until Oct 2025; Flux's axis 2 after
    merge_references = True

    def pe_axis_of(self, args: dict) -> int:
        pe = args.get("pe")
        if torch.is_tensor(pe) and pe.dim() > 2 and pe.shape[1] == 1 and pe.shape[2] > 1:
            return 2
        return self.pe_axis
