"""Pure-torch stand-ins for the flash-linear-attention kernels Megatron-Core's Gated DeltaNet calls.

Megatron-Core (``ssm/gated_delta_net``) imports ``causal_conv1d``, ``l2norm``
and ``chunk_gated_delta_rule`` from flash-linear-attention (Triton, CUDA only) and refuses to
build a GDN layer without them; its own torch fallback ``torch_chunk_gated_delta_rule`` refuses
``cu_seqlens``. These functions keep fla's signatures and semantics, including the varlen
contract: with ``cu_seqlens`` the batch must be 1, every segment ``[cu[i], cu[i+1])`` is an
independent sequence (the conv window and the recurrent state restart at each boundary),
``initial_state`` has one entry per segment and the final state is returned per segment.

Segments are never looped over in Python: the row is gathered into a padded
``(num_segments, max_len, ...)`` view, the computation runs over ``max_len`` (the recurrence is
token by token, vectorised over segments and heads), and the valid positions are scattered back.
Padding positions are neutral (zero input to the conv, ``beta = 0`` and ``g = 0`` in the
recurrence), so each segment's final state is the state after its last real token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "chunk_gated_delta_rule", "l2norm", "megatron_torch_rule", "pack_segments",
           "unpack_segments"]


def megatron_torch_rule():
    """Megatron-Core's own ``torch_chunk_gated_delta_rule`` (deterministic mode, no ``cu_seqlens``), from
    the module the installed Megatron-Core defines it in (``upstream_line().gdn_torch_rule_module``)."""
    import importlib

    from megatron.bridge_thd.upstream.line import upstream_line

    module = upstream_line().gdn_torch_rule_module
    if module is None:
        raise ImportError("the installed Megatron-Core defines no torch_chunk_gated_delta_rule")
    return importlib.import_module(module).torch_chunk_gated_delta_rule


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, output_dtype: torch.dtype | None = None, **_):
    """fla's ``l2norm``: ``x / sqrt(sum(x**2) + eps)`` over ``dim`` (fp32 inside)."""
    y = x.float() * torch.rsqrt(x.float().pow(2).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype if output_dtype is not None else x.dtype)


def _segment_layout(cu_seqlens: torch.Tensor, total: int):
    cu = cu_seqlens.to(dtype=torch.long).flatten()
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {total}, got {cu.tolist()}")
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    max_len = int(lengths.max())
    offsets = torch.arange(max_len, device=cu.device)
    valid = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # (S, L)
    index = (cu[:-1].unsqueeze(1) + offsets.unsqueeze(0)).clamp(max=max(total - 1, 0))
    return index, valid, lengths


def pack_segments(x: torch.Tensor, cu_seqlens: torch.Tensor):
    """``x`` of shape ``(1, T, ...)`` -> ``(S, L_max, ...)`` (zeros past each segment's end), the
    validity mask ``(S, L_max)`` and the segment lengths."""
    if x.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1, got {x.shape[0]}")
    index, valid, lengths = _segment_layout(cu_seqlens, x.shape[1])
    row = x[0]
    padded = row[index.flatten()].reshape(*index.shape, *row.shape[1:])
    mask = valid.reshape(*valid.shape, *([1] * (row.dim() - 1)))
    return padded * mask.to(padded.dtype), valid, lengths


def unpack_segments(padded: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_segments`: ``(S, L_max, ...)`` -> ``(1, T, ...)`` (segments are
    contiguous and in order, so the row-major valid positions are the row's token order)."""
    return padded[valid].unsqueeze(0)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: str | None = None,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
    **_,
):
    """Depthwise causal conv over time, fla's ``causal_conv1d`` contract.

    Args:
        x: ``(B, T, D)``.
        weight: ``(D, W)`` (None: identity).
        bias: ``(D,)`` or None.
        residual: ``(B, T, D)`` added to the output, or None.
        initial_state: ``(N, D, W)``: the last ``W`` inputs before each sequence (most recent
            last; only the last ``W - 1`` are read). ``N`` = B, or the number of segments.
        output_final_state: also return the last ``W`` inputs of each sequence, ``(N, D, W)``.
        activation: None, ``"silu"`` or ``"swish"``.
        cu_seqlens: ``(N + 1,)`` segment boundaries of a ``B = 1`` row.

    Returns:
        ``(y, final_state)``: ``y`` like ``x``; ``final_state`` None unless asked for.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    B, T, D = x.shape
    if weight is None:
        y = x
        if activation is not None:
            y = F.silu(y)
        return (y + residual if residual is not None else y), None
    W = weight.shape[-1]
    weight = weight.reshape(D, W)
    if cu_seqlens is not None:
        xs, valid, lengths = pack_segments(x, cu_seqlens)
    else:
        xs, valid, lengths = x, None, torch.full((B,), T, dtype=torch.long, device=x.device)
    N, L, _ = xs.shape
    xs_t = xs.transpose(1, 2)  # (N, D, L)
    if initial_state is None:
        state = xs_t.new_zeros(N, D, W)
    else:
        state = initial_state.to(xs_t.dtype)
        if state.shape != (N, D, W):
            raise ValueError(f"initial_state must be {(N, D, W)}, got {tuple(state.shape)}")
    z = torch.cat([state, xs_t], dim=-1)  # (N, D, W + L)
    if L:
        y = F.conv1d(z[..., 1:], weight.unsqueeze(1).to(xs_t.dtype), bias, groups=D)  # (N, D, L)
    else:
        y = xs_t
    if activation is not None:
        y = F.silu(y)
    y = y.transpose(1, 2)
    if valid is not None:
        y = unpack_segments(y, valid)
    y = y.to(x.dtype)
    if residual is not None:
        y = y + residual
    final_state = None
    if output_final_state:
        positions = lengths.unsqueeze(1) + torch.arange(W, device=x.device).unsqueeze(0)  # (N, W)
        final_state = torch.gather(z, 2, positions.unsqueeze(1).expand(N, D, W))
    return y, final_state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **_,
):
    """The gated delta rule, fla's ``chunk_gated_delta_rule`` contract, as a recurrence.

    Per head, with state ``S`` of shape ``(K, V)``, for each token t::

        S = exp(g_t) * S
        S = S + k_t (beta_t * (v_t - S^T k_t))^T
        o_t = S^T (scale * q_t)

    Args:
        q, k: ``(B, T, H, K)``; v: ``(B, T, HV, V)`` (HV a multiple of H: q/k heads are repeated).
        g: ``(B, T, HV)`` log decay; beta: ``(B, T, HV)`` (None: ones).
        scale: default ``K ** -0.5``.
        initial_state: ``(N, HV, K, V)``, N = B or the number of segments.
        output_final_state: also return the ``(N, HV, K, V)`` final states: fp32 (fp64 for
            fp64 inputs); computed in fp64 on the CPU, fp32 elsewhere.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        cu_seqlens: ``(N + 1,)`` segment boundaries of a ``B = 1`` row.

    Returns:
        ``(o, final_state)``: ``o`` of shape ``(B, T, HV, V)`` in ``q``'s dtype.
    """
    out_dtype = q.dtype
    K = q.shape[-1]
    if scale is None:
        scale = K**-0.5
    if beta is None:
        beta = torch.ones_like(g)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    HV = v.shape[2]
    if q.shape[2] != HV:
        q = q.repeat_interleave(HV // q.shape[2], dim=2)
        k = k.repeat_interleave(HV // k.shape[2], dim=2)
    # fp64 on the CPU: the recurrence's long products of decays otherwise sink into fp32
    # denormals (very slow CPU arithmetic) and accumulate order-dependent rounding.
    compute = torch.float64 if q.device.type == "cpu" else torch.float32
    q, k, v, g, beta = (t.to(compute) for t in (q, k, v, g, beta))
    if cu_seqlens is not None:
        (q, valid, _), (k, _, _), (v, _, _), (g, _, _), (beta, _, _) = (
            pack_segments(t, cu_seqlens) for t in (q, k, v, g, beta)
        )
    else:
        valid = None
    N, L, H, _ = q.shape
    V = v.shape[-1]
    if initial_state is None:
        state = q.new_zeros(N, H, K, V)
    else:
        state = initial_state.to(compute)
        if state.shape != (N, H, K, V):
            raise ValueError(f"initial_state must be {(N, H, K, V)}, got {tuple(state.shape)}")
    q = q * scale
    decay = g.exp()
    outputs = []
    for t in range(L):
        k_t = k[:, t]  # (N, H, K)
        state = state * decay[:, t, :, None, None]
        memory = torch.einsum("nhk,nhkv->nhv", k_t, state)
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append(torch.einsum("nhk,nhkv->nhv", q[:, t], state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(N, 0, H, V)
    if valid is not None:
        o = unpack_segments(o, valid)
    state_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    return o.to(out_dtype), (state.to(state_dtype) if output_final_state else None)
