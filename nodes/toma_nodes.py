"""The node classes (V1 API: loaded by the pinned March-2024 ComfyUI and by current ComfyUI alike).

Each node takes a MODEL and returns a patched clone; the input MODEL is never changed. The node checks
its inputs, resolves the adapter of the model's family (``adapters``) once, settles where it merges on it and
chooses a strategy (``toma_core.strategies``); ``patching.patch_with`` patches; a model no adapter supports
comes back unpatched with a log message naming the supported families.
"""
from ..toma_core import (CATOME_CONFIG3, CATOME_REFERENCE_STEPS, DEFAULT_TAU, CAToMe, CheckpointSchedule, DiTo,
                         MatchingSchedule, ReuseSchedule, ToMeSD)
from . import placement
from .adapters import (adapter_for, attention_placement_families, family_names, feed_forward_families,
                       keys_values_families, unet)
from .inputs import (AUTO_RATIO, CATEGORY, DEFAULT_RATIO, DEFAULT_REUSE, DEFAULT_TEMPORAL_WINDOW, DEFAULT_WINDOW,
                     MODEL_INPUT, RATIO_INPUT, REUSE_INPUT, SPEED_ALIASES, WINDOW_INPUT, check_inputs, float_input,
                     int_input, ratio_of)
from .patching import patch_with, preset_for, toma_strategy, unsupported


def preset_of(model) -> placement.Preset:
    """What "auto" means for ``model``'s kind (placement.PRESETS); a model no adapter serves gets the
    DiT one, unused: it comes back unpatched."""
    return preset_for(adapter_for(model), model)


def apply_strategy(model, strategy, levels="auto", scope: str = placement.AUTO, unique_id=None):
    """Patch ``model`` with a baseline's ``strategy`` (None: ratio 0, a plain clone), each block call with
    a plan of its own, as the baselines match. ``levels`` is a UNet notion (a DiT has one token grid);
    ``scope``: "auto" is the family's fallback placement."""
    if strategy is None:
        return model.clone()
    adapter = adapter_for(model)
    if adapter is None:
        return unsupported(model, strategy.name)
    return patch_with(model, adapter, placement.settle(adapter, scope, levels=levels, plan_per_block=True), strategy,
                      unique_id)


def in_words(names) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


class ModelPatchNode:
    """What every node of this pack that patches a MODEL shares."""

    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The patched model: connect it to a sampler.",)
    FUNCTION = "patch"
    SEARCH_ALIASES = list(SPEED_ALIASES)


class ToMAPatchModel(ModelPatchNode):
    DESCRIPTION = ("ToMA token merging (ICML 2025): in each local window, picks destination tokens by greedy "
                   "facility location, merges the others into them with attention-like weights before "
                   "self-attention and unmerges after it. Faster sampling on "
                   f"{'/'.join(unet.names)} with little change to the image. On the image DiTs "
                   f"{in_words(family_names(video=False))} it merges the image tokens, on the video DiTs "
                   f"{in_words(family_names(video=True))} the video tokens, in windows over frames, of every "
                   "block but the first ~13-25% of each group (text tokens never; each Qwen-Image-Edit reference "
                   "image by a plan of its own). Image-DiT blocks run whole on merged tokens; on video DiTs only "
                   "the self-attention's keys and values are merged. The Advanced node's scope can merge only the "
                   "keys and values of every DiT's self-attention but SD3's, or only the attention of "
                   f"{in_words(attention_placement_families())} double blocks. Runs of at most 8 steps build a "
                   "new plan every step on DiTs.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_INPUT, "ratio": RATIO_INPUT, "window_size": WINDOW_INPUT,
                             "reuse_interval": REUSE_INPUT},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, ratio=DEFAULT_RATIO, window_size=DEFAULT_WINDOW, reuse_interval=DEFAULT_REUSE,
              unique_id=None):
        adapter = adapter_for(model)
        preset = preset_for(adapter, model)
        return ToMAPatchModelAdvanced().patch(model, ratio, window_size, reuse_interval, levels=preset.levels,
                                              weights_interval=preset.weights_interval,
                                              start_percent=preset.start_percent, merge_every=preset.merge_every,
                                              unique_id=unique_id, adapter=adapter)


class ToMAPatchModelAdvanced(ModelPatchNode):
    DESCRIPTION = ("ToMA token merging with every knob: what runs merged (scope: on UNets; on every DiT but "
                   "SD3, keys/values; on "
                   f"{in_words(attention_placement_families())} double blocks, attention), which UNet levels, how "
                   "often weights are refreshed, the "
                   "part of the schedule that merges and which of its steps, softmax sharpness and exact "
                   "pseudo-inverse unmerging.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": MODEL_INPUT, "ratio": RATIO_INPUT, "window_size": WINDOW_INPUT,
                "reuse_interval": REUSE_INPUT,
                "scope": (list(placement.SCOPES), {
                    "default": "auto",
                    "tooltip": "attention: only self-attention runs on merged tokens. block: self-attention, "
                               "cross-attention and feed-forward all run merged (faster, more change). "
                               "keys/values: queries stay whole, keys and values come from merged tokens, "
                               "nothing to unmerge (UNets, and the self-attention of every block of "
                               f"{in_words(keys_values_families())}: the rest of the block runs whole, text and "
                               "cross-attention untouched; pays on long sequences: video, 2048 px). queries "
                               "(UNets): queries merged, keys and values whole. feed-forward ("
                               f"{in_words(feed_forward_families())}): the self-attention over every token, the "
                               "cross-attention and feed-forward on merged tokens (beside core's Model Sparse "
                               "Attention, whose kernel takes only attention over every token). On "
                               f"{in_words(attention_placement_families())} double blocks, attention merges only "
                               "the joint attention (the paper's placement) and block the whole block; their "
                               "single blocks then run whole on merged image tokens. auto: "
                               + placement.auto_in_words() + "."}),
                "levels": (list(unet.LEVEL_CHOICES), {
                    "default": "auto",
                    "tooltip": "UNet resolutions to merge, as downsample factors. auto: the highest-resolution "
                               "level with attention (1/1 on SD1.x/SD2.x, 1/2 on SDXL); auto+next adds the "
                               "level below it. UNets only: a DiT has one token grid and merges all "
                               "but the first blocks of each group."}),
                "weights_interval": int_input(1, 1, 100, "Steps between merge-weight refreshes (at most the "
                                                    "reuse interval matters; 1 = every step)."),
                "start_percent": float_input(0.0, 0.0, 1.0, 0.01, "Merge from this point of the schedule on "
                                                             "(0 = first step)."),
                "end_percent": float_input(1.0, 0.0, 1.0, 0.01, "Stop merging at this point of the schedule "
                                                           "(1 = last step)."),
                "tau": float_input(DEFAULT_TAU, 1.0, 10000.0, 1.0, "Softmax sharpness of the merge weights. "
                              "Large = each token goes to its most similar destination."),
                "exact_unmerge": ("BOOLEAN", {"default": False, "tooltip": "Unmerge with the exact "
                                  "pseudo-inverse (useful for small tau); off = the transpose, exact for large tau."}),
            },
            "optional": {
                "temporal_window": int_input(DEFAULT_TEMPORAL_WINDOW, 1, 16, "Video models: frames (latent frames) a "
                                        "merge window spans, so tokens merge with their neighbours in the "
                                        "next frames too; 1 = each frame apart. Images have one frame."),
                "merge_every": int_input(1, 1, 100, "Merge only on every k-th step (steps 0, k, 2k, ...); the other "
                                    "steps run the unpatched model. 1 = every step; the official Flux run "
                                    "uses 3."),
                "plan_per_block": ("BOOLEAN", {"default": False, "tooltip": "Each block picks destinations and "
                                   "weights from its own input (reused across steps per block); off = one plan "
                                   "per level or block group, built from its first block."}),
                "proportional_attention": ("BOOLEAN", {"default": False, "tooltip": "Scopes attention and "
                                           "keys/values (UNets and DiTs): a merged key weighs in the softmax as "
                                           "the tokens it stands for (ToMe's proportional attention; no mask: "
                                           "fused attention kernels, FlashAttention and SageAttention still "
                                           "apply). Not honoured with scope block: the log and the stats say so."}),
                "shared_destinations": ("BOOLEAN", {"default": False, "tooltip": "With plan_per_block: the "
                                        "first block of each level or block group chooses the destinations, "
                                        "each block computes its own weights to them (one selection per level "
                                        "instead of per block: far fewer GPU kernels, a little less faithful)."}),
                "rotation": (list(placement.ROTATIONS), {
                    "default": "auto",
                    "tooltip": "Destinations that rotate: each time a plan chooses new destinations, tokens that "
                               "were destinations of the same plan earlier in the run are less likely to be "
                               "chosen again, so successive plans keep different tokens and the merge error "
                               "averages out over the steps (a closer picture at the same speed: a few GPU "
                               "kernels per selection). auto: " + placement.rotation_in_words() + "."}),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def patch(self, model, ratio, window_size, reuse_interval, scope="auto", levels="auto",
              weights_interval=1, start_percent=0.0, end_percent=1.0, tau=DEFAULT_TAU, exact_unmerge=False,
              temporal_window=DEFAULT_TEMPORAL_WINDOW, merge_every=1, plan_per_block=False,
              proportional_attention=False, shared_destinations=False, rotation="auto", unique_id=None, adapter=None):
        """``adapter``: the model's, where the caller resolved it (the basic node); else resolved here."""
        check_inputs(ToMAPatchModelAdvanced, ratio=ratio, window_size=window_size, reuse_interval=reuse_interval,
                     scope=scope, levels=levels, weights_interval=weights_interval, start_percent=start_percent,
                     end_percent=end_percent, tau=tau, exact_unmerge=exact_unmerge, temporal_window=temporal_window,
                     merge_every=merge_every, plan_per_block=plan_per_block,
                     proportional_attention=proportional_attention, shared_destinations=shared_destinations,
                     rotation=rotation)
        adapter = adapter_for(model) if adapter is None else adapter
        preset = preset_for(adapter, model)
        # beside a step cache an auto ratio takes the stack setting of the model's kind (runtime/step_caches.py)
        stack_kind = adapter.preset_kind(model) if ratio == AUTO_RATIO and adapter is not None else None
        ratio = ratio_of(ratio, preset)
        if ratio == 0:
            return (model.clone(),)
        if adapter is None:
            return (unsupported(model, "ToMA"),)
        schedule = ReuseSchedule(start_percent, end_percent, reuse_interval, weights_interval, int(merge_every))
        where = placement.settle(adapter, scope, preset, levels=levels, plan_per_block=plan_per_block,
                                 shared_destinations=shared_destinations, proportional=proportional_attention,
                                 schedule=schedule, rotation=rotation, ratio=ratio,
                                 windows=(int(window_size or preset.window_size), int(temporal_window)))
        return (patch_with(model, adapter, where, toma_strategy(where, tau, exact_unmerge), unique_id, stack_kind),)


def _downsample_levels(max_downsample: int) -> frozenset[int]:
    return frozenset(d for d in MAX_DOWNSAMPLE_CHOICES if d <= max_downsample)


MAX_DOWNSAMPLE_CHOICES = (1, 2, 4, 8)
SEED_MAX = 2**31 - 1
TOME_COMMON = {
    "max_downsample": (list(MAX_DOWNSAMPLE_CHOICES), {
        "default": 1, "tooltip": "Merge in UNet levels downsampled at most this much (1 = full resolution "
                                 "only, as ToMeSD's default; SDXL has no attention there, use 2)."}),
    "sx": int_input(2, 1, 8, "Width of the cell that holds one destination."),
    "sy": int_input(2, 1, 8, "Height of the cell that holds one destination."),
    "seed": int_input(0, 0, SEED_MAX, "Seed of the random destination position in each cell."),
}


class ToMeSDPatchModel(ModelPatchNode):
    SEARCH_ALIASES = [*SPEED_ALIASES, "tomesd"]
    DESCRIPTION = ("ToMeSD baseline (Bolya & Hoffman 2023), as in the tomesd package: one random destination "
                   "per 2x2 cell, bipartite matching by cosine, the most similar sources averaged in; seeded.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_INPUT,
                             "ratio": float_input(0.5, 0.0, 0.75, 0.05, "Fraction of tokens merged away (ToMeSD "
                                             "caps it at 1 - 1/(sx*sy))."),
                             **TOME_COMMON},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, ratio, max_downsample=1, sx=2, sy=2, seed=0, unique_id=None):
        check_inputs(ToMeSDPatchModel, ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, seed=seed)
        strategy = None if ratio == 0 else ToMeSD(ratio, int(sx), int(sy), int(seed))
        return (apply_strategy(model, strategy, _downsample_levels(max_downsample), unique_id=unique_id),)


def parse_checkpoints(text: str) -> tuple[int, ...]:
    problem = (f"checkpoints must be comma-separated step numbers between 0 and {CATOME_REFERENCE_STEPS} (steps "
               f"of a {CATOME_REFERENCE_STEPS}-step run, counted from 1), got {text!r}")
    try:
        steps = tuple(sorted({int(s) for s in text.replace(" ", "").split(",") if s}))
    except ValueError:
        raise ValueError(problem) from None
    if not steps or steps[0] < 0 or steps[-1] > CATOME_REFERENCE_STEPS:
        raise ValueError(problem)
    return steps


class CAToMePatchModel(ModelPatchNode):
    SEARCH_ALIASES = [*SPEED_ALIASES, "ca-tome", "catome"]
    DESCRIPTION = ("CA-ToMe baseline (Saghatchian et al. 2025): ToMeSD's matching, but merges the sources "
                   "whose similarity reaches a threshold, and reuses the matches between checkpoint steps.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_INPUT,
                             "threshold": float_input(0.7, -1.0, 1.0, 0.01, "Sources at least this cosine-similar "
                                                 "to a destination are merged; 1 = almost nothing merged."),
                             "checkpoints": ("STRING", {"default": ",".join(map(str, CATOME_CONFIG3)),
                                             "tooltip": f"Steps of a {CATOME_REFERENCE_STEPS}-step run, counted "
                                                        "from 1 as the reference code counts them, at which "
                                                        "matches are recomputed (rescaled to the run's steps); "
                                                        "the paper's CONFIG 3 by default."}),
                             **TOME_COMMON},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, threshold, checkpoints=",".join(map(str, CATOME_CONFIG3)), max_downsample=1, sx=2,
              sy=2, seed=0, unique_id=None):
        check_inputs(CAToMePatchModel, threshold=threshold, max_downsample=max_downsample, sx=sx, sy=sy, seed=seed)
        strategy = CAToMe(threshold, int(sx), int(sy), int(seed), CheckpointSchedule(parse_checkpoints(checkpoints)))
        return (apply_strategy(model, strategy, _downsample_levels(max_downsample), unique_id=unique_id),)


class DiToPatchModel(ModelPatchNode):
    SEARCH_ALIASES = [*SPEED_ALIASES, "dito"]
    EXPERIMENTAL = True  # our reading of a paper whose method text could not be read (see its description)
    DESCRIPTION = ("Experimental. DiTo, after arXiv 2605.22011: it follows only the paper's abstract and first "
                   "figure, because the method text could not be read here (and no code is public); "
                   "toma_core/dito.py lists what it assumes, as do the help page and docs/architecture.md. Each DiT "
                   "block runs unmerged at a matching step, matches tokens by the similarity of its own output (ToMeSD's cells and bipartite matching), "
                   "and merges by that matching over the reduction steps until the next matching step, whole "
                   "blocks on merged image tokens; a penalty keeps it from merging the same tokens at every "
                   f"matching. DiTs only ({in_words(family_names(video=False) + family_names(video=True))}); a "
                   "UNet comes back unpatched.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": MODEL_INPUT,
                             "ratio": float_input(0.5, 0.0, 0.75, 0.05, "Fraction of image tokens merged away at reduction "
                                             "steps (at most 1 - 1/(2*2): one destination per 2x2 cell); 0 = off."),
                             "matching_interval": int_input(5, 2, 50, "Steps from one matching step to the next: each "
                                                       "block runs unmerged at a matching step and merges by its "
                                                       "matching over the steps in between (the paper chooses it by "
                                                       "its Pair Match Ratio)."),
                             "penalty": float_input(0.5, 0.0, 4.0, 0.05, "Selection-frequency penalty: a token's matching "
                                               "score is lowered by this much for every earlier matching of the run "
                                               "that merged it away, so later matchings merge other tokens (0 = off)."),
                             "seed": TOME_COMMON["seed"]},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, ratio, matching_interval=5, penalty=0.5, seed=0, unique_id=None):
        check_inputs(DiToPatchModel, ratio=ratio, matching_interval=matching_interval, penalty=penalty, seed=seed)
        strategy = None if ratio == 0 else DiTo(ratio, penalty, seed=int(seed),
                                                schedule=MatchingSchedule(int(matching_interval)))
        return (apply_strategy(model, strategy, scope=placement.BLOCK, unique_id=unique_id),)


NODE_CLASS_MAPPINGS = {
    "ToMAPatchModel": ToMAPatchModel,
    "ToMAPatchModelAdvanced": ToMAPatchModelAdvanced,
    "ToMeSDPatchModel": ToMeSDPatchModel,
    "CAToMePatchModel": CAToMePatchModel,
    "DiToPatchModel": DiToPatchModel,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "ToMAPatchModel": "ToMA Token Merge",
    "ToMAPatchModelAdvanced": "ToMA Token Merge (Advanced)",
    "ToMeSDPatchModel": "ToMeSD Token Merge",
    "CAToMePatchModel": "CA-ToMe Token Merge",
    "DiToPatchModel": "DiTo Token Merge (after arXiv 2605.22011)",
}
