"""Tests of the drop-in Megatron-Bridge forward step ``megatron.bridge_thd.qwen3_vl_step.forward_step``.

Losses are checked against each sample run alone through the unmodified Hugging Face model;
packing metadata is checked by spy models that record what the step hands them, against values
computed here from the input batch; each spy names the upstream signature it stands for. Here
process-group sizes other than 1 only decide the alignment, through a fake ``pg_collection``
attribute (what Megatron-Bridge's ``get_pg_collection`` prefers); real CP runs on gloo processes
with Megatron-Bridge's own model in ``test_context_parallel.py``, and Megatron-Bridge 0.6.2's
``Qwen3VLModel`` itself is tested in ``test_real_model_parity.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from _packing_helpers import round_up
import torch
import torch.nn.functional as F
from _real_model import FakeGroup

from megatron.bridge_thd import qwen3_vl_step, step
from megatron.bridge_thd.packing import required_alignment
from megatron.bridge_thd.qwen3_vl_step import forward_step
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL
from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state

IMAGE, VISION_START, VISION_END, EOS, PAD = 250, 252, 253, 254, 0
LOGGER = "megatron.bridge_thd"  # the step and its plan
SEQ = 2048
B = 4
SEED = 1




# ---------------------------------------------------------------------------------------------
# fixtures and helpers


@pytest.fixture(scope="module", autouse=True)
def process_groups():
    return init_single_process_groups()


@pytest.fixture(scope="module")
def ref():
    return ReferenceQwen3VL.tiny(seed=0)


@pytest.fixture(scope="module")
def right_batch():
    return synthetic_receipt_batch(B, seed=SEED)


@pytest.fixture(scope="module")
def left_batch():
    return synthetic_receipt_batch(B, seed=SEED, left_padding=True)


def fake_pg(tp=1, cp=1, pp=1, ep=1, pp_rank=0):
    return SimpleNamespace(tp=FakeGroup(tp), cp=FakeGroup(cp), pp=FakeGroup(pp, pp_rank), ep=FakeGroup(ep))


def real_lengths(batch) -> list[int]:
    return batch["attention_mask"].sum(1).tolist()


def real_tokens(batch, i) -> torch.Tensor:
    return batch["tokens"][i][batch["attention_mask"][i]]


def hf_per_sample_loss(ref, batch) -> float:
    """Each sample alone through the unmodified HF model; CE of labels summed at loss_mask == 1."""
    grids = batch["visual_inputs"].image_grid_thw
    pixels = batch["visual_inputs"].pixel_values
    patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
    total = 0.0
    with torch.no_grad():
        for i in range(batch["tokens"].shape[0]):
            keep = batch["attention_mask"][i]
            ids = batch["tokens"][i][keep]
            labels = batch["labels"][i][keep]
            supervised = batch["loss_mask"][i][keep] == 1
            logits = ref.hf_model(
                input_ids=ids[None],
                pixel_values=pixels[patch_ends[i] : patch_ends[i + 1]],
                image_grid_thw=grids[i : i + 1],
                mm_token_type_ids=(ids == IMAGE).int()[None],
            ).logits[0]
            ce = F.cross_entropy(logits.float()[supervised], labels[supervised], reduction="sum")
            total += float(ce)
    return total


def bshd_width(width: int) -> int:
    """Megatron-Bridge 0.6.2's padded width at TP = CP = 1 without forced padding: the batch width
    rounded up to 16 (its step always pads as for FP8, ``use_fp8_padding=True``)."""
    return -(-width // 16) * 16


def run_step(model, batch, state, **kwargs):
    with torch.no_grad():
        output, loss_function = forward_step(state, iter([batch]), model, **kwargs)
        loss, num_tokens, report = loss_function(output)
    return SimpleNamespace(output=output, loss_function=loss_function, loss=float(loss), num_tokens=int(num_tokens),
                           report=report, stats=state.bridge_thd_stats[-1])


class RecordingSpy(torch.nn.Module):
    """Same explicit signature as our ``ReferenceQwen3VL.forward`` (``megatron/bridge_thd_cpu/reference.py``,
    itself Megatron-Bridge 0.6.2's ``Qwen3VLModel.forward`` names plus ``padding_mask``); records
    kwargs; delegates to the wrapped model when ``delegate`` (else returns zero per-token losses)."""

    def __init__(self, inner, delegate: bool = False):
        super().__init__()
        self.inner = inner  # not "module": the step unwraps ".module" chains
        self.config = inner.config
        self.delegate = delegate
        self.calls: list[dict] = []

    def forward(
        self,
        input_ids,
        position_ids=None,
        attention_mask=None,
        labels=None,
        loss_mask=None,
        packed_seq_params=None,
        pixel_values=None,
        image_grid_thw=None,
        pixel_values_videos=None,
        video_grid_thw=None,
        padding_mask=None,
    ):
        kwargs = dict(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, labels=labels,
            loss_mask=loss_mask, packed_seq_params=packed_seq_params, pixel_values=pixel_values,
            image_grid_thw=image_grid_thw, pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
            padding_mask=padding_mask,
        )
        self.calls.append(kwargs)
        if self.delegate:
            return self.inner(**kwargs)
        return torch.zeros(input_ids.shape, dtype=torch.float32)


class PaddingMaskOnlySpy(torch.nn.Module):
    """Stands for Megatron-Bridge main's ``Qwen3VLModel.forward``
    (``models/qwen_vl/modelling_qwen3_vl/model.py``), which declares ``padding_mask`` (True =
    padding) beside ``loss_mask``; at CP = 1 it returns the output alone, as that code does."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, loss_mask=None,
                packed_seq_params=None, pixel_values=None, image_grid_thw=None, padding_mask=None, **kwargs):
        self.last = dict(input_ids=input_ids, packed_seq_params=packed_seq_params, padding_mask=padding_mask,
                         loss_mask=loss_mask, kwargs=set(kwargs))
        return torch.zeros(input_ids.shape)


class RopeCuSeqlensSpy(torch.nn.Module):
    """Stands for 0.6.2's ``Qwen3VLModel.forward`` (``megatron/bridge/models/qwen_vl/modelling_qwen3_vl/model.py``)
    with one more parameter, ``rope_cu_seqlens`` (the name Megatron-Bridge PR 3838 passed; no
    released Megatron-Bridge declares it): checks that an extra reaches a model only when it is
    declared by name."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, loss_mask=None,
                packed_seq_params=None, pixel_values=None, image_grid_thw=None, rope_cu_seqlens=None, **kwargs):
        self.last = dict(input_ids=input_ids, packed_seq_params=packed_seq_params, rope_cu_seqlens=rope_cu_seqlens,
                         kwargs=set(kwargs))
        return torch.zeros(input_ids.shape)


def slot_bounds(packed_seq_params, i):
    start = int(packed_seq_params.cu_seqlens_q_padded[i])
    length = int(packed_seq_params.cu_seqlens_q[i + 1] - packed_seq_params.cu_seqlens_q[i])
    return start, length


# ---------------------------------------------------------------------------------------------
# 1. loss equality: every layout == bshd == per-sample HF


@pytest.fixture(scope="module")
def per_sample_loss(ref, right_batch):
    # left_batch holds the same samples (same seed), so one per-sample reference serves both
    return hf_per_sample_loss(ref, right_batch)


@pytest.fixture(scope="module")
def layout_runs(ref, right_batch, left_batch):
    runs = {}
    for padding, batch in (("right", right_batch), ("left", left_batch)):
        for layout in qwen3_vl_step.LAYOUT_NAMES:
            state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout)
            runs[layout, padding] = run_step(ref, batch, state)
    return runs


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_loss_matches_bshd_and_per_sample(layout, padding, layout_runs, per_sample_loss, right_batch, left_batch):
    batch = right_batch if padding == "right" else left_batch
    run = layout_runs[layout, padding]
    assert run.stats.layout == layout
    assert run.num_tokens == int(batch["loss_mask"].sum())
    assert run.loss == pytest.approx(per_sample_loss, rel=1e-5)
    assert run.loss == pytest.approx(layout_runs["bshd", padding].loss, rel=1e-5)
    assert run.num_tokens == layout_runs["bshd", padding].num_tokens
    # the reporting entry carries the same numbers
    lm = run.report["lm loss"]
    assert float(lm[0]) == pytest.approx(run.loss) and int(lm[1]) == run.num_tokens
    # loss_function.args[0] is the mask it used; sum(output * mask) is the loss
    mask = run.loss_function.args[0]
    assert mask.numel() == run.output.numel()
    assert float((run.output.reshape(-1) * mask.reshape(-1)).sum()) == pytest.approx(run.loss, rel=1e-6)


def test_loss_is_not_trivially_equal_across_batches(layout_runs, ref):
    # guard: a different batch gives a different loss (the comparisons above are meaningful)
    other = synthetic_receipt_batch(2, seed=SEED + 100)
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="bshd")
    assert run_step(ref, other, state).loss != pytest.approx(layout_runs["bshd", "right"].loss, rel=1e-3)


# ---------------------------------------------------------------------------------------------
# 2. the model receives real cu_seqlens and per-sample MRoPE positions


@pytest.mark.parametrize("padding", ["right", "left"])
def test_model_receives_real_cu_seqlens_and_positions(padding, ref, right_batch, left_batch, layout_runs):
    batch = right_batch if padding == "right" else left_batch
    spy = RecordingSpy(ref, delegate=padding == "right")
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    run = run_step(spy, batch, state)
    assert len(spy.calls) == 1
    kw = spy.calls[0]
    psp = kw["packed_seq_params"]
    assert psp is not None and psp.qkv_format == "thd"
    lengths = real_lengths(batch)
    T = batch["tokens"].shape[1]
    assert psp.cu_seqlens_q.diff().tolist() == lengths
    assert psp.cu_seqlens_kv.diff().tolist() == lengths
    assert int(psp.cu_seqlens_q[0]) == 0
    padded = psp.cu_seqlens_q_padded.diff().tolist()
    align = required_alignment(1, 1)
    assert all(s % align == 0 for s in padded)
    assert not all(s == T for s in padded)
    assert all(s >= n for s, n in zip(padded, lengths))
    assert psp.max_seqlen_q >= max(lengths)

    ids = kw["input_ids"]
    N = ids.shape[1]
    assert ids.shape == (1, N) and N < B * T
    assert N == int(psp.cu_seqlens_q_padded[-1])
    assert kw["attention_mask"] is None
    pos = kw["position_ids"]
    assert pos.shape == (3, 1, N)

    grids = batch["visual_inputs"].image_grid_thw
    for i in range(B):
        start, length = slot_bounds(psp, i)
        sample = real_tokens(batch, i)
        assert torch.equal(ids[0, start : start + length], sample)
        assert (pos[:, 0, start] == 0).all(), f"sample {i} does not restart at position 0"
        slot_pos = pos[:, 0, start : start + length]
        image = sample == IMAGE
        # the three channels differ at image tokens: not the degenerate 1D expansion
        assert not torch.equal(slot_pos[1][image], slot_pos[2][image])
        assert not torch.equal(slot_pos[0][image], slot_pos[1][image])
        # independent: HF's own get_rope_index on the sample alone
        hf_pos, _ = ref.hf_model.model.get_rope_index(
            sample[None], mm_token_type_ids=image.int()[None], image_grid_thw=grids[i : i + 1]
        )
        assert torch.equal(slot_pos, hf_pos[:, 0].to(slot_pos.dtype)), f"sample {i}"
        # labels and loss mask travel with their tokens
        keep = batch["attention_mask"][i]
        assert torch.equal(kw["labels"][0, start : start + length], batch["labels"][i][keep])
    mask = run.loss_function.args[0]
    assert mask.shape[-1] == N and float(mask.sum()) == float(batch["loss_mask"].sum())
    if spy.delegate:
        assert run.loss == pytest.approx(layout_runs["thd", "right"].loss, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# 3. optional extras: passed only by explicit name


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_padding_mask_model_gets_padding_mask(layout, ref, right_batch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = PaddingMaskOnlySpy(ref.config)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout)
    run_step(model, right_batch, state)
    last = model.last
    assert "rope_cu_seqlens" not in last["kwargs"]
    mask = last["padding_mask"]
    ids = last["input_ids"]
    assert mask is not None and mask.dtype == torch.bool and mask.shape == ids.shape
    n_real = int(right_batch["attention_mask"].sum())
    assert int(mask.sum()) == ids.numel() - n_real
    # False exactly at the real slots
    expected = torch.ones_like(mask)
    lengths = real_lengths(right_batch)
    if layout == "bshd":
        for i, n in enumerate(lengths):
            expected[i, :n] = False
    else:
        psp = last["packed_seq_params"]
        for i in range(B):
            start, length = slot_bounds(psp, i)
            assert length == lengths[i]
            expected[0, start : start + length] = False
    assert torch.equal(mask, expected)
    messages = [r.getMessage() for r in caplog.records if "PaddingMaskOnlySpy" in r.getMessage()]
    assert messages
    passed, _, not_passed = messages[0].partition("not declared")
    assert "padding_mask" in passed and "rope_cu_seqlens" in not_passed and "padding_mask" not in not_passed


def test_rope_cu_seqlens_model_gets_it(ref, right_batch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = RopeCuSeqlensSpy(ref.config)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd", fp8="hybrid")
    run_step(model, right_batch, state)
    last = model.last
    assert "padding_mask" not in last["kwargs"]
    rope = last["rope_cu_seqlens"]
    assert rope is not None
    assert torch.equal(rope, last["packed_seq_params"].cu_seqlens_q_padded)
    expected = [0]
    for n in real_lengths(right_batch):
        expected.append(expected[-1] + round_up(n, 16))
    assert rope.tolist() == expected
    messages = [r.getMessage() for r in caplog.records if "RopeCuSeqlensSpy" in r.getMessage()]
    assert messages
    passed, _, not_passed = messages[0].partition("not declared")
    assert "rope_cu_seqlens" in passed and "padding_mask" in not_passed and "padding_mask" not in passed


# ---------------------------------------------------------------------------------------------
# 4. thd_static and pipeline parallelism


def test_thd_static_row_length_is_data_independent(ref):
    align = 4  # cp=2
    seq = 2001
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(cp=2)
    rows = []
    for seed in (21, 22):
        batch = synthetic_receipt_batch(B, seed=seed)
        state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout="thd_static")
        run = run_step(model, batch, state)
        rows.append(model.calls[-1]["input_ids"].shape[1])
        assert run.stats.layout == "thd_static"
        assert run.stats.processed_tokens == rows[-1]
        psp = model.calls[-1]["packed_seq_params"]
        assert psp.cu_seqlens_q.diff()[:B].tolist() == real_lengths(batch)
        assert int(psp.cu_seqlens_q_padded[-1]) == rows[-1]
    assert rows[0] == rows[1] == B * round_up(seq, align)


class FirstStageSpy(RecordingSpy):
    """A first pipeline stage: like Megatron-Core's ``GPTModel.forward`` without ``post_process``
    (``models/gpt/gpt_model.py``) it returns the decoder's hidden states ``(s, b=1, h)``."""

    HIDDEN = 8

    def forward(self, input_ids, **kwargs):
        super().forward(input_ids, **kwargs)
        return torch.zeros(input_ids.shape[1], 1, self.HIDDEN)


def test_pp_without_variable_seq_lengths_switches_to_static(ref, right_batch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = FirstStageSpy(ref)
    model.pg_collection = fake_pg(pp=2, pp_rank=0)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    with torch.no_grad():
        output, _ = forward_step(state, iter([right_batch]), model)
    assert state.bridge_thd_stats[-1].layout == "thd_static"
    assert model.calls[-1]["input_ids"].shape == (1, B * SEQ)
    # What goes to the next stage has the shape of Megatron-Core's p2p buffer (seq_length, mbs, H).
    assert output.shape == (SEQ, B, FirstStageSpy.HIDDEN)
    # first stage: no labels
    assert model.calls[-1]["labels"] is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "thd_static" in r.getMessage()]
    assert warnings, [r.getMessage() for r in caplog.records]
    # a second batch of different lengths keeps the same row length
    with torch.no_grad():
        forward_step(state, iter([synthetic_receipt_batch(B, seed=40)]), model)
    assert model.calls[-1]["input_ids"].shape == (1, B * SEQ)


@pytest.mark.parametrize("seq_length,batch_size,match", [(SEQ + 2, B, "model.seq_length"), (SEQ, B + 1, "micro_batch_size")])
def test_static_pipeline_row_that_cannot_fill_the_p2p_buffers_is_refused(ref, seq_length, batch_size, match):
    """Refused before the model runs (so before any send), naming the setting to change."""
    model = FirstStageSpy(ref)
    model.pg_collection = fake_pg(pp=2, pp_rank=0)
    state = minimal_state(seq_length=seq_length, micro_batch_size=B, packing_layout="thd_static", fp8="hybrid")
    with pytest.raises(ValueError, match=match):
        forward_step(state, iter([synthetic_receipt_batch(batch_size, seed=SEED)]), model)
    assert not model.calls
    # With variable_seq_lengths the row is not bound to the buffers: accepted.
    state.cfg.model.variable_seq_lengths = True
    with torch.no_grad():
        forward_step(state, iter([synthetic_receipt_batch(min(batch_size, B), seed=SEED)]), model)
    assert model.calls


@pytest.mark.parametrize("seq_length,batch_size,match",
                         [(SEQ + 2, B, "model.seq_length"), (SEQ, B - 1, "micro_batch_size"),
                          (SEQ, B + 1, "micro_batch_size")])
def test_padded_pipeline_layout_that_cannot_fill_the_p2p_buffers_is_refused(ref, seq_length, batch_size, match):
    """The padded layout under PP x CP without variable_seq_lengths: each stage sends
    ``(seq_length / cp, B, H)``, so the batch must be exactly micro_batch_size samples wide and
    seq_length a multiple of 2 * cp. Refused before the model runs."""
    model = FirstStageSpy(ref)
    model.pg_collection = fake_pg(pp=2, cp=2, pp_rank=0)
    state = minimal_state(seq_length=seq_length, micro_batch_size=B, packing_layout="bshd")
    with pytest.raises(ValueError, match=match):
        forward_step(state, iter([synthetic_receipt_batch(batch_size, seed=SEED)]), model)
    assert not model.calls


def test_pp_last_stage_gets_labels(ref, right_batch):
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(pp=2, pp_rank=1)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd", variable_seq_lengths=False)
    run_step(model, right_batch, state)
    assert model.calls[-1]["labels"] is not None
    assert model.calls[-1]["input_ids"].shape == (1, B * SEQ)


def test_pp_with_variable_seq_lengths_stays_thd(ref, right_batch):
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(pp=2)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd", variable_seq_lengths=True)
    run = run_step(model, right_batch, state)
    assert run.stats.layout == "thd"
    assert model.calls[-1]["input_ids"].shape == (1, sum(real_lengths(right_batch)))


# ---------------------------------------------------------------------------------------------
# 5. alignment for TP+SP, CP, FP8


@pytest.mark.parametrize(
    "pg_kwargs, settings, expected_align",
    [
        (dict(tp=2), dict(sequence_parallel=True), 2),
        (dict(cp=2), {}, 4),
        ({}, dict(fp8="hybrid"), 16),
        (dict(tp=2, cp=2), dict(sequence_parallel=True), 8),
        (dict(tp=4), dict(sequence_parallel=True, fp8="hybrid"), 16),
    ],
    ids=["tp2_sp", "cp2", "fp8", "tp2_sp_cp2", "tp4_sp_fp8"],
)
@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_alignment(layout, pg_kwargs, settings, expected_align, ref, right_batch):
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(**pg_kwargs)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout, **settings)
    run_step(model, right_batch, state)
    align = required_alignment(
        pg_kwargs.get("tp", 1), pg_kwargs.get("cp", 1),
        sequence_parallel=settings.get("sequence_parallel", False), fp8="fp8" in settings,
    )
    assert align == expected_align
    kw = model.calls[-1]
    psp = kw["packed_seq_params"]
    N = kw["input_ids"].shape[1]
    assert N % align == 0
    lengths = real_lengths(right_batch)
    slots = psp.cu_seqlens_q_padded.diff().tolist()
    assert all(s % align == 0 for s in slots), slots
    assert psp.cu_seqlens_q.diff()[:B].tolist() == lengths
    if layout == "thd":
        # minimal padding: each slot is the length rounded up
        assert slots == [round_up(n, align) for n in lengths]
        assert N == sum(round_up(n, align) for n in lengths)
    else:
        assert N == B * round_up(SEQ, align)
    assert psp.max_seqlen_q % align == 0 and psp.max_seqlen_q >= max(lengths)


def test_tp_without_sequence_parallel_needs_no_alignment(ref, right_batch):
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(tp=2)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    run_step(model, right_batch, state)
    assert model.calls[-1]["input_ids"].shape[1] == sum(real_lengths(right_batch))


# ---------------------------------------------------------------------------------------------
# 6. truncation to seq_length


def _image_end(batch, i) -> int:
    """Rank (among real tokens) of the vision-end token of sample i."""
    return int((real_tokens(batch, i) == VISION_END).nonzero()[0])


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_truncation_of_answer_text(layout, padding, ref, caplog):
    batch = synthetic_receipt_batch(B, seed=SEED, left_padding=padding == "left")
    lengths = real_lengths(batch)
    image_ends = [_image_end(batch, i) for i in range(B)]
    seq = max(max(image_ends) + 10, sorted(lengths)[1])  # cuts at least the two longest... answer text only
    assert seq < max(lengths)
    excess = sum(max(0, n - seq) for n in lengths)
    assert excess > 0
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout=layout)
    run = run_step(model, batch, state)
    assert int(run.stats.truncated_tokens) == excess
    assert int(run.stats.real_tokens) == sum(min(n, seq) for n in lengths)
    kw = model.calls[-1]
    if layout == "thd":
        got = kw["packed_seq_params"].cu_seqlens_q.diff().tolist()
        assert got == [min(n, seq) for n in lengths]
        assert max(got) <= seq
    else:
        # The padded width is seq_length rounded up to Megatron-Bridge 0.6.2's own divisor (16: its
        # step always pads as for FP8); nothing past seq_length is real.
        assert kw["input_ids"].shape[1] == -(-seq // 16) * 16
        # each row holds the sample's first min(n, seq) real tokens, right padded
        for i, n in enumerate(lengths):
            keep_n = min(n, seq)
            assert torch.equal(kw["input_ids"][i, :keep_n], real_tokens(batch, i)[:keep_n])
            assert (kw["input_ids"][i, keep_n:] == PAD).all()
    # supervised tokens: those among each sample's first seq real tokens
    expected_supervised = sum(
        int(batch["loss_mask"][i][batch["attention_mask"][i]][:seq].sum()) for i in range(B)
    )
    assert run.num_tokens == expected_supervised
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "truncat" in r.getMessage()]
    assert warnings
    assert str(excess) in warnings[-1].getMessage()


def test_truncation_that_cuts_an_image_raises(ref, right_batch):
    lengths = real_lengths(right_batch)
    starts = [int((real_tokens(right_batch, i) == IMAGE).nonzero()[0]) for i in range(B)]
    ends = [_image_end(right_batch, i) for i in range(B)]
    # cut inside the image of the sample whose image ends last
    victim = max(range(B), key=lambda i: ends[i])
    seq = ends[victim] - 5
    assert seq > starts[victim]
    expected = [i for i in range(B) if lengths[i] > seq and ends[i] - 1 >= seq]
    assert victim in expected
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout="thd")
    with pytest.raises(ValueError) as info:
        run_step(RecordingSpy(ref), right_batch, state)
    message = str(info.value)
    assert f"seq_length={seq}" in message and "overlong_samples='truncate'" in message
    # The failed samples, each by row and real length, and no other.
    named = [i for i in range(B) if f"row {i}: {lengths[i]} tokens" in message]
    assert named == expected


def test_truncation_that_cuts_all_images_names_every_sample(ref, left_batch):
    state = minimal_state(seq_length=30, micro_batch_size=B, packing_layout="bshd")
    with pytest.raises(ValueError) as info:
        run_step(RecordingSpy(ref), left_batch, state)
    lengths = real_lengths(left_batch)
    assert "seq_length=30" in str(info.value)
    assert all(f"row {i}: {lengths[i]} tokens" in str(info.value) for i in range(B))


# The over-long policy (overlong_samples) on a batch wider than seq_length: a collate that does not cut (a user's own,
# a VERL-like iterator) hands the step the whole samples; the policy decides what the step does with them.


def _overlong_setup(padding: str):
    """A batch with samples over, at and under ``seq``, cut in answer text only (after every image)."""
    batch = synthetic_receipt_batch(B, seed=SEED, left_padding=padding == "left")
    lengths = real_lengths(batch)
    seq = sorted(lengths)[1]  # one sample exactly at seq_length, one under, two over
    assert seq > max(_image_end(batch, i) for i in range(B))
    over = [i for i in range(B) if lengths[i] > seq]
    assert len(over) == 2 and lengths.count(seq) == 1
    return batch, lengths, seq, over


def hf_cut_sample_losses(ref, batch, seq: int) -> list[float]:
    """Each sample alone through the unmodified HF model, cut to its first ``seq`` real tokens (labels and loss mask
    cut with it, as a collate cuts them): CE summed at loss_mask == 1, per sample."""
    grids = batch["visual_inputs"].image_grid_thw
    pixels = batch["visual_inputs"].pixel_values
    patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
    losses = []
    with torch.no_grad():
        for i in range(batch["tokens"].shape[0]):
            keep = batch["attention_mask"][i]
            ids, labels = batch["tokens"][i][keep][:seq], batch["labels"][i][keep][:seq]
            supervised = batch["loss_mask"][i][keep][:seq] == 1
            logits = ref.hf_model(input_ids=ids[None], pixel_values=pixels[patch_ends[i]:patch_ends[i + 1]],
                                  image_grid_thw=grids[i:i + 1], mm_token_type_ids=(ids == IMAGE).int()[None]).logits[0]
            losses.append(float(F.cross_entropy(logits.float()[supervised], labels[supervised], reduction="sum")))
    return losses


def step_sample_losses(run, call: dict, layout: str) -> list[float]:
    """The step's loss per sample: the model's per-token losses times the step's loss mask, summed over each sample's
    slot of the THD row (its real and padded boundaries) or its row of the padded batch."""
    weighted = run.output * run.loss_function.args[0].reshape(run.output.shape)
    if layout == "bshd":
        return weighted.sum(dim=1).tolist()
    params = call["packed_seq_params"]
    bounds = [slot_bounds(params, i) for i in range(B)]
    return [float(weighted.reshape(-1)[start:start + length].sum()) for start, length in bounds]


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_a_batch_wider_than_seq_length_follows_the_policy(policy, layout, padding, ref, caplog):
    """truncate: every sample trains on its first seq_length tokens, as each sample alone cut the same way; drop:
    the over-long samples add nothing to the loss, the others equal each alone; both logged."""
    batch, lengths, seq, over = _overlong_setup(padding)
    caplog.set_level(logging.INFO, logger=LOGGER)
    spy = RecordingSpy(ref, delegate=True)
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout=layout)
    state.cfg.dataset.overlong_samples = policy
    run = run_step(spy, batch, state)
    alone = hf_cut_sample_losses(ref, batch, seq)
    got = step_sample_losses(run, spy.calls[-1], layout if layout == "bshd" else "thd")
    expected = [0.0 if policy == "drop" and i in over else alone[i] for i in range(B)]
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert all(alone[i] > 0 for i in over)  # drop removes a loss that truncate keeps
    cut_supervised = [int(batch["loss_mask"][i][batch["attention_mask"][i]][:seq].sum()) for i in range(B)]
    assert run.num_tokens == sum(n for i, n in enumerate(cut_supervised) if policy == "truncate" or i not in over)
    assert int(run.stats.real_tokens) == sum(min(n, seq) for n in lengths)  # the dropped samples' tokens still run
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    excess = sum(lengths[i] - seq for i in over)
    if policy == "drop":
        assert any(f"dropped {len(over)} over-long sample(s) from the loss (overlong_samples='drop'): {excess} real "
                   "tokens cut" in m for m in messages)
    else:
        assert any(f"truncated {excess} real tokens" in m and "overlong_samples='truncate'" in m for m in messages)


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_refuse_raises_before_the_forward_naming_each_over_long_sample(layout, padding, ref):
    from megatron.bridge_thd.overlong import SAMPLE_INDEX_KEY

    batch, lengths, seq, over = _overlong_setup(padding)
    batch = dict(batch, **{SAMPLE_INDEX_KEY: torch.tensor([70, 71, 72, 73])})  # as our loaders attach them
    spy = RecordingSpy(ref, delegate=True)
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout=layout)
    state.cfg.dataset.overlong_samples = "refuse"
    with pytest.raises(ValueError) as info:
        run_step(spy, batch, state)
    message = str(info.value)
    assert message.startswith(f"overlong_samples='refuse': samples of this micro-batch are longer than seq_length={seq}")
    named = [i for i in range(B) if f"row {i} (dataset sample {70 + i}): {lengths[i]} tokens" in message]
    assert named == over
    assert not spy.calls  # never a cut, never a forward


@pytest.mark.parametrize("policy,refused", [("truncate", True), ("drop", False)])
def test_a_sample_whose_supervision_lies_wholly_past_the_cut(policy, refused, ref):
    """truncate would leave it nothing to train on: refused, naming it; drop takes it out of the loss."""
    batch, lengths, seq, over = _overlong_setup("right")
    victim = over[0]
    loss_mask = batch["loss_mask"].clone()
    loss_mask[victim, :seq] = 0  # supervised only past the cut
    assert loss_mask[victim].sum() > 0
    batch = dict(batch, loss_mask=loss_mask)
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout="thd")
    state.cfg.dataset.overlong_samples = policy
    spy = RecordingSpy(ref, delegate=True)
    if refused:
        with pytest.raises(ValueError) as info:
            run_step(spy, batch, state)
        assert "every supervised token past seq_length" in str(info.value)
        assert f"row {victim}: {lengths[victim]} tokens" in str(info.value) and "overlong_samples='drop'" in str(info.value)
        assert not spy.calls
    else:
        run = run_step(spy, batch, state)
        kept = [int(loss_mask[i][batch["attention_mask"][i]][:seq].sum()) for i in range(B) if i not in over]
        assert run.num_tokens == sum(kept)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_a_cut_image_is_refused_under_every_policy(policy, ref, right_batch):
    ends = [_image_end(right_batch, i) for i in range(B)]
    victim = max(range(B), key=lambda i: ends[i])
    seq = ends[victim] - 5
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout="thd")
    state.cfg.dataset.overlong_samples = policy
    spy = RecordingSpy(ref, delegate=True)
    with pytest.raises(ValueError) as info:
        run_step(spy, right_batch, state)
    assert f"overlong_samples={policy!r}" in str(info.value) and "cut an image or video" in str(info.value)
    assert f"row {victim}:" in str(info.value) and not spy.calls


# ---------------------------------------------------------------------------------------------
# 7. missing attention mask


def _without_mask(batch):
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def test_missing_mask_raises(ref, right_batch):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    with pytest.raises(ValueError, match="skip_getting_attention_mask_from_dataset"):
        run_step(RecordingSpy(ref), _without_mask(right_batch), state)


def test_missing_mask_pad_token_fallback(ref, right_batch, layout_runs):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd",
                          tokenizer=SimpleNamespace(pad_id=0))
    state.cfg.dataset.packing_length_fallback = "pad_token"
    spy = RecordingSpy(ref, delegate=True)
    run = run_step(spy, _without_mask(right_batch), state)
    assert spy.calls[-1]["packed_seq_params"].cu_seqlens_q.diff().tolist() == real_lengths(right_batch)
    assert run.num_tokens == int(right_batch["loss_mask"].sum())
    assert run.loss == pytest.approx(layout_runs["thd", "right"].loss, rel=1e-6)


def test_missing_mask_fallback_uses_model_config_pad_id(ref, right_batch):
    # no tokenizer: the tiny model's text config has pad_token_id=0
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="bshd")
    state.cfg.dataset.packing_length_fallback = "pad_token"
    run = run_step(RecordingSpy(ref), _without_mask(right_batch), state)
    assert int(run.stats.real_tokens) == sum(real_lengths(right_batch))


def test_missing_mask_fallback_without_pad_id_raises(ref, right_batch):
    config = SimpleNamespace(
        image_token_id=250, video_token_id=251, vision_start_token_id=252, spatial_merge_size=2,
        text_config=SimpleNamespace(),
    )
    model = RecordingSpy(ref)
    model.config = config
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd", tokenizer=SimpleNamespace())
    state.cfg.dataset.packing_length_fallback = "pad_token"
    with pytest.raises(ValueError, match="pad"):
        run_step(model, _without_mask(right_batch), state)
    # sanity: the same model works with a pad id on the tokenizer
    state.tokenizer = SimpleNamespace(pad_token_id=0)
    run = run_step(model, _without_mask(right_batch), state)
    assert int(run.stats.real_tokens) == sum(real_lengths(right_batch))


# ---------------------------------------------------------------------------------------------
# 8. CP path: the loss mask goes to the model, a mismatched output is refused
# (the real CP path runs on gloo processes in test_context_parallel.py)


def test_loss_mask_reaches_the_model(ref, right_batch):
    spy = RecordingSpy(ref)
    for layout in ("thd", "bshd"):
        state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout)
        run = run_step(spy, right_batch, state)
        assert spy.calls[-1]["loss_mask"] is run.loss_function.args[0]
        assert int(spy.calls[-1]["loss_mask"].sum()) == int(right_batch["loss_mask"].sum())


def test_output_that_does_not_match_the_loss_mask_is_refused(ref, right_batch):
    """A model that shards the row but does not hand back its local loss mask (the crash of a
    step that gives the model no loss_mask) gets a clear error, not a shape error in the loss."""

    class ShardsWithoutMask(RecordingSpy):
        def forward(self, input_ids, **kwargs):
            return torch.zeros(1, input_ids.shape[1] // 2)

    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    with pytest.raises(ValueError, match="local_loss_mask"):
        run_step(ShardsWithoutMask(ref), right_batch, state)


# ---------------------------------------------------------------------------------------------
# 9. FLOPs / token bookkeeping


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_stats(layout, ref, right_batch):
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout)
    run_step(model, right_batch, state)
    assert len(state.bridge_thd_stats) == 1
    stats = state.bridge_thd_stats[0]
    lengths = real_lengths(right_batch)
    W = bshd_width(right_batch["tokens"].shape[1])  # Megatron-Bridge's padded width (layouts.bshd_width)
    assert stats.layout == layout
    assert int(stats.real_tokens) == int(right_batch["attention_mask"].sum())
    assert int(stats.truncated_tokens) == 0
    assert stats.padded_tokens == B * W
    assert stats.padded_attention_work == B * W**2
    N = model.calls[-1]["input_ids"].numel()
    assert stats.processed_tokens == N
    if layout == "bshd":
        assert int(stats.attention_work) == B * W**2
        assert N == B * W
    else:
        assert int(stats.attention_work) == sum(n * n for n in lengths)
    if layout == "thd":
        assert N == sum(lengths)
    # micro-batches accumulate
    run_step(model, right_batch, state)
    assert len(state.bridge_thd_stats) == 2


# ---------------------------------------------------------------------------------------------
# 10-12. schedule plan, layout selection, pre-packed batches


def test_return_schedule_plan_with_thd_raises(ref, right_batch):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    with pytest.raises(ValueError, match="return_schedule_plan"):
        run_step(RecordingSpy(ref), right_batch, state, return_schedule_plan=True)


def test_return_schedule_plan_with_bshd_builds_plan(ref, right_batch):
    class PlanSpy(RecordingSpy):
        """Has Megatron-Core's ``GPTModel.build_schedule_plan(input_ids, position_ids,
        attention_mask, ..., labels, loss_mask)`` signature (``models/gpt/gpt_model.py``)."""

        def build_schedule_plan(self, input_ids, position_ids, attention_mask, labels=None, loss_mask=None):
            self.plan_args = dict(input_ids=input_ids, position_ids=position_ids, labels=labels, loss_mask=loss_mask)
            return "plan"

    model = PlanSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="bshd")
    with torch.no_grad():
        plan, loss_function = forward_step(state, iter([right_batch]), model, return_schedule_plan=True)
    assert plan == "plan" and not model.calls
    assert model.plan_args["input_ids"].shape == (B, bshd_width(right_batch["tokens"].shape[1]))
    width = right_batch["tokens"].shape[1]
    assert torch.equal(loss_function.args[0][:, :width], right_batch["loss_mask"])
    assert not loss_function.args[0][:, width:].any()  # the columns the padded width adds are padding


def test_packing_off_is_bshd(ref, right_batch):
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing=False, packing_layout="thd")
    run = run_step(model, right_batch, state)
    assert run.stats.layout == "bshd"
    assert model.calls[-1]["packed_seq_params"] is None
    assert model.calls[-1]["input_ids"].shape == (B, bshd_width(right_batch["tokens"].shape[1]))


@pytest.mark.parametrize("enabled, expected", [(True, "thd"), (False, "bshd")])
def test_enable_in_batch_packing_old_name(enabled, expected, ref, right_batch):
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B)
    del state.cfg.dataset.pack_sequences_in_batch
    state.cfg.dataset.enable_in_batch_packing = enabled
    run = run_step(model, right_batch, state)
    assert run.stats.layout == expected
    assert (model.calls[-1]["packed_seq_params"] is not None) == (expected == "thd")


def test_unknown_layout_raises(ref, right_batch):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="sbhd")
    with pytest.raises(ValueError, match=r"dataset.bridge_thd \(megatron.bridge_thd's settings\):\n- layout: 'sbhd' is not "
                       r"one of \('thd', 'thd_static', 'bshd'\)"):
        run_step(RecordingSpy(ref), right_batch, state)


@pytest.mark.parametrize("key", ["cu_seqlens", "cu_seqlens_q"])
def test_prepacked_batch_raises(key, ref, right_batch):
    batch = dict(right_batch)
    batch[key] = torch.tensor([0, 5, 9], dtype=torch.int32)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    with pytest.raises(ValueError, match="cu_seqlens"):
        run_step(RecordingSpy(ref), batch, state)


def test_energons_own_packing_is_refused_before_the_forward(ref, right_batch):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    state.cfg.dataset.packing_buffer_size = 16
    spy = RecordingSpy(ref)
    with pytest.raises(ValueError, match=r"dataset\.packing_buffer_size: set \(16\)"):
        run_step(spy, right_batch, state)
    assert not spy.calls


def test_input_ids_key_and_wrapped_model(ref, right_batch):
    """``input_ids`` instead of ``tokens``, and a DDP-style ``.module`` wrapper, work alike."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    spy = RecordingSpy(ref)
    batch = {("input_ids" if k == "tokens" else k): v for k, v in right_batch.items()}
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    run = run_step(Wrapper(spy), batch, state)
    assert spy.calls[-1]["packed_seq_params"].cu_seqlens_q.diff().tolist() == real_lengths(right_batch)
    assert spy.calls[-1]["padding_mask"] is not None  # declared by the unwrapped model
    assert run.num_tokens == int(right_batch["loss_mask"].sum())


@pytest.mark.parametrize("padding", ["right", "left"])
def test_4d_megatron_mask_gives_the_same_lengths(padding, ref, right_batch, left_batch):
    """A 4D causal-with-padding mask (True = masked) describes the same real tokens as the 2D one."""
    batch = dict(right_batch if padding == "right" else left_batch)
    keep = batch["attention_mask"]
    T = keep.shape[1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    batch["attention_mask"] = (future[None] | ~keep[:, None, :])[:, None]
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd")
    run = run_step(model, batch, state)
    psp = model.calls[-1]["packed_seq_params"]
    assert psp.cu_seqlens_q.diff().tolist() == real_lengths(right_batch)
    for i in range(B):
        start, length = slot_bounds(psp, i)
        assert torch.equal(model.calls[-1]["input_ids"][0, start : start + length], real_tokens(right_batch, i))
    assert run.num_tokens == int(right_batch["loss_mask"].sum())


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_wide_padding_without_long_samples_truncates_nothing(layout, ref, caplog):
    """A batch padded past seq_length whose samples all fit loses no token and logs no warning."""
    seq = 1800
    batch = synthetic_receipt_batch(B, seed=SEED, pad_to=seq + 200)
    lengths = real_lengths(batch)
    assert max(lengths) <= seq
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=seq, micro_batch_size=B, packing_layout=layout)
    run = run_step(model, batch, state)
    assert int(run.stats.truncated_tokens) == 0
    assert int(run.stats.real_tokens) == sum(lengths)
    assert run.num_tokens == int(batch["loss_mask"].sum())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "truncat" in r.getMessage()]
    if layout == "bshd":
        assert model.calls[-1]["input_ids"].shape == (B, bshd_width(seq))
    else:
        assert model.calls[-1]["input_ids"].shape == (1, sum(lengths))


@pytest.mark.parametrize("fp8", [False, None])
def test_fp8_off_needs_no_fp8_alignment(fp8, ref, right_batch):
    # Megatron's fp8 setting is a recipe name or None; False must not switch on 16-alignment.
    model = RecordingSpy(ref)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout="thd", fp8=fp8)
    run_step(model, right_batch, state)
    assert model.calls[-1]["input_ids"].shape[1] == sum(real_lengths(right_batch))


def test_list_of_model_chunks_is_rejected(ref, right_batch):
    state = minimal_state(seq_length=SEQ, micro_batch_size=B)
    with pytest.raises(ValueError, match="^model: forward_step takes one model chunk"):
        forward_step(state, iter([right_batch]), [ref])


# ---------------------------------------------------------------------------------------------
# TransformerEngine issue 2186 (docs/te-cp-padding.md): THD + CP refused on an affected stack


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_thd_with_cp_is_refused_before_the_forward_on_an_affected_te_stack(ref, right_batch, monkeypatch, layout):
    from megatron.bridge_thd.upstream import te_compat

    # What the detection would read on an H100 with TE 2.6 and cuDNN 9.7.1 (the report).
    monkeypatch.setattr(te_compat, "installed_te_version", lambda: "2.6.0")
    monkeypatch.setattr(te_compat, "_detected_device", lambda: ((9, 0), (9, 7, 1)))
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    monkeypatch.delenv("BRIDGE_THD_ALLOW_TE_CP_PADDING", raising=False)
    model = RecordingSpy(ref)
    model.pg_collection = fake_pg(cp=2)
    state = minimal_state(seq_length=SEQ, micro_batch_size=B, packing_layout=layout)
    if layout == "bshd":  # no ragged attention, no all-padding chunk: accepted
        run_step(model, right_batch, state)
        assert model.calls
        return
    with pytest.raises(ValueError, match="issue 2186.*cuDNN"):
        run_step(model, right_batch, state)
    assert not model.calls
    # The same stack with cuDNN 9.18: accepted.
    monkeypatch.setattr(te_compat, "_detected_device", lambda: ((9, 0), (9, 18, 0)))
    run_step(model, right_batch, state)
    assert model.calls
