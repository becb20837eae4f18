"""Pack a padded ``(B, T)`` batch into one THD row of real tokens, and back.

Sample i's real tokens are laid out in order at ``[cu_seqlens_padded[i],
cu_seqlens_padded[i] + len_i)``; the rest of its physical slot (alignment padding) and, in
static mode, the tail of the row are padding the attention kernel skips. Everything is one
gather/scatter over integer indices: the number of torch ops does not depend on B, and the only
host synchronisation (dynamic mode) reads the row length and the validity flags in one go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported where a row is built: importing megatron.core runs its whole package
    from megatron.core.packed_seq_params import PackedSeqParams

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.lengths import (
    DeferredCheck,
    cu_seqlens_from_lengths,
    keep_mask_from_attention_mask,
    keep_mask_from_real_lengths,
    read_once,
)
from megatron.bridge_thd.lengths import real_lengths as lengths_of_keep_mask

__all__ = [
    "PackedBatch",
    "pack_bshd_to_thd",
    "pack_kept",
    "check_static_row",
    "relay_right_padded",
    "unpack_thd_to_bshd",
    "required_alignment",
    "segment_index",
    "row_index",
    "scatter_into_row",
    "gather_from_row",
    "thd_packed_seq_params",
    "round_up",
    "ceil_div",
]

INT32_MAX = torch.iinfo(torch.int32).max
LABEL_PAD = -100
POSITION_PAD = 0


@dataclass
class PackedBatch:
    """One packed THD row and the metadata that describes it.

    Shapes: N is the row length, B the number of samples packed, T the padded input width.

    Attributes:
        input_ids: ``(1, N)`` token ids; padding slots hold ``pad_token_id``.
        labels: ``(1, N)`` or None; padding slots hold -100.
        loss_mask: ``(1, N)`` or None; padding slots hold 0.
        position_ids: ``(1, N)`` or ``(3, 1, N)`` (MRoPE) or None; padding slots hold 0.
        cu_seqlens: ``(S + 1,)`` int32 real boundaries (cumulative real lengths).
        cu_seqlens_padded: ``(S + 1,)`` int32 physical boundaries, last entry N. S = B; B + 1
            when a dynamic row is extended to ``min_length``; in static mode ``segments`` (default
            B + 1): the row tail is one extra segment with no real token, and any further
            segments are zero-length at N.
        max_seqlen: int, the longest physical slot of a real sample (>= every real length,
            a multiple of the alignment).
        padding_mask: ``(1, N)`` bool, True at every slot that holds no real token (the MoE
            router's padding mask).
        packed_seq_params: Megatron-Core ``PackedSeqParams`` (``qkv_format="thd"``) carrying
            the real and padded pairs for q and kv.
        packed_index: ``(B, T)`` int64, the row slot of each input position; N where the
            position is padding. ``unpack_thd_to_bshd`` gathers with it.
        host_values: the caller's ``host_values`` as read on the host (dynamic mode), else None.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    loss_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    padding_mask: torch.Tensor
    packed_seq_params: PackedSeqParams
    packed_index: torch.Tensor
    host_values: list[int] | None = None


def required_alignment(
    tp_size: int = 1, cp_size: int = 1, *, sequence_parallel: bool = False, fp8: bool = False
) -> int:
    """Physical slot alignment Megatron needs for a THD row.

    Context parallelism (TE) needs every segment divisible by ``2 * cp`` (each rank holds two
    chunks of every segment); sequence parallelism needs the row divisible by TP, which aligning
    every slot guarantees (times ``2 * cp`` so each CP rank's share stays divisible); FP8 GEMMs
    need multiples of 16.

    Returns:
        The alignment, an int >= 1, to pass as ``align_to``.
    """
    for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
        check_int(name, value, 1, "pass the parallel group size")
    align = 2 * cp_size if cp_size > 1 else 1
    if sequence_parallel and tp_size > 1:
        align *= tp_size
    return math.lcm(align, 16) if fp8 else align


def ceil_div(x, divisor):
    """``ceil(x / divisor)`` in integer arithmetic, for ints or integer tensors of any shape (elementwise;
    ``divisor`` an int >= 1 or a tensor that broadcasts). No float: exact for any int64."""
    return (x + divisor - 1) // divisor


def round_up(x, multiple):
    """The smallest multiple of ``multiple`` that is >= ``x``, for ints or integer tensors of any shape
    (elementwise; ``multiple`` an int >= 1). The one rounding rule of THD slots: ``round_up(length, align_to)``."""
    return ceil_div(x, multiple) * multiple


def _check_tensor(name: str, value) -> None:
    if value is not None and not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}; convert it with torch.as_tensor")


def _check_companion(name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    _check_tensor(name, tensor)
    if tensor is not None and tuple(tensor.shape) != shape:
        raise ValueError(
            f"{name}: shape {tuple(tensor.shape)} does not match input_ids; expected {shape}"
        )


def row_index(keep: torch.Tensor, starts: torch.Tensor, row_length: int) -> torch.Tensor:
    """Where each position of a padded batch goes in a row: its sample's start plus its rank among the
    sample's kept positions; ``row_length`` (the trash slot :func:`scatter_into_row` cuts off) where not kept.

    Args:
        keep: ``(B, T)`` bool, the positions that go into the row.
        starts: ``(B,)`` int64, where each sample's part of the row begins.
        row_length: N, the row length.

    Returns:
        ``(B, T)`` int64 in ``[0, N]``. Built in place: on the CPU each ``(B, T)`` temporary costs as much as
        a scatter.
    """
    index = keep.cumsum(dim=1)
    index.add_(starts[:, None] - 1)
    index.masked_fill_(~keep, row_length)
    return index


def scatter_into_row(values: torch.Tensor, index: torch.Tensor, row_length: int, fill) -> torch.Tensor:
    """Scatter ``(..., B, T)`` values into a ``(..., 1, N)`` row at ``index`` ``(B, T)``.

    Positions whose index is N go to a trash slot that is cut off, so padding needs no boolean
    indexing (a host sync); slots nothing is scattered to hold ``fill``.
    """
    lead = values.shape[:-2]
    flat_values = values.reshape(*lead, -1)
    flat_index = index.reshape(-1).expand(*lead, -1)
    row = flat_values.new_full((*lead, row_length + 1), fill)
    row.scatter_(-1, flat_index, flat_values)
    return row[..., :row_length].unsqueeze(-2)


def relay_right_padded(values: torch.Tensor, keep: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``(..., B, T)`` -> ``(..., B, width)``: each sample's real tokens first, then ``fill``.

    One scatter; a sample's k-th real token lands in column k. The padded layout (``bshd``) re-lays left-padded or
    truncated samples this way, so that they reach the model in the causal-safe right-padded form.
    """
    batch_size = keep.shape[0]
    row_length = batch_size * width
    index = row_index(keep, torch.arange(batch_size, device=keep.device) * width, row_length)
    row = scatter_into_row(values, index, row_length, fill)  # (..., 1, B * width)
    return row.reshape(*values.shape[:-2], batch_size, width)


def gather_from_row(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[index]`` along dim 0, where index N (one past the end) reads zeros.

    Args:
        values: ``(N, ...)``; index: any integer shape with entries in ``[0, N]``.

    Returns:
        ``(*index.shape, ...)``; differentiable with respect to ``values``.
    """
    return torch.cat([values, values.new_zeros((1, *values.shape[1:]))])[index]


def thd_packed_seq_params(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int, pad_between_seqs: bool
) -> PackedSeqParams:
    """Megatron-Core's ``PackedSeqParams`` for a THD row: the same real and padded boundaries for
    q and kv (``(S + 1,)`` int32), ``max_seqlen`` an upper bound of the real segment lengths.

    ``pad_between_seqs`` is always set: left None, Transformer Engine derives it in every
    attention layer with a host sync, from all boundaries but the last, so padding only in the
    last slot goes unnoticed (TransformerEngine issue 3331: wrong attention under CP).
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        pad_between_seqs=pad_between_seqs,
    )


def _keep_mask(attention_mask, real_lengths, keep, batch_size: int, seq_len: int, device: torch.device):
    """The ``(B, T)`` bool keep mask from whichever of ``attention_mask``, ``real_lengths``, ``keep`` the
    caller passed (none: every token is real), and the deferred checks of its values."""
    for name, value in (("attention_mask", attention_mask), ("real_lengths", real_lengths), ("keep", keep)):
        _check_tensor(name, value)
    if attention_mask is not None and real_lengths is not None:
        raise ValueError("attention_mask, real_lengths: pass one of them, not both")
    if keep is not None and (attention_mask is not None or real_lengths is not None):
        given = "attention_mask" if attention_mask is not None else "real_lengths"
        raise ValueError(f"keep, {given}: pass one of them, not both")
    if keep is not None:
        if keep.dtype != torch.bool or tuple(keep.shape) != (batch_size, seq_len):
            raise ValueError(
                f"keep: expected a ({batch_size}, {seq_len}) bool tensor, got {keep.dtype} {tuple(keep.shape)}; "
                "pass a dataset's mask as attention_mask"
            )
        return keep.to(device), []
    if attention_mask is not None:
        return keep_mask_from_attention_mask(attention_mask.to(device), batch_size, seq_len)
    if real_lengths is not None:
        return keep_mask_from_real_lengths(real_lengths.to(device), batch_size, seq_len)
    return torch.ones(batch_size, seq_len, dtype=torch.bool, device=device), []


def pack_bshd_to_thd(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    real_lengths: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    align_to: int = 1,
    total_length: int | None = None,
    segments: int | None = None,
    max_seqlen: int | None = None,
    min_length: int = 0,
    pad_token_id: int = 0,
    checks: Sequence[DeferredCheck] = (),
    host_values: torch.Tensor | None = None,
) -> PackedBatch:
    """Pack the real tokens of a padded batch into one THD row.

    Args:
        input_ids: ``(B, T)`` token ids.
        attention_mask: ``(B, T)`` keep mask (bool, or 0 / 1 values, at any positions) or a 4D
            Megatron mask ``(B|1, 1, T, T)`` (True = masked). None with ``real_lengths`` None
            means every token is real.
        labels: ``(B, T)``, packed with -100 in padding slots.
        loss_mask: ``(B, T)``, packed with 0 in padding slots.
        position_ids: ``(B, T)`` or MRoPE ``(3, B, T)``, packed to ``(1, N)`` / ``(3, 1, N)``.
        real_lengths: ``(B,)`` instead of a mask: sample i's first ``real_lengths[i]`` tokens
            are real.
        keep: ``(B, T)`` bool instead of a mask: the keep mask a caller already derived and
            checked (True = the token goes into the row; the step's, after truncation), packed as
            given. Pass at most one of ``attention_mask``, ``real_lengths`` and ``keep``.
        align_to: every sample's physical slot is a multiple of this (see
            :func:`required_alignment`).
        total_length: static mode: the row is exactly this long, the tail after the last
            sample forming one extra segment with no real token. Keeps shapes static for
            pipeline p2p and CUDA graphs; no host synchronisation happens.
        segments: static mode: ``cu_seqlens`` get exactly ``segments + 1`` entries whatever B: the B samples,
            the tail, then zero-length segments at ``total_length`` (a fixed count, as CUDA graphs need).
            At least B + 1; None: B + 1.
        max_seqlen: static mode: the ``max_seqlen`` to report (a fixed value, as CUDA graphs need), checked to
            bound every real slot; None: ``round_up(T, align_to)``.
        min_length: dynamic mode: a shorter row (e.g. the empty row of a batch with no real
            token) is extended to this length by one extra segment of padding. A multiple of
            ``align_to``; the step passes ``align_to`` so that a model always gets a row.
        pad_token_id: the id written into padding slots of ``input_ids``.
        checks: the caller's own deferred checks (e.g. MRoPE placeholders vs grids): read with
            the packer's one host read in dynamic mode (``ValueError``), device asserts in
            static mode, like the packer's own.
        host_values: ``(K,)`` int64 the caller needs on the host (e.g. truncation counts):
            read with the same host read in dynamic mode and returned as
            ``PackedBatch.host_values``; not read in static mode (None there).

    Returns:
        A :class:`PackedBatch`.

    Raises:
        ValueError: on bad shapes or arguments, naming the argument and the fix. Data-dependent
            problems (lengths out of range, a 4D mask that is not causal-with-padding, an int32
            overflow, a row that does not fit ``total_length``) raise ValueError in dynamic
            mode; in static mode they are device-side asserts (RuntimeError on the CPU) so that
            no host synchronisation is needed.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected a (B, T) tensor, got {shape}; add a batch dimension")
    batch_size, seq_len = input_ids.shape
    check_int("align_to", align_to, 1, "use required_alignment(tp, cp, sequence_parallel=..., fp8=...)")
    check_int("min_length", min_length, 0, "pass 0 (no minimum) or align_to")
    if min_length % align_to:
        raise ValueError(f"min_length: {min_length} is not a multiple of align_to={align_to}; pass align_to")
    _check_companions(labels, loss_mask, position_ids, batch_size, seq_len)
    keep, mask_checks = _keep_mask(attention_mask, real_lengths, keep, batch_size, seq_len, input_ids.device)
    if total_length is not None:
        segments = batch_size + 1 if segments is None else segments
        check_static_row(total_length, segments, max_seqlen, align_to, batch_size=batch_size)
    return _pack(input_ids, keep, labels, loss_mask, position_ids, align_to=align_to, total_length=total_length,
                 segments=segments, max_seqlen=max_seqlen, min_length=min_length, pad_token_id=pad_token_id,
                 checks=mask_checks + list(checks), host_values=host_values)


def check_static_row(total_length: int, segments: int, max_seqlen: int | None, align_to: int, *,
                     batch_size: int = 0) -> None:
    """The static row's arguments of :func:`pack_bshd_to_thd`, checked: ``total_length`` (a multiple of
    ``align_to`` that int32 ``cu_seqlens`` can describe), ``segments`` (one per sample of ``batch_size`` and the
    tail) and ``max_seqlen`` (None: derived). :func:`pack_bshd_to_thd` checks them at every call; a caller whose
    rows are fixed for a run checks them once and packs with :func:`pack_kept` (the step, when it builds its plan).

    Raises:
        ValueError: naming the argument and what to pass.
    """
    check_int("total_length", total_length, 0, "pass micro_batch_size * seq_length rounded up to align_to")
    if total_length % align_to:
        raise ValueError(
            f"total_length: {total_length} is not a multiple of align_to={align_to}; round it up to "
            f"{round_up(total_length, align_to)}"
        )
    if total_length > INT32_MAX:
        raise ValueError(f"total_length: {total_length} exceeds int32 cu_seqlens ({INT32_MAX}); use a smaller row")
    check_int("segments", segments, batch_size + 1,
              f"a static row of {batch_size} samples needs a segment per sample and one for the tail")
    if max_seqlen is not None:
        check_int("max_seqlen", max_seqlen, 1, "pass round_up(seq_length, align_to)")


def pack_kept(
    input_ids: torch.Tensor,
    keep: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    align_to: int,
    total_length: int | None = None,
    segments: int | None = None,
    max_seqlen: int | None = None,
    min_length: int = 0,
    checks: Sequence[DeferredCheck] = (),
    host_values: torch.Tensor | None = None,
) -> PackedBatch:
    """:func:`pack_bshd_to_thd` for a caller that checked its integer arguments before its first batch and derived
    the keep mask itself: the step, which checks them once per run when it builds its plan (the alignment, and a
    static row's ``total_length``, ``segments`` >= B + 1 and ``max_seqlen`` with :func:`check_static_row`).

    ``input_ids`` ``(B, T)`` and ``keep`` ``(B, T)`` bool on one device; the other arguments as
    :func:`pack_bshd_to_thd` takes them (``segments`` and ``max_seqlen`` given with ``total_length``). The tensors
    that come with each batch (``labels``, ``loss_mask``, ``position_ids``) are still checked against ``input_ids``.
    """
    batch_size, seq_len = input_ids.shape
    _check_companions(labels, loss_mask, position_ids, batch_size, seq_len)
    return _pack(input_ids, keep, labels, loss_mask, position_ids, align_to=align_to, total_length=total_length,
                 segments=segments, max_seqlen=max_seqlen, min_length=min_length, pad_token_id=0,
                 checks=list(checks), host_values=host_values)


def _check_companions(labels, loss_mask, position_ids, batch_size: int, seq_len: int) -> None:
    """The tensors packed with ``input_ids`` ``(B, T)``: ``labels`` and ``loss_mask`` ``(B, T)``, ``position_ids``
    ``(B, T)`` or MRoPE ``(3, B, T)``."""
    _check_companion("labels", labels, (batch_size, seq_len))
    _check_companion("loss_mask", loss_mask, (batch_size, seq_len))
    _check_tensor("position_ids", position_ids)
    if position_ids is not None and tuple(position_ids.shape) not in ((batch_size, seq_len), (3, batch_size, seq_len)):
        raise ValueError(
            f"position_ids: shape {tuple(position_ids.shape)} does not match input_ids; expected "
            f"({batch_size}, {seq_len}) or MRoPE (3, {batch_size}, {seq_len})"
        )


def _pack(input_ids, keep, labels, loss_mask, position_ids, *, align_to: int, total_length: int | None,
          segments: int | None, max_seqlen: int | None, min_length: int, pad_token_id: int,
          checks: list[DeferredCheck], host_values: torch.Tensor | None) -> PackedBatch:
    """The packer itself, its arguments checked (:func:`pack_bshd_to_thd`, :func:`pack_kept`): the row's
    boundaries (:func:`_dynamic_row` or :func:`_static_row`), then one scatter per tensor."""
    batch_size, seq_len = input_ids.shape
    lengths = lengths_of_keep_mask(keep)
    slots = round_up(lengths, align_to)
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    cu_seqlens_padded = cu_seqlens_from_lengths(slots)
    if total_length is None:
        row_length, max_seqlen, pad_between_seqs, cu_seqlens, cu_seqlens_padded, read_values = _dynamic_row(
            cu_seqlens, cu_seqlens_padded, slots, min_length, checks, host_values)
    else:
        max_seqlen, cu_seqlens, cu_seqlens_padded = _static_row(
            cu_seqlens, cu_seqlens_padded, slots, batch_size * round_up(seq_len, align_to), align_to, seq_len,
            total_length, segments, max_seqlen, checks)
        row_length, read_values = total_length, None
        # Known without a host read: True is always correct (TE then honours the padded pair).
        pad_between_seqs = True

    # slot = start of the sample's slot + rank among its real tokens; padding -> trash slot N.
    packed_index = row_index(keep, cu_seqlens_padded[:batch_size], row_length)

    cu_seqlens = cu_seqlens.to(torch.int32)
    cu_seqlens_padded = cu_seqlens_padded.to(torch.int32)
    padding_mask = scatter_into_row(~keep, packed_index, row_length, True)
    packed_seq_params = thd_packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, pad_between_seqs)
    return PackedBatch(
        input_ids=scatter_into_row(input_ids, packed_index, row_length, pad_token_id),
        labels=None if labels is None else scatter_into_row(labels, packed_index, row_length, LABEL_PAD),
        loss_mask=None if loss_mask is None else scatter_into_row(loss_mask, packed_index, row_length, 0),
        position_ids=None
        if position_ids is None
        else scatter_into_row(position_ids, packed_index, row_length, POSITION_PAD),
        cu_seqlens=cu_seqlens,
        cu_seqlens_padded=cu_seqlens_padded,
        max_seqlen=max_seqlen,
        padding_mask=padding_mask,
        packed_seq_params=packed_seq_params,
        packed_index=packed_index,
        host_values=read_values,
    )


def _dynamic_row(cu_seqlens, cu_seqlens_padded, slots, min_length: int, checks: list[DeferredCheck], host_values):
    """A row as long as its aligned samples: ``(row_length, max_seqlen, pad_between_seqs, cu_seqlens,
    cu_seqlens_padded, host_values as read)`` from the one host read (row length, longest slot, real total, every
    check's flag, ``host_values``)."""
    checks = checks + [
        DeferredCheck(
            cu_seqlens_padded[-1] > INT32_MAX,
            f"input_ids: the packed row would exceed {INT32_MAX} tokens, which int32 cu_seqlens cannot "
            "describe; use a smaller micro-batch",
        )
    ]
    # The one host synchronisation: the row length sizes the output, and the validity flags
    # ride along so that checking costs nothing extra.
    (row_length, max_seqlen, real_total), read_values = read_once(
        [cu_seqlens_padded[-1], slots.max() if slots.numel() else slots.new_zeros(()), cu_seqlens[-1]], checks,
        host_values)
    # Padding anywhere (also in the last slot only) makes the padded total exceed the real one.
    pad_between_seqs = row_length != real_total
    if row_length < min_length:
        # e.g. a micro-batch of padding only: a (1, 0) row cannot go through a model (empty
        # reshapes; Megatron-Bridge's CP code would take N = 0 for a pre-sharded row).
        row_length, max_seqlen, pad_between_seqs = min_length, max(max_seqlen, min_length), True
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:]])
        cu_seqlens_padded = torch.cat([cu_seqlens_padded, cu_seqlens_padded.new_full((1,), row_length)])
    return row_length, max_seqlen, pad_between_seqs, cu_seqlens, cu_seqlens_padded, read_values


def _static_row(cu_seqlens, cu_seqlens_padded, slots, worst_case_length: int, align_to: int, seq_len: int,
                total_length: int, segments: int | None, max_seqlen: int | None, checks: list[DeferredCheck]):
    """A row of exactly ``total_length`` slots and ``segments`` segments, checks as device asserts (no host read):
    ``(max_seqlen, cu_seqlens, cu_seqlens_padded)``."""
    if total_length < worst_case_length:
        checks = checks + [
            DeferredCheck(
                cu_seqlens_padded[-1] > total_length,
                f"total_length: the batch's aligned real tokens do not fit in {total_length}; raise it "
                f"(B * round_up(T, align_to) = {worst_case_length} always fits)",
            )
        ]
    batch_size = slots.shape[0]
    segments = batch_size + 1 if segments is None else segments
    if max_seqlen is None:
        max_seqlen = round_up(seq_len, align_to)
    elif max_seqlen < round_up(seq_len, align_to):
        checks = checks + [DeferredCheck(
            slots.max() > max_seqlen,
            f"max_seqlen: a sample's aligned slot is longer than the static max_seqlen={max_seqlen}; "
            "truncate samples to seq_length before packing")]
    for check in checks:
        torch._assert_async(~check.failed, check.message)
    # The tail after the last sample is its own segment with no real token, so no real sample's
    # physical slot grows and max_seqlen stays a bound for every real segment; the segments past
    # it have length 0, so the entry count is fixed.
    fixed = segments - batch_size
    cu_seqlens = torch.cat([cu_seqlens, *[cu_seqlens[-1:]] * fixed])
    cu_seqlens_padded = torch.cat([cu_seqlens_padded, cu_seqlens_padded.new_full((fixed,), total_length)])
    return max_seqlen, cu_seqlens, cu_seqlens_padded


def unpack_thd_to_bshd(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Gather per-slot values of a packed row back into the padded batch layout.

    Args:
        values: ``(1, N, ...)`` or ``(N, ...)`` per-slot values (logits, per-token losses,
            hidden states).
        packed: the :class:`PackedBatch` the row came from.

    A ``(1, N, ...)`` tensor is read as one row; so is ``(1, 1)`` when N == 1 (use
    ``values[None]`` for a ``(N, 1)`` tensor then, to be unambiguous).

    Returns:
        ``(B, T, ...)``: each real position gets its slot's value, padding positions get 0.
        Differentiable: gradients flow back to ``values`` at real slots.
    """
    row_length = packed.padding_mask.shape[-1]
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == row_length:
        values = values[0]
    if values.dim() < 1 or values.shape[0] != row_length:
        raise ValueError(
            f"values: expected (1, {row_length}, ...) or ({row_length}, ...) to match the packed row, got "
            f"{tuple(values.shape)}"
        )
    return gather_from_row(values, packed.packed_index)


def segment_index(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    *,
    row_length: int,
    max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment view of a packed row, from its metadata alone.

    Args:
        cu_seqlens: ``(S + 1,)`` real boundaries.
        cu_seqlens_padded: ``(S + 1,)`` physical boundaries, or None when equal to the real ones.
        row_length: N, the row length.
        max_seqlen: an upper bound of the real segment lengths (the view's width L).

    Returns:
        index: ``(S, L)`` int64, the row slot of token j of segment s, or N where j is past
            the segment's real length (gather from a row extended by one trash slot).
        valid: ``(S, L)`` bool, True at real tokens.
    """
    starts = (cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)[:-1].to(torch.int64)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    offsets = torch.arange(max_seqlen, device=cu_seqlens.device)
    valid = offsets[None, :] < lengths[:, None]
    index = torch.where(valid, starts[:, None] + offsets[None, :], row_length)
    return index, valid
