"""A CP size per sample over real processes: 4 gloo ranks, Megatron-Core's hybrid context-parallel groups
(``initialize_model_parallel(hybrid_context_parallel=True)``), its ``BalancedCPScheduler`` (through
``place_with_cp_per_sample``) and its schedule (``forward_backward_no_pipelining`` dispatching to
``hybrid_context_parallel_forward_backward``), Megatron-Bridge's real ``Qwen3VLModel`` with ``vision_dp_when_cp``.

One step: a long video sample that needs CP 4 at the chosen limit, two that need CP 2 and five short ones (two of
them share a row on one rank). The loss sum, the token count and every parameter gradient, summed over the 4 ranks
(what Megatron-Core's per-token loss and DDP sum), must equal the same samples at CP = 1 on one process.
"""

from __future__ import annotations

import pytest
import torch
from _real_model import FakeGroup
from _cp_per_sample import cp1_reference as _cp1_reference
from _cp_per_sample import MAX_TOKENS_PER_RANK, PLACEMENTS, SEQ_LENGTH, WORLD, place, run_hybrid_step
from _cp_per_sample import samples as _samples

from megatron.bridge_thd.batching.cp_per_sample import place_with_cp_per_sample
from megatron.bridge_thd.cp_per_sample import (
    LOCAL_CP_SIZE_KEY, CPPerSampleStep, RowCP, bound_cp_group, find_cp_group_holders, row_cp_of,
)
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd_testbed.launcher import run_on_gloo

GRAD_TOLERANCE = 1e-5


def _config(**overrides):
    return tiny_qwen3_vl_config(seq_length=SEQ_LENGTH, **overrides)


def _hybrid_config():
    return _config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=MAX_TOKENS_PER_RANK, vision_dp_when_cp=True)


def _placement():
    return place_with_cp_per_sample([len(s) for s in _samples()], world=WORLD, max_tokens_per_rank=MAX_TOKENS_PER_RANK)


def test_the_step_is_the_one_the_issue_asks_for():
    """Megatron-Core's scheduler gives the long video 4 ranks, the two middle samples 2 each and the short ones
    1, two of them in one row (checked first: its fill step may raise a CP size)."""
    placement = _placement()
    assert [len(s) for s in _samples()] == [166, 88, 95, 23, 36, 30, 39, 21]
    assert placement.cp_size_of() == {0: 4, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    assert placement.row_id_groups() == [[[0], [0], [0], [0]], [[1], [1], [2], [2]], [[3], [4], [5], [6]]]
    assert placement.rows[6].samples == (3, 7)


def test_the_time_placement_runs_several_cp_sizes_in_one_group():
    """Ours on the time model: one group (no barrier), every rank a row of CP 4, then 2, then 1, the rows of
    different sizes interleaved in one global order."""
    placement = place(_samples(), "time")
    assert placement.groups == 1
    for rank in range(WORLD):
        assert [row.cp_size for row in placement.rows_of(rank)] == [4, 2, 1], rank


def test_the_two_placements_differ_only_in_their_groups_and_which_rank_runs_each_cp1_row():
    """Why the time placement runs on the dense model only (here), not also on Qwen3.5-VL and the MoE model
    (test_cp_per_sample_qwen35.py, test_cp_per_sample_moe.py): on this step both placements make the same rows
    (the same samples, CP sizes and slots; the CP > 1 rows on the same ranks) and give every rank CP 4, 2, 1 in that
    order, so a GDN layer or a router meets the same rows in the same order under either; what differs, one group
    instead of three and the ranks of the CP = 1 rows, is the schedule's, which the dense model's run covers. If this
    fails, the time placement needs its run on those models again."""
    megatron, by_time = (place(_samples(), placement) for placement in ("megatron", "time"))

    def rows(placement):
        return sorted((row.samples, row.cp_size, row.slots, row.ranks if row.cp_size > 1 else ())
                      for row in placement.rows)

    assert rows(megatron) == rows(by_time)
    assert (megatron.groups, by_time.groups) == (3, 1)
    for rank in range(WORLD):
        assert [row.cp_size for row in megatron.rows_of(rank)] == [row.cp_size for row in by_time.rows_of(rank)], rank


def hybrid_worker(state_dict, samples, placements=PLACEMENTS):
    """Every rank, per placement (one world for both: the same groups, weights and samples): a fresh model, the
    step's rows through Megatron-Core's hybrid-CP schedule, then the sums over the world."""
    return {placement: _hybrid_step(state_dict, samples, placement) for placement in placements}


def _hybrid_step(state_dict, samples, placement):
    model = build_qwen3_vl(_hybrid_config(), seed=0)
    model.load_state_dict(state_dict)
    result = run_hybrid_step(model, samples, placement)
    calls = result.pop("calls")
    return dict(result, row_cp_sizes=[int(p.local_cp_size) for p in calls],
                groups=[None if p.cp_group is None else torch.distributed.get_process_group_ranks(p.cp_group)
                        for p in calls],
                row_slots=[int(p.cu_seqlens_q_padded[-1]) for p in calls],
                holders_restored=all(getattr(h, n) is model.pg_collection.cp
                                     for h, n in find_cp_group_holders(model).places))


@pytest.fixture(scope="module")
def cp1_reference():
    """The same samples on one process at CP = 1: one packed THD row, its loss sum, tokens and gradients."""
    return _cp1_reference(lambda: build_qwen3_vl(_config(), seed=0))


@pytest.fixture(scope="module")
def hybrid_runs(cp1_reference):
    """Per rank, per placement: the step on the 4-rank hybrid-CP world (:func:`hybrid_worker`; one world runs both)."""
    return run_on_gloo(hybrid_worker, cp1_reference[0], _samples(), PLACEMENTS, dp=WORLD, hybrid_cp=True,
                       timeout=600)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_cp_per_sample_equals_cp1_on_the_real_model(cp1_reference, hybrid_runs, placement):
    _, expected = cp1_reference
    placed = place(_samples(), placement)
    assert expected["num_tokens"] > 0
    for rank, got in enumerate(by_placement[placement] for by_placement in hybrid_runs):
        # Each rank ran its rows with their CP sizes and Megatron-Core's groups, one forward per row, in order.
        mine = placed.rows_of(rank)
        assert got["row_cp_sizes"] == [row.cp_size for row in mine], rank
        assert got["groups"] == [list(row.ranks) if row.cp_size > 1 else None for row in mine], rank
        assert got["row_slots"] == [row.slots for row in mine], rank
        if placement == "megatron":
            pair = [0, 1] if rank < 2 else [2, 3]
            assert got["row_cp_sizes"] == [4, 2, 1], rank
            assert got["groups"] == [[0, 1, 2, 3], pair, None], rank
        # Every slot aligned for the row's CP size: 2k (the long video: 166 -> 168).
        assert got["row_slots"][0] == 168 and all(s % (2 * k) == 0 or k == 1
                                                  for s, k in zip(got["row_slots"], got["row_cp_sizes"])), rank
        assert got["holders_restored"], rank
        assert got["num_tokens"] == expected["num_tokens"], rank
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6), rank
        error, where = worst_relative_gradient_error(got["grads"], expected["grads"])
        assert error <= GRAD_TOLERANCE, f"rank {rank}: {where} relative gradient error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# the pieces on one process


def test_row_cp_of_reads_and_removes_the_schedules_size():
    plan = CPPerSampleStep(world=4, alignments=((1, 1), (2, 4), (4, 8)), holders=None)
    batch = {LOCAL_CP_SIZE_KEY: torch.tensor(1, dtype=torch.int32), "tokens": None}
    assert row_cp_of(batch, plan) == RowCP(1, None) and LOCAL_CP_SIZE_KEY not in batch
    with pytest.raises(ValueError, match="local_cp_size.*hybrid-CP schedule"):
        row_cp_of({"tokens": None}, plan)
    with pytest.raises(ValueError, match="local_cp_size: 8 is not a CP size"):
        row_cp_of({LOCAL_CP_SIZE_KEY: torch.tensor(8)}, plan)
    assert plan.alignment(4) == 8


def test_bound_cp_group_binds_every_holder_and_restores_them():
    init_single_process_groups()
    with cpu_stack():
        model = build_qwen3_vl(_config(), seed=0)
    holders = find_cp_group_holders(model)
    static = model.pg_collection.cp
    # The model's own attribute, its language model's, and the shared process-group collection.
    names = {(type(h).__name__, n) for h, n in holders.places}
    assert ("Qwen3VLModel", "cp_group") in names and ("ProcessGroupCollection", "cp") in names
    group = FakeGroup(2)
    with bound_cp_group(holders, group):
        assert model.pg_collection.cp is group and model.cp_group is group
        assert model.language_model.pg_collection.cp is group
    assert model.pg_collection.cp is static and model.cp_group is static
    with pytest.raises(RuntimeError), bound_cp_group(holders, group):
        raise RuntimeError("a forward that fails")
    assert all(getattr(h, n) is static for h, n in holders.places)


def test_the_cpu_attention_takes_the_rows_group_as_transformer_engine_does():
    """``TEDotProductAttention.forward``: ``packed_seq_params.cp_group`` replaces the module's group and persists;
    ``local_cp_size`` 1 without a group turns CP off; a larger size without its group is refused."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron.bridge_thd_cpu.attention import THDCoreAttention

    module = THDCoreAttention(_config(), 1, AttnMaskType.causal)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    q = torch.randn(4, 4, 16)
    kv = torch.randn(4, 2, 16)

    def params(**fields):
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                               cu_seqlens_kv_padded=cu, max_seqlen_q=4, max_seqlen_kv=4, **fields)

    module.cp_group = FakeGroup(2)  # as if a previous row ran on two ranks
    out = module(q, kv, kv, None, packed_seq_params=params(local_cp_size=1))
    assert module.cp_group is None and out.shape == (4, 64)
    module.cp_group = FakeGroup(2)
    module(q, kv, kv, None, packed_seq_params=params(cp_group=FakeGroup(1), local_cp_size=1))
    assert module.cp_group is None
    with pytest.raises(ValueError, match="local_cp_size: 2 without a cp_group"):
        module(q, kv, kv, None, packed_seq_params=params(local_cp_size=2))


def test_a_rank_without_a_row_in_a_group_is_refused():
    """The schedule runs each rank's last row of the last group outside its loop: every rank needs one."""
    from megatron.bridge_thd.batching.cp_per_sample import CPRow, CPPerSamplePlacement

    placement = CPPerSamplePlacement(rows=(CPRow(0, (0, 1), (0,), 8), CPRow(1, (0,), (1,), 4)), world=2,
                                   max_tokens_per_rank=8)
    with pytest.raises(RuntimeError, match=r"\(group, rank\) \[\(1, 1\)\]"):
        placement.row_id_groups()
    good = CPPerSamplePlacement(rows=(CPRow(0, (0, 1), (0,), 8),), world=2, max_tokens_per_rank=8)
    batches, groups = good.schedule_item(1, lambda row: {"samples": row.samples})
    assert groups == [[[0], [0]]] and batches == {0: {"samples": (0,)}}
