"""Context-parallel partitioning of a packed THD row (zigzag per segment).

Transformer Engine and Megatron-Core split a THD row for context parallelism segment by
segment: a physical segment of length L (divisible by ``2 * cp``) is cut into ``2 * cp``
chunks of ``L / (2 * cp)`` tokens and rank r keeps chunks ``r`` and ``2 * cp - 1 - r``, so
every rank gets the same share of causal attention work. Rank r's local row is the
concatenation, in segment order, of its two chunks of every segment.

These are pure tensor functions: no host synchronisation, no loop over segments.
"""

from __future__ import annotations

import torch

__all__ = ["thd_partition_indices", "thd_local_positions"]


def _check_cp(cp_size, cp_rank) -> None:
    for name, value, low in (("cp_size", cp_size, 1), ("cp_rank", cp_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {value!r}")
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
    segment = torch.searchsorted(local_starts[1:], local, right=True)
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
