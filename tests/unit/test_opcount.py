"""The op counter (``bridge_thd_testbed.opcount.count_ops``) counts every host read a GPU would stall on, each
exactly once: reads made by a tensor method, reads made inside torch functions (a tensor turned
into a Python number where no method is called), data-dependent output sizes, and blocking copies
between devices (the ``meta`` device stands in for a second device on the CPU). Pure device work
counts none."""

from __future__ import annotations

import operator

import pytest
import torch

from megatron.bridge_thd_testbed.opcount import count_ops


def _count(fn):
    with count_ops() as counts:
        fn()
    return counts


# --- reads made by a tensor method: one each, whatever they dispatch underneath -----------------

METHOD_READS = {
    "item": lambda t, x: t.item(),
    "tolist": lambda t, x: x.tolist(),
    "bool": lambda t, x: bool(t),
    "if_tensor": lambda t, x: 1 if x.sum() > 0 else 0,
    "int": lambda t, x: int(t),
    "float": lambda t, x: float(t),
    "index": lambda t, x: operator.index(t),
    "range": lambda t, x: range(t),
    "numpy": lambda t, x: x.numpy(),
    "cpu": lambda t, x: x.cpu(),
}


@pytest.mark.parametrize("case", list(METHOD_READS))
def test_a_method_read_counts_once(case):
    t, x = torch.tensor(3), torch.arange(10.0)
    counts = _count(lambda: METHOD_READS[case](t, x))
    assert counts.host_syncs == 1, counts.sync_sites


def test_item_dispatches_local_scalar_dense_but_counts_once():
    t = torch.tensor(3)
    counts = _count(t.item)
    assert counts.by_op["_local_scalar_dense"] == 1
    assert counts.host_syncs == 1 and counts.sync_sites == ["item"]


# --- reads made inside torch functions (no Python-level method is called) ------------------------

IMPLICIT_READS = {
    "arange": lambda t, x: torch.arange(t),
    "full_fill_value": lambda t, x: torch.full((2,), t),
    "zeros_size": lambda t, x: torch.zeros(t),
    "slice": lambda t, x: x[:t],
    "topk_k": lambda t, x: x.topk(t),
    # Tensor.split (Python) calls .item() on a tensor split size: a read nested inside a torch
    # function, which the torch-function level cannot see.
    "nested_split": lambda t, x: x.split(torch.tensor(5)),
    # Tensor.__format__ (Python) calls .item() on a 0-dim tensor.
    "nested_format": lambda t, x: format(t, "d"),
}


@pytest.mark.parametrize("case", list(IMPLICIT_READS))
def test_an_implicit_read_inside_a_torch_function_counts_once(case):
    t, x = torch.tensor(3), torch.arange(10.0)
    counts = _count(lambda: IMPLICIT_READS[case](t, x))
    assert counts.host_syncs == 1, counts.sync_sites
    assert counts.sync_sites[0].startswith("_local_scalar_dense")


def test_an_implicit_read_names_the_torch_function_it_happened_in():
    counts = _count(lambda: torch.arange(torch.tensor(4)))
    assert counts.sync_sites == ["_local_scalar_dense in arange"]


def test_a_read_nested_in_a_counted_read_counts_once():
    """``bool(t)`` reaches ``_local_scalar_dense`` underneath ``__bool__``; ``int(t.item())`` reads
    once; nested counters each count the read once."""
    t = torch.tensor(2)
    assert _count(lambda: bool(t)).host_syncs == 1
    assert _count(lambda: int(t.item())).host_syncs == 1
    with count_ops() as outer:
        with count_ops() as inner:
            t.item()
            torch.arange(t)
    assert inner.host_syncs == outer.host_syncs == 2, (inner.sync_sites, outer.sync_sites)


def test_each_read_counts_once_in_a_loop():
    x, lengths = torch.randn(5, 8), torch.tensor([1, 3, 8, 2, 4])
    counts = _count(lambda: [x[i, : lengths[i]] for i in range(5)])
    assert counts.host_syncs == 5, counts.sync_sites


def test_constructor_data_holding_tensors_reads_each():
    a, b = torch.tensor(1), torch.tensor(2)
    counts = _count(lambda: torch.tensor([a, b]))
    assert counts.host_syncs == 2, counts.sync_sites


# --- data-dependent output sizes ------------------------------------------------------------------

def test_nonzero_counts_once():
    keep = torch.tensor([True, False, True])
    assert _count(lambda: torch.nonzero(keep)).host_syncs == 1
    assert _count(keep.nonzero).host_syncs == 1
    assert _count(lambda: torch.where(keep)).host_syncs == 1


def test_boolean_mask_indexing_counts_once():
    x, keep = torch.randn(4, 6), torch.rand(4, 6) > 0.5
    counts = _count(lambda: x[keep])
    assert counts.host_syncs == 1 and counts.sync_sites == ["index"], counts.sync_sites
    assert _count(lambda: x.masked_select(keep)).host_syncs == 1


def test_data_sized_ops_count_once():
    s = torch.tensor([3, 1, 3, 0])
    assert _count(lambda: torch.unique(s)).host_syncs == 1
    assert _count(lambda: torch.bincount(s)).host_syncs == 1
    assert _count(lambda: torch.equal(s, s)).host_syncs == 1
    assert _count(lambda: torch.repeat_interleave(s)).host_syncs == 1
    assert _count(lambda: torch.repeat_interleave(s, s, output_size=7)).host_syncs == 0


# --- blocking copies between devices ("meta" stands in for a second device) ----------------------

def test_a_blocking_copy_between_devices_counts_once():
    x = torch.ones(3)
    counts = _count(lambda: x.to("meta"))
    assert counts.host_syncs == 1 and counts.sync_sites == ["_to_copy cpu->meta"], counts.sync_sites
    counts = _count(lambda: torch.empty(3, device="meta").copy_(x))
    assert counts.host_syncs == 1 and counts.sync_sites == ["copy_ cpu->meta"], counts.sync_sites
    assert _count(lambda: torch.tensor(x, device="meta")).host_syncs == 1


def test_a_constructor_from_host_data_onto_another_device_counts_once():
    counts = _count(lambda: torch.tensor([1, 2], device="meta"))
    assert counts.host_syncs == 1 and counts.sync_sites == ["tensor host->meta"], counts.sync_sites
    assert _count(lambda: torch.as_tensor([1, 2], device="meta")).host_syncs == 1


def test_non_blocking_and_same_device_copies_do_not_count():
    x = torch.ones(3)
    assert _count(lambda: x.to("meta", non_blocking=True)).host_syncs == 0
    assert _count(lambda: torch.empty(3, device="meta").copy_(x, non_blocking=True)).host_syncs == 0
    assert _count(lambda: torch.empty(3).copy_(x)).host_syncs == 0
    assert _count(lambda: x.to(torch.float64)).host_syncs == 0
    assert _count(lambda: x.to("cpu", non_blocking=True)).host_syncs == 0


def test_constructor_with_an_explicit_cpu_device_is_listed_not_counted():
    """On the CPU nothing is copied; on a GPU ``torch.tensor(host_data, device=cuda)`` is a blocking
    host-to-device copy: listed apart so a caller can see it."""
    counts = _count(lambda: torch.tensor([250, 251], device="cpu"))
    assert counts.host_syncs == 0
    assert counts.device_constructors == 1
    assert _count(lambda: torch.tensor([250, 251])).device_constructors == 0


# --- pure device work ---------------------------------------------------------------------------

def test_pure_device_ops_count_no_sync():
    x, keep = torch.randn(4, 6), torch.rand(4, 6) > 0.5
    index = torch.tensor([0, 2])

    def device_only():
        y = torch.where(keep, x, 0.0).cumsum(1)
        z = y.index_select(0, index) + y[index].sum()
        w = torch.zeros(8).scatter_add(0, torch.arange(6) % 8, x[0])
        torch._assert_async(keep.sum() >= 0)
        return z.mean(), w.max(), keep.any(), x.to(torch.float64), x[1:3], x.reshape(-1)

    counts = _count(device_only)
    assert counts.ops > 0
    assert counts.host_syncs == 0, counts.sync_sites


def test_counts_ops_per_dispatch():
    x = torch.randn(3)
    counts = _count(lambda: (x + 1) * 2)
    assert counts.ops == 2 and counts.by_op["add"] == 1 and counts.by_op["mul"] == 1
    assert counts.kernels == 2


def test_views_and_wrapped_numbers_launch_no_kernel():
    x, keep = torch.randn(4, 6), torch.rand(4, 6) > 0.5
    counts = _count(lambda: (x.view(-1), x[1:3], x[0], x.unsqueeze(0), x.t(), x.expand(2, 4, 6), torch.empty(3)))
    assert counts.ops == 7 and counts.kernels == 0, counts.by_op
    counts = _count(lambda: torch.where(keep, x, 0.0))
    assert counts.kernels == 1, counts.by_op


def test_each_sync_names_its_caller():
    def read_it(t):
        return t.item()

    counts = _count(lambda: (read_it(torch.tensor(1)), torch.arange(torch.tensor(2))))
    assert len(counts.sync_locations) == counts.host_syncs == 2
    assert "test_opcount.py:" in counts.sync_locations[0]
    assert counts.sync_locations[0].endswith("(read_it)")
    assert counts.sync_locations[1].endswith("(<lambda>)")
