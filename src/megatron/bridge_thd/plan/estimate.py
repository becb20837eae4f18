"""The planner: per layout, token slots, attention work, trainer FLOPs, MoE routing, memory and
the time model's step time (docs/time-model.md) for a model, a length distribution and a parallel layout.

Averages are per micro-batch over all micro-batches formed from the samples (consecutive groups
of ``micro_batch_size``); memory is the peak over them (the longest padded / packed micro-batch).
A step is ``micro_batches_per_step`` micro-batches on each of the ``dp`` data-parallel replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron.bridge_thd.cost.step_time import FITTED, MACHINES, Link, Machine, TimeParameters, get_machine
from megatron.bridge_thd.cost.flops import FlopsBreakdown, flops_config, micro_batch_flops, moe_routed_tokens
from megatron.bridge_thd.plan.layouts import LAYOUT_ORDER, Parallel, layout_stats, micro_batches
from megatron.bridge_thd.plan.memory import activation_bytes, model_state_bytes
from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.plan.roofline import GPU, get_gpu
from megatron.bridge_thd.cost.sample_lengths import SampleLengths
from megatron.bridge_thd.plan.step_model import StepModel, step_model

__all__ = ["PlanSettings", "LayoutEstimate", "Plan", "plan"]


@dataclass(frozen=True)
class PlanSettings:
    """Training setting: ``seq_length`` (tokens), ``micro_batch_size`` (samples), the parallel
    layout, ``micro_batches_per_step`` per DP replica, the GPU, the time model's parameters ``time``
    (docs/time-model.md; the fitted ones by default), an extra fixed per-step ``overhead_s`` (beyond the
    model's) and ``reserved_bytes`` per GPU (CUDA context, NCCL, fragmentation)."""

    seq_length: int
    micro_batch_size: int
    parallel: Parallel = field(default_factory=Parallel)
    micro_batches_per_step: int = 1
    gpu: GPU = field(default_factory=lambda: get_gpu("h100-sxm"))
    time: TimeParameters = FITTED
    overhead_s: float = 0.0
    reserved_bytes: float = 6e9

    @property
    def machine(self) -> Machine:
        """The time model's machine of ``gpu``: the measured one of that name, else the GPU's own figures with its
        link inside and between nodes at the listed bandwidth and no latency."""
        if self.gpu.name in MACHINES:
            return get_machine(self.gpu.name)
        link = Link(self.gpu.link_bytes_per_s, 0.0)
        return Machine(self.gpu.name, self.gpu.bf16_flops, self.gpu.hbm_bytes_per_s, self.gpu.memory_bytes, link, link)

    def step_model(self, spec: ModelSpec) -> StepModel:
        """The time model of this setting for ``spec`` (:mod:`~.step_model`)."""
        return step_model(spec, self.parallel, self.machine, self.time, self.seq_length)


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout's figures. Per micro-batch means: ``slots``, ``attention_work`` (tokens^2),
    ``flops`` (fwd + bwd, whole micro-batch), ``routed`` (token-expert assignments, all MoE
    layers). Per GPU: ``activation_peak`` / ``memory_peak`` (bytes, busiest micro-batch),
    ``step_s`` (seconds: the mean micro-batch's time model figure times the micro-batches, the bubble and what
    a step spends once), ``samples_per_s`` (whole job)."""

    layout: str
    slots: float
    attention_work: float
    flops: FlopsBreakdown
    routed: float
    activation_peak: float
    memory_peak: float
    fits: bool
    step_s: float
    samples_per_s: float


@dataclass(frozen=True)
class Plan:
    """The planner's answer: ``layouts[name]`` plus the inputs and data summary."""

    spec: ModelSpec
    samples: SampleLengths
    settings: PlanSettings
    real_tokens: float  # mean real tokens per micro-batch (after truncation)
    truncated_tokens: int
    state_bytes: float
    layouts: dict[str, LayoutEstimate]

    def speedup(self, layout: str = "thd", baseline: str = "bshd") -> float:
        """Predicted step-time ratio ``baseline / layout`` (> 1: ``layout`` is faster)."""
        return self.layouts[baseline].step_s / self.layouts[layout].step_s


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _estimate_layout(layout, spec, cfg, batches, settings, state_bytes, model: StepModel) -> LayoutEstimate:
    par, n_mb = settings.parallel, settings.micro_batches_per_step
    stats = [layout_stats(layout, b, settings.seq_length, par) for b in batches]
    flops = [micro_batch_flops(cfg, len(b.lengths), s, q, b.patches) for b, (s, q) in zip(batches, stats)]
    mean_flops = FlopsBreakdown(_mean(f.linear for f in flops), _mean(f.attention_core for f in flops),
                                _mean(f.vision for f in flops))
    acts = [activation_bytes(spec, par, s, b.patches, n_mb).total for b, (s, _) in zip(batches, stats)]
    peak = max(acts)
    memory_peak = state_bytes + peak + settings.reserved_bytes
    mean_seconds = _mean(model.micro_batch(layout, b.lengths, b.frames).total for b in batches)
    step = model.step([mean_seconds * n_mb], n_mb) + settings.overhead_s
    samples = settings.micro_batch_size * n_mb * par.dp
    return LayoutEstimate(layout, _mean(s for s, _ in stats), _mean(q for _, q in stats), mean_flops,
                          _mean(moe_routed_tokens(spec, s) for s, _ in stats), peak, memory_peak,
                          memory_peak <= settings.gpu.memory_bytes, step, samples / step)


def plan(spec: ModelSpec, samples: SampleLengths, settings: PlanSettings) -> Plan:
    """Estimate every layout of :data:`~.layouts.LAYOUT_ORDER` for ``spec`` on ``samples`` under ``settings``."""
    batches = micro_batches(samples, settings.micro_batch_size, settings.seq_length)
    cfg = flops_config(spec, settings.parallel.tp, settings.seq_length)
    state = model_state_bytes(spec, settings.parallel)
    model = settings.step_model(spec)
    layouts = {name: _estimate_layout(name, spec, cfg, batches, settings, state, model) for name in LAYOUT_ORDER}
    return Plan(spec, samples, settings, _mean(sum(b.lengths) for b in batches),
                sum(b.truncated for b in batches), state, layouts)
