# Sourced by the venv scripts: the Python 3.12 interpreter Megatron-Core needs.
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

find_python_or_exit() {
    if ! find_python; then
        echo "error: Python 3.12 not found (megatron-core needs it). Install it (for example" >&2
        echo "       'pyenv install 3.12') or put python3.12 on PATH, then run make again." >&2
        exit 1
    fi
}
