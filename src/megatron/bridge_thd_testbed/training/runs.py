"""The run definitions of the training-loop tests and their report (``tests/bridge/test_training.py``,
``tests/bridge/test_training_qwen35.py``, ``benchmarks/training_loop_report.py``): lists of
``(key, recipe, layout, settings)`` for :func:`~megatron.bridge_thd_testbed.training.runner.run_on_cpu`.
"""

from __future__ import annotations

__all__ = ["training_loop_runs", "qwen35_training_runs", "QWEN35_RECIPE"]

def training_loop_runs(recipe: str = "qwen3_vl_8b_sft_2gpu_h100_bf16_config", *, iterations: int = 20,
                       resume_at: int = 10, short: int = 5, micro_batch_size: int = 2, global_batch_size: int = 8,
                       seq_length: int = 512, global_iterations: int = 10, global_resume_at: int = 4,
                       eval_interval: int = 3, eval_iters: int = 2) -> list:
    """The runs that check Megatron-Bridge's training loop with our step, for :func:`run_on_cpu` on two
    ranks (``tests/bridge/test_training.py``, ``benchmarks/training_loop_report.py``), all with the
    recipe's data loader workers (forked) and pinned memory:

    * ``megatron_bridge``, ``thd_static``: ``iterations`` at DP=2 (Megatron-Bridge's own step; ours);
    * ``thd_first`` / ``thd_resumed``: ``thd`` stopped at ``resume_at`` (``exit_interval``: a checkpoint
      is saved), then resumed from that checkpoint to the end; ``train_iters`` is kept, so the data
      order and the schedule are the uninterrupted runs';
    * ``pp2``, ``cp2``: ``thd`` at PP=2 and at CP=2 on the same two ranks, ``short`` iterations;
    * ``thd_static_per_token``: ``thd_static`` with per-token loss normalisation in Megatron-Bridge's
      placement, ``global_iterations``, evaluating every ``eval_interval`` (``eval_iters`` steps) and
      at the end (validation and test);
    * ``thd_static_global_first`` / ``thd_static_global_resumed``: the same with global-batch packing
      (Qwen3-VL 8B's cost, the row chosen from the scanned lengths, which turns per-token
      normalisation on), stopped at ``global_resume_at`` and resumed.

    These first runs evaluate with the recipe's loaders too (``eval_iters`` at the end only). Only the
    runs that are resumed write checkpoints.
    """
    common = dict(train_iters=iterations, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                  seq_length=seq_length, eval_iters=eval_iters)
    evaluated = dict(common, train_iters=global_iterations, eval_interval=eval_interval)
    placement = dict(cost_model="qwen3-vl-8b")
    return [
        ("megatron_bridge", recipe, "megatron_bridge", dict(common, checkpoint=False)),
        ("thd_static", recipe, "thd_static", dict(common, checkpoint=False)),
        ("thd_first", recipe, "thd", dict(common, exit_interval=resume_at, run_name="thd-resume")),
        ("thd_resumed", recipe, "thd", dict(common, run_name="thd-resume")),
        ("pp2", recipe, "thd", dict(common, pp=2, exit_interval=short, count_tokens=False, checkpoint=False)),
        ("cp2", recipe, "thd", dict(common, cp=2, exit_interval=short, count_tokens=False, checkpoint=False)),
        ("thd_static_per_token", recipe, "thd_static",
         dict(evaluated, per_token_loss=True, run_name="thd-static-per-token", checkpoint=False)),
        ("thd_static_global_first", recipe, "thd_static",
         dict(evaluated, global_batch_packing=placement, exit_interval=global_resume_at, run_name="thd-static-global")),
        ("thd_static_global_resumed", recipe, "thd_static",
         dict(evaluated, global_batch_packing=placement, run_name="thd-static-global")),
    ]


QWEN35_RECIPE = "qwen35_vl_2b_sft_1gpu_h100_bf16_config"


def qwen35_training_runs(recipe: str = QWEN35_RECIPE, *, iterations: int = 6, resume_at: int = 3,
                         micro_batch_size: int = 2, global_batch_size: int = 8, seq_length: int = 512,
                         max_lr: float = 5e-4) -> list:
    """The runs that check Megatron-Bridge's training loop on its Qwen3.5-VL 2B recipe (the tiny hybrid
    Gated DeltaNet + attention checkpoint of :func:`write_tiny_hf_qwen35_checkpoint`), for :func:`run_on_cpu`
    on two ranks (``tests/bridge/test_training_qwen35.py``, ``benchmarks/training_loop_report.py --model
    qwen35``), all at DP=2 with the collate in the rank's process (no loader workers: the same in every
    run, and cheaper here) and no evaluation:

    * ``megatron_bridge``, ``thd_static``: ``iterations`` with Megatron-Bridge's own step and with ours,
      the first checking the Hugging Face conversion (:func:`pretrained_load_check`);
    * ``thd_first`` / ``thd_resumed``: ``thd`` stopped at ``resume_at`` (``exit_interval``: a checkpoint is
      saved), then resumed from that checkpoint to the end (``train_iters`` kept, so the data order and the
      schedule are the uninterrupted runs'); the resumed run writes no checkpoint.

    ``max_lr``: the peak learning rate (the recipe's is 5e-6, its floor a tenth of it: the floor is scaled
    alike), large enough that a random tiny model's loss falls in a few iterations.
    """
    common = dict(train_iters=iterations, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                  seq_length=seq_length, eval_iters=0, num_workers=0, max_lr=max_lr)
    return [
        ("megatron_bridge", recipe, "megatron_bridge", dict(common, checkpoint=False, check_pretrained_load=True)),
        ("thd_static", recipe, "thd_static", dict(common, checkpoint=False)),
        ("thd_first", recipe, "thd", dict(common, exit_interval=resume_at, run_name="qwen35-thd-resume")),
        ("thd_resumed", recipe, "thd", dict(common, checkpoint="load", run_name="qwen35-thd-resume")),
    ]
