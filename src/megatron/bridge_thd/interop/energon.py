"""Megatron-Energon / LLaVA-OneVision2 packed rows: ``cu_lengths`` and sample-ID masks, to and from
:class:`~megatron.bridge_thd.packing.PackedBatch`.

For one row ``input_ids`` ``(1, N)`` (a packed row needs micro-batch 1): ``cu_lengths`` ``[[0]]``
is one causal sequence; ``cu_lengths`` ``(1, P)`` is ``P - 1`` samples back to back, block-diagonal
causal, the tokens after ``cu_lengths[-1]`` padding; a sample-ID mask
``[[1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 5, 0, 0]]`` gives the same boundaries. Padding is never part of a
sample: the tail, and what the parallel layout adds, is one dummy segment with no real token.
``pad_to_multiple_of`` (SP) pads only the row end; ``align_to`` (CP's ``2 * cp``, FP8) re-lays the
samples into aligned slots through the packer (one gather / scatter, no loop over samples).
Conventions, layouts, host reads and proofs: docs/energon.md.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.lengths import DeferredCheck, cu_seqlens_from_sample_ids, seq_idx
from megatron.bridge_thd.packing import PackedBatch, pack_bshd_to_thd, round_up

__all__ = [
    "packed_batch_from_cu_lengths",
    "packed_batch_from_sample_ids",
    "cu_lengths_from_packed_batch",
    "sample_ids_from_packed_batch",
]


def packed_batch_from_cu_lengths(
    input_ids: torch.Tensor,
    cu_lengths: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    align_to: int = 1,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """A :class:`PackedBatch` from an Energon row and its ``cu_lengths``.

    Args:
        input_ids: ``(1, N)`` token ids of one packed row (micro-batch 1).
        cu_lengths: ``(1, P)`` (or ``(P,)``) integer cumulative sample lengths starting at 0,
            strictly increasing (no empty sample), last entry <= N: P - 1 samples. ``(1, 1)``
            holding 0 means not packed: one causal sample over all N tokens.
        labels: ``(1, N)``; padding slots get -100.
        loss_mask: ``(1, N)``; padding slots get 0.
        position_ids: ``(1, N)`` or MRoPE ``(3, 1, N)``, already per sample as the model wants
            them (Qwen3-VL: restarting at 0 in every sample); padding slots get 0.
        align_to: every sample's physical slot is a multiple of this (context parallelism /
            FP8: :func:`~megatron.bridge_thd.packing.required_alignment`); > 1 re-lays the
            samples into aligned slots (see the module docstring).
        pad_to_multiple_of: the row length is a multiple of this (sequence parallelism: the TP
            size); the padding joins the tail as one dummy segment. With ``align_to`` > 1 it
            must divide ``align_to`` (aligned slots then make the row a multiple of it).
        pad_token_id: written into padding slots of ``input_ids``.

    Returns:
        A :class:`PackedBatch`: ``cu_seqlens`` / ``cu_seqlens_padded`` ``(P,)`` int32 (``(2,)``
        for ``[[0]]``), or one entry more with the dummy tail segment (real length 0) when the
        samples do not fill the row; ``max_seqlen`` the longest real slot; ``input_ids`` etc.
        ``(1, N')`` with ``N' >= round_up(N, lcm(align_to,
        pad_to_multiple_of))`` (equal when ``align_to`` is 1); ``packed_index`` ``(1, N)``.

    Raises:
        ValueError: naming the argument: a micro-batch other than 1, bad shapes or dtypes, and
            ``cu_lengths`` that do not start at 0, do not increase strictly or run past N
            (checked with the one host read).
    """
    n = _check_row("input_ids", input_ids)
    if not isinstance(cu_lengths, torch.Tensor):
        raise ValueError(f"cu_lengths: expected a torch.Tensor, got {type(cu_lengths).__name__}")
    if cu_lengths.dim() == 2:
        if cu_lengths.shape[0] != 1:
            raise ValueError(
                f"cu_lengths: a packed row needs micro-batch 1, got shape {tuple(cu_lengths.shape)}; "
                "pass one row's (1, P) cu_lengths (set micro_batch_size=1 for Energon's packed path)"
            )
        cu_lengths = cu_lengths[0]
    if cu_lengths.dim() != 1 or cu_lengths.numel() == 0:
        raise ValueError(f"cu_lengths: expected shape (1, P) with P >= 1, got {tuple(cu_lengths.shape)}")
    if cu_lengths.is_floating_point() or cu_lengths.is_complex() or cu_lengths.dtype == torch.bool:
        raise ValueError(f"cu_lengths: expected an integer tensor, got dtype {cu_lengths.dtype}")
    given = cu_lengths.to(device=input_ids.device, dtype=torch.int64)
    # Data-dependent checks: read with the packer's one host read (the details only on failure).
    checks = [
        DeferredCheck(
            given[0] != 0,
            "cu_lengths: must start at 0 (Energon's cumulative lengths; (1, 1) holding 0 = not packed)",
            lambda: f"got {given.tolist()[:16]}",
        )
    ]
    if given.numel() == 1:
        # Not packed: one causal sample over the whole row.
        cu = torch.cat([given, given.new_full((1,), n)])
    else:
        cu = given
        checks += [
            DeferredCheck(
                (given[1:] <= given[:-1]).any(),
                "cu_lengths: must be strictly increasing (every packed sample has at least one token)",
                lambda: f"got {given.tolist()[:16]}",
            ),
            DeferredCheck(
                given[-1] > n,
                f"cu_lengths: the last entry (tokens of all samples) must be <= {n}, the row length of input_ids; "
                "pass the cu_lengths of this very row",
                lambda: f"got {int(given[-1])}",
            ),
        ]
    # Row i of the view holds sample i alone; the tail after cu[-1] lies in no row, so the
    # packer drops it and the dummy segment stands in for it.
    return _pack_rows(
        input_ids, cu, None, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
        align_to=align_to, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id, checks=checks,
        last_row_may_be_padding=None,
    )


def packed_batch_from_sample_ids(
    input_ids: torch.Tensor,
    sample_ids: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    align_to: int = 1,
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
) -> PackedBatch:
    """A :class:`PackedBatch` from an Energon row and its sample-ID mask.

    Args:
        input_ids: ``(1, N)`` token ids of one packed row (micro-batch 1).
        sample_ids: ``(1, N)`` integer: sample k's tokens carry k, ids 1..K as contiguous runs in
            row order, 0 only for a trailing padding tail (``[[1, 1, 2, 2, 2, 0, 0]]``).
        labels, loss_mask, position_ids, align_to, pad_to_multiple_of, pad_token_id: as for
            :func:`packed_batch_from_cu_lengths`.

    Returns:
        The same :class:`PackedBatch` as :func:`packed_batch_from_cu_lengths` with the
        equivalent ``cu_lengths``: K real segments, plus the dummy tail segment when the row
        has padding (or the alignment needs some).

    Raises:
        ValueError: naming the argument: a micro-batch other than 1, a shape other than
            input_ids', ids that are not contiguous runs 1..K followed by zeros.
    """
    n = _check_row("input_ids", input_ids)
    if not isinstance(sample_ids, torch.Tensor):
        raise ValueError(f"sample_ids: expected a torch.Tensor, got {type(sample_ids).__name__}")
    if sample_ids.dim() == 2 and sample_ids.shape[0] != 1:
        raise ValueError(
            f"sample_ids: a packed row needs micro-batch 1, got shape {tuple(sample_ids.shape)}; pass one row "
            "(set micro_batch_size=1 for Energon's packed path)"
        )
    if tuple(sample_ids.shape) != (1, n):
        raise ValueError(f"sample_ids: shape {tuple(sample_ids.shape)} does not match input_ids; expected (1, {n})")
    ids = sample_ids.to(input_ids.device)
    # The ids are checked by cu_seqlens_from_sample_ids; zeros only form the tail, so the real
    # mask below only empties the tail segment.
    # Validates the layout and reads the number of samples on the host: it sizes the view.
    # Boundaries of K samples, and of the padding tail when there is one (last entry N).
    bounds = cu_seqlens_from_sample_ids(ids).to(torch.int64)
    # Whether the last segment is the padding tail or sample K is data: it rides along with the
    # packer's one read instead of costing a read of its own.
    return _pack_rows(
        input_ids, bounds, ids[0] != 0, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
        align_to=align_to, pad_to_multiple_of=pad_to_multiple_of, pad_token_id=pad_token_id, checks=[],
        last_row_may_be_padding=ids[0, -1] == 0,
    )


def cu_lengths_from_packed_batch(packed: PackedBatch) -> torch.Tensor:
    """Energon's ``cu_lengths`` of a packed row.

    Energon's convention has no padding inside a sample, so a sample is its physical slot:
    alignment padding at the end of a slot counts in its sample (under causal attention it
    follows the sample's real tokens and changes none of their outputs; its labels are -100),
    and the dummy segments at the end of the row (no real token) are the tail after
    ``cu_lengths[-1]``. Segments without a real token and of zero width (empty samples of a
    padded batch) are left out.

    Args:
        packed: a :class:`PackedBatch` (from this module or from ``pack_bshd_to_thd``).

    Returns:
        ``(1, K + 1)`` int32 ``[0, end_1, ..., end_K]``, K the number of segments with a real
        token. A row of a single sample gives ``[[0, end]]``, never the ``[[0]]`` "not packed"
        sentinel.

    Raises:
        ValueError: when the row holds no real token (``[[0]]`` would mean one sample over the
            whole row) or a padding segment lies between samples (Energon cannot describe it).
            One host read (the number of samples sizes the output).
    """
    cu_padded, has_real, order_of_real = _segments(packed)
    ends = cu_padded[1:]
    count, bad_layout, bad_end = torch.stack(
        [has_real.sum(), _padding_before_a_sample(cu_padded, has_real), _wrong_row_end(packed, ends)]
    ).tolist()
    _raise_layout_errors(bad_layout, bad_end, packed)
    if count == 0:
        raise ValueError(
            "packed: the row holds no real token; Energon's cu_lengths cannot describe it ([[0]] means one "
            "unpacked sample over the whole row)"
        )
    # Ends of the real segments in row order: a stable sort brings them first without a boolean
    # index (which would read the count on the host a second time).
    sample_ends = ends[order_of_real[:count]]
    return torch.cat([sample_ends.new_zeros(1), sample_ends]).to(torch.int32)[None]


def sample_ids_from_packed_batch(packed: PackedBatch) -> torch.Tensor:
    """Energon's sample-ID mask of a packed row.

    Args:
        packed: a :class:`PackedBatch` (from this module or from ``pack_bshd_to_thd``).

    Returns:
        ``(1, N)`` int64: slot j carries k (1-based) when it lies in the k-th segment that
        holds a real token (its alignment padding included, as for
        :func:`cu_lengths_from_packed_batch`), 0 in the dummy segments at the end.

    Raises:
        ValueError: when a padding segment lies between samples (zeros inside the row are not
            Energon's convention). One host read (the check).
    """
    cu_padded, has_real, _ = _segments(packed)
    ends = cu_padded[1:]
    bad_layout, bad_end = torch.stack(
        [_padding_before_a_sample(cu_padded, has_real), _wrong_row_end(packed, ends)]
    ).tolist()
    _raise_layout_errors(bad_layout, bad_end, packed)
    row_length = packed.input_ids.shape[-1]
    slots = torch.arange(row_length, device=ends.device)
    # Segment of every slot (seq_idx steps over zero-width segments).
    segment = seq_idx(cu_padded, slots).clamp(max=max(ends.numel() - 1, 0))
    ids = torch.where(has_real, has_real.cumsum(0), 0)[segment] if ends.numel() else slots.new_zeros(row_length)
    return ids[None]


def _check_row(name: str, input_ids) -> int:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"{name}: expected one packed row (1, N), got {shape}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"{name}: a packed row needs micro-batch 1, got shape {tuple(input_ids.shape)}; set "
            "micro_batch_size=1 for Energon's packed path (an unpacked (B, T) batch goes to pack_bshd_to_thd)"
        )
    if input_ids.shape[1] == 0:
        raise ValueError(f"{name}: the row is empty (shape {tuple(input_ids.shape)})")
    return input_ids.shape[1]


def _expand_companion(name: str, value, n: int, rows: int, allow_mrope: bool = False):
    """``(1, N)`` (or ``(3, 1, N)``) -> the ``(S, N)`` (``(3, S, N)``) view, without a copy."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) == (1, n):
        return value.expand(rows, n)
    if allow_mrope and tuple(value.shape) == (3, 1, n):
        return value.expand(3, rows, n)
    expected = f"(1, {n})" + (f" or MRoPE (3, 1, {n})" if allow_mrope else "")
    raise ValueError(f"{name}: shape {tuple(value.shape)} does not match input_ids; expected {expected}")


def _pack_rows(
    input_ids: torch.Tensor,
    bounds: torch.Tensor,
    real: torch.Tensor | None,
    *,
    labels,
    loss_mask,
    position_ids,
    align_to: int,
    pad_to_multiple_of: int,
    pad_token_id: int,
    checks: list[DeferredCheck],
    last_row_may_be_padding: torch.Tensor | None,
) -> PackedBatch:
    """Pack the segments ``[bounds[i], bounds[i + 1])`` of a ``(1, N)`` row, each its own sample.

    Args:
        bounds: ``(S + 1,)`` int64 segment boundaries (validated by ``checks``).
        real: ``(N,)`` bool, or None (all real): a segment's tokens outside it are dropped.
        checks: the caller's data checks, read with the packer's one host read.
        last_row_may_be_padding: 0-dim bool, True when the last segment holds no real token
            (the sample-ID tail), or None (it never is). Read with the same host read; when
            True the segment's end boundary is removed, so that the tail becomes the one dummy
            segment rather than an empty sample.
    """
    n = input_ids.shape[1]
    check_int("align_to", align_to)
    check_int("pad_to_multiple_of", pad_to_multiple_of)
    if align_to > 1 and align_to % pad_to_multiple_of:
        raise ValueError(
            f"pad_to_multiple_of: {pad_to_multiple_of} does not divide align_to={align_to}, so aligned slots would "
            f"not keep the row a multiple of it; pass align_to={math.lcm(align_to, pad_to_multiple_of)} (or "
            "required_alignment(tp, cp, sequence_parallel=True))"
        )
    rows = bounds.numel() - 1
    labels = _expand_companion("labels", labels, n, rows)
    loss_mask = _expand_companion("loss_mask", loss_mask, n, rows)
    position_ids = _expand_companion("position_ids", position_ids, n, rows, allow_mrope=True)

    columns = torch.arange(n, device=input_ids.device)
    keep = (columns[None, :] >= bounds[:-1, None]) & (columns[None, :] < bounds[1:, None])
    if real is not None:
        keep &= real[None, :]
    # The row never shrinks below the input row (rounded up): the tail after the last sample,
    # and the padding SP/CP need, become one dummy segment (the packer's min_length).
    min_length = round_up(n, math.lcm(align_to, pad_to_multiple_of))
    # The packer widens max_seqlen to min_length whenever it extends the row (so that a row of
    # padding only gets a usable bound); here the extension is the dummy tail, which, as in the
    # packer's static mode, max_seqlen need not bound. The longest real slot rides along with
    # the packer's one host read instead.
    longest_slot = round_up(keep.sum(dim=1, dtype=torch.int64), align_to).max()
    tail_flag = longest_slot.new_zeros(()) if last_row_may_be_padding is None else last_row_may_be_padding.long()
    packed = pack_bshd_to_thd(
        input_ids.expand(rows, n), keep=keep, labels=labels, loss_mask=loss_mask, position_ids=position_ids,
        align_to=align_to, min_length=min_length, pad_token_id=pad_token_id, checks=checks,
        host_values=torch.stack([longest_slot, tail_flag]),
    )
    last_row_is_padding, longest = packed.host_values[1], packed.host_values[0]
    # Every input position lies in at most one row of the view: the smallest slot is its own
    # (the others are the trash slot N'). (1, N): unpacking returns Energon's row layout.
    packed.packed_index = packed.packed_index.amin(dim=0, keepdim=True)
    if longest > 0:
        packed.max_seqlen = longest
        packed.packed_seq_params.max_seqlen_q = packed.packed_seq_params.max_seqlen_kv = longest
    if last_row_is_padding:
        # The last row was the padding tail: it packed to an empty sample (zero-width slot).
        # Drop its end boundary; the row end (the packer's dummy extension, if any) follows.
        packed.cu_seqlens = torch.cat([packed.cu_seqlens[:rows], packed.cu_seqlens[rows + 1 :]])
        packed.cu_seqlens_padded = torch.cat([packed.cu_seqlens_padded[:rows], packed.cu_seqlens_padded[rows + 1 :]])
        packed.packed_seq_params = dataclasses.replace(
            packed.packed_seq_params,
            cu_seqlens_q=packed.cu_seqlens, cu_seqlens_kv=packed.cu_seqlens,
            cu_seqlens_q_padded=packed.cu_seqlens_padded, cu_seqlens_kv_padded=packed.cu_seqlens_padded,
        )
    packed.host_values = None
    return packed


def _segments(packed: PackedBatch):
    """Physical boundaries ``(S + 1,)`` int64, has_real ``(S,)`` (the segment holds a real token), and the
    segment indices with the real ones first, in row order (stable sort)."""
    if not isinstance(packed, PackedBatch):
        raise ValueError(f"packed: expected a PackedBatch, got {type(packed).__name__}")
    cu = packed.cu_seqlens.to(torch.int64)
    cu_padded = (packed.cu_seqlens if packed.cu_seqlens_padded is None else packed.cu_seqlens_padded).to(torch.int64)
    if cu.dim() != 1 or cu.shape != cu_padded.shape or cu.numel() == 0:
        raise ValueError(
            f"packed: cu_seqlens {tuple(cu.shape)} and cu_seqlens_padded {tuple(cu_padded.shape)} must be (S + 1,) each"
        )
    has_real = cu[1:] > cu[:-1]
    order_of_real = torch.argsort((~has_real).to(torch.int8), stable=True)
    return cu_padded, has_real, order_of_real


def _padding_before_a_sample(cu_padded, has_real) -> torch.Tensor:
    """True when a segment without a real token but with a width lies before a real one."""
    starts, ends = cu_padded[:-1], cu_padded[1:]
    if has_real.numel() == 0:
        return has_real.new_zeros((), dtype=torch.int64)
    index = torch.arange(has_real.numel(), device=has_real.device)
    last_real = torch.where(has_real, index, -1).max()
    return (~has_real & (ends > starts) & (index < last_real)).any().to(torch.int64)


def _wrong_row_end(packed: PackedBatch, ends) -> torch.Tensor:
    row_length = packed.input_ids.shape[-1]
    last = ends[-1] if ends.numel() else ends.new_zeros(())
    return (last != row_length).to(torch.int64)


def _raise_layout_errors(bad_layout, bad_end, packed: PackedBatch) -> None:
    if bad_end:
        raise ValueError(
            f"packed: cu_seqlens_padded must end at the row length {packed.input_ids.shape[-1]} of input_ids"
        )
    if bad_layout:
        raise ValueError(
            "packed: a padding segment lies between two samples; Energon's cu_lengths / sample ids only "
            "describe padding at the end of the row"
        )
