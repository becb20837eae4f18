"""The packing log adds no host synchronisation per micro-batch (docs/packing-logs.md): the step's own reads
(tests/model/test_step_host_syncs.py, unchanged) stay what they are with the packing log's sums added, counted by
``opcount`` on Megatron-Bridge's real model; the one read back is the logging interval's reduction."""

from __future__ import annotations

import pytest
import torch
from _real_model import receipt_batch, tiny_real_model, video_receipt_batch

from megatron.bridge_thd.packing_log import PackingTotals
from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch
from megatron.bridge_thd_testbed.opcount import count_ops
from megatron.bridge_thd_cpu.standalone import minimal_state

SEQ_LENGTH = 2048
# What test_step_host_syncs.py counts for prepare_micro_batch alone.
SYNCS_PER_LAYOUT = {"thd": 1, "thd_static": 0, "bshd": 1}


@pytest.fixture(scope="module")
def model():
    return tiny_real_model(SEQ_LENGTH)


def _prepare_and_add(model, batch, layout, totals):
    state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=batch["tokens"].shape[0], packing_layout=layout)
    model.config.seq_length = SEQ_LENGTH
    with count_ops() as counts:
        prepared = prepare_micro_batch(batch, model, state, model.pg_collection)
        totals.add(prepared.stats, prepared.loss_mask, prepared.forward_args)
    return counts, prepared


@pytest.mark.parametrize("layout", list(SYNCS_PER_LAYOUT))
@pytest.mark.parametrize("videos", [False, True])
def test_the_packing_sums_add_no_host_sync(model, layout, videos):
    totals = PackingTotals()
    batch = video_receipt_batch("right") if videos else receipt_batch("right")
    counts, prepared = _prepare_and_add(model, batch, layout, totals)
    assert counts.host_syncs == SYNCS_PER_LAYOUT[layout], counts.sync_sites
    with count_ops() as closing:
        totals.close_iteration(1)
    assert closing.host_syncs == 0, closing.sync_sites
    # The one read back, at the logging interval: the sums are what the step recorded.
    with count_ops() as reading:
        (row,) = totals.reduce()
    assert reading.host_syncs == 1, reading.sync_sites
    stats = prepared.stats
    assert row["real_tokens"] == int(stats.real_tokens) == int(batch["attention_mask"].bool().sum())
    assert row["supervised_tokens"] == int((prepared.loss_mask != 0).sum())
    assert row["attention_work"] == int(stats.attention_work)
    assert (row["token_slots"], row["padded_slots"], row["micro_batches"]) == (
        stats.processed_tokens, stats.padded_tokens, 1)
    grids = [g for g in (batch["visual_inputs"].image_grid_thw, getattr(batch["visual_inputs"], "video_grid_thw", None))
             if g is not None]
    assert row["vision_patches"] == sum(int(g.prod(dim=-1).sum()) for g in grids) > 0


def test_micro_batches_are_summed_per_iteration(model):
    totals = PackingTotals()
    _, first = _prepare_and_add(model, receipt_batch("right"), "thd", totals)
    _, second = _prepare_and_add(model, receipt_batch("left"), "thd", totals)
    totals.close_iteration(7)
    totals.close_iteration(8)  # no micro-batch: zeros
    rows = totals.reduce()
    assert [row["iteration"] for row in rows] == [7, 8]
    assert rows[0]["real_tokens"] == int(first.stats.real_tokens) + int(second.stats.real_tokens)
    assert rows[0]["micro_batches"] == 2 and rows[1]["micro_batches"] == 0 and rows[1]["real_tokens"] == 0
    assert totals.reduce() == []
