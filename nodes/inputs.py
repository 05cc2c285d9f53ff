"""What the pack's node files share about inputs: the declarations more than one node takes (the MODEL,
ratio, window and reuse inputs, their defaults, the category), and input checking: a node's inputs checked
against its own ``INPUT_TYPES()``, so a value from a script or the API that the UI would refuse gets a clear
error naming the input and what it allows, before anything is patched."""
from . import placement

CATEGORY = "model_patches/token_merging"
# What users type into the node search for these nodes (SEARCH_ALIASES: V1, and V3 through nodes/v3.py): the
# patch nodes make sampling faster; the merge maps show what they merged.
SPEED_ALIASES = ("token merge", "token merging", "tome", "toma", "speed up", "faster sampling", "acceleration")
MAP_ALIASES = ("token merge", "token merge map", "merged tokens", "tome", "toma")

# Defaults chosen from the speed-vs-fidelity curves on the trained proxies (docs/benchmarks.md, "The defaults, and why").
AUTO_RATIO = -1.0  # the ratio input's "auto": the model kind's ratio (placement.PRESETS)
DEFAULT_RATIO = AUTO_RATIO
DEFAULT_WINDOW = 0  # auto: the model kind's window (placement.PRESETS)
DEFAULT_REUSE = 5
DEFAULT_TEMPORAL_WINDOW = 2  # docs/notebook.md, "Windows over video frames"


def float_input(default, low, high, step, tooltip):
    return ("FLOAT", {"default": default, "min": low, "max": high, "step": step, "tooltip": tooltip})


def int_input(default, low, high, tooltip):
    return ("INT", {"default": default, "min": low, "max": high, "tooltip": tooltip})


def per_kind(field: str) -> str:
    """"0.5 on image DiTs, 0.75 on ..." for the presets' ``field`` ("ratio", "window_size"), for tooltips."""
    return ", ".join(f"{value:g} on {kinds}" for value, kinds in placement.values_in_words(field))


MODEL_INPUT = ("MODEL", {"tooltip": "The diffusion model to patch. It is cloned; the input stays unchanged."})
RATIO_INPUT = float_input(DEFAULT_RATIO, AUTO_RATIO, 0.9, 0.05,
                          "Fraction of image tokens removed before attention. 0 = off (output identical to the "
                          "unpatched model); -1 = auto, the default: the ratio that goes with the model kind's "
                          f"placement ({per_kind('ratio')}; README: What to expect); higher saves more and costs "
                          "more of the picture.")
WINDOW_INPUT = int_input(DEFAULT_WINDOW, 0, 32,
                         "Side, in tokens, of the local square window inside which destinations are chosen and "
                         "tokens merged. Small windows keep merges local and selection cheap. 0 = auto: the "
                         f"model's default ({per_kind('window_size')}).")
REUSE_INPUT = int_input(DEFAULT_REUSE, 1, 100,
                        "Steps between destination recomputations; in between, the destinations are reused "
                        "(pattern reuse).")


def ratio_of(ratio: float, preset: placement.Preset) -> float:
    """The ratio input's value: -1 (auto) is the preset's ratio; other values below 0 are refused."""
    if ratio == AUTO_RATIO:
        return preset.ratio
    if ratio < 0:
        raise ValueError(f"ratio must be -1 (auto: the model kind's ratio) or between 0.0 and 0.9, got {ratio}")
    return ratio


def check_range(name: str, value, low, high):
    """Errors that name the input and its allowed range (ComfyUI validates the same ranges in the UI)."""
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value


def check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


def check_inputs(node_class, **values) -> None:
    """Check ``values`` against the node's own ``INPUT_TYPES()``: numbers inside [min, max], INT inputs
    whole numbers (a fractional value can come through the API or a script), BOOLEAN inputs True or False
    (a script's "false" or 1 would otherwise be truthy), combos among their choices. Errors name the input
    and what it allows."""
    spec = {**node_class.INPUT_TYPES().get("required", {}), **node_class.INPUT_TYPES().get("optional", {})}
    for name, value in values.items():
        kind, options = spec[name][0], (spec[name][1] if len(spec[name]) > 1 else {})
        if isinstance(kind, (list, tuple)):
            check_choice(name, value, kind)
        elif kind in ("INT", "FLOAT"):
            whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "INT" and not whole):
                what = "an integer" if kind == "INT" else "a number"
                raise ValueError(f"{name} must be {what} between {options['min']} and {options['max']}, "
                                 f"got {value!r}")
            check_range(name, value, options["min"], options["max"])
        elif kind == "BOOLEAN" and not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False (JSON true or false over the API), got {value!r}")
