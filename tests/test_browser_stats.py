"""The front end, in a real headless Chromium: our extension loads without errors, the shipped workflows
load with no missing node and offer to download their models, the help page of each node opens without
an error, and after a queued run the ToMA node shows its live stats line (classic canvas and Nodes 2.0).

Front ends: the pinned host serves its bundled front end (March 2024); current ComfyUI (COMFYUI_PATH)
serves its installed comfyui-frontend-package (1.27.10 pinned by ComfyUI of October 2025) and, through
``--front-end-root``, the newest one, installed here from the package index into ``.cache/`` (skipped
when it cannot be installed). Screenshots are saved under test-artifacts/. Skipped only when Chromium
is not installed (CI installs it).
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toma_bench import comfy_host, models
from toma_bench.server import comfy_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = comfy_host.REPO / "test-artifacts"
WORKFLOW = Path(__file__).resolve().parent / "browser_sd15_merge_map.json"
CHECKPOINT = "toma_test_sd15.safetensors"  # the name the workflow's loader asks for
TOMA_NODE, SAMPLER_NODE, PREVIEW_NODE = 2, 6, 8  # node ids in WORKFLOW
LATENT_HW = (12, 16)  # WORKFLOW's EmptyLatentImage is 128x96 pixels
SAMPLER_STEPS = 2  # WORKFLOW's KSampler steps
STATS_LINE = re.compile(r"^(\d+)x(\d+) \(1/(\d+)\): (\d+) -> (\d+) tokens, (\d+) steps merged$")
TIME_LINE = re.compile(r"^select [\d.]+% · merge [\d.]+% · unmerge [\d.]+% of [\d.]+ s sampling$")
TINY_SD15 = {"channel_mult": [1, 2], "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
             "transformer_depth_output": [1, 1, 1, 1]}
NEWEST_FRONT_END = "1.58.1"  # comfyui-frontend-package version tested next to the tree's own

pytestmark = [
    pytest.mark.browser,
    pytest.mark.server,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Chromium is not installed at {CHROMIUM} (CI installs it: "
                       "apt-get install -y chromium chromium-driver)"),
]

# Records every string drawn on a canvas: where it was drawn (in the coordinates of the caller, node-local
# inside onDrawForeground and widget drawing) and the span [left, right] it covers.
SPY_FILL_TEXT = """
window.__drawnTexts = new Map();
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
  if (typeof text === "string") {
    const width = this.measureText(text).width;
    const left = this.textAlign === "right" || this.textAlign === "end" ? x - width
      : this.textAlign === "center" ? x - width / 2 : x;
    window.__drawnTexts.set(text, { y, left, right: left + width });
  }
  return fillText.call(this, text, x, y, ...rest);
};
"""

PREVIEW_SHOWN = """
(id) => { const imgs = window.app.graph.getNodeById(id).imgs; return Boolean(imgs && imgs.length && imgs[0].complete); }
"""

MISSING_NODE_TYPES = """
(workflow) => workflow.nodes.map((n) => n.type).filter((t) => !(t in LiteGraph.registered_node_types))
"""

# The text a user sees of a node in the DOM (Nodes 2.0: the node element; classic canvas of a current
# front end: the DOM widgets shown over the canvas, WORKFLOW has no other), or null when there is none.
NODE_DOM_TEXT = """
(id) => {
  const element = document.querySelector(`.lg-node[data-node-id="${id}"]`);
  if (element) return element.innerText;
  const shown = [...document.querySelectorAll('.dom-widget')].filter((e) => e.getClientRects().length > 0);
  return shown.length ? shown.map((e) => e.innerText).join("\\n") : null;
}
"""

PINIA = "document.querySelector('#vue-app')?.__vue_app__?.config.globalProperties.$pinia"  # none in 2024

# Opens the help page of a node type as the node library does, and returns what the page shows.
OPEN_HELP = f"""
async (name) => {{
  const pinia = {PINIA};
  const commands = window.app.extensionManager.command;
  if (!document.querySelector('.node-lib-node-container, .p-tree, .node-help-content')) {{
    await commands.execute('Workspace.ToggleSidebarTab.node-library');
  }}
  const help = pinia._s.get('nodeHelp');
  const nodeDef = pinia._s.get('nodeDef').nodeDefsByName[name];
  help.closeHelp();
  await new Promise((r) => setTimeout(r, 50));
  help.openHelp(nodeDef);
}}
"""

# Adds a node of a type at the front end's default size on an empty canvas; the checkpoints value.
ADD_NODE = """
(type) => {
  window.app.graph.clear();
  const node = LiteGraph.createNode(type);
  node.pos = [80, 80];
  window.app.graph.add(node);
  window.app.canvas.ds.offset = [0, 0];
  window.app.canvas.ds.scale = 1;
  window.app.canvas.setDirty(true, true);
  return node.widgets.find((w) => w.name === "checkpoints").value;
}
"""

# What the front end offers to download for a loaded workflow: {file name: why not, or "" when offered}.
# Front ends up to 1.2x list the files in a missing-models dialog, newer ones keep them in a store that
# their side panel shows.
MISSING_MODELS_OFFERED = f"""
() => {{
  const offered = {{}};
  for (const dialog of document.querySelectorAll('.p-dialog')) {{
    for (const item of dialog.querySelectorAll('.p-listbox-option, li')) {{
      const match = item.innerText.match(/[\\w.-]+ \\/ ([\\w.-]+\\.safetensors)/);
      const refused = /not allowed|Invalid directory|Only allowed/.test(item.innerText);
      if (match) offered[match[1]] = refused ? item.innerText : "";
    }}
  }}
  const store = {PINIA}?._s.get('missingModel');
  for (const model of store?.missingModelCandidates ?? []) {{
    offered[model.name] = String(model.url ?? "").startsWith("https://") ? "" : JSON.stringify(model);
  }}
  return offered;
}}
"""


@pytest.fixture(scope="module")
def checkpoints(pack, tmp_path_factory):
    """A folder with a random-weight SD1.5-shaped checkpoint (UNet only) named as WORKFLOW expects."""
    folder = tmp_path_factory.mktemp("checkpoints")
    models.save_sd15_checkpoint(folder / CHECKPOINT, seed=0, config=dict(models.SD15_SMALL, **TINY_SD15))
    return folder


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def newest_front_end() -> Path:
    """The static folder of comfyui-frontend-package NEWEST_FRONT_END, installed once into .cache/."""
    target = comfy_host.REPO / ".cache" / f"comfyui-frontend-package-{NEWEST_FRONT_END}"
    static = target / "comfyui_frontend_package" / "static"
    if not (static / "index.html").is_file():
        install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                                  f"comfyui-frontend-package=={NEWEST_FRONT_END}"], capture_output=True, text=True)
        if install.returncode != 0 or not (static / "index.html").is_file():
            pytest.skip(f"comfyui-frontend-package=={NEWEST_FRONT_END} could not be installed: {install.stderr[-500:]}")
    return static


@pytest.fixture(scope="module", params=["tree", NEWEST_FRONT_END])
def front_end(request, checkpoints, tmp_path_factory):
    """(name, ComfyClient) of a server with a real front end: the tree's own, or the newest one (current
    ComfyUI only: the March-2024 server cannot serve it)."""
    if request.param == "tree":
        name, extra = ("current" if comfy_host.is_current_comfy() else "pinned"), ()
    elif not comfy_host.is_current_comfy():
        pytest.skip("the newest front end needs current ComfyUI (set COMFYUI_PATH)")
    else:
        name, extra = f"frontend-{NEWEST_FRONT_END}", ("--front-end-root", str(newest_front_end()))
    workdir = tmp_path_factory.mktemp(f"server-{name}")
    with comfy_server(workdir, *extra, models={"checkpoints": checkpoints}, frontend=not extra) as client:
        # a fresh user of the current front end gets a template picker over the canvas; the newest front
        # end shows help in its node library only with the classic design; hosts without these settings
        # just store them
        client.request("POST", "/settings/Comfy.TutorialCompleted", True)
        client.request("POST", "/settings/Comfy.NodeLibrary.NewDesign", False)
        yield name, client


def open_front_end(browser, client, nodes_2: bool = False):
    """A page on the front end (Nodes 2.0 or the classic canvas), with its console errors and failed
    requests collected."""
    client.request("POST", "/settings/Comfy.VueNodes.Enabled", nodes_2)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text} @ {m.location}"))
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}\n{e.stack}"))
    page.on("requestfailed", lambda r: problems.append(f"requestfailed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.add_init_script(SPY_FILL_TEXT)
    page.goto(client.base_url)
    page.wait_for_function("window.app && window.app.graph && window.LiteGraph", timeout=120_000)
    page.wait_for_function("(name) => (window.app.extensions || []).some((e) => e.name === name)",
                           arg="comfyuitomatokenmerging.stats", timeout=60_000)
    return page, problems


def help_page_url(name: str, node_info: dict) -> str:
    """Where the current front end's node-docs panel first asks for a custom node's English help page:
    the pack folder comes from the node's python_module ("custom_nodes.<folder>")."""
    module = node_info.get("python_module", f"custom_nodes.{comfy_host.PACK_DIRNAME}").split(".")
    return f"/extensions/{module[1]}/docs/{name}/en.md"


def ours(problems):
    return [p for p in problems if re.search("toma", p, re.IGNORECASE)]


def check_stats_lines(lines):
    level = STATS_LINE.match(lines[0])
    assert level, f"unexpected stats line {lines[0]!r}"
    h, w, ds, tokens, merged, steps = map(int, level.groups())
    assert (ds, h, w) == (1, *LATENT_HW) and tokens == h * w
    assert 0 < merged < tokens and 1 <= steps <= SAMPLER_STEPS
    assert TIME_LINE.match(lines[-1]), lines[-1]


def run_and_wait(page, client, seed: int):
    """Queue WORKFLOW (loaded in the page) with the sampler's seed set, wait until the prompt ended and
    the front end had a moment to handle its end; the history entry of the prompt."""
    known = set(client.get_json("/history"))
    page.evaluate("([id, seed]) => { window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'seed')"
                  ".value = seed; }", [SAMPLER_NODE, seed])
    page.evaluate("() => window.app.queuePrompt(0, 1)")
    page.wait_for_function(f"Boolean(window.app.graph.getNodeById({TOMA_NODE}).tomaStats)", timeout=600_000)
    for _ in range(600):
        runs = {k: v for k, v in client.get_json("/history").items() if k not in known}
        if runs:
            break
        page.wait_for_timeout(200)
    page.wait_for_timeout(1000)  # the front end's handlers of the end of the prompt, and a few frames
    return list(runs.values())


# shipped workflows of model families newer than ComfyUI v0.3.64 -> the supported_models class they need
NEWER_FAMILIES = {"flux2": "Flux2", "z_image": "ZImage"}
# node types of kijai's ComfyUI-WanVideoWrapper, another custom node pack, which the test server does not have
WRAPPER_PACK = ("WanVideo", "LoadWanVideo")


def family_in_tree(workflow: str) -> bool:
    """Whether the ComfyUI tree in use has the model family of the shipped ``workflow`` (file name)."""
    import comfy.supported_models

    needed = [cls for prefix, cls in NEWER_FAMILIES.items() if workflow.startswith(prefix)]
    return all(hasattr(comfy.supported_models, cls) for cls in needed)


def test_front_end_shows_live_stats(pack, browser, front_end):
    name, client = front_end
    ARTIFACTS.mkdir(exist_ok=True)
    workflow = json.loads(WORKFLOW.read_text())
    page, problems = open_front_end(browser, client)
    offered = {}
    try:
        for shipped in sorted((comfy_host.REPO / "workflows").glob("*.json")):
            ui = json.loads(shipped.read_text())
            if "nodes" not in ui:  # API-format twin
                continue
            others = {node["type"] for node in ui["nodes"] if node["type"].startswith(WRAPPER_PACK)}
            if others:  # a workflow of another pack's nodes: only they are unknown here, ours are known
                assert set(page.evaluate(MISSING_NODE_TYPES, ui)) == others, shipped.name
                continue
            if not (comfy_host.is_current_comfy() or shipped.name.startswith("sd")) or not family_in_tree(shipped.name):
                # the pinned 2024 host predates Flux's core nodes, and v0.3.64 Flux.2's and Z-Image's: only ours
                # must be known there
                missing = page.evaluate(MISSING_NODE_TYPES, ui)
                assert not set(missing) & set(pack.nodes.NODE_CLASS_MAPPINGS), f"{shipped.name}: {missing}"
                continue
            page.evaluate("(w) => window.app.loadGraphData(w)", ui)
            assert page.evaluate(MISSING_NODE_TYPES, ui) == [], f"{shipped.name}: node types missing"
            if comfy_host.is_current_comfy():  # the March-2024 front end has no missing-models warning
                page.wait_for_function(f"Object.keys(({MISSING_MODELS_OFFERED})()).length > 0", timeout=15_000)
                offered[shipped.name] = page.evaluate(MISSING_MODELS_OFFERED)
                page.keyboard.press("Escape")
                page.wait_for_function("!document.querySelector('.p-dialog')", timeout=15_000)

        page.evaluate("(w) => window.app.loadGraphData(w)", workflow)
        assert page.evaluate(MISSING_NODE_TYPES, workflow) == []
        assert not page.evaluate(f"Boolean(window.app.graph.getNodeById({TOMA_NODE}).tomaStats)"), \
            "stats shown before anything ran"
        runs = run_and_wait(page, client, seed=0)
        page.wait_for_function(PREVIEW_SHOWN, arg=PREVIEW_NODE, timeout=60_000)
        shot = ARTIFACTS / f"browser_stats_{name}.png"
        page.screenshot(path=str(shot))
        lines = page.evaluate(f"window.app.graph.getNodeById({TOMA_NODE}).tomaStats")
        drawn = page.evaluate("Object.fromEntries(window.__drawnTexts)")
        in_dom = page.evaluate(NODE_DOM_TEXT, TOMA_NODE)
        body_height = page.evaluate(f"window.app.graph.getNodeById({TOMA_NODE}).size[1]")
        others = page.evaluate("window.app.graph._nodes.filter((n) => n.tomaStats).map((n) => String(n.id))")
    finally:
        page.close()
        (ARTIFACTS / f"browser_console_{name}.txt").write_text("\n".join(problems) + "\n")
    info = client.object_info()
    docs = {node: client.request("GET", help_page_url(node, info[node])) for node in pack.nodes.NODE_CLASS_MAPPINGS}

    assert others == [str(TOMA_NODE)], "stats must appear only on the node that patched the sampled model"
    check_stats_lines(lines)
    if in_dom is not None:  # the front end renders the node's progress text, after the prompt ended too
        assert all(line in in_dom for line in lines), f"stats not shown on the node: {in_dom!r}"
        assert not set(lines) & set(drawn), "stats drawn on the canvas too"
    else:  # drawn by our extension, inside the node's body where no link crosses it
        assert all(line in drawn for line in lines), f"stats not drawn on the canvas: {lines}"
        assert all(0 < drawn[line]["y"] < body_height for line in lines), (drawn, body_height)
    assert len(runs) == 1 and runs[0]["status"]["status_str"] == "success", runs
    assert runs[0]["outputs"][str(PREVIEW_NODE)]["images"], "the merge map produced no image"
    for node, (status, body) in docs.items():
        assert status == 200 and body.decode().startswith("# "), f"docs of {node}: HTTP {status}"
    assert all(offered.values()), f"no model download offered: {offered}"
    assert {f: e for shipped in offered.values() for f, e in shipped.items() if e} == {}
    assert ours(problems) == [], "\n".join(problems)


def test_text_widgets_show_label_and_value_at_default_width(browser, front_end):
    """A new CA-ToMe node, at the width the front end gives it: its checkpoints widget shows the label and
    the default value side by side (the March-2024 canvas draws at most 30 characters of a value)."""
    name, client = front_end
    page, problems = open_front_end(browser, client)
    try:
        value = page.evaluate(ADD_NODE, "CAToMePatchModel")
        page.wait_for_timeout(500)  # a few frames
        page.screenshot(path=str(ARTIFACTS / f"browser_catome_default_{name}.png"))
        drawn = page.evaluate("Object.fromEntries(window.__drawnTexts)")
    finally:
        page.close()

    label = drawn.get("checkpoints")
    shown = [text for text in drawn if len(text) >= min(30, len(value)) and value.startswith(text)]
    assert label, f"the checkpoints label is not drawn whole: {sorted(drawn)}"
    assert shown, f"the value {value!r} is not drawn"
    assert label["right"] < drawn[shown[0]]["left"], (label, drawn[shown[0]])
    assert ours(problems) == [], "\n".join(problems)


NEW_NODE_WIDGETS = """
(type) => {
  const node = LiteGraph.createNode(type);
  window.app.graph.add(node);
  return Object.fromEntries(node.widgets.map((w) => [w.name, w.value]));
}
"""


def test_new_baseline_nodes_keep_their_seed(browser, front_end):
    """ToMeSD's and CA-ToMe's seed places each cell's destination: the control both front ends add to an
    INT named seed must start at "fixed" on a new node, or a comparison changes after every run."""
    name, client = front_end
    page, problems = open_front_end(browser, client)
    try:
        widgets = {node: page.evaluate(NEW_NODE_WIDGETS, node) for node in ("ToMeSDPatchModel", "CAToMePatchModel")}
    finally:
        page.close()

    for node, values in widgets.items():
        assert values.get("control_after_generate") == "fixed", (name, node, values)
    assert ours(problems) == [], "\n".join(problems)


def test_nodes_2_shows_live_stats(browser, front_end):
    name, client = front_end
    if not comfy_host.is_current_comfy():
        pytest.skip("the March-2024 front end has no Nodes 2.0")
    workflow = json.loads(WORKFLOW.read_text())
    page, problems = open_front_end(browser, client, nodes_2=True)
    try:
        page.evaluate("(w) => window.app.loadGraphData(w)", workflow)
        page.wait_for_selector(f'.lg-node[data-node-id="{TOMA_NODE}"]', timeout=60_000)
        runs = run_and_wait(page, client, seed=1)
        page.screenshot(path=str(ARTIFACTS / f"browser_stats_nodes2_{name}.png"))
        lines = page.evaluate(f"window.app.graph.getNodeById({TOMA_NODE}).tomaStats")
        shown = page.evaluate(NODE_DOM_TEXT, TOMA_NODE)
    finally:
        page.close()
        client.request("POST", "/settings/Comfy.VueNodes.Enabled", False)

    assert runs and runs[0]["status"]["status_str"] == "success", runs
    check_stats_lines(lines)
    assert shown is not None and all(line in shown for line in lines), f"stats not shown on the node: {shown!r}"
    assert ours(problems) == [], "\n".join(problems)


def test_help_page_of_each_node_opens_without_errors(pack, browser, front_end):
    name, client = front_end
    if not comfy_host.is_current_comfy():
        pytest.skip("the March-2024 front end has no node help pages")
    page, problems = open_front_end(browser, client)
    shown = {}
    try:
        for node in sorted(pack.nodes.NODE_CLASS_MAPPINGS):
            title = (comfy_host.REPO / "web" / "docs" / f"{node}.md").read_text().splitlines()[0][2:]
            page.evaluate(OPEN_HELP, node)
            page.wait_for_function("(title) => [...document.querySelectorAll('h1')].some((h) => h.innerText === title)",
                                   arg=title, timeout=30_000)
            shown[node] = title
        page.screenshot(path=str(ARTIFACTS / f"browser_help_{name}.png"))
    finally:
        page.close()

    assert sorted(shown) == sorted(pack.nodes.NODE_CLASS_MAPPINGS)
    assert ours(problems) == [], "\n".join(problems)
