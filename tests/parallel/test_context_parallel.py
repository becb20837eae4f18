"""Context parallelism over real processes: gloo, ``torch.multiprocessing``, Megatron-Bridge 0.6.2's
real ``Qwen3VLModel`` splitting the row itself (``get_packed_seq_cp_partition_indices`` ->
Megatron-Core ``get_batch_on_this_cp_rank`` -> our pure-torch ``thd_get_partitioned_indices``)
and the CPU THD attention gathering K/V over the CP group.

The "left" batch holds an image per sample and two videos. For CP = 2 and 4, the loss sum and
token count (summed over the CP group, as Megatron-Core's per-token loss reduction does) and every
parameter gradient (all-reduced over the CP group, as Megatron's DDP does) must equal the CP = 1
run of the same weights.
"""

from __future__ import annotations

import random

import pytest
import torch
from _real_model import all_padding_batch, last_slot_batch, video_receipt_batch

from megatron.bridge_thd.context_parallel import thd_local_positions, thd_partition_indices
from megatron.bridge_thd_cpu.attention import THDCoreAttention, thd_cp_attention
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import gradients, step_run, worst_relative_gradient_error
from megatron.bridge_thd_cpu.reference import thd_attention
from megatron.bridge_thd_cpu.stack import QWEN3_VL_MODEL_MODULE, cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd.upstream.loading import load_bridge_module

GRAD_TOLERANCE = 1e-5


# ---------------------------------------------------------------------------------------------
# the zigzag partition, the patches, the attention on one process


def _reference_partition(cu_padded: list[int], cp: int, rank: int) -> list[int]:
    """The rule, segment by segment: chunks r and 2cp-1-r of L / (2cp) tokens."""
    out = []
    for start, end in zip(cu_padded[:-1], cu_padded[1:]):
        chunk = (end - start) // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + c * chunk, start + (c + 1) * chunk))
    return out


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_partition_indices_follow_the_zigzag_rule(cp, seed):
    rng = random.Random(seed)
    slots = [2 * cp * rng.randint(0, 6) for _ in range(rng.randint(1, 6))]
    cu = torch.tensor([0] + slots, dtype=torch.int32).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    ranks = [thd_partition_indices(cu, total, cp, r) for r in range(cp)]
    for r, index in enumerate(ranks):
        assert index.tolist() == _reference_partition(cu.tolist(), cp, r)
        segment, offset = thd_local_positions(cu, total, cp, r)
        assert torch.equal(cu.long()[segment] + offset, index)
    # Every slot of the row belongs to exactly one rank.
    assert sorted(torch.cat(ranks).tolist()) == list(range(total))


def test_partition_indices_reject_bad_arguments():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cp_rank"):
        thd_partition_indices(cu, 8, 2, 2)
    with pytest.raises(ValueError, match="total_tokens"):
        thd_partition_indices(cu, 6, 2, 0)


def test_cpu_stack_patches_are_scoped_and_reversible():
    import megatron.core.utils as mcore_utils

    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    before = (model_module.TENorm, model_module.TEColumnParallelLinear, mcore_utils.tex, torch.cuda.current_device)
    with cpu_stack():
        with cpu_stack():  # re-entrant
            pass
        assert model_module.TENorm is not before[0]
        assert mcore_utils.tex.thd_get_partitioned_indices(torch.tensor([0, 8]), 8, 2, 1).tolist() == [2, 3, 4, 5]
        assert torch.cuda.current_device() == torch.device("cpu")
    after = (model_module.TENorm, model_module.TEColumnParallelLinear, mcore_utils.tex, torch.cuda.current_device)
    assert all(a is b for a, b in zip(after, before))


@pytest.mark.parametrize("causal", [True, False])
def test_cp1_attention_equals_reference_thd_attention(causal):
    """One process: the CPU core attention equals the reference THD attention (which is checked
    against SDPA per sample in test_thd_attention.py), GQA, padded slots and a static tail."""
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 12, 12], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 8, 16, 24], dtype=torch.int32)
    q = torch.randn(24, 4, 8, generator=gen)
    k, v = torch.randn(24, 2, 8, generator=gen), torch.randn(24, 2, 8, generator=gen)
    ours = thd_cp_attention(q, k, v, cu, cu_padded, causal=causal, softmax_scale=8**-0.5)
    expected = thd_attention(q, k, v, cu, cu, cu_padded, cu_padded, causal=causal)
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert ours[5:8].abs().max() == 0 and ours[16:].abs().max() == 0


def test_core_attention_refuses_attention_bias():
    config = tiny_qwen3_vl_config()
    from megatron.core.transformer.enums import AttnMaskType

    module = THDCoreAttention(config, 1, AttnMaskType.causal)
    q = torch.zeros(4, 1, 4, 16)
    with pytest.raises(ValueError, match="attention_bias"):
        module(q, q[:, :, :2], q[:, :, :2], None, attention_bias=torch.zeros(1))


# ---------------------------------------------------------------------------------------------
# the real model over gloo


def _cases():
    """(name, batch, layout, moe, micro_batch_size): images, videos of several frames (``_real_model.VIDEOS``),
    left padding, padding only in the last slot, a static row, a static row with fewer samples than its
    micro-batch size (zero-length segments after the tail, as every short static micro-batch has), the padded
    layout, an all-padding micro-batch."""
    left = video_receipt_batch("left")
    return [
        ("left-thd", left, "thd", False, None),
        ("left-thd_static", left, "thd_static", False, None),
        ("short-thd_static", left, "thd_static", False, 5),
        ("left-bshd", left, "bshd", False, None),
        ("last-slot-thd", last_slot_batch(cp_align=8), "thd", False, None),
        ("all-padding-thd", all_padding_batch(), "thd", False, None),
        ("left-thd-moe", left, "thd", True, None),
    ]


def _run_case(state_dict, batch, layout, moe, micro_batch_size, cp):
    """One forward/backward; loss, token count and gradients reduced over the CP group."""
    model = build_qwen3_vl(tiny_qwen3_vl_config(moe=moe, cp=cp), seed=0)
    model.load_state_dict(state_dict)
    run = step_run(model, batch, layout, micro_batch_size=micro_batch_size)
    run.loss.backward()
    grads = gradients(model)
    totals = torch.stack([run.loss.detach().double(), run.num_tokens.double()])
    if cp > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        torch.distributed.all_reduce(totals, group=group)
        for g in grads.values():
            torch.distributed.all_reduce(g, group=group)
    return dict(loss=float(totals[0]), num_tokens=int(totals[1]), grads=grads,
                row_tokens=int(run.args["input_ids"].shape[1]),
                segments=None if run.args["packed_seq_params"] is None else len(run.args["packed_seq_params"].cu_seqlens_q))


def cp_worker(state_dicts, cases, cp):
    """Runs in every spawned rank (module level: pickled by reference)."""
    return {name: _run_case(state_dicts[moe], batch, layout, moe, mbs, cp) for name, batch, layout, moe, mbs in cases}


@pytest.fixture(scope="module")
def cp1_results():
    init_single_process_groups()
    cases = _cases()
    with cpu_stack():
        models = {moe: build_qwen3_vl(tiny_qwen3_vl_config(moe=moe), seed=0) for moe in (False, True)}
        state_dicts = {moe: m.state_dict() for moe, m in models.items()}
        results = {name: _run_case(state_dicts[moe], batch, layout, moe, mbs, 1)
                   for name, batch, layout, moe, mbs in cases}
    return cases, state_dicts, results


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_equals_cp1_on_the_real_model(cp1_results, cp):
    cases, state_dicts, reference = cp1_results
    if cp == 4:  # fewer cases: four processes share two cores
        cases = [case for case in cases if case[0] in ("left-thd", "last-slot-thd", "left-thd_static")]
    ranks = run_on_gloo(cp_worker, state_dicts, cases, cp, cp=cp, timeout=600)
    for name, *_ in cases:
        expected = reference[name]
        for rank, results in enumerate(ranks):
            got = results[name]
            # The step hands the model the whole row, aligned for the zigzag split; the model shards it.
            assert got["row_tokens"] % (2 * cp) == 0, (name, rank)
            assert got["num_tokens"] == expected["num_tokens"], name
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-9), name
            error, where = worst_relative_gradient_error(got["grads"], expected["grads"])
            assert error <= GRAD_TOLERANCE, f"{name} rank {rank}: {where} relative gradient error {error:.2e}"
    assert reference["left-thd"]["num_tokens"] > 0 and reference["all-padding-thd"]["num_tokens"] == 0
    # The short static micro-batch really carries zero-length segments (3 samples + tail, 6 segments), and its
    # numbers are the full static micro-batch's.
    assert reference["short-thd_static"]["segments"] == 5 + 2 and reference["left-thd_static"]["segments"] == 3 + 2
    assert reference["short-thd_static"]["loss"] == pytest.approx(reference["left-thd_static"]["loss"], rel=1e-6)
    assert len(dict((name, b) for name, b, *_ in cases)["left-thd"]["visual_inputs"].video_grid_thw) == 2
