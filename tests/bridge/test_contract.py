"""Our PackedSeqParams against Megatron-Bridge 0.6.2's own packed-sequence helpers.

The helpers are loaded from the installed megatron-bridge (without Transformer Engine) via
``load_bridge_module``; expected values are computed here from the input batch.
"""

from __future__ import annotations

import random

import pytest
import torch

from _packing_helpers import keep_row, round_up, verl_keep
from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd.upstream.loading import bridge_available, load_bridge_module
from megatron.core.packed_seq_params import PackedSeqParams

pytestmark = pytest.mark.skipif(not bridge_available(), reason="megatron-bridge is not installed")


@pytest.fixture(scope="module")
def psu():
    return load_bridge_module("training.utils.packed_seq_utils")


def _nonempty_keep(styles, seq_len, seed):
    """Keep masks in the given styles, with at least one real token per sample."""
    rng = random.Random(seed)
    rows = []
    for style in styles:
        row = keep_row(style, seq_len, rng)
        if not any(row):
            row[rng.randrange(seq_len)] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


BATCHES = [
    pytest.param(("right", "left", "verl"), 12, 0, id="mixed"),
    pytest.param(("holes",) * 5, 20, 1, id="holes"),
    pytest.param(("all_real",) * 2, 7, 2, id="all_real"),
    pytest.param(("right",), 9, 3, id="single"),
    pytest.param(("verl", "right", "holes", "left", "all_real", "verl", "right", "left"), 33, 4, id="b8"),
]


def _batch(styles, seq_len, seed):
    keep = _nonempty_keep(styles, seq_len, seed)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, keep.shape, generator=gen)
    return keep, ids


def test_packed_seq_params_class_is_megatron_cores(psu):
    keep, ids = _batch(("right", "left"), 6, 0)
    packed = pack_bshd_to_thd(ids, keep)
    assert psu.PackedSeqParams is PackedSeqParams
    assert type(packed.packed_seq_params) is PackedSeqParams
    assert packed.packed_seq_params.qkv_format == "thd"


@pytest.mark.parametrize("styles,seq_len,seed", BATCHES)
@pytest.mark.parametrize("align_to", [1, 2, 8])
@pytest.mark.parametrize("total_length", [None, "worst"])
def test_get_packed_seq_q_cu_seqlens_returns_our_tensors(psu, styles, seq_len, seed, align_to, total_length):
    keep, ids = _batch(styles, seq_len, seed)
    if total_length == "worst":
        total_length = len(styles) * round_up(seq_len, align_to)
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to, total_length=total_length)
    real, padded = psu.get_packed_seq_q_cu_seqlens(packed.packed_seq_params)
    assert torch.equal(real, packed.cu_seqlens)
    assert torch.equal(padded, packed.cu_seqlens_padded)
    lengths = keep.sum(1).tolist()
    assert torch.diff(real).tolist()[: len(lengths)] == lengths
    assert padded[-1].item() == packed.input_ids.shape[1]


@pytest.mark.parametrize("styles,seq_len,seed", BATCHES)
@pytest.mark.parametrize("align_to", [1, 3, 4, 16])
def test_unpack_mcore_thd_tensor_for_position_ids_reconstructs_samples(psu, styles, seq_len, seed, align_to):
    keep, ids = _batch(styles, seq_len, seed)
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to)
    rows, row_mask, padded_starts, lengths = psu.unpack_mcore_thd_tensor_for_position_ids(
        packed.input_ids, packed.packed_seq_params
    )
    expected_lengths = keep.sum(1).tolist()
    assert lengths == expected_lengths
    expected_starts = [0]
    for n in expected_lengths[:-1]:
        expected_starts.append(expected_starts[-1] + round_up(n, align_to))
    assert padded_starts == expected_starts
    assert padded_starts == packed.cu_seqlens_padded[:-1].tolist()
    assert lengths == torch.diff(packed.cu_seqlens).tolist()
    for i in range(len(styles)):
        assert torch.equal(rows[i, : lengths[i]], ids[i][keep[i]])
        assert row_mask[i].tolist() == [t < lengths[i] for t in range(max(lengths))]


@pytest.mark.parametrize("styles,seq_len,seed", BATCHES)
@pytest.mark.parametrize("align_to", [1, 4])
def test_repack_mcore_thd_position_ids_puts_positions_at_our_slots(psu, styles, seq_len, seed, align_to):
    """Positions built per logical row (as Qwen2.5-VL / GLM-4.5V do) and repacked by Bridge land
    exactly where our packer puts the same (3, B, T) positions."""
    keep, ids = _batch(styles, seq_len, seed)
    batch = keep.shape[0]
    # MRoPE-like positions: per sample, 0..len-1 on the real tokens, different per axis.
    rank = (keep.cumsum(1) - 1).clamp(min=0)
    positions = torch.stack([rank, rank * 2 + 1, rank + 100]) * keep
    packed = pack_bshd_to_thd(ids, keep, position_ids=positions, align_to=align_to)
    n = packed.input_ids.shape[1]

    rows, row_mask, padded_starts, lengths = psu.unpack_mcore_thd_tensor_for_position_ids(
        packed.input_ids, packed.packed_seq_params
    )
    logical = torch.zeros(3, batch, rows.shape[1], dtype=positions.dtype)
    for i in range(batch):
        logical[:, i, : lengths[i]] = positions[:, i][:, keep[i]]
    repacked = psu.repack_mcore_thd_position_ids(
        logical, padded_starts=padded_starts, lengths=lengths, total_length=n
    )
    assert repacked.shape == (3, 1, n)
    assert torch.equal(repacked, packed.position_ids)


@pytest.mark.parametrize("align_to", [1, 8])
@pytest.mark.parametrize("batch_dim", [False, True])
@pytest.mark.parametrize("tensor_max", [False, True])
def test_get_packed_seq_params_round_trips_our_metadata(psu, align_to, batch_dim, tensor_max):
    keep = verl_keep([2, 4, 1], [3, 0, 5], 4, 5)
    ids = torch.arange(27).reshape(3, 9)
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to)
    wrap = (lambda t: t[None]) if batch_dim else (lambda t: t)
    max_seqlen = torch.tensor([packed.max_seqlen]) if tensor_max else packed.max_seqlen
    params = psu.get_packed_seq_params(
        {
            "cu_seqlens_q": wrap(packed.cu_seqlens),
            "cu_seqlens_q_padded": wrap(packed.cu_seqlens_padded),
            "cu_seqlens_kv_padded": wrap(packed.cu_seqlens_padded),
            "max_seqlen_q": max_seqlen,
        }
    )
    ours = packed.packed_seq_params
    assert isinstance(params, PackedSeqParams)
    assert params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(params, name), getattr(ours, name)), name
    assert params.max_seqlen_q == ours.max_seqlen_q and params.max_seqlen_kv == ours.max_seqlen_kv
    assert isinstance(params.max_seqlen_q, int)
    # Independent check of the values themselves.
    assert params.cu_seqlens_q.tolist() == [0, 5, 9, 15]
    assert params.max_seqlen_q >= 6


@pytest.fixture(scope="module")
def qwen3_vl_rope():
    try:
        return load_bridge_module("models.qwen_vl.modelling_qwen3_vl.rope")
    except ImportError as exc:  # pragma: no cover - depends on the installed stack
        pytest.skip(f"Qwen3-VL rope module cannot be loaded without TE here: {exc}")


@pytest.mark.parametrize("styles,seq_len,seed", BATCHES)
@pytest.mark.parametrize("align_to", [1, 4])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("empty_sample", [False, True])
def test_qwen3_vl_dense_mask_from_our_metadata(qwen3_vl_rope, styles, seq_len, seed, align_to, static,
                                               empty_sample):
    """Qwen3-VL derives its dense keep mask from cu_seqlens_q / cu_seqlens_q_padded; with our
    metadata it must mark exactly the real slots (also with an empty sample and a static tail)."""
    keep, ids = _batch(styles, seq_len, seed)
    if empty_sample:
        keep[0] = False
    total_length = len(styles) * round_up(seq_len, align_to) + 2 * align_to if static else None
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to, total_length=total_length)
    dense = qwen3_vl_rope.get_packed_seq_attention_mask(packed.input_ids, packed.packed_seq_params)
    expected = torch.zeros(packed.input_ids.shape[1], dtype=torch.bool)
    start = 0
    for n in keep.sum(1).tolist():
        expected[start : start + n] = True
        start += round_up(n, align_to)
    assert dense[0].tolist() == expected.tolist()
    assert torch.equal(dense, ~packed.padding_mask)
