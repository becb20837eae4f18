"""The packed forward step for Megatron-Bridge VLMs, family-agnostic (docs/megatron-bridge-step.md).

Four modules, along the data's way; import each name from the module that defines it:

* :mod:`~megatron.bridge_thd.step.plan`: everything decided once per run, :class:`~.plan.StepPlan`
  (:func:`~.plan.build_step_plan`, the static rows :class:`~.plan.StaticRow` / :class:`~.plan.GlobalBatchRows`);
* :mod:`~megatron.bridge_thd.step.prepare`: one micro-batch prepared by the plan, batch -> keep mask, cut and
  positions -> the layout's row -> the model's device -> its stats (:func:`~.prepare.prepare_with_plan`,
  :func:`~.prepare.prepare_micro_batch`, :class:`~.prepare.PackingStats`);
* :mod:`~megatron.bridge_thd.step.forward`: Megatron-Bridge's ``forward_step`` for a model family
  (:func:`~.forward.make_forward_step`): the plan kept on the trainer's state, the trainer's timers, the model
  (pipeline stages' static rows), Megatron-Bridge's masked loss, the MoE overlap schedule plan;
* :mod:`~megatron.bridge_thd.step.flops`: Megatron-Bridge's FLOPs accounting fed with the row's real boundaries.

Where the work runs: on the device the batch arrives on. Megatron-Bridge's loader hands the step host tensors,
so the whole preparation runs on the host, where every read is free, and the finished row is copied to the
model's device from pinned memory without blocking: no host synchronisation, and only the copies are device
ops. A batch that is already on the model's device (VERL, custom iterators) is prepared there with one host
read (``thd``) or none (``thd_static``). ``megatron.bridge_thd.qwen3_vl_step.forward_step`` is the Qwen3-VL /
Qwen3.5-VL drop-in, ``megatron.bridge_thd.qwen25_vl_step.forward_step`` the Qwen2.5-VL one.
"""
