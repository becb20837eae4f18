"""Megatron-Energon / LLaVA-OneVision2 packed rows (``cu_lengths``, sample-ID masks) to and from
``PackedBatch``: the issue's example, round trips against a pure-Python reference layout, SP / CP
alignment, refusals, host reads, and per-token log-probabilities on Megatron-Bridge 0.6.2's real
``Qwen3VLModel`` (CPU build) against the same samples packed from the padded batch.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from _packing_helpers import round_up
import torch

from megatron.bridge_thd.interop.energon import (
    cu_lengths_from_packed_batch,
    packed_batch_from_cu_lengths,
    packed_batch_from_sample_ids,
    sample_ids_from_packed_batch,
)
from megatron.bridge_thd.lengths import cu_seqlens_from_sample_ids
from megatron.bridge_thd.packing import pack_bshd_to_thd, required_alignment, unpack_thd_to_bshd
from megatron.bridge_thd_testbed.opcount import count_ops

SEED_IDS = [[1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 5, 0, 0]]
PAD = 0




def reference_layout(lengths: list[int], n: int, align: int, multiple: int) -> tuple[list[int], list[int], int]:
    """Pure-Python layout: real / padded boundaries and row length (dummy tail segment if any)."""
    slots = [round_up(length, align) for length in lengths]
    real, padded = [0], [0]
    for length, slot in zip(lengths, slots):
        real.append(real[-1] + length)
        padded.append(padded[-1] + slot)
    row = max(padded[-1], round_up(n, math.lcm(align, multiple)))
    if row > padded[-1]:
        real.append(real[-1])
        padded.append(row)
    return real, padded, row


def random_row(rng: random.Random, max_samples: int = 6):
    """(lengths, tail, input_ids (1, N), labels (1, N)) of a random Energon row."""
    lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, max_samples))]
    tail = rng.randint(0, 5)
    n = sum(lengths) + tail
    ids = torch.tensor([[rng.randint(1, 999) for _ in range(n)]])
    labels = torch.tensor([[rng.choice([-100, rng.randint(1, 999)]) for _ in range(n)]])
    return lengths, tail, ids, labels


def cu_of(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for length in lengths:
        out.append(out[-1] + length)
    return torch.tensor([out], dtype=torch.int32)


def ids_of(lengths: list[int], tail: int) -> torch.Tensor:
    return torch.tensor([[k + 1 for k, length in enumerate(lengths) for _ in range(length)] + [0] * tail])


def assert_params_describe(packed) -> None:
    """PackedSeqParams carries the batch's own boundaries (q and kv) and max_seqlen."""
    params = packed.packed_seq_params
    assert params.qkv_format == "thd"
    for name in ("cu_seqlens_q", "cu_seqlens_kv"):
        assert torch.equal(getattr(params, name), packed.cu_seqlens), name
        assert torch.equal(getattr(params, f"{name}_padded"), packed.cu_seqlens_padded), name
    assert params.max_seqlen_q == params.max_seqlen_kv == packed.max_seqlen
    assert packed.cu_seqlens.dtype == packed.cu_seqlens_padded.dtype == torch.int32
    assert params.pad_between_seqs == (packed.cu_seqlens[-1] != packed.input_ids.shape[1]).item()


# ------------------------------------------------------------------------------------------------
# The issue's example and the not-packed sentinel


def test_seed_sample_ids_give_the_issue_boundaries_with_the_tail_segment():
    ids = torch.tensor(SEED_IDS)
    row = torch.arange(100, 113)[None]
    packed = packed_batch_from_sample_ids(row, ids)
    # The issue: bincount + cumsum, last entry = row length, the padding tail one extra segment.
    assert packed.cu_seqlens_padded.tolist() == [0, 2, 5, 7, 8, 11, 13]
    # ... whose real length is 0: the tail is padding, not part of sample 5.
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 7, 8, 11, 11]
    assert packed.padding_mask.tolist() == [[False] * 11 + [True] * 2]
    assert packed.input_ids.tolist() == [list(range(100, 111)) + [PAD, PAD]]
    assert packed.max_seqlen == 3
    assert packed.packed_seq_params.pad_between_seqs is True
    assert_params_describe(packed)
    # The same boundaries as the shared helper, and as Energon's cu_lengths of the same row.
    assert cu_seqlens_from_sample_ids(ids).tolist() == [0, 2, 5, 7, 8, 11, 13]
    from_cu = packed_batch_from_cu_lengths(row, torch.tensor([[0, 2, 5, 7, 8, 11]]))
    assert from_cu.cu_seqlens.tolist() == packed.cu_seqlens.tolist()
    assert from_cu.cu_seqlens_padded.tolist() == packed.cu_seqlens_padded.tolist()
    assert torch.equal(from_cu.input_ids, packed.input_ids)
    # And back.
    assert sample_ids_from_packed_batch(packed).tolist() == SEED_IDS
    assert cu_lengths_from_packed_batch(packed).tolist() == [[0, 2, 5, 7, 8, 11]]
    assert cu_lengths_from_packed_batch(packed).dtype == torch.int32


def test_not_packed_sentinel_is_one_causal_segment_over_the_row():
    row = torch.arange(1, 14)[None]
    packed = packed_batch_from_cu_lengths(row, torch.zeros(1, 1, dtype=torch.int64))
    assert packed.cu_seqlens.tolist() == [0, 13] and packed.cu_seqlens_padded.tolist() == [0, 13]
    assert packed.max_seqlen == 13
    assert not packed.padding_mask.any()
    assert torch.equal(packed.input_ids, row)
    assert packed.packed_seq_params.pad_between_seqs is False
    # Back to Energon: explicit boundaries, never the sentinel.
    assert cu_lengths_from_packed_batch(packed).tolist() == [[0, 13]]


# ------------------------------------------------------------------------------------------------
# Round trips and layouts against the pure-Python reference


@pytest.mark.parametrize("seed", range(12))
def test_cu_lengths_round_trip_and_reference_layout(seed):
    rng = random.Random(seed)
    lengths, tail, ids, labels = random_row(rng)
    n = ids.shape[1]
    align = rng.choice([1, 2, 4, 8])
    multiple = rng.choice([1, 2, 3, 4]) if align == 1 else rng.choice([d for d in (1, 2, 4) if align % d == 0])
    positions = torch.stack([torch.arange(n), torch.arange(n) + 1, torch.arange(n) + 2])[:, None]
    packed = packed_batch_from_cu_lengths(ids, cu_of(lengths), labels=labels, position_ids=positions,
                                          align_to=align, pad_to_multiple_of=multiple)
    real, padded, row = reference_layout(lengths, n, align, multiple)
    assert packed.cu_seqlens.tolist() == real
    assert packed.cu_seqlens_padded.tolist() == padded
    assert packed.input_ids.shape == (1, row) and packed.position_ids.shape == (3, 1, row)
    assert packed.max_seqlen == max(round_up(length, align) for length in lengths)
    assert_params_describe(packed)
    # Every sample's tokens at its slot, in order; everything else padding.
    expected_ids, expected_labels = [PAD] * row, [-100] * row
    expected_pos = [[0] * row for _ in range(3)]
    start = 0
    for k, length in enumerate(lengths):
        for j in range(length):
            slot = padded[k] + j
            expected_ids[slot] = int(ids[0, start + j])
            expected_labels[slot] = int(labels[0, start + j])
            for c in range(3):
                expected_pos[c][slot] = int(positions[c, 0, start + j])
        start += length
    assert packed.input_ids.tolist() == [expected_ids]
    assert packed.labels.tolist() == [expected_labels]
    assert packed.position_ids[:, 0].tolist() == expected_pos
    assert packed.padding_mask.tolist() == [[v == PAD for v in expected_ids]]
    # Unpacking returns Energon's row layout: the real tokens where they were, the tail 0.
    back = unpack_thd_to_bshd(packed.input_ids, packed)
    assert back.tolist() == [ids[0, : sum(lengths)].tolist() + [0] * tail]
    # And back to cu_lengths: the identity in place, the physical slots when re-laid.
    cu_back = cu_lengths_from_packed_batch(packed)
    assert cu_back.tolist() == [padded[: len(lengths) + 1]]
    if align == 1:
        assert cu_back.tolist() == cu_of(lengths).tolist()


@pytest.mark.parametrize("seed", range(12))
def test_sample_ids_round_trip_and_equal_the_cu_lengths_path(seed):
    rng = random.Random(100 + seed)
    lengths, tail, ids, labels = random_row(rng)
    sample_ids = ids_of(lengths, tail)
    align = rng.choice([1, 1, 2, 8])
    multiple = rng.choice([1, 4]) if align == 1 else 2
    kwargs = dict(labels=labels, loss_mask=(labels != -100).float(), align_to=align, pad_to_multiple_of=multiple)
    from_ids = packed_batch_from_sample_ids(ids, sample_ids, **kwargs)
    from_cu = packed_batch_from_cu_lengths(ids, cu_of(lengths), **kwargs)
    for field in ("input_ids", "labels", "loss_mask", "cu_seqlens", "cu_seqlens_padded", "padding_mask",
                  "packed_index"):
        assert torch.equal(getattr(from_ids, field), getattr(from_cu, field)), field
    assert from_ids.max_seqlen == from_cu.max_seqlen
    assert from_ids.packed_seq_params.pad_between_seqs == from_cu.packed_seq_params.pad_between_seqs
    assert_params_describe(from_ids)
    assert_params_describe(from_cu)
    ids_back = sample_ids_from_packed_batch(from_ids)
    row = from_ids.input_ids.shape[1]
    if align == 1:
        # The identity, extended with padding (id 0) where SP needed a longer row.
        assert ids_back.tolist() == [sample_ids[0].tolist() + [0] * (row - ids.shape[1])]
    # Ids and cu_lengths describe one physical layout: the shared helper agrees with both.
    assert cu_seqlens_from_sample_ids(ids_back).tolist() == from_ids.cu_seqlens_padded.tolist()
    assert cu_lengths_from_packed_batch(from_ids).tolist() == [from_ids.cu_seqlens_padded[: len(lengths) + 1].tolist()]


def test_rows_from_the_bshd_packer_convert_to_energon():
    """A PackedBatch of our packer (empty samples included) describes the same row to Energon."""
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    tokens = torch.arange(1, 21).view(4, 5)
    dynamic = pack_bshd_to_thd(tokens, keep)
    assert cu_lengths_from_packed_batch(dynamic).tolist() == [[0, 3, 5, 10]]
    assert sample_ids_from_packed_batch(dynamic).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3, 3]]
    static = pack_bshd_to_thd(tokens, keep, total_length=16)
    assert cu_lengths_from_packed_batch(static).tolist() == [[0, 3, 5, 10]]
    assert sample_ids_from_packed_batch(static).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3, 3] + [0] * 6]


# ------------------------------------------------------------------------------------------------
# Sequence-parallel padding is a dummy segment; CP slots never grow a real length


@pytest.mark.parametrize("tail", [0, 3])
def test_sp_padding_is_a_dummy_segment_not_the_last_sample(tail):
    tp = 4
    lengths = [5, 3, 6]  # 14 tokens: not a multiple of TP
    ids = torch.arange(1, sum(lengths) + tail + 1)[None]
    packed = packed_batch_from_cu_lengths(ids, cu_of(lengths), pad_to_multiple_of=tp)
    row = round_up(sum(lengths) + tail, tp)
    assert packed.input_ids.shape[1] == row and row % tp == 0
    # The samples keep their real *and* physical lengths; one segment (tail + SP padding) follows.
    assert packed.cu_seqlens.tolist() == [0, 5, 8, 14, 14]
    assert packed.cu_seqlens_padded.tolist() == [0, 5, 8, 14, row]
    assert packed.input_ids[0, :14].tolist() == list(range(1, 15))
    assert not packed.input_ids[0, 14:].ne(PAD).any()
    # The same for a sample-ID row.
    from_ids = packed_batch_from_sample_ids(ids, ids_of(lengths, tail), pad_to_multiple_of=tp)
    assert from_ids.cu_seqlens.tolist() == [0, 5, 8, 14, 14]
    assert from_ids.cu_seqlens_padded.tolist() == [0, 5, 8, 14, row]


def test_sp_aligned_row_gets_no_dummy_segment():
    packed = packed_batch_from_cu_lengths(torch.ones(1, 16, dtype=torch.long), cu_of([5, 3, 8]), pad_to_multiple_of=4)
    assert packed.cu_seqlens.tolist() == packed.cu_seqlens_padded.tolist() == [0, 5, 8, 16]
    assert packed.packed_seq_params.pad_between_seqs is False


def test_cp_re_lay_keeps_every_real_length():
    align = required_alignment(tp_size=2, cp_size=2, sequence_parallel=True)  # 8
    lengths = [5, 3, 6]
    packed = packed_batch_from_cu_lengths(torch.arange(1, 15)[None], cu_of(lengths), align_to=align,
                                          pad_to_multiple_of=2)
    real = packed.cu_seqlens.tolist()
    assert [b - a for a, b in zip(real, real[1:])][:3] == lengths
    slots = packed.cu_seqlens_padded.tolist()
    assert all((b - a) % align == 0 for a, b in zip(slots, slots[1:]))
    assert packed.packed_seq_params.pad_between_seqs is True


# ------------------------------------------------------------------------------------------------
# Refusals


def test_micro_batch_above_one_is_refused():
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids: a packed row needs micro-batch 1"):
        packed_batch_from_cu_lengths(ids, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"input_ids: a packed row needs micro-batch 1"):
        packed_batch_from_sample_ids(ids, torch.ones(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cu_lengths: a packed row needs micro-batch 1"):
        packed_batch_from_cu_lengths(ids[:1], torch.tensor([[0, 4], [0, 8]]))
    with pytest.raises(ValueError, match=r"sample_ids: a packed row needs micro-batch 1"):
        packed_batch_from_sample_ids(ids[:1], torch.ones(2, 8, dtype=torch.long))


ROW = torch.arange(1, 11)[None]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cu_lengths=torch.tensor([[1, 4, 8]])), r"cu_lengths: must start at 0"),
        (dict(cu_lengths=torch.tensor([[3]])), r"cu_lengths: must start at 0"),
        (dict(cu_lengths=torch.tensor([[0, 6, 4]])), r"cu_lengths: must be strictly increasing"),
        (dict(cu_lengths=torch.tensor([[0, 4, 4, 8]])), r"cu_lengths: must be strictly increasing"),
        (dict(cu_lengths=torch.tensor([[0, 4, 11]])), r"cu_lengths: the last entry .* <= 10"),
        (dict(cu_lengths=torch.tensor([[0.0, 4.0]])), r"cu_lengths: expected an integer tensor"),
        (dict(cu_lengths=torch.zeros(1, 0, dtype=torch.long)), r"cu_lengths: expected shape \(1, P\)"),
        (dict(cu_lengths=[0, 4]), r"cu_lengths: expected a torch.Tensor"),
        (dict(cu_lengths=torch.tensor([[0, 4]]), labels=torch.zeros(1, 9, dtype=torch.long)), r"labels: shape"),
        (dict(cu_lengths=torch.tensor([[0, 4]]), position_ids=torch.zeros(3, 10, dtype=torch.long)),
         r"position_ids: shape"),
        (dict(cu_lengths=torch.tensor([[0, 4]]), align_to=0), r"align_to: expected an int >= 1"),
        (dict(cu_lengths=torch.tensor([[0, 4]]), align_to=4, pad_to_multiple_of=3),
         r"pad_to_multiple_of: 3 does not divide align_to=4.*pass align_to=12"),
    ],
)
def test_bad_cu_lengths_inputs_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        packed_batch_from_cu_lengths(ROW, **kwargs)


@pytest.mark.parametrize(
    "sample_ids, match",
    [
        ([[1, 1, 0, 2, 2, 2, 3, 3, 0, 0]], r"sample_ids: ids must start at 1"),  # padding between samples
        ([[1, 1, 3, 3, 3, 3, 4, 4, 0, 0]], r"sample_ids: ids must start at 1"),  # skips id 2
        ([[2, 2, 1, 1, 1, 1, 3, 3, 0, 0]], r"sample_ids: ids must start at 1"),  # out of order
        ([[1, 1, 2]], r"sample_ids: shape \(1, 3\) does not match input_ids"),
        ([[1.0] * 10], r"sample_ids: expected a \(1, L\) or \(L,\) integer tensor"),
    ],
)
def test_bad_sample_ids_are_refused_naming_the_argument(sample_ids, match):
    with pytest.raises(ValueError, match=match):
        packed_batch_from_sample_ids(ROW, torch.tensor(sample_ids))


def test_rows_energon_cannot_describe_are_refused():
    empty = pack_bshd_to_thd(torch.ones(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.bool), min_length=4)
    with pytest.raises(ValueError, match=r"packed: the row holds no real token"):
        cu_lengths_from_packed_batch(empty)
    assert sample_ids_from_packed_batch(empty).tolist() == [[0, 0, 0, 0]]
    # A padding segment between two samples (hand-made metadata).
    packed = packed_batch_from_cu_lengths(torch.ones(1, 10, dtype=torch.long), cu_of([3, 2, 5]))
    gap = dataclasses.replace(packed, cu_seqlens=torch.tensor([0, 3, 3, 8], dtype=torch.int32),
                              cu_seqlens_padded=torch.tensor([0, 3, 5, 10], dtype=torch.int32))
    for convert in (cu_lengths_from_packed_batch, sample_ids_from_packed_batch):
        with pytest.raises(ValueError, match=r"packed: a padding segment lies between two samples"):
            convert(gap)


# ------------------------------------------------------------------------------------------------
# Host reads and vectorisation


def _row_of(num_samples: int, n: int = 256):
    lengths = [n // (num_samples + 1)] * num_samples
    return torch.arange(1, n + 1)[None], cu_of(lengths), ids_of(lengths, n - sum(lengths))


@pytest.mark.parametrize("align", [1, 8])
def test_host_reads_and_op_counts_do_not_grow_with_the_samples(align):
    counts = {}
    for num_samples in (3, 15):
        row, cu, sample_ids = _row_of(num_samples)
        with count_ops() as from_cu:
            packed = packed_batch_from_cu_lengths(row, cu, labels=row, align_to=align, pad_to_multiple_of=align)
        with count_ops() as from_ids:
            packed_batch_from_sample_ids(row, sample_ids, labels=row, align_to=align, pad_to_multiple_of=align)
        with count_ops() as to_cu:
            cu_lengths_from_packed_batch(packed)
        with count_ops() as to_ids:
            sample_ids_from_packed_batch(packed)
        # One read for cu_lengths (the packer's); sample ids also read their sample count.
        assert from_cu.host_syncs == 1, from_cu.sync_sites
        assert from_ids.host_syncs == 2, from_ids.sync_sites
        assert to_cu.host_syncs == 1 and to_ids.host_syncs == 1
        counts[num_samples] = (from_cu.ops, from_ids.ops, to_cu.ops, to_ids.ops)
    assert counts[3] == counts[15]


# ------------------------------------------------------------------------------------------------
# Megatron-Bridge 0.6.2's Qwen3VLModel (CPU build): an Energon row gives the packer's log-probs

IMAGE, VIDEO, VISION_START = 250, 251, 252
DLOGP_TOLERANCE = 1e-5
TAIL = 7


@pytest.fixture(scope="module")
def real_model():
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    init_single_process_groups()
    with cpu_stack():
        return build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)


@pytest.fixture(scope="module")
def receipts():
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch

    return synthetic_receipt_batch(3, seed=1)


def _forward(model, packed, batch):
    from megatron.bridge_thd_cpu.stack import cpu_stack

    from megatron.bridge_thd.upstream.line import upstream_line

    visual = batch["visual_inputs"]
    # Where the model declares padding_mask, it is given the row's: left to derive it from the boundaries, the
    # model refuses the zero-length segments a row may hold (docs/energon.md).
    extras = {"padding_mask": packed.padding_mask} if upstream_line().model_takes_padding_mask else {}
    with torch.no_grad(), cpu_stack():
        return model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                     labels=packed.labels, packed_seq_params=packed.packed_seq_params,
                     pixel_values=visual.pixel_values, image_grid_thw=visual.image_grid_thw, **extras)


@pytest.fixture(scope="module")
def packer_logp(real_model, receipts):
    """Per-sample -log p at every real token, the padded batch packed by pack_bshd_to_thd."""
    from megatron.bridge_thd.mrope import qwen3_vl_position_ids

    batch = receipts
    keep = batch["attention_mask"]
    positions = qwen3_vl_position_ids(batch["tokens"], keep, batch["visual_inputs"].image_grid_thw,
                                      image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START)
    packed = pack_bshd_to_thd(batch["tokens"], keep, labels=batch["labels"], loss_mask=batch["loss_mask"],
                              position_ids=positions)
    losses = unpack_thd_to_bshd(_forward(real_model, packed, batch), packed)
    return [losses[i][keep[i]] for i in range(keep.shape[0])]


@pytest.fixture(scope="module")
def energon_row(receipts):
    """The receipts as Energon packs them: samples back to back, a padding tail, cu_lengths; each
    sample's MRoPE positions computed on the sample alone."""
    from megatron.bridge_thd.mrope import qwen3_vl_position_ids

    batch = receipts
    grids = batch["visual_inputs"].image_grid_thw
    ids, labels, positions, lengths = [], [], [], []
    for i in range(batch["tokens"].shape[0]):
        keep = batch["attention_mask"][i]
        tokens = batch["tokens"][i][keep]
        # One receipt photo per sample.
        assert int((tokens == IMAGE).sum()) == int(grids[i].prod()) // 4
        ids.append(tokens)
        labels.append(batch["labels"][i][keep])
        positions.append(qwen3_vl_position_ids(tokens[None], None, grids[i : i + 1], image_token_id=IMAGE,
                                               video_token_id=VIDEO, vision_start_token_id=VISION_START))
        lengths.append(tokens.numel())
    ids.append(torch.full((TAIL,), PAD))
    labels.append(torch.full((TAIL,), -100))
    positions.append(torch.zeros(3, 1, TAIL, dtype=torch.long))
    return dict(input_ids=torch.cat(ids)[None], labels=torch.cat(labels)[None], position_ids=torch.cat(positions, -1),
                cu_lengths=cu_of(lengths), lengths=lengths)


def _energon_logp(model, batch, row, cu_lengths, **layout):
    packed = packed_batch_from_cu_lengths(row["input_ids"], cu_lengths, labels=row["labels"],
                                          position_ids=row["position_ids"], **layout)
    # Back in Energon's row layout: sample i at [cu[i], cu[i + 1]).
    losses = unpack_thd_to_bshd(_forward(model, packed, batch), packed)[0]
    bounds = row["cu_lengths"][0].tolist()
    return packed, [losses[a:b] for a, b in zip(bounds, bounds[1:])]


def _max_dlogp(ours, theirs, row):
    bounds = row["cu_lengths"][0].tolist()
    worst = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        labelled = row["labels"][0, a:b] != -100
        assert labelled.sum() > 30
        worst.append(float((ours[i] - theirs[i])[labelled].abs().max()))
    return worst


@pytest.mark.parametrize(
    "layout",
    [dict(pad_to_multiple_of=4), dict(align_to=8, pad_to_multiple_of=2)],
    ids=["in_place_sp_tail", "cp_re_lay"],
)
def test_energon_row_gives_the_packers_logp_on_the_real_model(real_model, receipts, energon_row, packer_logp, layout):
    packed, ours = _energon_logp(real_model, receipts, energon_row, energon_row["cu_lengths"], **layout)
    lengths = energon_row["lengths"]
    # The tail (and SP padding) is a dummy segment; with align_to the samples were re-laid.
    assert packed.cu_seqlens.tolist()[: len(lengths) + 1] == energon_row["cu_lengths"][0].tolist()
    assert packed.cu_seqlens.tolist()[-1] == sum(lengths) and packed.input_ids.shape[1] > sum(lengths)
    if layout.get("align_to", 1) > 1:
        assert packed.cu_seqlens_padded.tolist() != packed.cu_seqlens.tolist()[: packed.cu_seqlens_padded.numel()]
    assert [o.numel() for o in ours] == [p.numel() for p in packer_logp]
    assert max(_max_dlogp(ours, packer_logp, energon_row)) <= DLOGP_TOLERANCE


def test_not_packed_sentinel_on_the_real_model_mixes_samples(real_model, receipts, energon_row, packer_logp):
    """The control: the same row with cu_lengths [[0]] is one causal sequence, so the first sample
    is unchanged and the later ones see the samples before them."""
    _, ours = _energon_logp(real_model, receipts, energon_row, torch.zeros(1, 1, dtype=torch.int32))
    first, *later = _max_dlogp(ours, packer_logp, energon_row)
    assert first <= DLOGP_TOLERANCE
    assert min(later) > 1e-3
