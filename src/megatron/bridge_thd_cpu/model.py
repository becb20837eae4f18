"""Build Megatron-Bridge's own ``Qwen3VLModel`` (vision tower included) on the CPU.

The model class, its language model, rope, vision tower and CP handling are Megatron-Bridge's
and Megatron-Core's, untouched; only the modules Transformer Engine would provide are local
ones (see :mod:`megatron.bridge_thd_cpu.stack`). fp32, dropout 0, CPU initialisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron.bridge_thd_cpu.stack import QWEN3_VL_MODEL_MODULE, cpu_stack
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = ["tiny_qwen3_vl_config", "tiny_language_settings", "tiny_vision_config", "language_layer_spec", "build_qwen3_vl"]

# Token ids of the tiny model (the same as ReferenceQwen3VL.tiny and data.ReceiptSpec).
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_TOKEN_ID = 250, 251, 252


def tiny_vision_config():
    """A Hugging Face ``Qwen3VLVisionConfig``: 2 blocks, width 32, patch 4, merge 2, deepstack [0, 1]
    (the same tower as ``ReferenceQwen3VL.tiny``)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    from megatron.bridge_thd_cpu.reference import TINY_VISION_CONFIG

    settings = dict(TINY_VISION_CONFIG, deepstack_visual_indexes=list(TINY_VISION_CONFIG["deepstack_visual_indexes"]))
    return Qwen3VLVisionConfig(in_channels=3, **settings)


def tiny_language_settings(*, tp: int = 1, cp: int = 1, pp: int = 1) -> dict:
    """The ``TransformerConfig`` fields every test-bed model shares (a new dict each call).

    The tiny language model: vocabulary 256, hidden 64, 4 query heads of 16 over 2 KV groups
    (GQA), SwiGLU 128, no linear bias, RMSNorm, MRoPE sections [2, 3, 3]; and the CPU build: fp32,
    CPU initialisation, dropout 0, no fused kernels, per-token loss, the given parallel sizes.
    """
    return dict(
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        vocab_size=256,
        make_vocab_size_divisible_by=1,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        mrope_section=[2, 3, 3],
        rotary_base=10000.0,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.05,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        apply_rope_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        share_embeddings_and_output_weights=False,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        pipeline_model_parallel_size=pp,
        deallocate_pipeline_outputs=False,
    )


def tiny_qwen3_vl_config(
    *,
    moe: bool = False,
    num_layers: int = 3,
    tp: int = 1,
    cp: int = 1,
    pp: int = 1,
    ep: int = 1,
    seq_length: int = 2048,
    **overrides,
):
    """A Megatron-Bridge ``Qwen3VLTransformerConfig`` for a tiny Qwen3-VL.

    Language model: vocabulary 256, hidden 64, 4 query heads of 16 over 2 KV groups (GQA), QK
    layernorm, SwiGLU 128 (or, with ``moe``, 4 experts of 32, top-2, allgather dispatcher),
    MRoPE sections [2, 3, 3]. Token ids: image 250, video 251, vision start 252.

    Args:
        moe: mixture-of-experts MLP in every layer.
        tp, cp, pp, ep: parallel sizes (the process groups must exist with these sizes).
        seq_length: ``seq_length`` / ``language_max_sequence_length``.
        overrides: any other ``TransformerConfig`` field.
    """
    qwen_config = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.transformer_config")
    vision = tiny_vision_config()
    settings = dict(
        num_layers=num_layers,
        **tiny_language_settings(tp=tp, cp=cp, pp=pp),
        language_max_sequence_length=seq_length,
        add_qkv_bias=False,
        qk_layernorm=True,
        expert_model_parallel_size=ep,
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        in_channels=vision.in_channels,
        spatial_merge_size=vision.spatial_merge_size,
        num_position_embeddings=vision.num_position_embeddings,
        out_hidden_size=vision.out_hidden_size,
        deepstack_visual_indexes=list(vision.deepstack_visual_indexes),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_TOKEN_ID,
    )
    if not moe:
        # Unused without experts, but Megatron-Core's TransformerConfig refuses the default
        # "allgather" dispatcher together with variable_seq_lengths (pipeline-parallel THD).
        settings.update(moe_token_dispatcher_type="alltoall")
    if moe:
        settings.update(
            num_moe_experts=4,
            moe_ffn_hidden_size=32,
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
        )
    settings.update(overrides)
    config = qwen_config.Qwen3VLTransformerConfig(**settings)
    config.vision_config = vision
    config.seq_length = seq_length
    return config


def language_layer_spec(config):
    """Megatron-Core's local GPT layer spec with the CPU THD core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron.bridge_thd_cpu.attention import THDCoreAttention

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = THDCoreAttention
    return spec


def build_qwen3_vl(config, *, pg_collection=None, pre_process: bool = True, post_process: bool = True, seed: int = 0,
                   layer_spec=None):
    """Megatron-Bridge's ``Qwen3VLModel`` built on the CPU.

    Args:
        config: from :func:`tiny_qwen3_vl_config` (or any ``Qwen3VLTransformerConfig`` with a
            ``vision_config`` attribute holding the Hugging Face vision config). With
            ``mtp_num_layers`` set the model carries Megatron-Core's MTP block (local spec).
        pg_collection: Megatron-Core ``ProcessGroupCollection``; default: the mpu groups.
        pre_process / post_process: pipeline stage flags (the vision tower lives on the first).
        seed: weights are a function of the seed alone (CPU initialisation), whatever the
            parallel layout.
        layer_spec: ``config -> spec`` of the language model's layers, called inside
            :func:`cpu_stack` (default :func:`language_layer_spec`; Qwen3.5-VL passes its hybrid
            block).

    Returns:
        The model in train mode (dropout is 0).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    torch.manual_seed(seed)
    with cpu_stack():
        layer_spec = (layer_spec or language_layer_spec)(config)
        mtp_block_spec = (
            get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if config.mtp_num_layers else None
        )
        model = model_module.Qwen3VLModel(
            language_transformer_config=config,
            language_transformer_layer_spec=layer_spec,
            mtp_block_spec=mtp_block_spec,
            vision_transformer_config=config.vision_config,
            pre_process=pre_process,
            post_process=post_process,
            add_encoder=pre_process,
            pg_collection=pg_collection,
        )
    return model
