"""Every shipped workflow (workflows/*.json) matches the node definitions a real server publishes.

A renamed or reordered input of our nodes (or of ComfyUI's) must break a test here, not a user's graph.
The API files (``*_api.json``, what ``POST /prompt`` takes) are checked input by input against
``/object_info``; the UI files (what the front end loads) are checked for widget counts and are converted
to API format with /object_info's input order, which must give exactly the shipped API twin. Every model
file a UI file loads comes with a download link, as in ComfyUI's own templates.
Runs against the pinned tree, and against current ComfyUI when COMFYUI_PATH points at it. The workflows of
models that only 2025 ComfyUI runs (Wan 2.2, Qwen-Image, Z-Image, Flux.2) are checked against a ComfyUI
that has their nodes (COMFYUI_PATH; Flux.2's need v0.3.75: tests/setup_newest.sh) and skipped, with the
reason, in a tree without them.
"""
import copy
import json

import pytest

from toma_bench import server

pytestmark = [pytest.mark.server, pytest.mark.comfy]

UI_FILES = sorted(p.name for p in server.WORKFLOWS.glob("*.json") if not p.name.endswith("_api.json"))
API_FILES = sorted(p.name for p in server.WORKFLOWS.glob("*_api.json"))

# Flux arrived in ComfyUI in August 2024: the pinned March-2024 host has no FluxGuidance or
# EmptySD3LatentImage, and its UNETLoader / DualCLIPLoader lack the weight_dtype / type inputs. In a tree
# without Flux these nodes are left out (everything else in the Flux graphs is still checked); a tree with
# Flux (current ComfyUI, COMFYUI_PATH) checks them like any other node.
FLUX_ERA_NODES = {"UNETLoader", "DualCLIPLoader", "FluxGuidance", "EmptySD3LatentImage"}
# kijai's ComfyUI-WanVideoWrapper is another custom node pack, which the test server does not have: its nodes in a
# shipped workflow (wanvideowrapper_*) are left out there, as Flux's in a tree without Flux; ours and ComfyUI's in
# the same graph are checked like any other. tests/test_wanvideowrapper_workflow.py checks them all, against a
# server that has the wrapper installed.
WRAPPER_PACK = ("WanVideo", "LoadWanVideo")
# Combo inputs whose choices are the user's model files: the test server has none of them.
FILE_INPUTS = {"ckpt_name", "unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name"}
# Combo inputs whose choices are the files of the user's input folder (LoadImage): the test server's is empty.
INPUT_FOLDER_INPUTS = {"image"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
# ComfyUI v0.33.0's combo whose choice brings inputs of its own (SaveVideo's format and codec): a widget whose
# value is one of its options' keys.
DYNAMIC_COMBO = "COMFY_DYNAMICCOMBO_V3"
# Where the front end's missing-models dialog downloads from, and the files it takes.
DOWNLOAD_SOURCES = ("https://huggingface.co/", "https://civitai.com/")
DOWNLOAD_SUFFIXES = (".safetensors", ".sft")


def clip_types(info: dict) -> list:
    """The text encoder types this tree's CLIPLoader offers."""
    return info.get("CLIPLoader", {}).get("input", {}).get("required", {}).get("type", [[]])[0]


# Workflows of models that arrived in ComfyUI in 2025: the model, and how a server shows that it runs it. The
# pinned March-2024 host has none of their nodes (WanImageToVideo, EmptyHunyuanLatentVideo, ModelSamplingSD3,
# ModelSamplingAuraFlow, CreateVideo, SaveVideo, ...): there they are skipped, not half-checked like Flux's.
LATE_MODELS = {
    "wan22_i2v_toma": ("Wan 2.2 (ComfyUI of July 2025 or later)", lambda info: "Wan22ImageToVideoLatent" in info),
    "wan22_t2v_toma": ("Wan 2.2 (ComfyUI of July 2025 or later)", lambda info: "Wan22ImageToVideoLatent" in info),
    "qwen_image_toma": ("Qwen-Image (ComfyUI of August 2025 or later)",
                        lambda info: "qwen_image" in clip_types(info)),
    # Z-Image loads through Lumina 2's nodes (2025); the model itself needs ComfyUI v0.3.75 (Nov 2025)
    "z_image_turbo_toma": ("Z-Image-Turbo (Lumina 2 loaders: ComfyUI of 2025; the model needs v0.3.75)",
                           lambda info: "lumina2" in clip_types(info)),
    "flux2_dev_toma": ("FLUX.2 [dev] (ComfyUI v0.3.75, Nov 2025, or later)", lambda info: "EmptyFlux2LatentImage" in info),
}


def skip_unless_served(name: str, info: dict) -> None:
    """Skip a late model's workflow (UI or API file) in a tree that does not run that model."""
    stem = name.removesuffix(".json").removesuffix("_api")
    if stem in LATE_MODELS and not LATE_MODELS[stem][1](info):
        model = LATE_MODELS[stem][0]
        lacking = sorted({node["class_type"] for node in server.load_workflow(stem + "_api.json").values()} - set(info))
        pytest.skip(f"{name}: {model}; this ComfyUI does not run it (it lacks {', '.join(lacking) or 'the model'})")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict:
    """What one server publishes: /object_info, and its model folders (None where it has no /models)."""
    with server.comfy_server(tmp_path_factory.mktemp("workflows-server")) as client:
        status, folders = client.request("GET", "/models")
        return {"object_info": client.object_info(), "model_folders": json.loads(folders) if status == 200 else None}


@pytest.fixture(scope="module")
def object_info(served):
    return served["object_info"]


def checked_types(info: dict) -> callable:
    """Predicate: is a node of this class checked against this tree (see FLUX_ERA_NODES, WRAPPER_PACK)? The
    checks below take another as ``checked`` (tests/test_wanvideowrapper_workflow.py checks every node)."""
    has_flux = "FluxGuidance" in info
    return lambda class_type: ((has_flux or class_type not in FLUX_ERA_NODES)
                               and (class_type in info or not class_type.startswith(WRAPPER_PACK)))


def declared_inputs(definition: dict) -> list[tuple[str, list]]:
    """(name, spec) of the required then optional inputs, in the order the front end lays out widgets."""
    spec = definition["input"]
    return [(name, value) for group in ("required", "optional") for name, value in spec.get(group, {}).items()]


def options(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def is_widget(spec: list) -> bool:
    return ((isinstance(spec[0], list) or spec[0] in WIDGET_TYPES | {DYNAMIC_COMBO})
            and not options(spec).get("forceInput"))


def widget_slots(name: str, spec: list) -> int:
    """Values a widget input takes in ``widgets_values``: seed-like INTs carry the UI-only
    control_after_generate value after them (legacy rule for inputs named seed/noise_seed, or the flag), and
    a combo with an upload button (LoadImage's image) the button's value ("image")."""
    if spec[0] == "INT" and (options(spec).get("control_after_generate") or name in ("seed", "noise_seed")):
        return 2
    if options(spec).get("image_upload"):
        return 2
    return 1


def value_problems(where: str, name: str, spec: list, value) -> list[str]:
    """Why ``value`` would not pass the server's validation of input ``name`` (empty list: it would)."""
    kind, opts = spec[0], options(spec)
    choices = kind if isinstance(kind, list) else opts.get("options") if kind == "COMBO" else None
    if kind == DYNAMIC_COMBO:
        choices = [option["key"] for option in opts.get("options", [])]
    if choices is not None:
        if name in FILE_INPUTS | INPUT_FOLDER_INPUTS or value in choices:
            return []
        return [f"{where}: {name}={value!r} is not one of {choices}"]
    expected = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool}.get(kind)
    if expected is None:
        return []
    if not isinstance(value, expected) or (kind != "BOOLEAN" and isinstance(value, bool)):
        return [f"{where}: {name}={value!r} is not a {kind}"]
    if kind in ("INT", "FLOAT") and not opts.get("min", value) <= value <= opts.get("max", value):
        return [f"{where}: {name}={value!r} outside [{opts.get('min')}, {opts.get('max')}]"]
    return []


def api_problems(graph: dict, info: dict, checked=None) -> list[str]:
    """Everything in an API-format graph that the server's /object_info says is wrong."""
    checked = checked or checked_types(info)
    problems = []
    for node_id, node in graph.items():
        class_type = node["class_type"]
        where = f"node {node_id} ({class_type})"
        if not checked(class_type):
            continue
        if class_type not in info:
            problems.append(f"{where}: unknown node type")
            continue
        declared = dict(declared_inputs(info[class_type]))
        required = info[class_type]["input"].get("required", {})
        problems += [f"{where}: required input {name!r} missing" for name in required if name not in node["inputs"]]
        for name, value in node["inputs"].items():
            if name not in declared:
                problems.append(f"{where}: no input named {name!r} (has {sorted(declared)})")
            elif isinstance(value, list):  # a link [source node id, output slot]
                problems += link_problems(where, name, declared[name], value, graph, info, checked)
            elif not is_widget(declared[name]):
                problems.append(f"{where}: {name!r} takes a {declared[name][0]} link, got the value {value!r}")
            else:
                problems += value_problems(where, name, declared[name], value)
    return problems


def link_problems(where, name, spec, link, graph, info, checked) -> list[str]:
    source_id, slot = link
    source = graph.get(source_id)
    if source is None:
        return [f"{where}: {name!r} links to missing node {source_id}"]
    if not checked(source["class_type"]) or source["class_type"] not in info:
        return []  # reported (or deliberately left out) at the source node itself
    outputs = info[source["class_type"]]["output"]
    if slot >= len(outputs):
        return [f"{where}: {name!r} links to output {slot} of {source['class_type']}, which has {len(outputs)}"]
    wanted = spec[0] if not isinstance(spec[0], list) else "COMBO"
    if outputs[slot] != wanted and "*" not in (outputs[slot], wanted):
        return [f"{where}: {name!r} takes {wanted}, linked to a {outputs[slot]} output"]
    return []


def ui_to_api(workflow: dict, info: dict, checked=None) -> tuple[dict, list[str]]:
    """Convert a UI workflow the way the front end does (widgets_values mapped to the widget inputs in
    /object_info order, links by slot); returns (API graph, problems found on the way)."""
    checked = checked or checked_types(info)
    links = {link[0]: link for link in workflow["links"]}
    graph, problems = {}, []
    for node in workflow["nodes"]:
        class_type, where = node["type"], f"node {node['id']} ({node['type']})"
        linked = {entry["name"]: entry["link"] for entry in node.get("inputs", []) if entry.get("link") is not None}
        inputs = {name: [str(links[link][1]), links[link][2]] for name, link in linked.items()}
        graph[str(node["id"])] = {"class_type": class_type, "inputs": inputs}
        if not checked(class_type) or class_type not in info:
            continue
        widgets = [(name, spec) for name, spec in declared_inputs(info[class_type]) if is_widget(spec)]
        values = list(node.get("widgets_values", []))
        expected = sum(widget_slots(name, spec) for name, spec in widgets)
        # A workflow saved by an older tree lacks the optional widgets a later tree added after its own (v0.33.0's
        # CreateVideo bit_depth): the front end keeps their defaults, the server takes them as absent.
        required = info[class_type]["input"].get("required", {})
        while widgets and len(values) < expected and widgets[-1][0] not in required:
            expected -= widget_slots(*widgets.pop())
        if len(values) != expected:
            problems.append(f"{where}: {len(values)} widgets_values, the widgets "
                            f"{[name for name, _ in widgets]} take {expected}")
            continue
        for name, spec in widgets:
            value = values.pop(0)
            if widget_slots(name, spec) == 2 and options(spec).get("image_upload"):
                button = values.pop(0)
                if button != "image":
                    problems.append(f"{where}: the upload button of {name!r} saved {button!r}, not 'image'")
            elif widget_slots(name, spec) == 2:
                control = values.pop(0)
                if control not in ("fixed", "increment", "decrement", "randomize"):
                    problems.append(f"{where}: control_after_generate of {name!r} is {control!r}")
            if name not in inputs:  # a widget converted to an input takes its link instead
                inputs[name] = value
    return graph, problems


def ui_link_problems(workflow: dict, info: dict, checked=None) -> list[str]:
    """Links table vs the nodes' own inputs/outputs lists and the output types of /object_info."""
    checked = checked or checked_types(info)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    problems = []
    for link_id, source, slot, target, target_slot, kind in workflow["links"]:
        where = f"link {link_id}"
        if source not in nodes or target not in nodes:
            problems.append(f"{where}: joins missing nodes {source} -> {target}")
            continue
        if link_id not in nodes[source]["outputs"][slot].get("links", []):
            problems.append(f"{where}: not listed on output {slot} of node {source}")
        if nodes[target]["inputs"][target_slot].get("link") != link_id:
            problems.append(f"{where}: not the link of input {target_slot} of node {target}")
        source_type = nodes[source]["type"]
        if checked(source_type) and source_type in info and info[source_type]["output"][slot] != kind:
            problems.append(f"{where}: typed {kind}, output {slot} of {source_type} is "
                            f"{info[source_type]['output'][slot]}")
    return problems


def comparable(graph: dict) -> dict:
    """class_type + inputs only (the _meta titles are not part of what the server runs)."""
    return {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in graph.items()}


def test_every_ui_workflow_has_an_api_twin():
    assert UI_FILES, "no workflows shipped"
    assert sorted(name[: -len(".json")] + "_api.json" for name in UI_FILES) == API_FILES


def test_late_models_name_shipped_workflows():
    assert set(LATE_MODELS) <= {name[: -len(".json")] for name in UI_FILES}


def test_every_node_of_the_pack_is_used_in_a_shipped_workflow(pack):
    in_api = {node["class_type"] for name in API_FILES for node in server.load_workflow(name).values()}
    in_ui = {node["type"] for name in UI_FILES for node in server.load_workflow(name)["nodes"]}

    assert set(pack.nodes.NODE_CLASS_MAPPINGS) - in_api == set()
    assert set(pack.nodes.NODE_CLASS_MAPPINGS) - in_ui == set()


@pytest.mark.parametrize("name", API_FILES)
def test_api_workflow_matches_object_info(object_info, name):
    skip_unless_served(name, object_info)
    graph = server.load_workflow(name)

    problems = api_problems(graph, object_info)

    assert problems == []
    assert any(object_info.get(node["class_type"], {}).get("output_node") for node in graph.values()), \
        "no output node"


@pytest.mark.parametrize("name", UI_FILES)
def test_ui_workflow_matches_object_info_and_its_api_twin(object_info, name):
    skip_unless_served(name, object_info)
    workflow = server.load_workflow(name)
    twin = server.load_workflow(name[: -len(".json")] + "_api.json")

    converted, problems = ui_to_api(workflow, object_info)
    problems += ui_link_problems(workflow, object_info)

    assert workflow["version"] == 0.4
    assert problems == []
    checked = checked_types(object_info)
    kept = {node_id for node_id, node in twin.items() if checked(node["class_type"])}
    assert {k: v for k, v in comparable(converted).items() if k in kept} == \
           {k: v for k, v in comparable(twin).items() if k in kept}
    assert set(converted) == set(twin)


def model_link_problems(workflow: dict, info: dict, model_folders: list | None) -> list[str]:
    """Loader nodes whose model files have no download link the front end offers: a ``properties.models``
    entry {name, url, directory} per file widget value, as ComfyUI's templates carry them."""
    converted, _ = ui_to_api(workflow, info)
    checked = checked_types(info)
    problems = []
    for node in workflow["nodes"]:
        if not checked(node["type"]) or node["type"] not in info:
            continue  # its widgets are not mapped to inputs in this tree (see FLUX_ERA_NODES)
        where = f"node {node['id']} ({node['type']})"
        files = {value for name, value in converted[str(node["id"])]["inputs"].items() if name in FILE_INPUTS}
        links = {entry.get("name"): entry for entry in node.get("properties", {}).get("models", [])}
        problems += [f"{where}: no download link for {name}" for name in sorted(files - set(links))]
        problems += [f"{where}: link for {name}, which it does not load" for name in sorted(set(links) - files)]
        for name, entry in links.items():
            if not entry.get("url", "").startswith(DOWNLOAD_SOURCES) or not name.endswith(DOWNLOAD_SUFFIXES):
                problems.append(f"{where}: the front end does not download {entry}")
            if model_folders is not None and entry.get("directory") not in model_folders:
                problems.append(f"{where}: {name} goes to {entry.get('directory')!r}, not a model folder")
    return problems


@pytest.mark.parametrize("name", UI_FILES)
def test_ui_workflow_links_the_model_files_it_loads(served, name):
    skip_unless_served(name, served["object_info"])
    workflow = server.load_workflow(name)

    problems = model_link_problems(workflow, served["object_info"], served["model_folders"])

    assert problems == []
    assert any(node.get("properties", {}).get("models") for node in workflow["nodes"])


def test_checks_catch_a_renamed_input_and_a_missing_widget_value(object_info):
    """The checks above can fail: a renamed input and a dropped widget value are both reported."""
    graph = server.load_workflow("sd15_toma_api.json")
    patch = next(node for node in graph.values() if node["class_type"] == "ToMAPatchModel")
    patch["inputs"]["window"] = patch["inputs"].pop("window_size")
    workflow = copy.deepcopy(server.load_workflow("sd15_toma.json"))
    ui_patch = next(node for node in workflow["nodes"] if node["type"] == "ToMAPatchModel")
    ui_patch["widgets_values"].pop()

    api_report = api_problems(graph, object_info)
    _, ui_report = ui_to_api(workflow, object_info)

    assert any("'window'" in p for p in api_report) and any("'window_size' missing" in p for p in api_report), \
        json.dumps(api_report)
    assert any("ToMAPatchModel" in p and "widgets_values" in p for p in ui_report), json.dumps(ui_report)
