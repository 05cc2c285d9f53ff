"""The one route from a node's inputs to a patched model, shared by every node that patches (the basic and
Advanced ToMA nodes, the baselines' nodes, the WanVideoWrapper node).

A node resolves the adapter of the model's family once (``adapters.adapter_for``; the WanVideoWrapper node has
its own), reads the preset of the model's kind from it (``preset_for``), settles where it merges on it
(``placement.settle``: a Placement), builds the method from that Placement (``toma_strategy``; a baseline's
node builds its own), and hands all of it to ``patch_with``: the runtime, the adapter's patch, and the patched
model watched (its runtime findable for the merge map, its runs' stats sent to the node).
"""
import logging

from ..toma_core import DEFAULT_TAU, ToMA
from . import placement
from .adapters import supported_families
from .live_stats import stats_sender
from .runtime import MergeRuntime, attach_runtime
from .runtime.pace import HostPace, rule_on

log = logging.getLogger("ComfyUI-ToMA")


def model_sampling_of(model):
    """The model's noise schedule; None for a model without one (not a diffusion model: unsupported)."""
    try:
        if hasattr(model, "get_model_object"):
            return model.get_model_object("model_sampling")
        return model.model.model_sampling
    except AttributeError:
        return None


def preset_for(adapter, model) -> placement.Preset:
    """What "auto" means for ``model``'s kind (placement.PRESETS), read from its family's ``adapter``; a model no
    adapter serves (None) gets the DiT one, unused: it comes back unpatched."""
    return placement.PRESETS["dit" if adapter is None else adapter.preset_kind(model)]


def unsupported(model, name: str):
    """``model`` unpatched, the log naming the families ``name`` (the method) supports."""
    log.warning("ToMA: %s is not supported by %s (supported: %s); returning the model unpatched",
                type(model.model).__name__, name, supported_families())
    return model


def toma_strategy(where: placement.Placement, tau: float = DEFAULT_TAU, exact_unmerge: bool = False) -> ToMA:
    """ToMA as its Placement settled it (ratio, windows, schedule, rotation), with the node's ``tau`` and
    ``exact_unmerge``."""
    window_size, temporal_window = where.windows
    return ToMA(where.ratio, window_size, where.schedule, tau, exact_unmerge, temporal_window=temporal_window,
                rotation=where.rotation)


def patch_with(model, adapter, where: placement.Placement, strategy, unique_id=None, stack_kind: str | None = None):
    """``model`` patched by ``adapter`` (its family's) with ``strategy``, merging where ``where`` says; ``model``
    itself where the adapter refuses it (with its message). ``unique_id``: the patch node's id, to which the live
    stats of each sampling run are sent. ``stack_kind``: the kind of model (placement.PRESETS) whose stack setting
    the method takes beside a step cache found when sampling starts (runtime/step_caches.py: ToMA at an auto
    ratio); None: it merges as set beside one, and says so. A model that samples in ComfyUI's sampler gives the runtime its noise
    schedule and carries the runtime (runtime.registry); there ToMA stops merging for a run where the host sets
    its pace (runtime/pace.py; the baselines run as published)."""
    native = not adapter.own_sampler
    pace = HostPace() if native and strategy.stops_where_host_paced and rule_on() else None
    runtime = MergeRuntime(strategy, model_sampling_of(model) if native else None, where, pace, stack_kind)
    patched = adapter.patch(model, runtime, where)
    if patched is model:
        return model
    if native:
        attach_runtime(patched, runtime)
    if unique_id is not None:
        runtime.run_listeners.append(stats_sender(unique_id))
    return patched
