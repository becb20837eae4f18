"""The registry of rules (docs/rules.md): each rule once, tagged with its places; ``configure`` refuses what the step
and the MoE hook refuse later, in the same words; no configuration refusal outside the registry and the settings
record."""

from __future__ import annotations

import ast
import pathlib
import re
from types import SimpleNamespace

import pytest

import megatron.bridge_thd as package
from megatron.bridge_thd.configure import configure
from megatron.bridge_thd.moe_padding.refusals import fail_if_unsupported
from megatron.bridge_thd.rules.registry import CONFIGURE, HOOK, PLACES, PLANNER, STEP, Rule, rule
from megatron.bridge_thd.rules.run import MODULE_ORDER, RULES, _in_order, problems, rules_for
from megatron.bridge_thd.rules.setup import ROUTES_REAL_TOKENS_ONLY, ModelFacts, Setup, read_setup
from megatron.bridge_thd.settings import GlobalBatchPacking, PackingSettings, settings_of

# Rules the step runs that configure cannot decide from the config alone, each with the fact it lacks.
STEP_ONLY = {
    "row_lengths": "the rows global-batch packing chose when the loaders were built",
    "te_cp_padding": "the installed Transformer Engine and cuDNN on the GPU",
    "length_fallback_pad_id": "the tokenizer's pad id",
}


def test_every_rule_has_known_places_and_a_docstring():
    assert RULES, "no rule registered"
    for name, r in RULES.items():
        assert r.name == name and r.places and r.places <= set(PLACES), name
        assert r.summary, f"rule {name} has no docstring"


def test_configure_runs_every_rule_the_step_and_the_hook_run_except_what_it_cannot_know():
    configure_rules = {r.name for r in rules_for(CONFIGURE)}
    later = {r.name for r in rules_for(STEP)} | {r.name for r in rules_for(HOOK)}
    assert later - configure_rules == set(STEP_ONLY)
    assert {r.name for r in rules_for(HOOK)} <= configure_rules


def test_the_rules_keep_their_order_whichever_rule_module_is_imported_first():
    # The step imports rules.moe before rules.run, configure rules.graphs: registration order follows imports, the
    # order configure lists problems in does not.
    assert [r.check.__module__ for r in RULES.values()] == sorted((r.check.__module__ for r in RULES.values()),
                                                                  key=MODULE_ORDER.index)
    by_module = [{n: r for n, r in RULES.items() if r.check.__module__ == m} for m in reversed(MODULE_ORDER)]
    assert list(_in_order({n: r for block in by_module for n, r in block.items()})) == list(RULES)
    with pytest.raises(ValueError, match="MODULE_ORDER"):
        _in_order({"elsewhere": Rule("elsewhere", frozenset({STEP}), fail_if_unsupported)})


def test_a_rule_cannot_be_registered_twice_or_for_an_unknown_place():
    with pytest.raises(ValueError, match="registered twice"):
        rule(STEP)(RULES["moe_overlap"].check)
    with pytest.raises(ValueError, match="places"):
        rule("trainer")
    with pytest.raises(ValueError, match="place"):
        rules_for("trainer")


def _model(**settings):
    base = dict(tensor_model_parallel_size=1, context_parallel_size=1, pipeline_model_parallel_size=1,
                expert_model_parallel_size=1, seq_length=64, num_moe_experts=4, moe_token_dispatcher_type="alltoall",
                cuda_graph_impl="none", recompute_granularity=None, mlp_chunks_for_training=1)
    return SimpleNamespace(**{**base, **settings})


def _marked_hook(model):
    return model


setattr(_marked_hook, ROUTES_REAL_TOKENS_ONLY, True)


def _cfg(model):
    model._pre_wrap_hooks = [_marked_hook]
    return SimpleNamespace(dataset=SimpleNamespace(seq_length=64, dataloader_type="cyclic"), model=model,
                           train=SimpleNamespace(micro_batch_size=2, global_batch_size=8))


@pytest.mark.parametrize("setting", [
    dict(recompute_granularity="full"),
    dict(cuda_graph_impl="local"),
    dict(mlp_chunks_for_training=2),
    dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="position"),
    dict(moe_router_load_balancing_type="seq_aux_loss", recompute_granularity="selective", recompute_modules=["moe"]),
    dict(moe_router_load_balancing_type="quantile_balancing"),
])
def test_configure_refuses_what_the_hook_refuses_in_the_same_words(setting):
    with pytest.raises(ValueError) as hook_error:
        fail_if_unsupported(_model(**setting))
    hook_problems = str(hook_error.value).split("\n- ")[1:]
    assert hook_problems, str(hook_error.value)
    with pytest.raises(ValueError) as configure_error:
        configure(_cfg(_model(**setting)), "thd")
    configure_problems = str(configure_error.value).split("\n- ")[1:]
    for problem in hook_problems:
        assert problem in configure_problems
    # The setting is named in every problem.
    name = next(iter(setting))
    assert all(name in problem or "cuda_graph" in problem for problem in hook_problems)


def test_the_hook_accepts_what_configure_accepts():
    model = _model(moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="seq_aux_loss")
    configure(_cfg(model), "thd")
    fail_if_unsupported(model)  # nothing to refuse


def test_the_planner_refuses_in_the_rules_words():
    """``bridge-thd plan`` runs the planner's rules: the same message as the registry's rule."""
    from megatron.bridge_thd.plan.balance import micro_batches_per_rank

    setup = Setup(layout="thd", micro_batch_size=4, dp=8, global_batch_size=7)
    (expected,) = RULES["global_batch_size"].check(setup)
    with pytest.raises(ValueError) as error:
        micro_batches_per_rank(7, 4, 8, 1024)
    assert str(error.value) == f"--global-batch-size 7: {expected}"
    assert "train.global_batch_size" in expected and "set it to" in expected
    assert "global_batch_size" in {r.name for r in rules_for(PLANNER)}


def test_the_planner_marks_a_layout_the_step_would_refuse():
    from megatron.bridge_thd.plan.plan_command import build_parser, run

    text = run(build_parser().parse_args(["--pp", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
                                          "--row-buckets", "3", "--num-samples", "16"]))
    setup = Setup(layout="thd_static", settings=PackingSettings("thd_static", global_batch_packing=GlobalBatchPacking(
        row_buckets=3)), pp=2, micro_batch_size=1)
    (expected,) = RULES["global_batch_row_buckets"].check(setup)
    assert f"refused by the step for layout 'thd_static' (docs/rules.md): {expected}" in text


# ---- the settings record ----


def test_the_record_refuses_each_bad_value_naming_it():
    with pytest.raises(ValueError) as error:
        PackingSettings(layout="sbhd", overlong_samples="cut", length_fallback="eos",
                        global_batch_packing=GlobalBatchPacking(row_length=0, row_buckets=True, seed=-1))
    message = str(error.value)
    for needle in ("layout: 'sbhd'", "overlong_samples: 'cut'", "length_fallback: 'eos'",
                   "global_batch_packing.row_length: 0", "global_batch_packing.row_buckets: True",
                   "global_batch_packing.seed: -1"):
        assert needle in message
    with pytest.raises(ValueError, match="global_batch_packing: True"):
        PackingSettings(global_batch_packing=True)


def test_the_record_is_frozen_and_read_from_one_place():
    record = PackingSettings("thd_static", overlong_samples="drop")
    with pytest.raises(AttributeError):
        record.layout = "thd"  # type: ignore[misc]
    dataset = SimpleNamespace(bridge_thd=record)
    assert settings_of(dataset) is record
    hand_set = SimpleNamespace(packing_layout="bshd", overlong_samples="refuse")
    assert settings_of(hand_set) == PackingSettings("bshd", overlong_samples="refuse")
    assert settings_of(SimpleNamespace()) == PackingSettings()


def test_a_hand_set_attribute_contradicting_the_record_is_refused():
    dataset = SimpleNamespace(bridge_thd=PackingSettings("thd"), packing_layout="bshd")
    with pytest.raises(ValueError, match=r"dataset.packing_layout='bshd' contradicts dataset.bridge_thd"):
        settings_of(dataset)
    dataset.packing_layout = "thd"  # saying the same is fine
    assert settings_of(dataset).layout == "thd"


def test_configure_stores_the_record_and_clears_the_hand_set_attributes():
    cfg = _cfg(_model(num_moe_experts=None))
    cfg.dataset.overlong_samples = "drop"  # set by hand before configure: kept, moved into the record
    configure(cfg, "thd_static")
    assert cfg.dataset.bridge_thd == PackingSettings("thd_static", overlong_samples="drop")
    assert cfg.dataset.overlong_samples is None
    configure(cfg, "thd_static", overlong_samples="refuse")  # an argument replaces the held value
    assert settings_of(cfg.dataset).overlong_samples == "refuse"
    with pytest.raises(ValueError, match=r"dataset.bridge_thd.layout='thd_static' was set explicitly"):
        configure(cfg, "thd")
    assert settings_of(cfg.dataset).layout == "thd_static"  # refused: nothing written


# ---- no configuration refusal outside the registry ----

# What a raise names when it names a setting of the run's configuration.
_SETTING = re.compile(r"(dataset\.|model\.[a-z_]+|train\.|ddp\.|comm_overlap\.|config\.[a-z_]+|context_parallel_size|"
                      r"packing_layout|global_batch_packing|overlong_samples|packing_length_fallback|cuda_graph_impl|"
                      r"dataloader_type|recompute_|mlp_chunks|moe_[a-z_]+)")
# The raises outside the registry that name a setting, each a refusal of the data or the environment at run time
# (not of a combination of settings), or an argument check: (module, start of the message) -> why it stays.
ALLOWED = {
    ("batching/bridge.py", "global_batch_packing.sizes_cache:"): "a rank cannot read its node's scan (filesystem)",
    ("batching/bridge.py", "global_batch_packing ( loader): the ranks disagree"): "the ranks' data differ",
    ("batching/bridge.py", "global_batch_packing ( loader): the ranks' size digests"): "the ranks' data differ",
    ("batching/bridge.py", "overlong_samples='refuse':"): "the policy refusing samples of the data",
    ("batching/bridge.py", "overlong_samples= : have an image or video placeholder past"): "samples of the data whose "
    "image a cut would split (every policy)",
    ("batching/bridge.py", "overlong_samples='truncate': have every supervised token past"): "samples of the data a "
    "cut would leave without supervision",
    ("batching/bridge.py", "global_batch_packing: step"): "a step of the data does not fit the chosen row",
    ("batching/bridge.py", "global_batch_packing: Megatron-Bridge's data loaders cannot"): "the environment",
    ("cost/sample.py", "model: expected a preset name"): "an argument check",
    ("batching/sampler.py", "row_length"): "the run's draws need a longer row (the data)",
    ("batching/sizes.py", "dataset.sample_lengths:"): "the dataset's metadata",
    ("batching/sizes.py", "dataset.sample_image_grids:"): "the dataset's metadata",
    ("batching/sizes.py", "dataset sample"): "a sample of the data",
    ("moe_padding/hook.py", "model: this Megatron-Bridge's"): "the installed upstream (an argument check)",
    ("overlong.py", "overlong_samples='refuse':"): "the policy refusing samples of a micro-batch",
    ("overlong.py", "overlong_samples= : sample(s) of this micro-batch have an image"): "samples of a micro-batch whose "
    "image the cut would split (every policy)",
    ("overlong.py", "overlong_samples='truncate': sample(s) of this micro-batch have every"): "samples of a micro-batch "
    "the cut would leave without supervision",
    ("cost/presets.py", "model preset"): "an argument check of the planner",
    ("cost/presets.py", ": field"): "a config.json file's content",
    ("cost/presets.py", ": no such config.json"): "a missing file",
    ("step/prepare.py", "attention_mask:"): "a batch without a mask (the data)",
    ("cp_per_sample.py", "batch: no 'local_cp_size'"): "an iterator that is not Megatron-Core's hybrid-CP schedule's",
    ("step/prepare.py", "batch:  samples for train.micro_batch_size"): "a batch of another size than the loaders'",
    ("step/prepare.py", "batch:  samples, but the run's static row"): "a batch the static row cannot hold",
}


def _setting_raises(root: pathlib.Path) -> list[tuple[str, str]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = path.relative_to(root).as_posix()
        if module.startswith(("rules/", "interop/")) or module == "settings.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                text = " ".join(n.value for n in ast.walk(node.exc)
                                if isinstance(n, ast.Constant) and isinstance(n.value, str))
                if _SETTING.search(text):
                    found.append((module, text))
    return found


def _matches(module: str, text: str, allowed: tuple[str, str]) -> bool:
    return module == allowed[0] and " ".join(text.split()).startswith(" ".join(allowed[1].split()))


def test_no_configuration_refusal_outside_the_registry():
    found = _setting_raises(pathlib.Path(package.__file__).parent)
    unexplained = [f"{module}: {text[:100]!r}" for module, text in found
                   if not any(_matches(module, text, allowed) for allowed in ALLOWED)]
    assert not unexplained, "a raise naming a setting outside rules/ (register a rule instead):\n" + "\n".join(
        unexplained)
    stale = [allowed for allowed in ALLOWED if not any(_matches(module, text, allowed) for module, text in found)]
    assert not stale, f"ALLOWED entries that match no raise any more (remove them): {stale}"


def test_the_records_the_rules_and_the_step_read_are_typed_without_any():
    """``Setup``, ``ModelFacts``, ``StepPlan`` and ``PackingSettings``: every field has a type, none is ``Any``
    (the rules read facts, not upstream objects)."""
    import sys
    import typing

    import megatron.bridge_thd.adapters as adapters
    from megatron.bridge_thd.step.plan import StepPlan

    for record in (Setup, ModelFacts, StepPlan, PackingSettings):
        namespace = {**vars(sys.modules[record.__module__]), "ModelAdapter": adapters.ModelAdapter}
        hints = typing.get_type_hints(record, globalns=namespace)
        assert set(hints) == {f.name for f in record.__dataclass_fields__.values()}
        assert not [name for name, hint in hints.items() if "Any" in str(hint)], record.__name__


def test_a_stray_hand_set_attribute_is_an_explicit_setting_force_lifts():
    """After configure, a hand-set attribute that says something else: settings_of refuses the contradiction, and
    calling configure again settles it (refused as an explicit setting without force, moved into the record with)."""
    cfg = _cfg(_model(num_moe_experts=None))
    configure(cfg, "thd")
    cfg.dataset.packing_layout = "thd_static"
    with pytest.raises(ValueError, match="contradicts dataset.bridge_thd"):
        settings_of(cfg.dataset)
    with pytest.raises(ValueError, match=r"dataset.bridge_thd.layout='thd' was set explicitly"):
        configure(cfg, "thd_static")
    configure(cfg, "thd_static", force=True)
    assert settings_of(cfg.dataset).layout == "thd_static" and cfg.dataset.packing_layout is None
    # A bad hand-set value the argument replaces: an explicit setting, not a dead end.
    cfg = _cfg(_model(num_moe_experts=None))
    cfg.dataset.overlong_samples = "cut"
    with pytest.raises(ValueError, match=r"dataset.overlong_samples='cut' was set explicitly, but configure stores "
                       r"overlong_samples='drop' in dataset.bridge_thd"):
        configure(cfg, "thd", overlong_samples="drop")
    configure(cfg, "thd", overlong_samples="drop", force=True)
    assert settings_of(cfg.dataset).overlong_samples == "drop"
    # Not replaced: the record refuses it, naming the attribute it came from.
    cfg = _cfg(_model(num_moe_experts=None))
    cfg.dataset.overlong_samples = "cut"
    with pytest.raises(ValueError, match=r"(?s)dataset.overlong_samples='cut' from the hand-set settings: .*"
                       r"overlong_samples: 'cut'; expected one of"):
        configure(cfg, "thd")


def test_files_are_checked_by_configure_not_wherever_the_record_is_read(tmp_path):
    """A lengths_file must exist when configure makes the record; the record itself (read by the step and the
    loaders on every rank) checks values only."""
    missing = str(tmp_path / "lengths.json")
    record = PackingSettings("thd_static", global_batch_packing=GlobalBatchPacking(lengths_file=missing))
    assert record.global_batch_packing.resource_problems()  # it is missing
    cfg = _cfg(_model(num_moe_experts=None))
    with pytest.raises(ValueError, match=r"global_batch_packing.lengths_file: .* is not a file; write it with "
                       r"bridge-thd scan"):
        configure(cfg, "thd_static", global_batch_packing=GlobalBatchPacking(lengths_file=missing))
    assert getattr(cfg.dataset, "bridge_thd", None) is None  # refused: nothing written


def test_the_loaders_read_the_final_model_config_not_a_forecast():
    """Megatron-Bridge builds the loaders after its finalize(): there the model config's variable_seq_lengths is read
    as it is. A hand-made config (no finalize) at PP 2 and micro-batch size 4 keeps fixed pipeline shapes, so the
    loaders choose one thd_static row, as the step's plan then requires."""
    from megatron.bridge_thd.rules.rows import row_buckets

    model = _model(num_moe_experts=None, pipeline_model_parallel_size=2, variable_seq_lengths=False)
    cfg = _cfg(model)
    cfg.train.micro_batch_size = 4
    cfg.dataset.bridge_thd = PackingSettings("thd_static", global_batch_packing=GlobalBatchPacking())
    loaders = read_setup(cfg, "thd_static", final=True)
    assert loaders.fixed_p2p_shapes and row_buckets(loaders) == 1
    model.variable_seq_lengths = True  # what Megatron-Bridge's finalize() leaves for in-batch packing under PP
    assert row_buckets(read_setup(cfg, "thd_static", final=True)) == 4


# ---------------------------------------------------------------------------------------------
# a CP size per sample (Megatron-Core's hybrid_context_parallel)


def _hybrid(**facts) -> dict:
    return dict(cp_per_sample=True, max_tokens_per_rank=4096, per_token_loss=True, **facts)


def test_cp_per_sample_runs_in_the_step_with_what_the_hybrid_schedule_needs():

    accepted = Setup(layout="thd", model=ModelFacts(**_hybrid()), seq_lengths=(8192, 8192))
    assert problems(accepted, STEP) == []
    moe = Setup(layout="thd", model=ModelFacts(**_hybrid(experts=8, load_balancing=("aux_loss",))),
                seq_lengths=(8192, 8192), routes_real_tokens_only=True)
    assert problems(moe, STEP) == []
    gdn = Setup(layout="thd", dp=4, model=ModelFacts(**_hybrid(linear_attention="gated_delta_net",
                                                              linear_heads=(4, 8))), seq_lengths=(8192, 8192))
    assert problems(gdn, STEP) == []
    off = Setup(layout="bshd", pp=2, cp=2, model=ModelFacts(experts=8))  # none of these rules without the flag
    assert not [p for p in problems(off, STEP) if "hybrid_context_parallel" in p]


@pytest.mark.parametrize("setup, expected", [
    (dict(pp=2), "pipeline_model_parallel_size=2.*set pipeline_model_parallel_size=1"),
    (dict(cp=2), "context_parallel_size=2.*set context_parallel_size=1"),
    (dict(facts=dict(per_token_loss=False)), "calculate_per_token_loss=False.*set calculate_per_token_loss=True"),
    (dict(facts=dict(max_tokens_per_rank=None)), "max_seqlen_per_dp_cp_rank is not set"),
    (dict(facts=dict(graphs=True, graph_setting="model.cuda_graph_impl='local'")), "CUDA graphs are on"),
    (dict(moe_overlap="model.overlap_moe_expert_parallel_comm"), "overlap_moe_expert_parallel_comm=True"),
    (dict(layout="thd_static"), "layout='thd_static'.*set layout='thd'"),
    (dict(layout="bshd"), "layout='bshd'.*set layout='thd'"),
    (dict(tp=2, facts=dict(experts=4)), "num_moe_experts=4 with tensor_model_parallel_size=2.*set tensor_model"),
    (dict(ep=2, facts=dict(experts=4)), "expert_model_parallel_size=2.*set expert_model_parallel_size=1"),
    (dict(facts=dict(experts=4, load_balancing=("global_aux_loss",))), "'global_aux_loss'.*use 'aux_loss'"),
    (dict(facts=dict(experts=4, capacity_factor=1.0)), "moe_expert_capacity_factor=1.0.*unset"),
    (dict(facts=dict(experts=4, load_balancing=("seq_aux_loss",))), "'seq_aux_loss', not proven.*use 'aux_loss'"),
    (dict(facts=dict(recompute_granularity="full")), "recompute_granularity='full'.*set recompute_granularity=None"),
    (dict(dp=4, tp=2, facts=dict(linear_attention="gdn", linear_heads=(4, 16))),
     "linear_num_key_heads: 4 heads .2 per TP rank. do not split over the 4"),
    (dict(facts=dict(mtp_layers=1)), "mtp_num_layers=1"),
])
def test_cp_per_sample_refusals_name_the_setting(setup, expected):

    setup = dict(setup)
    facts = _hybrid()
    facts.update(setup.pop("facts", {}))
    s = Setup(layout=setup.pop("layout", "thd"), model=ModelFacts(**facts), seq_lengths=(8192, 8192), **setup)
    found = [p for p in problems(s, STEP) if "hybrid_context_parallel" in p]
    assert len(found) == 1 and re.search(expected, found[0]), found


def test_configure_takes_cp_per_sample_through_cp_per_sample_only():
    """The schedule reads one item of every row per step, which only the loaders cp_per_sample builds yield: the model's
    flag alone is refused; with cp_per_sample, what configure sets itself is not (it is judged at the step)."""
    from megatron.bridge_thd.settings import CPPerSample

    found = problems(Setup(layout="thd", model=ModelFacts(**_hybrid()), seq_lengths=(8192, 8192)), CONFIGURE)
    assert len(found) == 1 and "without cp_per_sample" in found[0] and "configure with cp_per_sample=" in found[0]
    asked = PackingSettings(cp_per_sample=CPPerSample(256), global_batch_packing=GlobalBatchPacking())
    assert problems(Setup(layout="thd", settings=asked, seq_lengths=(8192, 8192), dataloader_type="single"),
                          CONFIGURE) == []
    fixed = PackingSettings(cp_per_sample=CPPerSample(256), global_batch_packing=GlobalBatchPacking(row_length=4096))
    found = problems(Setup(layout="thd", settings=fixed, seq_lengths=(8192, 8192), dataloader_type="single"),
                           CONFIGURE)
    assert len(found) == 1 and "global_batch_packing.row_length=4096" in found[0] and "unset them" in found[0]
    # At the step (the config as configure left it) the flags configure sets are judged.
    step = Setup(layout="thd", settings=asked, model=ModelFacts(cp_per_sample=True), seq_lengths=(8192, 8192), built=True)
    assert any("calculate_per_token_loss=False" in p for p in problems(step, STEP))


def test_the_record_takes_cp_per_sample_with_global_batch_packing():
    from megatron.bridge_thd.settings import CPPerSample

    with pytest.raises(ValueError, match="cp_per_sample.max_tokens_per_rank: 255; expected an even int"):
        PackingSettings(cp_per_sample=CPPerSample(255), global_batch_packing=GlobalBatchPacking())
    with pytest.raises(ValueError, match="cp_per_sample: places each step .* set global_batch_packing too"):
        PackingSettings(cp_per_sample=CPPerSample(256))
