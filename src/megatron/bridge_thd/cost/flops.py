"""Model FLOPs by the formula Megatron-Bridge logs: its own ``num_floating_point_operations``
(``training/utils/flop_utils.py``, loaded by :func:`megatron.bridge_thd.upstream.load_flop_utils`).

The planner builds the ``cfg.model`` fields that function reads from a :class:`ModelSpec`
(``types.SimpleNamespace(model=..., peft=None)``) and evaluates it per micro-batch with the
layout's ``seqlen_sum`` (token slots), ``seqlen_squared_sum`` (attention work) and
``num_vision_patches``. Units: FLOPs for forward + backward (the formula's factor 3), for the
whole micro-batch (all model-parallel ranks together).

The breakdown splits the same function's value into
``vision = f(S, Q, P) - f(S, Q, 0)``, ``attention_core = f(S, Q, 0) - f(S, 0, 0)`` (the
``sum s_i^2`` term; zero for Gated-DeltaNet layers) and ``linear = f(S, 0, 0)`` (projections,
MLP / experts, logits: proportional to the slots S).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.upstream.loading import load_flop_utils

__all__ = ["FlopsBreakdown", "flops_config", "micro_batch_flops", "moe_routed_tokens"]


def flops_config(spec: ModelSpec, tensor_parallel: int = 1, seq_length: int = 4096) -> SimpleNamespace:
    """``SimpleNamespace(model=..., peft=None)`` with every ``cfg.model`` field ``flop_utils``
    reads for a GQA / MoE / Gated-DeltaNet stack with a ViT and the spec's MTP layers (no MLA, no sliding
    window)."""
    vision = spec.vision
    linear = spec.linear_attention_freq
    model = SimpleNamespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels, vocab_size=spec.vocab_size, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tensor_parallel, seq_length=seq_length,
        num_moe_experts=spec.num_moe_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk or 1, moe_layer_freq=1,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        mtp_num_layers=spec.mtp_num_layers or None, gated_linear_unit=True, multi_latent_attention=False,
        attention_output_gate=spec.attention_output_gate, window_size=None,
        experimental_attention_variant="gated_delta_net" if linear is not None else None,
        linear_attention_freq=list(linear) if isinstance(linear, tuple) else linear,
        linear_key_head_dim=spec.linear_key_head_dim, linear_value_head_dim=spec.linear_value_head_dim,
        linear_num_key_heads=spec.linear_num_key_heads, linear_num_value_heads=spec.linear_num_value_heads,
        linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
        vision_config=SimpleNamespace(
            depth=vision.depth, hidden_size=vision.hidden_size, num_heads=vision.num_heads,
            intermediate_size=vision.intermediate_size, spatial_merge_size=vision.spatial_merge_size,
            out_hidden_size=vision.out_hidden_size or spec.hidden_size,
        ),
    )
    return SimpleNamespace(model=model, peft=None)


@dataclass(frozen=True)
class FlopsBreakdown:
    """FLOPs (fwd + bwd) of one micro-batch; ``total = linear + attention_core + vision``."""

    linear: float
    attention_core: float
    vision: float

    @property
    def total(self) -> float:
        return self.linear + self.attention_core + self.vision

    def __add__(self, other: "FlopsBreakdown") -> "FlopsBreakdown":
        return FlopsBreakdown(self.linear + other.linear, self.attention_core + other.attention_core,
                              self.vision + other.vision)


def micro_batch_flops(cfg: SimpleNamespace, batch_size: int, slots: int, attention_work: int,
                      patches: int) -> FlopsBreakdown:
    """Evaluate ``num_floating_point_operations`` for one micro-batch of ``batch_size`` samples
    with ``slots`` token slots, ``attention_work`` = sum of s_i^2 (tokens^2) and ``patches`` ViT
    patches, split term by term (module docstring)."""
    f = load_flop_utils().num_floating_point_operations

    def call(squared: int, vision_patches: int) -> float:
        return float(f(cfg, batch_size=batch_size, seqlen_sum=slots, seqlen_squared_sum=squared,
                       num_vision_patches=vision_patches))

    full = call(attention_work, patches)
    no_vision = call(attention_work, 0)
    linear = call(0, 0)
    return FlopsBreakdown(linear=linear, attention_core=no_vision - linear, vision=full - no_vision)


def moe_routed_tokens(spec: ModelSpec, slots: int) -> int:
    """Token-to-expert assignments of one micro-batch summed over the MoE layers:
    ``slots * top_k * num_layers`` (every slot, padding included, goes through the router);
    0 for a dense model."""
    return slots * spec.moe_router_topk * spec.num_layers if spec.is_moe else 0
