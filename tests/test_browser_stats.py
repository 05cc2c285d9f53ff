"""The front end, in a real headless Chromium: our extension loads without errors, the shipped workflows
load with no missing node, and after a queued run the ToMA node shows its live stats line.

Runs against the tree under test: the pinned host serves its bundled front end; current ComfyUI
(COMFYUI_PATH) serves the installed comfyui-frontend-package. A screenshot of the canvas after the run
is saved under test-artifacts/. Skipped only when Chromium is not installed (CI installs it).
"""
import importlib
import json
import re
from pathlib import Path

import pytest

import comfy_host
from server import comfy_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = comfy_host.REPO / "test-artifacts"
WORKFLOW = Path(__file__).resolve().parent / "browser_sd15_merge_map.json"
CHECKPOINT = "toma_test_sd15.safetensors"  # the name the workflow's loader asks for
TOMA_NODE, MAP_NODE, PREVIEW_NODE = 2, 7, 8  # node ids in WORKFLOW
LATENT_HW = (12, 16)  # WORKFLOW's EmptyLatentImage is 128x96 pixels
SAMPLER_STEPS = 2  # WORKFLOW's KSampler steps
STATS_LINE = re.compile(r"^(\d+)x(\d+) \(1/(\d+)\): (\d+) → (\d+) tokens, (\d+) steps merged$")
TINY_SD15 = {"channel_mult": [1, 2], "num_res_blocks": [1, 1], "transformer_depth": [1, 1],
             "transformer_depth_output": [1, 1, 1, 1]}

pytestmark = [
    pytest.mark.browser,
    pytest.mark.server,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason=f"Chromium is not installed at {CHROMIUM} (CI installs it: "
                       "apt-get install -y chromium chromium-driver)"),
]

# Records every string drawn on a canvas (the stats line lives only on the canvas, not in the DOM).
SPY_FILL_TEXT = """
window.__drawnTexts = new Set();
const fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  if (typeof text === "string") window.__drawnTexts.add(text);
  return fillText.call(this, text, ...rest);
};
"""

PREVIEW_SHOWN = """
(id) => { const imgs = window.app.graph.getNodeById(id).imgs; return Boolean(imgs && imgs.length && imgs[0].complete); }
"""

MISSING_NODE_TYPES = """
(workflow) => workflow.nodes.map((n) => n.type).filter((t) => !(t in LiteGraph.registered_node_types))
"""


@pytest.fixture(scope="module")
def checkpoints(pack, tmp_path_factory):
    """A folder with a random-weight SD1.5-shaped checkpoint (UNet only) named as WORKFLOW expects."""
    models = importlib.import_module(f"{pack.__name__}.toma_bench.models")
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


def tree_name() -> str:
    return "current" if comfy_host.is_current_comfy() else "pinned"


def open_front_end(browser, url: str):
    """A page on the front end, with its console errors and failed requests collected."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems = []
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text} @ {m.location}"))
    page.on("pageerror", lambda e: problems.append(f"pageerror: {e}\n{e.stack}"))
    page.on("requestfailed", lambda r: problems.append(f"requestfailed: {r.url}"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.add_init_script(SPY_FILL_TEXT)
    page.goto(url)
    page.wait_for_function("window.app && window.app.graph && window.LiteGraph", timeout=120_000)
    page.wait_for_function("(name) => (window.app.extensions || []).some((e) => e.name === name)",
                           arg="comfyui_toma.stats", timeout=60_000)
    return page, problems


def help_page_url(name: str, node_info: dict) -> str:
    """Where the current front end's node-docs panel fetches a custom node's help page: the pack folder
    comes from the node's python_module ("custom_nodes.<folder>"); the old front end has no panel."""
    module = node_info.get("python_module", f"custom_nodes.{comfy_host.PACK_DIRNAME}").split(".")
    return f"/extensions/{module[1]}/docs/{name}.md"


def ours(problems):
    return [p for p in problems if re.search("toma", p, re.IGNORECASE)]


def test_front_end_shows_live_stats(pack, browser, checkpoints, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    workflow = json.loads(WORKFLOW.read_text())
    with comfy_server(tmp_path / "server", models={"checkpoints": checkpoints}, frontend=True) as client:
        # a fresh user of the current front end gets a template picker over the canvas; hosts without
        # this setting just store it
        client.request("POST", "/settings/Comfy.TutorialCompleted", True)
        page, problems = open_front_end(browser, client.base_url)
        try:
            for shipped in sorted((comfy_host.REPO / "workflows").glob("*.json")):
                ui = json.loads(shipped.read_text())
                if "nodes" not in ui:  # API-format twin
                    continue
                if not (comfy_host.is_current_comfy() or shipped.name.startswith("sd")):
                    # the pinned 2024 host predates Flux's core nodes: only ours must be known there
                    missing = page.evaluate(MISSING_NODE_TYPES, ui)
                    assert not set(missing) & set(pack.NODE_CLASS_MAPPINGS), f"{shipped.name}: {missing}"
                    continue
                page.evaluate("(w) => window.app.loadGraphData(w)", ui)
                assert page.evaluate(MISSING_NODE_TYPES, ui) == [], f"{shipped.name}: node types missing"

            page.evaluate("(w) => window.app.loadGraphData(w)", workflow)
            assert page.evaluate(MISSING_NODE_TYPES, workflow) == []
            assert not page.evaluate(f"Boolean(window.app.graph.getNodeById({TOMA_NODE}).tomaStats)"), \
                "stats shown before anything ran"
            page.evaluate("() => window.app.queuePrompt(0, 1)")
            page.wait_for_function(f"Boolean(window.app.graph.getNodeById({TOMA_NODE}).tomaStats)", timeout=600_000)
            page.wait_for_function("[...window.__drawnTexts].some((t) => t.includes(' steps merged'))",
                                   timeout=30_000)
            page.wait_for_function(PREVIEW_SHOWN, arg=PREVIEW_NODE, timeout=60_000)
            page.wait_for_timeout(300)  # one more frame
            shot = ARTIFACTS / f"browser_stats_{tree_name()}.png"
            page.screenshot(path=str(shot))
            lines = page.evaluate(f"window.app.graph.getNodeById({TOMA_NODE}).tomaStats")
            drawn = page.evaluate("[...window.__drawnTexts]")
            others = page.evaluate("window.app.graph._nodes.filter((n) => n.tomaStats).map((n) => n.id)")
        finally:
            page.close()
            (ARTIFACTS / f"browser_console_{tree_name()}.txt").write_text("\n".join(problems) + "\n")
        history = client.get_json("/history")
        info = client.object_info()
        docs = {name: client.request("GET", help_page_url(name, info[name])) for name in pack.NODE_CLASS_MAPPINGS}

    assert others == [TOMA_NODE], "stats must appear only on the node that patched the sampled model"
    assert all(line in drawn for line in lines), f"stats not drawn on the canvas: {lines}"
    level = STATS_LINE.match(lines[0])
    assert level, f"unexpected stats line {lines[0]!r}"
    h, w, ds, tokens, merged, steps = map(int, level.groups())
    assert (ds, h, w) == (1, *LATENT_HW) and tokens == h * w
    assert 0 < merged < tokens and 1 <= steps <= SAMPLER_STEPS
    assert re.match(r"^select [\d.]+% · merge [\d.]+% · unmerge [\d.]+% of [\d.]+ s sampling$", lines[-1]), lines[-1]
    runs = list(history.values())
    assert len(runs) == 1 and runs[0]["status"]["status_str"] == "success", runs
    assert runs[0]["outputs"][str(PREVIEW_NODE)]["images"], "the merge map produced no image"
    for name, (status, body) in docs.items():
        assert status == 200 and body.decode().startswith("# "), f"docs of {name}: HTTP {status}"
    assert ours(problems) == [], "\n".join(problems)
    assert shot.stat().st_size > 0
