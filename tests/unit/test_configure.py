"""Tests of ``megatron.bridge_thd.configure.configure``.

Two kinds of config objects are used:

* ``types.SimpleNamespace`` objects shaped like a ``ConfigContainer`` (``cfg.dataset``,
  ``cfg.model``, ``cfg.train``), where every attribute present counts as set by the user, and
  :class:`BridgeLikeDataset`, a dataclass with Bridge's dataset defaults, where a value equal to
  its default does not;
* Megatron-Bridge 0.6.2's own classes, where they load on the CPU: ``TransformerConfig``
  (``models/transformer_config.py``, with its deferred ``finalize()``), ``DataloaderConfig``
  (``data/base.py``) and ``MockVLMSFTDatasetConfig``, whose class body is executed from the
  installed ``data/builders/mock_vlm_sft.py`` (its module imports PIL and transformers, which the
  class itself does not use), plus ``_enable_safe_hybridep_dispatch``,
  ``validate_cuda_graph_configuration``, ``DirectSFTDataset`` and the CUDA graph check
  ``Qwen3VLModel.__init__`` runs on its language model config
  (``models/qwen_vl/modelling_qwen3_vl/model.py``).

``training/config.py`` (``ConfigContainer.validate``) is not imported in this process: the suite
loads Megatron-Bridge's modules without their package ``__init__`` (``megatron.bridge_thd.upstream.loading``),
and ``data.builders.gpt_sft`` needs ``megatron.bridge.data.packing.__init__``. The real
``validate()`` on the real recipes runs in a fresh process in ``tests/bridge/test_recipes.py``; here
its packing-related lines are copied verbatim into :func:`bridge_packing_validate` below (file
and line numbers there) for fast in-process cases, and ``test_copied_upstream_lines_are_current``
fails if the installed file no longer has them.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import logging
import math
import pathlib
import re
import sys
import typing
from types import SimpleNamespace

import pytest
import torch

from megatron.bridge_thd import configure as configure_module
from megatron.bridge_thd import configure_flags, qwen3_vl_step
from megatron.bridge_thd.configure import LAYOUT_NAMES, configure, cuda_graphs_enabled, uses_hybridep
from megatron.bridge_thd.layouts import layout_for
from megatron.bridge_thd.rules.setup import requested_layout
from megatron.bridge_thd.settings import (
    MISSING, SETTINGS_ATTRIBUTE, PackingSettings, explicit_value, is_explicit, settings_of,
)
from megatron.bridge_thd.upstream.loading import bridge_available, load_bridge_module
from megatron.bridge_thd.upstream.line import upstream_line

LOGGER = "megatron.bridge_thd.configure"


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def make_cfg(dataset=None, model=None, train=None):
    """A ConfigContainer-shaped namespace; no packing flag is set unless given."""
    base_dataset = dict(seq_length=4096)
    base_model = dict(pipeline_model_parallel_size=1, expert_model_parallel_size=1, seq_length=4096)
    base_train = dict(micro_batch_size=4, global_batch_size=32)
    return SimpleNamespace(
        dataset=SimpleNamespace(**{**base_dataset, **(dataset or {})}),
        model=SimpleNamespace(**{**base_model, **(model or {})}),
        train=SimpleNamespace(**{**base_train, **(train or {})}),
    )


@dataclasses.dataclass
class BridgeLikeDataset:
    """The packing fields of Megatron-Bridge 0.6.2's VLM dataset dataclasses, with their defaults
    (``DirectHFSFTDatasetConfig``, ``MockVLMSFTDatasetConfig``): a value equal to its field's
    default is not the user's, so ``configure`` may change it."""

    seq_length: int = 4096
    skip_getting_attention_mask_from_dataset: bool = True
    enable_in_batch_packing: bool = False
    defer_in_batch_packing_to_step: bool = False
    pad_to_max_length: bool = False


def make_bridge_like_cfg(dataset=None, model=None, train=None):
    """``make_cfg`` with a :class:`BridgeLikeDataset` (its fields at their defaults unless given)."""
    cfg = make_cfg(model=model, train=train)
    cfg.dataset = BridgeLikeDataset(**(dataset or {}))
    return cfg


def snapshot(cfg):
    return {name: copy.deepcopy(vars(getattr(cfg, name))) for name in ("dataset", "model", "train")}


def configured_layout(cfg):
    """The layout megatron.bridge_thd's step resolves from this config (the rules it builds its plan by)."""
    model = getattr(cfg.model, "transformer", cfg.model)
    return layout_for(requested_layout(cfg.dataset), pp=getattr(model, "pipeline_model_parallel_size", 1),
                      variable_seq_lengths=bool(getattr(model, "variable_seq_lengths", False)))


HYBRIDEP = dict(num_moe_experts=8, moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="hybridep")


# ---------------------------------------------------------------------------------------------
# Megatron-Bridge 0.6.2 pieces that load on the CPU
# ---------------------------------------------------------------------------------------------

needs_bridge = pytest.mark.skipif(not bridge_available(), reason="megatron-bridge is not installed")


def bridge_root() -> pathlib.Path:
    return pathlib.Path(list(importlib.util.find_spec("megatron.bridge").submodule_search_locations)[0])


@pytest.fixture(scope="module")
def bridge():
    if not bridge_available():
        pytest.skip("megatron-bridge is not installed")
    return SimpleNamespace(
        transformer_config=load_bridge_module("models.transformer_config"),
        cuda_graph=load_bridge_module("utils.cuda_graph"),
        data_base=load_bridge_module("data.base"),
        direct_sft=load_bridge_module("data.datasets.direct_sft"),
    )


@pytest.fixture(scope="module")
def mock_vlm_config_cls(bridge):
    """Megatron-Bridge 0.6.2's ``MockVLMSFTDatasetConfig``: its class source, executed as is.

    ``data/builders/mock_vlm_sft.py`` imports PIL and transformers at module level (not installed /
    not needed here); the dataclass body only uses ``dataclass``, ``Literal`` and the real
    ``DataloaderConfig``, so it runs unchanged.
    """
    path = bridge_root() / "data" / "builders" / "mock_vlm_sft.py"
    source = path.read_text()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "MockVLMSFTDatasetConfig")
    start = min([d.lineno for d in node.decorator_list] + [node.lineno])
    class_source = "\n".join(source.splitlines()[start - 1 : node.end_lineno])
    namespace = {
        # dataclasses resolves the class's module in sys.modules; this test module stands in.
        "__name__": __name__,
        "dataclass": dataclasses.dataclass,
        "Literal": typing.Literal,
        "Any": typing.Any,
        "DataloaderConfig": bridge.data_base.DataloaderConfig,
    }
    exec(compile(class_source, str(path), "exec"), namespace)
    return namespace["MockVLMSFTDatasetConfig"]


@pytest.fixture(scope="module")
def qwen3_vl_build_check(bridge):
    """The check Megatron-Bridge 0.6.2's ``Qwen3VLModel.__init__`` runs on its language model config.

    ``_expose_language_model_for_cuda_graph_helper`` (``models/qwen_vl/modelling_qwen3_vl/model.py``,
    the installed function itself) called on a stand-in ``self`` whose ``language_model.config`` is
    the given model config; building the whole model needs CUDA graphs' own machinery.
    """
    model_module = load_bridge_module("models.qwen_vl.modelling_qwen3_vl.model")
    check = model_module.Qwen3VLModel._expose_language_model_for_cuda_graph_helper

    def run(model_config):
        language_model = SimpleNamespace(config=model_config, position_embedding_type="mrope", rotary_pos_emb=None,
                                         decoder=None)
        check(SimpleNamespace(language_model=language_model))

    return run


def bridge_transformer_config(bridge, **overrides):
    """Megatron-Bridge 0.6.2's TransformerConfig (post-init deferred to ``finalize()``)."""
    settings = dict(num_layers=4, hidden_size=64, num_attention_heads=4, params_dtype=torch.float32)
    settings.update(overrides)
    return bridge.transformer_config.TransformerConfig(**settings)


def bridge_packing_validate(cfg, bridge, mock_vlm_config_cls):
    """The packing-related part of the installed Megatron-Bridge's ``ConfigContainer.validate()``, copied from
    whichever line is installed: decided by what the installed code offers (``upstream_line``'s
    ``hybridep_dispatch_takes_uses_thd``), as the package decides it."""
    if upstream_line().hybridep_dispatch_takes_uses_thd:
        return _packing_validate_hybridep_in_validate(cfg, bridge, mock_vlm_config_cls)
    return _packing_validate_hybridep_in_finalize(cfg, bridge, mock_vlm_config_cls)


def safe_hybridep_dispatch(bridge, config):
    """Megatron-Bridge's ``_enable_safe_hybridep_dispatch`` as the installed line calls it for our configs:
    from ``validate()`` with ``uses_thd`` (in-batch packing on), or from ``finalize()`` with the config only."""
    if upstream_line().hybridep_dispatch_takes_uses_thd:
        bridge.transformer_config._enable_safe_hybridep_dispatch(config, uses_thd=True)
    else:
        bridge.transformer_config._enable_safe_hybridep_dispatch(config)


def _packing_validate_hybridep_in_validate(cfg, bridge, mock_vlm_config_cls):
    """The packing-related part of ``ConfigContainer.validate()`` on the line whose validate() calls
    ``_enable_safe_hybridep_dispatch(transformer_config, uses_thd=...)`` (Megatron-Bridge 0.6.2).

    Copied verbatim (``self`` -> ``cfg``) from the installed
    ``megatron/bridge/training/config.py``:

    * L1150-1160: in-batch / offline packing exclusivity;
    * L1192-1196: ``dataset.validate()`` for the declarative VLM configs;
    * L1206-1211: ``pad_to_max_length`` forced for PP>1 or EP>1;
    * L1213-1231: the CP/SP collate padding multiple and the ``seq_length`` divisibility check;
    * L1235-1247: ``transformer_config._enable_in_batch_packing`` and the padding multiples;
    * L1249: ``_enable_safe_hybridep_dispatch`` (the real function is called);
    * L1251-1252: ``dataset.finalize()`` (ddp/optimizer finalize, L1253-1256, are not packing-related);
    * L1260-1262: ``validate_cuda_graph_configuration`` (real) and ``model.finalize()`` (real,
      when the model is Bridge's TransformerConfig; it applies ``models/transformer_config.py``
      L188-189: ``variable_seq_lengths = True`` for in-batch packing with PP>1);
    * L1480-1485: ``micro_batch_size`` must be > 1 with ``enable_in_batch_packing``.

    ``EnergonDatasetConfig`` / ``DirectHFSFTDatasetConfig`` cannot be loaded on the CPU, so the
    ``isinstance`` tuples hold the one declarative config that can, ``MockVLMSFTDatasetConfig``.
    """
    declarative = (mock_vlm_config_cls,)
    enable_in_batch_packing = getattr(cfg.dataset, "enable_in_batch_packing", False)
    enable_offline_packing = getattr(cfg.dataset, "enable_offline_packing", False)
    offline_packing_specs = getattr(cfg.dataset, "offline_packing_specs", None)
    uses_thd = enable_offline_packing or enable_in_batch_packing

    if enable_offline_packing and enable_in_batch_packing:
        raise ValueError("enable_offline_packing and enable_in_batch_packing are mutually exclusive.")
    if enable_offline_packing and offline_packing_specs is None:
        raise ValueError("offline_packing_specs must be set when enable_offline_packing=True.")
    if offline_packing_specs is not None and not enable_offline_packing:
        raise ValueError("enable_offline_packing must be True when offline_packing_specs is set.")

    if isinstance(cfg.dataset, declarative):
        cfg.dataset.validate()

    if hasattr(cfg.dataset, "pad_to_max_length"):
        requires_fixed_seq_len = (
            getattr(cfg.model, "pipeline_model_parallel_size", 1) > 1
            or getattr(cfg.model, "expert_model_parallel_size", 1) > 1
        )
        cfg.dataset.pad_to_max_length = cfg.dataset.pad_to_max_length or requires_fixed_seq_len

    cp_size = getattr(cfg.model, "context_parallel_size", 1)
    eval_cp_size = None  # cfg.dist.eval_context_parallel_size; no dist section here
    cp_sizes = {cp_size, eval_cp_size} if eval_cp_size is not None else {cp_size}
    tp_size = getattr(cfg.model, "tensor_model_parallel_size", 1)
    has_sp = getattr(cfg.model, "sequence_parallel", False)
    cp_multiples = [2 * size if size > 1 else 1 for size in cp_sizes]
    sp_multiples = [size * tp_size if has_sp and tp_size > 1 else 1 for size in cp_sizes]
    collate_padding_multiple = math.lcm(*cp_multiples, *sp_multiples)
    if isinstance(cfg.dataset, declarative) and cfg.dataset.seq_length % collate_padding_multiple != 0:
        raise ValueError(
            f"{type(cfg.dataset).__name__}.seq_length must be divisible by the CP/SP collate padding multiple "
            f"({collate_padding_multiple})."
        )

    transformer_config = getattr(cfg.model, "transformer", cfg.model)
    if enable_in_batch_packing:
        transformer_config._enable_in_batch_packing = True
        if hasattr(cfg.dataset, "in_batch_packing_pad_to_multiple_of"):
            cfg.dataset.in_batch_packing_pad_to_multiple_of = collate_padding_multiple
    elif isinstance(cfg.dataset, declarative):
        cfg.dataset.pad_to_multiple_of = math.lcm(cfg.dataset.pad_to_multiple_of, collate_padding_multiple)

    bridge.transformer_config._enable_safe_hybridep_dispatch(transformer_config, uses_thd=uses_thd)

    if hasattr(cfg.dataset, "finalize"):
        cfg.dataset.finalize()

    bridge.cuda_graph.validate_cuda_graph_configuration(cfg.model)
    if hasattr(cfg.model, "finalize"):
        cfg.model.finalize()

    if enable_in_batch_packing and cfg.train.micro_batch_size == 1:
        raise ValueError(
            "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True. "
            "In-batch packing concatenates multiple sequences within a microbatch, so at least 2 sequences "
            "are required per micro-batch."
        )


def _packing_validate_hybridep_in_finalize(cfg, bridge, mock_vlm_config_cls):
    """The packing-related part of ``ConfigContainer.validate()`` on the line whose ``TransformerConfig.finalize()``
    calls ``_enable_safe_hybridep_dispatch(self)`` (Megatron-Bridge 0.7.0, main ``067f987``).

    Copied verbatim (``self`` -> ``cfg``) from the installed ``megatron/bridge/training/config.py``:

    * L1269-1274: the packing switches (``enable_energon_packing``: Energon's native packing);
    * L1276-1281: in-batch / offline packing exclusivity;
    * L1313-1317: ``dataset.validate()`` for the declarative VLM configs (L1319-1345, Energon's micro-batch
      and native-packing checks, need an ``EnergonDatasetConfig`` and are left out);
    * L1347-1352: ``pad_to_max_length`` forced for PP>1 or EP>1;
    * L1354-1372: the CP/SP collate padding multiple and the ``seq_length`` divisibility check;
    * L1374-1388: ``transformer_config._enable_in_batch_packing`` (for in-batch or Energon packing) and the
      padding multiples; no ``_enable_safe_hybridep_dispatch`` call here any more;
    * L1390-1391: ``dataset.finalize()`` (ddp/optimizer finalize, L1392-1395, are not packing-related);
    * L1399-1401: ``validate_cuda_graph_configuration`` (real) and ``model.finalize()`` (real, when the model is
      Bridge's TransformerConfig; it applies ``models/transformer_config.py`` L178
      ``_enable_safe_hybridep_dispatch(self)`` and L185-186 ``variable_seq_lengths = True`` for in-batch packing
      with PP>1);
    * L1619-1624: ``micro_batch_size`` must be > 1 with ``enable_in_batch_packing``.

    ``EnergonDatasetConfig`` / ``DirectHFSFTDatasetConfig`` cannot be loaded on the CPU, so the ``isinstance``
    tuples hold the one declarative config that can, ``MockVLMSFTDatasetConfig``, and ``enable_energon_packing``
    (an ``EnergonDatasetConfig`` with ``packing_buffer_size``) is False.
    """
    declarative = (mock_vlm_config_cls,)
    energon = ()  # EnergonDatasetConfig does not load on the CPU
    enable_in_batch_packing = getattr(cfg.dataset, "enable_in_batch_packing", False)
    enable_energon_packing = isinstance(cfg.dataset, energon) and (
        cfg.dataset.packing_buffer_size is not None
    )
    enable_offline_packing = getattr(cfg.dataset, "enable_offline_packing", False)
    offline_packing_specs = getattr(cfg.dataset, "offline_packing_specs", None)

    if enable_offline_packing and enable_in_batch_packing:
        raise ValueError("enable_offline_packing and enable_in_batch_packing are mutually exclusive.")
    if enable_offline_packing and offline_packing_specs is None:
        raise ValueError("offline_packing_specs must be set when enable_offline_packing=True.")
    if offline_packing_specs is not None and not enable_offline_packing:
        raise ValueError("enable_offline_packing must be True when offline_packing_specs is set.")

    if isinstance(cfg.dataset, declarative):
        cfg.dataset.validate()

    if hasattr(cfg.dataset, "pad_to_max_length"):
        requires_fixed_seq_len = (
            getattr(cfg.model, "pipeline_model_parallel_size", 1) > 1
            or getattr(cfg.model, "expert_model_parallel_size", 1) > 1
        )
        cfg.dataset.pad_to_max_length = cfg.dataset.pad_to_max_length or requires_fixed_seq_len

    cp_size = getattr(cfg.model, "context_parallel_size", 1)
    eval_cp_size = None  # cfg.dist.eval_context_parallel_size; no dist section here
    cp_sizes = {cp_size, eval_cp_size} if eval_cp_size is not None else {cp_size}
    tp_size = getattr(cfg.model, "tensor_model_parallel_size", 1)
    has_sp = getattr(cfg.model, "sequence_parallel", False)
    cp_multiples = [2 * size if size > 1 else 1 for size in cp_sizes]
    sp_multiples = [size * tp_size if has_sp and tp_size > 1 else 1 for size in cp_sizes]
    collate_padding_multiple = math.lcm(*cp_multiples, *sp_multiples)
    if isinstance(cfg.dataset, declarative) and cfg.dataset.seq_length % collate_padding_multiple != 0:
        raise ValueError(
            f"{type(cfg.dataset).__name__}.seq_length must be divisible by the CP/SP collate padding multiple "
            f"({collate_padding_multiple})."
        )

    if enable_in_batch_packing or enable_energon_packing:
        transformer_config = getattr(cfg.model, "transformer", cfg.model)
        transformer_config._enable_in_batch_packing = True
        if hasattr(cfg.dataset, "in_batch_packing_pad_to_multiple_of"):
            cfg.dataset.in_batch_packing_pad_to_multiple_of = collate_padding_multiple
    elif isinstance(cfg.dataset, declarative):
        cfg.dataset.pad_to_multiple_of = math.lcm(
            cfg.dataset.pad_to_multiple_of,
            collate_padding_multiple,
        )

    if hasattr(cfg.dataset, "finalize"):
        cfg.dataset.finalize()

    bridge.cuda_graph.validate_cuda_graph_configuration(cfg.model)
    if hasattr(cfg.model, "finalize"):
        cfg.model.finalize()

    if enable_in_batch_packing and cfg.train.micro_batch_size == 1:
        raise ValueError(
            "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True. "
            "In-batch packing concatenates multiple sequences within a microbatch, so at least 2 sequences "
            "are required per micro-batch."
        )


def _normalized(text: str) -> str:
    return " ".join(text.split())


# Snippets both lines' files hold (normalised whitespace), then each line's own, keyed by
# upstream_line().hybridep_dispatch_takes_uses_thd (True: Megatron-Bridge 0.6.2; False: 0.7.0, main 067f987).
COPIED_LINES = {
    "training/config.py": [
        'enable_in_batch_packing = getattr(self.dataset, "enable_in_batch_packing", False)',
        'raise ValueError("enable_offline_packing and enable_in_batch_packing are mutually exclusive.")',
        "self.dataset.pad_to_max_length = self.dataset.pad_to_max_length or requires_fixed_seq_len",
        'getattr(self.model, "pipeline_model_parallel_size", 1) > 1 '
        'or getattr(self.model, "expert_model_parallel_size", 1) > 1',
        "collate_padding_multiple = math.lcm(*cp_multiples, *sp_multiples)",
        'transformer_config = getattr(self.model, "transformer", self.model)',
        "self.dataset.in_batch_packing_pad_to_multiple_of = collate_padding_multiple",
        "validate_cuda_graph_configuration(self.model) if hasattr(self.model, \"finalize\"): self.model.finalize()",
        "if enable_in_batch_packing and self.train.micro_batch_size == 1:",
    ],
    "models/transformer_config.py": [
        'if getattr(self, "_enable_in_batch_packing", False) and self.pipeline_model_parallel_size > 1: '
        "self.variable_seq_lengths = True",
        '"moe_hybridep_pad_uneven_dispatch_inputs", "moe_hybridep_pad_variable_tokens",',
    ],
    "data/datasets/direct_sft.py": [
        '"enable_in_batch_packing": enable_in_batch_packing and not defer_in_batch_packing_to_step,',
    ],
    "models/qwen_vl/qwen3_vl_step.py": [
        "if not skip_getting_attention_mask_from_dataset: required_device_keys.add(\"attention_mask\")",
    ],
    "training/comm_overlap.py": [
        "comm_overlap_cfg.overlap_moe_expert_parallel_comm = False",
        "if user_value is not None: setattr(comm_overlap_cfg, field.name, user_value)",
        "comm_overlap_cfg = self._get_model_comm_overlap_cfgs(model_config, ddp_config) "
        "self._apply_cfgs(comm_overlap_cfg, model_config)",
    ],
}
COPIED_LINES_BY_LINE = {
    True: {  # validate() pads HybridEP for THD configs
        "training/config.py": [
            "uses_thd = enable_offline_packing or enable_in_batch_packing",
            "if enable_in_batch_packing: transformer_config._enable_in_batch_packing = True",
            "_enable_safe_hybridep_dispatch(transformer_config, uses_thd=uses_thd)",
        ],
        "models/transformer_config.py": [
            "def _enable_safe_hybridep_dispatch(config: MCoreTransformerConfig, *, uses_thd: bool) -> None:",
        ],
    },
    False: {  # finalize() pads HybridEP for every config; Energon's native packing also sets the hook
        "training/config.py": [
            'enable_energon_packing = isinstance(self.dataset, EnergonDatasetConfig) and ( '
            'self.dataset.packing_buffer_size is not None )',
            "if enable_in_batch_packing or enable_energon_packing: "
            'transformer_config = getattr(self.model, "transformer", self.model) '
            "transformer_config._enable_in_batch_packing = True",
        ],
        "models/transformer_config.py": [
            "def _enable_safe_hybridep_dispatch(config: MCoreTransformerConfig) -> None:",
            "_set_moe_expert_tensor_parallel_default(self) _enable_safe_hybridep_dispatch(self) "
            "MCoreTransformerConfig.__post_init__(self)",
        ],
    },
}


@needs_bridge
def test_copied_upstream_lines_are_current():
    """The lines copied above (and the rules configure mirrors) are in the installed line's files, and the
    other line's own lines are not (so the seam decides the copy that is installed)."""
    root = bridge_root()
    line = upstream_line().hybridep_dispatch_takes_uses_thd
    for relative, snippets in [*COPIED_LINES.items(), *COPIED_LINES_BY_LINE[line].items()]:
        text = _normalized((root / relative).read_text())
        for snippet in snippets:
            assert _normalized(snippet) in text, f"{relative} no longer contains: {snippet}"
    for relative, snippets in COPIED_LINES_BY_LINE[not line].items():
        text = _normalized((root / relative).read_text())
        for snippet in snippets:
            assert _normalized(snippet) not in text, f"{relative} holds the other line's: {snippet}"
    # validate() calls the HybridEP padding itself on one line only.
    config_text = (root / "training/config.py").read_text()
    assert ("_enable_safe_hybridep_dispatch(" in config_text) is line


# The file:line references configure.py and docs/configure.md cite (Megatron-Bridge paths, and one Megatron-Core
# path through "../core"), per line: name -> {hybridep_dispatch_takes_uses_thd: (file, line, snippet)}. The
# True column is what docs/configure.md cites; docs/compatibility.md lists both.
_CITED = [
    ("qwen3vl_graph_assert", "models/qwen_vl/modelling_qwen3_vl/model.py", 388, 434,
     "assert not self.language_model.config.variable_seq_lengths", None),
    ("qwen3vl_graph_check", "models/qwen_vl/modelling_qwen3_vl/model.py", 384, 430,
     '"cuda_graph_impl", "none") != "none"', None),
    ("qwen3vl_graph_call", "models/qwen_vl/modelling_qwen3_vl/model.py", 373, 418,
     "self._expose_language_model_for_cuda_graph_helper()", None),
    ("validate_packing_hook_if", "training/config.py", 1236, 1376,
     "if enable_in_batch_packing:", "if enable_in_batch_packing or enable_energon_packing:"),
    ("validate_packing_hook", "training/config.py", 1237, 1378,
     "transformer_config._enable_in_batch_packing = True", None),
    ("finalize_hook_if", "models/transformer_config.py", 188, 185,
     "_enable_in_batch_packing\", False) and self.pipeline_model_parallel_size", None),
    ("finalize_hook", "models/transformer_config.py", 189, 186, "self.variable_seq_lengths = True", None),
    ("seq_length_assert", "training/config.py", 1505, 1644, "assert self.model.seq_length == data_seq_length", None),
    ("offline_exclusive", "training/config.py", 1156, 1277,
     "enable_offline_packing and enable_in_batch_packing are mutually exclusive.", None),
    ("fixed_seq_len", "training/config.py", 1207, 1348, "requires_fixed_seq_len = (", None),
    ("micro_batch_one", "training/config.py", 1482, 1621,
     "micro_batch_size should be greater than 1 when using enable_in_batch_packing=True.", None),
    ("comm_overlap_if", "training/config.py", 1883, 2027, "if cfg.comm_overlap is not None:", None),
    ("comm_overlap_setup", "training/config.py", 1885, 2029, "cfg.comm_overlap.setup(cfg.model, cfg.optimizer, cfg.ddp)",
     None),
    ("defer", "data/datasets/direct_sft.py", 91, 91, "enable_in_batch_packing and not defer_in_batch_packing_to_step",
     None),
    ("allgather_variable", "../core/transformer/transformer_config.py", 2648, 2740,
     "variable sequence length, please use alltoall dispatcher", None),
]
CITED_LINES = {name: {True: (relative, line_a, snippet_a), False: (relative, line_b, snippet_b or snippet_a)}
               for name, relative, line_a, line_b, snippet_a, snippet_b in _CITED}
# Where the HybridEP padding is called from differs by file as well as by line.
CITED_LINES["hybridep_padding_call"] = {
    True: ("training/config.py", 1249, "_enable_safe_hybridep_dispatch(transformer_config, uses_thd=uses_thd)"),
    False: ("models/transformer_config.py", 178, "_enable_safe_hybridep_dispatch(self)"),
}


@needs_bridge
@pytest.mark.parametrize("cited", list(CITED_LINES))
def test_cited_upstream_lines_are_current(cited):
    relative, line, snippet = CITED_LINES[cited][upstream_line().hybridep_dispatch_takes_uses_thd]
    text = (bridge_root() / relative).read_text().splitlines()[line - 1]
    assert snippet in text, f"{relative}:{line} is now: {text.strip()}"


# ---------------------------------------------------------------------------------------------
# layout argument
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_every_layout_the_step_runs_is_one_configure_sets_up(layout):
    # Each name of the step's layout registry is accepted and resolves to itself (the registry is one list:
    # tests/test_layouts.py::test_layout_names_are_one_list_everywhere).
    cfg = make_cfg()
    configure(cfg, layout)
    assert configured_layout(cfg) == layout


@pytest.mark.parametrize("layout", ["THD", "static", "", None, 3, ("thd",)])
def test_bad_layout_is_refused_and_cfg_untouched(layout):
    cfg = make_cfg()
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"^layout: "):
        configure(cfg, layout)
    assert snapshot(cfg) == before


def test_bad_cuda_graphs_argument():
    with pytest.raises(ValueError, match="cuda_graphs"):
        configure(make_cfg(), "thd", cuda_graphs="yes")


def test_missing_sections():
    with pytest.raises(ValueError, match="cfg.dataset"):
        configure(SimpleNamespace(model=SimpleNamespace(), train=SimpleNamespace()))


# ---------------------------------------------------------------------------------------------
# the dataset flags
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_sets_the_dataset_flags_and_returns_the_same_object(layout):
    cfg = make_cfg()
    out = configure(cfg, layout)
    assert out is cfg
    ds = cfg.dataset
    assert ds.enable_in_batch_packing is True
    assert ds.pack_sequences_in_batch is True
    assert ds.defer_in_batch_packing_to_step is True
    assert settings_of(ds).layout == layout
    assert ds.skip_getting_attention_mask_from_dataset is False
    assert configured_layout(cfg) == layout


def test_default_layout_is_thd():
    cfg = configure(make_cfg())
    assert settings_of(cfg.dataset).layout == "thd"


def test_without_configure_the_step_does_not_pack():
    """Control for the test above: the step's own layout rule falls back to the padded layout."""
    assert configured_layout(make_cfg(model=dict(variable_seq_lengths=False))) == "bshd"


@pytest.mark.parametrize("given", ["pack_sequences_in_batch", "enable_in_batch_packing"])
def test_either_packing_name_alone_sets_both(given):
    cfg = make_cfg(dataset={given: True})
    configure(cfg)
    assert cfg.dataset.pack_sequences_in_batch is True and cfg.dataset.enable_in_batch_packing is True


@pytest.mark.parametrize("pack, enable", [(True, False), (False, True)])
def test_both_packing_names_set_differently_is_refused(pack, enable):
    """The name set to False is refused as an explicit setting the layout
    contradicts (one rule for every flag, with force=True as the way out), not by a message of its own."""
    cfg = make_cfg(dataset=dict(pack_sequences_in_batch=pack, enable_in_batch_packing=enable))
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg)
    message = str(info.value)
    off = "pack_sequences_in_batch" if not pack else "enable_in_batch_packing"
    assert f"dataset.{off}=False was set explicitly" in message
    assert "enable_in_batch_packing" in message and "pack_sequences_in_batch" in message
    assert "force=True" in message
    assert snapshot(cfg) == before


def test_explicit_packing_off_is_refused_and_force_overwrites_it(caplog):
    cfg = make_cfg(dataset=dict(enable_in_batch_packing=False))
    with pytest.raises(ValueError, match=r"dataset.enable_in_batch_packing=False was set explicitly, but .*"
                       r"layout 'thd'.*set it to True.*force=True"):
        configure(cfg)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, force=True)
    assert cfg.dataset.enable_in_batch_packing is True
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "explicit dataset.enable_in_batch_packing=False with True" in warnings[0]


def test_pack_alias_skipped_where_the_object_refuses_new_attributes():
    @dataclasses.dataclass(slots=True)
    class SlottedDataset:
        enable_in_batch_packing: bool = False
        defer_in_batch_packing_to_step: bool = False
        skip_getting_attention_mask_from_dataset: bool = True
        packing_layout: str = "thd"
        seq_length: int = 4096
        bridge_thd: typing.Any = None  # where configure stores its settings record

    cfg = SimpleNamespace(dataset=SlottedDataset(), model=SimpleNamespace(), train=SimpleNamespace(micro_batch_size=2))
    configure(cfg, "thd_static")
    assert not hasattr(cfg.dataset, "pack_sequences_in_batch")
    assert cfg.dataset.enable_in_batch_packing and cfg.dataset.defer_in_batch_packing_to_step
    assert settings_of(cfg.dataset).layout == "thd_static"


def test_required_flag_that_cannot_be_set_is_an_error():
    @dataclasses.dataclass(frozen=True)
    class FrozenDataset:
        enable_in_batch_packing: bool = False
        seq_length: int = 4096

    # A frozen dataset cannot take the settings record either: refused before anything is written.
    cfg = SimpleNamespace(dataset=FrozenDataset(), model=SimpleNamespace(), train=SimpleNamespace())
    with pytest.raises(ValueError, match=r"cfg.dataset: a FrozenDataset takes no new attribute, so configure cannot "
                       r"store its settings record dataset.bridge_thd"):
        configure(cfg)
    assert cfg.dataset.enable_in_batch_packing is False

    class ReadOnlyFlag:  # takes the record, but the required flag is a read-only property
        seq_length = 4096

        @property
        def enable_in_batch_packing(self):
            return False

    cfg = SimpleNamespace(dataset=ReadOnlyFlag(), model=SimpleNamespace(), train=SimpleNamespace())
    with pytest.raises(ValueError, match=r"dataset.enable_in_batch_packing: cannot be set on ReadOnlyFlag"):
        configure(cfg, force=True)  # force: a property has no default, so its value counts as set explicitly


def test_explicit_defer_false_is_refused():
    cfg = make_cfg(dataset=dict(enable_in_batch_packing=True, defer_in_batch_packing_to_step=False))
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"defer_in_batch_packing_to_step=False.*set it to True") as info:
        configure(cfg)
    assert "rejects packed batches" in str(info.value)
    assert snapshot(cfg) == before
    configure(cfg, force=True)
    assert cfg.dataset.defer_in_batch_packing_to_step is True


def test_explicit_skip_attention_mask_is_refused_and_forced(caplog):
    cfg = make_cfg(dataset=dict(skip_getting_attention_mask_from_dataset=True))
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd_static")
    message = str(info.value)
    assert "dataset.skip_getting_attention_mask_from_dataset=True was set explicitly" in message
    assert "2D attention mask" in message and "set it to False" in message and "force=True" in message
    assert snapshot(cfg) == before
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd_static", force=True)
    assert cfg.dataset.skip_getting_attention_mask_from_dataset is False
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING]
    assert "force=True overwrites the explicit dataset.skip_getting_attention_mask_from_dataset=True" in (
        records[1].getMessage()
    )


def test_explicit_packing_layout_differing_from_the_argument_is_refused():
    # The record a first configure call stored.
    cfg = configure(make_cfg(), "thd")
    with pytest.raises(ValueError, match=r"dataset.bridge_thd.layout='thd' was set explicitly, but configure was "
                       r"called with layout='bshd'.*or call configure with that layout.*force=True"):
        configure(cfg, "bshd")
    assert settings_of(configure(cfg, "bshd", force=True).dataset).layout == "bshd"
    # A hand-set packing_layout (settings.HAND_SET_ATTRIBUTES): refused the same way; force moves it into the record.
    cfg = make_cfg(dataset=dict(packing_layout="thd"))
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"dataset.packing_layout='thd' was set explicitly, but configure was called "
                       r"with layout='bshd'.*or call configure with that layout.*force=True"):
        configure(cfg, "bshd")
    assert snapshot(cfg) == before
    configure(cfg, "bshd", force=True)
    assert settings_of(cfg.dataset).layout == "bshd" and cfg.dataset.packing_layout is None


def test_values_equal_to_what_the_layout_needs_are_not_overrides(caplog):
    cfg = make_cfg(
        dataset=dict(enable_in_batch_packing=True, pack_sequences_in_batch=True, defer_in_batch_packing_to_step=True,
                     packing_layout="thd", skip_getting_attention_mask_from_dataset=False, pad_to_max_length=True),
        model=dict(pipeline_model_parallel_size=2, variable_seq_lengths=True),
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd")
    # Nothing but the move of the hand-set layout into the record (settings.md: configure clears the attribute).
    assert (f"changed: dataset.{SETTINGS_ATTRIBUTE}: unset -> {PackingSettings(layout='thd')!r}; "
            "dataset.packing_layout: 'thd' -> None") in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The same values held as the record: nothing at all changes.
    cfg.dataset.packing_layout = None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd")
    assert "changed: nothing" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_several_explicit_overrides_are_listed_together_and_force_warns_once_each(caplog):
    cfg = make_cfg(
        dataset=dict(enable_in_batch_packing=False, skip_getting_attention_mask_from_dataset=True,
                     pad_to_max_length=False),
        model=dict(pipeline_model_parallel_size=2, variable_seq_lengths=False),
    )
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd")
    message = str(info.value)
    for setting in ("dataset.enable_in_batch_packing=False", "dataset.skip_getting_attention_mask_from_dataset=True",
                    "dataset.pad_to_max_length=False", "model.variable_seq_lengths=False"):
        assert f"{setting} was set explicitly" in message
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd", force=True)
    assert cfg.model.variable_seq_lengths is True and cfg.dataset.pad_to_max_length is True
    assert len([r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]) == 4


def test_force_lifts_only_explicit_overrides():
    cfg = make_cfg(dataset=dict(seq_length=2048, enable_offline_packing=True))
    with pytest.raises(ValueError) as info:
        configure(cfg, force=True)
    assert "dataset.enable_offline_packing" in str(info.value) and "dataset.seq_length=2048" in str(info.value)


@pytest.mark.parametrize("force", [None, 1, "yes"])
def test_bad_force_argument(force):
    with pytest.raises(ValueError, match="^force: "):
        configure(make_cfg(), force=force)


@pytest.mark.parametrize("value", [4096, None, False])
def test_the_old_keyword_dynamic_cp_names_its_new_name(value):
    """configure's argument for a CP size per sample is cp_per_sample; the old keyword is refused naming it, before
    anything is read or written."""
    cfg = make_cfg()
    before = snapshot(cfg)
    with pytest.raises(TypeError) as refused:
        configure(cfg, "thd", dynamic_cp=value)
    message = str(refused.value)
    assert "dynamic_cp was renamed cp_per_sample" in message and "pass cp_per_sample=" in message
    assert "max_tokens_per_rank as an int" in message
    assert snapshot(cfg) == before and not hasattr(cfg.dataset, SETTINGS_ATTRIBUTE)
    # Any other unknown keyword is Python's own TypeError; the new name is accepted.
    with pytest.raises(TypeError, match="unexpected keyword argument 'dynamic_cps'"):
        configure(cfg, "thd", dynamic_cps=4096)
    configure(cfg, "thd", cp_per_sample=False)
    assert settings_of(cfg.dataset).cp_per_sample is None


def test_defer_true_given_is_kept():
    cfg = make_cfg(dataset=dict(defer_in_batch_packing_to_step=True))
    configure(cfg)
    assert cfg.dataset.defer_in_batch_packing_to_step is True


def test_is_explicit():
    @dataclasses.dataclass
    class D:
        flag: bool = False
        required: int = dataclasses.field(default_factory=int)

    assert not is_explicit(D(), "flag")
    assert is_explicit(D(flag=True), "flag")
    assert is_explicit(D(), "required")  # no plain default: cannot tell, counts as set
    assert not is_explicit(D(), "absent")
    assert is_explicit(SimpleNamespace(flag=False), "flag")

    class OwnInit:
        """Like Bridge's GPTDatasetConfig: the flag is a constructor parameter, not a dataclass field."""

        def __init__(self, skip_getting_attention_mask_from_dataset: bool = True):
            self.skip_getting_attention_mask_from_dataset = skip_getting_attention_mask_from_dataset

    assert not is_explicit(OwnInit(), "skip_getting_attention_mask_from_dataset")
    assert is_explicit(OwnInit(False), "skip_getting_attention_mask_from_dataset")

    class ClassDefault:
        flag = False

    instance = ClassDefault()
    assert not is_explicit(instance, "flag")
    instance.flag = True
    assert is_explicit(instance, "flag")

    class Inherited(ClassDefault):  # a class default is found on a base class too
        @property
        def computed(self):  # a property is no default: counts as set
            return False

    assert not is_explicit(Inherited(), "flag") and is_explicit(Inherited(), "computed")
    assert explicit_value(D(flag=True), "flag") is True and explicit_value(D(), "flag") is MISSING


def test_what_a_config_holds_is_reconciled_in_settings():
    """settings.merged_settings / replaced_settings / storage_problems: the record configure stores from its arguments,
    the stored record and the hand-set attributes, the explicit values it replaces, a dataset that cannot hold it."""
    from megatron.bridge_thd.settings import (
        CPPerSample, GlobalBatchPacking, merged_settings, replaced_settings, storage_problems,
    )

    hand_set = SimpleNamespace(packing_layout="bshd", overlong_samples="drop")
    record = merged_settings(hand_set, {"layout": "thd", "cp_per_sample": None})
    assert (record.layout, record.overlong_samples) == ("thd", "drop")  # given, then hand-set, then the default
    assert [(r.name, r.old, r.new) for r in replaced_settings(hand_set, record)] == [("packing_layout", "bshd", "thd")]
    stored = SimpleNamespace(bridge_thd=PackingSettings(layout="bshd", overlong_samples="refuse"),
                             overlong_samples="drop")
    record = merged_settings(stored, {"layout": "thd_static"})  # the stored record wins over hand-set attributes
    assert (record.layout, record.overlong_samples) == ("thd_static", "refuse")
    assert [r.name for r in replaced_settings(stored, record)] == ["bridge_thd.layout", "overlong_samples"]
    assert merged_settings(SimpleNamespace(), {"cp_per_sample": CPPerSample(64)}).global_batch_packing == \
        GlobalBatchPacking()  # a CP size per sample brings global-batch packing's default
    with pytest.raises(ValueError, match=r"the record takes dataset.overlong_samples='cut' from the hand-set"):
        merged_settings(SimpleNamespace(overlong_samples="cut"), {"layout": "thd"})

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        seq_length: int = 4096

    class Slots:
        __slots__ = ("seq_length",)

    class SlotsWithRecord:
        __slots__ = ("seq_length", SETTINGS_ATTRIBUTE)

    assert storage_problems(SimpleNamespace()) == [] and storage_problems(SlotsWithRecord()) == []
    for dataset in (Frozen(), Slots()):
        assert "takes no new attribute, so configure cannot store" in storage_problems(dataset)[0]


@pytest.mark.parametrize(
    "offline",
    [
        dict(enable_offline_packing=True),
        dict(offline_packing_specs=SimpleNamespace(packed_sequence_size=4096)),
        dict(packed_sequence_specs=SimpleNamespace(packed_sequence_size=4096)),
    ],
    ids=lambda d: next(iter(d)),
)
def test_offline_packing_is_refused(offline):
    cfg = make_cfg(dataset=offline)
    before = snapshot(cfg)
    name = next(iter(offline))
    with pytest.raises(ValueError, match=rf"dataset\.{name}: set .*mutually exclusive.*enable_offline_packing=False"):
        configure(cfg)
    assert snapshot(cfg) == before


def test_offline_packing_off_is_fine():
    cfg = make_cfg(dataset=dict(enable_offline_packing=False, offline_packing_specs=None))
    configure(cfg)
    assert cfg.dataset.enable_in_batch_packing


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_energons_own_packing_is_refused_naming_the_setting(layout):
    """Energon's packing (``EnergonDatasetConfig.packing_buffer_size``) hands the step rows it packed already;
    Megatron-Bridge's own validation refuses it with ``defer_in_batch_packing_to_step``, which configure sets."""
    cfg = make_cfg(dataset=dict(packing_buffer_size=16))
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"dataset\.packing_buffer_size: set \(16\), which turns on Energon's own "
                                         r"packing.*Set dataset\.packing_buffer_size=None"):
        configure(cfg, layout)
    assert snapshot(cfg) == before
    configure(make_cfg(dataset=dict(packing_buffer_size=None)), layout)  # off: nothing to refuse


# ---------------------------------------------------------------------------------------------
# micro_batch_size
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_micro_batch_size_one_runs_the_layout_without_bridges_flag(layout, caplog):
    """One sample per micro-batch: Megatron-Bridge's flag stays off (its validate() refuses it there), the step's
    own switch turns the layout on, and the log says what the layout gives one sample."""
    cfg = make_bridge_like_cfg(train=dict(micro_batch_size=1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, layout)
    assert cfg.dataset.enable_in_batch_packing is False
    assert cfg.dataset.pack_sequences_in_batch is True and cfg.dataset.defer_in_batch_packing_to_step is True
    assert settings_of(cfg.dataset).layout == layout and configured_layout(cfg) == layout
    assert f"train.micro_batch_size=1: dataset.enable_in_batch_packing stays False" in caplog.text
    assert configure_flags.ONE_SAMPLE[layout] in caplog.text
    # Control: the same config at micro-batch size 2 turns Megatron-Bridge's flag on.
    assert configure(make_bridge_like_cfg(train=dict(micro_batch_size=2)), layout).dataset.enable_in_batch_packing


def test_micro_batch_size_one_refuses_an_explicit_bridge_flag_and_force_turns_it_off(caplog):
    cfg = make_cfg(dataset=dict(enable_in_batch_packing=True), train=dict(micro_batch_size=1))
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd")
    message = str(info.value)
    assert "dataset.enable_in_batch_packing=True was set explicitly" in message
    assert "train.micro_batch_size=1" in message and "refuses enable_in_batch_packing=True" in message
    assert "set it to False" in message and "raise train.micro_batch_size to 2 or more" in message
    assert snapshot(cfg) == before
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd", force=True)
    assert cfg.dataset.enable_in_batch_packing is False and configured_layout(cfg) == "thd"


def test_micro_batch_size_one_needs_the_steps_switch_where_the_layout_packs():
    @dataclasses.dataclass(slots=True)
    class SlottedDataset:
        enable_in_batch_packing: bool = False
        defer_in_batch_packing_to_step: bool = False
        skip_getting_attention_mask_from_dataset: bool = True
        packing_layout: str = "thd"
        seq_length: int = 4096
        bridge_thd: typing.Any = None  # where configure stores its settings record

    for layout in ("thd", "thd_static"):
        cfg = SimpleNamespace(dataset=SlottedDataset(), model=SimpleNamespace(), train=SimpleNamespace(micro_batch_size=1))
        with pytest.raises(ValueError, match=r"dataset.pack_sequences_in_batch: cannot be set on SlottedDataset"):
            configure(cfg, layout)
    # "bshd" is what the step runs without a switch: nothing to set.
    cfg = SimpleNamespace(dataset=SlottedDataset(), model=SimpleNamespace(), train=SimpleNamespace(micro_batch_size=1))
    assert configured_layout(configure(cfg, "bshd")) == "bshd"


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_micro_batch_size_one_with_pp_keeps_fixed_shapes_for_the_static_layouts(layout, caplog):
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2), train=dict(micro_batch_size=1))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, layout)
    assert getattr(cfg.model, "variable_seq_lengths", False) is (layout == "thd")
    assert configured_layout(cfg) == layout
    assert ("exchange fixed (seq_length, 1, hidden) buffers" in caplog.text) is (layout != "thd")


def test_micro_batch_size_one_with_pp_and_graphs_refuses_only_thd():
    """Without Megatron-Bridge's flag nothing turns variable_seq_lengths on for the static layouts, so
    Qwen3VLModel's CUDA-graph assert does not fire; "thd" needs it, and is refused naming the way out."""
    graphs = dict(pipeline_model_parallel_size=2, cuda_graph_impl="transformer_engine", cuda_graph_modules=["mlp"])
    configure(make_cfg(model=graphs, train=dict(micro_batch_size=1)), "bshd")
    configure(make_cfg(model=graphs, train=dict(micro_batch_size=1)), "thd_static")
    with pytest.raises(ValueError, match=r"layout 'thd' with PP>1 needs variable_seq_lengths=True.*use "
                       r"layout='thd_static' or 'bshd'"):
        configure(make_cfg(model=graphs, train=dict(micro_batch_size=1)), "thd")
    # Control: at micro-batch size 2 Megatron-Bridge's flag makes every layout variable-length under PP.
    with pytest.raises(ValueError, match=r"whatever the layout \('bshd' included\)"):
        configure(make_cfg(model=graphs, train=dict(micro_batch_size=2)), "bshd")


@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_micro_batch_size_one_with_global_batch_packing_is_accepted_and_says_what_it_does(layout):
    from megatron.bridge_thd.settings import GlobalBatchPacking
    from megatron.bridge_thd.rules.run import configure_problems
    from megatron.bridge_thd.rules.setup import read_setup

    cfg = make_cfg(dataset={"dataloader_type": "cyclic"}, train=dict(micro_batch_size=1))
    setup = read_setup(cfg, layout, global_batch=GlobalBatchPacking())
    assert configure_problems(setup) == []
    changes, notes = configure_module._plan(setup, configure_module._sections(cfg, setup))
    assert any("one sample" in note and "only balances the DP ranks" in note for note in notes)
    planned = {c.name: c.value for c in changes}
    assert planned["enable_in_batch_packing"] is False and planned["pack_sequences_in_batch"] is True
    assert planned["calculate_per_token_loss"] is True
    # Control: at micro-batch size 2 no such note.
    cfg.train.micro_batch_size = 2
    setup = read_setup(cfg, layout, global_batch=GlobalBatchPacking())
    assert not any("one sample" in note for note in configure_module._plan(
        setup, configure_module._sections(cfg, setup))[1])


@pytest.mark.parametrize("micro_batch_size", [2, 8])
def test_micro_batch_size_above_one_is_fine(micro_batch_size):
    assert configure(make_cfg(train=dict(micro_batch_size=micro_batch_size))).dataset.enable_in_batch_packing


def test_no_train_section_skips_the_check():
    cfg = make_cfg()
    del cfg.train
    assert configure(cfg).dataset.enable_in_batch_packing


# ---------------------------------------------------------------------------------------------
# pipeline / expert parallelism
# ---------------------------------------------------------------------------------------------


def test_thd_with_pp_sets_variable_seq_lengths():
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2))
    configure(cfg, "thd")
    assert cfg.model.variable_seq_lengths is True
    assert configured_layout(cfg) == "thd"


def test_thd_with_pp_refuses_an_explicit_variable_seq_lengths_false(caplog):
    """An explicit setting the layout contradicts is refused, never overwritten (force=True is the way out)."""
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2, variable_seq_lengths=False))
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"model.variable_seq_lengths=False was set explicitly, but layout 'thd' with "
                       r"pipeline_model_parallel_size=2 .*exchange shapes.*layout='thd_static'.*force=True"):
        configure(cfg, "thd")
    assert snapshot(cfg) == before
    configure(cfg, "thd_static")  # the static layout does not need it: accepted, kept False
    assert cfg.model.variable_seq_lengths is False
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        configure(cfg, "thd", force=True)
    assert cfg.model.variable_seq_lengths is True and configured_layout(cfg) == "thd"
    assert "model.variable_seq_lengths=False with True" in caplog.text


def test_thd_with_pp_without_configure_falls_back_to_static():
    """Control: the step would switch to 'thd_static' without variable_seq_lengths."""
    cfg = make_cfg(
        dataset=dict(enable_in_batch_packing=True, packing_layout="thd"),
        model=dict(pipeline_model_parallel_size=2, variable_seq_lengths=False),
    )
    assert configured_layout(cfg) == "thd_static"


def test_thd_without_pp_leaves_variable_seq_lengths():
    cfg = make_cfg(model=dict(variable_seq_lengths=False))
    configure(cfg, "thd")
    assert cfg.model.variable_seq_lengths is False


@pytest.mark.parametrize("layout", ["thd_static", "bshd"])
def test_static_layouts_with_pp_keep_variable_seq_lengths_false(layout):
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=4, variable_seq_lengths=False))
    configure(cfg, layout)
    assert cfg.model.variable_seq_lengths is False
    assert configured_layout(cfg) == layout


@pytest.mark.parametrize(
    "pp, ep, expected", [(1, 1, False), (2, 1, True), (1, 4, True), (2, 2, True)]
)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_pad_to_max_length_follows_bridge_rule(layout, pp, ep, expected):
    model = dict(pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    if ep > 1:
        model.update(num_moe_experts=8, moe_token_dispatcher_type="alltoall")
    cfg = make_bridge_like_cfg(model=model)  # pad_to_max_length at its dataclass default, False
    configure(cfg, layout)
    assert cfg.dataset.pad_to_max_length is expected


def test_explicit_pad_to_max_length_false_with_pp_is_refused():
    cfg = make_cfg(dataset=dict(pad_to_max_length=False), model=dict(pipeline_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"dataset.pad_to_max_length=False was set explicitly, but Megatron-Bridge's "
                       r"validate\(\) forces it True for PP>1 or EP>1.*force=True"):
        configure(cfg, "bshd")
    assert configure(cfg, "bshd", force=True).dataset.pad_to_max_length is True


def test_pad_to_max_length_not_added_without_the_field():
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2))
    configure(cfg, "bshd")
    assert not hasattr(cfg.dataset, "pad_to_max_length")


def test_moe_allgather_with_ep_refuses_thd():
    model = dict(num_moe_experts=8, moe_token_dispatcher_type="allgather", expert_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"'thd' with MoE moe_token_dispatcher_type='allgather'.*thd_static"):
        configure(make_cfg(model=model), "thd")
    for layout in ("thd_static", "bshd"):
        configure(make_cfg(model=model), layout)
    configure(make_cfg(model={**model, "expert_model_parallel_size": 1}), "thd")
    configure(make_cfg(model={**model, "moe_token_dispatcher_type": "alltoall"}), "thd")


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_moe_allgather_with_pp_and_variable_lengths_is_refused(bridge, layout):
    """Under PP>1 in-batch packing turns variable_seq_lengths on ('thd', or Megatron-Bridge's flag at micro-batch >
    1), which Megatron-Core refuses for the allgather dispatcher once the config is finalized again; a dense model
    is moved off the dispatcher it never uses instead, and the twice-finalized config then holds."""
    def cfg(model):
        return SimpleNamespace(dataset=SimpleNamespace(seq_length=4096), model=model,
                               train=SimpleNamespace(micro_batch_size=4, global_batch_size=32))

    moe = bridge_transformer_config(bridge, pipeline_model_parallel_size=2, num_moe_experts=4)
    with pytest.raises(ValueError, match=rf"layout: '{layout}' with MoE moe_token_dispatcher_type='allgather' and "
                                         r"pipeline_model_parallel_size=2.*'alltoall'"):
        configure(cfg(moe), layout)
    dense = bridge_transformer_config(bridge, pipeline_model_parallel_size=2)
    configure(cfg(dense), layout)
    assert dense.moe_token_dispatcher_type == "alltoall"
    dense._enable_in_batch_packing = True  # what validate() sets
    dense.finalize()
    dense.finalize()
    assert dense.variable_seq_lengths is True


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, expected",
    [
        (dict(cuda_graph_impl="none"), False),
        (dict(cuda_graph_impl=None), False),
        (dict(), False),
        (dict(cuda_graph_impl="transformer_engine"), True),
        (dict(cuda_graph_impl="full_iteration"), True),
        (dict(cuda_graph_impl="local"), True),
        (dict(enable_cuda_graph=True), True),
        (dict(external_cuda_graph=True), True),
        (dict(cuda_graph_scope="attn,full_iteration"), True),  # legacy, no cuda_graph_impl
        (dict(cuda_graph_impl="none", cuda_graph_scope="full_iteration"), False),
    ],
)
def test_cuda_graphs_enabled(model, expected):
    assert cuda_graphs_enabled(SimpleNamespace(**model)) is expected


@pytest.mark.parametrize(
    "model, argument",
    [
        (dict(cuda_graph_impl="transformer_engine"), None),
        (dict(enable_cuda_graph=True), None),
        (dict(external_cuda_graph=True), None),
        (dict(), True),
    ],
)
def test_thd_with_cuda_graphs_is_refused(model, argument):
    cfg = make_cfg(model=model)
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"layout: 'thd'.*CUDA graphs.*layout='thd_static'"):
        configure(cfg, "thd", cuda_graphs=argument)
    assert snapshot(cfg) == before


@pytest.mark.parametrize("layout", ["thd_static", "bshd"])
def test_static_layouts_with_cuda_graphs_fix_the_collate_width(layout):
    # thd_static takes Megatron-Core's local graphs only (docs/cuda-graphs.md); bshd any.
    impl = "local" if layout == "thd_static" else "transformer_engine"
    cfg = make_bridge_like_cfg(model=dict(cuda_graph_impl=impl))
    configure(cfg, layout)
    assert cfg.dataset.pad_to_max_length is True
    assert settings_of(cfg.dataset).layout == layout


def test_cuda_graphs_argument_false_contradicting_model():
    cfg = make_cfg(model=dict(cuda_graph_impl="full_iteration"))
    with pytest.raises(ValueError, match=r"cuda_graphs: False was passed, but the model config enables CUDA graphs"):
        configure(cfg, "thd_static", cuda_graphs=False)


def test_cuda_graphs_argument_false_without_graphs_is_fine():
    cfg = configure(make_cfg(dataset=dict(pad_to_max_length=False)), "thd", cuda_graphs=False)
    assert cfg.dataset.pad_to_max_length is False


@pytest.mark.parametrize("layout", ["thd_static", "bshd"])
def test_cuda_graphs_with_variable_seq_lengths_is_a_contradiction(layout):
    cfg = make_cfg(model=dict(cuda_graph_impl="transformer_engine", variable_seq_lengths=True))
    with pytest.raises(ValueError, match=r"model.variable_seq_lengths=True with CUDA graphs.*variable_seq_lengths=False"):
        configure(cfg, layout)


def test_variable_seq_lengths_set_by_bridges_hook_is_not_the_users_contradiction():
    """After Bridge's validate() (hook + finalize) a static layout with PP>1 has variable_seq_lengths=True.

    With CUDA graphs in the model config and PP>1 the config is refused (Qwen3VLModel asserts at build, see
    the tests below); this note is for graphs declared only through ``cuda_graphs=True``, which Qwen3VLModel
    does not see."""
    cfg = make_cfg(
        model=dict(pipeline_model_parallel_size=2, variable_seq_lengths=True, _enable_in_batch_packing=True)
    )
    configure(cfg, "thd_static", cuda_graphs=True)
    assert cfg.model.variable_seq_lengths is True


# ---------------------------------------------------------------------------------------------
# HybridEP
# ---------------------------------------------------------------------------------------------


def test_uses_hybridep():
    assert uses_hybridep(SimpleNamespace(**HYBRIDEP))
    assert not uses_hybridep(SimpleNamespace(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"))
    assert not uses_hybridep(SimpleNamespace(moe_token_dispatcher_type="alltoall", moe_flex_dispatcher_backend="hybridep"))
    assert not uses_hybridep(SimpleNamespace())


@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_hybridep_with_cuda_graphs_requires_bshd(layout):
    cfg = make_cfg(model=dict(HYBRIDEP, expert_model_parallel_size=4, cuda_graph_impl="transformer_engine"))
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=r"HybridEP.*CUDA graphs.*Use layout='bshd'") as info:
        configure(cfg, layout)
    # 'thd' gets one message that points at 'bshd', not the generic "use 'thd_static'".
    assert "layout='thd_static'" not in str(info.value)
    assert snapshot(cfg) == before


def test_hybridep_with_cuda_graphs_and_bshd_is_fine():
    cfg = make_bridge_like_cfg(model=dict(HYBRIDEP, expert_model_parallel_size=4, cuda_graph_impl="transformer_engine"))
    configure(cfg, "bshd")
    assert cfg.dataset.pad_to_max_length is True
    assert not getattr(cfg.model, "moe_hybridep_pad_uneven_dispatch_inputs", False)


@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_hybridep_without_cuda_graphs_allows_thd_and_pads(layout, caplog):
    cfg = make_cfg(model=dict(HYBRIDEP, expert_model_parallel_size=4))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, layout)
    assert cfg.model.moe_hybridep_pad_uneven_dispatch_inputs is True
    assert settings_of(cfg.dataset).layout == layout
    assert "HybridEP without CUDA graphs" in caplog.text


# ---------------------------------------------------------------------------------------------
# refusals of what would fail later
# ---------------------------------------------------------------------------------------------

PIPELINE_GRAPHS = {
    "te": (dict(cuda_graph_impl="transformer_engine"), "model.cuda_graph_impl='transformer_engine'"),
    "full_iteration": (dict(cuda_graph_impl="full_iteration"), "model.cuda_graph_impl='full_iteration'"),
    "local": (dict(cuda_graph_impl="local"), "model.cuda_graph_impl='local'"),
    "enable_cuda_graph": (dict(enable_cuda_graph=True), "model.enable_cuda_graph=True"),
    "external_cuda_graph": (dict(external_cuda_graph=True), "model.external_cuda_graph=True"),
}


@pytest.mark.parametrize("graphs", list(PIPELINE_GRAPHS))
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_cuda_graphs_with_pipeline_parallelism_are_refused_for_every_layout(layout, graphs):
    settings, named = PIPELINE_GRAPHS[graphs]
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2, **settings))
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, layout)
    message = str(info.value)
    assert message.startswith(f"configure: the config contradicts megatron.bridge_thd's step:\n- {named}")
    assert "with model.pipeline_model_parallel_size=2: " in message
    assert "Qwen3VLModel asserts at build that CUDA graphs run without model.variable_seq_lengths" in message
    assert "set variable_seq_lengths=True" in message
    assert "model.cuda_graph_impl='none'" in message and "model.pipeline_model_parallel_size=1" in message
    # One problem: not the PP=1 advice ("use layout='thd_static'" / "'bshd'"), which would fail the same way.
    assert message.count("\n- ") == 1
    assert snapshot(cfg) == before


@pytest.mark.parametrize("layout", ["thd_static", "bshd"])
def test_cuda_graphs_without_pipeline_parallelism_are_accepted(layout):
    impl = "local" if layout == "thd_static" else "transformer_engine"  # docs/cuda-graphs.md
    cfg = make_cfg(model=dict(cuda_graph_impl=impl))
    assert configure(cfg, layout) is cfg
    # Accepted means configured for that layout, with the user's graph setting kept as it was.
    assert configured_layout(cfg) == layout
    assert cfg.model.cuda_graph_impl == impl


def test_cuda_graphs_declared_by_argument_only_are_not_the_pipeline_refusal():
    """Qwen3VLModel reads cuda_graph_impl from the model config; graphs it does not see do not trip it."""
    configure(make_cfg(model=dict(pipeline_model_parallel_size=2)), "thd_static", cuda_graphs=True)


@pytest.mark.parametrize(
    "graph_settings",
    [
        dict(),
        dict(cuda_graph_impl="transformer_engine"),
        dict(cuda_graph_impl="full_iteration"),
        dict(cuda_graph_impl="local", cuda_graph_modules=["full_iteration"]),
        dict(enable_cuda_graph=True),
        dict(external_cuda_graph=True),
        dict(cuda_graph_scope="full_iteration"),  # deprecated scope with cuda_graph_impl "none": no graphs
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "none",
)
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("micro_batch_size", [4, 1])
def test_pipeline_graph_refusal_is_exactly_qwen3_vl_models_assert(
    bridge, mock_vlm_config_cls, qwen3_vl_build_check, pp, graph_settings, micro_batch_size
):
    """configure refuses a config exactly when Megatron-Bridge 0.6.2 would fail to build Qwen3VLModel.

    The Bridge side: the flags configure sets (in-batch packing on, deferred to the step), the
    packing part of ``validate()`` with the real ``finalize()``, then the real build-time check.
    """

    def config():
        model = bridge_transformer_config(bridge, pipeline_model_parallel_size=pp, **graph_settings)
        dataset = mock_vlm_config_cls(seq_length=4096, hf_processor_path="Qwen/Qwen3-VL-8B-Instruct")
        return SimpleNamespace(dataset=dataset, model=model, train=SimpleNamespace(micro_batch_size=micro_batch_size))

    upstream = config()
    # Megatron-Bridge's flag as configure sets it: on, except for a micro-batch of one sample.
    upstream.dataset.enable_in_batch_packing = micro_batch_size > 1
    upstream.dataset.defer_in_batch_packing_to_step = True
    bridge_packing_validate(upstream, bridge, mock_vlm_config_cls)
    try:
        qwen3_vl_build_check(upstream.model)
        builds = True
    except AssertionError as error:
        assert "variable_seq_lengths=False" in str(error)
        builds = False

    try:
        # bshd: the pipeline refusal holds for every layout, and bshd meets no other graph rule.
        configure(config(), "bshd")
        accepted = True
    except ValueError as error:
        assert "CUDA graphs run without model.variable_seq_lengths" in str(error)
        assert "set model.cuda_graph_impl='none'" in str(error)
        accepted = False
    assert accepted is builds
    assert builds is (pp == 1 or not graph_settings or "cuda_graph_scope" in graph_settings or micro_batch_size == 1)


MOE_EP = dict(num_moe_experts=8, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2)


@pytest.mark.parametrize("where", ["model", "comm_overlap"])
@pytest.mark.parametrize("layout", ["thd", "thd_static"])
def test_moe_overlap_with_a_thd_layout_is_refused(layout, where):
    cfg = make_cfg(model=MOE_EP)
    if where == "model":
        cfg.model.overlap_moe_expert_parallel_comm = True
    else:
        cfg.comm_overlap = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, layout)
    message = str(info.value)
    assert f"{where}.overlap_moe_expert_parallel_comm=True with layout={layout!r}" in message
    assert "return_schedule_plan" in message
    assert f"set {where}.overlap_moe_expert_parallel_comm=False, or use layout='bshd'" in message
    assert snapshot(cfg) == before


def test_moe_overlap_with_bshd_is_accepted():
    cfg = make_cfg(model=dict(MOE_EP, overlap_moe_expert_parallel_comm=True))
    configure(cfg, "bshd")
    assert configured_layout(cfg) == "bshd" and cfg.model.overlap_moe_expert_parallel_comm is True
    cfg = make_cfg(model=MOE_EP)  # off: fine with THD
    configure(cfg, "thd")
    assert configured_layout(cfg) == "thd" and not getattr(cfg.model, "overlap_moe_expert_parallel_comm", False)


class _ModelWithoutPlan:
    """Like Megatron-Bridge 0.6.2's Qwen3VLModel: no build_schedule_plan."""


class _ModelWithPlan:
    def build_schedule_plan(self, *args, **kwargs):
        raise NotImplementedError


class _ProviderBuildingNoPlan(SimpleNamespace):
    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> _ModelWithoutPlan:
        raise NotImplementedError


class _ProviderBuildingPlan(SimpleNamespace):
    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> "_ModelWithPlan":
        raise NotImplementedError


def test_moe_overlap_with_bshd_is_refused_when_the_provider_builds_a_model_without_schedule_plans():
    """Found on Megatron-Bridge's real Qwen3-VL 30B-A3B recipe (tests/bridge/test_recipes.py): its
    provider builds Qwen3VLModel, which has no build_schedule_plan, so 'bshd' with the overlap failed
    at the first step and neither configure nor validate() refused it."""
    cfg = make_cfg()
    cfg.model = _ProviderBuildingNoPlan(**{**vars(cfg.model), **MOE_EP})
    cfg.comm_overlap = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, "bshd")
    message = str(info.value)
    assert "comm_overlap.overlap_moe_expert_parallel_comm=True with layout='bshd'" in message
    assert "_ModelWithoutPlan" in message and "has none" in message
    assert "set comm_overlap.overlap_moe_expert_parallel_comm=False" in message
    assert snapshot(cfg) == before


def test_moe_overlap_with_bshd_is_accepted_when_the_provider_builds_a_model_with_schedule_plans():
    """The annotation may be a string (``from __future__ import annotations``): resolved in the module."""
    cfg = make_cfg()
    cfg.model = _ProviderBuildingPlan(**{**vars(cfg.model), **MOE_EP, "overlap_moe_expert_parallel_comm": True})
    configure(cfg, "bshd")
    assert configured_layout(cfg) == "bshd" and cfg.model.overlap_moe_expert_parallel_comm is True


def test_moe_overlap_in_the_model_that_comm_overlap_turns_off_is_accepted():
    """A ``comm_overlap`` section whose value is None writes False into the model config
    (``CommOverlapConfig.setup``), so the model's True never reaches the schedule."""
    cfg = make_cfg(model=dict(MOE_EP, overlap_moe_expert_parallel_comm=True))
    cfg.comm_overlap = SimpleNamespace(overlap_moe_expert_parallel_comm=None)
    configure(cfg, "thd")
    assert configured_layout(cfg) == "thd"
    assert cfg.comm_overlap.overlap_moe_expert_parallel_comm is None  # left for CommOverlapConfig to resolve


def test_seq_length_mismatch_is_refused_naming_both_values():
    cfg = make_cfg(dataset=dict(seq_length=2048), model=dict(seq_length=4096))
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd")
    message = str(info.value)
    assert "dataset.seq_length=2048 and model.seq_length=4096 differ" in message
    assert "Set dataset.seq_length and model.seq_length to the same value" in message
    assert snapshot(cfg) == before


def test_seq_length_read_from_the_transformer_config_and_missing_ones_skip_the_check():
    cfg = make_cfg()
    cfg.model = SimpleNamespace(transformer=SimpleNamespace(pipeline_model_parallel_size=1, seq_length=1024))
    with pytest.raises(ValueError, match=r"dataset.seq_length=4096 and model.seq_length=1024 differ"):
        configure(cfg)
    del cfg.dataset.seq_length
    configure(cfg)


# ---------------------------------------------------------------------------------------------
# errors, logging, idempotence
# ---------------------------------------------------------------------------------------------


def test_all_problems_are_reported_together():
    cfg = make_cfg(
        dataset=dict(defer_in_batch_packing_to_step=False, enable_offline_packing=True),
        model=dict(cuda_graph_impl="transformer_engine"),
        train=dict(micro_batch_size=1),
    )
    cfg.dataset.seq_length = 2048
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd")
    message = str(info.value)
    for name in ("dataset.enable_offline_packing", "defer_in_batch_packing_to_step", "dataset.seq_length=2048",
                 "layout: 'thd'"):
        assert name in message


def test_changes_are_logged_at_info(caplog):
    cfg = make_cfg(model=dict(pipeline_model_parallel_size=2))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, "thd")
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    text = records[0].getMessage()
    for change in (
        "dataset.enable_in_batch_packing: unset -> True",
        "dataset.defer_in_batch_packing_to_step: unset -> True",
        f"dataset.bridge_thd: unset -> {PackingSettings(layout='thd')!r}",
        "dataset.skip_getting_attention_mask_from_dataset: unset -> False",
        "model.variable_seq_lengths: unset -> True",
    ):
        assert change in text


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_second_call_changes_nothing(layout, caplog):
    cfg = make_bridge_like_cfg(model=dict(pipeline_model_parallel_size=2))
    configure(cfg, layout)
    after_first = snapshot(cfg)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        configure(cfg, layout)
    assert snapshot(cfg) == after_first
    assert "changed: nothing" in caplog.text


# ---------------------------------------------------------------------------------------------
# against Megatron-Bridge 0.6.2's own code
# ---------------------------------------------------------------------------------------------


def test_bridge_finalize_rejects_variable_seq_lengths_on_dense_models(bridge):
    """Why configure uses Bridge's hook: Megatron-Core's post-init refuses variable_seq_lengths
    with the default 'allgather' dispatcher, dense models included."""
    model = bridge_transformer_config(bridge, pipeline_model_parallel_size=2, variable_seq_lengths=True)
    with pytest.raises(ValueError, match="allgather does not support variable sequence length"):
        model.finalize()


def test_thd_with_pp_on_bridge_dense_config_finalizes(bridge):
    model = bridge_transformer_config(bridge, pipeline_model_parallel_size=2)
    cfg = SimpleNamespace(dataset=SimpleNamespace(seq_length=4096), model=model, train=SimpleNamespace(micro_batch_size=2))
    configure(cfg, "thd")
    assert model.variable_seq_lengths is False  # not set directly: finalize would refuse it
    assert model._enable_in_batch_packing is True
    model.finalize()
    assert model.variable_seq_lengths is True
    assert configured_layout(cfg) == "thd"


def test_thd_with_pp_on_bridge_moe_alltoall_config_sets_it_directly(bridge):
    model = bridge_transformer_config(
        bridge,
        pipeline_model_parallel_size=2,
        num_moe_experts=4,
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=2,
    )
    cfg = SimpleNamespace(dataset=SimpleNamespace(seq_length=4096), model=model, train=SimpleNamespace(micro_batch_size=2))
    configure(cfg, "thd")
    assert model.variable_seq_lengths is True
    model.finalize()
    assert model.variable_seq_lengths is True


def test_thd_static_with_pp_leaves_variable_seq_lengths_to_bridge(bridge, mock_vlm_config_cls):
    """configure leaves variable_seq_lengths off for 'thd_static' with PP>1 (the row length is fixed).

    That Bridge 0.6.2's validate() turns it on anyway (it sets the hook whenever enable_in_batch_packing
    is on) is asserted on the real validate() of the real recipes in tests/bridge/test_recipes.py
    (test_recipe_passes_validate, every recipe at pp2 with 'thd_static'); that the step still resolves
    'thd_static' then, by test_configured_config_passes_bridges_packing_validation."""
    model = bridge_transformer_config(bridge, pipeline_model_parallel_size=2)
    cfg = SimpleNamespace(
        dataset=mock_vlm_config_cls(seq_length=4096, hf_processor_path="Qwen/Qwen3-VL-8B-Instruct"),
        model=model,
        train=SimpleNamespace(micro_batch_size=2),
    )
    configure(cfg, "thd_static")
    assert model.variable_seq_lengths is False
    assert configured_layout(cfg) == "thd_static"


def test_hybridep_padding_matches_bridges_own(bridge):
    """configure sets exactly what _enable_safe_hybridep_dispatch sets, and Bridge then changes nothing."""
    settings = dict(HYBRIDEP, num_moe_experts=4, expert_model_parallel_size=2)
    ours = bridge_transformer_config(bridge, **settings)
    theirs = bridge_transformer_config(bridge, **settings)
    configure(SimpleNamespace(dataset=SimpleNamespace(seq_length=4096), model=ours, train=SimpleNamespace(micro_batch_size=2)), "thd")
    safe_hybridep_dispatch(bridge, theirs)
    assert theirs.moe_hybridep_pad_uneven_dispatch_inputs is True
    assert ours.moe_hybridep_pad_uneven_dispatch_inputs is True
    before = dict(vars(ours))
    safe_hybridep_dispatch(bridge, ours)
    assert dict(vars(ours)) == before


@pytest.mark.parametrize(
    "graph_settings",
    [
        dict(),
        dict(cuda_graph_impl="transformer_engine"),
        dict(cuda_graph_impl="full_iteration"),
        dict(cuda_graph_impl="local"),
        dict(enable_cuda_graph=True),
        dict(external_cuda_graph=True),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()) or "none",
)
def test_cuda_graph_detection_matches_bridges(bridge, graph_settings):
    """Bridge pads HybridEP inputs exactly when it sees no CUDA graphs; our detection agrees."""
    model = bridge_transformer_config(bridge, **HYBRIDEP, expert_model_parallel_size=2, **graph_settings)
    safe_hybridep_dispatch(bridge, model)
    assert cuda_graphs_enabled(model) is (not model.moe_hybridep_pad_uneven_dispatch_inputs)


def test_defer_makes_bridges_collate_leave_the_batch_unpacked(bridge):
    """Megatron-Bridge 0.6.2's DirectSFTDataset hands the collate enable_in_batch_packing only
    without defer; a packed batch (cu_seqlens) is then rejected by our step."""
    seen = []

    def collate(batch, processor, sequence_length=None, pad_to_max_length=False, enable_in_batch_packing=False):
        seen.append(enable_in_batch_packing)
        return {}

    def build(dataset_cfg):
        ds = bridge.direct_sft.DirectSFTDataset(
            [{"conversation": []}],
            4,
            None,
            collate_impl=collate,
            sequence_length=64,
            pad_to_max_length=getattr(dataset_cfg, "pad_to_max_length", False),
            enable_in_batch_packing=dataset_cfg.enable_in_batch_packing,
            defer_in_batch_packing_to_step=getattr(dataset_cfg, "defer_in_batch_packing_to_step", False),
        )
        ds.collate_fn([ds[0]])

    build(make_cfg(dataset=dict(enable_in_batch_packing=True)).dataset)  # not configured: the collate packs
    cfg = configure(make_cfg(dataset=dict(enable_in_batch_packing=True)))
    build(cfg.dataset)
    assert seen == [True, False]
    packed_batch = {"tokens": torch.ones(1, 9, dtype=torch.long), "cu_seqlens": torch.tensor([0, 5, 9], dtype=torch.int32)}
    with pytest.raises(ValueError, match="packs the micro-batch itself"):
        qwen3_vl_step.prepare_micro_batch(packed_batch, torch.nn.Linear(1, 1), SimpleNamespace(cfg=cfg), None)


def test_mock_vlm_defaults_are_overwritten_not_refused(mock_vlm_config_cls):
    """On Bridge's own dataclass the defaults (defer=False, enable=False) are not explicit."""
    dataset = mock_vlm_config_cls(seq_length=4096, hf_processor_path="Qwen/Qwen3-VL-8B-Instruct")
    assert dataset.defer_in_batch_packing_to_step is False and dataset.skip_getting_attention_mask_from_dataset is True
    cfg = SimpleNamespace(dataset=dataset, model=SimpleNamespace(), train=SimpleNamespace(micro_batch_size=2))
    configure(cfg, "thd")
    assert dataset.enable_in_batch_packing and dataset.defer_in_batch_packing_to_step
    assert dataset.skip_getting_attention_mask_from_dataset is False
    assert dataset.pack_sequences_in_batch is True and settings_of(dataset).layout == "thd"
    explicit = mock_vlm_config_cls(
        seq_length=4096, hf_processor_path="Qwen/Qwen3-VL-8B-Instruct", enable_in_batch_packing=True
    )
    explicit.defer_in_batch_packing_to_step = False  # still the default value: cannot be told apart
    configure(SimpleNamespace(dataset=explicit, model=SimpleNamespace(), train=SimpleNamespace(micro_batch_size=2)))
    assert explicit.defer_in_batch_packing_to_step is True


MODELS = {
    "dense": dict(),
    "moe_alltoall": dict(num_moe_experts=4, moe_token_dispatcher_type="alltoall", expert_model_parallel_size=2),
    "hybridep": dict(HYBRIDEP, num_moe_experts=4, expert_model_parallel_size=2),
}
GRAPHS = {"no_graphs": dict(), "te_graphs": dict(cuda_graph_impl="transformer_engine")}


@pytest.mark.parametrize("micro_batch_size", [4, 1])
@pytest.mark.parametrize("graphs", list(GRAPHS))
@pytest.mark.parametrize("model_kind", list(MODELS))
@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_configured_config_passes_bridges_packing_validation(
    bridge, mock_vlm_config_cls, qwen3_vl_build_check, layout, pp, model_kind, graphs, micro_batch_size
):
    """configure, then the packing part of the installed Bridge's validate (incl. the real model finalize, and the
    second finalize the 0.7 line's setup runs).

    Combinations configure refuses (CUDA graphs with PP>1, any layout; Transformer Engine graphs with a
    THD layout, docs/cuda-graphs.md) are checked to be refused; for the rest, Bridge's
    checks pass, Qwen3VLModel's build-time check on the language model config passes, the step
    resolves the requested layout, Bridge changes none of the flags configure set, and a second
    configure call after Bridge's validate changes nothing.
    """
    model = bridge_transformer_config(bridge, pipeline_model_parallel_size=pp, **MODELS[model_kind], **GRAPHS[graphs])
    dataset = mock_vlm_config_cls(seq_length=4096, hf_processor_path="Qwen/Qwen3-VL-8B-Instruct")
    cfg = SimpleNamespace(dataset=dataset, model=model, train=SimpleNamespace(micro_batch_size=micro_batch_size))
    with_graphs = graphs == "te_graphs"
    # With one sample per micro-batch only "thd" turns variable_seq_lengths on under PP (configure's hook).
    variable_lengths = pp > 1 and (micro_batch_size > 1 or layout == "thd")
    if with_graphs and variable_lengths:  # Qwen3VLModel would assert at build
        with pytest.raises(ValueError, match=r"cuda_graph_impl='transformer_engine' with "
                           r"model.pipeline_model_parallel_size=2: .*without model.variable_seq_lengths.*"
                           r"set model.cuda_graph_impl='none'.*model.pipeline_model_parallel_size=1"):
            configure(cfg, layout)
        return
    if with_graphs and (layout != "bshd"):  # thd; thd_static with Transformer Engine graphs; HybridEP
        with pytest.raises(ValueError, match="CUDA graphs|Transformer-Engine graph path"):
            configure(cfg, layout)
        return
    if micro_batch_size == 1:
        # Control: Megatron-Bridge's flag, which configure leaves off here, is what its validate() refuses.
        refused = copy.deepcopy(cfg)
        refused.dataset.enable_in_batch_packing = True
        with pytest.raises(ValueError, match="micro_batch_size should be greater than 1"):
            bridge_packing_validate(refused, bridge, mock_vlm_config_cls)
    configure(cfg, layout)
    flags = {
        name: getattr(dataset, name)
        for name in (
            "enable_in_batch_packing",
            "defer_in_batch_packing_to_step",
            "skip_getting_attention_mask_from_dataset",
            "pad_to_max_length",
            SETTINGS_ATTRIBUTE,
            "pack_sequences_in_batch",
        )
    }
    hybridep_padding = model.moe_hybridep_pad_uneven_dispatch_inputs
    bridge_packing_validate(cfg, bridge, mock_vlm_config_cls)
    # Megatron-Bridge's setup finalizes the model config once more before it builds the model (training/setup.py,
    # on the 0.7 line): Megatron-Core's checks then see variable_seq_lengths as validate() left it.
    model.finalize()
    assert {name: getattr(dataset, name) for name in flags} == flags
    assert model.moe_hybridep_pad_uneven_dispatch_inputs == hybridep_padding
    assert hybridep_padding is (model_kind == "hybridep" and not with_graphs)
    assert model.variable_seq_lengths is variable_lengths
    qwen3_vl_build_check(model)
    assert configured_layout(cfg) == layout
    after_validate = (copy.deepcopy(vars(dataset)), dict(vars(model)))
    configure(cfg, layout)
    assert (vars(dataset), dict(vars(model))) == after_validate


def _docs_configure_flags_block():
    """The ``configure-flags`` block of docs/configure.md as it stands, and as rendered from
    ``configure_flags.FLAGS`` now (scripts/readme_figures.py)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import readme_figures
    finally:
        sys.path.remove(str(root / "scripts"))
    path, body = readme_figures.all_blocks()["configure-flags"]
    assert path == root / "docs" / "configure.md"
    return f"<!-- figures:configure-flags -->{body}<!-- /figures:configure-flags -->", readme_figures.render_block(
        "configure-flags", path)


def test_the_flag_table_is_rendered_from_configures_records():
    names = [f"{flag.section}.{flag.name}" for flag in configure_flags.FLAGS]
    assert len(names) == len(set(names)), "a flag listed twice"
    for flag in (
        "dataset.enable_in_batch_packing",
        "dataset.pack_sequences_in_batch",
        "dataset.defer_in_batch_packing_to_step",
        "dataset.bridge_thd",
        "dataset.skip_getting_attention_mask_from_dataset",
        "dataset.pad_to_max_length",
        "model.variable_seq_lengths",
        "model._enable_in_batch_packing",
        "model.moe_token_dispatcher_type",
        "model.moe_hybridep_pad_uneven_dispatch_inputs",
        "model.moe_hybridep_pad_variable_tokens",
        "model.calculate_per_token_loss",
        "ddp.average_in_collective",
        "model.hybrid_context_parallel",
        "model.max_seqlen_per_dp_cp_rank",
        "model.vision_dp_when_cp",
    ):
        assert names.count(flag) == 1, flag
    in_docs, rendered = _docs_configure_flags_block()
    assert in_docs == rendered, "docs/configure.md's flag table is stale: run scripts/readme_figures.py"
    for flag in configure_flags.FLAGS:
        assert "| " + " | ".join(flag.row()) + " |" in in_docs
        assert in_docs.count(f"`{flag.section}.{flag.name}`") == 1, flag.name


@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_every_attribute_configure_sets_is_one_of_its_flags(layout, caplog, monkeypatch):
    """What configure changes (its INFO line lists every change) is a flag of configure_flags.FLAGS, or a hand-set
    attribute the record takes the place of (docs/settings.md): no flag is set outside its record."""
    from megatron.bridge_thd.settings import HAND_SET_ATTRIBUTES

    monkeypatch.setattr(configure_module, "_wrap_loader_builder", lambda: None)
    flags = {f"{flag.section}.{flag.name}" for flag in configure_flags.FLAGS}
    cleared = {f"dataset.{attribute}" for attribute in HAND_SET_ATTRIBUTES.values()}
    calls = [
        (make_cfg(dataset={"packing_layout": layout, "dataloader_type": "cyclic"}, train=dict(micro_batch_size=1),
                  model=dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2, **HYBRIDEP)),
         dict(global_batch_packing=layout != "bshd")),  # global-batch packing fills packed rows only
        (make_bridge_like_cfg(model=dict(pipeline_model_parallel_size=2)), {}),
    ]
    if layout == "thd":  # a CP size per sample runs the "thd" layout only
        calls.append((make_cfg(dataset={"dataloader_type": "cyclic"}, model={"vision_dp_when_cp": False}),
                      dict(cp_per_sample=4096)))
        calls[-1][0].ddp = SimpleNamespace(average_in_collective=True)
    changed = set()
    for cfg, kwargs in calls:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGER):
            configure(cfg, layout, force=True, **kwargs)
        changed |= set(re.findall(r"(?:changed: |; )(\w+\.\w+):", caplog.text))
    assert changed <= flags | cleared, changed - flags - cleared
    assert {"dataset.packing_layout", "dataset.enable_in_batch_packing", "dataset.pad_to_max_length"} <= changed
    assert ("model.calculate_per_token_loss" in changed) is (layout != "bshd")
    assert ("model.vision_dp_when_cp" in changed) is (layout == "thd")


def test_docs_explain_the_refusals_and_hold_the_one_flag_table():
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "configure.md").read_text()
    header = "| Purpose | Megatron-Bridge 0.6.2 |"
    assert header not in configure_module.__doc__, "the flag table's one copy is configure_flags.FLAGS"
    assert docs.count(header) == 1 and header in _docs_configure_flags_block()[0]
    for heading in (
        "### CUDA graphs with pipeline parallelism (every layout, at micro-batch size 1 `\"thd\"` only)",
        "### A micro-batch of one sample",
        "### MoE expert-parallel communication overlap with a THD layout",
        "### `dataset.seq_length` differs from `model.seq_length`",
        "### Explicit settings the layout contradicts",
    ):
        assert heading in docs


# ---------------------------------------------------------------------------------------------
# MoE capacity and seq_aux_loss with a THD layout need the padding hook (docs/moe-routing.md)


@pytest.mark.parametrize("moe_settings,name", [
    (dict(moe_expert_capacity_factor=1.0), "moe_expert_capacity_factor"),
    (dict(moe_router_load_balancing_type="seq_aux_loss"), "seq_aux_loss"),
    (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"]), "seq_aux_loss"),
])
def test_moe_capacity_or_seq_aux_loss_with_thd_need_the_padding_hook(moe_settings, name):
    from megatron.bridge_thd.moe_padding.hook import padding_mask_pre_wrap_hook

    for layout in ("thd", "thd_static"):
        with pytest.raises(ValueError, match=f"{name}.*layout='{layout}'.*padding_mask_pre_wrap_hook"):
            configure(make_cfg(model=dict(num_moe_experts=4, **moe_settings)), layout)
    # With the hook registered (as Megatron-Bridge's provider stores it), or the padded layout: accepted.
    cfg = make_cfg(model=dict(num_moe_experts=4, **moe_settings))
    cfg.model._pre_wrap_hooks = [padding_mask_pre_wrap_hook]
    configure(cfg, "thd")
    configure(make_cfg(model=dict(num_moe_experts=4, **moe_settings)), "bshd")
    # A dense model ignores MoE settings.
    configure(make_cfg(model=dict(moe_settings)), "thd")


# ---------------------------------------------------------------------------------------------
# global-batch packing's static rows (row_buckets)


def _row_bucket_setup(buckets, train=None, **model):
    from megatron.bridge_thd.settings import GlobalBatchPacking
    from megatron.bridge_thd.rules.setup import read_setup

    cfg = make_cfg(dataset={"dataloader_type": "cyclic"}, model=model, train=train)
    return read_setup(cfg, "thd_static", global_batch=GlobalBatchPacking(row_buckets=buckets))


@pytest.mark.parametrize("buckets", [0, -1, True, "4", 2.0])
def test_row_buckets_that_are_not_a_positive_int_are_refused(buckets):
    """The settings record refuses the value when it is made (docs/settings.md), so configure does too, before it
    changes anything."""
    from megatron.bridge_thd.settings import GlobalBatchPacking

    expected = f"\n- global_batch_packing.row_buckets: {buckets!r}; expected None"
    with pytest.raises(ValueError, match=r"^dataset.bridge_thd \(megatron.bridge_thd's settings\):") as info:
        _row_bucket_setup(buckets)
    assert expected in str(info.value)
    cfg = make_cfg(dataset={"dataloader_type": "cyclic"})
    before = snapshot(cfg)
    with pytest.raises(ValueError) as info:
        configure(cfg, "thd_static", global_batch_packing=GlobalBatchPacking(row_buckets=buckets))
    assert expected in str(info.value)
    assert snapshot(cfg) == before


# PP>1 keeps fixed p2p shapes at micro-batch size 1, and for a model config without finalize(): above it, Megatron-
# Bridge's in-batch packing flag makes its finalize() turn variable_seq_lengths on (rules.Setup.variable_lengths_when_run),
# and several rows can run.
@pytest.mark.parametrize("model, train, why", [
    ({"pipeline_model_parallel_size": 2}, {"micro_batch_size": 1}, "fixed-shape buffers"),
    ({"cuda_graph_impl": "local"}, None, "CUDA graphs"),
])
def test_several_rows_where_one_row_shape_can_run_are_refused_and_unset_means_one(model, train, why):
    from megatron.bridge_thd.rules.rows import row_buckets
    from megatron.bridge_thd.rules.run import configure_problems

    problems = configure_problems(_row_bucket_setup(4, train, **model))
    assert [p for p in problems if p.startswith("global_batch_packing.row_buckets: 4 rows") and why in p
            and "set row_buckets=1" in p], problems
    unset = _row_bucket_setup(None, train, **model)
    assert not [p for p in configure_problems(unset) if "row_buckets" in p]
    assert row_buckets(unset) == 1
    assert not [p for p in configure_problems(_row_bucket_setup(1, train, **model)) if "row_buckets" in p]


def test_several_rows_with_pp_are_accepted_where_bridge_makes_the_lengths_variable():
    """Control for the PP case above: at micro-batch size 4, a Megatron-Bridge model config (it has ``finalize()``)
    is built with variable_seq_lengths (its validate() sets the in-batch hook, finalize() turns it on), so several
    rows can run; a config without ``finalize()`` keeps fixed pipeline shapes, so one row."""
    from megatron.bridge_thd.rules.rows import row_buckets
    from megatron.bridge_thd.rules.run import configure_problems

    def finalize():
        return None

    setup = _row_bucket_setup(4, {"micro_batch_size": 4}, pipeline_model_parallel_size=2, finalize=finalize)
    assert setup.variable_lengths_on_build and not setup.fixed_p2p_shapes
    assert not [p for p in configure_problems(setup) if "row_buckets" in p]
    assert row_buckets(_row_bucket_setup(None, {"micro_batch_size": 4}, pipeline_model_parallel_size=2,
                                         finalize=finalize)) == 4
    plain = _row_bucket_setup(4, {"micro_batch_size": 4}, pipeline_model_parallel_size=2)
    assert plain.fixed_p2p_shapes
    assert [p for p in configure_problems(plain) if p.startswith("global_batch_packing.row_buckets: 4 rows")
            and "fixed-shape buffers" in p]


def test_row_buckets_default_to_four_where_several_row_shapes_can_run():
    from megatron.bridge_thd.rules.rows import row_buckets
    from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS

    assert DEFAULT_ROW_BUCKETS == 4
    assert row_buckets(_row_bucket_setup(None)) == 4
    assert row_buckets(_row_bucket_setup(None, pipeline_model_parallel_size=2, variable_seq_lengths=True)) == 4
    assert row_buckets(_row_bucket_setup(7)) == 7


# ---------------------------------------------------------------------------------------------
# a CP size per sample (docs/cp-per-sample.md)


def test_cp_per_sample_sets_megatron_cores_hybrid_cp_and_global_batch_packing(monkeypatch):
    from megatron.bridge_thd.settings import CPPerSample, GlobalBatchPacking

    # The loader builder's wrapping needs Megatron-Bridge whole (tests/bridge/test_cp_per_sample_training.py runs it).
    monkeypatch.setattr(configure_module, "_wrap_loader_builder", lambda: None)
    cfg = make_cfg(dataset={"dataloader_type": "cyclic"})
    configure(cfg, "thd", cp_per_sample=4096)
    record = settings_of(cfg.dataset)
    assert record.cp_per_sample == CPPerSample(4096) and record.global_batch_packing == GlobalBatchPacking()
    model = cfg.model
    assert (model.hybrid_context_parallel, model.max_seqlen_per_dp_cp_rank) == (True, 4096)
    assert not hasattr(model, "vision_dp_when_cp")  # set only where the provider has the field (Qwen3-VL's)
    assert model.calculate_per_token_loss is True
    # Off again: configure sets flags and never clears them, so the model's flag alone is refused, naming it.
    with pytest.raises(ValueError, match="hybrid_context_parallel=True without cp_per_sample"):
        configure(cfg, "thd", cp_per_sample=False)
    model.hybrid_context_parallel = False
    configure(cfg, "thd", cp_per_sample=False)
    assert settings_of(cfg.dataset).cp_per_sample is None


def test_cp_per_sample_refuses_ddp_averaging_in_the_collective_naming_itself():
    """Megatron-Bridge's recipes set ddp.average_in_collective=True, which configure cannot tell from a user's own
    (docs/cp-per-sample.md): refused as an explicit setting, the message saying that cp_per_sample needs per-token loss and
    that turning cp_per_sample off (not global-batch packing, which the user did not ask for) is the other way out."""
    cfg = make_cfg(dataset={"dataloader_type": "cyclic"})
    cfg.ddp = SimpleNamespace(average_in_collective=True)
    before = snapshot(cfg)
    with pytest.raises(ValueError) as refused:
        configure(cfg, "thd", cp_per_sample=4096)
    message = str(refused.value)
    assert "ddp.average_in_collective=True was set explicitly, but cp_per_sample needs per-token loss" in message
    assert "or turn cp_per_sample off" in message and "turn global-batch packing off" not in message
    assert snapshot(cfg) == before and cfg.ddp.average_in_collective is True


@pytest.mark.parametrize("layout, model, match", [
    ("thd_static", {}, "layout='thd_static'; rows run with a CP size each are packed 'thd' rows"),
    ("thd", {"context_parallel_size": 2}, "context_parallel_size=2; a CP size per sample is built on a static CP"),
    ("thd", {"pipeline_model_parallel_size": 2}, "pipeline_model_parallel_size=2"),
    ("thd", {"num_moe_experts": 8, "expert_model_parallel_size": 2}, "expert_model_parallel_size=2; the expert dispatch"),
    ("thd", {"max_seqlen_per_dp_cp_rank": 2048}, "max_seqlen_per_dp_cp_rank=2048 was set explicitly"),
    ("thd", {"vision_dp_when_cp": False}, "vision_dp_when_cp=False was set explicitly"),
])
def test_cp_per_sample_refusals_leave_the_config_unchanged(layout, model, match):
    cfg = make_cfg(dataset={"dataloader_type": "cyclic"}, model=model)
    before = snapshot(cfg)
    with pytest.raises(ValueError, match=re.escape(match)):
        configure(cfg, layout, cp_per_sample=4096)
    assert snapshot(cfg) == before
