"""The ``packing/*`` figures in Megatron-Bridge's own TensorBoard, through its callback path (docs/packing-logs.md).

Megatron-Bridge's ``finetune()`` on the CPU at DP=2 over gloo (its Qwen3-VL recipe with the tiny model,
``bridge_thd_testbed.training``), with a real TensorBoard ``SummaryWriter`` (``logger.tensorboard_dir``; the last
rank writes, as Megatron-Bridge does) and ``logger.log_interval=1``. Two runs: ``thd``, and ``thd_static`` with
global-batch packing; and, on 4 ranks, a CP size per sample against static CP = 1 on the same samples. The event file is read back with TensorBoard's own reader, and every figure is checked
against what the test computes independently from each rank's micro-batches (the collate's 2D attention mask, the
batch's ``loss_mask``, the slots the step processed), summed over the two ranks; the run log against the same.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")
pytest.importorskip("tensorboard", reason="TensorBoard is not installed: no event file to read back")

from megatron.bridge_thd.run_log import read_run_log  # noqa: E402
from megatron.bridge_thd_testbed.training import run_on_cpu  # noqa: E402

RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"
ITERATIONS, MICRO_BATCH, GLOBAL_BATCH, SEQ_LENGTH = 3, 2, 8, 512
PER_ITERATION = GLOBAL_BATCH // (MICRO_BATCH * 2)  # micro-batches per rank per iteration at DP=2
RUNS = {"thd": ("thd", None), "global": ("thd_static", dict(cost_model="qwen3-vl-8b"))}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("packing_logs")


@pytest.fixture(scope="module")
def ranks(workdir):
    common = dict(train_iters=ITERATIONS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  seq_length=SEQ_LENGTH, eval_iters=0, checkpoint=False, tensorboard=True, num_workers=0)
    runs = [(key, RECIPE, layout, dict(common, run_name=f"packing-{key}", run_log=str(workdir / f"{key}.jsonl"),
                                       **({} if placement is None else dict(global_batch_packing=placement))))
            for key, (layout, placement) in RUNS.items()]
    return run_on_cpu(runs, workdir=workdir, world_size=2, timeout=540)


def _scalars(workdir, key) -> dict:
    """``{tag: {step: value}}`` of the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = os.path.join(workdir, "tensorboard", f"packing-{key}")
    accumulator = EventAccumulator(folder, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {event.step: event.value for event in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()["scalars"]}


def _expected(ranks, key) -> list[dict]:
    """Per iteration, the figures summed over both ranks' training micro-batches, from the batches themselves."""
    expected = []
    per_rank = [[batch for batch in rank[key]["micro_batches"] if batch["training"]] for rank in ranks]
    for rank_batches in per_rank:
        assert len(rank_batches) == ITERATIONS * PER_ITERATION
    for iteration in range(ITERATIONS):
        batches = [b for rank_batches in per_rank
                   for b in rank_batches[iteration * PER_ITERATION:(iteration + 1) * PER_ITERATION]]
        expected.append({name: sum(b[name] for b in batches)
                         for name in ("real_tokens", "supervised_tokens", "token_slots")})
    return expected


@pytest.mark.parametrize("key", list(RUNS))
def test_tensorboard_holds_the_packing_figures_the_ranks_ran(ranks, workdir, key):
    scalars = _scalars(workdir, key)
    assert "throughput/tokens_per_sec" in scalars or "lm loss" in scalars, sorted(scalars)  # Megatron-Bridge's own
    for iteration, figures in enumerate(_expected(ranks, key), start=1):
        real, slots = figures["real_tokens"], figures["token_slots"]
        assert scalars["packing/real_tokens_per_iteration"][iteration] == real
        assert scalars["packing/supervised_tokens_per_iteration"][iteration] == figures["supervised_tokens"]
        assert scalars["packing/token_slots_per_iteration"][iteration] == slots
        assert real <= scalars["packing/padded_slots_per_iteration"][iteration] <= GLOBAL_BATCH * SEQ_LENGTH
        assert scalars["packing/padding_share"][iteration] == pytest.approx(1 - real / slots, rel=1e-5)
        time = scalars["packing/iteration_time"][iteration]
        # Megatron-Bridge's own iteration-time, read from the same timer moments later (after its FLOPs count).
        assert 0.95 * scalars["iteration-time"][iteration] <= time <= scalars["iteration-time"][iteration]
        assert scalars["packing/real_tokens_per_second"][iteration] == pytest.approx(real / time, rel=1e-4)
        assert scalars["packing/token_slots_per_second_per_gpu"][iteration] == pytest.approx(slots / time / 2,
                                                                                              rel=1e-4)
    # What packing bought: fewer slots than Megatron-Bridge's padded rows of the same micro-batches on some iteration.
    padded, slots = scalars["packing/padded_slots_per_iteration"], scalars["packing/token_slots_per_iteration"]
    assert any(padded[i] > slots[i] for i in slots)


def test_global_batch_packing_logs_the_placements_per_rank_cost(ranks, workdir):
    scalars = _scalars(workdir, "global")
    logged = {}
    for line in ranks[0]["global"]["placements"]:
        match = re.search(r"\(train\): step (\d+): .* per-rank cost max/mean ([\d.]+)", line)
        if match:
            logged.setdefault(int(match.group(1)), float(match.group(2)))
    for iteration in range(1, ITERATIONS + 1):
        assert scalars["packing/rank_cost_max_over_mean"][iteration] == pytest.approx(logged[iteration], abs=6e-4)
    assert "packing/rank_cost_max_over_mean" not in _scalars(workdir, "thd")


@pytest.mark.parametrize("key", list(RUNS))
def test_the_run_log_holds_one_line_per_iteration(ranks, workdir, key):
    records = read_run_log(workdir / f"{key}.jsonl")
    assert [r.iteration for r in records] == list(range(1, ITERATIONS + 1))
    layout = RUNS[key][0]
    for record, figures in zip(records, _expected(ranks, key), strict=True):
        assert (record.layout, record.dp, record.tp, record.cp, record.pp, record.ep) == (layout, 2, 1, 1, 1, 1)
        assert (record.micro_batch_size, record.micro_batches_per_step, record.global_batch_size,
                record.seq_length) == (MICRO_BATCH, PER_ITERATION, GLOBAL_BATCH, SEQ_LENGTH)
        assert (record.real_tokens, record.supervised_tokens, record.token_slots) == (
            figures["real_tokens"], figures["supervised_tokens"], figures["token_slots"])
        assert record.attention_work > 0 and record.iteration_time_s > 0
        assert (record.rank_cost_max_over_mean is not None) == (key == "global")


def test_the_planner_fits_its_fixed_costs_on_the_cpu_runs_log(ranks, workdir):
    """The mechanics of ``bridge-thd plan --fit-log`` on a real run's log (the figures mean something only on a GPU:
    here the model is a preset standing in for the tiny one): every timed iteration is fitted, the fit is no worse
    than the parameters it started from, and the fitted costs are what least squares gives on the log's times."""
    from megatron.bridge_thd.cost.step_time import FITTED, get_machine
    from megatron.bridge_thd.plan.fit_log import fit_run_log
    from megatron.bridge_thd.cost.presets import get_preset

    records = read_run_log(workdir / "thd.jsonl")
    fit = fit_run_log(records, get_preset("qwen3-vl-2b"), get_machine("h100-sxm"), FITTED, source="the CPU run")
    assert fit.iterations == len([r for r in records if r.iteration_time_s]) > 0
    assert fit.measured_s == tuple(r.iteration_time_s for r in records if r.iteration_time_s)
    assert fit.after_error <= fit.before_error
    # the fitted costs minimise the squared relative error: no nearby non-negative pair does better
    a, b = fit.params.per_micro_batch_s, fit.params.per_step_s
    steps = [r.micro_batches_per_step for r in records if r.iteration_time_s]
    base = [after - a * m - b for after, m in zip(fit.after_s, steps)]

    def loss(x, y):
        return sum(((z + x * m + y) / t - 1) ** 2 for z, m, t in zip(base, steps, fit.measured_s))

    for dx, dy in ((1e-3, 0), (-1e-3, 0), (0, 1e-3), (0, -1e-3), (1e-3, -1e-3), (-1e-3, 1e-3)):
        assert loss(a, b) <= loss(max(0.0, a + dx), max(0.0, b + dy)) + 1e-12


# A CP size per sample (docs/cp-per-sample.md) on 4 ranks against the same samples at static CP = 1 (DP = 4): the
# recipe's loader draws a step's samples per DP rank, so both runs train the same samples (as
# tests/bridge/test_cp_per_sample_training.py uses it).
CP_TOKENS_PER_RANK, CP_ITERATIONS = 240, 2


@pytest.fixture(scope="module")
def cp_ranks(workdir):
    common = dict(train_iters=CP_ITERATIONS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  seq_length=SEQ_LENGTH, eval_iters=0, checkpoint=False, count_tokens=False, tensorboard=True)
    runs = [("dynamic", RECIPE, "thd", dict(common, cp_per_sample=CP_TOKENS_PER_RANK, run_name="packing-dynamic")),
            ("static_cp1", RECIPE, "thd", dict(common, per_token_loss=True, run_name="packing-static_cp1"))]
    return run_on_cpu(runs, workdir=workdir, world_size=4, timeout=540)


def test_cp_per_sample_logs_its_rows_per_cp_size_and_each_rows_tokens_once(cp_ranks, workdir):
    dynamic, static = _scalars(workdir, "dynamic"), _scalars(workdir, "static_cp1")
    rows_logged = {}
    for line in cp_ranks[0]["dynamic"]["placements"]:
        match = re.search(r"\(train\): step (\d+): (\d+) samples in (\d+) rows", line)
        if match:
            rows_logged.setdefault(int(match.group(1)), int(match.group(3)))
    sizes = [tag for tag in dynamic if tag.startswith("packing/cp_per_sample_rows_")]
    assert sizes and all(int(tag.rsplit("_", 1)[1]) in (1, 2, 4) for tag in sizes)
    for iteration in range(1, CP_ITERATIONS + 1):
        assert sum(dynamic[tag].get(iteration, 0) for tag in sizes) == rows_logged[iteration]
        # Each row counted once over the DP x CP ranks: the real tokens of the same samples at static CP = 1.
        for name in ("real_tokens", "supervised_tokens", "vision_patches"):
            figure = f"packing/{name}_per_iteration"
            assert dynamic[figure][iteration] == static[figure][iteration] > 0, name
    assert not any(tag.startswith("packing/cp_per_sample_rows_") for tag in static)
