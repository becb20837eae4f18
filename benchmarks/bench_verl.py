#!/usr/bin/env python
"""Benchmark ``megatron.bridge_thd.verl`` against VERL 0.9.1's own packed-sequence helpers, on the CPU.

VERL's ``verl/models/mcore/util.py`` is loaded by file path (never the ``verl`` package, whose
``__init__`` needs ray): from ``BRIDGE_THD_VERL_UTIL``, an installed ``verl``, the cache
``~/.cache/bridge_thd/verl-0.9.1/``, or downloaded there with ``pip download --no-deps``
(only ``util.py`` is extracted; nothing is installed).

Tables:

1. CP = 1 (this process): ``preprocess_packed_seqs`` of the ids ``(B, T)``, of MRoPE
   ``position_ids.permute(1, 2, 0)`` ``(B, T, 3)``, and ``postprocess_packed_seqs`` of per-token
   log-probs ``(1, N)`` (VERL's fused-kernel path), for B in {8, 32, 128}, T = 1024 (VERL layout:
   prompt width 256, left-padded, response width 768, right-padded; real lengths uniform, fixed
   seed). Aten ops and host syncs per call (``opcount.count_ops``) and the median CPU time per call.
   Each configuration first checks that both give the same rows, padded boundaries and unpacked
   values; an int 0/1 mask is tried on both.
2. CP = 2 (two gloo processes, Megatron-Core's CP group; rank 0's figures): the same calls; the
   unpack all-gathers over the group. Fixed repeat counts (collectives need every rank in step).
3. Train vs rollout on Megatron-Bridge 0.6.2's real Qwen3VLModel (tiny, CPU build), CP = 1, 2, 4,
   for VERL's two model calls: the packed call (``model_forward_gen(vision_model=False)``:
   ``input_ids_rmpad``, packed 3D MRoPE ``position_ids``, ``packed_seq_params``, no labels, logits
   unpacked) and the vision-model call (``vision_model=True``: ``pre_process=False``, the padded
   ``(B, T)`` ids and mask go to the model, which packs after the vision embedding), each without
   and with ``use_fp8_padding``, vs each sample run alone: mean and max |dlogp| and
   ``token_mult_prob_error`` (mean of exp(|dlogp|)) over the response tokens, the gradient error
   of the summed response log-probs (summed over CP ranks), and the tokens the attention is told
   are real. A call that fails shows its exception.
4. VERL's vision-model call with a batch of one sample, CP = 1.

The VLM batch, VERL's loader and both model calls are :mod:`megatron.bridge_thd_testbed.verl_support`,
the code the tests assert on.

CPU times show host cost only; on a GPU every op is a kernel launch and every host sync a stream
stall, which is what the op / sync columns are for.

Usage:
    .venv/bin/python benchmarks/bench_verl.py [--quick] [--output PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import markdown  # noqa: E402

# megatron.core warns about missing Transformer Engine / Apex on import; irrelevant here.
warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

from megatron.bridge_thd import verl as ours  # noqa: E402
from megatron.bridge_thd_testbed import verl_support as shared  # noqa: E402
from megatron.bridge_thd_testbed.launcher import run_on_gloo  # noqa: E402
from megatron.bridge_thd_testbed.opcount import count_ops  # noqa: E402
from megatron.bridge_thd_cpu.parity import gradients  # noqa: E402

SEED = 1234
SEQ_LEN = 1024
PROMPT_WIDTH = 256


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def make_batch(batch_size: int, seed: int) -> dict:
    """VERL layout: prompt lengths ~ U[1, 256] left-padded, response lengths ~ U[1, 768] right-padded.

    Returns ids ``(B, T)``, mask ``(B, T)`` bool, positions ``(B, T, 3)`` (three distinct channels),
    logp ``(B, T)`` float (the values a model would return per real token)."""
    g = torch.Generator().manual_seed(seed)
    response_width = SEQ_LEN - PROMPT_WIDTH
    prompt = torch.randint(1, PROMPT_WIDTH + 1, (batch_size,), generator=g)
    response = torch.randint(1, response_width + 1, (batch_size,), generator=g)
    keep = torch.cat([
        torch.arange(PROMPT_WIDTH)[None, :] >= (PROMPT_WIDTH - prompt)[:, None],
        torch.arange(response_width)[None, :] < response[:, None],
    ], dim=1)
    ids = torch.randint(1, 151_936, keep.shape, generator=g) * keep
    base = (keep.long().cumsum(1) - 1).clamp_min(0) * keep
    positions = torch.stack([base, base // 2, base // 3], dim=-1)
    logp = -torch.rand(keep.shape, generator=g) * keep
    return dict(ids=ids, mask=keep, positions=positions, logp=logp)


def calls(helpers, b: dict) -> dict:
    """name -> zero-argument call, for one implementation (pre, post) and batch."""
    pre, post = helpers
    batch_size, seq_len = b["mask"].shape
    row, params = pre(b["ids"], b["mask"])
    # This rank's packed log-probs, as a model would return them.
    packed_logp = pre(b["logp"], b["mask"])[0]
    return {
        "pre ids (B,T)": lambda: pre(b["ids"], b["mask"]),
        "pre positions (B,T,3)": lambda: pre(b["positions"], b["mask"]),
        "post logp (1,N)": lambda: post(packed_logp, params, b["mask"], batch_size, seq_len),
    }


def verify(impls: dict, b: dict) -> None:
    """Both implementations must give the same rows, padded boundaries and unpacked values."""
    (pre_a, post_a), (pre_b, post_b) = impls["ours"], impls["verl"]
    for key in ("ids", "positions", "logp"):
        row_a, params_a = pre_a(b[key], b["mask"])
        row_b, params_b = pre_b(b[key], b["mask"])
        assert torch.equal(row_a, row_b), f"packed {key} differ"
        assert torch.equal(params_a.cu_seqlens_q_padded, params_b.cu_seqlens_q_padded), "padded boundaries differ"
    row, params = pre_a(b["logp"], b["mask"])
    for post in (post_a, post_b):
        assert torch.equal(post(row, params, b["mask"], *b["mask"].shape), b["logp"]), "unpacked values differ"


def count(fn) -> tuple[int, int]:
    with count_ops() as c:
        fn()
    return c.ops, c.host_syncs


def int_mask_outcome(pre, b: dict) -> str:
    """An int 0/1 mask: the same row as with the bool mask, a different one, or an exception."""
    try:
        row = pre(b["ids"], b["mask"].long())[0]
    except Exception as error:  # noqa: BLE001 - reported in the table
        return f"crash ({type(error).__name__})"
    return "same row" if torch.equal(row, pre(b["ids"], b["mask"])[0]) else "WRONG row (silent)"


def time_ms(fns: dict, *, warmup: int, reps: int | None, budget_s: float, min_reps: int = 5) -> dict:
    """Median ms per call; calls interleaved (rotating order) so that drifts hit all alike. With
    ``reps`` fixed (CP: every rank must call the collectives equally often) the budget is ignored."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    gc.collect()
    samples = {name: [] for name in names}
    start, rounds = time.perf_counter(), 0
    while (reps is not None and rounds < reps) or (
        reps is None and (rounds < min_reps or time.perf_counter() - start < budget_s * len(names))
    ):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def measure(impls: dict, batch_sizes, *, reps: int | None, budget_s: float, verify_first: bool) -> list[list[str]]:
    rows = []
    for batch_size in batch_sizes:
        b = make_batch(batch_size, SEED + batch_size)
        if verify_first:
            verify(impls, b)
        fns = {}
        for impl, helpers in impls.items():
            for call, fn in calls(helpers, b).items():
                fns[(impl, call)] = fn
        times = time_ms(fns, warmup=2, reps=reps, budget_s=budget_s)
        for (impl, call), fn in fns.items():
            ops, syncs = count(fn)
            rows.append([str(batch_size), str(SEQ_LEN), call, impl, str(ops), str(syncs), f"{times[(impl, call)]:.3f}"])
        for impl, (pre, _) in impls.items():
            rows.append([str(batch_size), str(SEQ_LEN), "pre ids, int 0/1 mask", impl, "", "", int_mask_outcome(pre, b)])
    return rows


def cp_timing_worker(verl_path: str, batch_sizes, reps: int) -> list[list[str]]:
    """One CP rank (module level: pickled by reference for spawn)."""
    verl_util = shared.load_verl_util(verl_path)
    impls = {
        "ours": (ours.preprocess_packed_seqs, ours.postprocess_packed_seqs),
        "verl": (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs),
    }
    return measure(impls, batch_sizes, reps=reps, budget_s=0.0, verify_first=True)


# --------------------------------------------------------------------------------------------
# Train vs rollout on the real model
# --------------------------------------------------------------------------------------------


def random_specs(batch_size: int, seed: int) -> list[tuple]:
    """Prompts of 1-12 text tokens around 0-2 images of grids (1, h, w), h, w in {4, 8};
    responses of 1-64 tokens."""
    g = torch.Generator().manual_seed(seed)

    def r(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=g))

    specs = []
    for i in range(batch_size):
        # At least one image in the batch (the first sample).
        images = tuple((4 * r(1, 2), 4 * r(1, 2)) for _ in range(max(r(0, 2), 1 if i == 0 else 0)))
        specs.append((r(1, 8), images, r(1, 4), r(1, 64)))
    return specs


def vlm_path_rows(verl_path: str, batch_size: int) -> list[list[str]]:
    """VERL's own call for vision models (metadata only, the model packs (B, T) itself), CP = 1,
    for the first sample of the batch alone (B = 1: the model takes the padded row for a packed one)."""
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack

    verl_util = shared.load_verl_util(verl_path)
    impls = {
        "ours": (ours.preprocess_packed_seqs, ours.postprocess_packed_seqs),
        "verl": (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs),
    }
    specs = random_specs(batch_size, SEED)[:1]
    rows = []
    with cpu_stack(), torch.no_grad():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        batch = shared.verl_vlm_batch(seed=SEED, specs=specs)
        alone = shared.per_sample_response_logp(model, batch)
        for impl, helpers in impls.items():
            try:
                logp = shared.response_logp(shared.vlm_path_forward(model, batch, *helpers), batch)
            except ValueError as error:
                rows.append([str(len(specs)), impl, "", "", "", f"ValueError: {str(error)[:60]}..."])
                continue
            f = shared.train_vs_rollout(logp, alone)
            rows.append([str(len(specs)), impl, f"{f['mean']:.2e}", f"{f['max']:.2e}", f"{f['mult']:.9f}", ""])
    return rows


CALLS = (("packed", "packed"), ("packed_fp8", "packed, FP8 padding"), ("vision", "vision"),
         ("vision_fp8", "vision, FP8 padding"))


def train_vs_rollout_rows(verl_path: str, batch_size: int, cp_sizes) -> list[list[str]]:
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    init_single_process_groups()
    batch = shared.verl_vlm_batch(seed=SEED, specs=random_specs(batch_size, SEED))
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        alone = shared.per_sample_response_logp(model, batch)
        model.zero_grad(set_to_none=True)
        sum(a.sum() for a in alone).backward()
        reference = gradients(model)
        state_dict = model.state_dict()
        alone = [a.detach() for a in alone]
        runs = {1: [shared.real_model_worker(state_dict, batch, verl_path, 1)]} if 1 in cp_sizes else {}
    for cp in cp_sizes:
        if cp > 1:
            runs[cp] = run_on_gloo(shared.real_model_worker, state_dict, batch, verl_path, cp, cp=cp, timeout=600)
    real_tokens = int(batch["attention_mask"].sum())
    rows = []
    for cp, ranks in runs.items():
        for call, label in CALLS:
            for impl in ("ours", "verl"):
                entry = ranks[0][impl].get(call)
                if entry is None:
                    rows.append([str(cp), label, impl, "", "", "", "", "", "not run under CP (a crash inside the "
                                 "model's CP collectives could hang the other ranks)"])
                    continue
                if "error" in entry:
                    rows.append([str(cp), label, impl, "", "", "", "", "", f"{entry['error']}: {entry['message'][:70]}..."])
                    continue
                # Every rank unpacks the same gathered batch: the worst rank is reported.
                figures = shared.train_vs_rollout(entry["logp"], alone)
                for r in ranks[1:]:
                    other = shared.train_vs_rollout(r[impl][call]["logp"], alone)
                    figures = {k: max(figures[k], other[k]) for k in figures}
                grad_error = ""
                if "grads" in entry:
                    grad_error = f"{shared.summed_gradient_error(ranks, (impl, call), reference)[0]:.2e}"
                told = (f"{entry['tokens_as_real']} / {real_tokens} / {entry['row_length']}"
                        if "row_length" in entry else f"(model's own) / {real_tokens} / (model's own)")
                rows.append([
                    str(cp), label, impl, f"{figures['mean']:.2e}", f"{figures['max']:.2e}", f"{figures['mult']:.9f}",
                    grad_error, told, "",
                ])
    return rows


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: B=8 only, few repeats, CP=1 and 2")
    parser.add_argument("--output", type=Path, help="also write the tables to this file")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()

    verl_path, how = shared.find_verl_util()
    if verl_path is None:
        print(f"VERL's util.py is not available: {how}", file=sys.stderr)
        return 1
    progress(f"VERL util.py: {verl_path} ({how})")
    verl_util = shared.load_verl_util(verl_path)
    batch_sizes = (8,) if args.quick else (8, 32, 128)

    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    init_single_process_groups()
    impls = {
        "ours": (ours.preprocess_packed_seqs, ours.postprocess_packed_seqs),
        "verl": (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs),
    }
    header = ["B", "T", "call", "impl", "ops/call", "host syncs/call", "CPU ms/call (median)"]
    progress("CP=1 ...")
    cp1 = measure(impls, batch_sizes, reps=None, budget_s=0.1 if args.quick else 0.5, verify_first=True)
    progress("CP=2 (gloo) ...")
    cp2 = run_on_gloo(cp_timing_worker, verl_path, batch_sizes, 5 if args.quick else 20, cp=2, timeout=600)[0]
    progress("train vs rollout on the real model ...")
    cp_sizes = (1, 2) if args.quick else (1, 2, 4)
    tvr = train_vs_rollout_rows(verl_path, 4 if args.quick else 8, cp_sizes)
    vlm = vlm_path_rows(verl_path, 4 if args.quick else 8)

    env = (f"torch {torch.__version__}, threads {torch.get_num_threads()}, {os.cpu_count()} logical cores, "
           f"python {platform.python_version()}, VERL util.py {shared.VERL_VERSION} ({how})")
    parts = [
        f"### CP = 1: ours vs VERL {shared.VERL_VERSION} (same rows and unpacked values checked first)",
        "",
        markdown(header, cp1),
        "",
        "### CP = 2 over gloo (rank 0; the unpack all-gathers over the CP group)",
        "",
        markdown(header, cp2),
        "",
        "### Train vs rollout on the tiny real Qwen3VLModel: packed forward vs each sample alone (response tokens)",
        "",
        markdown(["CP", "VERL call", "helpers", "mean abs dlogp", "max abs dlogp", "token_mult_prob_error",
                  "rel. grad error", "tokens told real / real tokens / row", "error"], tvr),
        "",
        "### VERL's vision-model call with one sample (the model takes the padded (1, T) row for a packed one), CP = 1",
        "",
        markdown(["B", "helpers", "mean abs dlogp", "max abs dlogp", "token_mult_prob_error", "error"], vlm),
        "",
        f"{env}; {time.perf_counter() - t_start:.0f} s.",
    ]
    text = "\n".join(parts)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
