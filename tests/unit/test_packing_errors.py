"""Bad input to the packer: every error names the offending argument.

Shape and argument errors are ValueError in both modes; data-dependent errors are ValueError in
dynamic mode and device asserts (RuntimeError on the CPU) in static mode.
"""

from __future__ import annotations

import math

import pytest
import torch

import megatron.bridge_thd.packing as packing
from _packing_helpers import megatron_4d_mask, round_up
from megatron.bridge_thd.packing import pack_bshd_to_thd, required_alignment, unpack_thd_to_bshd

B, T = 3, 8


@pytest.fixture
def ids():
    return torch.arange(1, B * T + 1).reshape(B, T)


@pytest.fixture
def keep():
    return torch.tensor([[t < n for t in range(T)] for n in (8, 3, 5)])


# --------------------------------------------------------------------------------------------
# shapes and arguments
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,value",
    [
        ("labels", torch.zeros(B, T + 1, dtype=torch.long)),
        ("labels", torch.zeros(B + 1, T, dtype=torch.long)),
        ("labels", torch.zeros(B * T, dtype=torch.long)),
        ("loss_mask", torch.zeros(B, T - 1)),
        ("loss_mask", torch.zeros(1, B, T)),
        ("position_ids", torch.zeros(B, T + 2, dtype=torch.long)),
        ("position_ids", torch.zeros(2, B, T, dtype=torch.long)),
        ("position_ids", torch.zeros(3, B, T - 1, dtype=torch.long)),
        ("position_ids", torch.zeros(3, 1, B, T, dtype=torch.long)),
    ],
)
def test_companion_shape_mismatch(ids, name, value):
    with pytest.raises(ValueError, match=f"^{name}"):
        pack_bshd_to_thd(ids, **{name: value})


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    "mask",
    [
        torch.ones(B, T + 1, dtype=torch.bool),
        torch.ones(B - 1, T, dtype=torch.bool),
        torch.ones(T, B, dtype=torch.bool),
        torch.ones(B, 1, T),  # 3D
        torch.ones(B, T, T),  # 3D
        torch.ones(B * T),  # 1D
        torch.ones(B, 2, T, T, dtype=torch.bool),  # 4D, two heads
        torch.ones(2, 1, T, T, dtype=torch.bool),  # 4D, wrong batch
        torch.ones(B, 1, T, T + 1, dtype=torch.bool),  # 4D, wrong key length
        torch.ones(B, 1, 1, T, T, dtype=torch.bool),  # 5D
    ],
    ids=["2d_T+1", "2d_B-1", "2d_transposed", "3d_b1t", "3d_btt", "1d", "4d_heads", "4d_batch", "4d_keys",
         "5d"],
)
def test_attention_mask_bad_shape(ids, mask, static):
    total_length = B * T if static else None
    with pytest.raises(ValueError, match="^attention_mask"):
        pack_bshd_to_thd(ids, mask, total_length=total_length)


@pytest.mark.parametrize("bad", [torch.arange(T), torch.zeros(1, B, T, dtype=torch.long), [[1, 2]], None])
def test_input_ids_must_be_2d_tensor(bad):
    if bad is None:
        bad = torch.zeros(B, T, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="^input_ids"):
        pack_bshd_to_thd(bad)


@pytest.mark.parametrize("align_to", [0, -4, 2.0, "8", True, None])
def test_align_to_must_be_positive_int(ids, align_to):
    with pytest.raises(ValueError, match="^align_to"):
        pack_bshd_to_thd(ids, align_to=align_to)


@pytest.mark.parametrize("total_length", [-1, 24.0, "24", True])
def test_total_length_must_be_non_negative_int(ids, total_length):
    with pytest.raises(ValueError, match="^total_length"):
        pack_bshd_to_thd(ids, total_length=total_length)


@pytest.mark.parametrize("align_to,total_length", [(4, 30), (8, 36), (3, 25), (16, 100)])
def test_total_length_not_multiple_of_align_to(ids, align_to, total_length):
    assert total_length % align_to  # the input really is misaligned
    with pytest.raises(ValueError, match=rf"^total_length.*align_to={align_to}"):
        pack_bshd_to_thd(ids, align_to=align_to, total_length=total_length)


def test_attention_mask_and_real_lengths_together(ids, keep):
    with pytest.raises(ValueError, match="attention_mask.*real_lengths"):
        pack_bshd_to_thd(ids, keep, real_lengths=keep.sum(1))


def test_keep_is_packed_as_the_bool_mask_is_and_takes_no_other_mask(ids, keep):
    a, b = pack_bshd_to_thd(ids, keep=keep, align_to=2), pack_bshd_to_thd(ids, keep, align_to=2)
    for name in ("input_ids", "cu_seqlens", "cu_seqlens_padded", "padding_mask", "packed_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.max_seqlen == b.max_seqlen
    with pytest.raises(ValueError, match=r"^keep, attention_mask: pass one of them"):
        pack_bshd_to_thd(ids, keep, keep=keep)
    with pytest.raises(ValueError, match=r"^keep, real_lengths: pass one of them"):
        pack_bshd_to_thd(ids, keep=keep, real_lengths=keep.sum(1))
    with pytest.raises(ValueError, match=r"^keep: expected a \(\d+, \d+\) bool tensor, got torch.int64"):
        pack_bshd_to_thd(ids, keep=keep.long())


@pytest.mark.parametrize(
    "lengths",
    [torch.tensor([1, 2]), torch.tensor([[1, 2, 3]]), torch.tensor(3), torch.tensor([1.0, 2.0, 3.0]),
     torch.tensor([True, False, True])],
    ids=["short", "2d", "0d", "float", "bool"],
)
def test_real_lengths_bad_shape_or_dtype(ids, lengths):
    with pytest.raises(ValueError, match="^real_lengths"):
        pack_bshd_to_thd(ids, real_lengths=lengths)


# --------------------------------------------------------------------------------------------
# data-dependent errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [[8, 9, 1], [-1, 2, 3], [0, 0, 100]])
def test_real_lengths_out_of_range_dynamic(ids, lengths):
    with pytest.raises(ValueError, match=r"^real_lengths.*\[0, 8\]"):
        pack_bshd_to_thd(ids, real_lengths=torch.tensor(lengths))


@pytest.mark.parametrize("lengths", [[8, 9, 1], [-1, 2, 3]])
def test_real_lengths_out_of_range_static(ids, lengths):
    with pytest.raises(RuntimeError, match="real_lengths"):
        pack_bshd_to_thd(ids, real_lengths=torch.tensor(lengths), total_length=B * T)


@pytest.mark.parametrize("lengths", [[0, 8, 0], [8, 8, 8], [0, 0, 0]])
def test_real_lengths_at_the_bounds_are_accepted(ids, lengths):
    packed = pack_bshd_to_thd(ids, real_lengths=torch.tensor(lengths))
    assert torch.diff(packed.cu_seqlens).tolist() == lengths


def _bidirectional(keep):
    # Key padding only, no causal part.
    return (~keep[:, None, :]).expand(-1, T, -1)[:, None]


def _future_not_masked_for_one_query(keep):
    mask = megatron_4d_mask(keep).clone()
    mask[0, 0, 2, 5] = False
    return mask


def _inverted(keep):
    # A keep-style 4D mask (True = attend) passed where True = masked is expected.
    return ~megatron_4d_mask(keep)


def _document_mask(keep):
    # Megatron's reset_attention_mask layout: block-diagonal causal documents.
    mask = megatron_4d_mask(torch.ones_like(keep)).clone()
    mask[:, :, 4:, :4] = True
    return mask


@pytest.mark.parametrize("build", [_bidirectional, _future_not_masked_for_one_query, _inverted, _document_mask])
def test_4d_mask_not_causal_with_padding_dynamic(ids, keep, build):
    mask = build(keep)
    assert mask.shape == (B, 1, T, T)
    with pytest.raises(ValueError, match="^attention_mask.*causal"):
        pack_bshd_to_thd(ids, mask)


def test_4d_mask_full_bidirectional_without_padding(ids):
    """An all-False (attend everywhere) mask has no causal part."""
    with pytest.raises(ValueError, match="^attention_mask"):
        pack_bshd_to_thd(ids, torch.zeros(B, 1, T, T, dtype=torch.bool))


@pytest.mark.parametrize("build", [_bidirectional, _document_mask])
def test_4d_mask_not_causal_with_padding_static(ids, keep, build):
    with pytest.raises(RuntimeError, match="attention_mask"):
        pack_bshd_to_thd(ids, build(keep), total_length=B * T)


def test_total_length_too_small_static_raises_runtime_error(ids):
    # All 24 tokens are real; 16 cannot hold them.
    with pytest.raises(RuntimeError, match="total_length"):
        pack_bshd_to_thd(ids, total_length=16)


@pytest.mark.parametrize("align_to", [1, 4])
def test_total_length_smaller_than_worst_case_but_fitting_is_accepted(ids, keep, align_to):
    needed = sum(round_up(n, align_to) for n in (8, 3, 5))
    assert needed < B * round_up(T, align_to)
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to, total_length=needed)
    assert packed.input_ids.shape == (1, needed)
    assert packed.cu_seqlens_padded[-1].item() == needed
    with pytest.raises(RuntimeError, match="total_length"):
        pack_bshd_to_thd(ids, keep, align_to=align_to, total_length=needed - align_to)


def test_int32_overflow_dynamic(monkeypatch, ids, keep):
    monkeypatch.setattr(packing, "INT32_MAX", 15)
    # 8 + 3 + 5 = 16 tokens > 15
    with pytest.raises(ValueError, match="^input_ids.*15"):
        pack_bshd_to_thd(ids, keep)
    # 15 tokens fit.
    keep[2, 4] = False
    assert pack_bshd_to_thd(ids, keep).input_ids.shape == (1, 15)


def test_int32_overflow_static(monkeypatch, ids):
    monkeypatch.setattr(packing, "INT32_MAX", 20)
    with pytest.raises(ValueError, match="^total_length"):
        pack_bshd_to_thd(ids, real_lengths=torch.tensor([1, 1, 1]), total_length=24)


def test_int32_max_is_the_real_int32_limit():
    assert packing.INT32_MAX == 2**31 - 1


def test_total_length_beyond_int32_rejected_without_monkeypatch(ids):
    # 2**31 is a multiple of every power-of-two alignment and larger than INT32_MAX.
    with pytest.raises(ValueError, match="^total_length"):
        pack_bshd_to_thd(ids, align_to=8, total_length=2**31)


@pytest.mark.parametrize("shape", [(5,), (1, 5), (2, 16), (1, 17, 4)])
def test_unpack_rejects_values_of_another_row_length(ids, keep, shape):
    packed = pack_bshd_to_thd(ids, keep)  # N = 16
    with pytest.raises(ValueError, match="^values"):
        unpack_thd_to_bshd(torch.zeros(shape), packed)


# --------------------------------------------------------------------------------------------
# all-padding samples
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("empty_at", [0, 1, 2])
@pytest.mark.parametrize("align_to", [1, 4])
@pytest.mark.parametrize("total_length", [None, 48])
def test_all_padding_sample_does_not_disturb_neighbours(ids, empty_at, align_to, total_length):
    lengths = [5, 7, 2]
    lengths[empty_at] = 0
    keep = torch.tensor([[t < n for t in range(T)] for n in lengths])
    labels = ids + 1000
    packed = pack_bshd_to_thd(ids, keep, labels=labels, align_to=align_to, total_length=total_length)
    others = [i for i in range(B) if i != empty_at]
    ref = pack_bshd_to_thd(ids[others], keep[others], labels=labels[others], align_to=align_to,
                           total_length=total_length)
    # Same row (the empty sample takes no slot), same boundaries with a repeated entry.
    assert torch.equal(packed.input_ids, ref.input_ids)
    assert torch.equal(packed.labels, ref.labels)
    cu = packed.cu_seqlens.tolist()
    assert cu[empty_at] == cu[empty_at + 1]
    assert packed.cu_seqlens_padded[empty_at] == packed.cu_seqlens_padded[empty_at + 1]
    assert cu[: empty_at + 1] + cu[empty_at + 2 :] == ref.cu_seqlens.tolist()
    # Round trip: the empty sample unpacks to zeros, the others to their real tokens.
    out = unpack_thd_to_bshd(packed.labels, packed)
    assert torch.equal(out[empty_at], torch.zeros(T, dtype=labels.dtype))
    assert torch.equal(out, torch.where(keep, labels, 0))


def test_all_padding_sample_through_4d_mask_and_real_lengths(ids):
    keep = torch.tensor([[t < n for t in range(T)] for n in (4, 0, 6)])
    a = pack_bshd_to_thd(ids, megatron_4d_mask(keep), align_to=2)
    b = pack_bshd_to_thd(ids, real_lengths=torch.tensor([4, 0, 6]), align_to=2)
    for packed in (a, b):
        assert packed.cu_seqlens.tolist() == [0, 4, 4, 10]
        assert packed.input_ids[0].tolist() == ids[0, :4].tolist() + ids[2, :6].tolist()


# --------------------------------------------------------------------------------------------
# required_alignment
# --------------------------------------------------------------------------------------------
def _documented_alignment(tp, cp, sp, fp8):
    """The documented rule: CP needs 2*cp, SP needs tp (multiplied in), FP8 needs 16 (lcm)."""
    align = 2 * cp if cp > 1 else 1
    if sp and tp > 1:
        align *= tp
    if fp8:
        align = align * 16 // math.gcd(align, 16)
    return align


ALIGNMENT_TABLE = [
    # tp, cp, sp, fp8, expected (written out by hand from the rule)
    (1, 1, False, False, 1),
    (8, 1, False, False, 1),  # TP without SP needs nothing
    (8, 1, True, False, 8),
    (1, 2, False, False, 4),
    (1, 4, False, False, 8),
    (2, 2, True, False, 8),
    (4, 2, True, False, 16),
    (4, 3, True, False, 24),
    (1, 3, False, False, 6),
    (1, 1, False, True, 16),
    (1, 3, False, True, 48),
    (2, 1, True, True, 16),
    (3, 1, True, True, 48),
    (4, 4, True, True, 32),
    (1, 1, True, False, 1),  # SP with tp=1 is a no-op
    (6, 5, True, True, 240),
]


@pytest.mark.parametrize("tp,cp,sp,fp8,expected", ALIGNMENT_TABLE)
def test_required_alignment_table(tp, cp, sp, fp8, expected):
    assert expected == _documented_alignment(tp, cp, sp, fp8)
    got = required_alignment(tp, cp, sequence_parallel=sp, fp8=fp8)
    assert isinstance(got, int)
    assert got == expected


@pytest.mark.parametrize("tp", range(1, 9))
@pytest.mark.parametrize("cp", range(1, 9))
def test_required_alignment_divisibility(tp, cp):
    for sp in (False, True):
        for fp8 in (False, True):
            a = required_alignment(tp, cp, sequence_parallel=sp, fp8=fp8)
            if cp > 1:
                assert a % (2 * cp) == 0
            if sp:
                assert a % tp == 0
            if fp8:
                assert a % 16 == 0
            assert a == _documented_alignment(tp, cp, sp, fp8)


@pytest.mark.parametrize("kwargs,name", [
    (dict(tp_size=0), "tp_size"),
    (dict(tp_size=-2), "tp_size"),
    (dict(tp_size=2.0), "tp_size"),
    (dict(cp_size=0), "cp_size"),
    (dict(cp_size=None), "cp_size"),
])
def test_required_alignment_rejects_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}"):
        required_alignment(**kwargs)


def test_required_alignment_feeds_the_packer(ids, keep):
    align = required_alignment(2, 2, sequence_parallel=True, fp8=False)  # 8
    packed = pack_bshd_to_thd(ids, keep, align_to=align)
    assert all(d % 8 == 0 for d in torch.diff(packed.cu_seqlens_padded).tolist())


@pytest.mark.parametrize("name", ["attention_mask", "real_lengths", "labels", "loss_mask", "position_ids"])
def test_non_tensor_arguments_name_the_argument(ids, name):
    value = [[1] * T] * B if name != "real_lengths" else [T] * B
    with pytest.raises(ValueError, match=rf"^{name}: expected a torch.Tensor"):
        pack_bshd_to_thd(ids, **{name: value})


def test_required_alignment_rejects_bool_sizes():
    with pytest.raises(ValueError, match="^tp_size"):
        required_alignment(tp_size=True)


def test_4d_mask_mixing_key_only_and_key_query_padding_per_sample(ids, keep):
    # Sample 0 masks only padded keys, sample 1 also masks its padded query rows: each sample is
    # a valid causal-with-padding mask, so the batch is accepted and packs like the 2D mask.
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    key_only = future | ~keep[:, None, :]
    key_and_query = key_only | ~keep[:, :, None]
    mixed = torch.stack([key_only[0], key_and_query[1], key_only[2]])[:, None]
    from_4d = pack_bshd_to_thd(ids, mixed)
    from_2d = pack_bshd_to_thd(ids, keep)
    assert torch.equal(from_4d.input_ids, from_2d.input_ids)
    assert torch.equal(from_4d.cu_seqlens, from_2d.cu_seqlens)
