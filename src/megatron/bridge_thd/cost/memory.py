"""Per-token and per-parameter figures of a model spec, what the time model and the planner's memory model share.

Activation bytes one token leaves in each decoder layer for backward (Korthikanti et al. (2022)'s per-layer formula
adapted per token and per layer: bf16, no recomputation, no dropout, fused attention keeping only the fp32
log-sum-exp instead of the ``s x s`` scores), per ViT patch and per output token, and the parameter counts. The
planner's memory model (:mod:`megatron.bridge_thd.plan.memory`) multiplies them by the tokens on a GPU; every term
and assumption: docs/planner.md (Memory model).
"""

from __future__ import annotations

from megatron.bridge_thd.cost.presets import ModelSpec

__all__ = ["layer_bytes_per_token", "vision_bytes_per_patch", "output_bytes_per_token", "mixer_parameters",
           "parameter_counts"]


def _mlp_bytes(spec: ModelSpec) -> int:
    h = spec.hidden_size
    if not spec.is_moe:
        return 2 * h + 6 * spec.ffn_hidden_size
    shared = 6 * (spec.moe_shared_expert_intermediate_size or 0)
    return 2 * h + 4 * spec.num_moe_experts + spec.moe_router_topk * (2 * h + 6 * spec.moe_ffn_hidden_size) + shared


def _mixer_bytes(spec: ModelSpec, linear: bool) -> int:
    h = spec.hidden_size
    if linear:
        qk = spec.linear_key_head_dim * spec.linear_num_key_heads
        v = spec.linear_value_head_dim * spec.linear_num_value_heads
        return 2 * h + 2 * (2 * qk + 2 * v + 2 * spec.linear_num_value_heads) + 2 * (2 * qk + v) + 4 * v
    q = spec.num_attention_heads * spec.kv_channels
    kv = spec.num_query_groups * spec.kv_channels
    gate = 2 * q if spec.attention_output_gate else 0
    return 2 * h + 2 * (q + 2 * kv) + gate + 2 * q + 4 * spec.num_attention_heads


def layer_bytes_per_token(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = True) -> list[float]:
    """Activation bytes one token leaves in each decoder layer for backward, per GPU of a TP group.

    Returns:
        One float per layer (bytes / token); multiply by the tokens on the GPU.
    """
    replicated = 8 * spec.hidden_size  # two norm inputs + QKV input + fc1 input
    out = []
    for linear in spec.linear_layer_pattern():
        total = 4 * spec.hidden_size + _mixer_bytes(spec, bool(linear)) + _mlp_bytes(spec)
        if sequence_parallel or tp == 1:
            out.append(total / tp)
        else:
            out.append(replicated + (total - replicated) / tp)
    return out


def vision_bytes_per_patch(spec: ModelSpec, tp: int = 1) -> float:
    """ViT activation bytes per patch, all layers, per GPU (``(16 h_v + 4 f_v + 4 heads) * depth / tp``)."""
    v = spec.vision
    return (16 * v.hidden_size + 4 * v.intermediate_size + 4 * v.num_heads) * v.depth / tp


def output_bytes_per_token(spec: ModelSpec, tp: int = 1) -> float:
    """Final norm + bf16 logits + fp32 logits for the loss, bytes per token per GPU."""
    return 2 * spec.hidden_size / tp + 6 * spec.vocab_size / tp


def mixer_parameters(spec: ModelSpec, linear: bool) -> int:
    """Parameters of one layer's token mixer (norms omitted): Gated DeltaNet (``linear``: in-projections
    ``h (2qk + 2v + 2 nv)``, depthwise conv ``k (2qk + v)``, out-projection ``v h``) or attention (Q, K, V,
    the output gate where the model has one, O)."""
    h = spec.hidden_size
    if linear:
        qk = spec.linear_key_head_dim * spec.linear_num_key_heads
        v = spec.linear_value_head_dim * spec.linear_num_value_heads
        return h * (2 * qk + 2 * v + 2 * spec.linear_num_value_heads) + spec.linear_conv_kernel_dim * (2 * qk + v) + v * h
    q, kv = spec.num_attention_heads * spec.kv_channels, spec.num_query_groups * spec.kv_channels
    return h * (q + 2 * kv + (q if spec.attention_output_gate else 0)) + q * h


def parameter_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts: ``dense`` (attention, dense MLP, shared experts, router, norms
    omitted), ``experts`` (routed experts), ``embedding`` (input + untied output), ``vision``."""
    h, dense, experts = spec.hidden_size, 0, 0
    for linear in spec.linear_layer_pattern():
        dense += mixer_parameters(spec, bool(linear))
        if spec.is_moe:
            experts += spec.num_moe_experts * 3 * h * spec.moe_ffn_hidden_size
            dense += h * spec.num_moe_experts + 3 * h * (spec.moe_shared_expert_intermediate_size or 0)
        else:
            dense += 3 * h * spec.ffn_hidden_size
    v = spec.vision
    merged = v.hidden_size * v.spatial_merge_size**2
    vision = v.depth * (4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size) + merged * merged + merged * (
        v.out_hidden_size or h)
    embedding = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return {"dense": dense, "experts": experts, "embedding": embedding, "vision": vision}
