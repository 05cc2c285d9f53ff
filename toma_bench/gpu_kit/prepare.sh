#!/usr/bin/env bash
# Fills the git-ignored .device/ with the GPU benchmark kit (at most 48 MiB), for a CUDA machine that has
# Python 3.12, torch and gpu-host-packages.txt but no ComfyUI and no network (docs/notebook.md):
#   .device/comfyui/   ComfyUI's code (its *.py files, without its tests): the current tree from the mirror
#                      tests/setup_current.sh uses (COMFYUI_MIRROR, default beside this checkout), else the
#                      pinned .comfyui tree (no Flux: the benchmark then skips Flux with a note)
#   .device/wheels/    CPython 3.12 x86-64 wheels of kit-requirements.txt
#   .device/run.sh     installs those wheels with --no-index and runs python -m toma_bench.gpu
# Then on the GPU machine, from the repo root: bash .device/run.sh        (here: bash .device/run.sh --dry-run)
# Safe to run again: only what changed is redone.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
kit="$root/.device"
mirror="${COMFYUI_MIRROR:-$(cd "$root/.." && pwd)/.mirror/Comfy-Org+ComfyUI/repo}"
py="${PYTHON:-python3}"
limit_mib=48
mkdir -p "$kit"

# -- ComfyUI's code ------------------------------------------------------------------------------------
if [ -d "$mirror" ] && rev="$(git --git-dir="$mirror" rev-parse HEAD 2>/dev/null)"; then
  source="mirror $rev"
elif [ -f "$root/.comfyui/main.py" ]; then
  source="pinned $(cd "$root/.comfyui" && find . -name '*.py' -not -path './tests*' | sort | xargs cat | md5sum | cut -c1-12)"
else
  echo "[device] no ComfyUI mirror at $mirror and no pinned tree at $root/.comfyui" \
       "(set COMFYUI_MIRROR, or run tests/setup_host.sh)" >&2
  exit 1
fi
if [ "$(cat "$kit/comfyui/.comfyui-source" 2>/dev/null)" != "$source" ]; then
  rm -rf "$kit/comfyui.tmp" && mkdir -p "$kit/comfyui.tmp"
  if [ "${source%% *}" = mirror ]; then
    echo "[device] ComfyUI $rev from $mirror (code only)"
    # a throwaway index, as in tests/setup_current.sh: the snapshot may lack large non-code blobs
    index="$(mktemp)"
    GIT_INDEX_FILE="$index" git --git-dir="$mirror" read-tree HEAD
    GIT_INDEX_FILE="$index" git --git-dir="$mirror" ls-files -- '*.py' ':!:tests/*' ':!:tests-unit/*' \
      | GIT_INDEX_FILE="$index" git --git-dir="$mirror" --work-tree="$kit/comfyui.tmp" checkout-index -f --stdin
    rm -f "$index"
    echo "$rev" > "$kit/comfyui.tmp/.comfyui-commit"
  else
    echo "[device] no ComfyUI mirror at $mirror: packing the pinned tree $root/.comfyui (no Flux)"
    (cd "$root/.comfyui" && find . -name '*.py' -not -path './tests*' -print0 | tar --null -T - -cf -) \
      | tar -xf - -C "$kit/comfyui.tmp"
  fi
  echo "$source" > "$kit/comfyui.tmp/.comfyui-source"
  rm -rf "$kit/comfyui" && mv "$kit/comfyui.tmp" "$kit/comfyui"
fi

# -- wheels ----------------------------------------------------------------------------------------------
if ! cmp -s "$here/kit-requirements.txt" "$kit/wheels/.requirements" 2>/dev/null; then
  echo "[device] downloading CPython 3.12 x86-64 wheels of toma_bench/gpu_kit/kit-requirements.txt"
  rm -rf "$kit/wheels" && mkdir -p "$kit/wheels"
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$kit/wheels" -r "$here/kit-requirements.txt"
  cp "$here/kit-requirements.txt" "$kit/wheels/.requirements"
fi

# -- scripts -----------------------------------------------------------------------------------------------
cp "$here/run.sh" "$kit/run.sh"
cp "$here/gpu-host-packages.txt" "$kit/gpu-host-packages.txt"

size_kib="$(du -sk "$kit" | cut -f1)"
if [ "$size_kib" -gt $((limit_mib * 1024)) ]; then
  echo "[device] .device/ holds $((size_kib / 1024)) MiB, over the kit's $limit_mib MiB" >&2
  exit 1
fi
echo "[device] kit ready in .device/ ($((size_kib / 1024)) MiB; ComfyUI: $source)"
echo "[device] on the GPU machine, from the repo root: bash .device/run.sh   (CPU check here: bash .device/run.sh --dry-run)"
