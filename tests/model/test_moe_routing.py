"""MoE routing that does not depend on the layout: expert capacity and ``seq_aux_loss``.

Megatron-Core 0.19.2 (``transformer/moe/router.py``, ``moe_utils.py``) sizes each expert's
capacity from every slot the router sees and lets padding compete for it, and computes
``seq_aux_loss`` per ``(s, b)`` sequence, so a THD row (``b = 1``) would give one whole-row
statistic. With :func:`~megatron.bridge_thd.moe_padding.with_padding_mask` the capacity comes from
the real tokens and padding takes none of it, and ``seq_aux_loss`` is computed per sample.

References, independent of our code:
* token dropping: Megatron-Core's own ``apply_router_token_dropping`` on the real tokens alone;
* the real model: Megatron-Core's own router, unwrapped, on a batch without any padding (every
  sample cut to the same length, the batch as wide as that length, the padded layout): the loss and
  the per-layer ``seq_aux_loss`` of the packed layouts of that batch, and of the same samples
  with padding, must equal it.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _real_model import trimmed

from megatron.bridge_thd.moe_padding.capacity import capacity_token_dropping
from megatron.bridge_thd.moe_padding.hook import with_padding_mask
from megatron.bridge_thd.moe_padding.mask import thd_sample_index
from megatron.bridge_thd_cpu.data import padding_free_batch, synthetic_receipt_batch
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import step_run

pytestmark = pytest.mark.usefixtures("real_model_stack")

SEQ = 640
# layout -> (padding side, step settings): thd with an FP8 alignment of 16 (alignment padding in
# every slot), thd_static (a tail), bshd (padding columns).
CASES = {"thd": ("left", dict(fp8="hybrid")), "thd_static": ("right", {}), "bshd": ("right", {})}


# ---------------------------------------------------------------------------------------------
# token dropping against Megatron-Core's own function


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5, 4.0])
@pytest.mark.parametrize("pad_to_capacity", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_dropping_equals_megatron_on_the_real_tokens_alone(capacity_factor, pad_to_capacity, seed):
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    gen = torch.Generator().manual_seed(seed)
    tokens, experts, topk = 40, 4, 2
    logits = torch.randn(tokens, experts, generator=gen)
    top = logits.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.softmax(logits, -1) * routing_map
    padding = torch.rand(tokens, generator=gen) < 0.4
    real = ~padding
    want_probs, want_map = apply_router_token_dropping(
        probs[real], routing_map[real], router_topk=topk, capacity_factor=capacity_factor, drop_policy="probs"
    )
    got_probs, got_map = capacity_token_dropping(probs, routing_map, padding, router_topk=topk,
                                                 capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity)
    # The weights each real token gets are Megatron-Core's; padding gets none.
    torch.testing.assert_close(got_probs[real], want_probs, rtol=0, atol=0)
    assert not got_probs[padding].any()
    if not pad_to_capacity:
        assert torch.equal(got_map[real], want_map) and not got_map[padding].any()
    else:  # static shapes: every expert gets the same number of slots, the kept tokens among them
        assert (got_map.sum(0) == got_map.sum(0)[0]).all()
        assert (got_map[real] >= want_map).all()
    if capacity_factor == 0.5:
        assert want_map.sum() < routing_map[real].sum()  # the capacity binds: tokens were dropped


def test_sample_index_counts_samples_not_padding_segments():
    from megatron.core.packed_seq_params import PackedSeqParams

    # samples of 3, 0 (all padding) and 5 real tokens in slots of 4, 0, 8; then a static tail of 4.
    cu = torch.tensor([0, 3, 3, 8, 8], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 4, 12, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu_padded)
    segment, samples = thd_sample_index(params, 16)
    assert segment.tolist() == [[0] * 4 + [2] * 8 + [3] * 4]
    assert int(samples) == 3


# ---------------------------------------------------------------------------------------------
# the real MoE model


def _model(wrapped: bool, **settings):
    model = build_qwen3_vl(tiny_qwen3_vl_config(moe=True, seq_length=SEQ, **settings), seed=0)
    return with_padding_mask(model) if wrapped else model


def _seq_aux(model) -> list[float]:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker().metrics["seq_load_balancing_loss"].values.tolist()


def _run(model, batch, layout, settings):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    run = step_run(model, batch, layout, seq_length=SEQ, **settings)
    return float(run.loss), int(run.num_tokens)


@pytest.fixture(scope="module")
def batches():
    """Padded batches (left / right) and the same samples cut to one length, without padding."""
    padded = {side: synthetic_receipt_batch(3, seed=1, left_padding=side == "left") for side in ("left", "right")}
    right = padded["right"]
    # Cut to a multiple of 16: the padded layout rounds its width up to 16 (Megatron-Bridge 0.6.2's
    # use_fp8_padding, layouts.bshd_alignment), which would add padding columns otherwise.
    unpadded = padding_free_batch(right)
    assert unpadded["attention_mask"].all() and unpadded["tokens"].shape[1] % 16 == 0
    # The same samples as trimmed() cuts them: only the last token loses its supervision.
    reference = trimmed(right, [unpadded["tokens"].shape[1]] * 3)
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(unpadded[name], reference[name][:, : unpadded["tokens"].shape[1]].to(unpadded[name].dtype))
    # No image was cut: every image token of the batch is still there.
    assert int((unpadded["tokens"] == 250).sum()) == int((right["tokens"] == 250).sum())
    return padded, unpadded


CAPACITY = dict(moe_expert_capacity_factor=1.0)


@pytest.mark.parametrize("pad_to_capacity", [False, True])
def test_capacity_loss_is_the_same_in_every_layout(batches, pad_to_capacity):
    padded, unpadded = batches
    settings = dict(CAPACITY, moe_pad_expert_input_to_capacity=pad_to_capacity)
    plain, wrapped = _model(False, **settings), _model(True, **settings)
    for batch in (unpadded, padded):
        if batch is unpadded:  # Megatron-Core's own router on a batch without padding
            reference = _run(plain, batch, "bshd", {})
        results = {layout: _run(wrapped, batch if batch is unpadded else batch[side], layout, st)
                   for layout, (side, st) in CASES.items()}
        if batch is unpadded:
            assert all(r == pytest.approx(reference, rel=1e-6) for r in results.values()), (reference, results)
        else:
            losses = [loss for loss, _ in results.values()]
            assert max(losses) - min(losses) <= 1e-6 * abs(losses[0]), results
    # The capacity binds (tokens are dropped) and, unwrapped, padding changes what is dropped.
    no_capacity = _run(_model(False), unpadded, "bshd", {})
    assert no_capacity[0] != pytest.approx(reference[0], rel=1e-6)
    unwrapped = _run(plain, padded["right"], "bshd", {})
    assert unwrapped[0] != pytest.approx(results["bshd"][0], rel=1e-6)


def test_megatrons_token_dropping_is_never_replaced(batches):
    """The capacity of real tokens lives in the padding-aware router's own code path: after a
    wrapped model with expert capacity has been built and run, Megatron-Core's router module still
    calls Megatron-Core's own ``apply_router_token_dropping``."""
    from megatron.core.transformer.moe import moe_utils, router

    from megatron.bridge_thd.moe_padding.routers import PaddingMaskTopKRouter

    padded, _ = batches
    wrapped = _model(True, **CAPACITY)
    assert all(isinstance(layer.mlp.router, PaddingMaskTopKRouter) for layer in wrapped.language_model.decoder.layers)
    for layout, (side, settings) in CASES.items():
        _run(wrapped, padded[side], layout, settings)
    assert router.apply_router_token_dropping is moe_utils.apply_router_token_dropping
    assert router.apply_router_token_dropping.__module__ == "megatron.core.transformer.moe.moe_utils"


SEQ_AUX = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2)


def test_seq_aux_loss_is_per_sample_in_every_layout(batches):
    padded, unpadded = batches
    plain, wrapped = _model(False, **SEQ_AUX), _model(True, **SEQ_AUX)
    _run(plain, unpadded, "bshd", {})
    reference = torch.tensor(_seq_aux(plain))  # Megatron-Core's router, no padding anywhere
    _run(wrapped, padded["right"], "bshd", {})
    padded_reference = torch.tensor(_seq_aux(wrapped))  # Megatron-Core's (s, b) path, padding masked
    for layout, (side, settings) in CASES.items():
        _run(wrapped, unpadded, layout, settings)
        torch.testing.assert_close(torch.tensor(_seq_aux(wrapped)), reference, rtol=1e-5, atol=0)
        _run(wrapped, padded[side], layout, settings)
        torch.testing.assert_close(torch.tensor(_seq_aux(wrapped)), padded_reference, rtol=1e-5, atol=0)
    # Control: Megatron-Core's own router on a THD row of the same samples (the step let through on
    # purpose) gives a whole-row statistic, visibly not the per-sample one.
    plain.bridge_thd_routes_real_tokens_only = True
    _run(plain, unpadded, "thd", {})
    assert (torch.tensor(_seq_aux(plain)) - reference).abs().max() > 1e-3


@pytest.mark.parametrize("settings", [CAPACITY, SEQ_AUX], ids=["capacity", "seq_aux_loss"])
def test_the_step_refuses_thd_without_the_wrapper(batches, settings, caplog):
    padded, _ = batches
    model = _model(False, **settings)
    for layout in ("thd", "thd_static"):
        name = "moe_expert_capacity_factor" if settings is CAPACITY else "seq_aux_loss"
        with pytest.raises(ValueError, match=f"{name}.* with layout='{layout}'.*padding_mask_pre_wrap_hook.*or set layout='bshd'"):
            step_run(model, padded["right"], layout, seq_length=SEQ)
    caplog.set_level(logging.WARNING)
    step_run(model, padded["right"], "bshd", seq_length=SEQ)  # Megatron-Bridge's own layout: a warning


@pytest.mark.parametrize("settings,match", [
    (dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"), "moe_token_drop_policy='position'"),
    (dict(SEQ_AUX, recompute_granularity="selective", recompute_modules=["moe"]), "recompute_modules"),
])
def test_settings_the_wrapper_cannot_make_layout_independent_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        _model(True, **settings)
