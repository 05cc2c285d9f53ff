"""ToMA Merge Map: a picture of the merge plans a patched model really used in its last sampling run.

Every merge group (a kept token and the tokens merged into it) gets its own colour (a token nothing was
merged into stays grey), kept tokens carry a dark dot (where destinations rotate, a white one for a token
not kept by the level's plan before: the tokens that rotated in), and the borders of the windows the method merges
inside (ToMA's windows, ToMeSD/CA-ToMe strides) are black lines. Nothing is recomputed: the runtime
recorded the plans while sampling (see ``runtime.records``), and the node reads them through the runtimes
the patch nodes stored in the MODEL.
"""
import math

import torch
import torch.nn.functional as F

from .inputs import CATEGORY, MAP_ALIASES, check_inputs
from .runtime import runtimes_of
from .runtime.records import PlanRecord

PIXELS_PER_LATENT = 8  # the map has the size of the decoded image of the latent
GOLDEN = (math.sqrt(5) - 1) / 2
SINGLE_GREY = 0.8  # groups of one token (nothing merged into it) stay grey, so merges stand out
ROTATED_IN = 1.0  # the dot of a kept token the level's plan before did not keep (rotating destinations): white
BORDER = 0.0  # window borders: black, visible on grey, colours and pictures alike


def group_colours(groups: torch.Tensor) -> torch.Tensor:
    """(...,) group ids -> (..., 3) RGB in [0, 1]. Hues step by the golden ratio, so ids next to each
    other (neighbouring kept tokens) get far-apart hues; brightness cycles in three steps on top."""
    g = groups.to(torch.float64)
    hue = torch.remainder(g * GOLDEN, 1.0) * 6.0
    value = torch.tensor([0.95, 0.8, 0.65], dtype=torch.float64)[groups.long() % 3]
    saturation = 0.65
    # HSV -> RGB: each channel is value * (1 - s * clamp(min(k, 4 - k), 0, 1)), k = (n + hue) mod 6
    channels = [value * (1 - saturation * torch.clamp(torch.minimum(k, 4 - k), 0, 1))
                for k in (torch.remainder(n + hue, 6.0) for n in (5.0, 3.0, 1.0))]
    return torch.stack(channels, dim=-1).float()


def pixel_tokens(pixels: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``pixels`` pixels along one axis: (token index, whether the pixel lies in the middle
    half of its token), with tokens spread evenly over the pixels."""
    centre = (torch.arange(pixels, dtype=torch.float64) + 0.5) * tokens / pixels
    index = centre.floor().long().clamp(max=tokens - 1)
    inside = centre - index
    return index, (inside >= 0.25) & (inside < 0.75)


def window_borders(index: torch.Tensor, window: int) -> torch.Tensor:
    """(P,) bool: pixels where a new window of ``window`` tokens starts (not at the image edge)."""
    win = index // window
    border = torch.zeros_like(index, dtype=torch.bool)
    border[1:] = win[1:] != win[:-1]
    return border


def render_record(record: PlanRecord, height: int, width: int, image: torch.Tensor | None = None,
                  opacity: float = 1.0) -> torch.Tensor:
    """(height, width, 3) float in [0, 1]: the merge groups of ``record`` stretched over the picture;
    groups of one token are grey. A video's record shows its first latent frame (its tokens lead the
    raster; a group kept in a later frame still has its colour). Kept tokens get a dark dot; where the
    record rotates destinations (its ``previous`` record), those that were not kept before a white one.

    image: optional (H', W', 3) picture shown under the groups (resized), the groups at ``opacity``.
    """
    rows, row_centre = pixel_tokens(height, record.h)
    cols, col_centre = pixel_tokens(width, record.w)
    token = rows[:, None] * record.w + cols[None, :]  # (height, width) raster index
    groups = record.groups.long()
    picture = group_colours(groups[token])
    alone = torch.bincount(groups, minlength=groups.numel()) == 1  # kept tokens nothing was merged into
    picture[alone[groups[token]]] = SINGLE_GREY
    kept = torch.zeros(groups.numel(), dtype=torch.bool)
    kept[record.kept.long()] = True
    centre = row_centre[:, None] & col_centre[None, :]
    if record.previous is not None:
        before = torch.zeros_like(kept)
        before[record.previous.kept.long()] = True
        picture[kept[token] & ~before[token] & centre] = ROTATED_IN
        kept &= before
    picture[kept[token] & centre] *= 0.3
    if image is not None:
        under = F.interpolate(image.permute(2, 0, 1)[None].float(), size=(height, width), mode="bilinear",
                              align_corners=False)[0].permute(1, 2, 0).clamp(0, 1)
        picture = opacity * picture + (1 - opacity) * under
    if record.window is not None:
        border = window_borders(rows, record.window[0])[:, None] | window_borders(cols, record.window[1])[None, :]
        picture[border] = BORDER
    return picture


def stack_levels(runtimes) -> dict:
    """Level -> LevelStats of the levels with recorded plans of a stack of token merge nodes (``runtimes``,
    nearest the sampler first): each level from the nearest node that merged it (nodes further away leave
    such levels alone)."""
    levels = {}
    for runtime in runtimes:
        for level, stats in runtime.report().levels.items():
            if stats.records and level not in levels:
                levels[level] = stats
    return levels


def merged_levels(levels: dict) -> list:
    """The Levels of ``levels`` (Level -> LevelStats) with recorded plans, most tokens first; equal grids
    (Flux's two block groups) in the order they first merged."""
    return sorted((level for level, stats in levels.items() if stats.records), key=lambda level: level.tokens,
                  reverse=True)


def step_ranges(steps) -> str:
    """{0, 1, 2, 5} -> '0-2, 5'."""
    steps, parts = sorted(steps), []
    for s in steps:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def choose_record(levels: dict, level: int, step: int) -> tuple:
    """(the Level, the record of the plan used at ``step`` at the ``level``-th of ``levels`` (Level ->
    LevelStats, merged_levels' order)), or a ValueError saying what there is to choose from."""
    names = merged_levels(levels)
    if not names:
        raise ValueError("the patched model has no recorded merge plans: run a sampler with this MODEL first "
                         "(connect the LATENT it produced), and check that some step merged (start/end percent, "
                         "levels)")
    if not 0 <= level < len(names):
        listed = "; ".join(f"{i} = {n}" for i, n in enumerate(names))
        raise ValueError(f"level must be between 0 and {len(names) - 1} for this run ({listed}), got {level}")
    name = names[level]
    records, merged = levels[name].records, levels[name].steps
    if step == -1:
        step = max(merged)
    if step not in merged:
        raise ValueError(f"step {step} was not merged at level {name}; merged steps: {step_ranges(merged)} "
                         "(-1 = the last one)")
    in_use = [r for r in records if r.step <= step]
    if not in_use:  # recording failed (logged while sampling)
        raise ValueError(f"step: no plan was recorded at level {name} up to step {step}; see the log")
    return name, in_use[-1]


def latent_size(latent: dict) -> tuple[int, int]:
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if samples is None or samples.dim() < 4:
        raise ValueError("latent must be a LATENT (a dict with 'samples' of shape (B, C, H, W)), as a "
                         "KSampler outputs it")
    return int(samples.shape[-2]), int(samples.shape[-1])


def check_grid_matches(record: PlanRecord, name, h: int, w: int):
    """The plans must come from a run on this latent's shape (token grid = latent / downsample, rounded up)."""
    if abs(record.h * w - record.w * h) > max(h, w):
        raise ValueError(f"latent: the recorded plans of level {name} are for a {record.h}x{record.w} token grid, "
                         f"which does not fit a {h}x{w} latent; connect the LATENT sampled with this MODEL")


class ToMAMergeMap:
    DESCRIPTION = ("Shows which tokens ToMA (or ToMeSD / CA-ToMe) merged in the last sampling run of the "
                   "connected model: each merge group (a kept token and the tokens merged into it) has its "
                   "own colour (grey: nothing was merged into the token), kept tokens carry a dark dot (with "
                   "rotation on, a white one where the plan before did not keep the token), "
                   "window borders are black; for a video, its first latent frame. Reads the plans recorded "
                   "while sampling; nothing is recomputed.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    SEARCH_ALIASES = list(MAP_ALIASES)
    OUTPUT_TOOLTIPS = ("The merge map at the decoded image's size (latent x8), optionally over the image.",)
    FUNCTION = "draw"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "The MODEL output of a ToMA / ToMeSD / CA-ToMe node, the same one "
                                               "the sampler used."}),
                "latent": ("LATENT", {"tooltip": "The LATENT that sampler produced: sets the picture's size and "
                                                 "makes this node run after sampling."}),
                "level": ("INT", {"default": 0, "min": 0, "max": 15, "tooltip": "Which group of merged "
                                  "blocks to show, largest token grid first: UNet 0 = the highest-resolution "
                                  "merged level (1/1 on SD1.x, 1/2 on SDXL), 1 = the next smaller; Flux 0 = "
                                  "two-stream (its double) blocks, 1 = joint (its single) blocks; SD3 0 = "
                                  "two-stream (its joint) blocks; video DiTs 0 = video blocks."}),
                "step": ("INT", {"default": -1, "min": -1, "max": 10000, "tooltip": "Sampling step (0 = first) "
                                 "whose plan to show; -1 = the last merged step. Steps that did not merge "
                                 "raise an error listing those that did."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "Optional picture (e.g. the decoded result) drawn under the "
                                               "map; it is resized to the map's size. First image of a batch."}),
                "opacity": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.05, "tooltip":
                                      "Opacity of the merge groups over the image (1 = groups only)."}),
            },
        }

    def runtimes(self, model) -> list:
        """The runtimes of the token merge nodes on ``model``, nearest the sampler first."""
        return runtimes_of(model)

    def draw(self, model, latent, level=0, step=-1, image=None, opacity=0.5):
        check_inputs(ToMAMergeMap, level=level, step=step, opacity=opacity)
        levels = stack_levels(self.runtimes(model))
        h, w = latent_size(latent)
        name, record = choose_record(levels, level, step)
        check_grid_matches(record, name, h, w)
        under = None if image is None else image[0]
        picture = render_record(record, h * PIXELS_PER_LATENT, w * PIXELS_PER_LATENT, under,
                                opacity if image is not None else 1.0)
        return (picture[None],)


NODE_CLASS_MAPPINGS = {"ToMAMergeMap": ToMAMergeMap}
NODE_DISPLAY_NAME_MAPPINGS = {"ToMAMergeMap": "ToMA Merge Map"}
