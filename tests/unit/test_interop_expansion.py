"""Boundaries for models that expand image placeholders in ``forward`` (LLaVA style).

The end-to-end proof follows the seed (Megatron-LM PR 3427): a tiny LLaVA-style model, packed
vs each sample run alone, compared with ``token_mult_prob_error`` (mean over tokens of
``exp(|logp_a - logp_b|)``). The per-sample side builds its expanded sequence with a Python loop
and runs dense causal SDPA, so it shares nothing with the packed side but the weights. The unit
tests check hand-computed cases and a slow per-sample Python reference.
"""

from __future__ import annotations

import random

import pytest
from _packing_helpers import round_up
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.bridge_thd.interop.expansion import (
    ExpandedBoundaries,
    expand_cu_seqlens,
    expand_row,
    expanded_positions,
)
from megatron.bridge_thd.packing import pack_bshd_to_thd, scatter_into_row, segment_index
from megatron.bridge_thd_testbed.opcount import count_ops
from megatron.bridge_thd_cpu.reference import thd_attention




def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Slow reference: per sample, Python lists only.
# ----------------------------------------------------------------------------------------------


def slow_expand(cu, cu_padded, expansion, align_to):
    """Python-loop reference of the documented layout: expanded real tokens, expanded collapsed
    padding, then alignment padding at the end of each segment's slot."""
    cu_out, cu_padded_out, positions, row = [0], [0], [], []
    longest = 0
    for i in range(len(cu) - 1):
        start, length, slot = cu_padded[i], cu[i + 1] - cu[i], cu_padded[i + 1] - cu_padded[i]
        base = cu_padded_out[-1]
        offset = 0
        for j in range(start, start + slot):
            positions.append(base + offset)
            row.extend([j] * expansion[j])
            offset += expansion[j]
        real = sum(expansion[start : start + length])
        aligned = round_up(offset, align_to)
        row.extend([None] * (aligned - offset))
        cu_out.append(cu_out[-1] + real)
        cu_padded_out.append(base + aligned)
        if real > 0:
            longest = max(longest, aligned)
    return cu_out, cu_padded_out, (longest or align_to), positions, row


# ----------------------------------------------------------------------------------------------
# Hand cases
# ----------------------------------------------------------------------------------------------


def test_one_image_in_sample_0_moves_the_later_boundary():
    # Collapsed lengths [3, 4]; slot 1 (sample 0) is an image of 5 embeddings -> [7, 4].
    expansion = t([1, 5, 1, 1, 1, 1, 1])
    out = expand_cu_seqlens(t([0, 3, 7]), t([0, 3, 7]), expansion)
    assert isinstance(out, ExpandedBoundaries)
    cu, cu_padded, max_seqlen = out  # unpacks like a tuple
    assert cu.tolist() == [0, 7, 11] and cu_padded.tolist() == [0, 7, 11]
    assert cu.dtype == torch.int32 and cu_padded.dtype == torch.int32
    assert max_seqlen == 7 and out.row_length == 11
    assert out.positions.tolist() == [0, 1, 6, 7, 8, 9, 10]
    assert out.packed_seq_params.qkv_format == "thd"
    assert out.packed_seq_params.pad_between_seqs is False
    assert out.packed_seq_params.cu_seqlens_kv_padded.tolist() == [0, 7, 11]
    # None for the padded pair means "no padding": same answer.
    again = expand_cu_seqlens(t([0, 3, 7]), None, expansion)
    assert again.cu_seqlens_padded.tolist() == [0, 7, 11] and again.positions.tolist() == out.positions.tolist()


def test_alignment_padding_goes_to_the_end_of_each_expanded_slot():
    # Lengths [3, 4] packed with align 4: cu_padded [0, 4, 8]. Sample 0: text, image k=6, text,
    # 1 collapsed padding slot -> 9 expanded physical slots, rounded up to 12 (3 extra padding at
    # its end); its real length is 8. Sample 1 (4 text tokens) starts at 12.
    expansion = t([1, 6, 1, 1, 1, 1, 1, 1])
    out = expand_cu_seqlens(t([0, 3, 7]), t([0, 4, 8]), expansion, align_to=4)
    assert out.cu_seqlens.tolist() == [0, 8, 12]
    assert out.cu_seqlens_padded.tolist() == [0, 12, 16]
    assert out.max_seqlen == 12 and out.row_length == 16
    assert out.positions.tolist() == [0, 1, 7, 8, 12, 13, 14, 15]
    assert out.packed_seq_params.pad_between_seqs is True
    row = out.expand_row(torch.arange(8), -1)
    assert row.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 3, -1, -1, -1, 4, 5, 6, 7]
    # Without re-alignment the row is exactly the cumulative sum.
    plain = expand_cu_seqlens(t([0, 3, 7]), t([0, 4, 8]), expansion)
    assert plain.cu_seqlens_padded.tolist() == [0, 9, 13]
    assert plain.positions.tolist() == [0, 1, 7, 8, 9, 10, 11, 12]


def test_real_boundaries_are_mapped_from_row_positions_not_from_cu_seqlens():
    # Lengths [3, 4] with align 4 (cu_padded [0, 4, 8]); the last real token of sample 1 (slot 7)
    # is an image of 3. Its real end is row position 8, not cu_seqlens[2] = 7: mapping cu_seqlens
    # through the cumulative sum directly would give [0, 7, 11].
    expansion = t([1, 5, 1, 1, 1, 1, 1, 3])
    out = expand_cu_seqlens(t([0, 3, 7]), t([0, 4, 8]), expansion, align_to=4)
    assert out.cu_seqlens.tolist() == [0, 7, 13]
    assert out.cu_seqlens_padded.tolist() == [0, 8, 16]
    assert out.positions.tolist() == [0, 1, 6, 7, 8, 9, 10, 11]
    plain = expand_cu_seqlens(t([0, 3, 7]), t([0, 4, 8]), expansion)
    assert plain.cu_seqlens.tolist() == [0, 7, 13] and plain.cu_seqlens_padded.tolist() == [0, 8, 14]


def test_images_in_every_sample_shift_every_later_boundary():
    # Three samples of 2 tokens, each starting with an image of 3, 4, 5 embeddings.
    expansion = t([3, 1, 4, 1, 5, 1])
    out = expand_cu_seqlens(t([0, 2, 4, 6]), None, expansion)
    assert out.cu_seqlens.tolist() == [0, 4, 9, 15]
    assert out.positions.tolist() == [0, 3, 4, 8, 9, 14]


def test_no_image_anywhere_is_the_identity():
    cu = t([0, 3, 3, 7])
    out = expand_cu_seqlens(cu, t([0, 4, 4, 8]), torch.ones(8, dtype=torch.int32))
    assert out.cu_seqlens.tolist() == [0, 3, 3, 7]
    assert out.cu_seqlens_padded.tolist() == [0, 4, 4, 8]
    assert out.positions.tolist() == list(range(8))


def test_images_in_some_samples_only():
    # Samples of 2, 3, 2, 1 tokens; only sample 1 (its middle token) is an image of 7.
    expansion = t([1, 1, 1, 7, 1, 1, 1, 1])
    out = expand_cu_seqlens(t([0, 2, 5, 7, 8]), None, expansion)
    assert out.cu_seqlens.tolist() == [0, 2, 11, 13, 14]
    assert out.max_seqlen == 9


def test_a_static_tail_segment_is_mapped_but_does_not_set_max_seqlen():
    # Static packing: samples of 3 and 2 tokens (align 2: slots 4, 2) and a tail of 10 padding
    # slots as a third segment without real tokens. Image of 4 at slot 0.
    expansion = torch.ones(16, dtype=torch.int64)
    expansion[0] = 4
    out = expand_cu_seqlens(t([0, 3, 5, 5]), t([0, 4, 6, 16]), expansion, align_to=2)
    assert out.cu_seqlens.tolist() == [0, 6, 8, 8]
    assert out.cu_seqlens_padded.tolist() == [0, 8, 10, 20]
    assert out.max_seqlen == 8  # the tail's 10 slots do not count
    assert out.row_length == 20


def test_empty_row():
    out = expand_cu_seqlens(t([0]), t([0]), t([]))
    assert out.cu_seqlens.tolist() == [0] and out.row_length == 0 and out.positions.numel() == 0


def test_expanded_positions_and_expand_row():
    expansion = t([2, 1, 3])
    assert expanded_positions(expansion).tolist() == [0, 2, 3]
    assert expand_row(t([10, 11, 12]), expansion, -1).tolist() == [10, 10, 11, 12, 12, 12]
    values = torch.arange(6.0).reshape(3, 2).requires_grad_()
    row = expand_row(values, expansion, 0.0)
    assert row.shape == (6, 2)
    row.sum().backward()
    # Each collapsed slot's gradient is its expansion (repeated that many times).
    assert values.grad[:, 0].tolist() == [2.0, 1.0, 3.0]


# ----------------------------------------------------------------------------------------------
# Property test against the slow reference
# ----------------------------------------------------------------------------------------------


@st.composite
def collapsed_rows(draw):
    num = draw(st.integers(0, 6))
    align = draw(st.sampled_from([1, 2, 3, 4, 8]))
    packed_align = draw(st.sampled_from([1, align]))
    lengths = [draw(st.integers(0, 7)) for _ in range(num)]
    slots = [round_up(n, packed_align) + draw(st.integers(0, 2)) * packed_align for n in lengths]
    if draw(st.booleans()):  # static tail segment
        lengths.append(0)
        slots.append(draw(st.integers(0, 9)))
    total = sum(slots)
    expansion = [draw(st.sampled_from([1, 1, 1, 2, 3, 5, 9])) for _ in range(total)]
    return lengths, slots, expansion, align


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collapsed_rows(), st.sampled_from([torch.int32, torch.int64]))
def test_matches_the_slow_per_sample_reference(case, dtype):
    lengths, slots, expansion, align = case
    cu, cu_padded = [0], [0]
    for n, s in zip(lengths, slots):
        cu.append(cu[-1] + n)
        cu_padded.append(cu_padded[-1] + s)
    want_cu, want_padded, want_max, want_positions, want_row = slow_expand(cu, cu_padded, expansion, align)
    out = expand_cu_seqlens(
        torch.tensor(cu, dtype=dtype), torch.tensor(cu_padded, dtype=dtype), torch.tensor(expansion, dtype=dtype),
        align_to=align,
    )
    assert out.cu_seqlens.tolist() == want_cu
    assert out.cu_seqlens_padded.tolist() == want_padded
    assert out.max_seqlen == want_max and out.max_seqlen % align == 0
    assert out.row_length == len(want_row) == want_padded[-1]
    assert out.positions.tolist() == want_positions
    n = len(expansion)
    assert out.expand_row(torch.arange(n), -1).tolist() == [-1 if v is None else v for v in want_row]
    if align == 1:
        assert out.positions.tolist() == expanded_positions(torch.tensor(expansion, dtype=dtype)).tolist()


# ----------------------------------------------------------------------------------------------
# Cost: one host read, op count independent of the number of samples / images
# ----------------------------------------------------------------------------------------------


def _random_case(num_samples, seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 20) for _ in range(num_samples)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    expansion = [rng.choice([1, 1, 1, 4, 9]) for _ in range(cu[-1])]
    return t(cu), t(expansion)


def test_one_host_read_and_no_loop_over_samples():
    counts = []
    for num_samples in (2, 40):
        cu, expansion = _random_case(num_samples, seed=num_samples)
        with count_ops() as c:
            out = expand_cu_seqlens(cu, cu, expansion, align_to=4)
        assert c.host_syncs == 1, c.sync_sites
        with count_ops() as c_row:
            out.expand_row(torch.arange(expansion.numel()), -1)
            expanded_positions(expansion)
        assert c_row.host_syncs == 0, c_row.sync_sites
        counts.append(c.ops)
    assert counts[0] == counts[1]


# ----------------------------------------------------------------------------------------------
# Bad inputs
# ----------------------------------------------------------------------------------------------

CU = t([0, 3, 7])


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((CU, CU, t([1] * 6)), {}, r"^expansion: has 6 entries.*cu_seqlens_padded\[-1\] = 7"),
        ((CU, CU, t([1] * 8)), {}, r"^expansion: has 8 entries"),
        ((CU, CU, t([1, 0, 1, 1, 1, 1, 1])), {}, r"^expansion: every entry must be >= 1.*entry 1 is 0"),
        ((CU, CU, t([1, 1, 1, -3, 1, 1, 1])), {}, r"^expansion: every entry must be >= 1.*entry 3 is -3"),
        ((CU, CU, torch.ones(7)), {}, r"^expansion: expected an integer dtype"),
        ((CU, CU, torch.ones(7, dtype=torch.bool)), {}, r"^expansion: expected an integer dtype"),
        ((CU, CU, torch.ones(1, 7, dtype=torch.int64)), {}, r"^expansion: expected a 1D tensor"),
        ((CU, CU, [1] * 7), {}, r"^expansion: expected a 1D integer torch.Tensor"),
        ((CU.float(), CU, t([1] * 7)), {}, r"^cu_seqlens: expected an integer dtype"),
        ((t([]), None, t([])), {}, r"^cu_seqlens: expected \(S \+ 1,\)"),
        ((CU, t([0, 7]), t([1] * 7)), {}, r"^cu_seqlens_padded: shape \(2,\) does not match"),
        ((t([1, 3, 7]), None, t([1] * 7)), {}, r"^cu_seqlens: boundaries must start at 0"),
        ((t([0, 5, 3]), t([0, 5, 7]), t([1] * 7)), {}, r"^cu_seqlens: boundaries must be non-decreasing"),
        ((t([0, 5, 7]), t([0, 4, 7]), t([1] * 7)), {}, r"^cu_seqlens_padded: every physical slot"),
        ((CU, CU, t([1] * 7)), {"align_to": 0}, r"^align_to: expected an int >= 1"),
        ((CU, CU, t([1] * 7)), {"align_to": True}, r"^align_to: expected an int >= 1"),
        ((CU, CU, t([1] * 7)), {"align_to": 2.0}, r"^align_to: expected an int >= 1"),
        ((CU, CU, t([1, 2**31, 1, 1, 1, 1, 1])), {}, r"^expansion: the expanded row would exceed"),
    ],
)
def test_bad_inputs_are_refused_naming_the_argument(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        expand_cu_seqlens(*args, **kwargs)


def test_expand_row_refuses_bad_inputs():
    with pytest.raises(ValueError, match=r"^values: expected \(3, \.\.\.\)"):
        expand_row(t([1, 2]), t([1, 1, 1]), 0)
    with pytest.raises(ValueError, match=r"^expansion: every entry must be >= 1.*entry 1 is 0"):
        expand_row(t([1, 2, 3]), t([1, 0, 1]), 0)
    with pytest.raises(ValueError, match=r"^positions: shape"):
        expand_row(t([1, 2, 3]), t([1, 1, 1]), 0, positions=t([0, 1]))
    with pytest.raises(ValueError, match=r"^row_length: expected an int >= 0"):
        expand_row(t([1, 2, 3]), t([1, 1, 1]), 0, row_length=-1)
    with pytest.raises(ValueError, match=r"^expansion: expected an integer dtype"):
        expanded_positions(torch.ones(3))


# ----------------------------------------------------------------------------------------------
# End to end: a tiny LLaVA-style model, packed vs each sample alone
# ----------------------------------------------------------------------------------------------

VOCAB, HIDDEN, HEADS, FEATURES, MAX_POSITIONS = 64, 32, 4, 12, 256
PAD, IMAGE = 0, 5  # text tokens are drawn from [8, VOCAB)


class TinyLlava(torch.nn.Module):
    """Token embedding; each ``IMAGE`` token is replaced in forward by k_i embeddings projected
    from the image's features ``(k_i, FEATURES)``; learned absolute positions (per sample, from
    the boundaries it is given); two pre-norm causal layers; an LM head."""

    def __init__(self, seed: int = 0, layers: int = 2):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.position = torch.nn.Embedding(MAX_POSITIONS, HIDDEN)
        self.vision = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN)
        )
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                dict(
                    norm1=torch.nn.LayerNorm(HIDDEN),
                    qkv=torch.nn.Linear(HIDDEN, 3 * HIDDEN),
                    out=torch.nn.Linear(HIDDEN, HIDDEN),
                    norm2=torch.nn.LayerNorm(HIDDEN),
                    mlp=torch.nn.Sequential(
                        torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(2 * HIDDEN, HIDDEN)
                    ),
                )
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def _trunk(self, h, positions, attend):
        h = h + self.position(positions)
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["norm1"](h)).view(h.shape[0], 3, HEADS, HIDDEN // HEADS).unbind(1)
            h = h + layer["out"](attend(q, k, v).reshape(h.shape[0], HIDDEN))
            h = h + layer["mlp"](layer["norm2"](h))
        return self.head(self.norm(h))

    def forward_alone(self, ids: list[int], images: list[torch.Tensor]) -> torch.Tensor:
        """One sample, unpacked: expansion by a Python loop, dense causal SDPA. ``(L_exp, V)``."""
        pieces, next_image = [], iter(images)
        for token in ids:
            pieces.append(self.vision(next(next_image)) if token == IMAGE else self.embed(t([token])))
        h = torch.cat(pieces)

        def attend(q, k, v):
            q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # (H, L, D)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)

        return self._trunk(h, torch.arange(h.shape[0]), attend)

    def forward_packed(self, row_ids, expansion, image_features, cu, cu_padded, max_seqlen, positions, row_length):
        """A packed collapsed row ``(N,)``, expanded in forward the LLaVA way; attention over
        the THD boundaries it is given (which must describe the expanded row). ``(R, V)``."""
        ids = expand_row(row_ids, expansion, PAD, positions=positions, row_length=row_length)
        h = self.embed(ids)
        h = h.masked_scatter((ids == IMAGE)[:, None], self.vision(image_features))
        index, valid = segment_index(cu, cu_padded, row_length=row_length, max_seqlen=max_seqlen)
        offsets = torch.arange(max_seqlen).expand_as(index)
        token_positions = scatter_into_row(offsets, index, row_length, 0)[0]

        def attend(q, k, v):
            return thd_attention(q, k, v, cu, cu, cu_padded, cu_padded, causal=True, max_seqlen=max_seqlen)

        return self._trunk(h, token_positions, attend)


def make_samples(seed: int = 1):
    """Sample 0 is text only (its boundaries stay right without the remap); later samples hold
    1-3 images of k in 3..9 embeddings at random places (also first, last, adjacent)."""
    rng = random.Random(seed)
    plan = [(14, 0), (16, 2), (18, 3), (12, 1), (10, 0), (17, 2), (15, 3)]  # (collapsed length, images)
    samples = []
    for length, num_images in plan:
        ids = [rng.randrange(8, VOCAB) for _ in range(length)]
        for place in rng.sample(range(length - 1), num_images):  # the last token stays text
            ids[place] = IMAGE
        ks = [rng.randint(3, 9) for _ in range(num_images)]
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        images = [torch.randn(k, FEATURES, generator=gen) for k in ks]
        samples.append((ids, ks, images))
    return samples


def labelled_positions(ids):
    """(collapsed index, next-token label) of every text token whose next token is text."""
    return [(j, ids[j + 1]) for j in range(len(ids) - 1) if ids[j] != IMAGE and ids[j + 1] != IMAGE]


def token_mult_prob_error(logp_a: torch.Tensor, logp_b: torch.Tensor) -> float:
    return float(torch.exp((logp_a - logp_b).abs()).mean())


@pytest.fixture(scope="module")
def tiny():
    model = TinyLlava(seed=0).eval()
    samples = make_samples()
    with torch.no_grad():
        alone = []
        for ids, ks, images in samples:
            logp = torch.log_softmax(model.forward_alone(ids, images), dim=-1)
            offsets, image_sizes = [0], iter(ks)  # expanded index of each collapsed token
            for token in ids:
                offsets.append(offsets[-1] + (next(image_sizes) if token == IMAGE else 1))
            alone.append(torch.stack([logp[offsets[j], label] for j, label in labelled_positions(ids)]))
    return model, samples, alone


def packed_logps(model, samples, *, align_to: int, remap: bool):
    """Pack the collapsed batch, expand in forward, and read log p(label) of every labelled text
    token: (per-sample list of logps, collapsed boundaries, the boundaries attention used)."""
    width = max(len(ids) for ids, _, _ in samples)
    input_ids = torch.full((len(samples), width), PAD, dtype=torch.int64)
    keep = torch.zeros(len(samples), width, dtype=torch.bool)
    for i, (ids, _, _) in enumerate(samples):
        input_ids[i, : len(ids)] = t(ids)
        keep[i, : len(ids)] = True
    packed = pack_bshd_to_thd(input_ids, keep, align_to=align_to, pad_token_id=PAD)
    row_ids = packed.input_ids[0]
    expansion = torch.ones_like(row_ids)
    expansion[row_ids == IMAGE] = t([k for _, ks, _ in samples for k in ks])
    features = torch.cat([image for _, _, images in samples for image in images])

    expanded = expand_cu_seqlens(packed.cu_seqlens, packed.cu_seqlens_padded, expansion, align_to=align_to)
    if remap:
        cu, cu_padded, max_seqlen = expanded
    else:  # the bug: collapsed boundaries used in expanded space
        cu, cu_padded, max_seqlen = packed.cu_seqlens, packed.cu_seqlens_padded, packed.max_seqlen
    with torch.no_grad():
        logits = model.forward_packed(
            row_ids, expansion, features, cu, cu_padded, max_seqlen, expanded.positions, expanded.row_length
        )
    logp = torch.log_softmax(logits, dim=-1)
    # (B, T) expanded row slot of each token (padding positions: index N, read as -1, unused).
    slots = F.pad(expanded.positions, (0, 1), value=-1)[packed.packed_index]
    per_sample = [
        torch.stack([logp[slots[i, j], label] for j, label in labelled_positions(ids)])
        for i, (ids, _, _) in enumerate(samples)
    ]
    return per_sample, packed, expanded


@pytest.mark.parametrize("align_to", [1, 4])
def test_packed_equals_per_sample_with_the_remap(tiny, align_to):
    model, samples, alone = tiny
    packed, collapsed, expanded = packed_logps(model, samples, align_to=align_to, remap=True)
    a, b = torch.cat(packed), torch.cat(alone)
    error = token_mult_prob_error(a, b)
    max_diff = float((a - b).abs().max())
    print(f"\nalign_to={align_to}: token_mult_prob_error with remap = {error:.8f}, max |dlogp| = {max_diff:.2e}")
    assert a.numel() > 60
    assert abs(error - 1.0) <= 1e-6
    assert max_diff <= 1e-5
    assert all(int(x) % align_to == 0 for x in expanded.cu_seqlens_padded.diff())
    if align_to > 1:  # the row really got alignment padding in expanded space, shifting later slots
        assert (expanded.positions != expanded_positions(expanded.expansion)).any()
    # Expanded real lengths are the per-sample expanded lengths.
    assert expanded.cu_seqlens.diff().tolist() == [len(ids) - len(ks) + sum(ks) for ids, ks, _ in samples]


def test_packed_differs_without_the_remap(tiny):
    model, samples, alone = tiny
    packed, collapsed, expanded = packed_logps(model, samples, align_to=1, remap=False)
    a, b = torch.cat(packed), torch.cat(alone)
    error = token_mult_prob_error(a, b)
    print(f"\ntoken_mult_prob_error without remap = {error:.6f}, max |dlogp| = {float((a - b).abs().max()):.3f}")
    assert error > 1.001

    # Which boundaries are wrong: exactly those after the first sample holding an image.
    has_images = [bool(ks) for _, ks, _ in samples]
    first = has_images.index(True)
    wrong = (collapsed.cu_seqlens != expanded.cu_seqlens).tolist()
    assert wrong == [i > first for i in range(len(samples) + 1)]
    # Sample 0 (before any image) is still exact; every sample from the first image on is not.
    for i, (p, r) in enumerate(zip(packed, alone)):
        diff = float((p - r).abs().max())
        if i < first:
            assert diff <= 1e-5, (i, diff)
        else:
            assert diff > 1e-3, (i, diff)
