#!/usr/bin/env python
"""Step time of Megatron-Bridge's in-batch placement vs global-batch packing (``batching.assign``) of the
same samples, on a DP = 2 gloo world running Megatron-Bridge 0.6.2's real ``Qwen3VLModel`` (tiny, CPU).

What it measures: per step, a global batch of 16 samples; Megatron-Bridge's own placement
(``in_batch_assignment``: consecutive slices of ``micro_batch_size`` per rank, what its samplers do)
and ``assign``'s placement of the same samples on DP 2 x 2 micro-batches (MBS 4, seq_length 2048).
Each rank builds the model once (``bridge_thd_cpu.model.build_qwen3_vl``, 2 layers, fp32, weights of seed 0 on
both ranks) and, per step and placement, runs its micro-batches (forward + backward) through
Megatron-Core's PP = 1 schedule (``get_forward_backward_func()`` = ``forward_backward_no_pipelining``,
what the trainer runs) with our ``qwen3_vl_step.forward_step``; gradients are zeroed (set to None)
between runs, no optimizer step. A rank's time is ``time.perf_counter`` from a DP barrier to the
schedule's return; the step time is the max over the two ranks (the slower rank is what a DP step
waits for at the gradient all-reduce, which is left out: it is the same for both placements). The
placements alternate run by run (in-batch, global, in-batch, global, ..., both layouts within each
step), so drift of the machine's load hits both alike; the first ``--warmup`` steps are excluded.

Layouts:

* ``thd``: one THD row per micro-batch of its real (aligned) tokens; ``assign`` caps a micro-batch at
  ``micro_batch_size * seq_length`` slots.
* ``thd_static``: a fixed row; in-batch: ``micro_batch_size * seq_length`` slots (Megatron-Bridge's
  placement cannot do better: any 4 samples of up to 2048 tokens must fit); global: one row for the
  whole run, the max over the run's steps of the smallest row at which ``assign`` places the step
  (as the runtime's ``choose_row_length`` fixes it from the run's steps), passed to the step as
  ``GlobalBatchPacking(row_length=...)``. This ratio includes the padding global-batch packing removes
  from the static row, not only the balance.

Distributions: ``receipts`` (``bridge_thd_cpu.data.synthetic_receipt_batch(16, seed=step)``, one image each)
and ``skewed`` (per step the 3 longest and 13 shortest of 64 receipts, shuffled: a few long samples
among short ones every step). Placement cost: ``batching.sample_cost`` of a ``plan.presets.ModelSpec``
with the tiny model's sizes (2 layers, hidden 64, 4 heads / 2 KV groups of 16, SwiGLU 128, vocabulary
256; ViT 2 blocks of width 32, patch 4, merge 2): Megatron-Bridge's FLOPs terms for this model. The
report gives, per placement, the per-rank cost max/mean (``placement_stats``) and the per-rank real
tokens; both losses are checked equal (sum over the DP group) so the two placements ran the same samples.

Why this is a CPU proxy, and what it does and does not show:

* Per-operator overhead, the usual worry with a tiny model (a time that does not depend on a rank's
  tokens, so that balancing tokens moves little time), is measured rather than assumed: after the
  runs each rank times a step of the same shape whose samples are minimal (39 tokens, 16 ViT patches
  each), the report's "floor". At these sizes (about 4,000-4,500 real tokens per rank per step) it is
  a few percent of a step, so here the CPU time does grow with the work; the overhead argument applies
  to this tiny model on a GPU (kernel launches), where the ratio would be expected close to 1.
* The placement balances the tiny model's FLOPs (``sample_cost``; for this model the ViT's per-image
  attention, ``p^2``, is the largest term), which the CPU time follows only loosely: fp32 CPU
  kernels' throughput varies with shapes, and the CPU attention stand-in (``bridge_thd_cpu.attention``) pads
  every segment of a row to the row's longest (dense ``S x L_max^2`` work, up to about twice the exact
  ``sum s^2``; the report gives the factor), which penalises rows mixing one long sample with short
  ones, what ``assign`` builds, where FlashAttention / cuDNN varlen kernels compute the exact sum.
* 16 samples on DP 2: the in-batch imbalance these distributions produce is modest (per-rank cost
  max/mean about 1.03-1.14), so the gain balance can bring is a few to about 15%; ``thd_static``'s
  ratio also contains the static-row padding global-batch packing removes.
* Two ranks on two logical CPUs, possibly shared with other processes (the 1-minute load average is
  recorded): a run varies by 10-20%, which the alternation, the per-step paired ratios and the medians
  reduce but do not remove. Each rank's process CPU seconds (``time.process_time``) are reported next to
  the wall seconds: with one torch thread per rank they are its compute time, largely insensitive to other
  processes taking the cores.

On a GPU with a real model (8B: hidden 4096, 36 layers) the step time follows the FLOPs closely, so the
ratio is expected near the in-batch / global ratio of the slowest rank's cost under that model's
``sample_cost`` (the report's "ratio if time ∝ cost" column gives it for the tiny model's cost), not
near this table's measured CPU ratios.

Writes ``benchmarks/results/global_batch_step_time.{json,md}`` (``--quick``: a smoke run of 2 steps per
distribution, writes nothing unless ``--out`` is given).

Usage:
    .venv/bin/python benchmarks/global_batch_step_time.py [--quick] [--threads N] [--steps N] [--warmup N] [--out DIR] [--render]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _global_batch_step import (  # noqa: E402
    DISTRIBUTIONS, DP, GLOBAL_BATCH_SIZE, LAYOUT_NAMES, MICRO_BATCH_SIZE, NUM_LAYERS, PLACEMENTS, SEQ_LENGTH, sample_sizes,
    step_batch, step_time_worker, tiny_model_spec)
from _tables import cpu_name, markdown  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

from megatron.bridge_thd.batching.policy import aligned_lengths, assign, in_batch_assignment, placement_stats  # noqa: E402
from megatron.bridge_thd.cost.sample import sample_cost  # noqa: E402
from megatron.bridge_thd.layouts import thd_alignment  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
NAME = "global_batch_step_time"
NUM_MICRO_BATCHES = GLOBAL_BATCH_SIZE // (MICRO_BATCH_SIZE * DP)
CAPACITY = MICRO_BATCH_SIZE * SEQ_LENGTH
ALIGN = thd_alignment(1, 1, sequence_parallel=False, fp8=False)  # TP = CP = 1
SEED = 0
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------------------------
# Placements (parent process)
# --------------------------------------------------------------------------------------------


def smallest_row(lengths, patches, squared, cost) -> int:
    """The shortest row at which ``assign`` places the step (as ``_smallest_row`` in
    tests/parallel/test_global_batch_equality.py, with the run's cost)."""
    slots = aligned_lengths(lengths, ALIGN)
    row = max(int(slots.max()), -(-int(slots.sum()) // (DP * NUM_MICRO_BATCHES)))
    while True:
        try:
            assign(lengths, dp_size=DP, num_micro_batches=NUM_MICRO_BATCHES, row_length=row, vision_patches=patches,
                   vision_patches_squared=squared, align_to=ALIGN, seed=SEED, cost=cost)
            return row
        except ValueError:
            row += ALIGN


def plan_distribution(distribution: str, steps: int, cost) -> dict:
    """Per step: sizes, the placements of both layouts and their measures; the run's static row."""
    sizes = []
    for step in range(steps):
        lengths, patches, squared = sample_sizes(step_batch(distribution, step))
        sizes.append((lengths, patches, squared))
    smallest = [smallest_row(*s, cost) for s in sizes]
    row = max(smallest)
    own = in_batch_assignment(GLOBAL_BATCH_SIZE, dp_size=DP, micro_batch_size=MICRO_BATCH_SIZE)
    planned = []
    for step, (lengths, patches, squared) in enumerate(sizes):
        costs = cost(lengths, patches, squared)
        slots = aligned_lengths(lengths, ALIGN).tolist()

        def place(row_length):
            return assign(lengths, dp_size=DP, num_micro_batches=NUM_MICRO_BATCHES, row_length=row_length,
                          vision_patches=patches, vision_patches_squared=squared, align_to=ALIGN, seed=SEED, cost=cost)

        runs = {
            ("thd", "in_batch"): (own, None, None),
            ("thd", "global"): (place(CAPACITY), None, None),
            ("thd_static", "in_batch"): (own, None, CAPACITY),
            ("thd_static", "global"): (place(row), row, row),
        }
        entries = {}

        def padded_attention(assignment):
            # What the CPU attention stand-in computes: every segment of a row padded to the row's longest
            # (LLM: samples, ViT: images), weighted with the cost's squared-term coefficients.
            return sum(len(mb) * (cost.per_token_squared * max(lengths[i] for i in mb) ** 2
                                  + cost.per_patch_squared * max(patches[i] for i in mb) ** 2)
                       for rank in assignment for mb in rank)

        exact_attention = float(sum(cost.per_token_squared * n * n + cost.per_patch_squared * q
                                    for n, q in zip(lengths, squared)))
        for (layout, placement), (assignment, row_length, static_row) in runs.items():
            stats = placement_stats(assignment, lengths, costs=costs, row_length=static_row, align_to=ALIGN)
            entries[f"{layout}/{placement}"] = {
                "assignment": assignment, "row_length": row_length,
                "rank_real_tokens": [sum(lengths[i] for mb in rank for i in mb) for rank in assignment],
                "rank_slots": [sum(static_row if static_row is not None else sum(slots[i] for i in mb) for mb in rank)
                               for rank in assignment],
                "samples_per_micro_batch": [[len(mb) for mb in rank] for rank in assignment],
                "rank_cost": list(stats.rank_cost), "rank_cost_imbalance": stats.rank_imbalance,
                "micro_batch_cost_imbalance": stats.micro_batch_imbalance, "padding": stats.padding,
                "stand_in_attention_flops": padded_attention(assignment), "exact_attention_flops": exact_attention,
            }
        planned.append({"step": step, "lengths": lengths, "patches": patches, "smallest_row": smallest[step],
                        "runs": entries})
    return {"static_row": row, "steps": planned}


# --------------------------------------------------------------------------------------------
# Summary and report
# --------------------------------------------------------------------------------------------


def _imbalance(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def summarise(results: dict) -> list[dict]:
    """Per distribution and layout: medians over the measured steps and the in-batch / global ratios."""
    rows = []
    warmup = results["parameters"]["warmup_steps"]
    for distribution, d in results["distributions"].items():
        measured = [s for s in d["steps"] if s["step"] >= warmup]
        for layout in LAYOUT_NAMES:
            row = {"distribution": distribution, "layout": layout, "measured_steps": len(measured)}
            for placement in PLACEMENTS:
                runs = [s["runs"][f"{layout}/{placement}"] for s in measured]
                row[placement] = {
                    "median_step_ms": 1e3 * statistics.median(r["step_seconds"] for r in runs),
                    "step_ms": [1e3 * r["step_seconds"] for r in runs],
                    "median_step_cpu_ms": 1e3 * statistics.median(r["step_cpu_seconds"] for r in runs),
                    "median_rank_time_imbalance": statistics.median(_imbalance(r["rank_seconds"]) for r in runs),
                    "median_rank_cpu_time_imbalance": statistics.median(_imbalance(r["rank_cpu_seconds"]) for r in runs),
                    "mean_rank_cost_imbalance": statistics.mean(r["rank_cost_imbalance"] for r in runs),
                    "worst_rank_cost_imbalance": max(r["rank_cost_imbalance"] for r in runs),
                    "mean_rank_token_imbalance": statistics.mean(_imbalance(r["rank_real_tokens"]) for r in runs),
                    "mean_real_tokens_per_rank": statistics.mean(t for r in runs for t in r["rank_real_tokens"]),
                    "mean_slots_per_rank": statistics.mean(t for r in runs for t in r["rank_slots"]),
                    "median_mean_rank_cpu_ms": 1e3 * statistics.median(statistics.mean(r["rank_cpu_seconds"]) for r in runs),
                    "stand_in_attention_overhead": statistics.mean(r["stand_in_attention_flops"] / r["exact_attention_flops"]
                                                                   for r in runs),
                    "samples_per_micro_batch": [min(n for r in runs for rank in r["samples_per_micro_batch"] for n in rank),
                                                max(n for r in runs for rank in r["samples_per_micro_batch"] for n in rank)],
                }
            paired = [s["runs"][f"{layout}/in_batch"]["step_seconds"] / s["runs"][f"{layout}/global"]["step_seconds"]
                      for s in measured]
            row["cost_predicted_ratio"] = statistics.median(
                max(s["runs"][f"{layout}/in_batch"]["rank_cost"]) / max(s["runs"][f"{layout}/global"]["rank_cost"])
                for s in measured)
            row["ratio_of_medians"] = row["in_batch"]["median_step_ms"] / row["global"]["median_step_ms"]
            row["cpu_ratio_of_medians"] = row["in_batch"]["median_step_cpu_ms"] / row["global"]["median_step_cpu_ms"]
            row["paired_ratio"] = {"median": statistics.median(paired), "min": min(paired), "max": max(paired),
                                   "global_faster_steps": sum(p > 1 for p in paired)}
            row["static_row"] = ({"in_batch": CAPACITY, "global": d["static_row"]} if layout == "thd_static" else None)
            rows.append(row)
    return rows


def headline(results: dict) -> str:
    """The short table for docs/batching.md (rendered by scripts/readme_figures.py)."""
    rows = []
    for r in results["summary"]:
        before, after = r["in_batch"], r["global"]
        rows.append([r["distribution"], r["layout"],
                     f"{before['median_step_ms']:.0f} → {after['median_step_ms']:.0f}", f"{r['ratio_of_medians']:.2f}x",
                     f"{r['cpu_ratio_of_medians']:.2f}x", f"{r['cost_predicted_ratio']:.2f}x",
                     f"{before['mean_rank_cost_imbalance']:.3f} → {after['mean_rank_cost_imbalance']:.3f}"])
    m = results["machine"]
    table = markdown(["distribution", "layout", "step ms (max over ranks): in-batch → global", "ratio (wall)",
                      "ratio (CPU)", "ratio if time ∝ cost", "rank cost max/mean"], rows)
    return (table + f"\n\nMedians of {results['summary'][0]['measured_steps']} steps per placement, alternating, one run; "
            f"1-minute load average {m.get('load_average_start', float('nan')):.1f} at the start and "
            f"{m.get('load_average_end', float('nan')):.1f} at the end.")


def render(results: dict) -> str:
    p, m = results["parameters"], results["machine"]
    rows = results["summary"]
    out = [
        "# Step time: in-batch placement vs global-batch packing (DP 2, gloo, tiny Qwen3-VL, CPU)",
        "",
        f"`benchmarks/global_batch_step_time.py`{' --quick' if p['quick'] else ''}: Megatron-Bridge 0.6.2's "
        f"`Qwen3VLModel` ({p['num_layers']} layers, hidden 64, ViT width 32, fp32), DP {p['dp']} over gloo, "
        f"MBS {p['micro_batch_size']}, {p['global_batch_size']} samples per step ({p['micro_batches_per_rank']} "
        f"micro-batches per rank), seq_length {p['seq_length']}; forward + backward through Megatron-Core's PP = 1 "
        f"schedule, the model built once per rank. Step time = max over the 2 ranks (barrier to schedule return); "
        f"median of {p['measured_steps']} steps after {p['warmup_steps']} warm-up, placements alternating run by run. "
        f"Cost: `sample_cost` of {results['cost']['name']} (Megatron-Bridge's FLOPs terms for the tiny model).",
        "",
        f"Machine: {m['cpu']}; {m['torch_threads_per_rank']} torch thread(s) per rank; 1-minute load average "
        f"{m['load_average_start']:.1f} at start, {m['load_average_end']:.1f} at end; run took "
        f"{results['total_seconds']:.0f} s.",
        "",
    ]
    for name, d in results["distributions"].items():
        lengths = [n for s in d["steps"] for n in s["lengths"]]
        out.append(f"- **{name}**: {d['description']}; tokens per sample {min(lengths)}-{max(lengths)} (mean "
                   f"{statistics.mean(lengths):.0f}); thd_static rows: in-batch {CAPACITY:,}, global {d['static_row']:,} "
                   f"(max over the run's steps of the smallest row `assign` fits)")
    floor_ms = 1e3 * statistics.median(results["floor"]["step_cpu_seconds"])
    medians = [r[p]["median_step_cpu_ms"] for r in rows for p in PLACEMENTS]
    out += ["", f"Ratio = in-batch / global step time (> 1: global-batch packing is faster); imbalance = max / mean "
            f"over the 2 ranks. Floor (the per-step cost that does not depend on tokens: a step of the same shape with "
            f"{results['floor']['tokens_per_sample']} tokens and {results['floor']['vit_patches_per_sample']} ViT patches "
            f"per sample): {floor_ms:.0f} ms CPU, "
            f"{100 * floor_ms / max(medians):.0f}-{100 * floor_ms / min(medians):.0f}% of the median steps below.", ""]

    def pair(row, key, fmt):
        return f"{fmt.format(row['in_batch'][key])} → {fmt.format(row['global'][key])}"

    out.append(markdown(
        ["distribution", "layout", "wall ms: in-batch → global", "ratio (medians)", "ratio per step: median [min, max]",
         "CPU ms: in-batch → global", "CPU ratio", "rank cost imbalance", "rank tokens imbalance",
         "rank CPU-time imbalance", "real tokens / slots per rank"],
        [[r["distribution"], r["layout"], pair(r, "median_step_ms", "{:.0f}"), f"{r['ratio_of_medians']:.2f}x",
          f"{r['paired_ratio']['median']:.2f}x [{r['paired_ratio']['min']:.2f}, {r['paired_ratio']['max']:.2f}] "
          f"({r['paired_ratio']['global_faster_steps']}/{r['measured_steps']} faster)",
          pair(r, "median_step_cpu_ms", "{:.0f}"), f"{r['cpu_ratio_of_medians']:.2f}x",
          pair(r, "mean_rank_cost_imbalance", "{:.3f}"), pair(r, "mean_rank_token_imbalance", "{:.3f}"),
          pair(r, "median_rank_cpu_time_imbalance", "{:.3f}"),
          f"{r['in_batch']['mean_real_tokens_per_rank']:,.0f} / {r['in_batch']['mean_slots_per_rank']:,.0f} → "
          f"{r['global']['mean_slots_per_rank']:,.0f}"]
         for r in rows]))
    out += ["", "Where the CPU time goes (diagnostics, same runs):", ""]
    out.append(markdown(
        ["distribution", "layout", "ratio if time ∝ cost", "mean-rank CPU ms: in-batch → global",
         "samples per micro-batch", "CPU attention stand-in's work / exact sum s^2 (LLM + ViT)"],
        [[r["distribution"], r["layout"], f"{r['cost_predicted_ratio']:.2f}x", pair(r, "median_mean_rank_cpu_ms", "{:.0f}"),
          f"{'-'.join(map(str, r['in_batch']['samples_per_micro_batch']))} → "
          f"{'-'.join(map(str, r['global']['samples_per_micro_batch']))}",
          pair(r, "stand_in_attention_overhead", "{:.2f}x")] for r in rows]))
    out += ["", "Ratio if time ∝ cost: in-batch max rank cost / global max rank cost (median over steps), the ratio a "
            "step whose time follows the FLOPs of the cost model would show (balance only: `thd_static`'s padding slots "
            "are not in the cost). Mean-rank CPU ms: the mean over the 2 ranks of their CPU seconds (the work, not the "
            "slowest rank), median over steps. The last column: attention FLOPs (the cost's squared terms) as the CPU stand-in "
            "computes them, every segment of a row (a sample for the LLM, an image for the ViT) padded to the row's "
            "longest, over the exact per-sample sum a varlen kernel (FlashAttention, cuDNN) computes; mean over steps."]
    check = results["loss_check"]
    out += [
        "",
        "Wall: the step time as defined above (max over the ranks of barrier-to-return wall seconds), median over "
        "the measured steps; ratio per step: the in-batch / global ratio of each step's pair of runs (same samples, "
        "run back to back). CPU: the same with each rank's process CPU seconds (`time.process_time`) in place of "
        "wall seconds: with one torch thread per rank and no collective inside the timed region it is the rank's "
        "compute time, largely insensitive to other processes taking the cores (on a quiet machine wall ~ CPU).",
        "",
        "Imbalances: cost = `placement_stats(...).rank_imbalance` with the tiny model's `sample_cost` (mean over "
        "measured steps); tokens = per-rank real tokens (mean over steps); CPU time = the measured per-rank CPU "
        "seconds (median over steps). The last column: mean real tokens per rank, and token slots per rank in-batch "
        "→ global (`thd`: aligned tokens, so equal; `thd_static`: rows x row length).",
        "",
        f"Same samples, same loss: the DP group's loss sum of the two placements agrees at every step (max relative "
        f"difference {check['max_relative_difference']:.1e}, tolerance {LOSS_RTOL:g}; supervised tokens equal: "
        f"{check['tokens_equal']}).",
        "",
        "CPU proxy (the script's docstring): the placement balances the tiny model's FLOPs, which the CPU time "
        "follows only loosely (the CPU attention stand-in pads every segment of a row to its longest; fp32 CPU "
        "kernels' speed varies with shape), and 2 ranks on 2 cores are noisy; on a GPU with a real model the "
        "step time follows the FLOPs closely, so the ratio there is expected near the 'ratio if time ∝ cost' of "
        "that model's cost, not this table's.",
    ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def run(args) -> dict:
    from megatron.bridge_thd_testbed.launcher import run_on_gloo

    steps = args.warmup + args.steps
    cost = sample_cost(tiny_model_spec(NUM_LAYERS))
    plans = {name: plan_distribution(name, steps, cost) for name in DISTRIBUTIONS}
    # One ordered list of runs, the same on both ranks: per distribution, per step, per layout, in-batch then global.
    schedule = []
    for name, d in plans.items():
        for s in d["steps"]:
            for layout in LAYOUT_NAMES:
                for placement in PLACEMENTS:
                    entry = s["runs"][f"{layout}/{placement}"]
                    schedule.append(dict(distribution=name, step=s["step"], layout=layout, placement=placement,
                                         assignment=entry["assignment"], row_length=entry["row_length"]))
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    ranks = run_on_gloo(step_time_worker, schedule, args.threads, dp=DP, timeout=args.timeout)
    total = time.perf_counter() - start
    load_end = os.getloadavg()[0]
    worst, tokens_equal = 0.0, True
    for k, entry in enumerate(schedule):
        measured = ranks[0]["runs"][k]
        run_entry = plans[entry["distribution"]]["steps"][entry["step"]]["runs"][f"{entry['layout']}/{entry['placement']}"]
        if measured["rank_real_tokens"] != run_entry["rank_real_tokens"]:
            raise RuntimeError(f"run {k}: ranks held {measured['rank_real_tokens']} tokens, planned "
                               f"{run_entry['rank_real_tokens']}")
        if measured["rank_slots"] != run_entry["rank_slots"]:
            raise RuntimeError(f"run {k}: ranks processed {measured['rank_slots']} slots, planned {run_entry['rank_slots']}")
        if measured["layouts"] != [entry["layout"]]:
            raise RuntimeError(f"run {k}: the step ran {measured['layouts']}, expected {entry['layout']}")
        run_entry.update(rank_seconds=measured["rank_seconds"], step_seconds=max(measured["rank_seconds"]),
                         rank_cpu_seconds=measured["rank_cpu_seconds"], step_cpu_seconds=max(measured["rank_cpu_seconds"]),
                         loss_sum=measured["loss_sum"], loss_tokens=measured["loss_tokens"])
        run_entry.pop("assignment")
        run_entry["placement"] = [[list(mb) for mb in rank] for rank in entry["assignment"]]
    for d in plans.values():
        for s in d["steps"]:
            for layout in LAYOUT_NAMES:
                own, placed = s["runs"][f"{layout}/in_batch"], s["runs"][f"{layout}/global"]
                worst = max(worst, abs(placed["loss_sum"] - own["loss_sum"]) / abs(own["loss_sum"]))
                tokens_equal &= placed["loss_tokens"] == own["loss_tokens"]
    if worst > LOSS_RTOL or not tokens_equal:
        raise RuntimeError(f"the placements' losses differ (relative {worst:.2e}, tokens equal: {tokens_equal})")
    results = {
        "parameters": {"quick": args.quick, "dp": DP, "micro_batch_size": MICRO_BATCH_SIZE,
                       "global_batch_size": GLOBAL_BATCH_SIZE, "micro_batches_per_rank": NUM_MICRO_BATCHES,
                       "seq_length": SEQ_LENGTH, "num_layers": NUM_LAYERS, "align": ALIGN, "seed": SEED,
                       "warmup_steps": args.warmup, "measured_steps": args.steps, "layouts": list(LAYOUT_NAMES),
                       "placements": {"in_batch": "batching.in_batch_assignment (Megatron-Bridge's samplers)",
                                      "global": "batching.assign (thd: row cap MBS * seq_length; thd_static: the "
                                                "run's fixed row)"},
                       "schedule": "megatron.core get_forward_backward_func() (PP = 1: forward_backward_no_pipelining)",
                       "order": "per distribution, per step: thd in-batch, thd global, thd_static in-batch, "
                                "thd_static global"},
        "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(),
                    "cpus_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                    "torch_threads_per_rank": ranks[0]["threads"], "torch_version": torch.__version__,
                    "load_average_start": load_start, "load_average_end": load_end},
        "cost": {"name": cost.name, "per_token": cost.per_token, "per_token_squared": cost.per_token_squared,
                 "per_patch": cost.per_patch, "per_patch_squared": cost.per_patch_squared,
                 "source": "batching.sample_cost(ModelSpec of the tiny test-bed model)"},
        "loss_check": {"max_relative_difference": worst, "tokens_equal": tokens_equal},
        "floor": {"description": f"a thd step of {NUM_MICRO_BATCHES} micro-batches of {MICRO_BATCH_SIZE} minimal "
                                 "samples, after the measured runs: max over the ranks of CPU seconds, per repeat",
                  "tokens_per_sample": ranks[0]["floor_tokens"] // MICRO_BATCH_SIZE, "vit_patches_per_sample": 16,
                  "step_cpu_seconds": [max(r["floor_cpu_seconds"][k] for r in ranks)
                                       for k in range(len(ranks[0]["floor_cpu_seconds"]))]},
        "total_seconds": total,
        "distributions": {name: {"description": DISTRIBUTIONS[name], **d} for name, d in plans.items()},
    }
    results["summary"] = summarise(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 steps per distribution (1 warm-up); "
                        "writes nothing unless --out is given")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per distribution (default 12; --quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per distribution, excluded (default 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole gloo world")
    parser.add_argument("--out", type=Path, default=None, help=f"directory for {NAME}.{{json,md}} (default "
                        "benchmarks/results; none with --quick)")
    parser.add_argument("--render", action="store_true", help="only re-render the .md from the results JSON")
    args = parser.parse_args(argv)
    if args.render:
        out = args.out or RESULTS
        results = json.loads((out / f"{NAME}.json").read_text())
        results["summary"] = summarise(results)
        (out / f"{NAME}.md").write_text(render(results))
        print(render(results))
        return 0
    if args.threads < 1 or args.warmup < 0 or (args.steps is not None and args.steps < 1):
        parser.error("--threads and --steps must be >= 1, --warmup >= 0")
    if args.steps is None:
        args.steps = 1 if args.quick else 12
    results = run(args)
    report = render(results)
    print(report)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{NAME}.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / f"{NAME}.md").write_text(report)
        print(f"wrote {out / (NAME + '.json')}, .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
