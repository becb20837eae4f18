"""What a GPU spends on a THD row: a time model per rank, layer by layer (docs/time-model.md).

Global-batch packing, CP per sample and the planner place samples by what they cost. FLOPs at a constant
efficiency cannot rank context-parallel layouts (static CP at the world size gives every rank exactly ``1 / W``
of the FLOPs), so this model prices what a GPU measurably spends beyond FLOPs:

* **GEMMs** (projections, MLP / experts, logits, the Gated-DeltaNet layers: every term of the trainer's formula
  linear in the tokens): the row's tokens on the rank at ``gemm_efficiency`` of the bf16 peak, and never faster
  than reading the weights three times (forward, backward data, backward weights) from HBM, which binds at small
  token counts;
* **attention** (the full-attention layers' core): each sample's causal attention at the kernel's measured rate for
  the length of the segment the kernel sees (``s`` alone, ``s / 2k`` chunks under CP ``k``), forward and backward
  rates apart;
* **the vision tower**: patches at the GEMM rate; attention within each frame (``t * (h w)^2``, how Qwen3-VL's
  vision model builds its ``cu_seqlens``) at the non-causal kernel rate for the frame's length; under CP the tower is
  split over the row's ranks;
* **the CP ring exchange**: per full-attention layer ``k - 1`` steps forward and ``k - 1`` backward, each taking the
  larger of the row's attention compute for the step and ``ring_step_s + latency + bytes / bandwidth`` (the whole
  row's chunk of K and V forward; K, V and their gradients backward: Transformer Engine's THD ring sends the row's
  chunk in one message a step), over NVLink when the CP group stays in a node, over the network when it spans nodes;
* **element-wise kernels**: the activations a token and a patch leave for backward, written once and read twice
  (forward and backward) at the HBM bandwidth;
* **MoE dispatch** (EP > 1): the all-to-all of each routed token's hidden state, dispatch and combine, forward and
  backward, over the EP group's link;
* **fixed costs**: per micro-batch (kernel launches, host work) and per step (optimizer, gradient sync not hidden),
  both fitted (:class:`TimeParameters`).

The FLOPs come from Megatron-Bridge's own formula through :class:`~megatron.bridge_thd.cost.sample.SampleCost`
(its four coefficients), so the model divides the trainer's FLOPs by rates; it never counts FLOPs its own way.
Every rate is a published figure or a fitted one: :data:`PUBLISHED` and :class:`TimeParameters` say which. Pure host
arithmetic on Python numbers: no tensors, no device.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from megatron.bridge_thd.cost.memory import (layer_bytes_per_token, output_bytes_per_token, parameter_counts,
                                             vision_bytes_per_patch)
from megatron.bridge_thd.cost.sample import SampleCost, frame_lengths, resolve_model_spec, sample_cost

__all__ = ["Link", "Machine", "MACHINES", "get_machine", "RateCurve", "TimeParameters", "PUBLISHED", "FITTED",
           "ModelShape",
           "SampleWork", "RowTime", "row_time", "sample_work", "frame_lengths", "model_shape", "load_time_parameters",
           "time_parameters_to_dict"]


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU path: ``bytes_per_s`` achieved per GPU per direction and ``latency_s`` per message."""

    bytes_per_s: float
    latency_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Machine:
    """A GPU and its node: dense bf16 peak (FLOP/s), HBM bandwidth (bytes/s) and capacity (bytes), the link inside
    a node and the network between nodes, and GPUs per node."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink: Link
    network: Link
    gpus_per_node: int = 8

    def link(self, ranks: int, stride: int = 1) -> Link:
        """The slowest link a group of ``ranks`` consecutive blocks of ``stride`` GPUs crosses: NVLink while the
        group stays within a node (groups are aligned: Megatron-Core lays TP innermost, then CP / DP)."""
        return self.nvlink if ranks * stride <= self.gpus_per_node else self.network


# Spec sheets and published link measurements: docs/time-model.md, "Parameters".
_NVLINK4 = Link(370e9, 10e-6)  # NCCL-measured on H100 SXM NVLink 4 (450 GB/s per direction nominal)
_NDR = Link(48e9, 20e-6)  # NDR InfiniBand, 400 Gb/s per GPU
MACHINES = {m.name: m for m in (
    Machine("h100-sxm", 989e12, 3.35e12, 80e9, _NVLINK4, _NDR),
    Machine("h100-pcie", 756e12, 2.0e12, 80e9, Link(115e9, 10e-6), _NDR, gpus_per_node=2),
    Machine("l40s", 362e12, 0.864e12, 48e9, Link(25e9, 10e-6), Link(24e9, 20e-6)),
    Machine("h200", 989e12, 4.8e12, 141e9, _NVLINK4, _NDR),
    Machine("b200", 2250e12, 8.0e12, 180e9, Link(740e9, 10e-6), _NDR),
    Machine("a100-80gb", 312e12, 2.0e12, 80e9, Link(230e9, 10e-6), Link(24e9, 20e-6)),
)}


def get_machine(name: str) -> Machine:
    """The machine called ``name``; ValueError listing the known ones otherwise."""
    key = str(name).strip().lower()
    if key not in MACHINES:
        raise ValueError(f"GPU {name!r} has no time model; known: {', '.join(MACHINES)}")
    return MACHINES[key]


@dataclass(frozen=True)
class RateCurve:
    """A kernel's achieved FLOP/s by the segment length it runs on, from measured points; between points the rate
    is interpolated in log(length), beyond them it is held at the end points.

    Attributes:
        points: ``((length, flops_per_s), ...)`` ascending in length.
    """

    points: tuple[tuple[int, float], ...]

    def __call__(self, length: float) -> float:
        lengths = [p[0] for p in self.points]
        if length <= lengths[0]:
            return self.points[0][1]
        if length >= lengths[-1]:
            return self.points[-1][1]
        i = bisect.bisect_right(lengths, length)
        (a, ra), (b, rb) = self.points[i - 1], self.points[i]
        x = (math.log(length) - math.log(a)) / (math.log(b) - math.log(a))
        return ra + x * (rb - ra)

    def scaled(self, factor: float) -> "RateCurve":
        return RateCurve(tuple((n, r * factor) for n, r in self.points))


@dataclass(frozen=True)
class TimeParameters:
    """Every rate the model divides by. Published ones carry their source in :data:`PUBLISHED` (and the docs
    table); ``fitted`` names the ones fitted to published step times, whose values a calibration replaces.

    Attributes:
        attention_forward / attention_backward: causal varlen attention (head dim 128, bf16) FLOP/s by segment
            length, forward and backward (the backward's FLOPs counted as 2.5 x the forward's, as the kernels'
            own benchmarks count them).
        vision_attention_forward / vision_attention_backward: the same for non-causal attention (the ViT's).
        gemm_efficiency: the fraction of the bf16 peak large GEMMs reach (published: H100 SXM bf16 matmuls of
            4096^2 and 8192^2 measured at 789 and 798 TFLOP/s, 0.80 of the 989 peak); small token counts are bound
            by reading the weights instead (the roofline floor of :func:`row_time`).
        per_micro_batch_s: fixed seconds per micro-batch and rank (launches, host work between kernels; fitted).
        ring_step_s: fixed seconds of one CP ring step of one layer beyond its transfer (the step's kernel launches,
            the send / receive handshake, the partial softmax merge; fitted, at least the link's latency).
        per_step_s: fixed seconds per step (optimizer, what the gradient sync does not hide; fitted).
        fitted: names of the fitted fields.
    """

    attention_forward: RateCurve
    attention_backward: RateCurve
    vision_attention_forward: RateCurve
    vision_attention_backward: RateCurve
    gemm_efficiency: float = 0.80
    per_micro_batch_s: float = 0.0
    ring_step_s: float = 0.0
    per_step_s: float = 0.0
    fitted: tuple[str, ...] = ("per_micro_batch_s", "ring_step_s", "per_step_s")
    source: str = "defaults"

    def with_fit(self, source: str, **values) -> "TimeParameters":
        unknown = set(values) - set(self.fitted)
        if unknown:
            raise ValueError(f"TimeParameters.with_fit: {sorted(unknown)} are not fitted parameters ({self.fitted})")
        return replace(self, source=source, **values)


# Attention kernels on H100 SXM5, head dim 128, bf16, batch x length = 16k tokens: the cuDNN series (the kernels
# Transformer Engine's fused attention calls) of the FlashAttention-3 paper's figures (arXiv 2407.08608, figures 5
# and 6, as transcribed from the charts; docs/time-model.md has every series and the caveats). TFLOP/s by length.
_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
_CUDNN_CAUSAL_FWD = (315, 410, 484, 518, 529, 539)
_CUDNN_FULL_FWD = (467, 574, 617, 609, 600, 595)
_CUDNN_FULL_BWD = (305, 408, 465, 499, 518, 516)
# No causal backward series is published with them: the non-causal backward scaled by the forward's causal /
# non-causal ratio at each length (derived, not measured).
_CUDNN_CAUSAL_BWD = tuple(b * c / f for b, c, f in zip(_CUDNN_FULL_BWD, _CUDNN_CAUSAL_FWD, _CUDNN_FULL_FWD))


def _curve(tflops) -> RateCurve:
    return RateCurve(tuple((n, t * 1e12) for n, t in zip(_LENGTHS, tflops)))


PUBLISHED = TimeParameters(
    attention_forward=_curve(_CUDNN_CAUSAL_FWD), attention_backward=_curve(_CUDNN_CAUSAL_BWD),
    vision_attention_forward=_curve(_CUDNN_FULL_FWD), vision_attention_backward=_curve(_CUDNN_FULL_BWD),
    source="published rates, fitted parameters at their defaults")

# The fitted parameters as ``megatron.bridge_thd.plan.fit.fit_parameters`` returns them on the fit tables (Megatron-LM's
# dynamic-CP example; docs/time-model.md), what the planner and the placements use unless given others. A test checks
# that the fit still returns them.
FITTED = PUBLISHED.with_fit("fitted on megatron-lm-dynamic-cp", ring_step_s=0.0012, per_micro_batch_s=0.0,
                            per_step_s=0.07998764391911385)


@dataclass(frozen=True)
class ModelShape:
    """What the time model reads of a model besides its FLOPs coefficients.

    Attributes:
        cost: the trainer's per-sample FLOPs coefficients (:func:`~megatron.bridge_thd.cost.sample.sample_cost`).
        num_layers: decoder layers; full_attention_layers: those with softmax attention (the rest are linear).
        kv_bytes_per_token: bf16 bytes of K and V of one token in one full-attention layer (all KV heads).
        weight_bytes: bf16 bytes of the weights a micro-batch's GEMMs read (language model and vision tower; the
            routed experts' share a token touches for an MoE), before TP.
        hidden_size: the decoder's hidden size; moe_topk: routed experts per token (0: dense).
        moe_layers: decoder layers with routed experts.
        activation_bytes_per_token / activation_bytes_per_patch: the activation bytes one LLM token (decoder layers
            and output) / one ViT patch leaves for backward (the planner's memory model), which the element-wise
            kernels between the GEMMs (norms, activations, rotary, residuals, the loss) write and read.
    """

    cost: SampleCost
    num_layers: int
    full_attention_layers: int
    kv_bytes_per_token: float
    weight_bytes: float
    hidden_size: int
    moe_topk: int = 0
    moe_layers: int = 0
    activation_bytes_per_token: float = 0.0
    activation_bytes_per_patch: float = 0.0


@dataclass(frozen=True)
class SampleWork:
    """One sample as the time model sees it: ``tokens`` (LLM tokens, its slots in the row), ``patches`` (ViT
    patches), ``frames`` (each frame's patches: an image is one frame, a video of grid ``(t, h, w)`` is ``t``
    frames of ``h * w``) and ``attended`` (False for padding that the GEMMs process but attention skips, as the pad
    tail of a sample in a THD row whose ``cu_seqlens`` stop at its real tokens)."""

    tokens: int
    patches: int = 0
    frames: tuple[int, ...] = ()
    attended: bool = True


def sample_work(tokens: int, grids: Sequence[Sequence[int]] = ()) -> SampleWork:
    frames = frame_lengths(grids)
    return SampleWork(int(tokens), sum(frames), frames)


@dataclass(frozen=True)
class RowTime:
    """Seconds one rank spends on a row, by part (:func:`row_time`); ``total`` is their sum."""

    gemm: float = 0.0
    attention: float = 0.0
    vision: float = 0.0
    ring_exposed: float = 0.0
    moe_dispatch: float = 0.0
    fixed: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return (self.gemm + self.attention + self.vision + self.ring_exposed + self.moe_dispatch + self.fixed
                + self.elementwise)


def _attention_seconds(flops: float, length: float, forward: RateCurve, backward: RateCurve) -> tuple[float, float]:
    """(forward, backward) seconds of attention whose trainer-counted FLOPs (forward x 3) are ``flops``, run on
    segments of ``length`` tokens: forward ``flops / 3`` at the forward rate, backward ``2.5 x`` that at the
    backward rate (the kernels' own FLOPs count)."""
    forward_flops = flops / 3
    return forward_flops / forward(length), 2.5 * forward_flops / backward(length)


def _ring_exposed(shape: ModelShape, params: TimeParameters, machine: Machine, slots: int,
                  attention_s: tuple[float, float], cp: int, tp: int) -> float:
    """Seconds the CP ring adds over the attention compute of a row of ``slots`` at CP ``cp``. Transformer Engine's
    THD ring exchanges the whole row's chunk in each step: per full-attention layer ``cp - 1`` steps forward (the
    chunk's K, V) and ``cp - 1`` backward (K, V and dK, dV), each the larger of its share of the layer's attention
    compute (the row's, forward and backward apart: ``attention_s``) and ``ring_step_s`` + the link's time for its
    bytes; returned is the excess over the compute."""
    if cp == 1 or shape.full_attention_layers == 0:
        return 0.0
    link = machine.link(cp, tp)
    chunk_kv = slots / cp * shape.kv_bytes_per_token / tp
    forward_step, backward_step = (seconds / shape.full_attention_layers / cp for seconds in attention_s)
    exposed = (cp - 1) * (max(forward_step, params.ring_step_s + link.seconds(chunk_kv)) - forward_step
                          + max(backward_step, params.ring_step_s + link.seconds(2 * chunk_kv)) - backward_step)
    return exposed * shape.full_attention_layers


def row_time(shape: ModelShape, samples: Sequence[SampleWork], machine: Machine, params: TimeParameters, *,
             cp: int = 1, tp: int = 1, ep: int = 1, align: int = 1) -> RowTime:
    """Seconds each of a row's ``cp * tp`` ranks spends on one micro-batch (forward and backward) of ``samples``.

    Args:
        samples: the row's samples; each takes ``round_up(tokens, align)`` slots (``align`` = 2 x CP under CP).
        cp: the row's CP size (its samples' chunks are ``slots / 2cp`` long for the kernel); tp: TP size; ep: EP
            size (MoE dispatch over the EP group when > 1).

    Returns:
        The parts (:class:`RowTime`); the fixed part is ``per_micro_batch_s``.
    """
    cost = shape.cost
    slots = sum(-(-w.tokens // align) * align for w in samples)
    ranks = cp * tp
    peak = machine.bf16_flops * params.gemm_efficiency
    weights = 3 * shape.weight_bytes / tp / machine.hbm_bytes_per_s
    patches = sum(w.patches for w in samples)
    elementwise = 3 * (shape.activation_bytes_per_token * slots + shape.activation_bytes_per_patch * patches) \
        / ranks / machine.hbm_bytes_per_s
    text_flops = cost.per_token * slots / ranks
    vision_flops = cost.per_patch * patches / ranks
    gemm = max(text_flops / peak, weights)
    forward = backward = 0.0
    for w in (w for w in samples if w.attended):
        segment = w.tokens / (2 * cp) if cp > 1 else w.tokens
        seconds = _attention_seconds(cost.per_token_squared * w.tokens ** 2 / ranks, segment,
                                     params.attention_forward, params.attention_backward)
        forward, backward = forward + seconds[0], backward + seconds[1]
    attention = forward + backward
    ring = _ring_exposed(shape, params, machine, slots, (forward, backward), cp, tp)
    vision = vision_flops / peak + sum(sum(_attention_seconds(
        cost.per_patch_squared * f * f / ranks, f, params.vision_attention_forward, params.vision_attention_backward))
        for w in samples for f in w.frames)
    dispatch = 0.0
    if ep > 1 and shape.moe_topk:
        routed = slots / ranks * shape.moe_topk * shape.hidden_size * 2 * (ep - 1) / ep
        dispatch = 4 * shape.moe_layers * machine.link(ep, tp * cp).seconds(routed)
    return RowTime(gemm, attention, vision, ring, dispatch, params.per_micro_batch_s, elementwise)


def _activation_bytes_per_token(spec) -> float:
    """A token's activation bytes: the decoder layers and the output, and per MTP layer one more layer (the last
    layer's kind) and one more output (its own logits and loss)."""
    layers = layer_bytes_per_token(spec)
    return sum(layers) + output_bytes_per_token(spec) + spec.mtp_num_layers * (layers[-1] + output_bytes_per_token(spec))


def model_shape(model) -> ModelShape:
    """The :class:`ModelShape` of a model given as :func:`~megatron.bridge_thd.cost.sample.sample_cost` takes it (a
    planner preset name, a ``config.json`` path or a ``ModelSpec``): its FLOPs coefficients from the trainer's formula,
    its layer counts, K/V width and bf16 weight bytes.

    Raises:
        ValueError: as :func:`~megatron.bridge_thd.cost.sample.sample_cost`.
    """
    spec = resolve_model_spec(model)
    counts = parameter_counts(spec)
    experts_touched = (counts["experts"] * spec.moe_router_topk / spec.num_moe_experts) if spec.is_moe else 0
    full = spec.linear_layer_pattern().count(0)
    return ModelShape(
        cost=sample_cost(spec), num_layers=spec.num_layers, full_attention_layers=full,
        kv_bytes_per_token=2 * spec.num_query_groups * spec.kv_channels * 2,
        weight_bytes=2 * (counts["dense"] + counts["embedding"] + experts_touched),
        hidden_size=spec.hidden_size, moe_topk=spec.moe_router_topk if spec.is_moe else 0,
        moe_layers=spec.num_layers if spec.is_moe else 0,
        activation_bytes_per_token=_activation_bytes_per_token(spec),
        activation_bytes_per_patch=vision_bytes_per_patch(spec))


_CURVES = ("attention_forward", "attention_backward", "vision_attention_forward", "vision_attention_backward")
_SCALARS = ("gemm_efficiency", "per_micro_batch_s", "ring_step_s", "per_step_s")


def time_parameters_to_dict(params: TimeParameters) -> dict:
    """``params`` as the JSON object :func:`load_time_parameters` reads (curves as ``[[length, flop_per_s], ...]``)."""
    out = {"source": params.source, "fitted": list(params.fitted)}
    fields = vars(params)
    out.update({name: fields[name] for name in _SCALARS})
    out.update({name: [list(p) for p in fields[name].points] for name in _CURVES})
    return out


def load_time_parameters(path, base: TimeParameters | None = None) -> TimeParameters:
    """The time parameters in the JSON file ``path`` (what ``benchmarks/gpu_calibrate.py`` writes on a GPU): every
    field it gives replaces ``base``'s (default :data:`FITTED`); a field it leaves out keeps ``base``'s.

    Raises:
        ValueError: the file is missing or not JSON, or a field is not what it must be (naming the file and field).
    """
    base = FITTED if base is None else base
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--time-params {path}: no such file; write it with benchmarks/gpu_calibrate.py") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--time-params {path}: not valid JSON (line {error.lineno}: {error.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--time-params {path}: expected a JSON object of parameters")
    unknown = set(data) - set(_CURVES) - set(_SCALARS) - {"source", "fitted", "measured"}  # measured: the raw figures
    if unknown:
        raise ValueError(f"--time-params {path}: unknown field(s) {sorted(unknown)}; known: "
                         f"{', '.join(_SCALARS + _CURVES)}")
    changes = {}
    for name in _SCALARS:
        if name in data:
            value = data[name]
            if not isinstance(value, (int, float)) or value < 0 or (name == "gemm_efficiency" and not 0 < value <= 1):
                raise ValueError(f"--time-params {path}: field {name!r} must be a number >= 0"
                                 f"{' and <= 1' if name == 'gemm_efficiency' else ''}, got {value!r}")
            changes[name] = float(value)
    for name in _CURVES:
        if name in data:
            points = data[name]
            if (not isinstance(points, list) or not points or any(
                    not isinstance(p, list) or len(p) != 2 or not all(isinstance(v, (int, float)) and v > 0 for v in p)
                    for p in points) or [p[0] for p in points] != sorted({p[0] for p in points})):
                raise ValueError(f"--time-params {path}: field {name!r} must be [[length, flop_per_s], ...] with "
                                 "positive numbers, lengths strictly ascending")
            changes[name] = RateCurve(tuple((int(n), float(r)) for n, r in points))
    fitted = tuple(data.get("fitted", base.fitted))
    return replace(base, source=str(data.get("source", f"{path}")), fitted=fitted, **changes)
