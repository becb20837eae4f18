"""Activation and model-state memory per GPU (bytes), a first-order estimate.

Activations: Korthikanti et al. (2022)'s per-layer formula adapted per token and per layer (bf16,
no recomputation, no dropout, fused attention keeping only the fp32 log-sum-exp instead of the
``s x s`` scores), with terms for full attention, Gated DeltaNet, SwiGLU / MoE MLPs, the ViT and
the output logits, divided by TP (with SP), CP and the 1F1B pipeline's in-flight micro-batches.
Model states: distributed optimizer, mixed precision (2 + 4 + 12 / DP bytes per parameter). Every
term and assumption: docs/planner.md (Memory model).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.plan.presets import ModelSpec

__all__ = ["layer_bytes_per_token", "vision_bytes_per_patch", "output_bytes_per_token", "ActivationEstimate",
           "activation_bytes", "parameter_counts", "model_state_bytes"]

GIB = 2**30


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


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes on the busiest GPU: ``layers`` (decoder), ``vision`` (ViT), ``output``."""

    layers: float
    vision: float
    output: float

    @property
    def total(self) -> float:
        return self.layers + self.vision + self.output


def activation_bytes(spec: ModelSpec, parallel: Parallel, slots: int, patches: int,
                     micro_batches: int = 1) -> ActivationEstimate:
    """Peak activation bytes per GPU for micro-batches of ``slots`` token slots and ``patches``
    ViT patches each (module docstring for the formula and the PP rule)."""
    per_layer = layer_bytes_per_token(spec, parallel.tp, parallel.sp)
    tokens = slots / parallel.cp
    if parallel.pp == 1:
        return ActivationEstimate(sum(per_layer) * tokens, vision_bytes_per_patch(spec, parallel.tp) * patches,
                                  output_bytes_per_token(spec, parallel.tp) * tokens)
    stage = len(per_layer) // parallel.pp
    in_flight = min(parallel.pp, micro_batches)
    first = ActivationEstimate(sum(per_layer[:stage]) * tokens * in_flight,
                               vision_bytes_per_patch(spec, parallel.tp) * patches * in_flight, 0.0)
    last = ActivationEstimate(sum(per_layer[-stage:]) * tokens, 0.0, output_bytes_per_token(spec, parallel.tp) * tokens)
    return max(first, last, key=lambda e: e.total)


def parameter_counts(spec: ModelSpec) -> dict[str, int]:
    """Parameter counts: ``dense`` (attention, dense MLP, shared experts, router, norms
    omitted), ``experts`` (routed experts), ``embedding`` (input + untied output), ``vision``."""
    h, dense, experts = spec.hidden_size, 0, 0
    for linear in spec.linear_layer_pattern():
        if linear:
            qk = spec.linear_key_head_dim * spec.linear_num_key_heads
            v = spec.linear_value_head_dim * spec.linear_num_value_heads
            dense += h * (2 * qk + 2 * v + 2 * spec.linear_num_value_heads) + spec.linear_conv_kernel_dim * (2 * qk + v) + v * h
        else:
            q, kv = spec.num_attention_heads * spec.kv_channels, spec.num_query_groups * spec.kv_channels
            dense += h * (q + 2 * kv + (q if spec.attention_output_gate else 0)) + q * h
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


def model_state_bytes(spec: ModelSpec, parallel: Parallel) -> float:
    """Weights + grads + optimizer states per GPU (bytes), distributed optimizer (module docstring)."""
    counts = parameter_counts(spec)
    dense = (counts["dense"] + counts["embedding"] + counts["vision"]) / (parallel.tp * parallel.pp)
    experts = counts["experts"] / (parallel.ep * parallel.tp * parallel.pp)
    dense_shards = parallel.dp * parallel.cp
    expert_shards = max(1, dense_shards // parallel.ep)
    return dense * (6 + 12 / dense_shards) + experts * (6 + 12 / expert_shards)
