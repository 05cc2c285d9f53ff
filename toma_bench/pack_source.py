"""Other node packs' code (TeaCache, MagCache, raylight), taken at test time from bare git mirrors of their
public repositories, never kept in this one.

``load(name)`` writes a pack's module from its mirror's HEAD into a temporary folder and imports it under
a private module name (``toma_bench_mirror_<pack>_<module>``), as ComfyUI would load the pack's nodes; the
host's ComfyUI must already be importable. A module that imports its pack's siblings or libraries the test
venv lacks (raylight's xfuser) is given them by the caller through ``stand_ins`` (module name -> module),
present in sys.modules only while it is imported. Mirrors live beside this checkout
(../.mirror/<owner>+<name>/repo), or where TOMA_MIRRORS points.
"""
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIRRORS = Path(os.environ.get("TOMA_MIRRORS", REPO.parent / ".mirror"))
PACKS = {  # name -> GitHub owner/name
    "teacache": "welltop-cn/ComfyUI-TeaCache",
    "magcache": "Zehong-Ma/ComfyUI-MagCache",
    "raylight": "komikndr/raylight",
}


def mirror(name: str) -> Path:
    return MIRRORS / PACKS[name].replace("/", "+") / "repo"


def missing(name: str) -> str | None:
    """Why pack ``name``'s code cannot be read here, or None."""
    if mirror(name).is_dir():
        return None
    return f"no mirror of {PACKS[name]} (looked at {mirror(name)}; set TOMA_MIRRORS to the folder of mirrors)"


def source(name: str, path: str) -> str:
    """The text of ``path`` at the HEAD of pack ``name``'s mirror."""
    return subprocess.run(["git", "--git-dir", str(mirror(name)), "show", f"HEAD:{path}"], check=True,
                          capture_output=True, text=True).stdout


def load(name: str, path: str = "nodes.py", stand_ins: dict | None = None, module_name: str | None = None):
    """Pack ``name``'s module ``path`` imported from its mirror (FileNotFoundError with the reason where
    there is none; the module's own ImportError where this ComfyUI lacks what it imports).
    ``module_name``: the name to import it under, where its relative imports must resolve (against
    ``stand_ins``); by default a private one."""
    reason = missing(name)
    if reason:
        raise FileNotFoundError(reason)
    module_name = module_name or f"toma_bench_mirror_{name}_{Path(path).with_suffix('').as_posix().replace('/', '_')}"
    stand_ins = stand_ins or {}
    saved = {key: sys.modules.get(key) for key in stand_ins}
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as folder:
        file = Path(folder) / Path(path).name
        file.write_text(source(name, path))
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        try:
            sys.modules.update(stand_ins)
            spec.loader.exec_module(module)
        finally:
            for key, previous in saved.items():
                if previous is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = previous
    return module
