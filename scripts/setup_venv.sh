#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs the package with its test extras, plus
# megatron-bridge 0.6.2 without its dependencies (its Transformer Engine chain cannot install
# without CUDA; the tests load only its pure-torch helpers).
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/find_python.sh
if [[ ! -x .venv/bin/python ]]; then
    PYTHON=$(find_python_or_exit)
    echo "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps "megatron-bridge==0.6.2"
touch .venv/.installed
