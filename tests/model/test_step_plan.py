"""The step's plan (decided once), the rules ``configure`` and the step share, the row that is static in
everything the decoder sees, and the host path (no host synchronisation when the batch arrives on the host).

The model is Megatron-Bridge's real tiny ``Qwen3VLModel``. "A GPU" is stood in for by the ``meta`` device:
a model whose parameters are on ``meta`` makes the step copy its row there, and any read of a ``meta``
tensor on the host raises, so a step that completes read nothing from the device; the ops dispatched
on ``meta`` tensors are the ops a GPU would launch.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch
from _real_model import FakeGroup, receipt_batch, tiny_real_model, trimmed, video_receipt_batch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron.bridge_thd.step.prepare as step_prepare
from megatron.bridge_thd.adapters import QWEN3_VL
from megatron.bridge_thd.configure import configure
from megatron.bridge_thd.qwen3_vl_step import forward_step, prepare_micro_batch, prepare_with_plan
from megatron.bridge_thd.rules.registry import CONFIGURE, STEP
from megatron.bridge_thd.rules.run import rules_for, step_problems
from megatron.bridge_thd.rules.setup import read_setup
from megatron.bridge_thd.step.plan import StaticRow, StepPlan, build_step_plan, in_batch_static_row
from megatron.bridge_thd.upstream.line import upstream_line
from megatron.bridge_thd_cpu.data import select_samples, synthetic_receipt_batch
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import minimal_state

SEQ = 2048
MBS = 3


@pytest.fixture(scope="module")
def model():
    return tiny_real_model(SEQ)


@pytest.fixture(scope="module")
def meta_model():
    """The same model with its parameters on ``meta``: the step's stand-in for a GPU."""
    return tiny_real_model(SEQ, device="meta")


def signature(forward_args: dict) -> dict:
    """What a CUDA-graph manager compares: every tensor's shape and dtype, every other value, of what the
    decoder sees (the token-level inputs and each ``PackedSeqParams`` field)."""
    def describe(value):
        return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value

    seen = {name: describe(forward_args[name]) for name in ("input_ids", "position_ids", "labels", "loss_mask")}
    params = forward_args["packed_seq_params"]
    seen.update({field.name: describe(getattr(params, field.name)) for field in dataclasses.fields(params)})
    return seen


# ---------------------------------------------------------------------------------------------
# the plan: decided once, read per micro-batch


def test_the_forward_step_builds_its_plan_once(model):
    """The plan built at the first micro-batch is the one every later micro-batch reads (kept on the state: the same
    object, not an equal one built again)."""
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd")
    batches = [receipt_batch("right", seed=seed) for seed in (1, 2, 3)]
    kept = []
    with cpu_stack():
        for batch in batches:
            forward_step(state, iter([batch]), model)
            kept.append(state.bridge_thd_plan)
    assert isinstance(kept[0], StepPlan)
    assert all(plan is kept[0] for plan in kept)


def test_the_micro_batch_path_reads_no_config_and_inspects_no_signature(model, monkeypatch):
    """Once the plan exists, the step runs with a config that raises on any read and with
    ``inspect.signature`` broken: the per-micro-batch path reads only the plan."""
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static")
    with cpu_stack():
        forward_step(state, iter([receipt_batch("right")]), model)  # builds the plan

    class Unreadable:
        def __getattr__(self, name):
            raise AssertionError(f"the micro-batch path read cfg.{name}")

    state.cfg = Unreadable()
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: (_ for _ in ()).throw(AssertionError("signature")))
    with cpu_stack():
        output, _ = forward_step(state, iter([receipt_batch("left", seed=2)]), model)
    assert output.shape[:2] == (1, MBS * SEQ)


def test_a_changed_config_is_a_new_plan(model):
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static")
    first = build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    assert build_step_plan(state, model, model.pg_collection, QWEN3_VL) == first  # same inputs, same record
    state.cfg.train.micro_batch_size = MBS + 1
    second = build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    assert second.static_row == in_batch_static_row(MBS + 1, SEQ, 1) != first.static_row
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.layout = "thd"


def test_a_static_row_is_checked_once_when_the_plan_is_built(model):
    """The packer's checks of a static row (``packing.check_static_row``) run when the plan is built, once per run,
    not at every micro-batch: a recorded row the packer cannot take is refused there, before any batch is read."""
    row = StaticRow(length=MBS * SEQ, segments=MBS + 1, max_seqlen=0)
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static", static_rows=(row,))
    with pytest.raises(ValueError, match=r"max_seqlen: expected an int >= 1, got 0"):
        build_step_plan(state, model, model.pg_collection, QWEN3_VL)


# What one micro-batch runs of the runtime before model(**args) (docs/step-plan.md, block step-path): at most these.
PATH_LIMITS = {"modules": 10, "module_changes": 30, "cross_module_calls": 22}
# The calls between the step's modules the data's way allows: forward_step runs the preparation, then the FLOPs
# feed; both read the plan. Nothing calls back into the module that called it, and no primitive calls the step.
STEP_CALLS = {("forward", "prepare"), ("forward", "flops"), ("forward", "plan"), ("prepare", "plan")}


# The device batch's path differs only inside mrope (its torch ops); scripts/readme_figures.py's block step-path, which
# tests/unit/test_readme_figures.py recomputes, holds both placements' figures.
@pytest.mark.parametrize("on_host", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["host batch", "device batch"])
def test_one_micro_batch_crosses_few_modules_one_way(on_host):
    from megatron.bridge_thd_testbed.callpath import step_call_paths

    step = "megatron.bridge_thd.step."
    for layout, path in step_call_paths(batch_on_host=on_host).items():
        figures = path.figures()
        assert all(figures[name] <= limit for name, limit in PATH_LIMITS.items()), (layout, figures)
        into_step = {(c.caller.removeprefix(step), c.module.removeprefix(step)) for c in path.calls
                     if c.caller is not None and c.caller != c.module and c.module.startswith(step)}
        assert into_step <= STEP_CALLS, (layout, into_step - STEP_CALLS)


def test_the_plan_records_what_the_model_takes(model):
    plan = build_step_plan(minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd"), model,
                           model.pg_collection, QWEN3_VL)
    # Megatron-Bridge's Qwen3VLModel declares padding_mask on one line only, rope_cu_seqlens on neither.
    declared = ("padding_mask",) if upstream_line().model_takes_padding_mask else ()
    assert plan.extras == declared and set(plan.extras_refused) == {"padding_mask", "rope_cu_seqlens"} - set(declared)
    assert plan.padding_mask_cut_for_cp is False  # CP = 1
    config = model.config
    assert (plan.tokens.image_token_id, plan.tokens.video_token_id) == (config.image_token_id, config.video_token_id)
    assert plan.static_row is None and plan.layout == "thd" and plan.device == torch.device("cpu")


def test_global_batch_rows_reach_the_plan_from_the_train_state(model):
    row = StaticRow(length=1000, segments=7, max_seqlen=1000)
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static", static_rows=(row,))
    assert build_step_plan(state, model, model.pg_collection, QWEN3_VL).static_row == row


# ---------------------------------------------------------------------------------------------
# one set of rules for configure and the step


def _moe_capacity(cfg_model):
    cfg_model.num_moe_experts = 4
    cfg_model.moe_expert_capacity_factor = 1.0


def _hybridep_graphs(cfg_model):
    cfg_model.num_moe_experts = 4
    cfg_model.moe_token_dispatcher_type, cfg_model.moe_flex_dispatcher_backend = "flex", "hybridep"
    cfg_model.cuda_graph_impl = "local"


def _graphs(cfg_model):
    cfg_model.cuda_graph_impl = "local"


@pytest.mark.parametrize("change", [_moe_capacity, _hybridep_graphs, _graphs], ids=["moe-capacity", "hybridep-graphs",
                                                                                     "graphs"])
def test_configure_and_the_step_refuse_with_the_same_words(change):
    """The same combination, judged by ``configure`` before the model exists and by the step's plan
    afterwards: both refuse, and the step's problems are among configure's, word for word."""
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd")
    state.cfg.dataset.enable_in_batch_packing = True
    change(state.cfg.model)
    sizes = dict(tp=1, cp=1, pp=1, ep=1)
    step_side = step_problems(read_setup(state.cfg, "thd", model_config=state.cfg.model, sizes=sizes,
                                         adapter=QWEN3_VL))
    assert step_side
    with pytest.raises(ValueError) as refused:
        configure(state.cfg, "thd")
    for problem in step_side:
        assert problem in str(refused.value)


def test_the_step_refuses_at_its_plan_what_configure_refuses(model):
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd")
    original = model.config.cuda_graph_impl
    model.config.cuda_graph_impl = "local"
    try:
        with pytest.raises(ValueError, match="layout: 'thd' gives a row whose length changes"):
            build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    finally:
        model.config.cuda_graph_impl = original


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_moe_overlap_is_refused_when_the_plan_is_built_not_at_the_first_schedule_plan(model, layout):
    """``overlap_moe_expert_parallel_comm`` makes Megatron-Core's combined 1F1B schedule ask for schedule plans: the
    step builds them only for ``bshd`` and only with the model's ``build_schedule_plan``, which Megatron-Bridge's
    ``Qwen3VLModel`` lacks; the plan refuses both before any micro-batch."""
    assert not hasattr(model, "build_schedule_plan")
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout=layout,
                          packing=layout != "bshd")
    original = getattr(model.config, "overlap_moe_expert_parallel_comm", False)
    model.config.overlap_moe_expert_parallel_comm = True
    try:
        with pytest.raises(ValueError) as refused:
            build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    finally:
        model.config.overlap_moe_expert_parallel_comm = original
    message = str(refused.value)
    assert message.startswith("bridge_thd: the configuration cannot run this step:")
    assert "model.overlap_moe_expert_parallel_comm=True" in message
    assert ("step builds one only for the padded layout" if layout == "thd" else
            f"({type(model).__name__}) has none") in message
    model.config.overlap_moe_expert_parallel_comm = original
    build_step_plan(state, model, model.pg_collection, QWEN3_VL)  # without overlap: the same state is accepted


def test_every_step_rule_is_a_configure_rule():
    # The recorded rows exist only once the loaders are built (configure judges the row_buckets setting instead);
    # the installed Transformer Engine stack and the length fallback's pad id only in the step; every other step rule
    # is configure's too.
    step_only = {"row_lengths", "te_cp_padding", "length_fallback_pad_id"}
    step = rules_for(STEP)
    assert step_only <= {rule.name for rule in step}
    assert {rule.name for rule in step if CONFIGURE not in rule.places} == step_only


# ---------------------------------------------------------------------------------------------
# thd_static: static in everything the decoder sees


def _static_signatures(model, batches, state, *, plan=None):
    plan = plan or build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    return [signature(prepare_with_plan(batch, plan).forward_args) for batch in batches]


def test_in_batch_static_rows_have_one_signature(model):
    """Micro-batches of 1 to 3 samples and of different widths (the collate pads each to its own longest):
    one row length, one cu_seqlens count, one max_seqlen."""
    right, left = receipt_batch("right"), receipt_batch("left", seed=2)
    lengths = [int(n) for n in right["attention_mask"].sum(1)]
    batches = [right, left, trimmed(right, lengths), select_samples(right, [0]), select_samples(left, [1, 2]),
               video_receipt_batch("right")]
    assert len({b["tokens"].shape for b in batches}) >= 4  # the widths and batch sizes really differ
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static")
    signatures = _static_signatures(model, batches, state)
    assert all(s == signatures[0] for s in signatures), signatures
    row = in_batch_static_row(MBS, SEQ, 1)
    assert signatures[0]["input_ids"][0] == (1, row.length)
    assert signatures[0]["cu_seqlens_q"][0] == (MBS + 2,) and signatures[0]["max_seqlen_q"] == SEQ


def test_global_batch_static_rows_have_one_signature(model):
    """Global-batch packing's micro-batches hold 1 to N samples in one row: one signature."""
    batch = synthetic_receipt_batch(8, seed=3)
    lengths = batch["attention_mask"].sum(1)
    row = StaticRow(length=int(lengths.sum()), segments=9, max_seqlen=SEQ)
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=(row,))
    micro_batches = [select_samples(batch, rows) for rows in ([0], [1, 2], [3, 4, 5, 6], list(range(8)))]
    signatures = _static_signatures(model, micro_batches, state)
    assert all(s == signatures[0] for s in signatures), signatures
    assert signatures[0]["cu_seqlens_q_padded"][0] == (10,) and signatures[0]["input_ids"][0] == (1, row.length)


def test_several_static_rows_one_signature_per_row_each_micro_batch_in_the_shortest_that_holds_it(model, meta_model):
    """Global-batch packing's rows (``row_buckets``): a micro-batch takes the shortest row that holds its tokens,
    chosen from the host mask (no device read: the ``meta`` model fails on any); every micro-batch that takes a
    row gives the decoder that row's one signature."""
    batch = synthetic_receipt_batch(8, seed=3)
    lengths = [int(n) for n in batch["attention_mask"].sum(1)]
    picks = ([0], [1, 2], [3, 4, 5, 6], list(range(8)), [1], [2, 3])
    totals = sorted({sum(lengths[i] for i in pick) for pick in picks})
    # Three rows: exactly the smallest micro-batch, between, and the whole batch (the longest row).
    lengths_of_rows = (totals[0], totals[len(totals) // 2], totals[-1])
    rows = tuple(StaticRow(length=n, segments=9, max_seqlen=min(n, SEQ)) for n in lengths_of_rows)
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=rows)
    micro_batches = [select_samples(batch, pick) for pick in picks]
    signatures = _static_signatures(model, micro_batches, state)
    by_row = {}
    for pick, seen in zip(picks, signatures):
        total = sum(lengths[i] for i in pick)
        expected = min(n for n in lengths_of_rows if n >= total)
        assert seen["input_ids"][0] == (1, expected), (pick, total)
        assert seen["max_seqlen_q"] == min(expected, SEQ) and seen["cu_seqlens_q"][0] == (10,)
        by_row.setdefault(expected, []).append(seen)
    assert len(by_row) == 3  # every row ran
    assert all(s == seen[0] for seen in by_row.values() for s in seen)
    meta_plan = build_step_plan(state, meta_model, meta_model.pg_collection, QWEN3_VL)
    assert meta_plan.static_rows == rows
    for micro_batch, seen in zip(micro_batches, signatures):
        assert signature(prepare_with_plan(micro_batch, meta_plan).forward_args)["input_ids"] == seen["input_ids"]


def test_several_recorded_rows_with_fixed_pipeline_buffers_are_refused():
    rows = (StaticRow(length=1024, segments=3, max_seqlen=1024), StaticRow(length=2 * SEQ, segments=3, max_seqlen=SEQ))
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=rows)
    problems = step_problems(read_setup(state.cfg, "thd_static", model_config=state.cfg.model,
                                        sizes={"tp": 1, "cp": 1, "pp": 2, "ep": 1},
                                        row_lengths=tuple(row.length for row in rows)))
    assert any("row_buckets: the loaders chose 2 rows (1024, 4096 slots)" in p and "fixed-shape buffers" in p
               and "set row_buckets=1" in p for p in problems), problems
    variable = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=rows,
                             variable_seq_lengths=True)
    assert not [p for p in step_problems(read_setup(variable.cfg, "thd_static", model_config=variable.cfg.model,
                                                    sizes={"tp": 1, "cp": 1, "pp": 2, "ep": 1},
                                                    row_lengths=(1024, 2 * SEQ))) if "row_buckets" in p]


def test_zero_length_segments_sit_at_the_row_end(model):
    batch = select_samples(synthetic_receipt_batch(4, seed=3), [0, 1])
    lengths = [int(n) for n in batch["attention_mask"].sum(1)]
    row = StaticRow(length=sum(lengths) + 10, segments=6, max_seqlen=SEQ)
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=(row,))
    params = prepare_micro_batch(batch, model, state, model.pg_collection).forward_args["packed_seq_params"]
    real = [0, lengths[0], sum(lengths)]
    assert params.cu_seqlens_q.tolist() == real + [sum(lengths)] * 4
    assert params.cu_seqlens_q_padded.tolist() == real + [row.length] * 4


def test_a_micro_batch_with_more_samples_than_the_row_has_segments_is_refused(model):
    row = StaticRow(length=8 * SEQ, segments=3, max_seqlen=SEQ)
    state = minimal_state(seq_length=SEQ, micro_batch_size=2, packing_layout="thd_static", static_rows=(row,))
    with pytest.raises(ValueError, match=r"batch: 3 samples, but the run's static row .* has segments for 2"):
        prepare_micro_batch(receipt_batch("right"), model, state, model.pg_collection)


# ---------------------------------------------------------------------------------------------
# the host path: a batch on the host, a model on the device


class _DeviceOps(TorchDispatchMode):
    """Counts the ops that touch a ``meta`` tensor (what a GPU would launch)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = list(args) + list((kwargs or {}).values())
        result = func(*args, **(kwargs or {}))
        outputs = result if isinstance(result, (tuple, list)) else [result]
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in flat + list(outputs)):
            self.ops.append(func.overloadpacket.__name__)
        return result


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
@pytest.mark.parametrize("videos", [False, True], ids=["images", "videos"])
def test_a_host_batch_costs_no_host_sync_and_only_copies(meta_model, layout, videos):
    batch = (video_receipt_batch if videos else receipt_batch)("left")
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout=layout)
    plan = build_step_plan(state, meta_model, meta_model.pg_collection, QWEN3_VL)
    assert plan.device.type == "meta"
    with _DeviceOps() as device:
        prepared = prepare_with_plan(batch, plan)  # any host read of a meta tensor would raise
    tensors = [v for v in prepared.forward_args.values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert set(device.ops) == {"_to_copy"}, device.ops
    assert len(device.ops) <= 12


def _tensors_of(forward_args: dict) -> dict:
    out = {name: value for name, value in forward_args.items() if isinstance(value, torch.Tensor)}
    params = forward_args.get("packed_seq_params")
    if params is not None:
        out.update({field: getattr(params, field) for field in ("cu_seqlens_q", "cu_seqlens_q_padded")})
        out.update(max_seqlen_q=params.max_seqlen_q)
    return out


@pytest.mark.parametrize("videos", [False, True], ids=["images", "videos"])
def test_the_host_path_builds_the_row_the_device_path_builds(model, meta_model, monkeypatch, videos):
    """The same batch prepared for a CPU model (everything on one device: torch ops, the device code) and for
    the ``meta`` model (built on the host, MRoPE by the host code, then copied): the same row. The copy to
    ``meta`` is left out here (its values cannot be read), so the host-built tensors are compared value by
    value."""
    batch = (video_receipt_batch if videos else receipt_batch)("left")
    monkeypatch.setattr(step_prepare, "to_device", lambda forward_args, device: forward_args)
    for layout in ("thd", "thd_static", "bshd"):
        state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout=layout)
        on_cpu = _tensors_of(prepare_micro_batch(batch, model, state, model.pg_collection).forward_args)
        on_host = _tensors_of(prepare_micro_batch(batch, meta_model, state, meta_model.pg_collection).forward_args)
        assert on_cpu.keys() == on_host.keys() and "position_ids" in on_cpu
        for name, value in on_cpu.items():
            if isinstance(value, torch.Tensor):
                assert value.device.type == on_host[name].device.type == "cpu"
                assert value.dtype == on_host[name].dtype and torch.equal(value, on_host[name]), (layout, name)
            else:
                assert value == on_host[name], (layout, name)


def test_sizes_other_than_one_come_from_the_process_groups(model):
    pg = SimpleNamespace(tp=FakeGroup(2), cp=FakeGroup(2), pp=FakeGroup(1), ep=FakeGroup(1))
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd_static", sequence_parallel=True)
    plan = build_step_plan(state, model, pg, QWEN3_VL)
    # The built model's config is read before cfg.model: its sequence_parallel=False wins, so 2 * cp.
    assert model.config.sequence_parallel is False
    assert (plan.tp, plan.cp, plan.align) == (2, 2, 4)
    assert plan.static_row == StaticRow(length=MBS * SEQ, segments=MBS + 1, max_seqlen=SEQ)


def test_configure_lets_the_loader_pin_the_visual_inputs(monkeypatch):
    """PyTorch's loader pins (in its pin thread) what has a ``pin_memory()``; after ``configure`` Megatron-Bridge's
    ``GenericVisualInputs`` has one, so its pixels reach the step pinned."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from megatron.bridge_thd.upstream.loading import load_bridge_module

    visual_class = load_bridge_module("training.utils.visual_inputs").GenericVisualInputs
    state = minimal_state(seq_length=SEQ, micro_batch_size=MBS, packing_layout="thd")
    configure(state.cfg, "thd")
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: pinned.append(self) or self.clone())
    visual = visual_class(pixel_values=torch.ones(4, 6), image_grid_thw=torch.tensor([[1, 2, 2]]))
    batch = pin_memory({"tokens": torch.ones(2, 3), "visual_inputs": visual})
    assert isinstance(batch["visual_inputs"], visual_class)
    assert any(t is visual.pixel_values for t in pinned) and any(t is visual.image_grid_thw for t in pinned)
    assert torch.equal(batch["visual_inputs"].pixel_values, visual.pixel_values)


@pytest.mark.parametrize("impl, modules, micro_batch_size, refused", [
    ("local", None, MBS, None),
    ("local", ["attn"], MBS, None),
    ("transformer_engine", None, MBS, "asserts packed_seq_params is None"),
    ("transformer_engine", ["attn"], 1, "asserts packed_seq_params is None"),
    ("transformer_engine", ["mlp"], MBS, "matches only for one sample of seq_length"),
    ("transformer_engine", ["mlp"], 1, None),
    ("full_iteration", None, MBS, "replays without comparing its arguments"),
])
def test_cuda_graph_implementations_that_cannot_replay_a_static_row_are_refused(impl, modules, micro_batch_size,
                                                                               refused):
    """docs/cuda-graphs.md: Megatron-Core's local manager compares every argument and takes the static row;
    Transformer Engine's asserts with attention in the graph and captures (seq_length, micro_batch_size, H)
    beside it; the full-iteration graph compares nothing. configure and the step's plan say the same."""
    state = minimal_state(seq_length=SEQ, micro_batch_size=micro_batch_size, packing_layout="thd_static")
    # Megatron-Bridge's flag as configure sets it: off for a micro-batch of one sample (its validate() refuses it).
    state.cfg.dataset.enable_in_batch_packing = micro_batch_size > 1
    state.cfg.model.cuda_graph_impl = impl
    if modules is not None:
        state.cfg.model.cuda_graph_modules = modules
    step_side = step_problems(read_setup(state.cfg, "thd_static", model_config=state.cfg.model,
                                         sizes=dict(tp=1, cp=1, pp=1, ep=1), adapter=QWEN3_VL))
    if refused is None:
        assert step_side == []
        configure(state.cfg, "thd_static")  # micro-batch 1 too (docs/configure.md, a micro-batch of one sample)
        assert state.cfg.dataset.enable_in_batch_packing is (micro_batch_size > 1)
        return
    assert len(step_side) == 1 and refused in step_side[0]
    with pytest.raises(ValueError) as error:
        configure(state.cfg, "thd_static")
    assert step_side[0] in str(error.value)
