"""What the merge map shows: light records of the plans a runtime used, and how a MODEL leads to its runtime.

Records. When a runtime builds (or rebuilds) a plan, it keeps a ``PlanRecord`` that holds the plan itself,
where it already is (on the device). Only when a merge map asks for a record's groups does it work out,
for the first batch row, which kept token every token was merged into, and copy that to the CPU as
small int32 tensors. Recording launches no device work and reads nothing back, so a run without a merge
map never waits for the device on its account; plans reused from the cache add nothing at all.

Finding the runtime from a MODEL. ``model_options`` is deep-copied whenever ComfyUI clones a patcher
(docs/architecture.md, "patches are deep-copied"), so the MODEL carries only a string: ``model_options["transformer_options"]["comfyui_toma"]``
is a registry id, and ``RUNTIMES`` maps ids to live runtimes. The registry holds them weakly: a runtime
lives exactly as long as the patches of some model refer to it, and a string survives any number of
clones (every clone of a patched model shares its runtime, see ``MergeRuntime.__deepcopy__``).
"""
import uuid
import weakref
from dataclasses import dataclass
from functools import cached_property

import torch

from ..toma_core import BipartitePlan, IdentityPlan, MergePlan, untile_tokens
from ..toma_core.tiles import grid_on

OPTIONS_KEY = "comfyui_toma"

RUNTIMES: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class PlanRecord:
    """One plan as the merge map draws it (batch row 0).

    step: sampling step at which the plan was built; it stays in use until the next record of its level.
    h, w: token grid (of each frame of a video). cell: (rows, cols) of the windows the method merges
    inside (ToMA tiles, ToMeSD cells) for drawing their borders, None if unknown. plan: the MergePlan,
    BipartitePlan or IdentityPlan. frames: latent frames of a video grid (frames x h x w), 1 for an image.
    """

    step: int
    h: int
    w: int
    cell: tuple[int, int] | None
    plan: object
    frames: int = 1

    @cached_property
    def _groups_and_kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.plan, MergePlan):
            groups, kept = toma_groups(self.plan)
        elif isinstance(self.plan, BipartitePlan):
            groups, kept = bipartite_groups(self.plan)
        else:
            groups = kept = torch.arange(self.plan.num_merged)
        return groups.to(device="cpu", dtype=torch.int32), kept.to(device="cpu", dtype=torch.int32)

    @property
    def groups(self) -> torch.Tensor:
        """(N,) int32 on the CPU: raster index of the kept token each token was merged into (its own index
        if it was kept)."""
        return self._groups_and_kept[0]

    @property
    def kept(self) -> torch.Tensor:
        """(K,) int32 on the CPU: raster indices of the tokens that survive merging (destinations)."""
        return self._groups_and_kept[1]


def toma_groups(plan: MergePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups (N,), kept (K,)) of row 0 of a ToMA plan: each token goes to the destination that gets the
    largest share of it, the argmax over the destination axis of its assignment (U = A^T, or the exact
    pseudo-inverse of M, which is A^T for hard assignments). Raster indices of the plan's grid: h*w tokens,
    or frames*h*w for windows over video frames."""
    grid = plan.grid
    dest = plan.destinations[0]  # (T, D) index inside the tile, -1 = unused slot
    share = plan.unmerge_weights[0].float().masked_fill(dest[:, None, :] < 0, float("-inf"))  # (T, S, D)
    in_tile = dest.gather(1, share.argmax(-1)).clamp(min=0)  # (T, S)
    origin = grid_on(grid, dest.device)[1]  # (T, S) raster index of each slot
    raster = origin.gather(1, in_tile)
    groups = untile_tokens(raster[None, :, :, None], grid)[0, :, 0]
    kept = origin.gather(1, dest.clamp(min=0))[dest >= 0]
    return groups, kept


def bipartite_groups(plan: BipartitePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups (N,), kept (K,)) of row 0 of a ToMeSD/CA-ToMe plan: merged sources belong to their
    destination, every other token to itself."""
    src, dst = plan.src_index[0], plan.dst_index[0]
    groups = torch.arange(plan.num_tokens, device=src.device)
    groups[src[plan.merged[0]]] = dst[plan.target[0]]
    kept = torch.cat([dst, src[plan.unmerged[0]]]).sort().values
    return groups, kept


def record_plan(plan, step: int, hw: tuple[int, ...], strategy=None) -> PlanRecord:
    """The PlanRecord of ``plan`` used from ``step`` on, for a grid of ``hw`` tokens, (h, w) or
    (frames, h, w). ``strategy`` gives the cell size of bipartite plans (its ``sy``, ``sx``)."""
    if isinstance(plan, (MergePlan, IdentityPlan)):
        cell = (plan.grid.tile, plan.grid.tile)
    elif isinstance(plan, BipartitePlan):
        cell = (strategy.sy, strategy.sx) if hasattr(strategy, "sy") and hasattr(strategy, "sx") else None
    else:
        raise TypeError(f"cannot record a {type(plan).__name__}")
    return PlanRecord(step, int(hw[-2]), int(hw[-1]), cell, plan, int(hw[0]) if len(hw) == 3 else 1)


# -- MODEL -> runtime ---------------------------------------------------------------------------
STACK_KEY = "comfyui_toma_stack"  # ids of every token merge node's runtime on this MODEL, in patch order


def attach_runtime(model, runtime) -> str:
    """Register ``runtime`` and write its id into the patched ``model``'s transformer_options."""
    runtime_id = f"{runtime.name}-{uuid.uuid4().hex}"
    RUNTIMES[runtime_id] = runtime
    options = model.model_options.setdefault("transformer_options", {})
    options[OPTIONS_KEY] = runtime_id
    options[STACK_KEY] = list(options.get(STACK_KEY, ())) + [runtime_id]
    return runtime_id


NOT_PATCHED = ("model: this MODEL was not patched by a ToMA, ToMeSD or CA-ToMe node of this pack (or it was "
               "patched with ratio 0, or the model family is not supported), so there are no merge plans to "
               "show; connect the MODEL output of the token merge node")


def runtime_of(model):
    """The runtime of the token merge node nearest the sampler on ``model`` (or on a model it was cloned
    from)."""
    options = getattr(model, "model_options", None) or {}
    runtime_id = options.get("transformer_options", {}).get(OPTIONS_KEY)
    runtime = RUNTIMES.get(runtime_id) if runtime_id is not None else None
    if runtime is None:
        raise ValueError(NOT_PATCHED)
    return runtime


def runtimes_of(model) -> list:
    """The runtimes of every token merge node on ``model``, the one nearest the sampler first."""
    options = (getattr(model, "model_options", None) or {}).get("transformer_options", {})
    runtimes = [RUNTIMES.get(i) for i in reversed(options.get(STACK_KEY, ()))]
    runtimes = [r for r in runtimes if r is not None]
    if not runtimes:
        raise ValueError(NOT_PATCHED)
    return runtimes
