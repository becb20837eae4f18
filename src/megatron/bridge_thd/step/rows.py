"""The step's third stage: the row the model takes, one builder per layout (:data:`BUILDERS`). ``thd`` and
``thd_static``: one packed THD row (:func:`build_packed`); ``bshd``: the padded batch, samples re-laid
right-padded (:func:`build_padded`). From :mod:`megatron.bridge_thd.step.capture`; next:
:mod:`megatron.bridge_thd.step.device`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.bridge_thd.layouts import bshd_width, row_bucket
from megatron.bridge_thd.packing import pack_bshd_to_thd, round_up, row_index, scatter_into_row
from megatron.bridge_thd.step.capture import Captured, log_truncation, read_now
from megatron.bridge_thd.step.plan import StepPlan, in_batch_static_row

__all__ = ["Built", "BUILDERS", "build_packed", "build_padded", "padded_width", "relay_right_padded"]


@dataclass
class Built:
    """What a layout hands back."""

    forward_args: dict
    extras: dict
    attention_work: torch.Tensor  # 0-dim, sum of s_i^2 the attention computes


def relay_right_padded(values: torch.Tensor, keep: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``(..., B, T)`` -> ``(..., B, width)``: each sample's real tokens first, then ``fill``.

    One scatter; a sample's k-th real token lands in column k. Used by the BSHD layout so that
    left-padded or truncated samples reach the model in the causal-safe right-padded form.
    """
    batch_size = keep.shape[0]
    row_length = batch_size * width
    index = row_index(keep, torch.arange(batch_size, device=keep.device) * width, row_length)
    row = scatter_into_row(values, index, row_length, fill)  # (..., 1, B * width)
    return row.reshape(*values.shape[:-2], batch_size, width)


def padded_width(c: Captured, plan: StepPlan) -> int:
    """``W``, the width of the padded layout's ``(B, W)`` batch (what ``bshd`` runs, what the stats compare to)."""
    return bshd_width(c.inputs.tokens.shape[1], seq_length=plan.seq_length, tp=plan.tp, cp=plan.cp, pp=plan.pp,
                      ep=plan.ep)


def build_padded(c: Captured, plan: StepPlan) -> Built:
    """``bshd``: the padded batch as Megatron-Bridge's own step lays it out, samples re-laid right-padded
    (causal-safe) in ``(B, W)``; one read of the checks."""
    width, inputs, keep = padded_width(c, plan), c.inputs, c.keep
    if plan.fixed_p2p_shapes and c.batch_size != (plan.micro_batch_size or c.batch_size):
        raise ValueError(
            f"batch: {c.batch_size} samples for train.micro_batch_size={plan.micro_batch_size}, the batch size of the "
            "pipeline's fixed buffers (bshd needs exactly that many); set train.micro_batch_size to the data "
            "loader's batch size, or set model.variable_seq_lengths=True")
    log_truncation(read_now(c.mask_checks + c.truncation_checks + c.position_checks, c.truncated), plan.seq_length,
                   plan.overlong_samples)
    loss_mask = relay_right_padded(inputs.loss_mask, keep, width, 0)
    forward_args = dict(
        input_ids=relay_right_padded(inputs.tokens, keep, width, 0),
        labels=None if inputs.labels is None else relay_right_padded(inputs.labels, keep, width, -100),
        position_ids=None if c.positions is None else relay_right_padded(c.positions, keep, width, 0),
        attention_mask=None,
        packed_seq_params=None,
        loss_mask=loss_mask,
    )
    extras = {"padding_mask": ~relay_right_padded(keep, keep, width, False)}
    return Built(forward_args, extras, keep.new_full((), c.batch_size * width**2, dtype=torch.int64))


def _row_slots(keep: torch.Tensor, align: int) -> int:
    """The aligned slots a micro-batch's real tokens take (at least one aligned padding segment): free on the host,
    one read on a device."""
    return max(int(round_up(keep.sum(dim=1), align).sum()), align)


def _static_row_of(c: Captured, plan: StepPlan):
    """The plan's static row for this micro-batch: the shortest of the run's rows that holds its aligned tokens
    (``layouts.row_bucket``; one row: that row, no read), checked to take its samples (a shape: known on the host)."""
    rows = plan.static_rows or (in_batch_static_row(c.batch_size, plan.seq_length, plan.align),)
    row = rows[-1]
    if len(rows) > 1:
        row = rows[min(row_bucket(plan.static_row_lengths, _row_slots(c.keep, plan.align)), len(rows) - 1)]
    if c.batch_size > row.max_samples:
        raise ValueError(
            f"batch: {c.batch_size} samples, but the run's static row ({row.length} slots) has segments for "
            f"{row.max_samples}; set train.micro_batch_size to the data loader's batch size (in-batch packing), or "
            "let global-batch packing build the loaders (its rows are sized from the run's draws)")
    return row


def build_packed(c: Captured, plan: StepPlan) -> Built:
    """``thd`` / ``thd_static``: one THD row; one read (``thd``) or none (``thd_static`` within ``seq_length``:
    the checks become device asserts)."""
    inputs, checks = c.inputs, c.mask_checks + c.truncation_checks + c.position_checks
    row = None
    if plan.layout == "thd_static":
        row = _static_row_of(c, plan)
        if c.truncated is not None:  # a truncating static batch: one read for the report
            log_truncation(read_now(c.truncation_checks, c.truncated), plan.seq_length, plan.overlong_samples)
            checks = c.mask_checks + c.position_checks  # the truncation check was just read
    packed = pack_bshd_to_thd(
        inputs.tokens, keep=c.keep, labels=inputs.labels, loss_mask=inputs.loss_mask, position_ids=c.positions,
        align_to=plan.align, total_length=None if row is None else row.length,
        segments=None if row is None else row.segments, max_seqlen=None if row is None else row.max_seqlen,
        # A micro-batch of padding only still reaches the model as one aligned padding segment.
        min_length=plan.align, checks=checks, host_values=c.truncated if row is None else None,
    )
    log_truncation(packed.host_values, plan.seq_length, plan.overlong_samples)
    forward_args = dict(
        input_ids=packed.input_ids,
        labels=packed.labels,
        position_ids=packed.position_ids,
        attention_mask=None,
        packed_seq_params=packed.packed_seq_params,
        loss_mask=packed.loss_mask,
    )
    extras = {"padding_mask": packed.padding_mask, "rope_cu_seqlens": packed.cu_seqlens_padded}
    return Built(forward_args, extras, (c.keep.sum(dim=1).to(torch.int64) ** 2).sum())


# One row builder per layout (layouts.LAYOUT_NAMES names them).
BUILDERS = {"thd": build_packed, "thd_static": build_packed, "bshd": build_padded}
