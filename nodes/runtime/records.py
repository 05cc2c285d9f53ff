"""What the merge map shows: light records of the plans a runtime used.

Records. When a runtime builds (or rebuilds) a plan, it keeps a ``PlanRecord`` that holds the plan itself,
where it already is (on the device). Only when a merge map asks for a record's groups does it work out
(``toma_core.merge_groups``), for the first batch row, which kept token every token was merged into, and
copy that to the CPU as small int32 tensors. Recording launches no device work and reads nothing back,
so a run without a merge map never waits for the device on its account; plans reused from the cache add
nothing at all.
"""
from dataclasses import dataclass
from functools import cached_property

import logging

import torch

from ...toma_core import BipartitePlan, IdentityPlan, MergePlan, merge_groups

log = logging.getLogger("ComfyUI-ToMA")


@dataclass(frozen=True)
class PlanRecord:
    """One plan as the merge map draws it (batch row 0).

    step: sampling step at which the plan was built; it stays in use until the next record of its level.
    h, w: token grid (of each frame of a video). window: (rows, cols) of the windows the method merges
    inside (ToMA's windows, ToMeSD's strides) for drawing their borders, None if unknown. plan: the
    MergePlan or BipartitePlan, or an IdentityPlan (nothing merged). frames: latent frames of a video grid (frames x h x w), 1 for an image.
    previous: where destinations rotate, the level's record before this one (the map marks the tokens kept
    now that were not kept then); None otherwise.
    """

    step: int
    h: int
    w: int
    window: tuple[int, int] | None
    plan: object
    frames: int = 1
    previous: "PlanRecord | None" = None

    @cached_property
    def _groups_and_kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        groups, kept = merge_groups(self.plan)
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


def record_plan(plan, step: int, grid: tuple[int, ...], strategy=None, previous: PlanRecord | None = None) -> PlanRecord:
    """The PlanRecord of ``plan`` used from ``step`` on, for a token grid (h, w) or (frames, h, w).
    ``strategy`` gives the window of bipartite plans (its strides ``sy``, ``sx``); ``previous``: the level's
    record before it, where destinations rotate."""
    if isinstance(plan, MergePlan):
        window = (plan.grid.window_size, plan.grid.window_size)
    elif isinstance(plan, BipartitePlan):
        window = None if strategy is None else (strategy.sy, strategy.sx)  # the cells of a bipartite method
    elif isinstance(plan, IdentityPlan):  # a step that merges nothing (DiTo's matching steps)
        window = None
    else:
        raise TypeError(f"cannot record a {type(plan).__name__}")
    return PlanRecord(step, int(grid[-2]), int(grid[-1]), window, plan, int(grid[0]) if len(grid) == 3 else 1,
                      previous)


def keep_record(records: list, level, step: int, plan, strategy, rotation: float) -> None:
    """Keep in ``records`` (a level's, ``LevelStats.records``) what the merge map needs of ``plan``, newly built
    at ``step`` by ``strategy``: one record per level and step (none of a rank's slab: the map draws whole
    grids); where destinations rotate (``rotation``), each record knows the level's record before it."""
    if level.slab is not None or (records and records[-1].step == step):
        return
    try:
        previous = records[-1] if rotation and records else None
        records.append(record_plan(plan, step, level.grid, strategy, previous))
    except Exception:  # the map is a diagnostic: never let it break sampling
        log.exception("ToMA: could not record the plan of %s for the merge map", level)
