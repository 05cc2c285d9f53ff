#!/usr/bin/env bash
# The project's test command: builds/refreshes the pinned test host, then runs pytest with the given args.
#   bash tests/run.sh                 # everything
#   bash tests/run.sh -m "not server" # pytest options pass through
# pytest's exit status is returned unchanged (5 = no tests collected is a failure).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tests/setup_host.sh
exec .venv/bin/python -m pytest "$@"
