"""The package's shared primitives, each at its one home: argument checks (checks), rounding
(packing.round_up / ceil_div), slot-to-segment (lengths.seq_idx), the one host read (lengths.read_once)."""

import pytest
import torch

from megatron.bridge_thd.checks import check_int, is_int_at_least
from megatron.bridge_thd.lengths import DeferredCheck, read_once, seq_idx
from megatron.bridge_thd.packing import ceil_div, round_up


@pytest.mark.parametrize("value", [0, -1, True, False, 2.0, "3", None])
def test_check_int_names_the_argument_and_the_fix(value):
    with pytest.raises(ValueError, match=r"^align_to: expected an int >= 1, got .*; pass required_alignment"):
        check_int("align_to", value, 1, "pass required_alignment")
    assert not is_int_at_least(value, 1)


def test_check_int_returns_the_value_and_appends_no_empty_hint():
    assert check_int("n", 0, 0) == 0 and check_int("n", 7) == 7
    with pytest.raises(ValueError, match=r"^n: expected an int >= 2, got 1$"):
        check_int("n", 1, 2)


def test_round_up_and_ceil_div_on_ints_and_tensors():
    assert [round_up(x, 4) for x in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert [ceil_div(x, 4) for x in (0, 1, 4, 5)] == [0, 1, 1, 2]
    big = 2**62 + 1  # exact where a float would round
    assert round_up(big, 2) == 2**62 + 2
    t = torch.tensor([[0, 1], [4, 5]])
    assert torch.equal(round_up(t, 4), torch.tensor([[0, 4], [4, 8]]))
    assert torch.equal(ceil_div(t, 4), torch.tensor([[0, 1], [1, 2]]))


def test_seq_idx_steps_over_zero_width_segments():
    cu = torch.tensor([0, 3, 3, 5, 8])  # segment 1 is empty
    slots = torch.arange(10)
    assert seq_idx(cu, slots).tolist() == [0, 0, 0, 2, 2, 3, 3, 3, 4, 4]  # past the row: S = 4
    assert seq_idx(cu, slots.reshape(2, 5)).shape == (2, 5)
    assert seq_idx(cu, slots).dtype == torch.int64


def test_read_once_splits_sizes_flags_and_extra():
    ok, bad = DeferredCheck(torch.tensor(False), "ok"), DeferredCheck(torch.tensor(True), "x: bad", lambda: "detail")
    assert read_once() == ([], None)
    assert read_once([torch.tensor(5), torch.tensor(2)], [ok], torch.tensor([[3, 4]])) == ([5, 2], [3, 4])
    assert read_once(checks=[ok]) == ([], None)
    assert read_once(extra=torch.tensor([1, 0])) == ([], [1, 0])
    with pytest.raises(ValueError, match=r"^x: bad \(detail\)$"):
        read_once([torch.tensor(5)], [ok, bad], torch.tensor([1]))
