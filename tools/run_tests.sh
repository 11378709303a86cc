#!/usr/bin/env bash
# Sets everything up on a fresh machine, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# The profile page's tests drive the system's Chromium (Debian's package, through Playwright): installed here where
# this runs as root with apt-get; elsewhere, without one, those tests skip and say how to get it.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get install -y -q chromium >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
        || echo "note: chromium could not be installed: the profile page's browser tests will skip"
fi
export PATH="$PWD/.venv/bin:$PATH"
# Two workers (pytest-xdist), each running whole files (tests/conftest.py groups them): most launches leave a
# core idle while their ranks start or wait on each other. PYTEST_WORKERS=0 runs in this one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${PYTEST_WORKERS:-2}" --dist loadscope \
    tests "$@"
