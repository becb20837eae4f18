"""Activation and model-state memory per GPU (bytes), a first-order estimate.

Activations follow Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models": per layer a GPT layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes, 34 per hidden
unit of tensors kept for backward and ``5*a*s`` for the attention scores / softmax / dropout.
Adapted here, per token and per layer, bf16 (2 bytes), no recomputation, no dropout:

* flash / fused attention keeps no ``s x s`` scores: the ``5*a*s/h`` term becomes the fp32
  log-sum-exp, ``4 * heads`` bytes;
* norms: two pre-norm inputs ``4h``;
* full attention: QKV input ``2h``, Q/K/V ``2(q + 2kv)`` (``q = heads * head_dim``,
  ``kv = kv_heads * head_dim``), output-gate ``2q`` (Qwen3.5), o-proj input ``2q``;
* Gated DeltaNet (Qwen3.5 linear layers): input ``2h``, in-projections ``2(2qk + 2v + 2nv)``,
  conv output ``2(2qk + v)``, core output and gated norm ``4v`` (chunk states neglected);
* SwiGLU MLP of width f: fc1 input ``2h``, fc1 output ``4f``, fc2 input ``2f``;
* MoE: router input ``2h`` and fp32 probabilities ``4E``, then per routed copy (top-k)
  ``2h + 6 f_e``, plus the shared expert ``6 f_s``;
* ViT (per patch, per layer): ``16 h_v + 4 f_v`` (GELU MLP, full attention, flash);
* output: final norm ``2h`` + bf16 logits ``2V/tp`` + fp32 logits for the loss ``4V/tp``.

Check: an MHA GPT layer with f = 4h, non-gated MLP, gives ``4h + 2h + 6h + 2h + 2h + 16h = 32h``,
Korthikanti's 34h minus the two 1-byte dropout masks.

Division: with sequence parallelism (or tp = 1) everything divides by tp; without it the
``4h + 2h + 2h`` norm / projection inputs stay replicated. Context parallelism divides tokens by
cp. Pipeline parallelism (1F1B): stage 0 holds ``min(pp, micro-batches)`` micro-batches of its
``L/pp`` layers (plus the ViT), the last stage one micro-batch of its layers plus the logits; the
estimate is the larger. EP does not reduce activations (each rank processes as many routed tokens
as its own micro-batch sends out, for balanced routing).

Model states (distributed optimizer, mixed precision): per parameter 2 (bf16 weight) + 4 (fp32
grad) + 12 (fp32 master + Adam m, v) / (DP shards) bytes; dense parameters split over tp * pp,
experts over ep * tp * pp (expert TP = TP), embeddings/vision counted as spread over pp.
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
