"""The packed forward step for Megatron-Bridge VLMs, family-agnostic (docs/megatron-bridge-step.md).

Data flow: batch -> keep mask (captured before any pad/truncate helper) -> truncation check -> the family's
position ids (:mod:`megatron.bridge_thd.adapters`) -> the layout's row (a packed THD row or the padded batch) ->
copy to the model's device -> model -> Megatron-Bridge's masked loss. Everything that can be decided once is in
the run's :class:`~megatron.bridge_thd.step_plan.StepPlan`; this module only reads it.

Where the work runs: on the device the batch arrives on. Megatron-Bridge's loader hands the step host tensors,
so the whole preparation runs on the host, where every read is free, and the finished row is copied to the
model's device from pinned memory without blocking: no host synchronisation, and only the copies are device
ops. A batch that is already on the model's device (VERL, custom iterators) is prepared there with one host
read (``thd``) or none (``thd_static``). :func:`make_forward_step` binds a family;
``megatron.bridge_thd.qwen3_vl_step.forward_step`` is the Qwen3-VL / Qwen3.5-VL drop-in.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Iterable

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.context_parallel import cut_for_context_parallel
from megatron.bridge_thd.layouts import LAYOUT_NAMES
from megatron.bridge_thd.layouts import bshd_width, row_bucket
from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_attention_mask, read_once
from megatron.bridge_thd.overlong import LENGTHS_KEY, cut_report, log_cut
from megatron.bridge_thd.packing import pack_bshd_to_thd, round_up, row_index, scatter_into_row
from megatron.bridge_thd.step_plan import (
    StepPlan,
    build_step_plan,
    in_batch_static_row,
    unwrap_model,
)
from megatron.bridge_thd.upstream import load_bridge_module, load_flop_utils
from megatron.bridge_thd.upstream_line import upstream_line

__all__ = ["make_forward_step", "forward_step", "PackingStats", "LAYOUT_NAMES", "prepare_micro_batch", "PreparedMicroBatch",
           "prepare_with_plan", "plan_for", "decoder_signature"]

logger = logging.getLogger(__name__)

# Where the forward step keeps its plan: an attribute of Megatron-Bridge's GlobalState, built at the first
# micro-batch of the run.
PLAN_ATTRIBUTE = "bridge_thd_plan"


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
    """

    layout: str
    real_tokens: torch.Tensor
    processed_tokens: int
    padded_tokens: int
    attention_work: torch.Tensor
    padded_attention_work: int
    truncated_tokens: torch.Tensor
    signature: tuple = ()


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
    return (tuple((name, describe(forward_args.get(name))) for name in _DECODER_INPUTS)
            + tuple((name, describe(getattr(params, name, None))) for name in _PACKED_SEQ_FIELDS))


@dataclass
class PreparedMicroBatch:
    """What the step hands the model and the loss, built by :func:`prepare_micro_batch`."""

    forward_args: dict[str, Any]
    loss_mask: torch.Tensor
    stats: PackingStats
    # Set for a static THD row under pipeline parallelism without variable_seq_lengths: the
    # micro_batch_size of Megatron-Core's p2p buffers (seq_length / cp, micro_batch_size, H).
    p2p_micro_batch_size: int | None = None


@dataclass
class _Inputs:
    """The micro-batch as the iterator gave it, on the device it arrived on (nothing copied yet)."""

    tokens: torch.Tensor  # (B, T)
    labels: torch.Tensor | None  # (B, T), last pipeline stage only
    loss_mask: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) or 4D
    multi_modal: dict  # the visual inputs as the model takes them (pixel_values, image_grid_thw, ...)


def _read_batch(batch: dict, is_last_stage: bool) -> _Inputs:
    """The micro-batch's tensors, where they are."""
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
    return _Inputs(tokens, labels, loss_mask, batch.get("attention_mask"), multi_modal)


def capture_keep_mask(inputs: _Inputs, plan: StepPlan) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """The ``(B, T)`` keep mask, taken from the dataset's mask before any pad/truncate helper, and its deferred
    validity checks (a 2D mask: only 0 / 1 values; a 4D one: causal with padding).

    Without a mask, lengths are derived from the pad token only when the user opted in with
    ``dataset.packing_length_fallback = "pad_token"`` (the plan's ``pad_token_id``), never a guess.
    """
    tokens = inputs.tokens
    if inputs.attention_mask is not None:
        return keep_mask_from_attention_mask(inputs.attention_mask.to(tokens.device), *tokens.shape)
    if plan.pad_token_id is None:
        raise ValueError(
            "attention_mask: the batch carries no attention mask, so real sample lengths are unknown. Set "
            "dataset.skip_getting_attention_mask_from_dataset=False so the dataset's 2D mask reaches the step "
            "(recommended), or set dataset.packing_length_fallback='pad_token' to derive right-padded lengths "
            "from the tokenizer's pad id."
        )
    is_content = tokens != plan.pad_token_id
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    real_length = torch.where(is_content, positions + 1, 0).amax(dim=1)
    return positions[None, :] < real_length[:, None], []


def truncate_to_seq_length(
    keep: torch.Tensor, tokens: torch.Tensor, seq_length: int, uncuttable_ids
) -> tuple[torch.Tensor, torch.Tensor | None, list[DeferredCheck]]:
    """Keep each sample's first ``seq_length`` real tokens, unless that would cut an image.

    ``uncuttable_ids``: the family's token ids truncation must not cut (image and video placeholders).

    Returns:
        keep: ``(B, T)`` the truncated keep mask.
        truncated: ``(B,)`` real tokens dropped per sample, or None when the batch is no wider
            than ``seq_length`` (nothing can be cut, nothing needs reading).
        checks: fails when a cut part holds image or video tokens (the vision tower would emit
            embeddings for placeholders that no longer exist); read by the caller.
    """
    if tokens.shape[1] <= seq_length:
        return keep, None, []
    rank = keep.cumsum(dim=1) - 1
    kept = keep & (rank < seq_length)
    dropped = keep & ~kept
    is_vision = functools.reduce(torch.logical_or, (tokens == token_id for token_id in uncuttable_ids))
    cut_vision = (dropped & is_vision).any(dim=1)
    check = DeferredCheck(
        cut_vision.any(),
        f"seq_length: samples of this micro-batch are longer than seq_length={seq_length} and truncating them would "
        "cut an image or video. Raise seq_length, lower the image resolution (max_pixels), or filter these samples "
        "in the dataset",
        lambda: f"samples {cut_vision.nonzero().flatten().tolist()}",
    )
    return kept, dropped.sum(dim=1), [check]


def _log_truncation(truncated: list[int] | None, seq_length: int) -> None:
    if truncated and any(truncated):
        logger.warning(
            "bridge_thd: truncated %s real tokens (per sample: %s) to seq_length=%d; no image was cut",
            sum(truncated), truncated, seq_length,
        )


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


def _read_now(checks: list[DeferredCheck], truncated: torch.Tensor | None) -> list[int] | None:
    """One read of every deferred check and the truncation counts (layouts without the packer's read); nothing
    at all when there is nothing to read. Free when the batch is on the host."""
    return read_once(checks=checks, extra=truncated)[1]


@dataclass
class _Captured:
    """What every layout starts from: the micro-batch where it arrived, its keep mask after truncation, the
    family's positions and the checks still to read."""

    inputs: _Inputs
    keep: torch.Tensor  # (B, T) bool, real tokens after truncation
    positions: torch.Tensor | None  # (3, B, T) or (B, T); None: the model computes its own
    truncated: torch.Tensor | None  # (B,) real tokens cut, None when nothing can be cut
    mask_checks: list[DeferredCheck]
    truncation_checks: list[DeferredCheck]
    position_checks: list[DeferredCheck]

    @property
    def batch_size(self) -> int:
        return self.inputs.tokens.shape[0]


@dataclass
class _Built:
    """What a layout hands back."""

    forward_args: dict
    extras: dict
    attention_work: torch.Tensor  # 0-dim, sum of s_i^2 the attention computes


def _capture(inputs: _Inputs, plan: StepPlan) -> _Captured:
    """Keep mask (before any pad/truncate helper could drop a 2D mask), truncation, the family's positions."""
    keep, mask_checks = capture_keep_mask(inputs, plan)
    keep, truncated, truncation_checks = truncate_to_seq_length(keep, inputs.tokens, plan.seq_length,
                                                                plan.tokens.uncuttable)
    # A batch on the host bound for a model elsewhere (Megatron-Bridge's loader and a GPU): host code builds the
    # positions where the data is; the finished row is copied once (_to_device).
    on_host = inputs.tokens.device.type == "cpu" and plan.device.type != "cpu"
    positions, position_checks = plan.adapter.position_ids(inputs.tokens, keep, inputs.multi_modal, plan.tokens,
                                                           on_host=on_host)
    position_checks = position_checks + plan.adapter.data_checks(plan.layout, keep)
    return _Captured(inputs, keep, positions, truncated, mask_checks, truncation_checks, position_checks)


def _padded_width(c: _Captured, plan: StepPlan) -> int:
    return bshd_width(c.inputs.tokens.shape[1], seq_length=plan.seq_length, tp=plan.tp, cp=plan.cp, pp=plan.pp,
                      ep=plan.ep)


def _build_padded(c: _Captured, plan: StepPlan) -> _Built:
    """``bshd``: the padded batch as Megatron-Bridge's own step lays it out, samples re-laid right-padded
    (causal-safe) in ``(B, W)``; one read of the checks."""
    width, inputs, keep = _padded_width(c, plan), c.inputs, c.keep
    if plan.fixed_p2p_shapes and c.batch_size != (plan.micro_batch_size or c.batch_size):
        raise ValueError(
            f"batch: {c.batch_size} samples for train.micro_batch_size={plan.micro_batch_size}, the batch size of the "
            "pipeline's fixed buffers (bshd needs exactly that many); set train.micro_batch_size to the data "
            "loader's batch size, or set model.variable_seq_lengths=True")
    _log_truncation(_read_now(c.mask_checks + c.truncation_checks + c.position_checks, c.truncated), plan.seq_length)
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


def _row_slots(keep: torch.Tensor, align: int) -> int:
    """The aligned slots a micro-batch's real tokens take (at least one aligned padding segment): free on the host,
    one read on a device."""
    return max(int(round_up(keep.sum(dim=1), align).sum()), align)


def _static_row_of(c: _Captured, plan: StepPlan):
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


def _build_packed(c: _Captured, plan: StepPlan) -> _Built:
    """``thd`` / ``thd_static``: one THD row; one read (``thd``) or none (``thd_static`` within ``seq_length``:
    the checks become device asserts)."""
    inputs, checks = c.inputs, c.mask_checks + c.truncation_checks + c.position_checks
    row = None
    if plan.layout == "thd_static":
        row = _static_row_of(c, plan)
        if c.truncated is not None:  # a truncating static batch: one read for the report
            _log_truncation(_read_now(c.truncation_checks, c.truncated), plan.seq_length)
            checks = c.mask_checks + c.position_checks  # the truncation check was just read
    packed = pack_bshd_to_thd(
        inputs.tokens, keep=c.keep, labels=inputs.labels, loss_mask=inputs.loss_mask, position_ids=c.positions,
        align_to=plan.align, total_length=None if row is None else row.length,
        segments=None if row is None else row.segments, max_seqlen=None if row is None else row.max_seqlen,
        # A micro-batch of padding only still reaches the model as one aligned padding segment.
        min_length=plan.align, checks=checks, host_values=c.truncated if row is None else None,
    )
    _log_truncation(packed.host_values, plan.seq_length)
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


def _report_overlong(measures: torch.Tensor | None, c: _Captured, plan: StepPlan) -> None:
    """Log what the collate (and the step) cut from over-long samples, from the lengths the collate measured before
    its cut (``overlong.LENGTHS_KEY``, ``(3, B)``). Host tensors only: a batch on a device is not read for a log."""
    if measures is None or measures.device.type != "cpu" or c.keep.device.type != "cpu":
        return
    kept_supervised = ((c.inputs.loss_mask != 0) & c.keep).sum(dim=1)
    log_cut(cut_report(measures, c.keep.sum(dim=1), kept_supervised), policy=plan.overlong_samples,
            seq_length=plan.seq_length)


def _to_device(forward_args: dict, device: torch.device) -> dict:
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
            value = replace(value, **{field: move(getattr(value, field)) for field in
                                      ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")})
        moved[name] = move(value)
    return moved


def prepare_with_plan(batch: dict, plan: StepPlan, *, is_last_stage: bool = True) -> PreparedMicroBatch:
    """Everything between the data iterator and ``model(**forward_args)``, by the run's plan.

    Host synchronisations: none when the batch arrives on the host (Megatron-Bridge's loader): the row is
    built there and copied. A batch already on the model's device: one in ``thd`` (the packer's read carries
    the row length, every validity flag and the truncation counts), one in ``bshd`` (the flags), none in
    ``thd_static`` within ``seq_length`` with one row (device asserts), one in a truncating ``thd_static`` and one
    to choose among several rows (global-batch packing's ``row_buckets``).
    """
    inputs = _read_batch(batch, is_last_stage)
    captured = _capture(inputs, plan)
    _report_overlong(batch.get(LENGTHS_KEY), captured, plan)
    built = _BUILDERS[plan.layout](captured, plan)
    forward_args = built.forward_args
    forward_args.update(inputs.multi_modal)
    forward_args.update({name: built.extras[name] for name in plan.extras if name in built.extras})
    forward_args = _to_device(forward_args, plan.device)
    batch_size = captured.batch_size
    width = _padded_width(captured, plan)
    stats = PackingStats(
        layout=plan.layout,
        real_tokens=captured.keep.sum(),
        processed_tokens=forward_args["input_ids"].numel(),
        padded_tokens=batch_size * width,
        attention_work=built.attention_work,
        padded_attention_work=batch_size * width**2,
        truncated_tokens=(captured.keep.new_zeros((), dtype=torch.int64) if captured.truncated is None
                          else captured.truncated.sum()),
        signature=decoder_signature(forward_args),
    )
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
    per run, :func:`plan_for`).

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
    _read_batch(batch, is_last_stage)  # a malformed batch is named before anything else
    plan = plan if plan is not None else build_step_plan(state, model, pg_collection, adapter)
    return prepare_with_plan(batch, plan, is_last_stage=is_last_stage)


def plan_for(state, model, pg_collection, adapter: ModelAdapter) -> StepPlan:
    """The run's plan, built at its first micro-batch and kept on ``state`` (one per model family)."""
    plan = getattr(state, PLAN_ATTRIBUTE, None)
    if plan is None or plan.adapter is not adapter:
        plan = build_step_plan(state, model, pg_collection, adapter)
        setattr(state, PLAN_ATTRIBUTE, plan)
    return plan


def _view_received_row_as_thd(decoder) -> None:
    """On a receiving stage, view the ``(S, micro_batch_size, H)`` buffer Megatron-Core filled
    (``TransformerBlock.set_input_tensor``) as the ``(S * micro_batch_size, 1, H)`` THD row it holds.
    The view keeps the buffer as the autograd leaf the schedule reads ``.grad`` from."""
    received = getattr(decoder, "input_tensor", None)
    if received is not None and received.dim() == 3 and received.shape[1] != 1:
        decoder.input_tensor = received.reshape(-1, 1, received.shape[-1])


@functools.lru_cache(maxsize=1)
def _flop_feed():
    """``(flop_utils, whether accumulate_flops_metadata takes cu_seqlens_unpadded)``, or None when
    the installation has no FLOPs helpers; decided once, not per micro-batch."""
    try:
        flop_utils = load_flop_utils()
    except ImportError as exc:  # an installation without the FLOPs helpers: nothing to feed
        logger.warning("bridge_thd: Megatron-Bridge's flop_utils cannot be loaded (%s); FLOPs not reported", exc)
        return None
    return flop_utils, "cu_seqlens_unpadded" in inspect.signature(flop_utils.accumulate_flops_metadata).parameters


def _vision_flops_feed(flop_utils, forward_args: dict, spatial_merge_size: int) -> dict:
    """The vision term, as the installed Megatron-Bridge's own step feeds it (``upstream_line.flops_vision_patch_stats``):
    ``vision_patch_stats`` (patch sum, squared sum per frame, merged tokens, summed over the image and video grids by
    its ``vision_patch_stats_from_grid_thw``; zeros without media, so that every data-parallel rank enters the
    trainer's reduction), or ``num_vision_patches`` (``sum(t * h * w)``, None without media) where it takes no stats."""
    grids = [grid for grid in (forward_args.get("image_grid_thw"), forward_args.get("video_grid_thw"))
             if grid is not None and grid.numel() > 0]
    if upstream_line().flops_vision_patch_stats:
        stats = (0, 0, 0)
        for grid in grids:
            delta = flop_utils.vision_patch_stats_from_grid_thw(grid, spatial_merge_size=spatial_merge_size)
            stats = tuple(total + part for total, part in zip(stats, delta, strict=True))
        return dict(vision_patch_stats=stats)
    patches = None
    for grid in grids:
        count = grid.prod(dim=-1).sum()
        patches = count if patches is None else patches + count
    return dict(num_vision_patches=patches)


def accumulate_flops(state, model, forward_args: dict, spatial_merge_size: int = 2) -> None:
    """Feed Megatron-Bridge's FLOPs accounting as its own step does, with the real boundaries.

    ``training/utils/flop_utils.accumulate_flops_metadata`` adds, per micro-batch, the token
    slots the model processes (``tokens.shape[0] * tokens.shape[1]``: the THD row, or the padded
    ``B * W``) for the linear terms, the attention term ``sum(s_i^2)`` over the real segment
    lengths (it prefers ``cu_seqlens_unpadded``), and the vision term (:func:`_vision_flops_feed`).
    The trainer resets and reads these ``state._flops_*`` accumulators every step. Everything
    stays on the device: no host synchronisation.
    """
    feed = _flop_feed()
    if feed is None:
        return
    flop_utils, takes_unpadded = feed
    params = forward_args.get("packed_seq_params")
    kwargs = dict(vp_stage=flop_utils.get_model_chunk_vp_stage(model),
                  **_vision_flops_feed(flop_utils, forward_args, spatial_merge_size))
    if params is not None:
        kwargs["cu_seqlens"] = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if takes_unpadded:
            kwargs["cu_seqlens_unpadded"] = params.cu_seqlens_q
    flop_utils.accumulate_flops_metadata(state, forward_args["input_ids"], **kwargs)


def _timer(state, name: str):
    timers = getattr(state, "timers", None)
    if timers is None:
        return contextlib.nullcontext()
    timer = timers(name, log_level=2)

    @contextlib.contextmanager
    def running():
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    return running()


def _straggler_timer(state, **kwargs):
    """Megatron-Bridge's ``state.straggler_timer`` (called with ``bdata=True`` for the data phase),
    or nothing outside its trainer."""
    timer = getattr(state, "straggler_timer", None)
    if timer is None:
        return contextlib.nullcontext()
    return timer(**kwargs) if kwargs else timer


def make_forward_step(adapter: ModelAdapter):
    """The Megatron-Bridge ``forward_step`` for one model family (:mod:`megatron.bridge_thd.adapters`).

    The returned function has Megatron-Bridge's step signature ``(state, data_iterator, model,
    return_schedule_plan=False)`` (the trainer inspects it to pass ``state``)."""

    def forward_step(state, data_iterator: Iterable, model, return_schedule_plan: bool = False):
        return _forward_step(state, data_iterator, model, return_schedule_plan, adapter)

    forward_step.__doc__ = _forward_step.__doc__
    forward_step.__qualname__ = forward_step.__name__ = "forward_step"
    forward_step.adapter = adapter
    return forward_step


def _forward_step(
    state,
    data_iterator: Iterable,
    model,
    return_schedule_plan: bool,
    adapter: ModelAdapter,
) -> tuple[torch.Tensor, partial]:
    """Megatron-Bridge forward step with real THD packing.

    Args:
        state: Megatron-Bridge ``GlobalState``.
        data_iterator: yields Megatron-Bridge VLM batch dicts.
        model: the model chunk (for Qwen3-VL: Megatron-Bridge's ``Qwen3VLModel`` or any module with
            its ``forward`` signature, e.g. :class:`~megatron.bridge_thd_cpu.reference.ReferenceQwen3VL`).
        return_schedule_plan: MoE overlap scheduling; BSHD layout only.

    Returns:
        ``(output_tensor, loss_function)``; ``loss_function`` is Megatron-Bridge's
        ``create_masked_next_token_loss_function`` over the packed loss mask. The micro-batch's
        :class:`PackingStats` is appended to ``state.bridge_thd_stats`` when that list exists.
    """
    if isinstance(model, list):
        raise ValueError("model: forward_step takes one model chunk, as Megatron's schedules pass it, not a list")
    pg_utils = load_bridge_module("training.utils.pg_utils")
    losses = load_bridge_module("training.losses")
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage

    pg_collection = pg_utils.get_pg_collection(model)
    is_last_stage = is_pp_last_stage(pg_collection.pp)
    # As Megatron-Bridge's step: "batch-generator" and the straggler timer's data phase cover
    # fetching the batch and its (non-blocking) device copies, here with the packing that
    # follows them.
    plan = plan_for(state, model, pg_collection, adapter)
    with _timer(state, "batch-generator"), _straggler_timer(state, bdata=True):
        batch = next(data_iterator)
        prepared = prepare_with_plan(batch, plan, is_last_stage=is_last_stage)
    accumulate_flops(state, model, prepared.forward_args, plan.tokens.spatial_merge_size)
    stats_log = getattr(state, "bridge_thd_stats", None)
    if isinstance(stats_log, list):
        stats_log.append(prepared.stats)

    check_nan, check_spiky = plan.check_nan, plan.check_spiky
    loss_mask = prepared.loss_mask
    args = prepared.forward_args
    if plan.padding_mask_cut_for_cp:
        args["padding_mask"] = cut_for_context_parallel(args["padding_mask"], args["input_ids"],
                                                        args["packed_seq_params"], pg_collection.cp)
    if return_schedule_plan:
        if args["packed_seq_params"] is not None:
            raise ValueError(
                "return_schedule_plan: MoE overlap schedule plans take the padded layout; set "
                "dataset.packing_layout='bshd' with overlap_moe_expert_parallel_comm"
            )
        core_model = unwrap_model(model)
        if not hasattr(core_model, "build_schedule_plan"):
            raise ValueError(
                f"return_schedule_plan: {type(core_model).__name__} has no build_schedule_plan (Megatron-Core's "
                "GPTModel has one; Megatron-Bridge's Qwen3VLModel does not), so MoE overlap schedule plans "
                "cannot be built for it; turn off overlap_moe_expert_parallel_comm"
            )
        plan = core_model.build_schedule_plan(
            args["input_ids"], args["position_ids"], None, labels=args["labels"], loss_mask=loss_mask
        )
        return plan, losses.create_masked_next_token_loss_function(loss_mask, check_nan, check_spiky)

    if prepared.p2p_micro_batch_size is not None:
        _view_received_row_as_thd(adapter.p2p_decoder(unwrap_model(model)))
    with _straggler_timer(state):
        output = model(**args)
    if isinstance(output, tuple):
        # Under CP Megatron-Bridge's Qwen3VLModel shards the row itself and, because it was given
        # loss_mask, returns the matching CP-local mask (models/qwen_vl/modelling_qwen3_vl/model.py),
        # on every pipeline stage.
        output, loss_mask = output
    if prepared.p2p_micro_batch_size is not None and not is_last_stage:
        # The (CP-local) row goes to the next stage in the shape its receive buffer has.
        output = output.reshape(-1, prepared.p2p_micro_batch_size, output.shape[-1])
    # Earlier pipeline stages return hidden states (s, b, h); the last returns per-token values.
    if is_last_stage and output.dim() >= 2 and tuple(output.shape[:2]) != tuple(loss_mask.shape):
        raise ValueError(
            f"model: returned an output of shape {tuple(output.shape)} for a loss mask of shape "
            f"{tuple(loss_mask.shape)}; a model that shards the sequence for context parallelism must return "
            "(output, local_loss_mask) when it is given loss_mask, as Megatron-Bridge's Qwen3VLModel does"
        )
    return output, losses.create_masked_next_token_loss_function(loss_mask, check_nan, check_spiky)


# Qwen3-VL / Qwen3.5-VL: the drop-in name (megatron.bridge_thd.qwen3_vl_step.forward_step).
forward_step = make_forward_step(QWEN3_VL)
