"""Model presets for the planner: published Hugging Face ``config.json`` numbers as small tables.

A :class:`ModelSpec` holds what the FLOPs formula (Megatron-Bridge's ``flop_utils``), the
activation-memory estimate and the parameter count need: language-model sizes (layers, hidden,
heads, KV heads, head dim, FFN / expert sizes, top-k, vocabulary), the Gated-DeltaNet sizes of
the Qwen3.5 hybrids (3 linear-attention layers per full-attention layer) and the vision tower.

Numbers were written from the published ``config.json`` files as known to the author (source repo
id per preset in a comment); entries marked ``unverified`` are the least certain (Qwen3.5 small
vision towers). Pass ``--hf-config path/to/config.json`` to use a downloaded config instead.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from megatron.bridge_thd.checks import check_int

__all__ = ["VisionSpec", "ModelSpec", "PRESETS", "get_preset", "spec_from_hf_config", "preset_names"]


@dataclass(frozen=True)
class VisionSpec:
    """ViT tower: ``depth`` layers of width ``hidden_size``; a ``patch_size`` x ``patch_size`` x
    ``temporal_patch_size`` patch is one ViT token; ``spatial_merge_size``^2 patches merge into one
    LLM token of width ``out_hidden_size``."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """Language model + vision tower sizes (HF names in comments).

    ``linear_attention_freq``: None for plain attention stacks; 4 for Qwen3.5 (layers 4, 8, ...
    are full attention, the rest Gated DeltaNet), or an explicit 0/1 list (1 = linear layer).
    """

    name: str
    hf_repo: str
    num_layers: int  # num_hidden_layers
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # num_key_value_heads
    kv_channels: int  # head_dim
    ffn_hidden_size: int  # intermediate_size (dense MLP)
    vocab_size: int
    vision: VisionSpec
    num_moe_experts: int | None = None  # num_experts
    moe_ffn_hidden_size: int | None = None  # moe_intermediate_size
    moe_router_topk: int = 0  # num_experts_per_tok
    moe_shared_expert_intermediate_size: int | None = None
    tie_word_embeddings: bool = False
    attention_output_gate: bool = False
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_conv_kernel_dim: int = 4
    mtp_num_layers: int = 0  # multi-token prediction layers (a recipe setting: Megatron-Bridge's mtp_num_layers)
    notes: str = field(default="", compare=False)

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts is not None

    def linear_layer_pattern(self) -> list[int]:
        """Per decoder layer: 1 = Gated DeltaNet (linear attention), 0 = full softmax attention."""
        freq = self.linear_attention_freq
        if freq is None:
            return [0] * self.num_layers
        if isinstance(freq, int):
            return [0 if (i + 1) % freq == 0 else 1 for i in range(self.num_layers)]
        return list(freq)


_V_QWEN3_SMALL = dict(depth=24, hidden_size=1024, num_heads=16, intermediate_size=4096)
_V_QWEN3_LARGE = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304)
_V_QWEN35_SMALL = dict(depth=12, hidden_size=768, num_heads=12, intermediate_size=3072)  # unverified
_QWEN3 = dict(vocab_size=151936, kv_channels=128)
_QWEN35 = dict(vocab_size=248320, kv_channels=256, attention_output_gate=True, linear_attention_freq=4)


def _p(name, repo, vision, **kw) -> ModelSpec:
    return ModelSpec(name=name, hf_repo=repo, vision=VisionSpec(**vision, out_hidden_size=kw["hidden_size"]), **kw)


PRESETS: dict[str, ModelSpec] = {
    p.name: p
    for p in (
        # Qwen/Qwen3-VL-2B-Instruct
        _p("qwen3-vl-2b", "Qwen/Qwen3-VL-2B-Instruct", _V_QWEN3_SMALL, num_layers=28, hidden_size=2048,
           num_attention_heads=16, num_query_groups=8, ffn_hidden_size=6144, tie_word_embeddings=True, **_QWEN3),
        # Qwen/Qwen3-VL-4B-Instruct
        _p("qwen3-vl-4b", "Qwen/Qwen3-VL-4B-Instruct", _V_QWEN3_SMALL, num_layers=36, hidden_size=2560,
           num_attention_heads=32, num_query_groups=8, ffn_hidden_size=9728, tie_word_embeddings=True, **_QWEN3),
        # Qwen/Qwen3-VL-8B-Instruct
        _p("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", _V_QWEN3_LARGE, num_layers=36, hidden_size=4096,
           num_attention_heads=32, num_query_groups=8, ffn_hidden_size=12288, **_QWEN3),
        # Qwen/Qwen3-VL-32B-Instruct
        _p("qwen3-vl-32b", "Qwen/Qwen3-VL-32B-Instruct", _V_QWEN3_LARGE, num_layers=64, hidden_size=5120,
           num_attention_heads=64, num_query_groups=8, ffn_hidden_size=25600, **_QWEN3),
        # Qwen/Qwen3-VL-30B-A3B-Instruct
        _p("qwen3-vl-30b-a3b", "Qwen/Qwen3-VL-30B-A3B-Instruct", _V_QWEN3_LARGE, num_layers=48, hidden_size=2048,
           num_attention_heads=32, num_query_groups=4, ffn_hidden_size=6144, num_moe_experts=128,
           moe_ffn_hidden_size=768, moe_router_topk=8, **_QWEN3),
        # Qwen/Qwen3-VL-235B-A22B-Instruct
        _p("qwen3-vl-235b-a22b", "Qwen/Qwen3-VL-235B-A22B-Instruct", _V_QWEN3_LARGE, num_layers=94, hidden_size=4096,
           num_attention_heads=64, num_query_groups=4, ffn_hidden_size=12288, num_moe_experts=128,
           moe_ffn_hidden_size=1536, moe_router_topk=8, **_QWEN3),
        # Qwen/Qwen3.5-0.8B (vision tower sizes unverified)
        _p("qwen3.5-vl-0.8b", "Qwen/Qwen3.5-0.8B", _V_QWEN35_SMALL, num_layers=24, hidden_size=1024,
           num_attention_heads=8, num_query_groups=2, ffn_hidden_size=3584, tie_word_embeddings=True,
           linear_num_value_heads=16, **_QWEN35),
        # Qwen/Qwen3.5-2B (vision tower sizes unverified)
        _p("qwen3.5-vl-2b", "Qwen/Qwen3.5-2B", _V_QWEN35_SMALL, num_layers=24, hidden_size=2048,
           num_attention_heads=8, num_query_groups=2, ffn_hidden_size=6144, tie_word_embeddings=True,
           linear_num_value_heads=16, **_QWEN35),
        # Qwen/Qwen3.5-4B (vision tower sizes unverified)
        _p("qwen3.5-vl-4b", "Qwen/Qwen3.5-4B", _V_QWEN3_SMALL, num_layers=32, hidden_size=2560,
           num_attention_heads=16, num_query_groups=4, ffn_hidden_size=9216, tie_word_embeddings=True, **_QWEN35),
        # Qwen/Qwen3.5-9B (text sizes = transformers' Qwen3_5TextConfig defaults)
        _p("qwen3.5-vl-9b", "Qwen/Qwen3.5-9B", _V_QWEN3_LARGE, num_layers=32, hidden_size=4096,
           num_attention_heads=16, num_query_groups=4, ffn_hidden_size=12288, **_QWEN35),
        # Qwen/Qwen3.5-27B
        _p("qwen3.5-vl-27b", "Qwen/Qwen3.5-27B", _V_QWEN3_LARGE, num_layers=64, hidden_size=5120,
           num_attention_heads=24, num_query_groups=4, ffn_hidden_size=17408, linear_num_value_heads=48, **_QWEN35),
        # Qwen/Qwen3.5-35B-A3B
        _p("qwen3.5-vl-35b-a3b", "Qwen/Qwen3.5-35B-A3B", _V_QWEN3_LARGE, num_layers=40, hidden_size=2048,
           num_attention_heads=16, num_query_groups=2, ffn_hidden_size=512, num_moe_experts=256,
           moe_ffn_hidden_size=512, moe_router_topk=8, moe_shared_expert_intermediate_size=512, **_QWEN35),
        # Qwen/Qwen3.5-122B-A10B
        _p("qwen3.5-vl-122b-a10b", "Qwen/Qwen3.5-122B-A10B", _V_QWEN3_LARGE, num_layers=48, hidden_size=3072,
           num_attention_heads=32, num_query_groups=2, ffn_hidden_size=1024, num_moe_experts=256,
           moe_ffn_hidden_size=1024, moe_router_topk=8, moe_shared_expert_intermediate_size=1024,
           linear_num_value_heads=64, **_QWEN35),
        # Qwen/Qwen3.5-397B-A17B
        _p("qwen3.5-vl-397b-a17b", "Qwen/Qwen3.5-397B-A17B", _V_QWEN3_LARGE, num_layers=60, hidden_size=4096,
           num_attention_heads=32, num_query_groups=2, ffn_hidden_size=1024, num_moe_experts=512,
           moe_ffn_hidden_size=1024, moe_router_topk=10, moe_shared_expert_intermediate_size=1024,
           linear_num_value_heads=64, **_QWEN35),
    )
}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (case-insensitive; ``_`` and ``-`` interchangeable).

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    key = str(name).strip().lower().replace("_", "-")
    aliases = {k.replace("qwen3.5-vl", "qwen3.5"): k for k in PRESETS}
    key = aliases.get(key, key)
    if key not in PRESETS:
        raise ValueError(f"model preset {name!r} is not known; valid presets: {', '.join(PRESETS)} "
                         "(or pass --hf-config path/to/config.json)")
    return PRESETS[key]


def _field(config: dict, path: Path, name: str, default=None, required: bool = True):
    if name in config:
        value = config[name]
    elif not required:
        return default
    else:
        raise ValueError(f"{path}: field {name!r} is missing; a Qwen-VL style config.json needs it")
    return check_int(f"{path}: field {name!r}", value, 0)


def _vision_from_hf(vision: dict, path: Path, hidden: int) -> VisionSpec:
    def get(key, default=None):
        return _field(vision, path, key, default, required=default is None)

    patch = vision.get("patch_size", 16)
    temporal = vision.get("temporal_patch_size", 2)
    return VisionSpec(depth=get("depth"), hidden_size=get("hidden_size"), num_heads=get("num_heads"),
                      intermediate_size=get("intermediate_size"),
                      patch_size=patch[0] if isinstance(patch, (list, tuple)) else patch,
                      temporal_patch_size=temporal[0] if isinstance(temporal, (list, tuple)) else temporal,
                      spatial_merge_size=get("spatial_merge_size", 2), out_hidden_size=get("out_hidden_size", hidden))


def _linear_freq_from_hf(text: dict):
    layer_types = text.get("layer_types")
    if layer_types:
        if "linear_attention" not in layer_types:
            return None
        return tuple(1 if t == "linear_attention" else 0 for t in layer_types)
    interval = text.get("full_attention_interval")
    return interval if isinstance(interval, int) and "linear_num_value_heads" in text else None


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Parse a Hugging Face ``config.json`` (Qwen3-VL / Qwen3.5 style: ``text_config`` and
    ``vision_config``; a flat text config is accepted too) into a :class:`ModelSpec`.

    Raises:
        ValueError: missing file, bad JSON or a missing / non-integer field (named).
    """
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such config.json") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    text = config.get("text_config", config)
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        raise ValueError(f"{path}: field 'vision_config' is missing; the planner needs a VLM config")
    hidden = _field(text, path, "hidden_size")
    heads = _field(text, path, "num_attention_heads")
    experts = _field(text, path, "num_experts", required=False)
    freq = _linear_freq_from_hf(text)
    linear = {}
    if freq is not None:
        linear = {k: _field(text, path, k) for k in ("linear_key_head_dim", "linear_value_head_dim",
                                                     "linear_num_key_heads", "linear_num_value_heads",
                                                     "linear_conv_kernel_dim")}
    return ModelSpec(
        name=path.stem if path.stem != "config" else path.parent.name or "config", hf_repo=str(path),
        num_layers=_field(text, path, "num_hidden_layers"), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=_field(text, path, "num_key_value_heads", heads, required=False),
        kv_channels=_field(text, path, "head_dim", hidden // max(heads, 1), required=False),
        ffn_hidden_size=_field(text, path, "intermediate_size", _field(text, path, "moe_intermediate_size", 0, False),
                               required=experts is None),
        vocab_size=_field(text, path, "vocab_size"), vision=_vision_from_hf(vision, path, hidden),
        num_moe_experts=experts or None,
        moe_ffn_hidden_size=_field(text, path, "moe_intermediate_size", required=bool(experts)) if experts else None,
        moe_router_topk=_field(text, path, "num_experts_per_tok", required=bool(experts)) if experts else 0,
        moe_shared_expert_intermediate_size=_field(text, path, "shared_expert_intermediate_size", None, False) or None,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        attention_output_gate=freq is not None, linear_attention_freq=freq, **linear,
    )


def replace(spec: ModelSpec, **changes) -> ModelSpec:
    """A copy of ``spec`` with some fields changed (tests use tiny variants)."""
    return dataclasses.replace(spec, **changes)
