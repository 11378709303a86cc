#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
