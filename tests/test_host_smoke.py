"""The pack installs into a real ComfyUI the way users install it: through ComfyUI's own loader.

Works against the pinned tree and against COMFYUI_PATH (sync vs async loader is feature-detected): V1 nodes in the
pinned tree, V3 nodes through comfy_entrypoint in trees with the V3 schema.
"""
import asyncio
import inspect
import os
import subprocess
import sys

import pytest

from node_info import host_has_v3_schema
from toma_bench import comfy_host

pytestmark = pytest.mark.comfy


def _run(value):
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _declared_nodes(module):
    """{node id: class} the pack declares: V1 NODE_CLASS_MAPPINGS, else a V3 comfy_entrypoint."""
    mapping = getattr(module, "NODE_CLASS_MAPPINGS", None)
    if mapping is not None:
        return dict(mapping)
    entrypoint = getattr(module, "comfy_entrypoint", None)
    assert entrypoint is not None, "the pack declares neither NODE_CLASS_MAPPINGS nor comfy_entrypoint"
    extension = _run(entrypoint())
    return {cls.GET_SCHEMA().node_id: cls for cls in _run(extension.get_node_list())}


@pytest.fixture
def comfy_registry(comfy, tmp_path):
    """ComfyUI's `nodes` module; its registries and the modules it imports from tmp_path are reset afterwards."""
    import nodes

    saved = {name: dict(getattr(nodes, name)) for name in
             ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "EXTENSION_WEB_DIRS")}
    modules = set(sys.modules)
    yield nodes
    for name, value in saved.items():
        getattr(nodes, name).clear()
        getattr(nodes, name).update(value)
    for name in set(sys.modules) - modules:  # the loader's copy of the pack
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def test_pack_loads_through_comfyui_loader(comfy_registry, tmp_path):
    nodes = comfy_registry
    path = comfy_host.install_pack(tmp_path / "custom_nodes")

    ok = _run(nodes.load_custom_node(str(path)))  # old: sync, current: async; both return True on success

    assert ok is True, "ComfyUI's load_custom_node reported failure (see the warning it logged above)"
    init = os.path.join(str(path), "__init__.py")
    loaded = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == init]
    assert len(loaded) == 1, f"expected ComfyUI to import {init} once, found {len(loaded)}"
    declared = _declared_nodes(loaded[0])
    v1 = loaded[0].nodes  # the pack's V1 declarations, in the loader's copy of the pack
    assert list(declared) == list(v1.NODE_CLASS_MAPPINGS)
    for node_id, cls in declared.items():
        assert nodes.NODE_CLASS_MAPPINGS.get(node_id) is cls, f"{node_id} not registered by ComfyUI"
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS.get(node_id) == v1.NODE_DISPLAY_NAME_MAPPINGS[node_id]
    # V3 through comfy_entrypoint where the host has the schema (a host takes NODE_CLASS_MAPPINGS first), else V1
    if host_has_v3_schema():
        from comfy_api.latest import io

        assert not hasattr(loaded[0], "NODE_CLASS_MAPPINGS") and hasattr(loaded[0], "comfy_entrypoint")
        assert all(issubclass(cls, io.ComfyNode) for cls in declared.values())
    else:
        assert not hasattr(loaded[0], "comfy_entrypoint")
        assert all(cls is v1.NODE_CLASS_MAPPINGS[node_id] for node_id, cls in declared.items())
    web = getattr(loaded[0], "WEB_DIRECTORY", None)
    if web is not None and os.path.isdir(os.path.join(str(path), web)):
        assert os.path.abspath(os.path.join(str(path), web)) in nodes.EXTENSION_WEB_DIRS.values()


@pytest.mark.server
def test_main_quick_test_for_ci_imports_pack(tmp_path):
    root = comfy_host.comfy_root()
    argv = comfy_host.main_argv(tmp_path, "--quick-test-for-ci")
    pack_path = str(tmp_path.resolve() / "custom_nodes" / comfy_host.PACK_DIRNAME)

    proc = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=600)

    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    # ComfyUI lists every custom node it tried: "   0.1 seconds[ (IMPORT FAILED)]: <path>".
    report = [line for line in log.splitlines() if "seconds" in line and line.rstrip().endswith(pack_path)]
    assert report, f"ComfyUI did not try to import {pack_path}:\n{log}"
    assert not any("IMPORT FAILED" in line for line in report), log
    assert f"Cannot import {pack_path}" not in log, log
