"""Opt-in: multi-token-prediction (MTP) label roll on packed THD rows, with context parallelism.

MTP trains depth k on the labels (and loss mask) shifted left by k tokens. On a packed row the
shift is *per sample*: the roll of ``[1, 2, 3 | 4, 5]`` is ``[2, 3, 0 | 5, 0]`` (each sample's last
real token and every padding slot get 0). Megatron-Core's ``roll_tensor`` reads only the
real boundaries, so it is exact only when no slot carries padding. :func:`roll_packed_left`
reads real and padded boundaries, builds one gather index for the local row (no loop over
samples, no host synchronisation) and under CP exchanges one message per neighbour;
:func:`roll_packed_left_with_megatron` delegates to Megatron-Core where
:func:`megatron_roll_is_exact` says it is exact. Layout, Megatron-Core's failure modes, validation:
docs/real-model.md (Multi-token prediction on packed rows).
"""

from __future__ import annotations

import torch

from megatron.bridge_thd.context_parallel import thd_local_positions
from megatron.bridge_thd.lengths import DeferredCheck, raise_failed_checks

__all__ = ["roll_packed_left", "roll_packed_left_with_megatron", "megatron_roll_is_exact"]


# ---------------------------------------------------------------------------------------------
# Metadata


def _boundaries(packed_seq_params) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_real, cu_padded)``, both ``(S + 1,)``, from a ``PackedSeqParams``.

    A missing ``cu_seqlens_q_padded`` means the real boundaries are the physical ones.
    """
    if packed_seq_params is None:
        raise ValueError("packed_seq_params: expected a PackedSeqParams with cu_seqlens_q, got None")
    qkv_format = packed_seq_params.qkv_format
    if qkv_format not in (None, "thd"):
        raise ValueError(f"packed_seq_params: qkv_format is {qkv_format!r}; the packed roll needs 'thd'")
    cu_real, cu_padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    if not isinstance(cu_real, torch.Tensor) or cu_real.dim() != 1 or cu_real.numel() < 2:
        raise ValueError(
            "packed_seq_params.cu_seqlens_q: expected a 1-D tensor of S + 1 >= 2 cumulative lengths, got "
            f"{_describe(cu_real)}"
        )
    if cu_padded is None:
        cu_padded = cu_real
    if not isinstance(cu_padded, torch.Tensor) or cu_padded.shape != cu_real.shape:
        raise ValueError(
            f"packed_seq_params.cu_seqlens_q_padded: expected a tensor of shape {tuple(cu_real.shape)} like "
            f"cu_seqlens_q, got {_describe(cu_padded)}"
        )
    for name, cu in (("cu_seqlens_q", cu_real), ("cu_seqlens_q_padded", cu_padded)):
        if cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
            raise ValueError(f"packed_seq_params.{name}: expected an integer tensor, got {cu.dtype}")
    return cu_real, cu_padded


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return repr(value)


def _metadata_checks(cu_real: torch.Tensor, cu_padded: torch.Tensor, total_tokens: int, cp_size: int) -> list:
    """The checks that need the boundary values. ``cu_*``: ``(S + 1,)`` int64."""
    real_lengths = cu_real[1:] - cu_real[:-1]
    slots = cu_padded[1:] - cu_padded[:-1]
    checks = [
        DeferredCheck(
            (cu_real[0] != 0) | (cu_padded[0] != 0),
            "packed_seq_params: cu_seqlens_q and cu_seqlens_q_padded must start at 0",
        ),
        DeferredCheck(
            (real_lengths < 0).any() | (real_lengths > slots).any(),
            "packed_seq_params.cu_seqlens_q: every real length must be >= 0 and fit in its physical slot "
            "(cu_seqlens_q_padded)",
        ),
        DeferredCheck(
            cu_padded[-1] != total_tokens,
            f"tensor: its last dim times cp_size is {total_tokens}, but packed_seq_params.cu_seqlens_q_padded "
            "ends elsewhere; pass this rank's local row of the packed row the metadata describes",
        ),
    ]
    if cp_size > 1:
        checks.append(
            DeferredCheck(
                (slots % (2 * cp_size) != 0).any(),
                f"packed_seq_params.cu_seqlens_q_padded: every physical segment length must be divisible by "
                f"2 * cp_size = {2 * cp_size}; align the packer with required_alignment(tp, cp)",
            )
        )
    return checks


def _enforce(checks: list) -> None:
    """Raise ``ValueError`` for CPU metadata; assert asynchronously on an accelerator (no sync)."""
    if not checks:
        return
    if checks[0].failed.device.type == "cpu":
        raise_failed_checks(checks)
        return
    for check in checks:
        torch._assert_async(~check.failed, check.message)


def megatron_roll_is_exact(packed_seq_params) -> bool:
    """Whether Megatron-Core's ``roll_tensor(..., packed_seq_params=)`` rolls this metadata exactly.

    It is exact when the real boundaries are the physical ones. Decided, in order:

    * no ``cu_seqlens_q_padded``: True (there are no other boundaries);
    * ``pad_between_seqs is False``: True (our packer sets False only when no slot has
      padding, i.e. ``cu_seqlens_q == cu_seqlens_q_padded``);
    * ``pad_between_seqs is True``: False, without reading the tensors (the boundaries may
      differ; a row that happens to have none is still rolled correctly by
      :func:`roll_packed_left`);
    * ``pad_between_seqs is None``: ``torch.equal(cu_seqlens_q, cu_seqlens_q_padded)``, a host
      read of both ``(S + 1,)`` tensors (a synchronisation on an accelerator).

    Raises:
        ValueError: ``packed_seq_params`` lacks ``cu_seqlens_q`` or has mismatched boundaries.
    """
    cu_real, _ = _boundaries(packed_seq_params)
    cu_padded = packed_seq_params.cu_seqlens_q_padded
    if cu_padded is None:
        return True
    flag = packed_seq_params.pad_between_seqs
    if flag is not None:
        return not flag
    return torch.equal(cu_real.to(torch.int64).cpu(), cu_padded.to(torch.int64).cpu())


# ---------------------------------------------------------------------------------------------
# Index construction (pure)


def _segment_layout(cu_padded: torch.Tensor, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(local_start, chunk)``: ``(S + 1,)`` local start of every segment (and the end), ``(S,)``
    chunk length ``c = L / (2 cp)``. Every rank holds ``2c`` tokens of a segment, so segment s
    starts at ``cu_padded[s] / cp`` of every local row."""
    local_start = cu_padded // cp_size
    chunk = (cu_padded[1:] - cu_padded[:-1]) // (2 * cp_size)
    return local_start, chunk


def _boundary_send_indices(
    cu_padded: torch.Tensor, n_local: int, cp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local indices of the first token of this rank's first and second chunk of every segment.

    Returns two ``(S,)`` int64 tensors. A zero-length segment has no tokens; its index is
    clamped into the row so the gather stays in bounds, and the receiver never reads it (it has
    no token of that segment either).
    """
    local_start, chunk = _segment_layout(cu_padded, cp_size)
    last = max(n_local - 1, 0)
    first_of_first = local_start[:-1].clamp_max(last)
    first_of_second = (local_start[:-1] + chunk).clamp_max(last)
    return first_of_first, first_of_second


def _successor_index(
    cu_real: torch.Tensor, cu_padded: torch.Tensor, n_local: int, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where every local token's successor comes from, and whether it has one.

    The source buffer is ``[local row (n_local) | from next rank (S) | from previous rank (S)]``:
    entry ``n_local + s`` is the first token of rank r+1's first chunk of segment s, entry
    ``n_local + S + s`` the first token of rank r-1's second chunk of segment s.

    Inside a chunk the successor is the next local token. At the end of the first chunk
    (chunk r) it is the first token of chunk r+1: rank r+1's first chunk, or for r = cp-1 its
    own second chunk (chunk cp), which follows locally. At the end of the second chunk (chunk
    2cp-1-r) it is the first token of chunk 2cp-r: rank r-1's second chunk; for r = 0 that is
    past the segment end, which the validity mask already zeroes.

    Args:
        cu_real, cu_padded: ``(S + 1,)`` int64 real and physical boundaries of the full row.
        n_local: the local row length, ``N / cp``.
        cp_size, cp_rank: the CP group size and this rank's index in it.

    Returns:
        source: ``(n_local,)`` int64 indices into the source buffer (0 where there is no
            successor, so the gather stays in bounds).
        valid: ``(n_local,)`` bool, True where the successor is a real token of the same sample.
    """
    segment, offset = thd_local_positions(cu_padded, n_local * cp_size, cp_size, cp_rank)
    local_start, chunk = _segment_layout(cu_padded, cp_size)
    local = torch.arange(n_local, device=cu_padded.device)
    source = local + 1
    if cp_size > 1:
        num_segments = cu_padded.numel() - 1
        position = local - local_start[segment]  # 0 .. 2c-1 inside this rank's share of the segment
        c = chunk[segment]
        if cp_rank < cp_size - 1:
            source = torch.where(position == c - 1, n_local + segment, source)
        if cp_rank > 0:
            source = torch.where(position == 2 * c - 1, n_local + num_segments + segment, source)
    real_length = (cu_real[1:] - cu_real[:-1])[segment]
    # The successor's offset in the full segment is offset + 1; it is a real token of the same
    # sample only below the sample's real length. This zeroes the last real token and padding.
    valid = offset + 1 < real_length
    return torch.where(valid, source, torch.zeros_like(source)), valid


# ---------------------------------------------------------------------------------------------
# Communication


def _cp_size_and_rank(cp_group) -> tuple[int, int]:
    if cp_group is None:
        return 1, 0
    size = torch.distributed.get_world_size(group=cp_group)
    if size == 1:
        return 1, 0
    return size, torch.distributed.get_rank(group=cp_group)


def _exchange_boundaries(
    to_prev: torch.Tensor, to_next: torch.Tensor, cp_group, cp_size: int, cp_rank: int
) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Send ``to_prev`` to rank r-1 and ``to_next`` to rank r+1; receive their counterparts.

    Args:
        to_prev: ``(..., S)`` first token of this rank's first chunk of every segment.
        to_next: ``(..., S)`` first token of this rank's second chunk of every segment.

    Returns:
        from_next: ``(..., S)`` rank r+1's ``to_prev`` (zeros on the last rank, which needs none).
        from_prev: ``(..., S)`` rank r-1's ``to_next`` (zeros on rank 0, which needs none).
        requests: the pending requests; wait on them before reading ``from_next`` / ``from_prev``.

    One message per neighbour and direction, all segments at once. Rank r-1 always needs
    rank r's first-chunk tokens (r-1 < cp-1) and rank r+1 always needs its second-chunk
    tokens (r+1 > 0), so the pattern is symmetric and every posted send has a matching receive.
    """
    peers = torch.distributed.get_process_group_ranks(cp_group)
    from_next = torch.zeros_like(to_next)
    from_prev = torch.zeros_like(to_prev)
    ops = []
    P2POp = torch.distributed.P2POp
    if cp_rank > 0:
        ops.append(P2POp(torch.distributed.isend, to_prev, peers[cp_rank - 1], cp_group))
        ops.append(P2POp(torch.distributed.irecv, from_prev, peers[cp_rank - 1], cp_group))
    if cp_rank < cp_size - 1:
        ops.append(P2POp(torch.distributed.isend, to_next, peers[cp_rank + 1], cp_group))
        ops.append(P2POp(torch.distributed.irecv, from_next, peers[cp_rank + 1], cp_group))
    return from_next, from_prev, torch.distributed.batch_isend_irecv(ops)


# ---------------------------------------------------------------------------------------------
# Public API


def _validated(tensor, packed_seq_params, cp_group) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Check the arguments of a roll; return int64 ``(S + 1,)`` boundaries on ``tensor``'s device
    and the CP size and rank."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise ValueError(f"tensor: expected a tensor of shape (..., N_local), got {_describe(tensor)}")
    cu_real, cu_padded = _boundaries(packed_seq_params)
    cp_size, cp_rank = _cp_size_and_rank(cp_group)
    n_local = tensor.shape[-1]
    cu_real = cu_real.to(device=tensor.device, dtype=torch.int64)
    cu_padded = cu_padded.to(device=tensor.device, dtype=torch.int64)
    if cp_size > 1 and n_local % 2:
        raise ValueError(
            f"tensor: the local row length {n_local} is odd; under CP every rank holds two equal chunks of "
            "every segment"
        )
    _enforce(_metadata_checks(cu_real, cu_padded, n_local * cp_size, cp_size))
    return cu_real, cu_padded, cp_size, cp_rank


def roll_packed_left(tensor: torch.Tensor, packed_seq_params, cp_group=None) -> torch.Tensor:
    """Shift a packed THD row left by one token per sample (the MTP label / loss-mask roll).

    Args:
        tensor: ``(..., N / cp)`` this rank's local row (the full row of N tokens when CP is
            off), any dtype; the last dim is the sequence.
        packed_seq_params: a ``PackedSeqParams`` with ``cu_seqlens_q`` ``(S + 1,)`` (real
            boundaries) and ``cu_seqlens_q_padded`` ``(S + 1,)`` (physical boundaries of the
            full row, last entry N; None means equal to ``cu_seqlens_q``). Under CP every
            physical segment length is divisible by ``2 * cp``.
        cp_group: the context-parallel process group, or None. With more than one rank, the
            boundary tokens travel between neighbouring ranks with point-to-point messages
            (one per neighbour, every segment at once); every rank of the group must call.

    Returns:
        ``(..., N / cp)``, same dtype and device: the successor of each real token within its
        sample, and 0 at each sample's last real token and at every padding slot.

    Raises:
        ValueError: ``tensor`` is not a tensor with a sequence dim, its length does not match
            the metadata, or ``packed_seq_params`` is malformed (see the module docstring for
            which checks are deferred on an accelerator).
    """
    cu_real, cu_padded, cp_size, cp_rank = _validated(tensor, packed_seq_params, cp_group)
    n_local = tensor.shape[-1]
    if n_local == 0:
        # An empty row (the same N on every rank, so no rank waits for a message).
        return tensor.clone()

    if cp_size > 1:
        # Post the exchange first, so that building the gather index overlaps with the transfer.
        first_of_first, first_of_second = _boundary_send_indices(cu_padded, n_local, cp_size)
        to_prev = tensor.index_select(-1, first_of_first).contiguous()
        to_next = tensor.index_select(-1, first_of_second).contiguous()
        from_next, from_prev, requests = _exchange_boundaries(to_prev, to_next, cp_group, cp_size, cp_rank)
    source, valid = _successor_index(cu_real, cu_padded, n_local, cp_size, cp_rank)
    if cp_size > 1:
        for request in requests:
            request.wait()
        source_row = torch.cat([tensor, from_next, from_prev], dim=-1)
    else:
        # One spare slot: the last token's default source (n_local) must stay in bounds.
        source_row = torch.cat([tensor, tensor.new_zeros(tensor.shape[:-1] + (1,))], dim=-1)
    rolled = source_row.index_select(-1, source)
    return torch.where(valid, rolled, rolled.new_zeros(()))


def roll_packed_left_with_megatron(tensor: torch.Tensor, packed_seq_params, cp_group=None) -> torch.Tensor:
    """Megatron-Core's ``roll_tensor`` where it is exact, :func:`roll_packed_left` elsewhere.

    Same arguments, shapes and result as :func:`roll_packed_left`. Delegates to
    ``megatron.core.transformer.multi_token_prediction.roll_tensor(tensor, -1, -1, cp_group,
    packed_seq_params)`` (dropping the sum it also returns) when
    :func:`megatron_roll_is_exact` says the real and physical boundaries coincide.
    """
    _validated(tensor, packed_seq_params, cp_group)
    if megatron_roll_is_exact(packed_seq_params):
        from megatron.core.transformer.multi_token_prediction import roll_tensor

        rolled, _ = roll_tensor(tensor, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        return rolled
    return roll_packed_left(tensor, packed_seq_params, cp_group=cp_group)
