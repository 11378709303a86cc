#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
export PATH="$PWD/.venv/bin:$PATH"
# Two workers (pytest-xdist), each running whole files (tests/conftest.py groups them): most launches leave a
# core idle while their ranks start or wait on each other. PYTEST_WORKERS=0 runs in this one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${PYTEST_WORKERS:-2}" --dist loadscope \
    tests "$@"
