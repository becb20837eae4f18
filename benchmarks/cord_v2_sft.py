"""cord_v2 SFT through Megatron-Bridge's own recipe and ``finetune()``: Megatron-Bridge's step (padded)
vs ours (``thd``, ``thd_static``, each with Megatron-Bridge's in-batch placement and with global-batch
packing), MBS 2 and 4, in the shape of Megatron-Bridge PR 3838's table.

``--recipe qwen3-vl-8b`` (default): Megatron-Bridge's Qwen3-VL 8B SFT recipe. ``--recipe qwen35-vl-2b``:
its Qwen3.5-VL 2B SFT recipe (Gated DeltaNet + attention), PR 3838's own configuration: on GPUs 8 ranks,
seq_length 2048, global batch 8 x MBS (16 at MBS 2, 32 at MBS 4), one micro-batch per rank and step; its
table puts PR 3838's published figures (theirs, 8xH100) beside ours (:data:`PR3838`).

Global-batch packing (docs/batching.md) rows: ``configure(..., global_batch_packing=GlobalBatchPacking(...))``
with ``--global-batch-cost`` (default ``tokens``: ``GlobalBatchPacking()``'s own default cost), which turns on
per-token loss normalisation (the runs set ``ddp.average_in_collective=False``, as a user must); the recipe's
``single`` data loader is what it draws from. ``thd_static`` then runs the row (and up to 3 shorter ones)
chosen from the run's draws instead of ``micro_batch_size * seq_length``.

Per run: ms/iter (median after the warm-up iterations), samples/s, real tokens/s (the collate's 2D
mask), model TFLOP/s per GPU as Megatron-Bridge's trainer counts them (its FLOPs accounting divided
by the step time), peak memory, and out of memory. Writes ``--out``/cord_v2_sft.json, a Markdown
table (.md) and a PNG. docs/cord-v2-benchmark.md.

CPU (tiny Qwen3-VL or Qwen3.5-VL, local cord_v2-shaped data, DP=2 over gloo; ``make bench``, and a smoke
in ``make test``)::

    .venv/bin/python benchmarks/cord_v2_sft.py --cpu-tiny [--recipe qwen35-vl-2b] [--iterations 6 --warmup 2]

8xH100 (the recipe as shipped, one ``torchrun`` per row; Transformer Engine, hub access; for Qwen3.5-VL
also Megatron-Core >= 0.18 and flash-linear-attention)::

    python benchmarks/cord_v2_sft.py --gpu --nproc 8 --iterations 30 --warmup 10 --seq-length 2048
    python benchmarks/cord_v2_sft.py --gpu --recipe qwen35-vl-2b --iterations 30 --warmup 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RECIPE_SCRIPT = ROOT / "recipes" / "qwen3_vl_8b_cord_v2_thd.py"
RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"
# --recipe: Megatron-Bridge's recipe function, our recipe script, the results' file stem, the tiny model of the
# CPU mode, and (GPU) PR 3838's shape where the harness follows it: seq_length, ranks, global batch per MBS.
RECIPES = {
    "qwen3-vl-8b": dict(function=RECIPE, script=RECIPE_SCRIPT, stem="cord_v2_sft", tiny="tiny Qwen3-VL",
                        gpu_seq_length=None, gpu_nproc=None, gpu_global_batch_per_rank=None),
    "qwen35-vl-2b": dict(function="qwen35_vl_2b_sft_1gpu_h100_bf16_config",
                         script=ROOT / "recipes" / "qwen35_vl_2b_cord_v2_thd.py", stem="cord_v2_sft_qwen35",
                         tiny="tiny Qwen3.5-VL", gpu_seq_length=2048, gpu_nproc=8, gpu_global_batch_per_rank=1),
}
# Megatron-Bridge PR 3838 ("[model, perf] feat: real THD packing in qwen3_vl_step", closed unmerged), as its
# commit message and description state them (commit a7079c48287edba1f4b6f0c65d352d46590ada95, branch
# chcui/qwen3vl-step-thd-packing): "Qwen3.5-VL 2B SFT (cord_v2, 1 node x 8 H100, seq_length=2048, mcore main @
# d167123d incl. NVIDIA/Megatron-LM#2645 GDN packed-seq)"; rows "MBS=2 GBS=16, force-pad to seq_length" and
# "MBS=4 GBS=32, force-pad to seq_length"; columns "PACK=0 (BSHD)" and "PACK=1 (THD)"; "Loss curves match
# within bf16 noise"; "+44% samples/sec at MBS=4 vs the best BSHD-fit configuration". It names no TP / PP / EP:
# the Qwen3.5-VL 2B SFT recipe of its base commit sets TP=1, PP=1 (so DP=8 on 8 GPUs) and MTP 1 layer.
# Their figures, GPU, not measured here; samples/s below are derived from them (GBS / ms per iteration).
PR3838 = {
    "source": "NVIDIA-NeMo/Megatron-Bridge PR 3838 (commit a7079c48287e), published figures",
    "setting": "Qwen3.5-VL 2B SFT, cord_v2, 1 node x 8 H100, seq_length 2048, mcore main @ d167123d",
    "rows": {2: {"global_batch_size": 16, "padded_ms": 363.0, "thd_ms": 342.0},
             4: {"global_batch_size": 32, "padded_ms": None, "thd_ms": 505.0}},  # None: out of memory
    "claim": "+44% samples/s at MBS 4 (THD) over the best BSHD-fit configuration (MBS 2)",
}
STEPS = ("megatron_bridge", "thd", "thd_static", "thd_global", "thd_static_global")
STEP_LABELS = {"megatron_bridge": "Megatron-Bridge qwen3_vl_step (padded)", "thd": "ours, thd", "thd_static": "ours, thd_static",
               "thd_global": "ours, thd + global-batch packing",
               "thd_static_global": "ours, thd_static + global-batch packing"}
# Each row's step: (layout, or "megatron_bridge" for Megatron-Bridge's own; global-batch packing on).
STEP_RUNS = {"megatron_bridge": ("megatron_bridge", False), "thd": ("thd", False), "thd_static": ("thd_static", False),
             "thd_global": ("thd", True), "thd_static_global": ("thd_static", True)}


def summarise(rows_per_rank: list[list[dict]], counts_per_rank: list[list[dict]] | None, *, warmup: int,
              global_batch_size: int, world_size: int, oom: bool = False) -> dict:
    """One table row from the per-iteration records of every rank (``bridge_thd_testbed.training`` recorder).

    ``rows_per_rank[r][i]``: rank r's record of iteration i (the loss only on the last PP stage);
    ``counts_per_rank[r]``: rank r's micro-batches in order (real tokens), or None where not counted.
    """
    if oom or not rows_per_rank or not rows_per_rank[0]:
        return {"oom": True}
    measured = slice(warmup, None)
    seconds = [max(rank[i]["seconds"] for rank in rows_per_rank) for i in range(len(rows_per_rank[0]))][measured]
    if not seconds:
        raise ValueError(f"--warmup {warmup}: no iteration left to measure; run more iterations")
    median = statistics.median(seconds)
    flops = [row["flops"] for row in rows_per_rank[0]][measured]
    row = {
        "oom": False,
        "iterations_measured": len(seconds),
        "ms_per_iter": median * 1000.0,
        "samples_per_s": global_batch_size / median,
        "tflops_per_gpu": statistics.median(f / s for f, s in zip(flops, seconds)) / world_size / 1e12,
        "peak_memory_gib": max(rank[-1]["peak_memory_bytes"] for rank in rows_per_rank) / 2**30,
        "final_loss": next((r[-1]["loss"] for r in reversed(rows_per_rank) if r[-1]["loss"] is not None), None),
    }
    if counts_per_rank:
        counts_per_rank = [[c for c in rank if c.get("training", True)] for rank in counts_per_rank]
        iterations = len(rows_per_rank[0])
        per_iteration = [len(counts) // iterations for counts in counts_per_rank]
        tokens = [sum(c["real_tokens"] for rank, n in zip(counts_per_rank, per_iteration)
                      for c in rank[i * n:(i + 1) * n] if c["counted"]) for i in range(iterations)][measured]
        row["real_tokens_per_s"] = sum(tokens) / sum(seconds)
    return row


_STEP_LINE = re.compile(r"\(train\): step (\d+): real tokens (\d+) in (\d+) slots \(padding [\d.]+%\); per-rank cost "
                        r"max/mean ([\d.]+) \(in-batch placement of the same samples: ([\d.]+)\)")
_ROWS_LINE = re.compile(r"thd_static rows for the run: ([\d, ]+) slots")


def placement_summary(lines: list[str], iterations: int) -> dict | None:
    """What global-batch packing logged on global rank 0 (``batching.sampler``, ``batching.bridge``) for the
    training steps ``1..iterations`` (the loader's prefetch past them left out): slots, real tokens, mean
    per-rank cost max / mean, the same for Megatron-Bridge's placement of the same samples, and the
    ``thd_static`` rows. None without such lines."""
    steps = {}
    for line in lines:
        match = _STEP_LINE.search(line)
        if match and int(match.group(1)) <= iterations:
            steps[int(match.group(1))] = [float(v) for v in match.groups()[1:]]
    if not steps:
        return None
    real, slots = sum(v[0] for v in steps.values()), sum(v[1] for v in steps.values())
    rows = next((m.group(1) for m in map(_ROWS_LINE.search, lines) if m), None)
    return {"steps": len(steps), "real_tokens": int(real), "slots": int(slots), "padding": 1 - real / slots,
            "rank_imbalance": statistics.mean(v[2] for v in steps.values()),
            "in_batch_rank_imbalance": statistics.mean(v[3] for v in steps.values()),
            "row_lengths": None if rows is None else [int(n) for n in rows.split(",")]}


def _theirs(step: str, mbs: int) -> str:
    """PR 3838's published ms/iter for a row of ours (their padded run beside Megatron-Bridge's step, their THD
    run beside our ``thd``; blank where they published nothing comparable)."""
    published = PR3838["rows"].get(mbs)
    if published is None or step not in ("megatron_bridge", "thd"):
        return ""
    value = published["padded_ms" if step == "megatron_bridge" else "thd_ms"]
    return "OOM" if value is None else f"{value:.0f}"


def render_pr3838() -> list[str]:
    """PR 3838's table as published (theirs), with the samples/s its ms/iter and global batch give."""
    rows = PR3838["rows"]
    lines = [f"Megatron-Bridge PR 3838's published figures (theirs: {PR3838['setting']}; GPU, not measured here; "
             "samples/s derived as global batch / ms per iteration):", "",
             "| MBS | global batch | padded (PACK=0, BSHD) ms/iter | THD (PACK=1) ms/iter | padded samples/s | "
             "THD samples/s |", "|---|---|---|---|---|---|"]
    rates = {}
    for mbs, r in rows.items():
        padded = None if r["padded_ms"] is None else r["global_batch_size"] / (r["padded_ms"] / 1000)
        thd = r["global_batch_size"] / (r["thd_ms"] / 1000)
        rates[mbs] = (padded, thd)
        padded_ms, padded_rate = ("OOM", "OOM") if padded is None else (f"{r['padded_ms']:.0f}", f"{padded:.1f}")
        lines.append(f"| {mbs} | {r['global_batch_size']} | {padded_ms} | {r['thd_ms']:.0f} | {padded_rate} | {thd:.1f} |")
    best_padded = max(p for p, _ in rates.values() if p is not None)
    best_thd = max(t for _, t in rates.values())
    lines += ["", f"Best THD row over the best padded row: {best_thd:.1f} / {best_padded:.1f} samples/s = "
              f"+{best_thd / best_padded - 1:.0%} (their claim: {PR3838['claim']})."]
    return lines


def render(results: dict) -> str:
    """The Markdown table of a results file."""
    theirs = results.get("recipe_key") == "qwen35-vl-2b"  # PR 3838's own configuration: their figures beside ours
    gbs = results["global_batch_size"]
    gbs = (", ".join(f"{g} at MBS {m}" for m, g in gbs.items()) if isinstance(gbs, dict) else gbs)
    lines = [
        f"{results['device']}; recipe `{results['recipe']}`, seq_length {results['seq_length']}, "
        f"global batch {gbs}, {results['world_size']} ranks, "
        f"median of {results['iterations'] - results['warmup']} iterations after {results['warmup']} warm-up.",
        "",
        "| MBS | step | ms/iter | samples/s | real tokens/s | TFLOP/s/GPU | peak memory (GiB) | vs padded |"
        + (" PR 3838 ms/iter (theirs, 8xH100) |" if theirs else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if theirs else ""),
    ]
    for mbs in results["micro_batch_sizes"]:
        baseline = results["rows"].get(f"megatron_bridge-mbs{mbs}", {})
        for step in STEPS:
            row = results["rows"].get(f"{step}-mbs{mbs}")
            if row is None:
                continue
            extra = f" {_theirs(step, mbs)} |" if theirs else ""
            if row.get("oom"):
                lines.append(f"| {mbs} | {STEP_LABELS[step]} | OOM | | | | | |" + extra)
                continue
            speedup = (f"{baseline['ms_per_iter'] / row['ms_per_iter']:.2f}x" if baseline and not baseline.get("oom")
                       else "baseline OOM")
            tokens = f"{row['real_tokens_per_s']:.0f}" if "real_tokens_per_s" in row else ""
            lines.append(f"| {mbs} | {STEP_LABELS[step]} | {row['ms_per_iter']:.1f} | {row['samples_per_s']:.2f} | "
                         f"{tokens} | {row['tflops_per_gpu']:.6f} | {row['peak_memory_gib']:.2f} | {speedup} |" + extra)
    placed = [(mbs, step, results["rows"][f"{step}-mbs{mbs}"]["placement"]) for mbs in results["micro_batch_sizes"]
              for step in STEPS if results["rows"].get(f"{step}-mbs{mbs}", {}).get("placement")]
    if placed:
        cost = results.get("global_batch_cost", "tokens")
        lines += ["", f"Global-batch packing (cost: {'s + s^2/24576, its default' if cost == 'tokens' else cost}; "
                  "per-token loss normalisation), as rank 0 logged it over the training steps:"]
        for mbs, step, p in placed:
            rows, in_batch = "", ""
            if p["row_lengths"]:  # thd_static: Megatron-Bridge's placement pads every micro-batch to mbs * seq_length
                rows = f"rows {', '.join(map(str, p['row_lengths']))} slots; "
                in_batch = (f", {1 - p['real_tokens'] / (p['steps'] * results['global_batch_size'] * results['seq_length']):.1%} "
                            "in Megatron-Bridge's placement")
            lines.append(f"* MBS {mbs}, {STEP_LABELS[step]}: {rows}{p['real_tokens']} real tokens in {p['slots']} slots "
                         f"(padding {p['padding']:.1%}{in_batch}); per-rank cost max/mean {p['rank_imbalance']:.3f} "
                         f"(Megatron-Bridge's placement of the same samples: {p['in_batch_rank_imbalance']:.3f}), mean over "
                         f"{p['steps']} steps.")
    if results["device"].startswith("CPU"):
        lines += ["", "CPU: peak memory is the process's maximum resident set so far, and the runs share two "
                  "processes in order, so it only grows down the table; timings of a tiny model on two cores, "
                  "not a GPU figure (on a shared machine a row's ms/iter moves by tens of percent between runs)."]
    if theirs:
        lines += ["", "The column \"PR 3838 ms/iter (theirs, 8xH100)\" is Megatron-Bridge PR 3838's published figure for "
                  "the same recipe, data set and MBS (their padded run beside Megatron-Bridge's step, their THD run "
                  "beside ours): theirs, the real 2B model in bf16 on 8 H100s at seq_length 2048"
                  + (", not comparable with this CPU run of a tiny model in fp32 (it is there for the table's shape "
                     "only)." if results["device"].startswith("CPU") else
                     "; the same shape as this run, but their software (Megatron-Core main @ d167123d, their step) "
                     "is not this run's."), ""] + render_pr3838()
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """ms/iter per step and MBS (bars; OOM marked), as in PR 3838's comparison."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [step for step in STEPS if any(f"{step}-mbs{mbs}" in results["rows"] for mbs in results["micro_batch_sizes"])]
    theirs = results.get("recipe_key") == "qwen35-vl-2b"
    if theirs:  # PR 3838's published GPU figures in a panel of their own: not on our axis
        fig, (ax, ax_theirs) = plt.subplots(1, 2, figsize=(13, 3.8), gridspec_kw={"width_ratios": [3, 1]})
        for position, (mbs, published) in enumerate(PR3838["rows"].items()):
            for offset, (key, label, color) in enumerate((("padded_ms", "padded (BSHD)", "C0"),
                                                          ("thd_ms", "THD", "C1"))):
                x = position + (offset - 0.5) * 0.4
                if published[key] is None:
                    ax_theirs.text(x, 0, "OOM", ha="center", va="bottom", rotation=90)
                else:
                    ax_theirs.bar(x, published[key], 0.4, color=color, hatch="//",
                                  label=label if position == 0 else None)
        ax_theirs.set_xticks(range(len(PR3838["rows"])), [f"MBS {m}" for m in PR3838["rows"]])
        ax_theirs.set_ylabel("ms / iteration")
        ax_theirs.set_title("PR 3838, theirs: 8xH100, Qwen3.5-VL 2B", fontsize=9)
        ax_theirs.legend(fontsize=8)
    else:
        fig, ax = plt.subplots(figsize=(10, 3.8))
    width = 0.8 / len(steps)
    for index, step in enumerate(steps):
        for position, mbs in enumerate(results["micro_batch_sizes"]):
            row = results["rows"].get(f"{step}-mbs{mbs}", {"oom": True})
            x = position + (index - (len(steps) - 1) / 2) * width
            if row.get("oom"):
                ax.text(x, 0, "OOM", ha="center", va="bottom", rotation=90)
                continue
            ax.bar(x, row["ms_per_iter"], width, color=f"C{index}", label=STEP_LABELS[step] if position == 0 else None)
    ax.set_xticks(range(len(results["micro_batch_sizes"])), [f"MBS {m}" for m in results["micro_batch_sizes"]])
    ax.set_ylabel("ms / iteration (median)")
    ax.set_title(f"cord_v2 SFT, {results['device']}" + (" (ours)" if theirs else ""), fontsize=9 if theirs else None)
    ax.legend(fontsize=8 if not theirs else 7, loc="upper left" if not theirs else "best",
              bbox_to_anchor=(1.01, 1.0) if not theirs else None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure_cpu(args) -> dict:
    from megatron.bridge_thd_testbed.training import run_on_cpu

    recipe = RECIPES[args.recipe]
    runs = []
    for mbs in args.micro_batch_sizes:
        for step in args.steps:
            layout, placed = STEP_RUNS[step]
            placement = dict(global_batch_packing=global_batch_setting(args.global_batch_cost)) if placed else {}
            runs.append((f"{step}-mbs{mbs}", recipe["function"], layout,
                         dict(train_iters=args.iterations, micro_batch_size=mbs, global_batch_size=args.global_batch_size,
                              seq_length=args.seq_length, run_name=f"bench-{step}-mbs{mbs}", checkpoint=False,
                              eval_iters=0, num_workers=0, **placement)))
    # Training steps are what is measured: no evaluation, no checkpoint, and the collate in the rank's own
    # process (the recipe's workers would only move it elsewhere on this machine's two cores).
    workdir = args.workdir or tempfile.mkdtemp(prefix="bridge_thd_cord_v2_sft_")
    ranks = run_on_cpu(runs, workdir=workdir, world_size=args.nproc, timeout=args.timeout)
    rows = {key: summarise([rank[key]["iterations"] for rank in ranks], [rank[key]["micro_batches"] for rank in ranks],
                           warmup=args.warmup, global_batch_size=args.global_batch_size, world_size=args.nproc)
            for key, *_ in runs}
    for key, *_ in runs:
        placement = placement_summary(ranks[0][key]["placements"], args.iterations)
        if placement is not None:
            rows[key]["placement"] = placement
    return {"device": f"CPU, {recipe['tiny']}, DP={args.nproc} over gloo", "rows": rows}


def global_batch_setting(cost: str) -> dict:
    """``GlobalBatchPacking``'s keywords for ``--global-batch-cost`` (as the recipe script reads
    ``--global-batch-packing``): ``tokens`` is its default cost (VERL's proxy), else a planner preset or a
    ``config.json``."""
    return {"cost_model": None if cost == "tokens" else cost}


def gpu_global_batch_size(recipe: str, mbs: int, nproc: int) -> int | None:
    """The global batch of a GPU row: PR 3838's (ranks x MBS: 16 at MBS 2, 32 at MBS 4 on 8 GPUs) for the
    Qwen3.5-VL recipe, None (the recipe's own) otherwise."""
    per_rank = RECIPES[recipe]["gpu_global_batch_per_rank"]
    return None if per_rank is None else per_rank * mbs * nproc


def gpu_command(step: str, mbs: int, args, report: str) -> list[str]:
    """The ``torchrun`` of one GPU row: the recipe script with the row's layout (and, for the Qwen3.5-VL recipe,
    PR 3838's global batch), and for a global-batch packing row ``--global-batch-packing COST`` (the script then
    calls ``configure(..., global_batch_packing=GlobalBatchPacking(...))``)."""
    recipe = getattr(args, "recipe", "qwen3-vl-8b")
    layout, placed = STEP_RUNS[step]
    command = ["torchrun", f"--nproc-per-node={args.nproc}", str(RECIPES[recipe]["script"]), "--layout", layout,
               "--micro-batch-size", str(mbs), "--seq-length", str(args.seq_length),
               "--train-iters", str(args.iterations), "--report", report]
    global_batch = gpu_global_batch_size(recipe, mbs, args.nproc)
    if global_batch is not None:
        command += ["--global-batch-size", str(global_batch)]
    return command + (["--global-batch-packing", args.global_batch_cost] if placed else [])


def measure_gpu(args) -> dict:
    rows, global_batch = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for mbs in args.micro_batch_sizes:
            for step in args.steps:
                key, report = f"{step}-mbs{mbs}", os.path.join(folder, f"{step}-{mbs}.json")
                command = gpu_command(step, mbs, args, report)
                done = subprocess.run(command, cwd=ROOT)
                reports = [json.load(open(f"{report}.rank{r}.json")) for r in range(args.nproc)
                           if os.path.exists(f"{report}.rank{r}.json")]
                if len(reports) != args.nproc:
                    rows[key] = {"oom": True, "failed": done.returncode}
                    continue
                first = reports[0]
                global_batch[mbs] = first["global_batch_size"]
                rows[key] = summarise([r["iterations"] for r in reports], [r["micro_batches"] for r in reports],
                                      warmup=args.warmup, global_batch_size=first["global_batch_size"],
                                      world_size=first["world_size"], oom=any(r["oom"] for r in reports))
    return {"device": f"{args.nproc}x GPU", "rows": rows, "global_batch_size": global_batch or None}


def parse_args(argv=None) -> argparse.Namespace:
    """The harness's arguments, with the defaults of ``--recipe`` and the mode filled in (``--seq-length``,
    ``--nproc``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cpu-tiny", action="store_true")
    mode.add_argument("--gpu", action="store_true")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="qwen3-vl-8b",
                        help="Megatron-Bridge's Qwen3-VL 8B SFT recipe (default) or its Qwen3.5-VL 2B SFT recipe "
                             "(PR 3838's configuration: on GPUs 8 ranks, seq_length 2048, global batch 8 x MBS)")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=None,
                        help="default 512 (CPU; GPU for qwen3-vl-8b); 2048 on GPUs for qwen35-vl-2b (PR 3838's)")
    parser.add_argument("--global-batch-size", type=int, default=16,
                        help="CPU mode (GPU: the recipe's; for qwen35-vl-2b PR 3838's, 8 x MBS)")
    parser.add_argument("--nproc", type=int, default=None, help="default 2 (CPU; GPU for qwen3-vl-8b); 8 on GPUs "
                        "for qwen35-vl-2b (PR 3838's node)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for cord_v2_sft[_qwen35][_gpu].json / .md / .png")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS),
                        help=f"rows to run per MBS (default all: {', '.join(STEPS)})")
    parser.add_argument("--global-batch-cost", default="tokens",
                        help="the global-batch packing rows' cost model: 'tokens' (GlobalBatchPacking's default, "
                             "VERL's proxy), a planner preset such as qwen3-vl-8b, or a config.json")
    args = parser.parse_args(argv)
    recipe = RECIPES[args.recipe]
    if args.seq_length is None:
        args.seq_length = (recipe["gpu_seq_length"] if args.gpu else None) or 512
    if args.nproc is None:
        args.nproc = (recipe["gpu_nproc"] if args.gpu else None) or 2
    if args.warmup >= args.iterations:
        parser.error(f"--warmup {args.warmup} must be smaller than --iterations {args.iterations}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    recipe = RECIPES[args.recipe]
    results = measure_cpu(args) if args.cpu_tiny else measure_gpu(args)
    results.update(recipe=recipe["function"], recipe_key=args.recipe, seq_length=args.seq_length,
                   global_batch_size=results.get("global_batch_size") or args.global_batch_size,
                   world_size=args.nproc, iterations=args.iterations, warmup=args.warmup,
                   micro_batch_sizes=args.micro_batch_sizes, global_batch_cost=args.global_batch_cost)
    if args.recipe == "qwen35-vl-2b":
        results["pr3838"] = PR3838
    stem = recipe["stem"] + ("" if args.cpu_tiny else "_gpu")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (args.out / f"{stem}.md").write_text(table + "\n")
    plot(results, args.out / f"{stem}.png")
    print(table)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
