"""The planner's step time: the time model (:mod:`megatron.bridge_thd.cost.step_time`) applied to a layout's
micro-batches, plus what a step spends once (docs/time-model.md).

A micro-batch in a layout becomes the row the time model prices:

* ``bshd``: every sample padded to the batch's width ``W`` (:func:`megatron.bridge_thd.layouts.bshd_width`): GEMMs
  on ``B x W`` slots and each sample's attention over ``W`` tokens, pads included (the kernel sees them);
* ``thd``: the samples' real lengths, each aligned as the step aligns it;
* ``thd_static``: the real samples plus the row's padding tail, which the GEMMs process and attention skips (the
  real ``cu_seqlens`` stop before it).

Per step: the micro-batches of a rank back to back, the 1F1B bubble ``(pp - 1) / m`` of them, and once per step the
data-parallel gradient sync and the optimizer (:func:`sync_seconds`), fully exposed because Megatron-Bridge's VLM
recipes set ``overlap_grad_reduce`` and ``overlap_param_gather`` off, plus the fitted ``per_step_s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron.bridge_thd import layouts
from megatron.bridge_thd.cost.step_time import (
    Machine, ModelShape, RowTime, SampleWork, TimeParameters, model_shape, row_time)
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.cost.memory import parameter_counts
from megatron.bridge_thd.cost.presets import ModelSpec

__all__ = ["StepModel", "sync_seconds", "step_model"]


def sync_seconds(spec: ModelSpec, parallel: Parallel, machine: Machine) -> float:
    """Seconds a step spends once on the weights: the distributed optimizer's gradient reduce-scatter (fp32, as the
    recipes set ``grad_reduce_in_fp32``) and parameter all-gather (bf16) over the ``dp * cp`` ranks that share a
    weight shard, each ``bytes * (n - 1) / n`` at the group's link, and the Adam update of the rank's shard from HBM
    (fp32 gradient, master weight and two moments read, the three written back, the bf16 weight written: 30 bytes a
    parameter)."""
    counts = parameter_counts(spec)
    dense = (counts["dense"] + counts["embedding"] + counts["vision"]) / (parallel.tp * parallel.pp)
    experts = counts["experts"] / (parallel.tp * parallel.pp * parallel.ep)
    seconds = 0.0
    for params, shards in ((dense, parallel.dp * parallel.cp), (experts, max(1, parallel.dp * parallel.cp // parallel.ep))):
        if params == 0:
            continue
        if shards > 1:
            link = machine.link(shards, parallel.tp)
            seconds += link.seconds(4 * params * (shards - 1) / shards) + link.seconds(2 * params * (shards - 1) / shards)
        seconds += 30 * params / shards / machine.hbm_bytes_per_s
    return seconds


@dataclass(frozen=True)
class StepModel:
    """One model, machine, parallel layout and set of time parameters: the seconds of a micro-batch in a layout and
    of a step (module docstring)."""

    spec: ModelSpec
    shape: ModelShape
    machine: Machine
    params: TimeParameters
    parallel: Parallel
    seq_length: int
    sync_s: float

    def rows(self, layout: str, lengths: Sequence[int], frames: Sequence[Sequence[int]],
             row_length: int | None = None) -> list[SampleWork]:
        """The row the time model prices for a micro-batch of ``lengths`` (truncated LLM tokens per sample) whose
        samples have ``frames`` (each sample's ViT frames' patches) in ``layout`` (``row_length``: a
        ``thd_static`` row's slots when not the in-batch default)."""
        par = self.parallel
        frames = list(frames) or [()] * len(lengths)
        works = [SampleWork(int(n), sum(f), tuple(f)) for n, f in zip(lengths, frames)]
        if layout == "bshd":
            width = layouts.bshd_width(max(lengths), seq_length=self.seq_length, tp=par.tp, cp=par.cp, pp=par.pp,
                                       ep=par.ep)
            return [SampleWork(width, w.patches, w.frames) for w in works]
        if layout == "thd":
            return works
        if layout == "thd_static":
            align = par.thd_alignment()
            used = layouts.thd_slots(lengths, align)
            row = row_length or layouts.static_row_length(len(lengths), seq_length=self.seq_length, align=align)
            return works + ([SampleWork(row - used, attended=False)] if row > used else [])
        raise ValueError(f"layout {layout!r} is not known; valid layouts: bshd, thd, thd_static")

    def micro_batch(self, layout: str, lengths: Sequence[int], frames: Sequence[Sequence[int]],
                    row_length: int | None = None) -> RowTime:
        """Seconds per rank of one micro-batch (:meth:`rows`)."""
        par = self.parallel
        works = self.rows(layout, lengths, frames, row_length)
        align = par.thd_alignment() if layout != "bshd" else 1
        return row_time(self.shape, works, self.machine, self.params, cp=par.cp, tp=par.tp, ep=par.ep, align=align)

    def step(self, rank_seconds: Sequence[float], micro_batches: int) -> float:
        """A step's seconds from each DP rank's busy seconds (its micro-batches back to back): the slowest rank,
        the 1F1B bubble, the weight sync and the fixed per-step cost."""
        bubble = 1 + (self.parallel.pp - 1) / micro_batches
        return max(rank_seconds) * bubble + self.sync_s + self.params.per_step_s


def step_model(spec: ModelSpec, parallel: Parallel, machine: Machine, params: TimeParameters,
               seq_length: int) -> StepModel:
    """The :class:`StepModel` of a plan."""
    return StepModel(spec, model_shape(spec), machine, params, parallel, seq_length,
                     sync_seconds(spec, parallel, machine))
