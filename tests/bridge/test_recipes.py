"""Megatron-Bridge 0.6.2's own Qwen-VL SFT recipes + ``configure`` pass its real ``ConfigContainer.validate()``.

Everything upstream runs for real, in a fresh process with Megatron-Bridge imported whole
(``run_on_gloo(whole_bridge=True, initialize=False)``): the recipe functions, unchanged, build their
model provider through ``AutoBridge.from_hf_pretrained`` from the model's ``config.json`` in an offline
hub cache (``bridge_thd_cpu.hf_hub``); ``configure(cfg, layout)`` then sets the packing flags, and
``cfg.validate()`` runs Megatron-Bridge's own checks and finalizes the model config (Megatron-Core's
``TransformerConfig.__post_init__`` included). One process computes every case once (a module
fixture); each test asserts on one case. Reasoning and the case table: docs/recipes-validate.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import traceback
from pathlib import Path

import pytest

from megatron.bridge_thd.settings import settings_of

ROOT = Path(__file__).resolve().parents[2]


LAYOUT_NAMES = ("thd", "thd_static", "bshd")

# recipe key -> (module, function, GPUs the recipe is written for)
RECIPES = {
    "qwen3_vl_8b": ("megatron.bridge.recipes.qwen_vl.h100.qwen3_vl", "qwen3_vl_8b_sft_2gpu_h100_bf16_config", 2),
    "qwen3_vl_30b_a3b": ("megatron.bridge.recipes.qwen_vl.h100.qwen3_vl", "qwen3_vl_30b_a3b_sft_8gpu_h100_bf16_config", 8),
    "qwen35_vl_2b": ("megatron.bridge.recipes.qwen_vl.h100.qwen35_vl", "qwen35_vl_2b_sft_1gpu_h100_bf16_config", 1),
    "qwen35_vl_35b_a3b": ("megatron.bridge.recipes.qwen_vl.h100.qwen35_vl", "qwen35_vl_35b_a3b_sft_16gpu_h100_bf16_config", 16),
}
# parallel variant -> changes to the recipe's model config (the recipe's own settings stay otherwise)
VARIANTS = {
    "own": {},
    "pp2": {"pipeline_model_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
}


def _outcome(error: BaseException | None, stage: str = "") -> dict:
    if error is None:
        return {"ok": True}
    return {"ok": False, "stage": stage, "type": type(error).__name__, "message": str(error),
            "traceback": traceback.format_exc()}


@contextlib.contextmanager
def _h100_device_properties():
    """The recipes' GPU for ``torch.cuda.get_device_properties`` inside the recipe call and ``runtime_config_update``
    only (the test bed's ``recipe_gpu_properties``: the 30B-A3B recipe and ``validate()`` read it to pick and check
    the flex dispatcher's backend)."""
    from megatron.bridge_thd_testbed.training.recipes_on_cpu import recipe_gpu_properties

    with recipe_gpu_properties():
        yield


# Transformer Engine kernels and features the recipes turn on and that Megatron-Core's post-init refuses without
# TE ("fused permutation is not available. Please install TE >= 2.1.0.", "TE version >= 2.3.0 is required for
# overlap_dispatch_backward_with_experts_wgrad"): turned off on this machine only. Neither depends on the layout:
# the permutation fusion is a kernel, and overlap_dispatch_backward_with_experts_wgrad only moves the experts'
# weight-gradient GEMMs onto a side stream behind the dispatch's backward (Megatron-Core transformer/moe/moe_layer.py);
# it refuses overlap_moe_expert_parallel_comm, which configure refuses for the THD layouts anyway.
CPU_ONLY_EDITS = {"moe_permute_fusion": False, "overlap_dispatch_backward_with_experts_wgrad": False}
# What Megatron-Core says without TE for each edit (the first it meets refuses the unedited recipe).
WITHOUT_TE = ("fused permutation is not available. Please install TE",
              "TE version >= 2.3.0 is required for overlap_dispatch_backward_with_experts_wgrad")


def _build(recipe: str, variant: dict, world_size: int, cpu_edits: bool = True):
    import importlib

    module, function, _ = RECIPES[recipe]
    with _h100_device_properties():
        cfg = getattr(importlib.import_module(module), function)()
    for name, value in variant.items():
        setattr(cfg.model, name, value)
    if cpu_edits and not importlib.util.find_spec("transformer_engine"):
        for name, value in CPU_ONLY_EDITS.items():
            if getattr(cfg.model, name, None) is not None:
                setattr(cfg.model, name, value)
    os.environ["WORLD_SIZE"] = str(world_size)
    return cfg


def _world_size(recipe: str, variant: dict) -> int:
    gpus = RECIPES[recipe][2]
    return gpus * variant.get("pipeline_model_parallel_size", 1) * variant.get("context_parallel_size", 1)


def _summary(cfg) -> dict:
    model = cfg.model
    return {
        "ok": True,
        "micro_batch_size": cfg.train.micro_batch_size,
        "pack_sequences_in_batch": getattr(cfg.dataset, "pack_sequences_in_batch", None),
        "hybridep": getattr(model, "moe_flex_dispatcher_backend", None) == "hybridep"
        and getattr(model, "moe_token_dispatcher_type", None) == "flex",
        "hybridep_padding": getattr(model, "moe_hybridep_pad_uneven_dispatch_inputs", None),
        "enable_in_batch_packing": cfg.dataset.enable_in_batch_packing,
        "defer": cfg.dataset.defer_in_batch_packing_to_step,
        "packing_layout": settings_of(cfg.dataset).layout,
        "pad_to_max_length": getattr(cfg.dataset, "pad_to_max_length", None),
        "skip_mask": getattr(cfg.dataset, "skip_getting_attention_mask_from_dataset", None),
        "variable_seq_lengths": model.variable_seq_lengths,
        "pp": model.pipeline_model_parallel_size,
        "cp": model.context_parallel_size,
        "tp": model.tensor_model_parallel_size,
        "ep": model.expert_model_parallel_size,
        "num_moe_experts": model.num_moe_experts,
        "mtp_num_layers": getattr(model, "mtp_num_layers", None),
        "dispatcher": getattr(model, "moe_token_dispatcher_type", None),
        "dataset_seq_length": cfg.dataset.seq_length,
        "model_seq_length": model.seq_length,
        "dataset_type": type(cfg.dataset).__name__,
        "data_parallel_size": cfg.data_parallel_size,
        "global_batch_packing": settings_of(cfg.dataset).global_batch_packing is not None,
        "per_token_loss": getattr(model, "calculate_per_token_loss", None),
        "average_in_collective": cfg.ddp.average_in_collective,
        "loaders_wrapped": _loaders_wrapped(),
        "hybrid_context_parallel": getattr(model, "hybrid_context_parallel", None),
        "max_seqlen_per_dp_cp_rank": getattr(model, "max_seqlen_per_dp_cp_rank", None),
        "vision_dp_when_cp": getattr(model, "vision_dp_when_cp", None),
        "cp_per_sample": getattr(settings_of(cfg.dataset).cp_per_sample, "max_tokens_per_rank", None),
    }


def _loaders_wrapped() -> bool:
    """Whether Megatron-Bridge's loader builder is the global-batch packing wrapper (batching.bridge)."""
    import sys

    loaders = sys.modules.get("megatron.bridge.data.loaders")
    return loaders is not None and hasattr(loaders.build_train_valid_test_data_loaders, "__wrapped__")


def run_case(recipe: str, variant: dict, layout: str | None, extra=None, cpu_edits: bool = True,
             **configure_kwargs) -> dict:
    """Recipe -> parallel variant -> (``extra(cfg)``) -> ``configure(cfg, layout)`` -> Megatron-Bridge's
    ``runtime_config_update`` (mixed precision, data-parallel size, comm overlap, then ``cfg.validate()``,
    what ``finetune`` runs before building the model); the outcome, and what validate left."""
    try:
        cfg = _build(recipe, variant, _world_size(recipe, variant), cpu_edits)
        if extra is not None:
            extra(cfg)
    except Exception as error:  # noqa: BLE001 - reported per case
        return _outcome(error, "recipe")
    if layout is not None:
        from megatron.bridge_thd.configure import configure

        try:
            configure(cfg, layout, **configure_kwargs)
        except Exception as error:  # noqa: BLE001
            return _outcome(error, "configure")
    from megatron.bridge.training.config import runtime_config_update

    try:
        with _h100_device_properties():  # validate() checks the flex dispatcher's backend against the GPU
            runtime_config_update(cfg)
    except Exception as error:  # noqa: BLE001
        return _outcome(error, "validate")
    return _summary(cfg)


# ---- edits that make a contradiction (module level: they run in the child process) ----


def cp_ready(cfg):
    """What validate asks for CP>1 fine-tuning (the recipes average in the collective)."""
    cfg.ddp.average_in_collective = False


def graphs_local(cfg):
    cfg.model.cuda_graph_impl = "local"


def graphs_te(cfg):
    cfg.model.cuda_graph_impl = "transformer_engine"


def seq_length_mismatch(cfg):
    cfg.dataset.seq_length = 2048


def micro_batch_one(cfg):
    """The 8B recipe at micro-batch 1, as it stands: it sets enable_in_batch_packing=True explicitly."""
    cfg.train.micro_batch_size = 1


def micro_batch_one_flag_off(cfg):
    """Micro-batch 1 with Megatron-Bridge's packing flag off (as Megatron-Bridge asks for one sample)."""
    cfg.train.micro_batch_size = 1
    cfg.dataset.enable_in_batch_packing = False


def micro_batch_one_graphs_pp2(cfg):
    """Micro-batch 1 with Transformer-Engine graphs of the MLP only, under PP=2."""
    micro_batch_one_flag_off(cfg)
    from megatron.bridge.utils.cuda_graph import set_cuda_graph_modules

    cfg.model.cuda_graph_impl = "transformer_engine"
    set_cuda_graph_modules(cfg.model, ["mlp"])


def defer_off(cfg):
    cfg.dataset.defer_in_batch_packing_to_step = False


def layout_bshd_explicit(cfg):
    cfg.dataset.packing_layout = "bshd"


def offline_packing(cfg):
    from megatron.bridge.data.builders.gpt_sft import PackedSequenceSpecs

    cfg.dataset.enable_in_batch_packing = False
    cfg.dataset.enable_offline_packing = True
    cfg.dataset.offline_packing_specs = PackedSequenceSpecs(packed_sequence_size=4096)


def moe_ep_overlap(cfg):
    from megatron.bridge.training.comm_overlap import CommOverlapConfig

    cfg.comm_overlap = CommOverlapConfig(tp_comm_overlap=False, overlap_moe_expert_parallel_comm=True)


def allgather_dispatcher(cfg):
    cfg.model.moe_token_dispatcher_type = "allgather"


def seq_aux_loss(cfg):
    cfg.model.moe_router_load_balancing_type = "seq_aux_loss"


def expert_capacity(cfg):
    cfg.model.moe_expert_capacity_factor = 1.0
    cfg.model.moe_token_drop_policy = "probs"


def hybridep_graphs(cfg):
    cfg.model.moe_token_dispatcher_type = "flex"
    cfg.model.moe_flex_dispatcher_backend = "hybridep"
    cfg.model.cuda_graph_impl = "transformer_engine"


def cp_ready_odd_seq_length(cfg):
    cp_ready(cfg)
    cfg.dataset.seq_length = cfg.model.seq_length = 4094  # even, but not a multiple of 2 * CP = 4


def sum_in_collective(cfg):
    """What a user sets for global-batch packing: the recipes average in the collective explicitly."""
    cfg.ddp.average_in_collective = False


def python_snippet(page: str, marker: str) -> str:
    """The first ```python block of ``docs/<page>`` that contains ``marker``, as written."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), flags=re.S)
    return next(block for block in blocks if marker in block)


def cp_per_sample_as_the_docs_say(cfg):
    """docs/cp-per-sample.md's snippet that turns a CP size per sample on, run as written on the recipe's config."""
    exec(python_snippet("cp-per-sample.md", "cp_per_sample="), {"cfg": cfg})  # noqa: S102 - our own docs


def cp_per_sample_by_the_recipe_script(cfg):
    """The recipe scripts' ``--cp-per-sample 16384`` (``recipes/_thd_recipe.config``) on the recipe's config."""
    import sys

    sys.path.insert(0, str(ROOT / "recipes"))
    from _thd_recipe import config

    config(lambda: cfg, "thd", cp_per_sample=16384)


def micro_batch_one_global(cfg):
    micro_batch_one_flag_off(cfg)
    sum_in_collective(cfg)


def batch_loader(cfg):
    sum_in_collective(cfg)
    cfg.dataset.dataloader_type = "batch"


GLOBAL = {"global_batch_packing": True}
CP2 = {"context_parallel_size": 2}
PP2 = {"pipeline_model_parallel_size": 2}

# name -> (recipe, parallel variant, layout, edit, configure keyword arguments)
CONTRADICTIONS = {
    "cp2_recipe_as_is": ("qwen3_vl_8b", CP2, "thd", None, {}),
    "cp2_seq_length_not_multiple_of_2cp": ("qwen3_vl_8b", CP2, "thd", cp_ready_odd_seq_length, {}),
    "graphs_local_pp2_thd_static": ("qwen3_vl_8b", PP2, "thd_static", graphs_local, {}),
    "graphs_local_pp2_bshd": ("qwen3_vl_8b", PP2, "bshd", graphs_local, {}),
    "graphs_te_pp1_thd": ("qwen3_vl_8b", {}, "thd", graphs_te, {}),
    "graphs_te_pp1_thd_static": ("qwen3_vl_8b", {}, "thd_static", graphs_te, {}),
    "graphs_local_pp1_thd_static": ("qwen3_vl_8b", {}, "thd_static", graphs_local, {}),
    "graphs_declared_pp1_thd": ("qwen3_vl_8b", {}, "thd", None, {"cuda_graphs": True}),
    "graphs_denied_but_on": ("qwen3_vl_8b", {}, "thd_static", graphs_local, {"cuda_graphs": False}),
    "seq_length_mismatch": ("qwen3_vl_8b", {}, "thd", seq_length_mismatch, {}),
    "micro_batch_size_1_bridge_flag_explicit": ("qwen3_vl_8b", {}, "thd", micro_batch_one, {}),
    "micro_batch_size_1_graphs_pp2_thd": ("qwen3_vl_8b", PP2, "thd", micro_batch_one_graphs_pp2, {}),
    "packing_layout_explicit_other": ("qwen3_vl_8b", {}, "thd", layout_bshd_explicit, {}),
    "offline_packing": ("qwen3_vl_8b", {}, "thd", offline_packing, {}),
    "moe_ep_overlap_thd": ("qwen3_vl_30b_a3b", {}, "thd", moe_ep_overlap, {}),
    "moe_ep_overlap_thd_static": ("qwen3_vl_30b_a3b", {}, "thd_static", moe_ep_overlap, {}),
    "moe_ep_overlap_bshd": ("qwen3_vl_30b_a3b", {}, "bshd", moe_ep_overlap, {}),
    "allgather_ep8_thd": ("qwen3_vl_30b_a3b", {}, "thd", allgather_dispatcher, {}),
    "seq_aux_loss_thd": ("qwen3_vl_30b_a3b", {}, "thd", seq_aux_loss, {}),
    "expert_capacity_thd_static": ("qwen35_vl_35b_a3b", {}, "thd_static", expert_capacity, {}),
    "hybridep_graphs_thd_static": ("qwen3_vl_30b_a3b", {}, "thd_static", hybridep_graphs, {}),
    "unknown_layout": ("qwen3_vl_8b", {}, "sbhd", None, {}),
    "global_batch_recipe_as_is": ("qwen3_vl_8b", {}, "thd_static", None, GLOBAL),
    "global_batch_bshd": ("qwen3_vl_8b", {}, "bshd", sum_in_collective, GLOBAL),
    "global_batch_batch_loader": ("qwen3_vl_8b", {}, "thd", batch_loader, GLOBAL),
    "cp_per_sample_recipe_as_is": ("qwen3_vl_8b", {}, "thd", None, {"cp_per_sample": 16384}),
}
# A CP size per sample turned on as docs/cp-per-sample.md and the recipe scripts do it (configure inside the edit).
DYNAMIC_CP = {"docs_snippet": cp_per_sample_as_the_docs_say, "recipe_script": cp_per_sample_by_the_recipe_script}
# The same edits where the layout allows them (what configure must not refuse).
ALLOWED = {
    # The recipe sets defer_in_batch_packing_to_step=True; False equals the dataclass default, so configure
    # cannot tell it from "not set" (docs/configure.md, the one blind spot) and sets it back to True.
    "defer_off_equal_to_default": ("qwen3_vl_8b", {}, "thd", defer_off, {}),
    "defer_off_explicit_forced": ("qwen3_vl_8b", {}, "thd", defer_off, {"force": True}),
    "graphs_te_pp1_bshd": ("qwen3_vl_8b", {}, "bshd", graphs_te, {}),
    "allgather_ep8_thd_static": ("qwen3_vl_30b_a3b", {}, "thd_static", allgather_dispatcher, {}),
    "seq_aux_loss_bshd": ("qwen3_vl_30b_a3b", {}, "bshd", seq_aux_loss, {}),
    "global_batch_thd_static": ("qwen3_vl_8b", {}, "thd_static", sum_in_collective, GLOBAL),
    "global_batch_thd_pp2": ("qwen3_vl_8b", PP2, "thd", sum_in_collective, GLOBAL),
    "global_batch_qwen35_moe_thd_static": ("qwen35_vl_35b_a3b", {}, "thd_static", sum_in_collective, GLOBAL),
    "global_batch_qwen35_moe_thd": ("qwen35_vl_35b_a3b", {}, "thd", sum_in_collective, GLOBAL),
    # A micro-batch of one sample (docs/configure.md): every layout, in-batch and global-batch packing.
    "micro_batch_size_1_thd": ("qwen3_vl_8b", {}, "thd", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_thd_static": ("qwen3_vl_8b", {}, "thd_static", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_bshd": ("qwen3_vl_8b", {}, "bshd", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_thd_pp2": ("qwen3_vl_8b", PP2, "thd", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_thd_static_pp2": ("qwen3_vl_8b", PP2, "thd_static", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_bshd_pp2": ("qwen3_vl_8b", PP2, "bshd", micro_batch_one_flag_off, {}),
    "micro_batch_size_1_graphs_pp2_bshd": ("qwen3_vl_8b", PP2, "bshd", micro_batch_one_graphs_pp2, {}),
    "micro_batch_size_1_global_batch_thd": ("qwen3_vl_8b", {}, "thd",
                                            micro_batch_one_global, GLOBAL),
}


def all_cases() -> dict:
    """Every case once, in this (fresh) process: key -> outcome."""
    results = {}
    variants = {"own": ({}, None), "pp2": (PP2, None), "cp2": (CP2, cp_ready)}
    for recipe in RECIPES:
        for variant_name, (variant, edit) in variants.items():
            for layout in (None, *LAYOUT_NAMES):
                results[("matrix", recipe, variant_name, layout)] = run_case(recipe, variant, layout, edit)
    for table in (CONTRADICTIONS, ALLOWED):
        for name, (recipe, variant, layout, edit, kwargs) in table.items():
            results[("case", name)] = run_case(recipe, variant, layout, edit, **kwargs)
            # What Megatron-Bridge alone does with the same config (no configure).
            results[("bridge_alone", name)] = run_case(recipe, variant, None, edit)
    results[("no_cpu_edits", "qwen35_vl_35b_a3b")] = run_case("qwen35_vl_35b_a3b", {}, "thd", cpu_edits=False)
    for name, edit in DYNAMIC_CP.items():
        results[("cp_per_sample", name)] = run_case("qwen3_vl_8b", {}, None, edit)
    return results


# ---------------------------------------------------------------- the tests (parent process)

# Each recipe's own settings, as its source and docstring state them (recipes/qwen_vl/h100/*.py), one entry per
# Megatron-Bridge line where they differ (0.6.2; 0.7.0 = main 067f987: the Qwen3.5-VL 35B-A3B recipe moved to
# TP=1, PP=2, EP=8, micro-batch 1, HybridEP). The installed recipe must be one of them, and configure must keep it.
RECIPE_SETTINGS = {
    "qwen3_vl_8b": [dict(tp=2, ep=1, pp=1, micro_batch_size=2, hybridep=False)],
    "qwen3_vl_30b_a3b": [dict(tp=1, ep=8, pp=1, micro_batch_size=2, hybridep=False)],
    "qwen35_vl_2b": [dict(tp=1, ep=1, pp=1, micro_batch_size=4, hybridep=False)],
    "qwen35_vl_35b_a3b": [dict(tp=2, ep=16, pp=1, micro_batch_size=4, hybridep=False),
                          dict(tp=1, ep=8, pp=2, micro_batch_size=1, hybridep=True)],
}
VARIANT_SIZES = {"own": dict(cp=1), "pp2": dict(pp=2, cp=1), "cp2": dict(cp=2)}  # over the recipe's


@pytest.fixture(scope="module")
def outcomes():
    """Every case, computed once in one fresh process with Megatron-Bridge imported whole (shared
    with test_package.py: tests/_fresh_bridge.py)."""
    from _fresh_bridge import fresh_bridge_process

    return fresh_bridge_process()["recipes"]


def _fail_text(outcome: dict) -> str:
    return f"{outcome.get('stage')}: {outcome.get('type')}: {outcome.get('message')}\n{outcome.get('traceback', '')}"


MATRIX = [(recipe, variant, layout) for recipe in RECIPES for variant in VARIANT_SIZES for layout in (None, *LAYOUT_NAMES)]


@pytest.mark.parametrize("recipe,variant,layout", MATRIX, ids=["-".join(map(str, case)) for case in MATRIX])
def test_recipe_passes_validate(outcomes, recipe, variant, layout):
    """The recipe (its own parallel settings, PP=2, or CP=2 with average_in_collective=False as validate
    asks), configured for ``layout`` (None: not configured), passes runtime_config_update / validate()."""
    outcome = outcomes[("matrix", recipe, variant, layout)]
    assert outcome["ok"], _fail_text(outcome)
    own = _recipe_settings(outcome, recipe)
    sizes = {**own, **VARIANT_SIZES[variant]}
    assert {name: outcome[name] for name in sizes} == sizes  # the recipe's settings, not configure's
    assert outcome["dataset_seq_length"] == outcome["model_seq_length"] == 4096
    # Megatron-Bridge's rules after validate(), whoever set them: a fixed collate width for PP>1 or EP>1,
    # and for in-batch packing with PP>1 variable_seq_lengths (finalize() through _enable_in_batch_packing).
    if sizes["pp"] > 1 or sizes["ep"] > 1:
        assert outcome["pad_to_max_length"] is True
    if outcome["hybridep"]:  # eager HybridEP pads uneven dispatch inputs (configure and Megatron-Bridge agree)
        assert outcome["hybridep_padding"] is True
    if layout is None:
        return
    assert outcome["packing_layout"] == layout
    assert outcome["pack_sequences_in_batch"] is True and outcome["defer"] is True
    assert outcome["skip_mask"] is False  # the step needs the dataset's 2D mask
    one_sample = sizes["micro_batch_size"] == 1
    # Megatron-Bridge's flag: on, except for a micro-batch of one sample (its validate() refuses it there), where
    # only "thd" turns variable_seq_lengths on under PP (configure's hook); the static layouts keep fixed shapes.
    assert outcome["enable_in_batch_packing"] is (not one_sample)
    assert outcome["variable_seq_lengths"] is (sizes["pp"] > 1 and (not one_sample or layout == "thd"))


def _recipe_settings(outcome: dict, recipe: str) -> dict:
    """The recipe's own settings on the installed line: the entry of RECIPE_SETTINGS whose settings the variant
    leaves alone (all but PP and CP) the outcome matches."""
    for settings in RECIPE_SETTINGS[recipe]:
        if all(outcome[name] == value for name, value in settings.items() if name != "pp"):
            return settings
    raise AssertionError(f"{recipe}: settings {outcome} are none of the recipe's known ones {RECIPE_SETTINGS[recipe]}")


def test_the_providers_come_from_the_hub_configs(outcomes):
    """AutoBridge built each provider from the offline hub's config.json: experts and MTP as those say."""
    summary = {recipe: outcomes[("matrix", recipe, "own", None)] for recipe in RECIPES}
    assert {recipe: s["num_moe_experts"] for recipe, s in summary.items()} == {
        "qwen3_vl_8b": None, "qwen3_vl_30b_a3b": 128, "qwen35_vl_2b": None, "qwen35_vl_35b_a3b": 256}
    assert summary["qwen35_vl_2b"]["mtp_num_layers"] == summary["qwen35_vl_35b_a3b"]["mtp_num_layers"] == 1
    assert summary["qwen3_vl_30b_a3b"]["dispatcher"] == "alltoall"


def test_the_recipes_own_packing_switch(outcomes):
    """Qwen3-VL recipes turn in-batch packing on, the Qwen3.5-VL recipes off (explicitly False, which
    equals the dataclass default: configure turns it on without calling it an explicit setting)."""
    assert outcomes[("matrix", "qwen3_vl_8b", "own", None)]["enable_in_batch_packing"] is True
    assert outcomes[("matrix", "qwen35_vl_2b", "own", None)]["enable_in_batch_packing"] is False
    assert outcomes[("matrix", "qwen35_vl_2b", "own", "thd")]["enable_in_batch_packing"] is True


# name -> (who refuses, a fragment of the message, what Megatron-Bridge alone does: None passes, else a fragment)
REFUSALS = {
    "cp2_recipe_as_is": ("validate", "When finetuning with CP>1, average_in_collective must be False",
                         "average_in_collective must be False"),
    "cp2_seq_length_not_multiple_of_2cp": ("validate", "seq_length must be divisible by the CP/SP collate padding "
                                           "multiple (4)", "collate padding multiple (4)"),
    "graphs_local_pp2_thd_static": ("configure", "model.cuda_graph_impl='local' with "
                                    "model.pipeline_model_parallel_size=2", "only for full-iteration CUDA graphs"),
    "graphs_local_pp2_bshd": ("configure", "('bshd' included); set model.cuda_graph_impl='none'",
                              "only for full-iteration CUDA graphs"),
    "graphs_te_pp1_thd": ("configure", "layout: 'thd' gives a row whose length changes every micro-batch, which "
                          "CUDA graphs cannot replay", None),
    "graphs_te_pp1_thd_static": ("configure", "Megatron-Core's Transformer-Engine graph path asserts "
                                 "packed_seq_params is None when attention is inside the graph", None),
    # Megatron-Core's local graphs take the static row, configure accepts them, and Megatron-Bridge's validate()
    # allows "local" only as full-iteration graphs (which check no argument): no graph runs a THD row in its loop.
    "graphs_local_pp1_thd_static": ("validate", 'supports model.cuda_graph_impl="local" only for full-iteration',
                                    'supports model.cuda_graph_impl="local" only for full-iteration'),
    "graphs_declared_pp1_thd": ("configure", "which CUDA graphs cannot replay; use layout='thd_static'", None),
    "graphs_denied_but_on": ("configure", "cuda_graphs: False was passed, but the model config enables CUDA graphs",
                             "only for full-iteration CUDA graphs"),
    "seq_length_mismatch": ("configure", "dataset.seq_length=2048 and model.seq_length=4096 differ",
                            "sequence length configuration in model config and dataset config match"),
    "micro_batch_size_1_bridge_flag_explicit": (
        "configure", "dataset.enable_in_batch_packing=True was set explicitly, but with train.micro_batch_size=1 "
        "Megatron-Bridge's ConfigContainer.validate() refuses", "micro_batch_size should be greater than 1 when using "
        "enable_in_batch_packing=True"),
    "micro_batch_size_1_graphs_pp2_thd": ("configure", "layout 'thd' with PP>1 needs variable_seq_lengths=True", None),
    "packing_layout_explicit_other": ("configure", "dataset.packing_layout='bshd' was set explicitly", None),
    "offline_packing": ("configure", "dataset.enable_offline_packing: set (True), but offline packing and in-batch "
                        "packing are mutually exclusive", "Micro batch size should be 1 when training with packed"),
    "moe_ep_overlap_thd": ("configure", "comm_overlap.overlap_moe_expert_parallel_comm=True with layout='thd'", None),
    "moe_ep_overlap_thd_static": ("configure", "comm_overlap.overlap_moe_expert_parallel_comm=True with "
                                  "layout='thd_static'", None),
    "moe_ep_overlap_bshd": ("configure", "(Qwen3VLModel, declared by Qwen3VLMoEModelProvider.provide) has none",
                            None),
    "allgather_ep8_thd": ("configure", "layout: 'thd' with MoE moe_token_dispatcher_type='allgather' and "
                          "expert_model_parallel_size=8", None),
    "seq_aux_loss_thd": ("configure", "model.moe_router_load_balancing_type='seq_aux_loss' with layout='thd'", None),
    "expert_capacity_thd_static": ("configure", "model.moe_expert_capacity_factor=1.0 with layout='thd_static'",
                                   None),
    "hybridep_graphs_thd_static": ("configure", "layout: 'thd_static' with HybridEP", None),
    "unknown_layout": ("configure", "layout: 'sbhd' is not one of ('thd', 'thd_static', 'bshd')", None),
    "global_batch_recipe_as_is": ("configure", "ddp.average_in_collective=True was set explicitly", None),
    "global_batch_bshd": ("configure", "global_batch_packing: layout 'bshd' lays out exactly", None),
    "global_batch_batch_loader": ("configure", "dataset.dataloader_type: 'batch'; global-batch packing draws", None),
    # What the docs' snippet sets before configure, and why: configure cannot tell the recipe's True from a user's.
    "cp_per_sample_recipe_as_is": ("configure", "ddp.average_in_collective=True was set explicitly, but cp_per_sample needs "
                                "per-token loss", None),
}


def test_every_contradiction_case_has_an_expectation():
    assert set(REFUSALS) == set(CONTRADICTIONS)


@pytest.mark.parametrize("name", list(REFUSALS))
def test_contradiction_is_refused(outcomes, name):
    """Each contradiction is refused before training, by configure or by Megatron-Bridge's validate()."""
    who, fragment, alone = REFUSALS[name]
    outcome = outcomes[("case", name)]
    assert not outcome["ok"], f"{name}: passed configure and validate()"
    assert outcome["stage"] == who, _fail_text(outcome)
    assert fragment in outcome["message"], _fail_text(outcome)
    # What Megatron-Bridge does with the same config without configure: where it passes, only ours refuses.
    bridge_alone = outcomes[("bridge_alone", name)]
    if alone is None:
        assert bridge_alone["ok"], _fail_text(bridge_alone)
    else:
        assert not bridge_alone["ok"] and alone in bridge_alone["message"], _fail_text(bridge_alone)


@pytest.mark.parametrize("name", list(ALLOWED))
def test_the_same_settings_pass_where_the_layout_allows_them(outcomes, name):
    outcome = outcomes[("case", name)]
    assert outcome["ok"], _fail_text(outcome)
    assert outcome["packing_layout"] == ALLOWED[name][2]
    assert outcome["defer"] is True


@pytest.mark.parametrize("name", [name for name in ALLOWED if name.startswith("micro_batch_size_1")])
def test_a_micro_batch_of_one_sample_passes_validate_in_every_layout(outcomes, name):
    """With train.micro_batch_size=1 configure leaves Megatron-Bridge's flag off (its validate() refuses it) and
    turns the step's own switch on; "thd" under PP gets variable_seq_lengths, the static layouts keep fixed p2p
    shapes (so CUDA graphs with PP pass Qwen3VLModel's assert); global-batch packing normalises per token."""
    recipe, variant, layout, _, kwargs = ALLOWED[name]
    outcome = outcomes[("case", name)]
    assert outcome["ok"], _fail_text(outcome)
    assert outcome["micro_batch_size"] == 1 and outcome["packing_layout"] == layout
    assert outcome["enable_in_batch_packing"] is False and outcome["pack_sequences_in_batch"] is True
    assert outcome["variable_seq_lengths"] is (outcome["pp"] > 1 and layout == "thd")
    assert outcome["global_batch_packing"] is bool(kwargs.get("global_batch_packing"))


@pytest.mark.parametrize("name", [name for name in ALLOWED if "global_batch" in name])
def test_global_batch_packing_passes_validate_with_per_token_loss(outcomes, name):
    """configure(global_batch_packing=True) on the real recipes: validate() passes, the loss is normalised
    per token over the step (Megatron-Core's DDP then sums in the collective), the setting is on the
    dataset, and Megatron-Bridge's loader builder is wrapped (its name exists in 0.6.2)."""
    outcome = outcomes[("case", name)]
    assert outcome["ok"], _fail_text(outcome)
    assert outcome["global_batch_packing"] and outcome["per_token_loss"] is True
    assert outcome["average_in_collective"] is False and outcome["loaders_wrapped"]
    # Without configure the recipes normalise per micro-batch (Megatron-Bridge's own setting at CP=1).
    assert outcomes[("bridge_alone", name)]["per_token_loss"] is False


def test_without_the_cpu_only_edit_validate_refuses_only_for_the_missing_transformer_engine(outcomes):
    """CPU_ONLY_EDITS is the one change made to the recipes here, and only because TE is absent."""
    outcome = outcomes[("no_cpu_edits", "qwen35_vl_35b_a3b")]
    if importlib.util.find_spec("transformer_engine"):
        pytest.skip("Transformer Engine is installed: the recipes run unedited")
    assert not outcome["ok"] and outcome["stage"] == "validate", _fail_text(outcome)
    assert any(message in outcome["message"] for message in WITHOUT_TE), _fail_text(outcome)


@pytest.mark.parametrize("name", list(DYNAMIC_CP))
def test_cp_per_sample_turns_on_as_the_docs_say(outcomes, name):
    """docs/cp-per-sample.md's snippet and the recipe scripts' ``--cp-per-sample`` on Megatron-Bridge's Qwen3-VL 8B recipe
    pass configure and validate(), with what a CP size per sample needs: Megatron-Core's hybrid CP on a static CP of
    1 at the record's tokens per rank, the vision tower split over a row's ranks, global-batch packing's loaders,
    per-token loss with DDP summing."""
    outcome = outcomes[("cp_per_sample", name)]
    assert outcome["ok"], _fail_text(outcome)
    assert outcome["packing_layout"] == "thd" and outcome["cp"] == 1
    assert outcome["hybrid_context_parallel"] is True and outcome["vision_dp_when_cp"] is True
    assert outcome["cp_per_sample"] and outcome["max_seqlen_per_dp_cp_rank"] == outcome["cp_per_sample"]
    assert outcome["global_batch_packing"] is True and outcome["loaders_wrapped"] is True
    assert outcome["per_token_loss"] is True and outcome["average_in_collective"] is False
