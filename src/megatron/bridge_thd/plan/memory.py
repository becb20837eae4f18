"""Activation and model-state memory per GPU (bytes), a first-order estimate.

Activations: Korthikanti et al. (2022)'s per-layer formula adapted per token and per layer (bf16,
no recomputation, no dropout, fused attention keeping only the fp32 log-sum-exp instead of the
``s x s`` scores), with terms for full attention, Gated DeltaNet, SwiGLU / MoE MLPs, the ViT and
the output logits (per token: :mod:`megatron.bridge_thd.cost.memory`), divided by TP (with SP), CP and the 1F1B
pipeline's in-flight micro-batches. Model states: distributed optimizer, mixed precision (2 + 4 + 12 / DP bytes per parameter). CUDA graphs
of several ``thd_static`` row shapes (:func:`cuda_graph_bytes`): a model of Megatron-Core's local graph
manager's memory pool, not a measurement. Every term and assumption: docs/planner.md (Memory model, CUDA
graphs of K rows).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge_thd.cost.memory import (layer_bytes_per_token, output_bytes_per_token, parameter_counts,
                                             vision_bytes_per_patch)
from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.plan.layouts import Parallel

__all__ = ["ActivationEstimate", "activation_bytes", "model_state_bytes", "GraphMemory", "graph_static_bytes",
           "cuda_graph_bytes"]

GIB = 2**30


@dataclass(frozen=True)
class ActivationEstimate:
    """Activation bytes on the busiest GPU: ``layers`` (decoder), ``vision`` (ViT), ``output``."""

    layers: float
    vision: float
    output: float

    @property
    def total(self) -> float:
        return self.layers + self.vision + self.output


def activation_bytes(spec: ModelSpec, parallel: Parallel, slots: int, patches: int,
                     micro_batches: int = 1) -> ActivationEstimate:
    """Peak activation bytes per GPU for micro-batches of ``slots`` token slots and ``patches``
    ViT patches each (module docstring for the formula and the PP rule)."""
    per_layer = layer_bytes_per_token(spec, parallel.tp, parallel.sp)
    tokens = slots / parallel.cp
    if parallel.pp == 1:
        return ActivationEstimate(sum(per_layer) * tokens, vision_bytes_per_patch(spec, parallel.tp) * patches,
                                  output_bytes_per_token(spec, parallel.tp) * tokens)
    stage = len(per_layer) // parallel.pp
    in_flight = min(parallel.pp, micro_batches)
    first = ActivationEstimate(sum(per_layer[:stage]) * tokens * in_flight,
                               vision_bytes_per_patch(spec, parallel.tp) * patches * in_flight, 0.0)
    last = ActivationEstimate(sum(per_layer[-stage:]) * tokens, 0.0, output_bytes_per_token(spec, parallel.tp) * tokens)
    return max(first, last, key=lambda e: e.total)


def graph_static_bytes(spec: ModelSpec, parallel: Parallel, slots: int) -> float:
    """Bytes of the static buffers one row shape's captured decoder-layer graphs keep for replay, per GPU:
    the hidden states between layers and their gradients (``2 (L + 1)`` bf16 tensors of ``slots / cp`` x
    ``h`` / tp with SP, each shared by neighbouring layers' graphs, as Megatron-Core's local manager chains
    one layer's output buffer into the next layer's input) and the rotary table (fp32, ``slots / cp`` x
    head dim, one buffer for all layers). ``cu_seqlens`` and the other small inputs are neglected."""
    tokens = slots / parallel.cp
    hidden = 2 * spec.hidden_size / (parallel.tp if parallel.sp or parallel.tp == 1 else 1)
    return tokens * (2 * (spec.num_layers + 1) * hidden + 4 * spec.kv_channels)


@dataclass(frozen=True)
class GraphMemory:
    """Megatron-Core's local CUDA graphs of the decoder layers for ``rows`` (one row shape each), per GPU,
    a model (docs/planner.md): ``layers[k]`` the decoder-layer activation bytes of one micro-batch of
    ``rows[k]`` (:func:`activation_bytes`), ``static[k]`` its graphs' static buffers (:func:`graph_static_bytes`).

    ``shared``: one memory pool for every graph (Megatron-Core's ``CudaGraphManager.global_mempool``, PP=1):
    the graphs are captured one after another, each shape's activations go back to the pool after its
    backward is captured and the next shape's capture reuses them, so the pool holds the largest row's
    activations plus the static buffers of every other row. ``separate``: no reuse between shapes (an
    upper bound): every row's activations. One row: both are the eager figure, ``layers[0]``."""

    rows: tuple[int, ...]
    layers: tuple[float, ...]
    static: tuple[float, ...]

    @property
    def shared(self) -> float:
        largest = max(range(len(self.rows)), key=lambda k: self.layers[k])
        return self.layers[largest] + sum(s for k, s in enumerate(self.static) if k != largest)

    @property
    def separate(self) -> float:
        return sum(self.layers)


def cuda_graph_bytes(spec: ModelSpec, parallel: Parallel, rows) -> GraphMemory:
    """:class:`GraphMemory` of ``thd_static`` rows ``rows`` (slots each) captured as Megatron-Core's local
    CUDA graphs of the decoder layers.

    Raises:
        ValueError: PP > 1 (the local manager then keeps one runner per micro-batch, rotated in the first
            iteration's order, so every micro-batch must keep its first iteration's row: one row shape).
    """
    if parallel.pp > 1:
        raise ValueError("CUDA graphs of several rows: with PP > 1 Megatron-Core's local graph manager keeps one "
                         "runner per micro-batch in the first iteration's order, so only one row shape can run")
    rows = tuple(rows)
    return GraphMemory(rows, tuple(activation_bytes(spec, parallel, row, 0).layers for row in rows),
                       tuple(graph_static_bytes(spec, parallel, row) for row in rows))


def model_state_bytes(spec: ModelSpec, parallel: Parallel) -> float:
    """Weights + grads + optimizer states per GPU (bytes), distributed optimizer (module docstring)."""
    counts = parameter_counts(spec)
    dense = (counts["dense"] + counts["embedding"] + counts["vision"]) / (parallel.tp * parallel.pp)
    experts = counts["experts"] / (parallel.ep * parallel.tp * parallel.pp)
    dense_shards = parallel.dp * parallel.cp
    expert_shards = max(1, dense_shards // parallel.ep)
    return dense * (6 + 12 / dense_shards) + experts * (6 + 12 / expert_shards)
