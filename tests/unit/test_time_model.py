"""The time model (batching.step_time, plan.step_model) against hand computations on a tiny model, its parameter
file, the stand-in for Megatron-Core's dp_balanced packing, and the published tables: the fit returns the stored
parameters, and the held-out tables are predicted within the bar (docs/time-model.md)."""

from __future__ import annotations

import json
import math
import warnings

import pytest

from megatron.bridge_thd.cost.sample import SampleCost
from megatron.bridge_thd.cost.step_time import (
    FITTED, PUBLISHED, Link, Machine, ModelShape, RateCurve, SampleWork, TimeParameters, frame_lengths, get_machine,
    load_time_parameters, model_shape, row_time, time_parameters_to_dict)
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec
from megatron.bridge_thd.plan.published import TABLES, dp_balanced_packs, lognormal_lengths
from megatron.bridge_thd.plan.step_model import sync_seconds

warnings.simplefilter("ignore")

# A machine of round numbers: 1e15 FLOP/s, HBM 1e12 B/s, NVLink 1e11 B/s with 1 us latency inside nodes of 4,
# 1e10 B/s with 10 us latency between them.
MACHINE = Machine("round", 1e15, 1e12, 80e9, Link(1e11, 1e-6), Link(1e10, 1e-5), gpus_per_node=4)
FLAT = RateCurve(((1, 1e14),))
PARAMS = TimeParameters(FLAT, FLAT, FLAT, FLAT, gemm_efficiency=0.5)
# per token 1e9 FLOPs, per token^2 1e3, per patch 1e8, per patch^2 1e2 (fwd + bwd, the trainer's factor 3)
SHAPE = ModelShape(cost=SampleCost(1e9, 1e3, 1e8, 1e2), num_layers=4, full_attention_layers=2,
                   kv_bytes_per_token=1000.0, weight_bytes=1e9, hidden_size=100, activation_bytes_per_token=1e4,
                   activation_bytes_per_patch=1e3)


def _attention(flops: float, rate: float = 1e14) -> float:
    """Forward a third of the trainer's FLOPs, backward 2.5 x that, both at ``rate``."""
    return flops / 3 / rate + 2.5 * flops / 3 / rate


def test_rate_curve_interpolates_in_log_length_and_holds_its_ends():
    curve = RateCurve(((100, 1.0), (10000, 3.0)))
    assert curve(100) == 1.0 and curve(10000) == 3.0
    assert curve(1000) == pytest.approx(2.0)  # half way in log(length)
    assert curve(10) == 1.0 and curve(1e6) == 3.0


def test_frames_of_a_video_are_its_temporal_patches():
    assert frame_lengths([(1, 4, 6), (3, 2, 2)]) == (24, 4, 4, 4)


def test_a_row_by_hand():
    works = [SampleWork(1000, 200, (200,)), SampleWork(3000)]
    t = row_time(SHAPE, works, MACHINE, PARAMS)
    assert t.gemm == pytest.approx(max(1e9 * 4000 / 5e14, 3 * 1e9 / 1e12))
    assert t.attention == pytest.approx(_attention(1e3 * 1000 ** 2) + _attention(1e3 * 3000 ** 2))
    assert t.vision == pytest.approx(1e8 * 200 / 5e14 + _attention(1e2 * 200 ** 2))
    assert t.elementwise == pytest.approx(3 * (1e4 * 4000 + 1e3 * 200) / 1e12)
    assert t.ring_exposed == 0 and t.moe_dispatch == 0 and t.fixed == 0
    assert t.total == pytest.approx(t.gemm + t.attention + t.vision + t.elementwise)


def test_small_rows_are_bound_by_reading_the_weights():
    t = row_time(SHAPE, [SampleWork(10)], MACHINE, PARAMS)
    assert t.gemm == pytest.approx(3 * 1e9 / 1e12)  # 6 ms of weight reads > 20 us of GEMM FLOPs


def test_padding_that_attention_skips_costs_gemms_only():
    real = row_time(SHAPE, [SampleWork(1000)], MACHINE, PARAMS)
    padded = row_time(SHAPE, [SampleWork(1000), SampleWork(3000, attended=False)], MACHINE, PARAMS)
    assert padded.attention == real.attention
    assert padded.gemm == pytest.approx(1e9 * 4000 / 5e14)


def test_cp_splits_the_work_and_prices_each_ring_step():
    slow = TimeParameters(FLAT, FLAT, FLAT, FLAT, gemm_efficiency=0.5, ring_step_s=1e-3)
    t = row_time(SHAPE, [SampleWork(4000)], MACHINE, slow, cp=2, align=4)
    attention = _attention(1e3 * 4000 ** 2 / 2)
    assert t.attention == pytest.approx(attention)
    forward_step, backward_step = attention / 3.5 / 2 / 2, attention * 2.5 / 3.5 / 2 / 2  # per layer, per ring step
    chunk = 2000 * 1000.0
    link = 1e-6 + chunk / 1e11, 1e-6 + 2 * chunk / 1e11
    expected = 2 * ((max(forward_step, 1e-3 + link[0]) - forward_step) + (max(backward_step, 1e-3 + link[1])
                                                                         - backward_step))
    assert t.ring_exposed == pytest.approx(expected)
    assert row_time(SHAPE, [SampleWork(4000)], MACHINE, slow, cp=8, align=16).ring_exposed > 0
    assert MACHINE.link(4) is MACHINE.nvlink and MACHINE.link(8) is MACHINE.network and MACHINE.link(2, 4) is MACHINE.network


def test_moe_dispatch_only_with_expert_parallelism():
    moe = ModelShape(SHAPE.cost, 4, 2, 1000.0, 1e9, hidden_size=100, moe_topk=2, moe_layers=4)
    assert row_time(moe, [SampleWork(1000)], MACHINE, PARAMS).moe_dispatch == 0
    routed = 1000 * 2 * 100 * 2 * 3 / 4  # tokens x top-k x hidden x bf16 x (ep - 1) / ep
    assert row_time(moe, [SampleWork(1000)], MACHINE, PARAMS, ep=4).moe_dispatch == pytest.approx(
        4 * 4 * (1e-6 + routed / 1e11))


def test_the_weight_sync_by_hand():
    spec = ModelSpec(name="t", hf_repo="-", num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                     kv_channels=4, ffn_hidden_size=16, vocab_size=128, tie_word_embeddings=True,
                     vision=VisionSpec(depth=0, hidden_size=4, num_heads=1, intermediate_size=8, out_hidden_size=8))
    from megatron.bridge_thd.cost.memory import parameter_counts

    params = sum(parameter_counts(spec).values())
    expected = (1e-6 + 4 * params * 3 / 4 / 1e11) + (1e-6 + 2 * params * 3 / 4 / 1e11) + 30 * params / 4 / 1e12
    assert sync_seconds(spec, Parallel(gpus=4), MACHINE) == pytest.approx(expected)
    assert sync_seconds(spec, Parallel(gpus=1), MACHINE) == pytest.approx(30 * params / 1e12)


def test_the_parameter_file_round_trips_and_refuses_bad_fields(tmp_path):
    path = tmp_path / "params.json"
    path.write_text(json.dumps(time_parameters_to_dict(FITTED)))
    assert load_time_parameters(path) == FITTED
    path.write_text(json.dumps({"per_step_s": 0.2, "attention_forward": [[512, 3e14], [4096, 5e14]]}))
    loaded = load_time_parameters(path)
    assert loaded.per_step_s == 0.2 and loaded.attention_forward(4096) == 5e14
    assert loaded.gemm_efficiency == FITTED.gemm_efficiency  # a field left out keeps the fitted value
    for bad, named in (({"gemm_efficiency": 1.5}, "gemm_efficiency"), ({"per_step": 1}, "unknown field"),
                       ({"attention_forward": [[4096, 1], [512, 1]]}, "attention_forward")):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=named):
            load_time_parameters(path)
    with pytest.raises(ValueError, match="no such file"):
        load_time_parameters(tmp_path / "missing.json")


def test_dp_balanced_packs_in_order_and_splits_singletons_to_a_multiple_of_dp():
    # Megatron-Core's DpBalancedScheduler by hand: capacity 10 packs [6, 3] [5, 4] [9] [2]; 4 packs at dp 2: as is,
    # micro-batch 0 = packs 0, 1; micro-batch 1 = packs 2, 3.
    assert dp_balanced_packs([6, 3, 5, 4, 9, 2], capacity=10, dp=2) == [[[0, 1], [4]], [[2, 3], [5]]]
    # [6, 3] [5, 4] [9]: 3 packs at dp 2, so the last pack with two samples gives up its last one: [6, 3] [5] [9] [4].
    assert dp_balanced_packs([6, 3, 5, 4, 9], capacity=10, dp=2) == [[[0, 1], [4]], [[2], [3]]]


def test_lognormal_lengths_are_seeded_and_clipped():
    a = lognormal_lengths(2000, mean=1024, sigma=1.5, low=128, high=8192, seed=0)
    assert a == lognormal_lengths(2000, mean=1024, sigma=1.5, low=128, high=8192, seed=0)
    assert min(a) == 128 and max(a) == 8192  # sigma 1.5: both clips are hit in 2,000 draws


def test_model_shape_reads_the_trainers_formula_and_the_memory_model():
    from megatron.bridge_thd.cost.sample import sample_cost
    from megatron.bridge_thd.cost.presets import get_preset, replace

    spec = get_preset("qwen3.5-vl-2b")
    shape = model_shape(spec)
    assert shape.cost == sample_cost(spec)
    assert shape.full_attention_layers == spec.num_layers // 4
    with_mtp = model_shape(replace(spec, mtp_num_layers=1))
    assert with_mtp.cost.per_token > shape.cost.per_token  # the MTP layer and its logits, in the trainer's formula
    assert with_mtp.activation_bytes_per_token > shape.activation_bytes_per_token


# --- the published tables: slow (the fit table's placements take ~20 s), computed once per process ---------------


@pytest.mark.slow  # the fit table's placements: ~20 s
def test_the_fit_returns_the_stored_parameters():
    from megatron.bridge_thd.plan.fit import fit_parameters

    result = fit_parameters()
    for name in FITTED.fitted:
        assert getattr(result.params, name) == pytest.approx(getattr(FITTED, name), rel=1e-9, abs=1e-12), name
    assert result.rms_error < 0.15


def _held_out(unit: str):
    return [f for key, table in TABLES.items() if table.role == "held out" for f in table.reproduce(FITTED)
            if f.judged and f.unit == unit]


@pytest.mark.slow
def test_held_out_speed_up_ratios_are_within_15_percent():
    ratios = _held_out("x")
    assert len(ratios) >= 4 and all(f.within_bar for f in ratios), [
        (f.label, f.published, round(f.predicted, 3)) for f in ratios if not f.within_bar]


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="the fitted fixed costs come from a 12-layer GPT on an unnamed GPU; PR 3838's "
                   "absolute step times are predicted 37-40% short (docs/time-model.md, Results): the bar is not met")
def test_held_out_absolute_times_on_a_named_gpu_are_within_25_percent():
    times = _held_out("ms")
    assert times and all(f.within_bar for f in times)


def test_published_rates_are_the_defaults_of_the_fitted_set():
    assert FITTED.attention_forward == PUBLISHED.attention_forward
    assert FITTED.gemm_efficiency == PUBLISHED.gemm_efficiency == 0.80
    assert set(FITTED.fitted) == {"per_micro_batch_s", "ring_step_s", "per_step_s"}
    assert get_machine("h100-sxm").bf16_flops == 989e12 and not math.isnan(FITTED.per_step_s)


# --- the GPU calibration script (its plumbing on the CPU) and bridge-thd plan --rank ----------------------------


def _calibration_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_calibrate.py"
    spec = importlib.util.spec_from_file_location("gpu_calibrate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_calibration_script_writes_a_file_the_planner_reads(tmp_path, capsys):
    script = _calibration_script()
    out = tmp_path / "params.json"
    assert script.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    params = load_time_parameters(out)
    assert [n for n, _ in params.attention_forward.points] == [32, 64]  # what it measured, not the published curve
    assert params.per_step_s == FITTED.per_step_s and params.fitted == FITTED.fitted  # what it cannot measure
    assert "gpu_calibrate" in params.source
    if not __import__("torch").cuda.is_available():
        assert script.main(["--out", str(out)]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def test_rank_lists_what_fits_best_first_with_the_balance_plans_figures():
    from megatron.bridge_thd.cost.presets import get_preset
    from megatron.bridge_thd.plan.balance import balance_plan
    from megatron.bridge_thd.plan.estimate import PlanSettings
    from megatron.bridge_thd.plan.samples import receipt_lengths
    from megatron.bridge_thd.plan.answer import rank_candidates

    spec, samples = get_preset("qwen3-vl-2b"), receipt_lengths(64)
    base = PlanSettings(2048, 1, Parallel(gpus=4))
    candidates = rank_candidates(spec, samples, base, 16, micro_batch_sizes=(1, 2), row_buckets=(1,), cps=(1, 2))
    fitting = [c for c in candidates if c.fits]
    assert fitting and all(c.memory_bytes <= base.gpu.memory_bytes for c in fitting)
    assert [c.samples_per_s for c in fitting] == sorted((c.samples_per_s for c in fitting), reverse=True)
    best = fitting[0]
    from dataclasses import replace as _replace

    settings = _replace(base, micro_batch_size=best.micro_batch_size, parallel=Parallel(cp=best.cp, gpus=4))
    again = balance_plan(spec, samples, settings, 16, row_buckets=1).layouts[best.layout][best.placement]
    assert again.step_s == pytest.approx(best.step_s)


def test_rank_with_a_token_limit_adds_cp_per_sample_by_both_placements(capsys):
    from megatron.bridge_thd.plan.plan_command import main

    assert main(["--model", "qwen3-vl-2b", "--num-samples", "64", "--global-batch-size", "16", "--gpus", "4",
                 "--rank", "--cp-per-sample", "4096"]) == 0
    out = capsys.readouterr().out
    assert "CP per sample, Megatron-Core's scheduler" in out and "CP per sample, ours (time model)" in out
    assert "| per sample |" in out
    assert main(["--model", "qwen3-vl-2b", "--rank"]) == 2
    assert "--global-batch-size" in capsys.readouterr().err


# --- the planner fitted on a run log (plan/fit_log.py, bridge-thd plan --fit-log) --------------------------------


def _record(iteration, slots, real, work, mbs_per_step=2, time=None, **sizes):
    from megatron.bridge_thd.run_log import RunLogRecord

    parallel = dict(tp=1, cp=1, pp=1, ep=1, dp=2) | sizes
    return RunLogRecord(iteration=iteration, iteration_time_s=time, layout="thd", micro_batch_size=2,
                        micro_batches_per_step=mbs_per_step, global_batch_size=2 * mbs_per_step * parallel["dp"],
                        seq_length=4096, token_slots=slots, real_tokens=real, supervised_tokens=real // 2,
                        attention_work=work, padded_slots=slots, truncated_tokens=0, vision_patches=0, **parallel)


def test_the_fit_on_a_run_log_recovers_the_fixed_costs_it_was_made_with(tmp_path, capsys):
    """A log whose iteration times are the model's own with per_step_s 0.2 s and per_micro_batch_s 15 ms: the fit
    gives those back, with no error left."""
    from dataclasses import replace as _replace

    from megatron.bridge_thd.plan.fit_log import fit_run_log, variable_seconds
    from megatron.bridge_thd.plan.plan_command import main
    from megatron.bridge_thd.cost.presets import get_preset

    spec, machine = get_preset("qwen3-vl-2b"), get_machine("h100-sxm")
    truth = FITTED.with_fit("truth", per_step_s=0.2, per_micro_batch_s=0.015)
    shape = model_shape(spec)
    records = []
    for k, (slots, real, work, mbs) in enumerate([(8192, 7000, 9e6, 2), (16384, 15000, 2.5e7, 4),
                                                   (4096, 4000, 3e6, 1), (12288, 9000, 1.2e7, 3)], 1):
        record = _record(k, slots, real, int(work), mbs)
        sync = sync_seconds(spec, Parallel(gpus=2), machine)
        records.append(_replace(record, iteration_time_s=variable_seconds(shape, record, machine, truth) + sync
                                + 0.2 + 0.015 * mbs))
    fit = fit_run_log(records, spec, machine, FITTED)
    assert fit.params.per_step_s == pytest.approx(0.2, rel=1e-6)
    assert fit.params.per_micro_batch_s == pytest.approx(0.015, rel=1e-6)
    assert fit.after_error < 1e-9 < fit.before_error
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(r.to_json() for r in records) + "\n")
    params = tmp_path / "params.json"
    assert main(["--model", "qwen3-vl-2b", "--fit-log", str(path), "--write-params", str(params)]) == 0
    assert "RMS error" in capsys.readouterr().out
    assert load_time_parameters(params).per_step_s == pytest.approx(0.2, rel=1e-6)
    untimed = tmp_path / "untimed.jsonl"
    untimed.write_text(_record(1, 10, 10, 100).to_json() + "\n")
    assert main(["--model", "qwen3-vl-2b", "--fit-log", str(untimed)]) == 2
    assert "no iteration has a time" in capsys.readouterr().err
