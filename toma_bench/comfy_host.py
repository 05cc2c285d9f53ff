"""Find, import and drive a real ComfyUI tree from the tests and the benchmarks.

Two trees are supported with the same code, told apart by feature detection only:
the pinned test host ``<repo>/.comfyui`` (ComfyUI of March 2024, built by ``tests/setup_host.sh``)
and any ComfyUI a user points ``COMFYUI_PATH`` at (e.g. ``.comfyui-current`` from
``tests/setup_current.sh``). Importing this module imports nothing from ComfyUI.
"""
from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PINNED_TREE = REPO / ".comfyui"  # tests/setup_host.sh
CURRENT_TREE = REPO / ".comfyui-current"  # tests/setup_current.sh
PACK_NAME = "comfyui_toma"  # sys.modules name used by load_pack()
PACK_DIRNAME = "ComfyUI-ToMA"  # folder name of the pack inside a custom_nodes dir

_state: dict = {}  # set once by import_comfy(): the tree and the settings it was imported with


def comfy_root(default: Path = PINNED_TREE) -> Path:
    """The ComfyUI tree to use: ``$COMFYUI_PATH`` if set, else ``default`` (the pinned tree)."""
    env = os.environ.get("COMFYUI_PATH")
    root = Path(env).expanduser().resolve() if env else default
    if not (root / "main.py").is_file() or not (root / "comfy").is_dir():
        if env:
            how = "check COMFYUI_PATH"
        elif default == PINNED_TREE:
            how = "run: bash tests/setup_host.sh"
        else:
            how = "set COMFYUI_PATH; tests/setup_current.sh makes one"
        raise RuntimeError(f"no ComfyUI tree at {root} ({how})")
    return root


def is_current_comfy() -> bool:
    """True for ComfyUI with the wrapper/DiT era APIs (Dec 2024+), False for the pinned March 2024 tree.

    Looks at the files of the tree in use, so it is cheap and imports nothing.
    """
    root = _state.get("root") or comfy_root()
    return (root / "comfy" / "patcher_extension.py").is_file()


def has_flux(root: Path) -> bool:
    """Whether the tree at ``root`` has Flux (August 2024 or later)."""
    return (root / "comfy" / "ldm" / "flux" / "model.py").is_file()


def sampler_reports_steps() -> bool:
    """Whether the tree in use wraps ``Sampler.sample`` (SAMPLER_SAMPLE wrappers), where the pack hands the
    sampler a callback and locates model calls by the steps it reports, reading no sigma. Reads the
    tree's file, imports nothing."""
    root = _state.get("root") or comfy_root()
    extension = root / "comfy" / "patcher_extension.py"
    return extension.is_file() and "SAMPLER_SAMPLE" in extension.read_text()


CURRENT_ONLY = ("Flux/SD3 exist only in current ComfyUI (set COMFYUI_PATH, e.g. to the .comfyui-current made "
                "by tests/setup_current.sh)")


def has_current_comfy() -> bool:
    """Like ``is_current_comfy`` but False where no ComfyUI tree exists (the comfy fixture reports that),
    for use in skip conditions at import time."""
    try:
        return is_current_comfy()
    except RuntimeError:
        return False


def import_comfy(root: Path | None = None, *, pytorch_attention: bool = False, cpu: bool = True,
                 highvram: bool = False, extra_nodes: bool = True) -> Path:
    """Make ComfyUI (the tree at ``root``, default comfy_root()) importable in this process, on the CPU
    unless ``cpu=False`` (benchmarks on CUDA; ``highvram`` keeps the weights on the GPU between runs).

    * The tree goes first on ``sys.path``: ComfyUI's top-level ``nodes.py`` must win over the pack's
      ``nodes/`` package (the repo root is on ``sys.path`` too: conftest.py, ``python -m`` from the root).
    * ``args.cpu`` (and the attention backend, VRAM mode) must be set before anything imports
      ``comfy.model_management``: it picks the device and attention backend at import time.
      That choice is per process, so a second call with other settings raises.
    * ``extra_nodes``: import ComfyUI's ``nodes.py`` and register its extra nodes (``TomePatchModel``, ...)
      with ``init_extra_nodes`` (current, async, external custom nodes skipped) or ``init_custom_nodes``
      (old). Without them only the core modules are imported: ``nodes.py`` pulls in PyAV and the API
      nodes, which the GPU kit does not carry. Idempotent; returns the tree path.
    """
    settings = {"pytorch_attention": pytorch_attention, "cpu": cpu, "highvram": highvram, "extra_nodes": extra_nodes}
    if _state:
        if _state["settings"] != settings:
            raise RuntimeError(f"ComfyUI was already imported with {_state['settings']}; use a subprocess for "
                               f"{settings}")
        return _state["root"]
    root = root or comfy_root()
    loaded = sys.modules.get("nodes")
    if loaded is not None and Path(getattr(loaded, "__file__", "")).resolve().parent != root.resolve():
        raise RuntimeError(f"a module 'nodes' from {getattr(loaded, '__file__', '?')} was imported before "
                           "ComfyUI's nodes.py; import the pack via comfy_host.load_pack(), never as 'nodes'")
    if "comfy.model_management" in sys.modules:
        raise RuntimeError("comfy.model_management was imported before import_comfy(): the device cannot be chosen")
    if str(root) in sys.path:
        sys.path.remove(str(root))
    sys.path.insert(0, str(root))

    import comfy.cli_args

    comfy.cli_args.args.cpu = cpu
    comfy.cli_args.args.highvram = highvram
    if pytorch_attention:
        comfy.cli_args.args.use_pytorch_cross_attention = True
    import comfy.model_management  # imported for its side effect: it picks the device and attention backend now

    if extra_nodes:
        import nodes

        if hasattr(nodes, "init_extra_nodes"):
            params = inspect.signature(nodes.init_extra_nodes).parameters
            result = nodes.init_extra_nodes(**{k: False for k in ("init_custom_nodes", "init_api_nodes")
                                               if k in params})
            if inspect.isawaitable(result):
                asyncio.run(result)
        else:
            nodes.init_custom_nodes()
    _state.update(root=root, settings=settings)
    return root


def import_core(device: str, require_flux: bool = True) -> Path:
    """For the DiT and GPU benchmarks: ComfyUI's core modules (``$COMFYUI_PATH``, else the current tree
    ``.comfyui-current``) on ``device`` ("cpu" or "cuda") with PyTorch SDPA; on CUDA in high-VRAM mode, so
    the weights stay on the GPU between interleaved runs. Imports neither ComfyUI's nodes.py nor anything
    it pulls in (PyAV, the API nodes). A missing tree, or one without Flux where ``require_flux``, ends
    the program with the reason."""
    try:
        root = comfy_root(default=CURRENT_TREE)
    except RuntimeError as missing:
        raise SystemExit(str(missing))
    if require_flux and not has_flux(root):
        raise SystemExit(f"no ComfyUI with Flux at {root}: set COMFYUI_PATH (tests/setup_current.sh makes one)")
    return import_comfy(root, pytorch_attention=True, cpu=device == "cpu", highvram=device == "cuda",
                        extra_nodes=False)


def load_pack():
    """Import the repo root as the package ``comfyui_toma`` (its relative imports then work) and return it.

    Never import the pack's ``nodes/`` as top-level ``nodes``: that name is ComfyUI's ``nodes.py``.
    ComfyUI is imported first (import_comfy with defaults unless already done) because the pack is
    ComfyUI glue. Note: ``comfyui_toma.toma_core`` and a plain ``import toma_core`` are two separate
    module objects (different class identities); tests of nodes should use ``pack.toma_core``. The
    harness is not part of the pack: it is ``toma_bench`` only (see toma_bench/__init__.py).
    """
    if PACK_NAME in sys.modules:
        return sys.modules[PACK_NAME]
    if not _state:
        import_comfy()
    spec = importlib.util.spec_from_file_location(PACK_NAME, REPO / "__init__.py",
                                                  submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == PACK_NAME or n.startswith(PACK_NAME + ".")]:
            del sys.modules[name]
        raise
    return module


def install_pack(custom_nodes: Path) -> Path:
    """Symlink the repo into ``custom_nodes/ComfyUI-ToMA`` (how users install it) and return that path."""
    custom_nodes.mkdir(parents=True, exist_ok=True)
    link = custom_nodes / PACK_DIRNAME
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    return link


def main_argv(workdir: Path, *extra: str) -> list[str]:
    """Command line that runs the tree's own ``main.py`` on CPU with the pack installed; run it with cwd=comfy_root().

    Everything it writes goes under ``workdir`` (custom_nodes/, output/, input/, temp/, user/, frontend/).
    Options only the current tree has are added when its ``comfy/cli_args.py`` defines them: a dummy
    ``--front-end-root`` (else it exits without the frontend wheel), ``--user-directory`` and
    an in-memory ``--database-url``. The yaml gives an absolute path: the old tree resolves relative
    ones against the CWD.
    """
    root = comfy_root()
    workdir = Path(workdir).resolve()
    install_pack(workdir / "custom_nodes")
    config = workdir / "extra_model_paths.yaml"
    config.write_text(f"comfyui_toma_tests:\n  custom_nodes: {json.dumps(str(workdir / 'custom_nodes'))}\n")
    dirs = {d: workdir / d for d in ("output", "input", "temp", "user", "frontend")}
    for d in dirs.values():
        d.mkdir(exist_ok=True)
    argv = [sys.executable, str(root / "main.py"), "--cpu", "--extra-model-paths-config", str(config),
            "--output-directory", str(dirs["output"]), "--input-directory", str(dirs["input"]),
            "--temp-directory", str(dirs["temp"])]
    options = (root / "comfy" / "cli_args.py").read_text()
    if '"--front-end-root"' in options:
        (dirs["frontend"] / "index.html").write_text("<!doctype html><title>ComfyUI test frontend</title>\n")
        argv += ["--front-end-root", str(dirs["frontend"])]
    if '"--user-directory"' in options:
        argv += ["--user-directory", str(dirs["user"])]
    if '"--database-url"' in options:
        argv += ["--database-url", "sqlite:///:memory:"]
    return argv + list(extra)
