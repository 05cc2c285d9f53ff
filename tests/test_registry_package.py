"""The registry package, as comfy-cli builds and checks it, and the help pages it ships.

``comfy node validate`` passes with the metadata the registry shows (issues URL, icon, supported ComfyUI
versions), and the zip of ``comfy node pack`` holds what runs the nodes and none of the development files
(.comfyignore).

comfy-cli runs offline here, with its telemetry off and its config in a temporary home. It packs a copy
of the working tree (tracked files plus untracked ones git does not ignore), so uncommitted changes count.
"""
import ast
import importlib.util
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

needs_comfy_cli = pytest.mark.skipif(importlib.util.find_spec("comfy_cli") is None,
                                     reason="comfy-cli is not installed (tests/requirements-host.txt lists it)")

# What a user's ComfyUI needs from the zip: the package, its front-end files and the example workflows.
SHIPPED_DIRS = ("nodes", "toma_core", "web/js", "web/docs", "workflows")
DEVELOPMENT_DIRS = ("tests/", ".ci/", "toma_bench/")

REGISTRY_FIELDS = """
import json
from comfy_cli.registry.config_parser import extract_node_configuration
config = extract_node_configuration()
print(json.dumps({"issues": config.project.urls.issues, "repository": config.project.urls.repository,
                  "homepage": config.project.urls.homepage,
                  "icon": config.tool_comfy.icon, "requires_comfyui": config.project.supported_comfyui_version,
                  "publisher": config.tool_comfy.publisher_id, "version": config.project.version}))
"""


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A git repository holding the working tree's files as they are now (links such as .venv left out)."""
    root = tmp_path_factory.mktemp("package") / "ComfyUI-ToMA"
    for name in sorted(set(git("ls-files", "-co", "--exclude-standard").splitlines())):
        source = REPO / name
        if source.is_symlink() or not source.is_file():
            continue
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, root / name)
    git("init", "-q", cwd=root)
    git("add", "-A", cwd=root)
    return root


def comfy_cli(checkout: Path, *args: str, code: str | None = None) -> subprocess.CompletedProcess:
    home = checkout.parent / "home"
    home.mkdir(exist_ok=True)
    env = dict(os.environ, DO_NOT_TRACK="1", HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"))
    argv = [sys.executable, "-c", code] if code else [sys.executable, "-m", "comfy_cli", *args]
    return subprocess.run(argv, cwd=checkout, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)


@needs_comfy_cli
def test_comfy_node_validate_passes_with_the_registry_metadata(checkout):
    validate = comfy_cli(checkout, "node", "validate")
    fields = comfy_cli(checkout, code=REGISTRY_FIELDS)

    output = validate.stdout + validate.stderr
    assert validate.returncode == 0, output
    assert "All validation checks passed" in output and "Warning" not in output, output
    assert fields.returncode == 0, fields.stderr
    metadata = json.loads(fields.stdout.strip().splitlines()[-1])
    assert metadata["issues"] == metadata["repository"] + "/issues", metadata
    assert metadata["homepage"] == metadata["repository"], metadata
    assert metadata["icon"].startswith("https://") and metadata["icon"].endswith(".png"), metadata
    icon_in_repo = metadata["icon"].split("/main/", 1)[-1]
    assert (REPO / icon_in_repo).is_file(), f"the Icon URL names {icon_in_repo}, which is not in the repository"
    assert metadata["requires_comfyui"].startswith(">="), metadata
    assert metadata["publisher"] and metadata["version"], metadata


def missing_imports(names: set[str], root: Path) -> list[str]:
    """Relative imports of the packed modules that name a module or package left out of the zip."""
    problems = []
    for name in sorted(n for n in names if n.endswith(".py")):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = Path(name).parents[node.level - 1]
            parts = node.module.split(".") if node.module else []
            targets = [base.joinpath(*parts)] if parts else [base / alias.name for alias in node.names]
            problems += [f"{name}: imports {target.as_posix()}, not in the zip" for target in targets
                         if not {f"{target.as_posix()}.py", f"{target.as_posix()}/__init__.py"} & names]
    return problems


@pytest.fixture(scope="module")
def packed(checkout) -> set[str]:
    """The names in the zip ``comfy node pack`` makes of the checkout."""
    result = comfy_cli(checkout, "node", "pack")
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(checkout / "node.zip") as archive:
        return set(archive.namelist())


MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def dead_links(page: str, root: Path, names: set[str]) -> list[str]:
    """Relative links of the markdown file ``page`` (in ``root``) to files that are not in ``names``."""
    problems = []
    for target in MARKDOWN_LINK.findall((root / page).read_text()):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):  # an anchor on the page, or an address
            continue
        linked = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
        if linked not in names:
            problems.append(f"{page} links {target}, which the zip leaves out")
    return problems


@needs_comfy_cli
def test_shipped_pages_link_only_to_shipped_files(checkout, packed):
    pages = sorted(name for name in packed if name.endswith(".md"))
    assert {"README.md", "docs/benchmarks.md"} <= set(pages) and "docs/architecture.md" not in packed

    assert [problem for page in pages for problem in dead_links(page, checkout, packed)] == []


@needs_comfy_cli
def test_comfy_node_pack_ships_the_nodes_and_no_development_files(checkout, packed):
    names = packed
    tracked = set(git("ls-files", cwd=checkout).splitlines())
    needed = {name for name in tracked if name.startswith(SHIPPED_DIRS)}
    needed |= {"__init__.py", "README.md", "LICENSE", "requirements.txt", "pyproject.toml"}
    assert needed - names == set(), "missing from the zip"
    assert [name for name in names if name.startswith(DEVELOPMENT_DIRS)] == []
    assert not {".comfyignore", ".gitignore", "pytest.ini"} & names
    assert missing_imports(names, checkout) == []
    assert any(name.startswith("web/docs/") and name.endswith("/en.md") for name in names)


def test_each_node_has_an_english_help_page_and_its_fallback(pack):
    """The front end asks for docs/<node>/<locale>.md first, then docs/<node>.md: English is the first,
    and the same page is the fallback for the other locales."""
    docs = REPO / "web" / "docs"
    for node in pack.nodes.NODE_CLASS_MAPPINGS:
        english = (docs / node / "en.md").read_text()
        assert english.startswith("# "), node
        assert (docs / f"{node}.md").read_text() == english, f"docs/{node}.md differs from docs/{node}/en.md"
    assert sorted(p.name for p in docs.iterdir() if p.is_dir()) == sorted(pack.nodes.NODE_CLASS_MAPPINGS)
