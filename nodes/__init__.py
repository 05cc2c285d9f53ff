"""ComfyUI glue: model adapters (per model family) and the node classes (V1 declarations; ``v3`` serves them in
the V3 schema on hosts that have it)."""
from . import merge_map, toma_nodes, v3, wan_video_wrapper

NODE_CLASS_MAPPINGS = {**toma_nodes.NODE_CLASS_MAPPINGS, **merge_map.NODE_CLASS_MAPPINGS,
                       **wan_video_wrapper.NODE_CLASS_MAPPINGS}
NODE_DISPLAY_NAME_MAPPINGS = {**toma_nodes.NODE_DISPLAY_NAME_MAPPINGS, **merge_map.NODE_DISPLAY_NAME_MAPPINGS,
                              **wan_video_wrapper.NODE_DISPLAY_NAME_MAPPINGS}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
