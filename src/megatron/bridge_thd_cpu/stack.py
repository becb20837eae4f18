"""The scoped patches that let Megatron-Bridge's real models run on a machine without CUDA,
Transformer Engine or flash-linear-attention, as :class:`~megatron.bridge_thd.upstream.patches.Patch` records.

:func:`cpu_patches` lists what this machine needs (each record says why); :func:`cpu_stack`
applies them with :func:`megatron.bridge_thd.upstream.patches.applied` for a ``with`` block and restores
each name on exit (re-entrant: an inner block is a no-op). Nothing is applied at import. The list
and the reasoning: docs/patches.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
from types import SimpleNamespace

import torch

from megatron.bridge_thd.context_parallel import thd_partition_indices
from megatron.bridge_thd.upstream.patches import Patch, applied
from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.line import upstream_line

__all__ = ["cpu_stack", "cpu_patches", "local_vit_layer_spec", "QWEN3_VL_MODEL_MODULE"]

QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"
QWEN3_VL_UTILS_MODULE = "models.qwen_vl.modelling_qwen3_vl.utils"
QWEN3_VL_ATTENTION_MODULE = "models.qwen_vl.modelling_qwen3_vl.attention"


def local_vit_layer_spec():
    """Megatron-Core's local ViT layer spec with the CPU THD core attention (no mask: each image
    attends to itself bidirectionally, images are separate THD segments)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    from megatron.bridge_thd_cpu.attention import THDCoreAttention

    spec = get_vit_layer_with_local_spec()
    spec.submodules.self_attention.submodules.core_attention = THDCoreAttention
    return spec


def _te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _cpu_device():
    return torch.device("cpu")


def _thd_get_partitioned_indices(cu_seqlens, total_tokens, world_size, rank):
    """Transformer Engine's ``tex.thd_get_partitioned_indices`` contract, in pure torch."""
    return thd_partition_indices(cu_seqlens, int(total_tokens), int(world_size), int(rank))


class _NoStream:
    """A CUDA stream on a machine without one: every kernel runs in order on the CPU anyway."""

    def wait_stream(self, stream):
        return None

    def synchronize(self):
        return None

    def record_event(self, event=None):
        return self  # an event whose synchronize() returns at once


_NO_STREAM = _NoStream()


class _CudaWithoutSync:
    """``torch.cuda`` as ``p2p_communication`` and the MoE all-to-all dispatcher see it:
    ``synchronize`` is a no-op and streams are one in-order no-op stream on the CPU."""

    def __getattr__(self, name):
        if name == "synchronize":
            return lambda *args, **kwargs: None
        if name in ("Stream", "current_stream"):
            return lambda *args, **kwargs: _NO_STREAM
        if name == "stream":
            return lambda stream=None: contextlib.nullcontext()
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as ``schedules`` sees it: tensors asked for on ``"cuda"`` by one of ``FACTORIES`` are
    made on the CPU, and ``torch.cuda`` is ``CUDA``."""

    FACTORIES = ("zeros", "ones", "empty", "tensor", "full")
    CUDA = _CudaWithoutSync

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in self.FACTORIES:
            def on_cpu(*args, device=None, **kwargs):
                if device is not None and str(device).startswith("cuda"):
                    device = "cpu"
                return value(*args, device=device, **kwargs)
            return on_cpu
        if name == "cuda":
            return self.CUDA()
        return value


def _split_sizes_on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` as the all-to-all dispatcher relies on it: on a GPU
    the split sizes come back as numpy arrays, which ``all_to_all_single`` takes as sizes; a CPU
    tensor is left a tensor there, which it refuses, so it is converted the same way."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


class _CpuRngTracker:
    """A CUDA RNG tracker as GDN's ``reset_parameters`` uses it: ``fork`` is the CPU generator."""

    @contextlib.contextmanager
    def fork(self, name=None):
        yield


def _cpu_rng_tracker():
    return _CpuRngTracker()


def _gdn_patches() -> list[Patch]:
    """Megatron-Core's Gated DeltaNet on the CPU without flash-linear-attention (docs/patches.md)."""
    patches: list[Patch] = []
    try:
        import megatron.core.ssm.gated_delta_net.common as gdn_common
        import megatron.core.ssm.gated_delta_net.gdn as gdn_module
    except ImportError:  # a Megatron-Core without Gated DeltaNet
        return patches
    if not _fla_available():
        from megatron.bridge_thd_cpu import gdn as kernels

        no_fla = "fla is absent: Gated DeltaNet refuses to build (HAVE_FLA) and its kernels are None"
        bound = "gdn.py imported the fla kernel by name: the pure-torch varlen one (cu_seqlens honoured)"
        patches += [
            Patch(gdn_common, "HAVE_FLA", True, no_fla),
            Patch(gdn_common, "causal_conv1d", kernels.causal_conv1d, no_fla),
            Patch(gdn_common, "l2norm", kernels.l2norm, no_fla),
            Patch(gdn_common, "chunk_gated_delta_rule", kernels.chunk_gated_delta_rule, no_fla),
            Patch(gdn_module, "causal_conv1d", kernels.causal_conv1d, bound),
            Patch(gdn_module, "chunk_gated_delta_rule", kernels.chunk_gated_delta_rule, bound),
        ]
    if not torch.cuda.is_available():
        patches.append(Patch(gdn_common, "get_cuda_rng_tracker", _cpu_rng_tracker,
                             "reset_parameters forks the CUDA RNG tracker; on the CPU fork is the CPU generator"))
    return patches


class _AbsentTEClass:
    """Base of the classes :func:`_absent_te_class` makes: none can be built (TE is absent)."""

    def __new__(cls, *args, **kwargs):
        raise TypeError(f"{cls.__qualname__} stands for a Transformer Engine class; TE is not installed here")


def _absent_te_class(name: str) -> type:
    """A real class named ``name`` that no object is an instance of.

    Without TE, Megatron-Core derives its TE classes (and their subclasses) from a ``MagicMock``, so
    each is a mock, not a type, and ``isinstance(x, it)`` raises. No instance of the TE class can exist
    without TE, so ``isinstance`` against this class is False for every object, as it would be there.
    """
    return type(name, (_AbsentTEClass,), {"__module__": __name__, "__qualname__": name})


def _is_mock_class(value) -> bool:
    return value is not None and not isinstance(value, type)


def _te_isinstance_patches() -> list[Patch]:
    """The TE classes that the installed upstream tests with ``isinstance`` on the model's path."""
    line, patches = upstream_line(), []
    if line.qwen3_vl_attention_tests_te_attention:
        from megatron.bridge_thd_cpu.attention import THDCoreAttention

        attention = load_bridge_module(QWEN3_VL_ATTENTION_MODULE)
        patches.append(Patch(attention, "TEDotProductAttention", THDCoreAttention,
                             "the Qwen3-VL attention tests its core attention against TE's with isinstance: the "
                             "CPU THD attention stands in for TE's, so it gets TE's masked-token mask"))
    if line.mtp_tests_inference_linear:
        import megatron.core.tensor_parallel.inference_layers as inference_layers

        for name in ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear"):
            if _is_mock_class(getattr(inference_layers, name, None)):
                patches.append(Patch(inference_layers, name, _absent_te_class(name),
                                     "the MTP layer's is_inference_column_parallel_linear tests eh_proj with "
                                     "isinstance; without TE this TE subclass is a MagicMock, and no instance exists"))
    return patches


def _uneven_all_gather(outputs, tensor, group=None, async_op=False):
    """``torch.distributed.all_gather`` into outputs whose first dimensions differ, as ProcessGroupNCCL runs it
    (gloo gathers equal shapes only): every rank's tensor padded to the longest, gathered, and cut back."""
    import torch.distributed as dist

    if async_op:
        raise ValueError("async_op: the CPU stack's uneven all_gather is synchronous")
    longest = max(out.shape[0] for out in outputs)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in outputs]
    dist.all_gather(parts, padded.contiguous(), group=group)
    for out, part in zip(outputs, parts):
        out.copy_(part[: out.shape[0]])


class _TorchWithUnevenAllGather:
    """``torch`` as Megatron-Bridge's ``modelling_qwen3_vl/utils.py`` sees it: ``torch.distributed.all_gather`` takes
    outputs of different lengths (its ``AllGatherVisionEmbeddings`` gathers each CP rank's share of the vision
    tower's frames, dealt by count)."""

    class _Distributed:
        def __getattr__(self, name):
            return _uneven_all_gather if name == "all_gather" else getattr(torch.distributed, name)

    def __getattr__(self, name):
        return self._Distributed() if name == "distributed" else getattr(torch, name)


def cpu_patches() -> list[Patch]:
    """Every patch this machine needs to build and run Megatron-Bridge's real models
    (model-spec names always; the rest only where CUDA, Transformer Engine or fla is absent)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    te_name = "a Transformer Engine name modelling_qwen3_vl/model.py binds at import: "
    patches = [
        Patch(model_module, "get_vit_layer_with_transformer_engine_spec", local_vit_layer_spec,
              te_name + "the local ViT spec with the CPU THD core attention (bidirectional per image)"),
        Patch(model_module, "TENorm", WrappedTorchNorm, te_name + "torch's norm"),
        Patch(model_module, "TEColumnParallelLinear", ColumnParallelLinear, te_name + "Megatron-Core's local linear"),
        Patch(model_module, "TERowParallelLinear", RowParallelLinear, te_name + "Megatron-Core's local linear"),
    ]
    if not torch.cuda.is_available():
        import megatron.core.pipeline_parallel.hybrid_cp_schedule as hybrid_cp_schedule
        import megatron.core.pipeline_parallel.p2p_communication as p2p
        import megatron.core.pipeline_parallel.schedules as schedules
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

        patches += [
            Patch(torch.cuda, "current_device", _cpu_device,
                  "MultimodalRotaryEmbedding and Megatron-Bridge's Qwen3-VL rope place inv_freq on it unconditionally"),
            Patch(schedules, "torch", _TorchOnCpu(), "the schedules allocate total_num_tokens with device='cuda'"),
            Patch(p2p, "torch", _TorchOnCpu(), "p2p_communication calls torch.cuda.synchronize()"),
            Patch(load_bridge_module(QWEN3_VL_UTILS_MODULE), "torch", _TorchWithUnevenAllGather(),
                  "vision_dp_when_cp: AllGatherVisionEmbeddings gathers CP ranks' unequal frame shares, which NCCL "
                  "takes and gloo does not"),
            Patch(hybrid_cp_schedule, "torch", _TorchOnCpu(),
                  "the hybrid-CP schedule makes its per-group sample counts with device='cuda' (as Megatron-LM's own "
                  "test_schedules.py patches it)"),
            Patch(token_dispatcher, "torch", _TorchOnCpu(),
                  "the all-to-all dispatcher copies split sizes on a torch.cuda.Stream: an in-order no-op stream"),
            Patch(token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_on_host,
                  "split sizes reach all_to_all_single as numpy arrays, as they do from a GPU"),
        ]
    if not _te_available():
        import megatron.core.utils as mcore_utils

        patches.append(Patch(mcore_utils, "tex", SimpleNamespace(thd_get_partitioned_indices=_thd_get_partitioned_indices),
                             "tex is None without TE: the THD CP split of get_batch_on_this_cp_rank and "
                             "get_packed_seq_cp_partition_indices needs thd_get_partitioned_indices"))
    patches += _te_isinstance_patches()
    patches += _gdn_patches()
    return patches


@contextlib.contextmanager
def cpu_stack():
    """Apply every CPU patch (:func:`cpu_patches`) for the duration of the block, then restore each name.

    Use it around building and running Megatron-Bridge's real model on a CPU machine::

        with cpu_stack():
            model = build_qwen3_vl(tiny_qwen3_vl_config())
            output = model(**forward_args)

    Re-entrant; on a machine with CUDA and Transformer Engine only the model-spec names of
    ``modelling_qwen3_vl/model.py`` are swapped (the THD attention is still the CPU one).
    ``GatedDeltaNet`` binds ``self.gated_delta_rule`` at construction: build it inside the block.
    """
    with applied(cpu_patches()), _compiled_functions_run_eagerly():
        yield


def _compiled_functions_run_eagerly():
    """Without CUDA, every ``torch.compile`` function called in the block runs its undecorated original
    (``torch.compiler.set_stance("force_eager")``): Megatron's ``@jit_fuser`` functions and methods (the training
    loop's bias-GeLU / SwiGLU / bias-dropout-add warm-up, the fused cross entropy's helpers, Gated DeltaNet's gate and
    norm methods) would otherwise be traced by Dynamo and compiled by Inductor to C++ on every new shape: seconds of
    a CPU run per ``finetune()`` and nothing any test asserts on. docs/patches.md."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")
