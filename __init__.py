"""ComfyUI-ToMA: token merging (ToMA, ToMeSD, CA-ToMe, DiTo) for faster diffusion sampling in ComfyUI.

ComfyUI imports this package from its ``custom_nodes`` folder. On a host with the V3 node schema
(``comfy_api.latest``) the pack registers through ``comfy_entrypoint``, V3 nodes built from the V1 declarations
(nodes/v3.py); elsewhere through ``NODE_CLASS_MAPPINGS`` and ``NODE_DISPLAY_NAME_MAPPINGS``. A host takes
``NODE_CLASS_MAPPINGS`` whenever a pack has it, so a V3 host is given ``comfy_entrypoint`` alone. The help pages
come from ``WEB_DIRECTORY`` either way. The engine in ``toma_core`` is plain torch; everything that touches
ComfyUI lives in ``nodes``.
"""
# pytest imports this file too (the repo root, where its ini is, holds it): as a package named after the
# folder where that name is a module name, else as a plain module, where a relative import cannot work (a
# checkout called ComfyUI-ToMA, as custom_nodes holds it): there it defines nothing.
if __package__:
    from . import nodes

    if nodes.v3.io is not None:
        comfy_entrypoint = nodes.v3.extension(nodes.NODE_CLASS_MAPPINGS, nodes.NODE_DISPLAY_NAME_MAPPINGS)
    else:
        NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = nodes.NODE_CLASS_MAPPINGS, nodes.NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"
