"""The THD signature a CUDA graph replays, judged by Megatron-Core 0.19.2's own bookkeeping on the CPU
(docs/cuda-graphs.md).

Megatron-Core's local CUDA-graph manager replays a captured layer only for a call whose arguments
match the capture (``_CudaGraphRunner.get_mismatch_errors``, ``transformer/cuda_graphs.py:1647``).
The first half shows that verdict is sensitive to exactly what a THD row can vary (the number of
``cu_seqlens`` entries, the ``max_seqlen`` ints, the row length) and blind to ``cu_seqlens`` values
(graph inputs, copied at replay). The second half prepares real ``thd_static`` micro-batches with
the step and compares what their decoder sees. The last part runs Megatron-Core's
Transformer-Engine replay path on the real model with a stand-in for TE's graphed callable.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _real_model import receipt_batch, tiny_real_model

from megatron.bridge_thd.packing import thd_packed_seq_params
from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
from megatron.bridge_thd_testbed.graphs import (
    decoder_kwargs,
    mcore_decoder_signature,
    mcore_graph_inputs,
    mcore_replay_mismatches,
    signature_differences,
    te_replay_stand_in,
)
from megatron.bridge_thd_cpu.parity import step_run
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state

HIDDEN, ROPE_DIM = 16, 8
CU_FIELDS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


# ---------------------------------------------------------------------------------------------
# 1. Megatron-Core's bookkeeping, on what a decoder layer receives
# ---------------------------------------------------------------------------------------------


def _psp(lengths: list[int], row: int, max_seqlen: int, *, pad_between_seqs: bool = True):
    """A THD row's PackedSeqParams as the step builds it (``packing.thd_packed_seq_params``):
    real segments of ``lengths``, then a tail segment to ``row``."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.cat([cu, torch.tensor([row], dtype=torch.int32)])
    cu = torch.cat([cu, cu[-1:]])
    return thd_packed_seq_params(cu, cu_padded, max_seqlen, pad_between_seqs)


def _layer_call(lengths: list[int], row: int, max_seqlen: int, **psp_kwargs) -> dict:
    """The keyword arguments TransformerBlock hands a TransformerLayer for one THD row
    (``transformer_block.py:664-678``), the ones that matter here."""
    return dict(
        hidden_states=torch.zeros(row, 1, HIDDEN),
        attention_mask=None,
        rotary_pos_emb=torch.zeros(row, 1, 1, ROPE_DIM),
        packed_seq_params=_psp(lengths, row, max_seqlen, **psp_kwargs),
    )


CAPTURED = dict(lengths=[100, 60, 40], row=256, max_seqlen=128)


def test_the_same_row_shape_replays_whatever_the_boundaries():
    """Other boundary values, the same count: no mismatch. cu_seqlens are graph inputs."""
    captured = _layer_call(**CAPTURED)
    other = _layer_call(lengths=[10, 20, 170], row=256, max_seqlen=128)
    assert not torch.equal(captured["packed_seq_params"].cu_seqlens_q, other["packed_seq_params"].cu_seqlens_q)
    assert mcore_replay_mismatches(captured, _layer_call(**CAPTURED)) == []
    assert mcore_replay_mismatches(captured, other) == []


def test_cu_seqlens_are_graph_inputs_and_max_seqlen_is_baked():
    """``get_tensors`` (the input surface copied into static buffers at each replay) takes the four
    cu_seqlens tensors out of PackedSeqParams; the max_seqlen ints are not inputs."""
    call = _layer_call(**CAPTURED)
    psp = call["packed_seq_params"]
    surface = mcore_graph_inputs(call)
    assert [id(t) for t in surface] == [id(call["hidden_states"]), id(call["rotary_pos_emb"]),
                                        *(id(getattr(psp, f)) for f in CU_FIELDS)]
    assert not any(isinstance(t, int) for t in surface)


REJECTED = {
    # One more sample: every cu_seqlens tensor one entry longer.
    "cu_seqlens_count": (dict(lengths=[100, 60, 40, 20], row=256, max_seqlen=128),
                         [f"kwargs['packed_seq_params'].{f}: Received shape torch.Size([6]) but expected "
                          "torch.Size([5])" for f in CU_FIELDS]),
    # A wider batch: max_seqlen follows it.
    "max_seqlen": (dict(lengths=[100, 60, 40], row=256, max_seqlen=192),
                   ["Value mismatch at kwargs['packed_seq_params'].max_seqlen_q: 192 vs 128",
                    "Value mismatch at kwargs['packed_seq_params'].max_seqlen_kv: 192 vs 128"]),
    # A longer row: the activations and the rotary table change shape.
    "row_length": (dict(lengths=[100, 60, 40], row=384, max_seqlen=128),
                   ["kwargs['hidden_states']: Received shape torch.Size([384, 1, 16]) but expected "
                    "torch.Size([256, 1, 16])",
                    "kwargs['rotary_pos_emb']: Received shape torch.Size([384, 1, 1, 8]) but expected "
                    "torch.Size([256, 1, 1, 8])"]),
}


@pytest.mark.parametrize("change", list(REJECTED))
def test_megatron_core_rejects_what_a_thd_row_can_vary(change):
    call, expected = REJECTED[change]
    errors = mcore_replay_mismatches(_layer_call(**CAPTURED), _layer_call(**call))
    assert len(errors) == len(expected), errors
    for fragment in expected:
        assert any(fragment in e for e in errors), (fragment, errors)
    # mcore_decoder_signature sees the same change (on the step's names for these inputs).
    a, b = _step_args(**CAPTURED), _step_args(**call)
    assert signature_differences(mcore_decoder_signature(a), mcore_decoder_signature(b))
    assert mcore_replay_mismatches(decoder_kwargs(a), decoder_kwargs(b))


def _step_args(lengths, row, max_seqlen, **psp_kwargs) -> dict:
    """``forward_args`` shaped as the step's THD layouts hand them to Qwen3VLModel."""
    return dict(
        input_ids=torch.zeros(1, row, dtype=torch.long),
        labels=torch.zeros(1, row, dtype=torch.long),
        position_ids=torch.zeros(3, 1, row, dtype=torch.long),
        attention_mask=None,
        loss_mask=torch.zeros(1, row),
        packed_seq_params=_psp(lengths, row, max_seqlen, **psp_kwargs),
        pixel_values=torch.zeros(7 * len(lengths), 96),  # vision tower: not in the decoder signature
    )


def test_other_packed_seq_params_values_are_part_of_the_signature():
    """Every non-tensor field is compared by value: pad_between_seqs and qkv_format too."""
    captured = _layer_call(**CAPTURED)
    flipped = _layer_call(**CAPTURED, pad_between_seqs=False)
    assert mcore_replay_mismatches(captured, flipped) == [
        "  - Value mismatch at kwargs['packed_seq_params'].pad_between_seqs: False vs True"]
    sbhd = dict(captured, packed_seq_params=dataclasses.replace(captured["packed_seq_params"], qkv_format="sbhd"))
    assert mcore_replay_mismatches(captured, sbhd) == [
        "  - Value mismatch at kwargs['packed_seq_params'].qkv_format: sbhd vs thd"]


def test_a_process_group_in_packed_seq_params_is_refused_outright():
    """``cp_group`` holding a ProcessGroup: ``_check_supported_type`` asserts (no mismatch list)."""
    pg = init_single_process_groups()
    call = _layer_call(**CAPTURED)
    with_group = dict(call, packed_seq_params=dataclasses.replace(call["packed_seq_params"], cp_group=pg.cp))
    with pytest.raises(AssertionError, match="not supported"):
        mcore_replay_mismatches(with_group, with_group)


def test_decoder_signature_keeps_only_what_the_decoder_sees():
    sig = mcore_decoder_signature(_step_args(**CAPTURED))
    fields = [f.name for f in dataclasses.fields(_psp(**CAPTURED))]
    assert list(sig) == ["input_ids", "position_ids", "labels", "loss_mask",
                         *(f"packed_seq_params.{f}" for f in fields)]
    assert sig["input_ids"] == ("tensor", "Tensor", (1, 256), "torch.int64", "cpu")
    assert sig["packed_seq_params.cu_seqlens_q"] == ("tensor", "Tensor", (5,), "torch.int32", "cpu")
    assert sig["packed_seq_params.max_seqlen_q"] == ("value", "int", 128)
    assert sig["packed_seq_params.qkv_format"] == ("value", "str", "thd")
    assert sig["packed_seq_params.seq_idx"] == ("value", "NoneType", None)
    # The visual inputs change with the images and run outside the decoder's graphs.
    other_images = dict(_step_args(**CAPTURED), pixel_values=torch.zeros(99, 96))
    assert mcore_decoder_signature(other_images) == sig


# ---------------------------------------------------------------------------------------------
# 2. Real thd_static micro-batches from the step (Megatron-Bridge 0.6.2's Qwen3VLModel, CPU build)
# ---------------------------------------------------------------------------------------------

SEQ_LENGTH = 2048
MICRO_BATCH_SIZE = 3


@pytest.fixture(scope="module")
def model():
    return tiny_real_model(SEQ_LENGTH)


def _prepared_args(model, batch, micro_batch_size: int) -> dict:
    """The step's forward arguments for ``batch`` (thd_static), prepared with CUDA graphs off."""
    state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=micro_batch_size, packing_layout="thd_static")
    return prepare_micro_batch(batch, model, state, model.pg_collection).forward_args


def _prepared(model, batch) -> dict:
    state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE, packing_layout="thd_static")
    return prepare_micro_batch(batch, model, state, model.pg_collection).forward_args


def _pairs():
    """Two micro-batches per case, the same ``train.micro_batch_size``:
    ``width``: three samples each, collated to different widths (601 and 700 columns);
    ``samples``: three samples and two (the last micro-batch of a sampler that ran short, or a
    global-batch-packing bin), the same width."""
    base = receipt_batch("right")  # 3 samples, seed 1, width 601
    width = base["tokens"].shape[1]
    return {
        "width": (base, synthetic_receipt_batch(3, seed=1, pad_to=width + 99)),
        "samples": (base, synthetic_receipt_batch(2, seed=1, pad_to=width)),
    }


PAIRS = _pairs()


@pytest.mark.parametrize("case", list(PAIRS))
def test_thd_static_rows_share_their_row_tensors(model, case):
    """The row itself: ``max(micro_batch_size, B) * seq_length`` slots, whatever the batch's width or sample
    count."""
    first, second = (mcore_decoder_signature(_prepared(model, b)) for b in PAIRS[case])
    differing = signature_differences(first, second)
    assert first["input_ids"] == ("tensor", "Tensor", (1, MICRO_BATCH_SIZE * SEQ_LENGTH), "torch.int64", "cpu")
    assert not {"input_ids", "position_ids", "labels", "loss_mask"} & set(differing), differing


@pytest.mark.parametrize("case", list(PAIRS))
def test_thd_static_micro_batches_share_the_decoder_signature(model, case):
    """A graph captured on one thd_static micro-batch replays every other one: the cu_seqlens count is padded
    with zero-length segments to the plan's fixed count and max_seqlen comes from the plan, so neither follows the
    batch width (``width``) or the number of samples (``samples``), and Megatron-Core's local manager finds no
    mismatch."""
    first, second = (_prepared(model, b) for b in PAIRS[case])
    assert signature_differences(mcore_decoder_signature(first), mcore_decoder_signature(second)) == {}
    assert mcore_replay_mismatches(decoder_kwargs(first), decoder_kwargs(second)) == []


# ---------------------------------------------------------------------------------------------
# 3. Megatron-Core's Transformer-Engine replay path on the real model (TE's graph stood in for)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("modules", [[], ["attn"]], ids=["whole_layer", "attn"])
def test_te_graphs_around_attention_refuse_a_thd_row(model, modules):
    """Attention inside the graph: ``_te_cuda_graph_replay`` asserts ``packed_seq_params is None``
    (``transformer_layer.py:1225``); Megatron-Bridge 0.6.2's language block passes it to every layer."""
    batch = synthetic_receipt_batch(1, seed=1)
    args = _prepared_args(model, batch, 1)  # the row, prepared before the graphs are switched on
    with cpu_stack(), te_replay_stand_in(model.language_model, modules, seq_length=SEQ_LENGTH,
                                         micro_batch_size=1) as calls:
        # The step's plan refuses this setting (rules._cuda_graphs_scope_problems) ...
        with pytest.raises(ValueError, match="asserts packed_seq_params is None"):
            step_run(model, batch, "thd_static", seq_length=SEQ_LENGTH, micro_batch_size=1)
        # ... because Megatron-Core's replay path would assert on the THD row.
        with pytest.raises(AssertionError, match="packed_seq_params are excluded from input list"):
            model(**args)
    assert calls == []


def test_te_graphs_beside_attention_take_a_thd_row_of_the_captured_shape(model):
    """Attention outside the graph (``cuda_graph_modules=["mlp"]``): attention runs eagerly with the
    THD metadata, the graph gets the hidden states only. A micro-batch of one whose row is
    ``seq_length`` long has the capture's shape and computes what the eager step computes."""
    batch = synthetic_receipt_batch(1, seed=1)
    with cpu_stack():
        eager = step_run(model, batch, "thd_static", seq_length=SEQ_LENGTH, micro_batch_size=1)
        with te_replay_stand_in(model.language_model, ["mlp"], seq_length=SEQ_LENGTH, micro_batch_size=1) as calls:
            graphed = step_run(model, batch, "thd_static", seq_length=SEQ_LENGTH, micro_batch_size=1)
    hidden = model.language_model.config.hidden_size
    assert calls and all(shapes == [(SEQ_LENGTH, 1, hidden)] and names == ["is_first_microbatch"]
                         for _, shapes, names in calls)
    assert torch.equal(graphed.output, eager.output)


def test_te_graphs_beside_attention_refuse_a_row_of_several_samples(model):
    """``micro_batch_size`` 3: TE captured ``(seq_length, 3, hidden)``; the THD row is
    ``(3 * seq_length, 1, hidden)`` and the copy into the captured buffer fails."""
    batch = receipt_batch("right")
    args = _prepared_args(model, batch, MICRO_BATCH_SIZE)
    with cpu_stack(), te_replay_stand_in(model.language_model, ["mlp"], seq_length=SEQ_LENGTH,
                                         micro_batch_size=MICRO_BATCH_SIZE):
        # The step's plan refuses this setting (rules._cuda_graphs_scope_problems) ...
        with pytest.raises(ValueError, match="matches only for one sample of seq_length"):
            step_run(model, batch, "thd_static", seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE)
        # ... because the copy into the captured buffer fails.
        with pytest.raises(RuntimeError, match="must match the size"):
            model(**args)
