"""One model call as the runtime sees it: what was settled for it before the model ran, and what it merged.

A ``ModelCall`` is made before the model runs (``MergeRuntime.call_at``, its decisions from the plan store:
``plans.PlanStore.call``), read by the block calls inside it (``MergeRuntime.plan``) and handed on to the run's
stats and the plan store after it (``MergeRuntime.end_call``).
"""
import torch

from .steps import Where


class ModelCall:
    """What the runtime settled for one model call before the model runs (``MergeRuntime.begin_call``),
    and what the call merged, applied to the run's stats after it (``MergeRuntime.end_call``).

    Under torch.compile the block calls are traced: everything they read from here becomes a guard of the
    graph, so they read only ``decisions`` (a few distinct values over a run: one graph per merge path)
    and never the step, which changes every call; what they write (``merged``, ``built``, ``decisions``)
    is replayed after the graph. The call's random seed (``seed``) is drawn here too, for the same reason:
    a generator cannot be used in traced code, a seed tensor is a graph input like any other. So are the
    counts of rotating destinations (``chosen``): the earlier builds' counts, handed in as tensors, so that a
    rebuild traces no new graph; the updated counts of the plans built (``counted``) are kept after the call."""

    def __init__(self, where: Where, decisions: dict, fresh: tuple[bool, bool, bool], seed: torch.Tensor | None,
                 chosen: dict | None = None, device: torch.device | None = None):
        self.where = where  # host side only: never read in a block call
        self.device = device  # where the call's tensors are (host side only)
        self.decisions = decisions  # PlanKey -> (merge, new destinations, new weights)
        self.fresh = fresh  # the decision of a plan key this run has not seen yet
        self.seed = seed  # int64 scalar from the run's generator, for a strategy that draws_seed
        self.chosen = {} if chosen is None else chosen  # counts key -> (B, T, S) counts of the earlier builds
        self.counted: dict = {}  # counts key -> the counts of the plan built in this call (MergePlan.chosen)
        self.compiled = False  # whether the diffusion model runs under torch.compile (compiled_model)
        self.seeds_taken = 0  # plans built from it in this call: each takes the next stream of it
        self.first_seen: list = []  # such keys, handed to the schedule after the call
        self.merged: dict = {}  # Level -> merged tokens of the plans used in this call
        self.built: list = []  # (Level, plan) built in this call, for the merge map
        self.shared: dict = {}  # (Level, rows) -> destinations a level's first block chose in this call
        self.unmerged: dict = {}  # reason -> block calls of this call run unmerged (MergeRuntime.unmerged)
        self.notices: dict = {}  # reason -> (message, args) of its first block call here, logged after the call


def compiled_model(apply_model, transformer_options) -> bool:
    """Whether the diffusion model behind ``apply_model`` (an APPLY_MODEL wrapper's executor, or the bound
    ``BaseModel.apply_model``) runs under torch.compile: current ComfyUI's TorchCompileModel swaps the
    compiled module in from an APPLY_MODEL wrapper keyed "torch.compile"; older trees object-patch
    ``diffusion_model`` with it (a compiled module keeps the original as ``_orig_mod``)."""
    if "torch.compile" in transformer_options.get("wrappers", {}).get("apply_model", {}):
        return True
    base_model = getattr(apply_model, "class_obj", None) or getattr(apply_model, "__self__", None)
    return hasattr(getattr(base_model, "diffusion_model", None), "_orig_mod")
