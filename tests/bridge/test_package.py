"""``bridge_thd_cpu.bridge_package``: Megatron-Bridge imported whole on a machine without Transformer Engine
or nvidia-resiliency-ext, under the module's four rules (docs/megatron-bridge-on-cpu.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

from _fresh_bridge import fresh_bridge_process  # noqa: E402


@pytest.fixture(scope="module")
def inspected():
    return fresh_bridge_process()["package"]


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

    from megatron.bridge_thd_cpu import bridge_package

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))
    assert "transformer_engine" not in bridge_package.stood_in_packages()


def test_refused_after_a_bare_load(monkeypatch):
    import sys
    import types

    from megatron.bridge_thd_cpu.bridge_package import bridge_package

    monkeypatch.setitem(sys.modules, "megatron.bridge", types.ModuleType("megatron.bridge"))  # no __file__
    with pytest.raises(RuntimeError, match="already loaded without its __init__"):
        with bridge_package():
            pass


def test_every_training_patch_is_listed_in_docs_and_the_module_docstring(inspected):
    """``bridge_thd_testbed.training``'s records need Megatron-Bridge whole, so tests/unit/test_patches.py cannot
    build them in the suite's process: they are built in the fresh one and checked here."""
    import pathlib
    import re

    from megatron.bridge_thd.upstream import patches

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "patches.md").read_text()
    records = inspected["training_patches"]
    assert len(records) >= 25
    for target, why, in_sys_modules, name in records:
        assert why, target
        assert f"`{target}`" in doc, f"docs/patches.md does not list {target}"
        if name != "torch":  # the trainer modules' torch is named once, as TRAINER_MODULES, in the docstring
            assert re.search(rf"``[\w.]*\b{name}``", patches.__doc__), f"patches' docstring does not list {target}"
    assert "``TRAINER_MODULES``" in patches.__doc__
