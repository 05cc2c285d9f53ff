"""Pure-torch token merging engine (never imports ComfyUI).

- ``tiles``: cut a raster token grid (an image, or the frames of a video) into local windows and back.
- ``selection``: greedy facility location, batched over tiles and batch rows.
- ``plan``: ToMA's merge plan, M = row-normalised softmax(tau * cos), unmerge U = A^T (or pinv).
- ``schedule``: merge window and pattern reuse, keyed on sampler sigmas (``Schedule``: what every schedule offers).
- ``baselines``: ToMeSD and CA-ToMe behind the same merge/unmerge interface.
- ``dito``: DiTo (after arXiv 2605.22011): matchings on block outputs, reused over reduction steps.
- ``strategies``: the four methods behind one protocol (``Strategy``: build a plan; a schedule says when).
- ``groups``: which kept token every token was merged into (what a merge map draws).
- ``memory``: the context the engine makes the tensors it caches under (the host's, handed in by its glue).
"""
from .baselines import (CATOME_CONFIG3, CATOME_REFERENCE_STEPS, BipartitePlan, CheckpointSchedule, catome_checkpoints,
                        catome_plan, tomesd_plan)
from .groups import bipartite_groups, merge_groups, toma_groups
from .plan import DEFAULT_TAU, ROTATION_STRENGTH, IdentityPlan, MergePlan, TokenPlan, destinations_per_tile, plan_tiles
from .schedule import EveryCall, ReuseSchedule, RunClock, Schedule, ShortRun, StepDecision, step_from_sigmas
from .selection import cosine_similarity, facility_location, select_destinations, stochastic_facility_location
from .dito import DiToPlan, MatchingPlan, MatchingSchedule, interval_from_pmr, pair_match_ratio
from .strategies import CAToMe, DiTo, Strategy, ToMA, ToMeSD
from .tiles import TileGrid, tile_tokens, token_grid, untile_tokens

__all__ = [
    "CATOME_CONFIG3", "CATOME_REFERENCE_STEPS", "BipartitePlan", "CheckpointSchedule", "catome_checkpoints",
    "catome_plan", "tomesd_plan",
    "bipartite_groups", "merge_groups", "toma_groups",
    "DEFAULT_TAU", "ROTATION_STRENGTH", "IdentityPlan", "MergePlan", "TokenPlan", "destinations_per_tile", "plan_tiles",
    "EveryCall", "ReuseSchedule", "RunClock", "Schedule", "ShortRun", "StepDecision", "step_from_sigmas",
    "DiToPlan", "MatchingPlan", "MatchingSchedule", "interval_from_pmr", "pair_match_ratio",
    "CAToMe", "DiTo", "Strategy", "ToMA", "ToMeSD",
    "cosine_similarity", "facility_location", "select_destinations", "stochastic_facility_location",
    "TileGrid", "tile_tokens", "token_grid", "untile_tokens",
]
