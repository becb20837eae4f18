"""Parity on Megatron-Bridge 0.6.2's own ``Qwen3VLModel`` (vision tower included), built on the CPU.

The step's packed forward (``thd``, ``thd_static``) and its padded one (``bshd``) must equal each
sample run alone through the same model, which then computes its own MRoPE positions with
Megatron-Bridge's unpacked ``get_rope_index``: per-token log-probabilities, loss sums, token
counts and gradients. Dense and MoE (4 experts, top-2, allgather dispatcher).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from _real_model import (
    IMAGE,
    all_padding_batch,
    gradients,
    last_slot_batch,
    masked_loss_sum,
    max_abs_dlogp,
    per_sample_losses_and_gradients,
    per_sample_from_output,
    per_sample_token_losses,
    receipt_batch,
    step_run,
    worst_relative_gradient_error,
)

from megatron.bridge_thd import qwen3_vl_step
from megatron.bridge_thd.cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd.upstream import load_bridge_module

LAYOUTS = ["thd", "thd_static", "bshd"]
DLOGP_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5


# World-size-1 process groups and the CPU patches, for every test here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_model_stack")


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request):
    return build_qwen3_vl(tiny_qwen3_vl_config(moe=request.param == "moe"), seed=0)


@pytest.fixture(scope="module")
def batches():
    return {padding: receipt_batch(padding) for padding in ("right", "left")}


@pytest.fixture(scope="module")
def alone(model, batches):
    """Per-sample per-token losses (right and left padded batches hold the same samples)."""
    with torch.no_grad():
        return per_sample_token_losses(model, batches["right"])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_per_token_logp_equals_each_sample_alone(model, batches, alone, layout, padding):
    batch = batches[padding]
    with torch.no_grad():
        run = step_run(model, batch, layout)
    packed = per_sample_from_output(run, batch)
    assert [p.numel() for p in packed] == [a.numel() for a in alone]
    assert max_abs_dlogp(packed, alone, batch) <= DLOGP_TOLERANCE
    # Loss sum and token count: what Megatron-Bridge's loss function reports.
    assert float(run.loss) == pytest.approx(masked_loss_sum(alone, batch), rel=1e-6)
    assert int(run.num_tokens) == int(batch["loss_mask"].sum())


@pytest.mark.parametrize("layout", LAYOUTS)
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
                                packed_seq_params=params)
        params = dataclasses.replace(params, cu_seqlens_q=params.cu_seqlens_q[:-1],
                                     cu_seqlens_q_padded=params.cu_seqlens_q_padded[:-1])
    ids = args["input_ids"][:, : int(params.cu_seqlens_q_padded[-1])]
    theirs, _ = rope.get_rope_index(2, 250, 251, 252, ids, image_grid_thw=args["image_grid_thw"],
                                    packed_seq_params=params)
    ours = args["position_ids"][..., : ids.shape[1]]
    real = ids != 0
    assert real.sum() == batch["attention_mask"].sum()
    assert torch.equal(ours[:, real], theirs[:, real])


def test_degenerate_positions_control_fails(model, batches):
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
    alone = per_sample_token_losses(model, batch)
    assert all(int((batch["tokens"][i] == IMAGE).sum()) > 0 for i in range(batch["tokens"].shape[0]))
    assert max_abs_dlogp(per_sample_from_output(run, batch), alone, batch) > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
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
    """0.6.2's Qwen3VLModel declares no padding_mask: its **kwargs go on to the language model,
    which raises TypeError on the name, so the step must not pass it, and says so once."""
    monkeypatch.setattr(qwen3_vl_step, "_logged_once", set())
    caplog.set_level(logging.INFO, logger="megatron.bridge_thd.qwen3_vl_step")
    batch = batches["right"]
    with torch.no_grad():
        run = step_run(model, batch, "thd")
        message = next(r.getMessage() for r in caplog.records if "Qwen3VLModel" in r.getMessage())
        passed, _, not_passed = message.partition("not declared")
        assert "padding_mask" not in passed and "padding_mask" in not_passed
        assert "padding_mask" not in run.args and "rope_cu_seqlens" not in run.args
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
    from megatron.bridge_thd.standalone import minimal_state

    state = minimal_state(seq_length=2048, micro_batch_size=batch["tokens"].shape[0], packing_layout="bshd")
    return forward_step(state, iter([batch]), model, return_schedule_plan=True)
