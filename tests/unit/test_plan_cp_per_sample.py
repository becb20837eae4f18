"""The planner's comparison of static context parallelism with a CP size per sample (``plan/cp_per_sample.py``) and
the synthetic mixes it draws (``plan/video_mix.py``, ``plan/text_mix.py``); docs/cp-per-sample.md."""

from __future__ import annotations

import pytest

from megatron.bridge_thd.cost.step_time import FITTED, SampleWork, get_machine, model_shape, row_time
from megatron.bridge_thd.plan.cp_per_sample import MEGATRON, OURS, compare_cp, format_cp_comparison
from megatron.bridge_thd.plan.plan_command import main
from megatron.bridge_thd.cost.presets import get_preset
from megatron.bridge_thd.plan.samples import SampleLengths
from megatron.bridge_thd.plan.text_mix import TEXT_MIX, text_mix_lengths
from megatron.bridge_thd.plan.video_mix import VIDEO_GEOMETRY, video_mix_lengths

SPEC = get_preset("qwen3-vl-2b")
GPU = "h100-sxm"


def _text(*tokens) -> SampleLengths:
    return SampleLengths(tuple(tokens), tuple(() for _ in tokens), source="test")


def _row(tokens, cp):
    return row_time(model_shape(SPEC), [SampleWork(n) for n in tokens], get_machine(GPU), FITTED, cp=cp,
                    align=2 * cp if cp > 1 else 1).total


def test_equal_samples_give_the_times_the_model_defines():
    """8 text samples of 1,000 tokens, 2 ranks, 1,000 tokens per rank, one step of 8.

    Static CP 1: 2 replicas, 4 one-sample rows each: 4 row times per step, balanced. Static CP 2: 1 replica, rows
    of 2,000 slots (2 samples, each aligned to 4 = 1,000), 4 rows at CP 2. Both priced by ``row_time``, plus the
    per-step fixed cost. CP per sample: every sample fits one rank (1,000 slots), so Megatron-Core's scheduler gives
    all CP 1; ours is never slower than it."""
    samples = _text(*[1000] * 8)
    static_1, static_2, megatron, ours = compare_cp(SPEC, samples, gpus=2, global_batch_size=8,
                                                    max_tokens_per_rank=1000, gpu=GPU)
    per_step = FITTED.per_step_s
    assert static_1.fits and static_1.step_s == pytest.approx(4 * _row([1000], 1) + per_step, rel=1e-12)
    assert static_1.imbalance == pytest.approx(1.0) and static_1.peak_tokens == 1000 and static_1.padding == 0
    assert static_2.fits and static_2.step_s == pytest.approx(4 * _row([1000, 1000], 2) + per_step, rel=1e-12)
    assert static_2.peak_tokens == 1000  # a 2,000-slot row, half on each rank
    assert megatron.name == MEGATRON and megatron.fits and megatron.cp_sizes == ((1, 8),)
    assert ours.name == OURS and ours.fits and ours.step_s <= megatron.step_s
    assert ours.peak_tokens <= 1000


def test_a_sample_longer_than_a_ways_ranks_hold_does_not_fit_it():
    samples = _text(5000, 100, 100, 100)
    estimates = compare_cp(SPEC, samples, gpus=4, global_batch_size=4, max_tokens_per_rank=1500, gpu=GPU)
    by_name = {e.name: e for e in estimates}
    # 5,000 tokens need 4 x 1,500 (CP 4); CP 1 and 2 hold 1,500 / 3,000.
    assert not by_name["static CP 1"].fits and not by_name["static CP 2"].fits
    assert "5000-token sample" in by_name["static CP 1"].why
    assert by_name["static CP 4"].fits and by_name[MEGATRON].fits and by_name[OURS].fits
    assert dict(by_name[MEGATRON].cp_sizes)[4] >= 1 and dict(by_name[OURS].cp_sizes)[4] >= 1
    longer = compare_cp(SPEC, _text(7000, 100, 100, 100), gpus=4, global_batch_size=4, max_tokens_per_rank=1500,
                        gpu=GPU)
    assert not any(e.fits for e in longer)
    assert "max_tokens_per_rank" in longer[-1].why
    table = format_cp_comparison(longer, max_tokens_per_rank=1500)
    assert table.count("does not fit") == len(longer)


def test_a_video_takes_less_row_time_than_one_image_of_its_patches():
    """The row time's vision tower attends within each frame: a video of 4 frames of 16 x 16 patches takes less than
    an image of 32 x 32 (the same 1,024 patches and tokens) by exactly its attention over one 1,024-patch frame less
    four 256-patch frames, and the same everything else."""
    from megatron.bridge_thd.cost.step_time import sample_work

    shape, machine = model_shape(SPEC), get_machine(GPU)
    video = row_time(shape, [sample_work(600, [(4, 16, 16)])], machine, FITTED)
    image = row_time(shape, [sample_work(600, [(1, 32, 32)])], machine, FITTED)

    def attention(patches):  # one frame's ViT attention: its vision time less its patches' GEMMs alone
        return (row_time(shape, [SampleWork(600, patches, (patches,))], machine, FITTED).vision
                - row_time(shape, [SampleWork(600, patches, ())], machine, FITTED).vision)

    assert image.vision - video.vision == pytest.approx(attention(1024) - 4 * attention(256), rel=1e-9)
    assert video.vision < image.vision and video.gemm == image.gemm


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


def test_the_text_mix_is_what_its_docstring_says():
    samples = text_mix_lengths(20_000, seed=1)
    assert samples == text_mix_lengths(20_000, seed=1) and not any(samples.grids)
    median, sigma, low, high = TEXT_MIX
    tokens = sorted(samples.tokens)
    assert low <= tokens[0] and tokens[-1] <= high
    assert abs(tokens[len(tokens) // 2] - median) < 0.05 * median
    assert 0.02 < sum(n > 16384 for n in tokens) / len(tokens) < 0.05  # "about 3% over 16,384"
    assert 0.005 < tokens.count(high) / len(tokens) < 0.015  # "1% at the cap"


def test_the_command_prints_the_comparison_and_names_its_options(capsys):
    assert main(["--cp-per-sample", "16384", "--num-samples", "64", "--global-batch-size", "32", "--model",
                 "qwen3-vl-2b"]) == 0
    out = capsys.readouterr().out
    assert "synthetic video mix" in out and f"| {MEGATRON} |" in out and f"| {OURS} |" in out
    assert "| static CP 8 |" in out
    assert main(["--cp-per-sample", "16384", "--num-samples", "64", "--global-batch-size", "32", "--text-mix"]) == 0
    assert "synthetic long-tailed text mix" in capsys.readouterr().out
    assert main(["--cp-per-sample", "16384", "--cp", "2"]) == 2
    assert "--cp-per-sample" in capsys.readouterr().err
    assert main(["--cp-per-sample", "16384", "--gpu", "v100"]) == 2
    assert "time model" in capsys.readouterr().err
