"""Input checking shared by every node of the pack: a node's inputs checked against its own
``INPUT_TYPES()``, so a value from a script or the API that the UI would refuse gets a clear error naming
the input and what it allows, before anything is patched."""


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
