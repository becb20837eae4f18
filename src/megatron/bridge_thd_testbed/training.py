"""Megatron-Bridge's own training loop (``finetune`` -> ``pretrain`` -> ``setup`` / ``train`` /
``train_step``, DDP, optimizer, checkpoints) on a machine without CUDA. Reasoning and the list:
docs/megatron-bridge-on-cpu.md.

:func:`cpu_training_patches` adds to :func:`~megatron.bridge_thd_cpu.stack.cpu_patches` what
the trainer needs, as :class:`~megatron.bridge_thd.patches.Patch` records: ``torch`` as a handful
of trainer modules see it (tensors they ask for on ``"cuda"`` are made on the CPU, ``torch.cuda``'s
synchronisation, cache, stream and memory-statistics calls are no-ops or zeros, its RNG state is
the CPU generator's), and the one Transformer Engine name the Qwen3-VL provider binds at import
(its language layer spec). Everything else (the recipe's config, validation, the provider, DDP,
the distributed optimizer, the schedule, loss reduction, logging, checkpoint save and load) is
Megatron-Bridge's and Megatron-Core's code, unchanged. :func:`cpu_training` applies them for a
``with`` block, inside :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os

import torch

from megatron.bridge_thd.patches import Patch, applied
from megatron.bridge_thd.reporting import counting_step, iteration_recorder, step_for
from megatron.bridge_thd_cpu.stack import _CudaWithoutSync, _TorchOnCpu, cpu_stack

__all__ = ["cpu_training", "cpu_training_patches", "TRAINER_MODULES", "prepare_cpu_run", "cpu_run_config",
           "run_recipe_on_cpu", "run_on_cpu", "recipe_function",
           "write_tiny_hf_checkpoint", "write_tiny_hf_qwen35_checkpoint", "TRAINING_VISION_GEOMETRY",
           "training_loop_runs", "is_qwen35_recipe", "pretrained_load_check", "qwen35_training_runs",
           "QWEN35_RECIPE"]

# The trainer modules that allocate on "cuda" or call torch.cuda directly (in the pinned Megatron-Bridge;
# docs/compatibility.md).
TRAINER_MODULES = (
    "megatron.bridge.training.setup",
    "megatron.bridge.training.initialize",
    "megatron.bridge.training.train",
    "megatron.bridge.training.eval",
    "megatron.bridge.training.utils.train_utils",
    "megatron.bridge.training.checkpointing",
    "megatron.bridge.models.model_provider",
    "megatron.bridge.data.loaders",
    "megatron.core.timers",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.tensor_parallel.random",
    "megatron.training.models.dist_utils",
    "megatron.training.utils.common_utils",
)


def _stay_on_cpu(tensor, device=None, non_blocking=False, **kwargs):
    """``Tensor.cuda`` on a machine whose only device is the CPU: the tensor itself."""
    return tensor


def _set_rng_state_on_cpu(new_state, device=-1, graph_safe=False):
    """``tensor_parallel.random._set_cuda_rng_state`` with the CPU generator as the device's."""
    torch.set_rng_state(new_state)


def _get_rng_state_on_cpu(device="cuda", clone=False, graph_safe=False):
    """``tensor_parallel.random._get_cuda_rng_state`` with the CPU generator as the device's."""
    return torch.get_rng_state()


class _CpuEvent:
    """``torch.cuda.Event`` on the CPU: wall-clock timestamps."""

    def __init__(self, *args, **kwargs):
        self.time = None

    def record(self, stream=None):
        import time

        self.time = time.perf_counter()

    def synchronize(self):
        return None

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1000.0


def _nothing(*args, **kwargs):
    return None


def _zero(*args, **kwargs):
    return 0


class _CudaForTrainer(_CudaWithoutSync):
    """``torch.cuda`` as the trainer modules see it on the CPU (see the module docstring)."""

    _NO_OPS = ("synchronize", "empty_cache", "set_device", "set_stream", "reset_peak_memory_stats")
    _ZEROS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")

    def __getattr__(self, name):
        if name == "is_available":
            return lambda: True  # initialize_megatron asserts it; the device is the CPU
        if name in self._NO_OPS:
            return _nothing
        if name in self._ZEROS:
            return _zero
        if name == "device_count":
            return lambda: 1  # one device, the CPU: the trainer then seeds Megatron's RNG tracker
        if name in ("manual_seed", "manual_seed_all"):
            return lambda seed: torch.manual_seed(seed)
        if name == "memory_stats":
            return lambda *args, **kwargs: {}
        if name == "get_rng_state":
            return lambda *args, **kwargs: torch.get_rng_state()
        if name == "set_rng_state":
            return lambda state, *args, **kwargs: torch.set_rng_state(state)
        if name == "Event":
            return _CpuEvent
        return super().__getattr__(name)


class _TorchForTrainer(_TorchOnCpu):
    """``torch`` as the trainer modules see it: more factories asked for ``"cuda"`` make CPU
    tensors, and ``torch.cuda`` is :class:`_CudaForTrainer`."""

    FACTORIES = _TorchOnCpu.FACTORIES + ("rand", "randn", "randint", "arange")
    CUDA = _CudaForTrainer


def _local_language_layer_spec(*args, **kwargs):
    """``bridge_thd_cpu.model.language_layer_spec`` (the local GPT layer spec with the CPU THD core attention),
    called as Megatron-Core's ``get_gpt_layer_with_transformer_engine_spec(num_experts,
    moe_grouped_gemm, qk_layernorm, ...)``."""
    from types import SimpleNamespace

    from megatron.bridge_thd_cpu.model import language_layer_spec

    names = ("num_experts", "moe_grouped_gemm", "qk_layernorm")
    settings = dict(zip(names, args))
    settings.update({key: value for key, value in kwargs.items() if key in names})
    return language_layer_spec(SimpleNamespace(num_moe_experts=settings.get("num_experts"),
                                               qk_layernorm=settings.get("qk_layernorm", False),
                                               normalization="RMSNorm"))


def _local_hybrid_block_spec(config, vp_stage=None, pp_rank=None):
    """``bridge_thd_cpu.qwen35.hybrid_block_spec`` (Gated DeltaNet and full-attention layers from local modules, the
    CPU THD core attention, zero-centred RMSNorm) sliced to this pipeline stage's layers as Megatron-Core's
    ``get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage, pp_rank)`` slices its
    Transformer Engine layers (that function asserts Transformer Engine)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron.bridge_thd_cpu.qwen35 import hybrid_block_spec

    block = hybrid_block_spec(config)
    if config.pipeline_model_parallel_layout is not None:
        from megatron.core.transformer.enums import LayerType

        local = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                         vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    return TransformerBlockSubmodules(layer_specs=[block.layer_specs[i] for i in local], layer_norm=block.layer_norm)


def _helpers_prebuilt() -> bool:
    return importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None


def _compile_helpers_prebuilt():
    """The megatron-core wheel ships ``helpers_cpp`` compiled and no Makefile: nothing to build."""
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def cpu_training_patches() -> list[Patch]:
    """The trainer's patches (on top of ``cpu_patches``); the Qwen3-VL providers' layer spec always,
    the rest only without CUDA."""
    providers = importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_provider")
    qwen35 = importlib.import_module("megatron.bridge.models.qwen_vl.qwen35_vl_provider")
    patches = [
        Patch(providers, "get_gpt_layer_with_transformer_engine_spec", _local_language_layer_spec,
              "a Transformer Engine spec qwen3_vl_provider.py binds at import: the local spec with the CPU THD attention"),
        Patch(qwen35, "get_transformer_block_with_experimental_attention_variant_spec", _local_hybrid_block_spec,
              "qwen35_vl_provider.py builds its hybrid block with it, and it asserts Transformer Engine: the same "
              "Gated DeltaNet / attention layers from local modules (bridge_thd_cpu.qwen35), sliced per pipeline stage"),
    ]
    if _helpers_prebuilt():
        initialize = importlib.import_module("megatron.bridge.training.initialize")
        patches.append(Patch(initialize, "compile_helpers", _compile_helpers_prebuilt,
                             "initialize_megatron runs `make` in megatron/core/datasets, which the wheel ships "
                             "without a Makefile (helpers_cpp comes prebuilt): sys.exit(1) otherwise"))
    if not torch.cuda.is_available():
        for name in TRAINER_MODULES:
            patches.append(Patch(importlib.import_module(name), "torch", _TorchForTrainer(),
                                 "allocates on 'cuda' / calls torch.cuda: CPU tensors, no-op syncs, CPU RNG state"))
        patches.append(Patch(torch.Tensor, "cuda", _stay_on_cpu,
                             "get_model moves the model with Module.cuda(), Megatron-Bridge's qwen3_vl_step and "
                             "eval.py move batches and accumulators with Tensor.cuda(): they stay on the CPU"))
        random = importlib.import_module("megatron.core.tensor_parallel.random")
        swaps = "Megatron's RNG tracker swaps generator states through it: the CPU generator's"
        patches += [Patch(random, "_set_cuda_rng_state", _set_rng_state_on_cpu, swaps),
                    Patch(random, "_get_cuda_rng_state", _get_rng_state_on_cpu, swaps)]
    return patches


@contextlib.contextmanager
def cpu_training():
    """``cpu_stack()`` plus :func:`cpu_training_patches` for the duration of the block."""
    with cpu_stack(), applied(cpu_training_patches()):
        yield


# Qwen3-VL's own vision geometry (patch 16, temporal patch 2, merge 2): with Megatron-Bridge's
# collate forcing min_pixels=200704, an image gives the same number of tokens as on the real model.
TRAINING_VISION_GEOMETRY = dict(patch_size=16, temporal_patch_size=2, spatial_merge_size=2)


def write_tiny_hf_checkpoint(folder, *, token_ids: dict, seed: int = 0, moe: bool = False, num_layers: int = 2) -> str:
    """Save a tiny random Hugging Face Qwen3-VL (``save_pretrained``) whose tokens agree with a processor.

    This is the "pretrained checkpoint" of the CPU runs: the recipe's ``AutoBridge.from_hf_pretrained``
    reads its config and ``finetune`` loads its weights through Megatron-Bridge's own HF conversion,
    as it does for ``Qwen/Qwen3-VL-8B-Instruct``. Language model as ``ReferenceQwen3VL.tiny`` (hidden
    64, 4 heads of 16 over 2 KV groups, MRoPE [2, 3, 3]); vision tower of ``TINY_VISION_CONFIG`` with
    Qwen3-VL's patch geometry (:data:`TRAINING_VISION_GEOMETRY`).

    Args:
        folder: created if needed.
        token_ids: ``vocab_size``, ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
            ``vision_end_token_id``, ``pad_token_id``, ``eos_token_id`` (e.g. ``cord_v2.PROCESSOR_TOKEN_IDS``).
        seed: the weights are a function of the seed.

    Returns:
        ``str(folder)``.
    """
    from megatron.bridge_thd_cpu.reference import tiny_hf_qwen3_vl_config

    ids = token_ids
    config, model_cls = tiny_hf_qwen3_vl_config(
        text=dict(vocab_size=ids["vocab_size"], num_hidden_layers=num_layers, max_position_embeddings=8192,
                  pad_token_id=ids["pad_token_id"], eos_token_id=ids["eos_token_id"],
                  **(dict(num_experts=4) if moe else {})),
        # One deepstack layer: it must sit on the first pipeline stage, which has one layer at PP=2.
        vision=dict(TRAINING_VISION_GEOMETRY, deepstack_visual_indexes=[0]),
        tokens={name: ids[name] for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                             "vision_end_token_id")},
        moe=moe,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(str(folder))
    return str(folder)


# The tiny Qwen3.5-VL language model (Hugging Face ``text_config`` fields): hidden 64, 4 query heads of 32 over
# 2 KV groups with Qwen3.5's output gate and partial rotary (a quarter of each head: 8 dims, MRoPE sections
# [2, 1, 1] where the 2B has [11, 11, 10] of 64), SwiGLU 128; Gated DeltaNet with 2 key heads and 4 value
# heads of 16 (two value heads per key head, as the larger Qwen3.5 models group them; the 2B has 16 of each),
# conv kernel 4.
TINY_QWEN35_TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True, "partial_rotary_factor": 0.25},
)


def write_tiny_hf_qwen35_checkpoint(folder, *, token_ids: dict, seed: int = 0,
                                    layer_types=("linear_attention", "full_attention")) -> str:
    """Save a tiny random Hugging Face Qwen3.5-VL (``Qwen3_5ForConditionalGeneration.save_pretrained``, the
    class Megatron-Bridge's ``Qwen35VLBridge`` converts from) whose tokens agree with a processor.

    The Qwen3.5-VL recipes' stand-in for ``Qwen/Qwen3.5-2B``: ``AutoBridge.from_hf_pretrained`` reads it
    into a ``Qwen35VLModelProvider`` and ``finetune`` loads its weights through the bridge's own mappings
    (Gated DeltaNet ``in_proj`` from ``in_proj_qkv/z/b/a``, its conv, ``A_log``, ``dt_bias``, gated norm;
    the gated attention's QKV; zero-centred norms). Language model: :data:`TINY_QWEN35_TEXT_CONFIG`, the
    layers ``layer_types`` (default one Gated DeltaNet layer, then one full-attention layer: the hybrid
    pattern at its smallest); vision tower: two blocks of width 32 with Qwen3.5's patch geometry (patch
    16, temporal patch 2, merge 2: :data:`TRAINING_VISION_GEOMETRY`) and, as Qwen3.5 has, no deepstack.
    No multi-token prediction: Hugging Face's class has no MTP module (it ignores ``mtp.*`` tensors on
    load) and saves none, so the provider read from it has no MTP layer, whereas the real checkpoint
    carries ``mtp.*`` tensors and the 2B SFT recipe sets ``mtp_num_layers=1``: the CPU mode, whose model is
    this checkpoint's provider, trains without the MTP head.

    Returns:
        ``str(folder)``.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    ids = token_ids
    text = dict(TINY_QWEN35_TEXT_CONFIG, vocab_size=ids["vocab_size"], num_hidden_layers=len(layer_types),
                layer_types=list(layer_types), max_position_embeddings=8192, pad_token_id=ids["pad_token_id"],
                eos_token_id=ids["eos_token_id"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=64, **TRAINING_VISION_GEOMETRY)
    tokens = {name: ids[name] for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                           "vision_end_token_id")}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    torch.manual_seed(seed)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(str(folder))
    return str(folder)


def is_qwen35_recipe(recipe: str) -> bool:
    """A Megatron-Bridge Qwen3.5-VL recipe function's name (``qwen35_vl_*``): its CPU mode runs the tiny
    Qwen3.5-VL checkpoint."""
    return recipe.startswith("qwen35_")


# The transformer fields of the CPU build (fp32, no fused kernels, dropout 0), from the test bed's
# own model settings.
_CPU_MODEL_FIELDS = ("use_cpu_initialization", "params_dtype", "pipeline_dtype", "apply_rope_fusion",
                     "bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                     "gradient_accumulation_fusion", "persist_layer_norm", "hidden_dropout", "attention_dropout")


def prepare_cpu_run(workdir, *, n_train: int = 64, n_val: int = 8, seed: int = 0, qwen3_vl: bool = True,
                    qwen35: bool = False) -> dict:
    """Write what a CPU run reads: the cord_v2-shaped dataset (``workdir/naver-clova-ix/cord-v2``, where
    the recipe's ``cord_v2`` preset finds it from the working directory ``workdir``), the tiny
    processor (``workdir/processor``, Qwen3-VL's patch geometry, which Qwen3.5-VL shares: both use
    ``Qwen3VLProcessor``) and the tiny Hugging Face checkpoints: Qwen3-VL (``workdir/hf``, with
    ``qwen3_vl``) and Qwen3.5-VL (``workdir/hf_qwen35``, with ``qwen35``). Call once, before the ranks start.

    Returns:
        ``{"workdir", "dataset", "processor", "hf_checkpoint", "hf_checkpoint_qwen35"}`` (paths as strings;
        a checkpoint not written is None).
    """
    from megatron.bridge_thd_cpu.cord_v2 import PROCESSOR_TOKEN_IDS, tiny_qwen3_vl_processor, write_cord_v2_preset_layout

    workdir = os.path.abspath(str(workdir))
    dataset = write_cord_v2_preset_layout(workdir, n_train=n_train, n_val=n_val, seed=seed)
    processor = os.path.join(workdir, "processor")
    tiny_qwen3_vl_processor(processor, patch_size=TRAINING_VISION_GEOMETRY["patch_size"])
    hf_checkpoint = (write_tiny_hf_checkpoint(os.path.join(workdir, "hf"), token_ids=PROCESSOR_TOKEN_IDS, seed=seed)
                     if qwen3_vl else None)
    hf_qwen35 = (write_tiny_hf_qwen35_checkpoint(os.path.join(workdir, "hf_qwen35"), token_ids=PROCESSOR_TOKEN_IDS,
                                                 seed=seed) if qwen35 else None)
    return {"workdir": workdir, "dataset": str(dataset), "processor": processor, "hf_checkpoint": hf_checkpoint,
            "hf_checkpoint_qwen35": hf_qwen35}


RECIPE = object()  # "keep the recipe's value"


def cpu_run_config(cfg, paths: dict, *, train_iters: int, global_batch_size: int, micro_batch_size: int,
                   seq_length: int, tp: int = 1, pp: int = 1, cp: int = 1, save_interval: int | None = None,
                   exit_interval: int | None = None, run_name: str = "run", eval_iters=RECIPE, eval_interval=RECIPE,
                   num_workers=RECIPE, checkpoint: bool | str = True, max_lr=RECIPE):
    """A Megatron-Bridge recipe's ``ConfigContainer`` for the CPU: only model size and device differ.

    The model is the tiny checkpoint's (``AutoBridge.from_hf_pretrained(paths["hf_checkpoint"])``, the
    call the recipes make with the hub name; it is also the pretrained checkpoint ``finetune`` loads;
    ``paths["hf_checkpoint_qwen35"]`` when the recipe's provider is a Qwen3.5-VL one) at the given TP / PP / CP; the dataset stays the recipe's (its ``cord_v2`` preset, found under the
    working directory) with the local processor. What the CPU forces, each for the reason given:

    * fp32 model and optimizer: Megatron-Core's mixed-precision optimizers accept only
      ``torch.cuda.*Tensor`` parameters;
    * the non-distributed optimizer: its reduce-scatter / all-gather of sharded buffers has no gloo path;
    * ``clip_grad=0``: ``clip_grad_by_total_norm_fp32`` asserts ``torch.cuda.FloatTensor`` gradients
      (the gradient norm is still computed and logged);
    * gloo, no tensorboard.

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
    from megatron.bridge import AutoBridge

    from megatron.bridge_thd_cpu.model import tiny_language_settings

    # The recipe's own provider class says which tiny checkpoint stands in for its hub model.
    pretrained = paths["hf_checkpoint_qwen35" if type(cfg.model).__name__.startswith("Qwen35") else "hf_checkpoint"]
    if pretrained is None:
        raise ValueError(f"no tiny checkpoint for a {type(cfg.model).__name__} in {paths['workdir']}: "
                         "prepare_cpu_run(..., qwen35=True) writes the Qwen3.5-VL one")
    model = AutoBridge.from_hf_pretrained(pretrained).to_megatron_provider(load_weights=False)
    settings = tiny_language_settings(tp=tp, cp=cp, pp=pp)
    for name in _CPU_MODEL_FIELDS:
        setattr(model, name, settings[name])
    model.tensor_model_parallel_size, model.pipeline_model_parallel_size, model.context_parallel_size = tp, pp, cp
    model.sequence_parallel = False
    model.seq_length = seq_length
    model.bf16 = model.fp16 = False
    cfg.model = model
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = cfg.optimizer.fp16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.data_parallel_sharding_strategy = "no_shard"
    if cp > 1:  # what a user must set too: validate() refuses CP>1 fine-tuning with averaging in the collective
        cfg.ddp.average_in_collective = False
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
    cfg.checkpoint.pretrained_checkpoint = pretrained
    folder = os.path.join(paths["workdir"], "checkpoints", run_name) if checkpoint else None
    cfg.checkpoint.save = None if checkpoint == "load" else folder
    cfg.checkpoint.load = folder
    cfg.checkpoint.save_interval = save_interval or train_iters
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_interval = 1
    return cfg


def recipe_function(name: str):
    """A Megatron-Bridge recipe function by name (``megatron.bridge.recipes.qwen_vl.h100``, where the recipe scripts import them from)."""
    recipes = importlib.import_module("megatron.bridge.recipes.qwen_vl.h100")
    return getattr(recipes, name)


def pretrained_load_check(hf_checkpoint: str):
    """A Megatron-Bridge ``Callback`` that checks, when training starts from the Hugging Face checkpoint
    (iteration 0, not a resume), that Megatron-Bridge's conversion loaded all of it and nothing else:
    its conversion tasks for the model (``AutoBridge.get_conversion_tasks``) cover every model parameter
    and use every tensor of the checkpoint, and the bridge's own export of the model
    (``export_hf_weights``) gives those tensors back value for value. Megatron-Bridge's trainer filters
    WARNING records from every logger (``logger.filter_warnings``), so a parameter the conversion has
    no mapping or tensor for would otherwise be left at its initial value without a word.

    Its ``result`` after training: None (a resumed run) or ``{"layers", "tensors", "parameters",
    "unmapped_parameters", "unused_tensors", "exported_missing", "max_abs_diff"}``: the checkpoint's
    tensor count, the model's parameter count, parameters no conversion task covers, checkpoint tensors
    no task reads, tensors a task reads that the export does not give back (a task whose tensor the
    checkpoint lacks), and the largest difference between a checkpoint tensor and its export; ``layers``:
    the class of each language-model layer's mixer (``GatedDeltaNet``, ``Qwen3VLSelfAttention``)."""
    import glob

    from megatron.bridge.training.callbacks import Callback

    class PretrainedLoadCheck(Callback):
        result = None

        def on_train_start(self, context):
            if int(context.state.train_state.step) != 0:
                return
            from megatron.bridge import AutoBridge
            from megatron.core.utils import unwrap_model
            from safetensors.torch import load_file

            expected = {}
            for path in sorted(glob.glob(os.path.join(hf_checkpoint, "*.safetensors"))):
                expected.update(load_file(path))
            bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
            tasks = [task for task in bridge.get_conversion_tasks(context.model) if task is not None]
            used = set()
            for task in tasks:
                names = task.mapping.hf_param
                used.update([names] if isinstance(names, str) else names.values())
            parameters = [name for chunk in unwrap_model(context.model) for name, _ in chunk.named_parameters()]
            exported = {name: tensor.detach().cpu() for name, tensor in
                        bridge.export_hf_weights(context.model, cpu=True, show_progress=False)}
            self.result = {
                # What each decoder layer's mixer is (Gated DeltaNet or attention), on the first chunk.
                "layers": [type(layer.self_attention).__name__
                           for layer in unwrap_model(context.model)[0].language_model.decoder.layers],
                "tensors": len(expected),
                "parameters": len(parameters),
                "unmapped_parameters": sorted(set(parameters) - {task.param_name for task in tasks}),
                "unused_tensors": sorted(set(expected) - used),
                "max_abs_diff": max(float((expected[n].float() - exported[n].float()).abs().max())
                                    for n in expected if n in exported),
                "exported_missing": sorted(set(used) - set(exported)),
            }

    return PretrainedLoadCheck()


def run_recipe_on_cpu(recipe: str, paths: dict, layout: str, *, train_iters: int, global_batch_size: int = 8,
                      micro_batch_size: int = 2, seq_length: int = 512, tp: int = 1, pp: int = 1, cp: int = 1,
                      save_interval: int | None = None, exit_interval: int | None = None,
                      run_name: str | None = None, count_tokens: bool = True,
                      global_batch_packing: dict | None = None, per_token_loss: bool = False,
                      eval_iters=RECIPE, eval_interval=RECIPE, num_workers=RECIPE, checkpoint: bool | str = True,
                      max_lr=RECIPE, check_pretrained_load: bool = False) -> dict:
    """Run Megatron-Bridge's ``finetune()`` on this rank for a recipe in its CPU mode
    (:func:`cpu_run_config`), with ``layout``'s step (:func:`megatron.bridge_thd.reporting.step_for`; ours after
    ``configure(cfg, layout)``). Call on every rank of a world started with
    ``run_on_gloo(..., whole_bridge=True, initialize=False)`` inside ``hf_hub.offline_hub()``; a run
    whose checkpoint folder already holds a checkpoint resumes from it.

    ``global_batch_packing``: the keywords of a ``batching.bridge.GlobalBatchPacking`` to turn it on
    (``sizes_cache`` defaults to ``workdir/sizes``); its per-step log lines are recorded.
    ``per_token_loss``: ``model.calculate_per_token_loss`` (and ``ddp.average_in_collective=False``,
    which Megatron-Core's DDP requires with it), as global-batch packing sets them.
    ``max_lr``: :func:`cpu_run_config`'s. ``check_pretrained_load``: run :func:`pretrained_load_check`
    (its result under ``"pretrained_load"``).

    Returns:
        ``{"iterations": [recorded rows], "micro_batches": [real / supervised token counts],
        "placements": [global-batch packing log lines, global rank 0], "evaluations": [validation and
        test losses], "pretrained_load": the conversion check or None}``.
    """
    from megatron.bridge.training.finetune import finetune

    from megatron.bridge_thd.configure import configure

    os.chdir(paths["workdir"])  # the recipe's cord_v2 preset resolves its hub path from here
    cfg = cpu_run_config(recipe_function(recipe)(), paths, train_iters=train_iters, global_batch_size=global_batch_size,
                         micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp, pp=pp, cp=cp,
                         save_interval=save_interval, exit_interval=exit_interval,
                         run_name=run_name or f"{recipe}-{layout}", eval_iters=eval_iters, eval_interval=eval_interval,
                         num_workers=num_workers, checkpoint=checkpoint, max_lr=max_lr)
    if per_token_loss or global_batch_packing is not None:
        # The recipes set ddp.average_in_collective=True explicitly; configure refuses to overwrite an
        # explicit setting, so a user turning global-batch packing on sets it, as here.
        cfg.ddp.average_in_collective = False
    if per_token_loss:
        cfg.model.calculate_per_token_loss = True
    placement = None
    if global_batch_packing is not None:
        from megatron.bridge_thd.batching.bridge import GlobalBatchPacking

        placement = GlobalBatchPacking(**{"sizes_cache": os.path.join(paths["workdir"], "sizes"),
                                          **global_batch_packing})
    if layout != "megatron_bridge":
        cfg = configure(cfg, layout=layout, global_batch_packing=placement)
    counts: list = []
    step = counting_step(step_for(layout), counts) if count_tokens else step_for(layout)

    recorder = iteration_recorder()
    callbacks = [recorder]
    if check_pretrained_load:
        callbacks.append(pretrained_load_check(cfg.checkpoint.pretrained_checkpoint))
    with cpu_training(), _log_lines("megatron.bridge_thd.batching") as placements:
        try:
            finetune(cfg, forward_step_func=step, callbacks=callbacks)
        except SystemExit as stop:
            # exit_interval: the trainer saves a checkpoint and calls sys.exit(0), as a job ends;
            # here the rank goes on, so it releases what the job's exit would have.
            if stop.code not in (0, None) or exit_interval is None:
                raise
            from megatron.bridge.training.initialize import destroy_global_state

            destroy_global_state()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return {"iterations": recorder.rows, "micro_batches": counts, "placements": placements,
            "evaluations": recorder.evaluations,
            "pretrained_load": callbacks[1].result if check_pretrained_load else None}


@contextlib.contextmanager
def _log_lines(name: str, level: int = logging.INFO):
    """The lines of ``level`` and above the ``name`` logger tree emits inside the block, as strings."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, target = _Keep(level), logging.getLogger(name)
    saved = target.level
    target.addHandler(handler)
    target.setLevel(level)
    try:
        yield lines
    finally:
        target.removeHandler(handler)
        target.setLevel(saved)


def _run_in_order(paths: dict, runs: list, ports: list, start_method: str = "fork") -> dict:
    """One rank's side of :func:`run_on_cpu`: each ``(key, recipe, layout, settings)`` in turn, with
    the data loader workers started by ``start_method``, set here explicitly: the test bed's ranks come
    from a forkserver and would otherwise take whatever start method their parent process chose; a rank
    torchrun starts is a fresh interpreter whose workers Linux forks, the setting the recipes' loader
    workers meet in a real run. ``ports``: one rendezvous port per run (``standalone.free_ports``)."""
    import multiprocessing

    multiprocessing.set_start_method(start_method, force=True)
    results = {}
    for (key, recipe, layout, settings), port in zip(runs, ports, strict=True):
        # Each finetune() makes and destroys its own process group: a fresh rendezvous port, the same on every rank.
        os.environ["MASTER_PORT"] = str(port)
        results[key] = run_recipe_on_cpu(recipe, paths, layout, **settings)
    return results


def run_on_cpu(runs: list, *, workdir, world_size: int = 2, timeout: float = 600.0, paths: dict | None = None,
               start_method: str = "fork") -> list:
    """Run Megatron-Bridge recipes in their CPU mode, one after another, on ``world_size`` gloo ranks.

    Args:
        runs: ``(key, recipe function name, layout or "megatron_bridge", settings)``; settings are
            :func:`run_recipe_on_cpu`'s keywords (``train_iters``, ``micro_batch_size``, ``pp``, ...).
        workdir: where the dataset, processor, tiny checkpoint and checkpoints go.
        paths: what :func:`prepare_cpu_run` returned, if it was already called for ``workdir``.
        start_method: how each rank's data loader workers start (``"fork"``, as under torchrun on Linux).

    Returns:
        Per rank, ``{key: run_recipe_on_cpu(...)}``.
    """
    from megatron.bridge_thd_cpu.hf_hub import offline_hub
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.standalone import free_ports

    paths = paths or prepare_cpu_run(workdir, qwen3_vl=any(not is_qwen35_recipe(run[1]) for run in runs),
                                     qwen35=any(is_qwen35_recipe(run[1]) for run in runs))
    with offline_hub():
        return run_on_gloo(_run_in_order, paths, runs, free_ports(len(runs)), start_method, dp=world_size,
                           whole_bridge=True, initialize=False, timeout=timeout)


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
