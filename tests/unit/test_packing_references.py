"""The packer against independent reference implementations written here.

(a) flash-attn's ``bert_padding.unpad_input`` / ``pad_input`` method (nonzero + flat gather);
(b) VERL's boolean gathering of left-padded prompt + right-padded response batches, with
    per-sample aligned slots (``preprocess_packed_seqs`` style);
(c) 4D Megatron causal-with-padding masks vs the equivalent 2D keep mask;
(d) a packed row of sample ids read back by ``cu_seqlens_from_sample_ids``.

The mask rules themselves (``lengths.py``) are tested in tests/unit/test_lengths.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from _packing_helpers import (
    LABEL_PAD,
    PADDING_STYLES,
    as_mask_dtype,
    keep_row,
    megatron_4d_mask,
    round_up,
    verl_keep,
)
from megatron.bridge_thd.lengths import cu_seqlens_from_sample_ids, keep_mask_from_attention_mask
from megatron.bridge_thd.packing import pack_bshd_to_thd, unpack_thd_to_bshd


# --------------------------------------------------------------------------------------------
# (a) flash-attn bert_padding reference
# --------------------------------------------------------------------------------------------
def flash_unpad_input(x: torch.Tensor, mask: torch.Tensor):
    """flash_attn.bert_padding.unpad_input, re-implemented: (unpadded, indices, cu_seqlens, max)."""
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return x.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen


def flash_pad_input(unpadded: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    """flash_attn.bert_padding.pad_input, re-implemented."""
    out = torch.zeros(batch * seqlen, *unpadded.shape[1:], dtype=unpadded.dtype)
    out[indices] = unpadded
    return out.reshape(batch, seqlen, *unpadded.shape[1:])


def _random_keep(styles, seq_len, seed):
    rng = random.Random(seed)
    return torch.tensor([keep_row(s, seq_len, rng) for s in styles], dtype=torch.bool).reshape(
        len(styles), seq_len
    )


FLASH_CASES = [
    pytest.param(styles, seq_len, seed, id=f"{'-'.join(styles)}-T{seq_len}-s{seed}")
    for seed, (styles, seq_len) in enumerate(
        [
            (("right", "right", "right"), 17),
            (("left", "left"), 9),
            (("verl", "verl", "verl", "verl"), 32),
            (("holes", "holes", "holes"), 23),
            (("all_real", "right", "all_padding", "left"), 8),
            (("all_padding", "holes", "verl", "all_real", "right"), 31),
            (("right",), 1),
            (tuple(PADDING_STYLES) * 2, 64),
        ]
    )
]


@pytest.mark.parametrize("styles,seq_len,seed", FLASH_CASES)
@pytest.mark.parametrize("mask_dtype", ["bool", "int", "float"])
def test_matches_flash_attn_unpad_at_align_1(styles, seq_len, seed, mask_dtype):
    keep = _random_keep(styles, seq_len, seed)
    batch = keep.shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, seq_len), generator=gen)
    labels = torch.randint(0, 1000, (batch, seq_len), generator=gen)
    unpadded, indices, cu_ref, max_ref = flash_unpad_input(ids, keep)
    labels_ref = labels.flatten()[indices]

    packed = pack_bshd_to_thd(ids, as_mask_dtype(keep, mask_dtype), labels=labels, align_to=1)
    assert torch.equal(packed.input_ids[0], unpadded)
    assert torch.equal(packed.labels[0], labels_ref)
    assert torch.equal(packed.cu_seqlens, cu_ref)
    assert torch.equal(packed.cu_seqlens_padded, cu_ref)
    assert packed.max_seqlen == max_ref
    assert not packed.padding_mask.any()

    # Model output per token (N, H) back to (B, T, H): same as flash's pad_input.
    hidden = torch.randn(unpadded.numel(), 5, generator=gen)
    assert torch.equal(unpack_thd_to_bshd(hidden, packed), flash_pad_input(hidden, indices, batch, seq_len))
    assert torch.equal(
        unpack_thd_to_bshd(hidden[None], packed), flash_pad_input(hidden, indices, batch, seq_len)
    )


@pytest.mark.parametrize("styles,seq_len,seed", FLASH_CASES)
@pytest.mark.parametrize("align_to", [2, 3, 8, 16])
@pytest.mark.parametrize("static", [False, True])
def test_matches_flash_attn_unpad_after_removing_alignment_padding(styles, seq_len, seed, align_to, static):
    keep = _random_keep(styles, seq_len, seed)
    batch = keep.shape[0]
    gen = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(1, 1000, (batch, seq_len), generator=gen)
    unpadded, indices, cu_ref, _ = flash_unpad_input(ids, keep)

    total_length = batch * round_up(seq_len, align_to) + align_to if static else None
    packed = pack_bshd_to_thd(ids, keep, align_to=align_to, total_length=total_length)
    real = ~packed.padding_mask[0]
    assert torch.equal(packed.input_ids[0][real], unpadded)
    expected_cu = cu_ref.tolist() + ([cu_ref[-1].item()] if static else [])
    assert packed.cu_seqlens.tolist() == expected_cu

    # A per-slot model output whose real slots carry flash's unpadded hidden states unpacks to
    # flash's pad_input; whatever sits in alignment slots is ignored.
    hidden = torch.randn(unpadded.numel(), 4, generator=gen)
    n = packed.input_ids.shape[1]
    per_slot = torch.full((n, 4), 123.0)
    per_slot[real] = hidden
    assert torch.equal(unpack_thd_to_bshd(per_slot, packed), flash_pad_input(hidden, indices, batch, seq_len))


# --------------------------------------------------------------------------------------------
# (b) VERL-style boolean gathering with aligned slots
# --------------------------------------------------------------------------------------------
def verl_reference_pack(x: torch.Tensor, mask: torch.Tensor, align_to: int, fill) -> torch.Tensor:
    """Per sample ``x[i][mask[i].bool()]``, each padded to a multiple of ``align_to``, concatenated."""
    pieces = []
    for i in range(x.shape[-2]):
        real = x[..., i, :][..., mask[i].bool()]
        pad = round_up(real.shape[-1], align_to) - real.shape[-1]
        pieces.append(F.pad(real, (0, pad), value=fill))
    return torch.cat(pieces, dim=-1)


def verl_position_ids(mask: torch.Tensor) -> torch.Tensor:
    """verl.utils.model.compute_position_id_with_mask."""
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0, max=None)


VERL_CASES = [
    # (prompt lengths, response lengths, prompt width, response width)
    ([3, 5, 1], [4, 2, 6], 5, 6),
    ([5, 5], [6, 6], 5, 6),  # no padding at all
    ([1, 2, 3, 4], [1, 1, 1, 1], 4, 3),
    ([0, 2], [3, 0], 2, 3),  # empty prompt / empty response
    ([7], [9], 8, 16),
]


@pytest.mark.parametrize("prompts,responses,pw,rw", VERL_CASES)
@pytest.mark.parametrize("align_to", [1, 2, 4, 16])
@pytest.mark.parametrize("mrope", [False, True])
def test_matches_verl_boolean_gather(prompts, responses, pw, rw, align_to, mrope):
    mask = verl_keep(prompts, responses, pw, rw).long()
    batch, seq_len = mask.shape
    gen = torch.Generator().manual_seed(sum(prompts) * 31 + sum(responses))
    ids = torch.randint(1, 1000, (batch, seq_len), generator=gen)
    # Response-only supervision, as VERL's actor builds it.
    loss_mask = torch.zeros(batch, seq_len)
    loss_mask[:, pw:] = mask[:, pw:].float()
    labels = torch.where(loss_mask.bool(), ids, torch.full_like(ids, -100))
    positions = verl_position_ids(mask)
    if mrope:
        positions = torch.stack([positions, positions * 2, positions * 3])

    packed = pack_bshd_to_thd(ids, mask, labels=labels, loss_mask=loss_mask, position_ids=positions,
                              align_to=align_to, pad_token_id=-7)
    assert torch.equal(packed.input_ids[0], verl_reference_pack(ids, mask, align_to, -7))
    assert torch.equal(packed.labels[0], verl_reference_pack(labels, mask, align_to, LABEL_PAD))
    assert torch.equal(packed.loss_mask[0], verl_reference_pack(loss_mask, mask, align_to, 0))
    expected_pos = verl_reference_pack(positions, mask, align_to, 0)
    if mrope:
        assert torch.equal(packed.position_ids[:, 0], expected_pos)
    else:
        assert torch.equal(packed.position_ids[0], expected_pos)
    lengths = [p + r for p, r in zip(prompts, responses)]
    assert packed.cu_seqlens.tolist() == list(itertools.accumulate(lengths, initial=0))
    assert packed.cu_seqlens_padded.tolist() == list(
        itertools.accumulate((round_up(n, align_to) for n in lengths), initial=0)
    )
    # Positions restart at 0 at every segment start (VERL's positions are per sample).
    starts = packed.cu_seqlens_padded[:-1].tolist()
    pos_row = packed.position_ids[0] if not mrope else packed.position_ids[0, 0]
    for s, n in zip(starts, lengths):
        assert pos_row[s : s + n].tolist() == list(range(n))


# --------------------------------------------------------------------------------------------
# (c) 4D Megatron mask == 2D keep mask
# --------------------------------------------------------------------------------------------
def _assert_same_packing(a, b):
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "cu_seqlens_padded", "padding_mask",
                 "packed_index"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x, y), name
    assert a.max_seqlen == b.max_seqlen


@pytest.mark.parametrize("styles,seq_len,seed", FLASH_CASES)
@pytest.mark.parametrize("query_padding", [False, True])
@pytest.mark.parametrize("align_to", [1, 4])
@pytest.mark.parametrize("static", [False, True])
def test_4d_mask_packs_like_2d_keep_mask(styles, seq_len, seed, query_padding, align_to, static):
    keep = _random_keep(styles, seq_len, seed)
    batch = keep.shape[0]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, seq_len), generator=gen)
    labels = torch.randint(0, 1000, (batch, seq_len), generator=gen)
    pos = torch.arange(seq_len).expand(batch, seq_len)
    mask4d = megatron_4d_mask(keep, query_padding=query_padding)
    assert mask4d.shape == (batch, 1, seq_len, seq_len)
    total_length = batch * round_up(seq_len, align_to) if static else None
    kw = dict(labels=labels, position_ids=pos, align_to=align_to, total_length=total_length)
    _assert_same_packing(pack_bshd_to_thd(ids, mask4d, **kw), pack_bshd_to_thd(ids, keep, **kw))
    # Also as an int / float mask (non-zero = masked).
    _assert_same_packing(pack_bshd_to_thd(ids, mask4d.float(), **kw), pack_bshd_to_thd(ids, keep, **kw))


@pytest.mark.parametrize("length,seq_len", [(5, 5), (3, 8), (0, 4), (1, 1)])
@pytest.mark.parametrize("query_padding", [False, True])
def test_broadcast_4d_mask_with_batch_1(length, seq_len, query_padding):
    keep = torch.tensor([[t < length for t in range(seq_len)]])
    mask = megatron_4d_mask(keep, query_padding=query_padding)
    assert mask.shape == (1, 1, seq_len, seq_len)
    ids = torch.arange(10, 10 + seq_len)[None]
    packed = pack_bshd_to_thd(ids, mask)
    assert packed.input_ids[0].tolist() == list(range(10, 10 + length))
    assert packed.cu_seqlens.tolist() == [0, length]


def test_broadcast_4d_mask_shared_by_a_batch():
    """A (1, 1, T, T) mask with B > 1 describes every sample the same way."""
    keep_one = torch.tensor([[True] * 4 + [False] * 2])
    ids = torch.arange(18).reshape(3, 6)
    packed = pack_bshd_to_thd(ids, megatron_4d_mask(keep_one))
    assert packed.input_ids[0].tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 12, 13, 14, 15]
    assert packed.cu_seqlens.tolist() == [0, 4, 8, 12]


def test_megatron_core_ltor_mask_is_all_real():
    """Megatron-Core's own GPT mask (causal, no padding) packs as all-real samples."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = torch.arange(1, 9)
    mask, _, position_ids = _get_ltor_masks_and_position_ids(tokens, 0, False, False, False, True)
    mask = mask.unsqueeze(0)  # (1, 1, T, T), True = masked
    keep, _ = keep_mask_from_attention_mask(mask, 1, 8)
    assert keep.tolist() == [[True] * 8]
    packed = pack_bshd_to_thd(tokens[None], mask, position_ids=position_ids[None])
    assert packed.input_ids[0].tolist() == tokens.tolist()
    assert packed.cu_seqlens.tolist() == [0, 8]
    assert packed.position_ids[0].tolist() == list(range(8))


# --------------------------------------------------------------------------------------------
# (d) a packed sample-ID row (the sample-ID rules themselves: tests/unit/test_lengths.py)
# --------------------------------------------------------------------------------------------
def test_packed_sample_id_row_round_trips_through_cu_seqlens_from_sample_ids():
    """Packing a sample-ID tensor (id i+1 on sample i's real tokens) at align_to=1 gives a
    sample-ID row whose cu_seqlens are the real boundaries of the packed batch."""
    keep = verl_keep([2, 0, 4], [3, 1, 2], 4, 3)
    sample_ids = (torch.arange(1, 4)[:, None] * keep).long()
    packed = pack_bshd_to_thd(sample_ids, keep, align_to=1)
    assert cu_seqlens_from_sample_ids(packed.input_ids).tolist() == [0, 5, 6, 12]
    # With a padding tail (static mode) the row end becomes an extra boundary.
    packed = pack_bshd_to_thd(sample_ids, keep, align_to=1, total_length=15)
    assert cu_seqlens_from_sample_ids(packed.input_ids).tolist() == [0, 5, 6, 12, 15]
