"""The ``packing/*`` figures of a CPU run, read back from its real TensorBoard event files and plotted
(docs/packing-logs.md): Megatron-Bridge's ``finetune()`` at DP=2 on the tiny Qwen3-VL (``bridge_thd_testbed.training``)
with our ``thd`` step, with ``thd_static`` and global-batch packing, and with Megatron-Bridge's own step (its
event file has no ``packing/*``: its padded rows are the ``packing/padded_slots_per_iteration`` our runs log for the
same micro-batches, and its own logging counts ``global_batch_size x seq_length`` per iteration).

Writes ``benchmarks/results/packing_logs.json`` and ``docs/packing-logs.png``.

    .venv/bin/python benchmarks/packing_logs_plot.py [--iterations 6]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "packing_logs.json"
FIGURE = ROOT / "docs" / "packing-logs.png"
RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"
MICRO_BATCH, GLOBAL_BATCH, SEQ_LENGTH = 2, 8, 512
RUNS = {"megatron_bridge": ("megatron_bridge", None), "thd": ("thd", None),
        "thd_static_global": ("thd_static", dict(cost_model="qwen3-vl-8b"))}


def _scalars(folder: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(folder, size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: {int(e.step): float(e.value) for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}


def measure(iterations: int) -> dict:
    from megatron.bridge_thd_testbed.training import run_on_cpu

    workdir = tempfile.mkdtemp(prefix="bridge_thd_packing_logs_")
    common = dict(train_iters=iterations, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                  seq_length=SEQ_LENGTH, eval_iters=0, checkpoint=False, tensorboard=True, num_workers=0)
    runs = [(key, RECIPE, layout, dict(common, run_name=f"packing-{key}",
                                       **({} if placement is None else dict(global_batch_packing=placement))))
            for key, (layout, placement) in RUNS.items()]
    run_on_cpu(runs, workdir=workdir, world_size=2, timeout=900)
    figures = {key: _scalars(os.path.join(workdir, "tensorboard", f"packing-{key}")) for key in RUNS}
    packing = {key: {tag: values for tag, values in scalars.items()
                     if tag.startswith("packing/") or tag == "iteration-time"} for key, scalars in figures.items()}
    return {"recipe": RECIPE, "dp": 2, "micro_batch_size": MICRO_BATCH, "global_batch_size": GLOBAL_BATCH,
            "seq_length": SEQ_LENGTH, "iterations": iterations, "packing": packing,
            "megatron_bridge_tags": sorted(figures["megatron_bridge"])}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    thd, static = results["packing"]["thd"], results["packing"]["thd_static_global"]
    own = results["packing"]["megatron_bridge"]
    steps = sorted(thd["packing/token_slots_per_iteration"])
    counted = results["global_batch_size"] * results["seq_length"]
    figure, (tokens, times) = plt.subplots(1, 2, figsize=(11, 4))
    tokens.plot(steps, [counted] * len(steps), "k--", label="Megatron-Bridge's count (global batch x seq_length)")
    tokens.plot(steps, [thd["packing/padded_slots_per_iteration"][s] for s in steps], "o-",
                label="Megatron-Bridge's padded step: token slots")
    tokens.plot(steps, [thd["packing/token_slots_per_iteration"][s] for s in steps], "s-", label="thd: token slots")
    tokens.plot(steps, [static["packing/token_slots_per_iteration"][s] for s in steps], "^-",
                label="thd_static + global-batch packing: token slots")
    tokens.plot(steps, [thd["packing/real_tokens_per_iteration"][s] for s in steps], "x:", label="real tokens")
    tokens.set_xlabel("iteration")
    tokens.set_ylabel("tokens per iteration, DP-summed (axis not from 0)")
    tokens.set_title("packing/* read back from the event files", fontsize=10)
    tokens.legend(fontsize=7, loc="lower left")
    later = steps[1:]  # iteration 1 carries the start-up
    for label, run, tag, style in (("Megatron-Bridge's step: iteration-time", own, "iteration-time", "o-"),
                                   ("thd: packing/iteration_time", thd, "packing/iteration_time", "s-"),
                                   ("thd_static + global-batch packing: packing/iteration_time", static,
                                    "packing/iteration_time", "^-")):
        if tag in run:
            times.plot(later, [run[tag][s] for s in later], style, label=label)
    times.set_xticks(later)
    times.set_xlabel("iteration")
    times.set_ylabel("seconds (CPU, 2 cores: not a GPU speed)")
    times.set_ylim(bottom=0)
    times.set_title("iteration time, from the same event files", fontsize=10)
    times.legend(fontsize=7, loc="lower left")
    figure.suptitle(f"tiny Qwen3-VL, cord_v2, DP=2, micro-batch {results['micro_batch_size']}, global batch "
                    f"{results['global_batch_size']}, seq_length {results['seq_length']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--plot-only", action="store_true", help="re-render the figure from the committed results")
    args = parser.parse_args(argv)
    if args.plot_only:
        results = json.loads(RESULTS.read_text())
    else:
        results = measure(args.iterations)
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    plot(results, FIGURE)
    print(f"wrote {FIGURE.relative_to(ROOT)} and {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
