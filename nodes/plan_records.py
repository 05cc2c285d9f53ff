"""What the merge map shows: light records of the plans a runtime used.

Records. When a runtime builds (or rebuilds) a plan, it keeps a ``PlanRecord`` that holds the plan itself,
where it already is (on the device). Only when a merge map asks for a record's groups does it work out,
for the first batch row, which kept token every token was merged into, and copy that to the CPU as
small int32 tensors. Recording launches no device work and reads nothing back, so a run without a merge
map never waits for the device on its account; plans reused from the cache add nothing at all.
"""
from dataclasses import dataclass
from functools import cached_property

import torch

from ..toma_core import BipartitePlan, MergePlan, untile_tokens
from ..toma_core.tiles import grid_on


@dataclass(frozen=True)
class PlanRecord:
    """One plan as the merge map draws it (batch row 0).

    step: sampling step at which the plan was built; it stays in use until the next record of its level.
    h, w: token grid (of each frame of a video). cell: (rows, cols) of the windows the method merges
    inside (ToMA tiles, ToMeSD cells) for drawing their borders, None if unknown. plan: the MergePlan
    or BipartitePlan. frames: latent frames of a video grid (frames x h x w), 1 for an image.
    """

    step: int
    h: int
    w: int
    cell: tuple[int, int] | None
    plan: object
    frames: int = 1

    @cached_property
    def _groups_and_kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups, kept = toma_groups(self.plan) if isinstance(self.plan, MergePlan) else bipartite_groups(self.plan)
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
    if isinstance(plan, MergePlan):
        cell = (plan.grid.tile, plan.grid.tile)
    elif isinstance(plan, BipartitePlan):
        cell = (strategy.sy, strategy.sx) if hasattr(strategy, "sy") and hasattr(strategy, "sx") else None
    else:
        raise TypeError(f"cannot record a {type(plan).__name__}")
    return PlanRecord(step, int(hw[-2]), int(hw[-1]), cell, plan, int(hw[0]) if len(hw) == 3 else 1)
