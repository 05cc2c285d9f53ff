"""Model-family adapters, one module per family, and the registry the nodes look a model up in.

An adapter module offers:
    FAMILY                                   its display name in messages and the README
    supports(model) -> bool                  whether the ModelPatcher's diffusion model is of this family
    patch(model, runtime, levels, scope)     the patched clone; ``model`` itself, unpatched with a log
                                             message, when the strategy or the host cannot serve it
Adding a family is one module here, its line in ADAPTERS and its tests.
"""
from . import chroma, flux, hunyuan_video, lumina, ltxv, qwen_image, sd3, unet, wan

ADAPTERS = (
    unet,
    flux,
    sd3,
    hunyuan_video,
    ltxv,
    wan,
    qwen_image,
    chroma,
    lumina,
)


# Diffusion model classes that no adapter serves for a reason worth telling the user (by class name: the
# classes need not exist in every ComfyUI).
UNSERVED = {
    "HiDreamImageTransformer2DModel": "HiDream calls its blocks directly, with no block-replace hook, and "
                                      "hands every block new Llama-3.1 layer tokens next to its "
                                      "mixture-of-experts feed-forward; this version of ToMA does not merge it",
}


def unserved_reason(model) -> str | None:
    """Why ``model``'s family is not served, where UNSERVED knows it."""
    return UNSERVED.get(type(getattr(model.model, "diffusion_model", None)).__name__)


def adapter_for(model):
    """The adapter module of ``model``'s family, or None."""
    return next((adapter for adapter in ADAPTERS if adapter.supports(model)), None)


def supported_families() -> str:
    return ", ".join(adapter.FAMILY for adapter in ADAPTERS)
