"""Which tokens of a padded batch are real, and the cu_seqlens that describe them.

Datasets hand the step one of three mask conventions; this module turns each of them into a
keep mask ``(B, T)`` (True = real token) or straight into cu_seqlens:

* a 2D keep mask ``(B, T)`` (bool, or 0 / 1 values of an int or float dtype; 1 = real) with real
  tokens at any positions: right padding, left padding, or VERL's left-padded prompt +
  right-padded response. :func:`keep_mask_from_2d` is the one rule for it, shared by the step
  and the VERL drop-in;
* a 4D Megatron mask ``(B|1, 1, T, T)``, True = masked: causal plus key (and optionally query)
  padding, as ``get_ltor_masks_and_position_ids`` builds it;
* a sample-ID mask ``(1, L)`` of an already packed row, ``[[1, 1, 2, 2, 2, 0, 0]]`` style:
  sample k's tokens carry id k, padding carries 0 (Megatron-Energon / LLaVA-OneVision2).

Data-dependent validity checks are returned as :class:`DeferredCheck` flags instead of being
evaluated here, so that the packer can fold all of them into its one host synchronisation
(or into asynchronous device asserts when it must not synchronise at all).
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "DeferredCheck",
    "raise_failed_checks",
    "read_once",
    "keep_mask_from_2d",
    "keep_mask_from_attention_mask",
    "keep_mask_from_real_lengths",
    "real_lengths",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_sample_ids",
    "seq_idx",
]


@dataclass(frozen=True)
class DeferredCheck:
    """A validity condition that needs the data to decide.

    ``failed`` is a 0-dim bool tensor on the data's device, True when the input is bad;
    ``message`` is the error text (it names the argument and the fix); ``details``, if given,
    builds a few more words from the data and is called only once the check has failed, so
    the host reads it needs cost nothing on the good path (device asserts use ``message``).
    """

    failed: torch.Tensor
    message: str
    details: Callable[[], str] | None = None

    def text(self) -> str:
        return self.message if self.details is None else f"{self.message} ({self.details()})"


def raise_failed_checks(checks: list[DeferredCheck], flags: list | None = None) -> None:
    """Raise ``ValueError`` with the message of the first failed check.

    Args:
        checks: the deferred checks.
        flags: their ``failed`` values already read on the host (the packer reads them with the
            row length); None reads them here, all in one host synchronisation.
    """
    if not checks:
        return
    if flags is None:
        flags = torch.stack([check.failed for check in checks]).tolist()
    for check, failed in zip(checks, flags):
        if failed:
            raise ValueError(check.text())


def read_once(
    sizes: Sequence[torch.Tensor] = (), checks: Sequence[DeferredCheck] = (), extra: torch.Tensor | None = None
) -> tuple[list[int], list[int] | None]:
    """The one host read: ``sizes``, every check's flag and ``extra`` in a single ``tolist()``, then the
    first failed check raised.

    The layout of what is read (``[*sizes, *flags, *extra]``) lives here only, so that a caller adds a
    value or a check without re-deriving where the others are.

    Args:
        sizes: 0-dim int64 tensors the caller sizes its output with (row length, ``max_seqlen``, ...).
        checks: deferred checks; their ``failed`` flags ride along.
        extra: ``(K,)`` (any shape, flattened) integer values the caller needs on the host, or None.
            Every tensor on one device.

    Returns:
        ``(sizes as ints, extra as ints or None)``. Nothing to read (no size, no check, no extra): no read,
        ``([], None)``.

    Raises:
        ValueError: the message of the first failed check.
    """
    head = list(sizes) + [check.failed.to(torch.int64) for check in checks]
    parts = ([torch.stack(head)] if head else []) + ([extra.reshape(-1).to(torch.int64)] if extra is not None else [])
    if not parts:
        return [], None
    host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
    raise_failed_checks(list(checks), host[len(sizes) : len(head)])
    return host[: len(sizes)], (host[len(head) :] if extra is not None else None)


def keep_mask_from_2d(mask: torch.Tensor, name: str = "attention_mask") -> tuple[torch.Tensor, list[DeferredCheck]]:
    """The one rule for a 2D keep mask: bool, or only 0 and 1 in an int or float dtype.

    Any other value (2, 0.5, -1, NaN: a mask of weights, of token ids or of sample ids) is an
    error, never "non-zero = real": such a mask is a collate bug that would otherwise be packed
    silently. The value check is deferred (no host read here): the caller reads it with its own
    one host read, or turns it into a device assert.

    Args:
        mask: ``(B, T)`` keep mask, 1 / True = real token, 0 / False = padding (shape checked by
            the caller).
        name: the argument's name, for the error message.

    Returns:
        keep: ``(B, T)`` bool, True where the token is real.
        checks: one :class:`DeferredCheck` (none for a bool mask) that fails on a value other
            than 0 / 1; its text names the argument, the first bad values and the fix.

    Raises:
        ValueError: on a complex dtype.
    """
    if mask.is_complex():
        raise ValueError(
            f"{name}: expected a bool mask or 0/1 values of an int or float dtype (1 = real token, 0 = padding), "
            f"got dtype {mask.dtype}; pass mask.real.bool() or build the mask as bool"
        )
    if mask.dtype == torch.bool:
        return mask, []  # already a keep mask: nothing to check, nothing to compute
    keep = mask != 0
    bad = keep & (mask != 1)  # NaN is != 0 and != 1: flagged too

    def bad_values() -> str:
        # Only called once the check has failed: the host read costs nothing on the good path.
        return f"found {sorted(set(mask[bad].flatten()[:1000].tolist()))[:5]}"

    check = DeferredCheck(
        bad.any(),
        f"{name}: a 2D keep mask must be bool or hold only 0 and 1 (1 = real token, 0 = padding); it holds other "
        f"values. Pass ({name} != 0) if every non-zero entry marks a real token, or fix the collate that wrote "
        "them (a mask of weights, token ids or sample ids is not a keep mask)",
        bad_values,
    )
    return keep, [check]


def keep_mask_from_attention_mask(
    attention_mask: torch.Tensor, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """Keep mask from a 2D keep mask or a 4D Megatron mask.

    Args:
        attention_mask: ``(B, T)`` keep mask, bool or 0 / 1 (1 = real token), at any positions; or
            ``(B|1, 1, T, T)`` Megatron mask, True (non-zero) = masked, causal with padding.
        batch_size: B, the batch the mask must describe.
        seq_len: T.

    Returns:
        keep: ``(B, T)`` bool, True where the token is real.
        checks: data-dependent checks (a 2D mask holds only 0 / 1, see :func:`keep_mask_from_2d`;
            a 4D mask must be causal-with-padding).

    Raises:
        ValueError: on a mask whose shape matches neither convention.
    """
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (batch_size, seq_len):
            raise ValueError(
                f"attention_mask: 2D keep mask has shape {tuple(attention_mask.shape)} but input_ids is "
                f"({batch_size}, {seq_len}); pass the dataset's (B, T) mask for this very batch"
            )
        return keep_mask_from_2d(attention_mask, "attention_mask")
    if attention_mask.dim() == 4:
        b, heads, s1, s2 = attention_mask.shape
        if b not in (1, batch_size) or heads != 1 or s1 != seq_len or s2 != seq_len:
            raise ValueError(
                f"attention_mask: 4D mask has shape {tuple(attention_mask.shape)}, expected "
                f"({batch_size} or 1, 1, {seq_len}, {seq_len}) (True = masked); pass the mask built for "
                "this batch, or the dataset's 2D (B, T) keep mask"
            )
        masked = (attention_mask[:, 0] != 0).expand(batch_size, seq_len, seq_len)
        # A token is real iff it may attend to itself: causal masks never hide the diagonal,
        # padding masks hide the padded key column (and possibly its row).
        keep = ~torch.diagonal(masked, dim1=1, dim2=2)
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=masked.device).triu(1)
        key_padding = future | ~keep[:, None, :]
        key_and_query_padding = key_padding | ~keep[:, :, None]
        # Per sample: some collates mask padded query rows too, others only padded keys.
        is_causal_with_padding = (
            (masked == key_padding).flatten(1).all(dim=1) | (masked == key_and_query_padding).flatten(1).all(dim=1)
        ).all()
        check = DeferredCheck(
            ~is_causal_with_padding,
            "attention_mask: the 4D mask is not causal-with-padding (True = masked, future keys masked, "
            "padding keys masked); packing cannot recover per-sample lengths from it. Pass the "
            "dataset's 2D (B, T) keep mask instead (set dataset.skip_getting_attention_mask_from_dataset="
            "False in Megatron-Bridge)",
        )
        return keep, [check]
    raise ValueError(
        f"attention_mask: expected a 2D (B, T) keep mask or a 4D (B|1, 1, T, T) Megatron mask, got "
        f"{attention_mask.dim()}D shape {tuple(attention_mask.shape)}"
    )


def keep_mask_from_real_lengths(
    real_lengths: torch.Tensor, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """Keep mask for right-padded samples given their real lengths.

    Args:
        real_lengths: ``(B,)`` integer; sample i's first ``real_lengths[i]`` tokens are real.

    Returns:
        keep: ``(B, T)`` bool; checks: lengths must lie in ``[0, T]``.
    """
    if real_lengths.dim() != 1 or real_lengths.numel() != batch_size:
        raise ValueError(
            f"real_lengths: expected shape ({batch_size},) (one length per sample of input_ids), got "
            f"{tuple(real_lengths.shape)}"
        )
    if real_lengths.is_floating_point() or real_lengths.dtype == torch.bool:
        raise ValueError(f"real_lengths: expected an integer tensor, got dtype {real_lengths.dtype}")
    positions = torch.arange(seq_len, device=real_lengths.device)
    keep = positions[None, :] < real_lengths[:, None]
    out_of_range = ((real_lengths < 0) | (real_lengths > seq_len)).any()
    check = DeferredCheck(
        out_of_range,
        f"real_lengths: every length must lie in [0, {seq_len}] (the row width T of input_ids); "
        "clip the lengths to the truncated row or pass the attention_mask instead",
    )
    return keep, [check]


def real_lengths(keep: torch.Tensor) -> torch.Tensor:
    """Per-sample real token counts.

    Args:
        keep: ``(B, T)`` bool keep mask.

    Returns:
        ``(B,)`` int64 number of real tokens of each sample.
    """
    return keep.sum(dim=1, dtype=torch.int64)


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Cumulative boundaries ``[0, l0, l0+l1, ...]``.

    Args:
        lengths: ``(B,)`` integer segment lengths.

    Returns:
        ``(B + 1,)`` int64 cumulative sum starting at 0 (callers cast to int32 after checking
        the total fits).
    """
    return F.pad(lengths.to(torch.int64).cumsum(0), (1, 0))


def seq_idx(cu_seqlens: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The segment each row slot lies in (Megatron-Core's ``seq_idx``).

    Args:
        cu_seqlens: ``(S + 1,)`` non-decreasing integer boundaries of a row (for the slots of a padded
            row, its physical pair ``cu_seqlens_padded``).
        slots: any shape, integer row positions, the dtype of ``cu_seqlens``.

    Returns:
        ``slots``' shape, int64: s with ``cu_seqlens[s] <= slot < cu_seqlens[s + 1]``. A slot on a boundary
        belongs to the segment that starts there, so a zero-width segment is never returned; a slot at or
        past ``cu_seqlens[-1]`` gives S (callers clamp it, or read it as "no segment").
    """
    return torch.searchsorted(cu_seqlens[1:], slots, right=True)


def cu_seqlens_from_sample_ids(sample_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of an already packed row given as a sample-ID mask.

    Example: ``[[1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 5, 0, 0]]`` -> ``[0, 2, 5, 7, 8, 11, 13]``: one
    segment per sample id, and the padding tail (id 0) as one extra segment, so the last entry
    is always the row length.

    Args:
        sample_ids: ``(1, L)`` or ``(L,)`` integer; ids 1..K in non-decreasing order, each id
            used at least once, zeros only as a trailing tail. A packed row needs micro-batch 1.

    Returns:
        ``(K + 1,)`` int32, or ``(K + 2,)`` when the row has a padding tail.

    Raises:
        ValueError: on any other layout (one host synchronisation reads the ids' summary).
    """
    if sample_ids.dim() == 2:
        if sample_ids.size(0) != 1:
            raise ValueError(
                f"sample_ids: a packed row has micro-batch 1, got shape {tuple(sample_ids.shape)}; "
                "pack each row separately"
            )
        sample_ids = sample_ids[0]
    if sample_ids.dim() != 1 or sample_ids.is_floating_point():
        raise ValueError(f"sample_ids: expected a (1, L) or (L,) integer tensor, got {tuple(sample_ids.shape)}")
    ids = sample_ids.to(torch.int64)
    row_length = ids.numel()
    is_padding = ids == 0
    steps = ids[1:] - ids[:-1]
    real_steps_ok = ((steps == 0) | (steps == 1) | is_padding[1:]).all()
    # Padding may only be followed by padding: a 0 followed by a sample id means a gap.
    tail_ok = ~(is_padding[:-1] & ~is_padding[1:]).any()
    first_ok = (ids[:1] <= 1).all()
    summary = torch.stack([ids.max() if row_length else ids.new_zeros(()),
                           (real_steps_ok & tail_ok & first_ok & (ids >= 0).all()).long(),
                           is_padding.sum()]).tolist()
    num_samples, well_formed, num_padding = summary
    if not well_formed:
        raise ValueError(
            "sample_ids: ids must start at 1, grow by 0 or 1 from token to token, and use 0 only for a "
            f"trailing padding tail (got {sample_ids.tolist()[:32]}...); renumber the samples 1..K in row order"
        )
    # scatter_add into a host-sized buffer: torch.bincount reads the maximum on CUDA (a second sync).
    counts = ids.new_zeros(num_samples + 1).scatter_add_(0, ids, torch.ones_like(ids))[1:]
    cu_seqlens = cu_seqlens_from_lengths(counts)
    if num_padding:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_full((1,), row_length)])
    return cu_seqlens.to(torch.int32)
