"""What a runtime keys its plans and stats by, and what it reports of a run.

A ``Level`` is where plans apply: one block group's token grid (a UNet level, a DiT block group). Stats,
records and the other node that took a level are keyed by it; its ``label`` is how the stats, the merge
map and the log name it, and nothing parses a label back: tests and benchmarks read the fields, through
``MergeRuntime.report()`` (a ``RunReport``) or the fields each level of ``summary()`` carries.
"""
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ...toma_core.tiles import Slab

UNET = "unet"  # the group of every UNet level (a UNet level is told apart by its downsampling)


class Level(NamedTuple):
    """group: the block group ("unet"; a DiT's group, e.g. "two-stream", "joint", "video"). grid: the
    token grid, (h, w) or (frames, h, w). downsample: a UNet level's downsampling (1, 2, 4, 8). slab:
    (begin, end, extra) where the level is one rank's slab of the grid under sequence parallelism, its
    raster tokens [begin, end), merged keeping ``extra`` destinations more than the ratio's
    (toma_core.tiles.Slab).

    A named tuple, not a dataclass: levels (and the plan keys holding them) are made inside the model
    call, and under torch.compile what the traced code stores in the runtime must be something dynamo can
    rebuild after the graph (a tuple; a frozen dataclass made in the trace leaves the frame to eager)."""

    group: str
    grid: tuple[int, ...]
    downsample: int | None = None
    slab: tuple[int, int, int] | None = None

    @property
    def tokens(self) -> int:
        return math.prod(self.grid) if self.slab is None else self.slab[1] - self.slab[0]

    @property
    def shape(self):
        """What plans are built on (a strategy's ``grid``): the grid, or the Slab of it."""
        return self.grid if self.slab is None else Slab(self.grid, *self.slab)

    @property
    def size(self) -> str:
        """The grid in words: "32x32", "5x6x8"."""
        return "x".join(map(str, self.grid))

    @property
    def label(self) -> str:
        """"32x32 (1/1)" for a UNet level, "<group> <size>" for a block group, "<group> <size> tokens
        <begin>-<end>" for a slab of one."""
        if self.downsample is not None:
            return f"{self.size} (1/{self.downsample})"
        return f"{self.group} {self.size}" + ("" if self.slab is None else f" tokens {self.slab[0]}-{self.slab[1]}")

    def __str__(self) -> str:
        return self.label

    def fields(self) -> dict:
        """The level as JSON fields (the stats message's summary)."""
        return {"group": self.group, "grid": list(self.grid),
                **({} if self.downsample is None else {"downsample": self.downsample}),
                **({} if self.slab is None else {"slab": list(self.slab[:2])})}


def unet_level(h: int, w: int, downsample: int) -> Level:
    return Level(UNET, (h, w), downsample)


class PlanKey(NamedTuple):
    """One cached plan: its level, the block it belongs to (None where one plan serves the level: the
    placement has no plans per block), and the batch layout of the calls it serves (``batch_key``)."""

    level: Level
    block: object
    rows: tuple


def batch_key(x, transformer_options) -> tuple:
    """The batch layout of a block call, part of every plan key: plans are never shared between calls
    with other rows (cond and uncond batched together, or split when memory is short)."""
    return (x.shape[0], tuple(transformer_options.get("cond_or_uncond") or ()))


@dataclass
class LevelStats:
    """What a run merged at one level: its tokens before and after, the steps it merged at, and the
    records of the plans it built (in step order, for the merge map)."""

    tokens: int = 0
    merged_tokens: int = 0
    steps: set = field(default_factory=set)
    records: list = field(default_factory=list)


class LeftTo(NamedTuple):
    """The other node that took a level, and what it did, in words."""

    node: str
    why: str


@dataclass(frozen=True)
class RunReport:
    """What a runtime knows of its current (or last) run.

    method: the strategy's name. steps: the run's step count where the host gave its schedule (None
    otherwise); schedule: its sigmas; short_run: how the schedule adapted to a run that short, in words
    (None: it did not). levels: the merged levels' stats. plans: the cached plans by key.
    shared_destinations: (level, rows) -> the destinations the level's blocks share this step.
    left_to: levels another node took. nothing_merges: why nothing merges, in words. failed: the plans
    that could not be built (their blocks run unmerged). unmerged: reason -> block calls that ran unmerged
    although the node would merge them (``MergeRuntime.unmerged``). seconds: time per stage (``clock`` says which
    clock); wall_seconds: the run's wall time so far (None outside a run). caveats: what the patched model
    does otherwise than its node asks, in words (MergeRuntime.caveat). host_paced: where the host set the
    run's pace and merging stopped for the rest of the run (runtime.pace: the reason, the merged model calls
    before the stop, the model calls run unmerged after it), None where merging went on. rotation: the strength of rotating
    destinations (0: off); destinations_kept: the share of the destinations of the run's rebuilt plans that
    were destinations at the previous build of their key too (None: no plan rebuilt, rotation off, or plans
    without values, the cost model's). step_cache: the step cache found on the model this run sampled and the
    setting the node took beside it (runtime.step_caches.CacheStack.summary), None where there was none."""

    method: str
    steps: int | None
    schedule: tuple | None
    short_run: str | None
    levels: dict
    plans: dict
    shared_destinations: dict
    left_to: dict
    nothing_merges: tuple
    failed: frozenset
    unmerged: dict
    seconds: dict
    clock: str
    wall_seconds: float | None
    caveats: tuple = ()
    untimed: bool = False
    host_paced: dict | None = None
    rotation: float = 0.0
    destinations_kept: float | None = None
    step_cache: dict | None = None  # the step cache found on the sampled model, and ToMA's setting beside it

    def summary(self) -> dict:
        """The report as JSON (stats message, run listeners): levels by label, each with its fields, in
        the order they first merged in the run (a model's block order)."""
        return {
            "method": self.method,
            "levels": {level.label: {"tokens": s.tokens, "merged_tokens": s.merged_tokens, "steps": len(s.steps),
                                     **level.fields()}
                       for level, s in self.levels.items()},
            "nothing_merges": list(self.nothing_merges),
            "short_run": self.short_run,
            "left_to": {level.label: left._asdict() for level, left in self.left_to.items()},
            "unmerged": dict(self.unmerged),
            "seconds": self.seconds,
            "clock": self.clock,
            "wall_seconds": self.wall_seconds,
            "caveats": list(self.caveats),
            "untimed": self.untimed,
            "host_paced": None if self.host_paced is None else dict(self.host_paced),
            "rotation": {"strength": self.rotation, "destinations_kept": self.destinations_kept} if self.rotation
            else None,
            "step_cache": self.step_cache,
        }


def grid_in_words(grid) -> str:
    """(h, w) or (frames, h, w) -> "a 1x1 token grid (1 token)", "a 3-frame 4x4 token grid (48 tokens)"."""
    *frames, h, w = grid
    tokens = math.prod(grid)
    depth = f"{frames[0]}-frame " if frames else ""
    return f"a {depth}{h}x{w} token grid ({tokens} token{'s' if tokens != 1 else ''})"
