"""The Megatron-Bridge ``finetune()`` worlds that several modules of tests/bridge assert on: their runs and sizes.

tests/bridge/conftest.py runs each world once per session (``training_world``, ``cp_per_sample_world``), the first
time a test asks for it; every module reading it asserts on the same runs, so a run is never repeated for another
module's figures (tests/README.md, "Shared runs"):

* :func:`training_runs`, 2 ranks: tests/bridge/test_training.py's runs (the test bed's ``training_loop_runs``), its
  ``thd`` run and its global-batch packing run (each stopped and resumed) with a real TensorBoard writer and a run
  log, which tests/bridge/test_packing_logs.py reads back; then tests/bridge/test_training_qwen35.py's runs (the
  test bed's ``qwen35_training_runs``, their keys prefixed :data:`QWEN35`: the same DP=2 world, the Qwen3.5-VL 2B
  recipe on its own tiny checkpoint, last because they collate in the rank's process);
* :func:`cp_per_sample_runs`, 4 ranks: tests/bridge/test_cp_per_sample_training.py's runs, its CP-per-sample run
  (stopped and resumed) and its static CP = 1 reference with a TensorBoard writer, which test_packing_logs.py reads.
"""

from __future__ import annotations

from typing import NamedTuple

RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"
MOE_RECIPE = "qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config"
MICRO_BATCH, GLOBAL_BATCH, SEQ_LENGTH = 2, 8, 512


class World(NamedTuple):
    """A world's result: per rank ``{run key: run_recipe_on_cpu's record}``, and the folder the runs wrote to."""

    ranks: list
    workdir: object


# --- the training world (2 ranks) --------------------------------------------------------------------------------
ITERATIONS, RESUME_AT = 20, 10
SHORT = 5  # iterations of the PP=2 and CP=2 runs
GLOBAL = 10  # iterations of the two per-token-loss runs: Megatron-Bridge's placement and global-batch packing
GLOBAL_RESUME_AT, EVAL_INTERVAL, EVAL_ITERS = 4, 3, 2
# The runs whose packing figures test_packing_logs.py reads, by its key: their stopped and resumed halves, which
# share one run name (so one TensorBoard folder, ``tensorboard/<run name>``) and one run log (``<key>.jsonl``).
LOGGED = {"thd": ("thd_first", "thd_resumed"), "global": ("thd_static_global_first", "thd_static_global_resumed")}


# test_training_qwen35.py's runs: their keys' prefix in the world, their sizes.
QWEN35 = "qwen35_"
QWEN35_ITERATIONS, QWEN35_RESUME_AT = 6, 3


def training_runs(workdir) -> list:
    """test_training.py's runs, the :data:`LOGGED` ones writing TensorBoard and a run log under ``workdir``; then
    test_training_qwen35.py's. A run after one that collates in the rank's process must not fork loader workers
    (docs/megatron-bridge-on-cpu.md, limits): test_training.py's runs use the recipe's workers, the Qwen3.5 runs none,
    so they come last."""
    from megatron.bridge_thd_testbed.training import qwen35_training_runs

    logged = {run: key for key, halves in LOGGED.items() for run in halves}
    runs = [(run, recipe, layout, dict(settings, tensorboard=True, run_log=str(workdir / f"{logged[run]}.jsonl"))
             if run in logged else settings) for run, recipe, layout, settings in _training_loop_runs()]
    qwen35 = qwen35_training_runs(iterations=QWEN35_ITERATIONS, resume_at=QWEN35_RESUME_AT,
                                  micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seq_length=SEQ_LENGTH)
    assert all(settings.get("num_workers") == 0 for *_, settings in qwen35)
    return runs + [(QWEN35 + run, recipe, layout, settings) for run, recipe, layout, settings in qwen35]


def logged_run_names() -> dict:
    """``{key: run name}`` of :data:`LOGGED`'s runs: their TensorBoard folder, ``tensorboard/<run name>``."""
    names = {key: {settings["run_name"] for run, _, _, settings in _training_loop_runs() if run in halves}
             for key, halves in LOGGED.items()}
    assert all(len(name) == 1 for name in names.values()), names  # both halves write one folder
    return {key: name.pop() for key, name in names.items()}


def _training_loop_runs() -> list:
    from megatron.bridge_thd_testbed.training import training_loop_runs

    return training_loop_runs(RECIPE, iterations=ITERATIONS, resume_at=RESUME_AT, short=SHORT,
                              micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH, seq_length=SEQ_LENGTH,
                              global_iterations=GLOBAL, global_resume_at=GLOBAL_RESUME_AT,
                              eval_interval=EVAL_INTERVAL, eval_iters=EVAL_ITERS)


# --- the CP-per-sample world (4 ranks) ---------------------------------------------------------------------------
CP_ITERATIONS = 2
# The receipts are 367-512 tokens once cut at 512: at 240 tokens per rank those up to 480 need 2 ranks, longer ones 4.
TOKENS_PER_RANK = 240
# The MoE routers' load-balancing statistics in the loss (the recipe's provider has aux loss 1e-3 and no z-loss).
MOE_ROUTING = dict(moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
# TensorBoard folders (run names) of the two dense runs test_packing_logs.py compares.
CP_RUN_NAMES = {"dynamic": "cp-per-sample", "static_cp1": "static-cp1"}


def cp_per_sample_runs() -> list:
    """test_cp_per_sample_training.py's runs (its docstring says what each proves)."""
    common = dict(train_iters=CP_ITERATIONS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  seq_length=SEQ_LENGTH, eval_iters=1, eval_interval=CP_ITERATIONS, checkpoint=False,
                  count_tokens=False)
    dynamic = dict(common, cp_per_sample=TOKENS_PER_RANK, run_name=CP_RUN_NAMES["dynamic"], tensorboard=True)
    return [
        # Stopped after iteration 1 (a checkpoint is saved), then resumed from it: the loader's sampler continues from
        # Megatron-Bridge's consumed_samples, so iteration 2 must be the uninterrupted reference's.
        ("dynamic_first", RECIPE, "thd", dict(dynamic, exit_interval=1, checkpoint=True)),
        ("dynamic_resumed", RECIPE, "thd", dict(dynamic, checkpoint="load")),
        ("static_cp1", RECIPE, "thd", dict(common, per_token_loss=True, run_name=CP_RUN_NAMES["static_cp1"],
                                           tensorboard=True)),
        *moe_runs(common),
    ]


def moe_runs(common: dict) -> list:
    """The MoE model with a CP size per sample and at static CP = 1, one sample per micro-batch
    (test_cp_per_sample_training.py's docstring says why), the loader in the rank's process and no evaluation (the
    dense runs prove both). Last in the world: a run after one that collates in the rank's process must not fork
    loader workers (docs/megatron-bridge-on-cpu.md, limits)."""
    moe = dict(common, micro_batch_size=1, eval_iters=0, num_workers=0, model_settings=MOE_ROUTING, moe_padding=True)
    return [("moe_dynamic", MOE_RECIPE, "thd", dict(moe, cp_per_sample=TOKENS_PER_RANK)),
            ("moe_static_cp1", MOE_RECIPE, "thd", dict(moe, per_token_loss=True))]
