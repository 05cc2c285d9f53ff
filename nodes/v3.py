"""The V3 node schema (``comfy_api.latest``: ``io.ComfyNode``, ``ComfyExtension``) on hosts that have it, built
from each node's one declaration: its V1 class (INPUT_TYPES, RETURN_TYPES, FUNCTION, DESCRIPTION, ...).

A host without the schema (the pinned March-2024 ComfyUI, anything before July 2025) loads the V1 classes as they
are. On a host with it, ``extension`` makes an ``io.ComfyNode`` of every V1 class: the same node ID, display name,
inputs (types, defaults, ranges, tooltips, optional inputs, hidden ones), outputs, category and description, so
saved workflows load unchanged; its ``execute`` calls the V1 class's function, which checks the inputs and
patches, and wraps the result in ``io.NodeOutput``. A new node, or a new input on one, becomes V3 with no code
here.
"""
import inspect

try:
    from comfy_api.latest import ComfyExtension, io
except ImportError:  # a host before the V3 schema: the pack registers its V1 classes (see __init__.py)
    ComfyExtension = io = None

WIDGETS = {"INT": "Int", "FLOAT": "Float", "BOOLEAN": "Boolean", "STRING": "String"}
# V1 class attributes with a meaning ``node_class`` does not carry over (lists, change detection, validation,
# lazy inputs): a node that has one is refused when the pack loads, rather than served without it.
NOT_CARRIED = ("INPUT_IS_LIST", "OUTPUT_IS_LIST", "IS_CHANGED", "VALIDATE_INPUTS", "check_lazy_status",
               "NOT_IDEMPOTENT", "DEPRECATED")
# V1 class attributes that only help the front end find and label a node, and the V3 Schema fields that carry
# them where this host's schema has the field (search_aliases: v0.33.0 on; is_experimental: 2025 on); a schema
# without the field has nothing to show them with, so they are left out there.
HINTS = {"SEARCH_ALIASES": "search_aliases", "EXPERIMENTAL": "is_experimental"}


def schema_input(name: str, spec: tuple, optional: bool):
    """The V3 input of a V1 input spec ``(type, options)``. Options the V3 input class takes by the same name
    (default, min, max, step, tooltip, ...) are passed as such; any other goes through ``extra_dict``, which
    /object_info serves as it is, so the front end sees what the V1 spec said (hosts of 2025 have no
    ``extra_dict`` on widget inputs: there such an option fails the pack's import, naming it)."""
    kind, options = spec[0], dict(spec[1]) if len(spec) > 1 else {}
    if isinstance(kind, (list, tuple)):
        comfy_type, options["options"] = io.Combo, list(kind)
    else:
        comfy_type = getattr(io, WIDGETS[kind]) if kind in WIDGETS else io.Custom(kind)
    takes = inspect.signature(comfy_type.Input).parameters
    named = {key: value for key, value in options.items() if key in takes}
    extra = {key: value for key, value in options.items() if key not in takes}
    if extra and "extra_dict" not in takes:
        raise TypeError(f"input {name}: this ComfyUI's V3 {kind} input takes no {', '.join(sorted(extra))}")
    return comfy_type.Input(name, optional=optional, **named, **({"extra_dict": extra} if extra else {}))


def hints(v1: type) -> dict:
    """The V3 Schema arguments of ``v1``'s HINTS that this host's schema takes."""
    takes = inspect.signature(io.Schema).parameters
    return {field: getattr(v1, name) for name, field in HINTS.items() if hasattr(v1, name) and field in takes}


def node_class(node_id: str, v1: type, display_name: str | None) -> type:
    """The ``io.ComfyNode`` of the V1 class ``v1``, registered as ``node_id``."""
    refused = [name for name in NOT_CARRIED if hasattr(v1, name)]
    if refused:
        raise TypeError(f"{node_id}: the V3 schema is built from V1 declarations without {', '.join(refused)}; "
                        "carry it over in nodes/v3.py")

    def define_schema(cls):
        spec = v1.INPUT_TYPES()
        names = getattr(v1, "RETURN_NAMES", (None,) * len(v1.RETURN_TYPES))
        tooltips = getattr(v1, "OUTPUT_TOOLTIPS", (None,) * len(v1.RETURN_TYPES))
        return io.Schema(
            node_id=node_id, display_name=display_name, category=v1.CATEGORY,
            description=getattr(v1, "DESCRIPTION", ""),
            inputs=[schema_input(name, input_spec, group == "optional")
                    for group in ("required", "optional") for name, input_spec in spec.get(group, {}).items()],
            outputs=[io.Custom(kind).Output(display_name=name, tooltip=tooltip)
                     for kind, name, tooltip in zip(v1.RETURN_TYPES, names, tooltips)],
            hidden=[io.Hidden(kind) for kind in spec.get("hidden", {}).values()],
            is_output_node=getattr(v1, "OUTPUT_NODE", False), **hints(v1))

    def execute(cls, **inputs):
        # V1 gets hidden inputs as arguments named in its INPUT_TYPES; V3 holds them on cls.hidden by kind
        hidden = {name: getattr(cls.hidden, io.Hidden(kind).name)
                  for name, kind in v1.INPUT_TYPES().get("hidden", {}).items()}
        return io.NodeOutput(*getattr(v1(), v1.FUNCTION)(**inputs, **hidden))

    return type(v1.__name__, (io.ComfyNode,), {
        "__doc__": v1.__doc__, "__module__": v1.__module__, "v1_class": v1,
        "define_schema": classmethod(define_schema), "execute": classmethod(execute)})


def extension(mappings: dict, display_names: dict):
    """The pack's ``comfy_entrypoint``: a coroutine function giving the ComfyExtension whose nodes are the V3
    classes of the V1 ``mappings`` (built here, so a declaration V3 cannot serve fails the pack's import)."""
    node_list = [node_class(node_id, v1, display_names.get(node_id)) for node_id, v1 in mappings.items()]

    class ToMAExtension(ComfyExtension):
        async def get_node_list(self):
            return list(node_list)

    async def comfy_entrypoint():
        return ToMAExtension()

    return comfy_entrypoint
