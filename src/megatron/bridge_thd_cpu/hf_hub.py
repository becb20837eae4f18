"""An offline Hugging Face hub cache holding the ``config.json`` of the models Megatron-Bridge's
Qwen-VL recipes load, so the recipe functions run unchanged without a network.

The recipes call ``AutoBridge.from_hf_pretrained("Qwen/...")`` (``recipes/qwen_vl/h100/*.py``), which
reads the model's ``config.json`` through ``transformers.AutoConfig`` (``safe_load_config_with_retry``)
and nothing else when ``to_megatron_provider(load_weights=False)`` follows. :func:`offline_hub` writes
each config into a temporary hub cache laid out as ``huggingface_hub`` lays out a download
(``models--Qwen--<name>/refs/main`` -> ``snapshots/<revision>/config.json``) and sets
``HF_HUB_OFFLINE=1``, ``HF_HUB_CACHE`` / ``HF_HOME`` and ``MEGATRON_CONFIG_LOCK_DIR`` for the block
(``huggingface_hub`` reads its constants at import, so the variables must be set before the process
that loads the configs imports it: enter the block in the parent and start that process inside it,
e.g. ``with offline_hub(): run_on_gloo(fn, whole_bridge=True, ...)``, whose spawned processes inherit
the environment).

Where the values come from (the hub itself cannot be reached from here; search of public sources):

* ``Qwen/Qwen3-VL-30B-A3B-Instruct``: verbatim, a public model report that prints the raw
  ``config.json`` of a local ``Qwen3-VL-30B-A3B-Instruct`` download (transformers_version
  4.57.0.dev0); every field below is that file's.
* ``Qwen/Qwen3-VL-8B-Instruct``: no verbatim copy was found. The text part equals Qwen3-8B's
  geometry with Qwen3-VL's 256K context and interleaved MRoPE (hidden 4096, 36 layers, 32 heads,
  8 KV heads, head_dim 128, intermediate 12288, vocab 151936, rope_theta 5e6, mrope_section
  [24, 20, 20], untied embeddings), as a public mlx-vlm test copies it; the vision part is the
  30B-A3B file's (the same SigLIP-2 tower, 27 layers, deepstack [8, 16, 24]) with
  ``out_hidden_size`` 4096 (the language model's width).
* ``Qwen/Qwen3.5-35B-A3B``: ``text_config`` verbatim from ``mlc-ai/pith-train``
  ``examples/pretrain_lm/qwen3.5-35b-a3b/config.json`` (commit 2bdf083, the released file's
  ``text_config``); the wrapper's token ids are the pinned transformers' ``Qwen3_5MoeConfig``
  defaults (docs/compatibility.md) and the vision tower is transformers' ``Qwen3_5MoeVisionConfig`` default (27 layers,
  1152 wide) with ``out_hidden_size`` 2048: not checked against the released file.
* ``Qwen/Qwen3.5-2B``: no verbatim copy was found. The text geometry is what a public loader test
  asserts for the official file (hidden 2048, intermediate 6144, 24 layers, 8 heads, 2 KV heads,
  head_dim 256, vocab 248320, 262144 positions, linear attention 16 key / 16 value heads of 128,
  conv kernel 4, a full-attention layer every 4th, rotary 64 of 256 dims, rope_theta 1e7, eos
  248044); the vision tower (24 layers, 1024 wide, 4096 MLP, out 2048, as Qwen3-VL's 2B) is an
  assumption.

What ``ConfigContainer.validate()`` and ``configure`` read from them (layers per PP stage, heads
and KV heads per TP rank, experts per EP rank, MoE or dense, MTP) is in the parts found verbatim
or asserted by the sources above; docs/recipes-validate.md lists which cases depend on what.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path

__all__ = ["HUB_CONFIGS", "offline_hub", "REVISION"]

# A fixed 40-hex revision name for every snapshot (huggingface_hub resolves refs/main to it).
REVISION = "0" * 39 + "1"


def _layer_types(layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


_QWEN3_VL_VISION = {
    "deepstack_visual_indexes": [8, 16, 24],
    "depth": 27,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "in_channels": 3,
    "initializer_range": 0.02,
    "intermediate_size": 4304,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
_QWEN3_VL_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}
_QWEN3_VL_ROPE = {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}

QWEN3_VL_30B_A3B = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_vl_moe_text",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(_QWEN3_VL_ROPE),
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "vision_config": {**_QWEN3_VL_VISION, "model_type": "qwen3_vl_moe", "out_hidden_size": 2048},
    **_QWEN3_VL_TOKENS,
}

QWEN3_VL_8B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(_QWEN3_VL_ROPE),
        "rope_theta": 5000000,
        "use_cache": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.0.dev0",
    "vision_config": {**_QWEN3_VL_VISION, "model_type": "qwen3_vl", "out_hidden_size": 4096},
    **_QWEN3_VL_TOKENS,
}

_QWEN35_TOKENS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}
_QWEN35_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}

QWEN35_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "layer_types": _layer_types(40),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
        "use_cache": True,
        "vocab_size": 248320,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": dict(_QWEN35_ROPE),
    },
    "tie_word_embeddings": False,
    "vision_config": {
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": "qwen3_5_moe",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    **_QWEN35_TOKENS,
}

QWEN35_2B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "layer_types": _layer_types(24),
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 8,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "use_cache": True,
        "vocab_size": 248320,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": dict(_QWEN35_ROPE),
    },
    "tie_word_embeddings": True,
    "vision_config": {
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4096,
        "model_type": "qwen3_5",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2048,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    **_QWEN35_TOKENS,
}

# Hub id -> config.json content.
HUB_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-VL-8B-Instruct": QWEN3_VL_8B,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": QWEN3_VL_30B_A3B,
    "Qwen/Qwen3.5-2B": QWEN35_2B,
    "Qwen/Qwen3.5-35B-A3B": QWEN35_35B_A3B,
}

_ENV = ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME", "MEGATRON_CONFIG_LOCK_DIR", "TRANSFORMERS_OFFLINE")


def write_hub_cache(cache: Path, configs: dict[str, dict] | None = None) -> Path:
    """Write ``configs`` (default :data:`HUB_CONFIGS`) into ``cache`` in huggingface_hub's layout."""
    for repo_id, config in (HUB_CONFIGS if configs is None else configs).items():
        repo = cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(copy.deepcopy(config), indent=2), encoding="utf-8")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(REVISION, encoding="utf-8")
    return cache


# One hub folder per process and configs, kept until the interpreter exits (TemporaryDirectory's finalizer).
_HUB_FOLDERS: dict[str, tempfile.TemporaryDirectory] = {}


def _hub_folder(configs: dict[str, dict] | None) -> Path:
    """The process's hub folder holding ``configs``, written the first time they are asked for."""
    key = json.dumps(HUB_CONFIGS if configs is None else configs, sort_keys=True)
    if key not in _HUB_FOLDERS:
        folder = tempfile.TemporaryDirectory(prefix="bridge_thd_hub_")
        write_hub_cache(Path(folder.name) / "hub", configs)
        _HUB_FOLDERS[key] = folder
    return Path(_HUB_FOLDERS[key].name)


@contextlib.contextmanager
def offline_hub(configs: dict[str, dict] | None = None):
    """Within the block, ``AutoConfig.from_pretrained("Qwen/...")`` reads the configs written here, offline.

    Every block of a process with the same ``configs`` uses one folder (written once, removed when the interpreter
    exits), so the variables it sets are the same each time: what the gloo launcher's bridge zygote is chosen by
    (``bridge_thd_testbed.launcher``, module docstring).

    Yields:
        The hub cache folder (the environment is restored when the block ends).
    """
    saved = {name: os.environ.get(name) for name in _ENV}
    root = _hub_folder(configs)
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_CACHE=str(root / "hub"),
                      HF_HOME=str(root), MEGATRON_CONFIG_LOCK_DIR=str(root))
    try:
        yield root / "hub"
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
