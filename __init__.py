"""ComfyUI-ToMA: token merging (ToMA, ToMeSD, CA-ToMe) for faster diffusion sampling in ComfyUI.

ComfyUI imports this package from its ``custom_nodes`` folder and reads ``NODE_CLASS_MAPPINGS``,
``NODE_DISPLAY_NAME_MAPPINGS`` and ``WEB_DIRECTORY``. The engine in ``toma_core`` is plain torch;
everything that touches ComfyUI lives in ``nodes``.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
