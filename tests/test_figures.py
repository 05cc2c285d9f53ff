"""The headline figures have one source, docs/figures.json: the README's "What to expect" table, the help
pages' figures and default ratios, docs/nodes.md's ratios and the table at the top of docs/benchmarks.md
are what ``python -m toma_bench.figures --write`` renders from it; its kinds, ratios and scopes are
nodes/placement.py's PRESETS, whose comments restate no figure; each figure names its date, the command
that printed it and the notebook entry that holds the run. The README's own lists (the nodes, the
workflows) and its set-up commands are checked here too.
"""
import copy
import json
import re
from pathlib import Path

import pytest

from toma_bench import figures

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_the_pages_are_what_the_data_file_renders():
    """Run ``python -m toma_bench.figures --write`` after editing docs/figures.json."""
    assert figures.missing_markers() == []
    assert figures.stale() == []


@pytest.mark.parametrize("page", sorted(figures.RENDERERS))
def test_a_changed_figure_or_ratio_makes_each_page_stale(page):
    """The check can fail: a value changed in the data (a figure, or a ratio for the pages that show only
    ratios) makes every page that renders it out of date."""
    data = copy.deepcopy(figures.load())
    data["kinds"]["sd1"]["figures"][0]["value"] = "9.99x"
    data["kinds"]["sd1"]["ratio"] = 0.7
    assert REPO / page in figures.stale(data)


def test_the_data_file_is_plain_json_with_every_field():
    data = json.loads(figures.DATA.read_text())
    for key, kind in data["kinds"].items():
        assert {"name", "short", "ratio", "scope", "merges", "tune", "figures"} <= set(kind), key
        assert any(f["headline"] and f["kind"] == "modelled" for f in kind["figures"]), key
        assert any(f["headline"] and f["kind"] == "measured" for f in kind["figures"]), key
        for f in kind["figures"]:
            assert f["kind"] in ("modelled", "measured"), (key, f)
            assert re.fullmatch(r"\d+\.\d+(x| dB)", f["value"]), (key, f)
            assert re.fullmatch(r"20\d\d-\d\d-\d\d", f["date"]), (key, f)
            assert f["command"].startswith(("python -m toma_bench.", "COMFYUI_PATH=")), (key, f)


@pytest.mark.parametrize("block", ["first", "stack"])
def test_what_to_turn_on_first_and_the_stack_row_are_rendered_from_the_data(block):
    """The README's "what to turn on first" lines and its "with a step cache" row come from docs/figures.json: a
    changed option or stack figure makes the README stale, and each names a notebook entry that exists."""
    data = copy.deepcopy(figures.load())
    dit = data["kinds"]["dit"]
    if block == "first":
        dit["first"]["options"][0]["speed"] = "9.99x"
    else:
        dit["stack"]["speed"] = "9.99x"
    assert REPO / "README.md" in figures.stale(data)
    anchors = notebook_anchors()
    for _, kind in figures.kinds(figures.load()):
        for entry in (kind.get("first"), kind.get("stack")):
            if entry is not None:
                assert entry["notebook"] in anchors and entry["command"].startswith("COMFYUI_PATH=")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def notebook_anchors() -> set[str]:
    text = (REPO / "docs" / "notebook.md").read_text()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # printed tables hold "## model:" lines
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,4} ", line)}


def test_every_figure_points_at_a_notebook_entry():
    anchors = notebook_anchors()
    missing = [f["notebook"] for _, kind in figures.kinds(figures.load()) for f in kind["figures"]
               if f["notebook"] not in anchors]
    assert missing == []


def test_the_kinds_are_the_presets(pack):
    """A kind added to PRESETS needs its figures in docs/figures.json; a ratio or scope changed in one place
    fails here until the other follows."""
    presets = pack.nodes.placement.PRESETS
    data = figures.load()["kinds"]
    assert set(data) == set(presets)
    assert {k: (v["ratio"], v["scope"]) for k, v in data.items()} == {
        k: (p.ratio, p.scope) for k, p in presets.items()}


def test_placement_restates_no_figure():
    """nodes/placement.py says why each default is what it is and points at docs/figures.json for how much:
    no speed-up or PSNR in its comments, where it would drift from the data file."""
    source = (REPO / "nodes" / "placement.py").read_text()
    comments = "\n".join(re.findall(r"#.*$", source, re.M))
    docstrings = "\n".join(re.findall(r'"""(.*?)"""', source, re.S))
    figures_found = re.findall(r"\d+(?:\.\d+)?\s?dB\b|\b\d+\.\d+x\b", comments + docstrings)
    assert figures_found == []
    assert "docs/figures.json" in source


def test_the_readme_lists_every_node(pack):
    """The README's node table names every node the pack registers (new nodes need a row), and no other."""
    section = README.split("## The nodes", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\| \*\*.*?\*\* \(`(\w+)`\)", section, re.M))
    assert named == set(pack.nodes.NODE_CLASS_MAPPINGS)


def shipped_workflows() -> set[str]:
    return {p.stem for p in (REPO / "workflows").glob("*.json") if not p.stem.endswith("_api")}


@pytest.mark.parametrize("page", ["README.md", "docs/main_job.md"])
def test_every_shipped_workflow_is_listed(page):
    text = (REPO / page).read_text()
    assert len(shipped_workflows()) >= 11
    assert [name for name in sorted(shipped_workflows()) if not re.search(rf"`{name}(\.json)?`", text)] == []


def test_the_readme_is_a_users_page():
    """Install within the first 40 lines; the modelled and measured figures said so near the top; the two
    set-up commands on a fresh machine (the main job, the tests) kept."""
    lines = README.splitlines()
    install = next(i for i, line in enumerate(lines) if line.startswith("## Install"))
    assert install < 40
    top = "\n".join(lines[:install])
    assert "**modelled**" in top and "**measured**" in top and "no GPU has run the pack yet" in top
    assert "bash tests/setup_host.sh && .venv/bin/python -m toma_bench.main_job" in README
    assert "\nbash tests/run.sh\n" in README
    assert len(lines) <= 200
