"""The pure-torch fla kernels of ``megatron.bridge_thd_cpu.gdn`` honour ``cu_seqlens``.

References: each segment evaluated alone (the same function, unpacked), Megatron-Core's
own ``torch_chunk_gated_delta_rule`` per segment, and ``torch.nn.functional.conv1d`` with causal
left padding per segment. Control: the same row without ``cu_seqlens`` leaks across segments.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.bridge_thd_cpu.gdn import causal_conv1d, chunk_gated_delta_rule, l2norm

LENGTHS = [5, 1, 0, 13, 2, 7]  # includes a length-1 and a zero-length segment
H, K, V, D, W = 3, 8, 6, 10, 4


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _segments(x, lengths):
    cu = _cu(lengths).tolist()
    return [x[:, cu[i] : cu[i + 1]] for i in range(len(lengths))]


def _gdn_inputs(T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(1, T, H, generator=gen, dtype=torch.float64))
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def test_gated_delta_rule_packed_equals_each_segment_alone():
    T = sum(LENGTHS)
    q, k, v, g, beta = _gdn_inputs(T)
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(len(LENGTHS), H, K, V, generator=gen, dtype=torch.float64)
    out, final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=_cu(LENGTHS)
    )
    assert out.shape == (1, T, H, V) and final.shape == (len(LENGTHS), H, K, V)
    pieces = zip(*(_segments(t, LENGTHS) for t in (q, k, v, g, beta)))
    for i, (qs, ks, vs, gs, bs) in enumerate(pieces):
        o_i, f_i = chunk_gated_delta_rule(qs, ks, vs, gs, bs, initial_state=h0[i : i + 1], output_final_state=True)
        torch.testing.assert_close(out[:, int(_cu(LENGTHS)[i]) : int(_cu(LENGTHS)[i + 1])], o_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(final[i : i + 1], f_i.to(final.dtype), rtol=0, atol=1e-12)
    # a zero-length segment hands its initial state straight through
    zero = LENGTHS.index(0)
    torch.testing.assert_close(final[zero], h0[zero], rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [4, 64])
def test_gated_delta_rule_matches_megatron_torch_reference_per_segment(chunk_size):
    """Megatron-Core's ``torch_chunk_gated_delta_rule`` (no cu_seqlens) on each segment alone;
    it pads every sequence to a multiple of ``chunk_size`` with g = beta = 0 itself, so any
    positive length is valid input (zero-length segments are skipped: it cannot take them)."""
    from megatron.bridge_thd_cpu.gdn import megatron_torch_rule

    torch_chunk_gated_delta_rule = megatron_torch_rule()

    T = sum(LENGTHS)
    q, k, v, g, beta = _gdn_inputs(T, seed=2)
    h0 = torch.randn(len(LENGTHS), H, K, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out, final = chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=_cu(LENGTHS), use_qk_l2norm_in_kernel=True
    )
    cu = _cu(LENGTHS).tolist()
    pieces = zip(*(_segments(t, LENGTHS) for t in (q, k, v, g, beta)))
    for i, (qs, ks, vs, gs, bs) in enumerate(pieces):
        if qs.shape[1] == 0:
            continue
        ref_o, ref_f = torch_chunk_gated_delta_rule(
            l2norm(qs), l2norm(ks), vs, gs, bs, chunk_size=chunk_size, initial_state=h0[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(out[:, cu[i] : cu[i + 1]], ref_o.to(out.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i : i + 1], ref_f.to(final.dtype), rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_without_boundaries_leaks():
    T = sum(LENGTHS)
    q, k, v, g, beta = _gdn_inputs(T, seed=4)
    packed, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=_cu(LENGTHS))
    whole, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    first = LENGTHS[0]
    torch.testing.assert_close(whole[:, :first], packed[:, :first], rtol=0, atol=1e-12)  # causal: segment 0 agrees
    assert (whole - packed).abs().max() > 1e-2  # later segments see their predecessors' state


def test_gated_delta_rule_gradients_match_per_segment():
    T = sum(LENGTHS)
    inputs = [t.requires_grad_() for t in _gdn_inputs(T, seed=5)]
    out, _ = chunk_gated_delta_rule(*inputs, cu_seqlens=_cu(LENGTHS))
    weights = torch.randn_like(out)
    packed_grads = torch.autograd.grad((out * weights).sum(), inputs)
    alone = [torch.cat([chunk_gated_delta_rule(*p)[0] for p in zip(*(_segments(t, LENGTHS) for t in inputs))], dim=1)]
    alone_grads = torch.autograd.grad((alone[0] * weights).sum(), inputs)
    for a, b in zip(packed_grads, alone_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _conv_inputs(T, seed=6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64)
    bias = torch.randn(D, generator=gen, dtype=torch.float64)
    return x, weight, bias


@pytest.mark.parametrize("activation", [None, "silu"])
def test_causal_conv1d_equals_conv1d_with_causal_left_padding_per_segment(activation):
    T = sum(LENGTHS)
    x, weight, bias = _conv_inputs(T)
    y, final = causal_conv1d(x, weight, bias, activation=activation, output_final_state=True, cu_seqlens=_cu(LENGTHS))
    assert y.shape == x.shape and final.shape == (len(LENGTHS), D, W)
    cu = _cu(LENGTHS).tolist()
    for i, xs in enumerate(_segments(x, LENGTHS)):
        if xs.shape[1]:
            ref = F.conv1d(F.pad(xs.transpose(1, 2), (W - 1, 0)), weight.unsqueeze(1), bias, groups=D).transpose(1, 2)
            if activation:
                ref = F.silu(ref)
            torch.testing.assert_close(y[:, cu[i] : cu[i + 1]], ref, rtol=0, atol=1e-12)
        # the same function on the segment alone, and the final state = its last W inputs
        alone, f_i = causal_conv1d(xs, weight, bias, activation=activation, output_final_state=True)
        torch.testing.assert_close(y[:, cu[i] : cu[i + 1]], alone, rtol=0, atol=1e-12)
        torch.testing.assert_close(final[i : i + 1], f_i, rtol=0, atol=0)
        tail = F.pad(xs.transpose(1, 2), (W, 0))[..., -W:]
        torch.testing.assert_close(final[i : i + 1], tail, rtol=0, atol=0)


def test_causal_conv1d_initial_state_continues_a_sequence():
    x, weight, bias = _conv_inputs(12, seed=7)
    whole, _ = causal_conv1d(x, weight, bias, activation="silu")
    head, state = causal_conv1d(x[:, :5], weight, bias, activation="silu", output_final_state=True)
    tail, _ = causal_conv1d(x[:, 5:], weight, bias, activation="silu", initial_state=state)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), whole, rtol=0, atol=1e-12)
    # and per segment through cu_seqlens
    packed, _ = causal_conv1d(
        torch.cat([x[:, 5:], x[:, 5:]], dim=1), weight, bias, activation="silu",
        initial_state=torch.cat([state, torch.zeros_like(state)]), cu_seqlens=_cu([7, 7]),
    )
    torch.testing.assert_close(packed[:, :7], whole[:, 5:], rtol=0, atol=1e-12)
    torch.testing.assert_close(packed[:, 7:], causal_conv1d(x[:, 5:], weight, bias, activation="silu")[0], rtol=0, atol=1e-12)


def test_gated_delta_rule_initial_state_continues_a_sequence():
    q, k, v, g, beta = _gdn_inputs(11, seed=8)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    head, state = chunk_gated_delta_rule(*(t[:, :4] for t in (q, k, v, g, beta)), output_final_state=True)
    tail, final = chunk_gated_delta_rule(*(t[:, 4:] for t in (q, k, v, g, beta)), initial_state=state, output_final_state=True)
    torch.testing.assert_close(torch.cat([head, tail], dim=1), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, whole_final, rtol=0, atol=1e-12)


def test_causal_conv1d_without_boundaries_leaks():
    T = sum(LENGTHS)
    x, weight, bias = _conv_inputs(T, seed=9)
    packed, _ = causal_conv1d(x, weight, bias, activation="silu", cu_seqlens=_cu(LENGTHS))
    whole, _ = causal_conv1d(x, weight, bias, activation="silu")
    assert (whole - packed).abs().max() > 1e-2


def test_cu_seqlens_contract_is_enforced():
    x, weight, bias = _conv_inputs(10)
    with pytest.raises(ValueError):  # boundaries must end at the row length
        causal_conv1d(x, weight, bias, cu_seqlens=_cu([4, 4]))
    with pytest.raises(ValueError):  # varlen means batch 1
        causal_conv1d(torch.cat([x, x]), weight, bias, cu_seqlens=_cu([10]))
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(*_gdn_inputs(8), cu_seqlens=_cu([4, 3]))


def test_cpu_stack_installs_the_kernels_scoped_and_reversibly():
    """Without fla, cpu_stack points Megatron-Core's GDN names (in ``common`` and where ``gdn.py``
    imported them by name) at these kernels and restores every one on exit."""
    import importlib.util

    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.ssm.gated_delta_net.gdn as gdn_module

    from megatron.bridge_thd_cpu import gdn as kernels
    from megatron.bridge_thd_cpu.stack import cpu_stack

    names = [(common, "HAVE_FLA"), (common, "causal_conv1d"), (common, "l2norm"), (common, "chunk_gated_delta_rule"),
             (gdn_module, "causal_conv1d"), (gdn_module, "chunk_gated_delta_rule"), (common, "get_cuda_rng_tracker"),
             (common._GDNBase, "_prepare_input_for_gated_delta_rule")]
    before = [getattr(owner, name) for owner, name in names]
    with cpu_stack():
        if importlib.util.find_spec("fla") is None:
            assert common.HAVE_FLA is True
            assert gdn_module.chunk_gated_delta_rule is kernels.chunk_gated_delta_rule
            assert gdn_module.causal_conv1d is kernels.causal_conv1d and common.l2norm is kernels.l2norm
    assert all(getattr(owner, name) is b for (owner, name), b in zip(names, before))
