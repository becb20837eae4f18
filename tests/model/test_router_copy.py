"""Our copy of Megatron-Core's routing step against Megatron-Core's own, on rows without padding.

``PaddingMaskTopKRouter.routing`` with a padding mask and ``moe_expert_capacity_factor`` set does not
call Megatron-Core's ``TopKRouter.routing``: it runs ``_routing_with_real_token_capacity``, a copy of
that method (``megatron/core/transformer/moe/router.py``) with ``apply_router_token_dropping``
replaced by ``capacity_token_dropping`` (capacity from the real tokens). On a row without padding
(mask all False) the two must agree exactly, so a change upstream that the copy does not follow, or
an edit of the copy, fails here. Reference: Megatron-Core's own ``TopKRouter`` with the same config,
the same weights and expert bias, on the same logits, called

* without a mask (``padding_mask=None``, what an unwrapped model passes), and
* with the same all-False mask, where Megatron-Core accepts one (not with expert bias: its
  ``_apply_expert_bias`` crashes on the flattened mask, docs/moe-padding-mask.md).

Compared, over two micro-batches (``global_aux_loss`` accumulates across them): probs and
routing_map (``torch.equal``), the gradient reaching the logits from ``probs.sum()`` (carries the
aux losses and the z-loss that the routing attaches), every metric recorded in Megatron-Core's
``get_moe_metrics_tracker()`` (``load_balancing_loss``, ``seq_load_balancing_loss``,
``global_load_balancing_loss``, ``z_loss``), and the router buffers ``local_tokens_per_expert``
(expert-bias counts), ``global_tokens_per_expert`` and ``ga_steps``. Train mode, grad enabled, so
every aux loss is computed. A spy asserts that our copy is what ran.

Where each routing setting comes from (Megatron-Bridge, both installed lines):

* ``qwen3_vl``: ``Qwen3VLMoEModelProvider`` (``models/qwen_vl/qwen3_vl_provider.py``:
  ``moe_router_score_function="softmax"``, ``moe_router_pre_softmax=False``, fp32 router) and
  ``Qwen3VLBridge.provider_bridge`` (``models/qwen_vl/qwen3_vl_bridge.py``:
  ``moe_router_load_balancing_type="aux_loss"``, ``moe_aux_loss_coeff=1e-3``).
* ``qwen35_vl``: ``Qwen35VLMoEModelProvider`` (``models/qwen_vl/qwen35_vl_provider.py``) and
  ``models/qwen/qwen35_bridge.py``: ``global_aux_loss`` 1e-3, softmax (Megatron-Core's default),
  ``pre_softmax=False``. Its recipes (``recipes/qwen_vl/h100/qwen35_vl.py``) set
  ``moe_router_fusion=True``, a Transformer Engine kernel not available on the CPU: unfused here.
* ``seq_aux_loss``: the load-balancing type this package computes per sample
  (docs/moe-routing.md, tests/model/test_moe_routing.py).
* ``sigmoid_expert_bias_z_loss``: the setting of tests/model/test_moe_padding.py (sigmoid scores,
  expert bias, aux loss, z-loss), the path of Megatron-Core's expert-bias bug that the wrapper fixes.
* ``none``: ``moe_router_load_balancing_type="none"``, no aux loss (only the z-loss).
* ``every_aux_loss``: Megatron-Core's list form, ``aux_loss``, ``seq_aux_loss`` and
  ``global_aux_loss`` at once (each ``_apply_*`` call of the copy with its own coefficient).
* ``pre_softmax_scaled``: ``moe_router_pre_softmax=True`` with ``moe_router_topk_scaling_factor``.
* ``group_limited``: ``moe_router_num_groups`` / ``moe_router_group_topk`` (DeepSeek-style,
  sigmoid, expert bias, scaling). No Qwen recipe sets them; kept because the copy passes them on.

No Qwen-VL recipe sets ``moe_expert_capacity_factor`` (they are dropless, where our router is
Megatron-Core's own); the capacity settings are Megatron-Core's: factor 0.5 (the capacity binds and
tokens are dropped), 1.0, 4.0 (capacity above the token count: nothing dropped), each with
``moe_pad_expert_input_to_capacity`` off and on, drop policy ``"probs"`` (the only one
``with_padding_mask`` accepts). Megatron-Core's ``TransformerConfig`` refuses the capacity factor
with ``sinkhorn`` balancing, so the copy's ``sinkhorn`` branch cannot be reached and is not tested.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.bridge_thd.moe_padding.routers import PaddingMaskTopKRouter

pytestmark = pytest.mark.usefixtures("real_model_stack")

SEQ, BATCH, EXPERTS, TOPK, LAYERS, LAYER = 12, 3, 8, 2, 2, 2
MICRO_BATCHES = 2

ROUTINGS = {
    "qwen3_vl": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3),
    "qwen35_vl": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-3),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2),
    "sigmoid_expert_bias_z_loss": dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
    ),
    "none": dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=1e-3),
    "every_aux_loss": dict(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
        moe_aux_loss_coeff=[1e-2, 2e-2, 3e-2], moe_z_loss_coeff=1e-3,
    ),
    "pre_softmax_scaled": dict(
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_router_pre_softmax=True,
        moe_router_topk_scaling_factor=2.5,
    ),
    "group_limited": dict(
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
    ),
}
# The metrics each setting must record (so that a copy that skips one is caught, not compared as absent).
METRICS = {
    "qwen3_vl": {"load_balancing_loss"},
    "qwen35_vl": {"global_load_balancing_loss"},
    "seq_aux_loss": {"seq_load_balancing_loss"},
    "sigmoid_expert_bias_z_loss": {"load_balancing_loss", "z_loss"},
    "none": {"z_loss"},
    "every_aux_loss": {"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"},
    "pre_softmax_scaled": {"load_balancing_loss"},
    "group_limited": {"seq_load_balancing_loss"},
}
BUFFERS = ("local_tokens_per_expert", "expert_bias", "global_tokens_per_expert", "ga_steps")


def _config(**settings):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=16, num_attention_heads=2, num_moe_experts=EXPERTS, moe_ffn_hidden_size=16,
        moe_router_topk=TOPK, moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall",
        moe_token_drop_policy="probs", **settings,
    )


def _routers(config):
    """Megatron-Core's TopKRouter twice (mask None, mask all False) and ours, in the same state."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter

    pg = ProcessGroupCollection.use_mpu_process_groups()
    torch.manual_seed(0)
    routers = [TopKRouter(config, pg_collection=pg), TopKRouter(config, pg_collection=pg),
               PaddingMaskTopKRouter(config, pg_collection=pg)]
    if routers[0].expert_bias is not None:  # a bias that changes the selection
        routers[0].expert_bias.copy_(torch.randn(EXPERTS) * 0.5)
    for router in routers:
        router.load_state_dict(routers[0].state_dict())
        router.set_layer_number(LAYER)
        router.train()
    return routers


def _route(router, logits, padding_mask):
    """One routing step; what it returns, records and accumulates."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    tracker.clear()
    logits = logits.clone().requires_grad_(True)
    with torch.enable_grad():
        if padding_mask is None:
            probs, routing_map = router.routing(logits)
        else:
            probs, routing_map = router.routing(logits, padding_mask=padding_mask)
        probs.sum().backward()
    metrics = {name: metric.values.clone() for name, metric in tracker.metrics.items() if metric.values.any()}
    buffers = {name: getattr(router, name).clone() for name in BUFFERS if getattr(router, name, None) is not None}
    return dict(probs=probs.detach(), routing_map=routing_map, grad=logits.grad, metrics=metrics, buffers=buffers)


def _assert_same(got, want, what):
    assert torch.equal(got["routing_map"], want["routing_map"]), f"routing_map differs from {what}"
    assert torch.equal(got["probs"], want["probs"]), f"probs differ from {what}"
    assert torch.equal(got["grad"], want["grad"]), f"the gradient reaching the logits differs from {what}"
    assert got["metrics"].keys() == want["metrics"].keys(), what
    for name in want["metrics"]:
        assert torch.equal(got["metrics"][name], want["metrics"][name]), f"{name} differs from {what}"
    assert got["buffers"].keys() == want["buffers"].keys(), what
    for name in want["buffers"]:
        assert torch.equal(got["buffers"][name], want["buffers"][name]), f"{name} differs from {what}"


@pytest.mark.parametrize("pad_to_capacity", [False, True], ids=["dropping", "pad_to_capacity"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_the_copy_routes_as_megatron_core_without_padding(routing, capacity_factor, pad_to_capacity):
    config = _config(moe_expert_capacity_factor=capacity_factor, moe_pad_expert_input_to_capacity=pad_to_capacity,
                     **ROUTINGS[routing])
    upstream, upstream_masked, ours = _routers(config)
    copy_calls = []
    copy = ours._routing_with_real_token_capacity
    ours._routing_with_real_token_capacity = lambda *args, **kwargs: copy_calls.append(1) or copy(*args, **kwargs)
    # Megatron-Core's expert-bias path refuses a (tokens,) mask against (tokens, experts).
    upstream_takes_mask = not config.moe_router_enable_expert_bias

    gen = torch.Generator().manual_seed(1)
    no_padding = torch.zeros(SEQ, BATCH, dtype=torch.bool)
    counted = 0
    for step in range(MICRO_BATCHES):
        logits = torch.randn(SEQ, BATCH, EXPERTS, generator=gen) * 2
        got = _route(ours, logits, no_padding)
        assert len(copy_calls) == step + 1, "PaddingMaskTopKRouter.routing did not take its copy"
        _assert_same(got, _route(upstream, logits, None), "Megatron-Core's routing without a mask")
        if upstream_takes_mask:
            _assert_same(got, _route(upstream_masked, logits, no_padding), "Megatron-Core's routing, mask all False")

        # The case is the one named: the metrics are recorded, the capacity binds or not, expert bias counts.
        assert set(got["metrics"]) == METRICS[routing] | ({"z_loss"} if config.moe_z_loss_coeff else set())
        routed = int(got["routing_map"].sum())
        if capacity_factor == 0.5:
            assert (got["probs"] > 0).sum() < SEQ * BATCH * TOPK  # tokens were dropped
        if pad_to_capacity:  # every expert gets exactly its capacity of slots
            capacity = min(SEQ * BATCH, math.ceil(SEQ * BATCH * TOPK / EXPERTS * capacity_factor))
            assert (got["routing_map"].sum(dim=0) == capacity).all()
        elif capacity_factor == 4.0:  # nothing dropped
            assert routed == SEQ * BATCH * TOPK
        if config.moe_router_enable_expert_bias:
            counted += routed  # the counts accumulate over the micro-batches
            assert int(got["buffers"]["local_tokens_per_expert"].sum()) == counted
