"""LTX-2's model classes (``LTXAVModel``), taken at run time from the ComfyUI tree that has them.

Where LTX-2 is: a pip-installable ComfyUI fork of February 2026 (hiddenswitch/pip-and-uv-installable-ComfyUI),
whose tree cannot host the pack: its ``comfy`` is an installed package of another layout (no top-level
nodes.py, folder_paths, server or execution: they live in comfy.cmd and comfy.nodes) and imports some 100
dependencies the test venv lacks (configargparse and humanize at comfy.model_management and
comfy.model_patcher, and jax, lightning, opentelemetry...). So ``lightricks_modules()`` takes the three files
of ``comfy/ldm/lightricks`` LTX-2 needs (model.py, av_model.py, symmetric_patchifier.py) from a bare git
mirror of that tree (COMFYUI_LTX2_MIRROR, default hiddenswitch+pip-and-uv-installable-ComfyUI/repo in the folder
of mirrors toma_bench/pack_source.py finds) into a temporary folder, and loads them in place of the host tree's
``comfy.ldm.lightricks`` modules while it is open (current ComfyUI or later). Nothing of that tree is kept in
the repository. The host's sampler has no LTX-2 latent (a [video, audio] pair): callers call the model as
the sampler would.
"""
import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import pack_source

MIRROR = Path(os.environ.get("COMFYUI_LTX2_MIRROR",
                             pack_source.MIRRORS / "hiddenswitch+pip-and-uv-installable-ComfyUI" / "repo"))
MODULES = ("symmetric_patchifier", "model", "av_model")  # in import order


def missing() -> str | None:
    """Why LTX-2's classes cannot be loaded here, or None."""
    if MIRROR.is_dir():
        return None
    return (f"no LTX-2 tree: set COMFYUI_LTX2_MIRROR to a bare git dir of hiddenswitch/pip-and-uv-installable-ComfyUI "
            f"(looked at {MIRROR})")


@contextlib.contextmanager
def lightricks_modules():
    """The February-2026 ``comfy.ldm.lightricks`` modules in sys.modules while open; yields av_model.
    The host's ComfyUI must be importable (its package is the one whose modules are swapped)."""
    import comfy.ldm.lightricks.model  # noqa: F401  (the host's package, whose modules are swapped)

    reason = missing()
    if reason:
        raise FileNotFoundError(reason)
    names = [f"comfy.ldm.lightricks.{name}" for name in MODULES]
    saved = {name: sys.modules.get(name) for name in names}
    with tempfile.TemporaryDirectory(prefix="ltx2_lightricks_") as folder:
        try:
            for name, short in zip(names, MODULES):
                source = subprocess.run(["git", "--git-dir", str(MIRROR), "show", f"HEAD:comfy/ldm/lightricks/{short}.py"],
                                        check=True, capture_output=True, text=True).stdout
                path = Path(folder) / f"{short}.py"
                path.write_text(source)
                spec = importlib.util.spec_from_file_location(name, path)
                module = sys.modules[name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            yield sys.modules["comfy.ldm.lightricks.av_model"]
        finally:
            pack_source.restore_modules(saved)
