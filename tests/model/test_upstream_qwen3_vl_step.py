# Copyright (c) 2026, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""Megatron-Bridge's own unit tests for what our step replaces, run against theirs and against ours.

Taken from https://github.com/NVIDIA-NeMo/Megatron-Bridge at commit
067f987df03b8355b03192d88d70f1709fedf51a (main, 2026-08-22), Apache-2.0 (header above kept):

* ``tests/unit_tests/models/qwen_vl/test_qwen3_vl_step.py``, whole (byte-identical at tag v0.6.0): the step's
  batch reader (``get_batch_from_iterator``) and ``forward_step``;
* ``tests/unit_tests/data/packing/test_in_batch.py``, whole: the in-batch packer that turns a right-padded
  ``(B, T)`` batch into one THD row (what the step's packing does).

Not taken: ``tests/unit_tests/training/test_vlm_step.py`` and ``training/utils/test_packed_seq_utils.py`` (the
generic VLM step and the helpers under it, which our step does not replace), Energon's tests (dataset plumbing).

Every test body is upstream's, unchanged, and runs twice: ``theirs`` (the installed ``megatron.bridge`` module,
loaded on the CPU without its package ``__init__``: ``megatron.bridge_thd.upstream.load_bridge_module``) and
``ours``. Only the entry points changed: the module-level names the bodies use (``forward_step``,
``get_batch_from_iterator``, the packers, and the ``monkeypatch`` seams of their step module) are fixtures here
that give theirs as they are, or ours behind an adapter (section "Entry points"). Upstream's module mark
``pytest.mark.unit`` is dropped (the folder gives the area mark, tests/conftest.py). Where ours differs on
purpose the case is ``xfail(strict=True)`` for ours with the reason; docs/upstream-tests.md lists every case.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from _real_model import FakeGroup

from megatron.bridge_thd.upstream.patches import Patch, applied
from megatron.bridge_thd.upstream.loading import load_bridge_module, load_flop_utils

STEP_MODULE = "megatron.bridge.models.qwen_vl.qwen3_vl_step"
IMPLEMENTATIONS = ("theirs", "ours")


# ---------------------------------------------------------------------------------------------
# Entry points: theirs as installed, ours behind adapters

def _their_step_module() -> types.ModuleType:
    """Their ``qwen3_vl_step``, loaded without the package ``__init__`` (which needs Transformer Engine): its
    ``flop_utils`` import goes through ``load_flop_utils``, and the two modules it imports only for type
    annotations (``ConfigContainer``, ``GlobalState``), whose import chains need TE, are placeholders for the
    duration of the import."""
    if STEP_MODULE in sys.modules:
        return sys.modules[STEP_MODULE]
    load_flop_utils()
    placeholders = []
    for relative, name in (("training.config", "ConfigContainer"), ("training.state", "GlobalState")):
        full = f"megatron.bridge.{relative}"
        module = types.ModuleType(full)
        setattr(module, name, type(name, (), {}))
        placeholders.append(Patch(sys.modules, full, module, f"qwen3_vl_step imports {name} for annotations only"))
    with applied(placeholders):
        return load_bridge_module("models.qwen_vl.qwen3_vl_step")


def _their_packer() -> types.ModuleType:
    return load_bridge_module("data.packing.in_batch")


# Qwen3-VL's vision token ids (Hugging Face's Qwen3-VL config); the text-only upstream batches contain none.
_QWEN3_VL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                           spatial_merge_size=2)


class _ModelChunk(torch.nn.Module):
    """What our step needs of a model chunk beyond upstream's fakes: a parameter (the device the row is copied
    to) and ``config`` with the family's token ids (our step computes MRoPE itself). Calls the test's model."""

    def __init__(self, model, config):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(0))
        self.config = config
        self.inner = model

    def forward(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None, packed_seq_params=None):
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                          labels=labels, loss_mask=loss_mask, packed_seq_params=packed_seq_params)


class _ChunkTakingPaddingMask(_ModelChunk):
    """A chunk whose ``forward`` declares ``padding_mask`` (as newer ``Qwen3VLModel``s do), so our step hands it
    the MoE padding mask: what upstream's packer emits with ``emit_padding_mask=True``."""

    def forward(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None, packed_seq_params=None,
                padding_mask=None):
        raise AssertionError("the packer's adapter never calls the model")


def _chunk_config(config=None, **settings) -> SimpleNamespace:
    fields = {name: value for name, value in vars(config).items()} if config is not None else {}
    if config is not None:
        fields.update({name: getattr(config, name) for name in dir(type(config)) if not name.startswith("__")})
    return SimpleNamespace(**{**_QWEN3_VL_TOKEN_IDS, **fields, **settings})


class _OurSeams:
    """Upstream's ``monkeypatch.setattr("...qwen3_vl_step.NAME", value)`` seams, pointed at ours.

    Where ours calls the same Megatron function through another module, the patch goes there; the names ours has
    no counterpart for are recorded for the entry-point adapter (``get_batch``: the batch the step reads;
    ``get_model_config``: the model chunk's config) or have nothing to replace (``_pad_and_pack_qwen3_vl_step``:
    what our step replaces, so ours packs; ``get_batch_on_this_cp_rank``: ours hands the whole row to the model,
    which shards it for CP)."""

    REDIRECTS = {
        "get_pg_collection": "megatron.bridge.training.utils.pg_utils.get_pg_collection",
        "is_pp_first_stage": "megatron.core.pipeline_parallel.utils.is_pp_first_stage",
        "is_pp_last_stage": "megatron.core.pipeline_parallel.utils.is_pp_last_stage",
        "_create_loss_function": "megatron.bridge.training.losses.create_masked_next_token_loss_function",
    }
    RECORDED = ("get_batch", "get_model_config")
    NOTHING_TO_REPLACE = ("_pad_and_pack_qwen3_vl_step", "get_batch_on_this_cp_rank")

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self._monkeypatch = monkeypatch
        self.recorded: dict = {}

    def setattr(self, target, name, value=None, raising=True):
        if isinstance(target, str) and target.startswith(STEP_MODULE + "."):
            value = name
            seam = target[len(STEP_MODULE) + 1:]
            if seam in self.REDIRECTS:
                load_bridge_module("training.utils.pg_utils")
                load_bridge_module("training.losses")
                return self._monkeypatch.setattr(self.REDIRECTS[seam], value)
            if seam in self.RECORDED:
                self.recorded[seam] = value
                return None
            if seam in self.NOTHING_TO_REPLACE:
                return None
            raise AssertionError(f"{target}: no counterpart in ours; add it to _OurSeams")
        if value is None:
            return self._monkeypatch.setattr(target, name, raising=raising)
        return self._monkeypatch.setattr(target, name, value, raising=raising)

    def __getattr__(self, name):
        return getattr(self._monkeypatch, name)


def _our_get_batch_from_iterator(data_iterator, use_mtp=False, skip_getting_attention_mask_from_dataset=True, *,
                                 is_first_pp_stage, is_last_pp_stage):
    """Ours reads the iterator's batch where upstream's ``get_batch_from_iterator`` does: the step's batch reader
    (``step.prepare.read_batch``), the micro-batch's tensors where they arrived; returned under the batch's names."""
    from megatron.bridge_thd.step.prepare import read_batch

    inputs = read_batch(next(data_iterator), is_last_pp_stage)
    return {"input_ids": inputs.tokens, "tokens": inputs.tokens, "labels": inputs.labels,
            "loss_mask": inputs.loss_mask, "attention_mask": inputs.attention_mask, **inputs.multi_modal}


def _our_forward_step(seams: _OurSeams):
    """Ours, called as upstream's test calls theirs. A patched ``get_batch`` becomes the one batch the iterator
    yields; a patched ``get_model_config`` becomes the model chunk's config; ``state.cfg`` gains the ``model`` /
    ``train`` sections our plan reads (``seq_length`` from the model config, one micro-batch)."""
    from megatron.bridge_thd.qwen3_vl_step import forward_step

    def adapted(state, data_iterator, model, return_schedule_plan=False):
        config = seams.recorded.get("get_model_config", lambda _: None)(model)
        if "get_batch" in seams.recorded:
            tokens, labels, loss_mask, attention_mask, position_ids, _ = seams.recorded["get_batch"](
                data_iterator, state.cfg, False, is_first_pp_stage=True, is_last_pp_stage=True)
            data_iterator = iter([{"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
                                   "attention_mask": attention_mask, "position_ids": position_ids,
                                   "visual_inputs": None}])
        if not isinstance(model, torch.nn.Module):
            model = _ModelChunk(model, _chunk_config(config))
        cfg = state.cfg
        if not hasattr(cfg, "model"):
            cfg.model = SimpleNamespace(seq_length=getattr(config, "seq_length", None))
        if not hasattr(cfg, "train"):
            cfg.train = SimpleNamespace(micro_batch_size=None)
        return forward_step(state, data_iterator, model, return_schedule_plan)

    return adapted


def _our_packer():
    """Upstream's collate packer's entry point, by our step: ``pack_right_padded_sequence_batch_to_mcore_thd``
    replaces the batch's content with what our step hands the model (``prepare_with_plan`` with the ``thd``
    layout), read back under the collate's names.

    The collate's arguments become the step's configuration: ``pad_to_multiple_of`` is the plan's alignment (ours
    derives it from TP / CP / SP / FP8), ``pad_token_id`` the pad id of ``dataset.packing_length_fallback=
    "pad_token"`` (ours takes lengths from the dataset's mask, and from the pad id only when asked to), the
    sequence length the batch's width (no truncation). MRoPE positions ``(3, 1, N)`` are read back as their first
    channel ``(1, N)`` (a text-only batch has three equal channels); ``max_seqlen_q`` as a tensor."""
    from megatron.bridge_thd.adapters import QWEN3_VL
    from megatron.bridge_thd.qwen3_vl_step import prepare_with_plan
    from megatron.bridge_thd.step.plan import build_step_plan
    from megatron.bridge_thd_cpu.standalone import minimal_state

    def pack_right_padded_sequence_batch_to_mcore_thd(batch, *, pad_token_id=0, pad_to_multiple_of=1,
                                                      emit_padding_mask=False):
        tokens = batch["tokens"] if "tokens" in batch else batch["input_ids"]
        batch_size, width = tokens.shape
        state = minimal_state(seq_length=width, micro_batch_size=batch_size, packing_layout="thd",
                              tokenizer=SimpleNamespace(pad_token_id=pad_token_id),
                              skip_getting_attention_mask_from_dataset=batch.get("attention_mask") is None)
        state.cfg.dataset.packing_length_fallback = "pad_token"
        pg = SimpleNamespace(tp=FakeGroup(1), cp=FakeGroup(1), pp=FakeGroup(1), ep=FakeGroup(1))
        model = _ChunkTakingPaddingMask(None, _chunk_config(seq_length=width))
        plan = dataclasses.replace(build_step_plan(state, model, pg, QWEN3_VL), align=pad_to_multiple_of)
        prepared = prepare_with_plan(dict(batch, visual_inputs=None), plan, is_last_stage=True)
        args, params = prepared.forward_args, prepared.forward_args["packed_seq_params"]
        position_ids = args["position_ids"]
        packed = {
            "tokens": args["input_ids"],
            "labels": args["labels"],
            "loss_mask": args["loss_mask"],
            "attention_mask": args["attention_mask"],
            "position_ids": position_ids[0] if position_ids is not None and position_ids.dim() == 3 else position_ids,
            "cu_seqlens_q": params.cu_seqlens_q,
            "cu_seqlens_q_padded": params.cu_seqlens_q_padded,
            "max_seqlen_q": torch.tensor(params.max_seqlen_q),
        }
        if emit_padding_mask:
            packed["padding_mask"] = args["padding_mask"]
        batch.clear()
        batch.update({key: value for key, value in packed.items() if value is not None or key != "attention_mask"})
        return batch

    def build_mcore_thd_sequence_batch_from_rows(rows, **kwargs):
        pytest.skip(ROWS_SKIP)

    return SimpleNamespace(pack_right_padded_sequence_batch_to_mcore_thd=pack_right_padded_sequence_batch_to_mcore_thd,
                           build_mcore_thd_sequence_batch_from_rows=build_mcore_thd_sequence_batch_from_rows)


ROWS_SKIP = ("ours has no counterpart of the collate's rows API (build_mcore_thd_sequence_batch_from_rows: unpadded "
             "rows, one aggregate sequence_length for the pack): our step takes the collated (B, T) micro-batch, each "
             "sample within seq_length; its fixed-width row is thd_static's micro_batch_size x seq_length "
             "(docs/upstream-tests.md)")

# Upstream's cases that fail against ours on purpose: (the exception the failing check raises, the reason), shown
# by pytest and listed in docs/upstream-tests.md.
_EMPTY_SAMPLE = ("ours packs a sample with no real token as a zero-length segment, and a micro-batch of padding only "
                 "as one aligned padding segment, instead of refusing it: every rank of a step must still run the "
                 "model (pipeline sends, the data-parallel gradient reduction), and the loss mask is zero there")
_LOSS_MASK = ("ours gives every stage a loss mask (ones where the batch carries none, 0 in padding slots), since it "
              "builds Megatron-Bridge's masked loss over it and a CP-sharding model returns its CP-local part only "
              "when given one; upstream's collate leaves it None")
OURS_DIFFERENCES: dict[str, tuple[type[BaseException], str]] = {
    "test_get_batch_from_iterator_rejects_collate_time_packing_metadata": (
        AssertionError, "same refusal (ValueError for a batch that carries cu_seqlens), other wording: ours says "
                        "'this step packs the micro-batch itself; use an unpacked collate (no cu_seqlens in the "
                        "batch)'"),
    "test_packing_empty_batch_raises": (pytest.fail.Exception, _EMPTY_SAMPLE),
    "test_packing_none_labels_empty_batch": (pytest.fail.Exception, _EMPTY_SAMPLE),
    "test_packing_none_labels_loss_mask": (AssertionError, _LOSS_MASK),
    "test_packing_none_labels_loss_mask_with_padding": (AssertionError, _LOSS_MASK),
    "test_packing_padding_extends_position_ids": (
        AssertionError, "ours writes position 0 into alignment padding slots (PackedBatch's rule for every padding "
                        "slot); they lie outside every real segment (cu_seqlens_q), so no real token attends to them "
                        "and their position is never used; upstream continues the sample's positions there"),
}

# Upstream's cases written for features the installed packer lacks (they came with Megatron-Bridge PR 5285, on the
# 0.7 line): skipped for theirs when its packer's signature lacks the parameter they call.
_THEIRS_NEEDS = {
    "test_direct_rows_can_pad_final_pack_to_fixed_width": ("build_mcore_thd_sequence_batch_from_rows",
                                                           "pad_to_max_length"),
    "test_fixed_width_direct_rows_reject_aggregate_over_sequence_length": ("build_mcore_thd_sequence_batch_from_rows",
                                                                          "pad_to_max_length"),
    "test_packing_marks_only_physical_alignment_gaps_as_padding": ("pack_right_padded_sequence_batch_to_mcore_thd",
                                                                   "emit_padding_mask"),
    "test_packing_removes_stale_padding_mask_when_not_emitted": ("pack_right_padded_sequence_batch_to_mcore_thd",
                                                                 "emit_padding_mask"),
}


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request):
    return request.param


@pytest.fixture
def monkeypatch(implementation):
    """pytest's ``monkeypatch``; for ours, upstream's seams of their step module are pointed at ours."""
    with pytest.MonkeyPatch.context() as patcher:
        yield patcher if implementation == "theirs" else _OurSeams(patcher)


@pytest.fixture(autouse=True)
def _entry_points(request, implementation, monkeypatch):
    """Bind the module-level names upstream's bodies use (their imports) to theirs or ours, and mark ours'
    differences on purpose."""
    name = request.node.originalname
    if implementation == "ours" and name in OURS_DIFFERENCES:
        raises, reason = OURS_DIFFERENCES[name]
        request.applymarker(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    if implementation == "theirs":
        step, packer = _their_step_module(), _their_packer()
        if name in _THEIRS_NEEDS:
            function, parameter = _THEIRS_NEEDS[name]
            if parameter not in inspect.signature(getattr(packer, function)).parameters:
                pytest.skip(f"the installed Megatron-Bridge's {function} has no {parameter} (the case came with "
                            "PR 5285, on the 0.7 line)")
        names = dict(forward_step=step.forward_step, get_batch_from_iterator=step.get_batch_from_iterator)
    else:
        packer = _our_packer()
        names = dict(forward_step=_our_forward_step(monkeypatch), get_batch_from_iterator=_our_get_batch_from_iterator)
    names.update(pack_right_padded_sequence_batch_to_mcore_thd=packer.pack_right_padded_sequence_batch_to_mcore_thd,
                 build_mcore_thd_sequence_batch_from_rows=packer.build_mcore_thd_sequence_batch_from_rows)
    with pytest.MonkeyPatch.context() as binder:
        for name, value in names.items():
            binder.setattr(sys.modules[__name__], name, value, raising=False)
        yield


# The names upstream's bodies import at module level; bound per test by _entry_points.
forward_step = get_batch_from_iterator = None
pack_right_padded_sequence_batch_to_mcore_thd = build_mcore_thd_sequence_batch_from_rows = None


# =============================================================================================
# Upstream: tests/unit_tests/models/qwen_vl/test_qwen3_vl_step.py (from its first test on, unchanged)

def test_get_batch_from_iterator_rejects_collate_time_packing_metadata():
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "position_ids": torch.tensor([[0, 1, 2]]),
        "visual_inputs": None,
        "cu_seqlens_q": torch.tensor([0, 3], dtype=torch.int32),
    }

    with pytest.raises(ValueError, match="does not support collate-time in-batch packing"):
        get_batch_from_iterator(
            iter([batch]),
            is_first_pp_stage=True,
            is_last_pp_stage=True,
        )


def test_get_batch_from_iterator_allows_deferred_none_packing_metadata(monkeypatch):
    batch = {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "position_ids": torch.tensor([[0, 1, 2]]),
        "labels": torch.tensor([[2, 3, -100]]),
        "loss_mask": torch.tensor([[1.0, 1.0, 0.0]]),
        "visual_inputs": None,
        "cu_seqlens_q": None,
        "cu_seqlens": None,
    }
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, **kwargs: self)

    result = get_batch_from_iterator(
        iter([batch]),
        is_first_pp_stage=True,
        is_last_pp_stage=True,
    )

    assert torch.equal(result["input_ids"], batch["input_ids"])


def test_forward_step_uses_compacted_loss_mask_from_model(monkeypatch):
    class _ProcessGroup:
        def rank(self):
            return 0

        def size(self):
            return 1

    class _Timer:
        def __call__(self, *args, **kwargs):  # noqa: ARG002
            return self

        def start(self):
            return None

        def stop(self):
            return None

        def __enter__(self):
            return self

        def __exit__(self, *exc):  # noqa: ARG002
            return False

    process_group = _ProcessGroup()
    pg_collection = type(
        "PGCollection",
        (),
        {"pp": process_group, "tp": process_group, "cp": process_group, "ep": process_group},
    )()
    config = type(
        "ModelConfig",
        (),
        {"mtp_num_layers": 0, "seq_length": 4, "overlap_moe_expert_parallel_comm": False},
    )()
    compacted_loss_mask = torch.tensor([[1.0, 0.0]])

    class _Model:
        def __call__(self, **kwargs):  # noqa: ARG002
            return torch.tensor(0.0), compacted_loss_mask

    state = type(
        "State",
        (),
        {
            "timers": _Timer(),
            "straggler_timer": _Timer(),
            "cfg": type(
                "Config",
                (),
                {
                    "dataset": type("Dataset", (), {"enable_in_batch_packing": True})(),
                    "rerun_state_machine": type(
                        "Rerun", (), {"check_for_nan_in_loss": False, "check_for_spiky_loss": False}
                    )(),
                },
            )(),
        },
    )()
    tokens = torch.tensor([[1, 2, 3, 0]])
    labels = torch.tensor([[2, 3, -100, -100]])
    original_loss_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    position_ids = torch.arange(4).unsqueeze(0)
    attention_mask = torch.ones_like(tokens, dtype=torch.bool)

    monkeypatch.setattr("megatron.bridge.models.qwen_vl.qwen3_vl_step.get_pg_collection", lambda _: pg_collection)
    monkeypatch.setattr("megatron.bridge.models.qwen_vl.qwen3_vl_step.is_pp_first_stage", lambda _: True)
    monkeypatch.setattr("megatron.bridge.models.qwen_vl.qwen3_vl_step.is_pp_last_stage", lambda _: True)
    monkeypatch.setattr("megatron.bridge.models.qwen_vl.qwen3_vl_step.get_model_config", lambda _: config)
    monkeypatch.setattr(
        "megatron.bridge.models.qwen_vl.qwen3_vl_step.get_batch",
        lambda *args, **kwargs: (tokens, labels, original_loss_mask, attention_mask, position_ids, {}),
    )
    monkeypatch.setattr(
        "megatron.bridge.models.qwen_vl.qwen3_vl_step._pad_and_pack_qwen3_vl_step",
        lambda *args, **kwargs: (*args[:5], object()),
    )
    monkeypatch.setattr(
        "megatron.bridge.models.qwen_vl.qwen3_vl_step.get_batch_on_this_cp_rank",
        lambda forward_args, **kwargs: forward_args,
    )
    captured_loss_masks = []
    monkeypatch.setattr(
        "megatron.bridge.models.qwen_vl.qwen3_vl_step._create_loss_function",
        lambda loss_mask, *args: captured_loss_masks.append(loss_mask) or object(),
    )

    output, _ = forward_step(state, iter(()), _Model())

    assert output.item() == 0.0
    assert captured_loss_masks == [compacted_loss_mask]


# =============================================================================================
# Upstream: tests/unit_tests/data/packing/test_in_batch.py (from its helper on, unchanged)

def _pack_padded_sequence_for_test(
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    pad_token_id: int = 0,
    pad_to_multiple_of: int = 1,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor | None,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """Adapt the canonical mutable-batch API to compact assertions in these tests."""
    batch = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    pack_right_padded_sequence_batch_to_mcore_thd(
        batch,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    cu_seqlens = batch.get("cu_seqlens_q_padded")
    if cu_seqlens is None:
        cu_seqlens = batch["cu_seqlens_q"]
    return (
        batch["tokens"],
        batch.get("labels"),
        batch.get("loss_mask"),
        batch.get("attention_mask"),
        batch["position_ids"],
        cu_seqlens,
        batch["max_seqlen_q"],
    )


class TestPackBatchSequences:
    """Tests for the _pack_padded_sequence_for_test function."""

    def test_basic_packing(self):
        """Test basic sequence packing functionality."""
        batch_size, seq_len = 2, 8
        # Tokens with padding at the end (pad_token_id=0)
        tokens = torch.tensor(
            [
                [1, 2, 3, 0, 0, 0, 0, 0],  # length 3
                [4, 5, 6, 7, 0, 0, 0, 0],  # length 4
            ]
        )
        labels = torch.tensor(
            [
                [2, 3, -100, -100, -100, -100, -100, -100],
                [5, 6, 7, -100, -100, -100, -100, -100],
            ]
        )
        loss_mask = torch.tensor(
            [
                [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            ]
        )
        position_ids = torch.arange(seq_len).unsqueeze(0).expand(batch_size, -1)
        attention_mask = None

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=attention_mask,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, packed_labels, packed_loss_mask, packed_attn, packed_pos, cu_seqlens, max_seqlen = result

        # Packed output should have shape [1, total_valid_len]
        assert packed_tokens.shape[0] == 1
        total_len = packed_tokens.shape[1]
        assert total_len == 7  # 3 + 4

        # cu_seqlens should have num_sequences + 1 elements
        assert len(cu_seqlens) == 3  # [0, 3, 7]
        assert cu_seqlens[0] == 0
        assert cu_seqlens[1] == 3  # first sequence length
        assert cu_seqlens[2] == 7  # total length

        # max_seqlen should be max of sequence lengths
        assert max_seqlen.item() == 4

        # Attention mask should be None for packed sequences
        assert packed_attn is None

    def test_direct_rows_can_pad_final_pack_to_fixed_width(self):
        """Fixed-width direct packing preserves real and physical boundaries."""
        rows = [
            {
                "input_ids": torch.tensor([1, 2, 3]),
                "position_ids": torch.tensor([0, 1, 2]),
                "labels": torch.tensor([2, 3, -100]),
                "loss_mask": torch.tensor([1.0, 1.0, 0.0]),
            },
            {
                "input_ids": torch.tensor([4, 5]),
                "position_ids": torch.tensor([0, 1]),
                "labels": torch.tensor([5, -100]),
                "loss_mask": torch.tensor([1.0, 0.0]),
            },
        ]

        packed = build_mcore_thd_sequence_batch_from_rows(
            rows,
            sequence_length=8,
            pad_to_max_length=True,
        )

        assert packed["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]
        assert packed["labels"].tolist() == [[2, 3, -100, 5, -100, -100, -100, -100]]
        assert packed["loss_mask"].tolist() == [[1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
        assert packed["cu_seqlens_q"].tolist() == [0, 3, 5]
        assert packed["cu_seqlens_q_padded"].tolist() == [0, 3, 8]
        assert packed["max_seqlen_q"].item() == 5
        assert packed["total_tokens"] == 8

    def test_fixed_width_direct_rows_reject_aggregate_over_sequence_length(self):
        """Fixed-width packing rejects rows whose physical aggregate cannot fit."""
        rows = [
            {"input_ids": torch.arange(5), "position_ids": torch.arange(5)},
            {"input_ids": torch.arange(4), "position_ids": torch.arange(4)},
        ]

        with pytest.raises(ValueError, match="Packed sequence length 9 exceeds configured sequence_length 8"):
            build_mcore_thd_sequence_batch_from_rows(
                rows,
                sequence_length=8,
                pad_to_max_length=True,
            )

    def test_packing_with_pad_to_multiple_of(self):
        """Test packing with padding to a multiple (for CP compatibility)."""
        batch_size = 2
        tokens = torch.tensor(
            [
                [1, 2, 3, 0, 0, 0, 0, 0, 0, 0],  # length 3 -> padded to 4 (mult of 2)
                [4, 5, 6, 7, 8, 0, 0, 0, 0, 0],  # length 5 -> padded to 6 (mult of 2)
            ]
        )
        labels = torch.tensor(
            [
                [2, 3, -100, -100, -100, -100, -100, -100, -100, -100],
                [5, 6, 7, 8, -100, -100, -100, -100, -100, -100],
            ]
        )
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.arange(10).unsqueeze(0).expand(batch_size, -1)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=2,  # Pad each sequence to multiple of 2
        )

        packed_tokens, packed_labels, packed_loss_mask, packed_attn, packed_pos, cu_seqlens, max_seqlen = result

        # Total length should be 4 + 6 = 10 (padded lengths)
        assert packed_tokens.shape[1] == 10

        # cu_seqlens should use padded lengths
        assert cu_seqlens[0] == 0
        assert cu_seqlens[1] == 4  # 3 -> 4 (padded)
        assert cu_seqlens[2] == 10  # 5 -> 6, total = 4 + 6

        # max_seqlen should be 6 (longest padded sequence)
        assert max_seqlen.item() == 6

    def test_packing_marks_only_physical_alignment_gaps_as_padding(self):
        """MoE routing can exclude collator-inserted THD alignment gaps."""
        batch = {
            "tokens": torch.tensor([[1, 2, 3, 0, 0], [4, 5, 0, 0, 0]]),
            "labels": torch.tensor([[2, 3, -100, -100, -100], [5, -100, -100, -100, -100]]),
            "loss_mask": torch.tensor([[1.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]),
            "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]),
            "position_ids": torch.arange(5).unsqueeze(0).expand(2, -1),
        }

        pack_right_padded_sequence_batch_to_mcore_thd(
            batch,
            pad_token_id=0,
            pad_to_multiple_of=4,
            emit_padding_mask=True,
        )

        assert batch["padding_mask"].dtype == torch.bool
        assert batch["padding_mask"].tolist() == [[False, False, False, True, False, False, True, True]]
        assert batch["cu_seqlens_q"].tolist() == [0, 3, 5]
        assert batch["cu_seqlens_q_padded"].tolist() == [0, 4, 8]

    def test_packing_removes_stale_padding_mask_when_not_emitted(self):
        """Packing without mask emission removes an incompatible input mask."""
        batch = {
            "tokens": torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]]),
            "position_ids": torch.arange(4).unsqueeze(0).expand(2, -1),
            "padding_mask": torch.tensor([[False, False, False, True], [False, False, True, True]]),
        }

        pack_right_padded_sequence_batch_to_mcore_thd(batch, pad_token_id=0)

        assert batch["tokens"].shape == (1, 5)
        assert "padding_mask" not in batch

    def test_packing_with_larger_multiple(self):
        """Test packing with larger pad_to_multiple_of (e.g., for CP=4)."""
        tokens = torch.tensor(
            [
                [1, 2, 0, 0, 0, 0, 0, 0],  # length 2 -> padded to 4
                [3, 4, 5, 0, 0, 0, 0, 0],  # length 3 -> padded to 4
            ]
        )
        labels = torch.tensor(
            [
                [2, -100, -100, -100, -100, -100, -100, -100],
                [4, 5, -100, -100, -100, -100, -100, -100],
            ]
        )
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.arange(8).unsqueeze(0).expand(2, -1)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=4,
        )

        packed_tokens, *_, cu_seqlens, max_seqlen = result

        # Both sequences padded to 4, total = 8
        assert packed_tokens.shape[1] == 8
        assert cu_seqlens.tolist() == [0, 4, 8]
        assert max_seqlen.item() == 4

    def test_packing_single_sequence(self):
        """Test packing a single sequence."""
        tokens = torch.tensor([[1, 2, 3, 4, 5, 0, 0, 0]])  # length 5
        labels = torch.tensor([[2, 3, 4, 5, -100, -100, -100, -100]])
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.arange(8).unsqueeze(0)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, *_, cu_seqlens, max_seqlen = result

        assert packed_tokens.shape[1] == 5
        assert cu_seqlens.tolist() == [0, 5]
        assert max_seqlen.item() == 5

    def test_packing_no_padding_sequences(self):
        """Test packing sequences with no padding."""
        tokens = torch.tensor(
            [
                [1, 2, 3, 4],
                [5, 6, 7, 8],
            ]
        )
        labels = torch.tensor(
            [
                [2, 3, 4, -100],
                [6, 7, 8, -100],
            ]
        )
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.arange(4).unsqueeze(0).expand(2, -1)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, *_, cu_seqlens, max_seqlen = result

        # Both sequences full length
        assert packed_tokens.shape[1] == 8
        assert cu_seqlens.tolist() == [0, 4, 8]

    def test_packing_preserves_loss_mask_zeros(self):
        """Test that loss_mask zeros are preserved during packing."""
        tokens = torch.tensor([[1, 2, 3, 0, 0]])
        labels = torch.tensor([[2, 3, -100, -100, -100]])
        loss_mask = torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0]])  # Second token masked
        position_ids = torch.arange(5).unsqueeze(0)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, packed_labels, packed_loss_mask, *_ = result

        # Only first 3 tokens should be kept
        assert packed_loss_mask.shape[1] == 3
        assert packed_loss_mask[0, 0].item() == 1.0
        assert packed_loss_mask[0, 1].item() == 0.0  # Preserved
        assert packed_loss_mask[0, 2].item() == 1.0

    def test_packing_position_ids_reset(self):
        """Test that position_ids are correctly packed."""
        tokens = torch.tensor(
            [
                [1, 2, 0, 0],
                [3, 4, 5, 0],
            ]
        )
        labels = torch.zeros_like(tokens)
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.tensor(
            [
                [0, 1, 2, 3],
                [0, 1, 2, 3],
            ]
        )

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        _, _, _, _, packed_pos, *_ = result

        # Position IDs should be extracted from original sequences
        assert packed_pos.shape[1] == 5  # 2 + 3
        assert packed_pos[0, 0].item() == 0  # First seq, pos 0
        assert packed_pos[0, 1].item() == 1  # First seq, pos 1
        assert packed_pos[0, 2].item() == 0  # Second seq, pos 0
        assert packed_pos[0, 3].item() == 1  # Second seq, pos 1
        assert packed_pos[0, 4].item() == 2  # Second seq, pos 2

    def test_packing_empty_batch_raises(self):
        """Test that all-padding batch fails instead of hiding invalid metadata."""
        tokens = torch.tensor([[0, 0, 0, 0]])  # All padding
        labels = torch.tensor([[-100, -100, -100, -100]])
        loss_mask = torch.zeros(1, 4)
        position_ids = torch.arange(4).unsqueeze(0)

        with pytest.raises(ValueError, match="Cannot pack a batch containing an empty sequence row"):
            _pack_padded_sequence_for_test(
                tokens=tokens,
                labels=labels,
                loss_mask=loss_mask,
                attention_mask=None,
                position_ids=position_ids,
                pad_token_id=0,
                pad_to_multiple_of=1,
            )

    def test_packing_different_dtypes(self):
        """Test packing with different tensor dtypes."""
        tokens = torch.tensor([[1, 2, 3, 0]], dtype=torch.long)
        labels = torch.tensor([[2, 3, -100, -100]], dtype=torch.long)
        loss_mask = torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float32)
        position_ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.long)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, packed_labels, packed_loss_mask, _, packed_pos, cu_seqlens, _ = result

        # Dtypes should be preserved
        assert packed_tokens.dtype == torch.long
        assert packed_labels.dtype == torch.long
        assert packed_loss_mask.dtype == torch.float32
        assert packed_pos.dtype == torch.long
        assert cu_seqlens.dtype == torch.int32

    def test_packing_padding_extends_position_ids(self):
        """Test that padding extends position_ids correctly."""
        tokens = torch.tensor([[1, 2, 3, 0]])  # length 3
        labels = torch.zeros_like(tokens)
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.tensor([[0, 1, 2, 3]])

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=4,  # Pad to 4
        )

        _, _, _, _, packed_pos, cu_seqlens, _ = result

        # Length should be 4 (padded)
        assert packed_pos.shape[1] == 4

        # Original positions should be preserved
        assert packed_pos[0, 0].item() == 0
        assert packed_pos[0, 1].item() == 1
        assert packed_pos[0, 2].item() == 2
        # Padding position should be extended
        assert packed_pos[0, 3].item() == 3

    def test_packing_cu_seqlens_dtype(self):
        """Test that cu_seqlens is int32 as expected by attention kernels."""
        tokens = torch.tensor([[1, 2, 0]])
        labels = torch.zeros_like(tokens)
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
        position_ids = torch.arange(3).unsqueeze(0)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
        )

        _, _, _, _, _, cu_seqlens, _ = result

        assert cu_seqlens.dtype == torch.int32

    def test_packing_none_labels_loss_mask(self):
        """Test packing with labels=None and loss_mask=None (non-last PP stage)."""
        tokens = torch.tensor(
            [
                [1, 2, 3, 0, 0, 0, 0, 0],  # length 3
                [4, 5, 6, 7, 0, 0, 0, 0],  # length 4
            ]
        )
        position_ids = torch.arange(8).unsqueeze(0).expand(2, -1)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=None,
            loss_mask=None,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=1,
        )

        packed_tokens, packed_labels, packed_loss_mask, packed_attn, packed_pos, cu_seqlens, max_seqlen = result

        assert packed_tokens.shape == (1, 7)
        assert torch.equal(packed_tokens, torch.tensor([[1, 2, 3, 4, 5, 6, 7]]))
        assert packed_labels is None
        assert packed_loss_mask is None
        assert packed_attn is None
        assert packed_pos.shape == (1, 7)
        assert torch.equal(packed_pos, torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
        assert cu_seqlens.tolist() == [0, 3, 7]
        assert max_seqlen.item() == 4

    def test_packing_none_labels_loss_mask_with_padding(self):
        """Test packing with None labels/loss_mask and pad_to_multiple_of > 1."""
        tokens = torch.tensor(
            [
                [1, 2, 3, 0, 0, 0, 0, 0],  # length 3 -> padded to 4
                [4, 5, 6, 7, 8, 0, 0, 0],  # length 5 -> padded to 8
            ]
        )
        position_ids = torch.arange(8).unsqueeze(0).expand(2, -1)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=None,
            loss_mask=None,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
            pad_to_multiple_of=4,
        )

        packed_tokens, packed_labels, packed_loss_mask, packed_attn, packed_pos, cu_seqlens, max_seqlen = result

        assert packed_tokens.shape == (1, 12)
        assert packed_labels is None
        assert packed_loss_mask is None
        assert packed_attn is None
        assert cu_seqlens.tolist() == [0, 4, 12]
        assert max_seqlen.item() == 8

    def test_packing_none_labels_empty_batch(self):
        """Test empty batch with None labels/loss_mask raises like other all-padding batches."""
        tokens = torch.tensor([[0, 0, 0, 0]])
        position_ids = torch.arange(4).unsqueeze(0)

        with pytest.raises(ValueError, match="Cannot pack a batch containing an empty sequence row"):
            _pack_padded_sequence_for_test(
                tokens=tokens,
                labels=None,
                loss_mask=None,
                attention_mask=None,
                position_ids=position_ids,
                pad_token_id=0,
                pad_to_multiple_of=1,
            )

    def test_packing_gpu_tensor(self):
        """Test packing works on GPU if available."""
        if not torch.cuda.is_available():
            pytest.skip("CUDA not available")

        tokens = torch.tensor([[1, 2, 3, 0, 0]], device="cuda")
        labels = torch.tensor([[2, 3, -100, -100, -100]], device="cuda")
        loss_mask = torch.ones_like(tokens, dtype=torch.float, device="cuda")
        position_ids = torch.arange(5, device="cuda").unsqueeze(0)

        result = _pack_padded_sequence_for_test(
            tokens=tokens,
            labels=labels,
            loss_mask=loss_mask,
            attention_mask=None,
            position_ids=position_ids,
            pad_token_id=0,
        )

        packed_tokens, _, _, _, _, cu_seqlens, _ = result

        assert packed_tokens.device.type == "cuda"
        assert cu_seqlens.device.type == "cuda"
