"""Parity figures on Megatron-Bridge 0.6.2's real Qwen3VLModel (CPU build), for the README.

Packed (thd, thd_static) and padded (bshd) forward steps vs each sample alone through the same
model, dense and MoE: max |dlogp|, loss-sum difference, worst relative gradient error. Then CP=2
and CP=4 over gloo processes vs CP=1, and PP=2 with Megatron-Core's 1F1B schedule vs PP=1: loss-sum
difference and worst relative gradient error.

The measured values go to ``benchmarks/results/parity_report.json`` (``--json``); the printed
tables and the README blocks (``scripts/readme_figures.py``) are both rendered from that file by
:func:`render`, so the README never holds a hand-copied figure.

    .venv/bin/python benchmarks/parity_report.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "parity_report.json"
LAYOUT_NAMES = ("thd", "thd_static", "bshd")
PP_CONFIGS = [("thd", True), ("thd_static", False), ("thd", False), ("bshd", False)]


# --------------------------------------------------------------------------------------------
# Measuring (needs torch and the CPU stack; imported lazily so that rendering needs neither)
# --------------------------------------------------------------------------------------------


def _alone(model, batch):
    from megatron.bridge_thd_cpu.parity import masked_loss_sum, per_sample_losses_and_gradients

    losses, grads = per_sample_losses_and_gradients(model, batch)
    return losses, masked_loss_sum(losses, batch), grads


def _packed(model, batch, layout):
    from megatron.bridge_thd_cpu.parity import gradients, step_run

    model.zero_grad(set_to_none=True)
    run = step_run(model, batch, layout)
    run.loss.backward()
    run.output = run.output.detach()
    return run, gradients(model)


def single_process_rows(batch) -> list[dict]:
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import max_abs_dlogp, per_sample_from_output, worst_relative_gradient_error

    rows = []
    for moe in (False, True):
        model = build_qwen3_vl(tiny_qwen3_vl_config(moe=moe), seed=0)
        alone, total, reference = _alone(model, batch)
        for layout in LAYOUT_NAMES:
            run, grads = _packed(model, batch, layout)
            dlogp = max_abs_dlogp(per_sample_from_output(run, batch), alone, batch)
            error, _ = worst_relative_gradient_error(grads, reference)
            rows.append(dict(model="MoE" if moe else "dense", layout=layout, max_abs_dlogp=float(dlogp),
                             loss_sum=float(run.loss), alone_loss_sum=float(total), tokens=int(run.num_tokens),
                             worst_rel_grad_error=float(error)))
    return rows


def cp_worker(state_dict, batch, layout, cp):
    import torch
    from megatron.core import parallel_state

    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config

    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=cp), seed=0)
    model.load_state_dict(state_dict)
    run, grads = _packed(model, batch, layout)
    group = parallel_state.get_context_parallel_group()
    totals = torch.stack([run.loss.detach().double(), run.num_tokens.double()])
    torch.distributed.all_reduce(totals, group=group)
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return float(totals[0]), int(totals[1]), grads


def cp_rows(batch) -> list[dict]:
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error

    rows = []
    model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
    state_dict = model.state_dict()
    for layout in ("thd", "thd_static"):
        run, reference = _packed(model, batch, layout)
        for cp in (2, 4):
            loss, tokens, grads = run_on_gloo(cp_worker, state_dict, batch, layout, cp, cp=cp, timeout=600)[0]
            error, _ = worst_relative_gradient_error(grads, reference)
            rows.append(dict(cp=cp, layout=layout, loss_sum_cp1=float(run.loss), loss_sum=loss,
                             tokens_equal=tokens == int(run.num_tokens), worst_rel_grad_error=float(error)))
    return rows


def pp_worker(full, batches, configs):
    from megatron.bridge_thd_testbed.pipeline import pipeline_step

    return {config: pipeline_step(full, batches, *config) for config in configs}


def pp_rows() -> list[dict]:
    """PP = 2 over gloo with Megatron-Core's 1F1B schedule vs PP = 1 with the same schedule."""
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error

    batches = [synthetic_receipt_batch(2, seed=1), synthetic_receipt_batch(2, seed=2, left_padding=True)]
    full = build_qwen3_vl(tiny_qwen3_vl_config(num_layers=4), seed=0).state_dict()
    reference = pp_worker(full, batches, PP_CONFIGS)
    stages = run_on_gloo(pp_worker, full, batches, PP_CONFIGS, pp=2, timeout=600)
    rows = []
    for config in PP_CONFIGS:
        want, got = reference[config], stages[1][config]
        grads = {**stages[0][config]["grads"], **got["grads"]}
        error, _ = worst_relative_gradient_error(grads, want["grads"])
        rows.append(dict(layout_asked=config[0], variable_seq_lengths=config[1], layout_run=got["layouts"][0],
                         loss_sums_pp1=[float(w["lm loss"][0]) for w in want["losses"]],
                         loss_sums_pp2=[float(g["lm loss"][0]) for g in got["losses"]],
                         worst_rel_grad_error=float(error)))
    return rows


def collect() -> dict:
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    start = time.perf_counter()
    init_single_process_groups()
    batch = synthetic_receipt_batch(4, seed=3, left_padding=True)
    results = {"script": "benchmarks/parity_report.py", "lengths": batch["attention_mask"].sum(1).tolist()}
    with cpu_stack():
        results["single"] = single_process_rows(batch)
        results["cp"] = cp_rows(batch)
        results["pp"] = pp_rows()
    results["runtime_s"] = round(time.perf_counter() - start, 1)
    return results


# --------------------------------------------------------------------------------------------
# Rendering (pure: JSON in, markdown out; scripts/readme_figures.py uses these)
# --------------------------------------------------------------------------------------------


def single_table(results: dict) -> str:
    rows = ["| model | layout | max abs dlogp vs alone | loss sum diff | worst rel. grad error |", "|---|---|---|---|---|"]
    for r in results["single"]:
        rows.append(f"| {r['model']} | {r['layout']} | {r['max_abs_dlogp']:.2e} "
                    f"| {abs(r['loss_sum'] - r['alone_loss_sum']):.2e} | {r['worst_rel_grad_error']:.2e} |")
    return "\n".join(rows)


def single_summary(results: dict) -> str:
    """The sentence under the single-process table: loss-sum scale and the worst relative difference."""
    rows = results["single"]
    by_model = {}
    for r in rows:
        by_model.setdefault(r["model"], r)
    sums = " and ".join(f"{r['alone_loss_sum']:.1f} ({name})" for name, r in by_model.items())
    tokens = max(r["tokens"] for r in rows)
    worst = max(abs(r["loss_sum"] - r["alone_loss_sum"]) / abs(r["alone_loss_sum"]) for r in rows)
    return (f"Loss sums are {sums}, fp32 sums over {tokens} supervised tokens: the differences are at most "
            f"{worst:.2e} relative.")


def cp_table(results: dict) -> str:
    rows = ["| CP | layout | loss sum (CP=1) | loss sum diff | tokens equal | worst rel. grad error |",
            "|---|---|---|---|---|---|"]
    for r in results["cp"]:
        rows.append(f"| {r['cp']} | {r['layout']} | {r['loss_sum_cp1']:.4f} | {abs(r['loss_sum'] - r['loss_sum_cp1']):.2e} "
                    f"| {r['tokens_equal']} | {r['worst_rel_grad_error']:.2e} |")
    return "\n".join(rows)


def pp_table(results: dict) -> str:
    rows = ["| layout asked | variable_seq_lengths | layout run | loss sums (PP=1) | max loss diff | worst rel. grad error |",
            "|---|---|---|---|---|---|"]
    for r in results["pp"]:
        diff = max(abs(a - b) for a, b in zip(r["loss_sums_pp2"], r["loss_sums_pp1"]))
        sums = ", ".join(f"{s:.2f}" for s in r["loss_sums_pp1"])
        rows.append(f"| {r['layout_asked']} | {r['variable_seq_lengths']} | {r['layout_run']} | {sums} | {diff:.2e} "
                    f"| {r['worst_rel_grad_error']:.2e} |")
    return "\n".join(rows)


def render(results: dict) -> str:
    """The report this script prints."""
    return "\n\n".join([
        f"Megatron-Bridge 0.6.2 Qwen3VLModel on the CPU, fp32; 4 left-padded synthetic receipts, real lengths "
        f"{results['lengths']}",
        single_table(results), single_summary(results), cp_table(results), pp_table(results),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"write the measured values here (default {RESULTS})")
    args = parser.parse_args(argv)
    results = collect()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
    print(f"\nwrote {args.json} ({results['runtime_s']} s)", file=sys.stderr)
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
