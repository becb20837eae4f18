"""Pure-torch THD core attention for Megatron-Core's local layer spec, with context parallelism.

Stands in for Transformer Engine's ``TEDotProductAttention`` on a machine without CUDA, with
its THD semantics: sample i's tokens sit at ``[cu_padded[i], cu_padded[i] + len_i)``, the rest
of its physical slot is padding that is never attended to and whose output is 0, and no query
sees another sample. Under a context-parallel group of size > 1 each rank holds chunks ``r``
and ``2cp-1-r`` of every physical segment (the zigzag rule of
:mod:`megatron.bridge_thd.context_parallel`); K and V are all-gathered over the group and every
local query is masked by its global position, so the result equals the CP=1 attention.

This is the CPU test stack: it reads segment widths on the host (one read per call) and uses a
dense per-segment mask. It is exact, not fast.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.bridge_thd.context_parallel import thd_local_positions, thd_partition_indices
from megatron.bridge_thd.packing import gather_from_row

__all__ = ["THDCoreAttention", "thd_cp_attention", "gather_row_over_cp"]


class _AllGatherRow(torch.autograd.Function):
    """All-gather ``(n, ...)`` local rows into ``(cp * n, ...)``, rank-major; the backward sums
    every rank's gradient (all-reduce) and keeps this rank's part. Works on gloo."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size)[rank], None


def gather_row_over_cp(local: torch.Tensor, cu_seqlens_padded: torch.Tensor, group) -> torch.Tensor:
    """Rebuild the full row from every CP rank's local row.

    Args:
        local: ``(N / cp, ...)`` this rank's tokens, in local-row order.
        cu_seqlens_padded: ``(S + 1,)`` physical boundaries of the full row.
        group: the CP process group.

    Returns:
        ``(N, ...)`` in full-row order; differentiable (gradients reach every rank's ``local``).
    """
    cp_size = dist.get_world_size(group)
    total = local.shape[0] * cp_size
    gathered = _AllGatherRow.apply(local, group)
    index = torch.cat([thd_partition_indices(cu_seqlens_padded, total, cp_size, r) for r in range(cp_size)])
    # Position gathered[k] belongs at full-row slot index[k]; invert the permutation.
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(total, device=index.device)
    return gathered[inverse]


def thd_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    cp_group=None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """THD attention for this rank's local queries.

    Args:
        q: ``(N / cp, H, D)`` local queries; k, v: ``(N / cp, Hkv, D)`` local keys and values,
            H a multiple of Hkv (GQA).
        cu_seqlens: ``(S + 1,)`` real boundaries; cu_seqlens_padded: ``(S + 1,)`` physical
            boundaries of the full row (last entry N).
        causal: causal within each sample (language model) or bidirectional (vision tower).
        softmax_scale: the logit scale.
        cp_group: the CP group; None or size 1 means the row is whole.

    Returns:
        ``(N / cp, H, D)``, 0 at padding slots.
    """
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
    num_local, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"k: {kv_heads} kv heads do not divide {heads} query heads")
    cu_seqlens = cu_seqlens.to(torch.int64)
    cu_seqlens_padded = cu_seqlens_padded.to(torch.int64)
    total = num_local * cp_size
    if cp_size > 1:
        # One collective and one set of partition indices for K and V together.
        kv = gather_row_over_cp(torch.cat([k, v], dim=-1), cu_seqlens_padded, cp_group)
        k, v = kv.split([k.shape[-1], v.shape[-1]], dim=-1)

    lengths = cu_seqlens.diff()
    local_widths = cu_seqlens_padded.diff() // cp_size
    # Host reads (CPU stack): the per-segment view widths. Segments with no real token (a
    # static tail) are skipped: their queries are padding and their keys are never attended.
    kv_width, q_width = (int(x) for x in torch.stack([lengths.max(), torch.where(lengths > 0, local_widths, 0).max()]))
    kv_width, q_width = max(kv_width, 1), max(q_width, 1)

    # Keys: the first len_s slots of segment s in the full row.
    kv_offsets = torch.arange(kv_width, device=q.device)
    kv_valid = kv_offsets[None, :] < lengths[:, None]
    kv_index = torch.where(kv_valid, cu_seqlens_padded[:-1, None] + kv_offsets[None, :], total)

    # Queries: this rank's local slots of segment s, and their global offsets in the segment.
    _, q_global = thd_local_positions(cu_seqlens_padded, total, cp_size, cp_rank)
    q_offsets = torch.arange(q_width, device=q.device)
    in_segment = q_offsets[None, :] < torch.where(lengths > 0, local_widths, 0)[:, None]
    q_index = torch.where(in_segment, cu_seqlens_padded[:-1, None] // cp_size + q_offsets[None, :], num_local)
    q_position = gather_from_row(q_global, q_index)  # (S, Wq) offset of each query in its segment
    q_valid = in_segment & (q_position < lengths[:, None])

    q_s = gather_from_row(q, q_index).transpose(1, 2)  # (S, H, Wq, D)
    k_s = gather_from_row(k, kv_index).transpose(1, 2)  # (S, Hkv, Wk, D)
    v_s = gather_from_row(v, kv_index).transpose(1, 2)
    group = heads // kv_heads
    k_s, v_s = k_s.repeat_interleave(group, dim=1), v_s.repeat_interleave(group, dim=1)
    allowed = kv_valid[:, None, :]
    if causal:
        allowed = allowed & (kv_offsets[None, None, :] <= q_position[:, :, None])
    # Padding queries attend to every slot so that no softmax row is empty; their output is dropped.
    allowed = allowed | ~q_valid[:, :, None]
    out = F.scaled_dot_product_attention(
        q_s, k_s, v_s, attn_mask=allowed[:, None], scale=softmax_scale, dropout_p=dropout_p
    )
    out = out.transpose(1, 2) * q_valid[:, :, None, None]  # (S, Wq, H, D)
    row = q.new_zeros(num_local + 1, heads, head_dim)
    row = row.index_put((q_index.flatten(),), out.reshape(-1, heads, head_dim), accumulate=True)
    return row[:num_local]


class THDCoreAttention(torch.nn.Module):
    """``core_attention`` for Megatron-Core's ``SelfAttention`` on the CPU: THD and BSHD, CP.

    Constructed by Megatron-Core exactly as ``DotProductAttention`` / ``TEDotProductAttention``
    are (``config, layer_number, attn_mask_type, attention_type, ...``). Causal unless
    ``attn_mask_type`` is ``no_mask`` (the vision tower). Inputs:

    * THD (``packed_seq_params`` given): q ``(N / cp, H, D)``, k, v ``(N / cp, Hkv, D)``;
      returns ``(N / cp, H * D)``.
    * A CP group per sample (Megatron-Core's hybrid context parallelism): ``packed_seq_params.cp_group`` /
      ``local_cp_size`` replace the group for this and later calls, as in Transformer Engine.
    * BSHD: q ``(S / cp, B, H, D)``; each batch row is one causal sequence (right padding is
      harmless under a causal mask); an explicit Megatron mask ``(B|1, 1, S, S)`` (True =
      masked) is honoured on one CP rank. Returns ``(S / cp, B, H * D)``.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        self.config = config
        self.layer_number = layer_number
        self.causal = attn_mask_type != AttnMaskType.no_mask
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # The vision tower shares the language model's process groups but is never CP-split
        # (its config says context_parallel_size=1): only a CP-sized config gathers K/V.
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        use_cp = (config.context_parallel_size or 1) > 1 and cp_group is not None and cp_group.size() > 1
        self.cp_group = cp_group if use_cp else None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by the CPU THD attention")
        dropout_p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            self._take_runtime_cp_group(packed_seq_params)
            cu = packed_seq_params.cu_seqlens_q
            cu_padded = packed_seq_params.cu_seqlens_q_padded
            out = thd_cp_attention(
                query, key, value, cu, cu if cu_padded is None else cu_padded,
                causal=self.causal, softmax_scale=self.softmax_scale, cp_group=self.cp_group, dropout_p=dropout_p,
            )
            return out.reshape(out.shape[0], -1)
        return self._bshd(query, key, value, attention_mask, dropout_p)

    def _take_runtime_cp_group(self, packed_seq_params) -> None:
        """A CP group per sample, as Transformer Engine's ``TEDotProductAttention.forward`` takes it (Megatron-Core
        ``extensions/transformer_engine.py``): ``packed_seq_params.cp_group`` replaces the module's group, and
        ``local_cp_size`` without a group (it must be 1) turns CP off; either persists on the module for later calls
        that carry neither, as it does there."""
        group = getattr(packed_seq_params, "cp_group", None)
        local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
        if group is not None:
            self.cp_group = group if group.size() > 1 else None
        elif local_cp_size is not None:
            if int(local_cp_size) != 1:
                raise ValueError(f"packed_seq_params.local_cp_size: {int(local_cp_size)} without a cp_group; a CP size "
                                 "above 1 comes with its group (Megatron-Core's hybrid CP groups), 1 turns CP off")
            self.cp_group = None

    def _bshd(self, query, key, value, attention_mask, dropout_p):
        local_len, batch, heads, head_dim = query.shape
        if attention_mask is not None:
            if self.cp_group is not None:
                raise ValueError("attention_mask: an explicit BSHD mask is not supported with context parallelism")
            group = heads // key.shape[2]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(), scale=self.softmax_scale,
                                                 dropout_p=dropout_p)
            return out.permute(2, 0, 1, 3).reshape(local_len, batch, heads * head_dim)
        # Each batch row is a segment of the full length; under CP Megatron splits it zigzag,
        # so a rank's (B * S / cp) tokens are laid out exactly like a THD local row.
        cp_size = self.cp_group.size() if self.cp_group is not None else 1
        full = local_len * cp_size
        cu = torch.arange(batch + 1, device=query.device, dtype=torch.int64) * full
        q, k, v = (t.transpose(0, 1).reshape(batch * local_len, t.shape[2], head_dim) for t in (query, key, value))
        out = thd_cp_attention(q, k, v, cu, cu, causal=self.causal, softmax_scale=self.softmax_scale,
                               cp_group=self.cp_group, dropout_p=dropout_p)
        return out.reshape(batch, local_len, heads * head_dim).transpose(0, 1)
