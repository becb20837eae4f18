"""The settings :func:`~megatron.bridge_thd.moe_padding.with_padding_mask` refuses, each with the setting named
and the fix: the one place its configuration refusals live (checked when the hook installs and on every
forward)."""

from __future__ import annotations

from megatron.bridge_thd.rules import uses_seq_aux_loss


def fail_if_unsupported(config) -> None:
    """Settings under which the mask cannot reach every router (docs/moe-padding-mask.md)."""
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError(
            "config.recompute_granularity='full': the decoder re-runs its layers in the backward pass, after "
            "with_padding_mask's forward has returned, so the recomputed MoE routers would run without the padding "
            "mask. Use recompute_granularity='selective' (recompute_modules=['moe'] keeps the mask) or None, "
            "or do not use with_padding_mask."
        )
    cuda_graph_impl = getattr(config, "cuda_graph_impl", "none")
    if cuda_graph_impl not in (None, "none"):
        raise ValueError(
            f"config.cuda_graph_impl={cuda_graph_impl!r}: CUDA-graphed transformer layers replay captured kernels instead "
            "of running their MoE layer's Python forward, so with_padding_mask cannot hand the padding mask to their "
            "MoE routers. Set cuda_graph_impl='none' or do "
            "not use with_padding_mask."
        )
    chunks = getattr(config, "mlp_chunks_for_training", 1) or 1
    if chunks > 1:
        raise ValueError(
            f"config.mlp_chunks_for_training={chunks}: Megatron-Core's chunked MLP path calls the MoE layer without "
            "padding_mask. Set mlp_chunks_for_training=1 or do not use with_padding_mask."
        )
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        policy = getattr(config, "moe_token_drop_policy", "probs")
        if policy != "probs":
            raise ValueError(
                f"config.moe_token_drop_policy={policy!r} with moe_expert_capacity_factor: 'position' keeps the "
                "earliest tokens of the router's token order, which is sequence-major (s, b) in the padded layout and "
                "sample-major in a THD row, so the kept tokens depend on the layout by definition. Use "
                "moe_token_drop_policy='probs' (Megatron-Core's default) or do not use with_padding_mask."
            )
    recompute_modules = getattr(config, "recompute_modules", None) or []
    if uses_seq_aux_loss(config) and getattr(config, "recompute_granularity", None) == "selective" \
            and "moe" in recompute_modules:
        raise ValueError(
            "config.moe_router_load_balancing_type='seq_aux_loss' with recompute_modules=['moe']: the recomputed "
            "routers run in the backward pass, after with_padding_mask's forward has returned, without the sample "
            "boundaries of the THD row, so their seq_aux_loss would be a whole-row statistic. Drop 'moe' from "
            "recompute_modules, or use another load-balancing type."
        )
