"""Which kept token every token was merged into: what a merge map draws of a plan (row 0 of the batch).

Both functions return (groups (N,), kept (K,)) on the plan's device: ``groups`` the raster index of the
kept token each token went to (its own index if it was kept), ``kept`` the raster indices of the tokens
that survive merging (destinations), over the plan's h*w grid (frames*h*w for windows over video frames).
"""
import torch

from .baselines import BipartitePlan
from .plan import IdentityPlan, MergePlan
from .tiles import grid_on, untile_tokens


def toma_groups(plan: MergePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """A ToMA plan: each token goes to the destination that gets the largest share of it, the argmax over
    the destination axis of its assignment (U = A^T, or the exact pseudo-inverse of M, which is A^T for
    hard assignments)."""
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
    """A ToMeSD/CA-ToMe plan: merged sources belong to their destination, every other token to itself."""
    src, dst = plan.src_index[0], plan.dst_index[0]
    groups = torch.arange(plan.num_tokens, device=src.device)
    groups[src[plan.merged[0]]] = dst[plan.target[0]]
    kept = torch.cat([dst, src[plan.unmerged[0]]]).sort().values
    return groups, kept


def merge_groups(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(groups, kept) of a ToMA or a bipartite plan, or of one that merges nothing (every token its own group:
    DiTo's matching steps)."""
    if isinstance(plan, IdentityPlan):
        every = torch.arange(plan.num_merged, device=plan.device)
        return every, every
    if isinstance(plan, MergePlan):
        return toma_groups(plan)
    if isinstance(plan, BipartitePlan):
        return bipartite_groups(plan)
    raise TypeError(f"cannot group the tokens of a {type(plan).__name__}")
