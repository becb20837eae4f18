#!/usr/bin/env bash
# Creates .venv-next: the same pins as .venv (scripts/setup_venv.sh), but Megatron-Core and
# Megatron-Bridge from the nearest source of Megatron-Bridge's 0.7 line (docs/compatibility.md):
#   MEGATRON_BRIDGE_GIT  a git directory of NVIDIA-NeMo/Megatron-Bridge that holds MEGATRON_BRIDGE_COMMIT
#   MEGATRON_LM_GIT      a git directory of NVIDIA/Megatron-LM that holds MEGATRON_LM_COMMIT
# (a clone of each repository, bare or not; README "The 0.7 line").
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MEGATRON_BRIDGE_GIT:?set MEGATRON_BRIDGE_GIT to a git directory of NVIDIA-NeMo/Megatron-Bridge (README: The 0.7 line)}"
: "${MEGATRON_LM_GIT:?set MEGATRON_LM_GIT to a git directory of NVIDIA/Megatron-LM (README: The 0.7 line)}"
MEGATRON_BRIDGE_COMMIT=${MEGATRON_BRIDGE_COMMIT:-067f987}
MEGATRON_LM_COMMIT=${MEGATRON_LM_COMMIT:-2a75ac12}
VENV=${VENV_NEXT:-.venv-next}

for pair in "$MEGATRON_BRIDGE_GIT:$MEGATRON_BRIDGE_COMMIT" "$MEGATRON_LM_GIT:$MEGATRON_LM_COMMIT"; do
    if ! git --git-dir="${pair%%:*}" cat-file -e "${pair##*:}^{commit}" 2>/dev/null; then
        echo "error: ${pair%%:*} has no commit ${pair##*:}; point the variable at a git directory that does" >&2
        exit 1
    fi
done

source scripts/find_python.sh
if [[ ! -x $VENV/bin/python ]]; then
    PYTHON=$(find_python_or_exit)
    echo "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/mlm" "$work/mbridge"
# Its docs hold images missing from the snapshot: only what installs.
git --git-dir="$MEGATRON_LM_GIT" archive "$MEGATRON_LM_COMMIT" \
    megatron pyproject.toml setup.py MANIFEST.in README.md LICENSE | tar -x -C "$work/mlm"
# The whole tree fails to archive on one docs image missing from the snapshot: only what installs.
git --git-dir="$MEGATRON_BRIDGE_GIT" archive "$MEGATRON_BRIDGE_COMMIT" \
    src pyproject.toml README.md LICENSE 3rdparty scripts examples tests | tar -x -C "$work/mbridge"

"$VENV/bin/python" -m pip install -q --upgrade pip
# Megatron-Core first (its C++ dataset helper builds in an isolated build), so that the project's
# `megatron-core>=...` is already met and PyPI's release is not installed over it.
"$VENV/bin/python" -m pip install -q "$work/mlm"
"$VENV/bin/python" -m pip install -q -e ".[test]"
"$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation "$work/mbridge"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("megatron-core", "megatron-bridge"):
    print(name, md.version(name))
PY
touch "$VENV/.installed"
