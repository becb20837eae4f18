"""Global-batch packing changes where a step's samples go, never the numbers: on Megatron-Bridge
0.6.2's real ``Qwen3VLModel`` the step's loss (summed loss and supervised tokens over every
micro-batch and DP rank, Megatron's per-token reduction) and every gradient (summed over the DP
group, as DDP reduces them) are those of Megatron-Bridge's own placement of the same samples.

* DP = 2 over gloo, each rank running Megatron-Core's schedule on its micro-batches, for ``thd``
  (row capped at ``micro_batch_size * seq_length``) and ``thd_static`` (the in-batch row
  ``micro_batch_size * seq_length`` vs the row global-batch packing chooses for the step, and vs
  several rows, each micro-batch taking the shortest that holds it: ``row_buckets``);
* PP = 2, ``thd_static`` with ``variable_seq_lengths=False`` on Megatron-Core's 1F1B schedule, where
  the p2p buffers hold ``micro_batch_size * seq_length`` slots and global-batch packing puts any
  number of samples in a micro-batch; and with ``variable_seq_lengths=True`` and several rows.
"""

from __future__ import annotations

import pytest
import torch

from megatron.bridge_thd.batching.policy import assign, in_batch_assignment
from megatron.bridge_thd.batching.sampler import optimal_row_lengths
from megatron.bridge_thd.layouts import row_bucket
from megatron.bridge_thd.step.plan import StaticRow
from megatron.bridge_thd_cpu.data import select_samples, synthetic_receipt_batch
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
from megatron.bridge_thd_testbed.pipeline import pipeline_step
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups

NUM_LAYERS = 4  # two per pipeline stage; the deepstack layers 0 and 1 on the first
DP_NUM_LAYERS = 2
SEQ_LENGTH = 2048
DP, DP_MICRO_BATCH_SIZE, DP_SAMPLES = 2, 2, 8  # two micro-batches of two per rank
PP_MICRO_BATCH_SIZE, PP_SAMPLES = 2, 8  # four micro-batches of two


def _state_dict(num_layers: int) -> dict:
    init_single_process_groups()
    with cpu_stack():
        return build_qwen3_vl(tiny_qwen3_vl_config(num_layers=num_layers, seq_length=SEQ_LENGTH), seed=0).state_dict()


def _lengths(batch: dict) -> torch.Tensor:
    return batch["attention_mask"].sum(dim=1)


def _smallest_row(lengths, *, dp_size: int, num_micro_batches: int) -> int:
    """The shortest row at which the step's samples fit (independently of the policy's own search)."""
    row = max(int(lengths.max()), -(-int(lengths.sum()) // (dp_size * num_micro_batches)))
    while True:
        try:
            assign(lengths, dp_size=dp_size, num_micro_batches=num_micro_batches, row_length=row)
            return row
        except ValueError:
            row += 1


def _static_row(row_length: int, samples: int) -> StaticRow:
    """Global-batch packing's run row (alignment 1 here): a segment for every sample of the step, one for the tail;
    max_seqlen seq_length, as the loader records it."""
    return StaticRow(length=row_length, segments=samples + 1, max_seqlen=min(row_length, SEQ_LENGTH))


def _reduced(result: dict) -> tuple[float, int, dict]:
    """Loss sum, supervised tokens and gradients of one rank's micro-batches."""
    loss = sum(float(entry["lm loss"][0]) for entry in result["losses"])
    tokens = sum(int(entry["lm loss"][1]) for entry in result["losses"])
    return loss, tokens, result["grads"]


def _rows(row_lengths, samples: int) -> tuple:
    """The step's static rows (none: in-batch) for lengths ``row_lengths``, ascending."""
    return () if row_lengths is None else tuple(_static_row(length, samples) for length in row_lengths)


def _buckets(assignment, lengths, largest: int) -> tuple[int, ...]:
    """Up to four rows for the placement's micro-batches, the longest ``largest`` (as the loaders choose them)."""
    slots = [int(lengths[micro_batch].sum()) for rank in assignment for micro_batch in rank]
    return optimal_row_lengths(torch.tensor(slots), count=4, largest=largest)


def dp_worker(full_state_dict, batch, placements):
    """On each DP rank: its micro-batches of every placement through the real model under Megatron-Core's
    schedule; loss sums, token counts and gradients summed over the DP group."""
    from megatron.core import parallel_state

    rank, group = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_group()
    out = {}
    for name, (layout, assignment, row_lengths) in placements.items():
        micro_batches = [select_samples(batch, rows) for rows in assignment[rank]]
        result = pipeline_step(full_state_dict, micro_batches, layout, False, num_layers=DP_NUM_LAYERS,
                               micro_batch_size=DP_MICRO_BATCH_SIZE, seq_length=SEQ_LENGTH,
                               static_rows=_rows(row_lengths, len(batch["tokens"])))
        loss, tokens, grads = _reduced(result)
        totals = torch.tensor([loss, float(tokens)], dtype=torch.float64)
        torch.distributed.all_reduce(totals, group=group)
        for tensor in grads.values():
            torch.distributed.all_reduce(tensor, group=group)
        out[name] = dict(loss=float(totals[0]), tokens=int(totals[1]), grads=grads, rows=result["rows"],
                         rank_tokens=int(sum(_lengths(b).sum() for b in micro_batches)))
    return out


@pytest.fixture(scope="module")
def dp_step():
    full_state_dict = _state_dict(DP_NUM_LAYERS)
    batch = synthetic_receipt_batch(DP_SAMPLES, seed=3)
    lengths = _lengths(batch)
    num_micro_batches = DP_SAMPLES // (DP * DP_MICRO_BATCH_SIZE)
    own = in_batch_assignment(DP_SAMPLES, dp_size=DP, micro_batch_size=DP_MICRO_BATCH_SIZE)
    capacity = DP_MICRO_BATCH_SIZE * SEQ_LENGTH
    row = _smallest_row(lengths, dp_size=DP, num_micro_batches=num_micro_batches)
    placed = assign(lengths, dp_size=DP, num_micro_batches=num_micro_batches, row_length=capacity)
    placed_static = assign(lengths, dp_size=DP, num_micro_batches=num_micro_batches, row_length=row)
    buckets = _buckets(placed_static, lengths, row)
    placements = {
        "thd in-batch": ("thd", own, None),
        "thd global": ("thd", placed, None),
        "thd_static in-batch": ("thd_static", own, None),
        "thd_static global": ("thd_static", placed_static, (row,)),
        "thd_static global rows": ("thd_static", placed_static, buckets),
    }
    ranks = run_on_gloo(dp_worker, full_state_dict, batch, placements, dp=DP, timeout=600)
    return dict(ranks=ranks, placements=placements, row=row, lengths=lengths, buckets=buckets)


@pytest.mark.parametrize("layout, placement", [("thd", "global"), ("thd_static", "global"),
                                               ("thd_static", "global rows")])
def test_dp2_step_equals_in_batch_placement(dp_step, layout, placement):
    ranks, placements = dp_step["ranks"], dp_step["placements"]
    ours = f"{layout} {placement}"
    own, placed = ranks[0][f"{layout} in-batch"], ranks[0][ours]
    # The placement really moved samples: some micro-batch differs, and so do the ranks' token loads.
    assert placements[f"{layout} in-batch"][1] != placements[ours][1]
    assert [r[f"{layout} in-batch"]["rank_tokens"] for r in ranks] != [r[ours]["rank_tokens"] for r in ranks]
    assert placed["tokens"] == own["tokens"] > 0
    assert placed["loss"] == pytest.approx(own["loss"], rel=1e-6)
    # Both ranks hold the same reduced gradients (the DP all-reduce), equal to the in-batch step's.
    for name in own["grads"]:
        assert torch.equal(ranks[0][ours]["grads"][name], ranks[1][ours]["grads"][name])
    error, where = worst_relative_gradient_error(placed["grads"], own["grads"])
    assert error < 1e-5, (error, where)


def test_dp2_micro_batches_take_the_shortest_row_that_holds_them(dp_step):
    # Each rank's micro-batch reached the model in the shortest of the rows that holds its tokens, and the rows
    # differ between micro-batches (several shapes ran), all of them shorter than the in-batch row.
    buckets, lengths = dp_step["buckets"], dp_step["lengths"]
    assignment = dp_step["placements"]["thd_static global rows"][1]
    taken = []
    for rank, result in enumerate(dp_step["ranks"]):
        expected = [buckets[row_bucket(buckets, int(lengths[mb].sum()))] for mb in assignment[rank]]
        assert result["thd_static global rows"]["rows"] == expected
        assert result["thd_static global"]["rows"] == [dp_step["row"]] * len(assignment[rank])
        taken += expected
    assert len(set(taken)) > 1 and max(taken) == dp_step["row"] < DP_MICRO_BATCH_SIZE * SEQ_LENGTH


def test_dp2_static_row_is_the_chosen_row(dp_step):
    # The static row global-batch packing chooses holds the step in fewer slots than the in-batch row.
    row, lengths = dp_step["row"], dp_step["lengths"]
    assert int(lengths.max()) <= row < DP_MICRO_BATCH_SIZE * SEQ_LENGTH
    for rank in dp_step["placements"]["thd_static global"][1]:
        for micro_batch in rank:
            assert int(lengths[micro_batch].sum()) <= row


def pp_worker(full_state_dict, batch, placements):
    out = {}
    for name, (assignment, row_lengths, variable) in placements.items():
        micro_batches = [select_samples(batch, rows) for rows in assignment[0]]
        out[name] = pipeline_step(full_state_dict, micro_batches, "thd_static", variable, num_layers=NUM_LAYERS,
                                  micro_batch_size=PP_MICRO_BATCH_SIZE, seq_length=SEQ_LENGTH,
                                  static_rows=_rows(row_lengths, len(batch["tokens"])))
    return out


@pytest.fixture(scope="module")
def pp_step():
    full_state_dict = _state_dict(NUM_LAYERS)
    batch = synthetic_receipt_batch(PP_SAMPLES, seed=4)
    lengths = _lengths(batch)
    num_micro_batches = PP_SAMPLES // PP_MICRO_BATCH_SIZE
    own = in_batch_assignment(PP_SAMPLES, dp_size=1, micro_batch_size=PP_MICRO_BATCH_SIZE)
    # Without variable_seq_lengths the row must fill the (seq_length, micro_batch_size, H) p2p buffers.
    row = PP_MICRO_BATCH_SIZE * SEQ_LENGTH
    # A cost that grows fast with length forces unequal sample counts per micro-batch.
    from megatron.bridge_thd.cost.sample import SampleCost

    placed = assign(lengths, dp_size=1, num_micro_batches=num_micro_batches, row_length=row,
                    cost=SampleCost(per_token=0.0, per_token_squared=1.0))
    assert sorted(len(mb) for mb in placed[0]) != [PP_MICRO_BATCH_SIZE] * num_micro_batches or placed != own
    # With variable_seq_lengths, several rows: the step's tightest row and shorter ones chosen for its micro-batches.
    tight = _smallest_row(lengths, dp_size=1, num_micro_batches=num_micro_batches)
    placed_tight = assign(lengths, dp_size=1, num_micro_batches=num_micro_batches, row_length=tight)
    buckets = _buckets(placed_tight, lengths, tight)
    placements = {"in-batch": (own, None, False), "global": (placed, (row,), False),
                  "global rows": (placed_tight, buckets, True)}
    first, last = run_on_gloo(pp_worker, full_state_dict, batch, placements, pp=2, timeout=600)
    return dict(first=first, last=last, placements=placements, lengths=lengths, buckets=buckets)


@pytest.mark.parametrize("placement", ["global", "global rows"])
def test_pp2_thd_static_1f1b_equals_in_batch_placement(pp_step, placement):
    first, last = pp_step["first"], pp_step["last"]
    results = {}
    for name in ("in-batch", placement):
        assert first[name]["losses"] == []  # only the last stage reports losses
        loss, tokens, _ = _reduced(last[name])
        grads = {**first[name]["grads"], **last[name]["grads"]}
        results[name] = (loss, tokens, grads)
        assert last[name]["layouts"] == ["thd_static"]
    (loss, tokens, grads), (own_loss, own_tokens, own_grads) = results[placement], results["in-batch"]
    assert tokens == own_tokens > 0
    assert loss == pytest.approx(own_loss, rel=1e-6)
    error, where = worst_relative_gradient_error(grads, own_grads)
    assert error < 1e-5, (error, where)


def test_pp2_with_variable_seq_lengths_runs_several_rows(pp_step):
    # Both stages gave each micro-batch the shortest row that holds it, and more than one row ran through the
    # pipeline's p2p (variable_seq_lengths sends each micro-batch's shape).
    buckets, lengths = pp_step["buckets"], pp_step["lengths"]
    assignment = pp_step["placements"]["global rows"][0][0]
    expected = [buckets[row_bucket(buckets, int(lengths[mb].sum()))] for mb in assignment]
    assert pp_step["first"]["global rows"]["rows"] == expected == pp_step["last"]["global rows"]["rows"]
    assert len(set(expected)) > 1
