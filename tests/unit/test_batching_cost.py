"""``cost.sample.sample_cost``: a sample's cost is Megatron-Bridge's own FLOPs formula, its vision
attention counted per frame.

The expectation in every case is Megatron-Bridge's ``training/utils/flop_utils.py`` evaluated
directly for the one sample (``num_floating_point_operations`` for the language model at
``seqlen_sum = s``, ``seqlen_squared_sum = s^2``, plus, per ``(t, h, w)`` grid, ``vit_flops`` of ``t``
frames of ``h * w`` patches each: the vision model attends within each frame, docs/batching.md),
never the coefficients the package derived. Frames have patch counts that are multiples of
``spatial_merge_size^2`` (the formula's patch merger floors ``patches / merge^2``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron.bridge_thd.cost.sample import SampleCost, image_patches, sample_cost
from megatron.bridge_thd.cost.flops import flops_config
from megatron.bridge_thd.cost.presets import get_preset, replace, spec_from_hf_config
from megatron.bridge_thd_cpu.hf_hub import QWEN3_VL_8B, QWEN35_2B
from megatron.bridge_thd.upstream.loading import load_bridge_module, load_flop_utils

DENSE, MOE, HYBRID, HYBRID_MOE = "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-vl-2b", "qwen3.5-vl-35b-a3b"

# (LLM tokens, per-image (t, h, w) grids): text only, one image, several images of different sizes.
SAMPLES = [
    (1, []),
    (37, []),
    (300, [(1, 10, 12)]),
    (1500, [(1, 52, 24), (1, 16, 16)]),
    (4096, [(2, 20, 30), (1, 8, 8), (1, 4, 6)]),
    (32768, [(1, 64, 64)]),
]


@pytest.fixture(scope="module")
def flop_utils():
    return load_flop_utils()


def _formula(flop_utils, spec, tokens: int, grids) -> float:
    """Megatron-Bridge's FLOPs for one sample, straight from flop_utils."""
    cfg = flops_config(spec)
    merge = spec.vision.spatial_merge_size
    total = float(flop_utils.num_floating_point_operations(
        cfg, batch_size=1, seqlen_sum=tokens, seqlen_squared_sum=tokens * tokens, num_vision_patches=0))
    for t, h, w in grids:
        assert (h * w) % (merge * merge) == 0, "keep frames whole merge units (the merger floors)"
        total += float(flop_utils.vit_flops(cfg, t, h * w))  # t frames ("batch") of h * w patches each
    return total


def _evaluate(cost: SampleCost, tokens: int, grids) -> float:
    patches, squared = image_patches([grids])
    return float(cost(torch.tensor([tokens]), patches, squared)[0])


@pytest.mark.parametrize("preset", [DENSE, MOE, HYBRID, HYBRID_MOE])
def test_sample_cost_is_megatron_bridges_formula(flop_utils, preset):
    spec = get_preset(preset)
    cost = sample_cost(preset)
    for tokens, grids in SAMPLES:
        assert _evaluate(cost, tokens, grids) == pytest.approx(_formula(flop_utils, spec, tokens, grids), rel=1e-9)
    # Several samples at once: each is its own cost (no cross-sample term).
    tokens = torch.tensor([s for s, _ in SAMPLES])
    patches, squared = image_patches([g for _, g in SAMPLES])
    batch = cost(tokens, patches, squared)
    assert batch.dtype == torch.float64 and batch.shape == (len(SAMPLES),)
    for value, (s, g) in zip(batch.tolist(), SAMPLES):
        assert value == pytest.approx(_formula(flop_utils, spec, s, g), rel=1e-9)


def test_one_image_default_squares_the_patches(flop_utils):
    """patches_squared=None takes each sample's patches as one image: vit_flops of that image."""
    spec = get_preset(DENSE)
    cost = sample_cost(DENSE)
    value = float(cost([800], [1 * 40 * 36])[0])
    assert value == pytest.approx(_formula(flop_utils, spec, 800, [(1, 40, 36)]), rel=1e-9)
    # Two images are cheaper than one image of their combined patches (ViT attention is per image).
    two = _evaluate(cost, 800, [(1, 40, 18), (1, 40, 18)])
    assert two < value
    assert two == pytest.approx(_formula(flop_utils, spec, 800, [(1, 40, 18), (1, 40, 18)]), rel=1e-9)


def test_moe_costs_its_routed_experts_not_all_of_them(flop_utils):
    """The MoE preset's linear term follows top-k: with more experts per token the formula (and the
    cost) grows, with the same number of experts it does not depend on num_moe_experts."""
    spec = get_preset(MOE)
    base = sample_cost(spec)
    more_topk = replace(spec, moe_router_topk=2 * spec.moe_router_topk)
    assert sample_cost(more_topk).per_token > base.per_token
    more_experts = replace(spec, num_moe_experts=2 * spec.num_moe_experts)
    assert sample_cost(more_experts).per_token == pytest.approx(base.per_token, rel=1e-9)
    for tokens, grids in SAMPLES[2:4]:
        assert _evaluate(sample_cost(more_topk), tokens, grids) == pytest.approx(
            _formula(flop_utils, more_topk, tokens, grids), rel=1e-9)


@pytest.mark.parametrize("preset", [HYBRID, HYBRID_MOE])
def test_gated_deltanet_hybrid_pays_s_squared_on_full_attention_layers_only(flop_utils, preset):
    """Qwen3.5: 1 in 4 layers is full attention, the others Gated DeltaNet (linear in s). The same
    ModelSpec with every layer full attention has the same heads and head size per layer, so its s^2
    coefficient is (layers / full-attention layers) times the hybrid's."""
    hybrid = get_preset(preset)
    full = replace(hybrid, linear_attention_freq=None)
    full_layers = sum(1 for layer in range(hybrid.num_layers) if (layer + 1) % 4 == 0)
    assert hybrid.num_layers % 4 == 0 and full_layers == hybrid.num_layers // 4
    hybrid_cost, full_cost = sample_cost(hybrid), sample_cost(full)
    assert 0 < hybrid_cost.per_token_squared < full_cost.per_token_squared
    assert hybrid_cost.per_token_squared / full_cost.per_token_squared == pytest.approx(
        full_layers / hybrid.num_layers, rel=1e-9)
    # The all-full-attention variant is the formula too (the comparison is between two formula values).
    for tokens, grids in SAMPLES[3:5]:
        assert _evaluate(full_cost, tokens, grids) == pytest.approx(_formula(flop_utils, full, tokens, grids), rel=1e-9)
    # The vision tower does not depend on the language layers' kind.
    assert (hybrid_cost.per_patch, hybrid_cost.per_patch_squared) == (full_cost.per_patch, full_cost.per_patch_squared)


def test_text_only_drops_the_vision_terms(flop_utils):
    spec = get_preset(DENSE)
    cost = sample_cost(DENSE)
    text = cost.text_only()
    assert (text.per_token, text.per_token_squared) == (cost.per_token, cost.per_token_squared)
    assert (text.per_patch, text.per_patch_squared) == (0.0, 0.0)
    for tokens, grids in SAMPLES:
        language_only = _formula(flop_utils, spec, tokens, [])
        assert _evaluate(text, tokens, grids) == pytest.approx(language_only, rel=1e-9)
        if grids:
            assert _evaluate(cost, tokens, grids) > _evaluate(text, tokens, grids)


def test_image_patches_on_hand_grids():
    grids = [
        [(1, 4, 6), (2, 2, 2)],  # 24 + 8 patches: an image of 24, a video of 2 frames of 4
        [],  # text only
        [(1, 8, 8)],  # 64
        [(3, 2, 5), (1, 1, 4), (1, 10, 10)],  # 30 (3 frames of 10) + 4 + 100
    ]
    patches, squared = image_patches(grids)
    assert patches.dtype == torch.int64 and squared.dtype == torch.float64
    assert patches.tolist() == [32, 0, 64, 134]
    # Attention within each frame: a frame of n patches adds n^2, a video of t frames t segments.
    assert squared.tolist() == [24.0**2 + 2 * 4.0**2, 0.0, 64.0**2, 3 * 10.0**2 + 4.0**2 + 100.0**2]
    # Grids as tensors (image_grid_thw rows) read the same.
    as_tensors = [torch.tensor(g, dtype=torch.int64).reshape(-1, 3) for g in grids]
    again = image_patches([[tuple(row) for row in t.tolist()] for t in as_tensors])
    assert again[0].tolist() == patches.tolist() and again[1].tolist() == squared.tolist()


# Per sample, its images (t = 1) and videos (t > 1): mixed, several per sample, frames of different sizes.
MEDIA = [
    [(1, 4, 6), (3, 2, 5)],
    [(4, 8, 8)],
    [],
    [(1, 10, 10), (2, 6, 4), (1, 2, 2), (5, 4, 4)],
]


def _segment_squares(cu_seqlens: torch.Tensor) -> float:
    """Sum of the squared segment lengths of a ``cu_seqlens``: the attention work of the segments."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return float((lengths * lengths).sum())


def _check_against(build_cu_seqlens):
    """``image_patches`` per sample against the segments ``build_cu_seqlens(grid_thw)`` attends within."""
    patches, squared = image_patches(MEDIA)
    for sample, (p, q) in enumerate(zip(patches.tolist(), squared.tolist())):
        if not MEDIA[sample]:
            assert (p, q) == (0, 0.0)
            continue
        cu_seqlens = build_cu_seqlens(torch.tensor(MEDIA[sample], dtype=torch.int64))
        assert int(cu_seqlens[-1]) == p
        assert _segment_squares(cu_seqlens) == q, f"sample {sample}"
    # The whole batch's grids at once (one vision call): the same total.
    every = torch.tensor([g for grids in MEDIA for g in grids], dtype=torch.int64)
    assert _segment_squares(build_cu_seqlens(every)) == float(squared.sum())


def test_the_vision_term_is_the_vision_models_own_segments():
    """Megatron-Bridge's ``Qwen3VLVisionModel.build_packed_seq_params`` (the ``cu_seqlens`` every ViT layer's
    attention runs on; it reads only its argument, so it is called unbound) cuts a video into its frames: the
    squared term of ``image_patches`` is the sum of its segments' squared lengths, on the installed line."""
    vision = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.vision_model").Qwen3VLVisionModel

    def megatron_bridge(grid_thw):
        params = vision.build_packed_seq_params(None, grid_thw)
        assert torch.equal(params.cu_seqlens_q, params.cu_seqlens_kv)
        return params.cu_seqlens_q

    _check_against(megatron_bridge)
    # A video is not one segment of t * h * w (what the term was before): the grids here tell them apart.
    assert sum((t * h * w) ** 2 for grids in MEDIA for t, h, w in grids) != float(image_patches(MEDIA)[1].sum())


def test_the_vision_term_is_hugging_faces_segments_too():
    """Hugging Face's Qwen3-VL vision model builds its ``cu_seqlens`` with ``get_vision_cu_seqlens`` (the name its
    ``forward`` calls, read from its module); the same segments."""
    modeling = pytest.importorskip("transformers.models.qwen3_vl.modeling_qwen3_vl")
    if not hasattr(modeling, "get_vision_cu_seqlens"):
        pytest.skip("this transformers' Qwen3-VL vision model computes its cu_seqlens inline (not callable)")
    _check_against(lambda grid_thw: modeling.get_vision_cu_seqlens(grid_thw))


def test_the_vision_term_is_the_trainers_where_its_flops_count_per_frame(flop_utils):
    """Where the installed Megatron-Bridge's FLOPs take grid statistics (``vision_patch_stats_from_grid_thw``, the 0.7
    line), their squared sum is ``image_patches``'; 0.6.2's ``vit_flops`` takes patches per image (docs/batching.md)."""
    if not hasattr(flop_utils, "vision_patch_stats_from_grid_thw"):
        pytest.skip("this Megatron-Bridge's FLOPs take no grid statistics (0.6.2: vit_flops per image)")
    patches, squared = image_patches(MEDIA)
    for grids, p, q in zip(MEDIA, patches.tolist(), squared.tolist()):
        grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
        patch_sum, patch_squared_sum, _ = flop_utils.vision_patch_stats_from_grid_thw(grid_thw, spatial_merge_size=2)
        assert (int(patch_sum), float(patch_squared_sum)) == (p, q)


@pytest.mark.parametrize("model", [42, None, 3.5, ["qwen3-vl-8b"], "no-such-model", "qwen3-vl-9000b"])
def test_bad_model_argument(model):
    with pytest.raises(ValueError):
        sample_cost(model)


def test_missing_or_broken_config_path(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        sample_cost(str(tmp_path / "absent" / "config.json"))
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        sample_cost(broken)
    no_vision = tmp_path / "text" / "config.json"
    no_vision.parent.mkdir()
    no_vision.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                                     "vocab_size": 100, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="vision_config"):
        sample_cost(no_vision)


def _write(path: Path, config: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_config_json_path_is_the_formula_of_that_config(flop_utils, tmp_path):
    # A small hand-written Qwen-VL style config with every field spec_from_hf_config needs.
    small = {
        "text_config": {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
                        "num_hidden_layers": 3, "intermediate_size": 704, "vocab_size": 1000},
        "vision_config": {"depth": 2, "hidden_size": 128, "num_heads": 4, "intermediate_size": 512,
                          "spatial_merge_size": 2, "out_hidden_size": 256},
    }
    path = _write(tmp_path / "small" / "config.json", small)
    spec = spec_from_hf_config(path)
    for model in (str(path), path):
        cost = sample_cost(model)
        for tokens, grids in SAMPLES:
            assert _evaluate(cost, tokens, grids) == pytest.approx(_formula(flop_utils, spec, tokens, grids), rel=1e-9)
    # A file whose name does not end in .json is read as a config too.
    other = _write(tmp_path / "small-config", small)
    assert sample_cost(str(other)).per_token == pytest.approx(sample_cost(path).per_token, rel=1e-12)


def test_published_configs_match_their_presets(tmp_path):
    """The Qwen3-VL-8B and Qwen3.5-2B config.json files of the test bed's offline hub give the same
    coefficients as the planner presets written for them (two sources, one model)."""
    for config, preset in ((QWEN3_VL_8B, DENSE), (QWEN35_2B, HYBRID)):
        from_file = sample_cost(_write(tmp_path / preset / "config.json", config))
        from_preset = sample_cost(preset)
        assert from_file.per_token_squared == pytest.approx(from_preset.per_token_squared, rel=1e-9)
        assert from_file.per_token == pytest.approx(from_preset.per_token, rel=1e-9)
        assert from_file.name == preset  # the folder name, as the config.json has no better one


def test_model_spec_argument(flop_utils):
    spec = replace(get_preset(DENSE), num_layers=2)
    cost = sample_cost(spec)
    assert cost.name == spec.name
    for tokens, grids in SAMPLES:
        assert _evaluate(cost, tokens, grids) == pytest.approx(_formula(flop_utils, spec, tokens, grids), rel=1e-9)
