"""The package lives in the shared ``megatron`` namespace without shadowing its neighbours."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import megatron
import megatron.bridge_thd
import megatron.core

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_no_megatron_init_file():
    # An __init__.py here would turn 'megatron' into a regular package and hide megatron.core.
    assert not (REPO / "src" / "megatron" / "__init__.py").exists()


def test_megatron_is_a_namespace_spanning_both_installations():
    # A namespace package has no __file__; megatron.core still comes from its own installation.
    assert getattr(megatron, "__file__", None) is None
    core_dir = pathlib.Path(megatron.core.__file__).resolve().parent
    assert core_dir.parent in [pathlib.Path(p).resolve() for p in megatron.__path__]
    assert not core_dir.is_relative_to(REPO / "src")
    assert pathlib.Path(megatron.bridge_thd.__file__).resolve().parent.name == "bridge_thd"


def test_megatron_bridge_resolves_to_the_installed_package():
    spec = importlib.util.find_spec("megatron.bridge")
    assert spec is not None
    assert not pathlib.Path(list(spec.submodule_search_locations)[0]).resolve().is_relative_to(REPO / "src")


def test_bridge_helpers_load_without_transformer_engine():
    # In a fresh interpreter: the loader must reach Megatron-Bridge's real loss module without
    # running megatron/bridge/__init__.py (which imports Transformer Engine).
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('transformer_engine') is None\n"
        "from megatron.bridge_thd.upstream import load_bridge_module\n"
        "losses = load_bridge_module('training.losses')\n"
        "assert hasattr(losses, 'create_masked_next_token_loss_function')\n"
        "assert 'megatron.bridge.models' not in sys.modules\n"
        "print(losses.__file__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("megatron/bridge/training/losses.py")
