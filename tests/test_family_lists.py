"""The model families the pack names for users follow the adapter registry (``nodes/adapters`` ADAPTERS,
each adapter's ``names``): the ToMA nodes' descriptions and scope tooltip are generated from it in the
code, the README's and help pages' model lists and pyproject.toml's description by ``python -m
toma_bench.family_lists --write`` (checked here to be what it writes), and the lists written by hand (the
table and the node table of docs/models.md and docs/nodes.md, the help pages' scope rows) are checked
against it here. A family added to the registry without
its names in every list fails, and so does a list that names a family the registry does not serve, or
gives the attention placement to a family that does not honour it.
"""
import re
from pathlib import Path

import pytest

from toma_bench import family_lists

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "docs" / "models.md"
NODES = REPO / "docs" / "nodes.md"

pytestmark = pytest.mark.comfy

WHERE = ["ToMAPatchModel.DESCRIPTION", "README models served", "docs/models.md supported models",
         "help page of ToMAPatchModel", "help page of ToMAPatchModelAdvanced", "pyproject.toml description"]
SCOPE_WHERE = ["scope tooltip", "ToMAPatchModelAdvanced.DESCRIPTION", "docs/nodes.md node table",
               "help page scope row"]


def supported_models_rows() -> list[str]:
    """The first column of each row of docs/models.md's "Supported models" table (up to the next heading)."""
    section = re.split(r"\n##+ ", MODELS.read_text().split("## Supported models", 1)[1], maxsplit=1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]


def readme_models_served() -> str:
    """The README's "Models served" section (up to the next heading)."""
    return re.split(r"\n##+ ", (REPO / "README.md").read_text().split("## Models served", 1)[1], maxsplit=1)[0]


def help_page_row(node: str, name: str) -> str:
    text = (REPO / "web" / "docs" / node / "en.md").read_text()
    return next(line for line in text.splitlines() if line.startswith(f"| **{name}** |"))


def lists(pack) -> dict:
    description = re.search(r'^description = "(.*)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    return {"ToMAPatchModel.DESCRIPTION": pack.nodes.toma_nodes.ToMAPatchModel.DESCRIPTION,
            "README models served": readme_models_served(),
            "docs/models.md supported models": "\n".join(supported_models_rows()),
            "help page of ToMAPatchModel": help_page_row("ToMAPatchModel", "model"),
            "help page of ToMAPatchModelAdvanced": help_page_row("ToMAPatchModelAdvanced", "model"),
            "pyproject.toml description": description}


def scope_texts(pack) -> dict:
    nodes = pack.nodes.toma_nodes
    table = next(line for line in NODES.read_text().splitlines() if "(`ToMAPatchModelAdvanced`)" in line)
    return {"scope tooltip": nodes.ToMAPatchModelAdvanced.INPUT_TYPES()["required"]["scope"][1]["tooltip"],
            "ToMAPatchModelAdvanced.DESCRIPTION": nodes.ToMAPatchModelAdvanced.DESCRIPTION,
            "docs/nodes.md node table": table,
            "help page scope row": help_page_row("ToMAPatchModelAdvanced", "scope")}


def named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text) is not None


def all_names(pack) -> list[str]:
    return [name for adapter in pack.nodes.adapters.ADAPTERS for name in adapter.names]


def test_every_adapter_has_names_of_its_own(pack):
    names = all_names(pack)
    assert all(adapter.names for adapter in pack.nodes.adapters.ADAPTERS)
    assert len(names) == len(set(names))


@pytest.mark.parametrize("where", WHERE)
def test_every_list_names_every_family(pack, where):
    text = lists(pack)[where]
    missing = [name for name in all_names(pack) if not named(name, text)]
    assert missing == [], f"{where} does not name {missing}"


def test_every_models_table_row_is_a_family_of_the_registry(pack):
    """A row of docs/models.md's Supported models table names a family the registry serves (one family may have
    several rows: Flux.1 and Flux.2)."""
    names = all_names(pack)
    strays = [row for row in supported_models_rows() if not any(named(name, row) for name in names)]
    assert strays == []


@pytest.mark.parametrize("where", SCOPE_WHERE)
def test_the_attention_placement_is_offered_where_a_family_honours_it(pack, where):
    """Where the scope's "attention" placement is described for DiT double blocks, it names exactly the
    families whose declaration honours it."""
    adapters = pack.nodes.adapters
    match = re.search(r"\b[Oo]n ((?:[\w.]+(?:, | and ))*[\w.]+) double blocks", scope_texts(pack)[where])
    assert match, f"{where} does not say which DiT double blocks the attention placement serves"
    offered = set(re.split(r", | and ", match.group(1)))
    assert offered == set(adapters.attention_placement_families())
    assert offered < {family.name for family in adapters.DIT_FAMILIES}


def test_the_generated_lists_are_what_the_registry_writes(pack):
    """The README's and help pages' model lists and pyproject.toml's description are python -m
    toma_bench.family_lists --write's output for this registry (run it after changing a declaration's names)."""
    assert family_lists.stale(pack) == []
    assert all(family_lists.SPAN.search(page.read_text()) for page in family_lists.PAGES)


# v0.33.0's supported_models classes that are no image or video diffusion model (docs/models.md says so)
NOT_IMAGE_OR_VIDEO = {"StableAudio", "StableAudio3", "ACEStep", "ACEStep15", "MiniMaxMusic3", "Hunyuan3Dv2",
                      "Hunyuan3Dv2mini", "Hunyuan3Dv2_1", "TripoSplat", "Trellis2", "RT_DETR_v4", "SAM3", "SAM31",
                      "DepthAnything3"}
EVERY_MODEL = "### Every diffusion model of ComfyUI v0.33.0"


def every_model_rows() -> list[str]:
    """The classes the first column of docs/models.md's table of v0.33.0's diffusion models names."""
    section = MODELS.read_text().split(EVERY_MODEL, 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    return [name.strip() for row in rows for name in row.split(",")]


def test_the_models_page_names_every_diffusion_class_of_the_tree(pack):
    """In a tree of v0.33.0's generation (it has MiniMaxH3), docs/models.md's table names every class of its
    supported_models list, once, but the audio, 3-D and detection models it leaves out (and says so)."""
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "MiniMaxH3"):
        pytest.skip("the table is v0.33.0's: bash tests/setup_2026.sh, then COMFYUI_PATH=.comfyui-2026")
    classes = {cls.__name__ for cls in comfy.supported_models.models}
    rows = every_model_rows()
    assert len(rows) == len(set(rows))
    assert set(rows) == classes - NOT_IMAGE_OR_VIDEO
    intro = MODELS.read_text().split(EVERY_MODEL, 1)[1].split("\n|", 1)[0]
    assert all(named(name, intro) for name in NOT_IMAGE_OR_VIDEO & classes)
