#!/usr/bin/env bash
# Where the project's device procedure starts (the developers' guide names this path): the GPU kit lives
# with the GPU benchmark, in toma_bench/gpu_kit/; this fills .device/ with it.
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/toma_bench/gpu_kit/prepare.sh" "$@"
