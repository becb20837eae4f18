"""One mechanism for every patch of an upstream name (``megatron.bridge_thd.upstream.patches``), and one
list of them (docs/patches.md) that names every record the code builds."""

from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest

from megatron.bridge_thd.upstream import patches
from megatron.bridge_thd.upstream.patches import Patch, applied, apply_permanently

DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "patches.md").read_text()


def _module(**names):
    module = types.ModuleType("owner")
    module.__dict__.update(names)
    return module


def test_applied_sets_for_the_block_and_restores_every_name():
    owner = _module(a=1)
    with applied([Patch(owner, "a", 2, "x"), Patch(owner, "b", 3, "new name"),
                  Patch(sys.modules, "bridge_thd_test_placeholder", owner, "mapping owner")]):
        assert (owner.a, owner.b) == (2, 3) and sys.modules["bridge_thd_test_placeholder"] is owner
    assert owner.a == 1 and not hasattr(owner, "b") and "bridge_thd_test_placeholder" not in sys.modules


def test_applied_is_reentrant_the_outer_block_wins_and_restores():
    owner = _module(a=1)
    with applied([Patch(owner, "a", 2, "outer")]):
        with applied([Patch(owner, "a", 3, "inner"), Patch(owner, "c", 4, "inner only")]):
            assert owner.a == 2 and owner.c == 4  # the enclosing block's value is kept
        assert owner.a == 2 and not hasattr(owner, "c")
    assert owner.a == 1


def test_applied_restores_on_an_exception():
    owner = _module(a=1)
    with pytest.raises(RuntimeError):
        with applied([Patch(owner, "a", 2, "x")]):
            raise RuntimeError("boom")
    assert owner.a == 1 and not patches._active


def test_apply_permanently_is_idempotent_and_returns_the_original():
    owner = _module(f=len)
    patch = Patch(owner, "f", abs, "x")
    assert apply_permanently(patch) is len and owner.f is abs
    assert apply_permanently(patch) is len and owner.f is abs


def test_targets_name_the_owner():
    assert Patch(sys.modules, "omegaconf", None, "").target == "sys.modules['omegaconf']"
    assert Patch(Patch, "target", None, "").target == "megatron.bridge_thd.upstream.patches.Patch.target"
    assert Patch(types, "ModuleType", None, "").target == "types.ModuleType"


def _every_record() -> list[Patch]:
    from megatron.bridge_thd.upstream import loading as upstream
    from megatron.bridge_thd_testbed.qwen25_vl import _OmegaConfPlaceholder  # noqa: F401 - the module loads
    from megatron.bridge_thd_cpu.stack import cpu_patches

    from megatron.bridge_thd_testbed.launcher import without_modelopt

    records = cpu_patches() + upstream._flop_utils_placeholders() + upstream._theoretical_memory_utils_placeholders() + [without_modelopt()]
    # qwen25_vl_import_patches() is empty where omegaconf is installed; its one record by name:
    records.append(Patch(sys.modules, "omegaconf", None, "qwen25_vl_import_patches"))
    # batching.bridge.loader_patch() and overlong.collate_patch() need Megatron-Bridge imported whole
    # (tests/bridge/test_recipes.py, tests/bridge/test_overlong_samples.py apply them there); their records by name:
    import types

    records.append(Patch(types.ModuleType("megatron.bridge.data.loaders"), "build_train_valid_test_data_loaders", None,
                         "batching.bridge.loader_patch"))
    records.append(Patch(types.ModuleType("megatron.bridge.models.qwen_vl.data.collate_fn"), "prepare_sequence_batch",
                         None, "overlong.collate_patch"))
    records.append(Patch(types.ModuleType("megatron.bridge.training.pretrain"), "_pretrain", None,
                         "packing_log.pretrain_patch"))
    from megatron.bridge_thd.upstream.pinning import visual_inputs_pin_patch

    records.append(visual_inputs_pin_patch())
    return records


def test_every_patch_the_code_builds_is_listed_in_docs_and_the_module_docstring():
    records = _every_record()
    assert len(records) >= 20
    for record in records:
        assert record.why, record.target
        assert f"`{record.target}`" in DOC, f"docs/patches.md does not list {record.target}"
        named = re.escape(record.target) if record.owner is sys.modules else rf"[\w.]*\b{record.name}"
        assert re.search(f"``{named}``", patches.__doc__), f"megatron.bridge_thd.upstream.patches' docstring does not list {record.target}"


def test_qwen25_vl_import_patches_is_one_placeholder_only_without_omegaconf(monkeypatch):
    import importlib.util

    from megatron.bridge_thd_testbed import qwen25_vl

    monkeypatch.delitem(sys.modules, "omegaconf", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "omegaconf" else real_find_spec(name, *a))
    (record,) = qwen25_vl.qwen25_vl_import_patches()
    assert record.target == "sys.modules['omegaconf']"
    with applied([record]):
        from omegaconf import OmegaConf

        with pytest.raises(ModuleNotFoundError, match="omegaconf is not installed"):
            OmegaConf.create({})
    assert "omegaconf" not in sys.modules


def test_cpu_stack_gives_each_te_class_upstream_tests_with_isinstance_a_type():
    """Where the installed upstream tests a Transformer Engine class with ``isinstance`` (``upstream_line()``)
    and that class is a ``MagicMock`` (no TE), ``cpu_stack`` binds a real type for the block: the Qwen3-VL
    attention's ``TEDotProductAttention`` is the CPU THD attention, the MTP layer's inference linears are
    classes no object is an instance of (and none can be built); every name is restored on exit."""
    from megatron.core.tensor_parallel import inference_layers
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron.bridge_thd.upstream.loading import load_bridge_module
    from megatron.bridge_thd.upstream.line import upstream_line
    from megatron.bridge_thd_cpu.attention import THDCoreAttention
    from megatron.bridge_thd_cpu.stack import QWEN3_VL_ATTENTION_MODULE, cpu_patches, cpu_stack

    line, attention = upstream_line(), load_bridge_module(QWEN3_VL_ATTENTION_MODULE)
    linears = ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")
    mocked = [name for name in linears if not isinstance(getattr(inference_layers, name), type)]
    targets = {record.target for record in cpu_patches()}
    assert (f"{attention.__name__}.TEDotProductAttention" in targets) == line.qwen3_vl_attention_tests_te_attention
    expected = set(mocked) if line.mtp_tests_inference_linear else set()
    assert {name for name in linears if f"{inference_layers.__name__}.{name}" in targets} == expected

    names = [(inference_layers, name) for name in linears] + [(attention, "TEDotProductAttention")]
    before = [getattr(owner, name, None) for owner, name in names]
    with cpu_stack():
        if line.qwen3_vl_attention_tests_te_attention:
            assert attention.TEDotProductAttention is THDCoreAttention
        if line.mtp_tests_inference_linear:
            assert all(isinstance(getattr(inference_layers, name), type) for name in linears)
            assert not inference_layers.is_inference_column_parallel_linear(object.__new__(ColumnParallelLinear))
            for name in mocked:
                with pytest.raises(TypeError, match="Transformer Engine"):
                    getattr(inference_layers, name)()
    assert all(getattr(owner, name, None) is value for (owner, name), value in zip(names, before))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the stance is set only where there is no CUDA")
def test_cpu_stack_runs_compiled_functions_eagerly_and_restores_the_stance():
    """Inside ``cpu_stack`` a ``torch.compile`` function (Megatron's ``@jit_fuser``) runs its original: the compiler
    backend is never called, for a function compiled before the block or one of Megatron's own; outside the block
    (before and after it) the same function is compiled again (docs/patches.md)."""
    import torch
    from megatron.core.jit import jit_fuser

    from megatron.bridge_thd_cpu.stack import cpu_stack

    compiled = []

    def counting_backend(graph_module, example_inputs):
        compiled.append(graph_module)
        return graph_module.forward

    @torch.compile(backend=counting_backend)
    def scaled(x):
        return x * 2 + 1

    x = torch.arange(4.0)
    torch._dynamo.reset()
    with cpu_stack():
        assert torch.equal(scaled(x), x * 2 + 1)
        with cpu_stack():  # re-entrant: the inner block leaves the outer one's stance
            scaled(x + 1)
        scaled(x + 2)
        assert hasattr(jit_fuser(lambda y: y + 1), "_torchdynamo_orig_callable")  # Megatron's @jit_fuser compiles
    assert compiled == []
    assert torch.equal(scaled(x), x * 2 + 1)
    assert len(compiled) == 1
