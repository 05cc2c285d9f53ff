#!/usr/bin/env bash
# A third test host (locally, and in .ci/run where a mirror is found), ComfyUI v0.3.75 (Nov 2025), the
# first tree with Z-Image, Flux.2 and HunyuanVideo 1.5 (and Lumina 2, HiDream as before).
#   .comfyui-newest/   ComfyUI from the mirror's HEAD, extracted as tests/setup_current.sh extracts its tree
# The venv is the test host's (tests/setup_host.sh); its comfyui-* wheels stay as they are.
# Then:  export COMFYUI_PATH=<repo>/.comfyui-newest   and run the tests as usual; the tests of families a
# tree lacks skip with the reason.
# Env: COMFYUI_NEWEST_MIRROR, a bare git dir of ComfyUI at v0.3.75 or later (default: the rattus128/ComfyUI
# mirror beside this checkout, a fork that tracks upstream at that release).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMFYUI_MIRROR="${COMFYUI_NEWEST_MIRROR:-$(cd "$root/.." && pwd)/.mirror/rattus128+ComfyUI/repo}" \
COMFYUI_DEST="$root/.comfyui-newest" COMFYUI_KEEP_WHEELS=1 exec bash "$root/tests/setup_current.sh"
