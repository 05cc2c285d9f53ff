"""Test-only ComfyUI nodes (installed next to the pack by toma_bench/server.py for the server tests and the
main job; never shipped to users).

Random-weight checkpoints carry no text encoder, so ``CLIPTextEncode`` cannot run on them.
``ToMATestConditioning`` stands in for it: seeded random CONDITIONING as wide as the model's
cross-attention context.

The trained proxies of toma_bench/proxy.py are bare diffusion models (ComfyUI's checkpoint loader does
not detect their small widths, and they have no VAE or text encoder): ``ToMAProxyLoader`` gives the
MODEL with the fixed CONDITIONING it was trained with, ``ToMAProxyDecode`` turns its LATENT into an IMAGE
by the proxy's fixed pixel map. Plain V1 nodes: they load in the pinned March-2024 ComfyUI and in
current ComfyUI.
"""
import sys
from pathlib import Path

import torch

# ComfyUI imports this folder by its path, outside the harness package; the proxy nodes need
# toma_bench.proxy. Appended, not prepended: the repo root's nodes/ must not shadow ComfyUI's nodes.py.
REPO = str(Path(__file__).resolve().parent.parent.parent)
if REPO not in sys.path:
    sys.path.append(REPO)

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


def proxy_path(name: str) -> Path:
    """A proxy file: ``name`` as a path if it is one, else the file of that name in toma_bench/proxies."""
    from toma_bench import proxy

    path = Path(name).expanduser()
    return path if path.is_file() else proxy.PROXY_DIR / name


class ToMAProxyLoader:
    DESCRIPTION = ("TEST ONLY: a trained proxy denoiser of toma_bench/proxy.py and the fixed conditioning it "
                   "was trained with (use it as both positive and negative; the proxy is unconditional).")
    CATEGORY = "testing/toma"
    RETURN_TYPES = ("MODEL", "CONDITIONING")
    RETURN_NAMES = ("model", "conditioning")
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"proxy": ("STRING", {"default": "sd15_proxy.safetensors", "tooltip":
                                                  "a file path, or a file name in toma_bench/proxies"})}}

    def load(self, proxy):
        from toma_bench import proxy as proxies

        path = proxy_path(proxy)
        if not path.is_file():
            raise FileNotFoundError(f"no proxy file {path} (python -m toma_bench.proxy train --arch sd15 writes it)")
        model = proxies.load(path)
        positive, _ = proxies.conditioning(model)
        return (model, positive)


class ToMAProxyDecode:
    DESCRIPTION = "TEST ONLY: a proxy model's LATENT as an IMAGE (the proxy's fixed pixel map; it has no VAE)."
    CATEGORY = "testing/toma"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL", {"tooltip": "the proxy that made the latent (its pixel map)."}),
                             "samples": ("LATENT",)}}

    def decode(self, model, samples):
        from toma_bench import proxy

        return (proxy.latent_to_images(model, samples["samples"]),)


NODE_CLASS_MAPPINGS = {"ToMATestConditioning": ToMATestConditioning, "ToMAProxyLoader": ToMAProxyLoader,
                       "ToMAProxyDecode": ToMAProxyDecode}
NODE_DISPLAY_NAME_MAPPINGS = {"ToMATestConditioning": "ToMA Test Conditioning (random)",
                              "ToMAProxyLoader": "ToMA Test Proxy Loader", "ToMAProxyDecode": "ToMA Test Proxy Decode"}
