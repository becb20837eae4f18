"""bridge-thd plan with and without global-batch packing (plan.balance): the slowest rank's step
time, the static row's padding and per-rank cost max / mean against hand computations on tiny
cases, the thd_static row buckets (--row-buckets) against a brute force, and the --global-batch-size
and --row-buckets flags with their errors."""

from __future__ import annotations

import warnings
from itertools import combinations, product

import pytest

from megatron.bridge_thd.plan.balance import balance_plan
from megatron.bridge_thd.plan.estimate import PlanSettings
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.plan.samples import SampleLengths
from megatron.bridge_thd.plan.cli import main
from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec, get_preset
from megatron.bridge_thd.cost.step_time import RateCurve, TimeParameters
from megatron.bridge_thd.plan.roofline import GPU

warnings.simplefilter("ignore")

# The tiny dense model of tests/unit/test_plan.py: hidden 8, q = 2 heads x 4 = 8, kv = 1 x 4 = 4, ffn 16, 2 layers,
# vocabulary 128 (already a multiple of 128).
TINY = ModelSpec(name="tiny", hf_repo="none", num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                 kv_channels=4, ffn_hidden_size=16, vocab_size=128,
                 vision=VisionSpec(depth=1, hidden_size=4, num_heads=1, intermediate_size=8, out_hidden_size=8))
H, Q, KV, F, L, V = 8, 8, 4, 16, 2, 128
PER_SLOT = 6 * H * 3 * F * L + 6 * L * (H * (Q + 2 * KV) + Q * H) + 6 * H * V  # fwd + bwd FLOPs per token slot
PER_SQUARED = 6 * L * Q  # fwd + bwd FLOPs per unit of sum s^2 (causal attention core)
PEAK = 1e15
# Memory and links never bind (bandwidth ~ infinite), GEMMs at the peak, and attention at rates whose forward (a
# third of the trainer's attention FLOPs, at PEAK) and backward (2.5 x the forward's FLOPs at 1.25 PEAK: two thirds
# of the trainer's) sum to FLOPs / PEAK, no fixed costs: a micro-batch takes exactly its FLOPs / PEAK.
COMPUTE_ONLY = GPU("compute-only", PEAK, 1e30, 80e9, 1e30)
_FLAT, _FLAT_BACKWARD = RateCurve(((1, PEAK),)), RateCurve(((1, 1.25 * PEAK),))
EXACT = TimeParameters(_FLAT, _FLAT_BACKWARD, _FLAT, _FLAT_BACKWARD, gemm_efficiency=1.0)


def _seconds(slots: int, lengths) -> float:
    """A micro-batch's time by hand on the compute-only machine: (linear in slots + attention in sum s^2) / peak."""
    return (PER_SLOT * slots + PER_SQUARED * sum(s * s for s in lengths)) / PEAK


def _cost(s: int) -> float:
    """Per-sample cost by hand (no images): the same FLOPs for one sample alone."""
    return PER_SLOT * s + PER_SQUARED * s * s


def _text(*lengths) -> SampleLengths:
    return SampleLengths(tuple(lengths), tuple(() for _ in lengths))


def _settings(micro_batch_size=2, gpus=2, micro_batches=1, seq_length=8, pp=1, overhead_s=0.0):
    return PlanSettings(seq_length, micro_batch_size, Parallel(pp=pp, gpus=gpus), micro_batches, COMPUTE_ONLY, EXACT,
                        overhead_s)


def _smallest_row(lengths, rows: int) -> int:
    """Smallest row that some split of ``lengths`` into ``rows`` non-empty rows fits (brute force)."""
    best = None
    for labels in product(range(rows), repeat=len(lengths)):
        if len(set(labels)) < rows:
            continue
        load = max(sum(n for n, r in zip(lengths, labels) if r == k) for k in range(rows))
        best = load if best is None else min(best, load)
    return best


def test_the_slowest_rank_sets_the_step_and_packing_balances_it():
    # DP 2, micro-batch 2, one step: in-batch gives rank 0 (8, 8) and rank 1 (1, 1); the balanced split is
    # (8, 1) on each rank.
    b = balance_plan(TINY, _text(8, 8, 1, 1), _settings())
    assert (b.global_batch_size, b.num_micro_batches, b.steps) == (4, 1, 1)
    thd, static, bshd = (b.layouts[k] for k in ("thd", "thd_static", "bshd"))
    assert thd["in-batch"].step_s == pytest.approx(_seconds(16, (8, 8)))
    assert thd["packed"].step_s == pytest.approx(_seconds(9, (8, 1)))
    assert b.speedup("thd") == pytest.approx(_seconds(16, (8, 8)) / _seconds(9, (8, 1)))
    # rank times (8, 8) vs (1, 1): max / mean
    slow, fast = _seconds(16, (8, 8)), _seconds(2, (1, 1))
    assert thd["in-batch"].rank_time_imbalance == pytest.approx(slow / ((slow + fast) / 2))
    assert thd["packed"].rank_time_imbalance == pytest.approx(1.0)
    # thd_static in-batch: every row micro_batch_size * seq_length = 16 slots; packed: the row chosen is 9
    assert static["in-batch"].row_length == 16 and static["in-batch"].step_s == pytest.approx(_seconds(16, (8, 8)))
    assert b.static_row == 9 and static["packed"].row_length == 9
    assert static["packed"].step_s == pytest.approx(_seconds(9, (8, 1)))
    # bshd: width 8 rounded up to Megatron-Bridge's multiple of 16, on both ranks; no packed figures
    assert bshd["in-batch"].step_s == pytest.approx(_seconds(2 * 16, (16, 16)))
    assert bshd["packed"].refused and "configure refuses" in bshd["packed"].refused


def test_static_row_padding_and_the_row_chosen_from_the_data():
    lengths = (5, 5, 5, 1)
    b = balance_plan(TINY, _text(*lengths), _settings(), row_buckets=1)
    # the lower bound max(longest, ceil(16 / 2 rows)) = 8 does not fit (5 + 5 + 5 + 1 cannot split 8 / 8)
    assert b.static_row == _smallest_row(lengths, 2) == 10
    assert b.static_rows == (10,) and b.static_row_use == (1.0,)
    static = b.layouts["thd_static"]
    real = sum(lengths)
    assert static["in-batch"].padding == pytest.approx(1 - real / (2 * 16))
    assert static["packed"].padding == pytest.approx(1 - real / (2 * 10))
    assert static["in-batch"].slots == 16 and static["packed"].slots == 10
    assert b.layouts["thd"]["in-batch"].padding == pytest.approx(0.0)  # align 1: thd slots are the real tokens


@pytest.mark.parametrize("row_buckets", [2, 4])
def test_a_second_row_takes_the_shorter_micro_batch(row_buckets):
    # The only split of 5, 5, 5, 1 into two rows of at most 10 slots is {5, 5} | {5, 1}: micro-batches of 10 and 6
    # slots. With two rows or more those are the rows (6, 10), each micro-batch takes its own: no padding.
    lengths = (5, 5, 5, 1)
    one = balance_plan(TINY, _text(*lengths), _settings(), row_buckets=1)
    b = balance_plan(TINY, _text(*lengths), _settings(), row_buckets=row_buckets)
    assert b.static_row == 10 and b.static_rows == (6, 10) and b.static_row_use == (0.5, 0.5)
    static = b.layouts["thd_static"]["packed"]
    assert static.row_length == 10 and static.slots == 8 and static.padding == pytest.approx(0.0)
    # the placement is the longest row's: the same per-rank balance; each micro-batch runs its own row's slots
    assert static.rank_cost_imbalance == one.layouts["thd_static"]["packed"].rank_cost_imbalance
    assert static.step_s == pytest.approx(max(_seconds(10, (5, 5)), _seconds(6, (5, 1))))
    assert one.layouts["thd_static"]["packed"].step_s == pytest.approx(_seconds(10, (5, 5)))


def _best_rows(slots, count: int, largest: int):
    """Brute force: every set of at most ``count - 1`` rows below ``largest`` (any length 1..largest - 1), each
    micro-batch in the shortest that holds it; ``(least total slots, [every row set reaching it])``."""
    best, winners = None, []
    for k in range(count):
        for shorter in combinations(range(1, largest), k):
            rows = (*shorter, largest)
            total = sum(min(r for r in rows if r >= s) for s in slots)
            if best is None or total < best:
                best, winners = total, [rows]
            elif total == best:
                winners.append(rows)
    return best, winners


def test_the_rows_are_a_brute_force_optimum_on_a_tiny_run():
    # Micro-batch size 1 on DP 2 x 2 micro-batches: 4 samples per step and 4 micro-batches, none empty (assign's
    # contract), so every micro-batch holds exactly one sample and its slots are that sample's length.
    steps = [(9, 12, 1, 15), (8, 2, 6, 4), (12, 16, 8, 13)]
    slots = [n for step in steps for n in step]
    settings = _settings(micro_batch_size=1, micro_batches=2, seq_length=16)
    one = balance_plan(TINY, _text(*slots), settings, row_buckets=1)
    assert one.static_row == 16  # the longest sample; every micro-batch holds one sample, so every step fits
    for count in (2, 3, 4):
        b = balance_plan(TINY, _text(*slots), settings, row_buckets=count)
        total, winners = _best_rows(slots, count, 16)
        assert len(winners) == 1, "the tiny case is chosen so that the optimum is unique"
        assert b.static_rows == winners[0] and b.static_row == 16
        static = b.layouts["thd_static"]["packed"]
        assert static.slots == pytest.approx(total / len(slots))
        assert static.padding == pytest.approx(1 - sum(slots) / total)
        assert b.static_row_use == tuple(
            sum(1 for s in slots if min(r for r in b.static_rows if r >= s) == row) / len(slots) for row in b.static_rows)
        assert static.padding <= one.layouts["thd_static"]["packed"].padding
    assert one.layouts["thd_static"]["packed"].padding == pytest.approx(1 - sum(slots) / (16 * len(slots)))


def test_row_buckets_lower_the_padding_of_a_real_preset_and_every_micro_batch_fits_its_row():
    from megatron.bridge_thd import layouts
    from megatron.bridge_thd.cost.sample import sample_cost
    from megatron.bridge_thd.plan.samples import receipt_lengths
    from megatron.bridge_thd.plan.balance import plan_steps, step_assignments

    samples, settings = receipt_lengths(256, 0), PlanSettings(2048, 4, Parallel(gpus=8))
    one = balance_plan(get_preset("qwen3-vl-8b"), samples, settings, 128, row_buckets=1)
    b = balance_plan(get_preset("qwen3-vl-8b"), samples, settings, 128, row_buckets=4)
    assert one.static_rows == (one.static_row,) and b.static_row == one.static_row
    assert 1 < len(b.static_rows) <= 4 and list(b.static_rows) == sorted(set(b.static_rows))
    before, after = one.layouts["thd_static"]["packed"], b.layouts["thd_static"]["packed"]
    assert after.padding < before.padding and after.step_s < before.step_s
    assert after.rank_cost_imbalance == before.rank_cost_imbalance  # the same placement
    assert after.activation_peak <= before.activation_peak
    # every micro-batch's aligned slots fit the row it takes, and those rows' slots are the padding's denominator
    real = taken = 0
    for step in plan_steps(samples, 128, 2048):
        for rank in step_assignments(step, "packed", dp=8, micro_batch_size=4, num_micro_batches=b.num_micro_batches,
                                     row_length=b.static_row, align=1, cost=sample_cost(b.spec)):
            for members in rank:
                need = sum(step.lengths[i] for i in members)
                row = min(r for r in b.static_rows if r >= need)
                assert row == b.static_rows[layouts.row_bucket(b.static_rows, need)]
                real, taken = real + need, taken + row
    assert after.padding == pytest.approx(1 - real / taken)
    # the rows as CUDA graphs: more than one graph of the longest row, at most every row's activations
    g = b.graph_memory
    assert g.rows == b.static_rows and g.layers[-1] < g.shared < g.separate
    assert one.graph_memory.shared == one.graph_memory.separate == one.graph_memory.layers[-1]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_row_buckets_are_refused_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--row-buckets: expected an int >= 1"):
        balance_plan(TINY, _text(8, 8, 1, 1), _settings(), row_buckets=bad)


def test_per_rank_cost_max_over_mean_by_hand():
    b = balance_plan(TINY, _text(8, 8, 1, 1), _settings())
    ranks = [2 * _cost(8), 2 * _cost(1)]
    expected = max(ranks) / (sum(ranks) / 2)
    for layout in ("thd", "thd_static", "bshd"):
        assert b.layouts[layout]["in-batch"].rank_cost_imbalance == pytest.approx(expected)
    assert b.layouts["thd"]["packed"].rank_cost_imbalance == pytest.approx(1.0)
    assert b.layouts["thd_static"]["packed"].rank_cost_imbalance == pytest.approx(1.0)


def test_a_video_of_t_frames_is_cheaper_than_one_image_of_its_patches():
    """A video of 4 frames of 8 x 8 patches and an image of 16 x 16: the same 256 patches, the same 80 tokens. The
    vision model attends within each frame, so the video's attention term is 4 * 64^2, a quarter of the image's
    256^2; balance's per-rank cost (one sample per rank, in-batch) sees the difference, by hand from the cost's
    coefficients."""
    from megatron.bridge_thd.cost.sample import sample_cost
    from megatron.bridge_thd.plan.balance import plan_steps

    video, image = (4, 8, 8), (1, 16, 16)
    samples = SampleLengths((80, 80), (((video,)), ((image,))))
    c = sample_cost(TINY)
    assert c.per_patch_squared > 0

    def by_hand(t, h, w):
        return c.per_token * 80 + c.per_token_squared * 80**2 + c.per_patch * t * h * w + c.per_patch_squared * t * (
            h * w) ** 2

    (step,) = plan_steps(samples, 2, 128)
    assert step.patches == (256, 256) and step.patches_squared == (4 * 64.0**2, 256.0**2)
    b = balance_plan(TINY, samples, _settings(micro_batch_size=1, gpus=2, seq_length=128))
    ranks = [by_hand(*video), by_hand(*image)]
    assert ranks[0] < ranks[1]
    assert b.layouts["thd"]["in-batch"].rank_cost_imbalance == pytest.approx(max(ranks) / (sum(ranks) / 2), rel=1e-12)
    assert b.layouts["thd"]["in-batch"].rank_cost_imbalance > 1 + 1e-9  # equal costs would give 1


def test_steps_are_consecutive_global_batches_averaged_with_bubble_and_overhead():
    # Two steps of 4 (the ninth sample is dropped); PP 2 (gpus 4 = PP2 x DP2), two micro-batches of 1 per rank.
    samples = _text(8, 2, 2, 2, 4, 4, 4, 4, 7)
    settings = _settings(micro_batch_size=1, gpus=4, micro_batches=2, pp=2, overhead_s=0.5)
    b = balance_plan(TINY, samples, settings)
    assert (b.global_batch_size, b.num_micro_batches, b.steps) == (4, 2, 2)
    bubble = 1 + (2 - 1) / 2

    def rank(*micro):  # FLOPs divide over the 2 pipeline stages
        return sum(_seconds(n, (n,)) for n in micro) / 2 * bubble + 0.5

    # in-batch: rank r's j-th micro-batch is sample j * DP + r of the step
    first = max(rank(8, 2), rank(2, 2))
    second = max(rank(4, 4), rank(4, 4))
    assert b.layouts["thd"]["in-batch"].step_s == pytest.approx((first + second) / 2)
    assert b.layouts["thd"]["in-batch"].samples_per_s == pytest.approx(4 / ((first + second) / 2))


def test_default_global_batch_is_micro_batch_size_times_micro_batches_times_dp():
    b = balance_plan(TINY, _text(*([3, 5] * 8)), _settings(micro_batches=2))
    assert b.global_batch_size == 2 * 2 * 2 and b.steps == 2


def test_bad_global_batch_sizes_are_refused_naming_the_flag():
    for bad, words in ((0, "int >= 1"), (8, "larger than the 4 samples")):
        with pytest.raises(ValueError, match=f"--global-batch-size.*{words}"):
            balance_plan(TINY, _text(8, 8, 1, 1), _settings(), bad)
    # The multiple-of rule is the rules registry's (global_batch_size), worded with the setting it is about.
    with pytest.raises(ValueError, match=r"train.global_batch_size: 6 is not a multiple of micro_batch_size \* DP = "
                       r"2 x 2 = 4 .*set it to e.g. 4"):
        balance_plan(TINY, _text(8, 8, 1, 1), _settings(), 6)


def test_cli_prints_both_placements_and_takes_the_flag(capsys):
    args = ["--model", "qwen3-vl-8b", "--num-samples", "64", "--seq-length", "2048", "--micro-batch-size", "4"]
    assert main(args + ["--global-batch-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "| thd |" in out and "| thd_static |" in out  # the existing table is still printed
    assert "2 micro-batch(es)/step" in out  # 64 = 4 x 2 x DP8
    assert "global batch 64 = DP8 x 2 micro-batch(es)" in out
    for layout, placement in product(("bshd", "thd", "thd_static"), ("in-batch (Megatron-Bridge)", "global-batch packing")):
        assert f"| {layout} | {placement} |" in out
    assert main(args) == 0
    assert "global batch 32 = DP8 x 1 micro-batch(es)" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--global-batch-size", "48"], "train.global_batch_size: 48 is not a multiple of micro_batch_size * DP = 4 x 8 = 32 "
     "(Megatron-Bridge's rule: every DP rank runs the same number of micro-batches); set it to e.g. 32"),
    (["--global-batch-size", "0"], "--global-batch-size: expected an int >= 1"),
    (["--global-batch-size", "-32"], "--global-batch-size: expected an int >= 1"),
    (["--global-batch-size", "128"], "--global-batch-size 128: larger than the 64 samples"),
    (["--global-batch-size", "64", "--micro-batches", "1"], "--global-batch-size 64 and --micro-batches 1 disagree"),
])
def test_cli_rejects_bad_global_batch_sizes_with_the_flag_named(capsys, extra, message):
    assert main(["--model", "qwen3-vl-8b", "--num-samples", "64"] + extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("bridge-thd plan: error: ") and message in err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_cli_refuses_row_buckets_below_one_naming_the_flag(capsys, value):
    assert main(["--model", "qwen3-vl-8b", "--num-samples", "64", "--row-buckets", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bridge-thd plan: error: --row-buckets: expected an int >= 1") and f"got {value}" in err


def test_cli_refuses_a_non_integer_row_buckets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--row-buckets", "four"])
    assert exit_info.value.code == 2 and "--row-buckets" in capsys.readouterr().err


def test_cli_prints_the_rows_and_their_graph_memory(capsys):
    args = ["--model", "qwen3-vl-8b", "--num-samples", "64", "--global-batch-size", "64"]
    assert main(args + ["--row-buckets", "1"]) == 0
    out = capsys.readouterr().out
    assert "(row_buckets 1)" in out and "one graph of the longest row holds" in out and "shared pool" not in out
    assert main(args + ["--row-buckets", "2"]) == 0
    out = capsys.readouterr().out
    assert "row_buckets 2: each micro-batch takes the shortest row that holds it" in out
    assert "2 rows, longest" in out and "in one shared pool" in out and "in separate pools at most" in out


def test_cli_refuses_a_non_integer_global_batch_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--global-batch-size", "many"])
    assert exit_info.value.code == 2 and "--global-batch-size" in capsys.readouterr().err


def test_real_preset_packing_never_slows_thd_static_and_fills_its_row():
    from megatron.bridge_thd.plan.samples import receipt_lengths

    b = balance_plan(get_preset("qwen3-vl-8b"), receipt_lengths(256, 0), PlanSettings(2048, 4, Parallel(gpus=8)), 128)
    static = b.layouts["thd_static"]
    assert b.static_row < b.capacity == 4 * 2048
    assert static["packed"].padding < static["in-batch"].padding
    assert static["packed"].step_s < static["in-batch"].step_s
    assert b.layouts["thd"]["packed"].rank_cost_imbalance <= b.layouts["thd"]["in-batch"].rank_cost_imbalance


def test_the_benchmark_smoke_run_writes_its_three_files(tmp_path):
    """benchmarks/global_batch_packing.py --quick (256 samples, GBS 64, one model, VERL left out)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "global_batch_packing.py"
    spec = importlib.util.spec_from_file_location("global_batch_packing_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--no-verl", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "global_batch_packing.json").read_text())
    assert set(results["distributions"]) == {"receipts", "long-tailed", "doc-chart file"}
    for row in results["rows"]:
        padding, bound = row["static_padding"], row["static_row"]
        assert bound["lower_bound"] <= bound["packed"] < bound["in_batch"]
        assert padding["lower_bound"] <= padding["packed"] < padding["in_batch"]
        assert row["rank_cost_imbalance"]["verl"] is None
        assert row["rank_cost_imbalance"]["assign_thd"]["mean"] <= row["rank_cost_imbalance"]["in_batch"]["mean"]
        # (f): K = 1 is (a)'s row; more rows never pad more, the longest is (a)'s row, the shares sum to 1
        buckets = row["row_buckets"]
        assert [b["count"] for b in buckets] == [1, 2, 4, 8]
        assert buckets[0]["rows"] == [bound["packed"]] and buckets[0]["padding"] == pytest.approx(padding["packed"])
        assert all(b["rows"][-1] == bound["packed"] and len(b["rows"]) <= b["count"] for b in buckets)
        assert all(later["padding"] <= earlier["padding"] for earlier, later in zip(buckets, buckets[1:]))
        assert all(sum(b["row_use"]) == pytest.approx(1.0) for b in buckets)
        g = [b["graph_memory_gib"] for b in buckets]
        assert g[0]["shared_pool"] == g[0]["separate_pools"] == g[0]["one_graph_longest_row"]
        assert all(x["one_graph_longest_row"] <= x["shared_pool"] <= x["separate_pools"] for x in g)
    report = (tmp_path / "global_batch_packing.md").read_text()
    assert "(a) `thd_static` static-row padding" in report and "(f) `thd_static` padding with K static rows" in report
    pytest.importorskip("matplotlib")
    assert (tmp_path / "global_batch_packing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
