"""Parity figures on Megatron-Bridge 0.6.2's real Qwen3VLModel (CPU build), for the README.

Packed (thd, thd_static) and padded (bshd) forward steps vs each sample alone through the same
model, dense and MoE: max |dlogp|, loss-sum difference, worst relative gradient error. Then CP=2
and CP=4 over gloo processes vs CP=1: loss-sum difference and worst relative gradient error.

    .venv/bin/python benchmarks/parity_report.py
"""

from __future__ import annotations

import sys

import torch

from megatron.bridge_thd.cpu.launcher import run_on_gloo
from megatron.bridge_thd.cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd.cpu.pipeline import pipeline_step
from megatron.bridge_thd.cpu.parity import (
    gradients,
    masked_loss_sum,
    max_abs_dlogp,
    per_sample_from_output,
    per_sample_losses_and_gradients,
    step_run,
    worst_relative_gradient_error,
)
from megatron.bridge_thd.cpu.stack import cpu_stack
from megatron.bridge_thd.data import synthetic_receipt_batch
from megatron.bridge_thd.standalone import init_single_process_groups

LAYOUTS = ("thd", "thd_static", "bshd")


def _alone(model, batch):
    losses, grads = per_sample_losses_and_gradients(model, batch)
    return losses, masked_loss_sum(losses, batch), grads


def _packed(model, batch, layout):
    model.zero_grad(set_to_none=True)
    run = step_run(model, batch, layout)
    run.loss.backward()
    run.output = run.output.detach()
    return run, gradients(model)


def single_process_table(batch) -> list[str]:
    rows = ["| model | layout | max abs dlogp vs alone | loss sum diff | worst rel. grad error |", "|---|---|---|---|---|"]
    for moe in (False, True):
        model = build_qwen3_vl(tiny_qwen3_vl_config(moe=moe), seed=0)
        alone, total, reference = _alone(model, batch)
        for layout in LAYOUTS:
            run, grads = _packed(model, batch, layout)
            dlogp = max_abs_dlogp(per_sample_from_output(run, batch), alone, batch)
            error, _ = worst_relative_gradient_error(grads, reference)
            rows.append(f"| {'MoE' if moe else 'dense'} | {layout} | {dlogp:.2e} | {abs(float(run.loss) - total):.2e} "
                        f"| {error:.2e} |")
    return rows


def cp_worker(state_dict, batch, layout, cp):
    from megatron.core import parallel_state

    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=cp), seed=0)
    model.load_state_dict(state_dict)
    run, grads = _packed(model, batch, layout)
    group = parallel_state.get_context_parallel_group()
    totals = torch.stack([run.loss.detach().double(), run.num_tokens.double()])
    torch.distributed.all_reduce(totals, group=group)
    for g in grads.values():
        torch.distributed.all_reduce(g, group=group)
    return float(totals[0]), int(totals[1]), grads


def cp_table(batch) -> list[str]:
    rows = ["| CP | layout | loss sum (CP=1) | loss sum diff | tokens equal | worst rel. grad error |",
            "|---|---|---|---|---|---|"]
    model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
    state_dict = model.state_dict()
    for layout in ("thd", "thd_static"):
        run, reference = _packed(model, batch, layout)
        for cp in (2, 4):
            loss, tokens, grads = run_on_gloo(cp_worker, state_dict, batch, layout, cp, cp=cp, timeout=600)[0]
            error, _ = worst_relative_gradient_error(grads, reference)
            rows.append(f"| {cp} | {layout} | {float(run.loss):.4f} | {abs(loss - float(run.loss)):.2e} "
                        f"| {tokens == int(run.num_tokens)} | {error:.2e} |")
    return rows


PP_CONFIGS = [("thd", True), ("thd_static", False), ("thd", False), ("bshd", False)]


def pp_worker(full, batches, configs):
    return {config: pipeline_step(full, batches, *config) for config in configs}


def pp_table() -> list[str]:
    """PP = 2 over gloo with Megatron-Core's 1F1B schedule vs PP = 1 with the same schedule."""
    batches = [synthetic_receipt_batch(2, seed=1), synthetic_receipt_batch(2, seed=2, left_padding=True)]
    full = build_qwen3_vl(tiny_qwen3_vl_config(num_layers=4), seed=0).state_dict()
    reference = pp_worker(full, batches, PP_CONFIGS)
    stages = run_on_gloo(pp_worker, full, batches, PP_CONFIGS, pp=2, timeout=600)
    rows = ["| layout asked | variable_seq_lengths | layout run | loss sums (PP=1) | max loss diff | worst rel. grad error |",
            "|---|---|---|---|---|---|"]
    for config in PP_CONFIGS:
        want, got = reference[config], stages[1][config]
        diffs = [abs(float(g["lm loss"][0]) - float(w["lm loss"][0])) for g, w in zip(got["losses"], want["losses"])]
        grads = {**stages[0][config]["grads"], **got["grads"]}
        error, _ = worst_relative_gradient_error(grads, want["grads"])
        sums = ", ".join(f"{float(w['lm loss'][0]):.2f}" for w in want["losses"])
        rows.append(f"| {config[0]} | {config[1]} | {got['layouts'][0]} | {sums} | {max(diffs):.2e} | {error:.2e} |")
    return rows


def main() -> None:
    init_single_process_groups()
    batch = synthetic_receipt_batch(4, seed=3, left_padding=True)
    lengths = batch["attention_mask"].sum(1).tolist()
    print(f"Megatron-Bridge 0.6.2 Qwen3VLModel on the CPU, fp32; 4 left-padded synthetic receipts, real lengths {lengths}")
    with cpu_stack():
        print("\n".join(single_process_table(batch)))
        print()
        print("\n".join(cp_table(batch)))
        print()
        print("\n".join(pp_table()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
