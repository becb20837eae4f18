"""The step's fourth stage: the finished row copied to the model's device, once per tensor and without blocking
the host. From :mod:`megatron.bridge_thd.step.rows`; next: the model (:mod:`megatron.bridge_thd.step.forward`)."""

from __future__ import annotations

from dataclasses import replace

import torch

__all__ = ["to_device"]

# The PackedSeqParams fields that hold tensors (its q and kv boundaries are one tensor in a THD row).
_PACKED_SEQ_TENSORS = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def to_device(forward_args: dict, device: torch.device) -> dict:
    """``forward_args`` on ``device``: one copy per distinct tensor (``PackedSeqParams`` shares its q and kv
    boundaries), none that blocks the host: a host tensor bound for a GPU is copied from pinned memory (a copy
    from pageable memory waits for the stream). A tensor already there is not touched."""
    copies: dict[int, torch.Tensor] = {}

    def move(value):
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        if id(value) not in copies:
            source = value
            if device.type == "cuda" and source.device.type == "cpu" and not source.is_pinned():
                source = source.pin_memory()
            copies[id(value)] = source.to(device, non_blocking=True)
        return copies[id(value)]

    moved = {}
    for name, value in forward_args.items():
        if name == "packed_seq_params" and value is not None:
            value = replace(value, **{field: move(getattr(value, field)) for field in _PACKED_SEQ_TENSORS})
        moved[name] = move(value)
    return moved
