"""What ``/object_info`` says of a node, in a form where the V1 and the V3 schema compare equal when they
declare the same node: used by tests/test_v3_schema.py (in process) and tests/test_server_api.py (served).

The V3 schema serves a combo as ``["COMBO", {"options": [...], "multiselect": false, ...}]`` where V1 serves
``[[...], {...}]``, a STRING input with ``"multiline": false`` where V1 leaves it unsaid (the same single-line
widget), and a hidden input as ``["UNIQUE_ID"]`` where V1 serves ``"UNIQUE_ID"``; the front end and the server's
validation read both alike. Everything else (names, order, types, defaults, ranges, tooltips,
optional inputs, outputs, display name, category, description) must be the same.
"""
import importlib.util
import json

# the fields of a V1 node's /object_info entry the front end reads to draw and run a node
COMPARED = ("name", "display_name", "category", "description", "input", "input_order", "output", "output_name",
            "output_is_list", "output_tooltips", "output_node")


def host_has_v3_schema() -> bool:
    """Whether the ComfyUI in use has the V3 node schema, ``comfy_api.latest`` (July 2025 on), looked up here and
    not through the pack's own detection. ComfyUI must be imported (on sys.path)."""
    return (importlib.util.find_spec("comfy_api") is not None
            and importlib.util.find_spec("comfy_api.latest") is not None)


def canonical_input(spec) -> list:
    """A V1 or V3 input spec as V1 writes it."""
    kind, options = spec[0], dict(spec[1]) if len(spec) > 1 else {}
    if kind == "COMBO":
        kind = options.pop("options")
        if options.get("multiselect") is False:
            del options["multiselect"]
    if kind == "STRING" and options.get("multiline") is False:
        del options["multiline"]
    return [kind, options]


def canonical(info: dict) -> dict:
    """The COMPARED fields an /object_info entry has (JSON as served; the March-2024 server serves no
    input_order or output_tooltips), inputs as V1 writes them."""
    info = json.loads(json.dumps(info))
    inputs = {group: {name: canonical_input(spec) for name, spec in specs.items()}
              for group, specs in info["input"].items() if group != "hidden"}
    inputs["hidden"] = {name: kind if isinstance(kind, str) else kind[0]
                        for name, kind in info["input"].get("hidden", {}).items()}
    return {**{field: info[field] for field in COMPARED if field in info}, "input": inputs}


def v1_info(node_id: str, v1: type, display_name: str) -> dict:
    """The /object_info entry a V1 host serves for the V1 class ``v1`` (ComfyUI's server.node_info)."""
    spec = v1.INPUT_TYPES()
    return canonical({
        "name": node_id, "display_name": display_name, "category": v1.CATEGORY,
        "description": getattr(v1, "DESCRIPTION", ""), "input": spec,
        "input_order": {group: list(specs) for group, specs in spec.items()},
        "output": list(v1.RETURN_TYPES), "output_name": list(getattr(v1, "RETURN_NAMES", v1.RETURN_TYPES)),
        "output_is_list": list(getattr(v1, "OUTPUT_IS_LIST", [False] * len(v1.RETURN_TYPES))),
        "output_tooltips": list(v1.OUTPUT_TOOLTIPS), "output_node": getattr(v1, "OUTPUT_NODE", False)})
