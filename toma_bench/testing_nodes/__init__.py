"""Test-only ComfyUI nodes (installed next to the pack by toma_bench/server.py for the server tests and the
main job; never shipped to users).

Random-weight checkpoints carry no text encoder, so ``CLIPTextEncode`` cannot run on them.
``ToMATestConditioning`` stands in for it: seeded random CONDITIONING as wide as the model's
cross-attention context. Plain V1 node: loads in the pinned March-2024 ComfyUI and in current ComfyUI.
"""
import torch

SDXL_POOLED_WIDTH = 1280  # SDXL's adm vector starts with CLIP-G's pooled output (then 6 size embeddings)


def context_width(model) -> int:
    """Width of the text context the UNet cross-attends to (768 SD1.x, 1024 SD2.x, 2048 SDXL)."""
    width = model.model.model_config.unet_config.get("context_dim")
    if not width:
        raise ValueError(f"ToMATestConditioning: {type(model.model).__name__} is not a UNet with cross-attention "
                         "(no context_dim); only SD1.x/SD2.x/SDXL-style models are supported")
    return width


class ToMATestConditioning:
    DESCRIPTION = "TEST ONLY: seeded random CONDITIONING shaped for the given model (stands in for CLIPTextEncode)."
    CATEGORY = "testing/toma"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "Only read for its context width."}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
                             "tokens": ("INT", {"default": 77, "min": 1, "max": 1024})}}

    def encode(self, model, seed, tokens):
        """[[context (1, tokens, width), options]]; SDXL-style models (adm input) also get a pooled vector."""
        g = torch.Generator().manual_seed(seed)
        context = torch.randn(1, tokens, context_width(model), generator=g)
        options = {}
        if model.model.model_config.unet_config.get("adm_in_channels"):
            options["pooled_output"] = torch.randn(1, SDXL_POOLED_WIDTH, generator=g)
        return ([[context, options]],)


NODE_CLASS_MAPPINGS = {"ToMATestConditioning": ToMATestConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"ToMATestConditioning": "ToMA Test Conditioning (random)"}
