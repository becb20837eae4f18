"""Context-parallel partitioning of a packed THD row (zigzag per segment).

Transformer Engine and Megatron-Core split a THD row for context parallelism segment by
segment: a physical segment of length L (divisible by ``2 * cp``) is cut into ``2 * cp``
chunks of ``L / (2 * cp)`` tokens and rank r keeps chunks ``r`` and ``2 * cp - 1 - r``, so
every rank gets the same share of causal attention work. Rank r's local row is the
concatenation, in segment order, of its two chunks of every segment.

These are pure tensor functions: no host synchronisation, no loop over segments.
:func:`thd_padding_chunks` reports which of those chunks hold no real token (Transformer
Engine issue 2186, ``docs/te-cp-padding.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.lengths import seq_idx
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = ["thd_partition_indices", "thd_local_positions", "thd_padding_chunks", "PaddingChunks", "cut_for_context_parallel"]


def _check_cp(cp_size, cp_rank) -> None:
    check_int("cp_size", cp_size, 1)
    check_int("cp_rank", cp_rank, 0)
    if cp_rank >= cp_size:
        raise ValueError(f"cp_rank: {cp_rank} is not below cp_size={cp_size}; pass the rank within the CP group")


def thd_local_positions(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each token of rank ``cp_rank``'s local row comes from.

    Args:
        cu_seqlens_padded: ``(S + 1,)`` physical segment boundaries of the full row; every
            segment length divisible by ``2 * cp_size``; last entry ``total_tokens``.
        total_tokens: N, the full row length (a host int: it sizes the output).
        cp_size, cp_rank: the context-parallel group size and this rank's index in it.

    Returns:
        segment: ``(N / cp,)`` int64, the segment each local token belongs to.
        offset: ``(N / cp,)`` int64, its position inside that segment of the full row
            (0 = the segment's first physical slot).
    """
    _check_cp(cp_size, cp_rank)
    if total_tokens % (2 * cp_size) and cp_size > 1:
        raise ValueError(
            f"total_tokens: {total_tokens} is not divisible by 2 * cp_size = {2 * cp_size}; align every segment "
            "with required_alignment(tp, cp)"
        )
    device = cu_seqlens_padded.device
    cu = cu_seqlens_padded.to(torch.int64)
    local = torch.arange(total_tokens // cp_size, device=device)
    # A segment of length L contributes L / cp tokens to every rank, in segment order.
    local_starts = cu // cp_size
    segment = seq_idx(local_starts, local)
    segment = segment.clamp_max(cu.numel() - 2)
    j = local - local_starts[segment]
    chunk = (cu[segment + 1] - cu[segment]) // (2 * cp_size)
    second_half = j >= chunk
    offset = torch.where(second_half, (2 * cp_size - 1 - cp_rank) * chunk + (j - chunk), cp_rank * chunk + j)
    return segment, offset


def thd_partition_indices(
    cu_seqlens_padded: torch.Tensor, total_tokens: int, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """Rank ``cp_rank``'s tokens as indices into the full row.

    The same contract as Transformer Engine's ``tex.thd_get_partitioned_indices(cu_seqlens,
    total_tokens, world_size, rank)``, which Megatron-Core's ``get_batch_on_this_cp_rank`` and
    Megatron-Bridge's ``get_packed_seq_cp_partition_indices`` call.

    Args:
        cu_seqlens_padded: ``(S + 1,)`` physical boundaries (see :func:`thd_local_positions`).
        total_tokens: N, the full row length.
        cp_size, cp_rank: the CP group size and this rank's index.

    Returns:
        ``(N / cp,)`` int64 indices into the full ``(N,)`` row, in local-row order.
    """
    segment, offset = thd_local_positions(cu_seqlens_padded, total_tokens, cp_size, cp_rank)
    return cu_seqlens_padded.to(torch.int64)[segment] + offset


@dataclass(frozen=True)
class PaddingChunks:
    """How many real tokens each CP rank's two chunks of every segment hold.

    Shapes: C = cp_size, S = number of segments.

    Attributes:
        chunk_ids: ``(C, 2)`` int64, the chunks rank r holds: ``(r, 2C - 1 - r)``.
        chunk_size: ``(S,)`` int64, the chunk length ``L_s / (2C)`` of each segment.
        chunk_real: ``(C, S, 2)`` int64, real tokens in chunk ``chunk_ids[r, k]`` of segment s.
        segment_real: ``(S,)`` int64, the segment's real length.
    """

    chunk_ids: torch.Tensor
    chunk_size: torch.Tensor
    chunk_real: torch.Tensor
    segment_real: torch.Tensor

    @property
    def all_padding(self) -> torch.Tensor:
        """``(C, S, 2)`` bool: the chunk has tokens and none of them is real."""
        return (self.chunk_real == 0) & (self.chunk_size > 0)[None, :, None]

    @property
    def all_padding_in_real_segment(self) -> torch.Tensor:
        """``(C, S, 2)`` bool: an all-padding chunk of a segment that has real tokens elsewhere,
        the case of TransformerEngine issue 2186 (a ring step attends from this chunk, empty as
        a query, to real keys of other chunks)."""
        return self.all_padding & (self.segment_real > 0)[None, :, None]

    def locations(self, which: torch.Tensor | None = None) -> torch.Tensor:
        """``(K, 3)`` int64 rows ``(rank, segment, chunk)`` where ``which`` (default
        :attr:`all_padding`) is True, chunk in ``[0, 2C)``; sorted by rank, segment, then the
        rank's first chunk before its second. Reads the result on the host (diagnostics, tests)."""
        which = self.all_padding if which is None else which
        rank, segment, k = which.nonzero(as_tuple=True)
        return torch.stack([rank, segment, self.chunk_ids[rank, k]], dim=1)


def thd_padding_chunks(cu_seqlens, cu_seqlens_padded: torch.Tensor | None = None, *, cp_size: int) -> PaddingChunks:
    """Which CP chunks of a THD row hold no real token, per rank, segment and chunk.

    Real tokens sit at the start of their segment, so chunk c (``[c * l, (c + 1) * l)`` of a
    segment of length L, ``l = L / (2 * cp)``) holds ``clamp(n - c * l, 0, l)`` of its n real
    tokens; rank r holds chunks r and ``2 * cp - 1 - r``. Vectorised over ranks, segments and
    chunks; no host synchronisation (a segment not divisible by ``2 * cp`` is a device assert).

    Args:
        cu_seqlens: ``(S + 1,)`` real boundaries, or a :class:`~megatron.bridge_thd.packing.PackedBatch`
            (its ``cu_seqlens`` and ``cu_seqlens_padded``; then leave ``cu_seqlens_padded`` None).
        cu_seqlens_padded: ``(S + 1,)`` physical boundaries.
        cp_size: the context-parallel group size.

    Returns:
        A :class:`PaddingChunks`.
    """
    if hasattr(cu_seqlens, "cu_seqlens_padded"):  # duck: a PackedBatch, or its boundary tensors
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded: pass a PackedBatch alone, or both boundary tensors")
        cu_seqlens, cu_seqlens_padded = cu_seqlens.cu_seqlens, cu_seqlens.cu_seqlens_padded
    _check_cp(cp_size, 0)
    for name, value in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 1:
            raise ValueError(f"{name}: expected a (S + 1,) tensor, got {value!r}")
    if cu_seqlens.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"cu_seqlens, cu_seqlens_padded: shapes {tuple(cu_seqlens.shape)} and {tuple(cu_seqlens_padded.shape)} "
            "differ; real and padded boundaries come in pairs"
        )
    chunks = 2 * cp_size
    real = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    physical = (cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]).to(torch.int64)
    torch._assert_async(
        (physical % chunks == 0).all(),
        f"cu_seqlens_padded: a segment is not divisible by 2 * cp_size = {chunks}; align with required_alignment",
    )
    size = physical // chunks
    ranks = torch.arange(cp_size, device=real.device)
    chunk_ids = torch.stack([ranks, chunks - 1 - ranks], dim=1)
    held = real[None, :, None] - chunk_ids[:, None, :] * size[None, :, None]
    chunk_real = torch.minimum(held.clamp_min(0), size[None, :, None])
    return PaddingChunks(chunk_ids=chunk_ids, chunk_size=size, chunk_real=chunk_real, segment_real=real)


def cut_for_context_parallel(mask: torch.Tensor, input_ids, packed_seq_params, cp_group) -> torch.Tensor:
    """``mask`` (the shape of ``input_ids``) cut as Megatron-Bridge's ``Qwen3VLModel`` cuts its row for context
    parallelism, with the model module's own helpers: a THD row by ``get_packed_seq_cp_partition_indices`` (zigzag
    per segment; pre-sharded input is already rank-local), BSHD by ``_split_if_full_sequence``. Unchanged at CP 1.

    Args:
        mask: ``(b, s)`` per-token values (bool or int), the shape of ``input_ids``.
        input_ids: ``(1, N)`` THD row or ``(B, T)`` padded batch.
        packed_seq_params: the row's boundaries, or None for BSHD.
        cp_group: the context-parallel process group.

    Returns:
        ``(b, s_cp)``: the values of this rank's tokens, in the model's order.
    """
    cp_size = cp_group.size()
    if cp_size == 1:
        return mask
    helpers = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.model")
    cp_rank = cp_group.rank()
    if packed_seq_params is None:
        cut, _ = helpers._split_if_full_sequence(
            mask, cp_size=cp_size, seq_dim=1, cp_rank=cp_rank, full_sequence_length=input_ids.size(1))
        return cut
    if helpers._is_packed_input_pre_sharded(input_ids, packed_seq_params, cp_size=cp_size):
        return mask
    index = helpers.get_packed_seq_cp_partition_indices(
        packed_seq_params, total_tokens=input_ids.size(1), cp_size=cp_size, cp_rank=cp_rank,
        device=input_ids.device, cp_group=cp_group)
    return mask.index_select(1, index)
