"""Fitting the time model's fitted parameters to the ``fit`` tables only (docs/time-model.md).

The fitted parameters (:attr:`~megatron.bridge_thd.cost.step_time.TimeParameters.fitted`) are chosen to
minimise the squared relative error of the fit tables' absolute step times: ``ring_step_s`` over a grid, and for
each grid point ``per_micro_batch_s`` and ``per_step_s`` by non-negative least squares (a step
time is linear in both: the per-micro-batch cost counts once per row on the slowest rank's path, read off two
evaluations). Held-out tables never enter the fit; :func:`judge` predicts them afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge_thd.cost.step_time import PUBLISHED, TimeParameters
from megatron.bridge_thd.plan.published import TABLES, Figure, PublishedTable

__all__ = ["RING_STEPS", "FitResult", "fit_parameters", "judge", "nonnegative_least_squares"]

RING_STEPS = (0.0, 25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 400e-6, 600e-6, 800e-6, 1.2e-3, 1.6e-3, 2.4e-3, 3.2e-3, 4.8e-3)
_PROBE = 1e-3  # seconds of per_micro_batch_s at which the slope is read


@dataclass(frozen=True)
class FitResult:
    """The fitted parameters, the tables fitted on and the root-mean-square relative error of their absolute times."""

    params: TimeParameters
    tables: tuple[str, ...]
    rms_error: float


def _times(tables: list[PublishedTable], params: TimeParameters) -> list[Figure]:
    return [f for table in tables for f in table.reproduce(params) if f.unit == "ms"]


def nonnegative_least_squares(base: list[float], slope: list[float], target: list[float]) -> tuple[float, float]:
    """``(a, b) >= 0`` minimising ``sum ((base + a * slope + b - target) / target)^2``: the unconstrained solution,
    else the best with one of them at 0."""
    w = [1 / t for t in target]
    r = [(t - b) * wi for t, b, wi in zip(target, base, w)]  # residual to explain, weighted
    x = [s * wi for s, wi in zip(slope, w)]  # column of a
    y = w  # column of b
    sxx, syy, sxy = sum(v * v for v in x), sum(v * v for v in y), sum(u * v for u, v in zip(x, y))
    sxr, syr = sum(u * v for u, v in zip(x, r)), sum(u * v for u, v in zip(y, r))
    det = sxx * syy - sxy * sxy
    candidates = []
    if det > 0:
        a, b = (sxr * syy - syr * sxy) / det, (syr * sxx - sxr * sxy) / det
        if a >= 0 and b >= 0:
            candidates.append((a, b))
    candidates += [(max(0.0, sxr / sxx) if sxx else 0.0, 0.0), (0.0, max(0.0, syr / syy))]

    def loss(ab):
        return sum((ri - ab[0] * xi - ab[1] * yi) ** 2 for ri, xi, yi in zip(r, x, y))

    return min(candidates, key=loss)


def fit_parameters(tables: list[PublishedTable] | None = None, base: TimeParameters = PUBLISHED) -> FitResult:
    """Fit :attr:`TimeParameters.fitted` on ``tables`` (default: every table whose role is ``fit``)."""
    tables = [t for t in TABLES.values() if t.role == "fit"] if tables is None else tables
    best = None
    for ring in RING_STEPS:
        zero = base.with_fit("fit", ring_step_s=ring, per_micro_batch_s=0.0, per_step_s=0.0)
        at_zero = _times(tables, zero)
        probed = _times(tables, zero.with_fit("fit", per_micro_batch_s=_PROBE))
        base_s = [f.predicted / 1e3 for f in at_zero]
        slope = [(p.predicted - f.predicted) / 1e3 / _PROBE for p, f in zip(probed, at_zero)]
        target = [f.published / 1e3 for f in at_zero]
        per_micro_batch, per_step = nonnegative_least_squares(base_s, slope, target)
        predicted = [b + per_micro_batch * s + per_step for b, s in zip(base_s, slope)]
        error = (sum((p / t - 1) ** 2 for p, t in zip(predicted, target)) / len(target)) ** 0.5
        if best is None or error < best[0]:
            best = (error, ring, per_micro_batch, per_step)
    error, ring, per_micro_batch, per_step = best
    names = ", ".join(t.key for t in tables)
    params = base.with_fit(f"fitted on {names}", ring_step_s=ring, per_micro_batch_s=per_micro_batch,
                           per_step_s=per_step)
    return FitResult(params, tuple(t.key for t in tables), error)


def judge(params: TimeParameters, role: str = "held out") -> dict[str, list[Figure]]:
    """Every table of ``role`` reproduced with ``params``: ``{key: figures}``."""
    return {key: table.reproduce(params) for key, table in TABLES.items() if table.role == role}
