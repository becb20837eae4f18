#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs the package with its test extras, plus
# megatron-bridge 0.6.2 without its dependencies (its Transformer Engine chain cannot install
# without CUDA; the tests load only its pure-torch helpers).
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
    for candidate in python3.12 "$(command -v pyenv >/dev/null 2>&1 && pyenv root)/versions/"3.12*/bin/python3.12 \
                     "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

if [[ ! -x .venv/bin/python ]]; then
    if ! PYTHON=$(find_python); then
        echo "error: Python 3.12 not found (megatron-core 0.19 needs it). Install it (for example" >&2
        echo "       'pyenv install 3.12') or put python3.12 on PATH, then run make again." >&2
        exit 1
    fi
    echo "creating .venv with $PYTHON"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -m pip install -q --no-deps "megatron-bridge==0.6.2"
touch .venv/.installed
