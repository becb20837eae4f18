"""``bridge-thd plan --fit-log run.jsonl``: the time model fitted on a user's own run (docs/time-model.md).

A run log (:mod:`megatron.bridge_thd.run_log`, one line per iteration: the iteration time Megatron-Bridge's timers
give, the summed token slots, real tokens, attention work and ViT patches, the parallel sizes) is priced iteration
by iteration with the time model, and the per-step and per-micro-batch fixed costs are fitted to its iteration times
(non-negative least squares on the relative errors, as :mod:`.fit` fits the published table). The command says how
well the model predicted the run before the fit and after it, and can write the fitted parameters as the file
``--time-params`` reads, so a first GPU run calibrates the planner for its own cluster.

The log holds each iteration's sums, not its samples: a rank's share is priced as equal samples of the
length-weighted mean length (``attention_work / real_tokens``) with its share of the padding as slots attention
skips; the vision tower's patches count in its GEMMs, its attention (per frame) is left out. On a CPU run's log the
mechanics hold; its figures mean something only on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron.bridge_thd.cost.step_time import (
    Machine, ModelShape, SampleWork, TimeParameters, model_shape, row_time)
from megatron.bridge_thd.plan.fit import nonnegative_least_squares
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.plan.step_model import sync_seconds

__all__ = ["LogFit", "rank_works", "variable_seconds", "fit_run_log", "format_log_fit"]


@dataclass(frozen=True)
class LogFit:
    """The fit of a run log: ``params`` (the fitted per-step and per-micro-batch costs over ``base``),
    ``iterations`` (how many records had a time), ``measured_s`` / ``before_s`` / ``after_s`` (per iteration: the
    log's time, the model's with ``base``, the model's with ``params``) and their RMS relative errors."""

    params: TimeParameters
    iterations: int
    measured_s: tuple[float, ...]
    before_s: tuple[float, ...]
    after_s: tuple[float, ...]

    @staticmethod
    def _rms(predicted, measured) -> float:
        return (sum((p / m - 1) ** 2 for p, m in zip(predicted, measured)) / len(measured)) ** 0.5

    @property
    def before_error(self) -> float:
        return self._rms(self.before_s, self.measured_s)

    @property
    def after_error(self) -> float:
        return self._rms(self.after_s, self.measured_s)


def rank_works(record) -> list[SampleWork]:
    """One data-parallel rank's share of an iteration as the time model prices it: ``real_tokens / dp`` tokens in
    samples of the length-weighted mean length, ``(token_slots - real_tokens) / dp`` slots of padding that attention
    skips, ``vision_patches / dp`` patches (module docstring)."""
    dp = max(1, record.dp)
    real = record.real_tokens / dp
    works = []
    if real > 0:
        length = max(1, round(record.attention_work / record.real_tokens)) if record.real_tokens else 1
        count = max(1, round(real / length))
        patches = round(record.vision_patches / dp / count)
        works += [SampleWork(length, patches)] * count
    padding = round((record.token_slots - record.real_tokens) / dp)
    if padding > 0:
        works.append(SampleWork(padding, attended=False))
    return works


def variable_seconds(shape: ModelShape, record, machine: Machine, params: TimeParameters) -> float:
    """The model's seconds of an iteration without its fitted fixed costs: the rank's share priced as one row (the
    micro-batches' work summed), times the 1F1B bubble, plus the weight sync."""
    zero = params.with_fit(params.source, per_micro_batch_s=0.0, per_step_s=0.0)
    busy = row_time(shape, rank_works(record), machine, zero, cp=record.cp, tp=record.tp, ep=record.ep).total
    return busy * (1 + (record.pp - 1) / record.micro_batches_per_step)


def fit_run_log(records: Sequence, spec: ModelSpec, machine: Machine, base: TimeParameters,
                source: str = "a run log") -> LogFit:
    """Fit ``per_step_s`` and ``per_micro_batch_s`` on the records with an iteration time (module docstring).

    Raises:
        ValueError: no record has an iteration time.
    """
    timed = [r for r in records if r.iteration_time_s]
    if not timed:
        raise ValueError(f"--fit-log {source}: no iteration has a time (iteration_time_s); log at least one full "
                         "logging interval")
    shape = model_shape(spec)
    base_s, slope, measured = [], [], []
    for r in timed:
        sync = sync_seconds(spec, Parallel(tp=r.tp, cp=r.cp, pp=r.pp, ep=r.ep, gpus=r.tp * r.cp * r.pp * r.dp),
                            machine)
        base_s.append(variable_seconds(shape, r, machine, base) + sync)
        slope.append(float(r.micro_batches_per_step))
        measured.append(float(r.iteration_time_s))
    before = [b + base.per_micro_batch_s * m + base.per_step_s for b, m in zip(base_s, slope)]
    per_micro_batch, per_step = nonnegative_least_squares(base_s, slope, measured)
    params = base.with_fit(f"fitted on {source}", per_micro_batch_s=per_micro_batch, per_step_s=per_step)
    after = [b + per_micro_batch * m + per_step for b, m in zip(base_s, slope)]
    return LogFit(params, len(timed), tuple(measured), tuple(before), tuple(after))


def format_log_fit(fit: LogFit) -> str:
    """What ``--fit-log`` prints: the iterations fitted, the errors before and after, the fitted values."""
    mean = sum(fit.measured_s) / len(fit.measured_s)
    return "\n".join([
        f"Fitted on {fit.iterations} timed iteration(s) (mean {mean * 1e3:,.1f} ms). RMS error of the time model's "
        f"prediction of them: {fit.before_error:.1%} with the parameters it had, {fit.after_error:.1%} with "
        "per_step_s and per_micro_batch_s fitted on them.",
        f"Fitted: per_step_s {fit.params.per_step_s * 1e3:.3f} ms, per_micro_batch_s "
        f"{fit.params.per_micro_batch_s * 1e3:.3f} ms; the rates, GEMM efficiency and ring step are kept "
        "(benchmarks/gpu_calibrate.py measures them).",
    ])
