"""One micro-batch prepared: everything between the data iterator and ``model(**forward_args)``, by the run's plan
(:class:`~megatron.bridge_thd.step.plan.StepPlan`), one way:

1. the batch: its tensors read from Megatron-Bridge's batch dict where they arrived (:func:`read_batch`);
2. which tokens are real: the keep mask taken from the dataset's mask before any pad/truncate helper, the cut to
   ``seq_length`` by the over-long policy (:func:`truncate_to_seq_length`), the family's positions
   (:mod:`megatron.bridge_thd.adapters`) and the checks still to read;
3. the layout's row: one packed THD row (``thd``, ``thd_static``: ``packing.pack_kept``) or the padded batch, samples
   re-laid right-padded (``bshd``: ``packing.relay_right_padded``), with the one host read of the checks where the
   layout needs one;
4. the row copied to the model's device, once per tensor and without blocking the host (:func:`to_device`);
5. what the micro-batch cost, for logging (:class:`PackingStats`).

The stages hand their records (``_Inputs``, ``_Captured``, ``_Built``) on, never back. The model, the loss and the
trainer's bookkeeping are :mod:`~megatron.bridge_thd.step.forward`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.layouts import bshd_width, row_bucket
from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_attention_mask, read_once
from megatron.bridge_thd.overlong import (
    DROPPED, LENGTHS_KEY, SAMPLE_INDEX_KEY, SETTING, TOKENS, cut_report, log_cut, row_names,
)
from megatron.bridge_thd.packing import pack_kept, relay_right_padded, round_up
from megatron.bridge_thd.step.plan import StaticRow, StepPlan, build_step_plan, in_batch_static_row

__all__ = ["PreparedMicroBatch", "PackingStats", "prepare_with_plan", "prepare_micro_batch", "read_batch",
           "truncate_to_seq_length", "overlong_sample_counts", "to_device", "decoder_signature"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# 1. the batch, where it arrived


@dataclass
class _Inputs:
    """The micro-batch as the iterator gave it, on the device it arrived on (nothing copied yet)."""

    tokens: torch.Tensor  # (B, T)
    labels: torch.Tensor | None  # (B, T), last pipeline stage only
    loss_mask: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) or 4D
    multi_modal: dict  # the visual inputs as the model takes them (pixel_values, image_grid_thw, ...)
    sample_index: torch.Tensor | None = None  # (B,) dataset indices, where the loader attached them


def read_batch(batch: dict, is_last_stage: bool) -> _Inputs:
    """The micro-batch's tensors, where they are (nothing copied, nothing computed): ``tokens`` (or
    ``input_ids``), ``labels`` (last pipeline stage only), ``loss_mask`` (ones without one), ``attention_mask``, the
    visual inputs as the model takes them (``multi_modal``) and the dataset indices where the loader attached them."""
    if batch.get("cu_seqlens_q") is not None or batch.get("cu_seqlens") is not None:
        raise ValueError(
            "batch: this step packs the micro-batch itself; use an unpacked collate (no cu_seqlens in the batch)"
        )
    tokens = batch.get("tokens")
    if tokens is None:
        tokens = batch.get("input_ids")
    if tokens is None or tokens.dim() != 2:
        raise ValueError("batch: expected 'tokens' or 'input_ids' of shape (B, T)")
    labels = batch.get("labels") if is_last_stage else None
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
    visual = batch.get("visual_inputs")
    multi_modal = visual.normalized_for_model() if visual is not None else {}
    multi_modal = {k: v for k, v in multi_modal.items() if v is not None}
    return _Inputs(tokens, labels, loss_mask, batch.get("attention_mask"), multi_modal, batch.get(SAMPLE_INDEX_KEY))


# --------------------------------------------------------------------------------------------
# 2. which tokens are real: keep mask, cut to seq_length, the family's positions


def _keep_mask(inputs: _Inputs, plan: StepPlan) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """The ``(B, T)`` keep mask, taken from the dataset's mask before any pad/truncate helper, and its deferred
    validity checks (a 2D mask: only 0 / 1 values; a 4D one: causal with padding).

    Without a mask, lengths are derived from the pad token only when the user opted in with
    ``length_fallback="pad_token"`` (the settings record) (the plan's ``pad_token_id``), never a guess.
    """
    tokens = inputs.tokens
    if inputs.attention_mask is not None:
        return keep_mask_from_attention_mask(inputs.attention_mask.to(tokens.device), *tokens.shape)
    if plan.pad_token_id is None:
        raise ValueError(
            "attention_mask: the batch carries no attention mask, so real sample lengths are unknown. Set "
            "dataset.skip_getting_attention_mask_from_dataset=False so the dataset's 2D mask reaches the step "
            "(recommended), or pass configure(..., length_fallback='pad_token') to derive right-padded lengths "
            "from the tokenizer's pad id."
        )
    is_content = tokens != plan.pad_token_id
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    real_length = torch.where(is_content, positions + 1, 0).amax(dim=1)
    return positions[None, :] < real_length[:, None], []


def _named_rows(flags: torch.Tensor, real: torch.Tensor, sample_index: torch.Tensor | None) -> Callable[[], str]:
    """The failed rows of a check, read only once it has failed: each row, its dataset index where the loader
    attached them (``overlong.SAMPLE_INDEX_KEY``) and its real tokens."""

    def details() -> str:
        rows = flags.nonzero().flatten().tolist()
        indices = None if sample_index is None else sample_index.tolist()
        lengths = real.tolist()
        return ", ".join(f"{name}: {lengths[r]} tokens" for name, r in zip(row_names(rows, indices), rows))

    return details


def truncate_to_seq_length(
    keep: torch.Tensor, tokens: torch.Tensor, seq_length: int, uncuttable_ids, *, policy: str = "truncate",
    loss_mask: torch.Tensor | None = None, sample_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[DeferredCheck]]:
    """Keep each sample's first ``seq_length`` real tokens, as the run's ``overlong_samples`` policy allows.

    ``uncuttable_ids``: the family's token ids truncation must not cut (image and video placeholders).
    ``policy``: ``"truncate"`` and ``"drop"`` cut (the caller masks a dropped sample's loss: every cut sample,
    ``truncated > 0``); ``"refuse"`` fails on any sample longer than ``seq_length``, before anything is cut.
    ``loss_mask`` ``(B, T)``: under ``"truncate"``, a sample whose every supervised token lies past the cut fails.
    ``sample_index`` ``(B,)``: the rows' dataset indices, named in the failures.

    Returns:
        keep: ``(B, T)`` the truncated keep mask.
        truncated: ``(B,)`` real tokens dropped per sample, or None when the batch is no wider
            than ``seq_length`` (nothing can be cut, nothing needs reading).
        checks: the policy's refusal, and under every policy a cut part that holds image or video tokens (the
            vision tower would emit embeddings for placeholders that no longer exist); read by the caller, before
            the model runs.
    """
    if tokens.shape[1] <= seq_length:
        return keep, None, []
    real = keep.sum(dim=1)
    rank = keep.cumsum(dim=1) - 1
    kept = keep & (rank < seq_length)
    dropped = keep & ~kept
    over = real > seq_length
    fix = "raise dataset.seq_length and model.seq_length, or filter these samples in the dataset"  # each refusal's way out
    checks = []
    if policy == "refuse":
        checks.append(DeferredCheck(
            over.any(),
            f"overlong_samples='refuse': samples of this micro-batch are longer than seq_length={seq_length}; {fix}, or "
            "set overlong_samples to 'truncate' (cut them) or 'drop' (no loss from them)",
            _named_rows(over, real, sample_index)))
    is_vision = functools.reduce(torch.logical_or, (tokens == token_id for token_id in uncuttable_ids))
    cut_vision = (dropped & is_vision).any(dim=1)
    checks.append(DeferredCheck(
        cut_vision.any(),
        f"overlong_samples={policy!r}: samples of this micro-batch are longer than seq_length={seq_length} and cutting "
        f"them would cut an image or video, which no overlong_samples policy allows; {fix}, or lower the image "
        "resolution (max_pixels)",
        _named_rows(cut_vision, real, sample_index)))
    if policy == "truncate" and loss_mask is not None:
        supervised = keep & (loss_mask != 0)
        emptied = over & supervised.any(dim=1) & ~(supervised & kept).any(dim=1)
        checks.append(DeferredCheck(
            emptied.any(),
            f"overlong_samples='truncate': samples of this micro-batch have every supervised token past seq_length="
            f"{seq_length}, so the cut leaves them nothing to train on; set overlong_samples='drop' to keep them out of "
            f"the loss, or {fix}",
            _named_rows(emptied, real, sample_index)))
    return kept, dropped.sum(dim=1), checks


def _drop_loss(inputs: _Inputs, truncated: torch.Tensor | None, policy: str) -> _Inputs:
    """Under ``overlong_samples="drop"``, every sample the step cut (``truncated`` ``(B,)`` > 0) out of the loss: its
    loss mask 0 and its labels -100, as the collate's drop does (device ops, no read)."""
    if policy != "drop" or truncated is None:
        return inputs
    dropped = (truncated > 0)[:, None]
    labels = None if inputs.labels is None else inputs.labels.masked_fill(dropped, -100)
    return dataclasses.replace(inputs, loss_mask=inputs.loss_mask.masked_fill(dropped, 0), labels=labels)


@dataclass
class _Captured:
    """What every layout starts from: the micro-batch where it arrived, its keep mask after truncation, the
    family's positions, the checks still to read and the padded layout's width."""

    inputs: _Inputs
    keep: torch.Tensor  # (B, T) bool, real tokens after truncation
    positions: torch.Tensor | None  # (3, B, T) or (B, T); None: the model computes its own
    truncated: torch.Tensor | None  # (B,) real tokens cut, None when nothing can be cut (under "drop": dropped)
    mask_checks: list[DeferredCheck]
    truncation_checks: list[DeferredCheck]
    position_checks: list[DeferredCheck]
    batch_size: int  # B
    padded_width: int  # W, the width of the padded layout's (B, W) batch (what bshd runs, what the stats compare to)


def _capture(inputs: _Inputs, plan: StepPlan) -> _Captured:
    """Keep mask (before any pad/truncate helper could drop a 2D mask), truncation by the over-long policy, the
    family's positions."""
    keep, mask_checks = _keep_mask(inputs, plan)
    keep, truncated, truncation_checks = truncate_to_seq_length(
        keep, inputs.tokens, plan.seq_length, plan.uncuttable, policy=plan.overlong_samples,
        loss_mask=inputs.loss_mask, sample_index=inputs.sample_index)
    inputs = _drop_loss(inputs, truncated, plan.overlong_samples)
    # A batch on the host bound for a model elsewhere (Megatron-Bridge's loader and a GPU): host code builds the
    # positions where the data is; the finished row is copied once (to_device).
    on_host = inputs.tokens.device.type == "cpu" and plan.device.type != "cpu"
    positions, position_checks = plan.adapter.position_ids(inputs.tokens, keep, inputs.multi_modal, plan.tokens,
                                                           on_host=on_host)
    position_checks = position_checks + plan.adapter.data_checks(plan.layout, keep)
    batch_size, batch_width = inputs.tokens.shape
    width = bshd_width(batch_width, seq_length=plan.seq_length, tp=plan.tp, cp=plan.cp, pp=plan.pp, ep=plan.ep)
    return _Captured(inputs, keep, positions, truncated, mask_checks, truncation_checks, position_checks, batch_size,
                     width)


# --------------------------------------------------------------------------------------------
# what over-long samples lost: logged, counted


def overlong_sample_counts(measures: torch.Tensor | None, plan: StepPlan) -> tuple[int, int]:
    """(truncated, dropped): the micro-batch's samples longer than ``seq_length`` that the over-long policy cut, and
    those it dropped from the loss, from the lengths the collate measured before its cut (``overlong.LENGTHS_KEY``,
    ``(len(MEASURES), B)``). Host tensors only, as :func:`_report_overlong`: (0, 0) without them or on a device."""
    if measures is None or measures.device.type != "cpu":
        return 0, 0
    dropped = measures[DROPPED] != 0
    return int(((measures[TOKENS] > plan.seq_length) & ~dropped).sum()), int(dropped.sum())


def _report_overlong(measures: torch.Tensor | None, c: _Captured, plan: StepPlan) -> None:
    """Log what the collate (and the step) cut from over-long samples, from the lengths the collate measured before
    its cut (``overlong.LENGTHS_KEY``, ``(len(MEASURES), B)``). Host tensors only: a batch on a device is not read
    for a log."""
    if measures is None or measures.device.type != "cpu" or c.keep.device.type != "cpu":
        return
    kept_supervised = ((c.inputs.loss_mask != 0) & c.keep).sum(dim=1)
    log_cut(cut_report(measures, c.keep.sum(dim=1), kept_supervised), policy=plan.overlong_samples,
            seq_length=plan.seq_length)


def _log_truncation(truncated: list[int] | None, seq_length: int, policy: str = "truncate") -> None:
    """The step's own cut (a batch wider than ``seq_length``), from the per-sample counts already on the host."""
    if not truncated or not any(truncated):
        return
    if policy == "drop":
        logger.warning(
            "bridge_thd: dropped %d over-long sample(s) from the loss (%s=%r): %s real tokens cut (per sample: %s) "
            "to seq_length=%d; no image was cut", sum(1 for n in truncated if n), SETTING, policy, sum(truncated),
            truncated, seq_length)
        return
    logger.warning(
        "bridge_thd: truncated %s real tokens (per sample: %s) to seq_length=%d (%s=%r); no image was cut",
        sum(truncated), truncated, seq_length, SETTING, policy,
    )


def _read_now(checks: list[DeferredCheck], truncated: torch.Tensor | None) -> list[int] | None:
    """One read of every deferred check and the truncation counts (layouts without the packer's read); nothing
    at all when there is nothing to read. Free when the batch is on the host."""
    return read_once(checks=checks, extra=truncated)[1]


# --------------------------------------------------------------------------------------------
# 3. the layout's row


@dataclass
class _Built:
    """What a layout hands back."""

    forward_args: dict
    extras: dict
    attention_work: torch.Tensor  # 0-dim, sum of s_i^2 the attention computes


def _build_padded(c: _Captured, plan: StepPlan) -> _Built:
    """``bshd``: the padded batch as Megatron-Bridge's own step lays it out, samples re-laid right-padded
    (causal-safe) in ``(B, W)``; one read of the checks."""
    width, inputs, keep = c.padded_width, c.inputs, c.keep
    if plan.fixed_p2p_shapes and c.batch_size != (plan.micro_batch_size or c.batch_size):
        raise ValueError(
            f"batch: {c.batch_size} samples for train.micro_batch_size={plan.micro_batch_size}, the batch size of the "
            "pipeline's fixed buffers (bshd needs exactly that many); set train.micro_batch_size to the data "
            "loader's batch size, or set model.variable_seq_lengths=True")
    _log_truncation(_read_now(c.mask_checks + c.truncation_checks + c.position_checks, c.truncated), plan.seq_length,
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
    return _Built(forward_args, extras, keep.new_full((), c.batch_size * width**2, dtype=torch.int64))


def _static_row_of(c: _Captured, plan: StepPlan) -> StaticRow:
    """The plan's static row for this micro-batch: the shortest of the run's rows that holds its aligned tokens
    (``layouts.row_bucket``; one row: that row, no read), checked to take its samples (a shape: known on the host).
    The plan checked each row once (``packing.check_static_row``); this check is the one that depends on the batch."""
    rows = plan.static_rows or (in_batch_static_row(c.batch_size, plan.seq_length, plan.align),)
    row = rows[-1]
    if len(rows) > 1:
        # The aligned slots the real tokens take (at least one aligned padding segment): free on the host, one read
        # on a device.
        slots = max(int(round_up(c.keep.sum(dim=1), plan.align).sum()), plan.align)
        row = rows[min(row_bucket(plan.static_row_lengths, slots), len(rows) - 1)]
    if c.batch_size > row.max_samples:
        raise ValueError(
            f"batch: {c.batch_size} samples, but the run's static row ({row.length} slots) has segments for "
            f"{row.max_samples}; set train.micro_batch_size to the data loader's batch size (in-batch packing), or "
            "let global-batch packing build the loaders (its rows are sized from the run's draws)")
    return row


def _build_packed(c: _Captured, plan: StepPlan) -> _Built:
    """``thd`` / ``thd_static``: one THD row; one read (``thd``) or none (``thd_static`` within ``seq_length``:
    the checks become device asserts)."""
    inputs, checks = c.inputs, c.mask_checks + c.truncation_checks + c.position_checks
    row = None
    if plan.layout == "thd_static":
        row = _static_row_of(c, plan)
        if c.truncated is not None:  # a truncating static batch: one read for the report
            _log_truncation(_read_now(c.truncation_checks, c.truncated), plan.seq_length, plan.overlong_samples)
            checks = c.mask_checks + c.position_checks  # the truncation check was just read
    packed = pack_kept(
        inputs.tokens, c.keep, labels=inputs.labels, loss_mask=inputs.loss_mask, position_ids=c.positions,
        align_to=plan.align, total_length=None if row is None else row.length,
        segments=None if row is None else row.segments, max_seqlen=None if row is None else row.max_seqlen,
        # A micro-batch of padding only still reaches the model as one aligned padding segment.
        min_length=plan.align, checks=checks, host_values=c.truncated if row is None else None,
    )
    _log_truncation(packed.host_values, plan.seq_length, plan.overlong_samples)
    forward_args = dict(
        input_ids=packed.input_ids,
        labels=packed.labels,
        position_ids=packed.position_ids,
        attention_mask=None,
        packed_seq_params=packed.packed_seq_params,
        loss_mask=packed.loss_mask,
    )
    extras = {"padding_mask": packed.padding_mask, "rope_cu_seqlens": packed.cu_seqlens_padded}
    return _Built(forward_args, extras, (c.keep.sum(dim=1).to(torch.int64) ** 2).sum())


# One row builder per layout (layouts.LAYOUT_NAMES names them).
_BUILDERS = {"thd": _build_packed, "thd_static": _build_packed, "bshd": _build_padded}


# --------------------------------------------------------------------------------------------
# 4. the model's device


def to_device(forward_args: dict, device: torch.device) -> dict:
    """``forward_args`` on ``device``: one copy per distinct tensor (``PackedSeqParams`` shares its q and kv
    boundaries), none that blocks the host: a host tensor bound for a GPU is copied from pinned memory (a copy
    from pageable memory waits for the stream). A tensor already there is not touched."""
    copies: dict[int, torch.Tensor] = {}

    def move(value):
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        if id(value) not in copies:
            source = value
            if device.type == "cuda" and source.device.type == "cpu" and not source.is_pinned():
                source = source.pin_memory()
            copies[id(value)] = source.to(device, non_blocking=True)
        return copies[id(value)]

    moved = {}
    for name, value in forward_args.items():
        if name == "packed_seq_params" and value is not None:
            # The PackedSeqParams fields that hold tensors (its q and kv boundaries are one tensor in a THD row).
            value = dataclasses.replace(
                value, cu_seqlens_q=move(value.cu_seqlens_q), cu_seqlens_kv=move(value.cu_seqlens_kv),
                cu_seqlens_q_padded=move(value.cu_seqlens_q_padded),
                cu_seqlens_kv_padded=move(value.cu_seqlens_kv_padded))
        moved[name] = move(value)
    return moved


# --------------------------------------------------------------------------------------------
# 5. what the micro-batch cost


@dataclass
class PackingStats:
    """Per micro-batch bookkeeping for logging (tensors on the batch's device: no sync).

    Attributes:
        layout: the layout that ran.
        real_tokens: 0-dim, real tokens in the micro-batch (after truncation).
        processed_tokens: int, token slots the model processes (row length or B * T).
        padded_tokens: int, token slots of the padded BSHD layout, ``B * T_bshd``.
        attention_work: 0-dim, sum over samples of ``s_i ** 2`` actually computed
            (``B * T_bshd ** 2`` for BSHD).
        padded_attention_work: int, ``B * T_bshd ** 2``, what the padded layout computes.
        truncated_tokens: 0-dim, real tokens cut because a sample exceeded ``seq_length``.
        signature: what a CUDA-graph manager compares of what the decoder sees (:func:`decoder_signature`);
            in ``thd_static`` the same for every micro-batch of a run.
        truncated_samples / dropped_samples: host ints, the micro-batch's samples the over-long policy cut to
            ``seq_length`` / dropped from the loss, from the lengths the collate measured before its cut
            (``overlong.LENGTHS_KEY``, a host tensor); 0 where the batch carries none.
    """

    layout: str
    real_tokens: torch.Tensor
    processed_tokens: int
    padded_tokens: int
    attention_work: torch.Tensor
    padded_attention_work: int
    truncated_tokens: torch.Tensor
    signature: tuple = ()
    truncated_samples: int = 0
    dropped_samples: int = 0


_DECODER_INPUTS = ("input_ids", "position_ids", "labels", "loss_mask")
_PACKED_SEQ_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv", "pad_between_seqs")


def decoder_signature(forward_args: dict) -> tuple:
    """``((name, value), ...)`` of the token-level inputs and each ``PackedSeqParams`` field: a tensor as
    ``(shape, dtype)``, anything else as it is. Megatron-Core's CUDA-graph managers replay a captured graph only
    for arguments equal in exactly these (docs/cuda-graphs.md). Host metadata only: no device read."""
    def describe(value):
        return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value

    params = forward_args.get("packed_seq_params")
    fields = tuple((name, getattr(params, name, None)) for name in _PACKED_SEQ_FIELDS)  # duck: PackedSeqParams or None
    return (tuple((name, describe(forward_args.get(name))) for name in _DECODER_INPUTS)
            + tuple((name, describe(value)) for name, value in fields))


def _packing_stats(c: _Captured, built: _Built, forward_args: dict, plan: StepPlan,
                   cut_samples: tuple[int, int]) -> PackingStats:
    """The micro-batch's :class:`PackingStats`: what the layout that ran processes (``forward_args`` on the model's
    device) against the padded layout's ``B * W`` slots; ``cut_samples``: (truncated, dropped) samples, host ints
    (:func:`overlong_sample_counts`)."""
    return PackingStats(
        layout=plan.layout,
        real_tokens=c.keep.sum(),
        processed_tokens=forward_args["input_ids"].numel(),
        padded_tokens=c.batch_size * c.padded_width,
        attention_work=built.attention_work,
        padded_attention_work=c.batch_size * c.padded_width**2,
        truncated_tokens=c.keep.new_zeros((), dtype=torch.int64) if c.truncated is None else c.truncated.sum(),
        signature=decoder_signature(forward_args),
        truncated_samples=cut_samples[0],
        dropped_samples=cut_samples[1],
    )


# --------------------------------------------------------------------------------------------
# the stages in order


@dataclass
class PreparedMicroBatch:
    """What the step hands the model and the loss, built by :func:`prepare_with_plan`."""

    forward_args: dict[str, Any]
    loss_mask: torch.Tensor
    stats: PackingStats
    # Set for a static THD row under pipeline parallelism without variable_seq_lengths: the
    # micro_batch_size of Megatron-Core's p2p buffers (seq_length / cp, micro_batch_size, H).
    p2p_micro_batch_size: int | None = None


def prepare_with_plan(batch: dict, plan: StepPlan, *, is_last_stage: bool = True) -> PreparedMicroBatch:
    """Everything between the data iterator and ``model(**forward_args)``, by the run's plan.

    Host synchronisations: none when the batch arrives on the host (Megatron-Bridge's loader): the row is
    built there and copied. A batch already on the model's device: one in ``thd`` (the packer's read carries
    the row length, every validity flag and the truncation counts), one in ``bshd`` (the flags), none in
    ``thd_static`` within ``seq_length`` with one row (device asserts), one in a truncating ``thd_static`` and one
    to choose among several rows (global-batch packing's ``row_buckets``).
    """
    inputs = read_batch(batch, is_last_stage)
    captured = _capture(inputs, plan)
    measures = batch.get(LENGTHS_KEY)
    _report_overlong(measures, captured, plan)
    built = _BUILDERS[plan.layout](captured, plan)
    forward_args = built.forward_args
    forward_args.update(captured.inputs.multi_modal)
    forward_args.update({name: built.extras[name] for name in plan.extras if name in built.extras})
    forward_args = to_device(forward_args, plan.device)
    stats = _packing_stats(captured, built, forward_args, plan, overlong_sample_counts(measures, plan))
    return PreparedMicroBatch(forward_args=forward_args, loss_mask=forward_args["loss_mask"], stats=stats,
                              p2p_micro_batch_size=plan.p2p_micro_batch_size)


def prepare_micro_batch(
    batch: dict,
    model,
    state,
    pg_collection,
    *,
    is_last_stage: bool = True,
    adapter: ModelAdapter = QWEN3_VL,
    plan: StepPlan | None = None,
) -> PreparedMicroBatch:
    """:func:`prepare_with_plan` with the plan built here (one-off calls; the forward step builds its plan once
    per run and keeps it on Megatron-Bridge's state, :mod:`~megatron.bridge_thd.step.forward`).

    Args:
        batch: Megatron-Bridge's VLM micro-batch dict: ``tokens``/``input_ids`` ``(B, T)``,
            ``labels``, ``loss_mask``, ``attention_mask`` (2D keep mask or 4D), ``position_ids``,
            ``visual_inputs`` (with ``normalized_for_model()``).
        model: the model chunk (or its DDP / Float16Module wrapper).
        state: Megatron-Bridge ``GlobalState`` (``state.cfg``, ``state.tokenizer``, ``state.train_state``).
        pg_collection: process groups (``tp``, ``cp``, ``pp``, ``ep``).
        adapter: the model family (:mod:`megatron.bridge_thd.adapters`).
        plan: a plan built already; None builds one.
    """
    read_batch(batch, is_last_stage)  # a malformed batch is named before anything else
    plan = plan if plan is not None else build_step_plan(state, model, pg_collection, adapter)
    return prepare_with_plan(batch, plan, is_last_stage=is_last_stage)
