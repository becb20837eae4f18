"""Figures of Megatron-Bridge's own training loop on the CPU (``testbed.training.training_loop_runs``,
the runs ``tests/test_bridge_training.py`` checks): per-iteration losses of Megatron-Bridge's step,
``thd`` (stopped at iteration 10 and resumed from the checkpoint) and ``thd_static`` at DP=2; the
largest relative difference; the resume check; the tokens and FLOPs the trainer logged; PP=2 vs CP=2.

Writes ``benchmarks/results/training_loop.json`` and prints the tables (docs/megatron-bridge-on-cpu.md).

    .venv/bin/python benchmarks/training_loop_report.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "training_loop.json"


def measure() -> dict:
    from megatron.bridge_thd.testbed.training import run_on_cpu, training_loop_runs

    ranks = run_on_cpu(training_loop_runs(), workdir=tempfile.mkdtemp(prefix="bridge_thd_loop_"), world_size=2)
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
    return {
        "iterations": rows,
        "resumed_first_iteration": rank0["thd_resumed"]["iterations"][0]["iteration"],
        "pp2": column("pp2", "loss", last),
        "cp2": column("cp2", "loss"),
    }


def render(results: dict) -> str:
    rows = results["iterations"]
    worst = max(max(abs(r["thd"] - r["megatron_bridge"]), abs(r["thd_static"] - r["megatron_bridge"])) / abs(r["megatron_bridge"])
                for r in rows)
    lines = ["| iteration | Megatron-Bridge step | thd | thd_static | tokens logged (MB / thd, rank 0) | model GFLOP (MB / thd) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['iteration']} | {r['megatron_bridge']:.6f} | {r['thd']:.6f} | {r['thd_static']:.6f} | "
                     f"{r['tokens_megatron_bridge']} / {r['tokens_thd']} | "
                     f"{r['flops_megatron_bridge'] / 1e9:.1f} / {r['flops_thd'] / 1e9:.1f} |")
    eleven = rows[10]
    lines += ["", f"Largest relative loss difference to Megatron-Bridge's step over {len(rows)} iterations: {worst:.2e}.",
              f"thd resumed from its iteration-10 checkpoint at iteration {results['resumed_first_iteration']}: "
              f"loss {eleven['thd']:.6f} (uninterrupted: Megatron-Bridge's step {eleven['megatron_bridge']:.6f}, "
              f"thd_static {eleven['thd_static']:.6f}).",
              "PP=2 vs CP=2 (same two ranks): " + ", ".join(f"{a:.6f} / {b:.6f}" for a, b in zip(results["pp2"], results["cp2"]))]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = measure()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(render(results))
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
