"""Build Megatron-Bridge's own ``Qwen25VLModel`` (Qwen2.5-VL) on the CPU.

The model class (``models/qwen_vl/modeling_qwen25_vl.py``), its provider
(``qwen25_vl_provider.py``), Megatron-Core's ``GPTModel`` language model and Hugging Face's
Qwen2.5-VL vision tower (``Qwen2_5_VisionTransformerPretrainedModel``, windowed attention, run by
transformers itself) are untouched. fp32, dropout 0, CPU initialisation. What it takes beyond
:func:`~megatron.bridge_thd_cpu.stack.cpu_stack` (whose ``torch.cuda.current_device`` patch
Megatron-Core's ``MultimodalRotaryEmbedding`` needs here too):

1. Import: the provider chain ``gpt_provider`` -> ``model_provider`` -> ``models/config.py``
   does ``from omegaconf import OmegaConf`` at module level (used only to load / save Hugging
   Face configs, never to build or run). Only when ``omegaconf`` is absent and only for the
   duration of that import, :func:`qwen25_vl_import_patches` makes it a placeholder module
   (a :class:`~megatron.bridge_thd.upstream.patches.Patch` applied with ``patches.applied``).
   No Transformer Engine name is bound at import by the Qwen2.5-VL modules.
2. Build: ``GPTModelProvider.transformer_layer_spec`` defaults to the Transformer Engine spec
   (``default_layer_spec`` -> ``get_gpt_layer_with_transformer_engine_spec``). It is a config
   field, so no patch: the config carries :func:`~megatron.bridge_thd_cpu.model.language_layer_spec`
   (local spec, CPU THD core attention). ``attention_backend`` must stay ``auto``: ``local``
   makes ``GPTModelProvider.provide`` swap the core attention back to Megatron-Core's
   ``DotProductAttention``, which refuses THD.

Use it inside ``cpu_stack()`` with model-parallel groups initialised (as the tests' fixture does).
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
import torch.nn.functional as F

from megatron.bridge_thd.upstream.patches import Patch, applied
from megatron.bridge_thd.upstream.loading import load_bridge_module

__all__ = [
    "IMAGE_TOKEN_ID",
    "VIDEO_TOKEN_ID",
    "VISION_START_TOKEN_ID",
    "VISION_END_TOKEN_ID",
    "QWEN25_VL_PROVIDER_MODULE",
    "QWEN25_VL_MODEL_MODULE",
    "qwen25_vl_import_patches",
    "load_qwen25_vl_provider",
    "tiny_qwen25_vl_vision_config",
    "tiny_qwen25_vl_config",
    "build_qwen25_vl",
]

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_TOKEN_ID, VISION_END_TOKEN_ID = 250, 251, 252, 253
QWEN25_VL_PROVIDER_MODULE = "models.qwen_vl.qwen25_vl_provider"
QWEN25_VL_MODEL_MODULE = "models.qwen_vl.modeling_qwen25_vl"


class _OmegaConfPlaceholder:
    """Stands for ``omegaconf.OmegaConf``: ``models/config.py`` uses it only in
    ``from_hf_pretrained`` / ``save_hf_pretrained`` (loading and saving configs)."""

    @staticmethod
    def _absent(*args, **kwargs):
        raise ModuleNotFoundError("omegaconf is not installed: loading/saving provider configs needs it")

    create = merge = to_container = _absent


def qwen25_vl_import_patches() -> list[Patch]:
    """The patches importing Megatron-Bridge's Qwen2.5-VL provider needs on a machine without
    the full Megatron-Bridge dependency set, for :func:`megatron.bridge_thd.upstream.patches.applied`.

    Only when ``omegaconf`` cannot be found: ``sys.modules["omegaconf"]`` is a placeholder whose
    ``OmegaConf`` raises when called (restored when the block ends). Otherwise none. Nothing else:
    the Qwen2.5-VL modules bind no Transformer Engine name at import.
    """
    if "omegaconf" in sys.modules or importlib.util.find_spec("omegaconf") is not None:
        return []
    placeholder = types.ModuleType("omegaconf")
    placeholder.OmegaConf = _OmegaConfPlaceholder
    return [Patch(sys.modules, "omegaconf", placeholder,
                  "the provider chain imports omegaconf at module level, only to load / save HF configs")]


def load_qwen25_vl_provider() -> types.ModuleType:
    """Megatron-Bridge's ``models/qwen_vl/qwen25_vl_provider.py`` (which imports
    ``modeling_qwen25_vl.py``), loaded without the package ``__init__`` chain."""
    with applied(qwen25_vl_import_patches()):
        return load_bridge_module(QWEN25_VL_PROVIDER_MODULE)


_SHARED_TOWER = ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
                 "spatial_merge_size", "out_hidden_size")


def tiny_qwen25_vl_vision_config(**overrides):
    """A Hugging Face ``Qwen2_5_VLVisionConfig``: 2 blocks (block 0 windowed, block 1 full
    attention), width 32, 2 heads, patch 4, temporal patch 2, merge 2, window 16 pixels (2 x 2
    merged tokens), ``tokens_per_second`` 2, output width 64 (the language hidden size)."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from megatron.bridge_thd_cpu.reference import TINY_VISION_CONFIG

    # The tower geometry of every test-bed model (2 blocks, width 32, patch 4, merge 2, output 64).
    settings = {name: TINY_VISION_CONFIG[name] for name in _SHARED_TOWER}
    settings.update(in_channels=3, window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
    settings.update(overrides)
    return Qwen2_5_VLVisionConfig(**settings)


def tiny_qwen25_vl_config(*, num_layers: int = 2, tp: int = 1, cp: int = 1, pp: int = 1,
                          seq_length: int = 2048, vision_config=None, **overrides):
    """A finalized Megatron-Bridge ``Qwen25VLModelProvider`` for a tiny Qwen2.5-VL.

    Language model (Qwen2 style): vocabulary 256, hidden 64, 4 query heads of 16 over 2 KV groups
    (GQA), QKV bias, no QK layernorm, SwiGLU 128, RMSNorm, MRoPE sections [2, 3, 3], its layer
    spec the local one with the CPU THD core attention. Token ids: image 250, video 251, vision
    start 252, vision end 253. Vision tower: :func:`tiny_qwen25_vl_vision_config`.

    Args:
        tp, cp, pp: parallel sizes (the process groups must exist with these sizes).
        seq_length: the provider's ``seq_length``.
        vision_config: a ``Qwen2_5_VLVisionConfig`` (default: the tiny one).
        overrides: any other provider / ``TransformerConfig`` field.
    """
    from megatron.bridge_thd_cpu.model import language_layer_spec, tiny_language_settings

    provider_module = load_qwen25_vl_provider()
    vision = vision_config if vision_config is not None else tiny_qwen25_vl_vision_config()
    settings = dict(
        num_layers=num_layers,
        **tiny_language_settings(tp=tp, cp=cp, pp=pp),
        should_pad_vocab=False,
        seq_length=seq_length,
        add_qkv_bias=True,
        qk_layernorm=False,
        position_embedding_type="mrope",
        cross_entropy_loss_fusion=False,
        # Unused without experts; Megatron-Core refuses the default "allgather" dispatcher
        # together with variable_seq_lengths (pipeline-parallel THD).
        moe_token_dispatcher_type="alltoall",
        vision_config=vision,
        bos_token_id=1,
        eos_token_id=254,
        vision_start_token_id=VISION_START_TOKEN_ID,
        vision_end_token_id=VISION_END_TOKEN_ID,
        vision_token_id=255,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
    )
    settings.update(overrides)
    config = provider_module.Qwen25VLModelProvider(**settings)
    # The provider's default spec is Transformer Engine's; a ModuleSpec is used as given.
    config.transformer_layer_spec = language_layer_spec(config)
    config.finalize()
    return config


def build_qwen25_vl(config, *, pre_process: bool = True, post_process: bool = True, seed: int = 0):
    """Megatron-Bridge's ``Qwen25VLModel`` built on the CPU through its own provider
    (``Qwen25VLModelProvider.provide``).

    Args:
        config: from :func:`tiny_qwen25_vl_config` (a finalized ``Qwen25VLModelProvider``).
        pre_process / post_process: pipeline stage flags (the vision tower lives on the first).
        seed: weights are a function of the seed alone (CPU initialisation). The Hugging Face
            vision tower draws its weights from the same CPU generator, after the seed.

    Returns:
        The model in train mode (dropout is 0).
    """
    from megatron.bridge_thd_cpu.stack import cpu_stack

    load_qwen25_vl_provider()
    torch.manual_seed(seed)
    with cpu_stack():
        model = config.provide(pre_process=pre_process, post_process=post_process)
    return model.train()
