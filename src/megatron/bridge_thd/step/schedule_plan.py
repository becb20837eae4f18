"""``return_schedule_plan``: Megatron-Core's MoE overlap schedule plan, built from the padded layout's row."""

from __future__ import annotations

from megatron.bridge_thd.step.plan import unwrap_model

__all__ = ["build_schedule_plan"]


def build_schedule_plan(model, args: dict, loss_mask):
    """The model's ``build_schedule_plan`` over the prepared ``bshd`` row; refused for a THD row and for a model
    without one."""
    # The plan's rule moe_overlap (megatron.bridge_thd.rules) refuses MoE overlap with a THD layout or a model without
    # build_schedule_plan before the first step; these are the function's own argument checks.
    if args["packed_seq_params"] is not None:
        raise ValueError("return_schedule_plan: the prepared row is a THD row; schedule plans take the padded layout")
    core_model = unwrap_model(model)
    if not hasattr(core_model, "build_schedule_plan"):
        raise ValueError(f"model: {type(core_model).__name__} has no build_schedule_plan")
    return core_model.build_schedule_plan(
        args["input_ids"], args["position_ids"], None, labels=args["labels"], loss_mask=loss_mask
    )
