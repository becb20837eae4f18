"""The GPUs the planner knows by name: their bf16 peak, HBM bandwidth, capacity and in-node link (``--gpu``,
``--list-models``). Step times come from the time model (:mod:`megatron.bridge_thd.cost.step_time`,
docs/time-model.md), which has its own measured links for these names; this table is what the planner's memory
checks and listings read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "get_gpu"]


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
