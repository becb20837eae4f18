"""Hypothesis property tests for pack_bshd_to_thd / unpack_thd_to_bshd.

Every expected value comes from the pure-Python reference packer in ``_packing_helpers`` or
from the documented invariants of the THD layout, never from the package's own output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _packing_helpers import (
    LABEL_PAD,
    LOSS_MASK_PAD,
    PADDING_STYLES,
    POSITION_PAD,
    as_mask_dtype,
    keep_row,
    megatron_4d_mask,
    reference_cu_seqlens,
    reference_pack,
    round_up,
)
from megatron.bridge_thd.packing import pack_bshd_to_thd, unpack_thd_to_bshd
from megatron.core.packed_seq_params import PackedSeqParams

ALIGNS = (1, 2, 3, 4, 8, 16)
MASK_KINDS = ("mask2d", "real_lengths", "mask4d", "mask4d_query", "none")
MASK_DTYPES = ("bool", "int", "float")  # other values are refused (lengths.keep_mask_from_2d)
STATIC_MODES = ("dynamic", "worst_case", "larger", "fit")
POSITION_MODES = ("none", "1d", "3d")

PROPERTY_SETTINGS = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Case:
    B: int
    T: int
    keep: list  # B lists of T bools
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None
    align_to: int
    total_length: int | None
    pad_token_id: int
    mask_kind: str
    kwargs: dict = field(default_factory=dict)

    @property
    def keep_tensor(self) -> torch.Tensor:
        return torch.tensor(self.keep, dtype=torch.bool).reshape(self.B, self.T)

    def pack(self):
        return pack_bshd_to_thd(
            self.input_ids,
            labels=self.labels,
            loss_mask=self.loss_mask,
            position_ids=self.position_ids,
            align_to=self.align_to,
            total_length=self.total_length,
            pad_token_id=self.pad_token_id,
            **self.kwargs,
        )

    @property
    def lengths(self) -> list[int]:
        return [sum(r) for r in self.keep]


@st.composite
def cases(draw) -> Case:
    B = draw(st.integers(1, 8))
    T = draw(st.integers(1, 64))
    rng = draw(st.randoms(use_true_random=False))
    mask_kind = draw(st.sampled_from(MASK_KINDS))

    if mask_kind == "none":
        keep = [[True] * T for _ in range(B)]
    elif mask_kind == "real_lengths":
        # real_lengths describes right padding only (0 = all-padding sample, T = all real).
        lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        keep = [[t < n for t in range(T)] for n in lengths]
    else:
        styles = draw(st.lists(st.sampled_from(PADDING_STYLES), min_size=B, max_size=B))
        keep = [keep_row(s, T, rng) for s in styles]
    keep_t = torch.tensor(keep, dtype=torch.bool).reshape(B, T)

    kwargs: dict = {}
    if mask_kind == "mask2d":
        kwargs["attention_mask"] = as_mask_dtype(keep_t, draw(st.sampled_from(MASK_DTYPES)))
    elif mask_kind == "real_lengths":
        kwargs["real_lengths"] = torch.tensor([sum(r) for r in keep], dtype=torch.int64)
    elif mask_kind in ("mask4d", "mask4d_query"):
        kwargs["attention_mask"] = megatron_4d_mask(keep_t, query_padding=mask_kind == "mask4d_query")

    align_to = draw(st.sampled_from(ALIGNS))
    worst_case = B * round_up(T, align_to)
    static_mode = draw(st.sampled_from(STATIC_MODES))
    if static_mode == "dynamic":
        total_length = None
    elif static_mode == "worst_case":
        total_length = worst_case
    elif static_mode == "larger":
        total_length = worst_case + align_to * draw(st.integers(1, 3))
    else:  # the data fits, possibly in less than the worst case
        needed = sum(round_up(sum(r), align_to) for r in keep)
        total_length = needed + align_to * draw(st.integers(0, 2))

    gen = torch.Generator().manual_seed(rng.getrandbits(32))
    input_ids = torch.randint(1, 50_000, (B, T), generator=gen)
    labels = torch.randint(0, 50_000, (B, T), generator=gen)
    labels[torch.rand(B, T, generator=gen) < 0.2] = -100
    loss_mask = (torch.rand(B, T, generator=gen) < 0.7).float()
    position_mode = draw(st.sampled_from(POSITION_MODES))
    if position_mode == "none":
        position_ids = None
    elif position_mode == "1d":
        position_ids = torch.randint(0, 4096, (B, T), generator=gen)
    else:
        position_ids = torch.randint(0, 4096, (3, B, T), generator=gen)
    pad_token_id = draw(st.sampled_from((0, -1, 151643)))
    return Case(B, T, keep, input_ids, labels, loss_mask, position_ids, align_to, total_length,
                pad_token_id, mask_kind, kwargs)


def _masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype))


def _unpack_positions(packed_positions: torch.Tensor, packed) -> torch.Tensor:
    if packed_positions.dim() == 2:
        return unpack_thd_to_bshd(packed_positions, packed)
    # (3, 1, N) -> (N, 3) -> (B, T, 3) -> (3, B, T)
    return unpack_thd_to_bshd(packed_positions[:, 0].T, packed).permute(2, 0, 1)


@PROPERTY_SETTINGS
@given(cases())
def test_round_trip_restores_real_positions_and_zeroes_padding(case: Case):
    packed = case.pack()
    keep = case.keep_tensor
    assert torch.equal(unpack_thd_to_bshd(packed.input_ids, packed), _masked(case.input_ids, keep))
    # The (N,) form of the same row gives the same answer.
    assert torch.equal(unpack_thd_to_bshd(packed.input_ids[0], packed), _masked(case.input_ids, keep))
    assert torch.equal(unpack_thd_to_bshd(packed.labels, packed), _masked(case.labels, keep))
    assert torch.equal(unpack_thd_to_bshd(packed.loss_mask, packed), _masked(case.loss_mask, keep))
    if case.position_ids is None:
        assert packed.position_ids is None
    else:
        assert torch.equal(_unpack_positions(packed.position_ids, packed), _masked(case.position_ids, keep))
    # Per-token hidden states (1, N, H) come back as (B, T, H).
    hidden = torch.arange(packed.input_ids.shape[1] * 3, dtype=torch.float32).reshape(1, -1, 3)
    out = unpack_thd_to_bshd(hidden, packed)
    assert out.shape == (case.B, case.T, 3)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))


@PROPERTY_SETTINGS
@given(cases())
def test_rows_equal_pure_python_reference(case: Case):
    """Every real token is kept, in order, at its aligned slot; padding slots hold the pad."""
    packed = case.pack()
    ids_row, slot_of = reference_pack(
        case.keep, case.input_ids.tolist(), case.align_to, case.pad_token_id, case.total_length
    )
    labels_row, _ = reference_pack(case.keep, case.labels.tolist(), case.align_to, LABEL_PAD, case.total_length)
    loss_row, _ = reference_pack(case.keep, case.loss_mask.tolist(), case.align_to, LOSS_MASK_PAD,
                                 case.total_length)
    assert packed.input_ids.shape == (1, len(ids_row))
    assert packed.input_ids[0].tolist() == ids_row
    assert packed.labels[0].tolist() == labels_row
    assert packed.loss_mask[0].tolist() == loss_row
    assert packed.input_ids.dtype == case.input_ids.dtype
    assert packed.labels.dtype == case.labels.dtype
    assert packed.loss_mask.dtype == case.loss_mask.dtype
    if case.position_ids is not None:
        if case.position_ids.dim() == 2:
            pos_row, _ = reference_pack(case.keep, case.position_ids.tolist(), case.align_to, POSITION_PAD,
                                        case.total_length)
            assert packed.position_ids.shape == (1, len(pos_row))
            assert packed.position_ids[0].tolist() == pos_row
        else:
            assert packed.position_ids.shape == (3, 1, len(ids_row))
            for axis in range(3):
                pos_row, _ = reference_pack(case.keep, case.position_ids[axis].tolist(), case.align_to,
                                            POSITION_PAD, case.total_length)
                assert packed.position_ids[axis, 0].tolist() == pos_row

    # packed_index: the slot of each input position, N for padding.
    n = len(ids_row)
    assert packed.packed_index.dtype == torch.int64
    assert packed.packed_index.shape == (case.B, case.T)
    expected_index = [[n if s is None else s for s in row] for row in slot_of]
    assert packed.packed_index.tolist() == expected_index

    # All real tokens, in order, and all supervised (loss_mask == 1) labels, in order.
    real_tokens = [v for keep, row in zip(case.keep, case.input_ids.tolist()) for k, v in zip(keep, row) if k]
    assert packed.input_ids[0][~packed.padding_mask[0]].tolist() == real_tokens
    supervised = [
        lab
        for keep, lrow, mrow in zip(case.keep, case.labels.tolist(), case.loss_mask.tolist())
        for k, lab, m in zip(keep, lrow, mrow)
        if k and m == 1
    ]
    assert packed.labels[0][packed.loss_mask[0] == 1].tolist() == supervised


@PROPERTY_SETTINGS
@given(cases())
def test_cu_seqlens_invariants(case: Case):
    packed = case.pack()
    cu, cu_padded = packed.cu_seqlens, packed.cu_seqlens_padded
    n = packed.input_ids.shape[1]
    assert cu.dtype == torch.int32 and cu_padded.dtype == torch.int32
    assert cu.dim() == 1 and cu.shape == cu_padded.shape
    expected_segments = case.B + (1 if case.total_length is not None else 0)
    assert cu.numel() == expected_segments + 1
    assert cu[0].item() == 0 and cu_padded[0].item() == 0
    d, dp = torch.diff(cu).tolist(), torch.diff(cu_padded).tolist()
    assert all(x >= 0 for x in d) and all(x >= 0 for x in dp)
    assert d[: case.B] == case.lengths
    assert all(p % case.align_to == 0 for p in dp[: case.B])
    assert all(p == round_up(l, case.align_to) for p, l in zip(dp[: case.B], case.lengths))
    assert all(x <= p for x, p in zip(d, dp))
    assert cu_padded[-1].item() == n
    if case.total_length is not None:
        assert n == case.total_length
        assert d[-1] == 0  # the tail segment holds no real token
    else:
        assert n == sum(round_up(l, case.align_to) for l in case.lengths)
    # Transformer Engine's flag: True whenever any slot (the last one included) holds padding.
    has_padding = any(x != p for x, p in zip(d, dp))
    assert packed.packed_seq_params.pad_between_seqs is True if case.total_length is not None else (
        packed.packed_seq_params.pad_between_seqs == has_padding)
    ref_cu, ref_cu_padded = reference_cu_seqlens(case.keep, case.align_to, case.total_length)
    assert cu.tolist() == ref_cu and cu_padded.tolist() == ref_cu_padded
    # max_seqlen bounds every real length and is a Python int.
    assert isinstance(packed.max_seqlen, int)
    assert all(packed.max_seqlen >= l for l in case.lengths)
    assert all(packed.max_seqlen >= p for p in dp[: case.B])
    assert packed.max_seqlen % case.align_to == 0


@PROPERTY_SETTINGS
@given(cases())
def test_padding_mask_is_complement_of_real_slots(case: Case):
    packed = case.pack()
    ids_row, slot_of = reference_pack(case.keep, case.input_ids.tolist(), case.align_to, None, case.total_length)
    real_slots = {s for row in slot_of for s in row if s is not None}
    expected = [i not in real_slots for i in range(len(ids_row))]
    assert packed.padding_mask.dtype == torch.bool
    assert packed.padding_mask.shape == (1, len(ids_row))
    assert packed.padding_mask[0].tolist() == expected
    pad = packed.padding_mask[0]
    assert (packed.input_ids[0][pad] == case.pad_token_id).all()
    assert (packed.labels[0][pad] == LABEL_PAD).all()
    assert (packed.loss_mask[0][pad] == LOSS_MASK_PAD).all()
    if case.position_ids is not None:
        assert (packed.position_ids[..., pad] == POSITION_PAD).all()
    # Real slots lie inside their segment's [cu_padded[i], cu_padded[i] + len_i).
    cu_padded = packed.cu_seqlens_padded.tolist()
    for i, row in enumerate(slot_of):
        slots = [s for s in row if s is not None]
        assert slots == list(range(cu_padded[i], cu_padded[i] + len(slots)))


@PROPERTY_SETTINGS
@given(cases())
def test_packed_seq_params_carry_the_cu_tensors(case: Case):
    packed = case.pack()
    p = packed.packed_seq_params
    assert isinstance(p, PackedSeqParams)
    assert p.qkv_format == "thd"
    for got in (p.cu_seqlens_q, p.cu_seqlens_kv):
        assert got.dtype == torch.int32 and torch.equal(got, packed.cu_seqlens)
    for got in (p.cu_seqlens_q_padded, p.cu_seqlens_kv_padded):
        assert got.dtype == torch.int32 and torch.equal(got, packed.cu_seqlens_padded)
    assert p.max_seqlen_q == packed.max_seqlen and p.max_seqlen_kv == packed.max_seqlen


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(1, 3))
def test_gradients_flow_through_unpack_to_source_slots(case: Case, hidden: int):
    packed = case.pack()
    n = packed.input_ids.shape[1]
    _, slot_of = reference_pack(case.keep, case.input_ids.tolist(), case.align_to, None, case.total_length)
    gen = torch.Generator().manual_seed(case.B * 1000 + case.T)
    values = torch.randn(1, n, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(case.B, case.T, hidden, generator=gen, dtype=torch.float64)
    out = unpack_thd_to_bshd(values, packed)
    assert out.shape == (case.B, case.T, hidden)
    (out * weights).sum().backward()
    expected = torch.zeros(n, hidden, dtype=torch.float64)
    for b, row in enumerate(slot_of):
        for t, s in enumerate(row):
            if s is not None:
                expected[s] = weights[b, t]
    assert values.grad is not None
    assert torch.equal(values.grad[0], expected)
    assert (values.grad[0][packed.padding_mask[0]] == 0).all()


@pytest.mark.parametrize("align_to", [1, 4])
def test_all_padding_batch_packs_to_empty_row(align_to):
    """Dynamic mode with no real token anywhere: an empty row, all-zero cu_seqlens (as
    flash-attn's unpad_input gives)."""
    ids = torch.arange(12).reshape(3, 4)
    packed = pack_bshd_to_thd(ids, torch.zeros(3, 4, dtype=torch.bool), align_to=align_to)
    assert packed.input_ids.shape == (1, 0)
    assert packed.cu_seqlens.tolist() == [0, 0, 0, 0]
    assert packed.cu_seqlens_padded.tolist() == [0, 0, 0, 0]
    assert packed.packed_seq_params.pad_between_seqs is False
    assert torch.equal(unpack_thd_to_bshd(packed.input_ids, packed), torch.zeros_like(ids))


@pytest.mark.parametrize("align_to", [1, 4])
def test_min_length_extends_an_all_padding_row_by_one_padding_segment(align_to):
    """What the step asks for: a model cannot take a (1, 0) row, so it becomes one aligned
    segment of padding after the B empty samples."""
    ids = torch.arange(12).reshape(3, 4)
    packed = pack_bshd_to_thd(ids, torch.zeros(3, 4, dtype=torch.bool), align_to=align_to, min_length=align_to,
                              pad_token_id=7)
    assert packed.input_ids.tolist() == [[7] * align_to]
    assert packed.padding_mask.all()
    assert packed.cu_seqlens.tolist() == [0, 0, 0, 0, 0]
    assert packed.cu_seqlens_padded.tolist() == [0, 0, 0, 0, align_to]
    assert packed.packed_seq_params.pad_between_seqs is True
    assert packed.max_seqlen >= 1
    assert torch.equal(unpack_thd_to_bshd(packed.input_ids, packed), torch.zeros_like(ids))
    # A row already long enough is left alone.
    keep = torch.ones(3, 4, dtype=torch.bool)
    assert torch.equal(pack_bshd_to_thd(ids, keep, min_length=4).input_ids, pack_bshd_to_thd(ids, keep).input_ids)
