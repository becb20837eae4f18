"""``with_padding_mask`` on Megatron-Bridge 0.6.2's real MoE ``Qwen3VLModel`` (CPU build).

The router statistics of a packed micro-batch must be those of its samples run alone, without
padding. What is measured, all by Megatron-Core 0.19.2's own code:

* aux loss and z-loss per layer: ``get_moe_metrics_tracker().metrics`` (``load_balancing_loss``
  = aux loss / coeff, ``z_loss`` = z-loss / coeff), recorded by the router during the forward;
* per-expert token counts per layer: ``router.local_tokens_per_expert``, the counts the router
  accumulates for the expert-bias update (``moe_router_enable_expert_bias``), which the padding
  mask must also clean (Megatron-Core's expert-bias path crashes on the mask; the wrapper fixes it).

Reference ("each sample alone"): the per-expert counts summed over the three samples each run
alone through the unwrapped model. The aux loss and z-loss are statistics of the whole
micro-batch (the aux loss multiplies batch-level token fractions by batch-level probabilities),
so their reference is Megatron-Core's router run on the union of the samples' real tokens: the
router inputs recorded in the per-sample runs, concatenated, no padding, no mask.

The model: tiny Qwen3-VL, 3 MoE layers of 4 experts, top-2, sigmoid scores (expert bias needs
them), aux loss 1e-2, z-loss 1e-3, expert bias on, ``seq_length`` 640 (a ``thd_static`` row of
1920 slots for 1665 real tokens). ``thd`` runs with an FP8 alignment of 16 so that every slot of
the row ends in padding (at TP = CP = 1 a ``thd`` row has none: both models then agree). The
padded layout (``bshd``, a ``(3, 608)`` batch: 601 columns rounded up to 16 as Megatron-Bridge pads) is checked too: the step passes it a ``(B, T)`` mask.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from unittest import mock

import pytest
import torch
from _real_model import FakeGroup

from megatron.bridge_thd import qwen3_vl_step, step
from megatron.bridge_thd.moe_padding.hook import padding_mask_pre_wrap_hook, with_padding_mask
from megatron.bridge_thd.moe_padding.mask import declares_padding_mask, padding_mask_from_packed_seq_params
from megatron.bridge_thd.moe_padding.model import PaddingMaskForward
from megatron.bridge_thd.moe_padding.routers import PaddingMaskMoELayer, PaddingMaskTopKRouter
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import (
    Recorder,
    global_expert_name,
    sample_inputs,
    step_run,
    worst_relative_gradient_error,
)
from megatron.bridge_thd_cpu.stack import QWEN3_VL_MODEL_MODULE
from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.line import upstream_line

SEQ = 640
TOPK = 2
CONFIG = dict(
    moe=True,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
    seq_length=SEQ,
)
# layout -> (padding side of the batch, step settings). fp8 only sets the step's slot alignment
# (16); the model itself runs in fp32.
CASES = {"thd": ("left", dict(fp8="hybrid")), "thd_static": ("right", {}), "bshd": ("right", {})}
PACKED = ["thd", "thd_static"]
RTOL = 1e-5


# ---------------------------------------------------------------------------------------------
# measuring the routers


def _routers(model):
    return [layer.mlp.router for layer in model.language_model.decoder.layers]


def _reset(model):
    """Zero the statistics, their entries created for the model's layers (a router that records only in the
    backward, under recompute, has recorded nothing when the forward's stats are read)."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    tracker = get_moe_metrics_tracker()
    for name in ("load_balancing_loss", "z_loss"):
        tracker.ensure_initialized(name, len(_routers(model)), device="cpu")
    tracker.clear()
    for router in _routers(model):
        router.local_tokens_per_expert.zero_()


def _stats(model) -> dict:
    """Per layer: aux loss / coeff, z-loss / coeff, expert-bias token counts ``(L, E)``."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    metrics = get_moe_metrics_tracker().metrics
    return dict(
        aux=metrics["load_balancing_loss"].values.clone(),
        z=metrics["z_loss"].values.clone(),
        counts=torch.stack([r.local_tokens_per_expert.clone() for r in _routers(model)]),
    )


def _measured_run(model, batch, layout, settings, record_routing=False):
    """The step's forward (train mode, grad on: the router computes its losses) and the stats."""
    routing = []
    handles = []
    if record_routing:
        for router in _routers(model):
            handles.append(router.register_forward_hook(lambda m, a, out: routing.append(out[1].detach())))
    _reset(model)
    try:
        run = step_run(model, batch, layout, seq_length=SEQ, **settings)
    finally:
        for handle in handles:
            handle.remove()
    return dict(run=run, routing=routing, **_stats(model))


# ---------------------------------------------------------------------------------------------
# fixtures


# World-size-1 process groups and the CPU patches, for every test here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_model_stack")


@pytest.fixture(scope="module")
def batches():
    return {side: synthetic_receipt_batch(3, seed=1, left_padding=side == "left") for side in ("left", "right")}


@pytest.fixture(scope="module")
def models():
    """The same weights twice: Megatron-Bridge 0.6.2 as is, and through ``with_padding_mask``."""
    plain = build_qwen3_vl(tiny_qwen3_vl_config(**CONFIG), seed=0)
    masked = build_qwen3_vl(tiny_qwen3_vl_config(**CONFIG), seed=0)
    keys = list(masked.state_dict())
    assert with_padding_mask(masked) is masked
    # In place: same parameters, same state-dict keys (checkpoints and HF export unaffected).
    assert list(masked.state_dict()) == keys
    for (name, a), (_, b) in zip(plain.state_dict().items(), masked.state_dict().items()):
        assert (a is None and b is None) or torch.equal(a, b), name  # None: extra-state entries
    return plain, masked


@pytest.fixture(scope="module")
def reference(models, batches):
    """Each sample alone through the unwrapped model (no padding, no mask)."""
    plain, _ = models
    batch = batches["right"]
    inputs = [[] for _ in _routers(plain)]
    handles = [
        router.register_forward_pre_hook(lambda m, args, i=i: inputs[i].append(args[0].detach()))
        for i, router in enumerate(_routers(plain))
    ]
    _reset(plain)
    try:
        for i in range(batch["tokens"].shape[0]):
            plain(**sample_inputs(batch, i))
    finally:
        for handle in handles:
            handle.remove()
    counts = _stats(plain)["counts"]  # accumulated over the three per-sample runs
    _reset(plain)
    for router, layer_inputs in zip(_routers(plain), inputs):
        router(torch.cat(layer_inputs, dim=0))  # the union of the real tokens, one batch
    union = _stats(plain)
    assert torch.equal(union["counts"], counts)
    real_tokens = int(batch["attention_mask"].sum())
    assert torch.all(counts.sum(dim=1) == real_tokens * TOPK)
    return dict(aux=union["aux"], z=union["z"], counts=counts, real_tokens=real_tokens)


@contextlib.contextmanager
def _expert_bias_off(model):
    """The routers without their expert-bias bookkeeping (the bias itself is zero until an optimizer step
    updates it, so routing and outputs are unchanged)."""
    routers = _routers(model)
    saved = [router.enable_expert_bias for router in routers]
    for router in routers:
        router.enable_expert_bias = False
    try:
        yield
    finally:
        for router, value in zip(routers, saved):
            router.enable_expert_bias = value


@pytest.fixture(scope="module")
def runs(models, batches):
    """(layout, "plain" | "masked") -> measured step run; (layout, "plain_error") -> what the plain model raised.

    Where Qwen3VLModel declares padding_mask, the step hands the plain model its mask, and Megatron-Core's router
    crashes on it with expert bias on: that error is kept, and "plain" is then the run without expert-bias
    bookkeeping (same outputs)."""
    plain, masked = models
    out = {}
    for layout, (side, settings) in CASES.items():
        try:
            out[layout, "plain"] = _measured_run(plain, batches[side], layout, settings)
        except RuntimeError as error:
            out[layout, "plain_error"] = error
            with _expert_bias_off(plain):
                out[layout, "plain"] = _measured_run(plain, batches[side], layout, settings)
        out[layout, "masked"] = _measured_run(masked, batches[side], layout, settings, record_routing=True)
    return out


# ---------------------------------------------------------------------------------------------
# 1. the statistics of a packed row equal those of the samples alone


@pytest.mark.parametrize("layout", list(CASES))
def test_packed_row_router_statistics_equal_each_sample_alone(runs, reference, layout):
    got = runs[layout, "masked"]
    slots = got["run"].args["input_ids"].numel()
    assert slots > reference["real_tokens"], "the micro-batch must hold padding for this test to mean anything"
    assert torch.equal(got["counts"], reference["counts"])
    torch.testing.assert_close(got["aux"], reference["aux"], rtol=RTOL, atol=0)
    torch.testing.assert_close(got["z"], reference["z"], rtol=RTOL, atol=0)


@pytest.mark.parametrize("layout", list(CASES))
def test_without_the_wrapper_padding_slots_are_counted(runs, reference, layout):
    """The control. Where Qwen3VLModel declares no padding_mask, the model as is counts every slot of the
    micro-batch. Where it declares one, the step hands it the mask: its aux loss and z-loss leave padding out,
    but Megatron-Core's router crashes on the mask with expert bias (``routing_map & ~padding_mask``, (tokens, E)
    against (tokens,)), which is why the wrapper's routers are needed on that line too."""
    got = runs[layout, "plain"]
    run = got["run"]
    slots = run.args["input_ids"].numel()
    if upstream_line().model_takes_padding_mask:
        error = runs[layout, "plain_error"]
        assert "must match the size of tensor b" in str(error) and f"({slots})" in str(error)
        torch.testing.assert_close(got["aux"], reference["aux"], rtol=RTOL, atol=0)
        torch.testing.assert_close(got["z"], reference["z"], rtol=RTOL, atol=0)
        return
    assert "padding_mask" not in run.args
    padding = slots - reference["real_tokens"]
    assert torch.all(got["counts"].sum(dim=1) == slots * TOPK)
    assert torch.all(got["counts"].sum(dim=1) - reference["counts"].sum(dim=1) == padding * TOPK)
    assert not torch.equal(got["counts"], reference["counts"])
    # Padding shifts the losses far beyond float noise (the wrapped runs match to ~1e-7; thd has
    # only 15 padding slots here and is off by ~1e-3, thd_static by ~1e-2).
    assert ((got["aux"] - reference["aux"]).abs() / reference["aux"]).max() > 1e-4
    assert ((got["z"] - reference["z"]).abs() / reference["z"]).max() > 1e-4


@pytest.mark.parametrize("layout", list(CASES))
def test_per_token_losses_are_unchanged_by_the_mask(runs, layout):
    """The mask only changes router statistics: the main loss is bit for bit the same."""
    plain, masked = runs[layout, "plain"]["run"], runs[layout, "masked"]["run"]
    assert torch.equal(masked.output, plain.output)
    assert torch.equal(masked.loss, plain.loss) and torch.equal(masked.num_tokens, plain.num_tokens)


def test_padding_slots_are_still_routed(runs):
    """As in Megatron-Bridge main: the mask cleans the statistics, it does not stop dispatch."""
    got = runs["thd_static", "masked"]
    padding = got["run"].args["padding_mask"][0]
    assert padding.any()
    for routing_map in got["routing"]:
        assert routing_map.shape[0] == padding.numel()
        assert torch.all(routing_map[padding].sum(dim=1) == TOPK)


def test_step_passes_the_mask_and_logs_it(models, batches, caplog):
    _, masked = models
    caplog.set_level(logging.INFO, logger="megatron.bridge_thd")
    with torch.no_grad():
        run = step_run(masked, batches["right"], "thd_static", seq_length=SEQ)
    mask = run.args["padding_mask"]
    assert mask.dtype == torch.bool and mask.shape == run.args["input_ids"].shape
    assert int((~mask).sum()) == int(batches["right"]["attention_mask"].sum())
    messages = [r.getMessage() for r in caplog.records if "PaddingMaskQwen3VLModel.forward" in r.getMessage()]
    assert messages, [r.getMessage() for r in caplog.records]
    passed, _, not_passed = messages[0].partition("not declared")
    assert "['padding_mask']" in passed and "padding_mask" not in not_passed


@pytest.mark.parametrize("layout", PACKED)
def test_mask_derived_from_the_boundaries_equals_the_step_mask(runs, layout):
    args = runs[layout, "masked"]["run"].args
    derived = padding_mask_from_packed_seq_params(args["packed_seq_params"], args["input_ids"].shape[1])
    assert torch.equal(derived, args["padding_mask"])


def test_without_an_explicit_mask_the_model_derives_it(models, runs, reference):
    """Like Megatron-Bridge main: a THD row without ``padding_mask`` gets the one its boundaries imply."""
    _, masked = models
    args = {k: v for k, v in runs["thd_static", "masked"]["run"].args.items() if k != "padding_mask"}
    _reset(masked)
    masked(**args)
    got = _stats(masked)
    assert torch.equal(got["counts"], reference["counts"])
    torch.testing.assert_close(got["aux"], reference["aux"], rtol=RTOL, atol=0)


# ---------------------------------------------------------------------------------------------
# 2. what the wrapper is, and what it refuses


def test_the_model_keeps_its_class_interface(models):
    plain, masked = models
    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    assert isinstance(masked, model_module.Qwen3VLModel) and isinstance(masked, PaddingMaskForward)
    assert type(masked).__name__ == "PaddingMaskQwen3VLModel"
    assert not hasattr(masked, "module")  # the step unwraps .module chains to read forward
    native = upstream_line().model_takes_padding_mask
    assert declares_padding_mask(masked) and declares_padding_mask(plain) == native
    assert masked.config is masked.language_model.config
    assert masked.shared_embedding_or_output_weight() is masked.language_model.shared_embedding_or_output_weight()
    assert masked.set_input_tensor.__func__ is model_module.Qwen3VLModel.set_input_tensor
    plain_parameters = list(inspect.signature(plain.forward).parameters)
    masked_parameters = list(inspect.signature(masked.forward).parameters)
    if native:  # the model's own signature, its own padding_mask included
        assert masked_parameters == plain_parameters
        return
    assert masked_parameters == plain_parameters[:-1] + ["padding_mask", plain_parameters[-1]]
    assert inspect.signature(masked.forward).parameters["padding_mask"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_routers_are_the_padding_aware_classes(models):
    """with_padding_mask gives each decoder MoE layer and its router the padding-aware subclass of
    Megatron-Core's class, in place; the unwrapped model keeps Megatron-Core's own classes, and no
    method is bound on an instance."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    plain, masked = models
    for layer in masked.language_model.decoder.layers:
        assert type(layer.mlp) is PaddingMaskMoELayer and type(layer.mlp.router) is PaddingMaskTopKRouter
        assert not {"forward", "routing", "_apply_expert_bias", "_apply_seq_aux_loss"} & set(vars(layer.mlp.router))
    for layer in plain.language_model.decoder.layers:
        assert type(layer.mlp) is MoELayer and type(layer.mlp.router) is TopKRouter


def test_megatron_bridges_weight_conversion_knows_the_padding_aware_router(models):
    """Megatron-Bridge's HF conversion (``AutoMapping``) tells a weight's layout by its module's class name and refuses
    names it does not know ("Cannot determine parallelism type"); the hook runs before ``finetune()`` loads the Hugging
    Face checkpoint, so the padding-aware router must be known, with ``TopKRouter``'s layout (its private detection
    is the call that refused; the whole load runs in tests/bridge/test_cp_per_sample_training.py)."""
    mapping_class = load_bridge_module("models.conversion.param_mapping").AutoMapping
    layouts = [mapping_class(f"language_model.decoder.layers.{i}.mlp.router.weight", "hf")._detect_parallelism_type(
        model.language_model.decoder.layers[i].mlp.router) for model in models for i in range(2)]
    assert layouts == ["replicated"] * 4


def test_the_model_declaring_padding_mask_gets_the_hook_and_the_mask_through_its_argument(models, batches):
    """Where Megatron-Bridge's Qwen3VLModel declares padding_mask itself the hook must not step aside (its
    routers would keep Megatron-Core's expert-bias crash, padded capacity and whole-row seq_aux_loss): the
    routers are ours on both lines (test_the_routers_are_the_padding_aware_classes), and the model's own
    argument gets the step's mask exactly where it declares one, so the model derives nothing itself (its
    derivation reads the host and refuses zero-length segments). A wrapped model is returned as it is."""
    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    native = upstream_line().model_takes_padding_mask
    assert native == ("padding_mask" in inspect.signature(model_module.Qwen3VLModel.forward).parameters)
    _, masked = models
    cls = type(masked)
    assert with_padding_mask(masked) is masked and type(masked) is cls
    assert padding_mask_pre_wrap_hook([masked]) == [masked]

    language_model = masked.language_model
    original = language_model.forward
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("padding_mask"))
        return original(*args, **kwargs)

    with mock.patch.object(language_model, "forward", spy):
        run = step_run(masked, batches["right"], "thd_static", seq_length=SEQ)
    assert len(seen) == 1
    if native:
        assert torch.equal(seen[0], run.args["padding_mask"])
        assert bool(seen[0].any()), "the static row's tail is padding"
    else:
        assert seen[0] is None


def test_a_wrapper_chain_is_handled_at_its_innermost_module():
    model = build_qwen3_vl(tiny_qwen3_vl_config(**CONFIG), seed=0)
    outer = Recorder(model)  # like DDP / Float16Module: .module
    assert with_padding_mask(outer) is outer and isinstance(outer.module, PaddingMaskForward)


def test_other_models_are_refused():
    with pytest.raises(TypeError, match="model: with_padding_mask takes .*Qwen3VLModel"):
        with_padding_mask(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="padding_mask_pre_wrap_hook"):
        with_padding_mask([torch.nn.Linear(2, 2)])


@pytest.mark.parametrize(
    "setting, value",
    [("recompute_granularity", "full"), ("cuda_graph_impl", "transformer_engine"), ("mlp_chunks_for_training", 2)],
)
def test_settings_that_would_drop_the_mask_are_refused(models, monkeypatch, setting, value):
    model = build_qwen3_vl(tiny_qwen3_vl_config(**CONFIG), seed=0)
    refusal = (r"^with_padding_mask: the MoE routers cannot see real tokens only:\n- "
               + re.escape(f"model.{setting}={value!r}") + r": .*do not use with_padding_mask")
    monkeypatch.setattr(model.config, setting, value)
    with pytest.raises(ValueError, match=refusal):
        with_padding_mask(model)
    assert not isinstance(model, PaddingMaskForward)
    # Set after wrapping: refused by forward, before any work.
    _, masked = models
    monkeypatch.setattr(masked.config, setting, value)
    with pytest.raises(ValueError, match=refusal):
        masked(input_ids=torch.ones(1, 8, dtype=torch.long), padding_mask=torch.zeros(1, 8, dtype=torch.bool))


def test_selective_moe_recompute_keeps_the_mask(monkeypatch, reference, batches):
    """``recompute_modules=["moe"]``: the MoE layer is checkpointed with the mask as an argument;
    its routers run under no_grad in the forward and record their statistics when the backward
    pass recomputes them, with the mask. (Megatron's checkpoint saves CUDA RNG states: no-ops on
    the CPU.)"""
    import megatron.core.tensor_parallel.random as megatron_random

    monkeypatch.setattr(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    monkeypatch.setattr(megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    config = tiny_qwen3_vl_config(recompute_granularity="selective", recompute_modules=["moe"], **CONFIG)
    model = with_padding_mask(build_qwen3_vl(config, seed=0))
    assert all(layer.mlp.moe_layer_recompute for layer in model.language_model.decoder.layers)
    got = _measured_run(model, batches["right"], "thd_static", {})
    got["run"].loss.backward()
    after = _stats(model)
    assert torch.equal(after["counts"], reference["counts"])
    torch.testing.assert_close(after["aux"], reference["aux"], rtol=RTOL, atol=0)
    torch.testing.assert_close(after["z"], reference["z"], rtol=RTOL, atol=0)


def test_a_mask_of_the_wrong_shape_is_refused(models):
    _, masked = models
    with pytest.raises(ValueError, match=r"padding_mask: shape \(1, 7\) does not match input_ids \(1, 8\)"):
        masked(input_ids=torch.ones(1, 8, dtype=torch.long), padding_mask=torch.zeros(1, 7, dtype=torch.bool))


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_sequence_parallel_cut_matches_megatrons_scatter(models, monkeypatch, layout):
    """Sequence parallelism cannot run on the CPU build (its torch norms refuse it), so the cut is
    checked against Megatron-Core's own ``scatter_to_sequence_parallel_region`` of the hidden
    states ``(s, b, h)``, on a mask that carries its flags through it."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    _, masked = models
    shape = (1, 24) if layout == "thd" else (3, 8)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.5
    input_ids = torch.ones(shape, dtype=torch.long)
    monkeypatch.setattr(masked.config, "sequence_parallel", True)
    for rank in range(2):
        group = FakeGroup(2, rank)
        monkeypatch.setattr(masked.pg_collection, "tp", group)
        got = masked._padding_mask_for_layers(masked._padding_mask_for_model(mask, input_ids, None))
        hidden = mask.transpose(0, 1).unsqueeze(-1).float()  # (s, b, 1)
        expected = scatter_to_sequence_parallel_region(hidden, group=group).squeeze(-1).transpose(0, 1).bool()
        assert torch.equal(got, expected), rank


def test_expert_bias_crashes_upstream_and_counts_real_tokens_with_the_wrapper(models):
    """Megatron-Core 0.19.2: ``routing_map & (~padding_mask)`` with (tokens, E) and (tokens,)
    raises. The wrapper's per-router fix hands the mask over as (tokens, 1)."""
    plain, masked = models
    tokens = 10
    hidden = torch.randn(tokens, 1, plain.config.hidden_size, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(tokens, 1, dtype=torch.bool)  # (s, b), as MoELayer hands it to the router
    mask[7:] = True
    with pytest.raises(RuntimeError, match="must match the size"):
        _routers(plain)[0](hidden, mask)
    router = _routers(masked)[0]
    assert isinstance(router, PaddingMaskTopKRouter)
    router.local_tokens_per_expert.zero_()
    _, routing_map = router(hidden, mask)
    assert torch.equal(router.local_tokens_per_expert, routing_map[:7].sum(dim=0).float())
    assert int(router.local_tokens_per_expert.sum()) == 7 * TOPK


# ---------------------------------------------------------------------------------------------
# 3. context parallelism: the mask is cut like the row (real processes over gloo)


def cp_worker(state_dict, cases):
    """Each CP rank: the wrapped model, every layout; stats and the mask shapes its routers saw."""
    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=2, **CONFIG), seed=0)
    model.load_state_dict(state_dict)
    with_padding_mask(model)
    out = {}
    for layout, batch, settings in cases:
        shapes = []
        handles = [
            r.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[1].shape))) for r in _routers(model)
        ]
        got = _measured_run(model, batch, layout, settings)
        for handle in handles:
            handle.remove()
        out[layout] = dict(aux=got["aux"], counts=got["counts"], mask_shapes=shapes,
                           input_shape=tuple(got["run"].args["input_ids"].shape))
    return out


@pytest.mark.slow  # a gloo world of two ranks
def test_cp2_statistics_summed_over_ranks_equal_each_sample_alone(models, batches, reference):
    """Under CP each rank routes its zigzag share of the row (BSHD: of every sample); the aux loss it records uses the
    CP-global token counts and its local probabilities, so the sum over ranks is the whole
    micro-batch's, and the expert-bias counts add up."""
    plain, _ = models
    cases = [(layout, batches[side], settings) for layout, (side, settings) in CASES.items()]
    ranks = run_on_gloo(cp_worker, plain.state_dict(), cases, cp=2, timeout=300)
    for layout in CASES:
        per_rank = [rank[layout] for rank in ranks]
        rows, length = per_rank[0]["input_shape"]
        # The router sees (s_local, b): half of the full row (THD) or of every sample (BSHD).
        assert all(shape == (length // 2, rows) for rank in per_rank for shape in rank["mask_shapes"]), layout
        counts = sum(rank["counts"] for rank in per_rank)
        aux = sum(rank["aux"] for rank in per_rank)
        assert torch.equal(counts, reference["counts"]), layout
        torch.testing.assert_close(aux, reference["aux"], rtol=RTOL, atol=0)


# ---------------------------------------------------------------------------------------------
# 4. the all-to-all dispatcher with expert parallelism (EP = 2 over gloo)

def ep_worker(state_dict, cases, ep):
    """Each rank (data-parallel x expert-parallel): the wrapped model with the all-to-all
    dispatcher (Megatron-Bridge's Qwen3-VL MoE setting) and this rank's experts of the EP = 1
    weights; every layout on the same micro-batch; stats, loss and gradients by global name."""
    from megatron.core import parallel_state

    config = tiny_qwen3_vl_config(ep=ep, **dict(CONFIG, moe_token_dispatcher_type="alltoall"))
    model = build_qwen3_vl(config, seed=0)
    ep_rank, per_rank = parallel_state.get_expert_model_parallel_rank(), config.num_moe_experts // ep
    model.load_state_dict({name: state_dict[global_expert_name(name, ep_rank, per_rank)] for name in model.state_dict()})
    with_padding_mask(model)
    out = {}
    for layout, batch, settings in cases:
        model.zero_grad(set_to_none=True)
        got = _measured_run(model, batch, layout, settings)
        got["run"].loss.backward()
        grads = {global_expert_name(n, ep_rank, per_rank): p.grad.clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        out[layout] = dict(aux=got["aux"], z=got["z"], counts=got["counts"], loss=float(got["run"].loss), grads=grads)
    return out


@pytest.mark.slow  # a gloo world of two ranks
def test_alltoall_dispatcher_with_ep2_keeps_the_statistics_of_each_sample_alone(models, batches, reference):
    """Megatron-Bridge's Qwen3-VL MoE recipes use ``moe_token_dispatcher_type="alltoall"``: with it
    and EP = 2 over gloo (2 data-parallel ranks on the same micro-batch, experts 0-1 on one and 2-3
    on the other) the routers' statistics still equal each sample alone, in every layout, and the
    loss and every gradient (each expert's on the rank that owns it) equal the EP = 1 run's."""
    plain, _ = models
    cases = [(layout, batches[side], settings) for layout, (side, settings) in CASES.items()]
    single = ep_worker(plain.state_dict(), cases, 1)  # EP = 1, all-to-all, this process
    ranks = run_on_gloo(ep_worker, plain.state_dict(), cases, 2, ep=2, dp=2, timeout=300)
    for layout in CASES:
        for rank in ranks:
            got = rank[layout]
            assert torch.equal(got["counts"], reference["counts"]), layout
            torch.testing.assert_close(got["aux"], reference["aux"], rtol=RTOL, atol=0)
            torch.testing.assert_close(got["z"], reference["z"], rtol=RTOL, atol=0)
            assert got["loss"] == pytest.approx(single[layout]["loss"], rel=1e-6)
        # Each expert's gradient lives on the rank that owns it. The all-to-all brings it the
        # tokens of both data-parallel ranks, which hold the same micro-batch here: twice EP = 1's
        # (Megatron's DDP then reduces expert gradients over the expert-data-parallel group only).
        experts = [{n: g / 2 for n, g in rank[layout]["grads"].items() if "local_experts" in n} for rank in ranks]
        assert set(experts[0]).isdisjoint(experts[1])
        grads = {**ranks[0][layout]["grads"], **experts[0], **experts[1]}
        assert set(grads) == set(single[layout]["grads"])
        error, where = worst_relative_gradient_error(grads, single[layout]["grads"])
        assert error <= 1e-5, f"{layout}: {where} relative gradient error {error:.2e}"
