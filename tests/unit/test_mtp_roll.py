"""``roll_packed_left`` (the MTP per-sample label roll) against a per-sample Python reference.

The reference unpacks every sample's real tokens, rolls them with ``torch.roll``, zeroes the
last and writes them back into a zero row: it shares nothing with the gather-index
implementation. Padding slots of the input hold a garbage value that must never reach the
output. Context parallelism runs on real gloo processes; each rank's local result is put back
in full-row order with a zigzag split written here (not ``thd_partition_indices``).
"""

from __future__ import annotations

import random

import pytest
from _packing_helpers import round_up
import torch
from megatron.core.packed_seq_params import PackedSeqParams

from _mtp_rows import GARBAGE, build_row, cumsum0, make_params, random_metadata, reference_roll
from megatron.bridge_thd.mtp import megatron_roll_is_exact, roll_packed_left, roll_packed_left_with_megatron




# ---------------------------------------------------------------------------------------------
# CP = 1: hand-written cases


def test_no_padding_matches_hand_roll():
    params = make_params([3, 2], [3, 2])
    out = roll_packed_left(torch.tensor([[1, 2, 3, 4, 5]]), params)
    assert out.tolist() == [[2, 3, 0, 5, 0]]


def test_alignment_padding_matches_hand_roll():
    p = GARBAGE
    params = make_params([3, 2], [4, 4], pad_between_seqs=True)
    out = roll_packed_left(torch.tensor([[1, 2, 3, p, 4, 5, p, p]]), params)
    assert out.tolist() == [[2, 3, 0, 0, 5, 0, 0, 0]]


def test_empty_sample_and_single_token_sample():
    p = GARBAGE
    # lengths [2, 0, 1, 3], slots [2, 0, 2, 4]: an empty sample with an empty slot, a one-token sample.
    params = make_params([2, 0, 1, 3], [2, 0, 2, 4], pad_between_seqs=True)
    row = torch.tensor([[1, 2, 3, p, 4, 5, 6, p]])
    assert roll_packed_left(row, params).tolist() == [[2, 0, 0, 0, 5, 6, 0, 0]]


def test_empty_sample_with_padding_slot():
    p = GARBAGE
    params = make_params([0, 2], [4, 4], pad_between_seqs=True)
    row = torch.tensor([[p, p, p, p, 1, 2, p, p]])
    assert roll_packed_left(row, params).tolist() == [[0, 0, 0, 0, 2, 0, 0, 0]]


def test_static_tail_segment():
    p = GARBAGE
    # Two samples, then the row tail as an extra segment with no real token.
    params = make_params([3, 1, 0], [3, 1, 4], pad_between_seqs=True)
    row = torch.tensor([[1, 2, 3, 4, p, p, p, p]])
    assert roll_packed_left(row, params).tolist() == [[2, 3, 0, 0, 0, 0, 0, 0]]


def test_missing_padded_boundaries_mean_real_ones():
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cumsum0([2, 3]))
    assert roll_packed_left(torch.tensor([[1, 2, 3, 4, 5]]), params).tolist() == [[2, 0, 4, 5, 0]]


def test_bool_and_float_dtypes_keep_dtype():
    params = make_params([3, 2], [4, 4], pad_between_seqs=True)
    mask = torch.tensor([[True, True, True, True, True, True, True, True]])
    out = roll_packed_left(mask, params)
    assert out.dtype == torch.bool
    assert out.tolist() == [[True, True, False, False, True, False, False, False]]
    values = torch.tensor([[0.5, 1.5, 2.5, float("nan"), 3.5, 4.5, float("inf"), 1.0]])
    out = roll_packed_left(values, params)
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.5, 2.5, 0.0, 0.0, 4.5, 0.0, 0.0, 0.0]]


# ---------------------------------------------------------------------------------------------
# CP = 1: random metadata against the reference


@pytest.mark.parametrize("align", [1, 4, 8])
@pytest.mark.parametrize("lead", [(1,), (2, 1)])
def test_random_metadata_matches_reference(align, lead):
    rng = random.Random(1000 * align + len(lead))
    for case in range(60):
        lengths, slots = random_metadata(rng, align, tail=case % 2 == 1)
        row = build_row(lengths, slots, lead, seed=case)
        params = make_params(lengths, slots, pad_between_seqs=lengths != slots)
        out = roll_packed_left(row, params)
        expected = reference_roll(row, lengths, slots)
        assert out.shape == row.shape
        assert torch.equal(out, expected), (lengths, slots)


def test_packer_output_rolls_like_each_sample():
    """End to end: labels packed by ``pack_bshd_to_thd`` roll like each sample's own labels."""
    from megatron.bridge_thd.packing import pack_bshd_to_thd

    gen = torch.Generator().manual_seed(3)
    real_lengths = torch.tensor([5, 0, 3, 7])
    labels = torch.randint(1, 1000, (4, 8), generator=gen)
    batch = pack_bshd_to_thd(torch.ones(4, 8, dtype=torch.long), labels=labels, real_lengths=real_lengths, align_to=4)
    out = roll_packed_left(batch.labels, batch.packed_seq_params)
    starts = batch.cu_seqlens_padded.tolist()
    expected = torch.zeros_like(batch.labels)
    for b, length in enumerate(real_lengths.tolist()):
        if length:
            sample = labels[b, :length]
            expected[0, starts[b] : starts[b] + length] = torch.cat([sample[1:], sample.new_zeros(1)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fn", ["ours", "megatron"])
def test_op_count_independent_of_sample_count(fn):
    """No loop over samples: the same number of torch ops for 2 and 40 samples, and one host
    read (the CPU-only validation read; on an accelerator the checks are asynchronous asserts).
    Megatron-Core's roll, counted the same way, grows with the sample count (the counter sees it)."""
    from megatron.bridge_thd_testbed.opcount import count_ops

    counts = []
    for samples in (2, 40):
        lengths = [3 + i % 5 for i in range(samples)]
        slots = lengths if fn == "megatron" else [round_up(length, 4) for length in lengths]
        row = build_row(lengths, slots, seed=samples)
        params = make_params(lengths, slots, pad_between_seqs=lengths != slots)
        with count_ops() as count:
            out = roll_packed_left(row, params) if fn == "ours" else megatron_roll(row, params)
        assert torch.equal(out, reference_roll(row, lengths, slots))
        counts.append(count)
    if fn == "ours":
        assert counts[0].ops == counts[1].ops, (counts[0].by_op, counts[1].by_op)
        assert counts[0].host_syncs == counts[1].host_syncs == 1, counts[1].sync_sites
    else:
        assert counts[1].ops > counts[0].ops


# ---------------------------------------------------------------------------------------------
# Megatron-Core's roll_tensor


def megatron_roll(tensor, params, cp_group=None):
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    rolled, _ = roll_tensor(tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=params)
    return rolled


def test_megatron_roll_equals_ours_without_padding():
    rng = random.Random(7)
    for case in range(30):
        lengths, slots = random_metadata(rng, 1, tail=False)
        lengths = [length for length in lengths if length] or [1]
        row = build_row(lengths, lengths, (2, 1), seed=case)
        params = make_params(lengths, lengths, pad_between_seqs=False)
        ours = roll_packed_left(row, params)
        assert torch.equal(megatron_roll(row, params), ours)
        assert torch.equal(ours, reference_roll(row, lengths, lengths))


@pytest.mark.parametrize(
    "lengths, slots",
    [
        ([3, 2], [4, 4]),  # alignment padding in every slot
        ([4, 2], [4, 4]),  # padding only in the last slot: the row tail is left unzeroed
        ([3, 0], [3, 4]),  # a static tail segment with no real token
    ],
)
def test_megatron_roll_is_wrong_with_alignment_padding(lengths, slots):
    row = build_row(lengths, slots, seed=1)
    params = make_params(lengths, slots, pad_between_seqs=True)
    expected = reference_roll(row, lengths, slots)
    assert not torch.equal(megatron_roll(row, params), expected)
    assert torch.equal(roll_packed_left(row, params), expected)


def test_megatron_roll_moves_next_sample_token_into_padding():
    """Where exactly it goes wrong: slicing at real boundaries [0, 3, 5] of a row whose samples
    start at [0, 4], the padding slot 3 receives sample 1's first token and sample 1's first
    real token receives 0 (a lost training target)."""
    p = GARBAGE
    params = make_params([3, 2], [4, 4], pad_between_seqs=True)
    row = torch.tensor([[1, 2, 3, p, 4, 5, p, p]])
    wrong = megatron_roll(row, params)
    assert wrong[0, 3].item() == row[0, 4].item()  # padding slot gets sample 1's first token
    assert wrong[0, 4].item() == 0  # sample 1's first token should see its successor (5)
    assert wrong[0, 6].item() == p  # padding is not zeroed


def test_megatron_roll_is_exact_decisions():
    same = make_params([3, 2], [3, 2])
    differ = make_params([3, 2], [4, 4])
    assert megatron_roll_is_exact(make_params([3, 2], [3, 2], pad_between_seqs=False))
    # The flag is trusted and conservative: True means "may differ", no tensor read.
    assert not megatron_roll_is_exact(make_params([3, 2], [3, 2], pad_between_seqs=True))
    # None: decided by comparing the boundaries.
    assert megatron_roll_is_exact(same)
    assert not megatron_roll_is_exact(differ)
    assert megatron_roll_is_exact(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cumsum0([3, 2])))


@pytest.mark.parametrize("lengths, slots, delegates", [([3, 2], [3, 2], True), ([3, 2], [4, 4], False)])
def test_roll_with_megatron_delegates_only_where_exact(monkeypatch, lengths, slots, delegates):
    import megatron.core.transformer.multi_token_prediction as mtp_module

    calls = []
    original = mtp_module.roll_tensor

    def counting_roll_tensor(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(mtp_module, "roll_tensor", counting_roll_tensor)
    row = build_row(lengths, slots, (2, 1), seed=5)
    out = roll_packed_left_with_megatron(row, make_params(lengths, slots))
    assert bool(calls) == delegates
    assert torch.equal(out, reference_roll(row, lengths, slots))


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("fn", [roll_packed_left, roll_packed_left_with_megatron])
def test_wrong_row_length_names_tensor(fn):
    params = make_params([3, 2], [4, 4], pad_between_seqs=True)
    with pytest.raises(ValueError, match="tensor"):
        fn(torch.zeros(1, 7), params)


def test_bad_arguments_are_named():
    params = make_params([3, 2], [4, 4], pad_between_seqs=True)
    with pytest.raises(ValueError, match="^tensor"):
        roll_packed_left(torch.tensor(1), params)
    with pytest.raises(ValueError, match="^packed_seq_params"):
        roll_packed_left(torch.zeros(1, 8), None)
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        bad = make_params([3, 2], [4, 4])
        bad.cu_seqlens_q_padded = cumsum0([4, 4, 0])
        roll_packed_left(torch.zeros(1, 8), bad)
    with pytest.raises(ValueError, match="cu_seqlens_q:"):
        roll_packed_left(torch.zeros(1, 8), make_params([5, 2], [4, 4]))
    with pytest.raises(ValueError, match="qkv_format"):
        bad = make_params([3, 2], [4, 4])
        bad.qkv_format = "sbhd"
        roll_packed_left(torch.zeros(1, 8), bad)
