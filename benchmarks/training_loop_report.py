"""Figures of Megatron-Bridge's own training loop on the CPU (``bridge_thd_testbed.training.training_loop_runs``,
the runs ``tests/bridge/test_training.py`` checks): per-iteration losses of Megatron-Bridge's step,
``thd`` (stopped at iteration 10 and resumed from the checkpoint) and ``thd_static`` at DP=2; the
largest relative difference; the resume check; the tokens and FLOPs the trainer logged; PP=2 vs CP=2.

Writes ``benchmarks/results/training_loop.json`` and prints the tables (docs/megatron-bridge-on-cpu.md).

``--model qwen35``: the same for Megatron-Bridge's Qwen3.5-VL 2B recipe on the tiny hybrid Gated DeltaNet +
attention model (``bridge_thd_testbed.training.qwen35_training_runs``, the runs ``tests/bridge/test_training_qwen35.py``
checks: 6 iterations, ``thd`` stopped at 3 and resumed; no PP / CP runs), written to
``benchmarks/results/training_loop_qwen35.json``, with the check of the Hugging Face conversion.

    .venv/bin/python benchmarks/training_loop_report.py [--model qwen35]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "training_loop.json"
RESULTS_QWEN35 = ROOT / "benchmarks" / "results" / "training_loop_qwen35.json"


def measure(model: str = "qwen3-vl") -> dict:
    from megatron.bridge_thd_testbed.training import qwen35_training_runs, run_on_cpu, training_loop_runs

    runs = qwen35_training_runs() if model == "qwen35" else training_loop_runs()
    ranks = run_on_cpu(runs, workdir=tempfile.mkdtemp(prefix="bridge_thd_loop_"), world_size=2)
    rank0, last = ranks[0], ranks[-1]

    def column(name, key, rank=rank0):
        return [row[key] for row in rank[name]["iterations"]]

    thd = {key: column("thd_first", key) + column("thd_resumed", key) for key in ("loss", "flops", "flops_tokens")}
    rows = []
    for i, (theirs, static) in enumerate(zip(column("megatron_bridge", "loss"), column("thd_static", "loss"))):
        rows.append({"iteration": i + 1, "megatron_bridge": theirs, "thd": thd["loss"][i], "thd_static": static,
                     "tokens_megatron_bridge": column("megatron_bridge", "flops_tokens")[i],
                     "tokens_thd": thd["flops_tokens"][i],
                     "flops_megatron_bridge": column("megatron_bridge", "flops")[i], "flops_thd": thd["flops"][i]})
    results = {
        "model": model,
        "iterations": rows,
        "resumed_first_iteration": rank0["thd_resumed"]["iterations"][0]["iteration"],
    }
    if model == "qwen35":
        results["pretrained_load"] = rank0["megatron_bridge"]["pretrained_load"]
    else:
        results.update(pp2=column("pp2", "loss", last), cp2=column("cp2", "loss"))
    return results


def render(results: dict) -> str:
    rows = results["iterations"]

    def relative(r, name):
        return abs(r[name] - r["megatron_bridge"]) / abs(r["megatron_bridge"])

    worst = max(max(relative(r, "thd"), relative(r, "thd_static")) for r in rows)
    lines = ["| iteration | Megatron-Bridge step | thd | thd_static | tokens logged (MB / thd, rank 0) | model GFLOP (MB / thd) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['iteration']} | {r['megatron_bridge']:.6f} | {r['thd']:.6f} | {r['thd_static']:.6f} | "
                     f"{r['tokens_megatron_bridge']} / {r['tokens_thd']} | "
                     f"{r['flops_megatron_bridge'] / 1e9:.1f} / {r['flops_thd'] / 1e9:.1f} |")
    resumed = results["resumed_first_iteration"]
    first = rows[resumed - 1]
    per_iteration = ("; per iteration, thd / thd_static: " + ", ".join(
        f"{relative(r, 'thd'):.1e} / {relative(r, 'thd_static'):.1e}" for r in rows)) if len(rows) <= 10 else ""
    lines += ["", f"Largest relative loss difference to Megatron-Bridge's step over {len(rows)} iterations: {worst:.2e}"
              f"{per_iteration}.",
              f"thd resumed from its iteration-{resumed - 1} checkpoint at iteration {resumed}: "
              f"loss {first['thd']:.6f} (uninterrupted: Megatron-Bridge's step {first['megatron_bridge']:.6f}, "
              f"thd_static {first['thd_static']:.6f})."]
    if "pp2" in results:
        lines.append("PP=2 vs CP=2 (same two ranks): "
                     + ", ".join(f"{a:.6f} / {b:.6f}" for a, b in zip(results["pp2"], results["cp2"])))
    if results.get("pretrained_load"):
        check = results["pretrained_load"]
        lines.append(f"Hugging Face conversion: layers {', '.join(check['layers'])}; {check['tensors']} checkpoint tensors "
                     f"into {check['parameters']} parameters, {len(check['unmapped_parameters'])} parameters unmapped, "
                     f"{len(check['unused_tensors'])} tensors unused, exported back with largest difference "
                     f"{check['max_abs_diff']:.1e}.")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("qwen3-vl", "qwen35"), default="qwen3-vl",
                        help="qwen3-vl: the Qwen3-VL 8B recipe's runs (default); qwen35: the Qwen3.5-VL 2B recipe's")
    parser.add_argument("--json", type=Path, default=None,
                        help="default benchmarks/results/training_loop.json (qwen35: training_loop_qwen35.json)")
    args = parser.parse_args(argv)
    args.json = args.json or (RESULTS_QWEN35 if args.model == "qwen35" else RESULTS)
    results = measure(args.model)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(render(results))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
