"""Rows and metadata for the MTP roll tests, and the per-sample reference roll, independent of the code under
test (shared by tests/unit/test_mtp_roll.py and tests/parallel/test_mtp_context_parallel.py)."""

from __future__ import annotations

import random

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from _packing_helpers import round_up

GARBAGE = -7  # every padding slot of an input row; the roll must output 0 there


def cumsum0(values: list[int]) -> torch.Tensor:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return torch.tensor(out, dtype=torch.int32)


def make_params(lengths: list[int], slots: list[int], pad_between_seqs=None) -> PackedSeqParams:
    cu, cu_padded = cumsum0(lengths), cumsum0(slots)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=max(slots),
        max_seqlen_kv=max(slots),
        pad_between_seqs=pad_between_seqs,
    )


def build_row(lengths, slots, lead=(1,), *, seed=0, dtype=torch.int64) -> torch.Tensor:
    """A ``(*lead, N)`` row: random non-zero values at real tokens, GARBAGE in padding slots."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.full((*lead, sum(slots)), GARBAGE, dtype=dtype)
    start = 0
    for length, slot in zip(lengths, slots):
        row[..., start : start + length] = torch.randint(1, 1000, (*lead, length), generator=gen).to(dtype)
        start += slot
    return row


def reference_roll(row: torch.Tensor, lengths, slots) -> torch.Tensor:
    """Per sample: take its real tokens, ``torch.roll`` left, zero the last, put back."""
    out = torch.zeros_like(row)
    start = 0
    for length, slot in zip(lengths, slots):
        if length:
            sample = row[..., start : start + length]
            rolled = torch.roll(sample, shifts=-1, dims=-1)
            rolled[..., -1] = 0
            out[..., start : start + length] = rolled
        start += slot
    return out


def zigzag_indices(slots: list[int], cp: int, rank: int) -> list[int]:
    """Full-row index of every token of CP rank ``rank``'s local row, by the definition."""
    out, start = [], 0
    for slot in slots:
        c = slot // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            out.extend(range(start + chunk * c, start + (chunk + 1) * c))
        start += slot
    return out


def random_metadata(rng: random.Random, align: int, *, tail: bool, max_len: int = 13):
    count = rng.randint(1, 6)
    lengths = [0 if rng.random() < 0.15 else rng.randint(1, max_len) for _ in range(count)]
    slots = [round_up(length, align) for length in lengths]
    if tail:
        lengths.append(0)
        slots.append(align * rng.randint(1, 3))
    if sum(slots) == 0:  # a row needs at least one token
        lengths.append(0)
        slots.append(align)
    return lengths, slots


