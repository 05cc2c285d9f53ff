"""kijai's ComfyUI-WanVideoWrapper: "ToMA Token Merge (WanVideoWrapper)" (WANVIDEOMODEL in, WANVIDEOMODEL out)
and "ToMA Merge Map (WanVideoWrapper)". How the node patches the wrapper's model: adapters/wan_video_wrapper.py.
"""
import logging

from ..toma_core import ReuseSchedule
from . import placement
from .adapters import wan_video_wrapper as wrapper
from .inputs import (CATEGORY, DEFAULT_TEMPORAL_WINDOW, MAP_ALIASES, RATIO_INPUT, REUSE_INPUT, SPEED_ALIASES,
                     WINDOW_INPUT, check_inputs, float_input, int_input, ratio_of)
from .merge_map import ToMAMergeMap
from .patching import patch_with, toma_strategy

log = logging.getLogger("ComfyUI-ToMA")

PRESET = placement.PRESETS["video"]


class ToMAWanVideoWrapper:
    DESCRIPTION = ("ToMA token merging for kijai's ComfyUI-WanVideoWrapper (WANVIDEOMODEL in and out, between its "
                   "model loader and WanVideoSampler): in every block but the first ~13%, the keys and values of the "
                   "self-attention come from merged video tokens, in windows over frames; queries stay whole, so "
                   "nothing is unmerged. The video default of the native nodes (ratio 0.9, a plan per block, "
                   "proportional attention); runs of at most 8 steps build a new plan every step. Composes with the "
                   "wrapper's TeaCache, MagCache, EasyCache, block swap and per-block torch.compile; inputs whose "
                   "tokens it does not merge yet (Phantom, FantasyTalking, MultiTalk, Stand-In, radial or UltraViCo "
                   "attention, ...) run unmerged, named in the stats.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("WANVIDEOMODEL",)
    SEARCH_ALIASES = [*SPEED_ALIASES, "wanvideowrapper"]
    OUTPUT_TOOLTIPS = ("The patched model: connect it to WanVideoSampler (or to the wrapper's nodes before it).",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANVIDEOMODEL", {"tooltip": "The WANVIDEOMODEL of WanVideoModelLoader (or of a node after "
                                                       "it). It is cloned; the input stays unchanged."}),
                "ratio": RATIO_INPUT, "window_size": WINDOW_INPUT, "reuse_interval": REUSE_INPUT,
            },
            "optional": {
                "start_percent": float_input(0.0, 0.0, 1.0, 0.01, "Merge from this fraction of the steps on (0 = first "
                                                             "step; the wrapper's own step fraction)."),
                "end_percent": float_input(1.0, 0.0, 1.0, 0.01, "Stop merging at this fraction of the steps (1 = last "
                                                           "step)."),
                "temporal_window": int_input(DEFAULT_TEMPORAL_WINDOW, 1, 16, "Latent frames a merge window spans, so "
                                        "tokens merge with their neighbours in the next frames too; 1 = each frame "
                                        "apart."),
                "plan_per_block": ("BOOLEAN", {"default": PRESET.plan_per_block, "tooltip": "Each block picks "
                                   "destinations and weights from its own values (reused across steps per block); "
                                   "off = one plan per model call, built by the first merged block."}),
                "shared_destinations": ("BOOLEAN", {"default": PRESET.shared_destinations, "tooltip": "With "
                                        "plan_per_block: the first merged block chooses the destinations, each block "
                                        "computes its own weights to them."}),
                "proportional_attention": ("BOOLEAN", {"default": PRESET.proportional, "tooltip": "A merged key "
                                           "weighs in the softmax as the tokens it stands for (attention modes sdpa, "
                                           "flash and comfy; off under SageAttention, whose kernels take head dims 64 "
                                           "and 128 only: the log and the stats say so)."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def patch(self, model, ratio, window_size, reuse_interval, start_percent=0.0, end_percent=1.0,
              temporal_window=DEFAULT_TEMPORAL_WINDOW, plan_per_block=PRESET.plan_per_block,
              shared_destinations=PRESET.shared_destinations, proportional_attention=PRESET.proportional,
              unique_id=None):
        check_inputs(ToMAWanVideoWrapper, ratio=ratio, window_size=window_size, reuse_interval=reuse_interval,
                     start_percent=start_percent, end_percent=end_percent, temporal_window=temporal_window,
                     plan_per_block=plan_per_block, shared_destinations=shared_destinations,
                     proportional_attention=proportional_attention)
        ratio = ratio_of(ratio, PRESET)
        why = wrapper.unsupported(wrapper.diffusion_model_of(model))
        if why is not None:
            log.warning("ToMA: this WANVIDEOMODEL cannot be merged (%s); returning it unpatched", why)
            return (model,)
        if ratio == 0:
            return (model.clone(),)
        schedule = ReuseSchedule(start_percent, end_percent, reuse_interval, short_run=PRESET.short_run)
        where = placement.settle(wrapper, placement.KEYS_VALUES, PRESET, plan_per_block=plan_per_block,
                                 shared_destinations=shared_destinations, proportional=proportional_attention,
                                 schedule=schedule, rotation="auto",  # the video kind's rotation
                                 ratio=ratio, windows=(int(window_size or PRESET.window_size), int(temporal_window)))
        return (patch_with(model, wrapper, where, toma_strategy(where), unique_id),)


class ToMAMergeMapWanVideoWrapper(ToMAMergeMap):
    SEARCH_ALIASES = [*MAP_ALIASES, "wanvideowrapper"]
    DESCRIPTION = ("The ToMA Merge Map of a WANVIDEOMODEL: which video tokens the ToMA (WanVideoWrapper) node merged "
                   "in the last run of WanVideoSampler (its first latent frame), read from the plans recorded while "
                   "sampling.")

    @classmethod
    def INPUT_TYPES(cls):
        spec = ToMAMergeMap.INPUT_TYPES()
        spec["required"]["model"] = ("WANVIDEOMODEL", {"tooltip": "The WANVIDEOMODEL output of the ToMA "
                                                                  "(WanVideoWrapper) node, the one the sampler used."})
        spec["required"]["latent"] = ("LATENT", {"tooltip": "The samples WanVideoSampler produced: set the picture's "
                                                            "size and make this node run after sampling."})
        return spec

    def runtimes(self, model) -> list:
        patches = wrapper.patches_of(model)
        if not patches:
            raise ValueError("model: this WANVIDEOMODEL was not patched by a ToMA Token Merge (WanVideoWrapper) node "
                             "(or it was patched with ratio 0, or refused), so there are no merge plans to show; "
                             "connect that node's output, the one the sampler used")
        return [patch.runtime for patch in reversed(patches)]


NODE_CLASS_MAPPINGS = {
    "ToMAWanVideoWrapper": ToMAWanVideoWrapper,
    "ToMAMergeMapWanVideoWrapper": ToMAMergeMapWanVideoWrapper,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ToMAWanVideoWrapper": "ToMA Token Merge (WanVideoWrapper)",
    "ToMAMergeMapWanVideoWrapper": "ToMA Merge Map (WanVideoWrapper)",
}
