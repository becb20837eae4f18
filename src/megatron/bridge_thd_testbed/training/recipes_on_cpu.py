"""A Megatron-Bridge recipe in its CPU mode: the recipe function by name (:func:`recipe_function`), its config
built without a GPU (:func:`recipe_config`, :func:`recipe_gpu_properties`) and that ``ConfigContainer`` changed only
in model size and device (:func:`cpu_run_config`). Docs: docs/megatron-bridge-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re

__all__ = ["RECIPE", "cpu_run_config", "recipe_function", "recipe_config", "recipe_gpu_properties",
           "is_qwen35_recipe", "is_qwen3_vl_moe_recipe"]

def is_qwen35_recipe(recipe: str) -> bool:
    """A Megatron-Bridge Qwen3.5-VL recipe function's name (``qwen35_vl_*``): its CPU mode runs the tiny
    Qwen3.5-VL checkpoint."""
    return recipe.startswith("qwen35_")


def is_qwen3_vl_moe_recipe(recipe: str) -> bool:
    """A Megatron-Bridge Qwen3-VL MoE recipe function's name (``qwen3_vl_30b_a3b_*``: total and active parameters):
    its CPU mode runs the tiny Qwen3-VL MoE checkpoint."""
    return re.match(r"qwen3_vl_\d+b_a\d+b_", recipe) is not None


# The transformer fields of the CPU build (fp32, no fused kernels, dropout 0), from the test bed's
# own model settings.
_CPU_MODEL_FIELDS = ("use_cpu_initialization", "params_dtype", "pipeline_dtype", "apply_rope_fusion",
                     "bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                     "gradient_accumulation_fusion", "persist_layer_norm", "hidden_dropout", "attention_dropout")
# An MoE provider's fields the CPU build changes: the local layer spec builds Megatron-Core's SequentialMLP experts
# (no grouped GEMM; Megatron-Bridge's Qwen3-VL MoE mappings convert both layouts), and the permutation fusion is a
# Transformer Engine kernel (Megatron-Core's config check refuses it without).
_CPU_MOE_FIELDS = {"moe_grouped_gemm": False, "moe_permute_fusion": False}



RECIPE = object()  # "keep the recipe's value"


def cpu_run_config(cfg, paths: dict, *, train_iters: int, global_batch_size: int, micro_batch_size: int,
                   seq_length: int, tp: int = 1, pp: int = 1, cp: int = 1, save_interval: int | None = None,
                   exit_interval: int | None = None, run_name: str = "run", eval_iters=RECIPE, eval_interval=RECIPE,
                   num_workers=RECIPE, checkpoint: bool | str = True, max_lr=RECIPE):
    """A Megatron-Bridge recipe's ``ConfigContainer`` for the CPU: only model size and device differ.

    The model is the tiny checkpoint's (``AutoBridge.from_hf_pretrained(paths["hf_checkpoint"])``, the
    call the recipes make with the hub name; it is also the pretrained checkpoint ``finetune`` loads;
    ``paths["hf_checkpoint_qwen35"]`` when the recipe's provider is a Qwen3.5-VL one, ``paths["hf_checkpoint_moe"]``
    when it is the Qwen3-VL MoE one) at the given TP / PP / CP (EP 1); the dataset stays the recipe's (its ``cord_v2``
    preset, found under the working directory) with the local processor. What the CPU forces, each for the reason
    given:

    * fp32 model and optimizer: Megatron-Core's mixed-precision optimizers accept only
      ``torch.cuda.*Tensor`` parameters;
    * the non-distributed optimizer: its reduce-scatter / all-gather of sharded buffers has no gloo path;
    * ``clip_grad=0``: ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients
      (the gradient norm is still computed and logged);
    * gloo, no tensorboard;
    * for an MoE model, no grouped GEMM and no permutation fusion (:data:`_CPU_MOE_FIELDS`).

    ``micro_batch_size=1`` also sets ``dataset.enable_in_batch_packing=False``, as a user must: the Qwen3-VL recipes
    set it True, which Megatron-Bridge's ``validate()`` refuses with one sample (``configure`` then turns the step's
    own switch on; docs/configure.md).

    The recipe's loader settings (workers, pinned memory, persistence) and its evaluation
    (``eval_interval``, ``eval_iters``) are kept unless given (``eval_iters``, ``eval_interval``,
    ``num_workers``: a test's shorter evaluation, or no workers); pinned memory has no device to pin for
    on the CPU (the loader warns and copies nothing). ``checkpoint=False`` writes no checkpoint (a run
    that is never resumed: the save costs seconds per run here and is proven by the runs that resume);
    ``checkpoint="load"`` resumes from the run's checkpoint folder and writes none (the last run of a
    stopped-and-resumed pair).
    ``max_lr`` replaces the recipe's peak learning rate, its floor scaled by the same factor (a test's
    knob: the Qwen3.5-VL recipes' 5e-6 moves a random tiny model's loss by less than one batch differs
    from the next in a few iterations).

    Returns:
        ``cfg``, changed in place.
    """
    model, pretrained = _tiny_provider(cfg, paths, tp=tp, pp=pp, cp=cp, seq_length=seq_length)
    cfg.model = model
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.data_parallel_sharding_strategy = "no_shard"
    if cp > 1:  # what a user must set too: validate() refuses CP>1 fine-tuning with averaging in the collective
        cfg.ddp.average_in_collective = False
    if micro_batch_size == 1:
        cfg.dataset.enable_in_batch_packing = False
    cfg.optimizer.clip_grad = 0.0
    cfg.dist.distributed_backend = "gloo"
    cfg.tokenizer.vocab_size = model.vocab_size
    cfg.dataset.seq_length = seq_length
    cfg.dataset.hf_processor_path = paths["processor"]
    if num_workers is not RECIPE:
        cfg.dataset.num_workers = num_workers
    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size = global_batch_size
    cfg.train.micro_batch_size = micro_batch_size
    cfg.scheduler.lr_decay_iters = train_iters
    if max_lr is not RECIPE:
        cfg.optimizer.min_lr = (cfg.optimizer.min_lr or 0.0) * max_lr / cfg.optimizer.lr
        cfg.optimizer.lr = max_lr
    cfg.scheduler.lr_warmup_iters = min(cfg.scheduler.lr_warmup_iters, max(train_iters // 4, 1))
    # A run stopped early keeps train_iters: the dataset's sample order and the schedule are
    # functions of it, so the stopped-and-resumed run follows the uninterrupted one.
    cfg.train.exit_interval = exit_interval
    if eval_iters is not RECIPE:
        cfg.validation.eval_iters = eval_iters
    if eval_interval is not RECIPE:
        cfg.validation.eval_interval = eval_interval
    _checkpoint_settings(cfg, paths, pretrained, run_name=run_name, checkpoint=checkpoint,
                         save_interval=save_interval or train_iters)
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_interval = 1
    return cfg


def _tiny_provider(cfg, paths: dict, *, tp: int, pp: int, cp: int, seq_length: int):
    """The tiny checkpoint's model provider for the CPU (fp32, no fused kernels, dropout 0) at the given TP / PP /
    CP, and that checkpoint's path: ``(provider, pretrained)``."""
    from megatron.bridge import AutoBridge

    from megatron.bridge_thd_cpu.model import tiny_language_settings

    key, flag = _tiny_checkpoint(cfg.model)
    pretrained = paths.get(key)
    if pretrained is None:
        raise ValueError(f"no tiny checkpoint for a {type(cfg.model).__name__} in {paths['workdir']}: "
                         f"prepare_cpu_run(..., {flag}=True) writes it")
    model = AutoBridge.from_hf_pretrained(pretrained).to_megatron_provider(load_weights=False)
    settings = tiny_language_settings(tp=tp, cp=cp, pp=pp)
    for name in _CPU_MODEL_FIELDS:
        setattr(model, name, settings[name])
    if getattr(model, "num_moe_experts", None):
        for name, value in _CPU_MOE_FIELDS.items():
            setattr(model, name, value)
    model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size = tp, pp, cp
    model.sequence_parallel = False
    model.seq_length = seq_length
    model.bf16 = model.fp16 = False
    return model, pretrained


def _tiny_checkpoint(provider) -> tuple[str, str]:
    """Which tiny checkpoint stands in for a recipe's hub model, by the recipe's own provider class: its key in
    :func:`~.checkpoints.prepare_cpu_run`'s paths and the flag that writes it."""
    name = type(provider).__name__
    if name.startswith("Qwen35"):
        return "hf_checkpoint_qwen35", "qwen35"
    if name == "Qwen3VLMoEModelProvider":
        return "hf_checkpoint_moe", "qwen3_vl_moe"
    return "hf_checkpoint", "qwen3_vl"


def _checkpoint_settings(cfg, paths: dict, pretrained: str, *, run_name: str, checkpoint: bool | str,
                         save_interval: int) -> None:
    """The pretrained checkpoint ``finetune`` loads, and the run's own checkpoint folder (see :func:`cpu_run_config`'s
    ``checkpoint``)."""
    cfg.checkpoint.pretrained_checkpoint = pretrained
    folder = os.path.join(paths["workdir"], "checkpoints", run_name) if checkpoint else None
    cfg.checkpoint.save = None if checkpoint == "load" else folder
    cfg.checkpoint.load = folder
    cfg.checkpoint.save_interval = save_interval


def recipe_function(name: str):
    """A Megatron-Bridge recipe function by name (``megatron.bridge.recipes.qwen_vl.h100``, where the recipe scripts import them from)."""
    recipes = importlib.import_module("megatron.bridge.recipes.qwen_vl.h100")
    return getattr(recipes, name)


def recipe_config(name: str):
    """The named recipe's ``ConfigContainer``, built as on the GPU it is written for (:func:`recipe_gpu_properties`)."""
    with recipe_gpu_properties():
        return recipe_function(name)()


class _H100Properties:
    """What ``torch.cuda.get_device_properties(0)`` returns on the GPU the recipes are written for."""

    name = "NVIDIA H100 80GB HBM3"
    major, minor = 9, 0


@contextlib.contextmanager
def recipe_gpu_properties():
    """``torch.cuda.get_device_properties`` answering as the H100 the recipes are written for, inside the block.

    The MoE recipes call ``apply_flex_dispatcher_backend(cfg.model, ...)`` and ``validate()`` calls
    ``validate_flex_dispatcher_backend`` for a flex dispatcher (HybridEP in the Qwen3.5-VL 35B-A3B recipe of the 0.7
    line); both read the device's properties (training/flex_dispatcher_backend.py), which raises on a machine without
    a driver. HybridEP and DeepEP support the H100, so each recipe keeps the dispatcher it picks there.
    """
    import torch

    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: _H100Properties()
    try:
        yield
    finally:
        torch.cuda.get_device_properties = original
