"""The packed forward step for Megatron-Bridge VLMs, family-agnostic (docs/megatron-bridge-step.md).

Data flow, one module per stage: batch (:mod:`~megatron.bridge_thd.step.batch`) -> keep mask (captured before any
pad/truncate helper), truncation check and the family's position ids (:mod:`~megatron.bridge_thd.step.capture`,
:mod:`megatron.bridge_thd.adapters`) -> the layout's row, a packed THD row or the padded batch
(:mod:`~megatron.bridge_thd.step.rows`) -> copy to the model's device (:mod:`~megatron.bridge_thd.step.device`),
with the micro-batch's stats (:mod:`~megatron.bridge_thd.step.stats`); :mod:`~megatron.bridge_thd.step.prepare`
runs these -> model -> Megatron-Bridge's masked loss (:mod:`~megatron.bridge_thd.step.forward`, with the FLOPs
feed :mod:`~megatron.bridge_thd.step.flops`, the trainer's timers :mod:`~megatron.bridge_thd.step.timers`, the
pipeline's received rows :mod:`~megatron.bridge_thd.step.pipeline` and the MoE overlap schedule plan
:mod:`~megatron.bridge_thd.step.schedule_plan`). Everything that can be decided once is in the run's
:class:`~megatron.bridge_thd.step.plan.StepPlan`; the step only reads it.

Where the work runs: on the device the batch arrives on. Megatron-Bridge's loader hands the step host tensors,
so the whole preparation runs on the host, where every read is free, and the finished row is copied to the
model's device from pinned memory without blocking: no host synchronisation, and only the copies are device
ops. A batch that is already on the model's device (VERL, custom iterators) is prepared there with one host
read (``thd``) or none (``thd_static``). :func:`make_forward_step` binds a family;
``megatron.bridge_thd.qwen3_vl_step.forward_step`` is the Qwen3-VL / Qwen3.5-VL drop-in.
"""

from megatron.bridge_thd.layouts import LAYOUT_NAMES
from megatron.bridge_thd.step.capture import capture_keep_mask, truncate_to_seq_length
from megatron.bridge_thd.step.flops import accumulate_flops
from megatron.bridge_thd.step.forward import forward_step, make_forward_step
from megatron.bridge_thd.step.prepare import (
    PLAN_ATTRIBUTE,
    PreparedMicroBatch,
    plan_for,
    prepare_micro_batch,
    prepare_with_plan,
)
from megatron.bridge_thd.step.rows import relay_right_padded
from megatron.bridge_thd.step.stats import PackingStats, decoder_signature

__all__ = ["make_forward_step", "forward_step", "PackingStats", "LAYOUT_NAMES", "prepare_micro_batch", "PreparedMicroBatch",
           "prepare_with_plan", "plan_for", "decoder_signature", "truncate_to_seq_length", "capture_keep_mask",
           "relay_right_padded", "accumulate_flops", "PLAN_ATTRIBUTE"]
