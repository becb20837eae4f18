"""Parity on Megatron-Bridge 0.6.2's own ``Qwen3VLModel`` (vision tower included), built on the CPU.

The step's packed forward (``thd``, ``thd_static``) and its padded one (``bshd``) must equal each
sample run alone through the same model, which then computes its own MRoPE positions with
Megatron-Bridge's unpacked ``get_rope_index``: per-token log-probabilities, loss sums, token
counts and gradients. Dense and MoE (4 experts, top-2, allgather dispatcher). Every sample holds
an image; two hold a video of several frames before it (``_real_model.VIDEOS``), so images and
videos interleave in the row as Megatron-Bridge's ``reorganize_inputs`` orders them.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from _real_model import IMAGE, VIDEO, VIDEOS, all_padding_batch, last_slot_batch, video_receipt_batch

from megatron.bridge_thd import mrope, qwen3_vl_step, step
from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import (
    gradients,
    masked_loss_sum,
    max_abs_dlogp,
    per_sample_from_output,
    per_sample_losses_and_gradients,
    per_sample_token_losses,
    sample_inputs,
    step_run,
    worst_relative_gradient_error,
)
from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.line import upstream_line

LAYOUT_NAMES = ["thd", "thd_static", "bshd"]
DLOGP_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5


# World-size-1 process groups and the CPU patches, for every test here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_model_stack")


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return build_qwen3_vl(tiny_qwen3_vl_config(moe=request.param == "moe"), seed=0)


@pytest.fixture(scope="module")
def batches():
    return {padding: video_receipt_batch(padding) for padding in ("right", "left")}


@pytest.fixture(scope="module")
def alone(model, batches):
    """Per-sample per-token losses (right and left padded batches hold the same samples)."""
    with torch.no_grad():
        return per_sample_token_losses(model, batches["right"])


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_per_token_logp_equals_each_sample_alone(model, batches, alone, layout, padding):
    batch = batches[padding]
    with torch.no_grad():
        run = step_run(model, batch, layout)
    packed = per_sample_from_output(run, batch)
    assert [p.numel() for p in packed] == [a.numel() for a in alone]
    # The videos reach the model as they came, in order of appearance.
    assert torch.equal(run.args["video_grid_thw"], batch["visual_inputs"].video_grid_thw)
    assert torch.equal(run.args["pixel_values_videos"], batch["visual_inputs"].pixel_values_videos)
    assert max_abs_dlogp(packed, alone, batch) <= DLOGP_TOLERANCE
    # Loss sum and token count: what Megatron-Bridge's loss function reports.
    assert float(run.loss) == pytest.approx(masked_loss_sum(alone, batch), rel=1e-6)
    assert int(run.num_tokens) == int(batch["loss_mask"].sum())


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_gradients_equal_each_sample_alone(model, batches, layout):
    batch = batches["left"]
    _, reference = per_sample_losses_and_gradients(model, batch)
    step_run(model, batch, layout).loss.backward()
    packed = gradients(model)
    model.zero_grad(set_to_none=True)
    assert any(float(g.abs().max()) > 0 for name, g in reference.items() if "vision_model" in name)
    error, where = worst_relative_gradient_error(packed, reference)
    assert error <= GRAD_TOLERANCE, f"{where}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_positions_equal_bridge_packed_get_rope_index(model, batches, layout):
    """The step's explicit (3, 1, N) MRoPE ids equal Megatron-Bridge's own packed get_rope_index
    (``modelling_qwen3_vl/rope.py``) on the same row and metadata, at every real slot."""
    rope = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.rope")
    batch = batches["left"]
    with torch.no_grad():
        run = step_run(model, batch, layout)
    args = run.args
    params = args["packed_seq_params"]
    if layout == "thd_static":
        # Megatron-Bridge's packed get_rope_index cannot take a segment without real tokens
        # (torch.cat of an empty list): drop the static tail, which holds no position to compare.
        with pytest.raises(ValueError, match="non-empty"):
            rope.get_rope_index(2, 250, 251, 252, args["input_ids"], image_grid_thw=args["image_grid_thw"],
                                video_grid_thw=args["video_grid_thw"], packed_seq_params=params)
        params = dataclasses.replace(params, cu_seqlens_q=params.cu_seqlens_q[:-1],
                                     cu_seqlens_q_padded=params.cu_seqlens_q_padded[:-1])
    ids = args["input_ids"][:, : int(params.cu_seqlens_q_padded[-1])]
    theirs, _ = rope.get_rope_index(2, 250, 251, 252, ids, image_grid_thw=args["image_grid_thw"],
                                    video_grid_thw=args["video_grid_thw"], packed_seq_params=params)
    ours = args["position_ids"][..., : ids.shape[1]]
    real = ids != 0
    assert real.sum() == batch["attention_mask"].sum()
    assert int((ids == VIDEO).sum()) == sum(t * h * w // 4 for t, h, w in VIDEOS.values())
    assert torch.equal(ours[:, real], theirs[:, real])


def test_degenerate_positions_control_fails(model, batches, alone):
    """The check can fail: 1D per-sample positions copied to the three MRoPE channels (what a
    naive packer emits) change the log-probabilities of image samples far beyond tolerance."""
    batch = batches["right"]
    with torch.no_grad():
        run = step_run(model, batch, "thd")
        args = dict(run.args)
        params = args["packed_seq_params"]
        slot = torch.arange(args["input_ids"].shape[1])
        segment = torch.searchsorted(params.cu_seqlens_q_padded[1:].long(), slot, right=True)
        flat = slot - params.cu_seqlens_q_padded.long()[segment]
        args["position_ids"] = flat.expand(3, 1, -1).clone()
        degenerate = model(**args)
    run.output = degenerate
    assert all(int((batch["tokens"][i] == IMAGE).sum()) > 0 for i in range(batch["tokens"].shape[0]))
    assert max_abs_dlogp(per_sample_from_output(run, batch), alone, batch) > 1e-3


def _assert_only_video_samples_move(run, batch, alone):
    """max |dlogp| vs alone > 1e-3 on every sample with a video, within tolerance on the others."""
    packed = per_sample_from_output(run, batch)
    for i in range(batch["tokens"].shape[0]):
        one = {k: (v[i : i + 1] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        dlogp = max_abs_dlogp(packed[i : i + 1], alone[i : i + 1], one)
        assert (dlogp > 1e-3) if i in VIDEOS else (dlogp <= DLOGP_TOLERANCE), (i, dlogp)


def test_video_pixels_reach_the_compared_tokens(model, batches, alone):
    """The check sees the videos: the same row with the video pixels zeroed moves the video
    samples' log-probabilities far beyond tolerance (and leaves the sample without a video as it was)."""
    batch = batches["right"]
    visual = batch["visual_inputs"]
    blank = {**batch, "visual_inputs": dataclasses.replace(visual, pixel_values_videos=torch.zeros_like(
        visual.pixel_values_videos))}
    with torch.no_grad():
        run = step_run(model, blank, "thd")
    _assert_only_video_samples_move(run, batch, alone)


def test_video_positions_without_the_frame_split_control_fails(model, batches, alone, monkeypatch):
    """The frame split is load-bearing: laying each video out as one (t, h, w) item, as an image
    would be, instead of t frames of (1, h, w) each at the running text position, moves the video
    samples' log-probabilities far beyond tolerance."""
    vision_positions = mrope._vision_positions
    monkeypatch.setattr(mrope, "_vision_positions", lambda *args, frames=False: vision_positions(*args))
    batch = batches["right"]
    with torch.no_grad():
        run = step_run(model, batch, "thd")
    _assert_only_video_samples_move(run, batch, alone)


def test_parity_helpers_take_any_mask_the_step_takes(model, batches, alone):
    """``bridge_thd_cpu.parity`` reads the mask as the step does: a float (1.0 / 0.0) or int 2D keep mask,
    or a 4D Megatron mask (True = masked), not only a bool one (a float mask used to fail with
    'slice indices must be integers')."""
    batch = batches["left"]
    keep = batch["attention_mask"]
    causal = torch.ones(keep.shape[1], keep.shape[1], dtype=torch.bool).tril()
    masks = {"float": keep.float(), "int": keep.long(),
             "4d": ~(causal[None] & keep[:, None, :] & keep[:, :, None])[:, None]}
    with torch.no_grad():
        run = step_run(model, {**batch, "attention_mask": masks["float"]}, "thd")
    assert float(run.loss) == pytest.approx(masked_loss_sum(alone, batch), rel=1e-6)
    reference = per_sample_from_output(run, batch)
    for kind, mask in masks.items():
        other = {**batch, "attention_mask": mask}
        for i in range(keep.shape[0]):
            ours, expected = sample_inputs(other, i), sample_inputs(batch, i)
            assert ours.keys() == expected.keys(), kind
            assert all(torch.equal(ours[k], expected[k]) for k in ours), kind
        packed = per_sample_from_output(run, other)
        assert all(torch.equal(p, r) for p, r in zip(packed, reference)), kind
        assert max_abs_dlogp(packed, alone, other) <= DLOGP_TOLERANCE, kind
        assert masked_loss_sum(alone, other) == pytest.approx(masked_loss_sum(alone, batch), rel=1e-12), kind


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_all_padding_micro_batch_trains_on_nothing(model, layout):
    """No real token at all: the model gets one aligned padding segment (thd), the static row or
    the padded batch, and the loss is 0 over 0 tokens with zero gradients, not a crash."""
    batch = all_padding_batch()
    model.zero_grad(set_to_none=True)
    run = step_run(model, batch, layout)
    assert run.args["input_ids"].numel() > 0
    assert float(run.loss) == 0.0 and int(run.num_tokens) == 0
    run.loss.backward()
    assert all(float(g.abs().max()) == 0.0 for g in gradients(model).values())
    model.zero_grad(set_to_none=True)


def test_bridge_model_gets_no_undeclared_extras(model, batches, monkeypatch, caplog):
    """Where Qwen3VLModel declares no padding_mask, its **kwargs go on to the language model, which raises
    TypeError on the name, so the step must not pass it, and says so once. Where it declares one
    (``upstream_line().model_takes_padding_mask``), the step passes its mask, so the model derives none itself
    (host reads, and a refusal of zero-length segments); neither line declares rope_cu_seqlens."""
    caplog.set_level(logging.INFO, logger="megatron.bridge_thd")
    batch = batches["right"]
    with torch.no_grad():
        run = step_run(model, batch, "thd")
        message = next(r.getMessage() for r in caplog.records if "Qwen3VLModel" in r.getMessage())
        passed, _, not_passed = message.partition("not declared")
        assert "rope_cu_seqlens" not in run.args and "rope_cu_seqlens" in not_passed
        if upstream_line().model_takes_padding_mask:
            assert "padding_mask" in passed and "padding_mask" in run.args
            assert run.args["padding_mask"].shape == run.args["input_ids"].shape
        else:
            assert "padding_mask" not in passed and "padding_mask" in not_passed
            assert "padding_mask" not in run.args
            with pytest.raises(TypeError, match="padding_mask"):
                model(**run.args, padding_mask=torch.zeros_like(run.args["input_ids"], dtype=torch.bool))


def test_pad_between_seqs_catches_padding_in_the_last_slot_only():
    """TransformerEngine <= 2.17.1 derives pad_between_seqs, when left None, as
    ``not torch.equal(cu_seqlens_padded[:-1], cu_seqlens[:-1])`` (issue 3331), which misses
    padding in the last slot; the packer sets it from the totals instead."""
    batch = last_slot_batch(cp_align=8)
    packed = pack_bshd_to_thd(batch["tokens"], batch["attention_mask"], align_to=8)
    cu, cu_padded = packed.cu_seqlens, packed.cu_seqlens_padded
    assert torch.equal(cu[:-1], cu_padded[:-1]) and cu[-1] != cu_padded[-1]
    te_derived = not torch.equal(cu_padded[:-1], cu[:-1])
    assert te_derived is False
    assert packed.packed_seq_params.pad_between_seqs is True
    # No padding anywhere: False, so TE may keep its faster path.
    aligned = pack_bshd_to_thd(batch["tokens"][:-1], batch["attention_mask"][:-1], align_to=8)
    assert aligned.packed_seq_params.pad_between_seqs is False


def test_schedule_plan_on_a_model_without_one_is_refused_clearly(model, batches):
    """0.6.2's Qwen3VLModel has no build_schedule_plan: a clear error, not an AttributeError."""
    with pytest.raises(ValueError, match="build_schedule_plan"):
        step_run_with_plan(model, batches["right"])


def step_run_with_plan(model, batch):
    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd_cpu.standalone import minimal_state

    state = minimal_state(seq_length=2048, micro_batch_size=batch["tokens"].shape[0], packing_layout="bshd")
    return forward_step(state, iter([batch]), model, return_schedule_plan=True)
