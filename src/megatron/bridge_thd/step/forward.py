"""The forward step itself: Megatron-Bridge's ``forward_step(state, data_iterator, model, return_schedule_plan)``
for one model family (:func:`make_forward_step`).

One micro-batch: the run's plan (built at the first micro-batch and kept on Megatron-Bridge's state), the next batch
prepared (:mod:`~megatron.bridge_thd.step.prepare`) inside the trainer's data timers, the FLOPs feed
(:mod:`~megatron.bridge_thd.step.flops`) and the stats, then the model (a static row between pipeline stages viewed
and shaped as Megatron-Core's p2p buffers hold it) and Megatron-Bridge's masked loss; or, for MoE overlap,
Megatron-Core's schedule plan of the padded row.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.context_parallel import cut_for_context_parallel
from megatron.bridge_thd.cp_per_sample import RowCP, bind_row_to_params, bound_cp_group, row_cp_of
from megatron.bridge_thd.packing_log import TOTALS_ATTRIBUTE
from megatron.bridge_thd.step.flops import accumulate_flops, accumulate_no_flops
from megatron.bridge_thd.step.plan import StepPlan, build_step_plan, unwrap_model
from megatron.bridge_thd.step.prepare import PreparedMicroBatch, prepare_with_plan
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = ["make_forward_step", "forward_step", "PLAN_ATTRIBUTE"]

# Where the forward step keeps its plan: an attribute of Megatron-Bridge's GlobalState, built at the first
# micro-batch of the run.
PLAN_ATTRIBUTE = "bridge_thd_plan"
# What the step reads of Megatron-Bridge's GlobalState besides cfg, in _StateParts' order: its plan, the trainer's
# timers, the list the micro-batches' stats go to and the packing log's sums (packing_log.PackingTotals).
_STATE_PARTS = (PLAN_ATTRIBUTE, "timers", "straggler_timer", "bridge_thd_stats", TOTALS_ATTRIBUTE)


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


@functools.lru_cache(maxsize=1)
def _trainer_modules():
    """Megatron-Bridge's process-group helpers and losses and Megatron-Core's pipeline helpers, loaded at the first
    micro-batch; their functions are looked up at each call (a test may replace them)."""
    import megatron.core.pipeline_parallel.utils as pipeline_utils  # megatron.core: loaded with the first step

    return load_bridge_module("training.utils.pg_utils"), load_bridge_module("training.losses"), pipeline_utils


@dataclass(frozen=True)
class _StateParts:
    """The parts of Megatron-Bridge's ``GlobalState`` the step reads besides ``cfg`` (:data:`_STATE_PARTS`), each
    None where the state has none."""

    plan: StepPlan | None
    timers: Any
    straggler_timer: Any
    stats_log: Any
    totals: Any


def _state_parts(state) -> _StateParts:
    return _StateParts(*(getattr(state, name, None) for name in _STATE_PARTS))  # optional: absent outside a trainer


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
        :class:`~megatron.bridge_thd.step.prepare.PackingStats` is appended to ``state.bridge_thd_stats`` when that
        list exists.
    """
    if isinstance(model, list):
        raise ValueError("model: forward_step takes one model chunk, as Megatron's schedules pass it, not a list")
    pg_utils, losses, pipeline_utils = _trainer_modules()
    pg_collection = pg_utils.get_pg_collection(model)
    is_last_stage = pipeline_utils.is_pp_last_stage(pg_collection.pp)
    parts = _state_parts(state)
    plan = _plan_for(state, parts.plan, model, pg_collection, adapter)
    prepared, row = _next_micro_batch(parts, data_iterator, plan, is_last_stage)
    _account(state, parts, model, prepared, plan, row)

    loss_mask = prepared.loss_mask
    args = prepared.forward_args
    if plan.padding_mask_cut_for_cp:
        args["padding_mask"] = cut_for_context_parallel(args["padding_mask"], args["input_ids"],
                                                        args["packed_seq_params"], pg_collection.cp)
    if return_schedule_plan:
        schedule_plan = _build_schedule_plan(model, args, loss_mask, plan)
        return schedule_plan, losses.create_masked_next_token_loss_function(loss_mask, plan.check_nan,
                                                                            plan.check_spiky)
    with bound_cp_group(plan.cp_per_sample.holders, row.group) if row is not None else contextlib.nullcontext():
        output, loss_mask = _run_model(parts, model, prepared, adapter, is_last_stage)
    return output, losses.create_masked_next_token_loss_function(loss_mask, plan.check_nan, plan.check_spiky)


def _plan_for(state, kept: StepPlan | None, model, pg_collection, adapter: ModelAdapter) -> StepPlan:
    """The run's plan: ``kept`` (built at the run's first micro-batch and kept on ``state``), or a new one for
    another model family."""
    if kept is None or kept.adapter is not adapter:
        kept = build_step_plan(state, model, pg_collection, adapter)
        setattr(state, PLAN_ATTRIBUTE, kept)
    return kept


def _next_micro_batch(parts: _StateParts, data_iterator: Iterable, plan: StepPlan,
                      is_last_stage: bool) -> tuple[PreparedMicroBatch, RowCP | None]:
    """The next batch, prepared, and under a CP size per row (``plan.cp_per_sample``) the row's CP size and group,
    read from the batch (:mod:`megatron.bridge_thd.cp_per_sample`): the row is packed with that size's alignment and
    its ``PackedSeqParams`` name the group. As Megatron-Bridge's step: "batch-generator" and the straggler timer's
    data phase cover fetching the batch and its (non-blocking) device copies, here with the packing that follows."""
    with _timed(parts.timers, "batch-generator"), _straggler(parts.straggler_timer, bdata=True):
        batch = next(data_iterator)
        if plan.cp_per_sample is None:
            return prepare_with_plan(batch, plan, is_last_stage=is_last_stage), None
        row = row_cp_of(batch, plan.cp_per_sample)
        prepared = prepare_with_plan(batch, plan.for_row_cp(row.size), is_last_stage=is_last_stage)
        bind_row_to_params(prepared.forward_args.get("packed_seq_params"), row)
        return prepared, row


def _account(state, parts: _StateParts, model, prepared: PreparedMicroBatch, plan: StepPlan,
             row: RowCP | None) -> None:
    """The FLOPs feed (under a CP size per row by the row group's first rank only: the trainer sums the feed over
    every DP x CP rank), the micro-batch's stats on ``state.bridge_thd_stats`` where that list exists, and a training
    micro-batch's figures added to the packing log's sums where the run has them (``packing_log.PackingTotals``)."""
    if row is None or row.leads:
        accumulate_flops(state, model, prepared.forward_args, plan.tokens.spatial_merge_size)
    else:
        accumulate_no_flops(state, model, prepared.forward_args)
    if isinstance(parts.stats_log, list):
        parts.stats_log.append(prepared.stats)
    if parts.totals is not None and model.training and (row is None or row.leads):
        # The packing/* figures (packing_log): device sums on the device, host ints on the host; no read back.
        parts.totals.add(prepared.stats, prepared.loss_mask, prepared.forward_args, None if row is None else row.size)


def _run_model(parts: _StateParts, model, prepared: PreparedMicroBatch, adapter: ModelAdapter,
               is_last_stage: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``model(**args)``: its output and the loss mask that goes with it (CP-local where the model shards)."""
    loss_mask = prepared.loss_mask
    if prepared.p2p_micro_batch_size is not None:
        _view_received_row_as_thd(adapter.p2p_decoder(unwrap_model(model)))
    with _straggler(parts.straggler_timer):
        output = model(**prepared.forward_args)
    if isinstance(output, tuple):
        # Under CP Megatron-Bridge's Qwen3VLModel shards the row itself and, because it was given
        # loss_mask, returns the matching CP-local mask (models/qwen_vl/modelling_qwen3_vl/model.py),
        # on every pipeline stage.
        output, loss_mask = output
    if prepared.p2p_micro_batch_size is not None and not is_last_stage:
        # The (CP-local) row a stage sends, in the (S, micro_batch_size, H) shape of the next stage's buffer.
        output = output.reshape(-1, prepared.p2p_micro_batch_size, output.shape[-1])
    # Earlier pipeline stages return hidden states (s, b, h); the last returns per-token values.
    if is_last_stage and output.dim() >= 2 and tuple(output.shape[:2]) != tuple(loss_mask.shape):
        raise ValueError(
            f"model: returned an output of shape {tuple(output.shape)} for a loss mask of shape "
            f"{tuple(loss_mask.shape)}; a model that shards the sequence for context parallelism must return "
            "(output, local_loss_mask) when it is given loss_mask, as Megatron-Bridge's Qwen3VLModel does"
        )
    return output, loss_mask


def _view_received_row_as_thd(decoder) -> None:
    """A static THD row between pipeline stages whose p2p buffers have Megatron-Core's fixed ``(seq_length / cp,
    micro_batch_size, H)`` shape: on a receiving stage, the buffer Megatron-Core filled
    (``TransformerBlock.set_input_tensor``) viewed as the ``(S * micro_batch_size, 1, H)`` THD row it holds. The view
    keeps the buffer as the autograd leaf the schedule reads ``.grad`` from. ``decoder``: the family's
    (``ModelAdapter.p2p_decoder``), or None."""
    received = None if decoder is None else decoder.input_tensor
    if received is not None and received.dim() == 3 and received.shape[1] != 1:
        decoder.input_tensor = received.reshape(-1, 1, received.shape[-1])


def _build_schedule_plan(model, args: dict, loss_mask: torch.Tensor, plan: StepPlan):
    """``return_schedule_plan``: Megatron-Core's MoE overlap schedule plan, the model's ``build_schedule_plan`` over
    the prepared ``bshd`` row; refused for a THD row and for a model without one."""
    # The plan's rule moe_overlap (megatron.bridge_thd.rules) refuses MoE overlap with a THD layout or a model without
    # build_schedule_plan before the first step; these are the function's own argument checks.
    if args["packed_seq_params"] is not None:
        raise ValueError("return_schedule_plan: the prepared row is a THD row; schedule plans take the padded layout")
    if not plan.builds_schedule_plan:
        raise ValueError(f"model: {plan.model_name} has no build_schedule_plan")
    return unwrap_model(model).build_schedule_plan(
        args["input_ids"], args["position_ids"], None, labels=args["labels"], loss_mask=loss_mask
    )


def _timed(timers, name: str):
    """Megatron-Bridge's ``timers(name)`` started and stopped around the block, as its own step runs them, or
    nothing outside its trainer (``timers`` None)."""
    if timers is None:
        return contextlib.nullcontext()
    started = timers(name, log_level=2)

    @contextlib.contextmanager
    def running():
        started.start()
        try:
            yield
        finally:
            started.stop()

    return running()


def _straggler(straggler_timer, **kwargs):
    """Megatron-Bridge's ``straggler_timer`` (called with ``bdata=True`` for the data phase), or nothing outside its
    trainer (None)."""
    if straggler_timer is None:
        return contextlib.nullcontext()
    return straggler_timer(**kwargs) if kwargs else straggler_timer


# Qwen3-VL / Qwen3.5-VL: the drop-in name (megatron.bridge_thd.qwen3_vl_step.forward_step).
forward_step = make_forward_step(QWEN3_VL)
