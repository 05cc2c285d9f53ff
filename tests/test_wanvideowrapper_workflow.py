"""The shipped workflow of kijai's ComfyUI-WanVideoWrapper (workflows/wanvideowrapper_t2v_toma.json and its API twin)
in a real ComfyUI server that has the wrapper installed as a custom node pack, as a user has it, and in that
server's own front end: every node type is known, every node of the graph (the wrapper's, ours, ComfyUI's) matches
/object_info input by input, and the front end loads the UI file with no node missing, no error naming its nodes,
and makes exactly the API twin of it.

tests/test_server_workflows.py and tests/test_browser_stats.py check the same files against a server without the
wrapper (its nodes left out). Here one server per module runs with the wrapper's code at the HEAD of a 2026 mirror
(toma_bench/pack_source.py: kijai's code to 2026-05, else of 2026-02-01) extracted into its custom_nodes folder,
and, for the loaders' file lists, an empty file for each model file the workflow links to download, in the folder
the link names. Skipped, with the reason, where no such mirror or a test-only requirement of the wrapper is here
(tests/requirements-wanvideowrapper.txt), and in the pinned March-2024 tree, which cannot load the wrapper's 2026
code (it imports comfy.model_patcher.get_key_weight and other APIs of 2025): set COMFYUI_PATH (tests/setup_2026.sh
makes .comfyui-2026; ComfyUI v0.3.64 loads it too).
"""
import copy
import json
import re

import pytest
import test_browser_stats
from test_browser_stats import ARTIFACTS, CHROMIUM, MISSING_NODE_TYPES, open_front_end
from test_server_workflows import WRAPPER_PACK, api_problems, comparable, ui_link_problems, ui_to_api

from toma_bench import comfy_host, pack_source, server
from toma_bench import wanvideo_wrapper as ww

pytestmark = [pytest.mark.server, pytest.mark.comfy]
browser = test_browser_stats.browser  # its fixture: one headless Chromium for this module

UI_FILE, API_FILE = "wanvideowrapper_t2v_toma.json", "wanvideowrapper_t2v_toma_api.json"
MIRRORS_2026 = ("wanvideowrapper", "wanvideowrapper-2026-02")  # pack_source.PACKS, the first one here is used
OURS = {"ToMAWanVideoWrapper", "ToMAMergeMapWanVideoWrapper"}
RENAMED = "WanVideoSamplerRenamed"  # what the checks must report when a node type of the workflow is renamed


def every_node(class_type: str) -> bool:
    """``checked`` for the checks of test_server_workflows: no node is left out here."""
    return True


def wrapper_mirror() -> str:
    """The first 2026 mirror of the wrapper that is here (with the wrapper's test-only requirements); else skip."""
    reasons = []
    for name in MIRRORS_2026:
        reason = ww.missing(name)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    pytest.skip(f"no 2026 code of kijai's ComfyUI-WanVideoWrapper to install: {'; '.join(reasons)}")


def placeholder_models(workflow: dict, folder) -> dict:
    """An empty file for each model file the UI ``workflow`` links (properties.models: name, url, directory), in
    ``folder``/<directory>; {directory: its folder} for comfy_server's ``models``. The loaders' file lists then
    hold exactly these names, so a file name or folder the loader does not read fails the checks."""
    kinds = {}
    for node in workflow["nodes"]:
        for model in node.get("properties", {}).get("models", []):
            kinds[model["directory"]] = folder / model["directory"]
            kinds[model["directory"]].mkdir(parents=True, exist_ok=True)
            (kinds[model["directory"]] / model["name"]).touch()
    return kinds


@pytest.fixture(scope="module")
def wrapper_server(tmp_path_factory):
    """(ComfyClient, /object_info) of one server with our pack, the wrapper and placeholder model files, serving
    the tree's own front end."""
    if not comfy_host.is_current_comfy():
        pytest.skip("the pinned March-2024 ComfyUI cannot load the 2026 code of kijai's ComfyUI-WanVideoWrapper (it "
                    "imports comfy.model_patcher.get_key_weight and other APIs of 2025): set COMFYUI_PATH, e.g. to the "
                    ".comfyui-2026 of tests/setup_2026.sh")
    name = wrapper_mirror()
    workdir = tmp_path_factory.mktemp("wanvideowrapper-server")
    pack_source.extract(name, workdir / "custom_nodes" / ww.FOLDER_NAME)
    models = placeholder_models(server.load_workflow(UI_FILE), workdir / "models")
    with server.comfy_server(workdir, models=models, frontend=True) as client:
        client.request("POST", "/settings/Comfy.TutorialCompleted", True)  # no template picker over the canvas
        yield client, client.object_info()


def import_report(client) -> str:
    """What the server's log says about loading the wrapper (its import failure and traceback, if any)."""
    lines = client.log.read_text(errors="replace").splitlines()
    keep = [i for i, line in enumerate(lines) if ww.FOLDER_NAME in line or "WanVideoWrapper" in line
            or line.startswith("Traceback")]
    shown = sorted({j for i in keep for j in range(i, min(i + 12, len(lines)))})
    return f"{client.log}:\n" + "\n".join(lines[j] for j in shown)


def workflow_problems(ui: dict, api: dict, info: dict) -> list[str]:
    """Everything /object_info says is wrong with the UI file ``ui`` and its API twin ``api``, every node checked:
    unknown node types, inputs of the API graph, widgets and links of the UI graph, and the API graph the UI
    graph converts to against the twin."""
    types = {node["type"] for node in ui["nodes"]} | {node["class_type"] for node in api.values()}
    problems = [f"unknown node type {name}" for name in sorted(types - set(info))]
    problems += api_problems(api, info, every_node)
    converted, found = ui_to_api(ui, info, every_node)
    problems += found + ui_link_problems(ui, info, every_node)
    if comparable(converted) != comparable(api):
        problems.append(f"{UI_FILE} converts to another graph than {API_FILE}: "
                        f"{json.dumps(comparable(converted), sort_keys=True)[:3000]}")
    return problems


def renamed(ui: dict, api: dict) -> tuple[dict, dict]:
    """Copies of both files with their WanVideoSampler renamed RENAMED."""
    ui, api = copy.deepcopy(ui), copy.deepcopy(api)
    for node in ui["nodes"]:
        node["type"] = RENAMED if node["type"] == "WanVideoSampler" else node["type"]
    for node in api.values():
        node["class_type"] = RENAMED if node["class_type"] == "WanVideoSampler" else node["class_type"]
    return ui, api


def test_wrapper_workflow_matches_object_info_of_a_server_with_the_wrapper(wrapper_server):
    client, info = wrapper_server
    ui, api = server.load_workflow(UI_FILE), server.load_workflow(API_FILE)
    types = {node["type"] for node in ui["nodes"]}
    wrapper_types = {name for name in types if name.startswith(WRAPPER_PACK)}

    assert wrapper_types and OURS <= types, sorted(types)
    assert sorted(wrapper_types - set(info)) == [], f"the wrapper's nodes are not served; {import_report(client)}"
    assert {info[name]["python_module"] for name in wrapper_types} == {f"custom_nodes.{ww.FOLDER_NAME}"}
    assert {info[name]["python_module"] for name in OURS} == {f"custom_nodes.{comfy_host.PACK_DIRNAME}"}
    assert workflow_problems(ui, api, info) == []
    assert any(info[node["class_type"]].get("output_node") for node in api.values()), "no output node"


def test_checks_catch_a_renamed_wrapper_node_and_input(wrapper_server):
    """The checks above can fail: a renamed node type of the wrapper, and a renamed input of one of its nodes."""
    _, info = wrapper_server
    ui, api = renamed(server.load_workflow(UI_FILE), server.load_workflow(API_FILE))
    decode = next(node for node in api.values() if node["class_type"] == "WanVideoDecode")
    decode["inputs"]["tile_w"] = decode["inputs"].pop("tile_x")

    problems = workflow_problems(ui, api, info)

    assert f"unknown node type {RENAMED}" in problems, problems
    assert any("(WanVideoDecode): no input named 'tile_w'" in p for p in problems), problems
    assert any("(WanVideoDecode): required input 'tile_x' missing" in p for p in problems), problems


# The API graph the front end makes of the loaded workflow (what it queues), and the node types of its graph.
FRONT_END_PROMPT = """
async () => {
  const { output } = await window.app.graphToPrompt();
  return { output, types: window.app.graph._nodes.map((n) => n.type) };
}
"""


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Chromium is not installed at {CHROMIUM} (CI installs it: "
                    "apt-get install -y chromium chromium-driver)")
def test_front_end_loads_the_wrapper_workflow(wrapper_server, browser):
    client, _ = wrapper_server
    ui, api = server.load_workflow(UI_FILE), server.load_workflow(API_FILE)
    renamed_ui, _ = renamed(ui, api)
    ARTIFACTS.mkdir(exist_ok=True)
    page, problems = open_front_end(browser, client)
    try:
        page.evaluate("(w) => window.app.loadGraphData(w)", ui)
        missing = page.evaluate(MISSING_NODE_TYPES, ui)
        missing_renamed = page.evaluate(MISSING_NODE_TYPES, renamed_ui)
        page.wait_for_timeout(1000)  # a few frames, and what the front end does after loading
        made = page.evaluate(FRONT_END_PROMPT)
        page.screenshot(path=str(ARTIFACTS / "browser_wanvideowrapper.png"))
    finally:
        page.close()
        (ARTIFACTS / "browser_console_wanvideowrapper.txt").write_text("\n".join(problems) + "\n")
    names = {node["type"] for node in ui["nodes"]} | {"toma"}
    naming_ours = [p for p in problems if re.search("|".join(map(re.escape, names)), p, re.IGNORECASE)]

    assert missing == [], f"node types missing in the front end: {missing}; {import_report(client)}"
    assert missing_renamed == [RENAMED]  # the check above can fail
    assert sorted(made["types"]) == sorted(node["type"] for node in ui["nodes"])
    assert comparable(made["output"]) == comparable(api)
    assert naming_ours == [], "\n".join(problems)
