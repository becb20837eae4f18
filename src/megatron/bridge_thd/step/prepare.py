"""Everything between the data iterator and ``model(**forward_args)``, one way: batch
(:mod:`~megatron.bridge_thd.step.batch`) -> keep mask, truncation and positions
(:mod:`~megatron.bridge_thd.step.capture`) -> the layout's row (:mod:`~megatron.bridge_thd.step.rows`) -> the
model's device (:mod:`~megatron.bridge_thd.step.device`), with the micro-batch's stats
(:mod:`~megatron.bridge_thd.step.stats`). The run's plan is built once and kept on Megatron-Bridge's state
(:func:`plan_for`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.overlong import LENGTHS_KEY
from megatron.bridge_thd.step.batch import read_batch
from megatron.bridge_thd.step.capture import capture, overlong_sample_counts, report_overlong
from megatron.bridge_thd.step.device import to_device
from megatron.bridge_thd.step.rows import BUILDERS
from megatron.bridge_thd.step.stats import PackingStats, packing_stats
from megatron.bridge_thd.step.plan import StepPlan, build_step_plan

__all__ = ["PreparedMicroBatch", "prepare_with_plan", "prepare_micro_batch", "plan_for", "PLAN_ATTRIBUTE"]

# Where the forward step keeps its plan: an attribute of Megatron-Bridge's GlobalState, built at the first
# micro-batch of the run.
PLAN_ATTRIBUTE = "bridge_thd_plan"


@dataclass
class PreparedMicroBatch:
    """What the step hands the model and the loss, built by :func:`prepare_micro_batch`."""

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
    captured = capture(inputs, plan)
    report_overlong(batch.get(LENGTHS_KEY), captured, plan)
    built = BUILDERS[plan.layout](captured, plan)
    forward_args = built.forward_args
    forward_args.update(inputs.multi_modal)
    forward_args.update({name: built.extras[name] for name in plan.extras if name in built.extras})
    forward_args = to_device(forward_args, plan.device)
    stats = packing_stats(captured, built, forward_args, plan, overlong_sample_counts(batch.get(LENGTHS_KEY), plan))
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
    read_batch(batch, is_last_stage)  # a malformed batch is named before anything else
    plan = plan if plan is not None else build_step_plan(state, model, pg_collection, adapter)
    return prepare_with_plan(batch, plan, is_last_stage=is_last_stage)


def plan_for(state, model, pg_collection, adapter: ModelAdapter) -> StepPlan:
    """The run's plan, built at its first micro-batch and kept on ``state`` (one per model family)."""
    plan = getattr(state, PLAN_ATTRIBUTE, None)
    if plan is None or plan.adapter is not adapter:
        plan = build_step_plan(state, model, pg_collection, adapter)
        setattr(state, PLAN_ATTRIBUTE, plan)
    return plan
