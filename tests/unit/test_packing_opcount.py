"""Op and host-sync counts of the packer: independent of the batch size, one sync (dynamic) or
none (static). A sanity test shows that the counter does see per-sample loops and syncs."""

from __future__ import annotations

import pytest
import torch

from _packing_helpers import megatron_4d_mask, round_up
from megatron.bridge_thd.packing import pack_bshd_to_thd, unpack_thd_to_bshd
from megatron.bridge_thd_testbed.opcount import count_ops

T = 32
BATCH_SIZES = (4, 64)
MASK_STYLES = ("mask2d", "mask2d_int", "real_lengths", "mask4d", "mask4d_query", "none")


def _inputs(batch: int, style: str, positions: str = "1d", seed: int = 0):
    gen = torch.Generator().manual_seed(seed + batch)
    lengths = torch.randint(0, T + 1, (batch,), generator=gen)
    keep = torch.arange(T)[None, :] < lengths[:, None]
    # Mix in left padding for the 2D masks: flip every other row.
    if style.startswith("mask2d"):
        keep[::2] = keep[::2].flip(1)
    ids = torch.randint(1, 1000, (batch, T), generator=gen)
    kwargs = dict(labels=ids.clone(), loss_mask=keep.float())
    if positions == "1d":
        kwargs["position_ids"] = torch.arange(T).expand(batch, T)
    elif positions == "3d":
        kwargs["position_ids"] = torch.arange(T).expand(3, batch, T)
    if style == "mask2d":
        kwargs["attention_mask"] = keep
    elif style == "mask2d_int":
        kwargs["attention_mask"] = keep.long()
    elif style == "real_lengths":
        kwargs["real_lengths"] = lengths
    elif style == "mask4d":
        kwargs["attention_mask"] = megatron_4d_mask(keep)
    elif style == "mask4d_query":
        kwargs["attention_mask"] = megatron_4d_mask(keep, query_padding=True)
    return ids, kwargs


def _count_pack(batch, style, positions="1d", **pack_kwargs):
    ids, kwargs = _inputs(batch, style, positions)
    if pack_kwargs.get("total_length") == "worst":
        pack_kwargs["total_length"] = batch * round_up(T, pack_kwargs.get("align_to", 1))
    attention_mask = kwargs.pop("attention_mask", None)
    with count_ops() as counts:
        packed = pack_bshd_to_thd(ids, attention_mask, **kwargs, **pack_kwargs)
    return counts, packed


@pytest.mark.parametrize("style", MASK_STYLES)
@pytest.mark.parametrize("positions", ["none", "1d", "3d"])
@pytest.mark.parametrize("align_to", [1, 8])
def test_dynamic_pack_op_count_independent_of_batch_size_one_sync(style, positions, align_to):
    results = [_count_pack(b, style, positions, align_to=align_to)[0] for b in BATCH_SIZES]
    assert results[0].ops > 0
    assert results[0].ops == results[1].ops, (results[0].by_op, results[1].by_op)
    assert results[0].by_op == results[1].by_op
    for counts in results:
        assert counts.host_syncs == 1, counts.sync_sites


@pytest.mark.parametrize("style", MASK_STYLES)
@pytest.mark.parametrize("total_length", ["worst", 4096])
@pytest.mark.parametrize("align_to", [1, 8])
def test_static_pack_op_count_independent_of_batch_size_no_sync(style, total_length, align_to):
    results = [_count_pack(b, style, align_to=align_to, total_length=total_length)[0] for b in BATCH_SIZES]
    assert results[0].ops == results[1].ops, (results[0].by_op, results[1].by_op)
    for counts in results:
        assert counts.host_syncs == 0, counts.sync_sites


@pytest.mark.parametrize("style", ["mask2d", "real_lengths", "mask4d"])
@pytest.mark.parametrize("align_to", [1, 4])
def test_static_pack_below_worst_case_still_has_no_host_sync(style, align_to):
    """Below the worst case the fit check is a device assert, not a host read."""
    ops = []
    for batch in BATCH_SIZES:
        ids, kwargs = _inputs(batch, style)
        keep = kwargs["loss_mask"].bool()
        needed = sum(round_up(int(n), align_to) for n in keep.sum(1))
        worst = batch * round_up(T, align_to)
        assert needed < worst
        attention_mask = kwargs.pop("attention_mask", None)
        with count_ops() as counts:
            packed = pack_bshd_to_thd(ids, attention_mask, **kwargs, align_to=align_to, total_length=needed)
        assert counts.host_syncs == 0, counts.sync_sites
        assert packed.input_ids.shape == (1, needed)
        ops.append(counts.ops)
    assert ops[0] == ops[1]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("trailing", [(), (5,)])
def test_unpack_has_no_host_sync_and_batch_independent_op_count(static, trailing):
    results = []
    for batch in BATCH_SIZES:
        total_length = batch * T if static else None
        _, packed = _count_pack(batch, "mask2d", total_length=total_length)
        n = packed.input_ids.shape[1]
        values = torch.randn(1, n, *trailing, requires_grad=True)
        with count_ops() as counts:
            out = unpack_thd_to_bshd(values, packed)
        assert out.shape == (batch, T, *trailing)
        assert counts.host_syncs == 0, counts.sync_sites
        results.append(counts)
    assert results[0].ops == results[1].ops, (results[0].by_op, results[1].by_op)


def test_counter_sees_per_sample_slicing_loop():
    """The counter can fail: a per-sample ``x[i, :int(l[i])]`` loop syncs once per sample and
    dispatches more ops as the batch grows."""
    results = []
    for batch in BATCH_SIZES:
        x = torch.randn(batch, T)
        lengths = torch.randint(1, T + 1, (batch,))
        with count_ops() as counts:
            pieces = [x[i, : int(lengths[i])] for i in range(batch)]
            torch.cat(pieces)
        assert counts.host_syncs == batch
        results.append(counts)
    assert results[1].ops > results[0].ops


def test_counter_sees_boolean_mask_gather_and_tolist():
    x = torch.randn(4, T)
    keep = torch.rand(4, T) > 0.5
    with count_ops() as counts:
        x[keep]
    assert counts.host_syncs == 1
    with count_ops() as counts:
        keep.sum(1).tolist()
        torch.nonzero(keep.flatten())
    assert counts.host_syncs == 2
