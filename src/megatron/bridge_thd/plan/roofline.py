"""Roofline step time on a named GPU.

``t_step = max(t_compute, t_memory) * bubble + overhead`` per GPU, with

* ``t_compute = FLOPs_per_gpu / (peak_bf16 * mfu)``: the micro-batches' model FLOPs (the trainer's
  formula, fwd + bwd) divided over the tp * cp * pp ranks that share them (EP ranks each carry
  their own micro-batch);
* ``t_memory = (3 * weight_bytes + 3 * activation_bytes) / hbm_bandwidth``: weights read in
  forward, backward-data and backward-weight; activations written once, read twice;
* ``bubble = 1 + (pp - 1) / micro_batches`` (1F1B) and a fixed ``overhead`` (optimizer step,
  DP all-reduce not overlapped, data loading, launch latency; 0 unless given).

The MFU is an assumption (default 0.40, typical of well-tuned Megatron bf16 runs of mid-sized
models); the speed-up of one layout over another is independent of it while compute-bound and
without overhead.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "get_gpu", "step_seconds"]


@dataclass(frozen=True)
class GPU:
    """Dense bf16 peak (FLOP/s, no sparsity), HBM bandwidth (bytes/s), capacity (bytes) and the GPU-to-GPU link's
    bandwidth per direction within a node (bytes/s; NVLink, PCIe for the L40S): half the vendor's bidirectional
    total (H100 / H200 SXM NVLink 4: 900 GB/s; H100 PCIe NVLink bridge: 600 GB/s; A100 NVLink 3: 600 GB/s; B200
    NVLink 5: 1.8 TB/s; L40S: PCIe Gen4 x16, 64 GB/s)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float = 450e9


GPUS = {g.name: g for g in (
    GPU("h100-sxm", 989e12, 3.35e12, 80e9, 450e9),
    GPU("h100-pcie", 756e12, 2.0e12, 80e9, 300e9),
    GPU("h200", 989e12, 4.8e12, 141e9, 450e9),
    GPU("a100-80gb", 312e12, 2.0e12, 80e9, 300e9),
    GPU("b200", 2250e12, 8.0e12, 180e9, 900e9),
    GPU("l40s", 362e12, 0.864e12, 48e9, 32e9),
)}


def get_gpu(name: str) -> GPU:
    """The GPU called ``name``; ValueError listing the known ones otherwise."""
    key = str(name).strip().lower()
    if key not in GPUS:
        raise ValueError(f"GPU {name!r} is not known; valid GPUs: {', '.join(GPUS)}")
    return GPUS[key]


def step_seconds(flops_per_gpu: float, weight_bytes: float, activation_bytes: float, gpu: GPU, mfu: float,
                 pp: int = 1, micro_batches: int = 1, overhead_s: float = 0.0) -> float:
    """Roofline step time in seconds (module docstring).

    Args:
        flops_per_gpu: model FLOPs of this GPU's share of the step.
        weight_bytes: bf16 weight bytes on this GPU; activation_bytes: per micro-batch.
    """
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu: expected 0 < mfu <= 1, got {mfu!r}")
    compute = flops_per_gpu / (gpu.bf16_flops * mfu)
    memory = micro_batches * (3 * weight_bytes + 3 * activation_bytes) / gpu.hbm_bytes_per_s
    bubble = 1 + (pp - 1) / micro_batches
    return max(compute, memory) * bubble + overhead_s
