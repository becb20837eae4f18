"""Real THD sequence packing for Qwen3-VL training in Megatron-Bridge.

Data flows one way: batch -> lengths -> packed row -> model -> loss.
"""

from megatron.bridge_thd.lengths import cu_seqlens_from_lengths, cu_seqlens_from_sample_ids, real_lengths
from megatron.bridge_thd.mrope import qwen3_vl_position_ids
from megatron.bridge_thd.packing import PackedBatch, pack_bshd_to_thd, required_alignment, unpack_thd_to_bshd

__all__ = [
    "PackedBatch",
    "pack_bshd_to_thd",
    "unpack_thd_to_bshd",
    "required_alignment",
    "qwen3_vl_position_ids",
    "real_lengths",
    "cu_seqlens_from_lengths",
    "cu_seqlens_from_sample_ids",
]
