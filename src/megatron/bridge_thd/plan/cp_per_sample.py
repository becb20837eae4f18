"""Static context parallelism against a CP size per sample, for one length distribution (docs/cp-per-sample.md).

A world of ``W`` ranks (``gpus / tp``; PP 1) runs each step's ``global_batch_size`` samples with at most
``max_tokens_per_rank`` tokens of a sample on a rank (what its activations can hold):

* **static CP c** (``c`` = 1, 2, 4, ... up to ``W``): ``W / c`` data-parallel replicas, every sample cut over its
  replica's ``c`` ranks. Samples are placed by global-batch packing (:func:`megatron.bridge_thd.batching.policy.assign`,
  balanced on the trainer's FLOPs) in rows of ``c * max_tokens_per_rank`` slots, as few rows per replica as fit; a
  sample longer than a row does not fit that ``c`` at all.
* **CP per sample, Megatron-Core's scheduler**: ``BalancedCPScheduler`` through
  :func:`megatron.bridge_thd.batching.cp_per_sample.place_with_cp_per_sample`; groups run one after another (a barrier
  between them).
* **CP per sample, ours**: :func:`megatron.bridge_thd.batching.time_placement.place_by_time`, balanced on the time
  model below; one group, rows in one global order.

Every way's rows are priced by the time model, :func:`megatron.bridge_thd.cost.step_time.row_time` (seconds per
rank of a row: GEMMs with the weight-read floor, attention by chunk length, the ViT per frame, the CP ring's exposed
steps over NVLink within a node and the network across nodes, fixed costs; docs/time-model.md), and run as the
schedule runs them (:func:`megatron.bridge_thd.batching.cp_per_sample.timeline`: each rank's rows back to back, a row
starting when all its ranks are free, barriers between groups); each step adds the model's per-step fixed cost.
Each rank's peak activation tokens is its largest row's share, ``slots / k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron.bridge_thd.batching.cp_per_sample import CPRow, TooLongForTheWorld, place_with_cp_per_sample, timeline
from megatron.bridge_thd.batching.policy import DoesNotFit, assign
from megatron.bridge_thd.cost.step_time import SampleWork, TimeParameters, sample_work
from megatron.bridge_thd.batching.time_placement import RowPricer, place_by_time
from megatron.bridge_thd.packing import round_up
from megatron.bridge_thd.cost.sample_lengths import SampleLengths

__all__ = ["CPEstimate", "compare_cp", "format_cp_comparison", "MEGATRON", "OURS"]

MEGATRON = "CP per sample (Megatron-Core's scheduler)"
OURS = "CP per sample (ours, time model)"


@dataclass(frozen=True)
class CPEstimate:
    """One way of running the steps (static CP ``c``, or CP per sample by one of the two placements).

    Attributes:
        name: ``"static CP c"``, :data:`MEGATRON` or :data:`OURS`.
        fits: every sample fits (else the other figures are None and ``why`` says which sample does not).
        step_s: mean step time (seconds).
        imbalance: per-rank busy time, max / mean, averaged over steps.
        peak_tokens: the most tokens of one row a rank holds, over the run.
        cp_sizes: samples per CP size (CP per sample), or ``{c: n}``.
        padding: slots over real tokens, minus one.
        unbarred_s: Megatron-Core's scheduler: the mean step time if its groups ran without the barrier between them
            (each rank busy back to back: the slowest rank's total; a lower bound), else None.
        unbalanced_steps: ours: the steps whose busy max / mean is above the placement's target (each with the
            placement's reason), else None.
        why: why the way does not fit.
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
    unbalanced_steps: int | None = None


def _static(c: int, world: int, steps: list[list[int]], samples: SampleLengths, limit: int, pricer: RowPricer,
            works: list[SampleWork]) -> CPEstimate:
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
                                cost=pricer.shape.cost)
                break
            except DoesNotFit:
                micro += 1
        busy = [sum(pricer.seconds([works[step[i]] for i in mb], c) for mb in rank) for rank in placed]
        times.append(max(busy) + pricer.params.per_step_s)
        imbalance.append(max(busy) / (sum(busy) / len(busy)))
        peak = max(peak, max(sum(round_up(lengths[i], align) for i in mb) // c for rank in placed for mb in rank))
        slots += sum(round_up(n, align) for n in lengths)
    real = sum(samples.tokens[i] for step in steps for i in step)
    return CPEstimate(f"static CP {c}", True, sum(times) / len(times), sum(imbalance) / len(imbalance), peak,
                      ((c, sum(len(s) for s in steps)),), slots / real - 1)


def _per_sample(name: str, world: int, steps: list[list[int]], samples: SampleLengths, limit: int,
                pricer: RowPricer, works: list[SampleWork]) -> CPEstimate:
    times, unbarred, imbalance, peak, slots, sizes, unbalanced = [], [], [], 0, 0, {}, 0
    for step in steps:
        step_works = [works[i] for i in step]
        try:
            if name == OURS:
                placement = place_by_time(step_works, world=world, max_tokens_per_rank=limit, pricer=pricer)
                unbalanced += bool(placement.reason)
            else:
                placement = place_with_cp_per_sample([w.tokens for w in step_works], world=world,
                                                     max_tokens_per_rank=limit)
        except TooLongForTheWorld as error:
            return CPEstimate(name, False, why=str(error).split(";")[0])

        def seconds(row: CPRow) -> float:
            return pricer.seconds([step_works[i] for i in row.samples], row.cp_size)

        step_s, busy = timeline(placement.rows, world, seconds)
        times.append(step_s + pricer.params.per_step_s)
        unbarred.append(max(busy) + pricer.params.per_step_s)
        imbalance.append(max(busy) / (sum(busy) / world))
        peak = max([peak] + [r.slots_per_rank for r in placement.rows])
        slots += sum(r.slots for r in placement.rows)
        for k in placement.cp_size_of().values():
            sizes[k] = sizes.get(k, 0) + 1
    real = sum(samples.tokens[i] for step in steps for i in step)
    return CPEstimate(name, True, sum(times) / len(times), sum(imbalance) / len(imbalance), peak,
                      tuple(sorted(sizes.items())), slots / real - 1,
                      unbarred_s=sum(unbarred) / len(unbarred) if name == MEGATRON else None,
                      unbalanced_steps=unbalanced if name == OURS else None)


def compare_cp(model: Any, samples: SampleLengths, *, gpus: int, tp: int = 1, global_batch_size: int,
               max_tokens_per_rank: int, gpu: str, params: TimeParameters | None = None) -> list[CPEstimate]:
    """Static CP 1, 2, 4, ... (up to the world), CP per sample by Megatron-Core's scheduler and by ours, on
    consecutive global batches of ``samples`` (the remainder dropped), priced by the time model (module docstring).

    Args:
        model: a planner preset name, a ``config.json`` path or a ``ModelSpec`` (``step_time.model_shape``).
        gpu: a machine of the time model (``step_time.MACHINES``); 8 GPUs a node (CP groups above cross nodes).
        params: the time model's parameters; None: the fitted ones (``step_time.FITTED``).
    """
    world = gpus // tp
    if world < 1 or world * tp != gpus or world & (world - 1):
        raise ValueError(f"--gpus {gpus} / --tp {tp}: CP per sample needs a power-of-two DP x CP world; got {gpus / tp}")
    steps = [list(range(s * global_batch_size, (s + 1) * global_batch_size))
             for s in range(len(samples.tokens) // global_batch_size)]
    if not steps:
        raise ValueError(f"--global-batch-size {global_batch_size}: larger than the {len(samples.tokens)} samples")
    pricer = RowPricer.of(model, gpu, tp=tp, params=params)
    works = [sample_work(n, grids) for n, grids in zip(samples.tokens, samples.grids)]
    sizes = [2 ** i for i in range(int(math.log2(world)) + 1)]
    return [_static(c, world, steps, samples, max_tokens_per_rank, pricer, works) for c in sizes] + [
        _per_sample(name, world, steps, samples, max_tokens_per_rank, pricer, works) for name in (MEGATRON, OURS)]


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
        busy = f"{e.imbalance:.3f}" + (f" (steps above 1.05: {e.unbalanced_steps})" if e.unbalanced_steps else "")
        rows.append(f"| {e.name} | {step} | {busy} | {e.peak_tokens:,} | {e.padding:.1%} | {sizes} |")
    return "\n".join(rows)
