"""``upstream_line``: the one seam between Megatron-Bridge's lines (docs/compatibility.md).

What each seam changes is proven by the feature's own tests on both lines (``make test`` and
``make test-next``): the MoE padding (model/test_moe_padding.py), the FLOPs feed (model/test_flops.py),
``configure`` against the installed ``validate()`` (unit/test_configure.py), the CPU build (model/*).
Here: the record is decided once and read only through its fields, every field is read by some code,
and each is what the installed code offers, checked by a route independent of the detector (the source
text of the upstream definition, not its signature object)."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest

from megatron.bridge_thd.upstream.loading import load_bridge_module, load_flop_utils
from megatron.bridge_thd.upstream.line import UpstreamLine, takes_parameter, upstream_line

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "megatron"


def _source_of(function) -> str:
    return inspect.getsource(function)


def test_decided_once_and_frozen():
    line = upstream_line()
    assert upstream_line() is line
    with pytest.raises(dataclasses.FrozenInstanceError):
        line.model_takes_padding_mask = not line.model_takes_padding_mask
    assert len(line.describe()) == len(dataclasses.fields(UpstreamLine))


def test_every_seam_is_read_by_the_code():
    """A field nobody reads is a difference decided and then ignored."""
    # An attribute read (``.name``): the record's own definition and constructor name the fields without a dot.
    text = "\n".join(path.read_text() for path in SRC.rglob("*.py"))
    for field in dataclasses.fields(UpstreamLine):
        assert re.search(rf"\.{field.name}\b", text), f"no code reads upstream_line().{field.name}"


def test_each_seam_is_what_the_installed_source_says():
    line = upstream_line()
    model = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.model").Qwen3VLModel
    header = _source_of(model.forward).split(")", 1)[0]
    assert line.model_takes_padding_mask == bool(re.search(r"\bpadding_mask\b", header))
    flop_utils = load_flop_utils()
    accumulate = _source_of(flop_utils.accumulate_flops_metadata).split(") ->", 1)[0]
    assert line.flops_vision_patch_stats == ("vision_patch_stats" in accumulate)
    assert line.flops_runtime_stats_record == ("class GlobalFlopsRuntimeStats" in inspect.getsource(flop_utils))
    dispatch = load_bridge_module("models.transformer_config")._enable_safe_hybridep_dispatch
    assert line.hybridep_dispatch_takes_uses_thd == ("uses_thd" in _source_of(dispatch).split(")", 1)[0])
    assert "def torch_chunk_gated_delta_rule" in inspect.getsource(__import__(
        line.gdn_torch_rule_module, fromlist=["torch_chunk_gated_delta_rule"]))


def test_takes_parameter_ignores_kwargs():
    def f(a, *args, b=1, **kwargs):
        return a

    assert takes_parameter(f, "a") and takes_parameter(f, "b")
    assert not takes_parameter(f, "args") and not takes_parameter(f, "kwargs") and not takes_parameter(f, "c")
