"""What differs between the ComfyUI versions the pack runs in, feature-detected in one place.

- The original of an object patch: ``ModelPatcher.get_model_object`` where it exists.
- The attention override (``wrap_attn``): where the attention functions call one, DiT scopes can merge inside
  the attention call (placement.settle reads it).
- Run boundaries: current ComfyUI runs OUTER_SAMPLE wrappers around every sampling run and hands them
  the run's sigmas; the March-2024 tree has no run hooks, so two calls every sampling run makes are
  object-patched (the model itself is untouched): ``comfy.samplers.sample`` first encodes each cond
  through ``BaseModel.extra_conds`` (with the run's ``latent_image``), and at the end hands the sampled
  latent to ``BaseModel.process_latent_out``. A run start must come from the host: sigmas cannot tell
  runs apart (one-step runs and a run cancelled in its first step begin at the sigma the previous one
  stopped at), and rise inside one run (ancestral and second-order solvers).
"""
import sys
import weakref

import torch

WRAPPER_KEY = "comfyui_toma"
# ComfyUI core's "Model Sparse Attention" node (comfy_extras/nodes_sparse_attention.py, 2026-09): the key of
# the ON_PREPARE_STATE callback that puts its attention override back on top at every model call
SPARSE_ATTENTION_KEY = "block_sparse_attention"


def sparse_attention_min_tokens(model) -> int | None:
    """Where core's Model Sparse Attention node is on the ModelPatcher ``model`` (its ON_PREPARE_STATE
    callback), the fewest query tokens an attention call needs for its kernel to take it: its ``min_tokens``,
    read from the options its callback holds, else 0 (every call may be its); None where it is not on."""
    get_callbacks = getattr(model, "get_callbacks", None)
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:
        return None
    callbacks = get_callbacks(CallbacksMP.ON_PREPARE_STATE, SPARSE_ATTENTION_KEY) if get_callbacks else None
    if not callbacks:
        return None
    for callback in callbacks:
        for cell in getattr(callback, "__closure__", None) or ():
            try:
                value = getattr(cell.cell_contents, "min_tokens", None)
            except ValueError:  # an empty cell
                continue
            if isinstance(value, int):
                return value
    return 0


def attention_override_supported() -> bool:
    """Whether this ComfyUI's attention functions call ``transformer_options["optimized_attention_override"]``
    (``wrap_attn``; current ComfyUI), which the DiT scopes "attention" and "keys/values" run through
    (placement.settle)."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return False
    return hasattr(attention, "wrap_attn")


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


def schedule_of_caller(max_depth: int = 8) -> list[float] | None:
    """The sigmas of the sampling run that is calling, read from the frame of ComfyUI's
    ``comfy.samplers.sample(model, ..., sigmas, ...)``: the March-2024 tree hands them to no model hook.
    None when no such frame is found (the step is then counted from distinct sigmas)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_code.co_name == "sample" and frame.f_globals.get("__name__") == "comfy.samplers":
            sigmas = frame.f_locals.get("sigmas")
            if torch.is_tensor(sigmas) and sigmas.dim() == 1:
                return [float(s) for s in sigmas.tolist()]
            return None
        frame = frame.f_back
    return None


def block_patches_of_caller(max_depth: int = 16) -> dict | None:
    """The patches (``attn1_patch`` lists, ...) of the transformer block call that is calling, read from
    the frame of ComfyUI's ``BasicTransformerBlock`` forward (``transformer_patches``, in both trees): the
    block hands them to no patch, and they tell which node changed the tokens before the self-attention.
    None when no such frame is found."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        if frame.f_globals.get("__name__") == "comfy.ldm.modules.attention" and \
                "transformer_patches" in frame.f_code.co_varnames:
            patches = frame.f_locals.get("transformer_patches")
            return patches if isinstance(patches, dict) else None
        frame = frame.f_back
    return None


def install_run_hooks(m, runtime) -> None:
    """``runtime.begin_run`` at the start of every sampling run of the patched clone ``m`` (with the
    run's sigmas and the sampled model's noise schedule), ``runtime.end_run`` at its end, and
    ``runtime.around_model_call`` around every model call, outside the diffusion model (which is all that
    ComfyUI's TorchCompileModel compiles): current ComfyUI's APPLY_MODEL wrapper, else an object patch of
    ``BaseModel.apply_model``. Where current ComfyUI has SAMPLER_SAMPLE wrappers, the sampler also reports
    its steps to the runtime (``runtime.sampler_sample_wrapper``): no model call reads its sigma."""
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:
        WrappersMP = None
    if WrappersMP is not None and hasattr(m, "add_wrapper_with_key"):
        m.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, runtime.outer_sample_wrapper)
        m.add_wrapper_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY, runtime.around_model_call)
        if hasattr(WrappersMP, "SAMPLER_SAMPLE"):
            m.add_wrapper_with_key(WrappersMP.SAMPLER_SAMPLE, WRAPPER_KEY, runtime.sampler_sample_wrapper)
        return
    extra_conds = original_attr(m, "extra_conds")
    base_model = m.model
    # object patches stay applied to the BaseModel after the MODEL is dropped: they must not keep the
    # runtime alive (the adapter holds it on the MODEL, see runtime.hold)
    owner = weakref.ref(runtime)

    def begin_run_then_extra_conds(**kwargs):
        run = owner()
        if run is not None and "latent_image" in kwargs:  # PerpNeg also encodes a cond in every step, without latent_image
            # object patches (a model sampling node's too) are applied while the model samples
            run.begin_run(schedule_of_caller(), base_model.model_sampling)
        return extra_conds(**kwargs)

    m.add_object_patch("extra_conds", begin_run_then_extra_conds)
    process_latent_out = original_attr(m, "process_latent_out")

    def process_latent_out_then_end_run(latent):
        out = process_latent_out(latent)
        run = owner()
        if run is not None:
            run.end_run()
        return out

    m.add_object_patch("process_latent_out", process_latent_out_then_end_run)
    apply_model = original_attr(m, "apply_model")

    def apply_model_in_a_model_call(*args, **kwargs):
        run = owner()
        return apply_model(*args, **kwargs) if run is None else run.around_model_call(apply_model, *args, **kwargs)

    m.add_object_patch("apply_model", apply_model_in_a_model_call)
