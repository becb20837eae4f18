"""The step's second stage: which tokens are real. The keep mask, captured from the dataset's mask before any
pad/truncate helper, the cut to ``seq_length``, the family's positions and the deferred checks still to read
(:class:`Captured`), and the log of what over-long samples lost. From :mod:`megatron.bridge_thd.step.batch`;
next: :mod:`megatron.bridge_thd.step.rows`."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_attention_mask, read_once
from megatron.bridge_thd.overlong import SETTING, cut_report, log_cut, row_names
from megatron.bridge_thd.step.batch import Inputs
from megatron.bridge_thd.step.plan import StepPlan

__all__ = ["Captured", "capture", "capture_keep_mask", "truncate_to_seq_length", "log_truncation", "read_now",
           "report_overlong"]

logger = logging.getLogger(__name__)


def capture_keep_mask(inputs: Inputs, plan: StepPlan) -> tuple[torch.Tensor, list[DeferredCheck]]:
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


def log_truncation(truncated: list[int] | None, seq_length: int, policy: str = "truncate") -> None:
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


def read_now(checks: list[DeferredCheck], truncated: torch.Tensor | None) -> list[int] | None:
    """One read of every deferred check and the truncation counts (layouts without the packer's read); nothing
    at all when there is nothing to read. Free when the batch is on the host."""
    return read_once(checks=checks, extra=truncated)[1]


@dataclass
class Captured:
    """What every layout starts from: the micro-batch where it arrived, its keep mask after truncation, the
    family's positions and the checks still to read."""

    inputs: Inputs
    keep: torch.Tensor  # (B, T) bool, real tokens after truncation
    positions: torch.Tensor | None  # (3, B, T) or (B, T); None: the model computes its own
    truncated: torch.Tensor | None  # (B,) real tokens cut, None when nothing can be cut (under "drop": dropped)
    mask_checks: list[DeferredCheck]
    truncation_checks: list[DeferredCheck]
    position_checks: list[DeferredCheck]

    @property
    def batch_size(self) -> int:
        return self.inputs.tokens.shape[0]


def drop_loss(inputs: Inputs, truncated: torch.Tensor | None, policy: str) -> Inputs:
    """Under ``overlong_samples="drop"``, every sample the step cut (``truncated`` ``(B,)`` > 0) out of the loss: its
    loss mask 0 and its labels -100, as the collate's drop does (device ops, no read)."""
    if policy != "drop" or truncated is None:
        return inputs
    dropped = (truncated > 0)[:, None]
    labels = None if inputs.labels is None else inputs.labels.masked_fill(dropped, -100)
    return dataclasses.replace(inputs, loss_mask=inputs.loss_mask.masked_fill(dropped, 0), labels=labels)


def capture(inputs: Inputs, plan: StepPlan) -> Captured:
    """Keep mask (before any pad/truncate helper could drop a 2D mask), truncation by the over-long policy, the
    family's positions."""
    keep, mask_checks = capture_keep_mask(inputs, plan)
    keep, truncated, truncation_checks = truncate_to_seq_length(
        keep, inputs.tokens, plan.seq_length, plan.tokens.uncuttable, policy=plan.overlong_samples,
        loss_mask=inputs.loss_mask, sample_index=inputs.sample_index)
    inputs = drop_loss(inputs, truncated, plan.overlong_samples)
    # A batch on the host bound for a model elsewhere (Megatron-Bridge's loader and a GPU): host code builds the
    # positions where the data is; the finished row is copied once (step.device.to_device).
    on_host = inputs.tokens.device.type == "cpu" and plan.device.type != "cpu"
    positions, position_checks = plan.adapter.position_ids(inputs.tokens, keep, inputs.multi_modal, plan.tokens,
                                                           on_host=on_host)
    position_checks = position_checks + plan.adapter.data_checks(plan.layout, keep)
    return Captured(inputs, keep, positions, truncated, mask_checks, truncation_checks, position_checks)


def overlong_sample_counts(measures: torch.Tensor | None, plan: StepPlan) -> tuple[int, int]:
    """(truncated, dropped): the micro-batch's samples longer than ``seq_length`` that the over-long policy cut, and
    those it dropped from the loss, from the lengths the collate measured before its cut (``overlong.LENGTHS_KEY``,
    ``(len(MEASURES), B)``). Host tensors only, as :func:`report_overlong`: (0, 0) without them or on a device."""
    from megatron.bridge_thd.overlong import DROPPED, TOKENS

    if measures is None or measures.device.type != "cpu":
        return 0, 0
    dropped = measures[DROPPED] != 0
    return int(((measures[TOKENS] > plan.seq_length) & ~dropped).sum()), int(dropped.sum())


def report_overlong(measures: torch.Tensor | None, c: Captured, plan: StepPlan) -> None:
    """Log what the collate (and the step) cut from over-long samples, from the lengths the collate measured before
    its cut (``overlong.LENGTHS_KEY``, ``(len(MEASURES), B)``). Host tensors only: a batch on a device is not read for a log."""
    if measures is None or measures.device.type != "cpu" or c.keep.device.type != "cpu":
        return
    kept_supervised = ((c.inputs.loss_mask != 0) & c.keep).sum(dim=1)
    log_cut(cut_report(measures, c.keep.sum(dim=1), kept_supervised), policy=plan.overlong_samples,
            seq_length=plan.seq_length)
