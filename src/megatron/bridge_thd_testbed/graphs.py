"""Megatron-Core's own CUDA-graph argument bookkeeping, run on the CPU (docs/cuda-graphs.md).

The local CUDA-graph manager (``cuda_graph_impl="local"``, ``megatron/core/transformer/cuda_graphs.py``)
replays a captured graph only for a call whose arguments match the capture. It decides that with
``ArgMetadata`` and ``_CudaGraphRunner.get_mismatch_errors``: every tensor compared by type, shape,
dtype and device (never by value: tensors, dataclass fields included, are graph inputs copied into
static buffers at replay, ``_CudagraphReplayNode.forward``), every other argument by ``!=``,
dataclasses such as ``PackedSeqParams`` field by field (``get_mismatch_errors``' inner ``check``).
None of that needs CUDA; only ``_CudaGraphRunner.__init__`` does (it creates ``torch.cuda.Event``
objects), so this module calls Megatron-Core's unbound methods on a runner made without
``__init__``, holding exactly the two attributes ``__init__`` sets from the first call's arguments
(``fwd_graph_input_arg_metas``, ``fwd_graph_input_kwarg_metas``). The upstream lines each of these
rests on: docs/compatibility.md.

Test-bed only: the runtime never imports it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "DECODER_INPUTS",
    "arg_signature",
    "decoder_kwargs",
    "mcore_decoder_signature",
    "mcore_graph_inputs",
    "mcore_replay_mismatches",
    "signature_differences",
    "te_replay_stand_in",
]

# What the step hands the language model that reaches the decoder layers: the row tensors (input_ids
# becomes hidden_states (T, 1, H), position_ids the MRoPE embedding (T, 1, 1, d)) and the THD
# metadata. The visual inputs run in the vision tower, outside the decoder's graphs.
DECODER_INPUTS = ("input_ids", "position_ids", "labels", "loss_mask", "packed_seq_params")


def _cuda_graphs():
    from megatron.core.transformer import cuda_graphs

    return cuda_graphs


def arg_signature(value: Any) -> tuple:
    """One argument as Megatron-Core's ``ArgMetadata`` sees it, in the terms
    ``get_mismatch_errors`` compares (its inner ``check``).

    Returns:
        ``("tensor", type, shape, dtype, device)`` for a tensor; ``("dataclass", type, ((field,
        signature), ...))`` for a dataclass (``PackedSeqParams``), field by field;
        ``("unsupported", type)`` for a type ``_check_supported_type`` refuses with an
        AssertionError (a ``ProcessGroup`` in ``PackedSeqParams.cp_group``); otherwise
        ``("value", type, value)``.
    """
    cg = _cuda_graphs()
    meta = cg.ArgMetadata(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", meta.type.__name__, tuple(meta.shape), str(meta.dtype), str(meta.device))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ("dataclass", meta.type.__name__,
                tuple((f.name, arg_signature(getattr(value, f.name))) for f in dataclasses.fields(value)))
    try:
        cg._check_supported_type(meta)
    except AssertionError:
        return ("unsupported", meta.type.__name__)
    return ("value", meta.type.__name__, meta.value)


def decoder_kwargs(forward_args: dict) -> dict:
    """The part of the step's ``forward_args`` that reaches the decoder layers (:data:`DECODER_INPUTS`)."""
    return {name: forward_args.get(name) for name in DECODER_INPUTS}


def mcore_decoder_signature(forward_args: dict) -> dict[str, tuple]:
    """Megatron-Core's metadata view of what the decoder sees, one entry per tensor and per
    ``PackedSeqParams`` field.

    The arguments go through Megatron-Core's own ``tree_map`` with ``ArgMetadata`` in place of
    every tensor, as ``_CudaGraphRunner.record_graph_capture`` records a capture
    (its ``_replace_with_meta``; ``tree_map`` recurses into dataclasses).
    Two micro-batches a captured graph can replay have equal signatures.

    Returns:
        ``{"input_ids": ..., "position_ids": ..., "labels": ..., "loss_mask": ...,
        "packed_seq_params.<field>": ...}`` (``"packed_seq_params"`` alone when it is None), each
        value as :func:`arg_signature` writes it.
    """
    cg = _cuda_graphs()
    recorded = cg.tree_map(lambda a: cg.ArgMetadata(a) if torch.is_tensor(a) else a, decoder_kwargs(forward_args))
    out: dict[str, tuple] = {}
    for name, value in recorded.items():
        original = forward_args.get(name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                out[f"{name}.{f.name}"] = _recorded_signature(getattr(value, f.name), getattr(original, f.name))
        else:
            out[name] = _recorded_signature(value, original)
    return out


def _recorded_signature(recorded: Any, original: Any) -> tuple:
    cg = _cuda_graphs()
    if isinstance(recorded, cg.ArgMetadata):  # a tensor, as the record keeps it
        return ("tensor", recorded.type.__name__, tuple(recorded.shape), str(recorded.dtype), str(recorded.device))
    return arg_signature(original)


def signature_differences(a: dict[str, tuple], b: dict[str, tuple]) -> dict[str, tuple]:
    """``{key: (a[key], b[key])}`` for every key whose signature differs (or that only one side has)."""
    return {key: (a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)}


def _bare_runner(captured_kwargs: dict, captured_args: tuple = ()):
    cg = _cuda_graphs()
    runner = object.__new__(cg._CudaGraphRunner)  # __init__ creates a torch.cuda.Event
    # Exactly what _CudaGraphRunner.__init__ records from the first call (its two *_metas attributes).
    runner.fwd_graph_input_arg_metas = [cg.ArgMetadata(a) for a in captured_args]
    runner.fwd_graph_input_kwarg_metas = {k: cg.ArgMetadata(a) for k, a in captured_kwargs.items()}
    return runner


def mcore_replay_mismatches(captured_kwargs: dict, kwargs: dict, *, captured_args: tuple = (),
                            args: tuple = ()) -> list[str]:
    """Megatron-Core's own verdict: ``_CudaGraphRunner.get_mismatch_errors`` for a graph captured
    with ``captured_kwargs`` and called again with ``kwargs``.

    Empty means the local manager replays the graph (``CudaGraphManager.get_cudagraph_runner``,
    its ``is_valid``); otherwise it asserts once graphs exist (``get_cudagraph_runner`` when
    ``cudagraph_created`` is set and no runner matches, or ``_CudaGraphRunner.replay_graph_capture``) and
    these are its messages. An unsupported argument type (a ``ProcessGroup``) raises
    ``AssertionError`` from ``_check_supported_type`` instead.
    """
    cg = _cuda_graphs()
    return cg._CudaGraphRunner.get_mismatch_errors(_bare_runner(captured_kwargs, captured_args), args, kwargs)


def mcore_graph_inputs(kwargs: dict, args: tuple = ()) -> tuple[torch.Tensor, ...]:
    """The tensors Megatron-Core's ``_CudaGraphRunner.get_tensors`` takes from a call: the graph's
    input surface, copied into the captured static buffers at every replay (``_CudagraphReplayNode.forward``).
    Tensor fields of a dataclass argument (``PackedSeqParams.cu_seqlens_*``) are among them;
    non-tensor fields (``max_seqlen_*``) are not: they are baked into the capture."""
    cg = _cuda_graphs()
    return cg._CudaGraphRunner.get_tensors(_bare_runner({}), args, kwargs)


@contextmanager
def te_replay_stand_in(language_model, modules=(), *, seq_length: int, micro_batch_size: int):
    """The decoder layers of ``language_model`` take Megatron-Core's Transformer-Engine replay
    path, as after ``TECudaGraphHelper.create_cudagraphs``, with a stand-in for TE's graphed callable.

    What runs is Megatron-Core's own code: ``GraphableMegatronModule.__call__`` picks
    ``_te_cuda_graph_replay`` (``_should_call_te_cudagraph``: the impl is
    ``"transformer_engine"``, training, ``cuda_graphs`` non-empty), ``TransformerLayer._te_cuda_graph_replay``
    runs attention eagerly when ``cuda_graph_modules`` leaves it out and asserts that no
    ``packed_seq_params`` reaches the graph, and
    ``GraphableMegatronModule._get_te_cuda_graph_replay_args`` prepares the graph's arguments.
    Two things stand in for Transformer Engine, which the CPU build lacks:
    ``TransformerLayer._get_te_cuda_graph_replay_args``' TE import (only the base class's part
    runs) and the graphed callable itself, which copies its input into a
    static buffer of the capture's shape, as TE's ``Graphed.forward`` does (``copy_``, no shape
    check: a shape that does not broadcast raises), then computes what the capture covers
    (``TransformerLayer._te_cuda_graph_capture``) on the live tensor. The capture
    shape is ``GraphableMegatronModule.get_layer_static_inputs``' ``(seq_length / cp [/ tp under SP],
    micro_batch_size, hidden)`` (the helper built with ``model.seq_length`` and
    ``train.micro_batch_size``, Megatron-Bridge's ``train`` in ``training/train.py``, where it builds
    ``TECudaGraphHelper``). The upstream lines: docs/compatibility.md.

    The config is mutated in place (its post-init checks are not re-run) and restored on exit.

    Yields:
        A list that receives, per graph call, ``(layer_number, positional shapes, keyword names)``.
    """
    from megatron.core.transformer.enums import CudaGraphModule
    from megatron.core.transformer.module import GraphableMegatronModule

    config = language_model.config
    saved = (config.cuda_graph_impl, list(config.cuda_graph_modules))
    layers = list(language_model.decoder.layers)
    calls: list[tuple] = []

    cp = config.context_parallel_size
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    static_shape = (seq_length // cp // tp, micro_batch_size, config.hidden_size)

    def stand_in(layer):
        def graph(*args, **kwargs):
            calls.append((layer.layer_number, [tuple(a.shape) for a in args], sorted(kwargs)))
            static = torch.empty(static_shape, dtype=args[0].dtype)
            static.copy_(args[0].detach())  # TE's Graphed.forward: copy into the captured input buffer
            kwargs.pop("is_first_microbatch", None)
            return layer._te_cuda_graph_capture(*args, **kwargs)

        return graph

    try:
        config.cuda_graph_impl = "transformer_engine"
        config.cuda_graph_modules = [CudaGraphModule[name] for name in modules]
        language_model.decoder.cuda_graphs = []  # what GraphableMegatronModule.__init__ sets
        for layer in layers:
            layer.cuda_graphs = [stand_in(layer)]
            layer.cuda_graph_manual_hooks = []
            layer._get_te_cuda_graph_replay_args = (
                lambda *a, _layer=layer, **k: GraphableMegatronModule._get_te_cuda_graph_replay_args(_layer, *a, **k))
        yield calls
    finally:
        config.cuda_graph_impl, config.cuda_graph_modules = saved
        for module in [language_model.decoder, *layers]:
            for name in ("cuda_graphs", "cuda_graph_manual_hooks", "_get_te_cuda_graph_replay_args"):
                module.__dict__.pop(name, None)
