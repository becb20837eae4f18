"""``bridge-thd plan --rank``: every way of running the user's lengths that fits, best first (docs/planner.md).

For a model, a lengths file (or the synthetic receipts), the GPUs and a global batch size, the candidates are every
layout (``bshd``, ``thd``, ``thd_static``) with Megatron-Bridge's in-batch placement and with global-batch packing,
at each micro-batch size and each static CP size that divides the world, plus ``thd_static``'s row buckets. Each is
priced by the time model (:mod:`.step_model`) and the memory model (:mod:`.peak_memory`: the largest micro-batch on
a rank) and kept when it fits the GPU; the table lists them by predicted samples per second. With a per-rank token
limit (``--cp-per-sample TOKENS``), CP per sample joins them, placed by Megatron-Core's scheduler and by ours. Every time figure
rests on the fitted parameters (:attr:`~megatron.bridge_thd.cost.step_time.TimeParameters.fitted`) and every
memory figure on the assumed reserve: the table says so above itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron.bridge_thd.plan.balance import balance_plan, micro_batches_per_rank
from megatron.bridge_thd.plan.cp_per_sample import MEGATRON, OURS, compare_cp
from megatron.bridge_thd.plan.estimate import PlanSettings
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.plan.peak_memory import peak_memory_bytes
from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.cost.sample_lengths import SampleLengths

__all__ = ["Candidate", "rank_candidates", "cp_per_sample_candidates", "best_first", "format_candidates"]

GIB = 2**30


@dataclass(frozen=True)
class Candidate:
    """One way of running the step: ``layout``, ``placement`` (``in-batch`` / ``packed``), ``micro_batch_size``,
    ``cp`` (static CP size), ``row_buckets`` (``thd_static`` packed only, else None); the predicted ``step_s`` and
    ``samples_per_s``, the peak memory per GPU ``memory_bytes`` and whether it ``fits``; ``why`` a candidate that
    cannot run does not (then the figures are NaN)."""

    layout: str
    placement: str
    micro_batch_size: int
    cp: int
    row_buckets: int | None
    step_s: float
    samples_per_s: float
    memory_bytes: float
    fits: bool
    why: str = ""


def _settings(base: PlanSettings, micro_batch_size: int, cp: int) -> PlanSettings:
    return replace(base, micro_batch_size=micro_batch_size, parallel=replace(base.parallel, cp=cp))


def rank_candidates(spec: ModelSpec, samples: SampleLengths, base: PlanSettings, global_batch_size: int, *,
                    micro_batch_sizes=(1, 2, 4, 8), row_buckets=(1, 4), cps=None, seed: int = 0) -> list[Candidate]:
    """Every candidate (module docstring), fitting ones first by samples per second, then the ones that do not fit.

    Args:
        base: the setting every candidate varies (GPU, TP, PP, EP, GPUs, seq_length, time parameters).
        cps: static CP sizes to try (default: 1, 2, 4, ... while they divide ``gpus / (tp * pp)``).
    """
    par = base.parallel
    world = par.gpus // (par.tp * par.pp)
    cps = cps or [c for c in (2 ** i for i in range(8)) if c <= world and world % c == 0]
    out = []
    for cp in cps:
        for mbs in micro_batch_sizes:
            settings = _settings(base, mbs, cp)
            try:
                micro_batches_per_rank(global_batch_size, mbs, settings.parallel.dp, len(samples))
            except ValueError as error:
                out.append(Candidate("any", "any", mbs, cp, None, *(float("nan"),) * 3, False, str(error)))
                continue
            for buckets in row_buckets:
                plan = balance_plan(spec, samples, settings, global_batch_size, seed=seed, row_buckets=buckets)
                for layout, placements in plan.layouts.items():
                    for placement, estimate in placements.items():
                        static_packed = layout == "thd_static" and placement == "packed"
                        if buckets != row_buckets[0] and not static_packed:
                            continue  # row buckets change only the packed thd_static rows
                        if estimate.refused:
                            continue
                        slots, patches = estimate.largest_micro_batch
                        memory = peak_memory_bytes(spec, settings.parallel, slots_per_rank=slots / cp,
                                                   patches=patches, micro_batches=plan.num_micro_batches,
                                                   mtp_layers=spec.mtp_num_layers).total
                        out.append(Candidate(layout, placement, mbs, cp, buckets if static_packed else None,
                                             estimate.step_s, estimate.samples_per_s, memory,
                                             memory <= base.gpu.memory_bytes))
    return best_first(out)


def best_first(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting candidates by samples/s, highest first, then the ones that do not fit or cannot run."""
    return sorted(candidates, key=lambda c: (not c.fits, -(c.samples_per_s if c.samples_per_s == c.samples_per_s
                                                            else 0)))


def cp_per_sample_candidates(spec: ModelSpec, samples: SampleLengths, base: PlanSettings, global_batch_size: int,
                             max_tokens_per_rank: int) -> list[Candidate]:
    """CP per sample at ``max_tokens_per_rank`` tokens of a sample per rank, placed by Megatron-Core's scheduler and
    by ours (:func:`~.cp_per_sample.compare_cp`, the same time model): ``cp`` is 0 (per sample), the memory is the
    memory model's for the rank's largest row, counted without its vision activations (the comparison keeps no
    patches per row)."""
    par = base.parallel
    estimates = compare_cp(spec, samples, gpus=par.gpus, tp=par.tp, global_batch_size=global_batch_size,
                           max_tokens_per_rank=max_tokens_per_rank, gpu=base.gpu.name, params=base.time)
    out = []
    for e in (e for e in estimates if e.name in (MEGATRON, OURS)):
        placement = "Megatron-Core's scheduler" if e.name == MEGATRON else "ours (time model)"
        if not e.fits:
            out.append(Candidate("thd", f"CP per sample, {placement}", 1, 0, None, *(float("nan"),) * 3, False,
                                 e.why))
            continue
        memory = peak_memory_bytes(spec, Parallel(tp=par.tp, gpus=par.gpus), slots_per_rank=e.peak_tokens, patches=0,
                                   mtp_layers=spec.mtp_num_layers).total
        out.append(Candidate("thd", f"CP per sample, {placement}", 1, 0, None, e.step_s, global_batch_size / e.step_s,
                             memory, memory <= base.gpu.memory_bytes))
    return out


def format_candidates(candidates: list[Candidate], settings: PlanSettings, *, limit: int = 20) -> str:
    """The candidates as a Markdown table, best first (at most ``limit`` fitting rows, then a count of the rest)."""
    fitting = [c for c in candidates if c.fits]
    lines = [f"Every way that fits {settings.gpu.name} ({settings.gpu.memory_bytes / 1e9:.0f} GB), best first. Step "
             f"times are the time model's ({settings.time.source}; they rest on the fitted "
             f"{', '.join(settings.time.fitted)}); memory is the memory model's, with an assumed reserve "
             "(docs/time-model.md, docs/planner.md): a model's figures, not measurements.", "",
             "| # | layout | placement | MBS | CP | row buckets | step (ms) | samples/s | peak memory (GiB/GPU) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k, c in enumerate(fitting[:limit], 1):
        lines.append(f"| {k} | {c.layout} | {c.placement} | {c.micro_batch_size if c.cp else '-'} | "
                     f"{c.cp or 'per sample'} | "
                     f"{c.row_buckets if c.row_buckets is not None else ''} | {c.step_s * 1e3:,.0f} | "
                     f"{c.samples_per_s:,.1f} | {c.memory_bytes / GIB:.1f} |")
    rest = len(fitting) - limit
    over = [c for c in candidates if not c.fits and not c.why]
    refused = [c for c in candidates if c.why]
    if rest > 0:
        lines.append(f"\n{rest} more fit (slower).")
    if over:
        lines.append(f"\nDo not fit {settings.gpu.name}: " + "; ".join(
            f"{c.layout} {c.placement} MBS {c.micro_batch_size} CP {c.cp} ({c.memory_bytes / GIB:.1f} GiB)"
            for c in over[:8]) + (f"; {len(over) - 8} more" if len(over) > 8 else ""))
    for c in refused:
        lines.append(f"\nMBS {c.micro_batch_size} CP {c.cp}: {c.why}")
    return "\n".join(lines)
