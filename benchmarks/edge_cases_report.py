"""Figures for the edge-case combinations (layouts x parallelism x features), on Megatron-Bridge 0.6.2's real Qwen3VLModel (CPU build).

* PP=2 x CP=2 over gloo with Megatron-Core's 1F1B schedule vs PP=1 / CP=1, per layout: the
  difference of the loss sums and the worst relative gradient error;
* MoE expert capacity (``moe_expert_capacity_factor=1.0``): the loss per layout, with and without
  :func:`megatron.bridge_thd.moe_padding.with_padding_mask`;
* ``seq_aux_loss`` per layout (mean over layers), with and without the wrapper, against
  Megatron-Core's own router on the same samples without any padding (the padded layout of a batch
  cut to one length);
* the all-to-all dispatcher with EP=2 (two data-parallel ranks on the same micro-batch) vs EP=1:
  loss difference and worst relative gradient error (expert gradients halved: each expert gets the
  tokens of both ranks).

The values go to ``benchmarks/results/edge_cases.json``; the printed tables and the README block
(``scripts/readme_figures.py``) are rendered from that file by :func:`render`.

    .venv/bin/python benchmarks/edge_cases_report.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "edge_cases.json"
PP_CONFIGS = [("thd", True), ("thd_static", False), ("thd", False), ("bshd", False)]
MOE_SEQ = 640
# layout -> (padding side, step settings): thd with FP8 alignment 16 (padding in every slot).
MOE_CASES = {"thd": ("left", dict(fp8="hybrid")), "thd_static": ("right", {}), "bshd": ("right", {})}


# --------------------------------------------------------------------------------------------
# Measuring (imported lazily so that rendering needs no torch)
# --------------------------------------------------------------------------------------------


def _pp_worker(full_state_dict, batches):
    from megatron.bridge_thd_testbed.pipeline import pipeline_step

    return {config: pipeline_step(full_state_dict, batches, *config, num_layers=4, micro_batch_size=2,
                                  seq_length=2048) for config in PP_CONFIGS}


def pp_cp_rows() -> list[dict]:
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
    from megatron.bridge_thd_cpu.stack import cpu_stack

    batches = [synthetic_receipt_batch(2, seed=1), synthetic_receipt_batch(2, seed=2, left_padding=True)]
    with cpu_stack():
        full = build_qwen3_vl(tiny_qwen3_vl_config(num_layers=4, seq_length=2048), seed=0).state_dict()
        reference = _pp_worker(full, batches)
    ranks = run_on_gloo(_pp_worker, full, batches, pp=2, cp=2, timeout=600)
    rows = []
    for config in PP_CONFIGS:
        want = reference[config]
        for cp_rank in range(2):
            first, last = ranks[cp_rank][config], ranks[2 + cp_rank][config]
            sums = [(float(g["lm loss"][0]), float(w["lm loss"][0])) for g, w in zip(last["losses"], want["losses"])]
            error, _ = worst_relative_gradient_error({**first["grads"], **last["grads"]}, want["grads"])
            rows.append(dict(layout=config[0], variable_seq_lengths=config[1], cp_rank=cp_rank,
                             ran=last["layouts"][0], loss_sums=[w for _, w in sums],
                             max_loss_diff=max(abs(g - w) for g, w in sums), grad_error=error))
    return rows


def _moe_run(model, batch, layout, settings):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron.bridge_thd_cpu.parity import step_run

    get_moe_metrics_tracker().clear()
    run = step_run(model, batch, layout, seq_length=MOE_SEQ, **settings)
    metrics = get_moe_metrics_tracker().metrics
    seq_aux = metrics.get("seq_load_balancing_loss")
    return float(run.loss), (float(seq_aux.values.mean()) if seq_aux is not None else None)


def _moe_batches():
    from megatron.bridge_thd_cpu.data import padding_free_batch, synthetic_receipt_batch

    padded = {side: synthetic_receipt_batch(3, seed=1, left_padding=side == "left") for side in ("left", "right")}
    return padded, padding_free_batch(padded["right"])


def moe_rows() -> dict:
    from megatron.bridge_thd.moe_padding.hook import with_padding_mask
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config

    padded, unpadded = _moe_batches()
    out = {}
    for name, settings in (("capacity", dict(moe_expert_capacity_factor=1.0)),
                           ("seq_aux_loss", dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2))):
        config = tiny_qwen3_vl_config(moe=True, seq_length=MOE_SEQ, **settings)
        plain = build_qwen3_vl(config, seed=0)
        plain.bridge_thd_routes_real_tokens_only = True  # let the step run the unwrapped model, to measure it
        wrapped = with_padding_mask(build_qwen3_vl(config, seed=0))
        rows = {"reference (no padding, Megatron-Core)": _moe_run(plain, unpadded, "bshd", {})}
        for layout, (side, step_settings) in MOE_CASES.items():
            rows[f"{layout}, unwrapped"] = _moe_run(plain, padded[side], layout, step_settings)
            rows[f"{layout}, with_padding_mask"] = _moe_run(wrapped, padded[side], layout, step_settings)
            rows[f"{layout}, with_padding_mask, no padding"] = _moe_run(wrapped, unpadded, layout, step_settings)
        out[name] = {k: dict(loss=v[0], seq_aux_loss=v[1]) for k, v in rows.items()}
    return out


def _ep_worker(state_dict, batch, ep):
    from megatron.core import parallel_state

    from megatron.bridge_thd.moe_padding.hook import with_padding_mask
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import global_expert_name, gradients, step_run

    config = tiny_qwen3_vl_config(moe=True, ep=ep, seq_length=MOE_SEQ, moe_token_dispatcher_type="alltoall",
                                  moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    model = build_qwen3_vl(config, seed=0)
    rank, per_rank = parallel_state.get_expert_model_parallel_rank(), config.num_moe_experts // ep

    def global_name(name):
        return global_expert_name(name, rank, per_rank)

    model.load_state_dict({n: state_dict[global_name(n)] for n in model.state_dict()})
    with_padding_mask(model)
    out = {}
    for layout, (_, settings) in MOE_CASES.items():
        model.zero_grad(set_to_none=True)
        run = step_run(model, batch, layout, seq_length=MOE_SEQ, **settings)
        run.loss.backward()
        grads = {global_name(n): g / (ep if "local_experts" in n else 1) for n, g in gradients(model).items()}
        out[layout] = dict(loss=float(run.loss), grads=grads)
    return out


def ep_rows() -> list[dict]:
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
    from megatron.bridge_thd_cpu.stack import cpu_stack

    padded, _ = _moe_batches()
    batch = padded["right"]
    with cpu_stack():
        state_dict = build_qwen3_vl(tiny_qwen3_vl_config(moe=True, seq_length=MOE_SEQ), seed=0).state_dict()
        single = _ep_worker(state_dict, batch, 1)
    ranks = run_on_gloo(_ep_worker, state_dict, batch, 2, ep=2, dp=2, timeout=600)
    rows = []
    for layout in MOE_CASES:
        experts = [{n: g for n, g in r[layout]["grads"].items() if "local_experts" in n} for r in ranks]
        grads = {**ranks[0][layout]["grads"], **experts[0], **experts[1]}
        error, _ = worst_relative_gradient_error(grads, single[layout]["grads"])
        rows.append(dict(layout=layout, loss=single[layout]["loss"],
                         max_loss_diff=max(abs(r[layout]["loss"] - single[layout]["loss"]) for r in ranks),
                         grad_error=error))
    return rows


def measure() -> dict:
    import torch

    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    start = time.perf_counter()
    torch.set_num_threads(2)
    init_single_process_groups()
    results = dict(pp_cp=pp_cp_rows())
    with cpu_stack():
        results["moe"] = moe_rows()
    results["ep"] = ep_rows()
    results["runtime_s"] = round(time.perf_counter() - start, 1)
    results["environment"] = f"torch {torch.__version__}, CPU, fp32"
    return results


# --------------------------------------------------------------------------------------------
# Rendering (pure: the README block is this function of the JSON)
# --------------------------------------------------------------------------------------------


def render(results: dict) -> str:
    lines = ["PP=2 x CP=2 (gloo, Megatron-Core 1F1B, 2 micro-batches of 2) vs PP=1 / CP=1:", "",
             "| layout | variable_seq_lengths | ran | CP rank | loss sums (PP=1) | max loss-sum diff | worst rel. grad error |",
             "|---|---|---|---|---|---|---|"]
    for row in results["pp_cp"]:
        sums = ", ".join(f"{s:.2f}" for s in row["loss_sums"])
        lines.append(f"| {row['layout']} | {row['variable_seq_lengths']} | {row['ran']} | {row['cp_rank']} | {sums} | "
                     f"{row['max_loss_diff']:.1e} | {row['grad_error']:.1e} |")
    for name, title in (("capacity", "MoE, moe_expert_capacity_factor=1.0: loss sum"),
                        ("seq_aux_loss", "MoE, seq_aux_loss (coeff 1e-2): loss sum and seq_aux_loss (mean of layers)")):
        lines += ["", f"{title}:", "", "| run | loss sum | seq_aux_loss |", "|---|---|---|"]
        for run, values in results["moe"][name].items():
            aux = "-" if values["seq_aux_loss"] is None else f"{values['seq_aux_loss']:.6f}"
            lines.append(f"| {run} | {values['loss']:.4f} | {aux} |")
    lines += ["", "All-to-all dispatcher, EP=2 (2 data-parallel ranks, same micro-batch) vs EP=1, with_padding_mask:", "",
              "| layout | loss sum | max loss diff | worst rel. grad error |", "|---|---|---|---|"]
    for row in results["ep"]:
        lines.append(f"| {row['layout']} | {row['loss']:.4f} | {row['max_loss_diff']:.1e} | {row['grad_error']:.1e} |")
    lines += ["", f"{results['environment']}; runtime {results['runtime_s']} s"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"write the measured values here (default {RESULTS})")
    args = parser.parse_args()
    results = measure()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
    print(f"\nwrote {args.json} ({results['runtime_s']} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
