#!/usr/bin/env bash
# The checkers pack authors run (tests/requirements-checkers.txt: comfy-import-guard, comfy-test), from PyPI into
# .checkers/, a venv of their own (they are tools, not the test host's packages). tests/outside_checkers.py and
# tests/test_outside_checkers.py find them there. Re-installs when the pinned versions change.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.checkers"
requirements="$root/tests/requirements-checkers.txt"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
if ! cmp -s "$requirements" "$venv/.requirements"; then
  "$venv/bin/python" -m pip install -q -r "$requirements"
  cp "$requirements" "$venv/.requirements"
fi
echo "[setup-checkers] $("$venv/bin/python" -m pip freeze | grep -E '^comfy-(import-guard|test)==' | tr '\n' ' ')in $venv"
