"""``lengths.py``: which tokens of a padded batch are real, the rule every layout and the VERL drop-in rest on.

Each mask convention against a reference written here: a 2D keep mask (bool, or only 0 / 1), a 4D Megatron
mask (causal with key, optionally query, padding), real lengths, and a packed row of sample ids; the deferred
checks fail on bad data and only when read.
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

from _packing_helpers import megatron_4d_mask
from megatron.bridge_thd.lengths import (
    DeferredCheck,
    cu_seqlens_from_lengths,
    cu_seqlens_from_sample_ids,
    keep_mask_from_2d,
    keep_mask_from_attention_mask,
    keep_mask_from_real_lengths,
    raise_failed_checks,
    real_lengths,
)


def _failed(checks) -> bool:
    return any(bool(check.failed) for check in checks)


# --------------------------------------------------------------------------------------------
# 2D keep masks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16])
def test_a_0_1_mask_of_any_dtype_is_the_same_keep_mask(dtype):
    pattern = [[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]]  # left, none, all padding
    keep, checks = keep_mask_from_2d(torch.tensor(pattern).to(dtype))
    assert keep.dtype == torch.bool and keep.tolist() == [[bool(v) for v in row] for row in pattern]
    assert not _failed(checks)
    assert checks == [] if dtype == torch.bool else len(checks) == 1


@pytest.mark.parametrize("bad", [2, 0.5, -1, float("nan")])
def test_a_value_other_than_0_or_1_fails_its_check_naming_the_argument(bad):
    mask = torch.tensor([[1.0, bad, 0.0]])
    _, checks = keep_mask_from_2d(mask, name="response_mask")
    assert _failed(checks)
    with pytest.raises(ValueError, match=r"^response_mask: a 2D keep mask must be bool or hold only 0 and 1"):
        raise_failed_checks(checks)


def test_a_complex_mask_is_refused_at_once():
    with pytest.raises(ValueError, match="attention_mask: expected a bool mask"):
        keep_mask_from_2d(torch.ones(1, 3, dtype=torch.complex64))


# --------------------------------------------------------------------------------------------
# 4D Megatron masks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("query_padding", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_a_causal_mask_with_padding_gives_back_the_keep_mask(query_padding, seed):
    generator = torch.Generator().manual_seed(seed)
    keep = torch.rand(3, 7, generator=generator) < 0.7
    got, checks = keep_mask_from_attention_mask(megatron_4d_mask(keep, query_padding=query_padding), 3, 7)
    assert torch.equal(got, keep)
    assert not _failed(checks)


def test_a_4d_mask_that_is_not_causal_fails_its_check():
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)  # nothing masked: bidirectional
    _, checks = keep_mask_from_attention_mask(mask, 1, 4)
    with pytest.raises(ValueError, match="not causal-with-padding"):
        raise_failed_checks(checks)


@pytest.mark.parametrize("shape", [(2, 5), (3, 4), (3, 2, 5, 5), (3, 1, 5, 4), (2, 1, 5, 5), (3, 5, 1)])
def test_a_mask_of_the_wrong_shape_is_refused_with_both_shapes(shape):
    with pytest.raises(ValueError, match=r"attention_mask: .*" + re.escape(str(tuple(shape)))):
        keep_mask_from_attention_mask(torch.zeros(shape), 3, 5)


# --------------------------------------------------------------------------------------------
# real lengths
# --------------------------------------------------------------------------------------------
def test_real_lengths_are_right_padded_keep_masks():
    keep, checks = keep_mask_from_real_lengths(torch.tensor([0, 3, 5]), 3, 5)
    assert keep.tolist() == [[False] * 5, [True] * 3 + [False] * 2, [True] * 5]
    assert not _failed(checks)


@pytest.mark.parametrize("lengths", [[-1, 2], [2, 6]])
def test_a_length_outside_the_row_fails_its_check(lengths):
    _, checks = keep_mask_from_real_lengths(torch.tensor(lengths), 2, 5)
    with pytest.raises(ValueError, match=r"real_lengths: every length must lie in \[0, 5\]"):
        raise_failed_checks(checks)


@pytest.mark.parametrize("bad", [torch.tensor([1.0, 2.0]), torch.tensor([1, 2, 3]), torch.tensor([[1, 2]])])
def test_lengths_of_the_wrong_shape_or_dtype_are_refused(bad):
    with pytest.raises(ValueError, match="real_lengths: expected"):
        keep_mask_from_real_lengths(bad, 2, 5)


# --------------------------------------------------------------------------------------------
# deferred checks
# --------------------------------------------------------------------------------------------
def test_only_the_first_failed_check_raises_and_details_are_built_only_then():
    calls = []

    def details():
        calls.append(1)
        return "found 7"

    checks = [DeferredCheck(torch.tensor(False), "first", details), DeferredCheck(torch.tensor(True), "second", details),
              DeferredCheck(torch.tensor(True), "third")]
    with pytest.raises(ValueError, match=r"^second \(found 7\)$"):
        raise_failed_checks(checks)
    assert calls == [1]
    raise_failed_checks(checks, flags=[False, False, False])  # flags already read by the caller decide
    raise_failed_checks([])


# --------------------------------------------------------------------------------------------
# sample-ID rows and length helpers
# --------------------------------------------------------------------------------------------
def test_sample_ids_documented_example():
    ids = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 5, 0, 0]])
    cu = cu_seqlens_from_sample_ids(ids)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 2, 5, 7, 8, 11, 13]
    assert cu_seqlens_from_sample_ids(ids[0]).tolist() == [0, 2, 5, 7, 8, 11, 13]


def test_sample_ids_without_padding_tail():
    cu = cu_seqlens_from_sample_ids(torch.tensor([[1, 2, 2, 3, 3, 3]]))
    assert cu.tolist() == [0, 1, 3, 6]


def _sample_ids_reference(ids: list[int]) -> list[int]:
    """K + 1 boundaries from run lengths of ids 1..K, plus the row end if a zero tail exists."""
    cu = [0]
    for _, group in itertools.groupby(i for i in ids if i != 0):
        cu.append(cu[-1] + len(list(group)))
    if 0 in ids:
        cu.append(len(ids))
    return cu


@pytest.mark.parametrize("seed", range(20))
def test_sample_ids_random_layouts(seed):
    rng = random.Random(seed)
    counts = [rng.randint(1, 6) for _ in range(rng.randint(1, 7))]
    tail = rng.choice([0, 0, 1, 5])
    ids = [k + 1 for k, c in enumerate(counts) for _ in range(c)] + [0] * tail
    assert cu_seqlens_from_sample_ids(torch.tensor([ids])).tolist() == _sample_ids_reference(ids)


@pytest.mark.parametrize(
    "ids",
    [
        [2, 2, 3],  # does not start at 1
        [1, 1, 3],  # skips an id
        [1, 2, 1],  # goes back
        [1, 0, 2],  # padding in the middle
        [1, 1, 0, 0, 1],  # padding then a sample again
        [0, 1, 1],  # leading padding
        [1, -1],  # negative id
        [1, 2, 2, 1, 0],
    ],
)
def test_sample_ids_bad_layouts_raise(ids):
    with pytest.raises(ValueError, match="sample_ids"):
        cu_seqlens_from_sample_ids(torch.tensor([ids]))


@pytest.mark.parametrize(
    "bad",
    [torch.tensor([[1, 1], [1, 1]]), torch.tensor([[1.0, 2.0]]), torch.ones(1, 1, 3, dtype=torch.long)],
    ids=["batch2", "float", "3d"],
)
def test_sample_ids_bad_shapes_raise(bad):
    with pytest.raises(ValueError, match="sample_ids"):
        cu_seqlens_from_sample_ids(bad)


def test_real_lengths_and_cu_seqlens_from_lengths():
    keep = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert real_lengths(keep).tolist() == [3, 0, 4]
    assert real_lengths(keep).dtype == torch.int64
    lengths = [3, 0, 4, 7, 1]
    assert cu_seqlens_from_lengths(torch.tensor(lengths)).tolist() == list(
        itertools.accumulate(lengths, initial=0)
    )
