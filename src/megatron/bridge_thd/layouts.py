"""The layout contract: what each packing layout is, as data and small pure functions.

The step builds rows by it, ``configure`` sets Megatron-Bridge's flags by it, and the planner
counts slots by it: one home, so the three cannot drift. Reasoning: docs/layouts.md.

    >>> layout_for(requested="thd", pp=2, variable_seq_lengths=False)
    'thd_static'
    >>> bshd_width(601, seq_length=2048, tp=1, cp=1, pp=1, ep=1)
    608
    >>> thd_slots([5, 9], align=4), static_row_length(2, seq_length=10, align=4)
    (20, 24)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

from megatron.bridge_thd.packing import required_alignment, round_up

__all__ = [
    "Layout",
    "LAYOUTS",
    "LAYOUT_NAMES",
    "THD_LAYOUTS",
    "layout_for",
    "thd_alignment",
    "bshd_alignment",
    "bshd_width",
    "thd_slots",
    "static_row_length",
    "row_bucket",
]


@dataclass(frozen=True)
class Layout:
    """One packing layout (the settings' ``layout``).

    Attributes:
        name: the value users set.
        packed: the model gets one ``(1, N)`` THD row with ``packed_seq_params``.
    """

    name: str
    packed: bool


LAYOUTS: dict[str, Layout] = {
    layout.name: layout
    for layout in (
        Layout("thd", packed=True),  # one (1, N) row of real tokens, each slot aligned for TP / CP / SP / FP8
        Layout("thd_static", packed=True),  # the same row padded to a length fixed by the configuration
        Layout("bshd", packed=False),  # the padded (B, W) batch, samples re-laid right-padded
    )
}
LAYOUT_NAMES = tuple(LAYOUTS)
THD_LAYOUTS = tuple(name for name, layout in LAYOUTS.items() if layout.packed)


def layout_for(requested: str, *, pp: int, variable_seq_lengths: bool) -> str:
    """The layout that runs: ``requested``, except ``thd`` under pipeline parallelism without
    ``variable_seq_lengths``, which becomes ``thd_static`` (stages exchange fixed-shape buffers;
    a row whose length changes every micro-batch would make send and receive disagree)."""
    if requested not in LAYOUTS:  # an argument check: a run's layout comes from the validated settings
        raise ValueError(f"requested: {requested!r} is not one of {LAYOUT_NAMES}")
    if requested == "thd" and pp > 1 and not variable_seq_lengths:
        return "thd_static"
    return requested


def thd_alignment(tp: int, cp: int, *, sequence_parallel: bool, fp8: bool) -> int:
    """Every THD slot's alignment: ``2 * cp`` under CP, times ``tp`` with sequence parallelism,
    ``lcm(., 16)`` with FP8 (:func:`megatron.bridge_thd.packing.required_alignment`)."""
    return required_alignment(tp, cp, sequence_parallel=sequence_parallel, fp8=fp8)


def bshd_alignment(tp: int, cp: int) -> int:
    """The padded layout's width divisor, as Megatron-Bridge's ``qwen3_vl_step`` computes it:
    ``tp * 2 * cp`` under CP (else ``tp``), then ``lcm(., 16)`` because that step always passes
    ``use_fp8_padding=True`` (``models/qwen_vl/qwen3_vl_step.py``, ``_pad_and_pack_qwen3_vl_step``)."""
    return math.lcm(tp * cp * 2 if cp > 1 else tp, 16)


def bshd_width(batch_width: int, *, seq_length: int, tp: int, cp: int, pp: int, ep: int) -> int:
    """``W`` of the padded ``(B, W)`` layout for a collated batch ``batch_width`` wide: the width cut
    to ``seq_length`` and rounded up to :func:`bshd_alignment`; ``seq_length`` itself when PP>1 or
    EP>1 (Megatron-Bridge's ``force_to_pad_to_seq_len``)."""
    if pp > 1 or ep > 1:
        return seq_length
    return round_up(min(batch_width, seq_length), bshd_alignment(tp, cp))


def thd_slots(lengths, align: int) -> int:
    """Slots of a ``thd`` row: ``sum_i round_up(s_i, align)`` over real lengths ``s_i``."""
    return sum(round_up(int(n), align) for n in lengths)


def static_row_length(batch_size: int, *, seq_length: int, align: int, micro_batch_size: int | None = None,
                      row_length: int | None = None) -> int:
    """Slots of a ``thd_static`` row: ``max(micro_batch_size, B) * round_up(seq_length, align)``,
    whatever the data; with global-batch packing (``row_length`` set: the run's fixed row, chosen
    by ``megatron.bridge_thd.batching``), ``round_up(row_length, align)`` whatever the batch size."""
    if row_length is not None:
        return round_up(row_length, align)
    return max(micro_batch_size or batch_size, batch_size) * round_up(seq_length, align)

def row_bucket(row_lengths: Sequence[int], slots: int) -> int:
    """The index of the smallest of ``row_lengths`` (ascending: a run's ``thd_static`` rows) that holds
    ``slots`` aligned slots; ``len(row_lengths)`` when none does. Every micro-batch takes the smallest row
    that fits it; global-batch packing chooses the rows (``megatron.bridge_thd.batching``), the step reads them.

    >>> row_bucket((1024, 2048, 4096), 1024), row_bucket((1024, 2048, 4096), 1025), row_bucket((1024,), 2000)
    (0, 1, 1)
    """
    return bisect.bisect_left(row_lengths, slots)
