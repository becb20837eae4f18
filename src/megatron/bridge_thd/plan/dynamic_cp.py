"""Static context parallelism against a CP size per sample, for one length distribution (docs/dynamic-cp.md).

A world of ``W`` ranks (``gpus / tp``; PP 1) runs each step's ``global_batch_size`` samples with at most
``max_tokens_per_rank`` tokens of a sample on a rank (what its activations can hold):

* **static CP c** (``c`` = 1, 2, 4, ... up to ``W``): ``W / c`` data-parallel replicas, every sample cut over its
  replica's ``c`` ranks. Samples are placed by global-batch packing (:func:`megatron.bridge_thd.batching.policy.assign`,
  balanced on the trainer's FLOPs) in rows of ``c * max_tokens_per_rank`` slots, as few rows per replica as fit; a
  sample longer than a row does not fit that ``c`` at all.
* **CP per sample**: Megatron-Core's ``BalancedCPScheduler`` through
  :func:`megatron.bridge_thd.batching.dynamic_cp.place_with_cp_per_sample`; groups run one after another (a barrier
  between them), so the step takes the sum over groups of the slowest rank in each.

A row's time on each of its ``k`` ranks is its FLOPs (:func:`megatron.bridge_thd.batching.cost.sample_cost`, the
trainer's formula: language and vision, the vision attention per frame as ``batching.cost.image_patches`` counts it)
over ``k`` at ``mfu`` of the GPU's bf16 peak, plus CP communication with no overlap (an upper bound): per
full-attention layer and sample, every rank receives the other ranks' K and V,
``2 * s * (k - 1) / k * num_query_groups * kv_channels * 2`` bytes, three times over forward and backward
(K/V again and their gradients), at the GPU's link bandwidth per direction. Gated-DeltaNet layers' CP exchange is
not modelled. Each rank's peak activation tokens is its largest row's share, ``slots / k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.bridge_thd.batching.cost import SampleCost, image_patches, sample_cost
from megatron.bridge_thd.batching.dynamic_cp import TooLongForTheWorld, place_with_cp_per_sample
from megatron.bridge_thd.batching.policy import DoesNotFit, assign
from megatron.bridge_thd.packing import round_up
from megatron.bridge_thd.plan.presets import ModelSpec
from megatron.bridge_thd.plan.roofline import GPU
from megatron.bridge_thd.plan.samples import SampleLengths

__all__ = ["CPEstimate", "compare_cp", "format_cp_comparison"]


@dataclass(frozen=True)
class CPEstimate:
    """One way of running the steps (static CP ``c``, or CP per sample).

    Attributes:
        name: ``"static CP c"`` or ``"CP per sample"``.
        fits: every sample fits (else the other figures are None and ``why`` says which sample does not).
        step_s: mean step time (seconds).
        imbalance: per-rank busy time, max / mean, averaged over steps.
        peak_tokens: the most tokens of one row a rank holds, over the run.
        cp_sizes: samples per CP size (CP per sample), or ``{c: n}``.
        padding: slots over real tokens, minus one.
        unbarred_s: CP per sample: the mean step time if the groups ran without the barrier between them (each rank
            busy back to back: the slowest rank's total; a lower bound), else None.
    """

    name: str
    fits: bool
    step_s: float | None = None
    imbalance: float | None = None
    peak_tokens: int | None = None
    cp_sizes: tuple[tuple[int, int], ...] = ()
    padding: float | None = None
    why: str = ""
    unbarred_s: float | None = None


def _kv_bytes_per_token(spec: ModelSpec) -> float:
    """K and V bytes (bf16) of one token over the full-attention layers."""
    full_attention = spec.linear_layer_pattern().count(0)
    return 2 * spec.num_query_groups * spec.kv_channels * 2 * full_attention


class _RowTime:
    """A row's seconds on each of its ranks."""

    def __init__(self, spec: ModelSpec, samples: SampleLengths, gpu: GPU, mfu: float, tp: int):
        self.cost: SampleCost = sample_cost(spec)
        self.samples, self.gpu, self.mfu, self.tp = samples, gpu, mfu, tp
        self.kv = _kv_bytes_per_token(spec)
        patches, squared = image_patches(samples.grids)
        self.flops = self.cost(list(samples.tokens), patches, squared).tolist()

    def __call__(self, members, k: int) -> float:
        flops = sum(self.flops[i] for i in members)
        compute = flops / (k * self.tp) / (self.gpu.bf16_flops * self.mfu)
        comm = sum(3 * self.samples.tokens[i] * (k - 1) / k * self.kv for i in members) / self.tp \
            / self.gpu.link_bytes_per_s
        return compute + comm


def _static(c: int, world: int, steps: list[list[int]], samples: SampleLengths, limit: int,
            row_time: _RowTime) -> CPEstimate:
    dp, align, row = world // c, 2 * c if c > 1 else 1, c * limit
    times, imbalance, peak, slots = [], [], 0, 0
    for step in steps:
        lengths = [samples.tokens[i] for i in step]
        longest = max(round_up(n, align) for n in lengths)
        if longest > row:
            return CPEstimate(f"static CP {c}", False, why=f"a {max(lengths)}-token sample needs more than {c} x "
                              f"{limit} tokens per rank")
        micro = max(1, math.ceil(sum(round_up(n, align) for n in lengths) / (dp * row)))
        while True:
            try:
                placed = assign(lengths, dp_size=dp, num_micro_batches=micro, row_length=row, align_to=align,
                                cost=row_time.cost)
                break
            except DoesNotFit:
                micro += 1
        busy = [sum(row_time([step[i] for i in mb], c) for mb in rank) for rank in placed]
        times.append(max(busy))
        imbalance.append(max(busy) / (sum(busy) / len(busy)))
        peak = max(peak, max(sum(round_up(lengths[i], align) for i in mb) // c for rank in placed for mb in rank))
        slots += sum(round_up(n, align) for n in lengths)
    real = sum(samples.tokens[i] for step in steps for i in step)
    return CPEstimate(f"static CP {c}", True, sum(times) / len(times), sum(imbalance) / len(imbalance), peak,
                      ((c, real and sum(len(s) for s in steps)),), slots / real - 1)


def _per_sample(world: int, steps: list[list[int]], samples: SampleLengths, limit: int,
                row_time: _RowTime) -> CPEstimate:
    times, unbarred, imbalance, peak, slots, sizes = [], [], [], 0, 0, {}
    for step in steps:
        lengths = [samples.tokens[i] for i in step]
        try:
            placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=limit)
        except TooLongForTheWorld as error:
            return CPEstimate("CP per sample", False, why=str(error).split(";")[0])
        busy = [[0.0] * world for _ in range(placement.groups)]
        for r in placement.rows:
            seconds = row_time([step[i] for i in r.samples], r.cp_size)
            for rank in r.ranks:
                busy[r.group][rank] += seconds
            peak = max(peak, r.slots_per_rank)
            slots += r.slots
        times.append(sum(max(group) for group in busy))
        totals = [sum(group[rank] for group in busy) for rank in range(world)]
        unbarred.append(max(totals))
        imbalance.append(max(totals) / (sum(totals) / world))
        for k in placement.cp_size_of().values():
            sizes[k] = sizes.get(k, 0) + 1
    real = sum(samples.tokens[i] for step in steps for i in step)
    return CPEstimate("CP per sample", True, sum(times) / len(times), sum(imbalance) / len(imbalance), peak,
                      tuple(sorted(sizes.items())), slots / real - 1, unbarred_s=sum(unbarred) / len(unbarred))


def compare_cp(spec: ModelSpec, samples: SampleLengths, *, gpus: int, tp: int = 1, global_batch_size: int,
               max_tokens_per_rank: int, gpu: GPU, mfu: float = 0.40) -> list[CPEstimate]:
    """Static CP 1, 2, 4, ... (up to the world) and CP per sample on consecutive global batches of ``samples``
    (the remainder dropped), by the model of the module docstring."""
    world = gpus // tp
    if world < 1 or world * tp != gpus or world & (world - 1):
        raise ValueError(f"--gpus {gpus} / --tp {tp}: CP per sample needs a power-of-two DP x CP world; got {gpus / tp}")
    steps = [list(range(s * global_batch_size, (s + 1) * global_batch_size))
             for s in range(len(samples.tokens) // global_batch_size)]
    if not steps:
        raise ValueError(f"--global-batch-size {global_batch_size}: larger than the {len(samples.tokens)} samples")
    row_time = _RowTime(spec, samples, gpu, mfu, tp)
    sizes = [2 ** i for i in range(int(math.log2(world)) + 1)]
    return [_static(c, world, steps, samples, max_tokens_per_rank, row_time) for c in sizes] + [
        _per_sample(world, steps, samples, max_tokens_per_rank, row_time)]


def format_cp_comparison(estimates: list[CPEstimate], *, max_tokens_per_rank: int) -> str:
    """The comparison as a Markdown table (and the reasons a way does not fit)."""
    rows = [f"| run (at most {max_tokens_per_rank:,} tokens of a sample per rank) | step time (ms) | per-rank busy "
            "max / mean | peak tokens per rank | padding | samples per CP size |", "|---|---|---|---|---|---|"]
    for e in estimates:
        if not e.fits:
            rows.append(f"| {e.name} | does not fit: {e.why} | | | | |")
            continue
        sizes = ", ".join(f"CP {k}: {n}" for k, n in e.cp_sizes)
        step = f"{e.step_s * 1e3:,.1f}" + (f" ({e.unbarred_s * 1e3:,.1f} without the barriers between groups)"
                                           if e.unbarred_s is not None else "")
        rows.append(f"| {e.name} | {step} | {e.imbalance:.3f} | {e.peak_tokens:,} | "
                    f"{e.padding:.1%} | {sizes} |")
    return "\n".join(rows)
