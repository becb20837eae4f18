"""``return_schedule_plan``: Megatron-Core's MoE overlap schedule plan, built from the padded layout's row."""

from __future__ import annotations

from megatron.bridge_thd.step_plan import unwrap_model

__all__ = ["build_schedule_plan"]


def build_schedule_plan(model, args: dict, loss_mask):
    """The model's ``build_schedule_plan`` over the prepared ``bshd`` row; refused for a THD row and for a model
    without one."""
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
    return core_model.build_schedule_plan(
        args["input_ids"], args["position_ids"], None, labels=args["labels"], loss_mask=loss_mask
    )
