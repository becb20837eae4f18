"""The padding mask and the sample of each slot of a packed THD row, from its boundaries (``PackedSeqParams``).

Pure tensor ops, no host synchronisation: what :class:`~megatron.bridge_thd.moe_padding.model.PaddingMaskForward`
derives when the caller passes no mask, and what ``seq_aux_loss`` per sample counts by.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd.lengths import seq_idx
from megatron.bridge_thd.upstream.line import takes_parameter


def declares_padding_mask(model) -> bool:
    """True when ``model.forward`` takes a parameter named ``padding_mask`` (not via ``**kwargs``)."""
    return takes_parameter(model.forward, "padding_mask")


def padding_mask_from_packed_seq_params(packed_seq_params, total_tokens: int) -> torch.Tensor:
    """The ``(1, N)`` padding mask of a packed THD row, from its boundaries.

    Slot ``j`` of physical segment ``i`` (``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1])``)
    is real when ``j - cu_seqlens_q_padded[i] < cu_seqlens_q[i + 1] - cu_seqlens_q[i]``; slots past
    the last physical boundary are padding. Zero-length segments (an all-padding sample, the
    ``thd_static`` tail) are allowed. Pure tensor ops: no host synchronisation.

    Args:
        packed_seq_params: Megatron-Core ``PackedSeqParams`` (``cu_seqlens_q``, optionally
            ``cu_seqlens_q_padded``) of the full row.
        total_tokens: N, the row length.

    Returns:
        ``(1, N)`` bool, True = padding.
    """
    cu_real, cu_physical, segment, inside = _physical_segments(packed_seq_params, total_tokens)
    offset = torch.arange(total_tokens, device=cu_real.device) - cu_physical[segment]
    real = inside & (offset < cu_real[segment + 1] - cu_real[segment])
    return (~real).unsqueeze(0)


def _physical_segments(packed_seq_params, total_tokens: int):
    """The boundaries of a THD row (int64) and the physical segment of each of its N slots.

    Returns:
        cu_real, cu_physical: ``(S + 1,)`` int64 (``cu_seqlens_q``, ``cu_seqlens_q_padded`` or the
            real ones when unset).
        segment: ``(N,)`` int64, the segment whose physical slot holds the slot (slots at or past
            the last boundary: the last segment).
        inside: ``(N,)`` bool, False for slots at or past the last boundary.
    """
    cu_real = packed_seq_params.cu_seqlens_q
    cu_physical = packed_seq_params.cu_seqlens_q_padded
    if cu_physical is None:
        cu_physical = cu_real
    if cu_real is None or cu_real.dim() != 1 or cu_physical.shape != cu_real.shape or cu_real.numel() < 2:
        raise ValueError(
            "packed_seq_params: cu_seqlens_q (and cu_seqlens_q_padded when set) must be 1-D boundaries of the "
            "same length >= 2 to derive the padding mask; pass padding_mask explicitly instead"
        )
    cu_real = cu_real.to(torch.int64)
    cu_physical = cu_physical.to(torch.int64)
    segments = cu_real.numel() - 1
    positions = torch.arange(total_tokens, device=cu_real.device)
    # right=True: a slot on a boundary belongs to the segment that starts there (zero-length
    # segments are skipped); slots at or past the last boundary get index == segments.
    segment = seq_idx(cu_physical, positions)
    return cu_real, cu_physical, segment.clamp_max(segments - 1), segment < segments


def thd_sample_index(packed_seq_params, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sample each slot of a THD row belongs to, and how many samples the row holds.

    A segment is a sample unless it is a padding segment: physical length > 0 and no real token
    (the ``thd_static`` tail, the aligned segment of an all-padding micro-batch, Energon's
    sequence-parallel dummy). Zero-length segments (all-padding samples) are samples. Pure tensor
    ops, no host synchronisation.

    Returns:
        ``(1, N)`` int64 physical segment of each slot (slots past the last boundary: the last
        segment), and a 0-dim int64 count of samples.
    """
    cu_real, cu_physical, segment, _ = _physical_segments(packed_seq_params, total_tokens)
    padding_segment = (cu_real.diff() == 0) & (cu_physical.diff() > 0)
    return segment.unsqueeze(0), (~padding_segment).sum()
