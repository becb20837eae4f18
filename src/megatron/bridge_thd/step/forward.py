"""The forward step itself: Megatron-Bridge's ``forward_step(state, data_iterator, model, return_schedule_plan)``
for one model family (:func:`make_forward_step`). One micro-batch: the run's plan, the prepared row
(:mod:`~megatron.bridge_thd.step.prepare`), the FLOPs feed and stats, then the model and Megatron-Bridge's
masked loss."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Iterable

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.context_parallel import cut_for_context_parallel
from megatron.bridge_thd.cp_per_sample import RowCP, bind_row_to_params, bound_cp_group, row_cp_of
from megatron.bridge_thd.packing_log import TOTALS_ATTRIBUTE
from megatron.bridge_thd.step.flops import accumulate_flops, accumulate_no_flops
from megatron.bridge_thd.step.pipeline import shape_for_next_stage, view_received_row_as_thd
from megatron.bridge_thd.step.prepare import PreparedMicroBatch, plan_for, prepare_with_plan
from megatron.bridge_thd.step.schedule_plan import build_schedule_plan
from megatron.bridge_thd.step.timers import straggler_timer, timer
from megatron.bridge_thd.step.plan import StepPlan, unwrap_model
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = ["make_forward_step", "forward_step"]


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
    plan = plan_for(state, model, pg_collection, adapter)
    prepared, row = _next_micro_batch(state, data_iterator, plan, is_last_stage)
    _account(state, model, prepared, plan, row)

    loss_mask = prepared.loss_mask
    args = prepared.forward_args
    if plan.padding_mask_cut_for_cp:
        args["padding_mask"] = cut_for_context_parallel(args["padding_mask"], args["input_ids"],
                                                        args["packed_seq_params"], pg_collection.cp)
    if return_schedule_plan:
        schedule_plan = build_schedule_plan(model, args, loss_mask)
        return schedule_plan, losses.create_masked_next_token_loss_function(loss_mask, plan.check_nan,
                                                                            plan.check_spiky)
    with bound_cp_group(plan.cp_per_sample.holders, row.group) if row is not None else contextlib.nullcontext():
        output, loss_mask = _run_model(state, model, prepared, adapter, is_last_stage)
    return output, losses.create_masked_next_token_loss_function(loss_mask, plan.check_nan, plan.check_spiky)


def _next_micro_batch(state, data_iterator: Iterable, plan: StepPlan,
                      is_last_stage: bool) -> tuple[PreparedMicroBatch, RowCP | None]:
    """The next batch, prepared, and under a CP size per row (``plan.cp_per_sample``) the row's CP size and group,
    read from the batch (:mod:`megatron.bridge_thd.cp_per_sample`): the row is packed with that size's alignment and
    its ``PackedSeqParams`` name the group. As Megatron-Bridge's step: "batch-generator" and the straggler timer's
    data phase cover fetching the batch and its (non-blocking) device copies, here with the packing that follows."""
    with timer(state, "batch-generator"), straggler_timer(state, bdata=True):
        batch = next(data_iterator)
        if plan.cp_per_sample is None:
            return prepare_with_plan(batch, plan, is_last_stage=is_last_stage), None
        row = row_cp_of(batch, plan.cp_per_sample)
        prepared = prepare_with_plan(batch, plan.for_row_cp(row.size), is_last_stage=is_last_stage)
        bind_row_to_params(prepared.forward_args.get("packed_seq_params"), row)
        return prepared, row


def _account(state, model, prepared: PreparedMicroBatch, plan: StepPlan, row: RowCP | None) -> None:
    """The FLOPs feed (under a CP size per row by the row group's first rank only: the trainer sums the feed over
    every DP x CP rank), the micro-batch's stats on ``state.bridge_thd_stats`` where that list exists, and a training
    micro-batch's figures added to the packing log's sums where the run has them (``packing_log.PackingTotals``)."""
    if row is None or row.leads:
        accumulate_flops(state, model, prepared.forward_args, plan.tokens.spatial_merge_size)
    else:
        accumulate_no_flops(state, model, prepared.forward_args)
    stats_log = getattr(state, "bridge_thd_stats", None)
    if isinstance(stats_log, list):
        stats_log.append(prepared.stats)
    totals = getattr(state, TOTALS_ATTRIBUTE, None)
    if totals is not None and getattr(model, "training", True) and (row is None or row.leads):
        # The packing/* figures (packing_log): device sums on the device, host ints on the host; no read back.
        totals.add(prepared.stats, prepared.loss_mask, prepared.forward_args, None if row is None else row.size)


def _run_model(state, model, prepared: PreparedMicroBatch, adapter: ModelAdapter,
               is_last_stage: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``model(**args)``: its output and the loss mask that goes with it (CP-local where the model shards)."""
    loss_mask = prepared.loss_mask
    if prepared.p2p_micro_batch_size is not None:
        view_received_row_as_thd(adapter.p2p_decoder(unwrap_model(model)))
    with straggler_timer(state):
        output = model(**prepared.forward_args)
    if isinstance(output, tuple):
        # Under CP Megatron-Bridge's Qwen3VLModel shards the row itself and, because it was given
        # loss_mask, returns the matching CP-local mask (models/qwen_vl/modelling_qwen3_vl/model.py),
        # on every pipeline stage.
        output, loss_mask = output
    if prepared.p2p_micro_batch_size is not None and not is_last_stage:
        output = shape_for_next_stage(output, prepared.p2p_micro_batch_size)
    # Earlier pipeline stages return hidden states (s, b, h); the last returns per-token values.
    if is_last_stage and output.dim() >= 2 and tuple(output.shape[:2]) != tuple(loss_mask.shape):
        raise ValueError(
            f"model: returned an output of shape {tuple(output.shape)} for a loss mask of shape "
            f"{tuple(loss_mask.shape)}; a model that shards the sequence for context parallelism must return "
            "(output, local_loss_mask) when it is given loss_mask, as Megatron-Bridge's Qwen3VLModel does"
        )
    return output, loss_mask


# Qwen3-VL / Qwen3.5-VL: the drop-in name (megatron.bridge_thd.qwen3_vl_step.forward_step).
forward_step = make_forward_step(QWEN3_VL)
