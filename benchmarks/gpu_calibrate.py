"""Measure on a GPU what the time model's parameters need, and write the file ``bridge-thd plan --time-params`` reads
(docs/time-model.md, "Calibrating on your GPU").

Measured, each as the median of timed repeats after a warm-up, with CUDA events:

* **GEMMs by tokens**: bf16 ``(tokens x hidden) @ (hidden x ffn)`` forward, for the token counts a rank holds; the
  best achieved fraction of the GPU's bf16 peak is ``gemm_efficiency`` (the model's weight-read floor covers the
  small token counts);
* **attention by segment length**: causal (and non-causal, the vision tower's) attention of bf16, head dim 128,
  batch x length = 16k tokens as the published figures are measured, forward and forward + backward, through
  PyTorch's scaled-dot-product attention (flash / cuDNN backends): the four rate curves;
* **the ring step**: with two or more GPUs, one send / receive of a CP chunk's K and V between two ranks, small
  (its latency: the floor of ``ring_step_s``) and large (the link's bandwidth).

What a GPU cannot measure without the model (the per-micro-batch and per-step fixed costs) keeps the fitted values.

Usage (on the GPU machine; two ranks for the ring step)::

    python benchmarks/gpu_calibrate.py --gpu h100-sxm --out time_params.json
    torchrun --nproc-per-node 2 benchmarks/gpu_calibrate.py --gpu h100-sxm --out time_params.json
    bridge-thd plan --time-params time_params.json ...

``--device cpu --quick`` runs every measurement tiny on the CPU (the file's plumbing only: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from megatron.bridge_thd.cost.step_time import (
    FITTED, RateCurve, get_machine, time_parameters_to_dict)

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)


def _timed(fn, device: str, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def measure_gemms(device: str, dtype, hidden: int, ffn: int, tokens=TOKENS, repeats: int = 10) -> dict[int, float]:
    """Achieved FLOP/s of ``(tokens x hidden) @ (hidden x ffn)`` by token count."""
    out = {}
    weight = torch.randn(hidden, ffn, device=device, dtype=dtype)
    for n in tokens:
        x = torch.randn(n, hidden, device=device, dtype=dtype)
        out[n] = 2 * n * hidden * ffn / _timed(lambda: x @ weight, device, repeats)
    return out


def measure_attention(device: str, dtype, *, causal: bool, heads: int = 16, head_dim: int = 128, total: int = 16384,
                      lengths=LENGTHS, repeats: int = 5) -> tuple[dict[int, float], dict[int, float]]:
    """Forward and backward FLOP/s of attention by length, ``batch = total / length`` (the published setup), counted
    as the kernels' benchmarks count them: forward ``4 b s^2 h d`` (halved when causal), backward 2.5 x that."""
    import torch.nn.functional as F

    forward, backward = {}, {}
    for s in lengths:
        b = max(1, total // s)
        q, k, v = (torch.randn(b, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        flops = 4 * b * s * s * heads * head_dim / (2 if causal else 1)
        fwd = _timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), device, repeats)

        def fwd_bwd():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()

        both = _timed(fwd_bwd, device, repeats)
        forward[s] = flops / fwd
        backward[s] = 2.5 * flops / max(both - fwd, 1e-9)
    return forward, backward


def measure_ring_step(device: str, dtype, nbytes=(1024, 64 << 20), repeats: int = 10) -> dict[int, float] | None:
    """Seconds of one send / receive between rank 0 and rank 1 by message bytes, or None with one process."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    out = {}
    for size in nbytes:
        buffer = torch.empty(size // 2, device=device, dtype=dtype)

        def exchange():
            if rank == 0:
                dist.send(buffer, 1)
            elif rank == 1:
                dist.recv(buffer, 0)

        out[size] = _timed(exchange, device, repeats)
    return out


def calibrated(gpu: str, gemms, causal, full, ring) -> dict:
    """The parameter file's object: measured curves and GEMM efficiency over the fitted parameters; the ring
    step's small-message time as the floor of ``ring_step_s``."""
    machine = get_machine(gpu)
    params = FITTED
    changes = {
        "gemm_efficiency": min(1.0, max(gemms.values()) / machine.bf16_flops),
        "attention_forward": RateCurve(tuple(sorted(causal[0].items()))),
        "attention_backward": RateCurve(tuple(sorted(causal[1].items()))),
        "vision_attention_forward": RateCurve(tuple(sorted(full[0].items()))),
        "vision_attention_backward": RateCurve(tuple(sorted(full[1].items()))),
    }
    if ring:
        changes["ring_step_s"] = max(params.ring_step_s, min(ring.values()))
    from dataclasses import replace

    data = time_parameters_to_dict(replace(params, source=f"measured on {gpu} by benchmarks/gpu_calibrate.py",
                                           **changes))
    data["measured"] = {"gemm_flop_per_s": {str(k): v for k, v in gemms.items()},
                        "ring_step_s": {str(k): v for k, v in (ring or {}).items()}}
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpu", default="h100-sxm", help="the time model's name of this GPU (its peak and links)")
    p.add_argument("--out", default="time_params.json")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (the plumbing only)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=12288)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_calibrate: no CUDA device; run it on the GPU machine (or --device cpu --quick for the plumbing)",
              file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tokens, lengths, total = ((64, 128), (32, 64), 128) if args.quick else (TOKENS, LENGTHS, 16384)
    hidden, ffn = (64, 128) if args.quick else (args.hidden, args.ffn)
    gemms = measure_gemms(args.device, dtype, hidden, ffn, tokens, repeats=3 if args.quick else 10)
    causal = measure_attention(args.device, dtype, causal=True, heads=2 if args.quick else 16,
                               head_dim=16 if args.quick else 128, total=total, lengths=lengths,
                               repeats=2 if args.quick else 5)
    full = measure_attention(args.device, dtype, causal=False, heads=2 if args.quick else 16,
                             head_dim=16 if args.quick else 128, total=total, lengths=lengths,
                             repeats=2 if args.quick else 5)
    ring = measure_ring_step(args.device, dtype, (1024, 1 << 16) if args.quick else (1024, 64 << 20))
    if int(os.environ.get("RANK", "0")) == 0:
        data = calibrated(args.gpu, gemms, causal, full, ring)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.out}: gemm_efficiency {data['gemm_efficiency']:.2f}; bridge-thd plan --time-params "
              f"{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
