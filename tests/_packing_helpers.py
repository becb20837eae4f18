"""Shared helpers for the packer tests: mask builders and a pure-Python reference packer.

Everything here is written independently of ``megatron.bridge_thd``: the reference packer works
on Python lists only, so that the tests compare the package against a second implementation
rather than against its own output.
"""

from __future__ import annotations

import random

import torch

LABEL_PAD = -100  # documented pad value for labels
LOSS_MASK_PAD = 0  # documented pad value for loss_mask
POSITION_PAD = 0  # documented pad value for position_ids

PADDING_STYLES = ("right", "left", "verl", "holes", "all_real", "all_padding")


def round_up(x: int, multiple: int) -> int:
    """Plain-int ceiling to a multiple: the tests' own reference (independent of
    ``packing.round_up``, which is under test); the one copy every test imports."""
    return -(-x // multiple) * multiple


def keep_row(style: str, seq_len: int, rng: random.Random) -> list[bool]:
    """One sample's keep mask (True = real token) in the given padding style."""
    if style == "all_real":
        return [True] * seq_len
    if style == "all_padding":
        return [False] * seq_len
    if style == "right":
        n = rng.randint(0, seq_len)
        return [True] * n + [False] * (seq_len - n)
    if style == "left":
        n = rng.randint(0, seq_len)
        return [False] * (seq_len - n) + [True] * n
    if style == "verl":
        # VERL: the prompt half is left-padded, the response half right-padded.
        prompt_width = rng.randint(0, seq_len)
        response_width = seq_len - prompt_width
        p = rng.randint(0, prompt_width)
        r = rng.randint(0, response_width)
        return (
            [False] * (prompt_width - p)
            + [True] * p
            + [True] * r
            + [False] * (response_width - r)
        )
    if style == "holes":
        return [rng.random() < 0.6 for _ in range(seq_len)]
    raise ValueError(style)


def verl_keep(prompt_lengths, response_lengths, prompt_width, response_width) -> torch.Tensor:
    """VERL-shaped keep mask: ``[pad.. prompt | response ..pad]`` per sample."""
    rows = []
    for p, r in zip(prompt_lengths, response_lengths):
        rows.append(
            [False] * (prompt_width - p) + [True] * p + [True] * r + [False] * (response_width - r)
        )
    return torch.tensor(rows, dtype=torch.bool).reshape(len(rows), prompt_width + response_width)


def megatron_4d_mask(keep: torch.Tensor, query_padding: bool = False) -> torch.Tensor:
    """Megatron causal-with-padding mask ``(B, 1, T, T)``, True = masked."""
    _, seq_len = keep.shape
    future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1)
    masked = future[None] | ~keep[:, None, :]
    if query_padding:
        masked = masked | ~keep[:, :, None]
    return masked[:, None]


def as_mask_dtype(keep: torch.Tensor, dtype_name: str) -> torch.Tensor:
    """The keep mask as bool, int or float (values 0 / 1: the package's one 2D mask rule)."""
    if dtype_name == "bool":
        return keep.clone()
    if dtype_name == "int":
        return keep.long()
    if dtype_name == "float":
        return keep.float()
    raise ValueError(dtype_name)


def reference_pack(keep_rows, per_sample_values, align_to, fill, total_length=None):
    """Pure-Python packing of one field.

    Args:
        keep_rows: list of B lists of bools.
        per_sample_values: list of B lists of T values (anything).
        align_to: slot alignment.
        fill: value of padding slots.
        total_length: static row length, or None.

    Returns:
        (row, slot_of): the packed row as a list, and ``slot_of[b][t]`` = slot index or None.
    """
    row: list = []
    slot_of = []
    for keep, values in zip(keep_rows, per_sample_values):
        slots = []
        n_real = 0
        for k, v in zip(keep, values):
            if k:
                slots.append(len(row))
                row.append(v)
                n_real += 1
            else:
                slots.append(None)
        row.extend([fill] * (round_up(n_real, align_to) - n_real))
        slot_of.append(slots)
    if total_length is not None:
        assert len(row) <= total_length
        row.extend([fill] * (total_length - len(row)))
    return row, slot_of


def reference_cu_seqlens(keep_rows, align_to, total_length=None):
    """(cu_seqlens, cu_seqlens_padded) as Python lists, from the spec."""
    cu, cu_padded = [0], [0]
    for keep in keep_rows:
        n = sum(1 for k in keep if k)
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + round_up(n, align_to))
    if total_length is not None:
        cu.append(cu[-1])
        cu_padded.append(total_length)
    return cu, cu_padded


def bshd_to_lists(t: torch.Tensor) -> list[list]:
    return [list(r) for r in t.tolist()]
