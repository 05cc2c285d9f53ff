"""The checkers pack authors run on a pack, run on this one as a user who clones it gets it:

  comfy-import-guard check   every ``comfy.*`` name the pack uses, and every call into ``comfy.*``, resolved against
                             ComfyUI v0.33.0 (the mirror's HEAD, offline): the verdict must be SAFE (--strict: a
                             WARN fails too)
  comfy-test lint            its static checks (syntax: forbidden torch patterns, cp1252 sources, a dependency file;
                             javascript: the web/ extensions' names) must pass (--strict: a JavaScript warning fails
                             too)

Both read the whole folder (neither reads .comfyignore), so they get the pack's tracked files plus the untracked ones
git does not ignore (what a commit would ship; uncommitted edits count), copied into
``<tmp>/ComfyUI/custom_nodes/ComfyUI-ToMA`` as a ``git clone`` there would place them. Their pinned versions are in
tests/requirements-checkers.txt; tests/setup_checkers.sh installs them into .checkers/ (a venv of their own). .ci/run
runs that and this file; tests/test_outside_checkers.py runs the same checks where the tools are installed.

    .venv/bin/python tests/outside_checkers.py [--tools .checkers/bin]

prints one line per checker and exits 1 when either gives a bad verdict (its report follows the line), 2 when one
could not run (a tool or the ComfyUI mirror missing).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / ".checkers" / "bin"  # where tests/setup_checkers.sh installs tests/requirements-checkers.txt
INSTALL = "bash tests/setup_checkers.sh installs the pinned versions"
PACK_FOLDER = "ComfyUI-ToMA"  # the folder `git clone` of the repository makes
MIRROR_VARIABLE, MIRROR_REPO = "COMFYUI_2026_MIRROR", "yzkee+ComfyUI"  # ComfyUI v0.33.0, as tests/setup_2026.sh


@dataclass
class Verdict:
    passed: bool
    line: str    # one line: the tool, its version, what it checked against, its verdict
    report: str  # the tool's own report, for when it fails


def executable(name: str, tools: Path | None = None) -> Path | None:
    """``name`` in ``tools`` (default .checkers/bin), else beside this Python, else on PATH; None where none is."""
    for folder in (tools or TOOLS, Path(sys.executable).parent):
        if (folder / name).is_file():
            return folder / name
    found = shutil.which(name)
    return Path(found) if found else None


def comfyui_mirror() -> Path | None:
    """The bare git mirror of ComfyUI v0.33.0: $COMFYUI_2026_MIRROR, else .mirror/yzkee+ComfyUI/repo in the
    checkout's parent folder or any folder above it (as .ci/run finds it)."""
    if os.environ.get(MIRROR_VARIABLE):
        return Path(os.environ[MIRROR_VARIABLE])
    for folder in REPO.parents:
        if (folder / ".mirror" / MIRROR_REPO / "repo").is_dir():
            return folder / ".mirror" / MIRROR_REPO / "repo"
    return None


def git(*args: str, cwd: Path = REPO) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def user_clone(root: Path) -> Path:
    """The pack's files as a user's ``git clone`` into ``root``/ComfyUI/custom_nodes gets them; the pack's folder."""
    pack = root / "ComfyUI" / "custom_nodes" / PACK_FOLDER
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not shipped
            (pack / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, pack / name)
    return pack


def comfyui_clone(mirror: Path, cache: Path) -> str:
    """A clone of ``mirror`` where comfy-import-guard looks for its ComfyUI (<cache>/ComfyUI/.git), so it runs
    offline; the commit to check against (the mirror's HEAD). The tool reads the commit's files through git, so no
    work tree is needed: a sparse checkout of one file, as a mirror may lack its largest blobs (tokenizer files)."""
    clone = cache / "ComfyUI"
    git("clone", "--quiet", "--shared", "--no-checkout", str(mirror), str(clone), cwd=cache)
    git("sparse-checkout", "set", "--no-cone", "/LICENSE", cwd=clone)
    git("checkout", "--quiet", cwd=clone)
    return git("rev-parse", "HEAD", cwd=clone).strip()


def version(tool: Path, package: str) -> str:
    """The installed version of ``package``, read by the tool's own Python."""
    python = tool.parent / "python"
    if not python.is_file():
        return "(version unknown)"
    script = f"from importlib.metadata import version; print(version({package!r}))"
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
    return done.stdout.strip() or "(version unknown)"


def import_guard(tool: Path, mirror: Path, root: Path) -> Verdict:
    """comfy-import-guard check --strict of the pack in ``root``/ComfyUI against the mirror's HEAD."""
    cache = root / "import-guard-cache"
    cache.mkdir()
    commit = comfyui_clone(mirror, cache)
    done = subprocess.run([str(tool), "--cache-dir", str(cache), "--offline", "--quiet", "check", "--strict",
                           "--comfy-dir", str(root / "ComfyUI"), "--target", commit, "--json"],
                          capture_output=True, text=True)
    head = f"comfy-import-guard {version(tool, 'comfy-import-guard')} check against ComfyUI {commit[:9]}"
    try:
        (pack,) = json.loads(done.stdout)["packs"]
    except (ValueError, KeyError, TypeError):
        return Verdict(False, f"{head}: no report (exit {done.returncode})", done.stdout + done.stderr)
    line = (f"{head}: {pack['pack']} {pack['verdict']} ({pack['python_files']} python files, "
            f"{pack['references']} comfy.* references)")
    findings = [f"{kind} {row['dotted']} at {row['file']}:{row['line']} {row.get('detail') or ''}".rstrip()
                for kind in ("breaking", "soft", "unresolvable", "signature_drift") for row in pack[kind]]
    findings += [f"unparsed {row['file']}: {row['error']}" for row in pack["unparseable"]]
    passed = done.returncode == 0 and pack["verdict"] == "SAFE"
    return Verdict(passed, line, "\n".join(filter(None, findings + [pack["note"]])) if not passed else "")


def lint(tool: Path, pack: Path) -> Verdict:
    """comfy-test lint --strict of ``pack``."""
    done = subprocess.run([str(tool), "lint", "--strict", "--json", str(pack)], capture_output=True, text=True)
    head = f"comfy-test {version(tool, 'comfy-test')} lint"
    try:
        results = json.loads(done.stdout)["results"]
    except (ValueError, KeyError, TypeError):
        return Verdict(False, f"{head}: no report (exit {done.returncode})", done.stdout + done.stderr)
    states = ", ".join(f"{check.upper()} {'PASSED' if r['passed'] else 'FAILED'}" for check, r in results.items())
    failed = [f"[{check.upper()}] {r.get('error')}\n{r.get('details') or ''}" for check, r in results.items()
              if not r["passed"]]
    passed = done.returncode == 0 and not failed
    report = "\n".join(failed) or done.stdout + done.stderr
    return Verdict(passed, f"{head}: {states}", "" if passed else report)


CHECKERS = ("comfy-import-guard", "comfy-test")


def run(tools: Path | None = None, checkers: tuple = CHECKERS) -> dict[str, Verdict | str]:
    """Each of ``checkers``' Verdict, or why it could not run."""
    out: dict[str, Verdict | str] = {}
    with tempfile.TemporaryDirectory(prefix="toma_outside_checkers_") as folder:
        root = Path(folder)
        pack = user_clone(root)
        for name in checkers:
            tool = executable(name, tools)
            mirror = comfyui_mirror()
            if tool is None:
                out[name] = f"{name} is not installed ({INSTALL})"
            elif name == "comfy-test":
                out[name] = lint(tool, pack)
            elif mirror is None or not mirror.is_dir():
                out[name] = (f"no ComfyUI v0.33.0 mirror ({MIRROR_VARIABLE} unset or not a folder; no "
                             f".mirror/{MIRROR_REPO}/repo beside or above {REPO})")
            else:
                out[name] = import_guard(tool, mirror, root)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", type=Path, default=None,
                        help=f"the folder of the checkers' executables (default: {TOOLS.relative_to(REPO)}, "
                             "then beside this Python, then PATH)")
    args = parser.parse_args()
    verdicts = run(args.tools)
    for name, verdict in verdicts.items():
        if isinstance(verdict, str):
            print(f"[outside] {name}: not run: {verdict}")
            continue
        print(f"[outside] {verdict.line}: {'pass' if verdict.passed else 'FAIL'}")
        if not verdict.passed:
            print(verdict.report)
    if any(isinstance(v, Verdict) and not v.passed for v in verdicts.values()):
        return 1
    return 2 if any(isinstance(v, str) for v in verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
