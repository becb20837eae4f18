"""``testbed.bridge_package``: Megatron-Bridge imported whole on a machine without Transformer Engine
or nvidia-resiliency-ext, under the module's four rules (docs/megatron-bridge-on-cpu.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

from megatron.bridge_thd.testbed.launcher import run_on_gloo  # noqa: E402


def _inspect_import():
    import sys

    from megatron.bridge_thd.testbed.bridge_package import StandInCalled, is_stand_in, stood_in_packages

    import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block as qwen3_vl_block
    import megatron.bridge.peft.lora_layers as lora_layers
    import megatron.bridge.training.comm_overlap as comm_overlap
    import megatron.bridge.training.finetune  # noqa: F401 - pretrain imports nvidia_resiliency_ext
    import megatron.core.extensions.transformer_engine as mcore_te
    import megatron.core.tensor_parallel.random as mcore_random

    holders = sorted(name for name, module in list(sys.modules.items())
                     if any(is_stand_in(value) for value in list(getattr(module, "__dict__", {}).values())))
    try:
        lora_layers.te.Linear(4, 4)
        called = "no error"
    except StandInCalled as error:
        called = str(error)
    try:
        import transformer_engine  # noqa: F401
        absent = False
    except ImportError:
        absent = True
    return {
        "stood_in": stood_in_packages(),
        "holders": holders,
        "resident": sorted(n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "nvidia_resiliency_ext")),
        "have_te": {"megatron.core.extensions.transformer_engine": mcore_te.HAVE_TE,
                    "megatron.bridge.training.comm_overlap": comm_overlap.HAVE_TE,
                    "modelling_qwen3_vl.transformer_block": qwen3_vl_block.HAVE_TE,
                    "megatron.core.tensor_parallel.random": getattr(mcore_random, "HAVE_TE", False)},
        "called": called,
        "absent_in_block": absent,
        "package_file": sys.modules["megatron.bridge"].__file__,
    }


@pytest.fixture(scope="module")
def inspected():
    return run_on_gloo(_inspect_import, whole_bridge=True, initialize=False, timeout=240)[0]


def test_the_whole_package_is_imported(inspected):
    assert inspected["package_file"].endswith("megatron/bridge/__init__.py")
    assert set(inspected["stood_in"]) == {"transformer_engine", "nvidia_resiliency_ext"}


def test_only_unguarded_megatron_bridge_imports_got_the_stand_in(inspected):
    assert inspected["holders"] == ["megatron.bridge.peft.lora_layers", "megatron.bridge.training.pretrain"]
    assert not any(inspected["have_te"].values()), inspected["have_te"]


def test_a_stand_in_raises_when_called(inspected):
    assert "transformer_engine.pytorch.Linear is an import-time stand-in" in inspected["called"]


def test_the_stand_in_never_stays_in_sys_modules(inspected):
    assert inspected["resident"] == []
    assert inspected["absent_in_block"]


def test_an_installed_package_is_never_stood_in(monkeypatch):
    import importlib.util

    from megatron.bridge_thd.testbed import bridge_package

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    assert "transformer_engine" not in bridge_package.stood_in_packages()


def test_refused_after_a_bare_load(monkeypatch):
    import sys
    import types

    from megatron.bridge_thd.testbed.bridge_package import bridge_package

    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))  # no __file__
    with pytest.raises(RuntimeError, match="already loaded without its __init__"):
        with bridge_package():
            pass
