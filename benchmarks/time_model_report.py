"""The time model against published GPU measurements (docs/time-model.md): the fit, the held-out tables predicted
beside published, and how much each held-out table's unstated assumptions move its prediction.

The fit is re-run here (``plan.fit.fit_parameters`` on the fit tables) and compared with the stored parameters
(``batching.step_time.FITTED``); the held-out tables are reproduced from the stored ones. No timing is measured: every
predicted figure is the time model's. The values go to ``benchmarks/results/time_model.json``; the docs block
``time-model-sensitivity`` is rendered from it by :func:`render` (``scripts/readme_figures.py``).

    .venv/bin/python benchmarks/time_model_report.py [--json PATH]
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "time_model.json"


def measure() -> dict:
    from megatron.bridge_thd.cost.step_time import FITTED
    from megatron.bridge_thd.plan.fit import fit_parameters
    from megatron.bridge_thd.plan.published import SENSITIVITY, TABLES, reproduce_with

    fit = fit_parameters()
    stored = {name: getattr(FITTED, name) for name in FITTED.fitted}
    refit = {name: getattr(fit.params, name) for name in FITTED.fitted}
    tables = {key: dict(role=t.role, title=t.title, figures=[dataclasses.asdict(f) for f in t.reproduce(FITTED)])
              for key, t in TABLES.items()}
    sensitivity = []
    for key, assumption, values in SENSITIVITY:
        rows = {label: [dataclasses.asdict(f) for f in reproduce_with(key, FITTED, **kwargs)]
                for label, kwargs in values.items()}
        sensitivity.append(dict(table=key, assumption=assumption, rows=rows))
    return dict(fitted=stored, refit=refit, fit_rms=fit.rms_error, source=FITTED.source, tables=tables,
                sensitivity=sensitivity)


def render(results: dict) -> str:
    lines = [f"Stored fitted parameters ({results['source']}): " + ", ".join(
        f"`{k}` {v * 1e3:.3f} ms" for k, v in results["fitted"].items()) + f"; the fit re-run here: RMS error of the fit "
        f"table's step times {results['fit_rms']:.1%}" + (
            "" if all(abs(results["refit"][k] - v) <= 1e-9 + 1e-9 * abs(v) for k, v in results["fitted"].items())
            else " (**differs from the stored values: update step_time.FITTED**)") + ".", ""]
    for entry in results["sensitivity"]:
        labels = [f["label"] for f in next(iter(entry["rows"].values())) if f["judged"]]
        lines += [f"**{results['tables'][entry['table']]['title']}**, by {entry['assumption']} (predicted; "
                  "published in the header):", "",
                  "| " + entry["assumption"] + " | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        published = [f for f in next(iter(entry["rows"].values())) if f["judged"]]
        lines.append("| published | " + " | ".join(
            f"{f['published']:.0f} ms" if f["unit"] == "ms" else f"{f['published']:.3f}" for f in published) + " |")
        for label, figures in entry["rows"].items():
            cells = [f"{f['predicted']:.0f} ms ({f['predicted'] / f['published'] - 1:+.0%})" if f["unit"] == "ms"
                     else f"{f['predicted']:.3f} ({f['predicted'] / f['published'] - 1:+.1%})"
                     for f in figures if f["judged"]]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> None:
    from _tables import report_main

    report_main(__doc__, RESULTS, measure, render, argv)


if __name__ == "__main__":
    main()
