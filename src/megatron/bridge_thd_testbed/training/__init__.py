"""Megatron-Bridge's own training loop (``finetune`` -> ``pretrain`` -> ``setup`` / ``train`` /
``train_step``, DDP, optimizer, checkpoints) on a machine without CUDA. Reasoning and the list:
docs/megatron-bridge-on-cpu.md.

One module per job, every name re-exported here (``from megatron.bridge_thd_testbed.training import ...``):

* ``trainer_on_cpu``: the trainer's CPU patches (:func:`cpu_training_patches`, :func:`cpu_training`,
  ``TRAINER_MODULES``). Everything else (the recipe's config, validation, the provider, DDP, the distributed
  optimizer, the schedule, loss reduction, logging, checkpoint save and load) is Megatron-Bridge's and
  Megatron-Core's code, unchanged;
* ``checkpoints``: the tiny Hugging Face checkpoints, :func:`prepare_cpu_run` (what a CPU run reads) and
  :func:`pretrained_load_check`;
* ``recipes_on_cpu``: a recipe's CPU mode (:func:`cpu_run_config`, :func:`recipe_function`);
* ``runner``: :func:`run_on_cpu` (gloo ranks, one ``finetune()`` per run: :func:`run_recipe_on_cpu`);
* ``runs``: the runs of the training-loop tests (:func:`training_loop_runs`, :func:`qwen35_training_runs`).
"""

from __future__ import annotations

from megatron.bridge_thd_testbed.training.checkpoints import (
    TRAINING_VISION_GEOMETRY,
    prepare_cpu_run,
    pretrained_load_check,
    write_tiny_hf_checkpoint,
    write_tiny_hf_qwen35_checkpoint,
)
from megatron.bridge_thd_testbed.training.recipes_on_cpu import (
    cpu_run_config,
    is_qwen3_vl_moe_recipe,
    is_qwen35_recipe,
    recipe_config,
    recipe_function,
    recipe_gpu_properties,
)
from megatron.bridge_thd_testbed.training.runner import run_on_cpu, run_recipe_on_cpu
from megatron.bridge_thd_testbed.training.runs import QWEN35_RECIPE, qwen35_training_runs, training_loop_runs
from megatron.bridge_thd_testbed.training.trainer_on_cpu import TRAINER_MODULES, cpu_training, cpu_training_patches

__all__ = ["cpu_training", "cpu_training_patches", "TRAINER_MODULES", "prepare_cpu_run", "cpu_run_config",
           "run_recipe_on_cpu", "run_on_cpu", "recipe_function", "recipe_config", "recipe_gpu_properties",
           "write_tiny_hf_checkpoint", "write_tiny_hf_qwen35_checkpoint", "TRAINING_VISION_GEOMETRY",
           "training_loop_runs", "is_qwen35_recipe", "is_qwen3_vl_moe_recipe", "pretrained_load_check", "qwen35_training_runs",
           "QWEN35_RECIPE"]
