"""Build a tiny Qwen3.5-VL the way Megatron-Bridge builds it, on the CPU.

Megatron-Bridge's ``Qwen35VLModelProvider.provide()`` (``models/qwen_vl/qwen35_vl_provider.py``)
builds its own ``Qwen3VLModel`` (vision tower + ``Qwen3VLGPTModel``) with a per-layer block spec
from Megatron-Core's ``get_transformer_block_with_experimental_attention_variant_spec``:
Gated DeltaNet layers and full-attention layers interleaved by ``linear_attention_freq``, then
``_patch_standard_attention_specs`` swaps the full-attention layers' module for
``Qwen3VLSelfAttention`` (MRoPE). Config: ``attention_output_gate``,
``layernorm_zero_centered_gamma``, ``experimental_attention_variant="gated_delta_net"``.

That spec function asserts ``transformer_impl == "transformer_engine"`` (TE modules throughout),
so :func:`hybrid_block_spec` assembles the same per-layer structure from Megatron-Core's local
modules: GDN layers get ``GatedDeltaNet`` with a separate input norm and a ``ColumnParallelLinear``
``in_proj`` (TE fuses the norm into ``TELayerNormColumnParallelLinear``: same math), full-attention
layers the local GPT layer spec with :class:`~megatron.bridge_thd_cpu.attention.THDCoreAttention`
and ``Qwen3VLSelfAttention``. The norms are :class:`RMSNorm` (zero-centred gamma, which
Megatron-Core's ``WrappedTorchNorm`` refuses). The GDN kernels are the pure-torch varlen ones of
:mod:`megatron.bridge_thd_cpu.gdn`, installed by :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = ["RMSNorm", "tiny_qwen35_vl_config", "hybrid_block_spec", "build_qwen35_vl", "gdn_layers"]


class RMSNorm(torch.nn.Module):
    """RMSNorm with Megatron's ``layernorm_zero_centered_gamma`` (scale ``1 + weight``, weight
    initialised to 0), the ``(config, hidden_size, eps)`` constructor of Megatron's norms."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.zero_centered_gamma = bool(getattr(config, "layernorm_zero_centered_gamma", False))
        self.eps = eps
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(getattr(config, "sequence_parallel", False)))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        scale = (1 + self.weight.float()) if self.zero_centered_gamma else self.weight.float()
        return (y * scale).to(dtype)


def tiny_qwen35_vl_config(*, moe: bool = False, linear_attention_freq=(1, 0, 1, 0), **overrides):
    """A ``Qwen3VLTransformerConfig`` with Qwen3.5's hybrid settings on the tiny Qwen3-VL of
    :func:`~megatron.bridge_thd_cpu.model.tiny_qwen3_vl_config`.

    Layers follow ``linear_attention_freq`` (1 = Gated DeltaNet, 0 = full attention; default
    GDN, attention, GDN, attention). GDN: 2 key heads and 4 value heads (grouped, like 16/48),
    head dims 8, conv kernel 4. Full attention: output gate. Zero-centred norm gamma.
    """
    pattern = list(linear_attention_freq) if not isinstance(linear_attention_freq, int) else linear_attention_freq
    num_layers = len(pattern) if isinstance(pattern, list) else overrides.pop("num_layers", 4)
    settings = dict(
        num_layers=num_layers,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=pattern,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
    )
    settings.update(overrides)
    return tiny_qwen3_vl_config(moe=moe, **settings)


def hybrid_block_spec(config):
    """Megatron-Core's experimental-attention-variant block structure from local modules (see the
    module docstring): a ``TransformerBlockSubmodules`` with one layer spec per layer."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_linear_attention_pattern,
        get_moe_layer_pattern,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron.bridge_thd_cpu.attention import THDCoreAttention

    attention_module = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.attention").Qwen3VLSelfAttention

    def local_layer(num_experts):
        spec = get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
            normalization=config.normalization,
        )
        sub = spec.submodules
        sub.self_attention.submodules.core_attention = THDCoreAttention
        if sub.self_attention.module is SelfAttention:
            sub.self_attention.module = attention_module
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if config.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = RMSNorm
            sub.self_attention.submodules.k_layernorm = RMSNorm
        return spec

    gdn_spec = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=RMSNorm, out_proj=RowParallelLinear),
    )
    attention_pattern = get_linear_attention_pattern(config=config)
    moe_pattern = get_moe_layer_pattern(config=config) if config.num_moe_experts else [0] * config.num_layers
    dense, moe = local_layer(None), (local_layer(config.num_moe_experts) if config.num_moe_experts else None)
    layer_specs = []
    for layer in range(config.num_layers):
        mlp_spec = moe if moe_pattern[layer] else dense
        layer_specs.append(
            ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=RMSNorm,
                    self_attention=gdn_spec if attention_pattern[layer] else mlp_spec.submodules.self_attention,
                    self_attn_bda=get_bias_dropout_add,
                    pre_mlp_layernorm=RMSNorm,
                    mlp=mlp_spec.submodules.mlp,
                    mlp_bda=get_bias_dropout_add,
                ),
            )
        )
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=RMSNorm)


def build_qwen35_vl(config, *, pg_collection=None, pre_process: bool = True, post_process: bool = True, seed: int = 0):
    """Megatron-Bridge's ``Qwen3VLModel`` with the Qwen3.5 hybrid block, built on the CPU
    by :func:`~megatron.bridge_thd_cpu.model.build_qwen3_vl` inside ``cpu_stack()`` (so the GDN layers bind
    the pure-torch varlen kernels).

    Args:
        config: from :func:`tiny_qwen35_vl_config`.
        pg_collection, pre_process, post_process, seed: as in
            :func:`~megatron.bridge_thd_cpu.model.build_qwen3_vl`.
    """
    return build_qwen3_vl(config, pg_collection=pg_collection, pre_process=pre_process, post_process=post_process,
                          seed=seed, layer_spec=hybrid_block_spec)


def gdn_layers(model):
    """The model's Gated DeltaNet modules."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
