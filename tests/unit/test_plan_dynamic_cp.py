"""The planner's comparison of static context parallelism with a CP size per sample (``plan/dynamic_cp.py``) and
the synthetic video mix it draws (``plan/video_mix.py``); docs/dynamic-cp.md."""

from __future__ import annotations

import pytest

from megatron.bridge_thd.batching.cost import sample_cost
from megatron.bridge_thd.plan.dynamic_cp import compare_cp, format_cp_comparison
from megatron.bridge_thd.plan.plan_command import main
from megatron.bridge_thd.plan.presets import get_preset
from megatron.bridge_thd.plan.roofline import get_gpu
from megatron.bridge_thd.plan.samples import SampleLengths
from megatron.bridge_thd.plan.video_mix import VIDEO_GEOMETRY, video_mix_lengths

SPEC = get_preset("qwen3-vl-2b")
GPU = get_gpu("h100-sxm")


def _text(*tokens) -> SampleLengths:
    return SampleLengths(tuple(tokens), tuple(() for _ in tokens), source="test")


def test_equal_samples_give_the_times_the_model_defines():
    """8 text samples of 1,000 tokens, 2 ranks, 1,000 tokens per rank, one step of 8.

    Static CP 1: 2 replicas, 4 one-sample rows each: 4 sample-times per step, balanced. Static CP 2: 1 replica, rows
    of 2,000 slots (2 samples, each aligned to 4 = 1,000), each row half the FLOPs per rank plus the K/V exchange of
    its 2 samples: the step is the same compute plus 8 samples' exchange. CP per sample: every sample fits one rank
    (1,000 slots, aligned to 2 x 2), so all take CP 1."""
    samples = _text(*[1000] * 8)
    static_1, static_2, per_sample = compare_cp(SPEC, samples, gpus=2, global_batch_size=8, max_tokens_per_rank=1000,
                                                gpu=GPU, mfu=0.5)
    sample_s = float(sample_cost(SPEC)([1000])[0]) / (GPU.bf16_flops * 0.5)
    full_attention = SPEC.linear_layer_pattern().count(0)
    kv_bytes = 2 * SPEC.num_query_groups * SPEC.kv_channels * 2 * full_attention  # K and V, bf16, per token
    exchange_s = 3 * 1000 * (2 - 1) / 2 * kv_bytes / GPU.link_bytes_per_s  # per sample on 2 ranks
    assert static_1.fits and static_1.step_s == pytest.approx(4 * sample_s, rel=1e-12)
    assert static_1.imbalance == pytest.approx(1.0) and static_1.peak_tokens == 1000 and static_1.padding == 0
    assert static_2.fits and static_2.step_s == pytest.approx(4 * sample_s + 8 * exchange_s, rel=1e-12)
    assert static_2.peak_tokens == 1000  # a 2,000-slot row, half on each rank
    assert per_sample.fits and per_sample.cp_sizes == ((1, 8),)
    assert per_sample.step_s >= 4 * sample_s * (1 - 1e-12)  # 8 sample-times on 2 ranks: at best 4 each


def test_a_sample_longer_than_a_ways_ranks_hold_does_not_fit_it():
    samples = _text(5000, 100, 100, 100)
    estimates = compare_cp(SPEC, samples, gpus=4, global_batch_size=4, max_tokens_per_rank=1500, gpu=GPU)
    by_name = {e.name: e for e in estimates}
    # 5,000 tokens need 4 x 1,500 (CP 4); CP 1 and 2 hold 1,500 / 3,000.
    assert not by_name["static CP 1"].fits and not by_name["static CP 2"].fits
    assert "5000-token sample" in by_name["static CP 1"].why
    assert by_name["static CP 4"].fits and by_name["CP per sample"].fits
    assert dict(by_name["CP per sample"].cp_sizes)[4] >= 1  # the long one on all four ranks
    longer = compare_cp(SPEC, _text(7000, 100, 100, 100), gpus=4, global_batch_size=4, max_tokens_per_rank=1500,
                        gpu=GPU)
    assert not any(e.fits for e in longer)
    assert "max_tokens_per_rank" in longer[-1].why
    table = format_cp_comparison(longer, max_tokens_per_rank=1500)
    assert table.count("does not fit") == len(longer)


def test_a_video_takes_less_row_time_than_one_image_of_its_patches():
    """The row times' FLOPs (``sample_cost`` on ``image_patches``): a video of 4 frames of 16 x 16 patches costs
    ``per_patch_squared * 256^2 * 3`` less than an image of 32 x 32 (the same 1,024 patches and tokens), its
    attention being within each frame (4 * 256^2 against 1,024^2)."""
    from megatron.bridge_thd.plan.dynamic_cp import _RowTime

    samples = SampleLengths((600, 600), (((4, 16, 16),), ((1, 32, 32),)), source="test")
    cost = sample_cost(SPEC)
    video, image = _RowTime(SPEC, samples, GPU, 0.5, 1).flops
    assert image - video == pytest.approx(cost.per_patch_squared * (1024**2 - 4 * 256**2), rel=1e-9)
    assert video < image


def test_the_world_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two DP x CP world"):
        compare_cp(SPEC, _text(10, 10, 10), gpus=6, global_batch_size=3, max_tokens_per_rank=64, gpu=GPU)


def test_the_video_mix_is_what_its_docstring_says():
    samples = video_mix_lengths(400, video_share=0.25, seed=3)
    assert samples == video_mix_lengths(400, video_share=0.25, seed=3)  # seeded
    fps, most_frames, per_temporal_patch, side, merge, stamp = VIDEO_GEOMETRY
    videos = [(n, grids[0]) for n, grids in zip(samples.tokens, samples.grids) if grids and grids[0][0] > 1]
    assert len(videos) == 100  # 25% of 400
    for tokens, (t, h, w) in videos:
        assert (h, w) == (side, side) and 2 <= t <= most_frames // per_temporal_patch
        answer = tokens - t * (side * side // (merge * merge) + stamp) - 30
        assert 16 <= answer <= 1024
    assert max(samples.tokens) > 10_000  # long-tailed: videos of minutes


def test_the_command_prints_the_comparison_and_names_its_options(capsys):
    assert main(["--dynamic-cp", "16384", "--num-samples", "64", "--global-batch-size", "32", "--model",
                 "qwen3-vl-2b"]) == 0
    out = capsys.readouterr().out
    assert "synthetic video mix" in out and "| CP per sample |" in out and "| static CP 8 |" in out
    assert main(["--dynamic-cp", "16384", "--cp", "2"]) == 2
    assert "--dynamic-cp" in capsys.readouterr().err
