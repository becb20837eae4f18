"""Megatron-Bridge 0.6.2's own training loop (``finetune`` -> ``pretrain`` -> ``setup`` / ``train`` /
``train_step``, DDP, optimizer, checkpoints) on a machine without CUDA. Reasoning and the list:
docs/megatron-bridge-on-cpu.md.

:func:`cpu_training_patches` adds to :func:`~megatron.bridge_thd.testbed.stack.cpu_patches` what
the trainer needs, as :class:`~megatron.bridge_thd.patches.Patch` records: ``torch`` as a handful
of trainer modules see it (tensors they ask for on ``"cuda"`` are made on the CPU, ``torch.cuda``'s
synchronisation, cache, stream and memory-statistics calls are no-ops or zeros, its RNG state is
the CPU generator's), and the one Transformer Engine name the Qwen3-VL provider binds at import
(its language layer spec). Everything else (the recipe's config, validation, the provider, DDP,
the distributed optimizer, the schedule, loss reduction, logging, checkpoint save and load) is
Megatron-Bridge's and Megatron-Core's code, unchanged. :func:`cpu_training` applies them for a
``with`` block, inside :func:`~megatron.bridge_thd.testbed.stack.cpu_stack`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os


import torch

from megatron.bridge_thd.patches import Patch, applied
from megatron.bridge_thd.testbed.stack import _CudaWithoutSync, _TorchOnCpu, cpu_stack

__all__ = ["cpu_training", "cpu_training_patches", "TRAINER_MODULES", "prepare_cpu_run", "cpu_run_config",
           "run_recipe_on_cpu", "run_on_cpu", "iteration_recorder", "counting_step", "step_for", "recipe_function",
           "write_tiny_hf_checkpoint", "TRAINING_VISION_GEOMETRY", "training_loop_runs"]

# The trainer modules that allocate on "cuda" or call torch.cuda directly (Megatron-Bridge 0.6.2).
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
    """``testbed.model.language_layer_spec`` (the local GPT layer spec with the CPU THD core attention),
    called as Megatron-Core's ``get_gpt_layer_with_transformer_engine_spec(num_experts,
    moe_grouped_gemm, qk_layernorm, ...)``."""
    from types import SimpleNamespace

    from megatron.bridge_thd.testbed.model import language_layer_spec

    names = ("num_experts", "moe_grouped_gemm", "qk_layernorm")
    settings = dict(zip(names, args))
    settings.update({key: value for key, value in kwargs.items() if key in names})
    return language_layer_spec(SimpleNamespace(num_moe_experts=settings.get("num_experts"),
                                               qk_layernorm=settings.get("qk_layernorm", False),
                                               normalization="RMSNorm"))


def _helpers_prebuilt() -> bool:
    return importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None


def _compile_helpers_prebuilt():
    """The megatron-core wheel ships ``helpers_cpp`` compiled and no Makefile: nothing to build."""
    importlib.import_module("megatron.core.datasets.helpers_cpp")


def cpu_training_patches() -> list[Patch]:
    """The trainer's patches (on top of ``cpu_patches``); the Qwen3-VL providers' layer spec always,
    the rest only without CUDA."""
    providers = importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_provider")
    patches = [
        Patch(providers, "get_gpt_layer_with_transformer_engine_spec", _local_language_layer_spec,
              "a Transformer Engine spec qwen3_vl_provider.py binds at import: the local spec with the CPU THD attention"),
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
    from megatron.bridge_thd.testbed.reference import tiny_hf_qwen3_vl_config

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


# The transformer fields of the CPU build (fp32, no fused kernels, dropout 0), from the test bed's
# own model settings.
_CPU_MODEL_FIELDS = ("use_cpu_initialization", "params_dtype", "pipeline_dtype", "apply_rope_fusion",
                     "bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                     "gradient_accumulation_fusion", "persist_layer_norm", "hidden_dropout", "attention_dropout")


def prepare_cpu_run(workdir, *, n_train: int = 64, n_val: int = 8, seed: int = 0) -> dict:
    """Write what a CPU run reads: the cord_v2-shaped dataset (``workdir/naver-clova-ix/cord-v2``, where
    the recipe's ``cord_v2`` preset finds it from the working directory ``workdir``), the tiny
    processor (``workdir/processor``, Qwen3-VL's patch geometry) and the tiny Hugging Face checkpoint
    (``workdir/hf``). Call once, before the ranks start.

    Returns:
        ``{"workdir", "dataset", "processor", "hf_checkpoint"}`` (paths as strings).
    """
    from megatron.bridge_thd.testbed.cord_v2 import PROCESSOR_TOKEN_IDS, tiny_qwen3_vl_processor, write_cord_v2_preset_layout

    workdir = os.path.abspath(str(workdir))
    dataset = write_cord_v2_preset_layout(workdir, n_train=n_train, n_val=n_val, seed=seed)
    processor = os.path.join(workdir, "processor")
    tiny_qwen3_vl_processor(processor, patch_size=TRAINING_VISION_GEOMETRY["patch_size"])
    hf_checkpoint = write_tiny_hf_checkpoint(os.path.join(workdir, "hf"), token_ids=PROCESSOR_TOKEN_IDS, seed=seed)
    return {"workdir": workdir, "dataset": str(dataset), "processor": processor, "hf_checkpoint": hf_checkpoint}


RECIPE = object()  # "keep the recipe's value"


def cpu_run_config(cfg, paths: dict, *, train_iters: int, global_batch_size: int, micro_batch_size: int,
                   seq_length: int, tp: int = 1, pp: int = 1, cp: int = 1, save_interval: int | None = None,
                   exit_interval: int | None = None, run_name: str = "run", eval_iters=RECIPE, eval_interval=RECIPE,
                   num_workers=RECIPE, checkpoint: bool = True):
    """A Megatron-Bridge recipe's ``ConfigContainer`` for the CPU: only model size and device differ.

    The model is the tiny checkpoint's (``AutoBridge.from_hf_pretrained(paths["hf_checkpoint"])``, the
    call the recipes make with the hub name; it is also the pretrained checkpoint ``finetune`` loads)
    at the given TP / PP / CP; the dataset stays the recipe's (its ``cord_v2`` preset, found under the
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
    that is never resumed: the save costs seconds per run here and is proven by the runs that resume).

    Returns:
        ``cfg``, changed in place.
    """
    from megatron.bridge import AutoBridge

    from megatron.bridge_thd.testbed.model import tiny_language_settings

    model = AutoBridge.from_hf_pretrained(paths["hf_checkpoint"]).to_megatron_provider(load_weights=False)
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
    cfg.scheduler.lr_warmup_iters = min(cfg.scheduler.lr_warmup_iters, max(train_iters // 4, 1))
    # A run stopped early keeps train_iters: the dataset's sample order and the schedule are
    # functions of it, so the stopped-and-resumed run follows the uninterrupted one.
    cfg.train.exit_interval = exit_interval
    if eval_iters is not RECIPE:
        cfg.validation.eval_iters = eval_iters
    if eval_interval is not RECIPE:
        cfg.validation.eval_interval = eval_interval
    cfg.checkpoint.pretrained_checkpoint = paths["hf_checkpoint"]
    cfg.checkpoint.save = os.path.join(paths["workdir"], "checkpoints", run_name) if checkpoint else None
    cfg.checkpoint.load = cfg.checkpoint.save
    cfg.checkpoint.save_interval = save_interval or train_iters
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_interval = 1
    return cfg


def recipe_function(name: str):
    """A Megatron-Bridge 0.6.2 recipe function by name (``megatron.bridge.recipes.qwen_vl.h100``, where the recipe scripts import them from)."""
    recipes = importlib.import_module("megatron.bridge.recipes.qwen_vl.h100")
    return getattr(recipes, name)


def step_for(layout: str):
    """The forward step of a run: ``"megatron_bridge"`` is Megatron-Bridge 0.6.2's own
    ``qwen3_vl_step.forward_step`` (the padded baseline); any layout name is ours."""
    if layout == "megatron_bridge":
        return importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_step").forward_step
    return importlib.import_module("megatron.bridge_thd.qwen3_vl_step").forward_step


def _peak_memory_bytes() -> int:
    """Peak memory so far: the device's allocator peak on a GPU, the process's maximum resident
    set on the CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def iteration_recorder():
    """A Megatron-Bridge ``Callback`` recording, per iteration, what the trainer logs: the reduced
    loss, the gradient norm, the model FLOPs the trainer added (``floating_point_operations_so_far``,
    DP-global), the sequence tokens its FLOPs accounting saw on this rank (``_flops_seqlen_sum``)
    and the step's wall time."""
    import time

    from megatron.bridge.training.callbacks import Callback

    class Recorder(Callback):
        # The trainer adds a step's FLOPs after on_train_step_end fires (train.py), so a step's
        # FLOPs are read at the next step's start (or at the end of training).
        def __init__(self):
            self.rows = []
            self.evaluations = []  # per evaluation: {"test": bool, "iteration", "loss"}
            self._start = None

        def _evaluated(self, context, test: bool):
            losses = context.total_loss_dict or {}
            loss = losses.get("lm loss")
            self.evaluations.append({"test": test, "iteration": int(context.state.train_state.step),
                                     "loss": None if loss is None else float(loss)})

        def on_eval_end(self, context):
            self._evaluated(context, test=False)

        def on_test_end(self, context):
            self._evaluated(context, test=True)

        def _close_previous(self, state):
            if self.rows and self.rows[-1]["flops"] is None:
                self.rows[-1]["flops"] = float(state.train_state.floating_point_operations_so_far) - self._flops

        def on_train_step_start(self, context):
            self._close_previous(context.state)
            self._flops = float(context.state.train_state.floating_point_operations_so_far)
            self._start = time.perf_counter()

        def on_train_step_end(self, context):
            state = context.state
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            self.rows.append({
                "iteration": int(state.train_state.step) + 1,  # the trainer counts the step after this event
                "loss": float(loss) if loss is not None else None,
                "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                "flops": None,
                "flops_tokens": int(getattr(state, "_flops_seqlen_sum", 0)),
                "seconds": time.perf_counter() - self._start,
                "peak_memory_bytes": _peak_memory_bytes(),
            })

        def on_train_end(self, context):
            self._close_previous(context.state)

        def on_checkpoint_save(self, context):
            # exit_interval saves and exits (sys.exit) without on_train_end; the step's FLOPs are in by then.
            self._close_previous(context.state)

    return Recorder()


class _RealTokenCounter:
    """Wraps the trainer's data iterator: counts the real tokens (the collate's 2D attention mask)
    and the supervised tokens (``loss_mask``) of every micro-batch this rank's step takes."""

    def __init__(self, iterator, counts: list, training: bool = True):
        self.iterator, self.counts, self.training = iterator, counts, training

    def __iter__(self):
        return self

    def __next__(self):
        from megatron.core import parallel_state

        batch = next(self.iterator)
        mask = batch.get("attention_mask")
        self.counts.append({
            # The ranks of one model replica (TP / CP / PP) read the same micro-batch: count it once.
            "counted": (parallel_state.get_tensor_model_parallel_rank() == 0
                        and parallel_state.get_context_parallel_rank() == 0
                        and parallel_state.get_pipeline_model_parallel_rank() == 0),
            "real_tokens": None if mask is None or mask.dim() != 2 else int(mask.bool().sum()),
            "supervised_tokens": int(batch["loss_mask"].bool().sum()) if "loss_mask" in batch else None,
            "samples": int(next(batch[k] for k in ("tokens", "input_ids") if k in batch).shape[0]),
            "training": self.training,  # False: an evaluation's micro-batch
        })
        return batch

    def __getattr__(self, name):
        return getattr(self.iterator, name)


def counting_step(step, counts: list):
    """``step`` with its data iterator wrapped by :class:`_RealTokenCounter` (``counts`` receives one
    entry per micro-batch this rank takes, training or evaluation, as the model's mode says, with the
    decoder's signature when the step is ours); same signature, so the trainer injects the same arguments."""
    import functools

    @functools.wraps(step)
    def counted(state, data_iterator, model, *args, **kwargs):
        if data_iterator is not None:
            data_iterator = _RealTokenCounter(data_iterator, counts, training=bool(getattr(model, "training", True)))
        if not isinstance(getattr(state, "bridge_thd_stats", None), list):
            state.bridge_thd_stats = []  # our step appends each micro-batch's PackingStats here
        before = len(state.bridge_thd_stats)
        result = step(state, data_iterator, model, *args, **kwargs)
        if data_iterator is not None and len(state.bridge_thd_stats) > before:
            # What the decoder saw (step.decoder_signature): in thd_static one value for the whole run.
            counts[-1]["signature"] = repr(state.bridge_thd_stats.pop().signature)
        return result

    return counted


def run_recipe_on_cpu(recipe: str, paths: dict, layout: str, *, train_iters: int, global_batch_size: int = 8,
                      micro_batch_size: int = 2, seq_length: int = 512, tp: int = 1, pp: int = 1, cp: int = 1,
                      save_interval: int | None = None, exit_interval: int | None = None,
                      run_name: str | None = None, count_tokens: bool = True,
                      global_batch_packing: dict | None = None, per_token_loss: bool = False,
                      eval_iters=RECIPE, eval_interval=RECIPE, num_workers=RECIPE, checkpoint: bool = True) -> dict:
    """Run Megatron-Bridge's ``finetune()`` on this rank for a recipe in its CPU mode
    (:func:`cpu_run_config`), with ``layout``'s step (:func:`step_for`; ours after
    ``configure(cfg, layout)``). Call on every rank of a world started with
    ``run_on_gloo(..., whole_bridge=True, initialize=False)`` inside ``hf_hub.offline_hub()``; a run
    whose checkpoint folder already holds a checkpoint resumes from it.

    ``global_batch_packing``: the keywords of a ``batching.bridge.GlobalBatchPacking`` to turn it on
    (``sizes_cache`` defaults to ``workdir/sizes``); its per-step log lines are recorded.
    ``per_token_loss``: ``model.calculate_per_token_loss`` (and ``ddp.average_in_collective=False``,
    which Megatron-Core's DDP requires with it), as global-batch packing sets them.

    Returns:
        ``{"iterations": [recorded rows], "micro_batches": [real / supervised token counts],
        "placements": [global-batch packing log lines, global rank 0], "evaluations": [validation and
        test losses]}``.
    """
    from megatron.bridge.training.finetune import finetune

    from megatron.bridge_thd.configure import configure

    os.chdir(paths["workdir"])  # the recipe's cord_v2 preset resolves its hub path from here
    cfg = cpu_run_config(recipe_function(recipe)(), paths, train_iters=train_iters, global_batch_size=global_batch_size,
                         micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp, pp=pp, cp=cp,
                         save_interval=save_interval, exit_interval=exit_interval,
                         run_name=run_name or f"{recipe}-{layout}", eval_iters=eval_iters, eval_interval=eval_interval,
                         num_workers=num_workers, checkpoint=checkpoint)
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
    with cpu_training(), _log_lines("megatron.bridge_thd.batching") as placements:
        try:
            finetune(cfg, forward_step_func=step, callbacks=[recorder])
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
            "evaluations": recorder.evaluations}


@contextlib.contextmanager
def _log_lines(name: str):
    """The INFO lines the ``name`` logger tree emits inside the block, as strings."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, target = _Keep(logging.INFO), logging.getLogger(name)
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        target.removeHandler(handler)
        target.setLevel(level)


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
    from megatron.bridge_thd.testbed.hf_hub import offline_hub
    from megatron.bridge_thd.testbed.launcher import run_on_gloo
    from megatron.bridge_thd.testbed.standalone import free_ports

    paths = paths or prepare_cpu_run(workdir)
    with offline_hub():
        return run_on_gloo(_run_in_order, paths, runs, free_ports(len(runs)), start_method, dp=world_size,
                           whole_bridge=True, initialize=False, timeout=timeout)


def training_loop_runs(recipe: str = "qwen3_vl_8b_sft_2gpu_h100_bf16_config", *, iterations: int = 20,
                       resume_at: int = 10, short: int = 5, micro_batch_size: int = 2, global_batch_size: int = 8,
                       seq_length: int = 512, global_iterations: int = 10, global_resume_at: int = 4,
                       eval_interval: int = 3, eval_iters: int = 2) -> list:
    """The runs that check Megatron-Bridge's training loop with our step, for :func:`run_on_cpu` on two
    ranks (``tests/test_bridge_training.py``, ``benchmarks/training_loop_report.py``), all with the
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
