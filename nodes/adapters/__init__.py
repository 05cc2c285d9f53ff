"""Model-family adapters and the registry the nodes look a model up in.

An adapter offers:
    name                                     its display name in messages
    names                                    what users know its models by (node descriptions, README,
                                             help pages, pyproject.toml: tests/test_family_lists.py)
    supports(model) -> bool                  whether the ModelPatcher's diffusion model is of this family
    placements, fallback                     the scopes it honours, and the one it takes for another
                                             (placement.settle)
    needs_attention_override                 the scopes it runs through the host's attention override
                                             (placement.settle runs whole blocks on a host without one)
    preset_kind(model) -> str                the kind of model whose preset "auto" means (placement.PRESETS)
    own_sampler                              whether its models sample in a sampler of their own, not
                                             ComfyUI's (nodes/patching.py: kijai's WanVideoWrapper)
    patch(model, runtime, placement)         the patched clone, merging where ``placement`` (the node's
                                             placement.Placement, settled once) says; ``model`` itself,
                                             unpatched with a log message, when the strategy or the host
                                             cannot serve it
The UNet adapter is a module (unet.py); every DiT family is a declaration (family.DiTFamily) in
families.py; kijai's WanVideoWrapper, whose WANVIDEOMODEL no other adapter sees, has one of its own
(wan_video_wrapper.py), used by its node only.
Adding a DiT family is its row there and in DIT_FAMILIES, its model builder and conformance
row in the tests, and its row in docs/models.md.
"""
from .. import placement
from . import unet
from .families import DIT_FAMILIES

ADAPTERS = (unet, *DIT_FAMILIES)


def adapter_for(model):
    """The adapter of ``model``'s family, or None."""
    return next((adapter for adapter in ADAPTERS if adapter.supports(model)), None)


def supported_families() -> str:
    return ", ".join(adapter.name for adapter in ADAPTERS)


def family_names(video: bool) -> list[str]:
    """The names users know the image (``video`` False) or video DiTs by, in registry order."""
    return [n for family in DIT_FAMILIES if family.video == video for n in family.names]


def keys_values_families() -> list[str]:
    """The DiT families whose blocks can merge only the keys and values of their self-attention (scope
    "keys/values")."""
    return [family.name for family in DIT_FAMILIES if placement.KEYS_VALUES in family.placements]


def feed_forward_families() -> list[str]:
    """The DiT families whose blocks can merge only around their self-attention (scope "feed-forward")."""
    return [family.name for family in DIT_FAMILIES if placement.FEED_FORWARD in family.placements]


def attention_placement_families() -> list[str]:
    """The DiT families whose double blocks can merge only their joint attention (scope "attention")."""
    return [family.name for family in DIT_FAMILIES if placement.ATTENTION in family.placements]
