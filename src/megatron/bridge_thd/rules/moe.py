"""Rules on MoE token dispatch, communication overlap and routing, and the MoE padding hook's own (docs/rules.md,
docs/moe-routing.md, docs/moe-padding-mask.md)."""

from __future__ import annotations

from megatron.bridge_thd.layouts import THD_LAYOUTS
from megatron.bridge_thd.rules.registry import CONFIGURE, HOOK, STEP, rule
from megatron.bridge_thd.rules.setup import ModelFacts, Setup

__all__ = ["layout_dependent_moe_settings"]


@rule(CONFIGURE, STEP)
def _moe_allgather(s: Setup) -> list[str]:
    """``"thd"`` with MoE's allgather dispatcher over EP>1, which needs equal-sized token blocks per rank; or under
    PP>1, where the row's length travels with ``variable_seq_lengths``, which the dispatcher refuses."""
    moe_allgather = bool(s.model.experts) and s.model.dispatcher == "allgather"
    variable_lengths = s.pp > 1 and (s.layout == "thd" or s.bridge_packing_flag)
    if moe_allgather and variable_lengths and not (s.layout == "thd" and s.ep > 1):
        return [
            f"layout: {s.layout!r} with MoE moe_token_dispatcher_type='allgather' and pipeline_model_parallel_size="
            f"{s.pp}: the stages exchange the row's changing length (variable_seq_lengths=True, set for in-batch "
            "packing under PP), which Megatron-Core's config check refuses for the allgather dispatcher once "
            "Megatron-Bridge's setup finalizes the model config again; set moe_token_dispatcher_type='alltoall' / "
            "'flex'" + (", or use layout='thd_static' with train.micro_batch_size=1" if s.layout == "thd" else
                        ", or train.micro_batch_size=1 (no in-batch flag, fixed shapes)")
        ]
    if not (moe_allgather and s.ep > 1 and s.layout == "thd"):
        return []
    return [
        f"layout: 'thd' with MoE moe_token_dispatcher_type='allgather' and expert_model_parallel_size={s.ep}: the "
        "allgather dispatcher gathers equal-sized token blocks across the expert-parallel ranks, which hold "
        "different micro-batches whose 'thd' rows differ in length; use layout='thd_static' or 'bshd', or "
        "moe_token_dispatcher_type='alltoall' / 'flex'"
    ]


@rule(CONFIGURE, STEP)
def _moe_overlap(s: Setup) -> list[str]:
    """MoE EP communication overlap: the step builds schedule plans only for ``"bshd"``, and only
    through the model's ``build_schedule_plan``."""
    # Megatron-Core's pipeline_parallel/combined_1f1b.py calls forward_step(..., return_schedule_plan=True)
    # when overlap_moe_expert_parallel_comm is on; the step builds a plan only from the padded layout's row, with
    # model.build_schedule_plan.
    if s.moe_overlap is None:
        return []
    if s.layout in THD_LAYOUTS:
        return [
            f"{s.moe_overlap}=True with layout={s.layout!r}: Megatron-Core's combined 1F1B schedule "
            "(pipeline_parallel/combined_1f1b.py) then asks the forward step for a schedule plan "
            "(return_schedule_plan=True), and megatron.bridge_thd's step builds one only for the padded layout; set "
            f"{s.moe_overlap}=False, or use layout='bshd' with a model that has build_schedule_plan (Megatron-Bridge's "
            "Qwen3VLModel has none)"
        ]
    if s.built_model_plans is False:
        # Megatron-Bridge's Qwen3VLModel (models/qwen_vl/modelling_qwen3_vl/model.py) has no
        # build_schedule_plan; its own step (models/qwen_vl/qwen3_vl_step.py) and ours call it for the plan.
        return [
            f"{s.moe_overlap}=True with layout={s.layout!r}: Megatron-Core's combined 1F1B schedule asks the "
            "forward step for a schedule plan (return_schedule_plan=True), which the step builds with "
            f"model.build_schedule_plan, and the model this run builds ({s.built_model}"
            f"{f', declared by {s.provider}.provide' if s.provider and not s.built else ''}) has none, so the first "
            "step fails; set "
            f"{s.moe_overlap}=False"
        ]
    return []


def layout_dependent_moe_settings(model: ModelFacts) -> list[tuple[str, str]]:
    """The MoE settings whose result depends on the layout unless the routers see real tokens only, as
    ``(setting, why)``; empty for a dense model.

    Megatron-Core's token dropping (``moe_expert_capacity_factor``) sizes the capacity from every slot and lets
    padding compete for it, and its ``seq_aux_loss`` reshapes the router's ``(s, b)`` tokens per sequence, so a
    THD row (``b = 1``) becomes one whole-row statistic. Both are made layout-independent by
    :func:`megatron.bridge_thd.moe_padding.with_padding_mask` (docs/moe-routing.md).
    """
    if not model.experts:
        return []
    settings = []
    if model.capacity_factor is not None:
        settings.append((
            f"model.moe_expert_capacity_factor={model.capacity_factor}",
            "padding slots compete with real tokens for expert capacity and the capacity is sized from every slot "
            "(the thd_static tail is most of the row), so the tokens dropped and the loss depend on the layout",
        ))
    if model.seq_aux_loss:
        settings.append((
            "model.moe_router_load_balancing_type='seq_aux_loss'",
            "Megatron-Core computes seq_aux_loss per (s, b) sequence and a THD row is one sequence, so it becomes a "
            "whole-row statistic instead of a per-sample one",
        ))
    return settings


@rule(CONFIGURE, STEP)
def _moe_routing(s: Setup) -> list[str]:
    """Expert capacity or ``seq_aux_loss`` with a THD layout on routers that also see padding.

    Megatron-Core's token dropping lets padding take expert capacity and sizes it from every slot, and its
    ``seq_aux_loss`` is per ``(s, b)`` sequence (a THD row is one); the results then depend on the layout
    (docs/moe-routing.md). ``moe_padding.padding_mask_pre_wrap_hook`` makes both layout-independent.
    """
    if s.layout not in THD_LAYOUTS or s.routes_real_tokens_only:
        return []
    return [
        f"{setting} with layout={s.layout!r}: {why} (measured on the tiny MoE model in docs/moe-routing.md); register "
        "megatron.bridge_thd.moe_padding.hook.padding_mask_pre_wrap_hook (cfg.model.register_pre_wrap_hook) so the "
        "routers see real tokens only, or set layout='bshd'"
        for setting, why in layout_dependent_moe_settings(s.model)
    ]


# ---- the padding-mask hook's rules: settings under which the mask cannot reach every router ----
# (moe_padding.with_padding_mask runs them when it installs its routers and on every forward; configure and the step
# run them whenever the hook is registered.)


@rule(CONFIGURE, STEP, HOOK)
def _hook_full_recompute(s: Setup) -> list[str]:
    """Full recomputation re-runs the routers after the hook's forward has returned."""
    if not s.routes_real_tokens_only or s.model.recompute_granularity != "full":
        return []
    return ["model.recompute_granularity='full': the decoder re-runs its layers in the backward pass, after "
            "with_padding_mask's forward has returned, so the recomputed MoE routers would run without the padding "
            "mask. Use recompute_granularity='selective' (recompute_modules=['moe'] keeps the mask) or None, "
            "or do not use with_padding_mask."]


@rule(CONFIGURE, STEP, HOOK)
def _hook_cuda_graphs(s: Setup) -> list[str]:
    """CUDA-graphed layers replay kernels instead of running the MoE layer's Python forward."""
    if not s.routes_real_tokens_only or s.model.graph_impl == "none":
        return []
    return [f"{s.model.graph_setting}: CUDA-graphed transformer layers replay captured kernels instead of running their "
            "MoE layer's Python forward, so with_padding_mask cannot hand the padding mask to their MoE routers. Set "
            "model.cuda_graph_impl='none' or do not use with_padding_mask."]


@rule(CONFIGURE, STEP, HOOK)
def _hook_chunked_mlp(s: Setup) -> list[str]:
    """Megatron-Core's chunked MLP path calls the MoE layer without ``padding_mask``."""
    if not s.routes_real_tokens_only or s.model.mlp_chunks <= 1:
        return []
    return [f"model.mlp_chunks_for_training={s.model.mlp_chunks}: Megatron-Core's chunked MLP path calls the MoE layer "
            "without padding_mask. Set mlp_chunks_for_training=1 or do not use with_padding_mask."]


@rule(CONFIGURE, STEP, HOOK)
def _hook_position_drop_policy(s: Setup) -> list[str]:
    """Token dropping by position keeps tokens by the router's token order, which the layout decides."""
    model = s.model
    if not s.routes_real_tokens_only or model.capacity_factor is None or model.token_drop_policy == "probs":
        return []
    return [f"model.moe_token_drop_policy={model.token_drop_policy!r} with moe_expert_capacity_factor: 'position' keeps "
            "the earliest tokens of the router's token order, which is sequence-major (s, b) in the padded layout and "
            "sample-major in a THD row, so the kept tokens depend on the layout by definition. Use "
            "moe_token_drop_policy='probs' (Megatron-Core's default) or do not use with_padding_mask."]


@rule(CONFIGURE, STEP, HOOK)
def _hook_recomputed_seq_aux_loss(s: Setup) -> list[str]:
    """Recomputed routers run without the row's sample boundaries, so their ``seq_aux_loss`` is whole-row."""
    model = s.model
    if not (s.routes_real_tokens_only and model.seq_aux_loss and model.recompute_granularity == "selective"
            and "moe" in model.recompute_modules):
        return []
    return ["model.moe_router_load_balancing_type='seq_aux_loss' with recompute_modules=['moe']: the recomputed "
            "routers run in the backward pass, after with_padding_mask's forward has returned, without the sample "
            "boundaries of the THD row, so their seq_aux_loss would be a whole-row statistic. Drop 'moe' from "
            "recompute_modules, or use another load-balancing type."]


@rule(CONFIGURE, STEP, HOOK)
def _hook_quantile_balancing(s: Setup) -> list[str]:
    """Megatron-Core's quantile-balancing routing takes no padding mask (``router.py`` asserts none is given)."""
    if not s.routes_real_tokens_only or "quantile_balancing" not in s.model.load_balancing:
        return []
    return ["model.moe_router_load_balancing_type='quantile_balancing': Megatron-Core's quantile-balancing routing "
            "does not take a padding mask (TopKRouter.routing asserts none is given), so with_padding_mask cannot "
            "keep padding out of it. Use another load-balancing type, or do not use with_padding_mask."]
