"""The recipe scripts' tiny CPU mode and the cord_v2 benchmark harness's, run as a user runs them
(``python recipes/qwen3_vl_8b_cord_v2_thd.py --cpu-tiny``, ``benchmarks/cord_v2_sft.py --cpu-tiny``):
the same code path as on GPUs (the recipe function, ``configure``, the cord_v2 provider and collate,
``finetune()``), only model size and device differ (docs/megatron-bridge-on-cpu.md)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

ROOT = Path(__file__).resolve().parents[2]


def test_recipe_script_runs_in_its_cpu_mode(tmp_path):
    """The recipe script in CPU mode, with ``--global-batch-packing qwen3-vl-8b`` (one run for both: the
    same script path; test_training.py runs the loop without it): configure's setting reaches
    Megatron-Bridge's loop with the recipe's own loader settings (its workers, forked, and pinned
    memory) and its evaluation (validation and test after training; ``--eval-iters 1`` keeps it short),
    and rank 0 logs one placement per iteration."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-W", "ignore", str(ROOT / "recipes" / "qwen3_vl_8b_cord_v2_thd.py"), "--cpu-tiny",
               "--layout", "thd", "--global-batch-packing", "qwen3-vl-8b", "--train-iters", "3", "--eval-iters", "1",
               "--workdir", str(tmp_path / "run"), "--report", str(report)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["recipe"] == "qwen3_vl_8b_sft_2gpu_h100_bf16_config" and result["layout"] == "thd"
    assert result["global_batch_packing"] == "qwen3-vl-8b"
    for rank in result["ranks"]:
        assert [row["iteration"] for row in rank["iterations"]] == [1, 2, 3]
        assert all(math.isfinite(row["loss"]) for row in rank["iterations"])
        # Every micro-batch the step took came from the recipe's data path with its 2D mask.
        assert all(batch["real_tokens"] > 0 for batch in rank["micro_batches"])
        training = [batch for batch in rank["micro_batches"] if batch["training"]]
        assert len(training) == 3 * 2 and len(rank["micro_batches"]) == len(training) + 2 * 2  # + validation, test
    assert "iteration   3 | lm loss" in done.stdout
    for rank in result["ranks"]:  # the recipe's final validation and test evaluation ran
        assert [(e["test"], e["iteration"]) for e in rank["evaluations"]] == [(False, 3), (True, 3)]
        assert all(math.isfinite(e["loss"]) for e in rank["evaluations"])
    placements = result["ranks"][0]["placements"]
    train_steps = [line.split(": step ")[1].split(":")[0] for line in placements if "(train): step " in line]
    assert train_steps[:3] == ["1", "2", "3"]  # and the loader workers' prefetch past the run


def test_global_batch_packing_flag_needs_a_packed_layout():
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "qwen3_vl_8b_cord_v2_thd.py"), "--layout", "bshd",
                           "--global-batch-packing", "qwen3-vl-8b"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.returncode != 0 and "--global-batch-packing: needs --layout thd or thd_static" in done.stderr


def test_cp_per_sample_flag_needs_the_thd_layout():
    """``--cp-per-sample`` (docs/cp-per-sample.md; tests/bridge/test_recipes.py runs its config on the recipe) is refused
    for a layout it does not run with."""
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "qwen3_vl_8b_cord_v2_thd.py"), "--layout",
                           "thd_static", "--cp-per-sample", "16384"], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert done.returncode != 0 and "--cp-per-sample: needs --layout thd, not 'thd_static'" in done.stderr


def test_qwen35_recipe_script_runs_its_cpu_mode(monkeypatch, tmp_path):
    """``recipes/qwen35_vl_2b_cord_v2_thd.py --cpu-tiny`` hands Megatron-Bridge's Qwen3.5-VL 2B recipe function to
    the CPU mode's ``run_on_cpu`` (which then writes and trains the tiny Qwen3.5-VL: that run is
    tests/bridge/test_training_qwen35.py's, too dear to repeat through a subprocess here); ``--global-batch-size``
    reaches it."""
    import runpy

    from megatron.bridge_thd_testbed import training

    calls = []

    def run_on_cpu(runs, *, workdir, world_size, **_):
        calls.append((runs, workdir, world_size))
        row = {"iteration": 1, "loss": 6.2, "flops": 1e9, "flops_tokens": 1000, "seconds": 0.5}
        return [{runs[0][0]: {"iterations": [row], "micro_batches": []}}] * world_size

    monkeypatch.setattr(training, "run_on_cpu", run_on_cpu)
    monkeypatch.setattr(sys, "argv", ["qwen35_vl_2b_cord_v2_thd.py", "--cpu-tiny", "--layout", "thd_static",
                                      "--train-iters", "2", "--global-batch-size", "8", "--workdir", str(tmp_path)])
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    runpy.run_path(str(ROOT / "recipes" / "qwen35_vl_2b_cord_v2_thd.py"), run_name="__main__")
    [(runs, workdir, world_size)] = calls
    [(key, recipe, layout, settings)] = runs
    assert recipe == "qwen35_vl_2b_sft_1gpu_h100_bf16_config" and training.is_qwen35_recipe(recipe)
    assert (key, layout, workdir, world_size) == ("thd_static", "thd_static", str(tmp_path), 2)
    assert settings["train_iters"] == 2 and settings["global_batch_size"] == 8


def test_benchmark_harness_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cord_v2_sft
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # Two of the five rows (every row's run is one finetune() through the same harness function; thd, thd_static
    # and thd with global-batch packing run inside finetune() in tests/bridge/test_training.py): the suite's time.
    results = cord_v2_sft.main(["--cpu-tiny", "--iterations", "2", "--warmup", "1", "--micro-batch-sizes", "2",
                                "--global-batch-size", "8", "--steps", "megatron_bridge", "thd_static_global",
                                "--out", str(tmp_path), "--workdir", str(tmp_path / "run")])
    rows = results["rows"]
    assert set(rows) == {"megatron_bridge-mbs2", "thd_static_global-mbs2"}
    for row in rows.values():
        assert not row["oom"] and row["iterations_measured"] == 1
        assert row["ms_per_iter"] > 0 and row["tflops_per_gpu"] > 0 and row["peak_memory_gib"] > 0
    # Same data for every step: the same real tokens (global-batch packing only moves the step's samples between
    # ranks and micro-batches), and Megatron-Bridge's step counts the padded work in its FLOPs, ours the real work
    # (fewer FLOPs per token processed).
    tokens = {key: row["real_tokens_per_s"] * row["ms_per_iter"] / 1000 for key, row in rows.items()}
    assert tokens["thd_static_global-mbs2"] == pytest.approx(tokens["megatron_bridge-mbs2"], rel=1e-9)
    # The global-batch row placed both training steps (rank 0's log); its rows end at most at the in-batch row,
    # micro_batch_size * seq_length.
    placed = rows["thd_static_global-mbs2"]["placement"]
    assert placed["steps"] == 2 and placed["slots"] >= placed["real_tokens"] > 0
    static_rows = placed["row_lengths"]
    assert static_rows == sorted(static_rows) and static_rows[-1] <= 2 * 512 and len(static_rows) <= 4
    assert "placement" not in rows["megatron_bridge-mbs2"]
    table = (tmp_path / "cord_v2_sft.md").read_text()
    assert "Megatron-Bridge qwen3_vl_step (padded)" in table
    assert "| 2 | ours, thd_static + global-batch packing |" in table
    assert "* MBS 2, ours, thd_static + global-batch" in table
    assert (tmp_path / "cord_v2_sft.png").stat().st_size > 1000


def test_benchmark_harness_gpu_rows_run_the_recipe_script_with_global_batch_packing():
    """``--gpu``: one torchrun of the recipe script per row; a global-batch packing row runs the script's
    ``--global-batch-packing`` (its ``configure(..., global_batch_packing=GlobalBatchPacking(...))``) with the
    row's layout, the others none. No GPU needed: the commands only."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cord_v2_sft
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    args = argparse.Namespace(nproc=8, seq_length=2048, iterations=30, global_batch_cost="tokens")
    commands = {step: cord_v2_sft.gpu_command(step, 4, args, "r.json") for step in cord_v2_sft.STEPS}
    for step, command in commands.items():
        assert command[:3] == ["torchrun", "--nproc-per-node=8", str(ROOT / "recipes" / "qwen3_vl_8b_cord_v2_thd.py")]
        layout = command[command.index("--layout") + 1]
        assert layout == step.removesuffix("_global")
        placed = command[command.index("--global-batch-packing") + 1] if "--global-batch-packing" in command else None
        assert placed == ("tokens" if step.endswith("_global") else None)
    # The Qwen3.5-VL recipe's rows run PR 3838's configuration: its script, 8 ranks, seq_length 2048, global batch
    # 8 x MBS (one micro-batch per rank and step).
    qwen35 = cord_v2_sft.parse_args(["--gpu", "--recipe", "qwen35-vl-2b"])
    assert (qwen35.nproc, qwen35.seq_length, qwen35.micro_batch_sizes) == (8, 2048, [2, 4])
    for mbs, global_batch in ((2, 16), (4, 32)):
        for step in cord_v2_sft.STEPS:
            command = cord_v2_sft.gpu_command(step, mbs, qwen35, "r.json")
            assert command[:3] == ["torchrun", "--nproc-per-node=8", str(ROOT / "recipes" / "qwen35_vl_2b_cord_v2_thd.py")]
            assert command[command.index("--global-batch-size") + 1] == str(global_batch)
            assert command[command.index("--seq-length") + 1] == "2048"
    # The default recipe keeps its own global batch and the harness's sizes.
    default = cord_v2_sft.parse_args(["--gpu"])
    assert (default.recipe, default.nproc, default.seq_length) == ("qwen3-vl-8b", 2, 512)
    assert "--global-batch-size" not in cord_v2_sft.gpu_command("thd", 2, default, "r.json")
    # The recipe script reads 'tokens' as GlobalBatchPacking's default cost.
    recipes = str(ROOT / "recipes")
    sys.path.insert(0, recipes)
    try:
        import _thd_recipe
    finally:
        sys.path.remove(recipes)
    assert _thd_recipe.global_batch_setting("tokens") == cord_v2_sft.global_batch_setting("tokens") == {"cost_model": None}


def test_benchmark_table_puts_pr3838_beside_ours():
    """The Qwen3.5-VL table: PR 3838's published ms/iter beside our Megatron-Bridge-step and thd rows, marked as
    theirs, their own table with the samples/s it implies (+44% at MBS 4), and, on the CPU, a note that the two are
    not comparable. No run: a results file of made-up timings."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cord_v2_sft
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    row = dict(oom=False, ms_per_iter=100.0, samples_per_s=160.0, real_tokens_per_s=1.0, tflops_per_gpu=0.01,
               peak_memory_gib=1.0)
    results = dict(device="CPU, tiny Qwen3.5-VL, DP=2 over gloo", recipe="qwen35_vl_2b_sft_1gpu_h100_bf16_config",
                   recipe_key="qwen35-vl-2b", seq_length=512, global_batch_size=16, world_size=2, iterations=6, warmup=2,
                   micro_batch_sizes=[2, 4],
                   rows={f"{step}-mbs{mbs}": dict(row) for step in ("megatron_bridge", "thd") for mbs in (2, 4)})
    table = cord_v2_sft.render(results)
    assert "PR 3838 ms/iter (theirs, 8xH100) |" in table
    assert "| 2 | Megatron-Bridge qwen3_vl_step (padded) | 100.0 |" in table and table.count(" 363 |") == 2
    assert "| 4 | Megatron-Bridge qwen3_vl_step (padded) | 100.0 |" in table and "| OOM |\n" in table
    assert "| 2 | ours, thd | 100.0 |" in table and " 342 |" in table and " 505 |" in table
    assert "| 4 | 32 | OOM | 505 | OOM | 63.4 |" in table and "= +44%" in table
    assert "not comparable" in table
    # The default recipe's table has no such column.
    plain = cord_v2_sft.render(dict(results, recipe_key="qwen3-vl-8b"))
    assert "PR 3838" not in plain
