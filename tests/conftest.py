"""Shared pytest setup.

The repo root goes on sys.path so engine tests can ``import toma_core`` without ComfyUI, and every test
can import the harness ``toma_bench``; this folder too, so tests import the helpers only tests use
(``dit_checks``) by name, whatever pytest's import mode. Nothing here imports ComfyUI: tests that need it ask for the
``comfy`` fixture (or call comfy_host directly).
"""
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
for folder in (REPO, REPO / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from toma_bench import comfy_host  # after the sys.path lines above; imports nothing from ComfyUI


@pytest.fixture(scope="session")
def comfy() -> Path:
    """ComfyUI imported in-process on CPU with built-in extra nodes registered; the tree's path."""
    return comfy_host.import_comfy()


@pytest.fixture(scope="session")
def pack(comfy):
    """The pack imported as ``comfyui_toma`` (see comfy_host.load_pack)."""
    return comfy_host.load_pack()


@pytest.fixture
def sent(monkeypatch) -> list:
    """The messages (event, data, client id) sent through a stand-in for ComfyUI's running PromptServer
    (found, as the pack finds it, as ``server.PromptServer.instance``; its client is "client-1", and the
    prompt it runs "prompt-1")."""
    messages = []
    instance = types.SimpleNamespace(client_id="client-1", last_prompt_id="prompt-1",
                                     send_sync=lambda event, data, sid=None: messages.append((event, data, sid)))
    prompt_server = types.SimpleNamespace(instance=instance)
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=prompt_server))
    return messages


def pytest_collection_modifyitems(items):
    # Tests that use the ComfyUI fixtures carry the `comfy` marker even if their author forgot it,
    # so `-m "not comfy"` really skips everything that imports ComfyUI.
    for item in items:
        if {"comfy", "pack"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.comfy)


def pytest_report_header(config):
    return f"ComfyUI tree: {os.environ.get('COMFYUI_PATH') or comfy_host.PINNED_TREE} (COMFYUI_PATH overrides)"
