"""THD boundaries for models that expand image placeholders inside ``forward`` (LLaVA style).

A LLaVA-style model receives one ``<image>`` token per image in ``input_ids`` and replaces it,
inside ``forward``, by ``k_i`` embeddings (tiles times tokens per tile, different for every
image). The packer builds ``cu_seqlens`` over the *collapsed* row (one slot per placeholder);
attention runs over the *expanded* row, so every boundary after the first image is off by the
images' extra embeddings unless it is remapped (Megatron-LM PR 3427). Qwen3-VL's processor
already expands the placeholders in ``input_ids``, so its step needs none of this.

The remap is one cumulative sum: with ``expansion`` ``(N,)`` the number of embeddings each
collapsed slot becomes (1 for text and padding, ``k_i`` for an image placeholder) and
``E = [0, cumsum(expansion)]`` ``(N + 1,)``, collapsed row position ``p`` moves to ``E[p]``.
Real and physical (padded) boundaries are both mapped through ``E``; alignment is then
re-applied in expanded space (see :func:`expand_cu_seqlens`).

Example: collapsed real lengths ``[3, 4]`` (``cu_seqlens = [0, 3, 7]``), an image of
``k = 5`` embeddings at slot 1 of sample 0 -> expanded lengths ``[7, 4]``,
``cu_seqlens = [0, 7, 11]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.lengths import DeferredCheck, cu_seqlens_from_lengths, read_once, seq_idx
from megatron.bridge_thd.packing import round_up, thd_packed_seq_params

__all__ = ["ExpandedBoundaries", "expand_cu_seqlens", "expanded_positions", "expand_row"]

INT32_MAX = torch.iinfo(torch.int32).max


@dataclass
class ExpandedBoundaries:
    """THD metadata of the expanded row, and where each collapsed slot went.

    Shapes: S segments, N collapsed slots, R expanded slots (``row_length``).

    Unpacks like a tuple: ``cu, cu_padded, max_seqlen = expand_cu_seqlens(...)``.

    Attributes:
        cu_seqlens: ``(S + 1,)`` int32 expanded real boundaries (cumulative expanded real
            lengths).
        cu_seqlens_padded: ``(S + 1,)`` int32 expanded physical boundaries, last entry R; every
            slot a multiple of ``align_to``.
        max_seqlen: int, the longest expanded physical slot of a segment that holds a real
            token (a bound of every expanded real length, a multiple of ``align_to``);
            ``align_to`` when no segment holds one.
        row_length: int, R.
        positions: ``(N,)`` int64, the expanded row index where collapsed slot j's first
            embedding goes; slot j occupies ``[positions[j], positions[j] + expansion[j])``.
        expansion: ``(N,)`` int64, the expansion the boundaries were built from.
        packed_seq_params: Megatron-Core ``PackedSeqParams`` (``qkv_format="thd"``) with the
            expanded pairs for q and kv and ``pad_between_seqs`` set explicitly.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    row_length: int
    positions: torch.Tensor
    expansion: torch.Tensor
    packed_seq_params: PackedSeqParams

    def __iter__(self):
        return iter((self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen))

    def expand_row(self, values: torch.Tensor, fill) -> torch.Tensor:
        """:func:`expand_row` onto this expanded row: ``(N, ...)`` -> ``(R, ...)``, no host read."""
        return expand_row(values, self.expansion, fill, positions=self.positions, row_length=self.row_length)



def _check_index_tensor(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a 1D integer torch.Tensor, got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"{name}: expected a 1D tensor, got shape {tuple(value.shape)}")
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(
            f"{name}: expected an integer dtype (int32 / int64), got {value.dtype}; "
            f"convert it with .to(torch.int64)"
        )


def _first_bad(values: torch.Tensor, bad: torch.Tensor) -> str:
    # Only called once a check has failed: the extra host read costs nothing on the good path.
    index = int(bad.to(torch.int64).argmax())
    return f"entry {index} is {int(values[index])}"


def expanded_positions(expansion: torch.Tensor) -> torch.Tensor:
    """Start of each collapsed slot in the expanded row (no alignment): exclusive cumsum.

    Args:
        expansion: ``(N,)`` integer, the number of embeddings each collapsed slot becomes
            (every entry >= 1; not checked here, so that no host read happens:
            :func:`expand_cu_seqlens` checks it).

    Returns:
        ``(N,)`` int64 ``[0, e0, e0 + e1, ...]``: collapsed slot j occupies
        ``[out[j], out[j] + expansion[j])``. With alignment use
        :attr:`ExpandedBoundaries.positions` instead.
    """
    _check_index_tensor("expansion", expansion)
    cumulative = expansion.to(torch.int64).cumsum(0)
    return cumulative - expansion.to(torch.int64)


def expand_row(
    values: torch.Tensor,
    expansion: torch.Tensor,
    fill,
    *,
    positions: torch.Tensor | None = None,
    row_length: int | None = None,
) -> torch.Tensor:
    """Lay per-collapsed-slot values onto the expanded row.

    Collapsed slot j's value is repeated over its ``expansion[j]`` expanded slots
    ``[positions[j], positions[j] + expansion[j])``; expanded slots no collapsed slot covers
    (alignment padding added by :func:`expand_cu_seqlens`) hold ``fill``. Typical uses:
    ``input_ids`` (then ``embeddings.masked_scatter(ids == image_token, vision_embeddings)``),
    ``loss_mask``, ``labels``.

    Args:
        values: ``(N, ...)``; dim 0 runs over the collapsed row (move it first for e.g.
            ``(3, N)`` MRoPE ids).
        expansion: ``(N,)`` integer, every entry >= 1.
        fill: the value of uncovered expanded slots.
        positions: ``(N,)`` start of each collapsed slot in the expanded row, non-decreasing;
            default :func:`expanded_positions` (no alignment padding).
            :attr:`ExpandedBoundaries.positions` for an aligned row.
        row_length: R, the expanded row length; default ``positions[-1] + expansion[-1]``
            read on the host (the one host read, which also checks ``expansion >= 1``). Pass
            :attr:`ExpandedBoundaries.row_length` to read nothing.

    Returns:
        ``(R, ...)`` with ``values``' dtype; differentiable with respect to ``values``.
    """
    _check_index_tensor("expansion", expansion)
    if not isinstance(values, torch.Tensor) or values.dim() < 1 or values.shape[0] != expansion.shape[0]:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(
            f"values: expected ({expansion.shape[0]}, ...) (one entry per collapsed slot, like expansion), got {shape}"
        )
    if positions is None:
        positions = expanded_positions(expansion)
    else:
        _check_index_tensor("positions", positions)
        if positions.shape != expansion.shape:
            raise ValueError(
                f"positions: shape {tuple(positions.shape)} does not match expansion {tuple(expansion.shape)}"
            )
    num_slots = expansion.shape[0]
    expansion = expansion.to(torch.int64)
    positions = positions.to(torch.int64)
    ends = positions + expansion
    if row_length is None:
        bad = expansion < 1
        end = ends[-1] if num_slots else ends.new_zeros(())
        row_length, failed = torch.stack([end, bad.any().to(torch.int64)]).tolist()
        if failed:
            raise ValueError(
                f"expansion: every entry must be >= 1 (1 for text and padding, k for an image placeholder); "
                f"{_first_bad(expansion, bad)}"
            )
    else:
        check_int("row_length", row_length, 0)
    slots = torch.arange(row_length, device=expansion.device)
    # The last collapsed slot starting at or before each expanded slot; uncovered -> N (fill).
    source = torch.searchsorted(positions, slots, right=True) - 1
    # ends[-1] = -1 is a sentinel: slots before the first collapsed slot (source -1) are uncovered.
    ends = torch.cat([ends, ends.new_full((1,), -1)])
    covered = slots < ends[source]
    index = torch.where(covered, source, num_slots)
    padded = torch.cat([values, values.new_full((1, *values.shape[1:]), fill)])
    return padded[index]


def expand_cu_seqlens(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    expansion: torch.Tensor,
    *,
    align_to: int = 1,
) -> ExpandedBoundaries:
    """Remap collapsed THD boundaries (one slot per image placeholder) to the expanded row.

    With ``E = [0, cumsum(expansion)]`` ``(N + 1,)`` and sample i's real tokens at collapsed
    ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + len_i)``:

    * expanded real length ``E[cu_seqlens_padded[i] + len_i] - E[cu_seqlens_padded[i]]``
      (the boundaries of ``cu_seqlens`` are cumulative lengths, not row positions, when the
      row has padding, so ``E[cu_seqlens]`` would be wrong there);
    * expanded physical slot ``E[cu_seqlens_padded[i + 1]] - E[cu_seqlens_padded[i]]``
      (the collapsed slot's padding, expanded like any slot), rounded up to ``align_to``.

    Layout of the expanded row: segment i starts at ``cu_seqlens_padded_out[i]`` and holds, in
    order, its expanded real tokens, its expanded collapsed padding, then the alignment padding
    added in expanded space (``round_up(slot, align_to) - slot`` slots) at the end of its slot.
    Every later segment therefore shifts right by the alignment padding added before it;
    :attr:`ExpandedBoundaries.positions` includes that shift. With ``align_to=1`` nothing is
    added and the expanded row is exactly ``E``: ``positions == E[:-1]``, the padded boundaries
    are ``E[cu_seqlens_padded]``. A segment without real tokens (a static row's tail) is mapped
    like any other.

    Vectorised (no loop over samples or images); one host read sizes the output (row length,
    ``max_seqlen``) and carries every validity flag.

    Args:
        cu_seqlens: ``(S + 1,)`` integer collapsed real boundaries, starting at 0.
        cu_seqlens_padded: ``(S + 1,)`` integer collapsed physical boundaries, last entry N; None
            when equal to ``cu_seqlens`` (no padding).
        expansion: ``(N,)`` integer, the number of embeddings each collapsed slot becomes: 1 for
            text and padding, ``k_i`` (tiles * tokens per tile) for image placeholder i. Every
            entry >= 1.
        align_to: every expanded physical slot is rounded up to a multiple of this (e.g.
            ``required_alignment(tp, cp, ...)``, the alignment the collapsed row was packed with).

    Returns:
        An :class:`ExpandedBoundaries` (unpacks as ``(cu_seqlens, cu_seqlens_padded, max_seqlen)``).

    Raises:
        ValueError: naming the argument: non-tensor / non-1D / non-integer inputs, shape
            mismatches, ``align_to`` < 1; after the host read: ``expansion`` entries < 1, an
            ``expansion`` whose length is not ``cu_seqlens_padded[-1]``, boundaries not starting
            at 0 or decreasing, real lengths larger than their physical slots, an expanded row
            that int32 cannot describe.
    """
    _check_index_tensor("cu_seqlens", cu_seqlens)
    _check_index_tensor("cu_seqlens_padded", cu_seqlens_padded, allow_none=True)
    _check_index_tensor("expansion", expansion)
    check_int("align_to", align_to, 1, "use required_alignment(tp, cp, ...)")
    if cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens: expected (S + 1,) boundaries, got an empty tensor; pass at least [0]")
    if cu_seqlens_padded is not None and cu_seqlens_padded.shape != cu_seqlens.shape:
        raise ValueError(
            f"cu_seqlens_padded: shape {tuple(cu_seqlens_padded.shape)} does not match cu_seqlens "
            f"{tuple(cu_seqlens.shape)}; pass the padded pair of the same packed row"
        )
    for name, tensor in (("cu_seqlens_padded", cu_seqlens_padded), ("expansion", expansion)):
        if tensor is not None and tensor.device != cu_seqlens.device:
            raise ValueError(f"{name}: on {tensor.device}, cu_seqlens on {cu_seqlens.device}; move them together")

    num_slots = expansion.shape[0]
    cu = cu_seqlens.to(torch.int64)
    cu_padded = cu if cu_seqlens_padded is None else cu_seqlens_padded.to(torch.int64)
    expansion = expansion.to(torch.int64)
    mapping = F.pad(expansion.cumsum(0), (1, 0))  # E, (N + 1,)

    lengths = cu.diff()
    starts = cu_padded[:-1]
    # Clamped so that bad boundaries index safely until the host read reports them.
    def mapped(index):
        return mapping[index.clamp(0, num_slots)]

    start_out = mapped(starts)
    real_lengths = mapped(starts + lengths) - start_out
    slot_lengths = round_up(mapped(cu_padded[1:]) - start_out, align_to)
    cu_out = cu_seqlens_from_lengths(real_lengths)
    cu_padded_out = cu_seqlens_from_lengths(slot_lengths)

    # positions[j] = E[j] + alignment padding added before j's segment.
    num_segments = lengths.shape[0]
    segment = seq_idx(cu_padded, torch.arange(num_slots, device=cu.device))
    shift = F.pad(cu_padded_out[:-1] - start_out, (0, 1))  # index S (bad input) reads 0
    positions = mapping[:-1] + shift[segment.clamp(max=num_segments)]

    holds_real = real_lengths > 0
    longest = torch.where(holds_real, slot_lengths, 0).max() if num_segments else cu.new_zeros(())
    bad_expansion = expansion < 1
    checks = [
        DeferredCheck(
            bad_expansion.any(),
            "expansion: every entry must be >= 1 (1 for text and padding, k for an image placeholder's "
            "embeddings); a placeholder that yields no embedding must be removed from input_ids",
            lambda: _first_bad(expansion, bad_expansion),
        ),
        DeferredCheck(
            cu_padded[-1] != num_slots,
            f"expansion: has {num_slots} entries, but the collapsed row has cu_seqlens_padded[-1] slots; "
            "pass one entry per collapsed row slot (padding included)",
            lambda: f"cu_seqlens_padded[-1] = {int(cu_padded[-1])}",
        ),
        DeferredCheck(
            (cu[0] != 0) | (cu_padded[0] != 0),
            "cu_seqlens: boundaries must start at 0 (cu_seqlens[0] and cu_seqlens_padded[0])",
        ),
        DeferredCheck(
            (lengths < 0).any() | (cu_padded.diff() < 0).any(),
            "cu_seqlens: boundaries must be non-decreasing (cu_seqlens and cu_seqlens_padded)",
        ),
        DeferredCheck(
            (lengths > cu_padded.diff()).any(),
            "cu_seqlens_padded: every physical slot must hold its sample's real tokens "
            "(cu_seqlens_padded[i+1] - cu_seqlens_padded[i] >= cu_seqlens[i+1] - cu_seqlens[i])",
        ),
        DeferredCheck(
            cu_padded_out[-1] > INT32_MAX,
            f"expansion: the expanded row would exceed {INT32_MAX} slots, which int32 cu_seqlens cannot "
            "describe; pack fewer samples per row",
        ),
    ]
    # The one host read: the output sizes, with every validity flag riding along.
    (row_length, max_seqlen, real_total), _ = read_once([cu_padded_out[-1], longest, cu_out[-1]], checks)
    max_seqlen = max_seqlen if max_seqlen > 0 else align_to

    cu_out = cu_out.to(torch.int32)
    cu_padded_out = cu_padded_out.to(torch.int32)
    packed_seq_params = thd_packed_seq_params(cu_out, cu_padded_out, max_seqlen, row_length != real_total)
    return ExpandedBoundaries(
        cu_seqlens=cu_out,
        cu_seqlens_padded=cu_padded_out,
        max_seqlen=max_seqlen,
        row_length=row_length,
        positions=positions,
        expansion=expansion,
        packed_seq_params=packed_seq_params,
    )
