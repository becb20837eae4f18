"""The scoped patches that let Megatron-Bridge 0.6.2's real Qwen3-VL run on a machine without CUDA.

Nothing here is applied at import. :func:`cpu_stack` applies every patch for the duration of
a ``with`` block and restores each name on exit (re-entrant: an inner block is a no-op):

1. ``torch.cuda.current_device`` returns the CPU device. Megatron-Core's
   ``MultimodalRotaryEmbedding.__init__`` and Megatron-Bridge's Qwen3-VL rope call it
   unconditionally to place ``inv_freq``.
2. The four Transformer Engine names that Megatron-Bridge's ``modelling_qwen3_vl/model.py``
   binds at import (``get_vit_layer_with_transformer_engine_spec``, ``TENorm``,
   ``TEColumnParallelLinear``, ``TERowParallelLinear``) point at a local ViT spec whose core
   attention is :class:`~megatron.bridge_thd.testbed.attention.THDCoreAttention` (bidirectional
   per image), ``WrappedTorchNorm``, ``ColumnParallelLinear`` and ``RowParallelLinear``.
3. Only when Transformer Engine is absent: Megatron-Core's ``megatron.core.utils.tex`` (None
   without TE) gets a ``thd_get_partitioned_indices`` implemented by
   :func:`~megatron.bridge_thd.context_parallel.thd_partition_indices`, so the THD CP split of
   Megatron-Core's ``get_batch_on_this_cp_rank`` and Megatron-Bridge's
   ``get_packed_seq_cp_partition_indices`` runs.
4. Only without CUDA: Megatron-Core 0.19.2's pipeline schedules allocate ``total_num_tokens``
   with ``device="cuda"`` and ``p2p_communication`` calls ``torch.cuda.synchronize()``; both
   are redirected to the CPU (``torch.zeros`` in ``schedules`` and the module's ``torch.cuda``
   seen through a proxy). The MoE all-to-all dispatcher (``transformer/moe/token_dispatcher.py``)
   creates a ``torch.cuda.Stream()`` for its device-to-host copies of the split sizes and enters
   it with ``torch.cuda.stream``: through the same proxy these are an in-order no-op stream.
   Its ``maybe_move_tensor_to_cpu`` turns the split sizes into numpy arrays only for CUDA
   tensors; on the CPU they are converted the same way (``all_to_all_single`` refuses tensors).
5. Only when flash-linear-attention is absent: Megatron-Core's Gated DeltaNet
   (``ssm/gated_delta_net``) imports fla's ``causal_conv1d``, ``l2norm`` and
   ``chunk_gated_delta_rule`` at module level (None without fla) and refuses to build
   (``HAVE_FLA``). ``common.HAVE_FLA`` becomes True and those names, in ``common`` and where
   ``gdn.py`` imported them by name, point at the pure-torch varlen kernels of
   :mod:`megatron.bridge_thd.testbed.gdn` (``cu_seqlens`` honoured). ``GatedDeltaNet`` binds
   ``self.gated_delta_rule`` at construction, so build the model inside the block.
6. Only without CUDA: ``_GDNBase.reset_parameters`` initialises ``dt_bias`` / ``A_log`` under
   ``get_cuda_rng_tracker().fork()``, whose CUDA RNG state a CPU process never adds; ``common``'s
   ``get_cuda_rng_tracker`` gives a tracker whose ``fork`` draws from the CPU generator. And the three ``@jit_fuser`` (``torch.compile``) methods of ``_GDNBase``
   (``_apply_gated_norm``, ``_prepare_input_for_gated_delta_rule``, ``_compute_g_and_beta``)
   run as their undecorated originals (no Inductor compile on the CPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from types import SimpleNamespace

import torch

from megatron.bridge_thd.context_parallel import thd_partition_indices
from megatron.bridge_thd.upstream import load_bridge_module

__all__ = ["cpu_stack", "local_vit_layer_spec", "QWEN3_VL_MODEL_MODULE"]

QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"

_lock = threading.RLock()
_depth = 0


def local_vit_layer_spec():
    """Megatron-Core's local ViT layer spec with the CPU THD core attention (no mask: each image
    attends to itself bidirectionally, images are separate THD segments)."""
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    from megatron.bridge_thd.testbed.attention import THDCoreAttention

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
    """``torch`` as ``schedules`` sees it: tensors asked for on ``"cuda"`` are made on the CPU."""

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            def on_cpu(*args, device=None, **kwargs):
                if device is not None and str(device).startswith("cuda"):
                    device = "cpu"
                return value(*args, device=device, **kwargs)
            return on_cpu
        if name == "cuda":
            return _CudaWithoutSync()
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


_GDN_FUSED_METHODS = ("_apply_gated_norm", "_prepare_input_for_gated_delta_rule", "_compute_g_and_beta")


def _gdn_patches() -> list[tuple[object, str, object]]:
    """Patches 5 and 6: Megatron-Core's Gated DeltaNet on the CPU without flash-linear-attention."""
    patches: list[tuple[object, str, object]] = []
    try:
        import megatron.core.ssm.gated_delta_net.common as gdn_common
        import megatron.core.ssm.gated_delta_net.gdn as gdn_module
    except ImportError:  # a Megatron-Core without Gated DeltaNet
        return patches
    if not _fla_available():
        from megatron.bridge_thd.testbed import gdn as kernels

        patches += [
            (gdn_common, "HAVE_FLA", True),
            (gdn_common, "causal_conv1d", kernels.causal_conv1d),
            (gdn_common, "l2norm", kernels.l2norm),
            (gdn_common, "chunk_gated_delta_rule", kernels.chunk_gated_delta_rule),
            (gdn_module, "causal_conv1d", kernels.causal_conv1d),
            (gdn_module, "chunk_gated_delta_rule", kernels.chunk_gated_delta_rule),
        ]
    if not torch.cuda.is_available():
        patches.append((gdn_common, "get_cuda_rng_tracker", _cpu_rng_tracker))
        for name in _GDN_FUSED_METHODS:
            fused = gdn_common._GDNBase.__dict__.get(name)
            original = getattr(fused, "_torchdynamo_orig_callable", None) or getattr(fused, "__wrapped__", None)
            if original is not None:
                patches.append((gdn_common._GDNBase, name, original))
    return patches


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for every patch this machine needs."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    patches: list[tuple[object, str, object]] = [
        (model_module, "get_vit_layer_with_transformer_engine_spec", local_vit_layer_spec),
        (model_module, "TENorm", WrappedTorchNorm),
        (model_module, "TEColumnParallelLinear", ColumnParallelLinear),
        (model_module, "TERowParallelLinear", RowParallelLinear),
    ]
    if not torch.cuda.is_available():
        import megatron.core.pipeline_parallel.p2p_communication as p2p
        import megatron.core.pipeline_parallel.schedules as schedules
        import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

        patches += [
            (torch.cuda, "current_device", _cpu_device),
            (schedules, "torch", _TorchOnCpu()),
            (p2p, "torch", _TorchOnCpu()),
            (token_dispatcher, "torch", _TorchOnCpu()),
            (token_dispatcher, "maybe_move_tensor_to_cpu", _split_sizes_on_host),
        ]
    if not _te_available():
        import megatron.core.utils as mcore_utils

        patches.append((mcore_utils, "tex", SimpleNamespace(thd_get_partitioned_indices=_thd_get_partitioned_indices)))
    patches += _gdn_patches()
    return patches


@contextlib.contextmanager
def cpu_stack():
    """Apply every CPU patch for the duration of the block, then restore each name.

    Use it around building and running Megatron-Bridge's real model on a CPU machine::

        with cpu_stack():
            model = build_qwen3_vl(tiny_qwen3_vl_config())
            output = model(**forward_args)

    Re-entrant; on a machine with CUDA and Transformer Engine only the model-spec names of
    ``modelling_qwen3_vl/model.py`` are swapped (the THD attention is still the CPU one).
    """
    global _depth
    with _lock:
        if _depth:
            _depth += 1
            saved = None
        else:
            patches = _patches()
            saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
            for owner, name, replacement in patches:
                setattr(owner, name, replacement)
            _depth = 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if saved is not None:
                for owner, name, original in reversed(saved):
                    setattr(owner, name, original)
