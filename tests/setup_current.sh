#!/usr/bin/env bash
# Adds a current ComfyUI next to the pinned test host (locally, and in .ci/run where a mirror is found).
#   .comfyui-current/   ComfyUI from the mirror's HEAD (git archive), or an existing checkout left as is
#   .venv/              the test host's venv, plus what current ComfyUI needs beyond the pinned tree
# The same venv keeps serving the pinned tree; torch/torchvision stay as tests/setup_host.sh pinned them.
# Then:  export COMFYUI_PATH=<repo>/.comfyui-current   and run the tests as usual.
# Env: COMFYUI_MIRROR, a bare git dir of Comfy-Org/ComfyUI (default: the mirror beside this checkout).
# tests/setup_newest.sh runs this script for a newer tree: COMFYUI_DEST (the folder to extract into) and
# COMFYUI_KEEP_WHEELS=1 (leave the comfyui-* wheels as the venv has them: the browser tests pin the
# front end of the current tree, and the tests pass --front-end-root anyway).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
dest="${COMFYUI_DEST:-$root/.comfyui-current}"
label="setup-${dest##*/.comfyui-}"  # setup-current, setup-newest
mirror="${COMFYUI_MIRROR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.mirror/Comfy-Org+ComfyUI/repo}"
py="$venv/bin/python"

[ -x "$py" ] || bash "$root/tests/setup_host.sh"

if [ -d "$mirror" ] && rev="$(git --git-dir="$mirror" rev-parse HEAD 2>/dev/null)"; then
  if [ "$(cat "$dest/.comfyui-commit" 2>/dev/null)" != "$rev" ]; then
    echo "[$label] extracting ComfyUI $rev from $mirror"
    rm -rf "$dest.tmp" && mkdir "$dest.tmp"
    # Like `git archive HEAD`, but a snapshot may lack its largest blobs (e.g. a llama tokenizer.json):
    # check out every file whose blob is present through a throwaway index and list the others.
    index="$(mktemp)"
    GIT_INDEX_FILE="$index" git --git-dir="$mirror" read-tree HEAD
    git --git-dir="$mirror" ls-tree -r HEAD > "$index.tree"
    awk '$2 == "blob" {print $3}' "$index.tree" | git --git-dir="$mirror" cat-file --batch-check \
      | awk '$2 == "missing" {print $1}' > "$index.missing"
    awk -F '\t' 'NR == FNR {gone[$1] = 1; next} {split($1, f, " "); if (f[3] in gone) print $2}' \
      "$index.missing" "$index.tree" > "$dest.tmp/.missing-files"
    if [ -s "$dest.tmp/.missing-files" ]; then
      echo "[$label] not in the mirror, skipped: $(tr '\n' ' ' < "$dest.tmp/.missing-files")"
      GIT_INDEX_FILE="$index" git --git-dir="$mirror" update-index --force-remove --stdin < "$dest.tmp/.missing-files"
    fi
    GIT_INDEX_FILE="$index" git --git-dir="$mirror" --work-tree="$dest.tmp" checkout-index -a -f
    rm -f "$index" "$index.tree" "$index.missing"
    echo "$rev" > "$dest.tmp/.comfyui-commit"
    rm -rf "$dest" && mv "$dest.tmp" "$dest"
  fi
elif [ ! -f "$dest/main.py" ]; then
  echo "[$label] no mirror at $mirror; set COMFYUI_MIRROR, or clone ComfyUI into $dest yourself" >&2
  exit 1
fi

# The tree's requirements.txt under the host's torch/torchvision pins (constraints: pip never replaces torch).
# torchaudio is optional: installed where a wheel accepts the pinned torch (torchaudio 2.11 on accepts any later
# torch); older trees import it only in audio nodes, v0.33.0's comfy.sd imports it at the top (the import
# check below says so where it is missing).
# Packages below "#non essential" and the comfyui-* wheels (frontend, templates, docs) are optional:
# the tests pass --front-end-root, and a missing one only turns some comfy_extras into warnings.
# The stamp holds the requirements and this script: a change to either installs again.
reqs="$dest/requirements.txt"
stamp="$venv/.${dest##*/.comfyui-}-requirements"
if ! cat "$reqs" "${BASH_SOURCE[0]}" | cmp -s - "$stamp" 2>/dev/null; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  "$py" -m pip freeze 2>/dev/null | grep -iE '^(torch|torchvision)==' > "$tmp/constraints.txt"
  awk '/^#non essential/ {opt=1} /^[[:space:]]*(#|$)/ {next}
       { name=tolower($0); sub(/[<>=~!; \[].*/, "", name)
         if (name ~ /^(torch|torchvision)$/) next
         if (name ~ /^comfyui-/ && "'"${COMFYUI_KEEP_WHEELS:-}"'" != "") next
         if (opt || name ~ /^comfyui-/ || name == "torchaudio") print > "'"$tmp"'/optional.txt"; else print > "'"$tmp"'/required.txt" }' "$reqs"
  echo "[$label] installing the requirements of $dest into $venv"
  "$py" -m pip install -q -c "$tmp/constraints.txt" -r "$tmp/required.txt"
  while read -r req; do
    "$py" -m pip install -q -c "$tmp/constraints.txt" "$req" \
      || echo "[$label] WARNING: optional '$req' not installed"
  done < "$tmp/optional.txt"
  cat "$reqs" "${BASH_SOURCE[0]}" > "$stamp"
fi

# Both trees must import in this venv (each in its own process: one ComfyUI per process).
for tree in "$root/.comfyui" "$dest"; do
  if ! COMFYUI_PATH="$tree" "$py" -c 'import sys; sys.path.insert(0, sys.argv[1]); from toma_bench import comfy_host
comfy_host.import_comfy(); import nodes; assert "TomePatchModel" in nodes.NODE_CLASS_MAPPINGS' \
      "$root" > "$venv/.import-check.log" 2>&1; then
    tail -n 30 "$venv/.import-check.log" >&2
    echo "[$label] ComfyUI at $tree does not import in $venv (log: $venv/.import-check.log)" >&2
    exit 1
  fi
done
echo "[$label] ready. Run the tests against it with:"
echo "export COMFYUI_PATH=$dest"
