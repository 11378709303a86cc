#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extras.
# torch is pinned to the CPU build by default; on a CUDA machine set TORCH_SPEC, e.g. TORCH_SPEC="torch".
set -euo pipefail
cd "$(dirname "$0")/.."
python_bin=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python_bin" -m venv .venv
pip_quiet() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
pip_quiet "${TORCH_SPEC:-torch==2.13.0}"
pip_quiet -e '.[test]'
.venv/bin/python -c "import torch, deepspeed; print(f'environment ready: torch {torch.__version__}, deepspeed {deepspeed.__version__}')" 2>&1 | grep -v "real_accelerator"
