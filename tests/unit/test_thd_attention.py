"""``thd_attention`` against per-sample ``torch.nn.functional.scaled_dot_product_attention``.

The reference runs every sample on its own (its real tokens only, GQA by repeating kv heads),
so it shares nothing with the packed implementation; padding slots of the packed row hold
garbage (huge values, inf, NaN) that must never reach an output.
"""

from __future__ import annotations

import math

import pytest
from _packing_helpers import round_up
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.bridge_thd_cpu.reference import thd_attention

GARBAGE = (1e6, float("inf"), float("nan"))




def cumsum0(values: list[int]) -> torch.Tensor:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return torch.tensor(out, dtype=torch.int32)


def build_row(lengths, slots, heads, head_dim, *, seed, garbage=None, dtype=torch.float32):
    """A packed row: sample i's real tokens at ``[start_i, start_i + len_i)`` of its slot,
    the rest of the slot filled with garbage (or random values)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(slots)
    x = torch.randn(total, heads, head_dim, generator=gen, dtype=dtype)
    real = torch.zeros(total, dtype=torch.bool)
    start = 0
    for n, slot in zip(lengths, slots):
        real[start : start + n] = True
        start += slot
    if garbage is not None:
        x[~real] = garbage
    return x, real


def per_sample_sdpa(q, k, v, lengths_q, slots_q, lengths_kv, slots_kv, *, causal, scale):
    """Reference: each sample alone through SDPA. Returns (N, H, D) with zeros at padding."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros_like(q)
    sq = skv = 0
    for lq, pq, lkv, pkv in zip(lengths_q, slots_q, lengths_kv, slots_kv):
        if lq > 0:
            qi = q[sq : sq + lq].transpose(0, 1)  # (H, L, D)
            ki = k[skv : skv + lkv].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            vi = v[skv : skv + lkv].transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
            if lkv == 0:
                oi = torch.zeros_like(qi)
            else:
                oi = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=causal, scale=scale)[0]
            out[sq : sq + lq] = oi.transpose(0, 1)
        sq += pq
        skv += pkv
    return out


def run_case(lengths, *, align=1, tail=0, heads=4, kv_heads=2, head_dim=8, causal=True, scale=None,
             garbage=None, pass_padded=None, max_seqlen=None, seed=0):
    slots = [round_up(n, align) for n in lengths]
    if tail:
        # Static-shape mode: the row tail is one extra segment with no real token.
        lengths, slots = list(lengths) + [0], slots + [tail]
    q, real = build_row(lengths, slots, heads, head_dim, seed=seed, garbage=garbage)
    k, _ = build_row(lengths, slots, kv_heads, head_dim, seed=seed + 1, garbage=garbage)
    v, _ = build_row(lengths, slots, kv_heads, head_dim, seed=seed + 2, garbage=garbage)
    cu = cumsum0(lengths)
    cu_padded = cumsum0(slots)
    if pass_padded is None:
        pass_padded = slots != list(lengths)
    out = thd_attention(
        q, k, v, cu, cu,
        cu_padded if pass_padded else None,
        cu_padded if pass_padded else None,
        causal=causal, softmax_scale=scale, max_seqlen=max_seqlen,
    )
    expected = per_sample_sdpa(q, k, v, lengths, slots, lengths, slots, causal=causal, scale=scale)
    return out, expected, real


def assert_matches(out, expected, real):
    assert out.shape == expected.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~real], torch.zeros_like(out[~real])), "padding slots must be exactly 0"


@pytest.mark.parametrize(
    "lengths",
    [[5], [1], [3, 7, 1], [0, 4, 0, 9], [6, 0], [0], [16, 16], [2, 11, 5, 1, 8]],
)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_unpadded_cu_seqlens(lengths, kv_heads):
    out, expected, real = run_case(lengths, kv_heads=kv_heads, pass_padded=False)
    assert real.all()
    assert_matches(out, expected, real)


@pytest.mark.parametrize("align", [2, 4, 8])
@pytest.mark.parametrize("garbage", GARBAGE)
def test_padded_cu_seqlens_ignore_garbage(align, garbage):
    lengths = [3, 0, 8, 5, 1, 0, 13]
    out, expected, real = run_case(lengths, align=align, garbage=garbage)
    assert (~real).any()
    assert_matches(out, expected, real)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_static_tail_segment(garbage):
    """A row tail without real tokens (static total_length) is skipped and outputs 0."""
    out, expected, real = run_case([4, 7, 2], align=4, tail=12, garbage=garbage, max_seqlen=8)
    assert_matches(out, expected, real)


def test_padding_values_do_not_influence_outputs():
    lengths = [5, 2, 9]
    a, _, real = run_case(lengths, align=8, garbage=0.0)
    b, _, _ = run_case(lengths, align=8, garbage=-3e4)
    assert torch.equal(a, b)


@pytest.mark.parametrize("align", [1, 4])
def test_non_causal(align):
    out, expected, real = run_case([6, 0, 3, 10], align=align, causal=False, garbage=float("nan"))
    assert_matches(out, expected, real)
    causal_out, _, _ = run_case([6, 0, 3, 10], align=align, causal=True, garbage=float("nan"))
    assert not torch.allclose(out[real], causal_out[real]), "causal flag has no effect"


@pytest.mark.parametrize("scale", [0.05, 1.0, 3.0])
def test_custom_softmax_scale(scale):
    out, expected, real = run_case([7, 4, 12], align=4, scale=scale, garbage=1e6)
    assert_matches(out, expected, real)
    default, _, _ = run_case([7, 4, 12], align=4, scale=None)
    explicit, _, _ = run_case([7, 4, 12], align=4, scale=1 / math.sqrt(8))
    torch.testing.assert_close(default, explicit, rtol=0, atol=0)


def test_max_seqlen_explicit_equals_computed():
    a, expected, real = run_case([3, 9, 5], align=4, max_seqlen=None, garbage=float("nan"))
    b, _, _ = run_case([3, 9, 5], align=4, max_seqlen=12, garbage=float("nan"))
    assert_matches(a, expected, real)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_first_token_attends_only_to_itself():
    """Causal: a sample's first output is its own first value (per head group)."""
    lengths = [4, 6]
    out, _, _ = run_case(lengths, heads=4, kv_heads=2)
    v, _ = build_row(lengths, lengths, 2, 8, seed=2)
    for start in (0, 4):
        torch.testing.assert_close(out[start], v[start].repeat_interleave(2, dim=0), rtol=1e-6, atol=1e-6)


def test_gradients_match_per_sample_sdpa():
    lengths, align = [5, 0, 7, 3], 4
    slots = [round_up(n, align) for n in lengths]
    q, real = build_row(lengths, slots, 4, 8, seed=0, garbage=0.0)
    k, _ = build_row(lengths, slots, 2, 8, seed=1, garbage=0.0)
    v, _ = build_row(lengths, slots, 2, 8, seed=2, garbage=0.0)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(3))
    cu, cu_padded = cumsum0(lengths), cumsum0(slots)
    grads = []
    for packed in (True, False):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        if packed:
            out = thd_attention(qq, kk, vv, cu, cu, cu_padded, cu_padded)
        else:
            out = per_sample_sdpa(qq, kk, vv, lengths, slots, lengths, slots, causal=True, scale=None)
        (out * weight).sum().backward()
        grads.append([t.grad for t in (qq, kk, vv)])
    for g_packed, g_ref in zip(*grads):
        torch.testing.assert_close(g_packed, g_ref, rtol=1e-5, atol=1e-6)
        assert torch.all(g_packed[~real] == 0), "no gradient may reach padding slots"


def test_rejects_bad_head_counts():
    q = torch.randn(4, 3, 8)
    k = v = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv heads"):
        thd_attention(q, k, v, cu, cu)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
    align=st.sampled_from([1, 2, 4, 8]),
    tail=st.sampled_from([0, 0, 8]),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (6, 3)]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3]),
    garbage=st.sampled_from((None,) + GARBAGE),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_matches_per_sample_sdpa(lengths, align, tail, heads, causal, scale, garbage, seed):
    out, expected, real = run_case(
        lengths, align=align, tail=tail, heads=heads[0], kv_heads=heads[1], causal=causal,
        scale=scale, garbage=garbage, pass_padded=True, seed=seed,
    )
    assert_matches(out, expected, real)


def test_check_can_fail_when_padding_counts_as_real():
    """Sanity of the comparison itself: attending to the padding slots (real boundaries taken
    equal to the physical ones) is caught."""
    lengths, align = [3, 6, 2], 4
    slots = [round_up(n, align) for n in lengths]
    q, real = build_row(lengths, slots, 4, 8, seed=0, garbage=0.5)
    k, _ = build_row(lengths, slots, 2, 8, seed=1, garbage=0.5)
    v, _ = build_row(lengths, slots, 2, 8, seed=2, garbage=0.5)
    cu_padded = cumsum0(slots)
    wrong = thd_attention(q, k, v, cu_padded, cu_padded, causal=False)
    expected = per_sample_sdpa(q, k, v, lengths, slots, lengths, slots, causal=False, scale=None)
    assert not torch.allclose(wrong[real], expected[real], atol=1e-3)
    wrong_causal = thd_attention(q, k, v, cu_padded, cu_padded)
    assert (wrong_causal[~real] != 0).any()


def test_reference_model_rejects_a_4d_mask_that_is_not_causal_with_padding():
    # The wrapper reads lengths from a 4D mask; a bidirectional mask carries none and must not
    # be silently taken as "every token real".
    from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL

    model = ReferenceQwen3VL.tiny()
    ids = torch.randint(1, 200, (2, 6))
    bidirectional = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    with pytest.raises(ValueError, match="^attention_mask: the 4D mask is not causal-with-padding"):
        model(ids, attention_mask=bidirectional)
