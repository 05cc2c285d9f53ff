"""ComfyUI-ToMA: token merging (ToMA, ToMeSD, CA-ToMe, DiTo) for faster diffusion sampling in ComfyUI.

ComfyUI imports this package from its ``custom_nodes`` folder and reads ``NODE_CLASS_MAPPINGS``,
``NODE_DISPLAY_NAME_MAPPINGS`` and ``WEB_DIRECTORY``. The engine in ``toma_core`` is plain torch;
everything that touches ComfyUI lives in ``nodes``.
"""
# pytest imports this file too (the repo root, where its ini is, holds it): as a package named after the
# folder where that name is a module name, else as a plain module, where a relative import cannot work (a
# checkout called ComfyUI-ToMA, as custom_nodes holds it): there it defines nothing.
if __package__:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
