"""The model families the pack names for users (the ToMA node's description, its help pages, the README's
table, the registry description in pyproject.toml) follow the adapter registry: an adapter added to
``nodes/adapters`` ADAPTERS without its names in every list fails here, and so does a list that names
a family under one name and drops another.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.comfy

# For each adapter of ADAPTERS (by its name), the names users know its models by (what each list must name).
NAMES = {
    "SD1.x/SD2.x/SDXL UNet": ("SD1.x", "SD2.x", "SDXL"),
    "Flux": ("Flux", "Flux.2"),
    "SD3/SD3.5": ("SD3",),
    "HunyuanVideo": ("HunyuanVideo", "HunyuanVideo 1.5"),
    "LTX-Video": ("LTX-Video",),
    "Wan 2.1/2.2": ("Wan",),
    "Qwen-Image": ("Qwen-Image",),
    "Chroma": ("Chroma",),
    "Lumina 2 / Z-Image": ("Z-Image", "Lumina 2"),
}


def supported_models_table() -> str:
    """The first column of the README's "Supported models" table."""
    section = (REPO / "README.md").read_text().split("## Supported models", 1)[1].split("\n## ", 1)[0]
    return "\n".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| ") and "---" not in line)


def help_page_model_row(node: str) -> str:
    text = (REPO / "web" / "docs" / node / "en.md").read_text()
    return next(line for line in text.splitlines() if line.startswith("| **model** |"))


def lists(pack) -> dict:
    description = re.search(r'^description = "(.*)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    return {"ToMAPatchModel.DESCRIPTION": pack.nodes.toma_nodes.ToMAPatchModel.DESCRIPTION,
            "README supported models": supported_models_table(),
            "help page of ToMAPatchModel": help_page_model_row("ToMAPatchModel"),
            "help page of ToMAPatchModelAdvanced": help_page_model_row("ToMAPatchModelAdvanced"),
            "pyproject.toml description": description}


def test_names_cover_the_registry(pack):
    registry = {adapter.name for adapter in pack.nodes.adapters.ADAPTERS}
    assert set(NAMES) == registry


@pytest.mark.parametrize("where", ["ToMAPatchModel.DESCRIPTION", "README supported models",
                                   "help page of ToMAPatchModel", "help page of ToMAPatchModelAdvanced",
                                   "pyproject.toml description"])
def test_every_list_names_every_family(pack, where):
    text = lists(pack)[where]
    missing = [name for names in NAMES.values() for name in names
               if not re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w-])", text)]
    assert missing == [], f"{where} does not name {missing}"
