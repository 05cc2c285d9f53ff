"""What a ComfyUI tree needs installed to start, read from its own requirements.txt, checked against the running
Python, and installed on request (the main job's ``--comfyui DIR --install-requirements``).

ComfyUI lists the packages it imports at start first and the optional ones below a ``#non essential`` line; only the
first are needed (a missing optional one turns a few extra nodes into warnings). Installing keeps the installed
torch, torchvision and torchaudio as they are (pip constraints), as tests/setup_current.sh does for the harness's
venv: a user's torch build (CUDA, ROCm) is theirs.
"""
from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tempfile
from pathlib import Path

OPTIONAL_BELOW = "#non essential"  # ComfyUI's requirements.txt: optional packages from this line on
KEPT = ("torch", "torchvision", "torchaudio")  # pinned at their installed versions while installing


def name_of(requirement: str) -> str:
    """The distribution name of a requirement line ("SQLAlchemy>=2.0.0" -> "SQLAlchemy")."""
    return re.split(r"[<>=~!;@\[\s]", requirement.strip(), maxsplit=1)[0]


def essential(root: Path) -> list[str]:
    """The requirement lines of the tree at ``root`` above its optional ones ([] without a requirements.txt)."""
    path = Path(root) / "requirements.txt"
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.lower().startswith(OPTIONAL_BELOW):
            break
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def installed_version(name: str) -> str | None:
    """The version of the installed distribution ``name``; None when this Python lacks it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(name: str) -> bool:
    return installed_version(name) is not None


def missing(root: Path) -> list[str]:
    """The essential requirement lines of the tree at ``root`` whose package this Python lacks."""
    return [line for line in essential(root) if not is_installed(name_of(line))]


def constraints() -> list[str]:
    """``name==version`` of each installed package of KEPT (a Python without torchaudio pins the other two)."""
    versions = {name: installed_version(name) for name in KEPT}
    return [f"{name}=={version}" for name, version in versions.items() if version is not None]


def install(requirements: list[str]) -> None:
    """pip-install ``requirements`` into this Python, the installed torch family kept as it is; raises
    CalledProcessError (pip has said why) when pip fails."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="toma-constraints-") as pins:
        pins.write("\n".join(constraints()) + "\n")
        pins.flush()
        subprocess.run([sys.executable, "-m", "pip", "install", "-c", pins.name, *requirements], check=True)
