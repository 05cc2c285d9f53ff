#!/usr/bin/env bash
# The test host of 2026 (locally, and in .ci/run where a mirror is found): ComfyUI v0.33.0 (2026-08), the first
# tree with MiniMax-H3, comfy-kitchen's ops and dynamic VRAM (comfy-aimdo).
#   .comfyui-2026/   ComfyUI from the mirror's HEAD, extracted as tests/setup_current.sh extracts its tree
# The venv is the test host's (tests/setup_host.sh); the tree's requirements (comfy-kitchen, comfy-aimdo,
# blake3, simpleeval, torchaudio, which its comfy.sd imports, ...) go into it beside the older trees' (torch and
# torchvision stay pinned); its comfyui-* wheels stay as they are.
# Then the test-only requirements of kijai's ComfyUI-WanVideoWrapper (tests/requirements-wanvideowrapper.txt).
# Then:  export COMFYUI_PATH=<repo>/.comfyui-2026   and run the tests as usual.
# Env: COMFYUI_2026_MIRROR, a bare git dir of ComfyUI at v0.33.0 or later (default: the yzkee/ComfyUI mirror, a
# plain mirror of upstream, beside this checkout).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
COMFYUI_MIRROR="${COMFYUI_2026_MIRROR:-$(cd "$root/.." && pwd)/.mirror/yzkee+ComfyUI/repo}" \
COMFYUI_DEST="$root/.comfyui-2026" COMFYUI_KEEP_WHEELS=1 bash "$root/tests/setup_current.sh"

# The test-only requirements of kijai's ComfyUI-WanVideoWrapper, which tests/test_wan_video_wrapper.py loads into
# this tree from a mirror and samples (under the host's torch pins: pip never replaces torch).
py="$root/.venv/bin/python"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
"$py" -m pip freeze 2>/dev/null | grep -iE '^(torch|torchvision|torchaudio)==' > "$constraints"
"$py" -m pip install -q -c "$constraints" -r "$root/tests/requirements-wanvideowrapper.txt"

# comfy-kitchen's eager sol_attn reference (0.2.40), which tests/test_sparse_attention.py reads from the wheel (the
# tree pins an older comfy-kitchen, which stays installed): downloaded into .cache where the package index answers,
# else that test skips with the reason.
if ! ls "$root/.cache"/comfy_kitchen-0.2.4*.whl > /dev/null 2>&1; then
  "$py" -m pip download -q comfy-kitchen==0.2.40 --no-deps -d "$root/.cache" \
    || echo "[setup-2026] comfy-kitchen 0.2.40 not downloaded: test_sparse_attention's eager Sol-Attn test will skip"
fi
