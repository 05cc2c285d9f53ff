"""The four merge methods behind one small protocol (``Strategy``): how a plan is built (``build``) and when
(``schedule``, a ``schedule.Schedule``).

    build(features (B, N, C), grid (h, w) or (frames, h, w), generator, destinations=None) -> plan

    merges_nothing(grid) -> str or None

``merges_nothing``: why the inputs leave nothing to merge on a grid, said once in the log and the live
stats (None: plans may merge).
``destinations``: those of the group's last plan, given when the schedule asks for new weights only.
``generator``: one per sampling run, advanced by every build (as tomesd advances one generator), so
every block and step draws new random cells. A strategy whose ``draws_seed`` is true (ToMA with windows
over 64 tokens, ToMeSD) is given no generator but a ``seed`` tensor instead (``selection.draw_seed``, one
per model call from the run's generator, a stream of it per build: ``selection.seed_stream``), drawn
before the model call, since a block call under torch.compile cannot draw from a generator. Whether one
plan serves the blocks of a group in a step or each block call builds its own is where a host merges,
not what a method is: the host decides it (ComfyUI-ToMA's ``placement.Placement``).

Rotating destinations (ToMA's ``rotation``, a strength; 0: off): where a build chooses destinations, it is
given ``chosen``, the counts of how often each token was a destination at the plan key's earlier builds in
the run (None at its first), and its plan carries them updated (``MergePlan.chosen``), which the runtime
keeps on the device for the key's next build. ToMeSD and CA-ToMe stay as their papers have them.
"""
from dataclasses import dataclass, field

import torch

from .baselines import CheckpointSchedule, catome_plan, tomesd_plan
from .dito import MatchingSchedule, dito_plan, raster_rows
from .plan import DEFAULT_TAU, plan_tiles
from .schedule import EveryCall, ReuseSchedule, Schedule
from .selection import EXACT_GREEDY_MAX_TILE
from .tiles import token_grid


class Strategy:
    """What every merge method offers the runtime and the nodes, with the defaults of a method that does not
    say otherwise; a method is a frozen dataclass of its inputs that subclasses it and sets what differs.

    name: in messages and the stats. schedule: when it merges and rebuilds (a ``schedule.Schedule``). seed:
    of the run's generator. patches_unets, patches_dits: the kinds of model it merges (the others come back
    unpatched, with a message). draws_seed: its builds take a ``seed`` tensor (the module docstring), not
    the generator. under_compile: what it does otherwise under torch.compile, said once where the model is
    compiled (None: nothing). stops_where_host_paced: merging stops for a run whose pace the host sets
    (nodes/runtime/pace.py: ToMA; the baselines run as published)."""

    name: str
    schedule: Schedule
    seed: int
    patches_unets = True
    patches_dits = True
    draws_seed = False
    under_compile: str | None = None
    stops_where_host_paced = False

    def build(self, features: torch.Tensor, grid, generator=None, destinations=None, **drawn):
        """A plan for ``features`` (B, N, C) on ``grid`` (the module docstring)."""
        raise NotImplementedError

    def merges_nothing(self, grid) -> str | None:
        """Why the inputs leave nothing to merge on ``grid``, said once in the log and the stats (None: plans
        may merge)."""
        return None


@dataclass(frozen=True)
class ToMA(Strategy):
    """ToMA: destinations by facility location in local windows, soft merge weights, reused across steps
    as ``schedule`` says. A window is ``window_size`` tokens square and, on a video grid,
    ``temporal_window`` frames deep (1: each frame apart, as on images)."""

    ratio: float
    window_size: int
    schedule: ReuseSchedule = field(default_factory=ReuseSchedule)
    tau: float = DEFAULT_TAU
    exact: bool = False
    seed: int = 0
    temporal_window: int = 1
    # strength of rotating destinations (plan.ROTATION_STRENGTH; 0: off): a token that was a destination at the
    # plan key's earlier builds in the run is less likely to be one again (plan_tiles)
    rotation: float = 0.0
    # why the node merges nothing at all with this strategy, said once in the log and the stats (None: it merges
    # as set); the node's stack setting beside a step cache that keeps more of the picture alone (nodes/runtime/
    # step_caches.py)
    idle_because: str | None = None
    name = "ToMA"
    stops_where_host_paced = True

    def build(self, features: torch.Tensor, grid, generator=None, destinations=None, seed=None, chosen=None):
        return plan_tiles(features, grid, self.window_size, self.ratio, self.tau, self.exact,
                          destinations=destinations, generator=generator, temporal_window=self.temporal_window,
                          seed=seed, rotation=self.rotation, chosen=chosen)

    def first_counts(self, grid, batch: int, device) -> torch.Tensor:
        """(batch, T, S) zeros: the rotation counts of a plan key before its first build on ``grid``, for a
        host that settles a call's inputs before its blocks run, so that the first build and the later ones
        trace alike (blocks compiled one by one)."""
        tiles = token_grid(grid, self.window_size, self.temporal_window)
        return torch.zeros(batch, tiles.num_tiles, tiles.tile_size, device=device)

    @property
    def draws_seed(self) -> bool:
        """Whether a window can hold over ``EXACT_GREEDY_MAX_TILE`` tokens, where selection is stochastic:
        its randomness comes from a seed tensor the runtime draws before each model call and hands to
        ``build`` as ``seed`` (traced code cannot draw from a generator: toma_core.selection). Smaller
        windows select exactly and need no draw."""
        return self.window_size ** 2 * self.temporal_window > EXACT_GREEDY_MAX_TILE

    def merges_nothing(self, grid) -> str | None:
        if self.idle_because is not None:
            return self.idle_because
        start, end = self.schedule.start_percent, self.schedule.end_percent
        if start == end:
            return f"start_percent equals end_percent ({start}): no step lies between them"
        video = len(grid) == 3 and grid[0] > 1
        if self.window_size == 1 and (not video or self.temporal_window == 1):
            depth = " and temporal_window 1" if video else ""
            return f"window_size 1{depth}: each window holds a single token, with nothing to merge into it"
        return None


@dataclass(frozen=True)
class ToMeSD(Strategy):
    """ToMeSD: a fresh bipartite matching in every merged block call, as the tomesd package does, each with
    new random cells: hashed from the stream of the model call's seed that the build is given (``seed``,
    drawn from the run's generator before the call: a block call under torch.compile cannot draw)."""

    ratio: float
    sx: int = 2
    sy: int = 2
    seed: int = 0
    schedule: EveryCall = field(default_factory=EveryCall)
    name = "ToMeSD"
    patches_dits = False
    draws_seed = True

    def build(self, features: torch.Tensor, grid, generator=None, destinations=None, seed=None):
        return tomesd_plan(features, grid, self.ratio, self.sx, self.sy, generator=generator, seed=seed)


@dataclass(frozen=True)
class CAToMe(Strategy):
    """CA-ToMe: per block, threshold matching computed at the checkpoint steps, reused in between."""

    threshold: float
    sx: int = 2
    sy: int = 2
    seed: int = 0
    schedule: CheckpointSchedule = field(default_factory=CheckpointSchedule)
    name = "CA-ToMe"
    patches_dits = False
    # what the method does under torch.compile, said once where the model is compiled (the others: None)
    under_compile = ("its merged length depends on the data, so torch.compile breaks the graph around each "
                     "plan it builds (at its checkpoint steps): the model runs in several graphs, not one per "
                     "merge path as with ToMA and ToMeSD")

    def build(self, features: torch.Tensor, grid, generator=None, destinations=None):
        return catome_plan(features, grid, self.threshold, self.sx, self.sy, generator=generator)


@dataclass(frozen=True)
class DiTo(Strategy):
    """DiTo, after arXiv 2605.22011 (``toma_core.dito``, with its assumptions): each block matches on its own
    output at a matching step (run unmerged) and merges by that matching over the reduction steps after it,
    with a penalty on sources merged at earlier matchings. Per block (each block's own output), DiTs only;
    the matching's cells are hashed from a stream of the model call's seed (``draws_seed``), as ToMeSD's."""

    ratio: float
    penalty: float = 0.5
    sx: int = 2
    sy: int = 2
    seed: int = 0
    schedule: MatchingSchedule = field(default_factory=MatchingSchedule)
    name = "DiTo"
    patches_unets = False
    draws_seed = True

    def build(self, features: torch.Tensor, grid, generator=None, destinations=None, seed=None):
        return dito_plan(features, grid, self.ratio, self.penalty, self.sx, self.sy, destinations, seed, generator)

    def merges_nothing(self, grid) -> str | None:
        rows, cols = raster_rows(grid)
        if rows < self.sy or cols < self.sx:
            return f"the {rows}x{cols} token grid holds no whole {self.sy}x{self.sx} cell to keep a destination in"
        if int(rows * cols * self.ratio) == 0:
            return f"ratio {self.ratio:g} of {rows * cols} tokens merges no token"
        return None
