"""``bridge-thd plan --calibrate``: the time model against published GPU measurements (docs/time-model.md).

Prints the parameter table (each value and where it comes from: a published measurement, a spec sheet, or the fit),
the fit table reproduced with the fitted parameters, and every held-out table predicted from them beside the
published figures, each judged against the bar (:data:`~.published.RATIO_BAR`, :data:`~.published.TIME_BAR`); then
PR 3838's memory: the four runs' peak per GPU by the memory model (:mod:`.peak_memory`) against what ran and what
ran out of memory. Every figure printed is a model's figure.
"""

from __future__ import annotations

from megatron.bridge_thd.cost.step_time import FITTED, RateCurve, TimeParameters
from megatron.bridge_thd.plan.published import TABLES, Figure, pr3838_memory

__all__ = ["PARAMETER_SOURCES", "parameter_table", "figures_table", "calibration_report"]

PARAMETER_SOURCES = {
    "attention_forward": "published: cuDNN causal forward, H100 SXM, head dim 128 (FlashAttention-3 paper's figures)",
    "attention_backward": "derived: the cuDNN backward scaled by the forward's causal / non-causal ratio",
    "vision_attention_forward": "published: cuDNN non-causal forward (FlashAttention-3 paper's figures)",
    "vision_attention_backward": "published: cuDNN backward (FlashAttention-3 paper's figures)",
    "gemm_efficiency": "published: H100 SXM bf16 matmul, 789-798 TFLOP/s at 4096^2-8192^2 (of 989)",
    "per_micro_batch_s": "fitted",
    "ring_step_s": "fitted",
    "per_step_s": "fitted",
}


def _values(params: TimeParameters) -> dict[str, RateCurve | float]:
    """Each parameter of :data:`PARAMETER_SOURCES` with its value in ``params``."""
    return {"attention_forward": params.attention_forward, "attention_backward": params.attention_backward,
            "vision_attention_forward": params.vision_attention_forward,
            "vision_attention_backward": params.vision_attention_backward, "gemm_efficiency": params.gemm_efficiency,
            "per_micro_batch_s": params.per_micro_batch_s, "ring_step_s": params.ring_step_s,
            "per_step_s": params.per_step_s}


def _value(value: RateCurve | float, name: str) -> str:
    if isinstance(value, RateCurve):
        return ", ".join(f"{n}: {r / 1e12:.0f}" for n, r in value.points) + " TFLOP/s"
    if name.endswith("_s"):
        return f"{value * 1e3:.3f} ms"
    return f"{value:.2f}"


def parameter_table(params: TimeParameters = FITTED) -> str:
    """The parameters as a Markdown table: name, value, source (``fitted`` names what :mod:`.fit` chose)."""
    rows = ["| parameter | value | source |", "|---|---|---|"]
    values = _values(params)
    for name, source in PARAMETER_SOURCES.items():
        rows.append(f"| `{name}` | {_value(values[name], name)} | "
                    f"{params.source if name in params.fitted else source} |")
    return "\n".join(rows)


def figures_table(figures: list[Figure]) -> str:
    """Published beside predicted, with the error and the verdict against the bar (ratios 15%, named-GPU times
    25%; a time on an unnamed GPU is reported, not judged)."""
    rows = ["| figure | published | predicted | error | within the bar |", "|---|---|---|---|---|"]
    for f in figures:
        fmt = ".0f" if f.unit == "ms" else ".3f"
        verdict = ("yes" if f.within_bar else "**no**") if f.judged else "(not judged: GPU not named)"
        rows.append(f"| {f.label} | {f.published:{fmt}} {f.unit} | {f.predicted:{fmt}} {f.unit} | {f.error:+.1%} | "
                    f"{verdict} |")
    return "\n".join(rows)


def _memory_table() -> str:
    rows = ["| run | on the GPU | predicted peak (GiB per GPU) | predicted |", "|---|---|---|---|"]
    for (layout, mbs), (ran, estimate, capacity) in pr3838_memory().items():
        fits = estimate.fits(capacity)
        verdict = "fits" if fits else "does not fit"
        right = fits == ran
        rows.append(f"| {layout} MBS {mbs} | {'ran' if ran else 'out of memory'} | {estimate.total / 2**30:.1f} | "
                    f"{verdict}{'' if right else ' (**wrong**)'} |")
    return "\n".join(rows)


def calibration_report(params: TimeParameters = FITTED) -> str:
    """Markdown text: the parameters, the fit table, the held-out tables, PR 3838's memory (module docstring)."""
    lines = ["The time model against published GPU measurements (a model's figures; docs/time-model.md)", "",
             f"Parameters ({params.source}):", "", parameter_table(params)]
    for role in ("fit", "held out"):
        for table in (t for t in TABLES.values() if t.role == role):
            lines += ["", f"{'Fit' if role == 'fit' else 'Held out'}: {table.title} ({table.source})", "",
                      f"Stated: {table.setup}.", "", "Assumed: " + "; ".join(table.assumptions) + ".", "",
                      figures_table(table.reproduce(params))]
    lines += ["", "PR 3838's memory (the memory model, plan/peak_memory.py; the same assumed lengths):", "",
              _memory_table()]
    return "\n".join(lines)
