"""Adapter for UNet models (SD1.x, SD2.x, SDXL and relatives): patches through ComfyUI's ModelPatcher.

scope "attention": ``attn1_patch`` merges the self-attention input (q, k and v come from the merged tokens)
and ``attn1_output_patch`` unmerges after the output projection (rows of U sum to 1, so unmerging commutes
with that linear layer and we do the cheap side).
scope "block": each BasicTransformerBlock's ``forward`` is object-patched (the module itself is untouched,
so LoRA keys stay valid): self-attention, cross-attention and feed-forward all run on merged tokens, and
the block's update is unmerged onto the full-resolution residual stream.
"""
import logging
import math
import types

from .runtime import MergeRuntime

log = logging.getLogger("ComfyUI-ToMA")

LEVEL_CHOICES = ("auto", "auto+next", "all", "1", "2", "4", "1,2", "2,4")


def transformer_blocks(diffusion_model):
    """[(dotted path relative to the BaseModel, block)] of every BasicTransformerBlock in the UNet."""
    from comfy.ldm.modules.attention import BasicTransformerBlock

    return [(f"diffusion_model.{name}", m) for name, m in diffusion_model.named_modules()
            if isinstance(m, BasicTransformerBlock)]


def attention_levels(diffusion_model) -> list[int]:
    """Downsample factors (1, 2, 4, ...) of the UNet levels that hold transformer blocks, sorted."""
    from comfy.ldm.modules.attention import SpatialTransformer
    from comfy.ldm.modules.diffusionmodules.openaimodel import Downsample

    levels, ds = set(), 1
    for block in getattr(diffusion_model, "input_blocks", []):
        for layer in block:
            if isinstance(layer, Downsample):
                ds *= 2
            elif isinstance(layer, SpatialTransformer):
                levels.add(ds)
    if any(isinstance(layer, SpatialTransformer) for layer in getattr(diffusion_model, "middle_block", [])):
        levels.add(ds)
    return sorted(levels)


def resolve_levels(choice: str, available: list[int]) -> frozenset[int]:
    if choice == "auto":
        return frozenset(available[:1])
    if choice == "auto+next":
        return frozenset(available[:2])
    if choice == "all":
        return frozenset(available)
    try:
        return frozenset(int(v) for v in choice.split(","))
    except ValueError:
        raise ValueError(f"levels must be one of {', '.join(LEVEL_CHOICES)} or a comma list of downsample "
                         f"factors; got {choice!r}") from None


def token_grid(n_tokens: int, transformer_options) -> tuple[int, int, int] | None:
    """(h, w, downsample) of the token grid of this block call. ComfyUI >= 2025-04 gives the exact shape
    (``activations_shape``); older ComfyUI gives only the latent shape, from which the grid is derived the
    way ToMe does (Downsample is a stride-2 conv with padding 1, so sizes round up)."""
    shape = transformer_options.get("activations_shape")
    latent = transformer_options.get("original_shape")
    if shape is not None and shape[-2] * shape[-1] == n_tokens and latent is not None:
        h, w = int(shape[-2]), int(shape[-1])
        return h, w, max(1, round(latent[-2] / h))
    if latent is None:
        return None
    H, W = int(latent[-2]), int(latent[-1])
    ds = max(1, math.ceil(math.sqrt(H * W // n_tokens)))
    h, w = -(-H // ds), -(-W // ds)
    if h * w != n_tokens:
        return None
    return h, w, ds


def batch_key(x, transformer_options):
    return (x.shape[0], tuple(transformer_options.get("cond_or_uncond") or ()))


class UNetPatch:
    """Everything one patched UNet clone needs: the runtime and the levels to merge."""

    def __init__(self, runtime: MergeRuntime, levels: frozenset[int]):
        self.runtime = runtime
        self.levels = levels
        self.pending = None  # plan set by attn1_patch, consumed by attn1_output_patch of the same block

    def plan_for(self, x, features, transformer_options):
        grid = token_grid(x.shape[1], transformer_options)
        if grid is None or grid[2] not in self.levels:
            return None
        h, w, ds = grid
        shared = self.runtime.method.shared_per_level
        where = ("level", ds) if shared else (tuple(transformer_options.get("block") or ()),
                                               transformer_options.get("block_index", 0))
        key = (where, (h, w), batch_key(x, transformer_options))
        return self.runtime.plan(key, features, (h, w), transformer_options, f"{h}x{w} (1/{ds})")

    # scope "attention" -------------------------------------------------------------------------
    def attn1_patch(self, n, context_attn1, value_attn1, extra_options):
        self.pending = None
        plan = self.plan_for(n, lambda: n, extra_options)
        if plan is None:
            return n, context_attn1, value_attn1
        self.pending = plan
        merged = self.runtime.timed("merge", plan.merge, n)
        self_attention = context_attn1 is n or context_attn1 is None
        if self_attention:
            return merged, merged, merged
        return merged, context_attn1, value_attn1

    def attn1_output_patch(self, n, extra_options):
        plan, self.pending = self.pending, None
        if plan is None:
            return n
        return self.runtime.timed("unmerge", plan.unmerge, n)

    # scope "block" -----------------------------------------------------------------------------
    def block_forward(self, original):
        patch = self

        def forward(block, x, context=None, transformer_options={}):
            plan = patch.plan_for(x, lambda: block.norm1(x), transformer_options)
            if plan is None:
                return original(x, context=context, transformer_options=transformer_options)
            xm = patch.runtime.timed("merge", plan.merge, x)
            ym = original(xm, context=context, transformer_options=transformer_options)
            return x + patch.runtime.timed("unmerge", plan.unmerge, ym - xm)

        return forward


def original_attr(model, key):
    """What ``key`` of the BaseModel is for this clone before our patch: the clone's own object patch,
    else the saved original (object patches stay applied after sampling), else the live attribute."""
    import comfy.utils

    if hasattr(model, "get_model_object"):
        return model.get_model_object(key)
    if key in model.object_patches:
        return model.object_patches[key]
    if key in model.object_patches_backup:
        return model.object_patches_backup[key]
    return comfy.utils.get_attr(model.model, key)


def is_unet(model) -> bool:
    dm = getattr(model.model, "diffusion_model", None)
    return dm is not None and hasattr(dm, "input_blocks") and bool(transformer_blocks(dm))


def patch_unet(model, runtime: MergeRuntime, levels_choice: str, scope: str):
    """Returns the patched clone of ``model`` (a ComfyUI ModelPatcher), or raises ValueError."""
    dm = model.model.diffusion_model
    available = attention_levels(dm)
    levels = resolve_levels(levels_choice, available)
    if not levels & set(available):  # e.g. ToMeSD's max_downsample 1 on SDXL: a silent no-op otherwise
        log.warning("ToMA: %s merges nothing: this UNet has attention only at downsample %s, none of %s",
                    runtime.name, ", ".join(map(str, available)), ", ".join(map(str, sorted(levels))))
    patch = UNetPatch(runtime, levels)
    m = model.clone()
    if scope == "attention":
        m.set_model_attn1_patch(patch.attn1_patch)
        m.set_model_attn1_output_patch(patch.attn1_output_patch)
    elif scope == "block":
        for path, block in transformer_blocks(dm):
            original = original_attr(m, f"{path}.forward")
            m.add_object_patch(f"{path}.forward", types.MethodType(patch.block_forward(original), block))
    else:
        raise ValueError(f"scope must be 'attention' or 'block', got {scope!r}")
    install_run_hooks(m, runtime)
    log.info("ToMA: %s patched on UNet levels %s (scope %s)", runtime.name,
             ", ".join(f"1/{d}" for d in sorted(levels)) or "none", scope)
    return m


def install_run_hooks(m, runtime: MergeRuntime):
    """A clean slate per sampling run and stats at its end: CUR's OUTER_SAMPLE wrapper when the host has
    it. Older ComfyUI has no run hooks, so two calls every sampling run makes are object-patched (the model
    itself is untouched): ``comfy.samplers.sample`` first encodes each cond through
    ``BaseModel.extra_conds`` (with the run's ``latent_image``), and at the end hands the sampled latent to
    ``BaseModel.process_latent_out``. The start matters where sigmas cannot tell runs apart: one-step runs,
    and a run cancelled in its first step, all begin at the sigma the previous one stopped at."""
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        WrappersMP = None
    if WrappersMP is not None and hasattr(m, "add_wrapper_with_key"):
        m.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, "comfyui_toma", runtime.outer_sample_wrapper)
        return
    extra_conds = original_attr(m, "extra_conds")

    def reset_then_extra_conds(**kwargs):
        if "latent_image" in kwargs:  # PerpNeg also encodes a cond in every step, without latent_image
            runtime.reset()
        return extra_conds(**kwargs)

    m.add_object_patch("extra_conds", reset_then_extra_conds)
    process_latent_out = original_attr(m, "process_latent_out")

    def process_latent_out_then_end_run(latent):
        out = process_latent_out(latent)
        runtime.end_run()
        return out

    m.add_object_patch("process_latent_out", process_latent_out_then_end_run)

