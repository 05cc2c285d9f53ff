#!/usr/bin/env bash
# The GPU benchmark in one command (copied to .device/run.sh by toma_bench/gpu_kit/prepare.sh). From the repo root:
#   bash .device/run.sh [toma_bench.gpu options]             on the GPU machine: python3 with torch (CUDA)
#   bash .device/run.sh --dry-run [toma_bench.gpu options]   here: the CPU at tiny sizes, in a fresh venv
# Installs .device/wheels with --no-index (no network) into a temporary folder, points COMFYUI_PATH at
# .device/comfyui and runs python -m toma_bench.gpu, which writes gpu_bench.md and gpu_bench.json to $OUT
# (else ./gpu-results). The dry run's venv stands in for the GPU machine: torch ($DRY_RUN_TORCH) and
# gpu-host-packages.txt come from this machine's package cache, everything else only from .device/.
set -euo pipefail
kit="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$kit/.." && pwd)"
py="${PYTHON:-python3}"
dry_run=0
for arg in "$@"; do
  [ "$arg" = --dry-run ] && dry_run=1
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ "$dry_run" = 1 ]; then
  echo "[run] dry run: fresh virtual environment in $work/venv"
  "$py" -m venv "$work/venv"
  py="$work/venv/bin/python"
  grep -v '^#' "$kit/gpu-host-packages.txt" | grep . > "$work/host.txt"
  "$py" -m pip install -q --no-compile "${DRY_RUN_TORCH:-torch==2.14.1}" -r "$work/host.txt"
fi
"$py" -c 'import torch, torchvision' || { echo "[run] $py lacks torch or torchvision" >&2; exit 1; }
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$kit"/wheels/*.whl
export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
export COMFYUI_PATH="$kit/comfyui"
export PYTHONUNBUFFERED=1
cd "$root"
"$py" -m toma_bench.gpu --out "${OUT:-$root/gpu-results}" "$@"
