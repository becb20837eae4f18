"""Megatron-Bridge's trainer on a machine without CUDA: :func:`cpu_training_patches` adds to
:func:`~megatron.bridge_thd_cpu.stack.cpu_patches` what the trainer needs, as
:class:`~megatron.bridge_thd.upstream.patches.Patch` records: ``torch`` as a handful of trainer modules see it
(tensors they ask for on ``"cuda"`` are made on the CPU, ``torch.cuda``'s synchronisation, cache, stream
and memory-statistics calls are no-ops or zeros, its RNG state is the CPU generator's), and the one
Transformer Engine name the Qwen3-VL provider binds at import (its language layer spec). :func:`cpu_training`
applies them for a ``with`` block, inside :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`. Reasoning and the
list: docs/megatron-bridge-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

from megatron.bridge_thd.upstream.patches import Patch, applied
from megatron.bridge_thd_cpu.stack import _CudaWithoutSync, _TorchOnCpu, cpu_stack

__all__ = ["cpu_training", "cpu_training_patches", "TRAINER_MODULES"]

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
