"""Opt-in: set a Megatron-Bridge config's packing flags consistently for ``megatron.bridge_thd``'s step.

::

    from megatron.bridge_thd.configure import configure
    from megatron.bridge_thd.qwen3_vl_step import forward_step

    cfg = configure(qwen3_vl_recipe_config(), layout="thd")   # same object, mutated
    finetune(cfg, forward_step_func=forward_step)

``configure(cfg, layout="thd", *, cuda_graphs=None, force=False)`` takes a Megatron-Bridge
``ConfigContainer`` (or any object with ``cfg.dataset``, ``cfg.model`` and ``cfg.train`` shaped
like it), checks the settings that decide how a micro-batch reaches the step, sets the flags
(below), logs what it changed at INFO and returns ``cfg``. Every check runs before anything is
written: a config it refuses is left untouched, and the ``ValueError`` lists each problem with the
settings involved, what is wrong and how to fix it. A value the user set explicitly is never
overwritten silently: when it differs from what the layout needs, ``configure`` refuses; with
``force=True`` it overwrites it and logs one WARNING line per setting. Calling it twice with the
same layout is harmless (the second call changes nothing).

The flags it sets are the records of :data:`FLAG_RULES` (the only copy: the table in
docs/configure.md is rendered from it). The rules, every refusal with the upstream code that
motivates it, how "set explicitly" is told from a dataclass default, and what ``force`` does and
does not lift: docs/configure.md.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, NamedTuple

from megatron.bridge_thd.layouts import LAYOUT_NAMES
from megatron.bridge_thd.layouts import STATIC_LAYOUTS as _STATIC_LAYOUTS
from megatron.bridge_thd.layouts import THD_LAYOUTS as _THD_LAYOUTS

__all__ = [
    "configure",
    "LAYOUTS",
    "STATIC_LAYOUTS",
    "cuda_graphs_enabled",
    "effective_cuda_graph_impl",
    "uses_hybridep",
    "is_explicit",
]

logger = logging.getLogger(__name__)


class FlagRule(NamedTuple):
    """One flag ``configure`` sets: a row of the flag table in ``docs/configure.md``."""

    purpose: str
    name_062: str  # Megatron-Bridge 0.6.2 (Megatron-Core 0.19.2)
    name_main: str  # Megatron-Bridge main (Aug 2026)
    set_to: str  # what configure sets it to


# Markdown cells. ``*``: not a field of Megatron-Bridge's dataset config dataclasses (FLAG_RULES_NOTE).
FLAG_RULES: tuple[FlagRule, ...] = (
    FlagRule("in-batch packing on", "`dataset.enable_in_batch_packing`", "same", "`True`"),
    FlagRule("same switch, design name (alias)", "`dataset.pack_sequences_in_batch` *", "gone",
             "`True` (where the object takes it)"),
    FlagRule("collate leaves packing to the step", "`dataset.defer_in_batch_packing_to_step`", "same", "`True`"),
    FlagRule("layout of the packed row", "`dataset.packing_layout` * (ours)", "(ours)", "`layout`"),
    FlagRule("the dataset's 2D mask reaches the step", "`dataset.skip_getting_attention_mask_from_dataset`", "same",
             "`False`"),
    FlagRule("fixed collate width", "`dataset.pad_to_max_length`", "same (forced for PP>1 or EP>1)",
             "`True` for PP>1 or EP>1 (Bridge's rule, where the field exists) and with CUDA graphs"),
    FlagRule("pipeline p2p exchanges shapes",
             "`model.variable_seq_lengths`, or the hook `model._enable_in_batch_packing`", "same",
             '`True` for `"thd"` with PP>1; not set for the static layouts'),
    FlagRule("HybridEP pads uneven dispatch inputs",
             "`model.moe_hybridep_pad_uneven_dispatch_inputs` (Megatron-Core 0.19.2)",
             "`moe_hybridep_pad_variable_tokens` in Core versions that name it so (Bridge lists both)",
             "`True` for HybridEP without CUDA graphs (what Bridge's validate sets itself)"),
    FlagRule("global-batch packing setting", "`dataset.global_batch_packing` * (ours)", "(ours)",
             "the `global_batch_packing` argument, when given ([batching.md](batching.md))"),
    FlagRule("loss normalised per token over the whole step", "`model.calculate_per_token_loss`", "same",
             "`True` with global-batch packing"),
    FlagRule("DDP sums gradients (required with per-token loss)", "`ddp.average_in_collective`", "same",
             "`False` with global-batch packing"),
)
FLAG_RULES_NOTE = (
    "`*` not a field of Megatron-Bridge's dataset config dataclasses: set as a plain attribute, so it is lost "
    "when the config is written to YAML and read back (re-run `configure` after loading)."
)

# The layout names and their kinds come from the one layout contract.
LAYOUTS, STATIC_LAYOUTS, THD_LAYOUTS = LAYOUT_NAMES, _STATIC_LAYOUTS, _THD_LAYOUTS
# Megatron-Bridge 0.6.2 models/transformer_config.py _HYBRIDEP_PADDING_FIELDS (0.19.2 has the first).
HYBRIDEP_PADDING_FIELDS = ("moe_hybridep_pad_uneven_dispatch_inputs", "moe_hybridep_pad_variable_tokens")
# Offline (pre-packed dataset) settings: 0.6.2 names, then the older ``packed_sequence_specs``.
_OFFLINE_PACKING = ("enable_offline_packing", "offline_packing_specs", "packed_sequence_specs")
_MISSING = object()


def _has_full_iteration(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(
        "full_iteration" in item.split(",")
        if isinstance(item, str)
        else getattr(item, "name", None) == "full_iteration"
        for item in values
    )


def cuda_graphs_enabled(model: Any) -> bool:
    """Whether a model config enables training CUDA graphs.

    The same test as Megatron-Bridge 0.6.2's ``_enable_safe_hybridep_dispatch``
    (``models/transformer_config.py``): ``cuda_graph_impl`` not in ``(None, "none")``,
    ``enable_cuda_graph``, ``external_cuda_graph``, or, on configs without ``cuda_graph_impl``, a
    ``full_iteration`` entry in ``cuda_graph_modules`` / ``cuda_graph_scope``.
    """
    legacy_full_iteration = not hasattr(model, "cuda_graph_impl") and (
        _has_full_iteration(getattr(model, "cuda_graph_modules", None))
        or _has_full_iteration(getattr(model, "cuda_graph_scope", None))
    )
    return bool(
        getattr(model, "cuda_graph_impl", "none") not in (None, "none")
        or getattr(model, "enable_cuda_graph", False)
        or getattr(model, "external_cuda_graph", False)
        or legacy_full_iteration
    )


def effective_cuda_graph_impl(model: Any) -> str:
    """``model.cuda_graph_impl`` as Megatron-Core 0.19.2's ``TransformerConfig.__post_init__`` leaves it.

    The deprecated switches are mapped as that post-init maps them (``enable_cuda_graph`` ->
    ``"local"``, ``external_cuda_graph`` -> ``"transformer_engine"``); ``None`` or a missing
    attribute reads as ``"none"``, as Megatron-Bridge's ``Qwen3VLModel`` reads a missing one.
    """
    impl = getattr(model, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        return impl
    if getattr(model, "enable_cuda_graph", False):
        return "local"
    if getattr(model, "external_cuda_graph", False):
        return "transformer_engine"
    return "none"


def uses_hybridep(model: Any) -> bool:
    """Whether MoE tokens go through the flex dispatcher's HybridEP backend."""
    return (
        getattr(model, "moe_token_dispatcher_type", None) == "flex"
        and getattr(model, "moe_flex_dispatcher_backend", None) == "hybridep"
    )


def _default_value(obj: Any, name: str) -> Any:
    """The value ``obj.name`` holds when nobody set it, or ``_MISSING`` when that cannot be told.

    In this order: the dataclass field's plain default; the default of the class constructor's
    parameter of that name (Bridge's ``GPTDatasetConfig`` takes
    ``skip_getting_attention_mask_from_dataset`` in its own ``__init__``, not as a field); a plain
    class attribute. A field built by ``default_factory`` or a required one has no default here.
    """
    cls = type(obj)
    field = getattr(cls, "__dataclass_fields__", {}).get(name) if dataclasses.is_dataclass(obj) else None
    if field is not None:
        return _MISSING if field.default is dataclasses.MISSING else field.default
    try:
        parameter = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):  # builtins such as SimpleNamespace have no signature
        parameter = None
    if parameter is not None:
        return _MISSING if parameter.default is inspect.Parameter.empty else parameter.default
    default = inspect.getattr_static(cls, name, _MISSING)
    return _MISSING if hasattr(default, "__get__") else default  # a property or method is no default


def is_explicit(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` was set by the user, as far as can be told.

    Present and different from its default (:func:`_default_value`); present without a known
    default (a ``types.SimpleNamespace`` attribute, a required field) counts as explicit. A value
    equal to the default cannot be told from the default and counts as not set.
    """
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        return False
    default = _default_value(obj, name)
    return default is _MISSING or value != default


def _size(model: Any, name: str) -> int:
    return int(getattr(model, name, 1) or 1)


def configure(cfg: Any, layout: str = "thd", *, cuda_graphs: bool | None = None, force: bool = False,
              global_batch_packing: Any = None) -> Any:
    """Set ``cfg``'s packing flags for ``megatron.bridge_thd.qwen3_vl_step.forward_step``.

    Args:
        cfg: a Megatron-Bridge ``ConfigContainer`` or an object shaped like it (``cfg.dataset``,
            ``cfg.model`` (its ``.transformer`` when it has one), ``cfg.train``, optionally
            ``cfg.comm_overlap``).
        layout: ``"thd"``, ``"thd_static"`` or ``"bshd"`` (see ``docs/configure.md``).
        cuda_graphs: ``None`` reads the model config; ``True`` declares CUDA graphs the model
            config does not show; ``False`` asserts none (refused if the model enables them).
        force: overwrite settings the user set explicitly to values the layout cannot use, with a
            WARNING line each, instead of refusing them. It lifts nothing else.
        global_batch_packing: ``None`` / ``False``: Megatron-Bridge's own placement (in-batch
            packing). ``True`` or a :class:`megatron.bridge_thd.batching.bridge.GlobalBatchPacking`:
            place each step's samples across DP ranks and micro-batches (docs/batching.md); stored
            as ``dataset.global_batch_packing``, and Megatron-Bridge's loader builder is wrapped
            once for the process (``batching.bridge.loader_patch``).

    Returns:
        ``cfg`` itself, mutated.

    Raises:
        ValueError: ``layout`` is not a known layout, or the config contradicts the step (every
            problem found is listed; nothing is changed then).
    """
    _check_arguments(layout, cuda_graphs, force)
    settings = _read_settings(cfg, layout, cuda_graphs, _global_batch_setting(global_batch_packing))

    problems, notes = _find_problems(settings)
    changes, change_notes = _plan_changes(settings)
    overrides = _explicit_overrides(changes)
    if not force:
        problems += [override.refusal() for override in overrides]
    if problems:
        raise ValueError("configure: the config contradicts megatron.bridge_thd's step:\n- " + "\n- ".join(problems))

    # ---- everything checked: write ----
    changed = _apply(changes)
    if settings.global_batch is not None:
        from megatron.bridge_thd.batching.bridge import loader_patch
        from megatron.bridge_thd.patches import apply_permanently

        apply_permanently(loader_patch())
    _log(settings, changed, notes + change_notes, overrides)
    return cfg


# ---- step 1: read the settings ----


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What ``configure`` reads from its arguments and ``cfg``, resolved once for the checks and writes."""

    layout: str
    cuda_graphs: bool | None  # the argument as passed
    dataset: Any
    model: Any  # the transformer config
    train: Any
    pp: int
    ep: int
    model_graphs: bool  # the model config enables CUDA graphs
    graphs: bool  # CUDA graphs on, from the model config or the argument
    graph_impl: str  # the model's cuda_graph_impl after Megatron-Core's post-init
    hybridep: bool
    dispatcher: Any
    moe_overlap: str | None  # the setting that turns MoE EP communication overlap on, if any
    seq_lengths: tuple[Any, Any]  # (dataset.seq_length, model.seq_length)
    pre_wrap_hooks: tuple = ()  # the model provider's registered pre-wrap hooks
    built_model: Any = None  # the model class the provider's provide() declares it builds, if it can be told
    global_batch: Any = None  # a batching.bridge.GlobalBatchPacking, or None
    ddp: Any = None  # cfg.ddp, if any

    @property
    def pipeline_graphs(self) -> bool:
        """PP>1 with CUDA graphs in the model config: Qwen3VLModel refuses to build (see the check)."""
        return self.pp > 1 and self.graph_impl != "none"


def _check_arguments(layout: Any, cuda_graphs: Any, force: Any) -> None:
    """Refuse a ``layout``, ``cuda_graphs`` or ``force`` argument that ``configure`` does not know."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs: {cuda_graphs!r}; pass None (read the model config), True or False")
    if not isinstance(force, bool):
        raise ValueError(f"force: {force!r}; pass True or False")


def _moe_overlap_setting(cfg: Any, model: Any) -> str | None:
    """The setting that turns MoE EP communication overlap on as Megatron-Bridge 0.6.2 resolves it, or None.

    With a ``cfg.comm_overlap`` section, ``runtime_config_update`` (``training/config.py``) runs
    ``CommOverlapConfig.setup``, which writes the section's value into the model config, ``False``
    when the user left it ``None`` (``training/comm_overlap.py``, ``_get_model_comm_overlap_cfgs``).
    Without one, the model config's own value stands.
    """
    comm_overlap = getattr(cfg, "comm_overlap", None)
    if comm_overlap is not None:
        value = getattr(comm_overlap, "overlap_moe_expert_parallel_comm", None)
        return "comm_overlap.overlap_moe_expert_parallel_comm" if value else None
    on = getattr(model, "overlap_moe_expert_parallel_comm", False)
    return "model.overlap_moe_expert_parallel_comm" if on else None


def _global_batch_setting(value: Any) -> Any:
    """``global_batch_packing`` as a ``GlobalBatchPacking`` or None; anything else is refused."""
    if value is None or value is False:
        return None
    from megatron.bridge_thd.batching.bridge import GlobalBatchPacking

    if value is True:
        return GlobalBatchPacking()
    if not isinstance(value, GlobalBatchPacking):
        raise ValueError(f"global_batch_packing: {value!r}; pass None, True or a batching.bridge.GlobalBatchPacking")
    return value


def _read_settings(cfg: Any, layout: str, cuda_graphs: bool | None, global_batch: Any = None) -> _Settings:
    """Pick ``cfg``'s sections and the parallel sizes and switches the checks and writes depend on."""
    dataset = getattr(cfg, "dataset", None)
    model_root = getattr(cfg, "model", None)
    if dataset is None or model_root is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    # Bridge's validate reads the model's transformer config this way (GPTModelConfig proxies it).
    model = getattr(model_root, "transformer", model_root)
    model_graphs = cuda_graphs_enabled(model)
    model_seq_length = getattr(model_root, "seq_length", None)
    return _Settings(
        layout=layout,
        cuda_graphs=cuda_graphs,
        dataset=dataset,
        model=model,
        train=getattr(cfg, "train", None),
        pp=_size(model, "pipeline_model_parallel_size"),
        ep=_size(model, "expert_model_parallel_size"),
        model_graphs=model_graphs,
        graphs=model_graphs or bool(cuda_graphs),
        graph_impl=effective_cuda_graph_impl(model),
        hybridep=uses_hybridep(model),
        dispatcher=getattr(model, "moe_token_dispatcher_type", None),
        moe_overlap=_moe_overlap_setting(cfg, model),
        seq_lengths=(
            getattr(dataset, "seq_length", None),
            model_seq_length if model_seq_length is not None else getattr(model, "seq_length", None),
        ),
        pre_wrap_hooks=tuple(getattr(model_root, "_pre_wrap_hooks", None) or ()),
        built_model=_built_model_class(model_root),
        global_batch=global_batch,
        ddp=getattr(cfg, "ddp", None),
    )


def _built_model_class(provider: Any) -> type | None:
    """The class a Megatron-Bridge model provider's ``provide()`` declares it returns, or None.

    Read from the return annotation (resolved in the provider module's namespace when it is a string,
    as under ``from __future__ import annotations``); nothing is imported or built. Megatron-Bridge
    0.6.2's Qwen-VL providers (``models/qwen_vl/qwen3_vl_provider.py``, ``qwen35_vl_provider.py``)
    declare ``-> Qwen3VLModel``.
    """
    provide = getattr(type(provider), "provide", None)
    if provide is None:
        return None
    try:
        annotation = inspect.signature(provide).return_annotation
    except (TypeError, ValueError):
        return None
    if isinstance(annotation, str):
        annotation = getattr(provide, "__globals__", {}).get(annotation.split(".")[-1])
    return annotation if isinstance(annotation, type) else None


# ---- step 2: collect the problems (nothing is written yet) ----


def _find_problems(s: _Settings) -> tuple[list[str], list[str]]:
    """Run every check, in the order the error lists their problems; return (problems, notes)."""
    notes: list[str] = []
    problems = [
        *_cuda_graphs_argument_problems(s),
        *_offline_packing_problems(s.dataset),
        *_micro_batch_size_problems(s.train),
        *_seq_length_problems(s),
        *_cuda_graphs_pipeline_problems(s),
        *_hybridep_problems(s),
        *_cuda_graphs_layout_problems(s),
        *_variable_seq_lengths_problems(s, notes),
        *_moe_allgather_problems(s),
        *_moe_overlap_problems(s),
        *_moe_routing_problems(s),
        *_global_batch_problems(s),
    ]
    return problems, notes


def _global_batch_problems(s: _Settings) -> list[str]:
    """Global-batch packing with a layout, a data loader or a setting it cannot work with."""
    g = s.global_batch
    if g is None:
        return []
    problems = []
    if s.layout not in ("thd", "thd_static"):
        problems.append(
            f"global_batch_packing: layout {s.layout!r} lays out exactly train.micro_batch_size samples per micro-batch, "
            "but global-batch packing gives each micro-batch as many samples as fit its row; use layout 'thd' or "
            "'thd_static'")
    loader = getattr(s.dataset, "dataloader_type", None)
    if loader not in ("single", "cyclic"):
        problems.append(
            f"dataset.dataloader_type: {loader!r}; global-batch packing draws each step from Megatron-Bridge's 'single' "
            "or 'cyclic' sampler ('batch' splits a per-rank global batch into equal micro-batches in the training "
            "step, 'external' has no sampler to draw from); set it to 'cyclic' (or 'single')")
    row = g.row_length
    if row is not None and (isinstance(row, bool) or not isinstance(row, int) or row < 1):
        problems.append(f"global_batch_packing.row_length: {row!r}; expected None (chosen from the data) or an int >= 1")
    if g.cost_model is not None:
        from megatron.bridge_thd.batching.cost import sample_cost

        try:
            sample_cost(g.cost_model)
        except (ValueError, OSError) as error:
            problems.append(f"global_batch_packing.cost_model: {error}")
    return problems


def _cuda_graphs_argument_problems(s: _Settings) -> list[str]:
    """``cuda_graphs=False`` passed for a model config that enables CUDA graphs."""
    if not (s.cuda_graphs is False and s.model_graphs):
        return []
    model = s.model
    return [
        "cuda_graphs: False was passed, but the model config enables CUDA graphs (cuda_graph_impl="
        f"{getattr(model, 'cuda_graph_impl', None)!r}, "
        f"enable_cuda_graph={getattr(model, 'enable_cuda_graph', None)!r}, "
        f"external_cuda_graph={getattr(model, 'external_cuda_graph', None)!r}); turn them off in model, or pass "
        "cuda_graphs=None to follow the model config"
    ]


def _offline_packing_problems(dataset: Any) -> list[str]:
    """Offline packing settings that are on: batches would arrive pre-packed with cu_seqlens."""
    problems = []
    for name in _OFFLINE_PACKING:
        value = getattr(dataset, name, None)
        if value is not None and value is not False:
            problems.append(
                f"dataset.{name}: set ({value!r}), but offline packing and in-batch packing are mutually exclusive "
                "(Megatron-Bridge refuses both) and pre-packed batches carry cu_seqlens, which this step rejects; "
                "set dataset.enable_offline_packing=False and dataset.offline_packing_specs=None (0.6.2 names; "
                "packed_sequence_specs=None in older versions), or keep offline packing with Megatron-Bridge's own step"
            )
    return problems


def _micro_batch_size_problems(train: Any) -> list[str]:
    """``micro_batch_size == 1``, which Bridge refuses with in-batch packing."""
    if getattr(train, "micro_batch_size", None) != 1:
        return []
    return [
        "train.micro_batch_size=1: in-batch packing concatenates the samples of one micro-batch, so one sample "
        "gains nothing, and Megatron-Bridge 0.6.2 refuses enable_in_batch_packing with micro_batch_size 1; raise "
        "train.micro_batch_size (and divide the gradient-accumulation steps accordingly), or turn packing off"
    ]


def _seq_length_problems(s: _Settings) -> list[str]:
    """``dataset.seq_length`` and ``model.seq_length`` both set, to different values."""
    dataset_length, model_length = s.seq_lengths
    if dataset_length is None or model_length is None or dataset_length == model_length:
        return []
    # Megatron-Bridge 0.6.2 training/config.py:1505 asserts equality only for five dataset config classes.
    return [
        f"dataset.seq_length={dataset_length!r} and model.seq_length={model_length!r} differ: the collate pads and "
        "truncates to dataset.seq_length, while megatron.bridge_thd's step truncates samples and sizes static rows "
        "by model.seq_length (qwen3_vl_step._step_settings) and the pipeline schedule sizes its p2p buffers by it "
        "(training/train.py); Megatron-Bridge 0.6.2 checks the two only for some dataset configs. Set "
        "dataset.seq_length and model.seq_length to the same value"
    ]


def _graph_setting(model: Any) -> str:
    """The model setting that turns CUDA graphs on, as ``name=value`` for a message."""
    impl = getattr(model, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        return f"model.cuda_graph_impl={impl!r}"
    name = "enable_cuda_graph" if getattr(model, "enable_cuda_graph", False) else "external_cuda_graph"
    impl = effective_cuda_graph_impl(model)
    return f"model.{name}=True (Megatron-Core's post-init makes it cuda_graph_impl={impl!r})"


def _cuda_graphs_pipeline_problems(s: _Settings) -> list[str]:
    """CUDA graphs in the model config with PP>1: Qwen3VLModel asserts at build, for every layout."""
    # Megatron-Bridge 0.6.2 models/qwen_vl/modelling_qwen3_vl/model.py:388, in
    # Qwen3VLModel._expose_language_model_for_cuda_graph_helper (called by __init__): when the
    # language model config's cuda_graph_impl != "none" it asserts `not config.variable_seq_lengths`.
    # With in-batch packing on (every layout configure sets up) training/config.py:1236-1237
    # (validate) sets transformer_config._enable_in_batch_packing, and models/transformer_config.py:188-189
    # (finalize) turns that into variable_seq_lengths=True when pipeline_model_parallel_size > 1.
    # Any cuda_graph_impl counts ("local", "transformer_engine", "full_iteration", or the deprecated
    # switches mapped to them), dense or MoE; PP=1 leaves variable_seq_lengths alone.
    if not s.pipeline_graphs:
        return []
    return [
        f"{_graph_setting(s.model)} with model.pipeline_model_parallel_size={s.pp}: Megatron-Bridge 0.6.2's "
        "Qwen3VLModel asserts at build that CUDA graphs run without model.variable_seq_lengths "
        "(models/qwen_vl/modelling_qwen3_vl/model.py:388), and for in-batch packing with PP>1 its validate() and "
        "finalize() set variable_seq_lengths=True (training/config.py:1237, models/transformer_config.py:189) "
        f"whatever the layout ({s.layout!r} included); set model.cuda_graph_impl='none' (and enable_cuda_graph / "
        "external_cuda_graph False) or model.pipeline_model_parallel_size=1"
    ]


def _hybridep_problems(s: _Settings) -> list[str]:
    """HybridEP with CUDA graphs and a layout other than ``"bshd"``: dispatch inputs must match across ranks."""
    layout = s.layout
    # With PP>1, _cuda_graphs_pipeline_problems already refuses every layout (one problem, not two).
    if not (s.graphs and s.hybridep and layout != "bshd") or s.pipeline_graphs:
        return []
    reason = (
        "'thd' rows differ in length per rank, so HybridEP dispatch inputs would be uneven"
        if layout == "thd"
        else "'thd_static' rows are equal in length, but packed attention with HybridEP inside CUDA graphs is not "
        "supported by this package"
    )
    return [
        f"layout: {layout!r} with HybridEP (moe_token_dispatcher_type='flex', moe_flex_dispatcher_backend="
        f"'hybridep') and CUDA graphs: the dispatch must see equal token counts on every rank without a host "
        f"sync (Megatron-Bridge pads uneven HybridEP inputs only when CUDA graphs are off); {reason}. Use "
        "layout='bshd', or turn CUDA graphs off to keep a THD layout"
    ]


def _cuda_graphs_layout_problems(s: _Settings) -> list[str]:
    """``"thd"`` with CUDA graphs, which cannot replay a row whose length changes."""
    # With HybridEP, _hybridep_problems already reports "thd"; with PP>1, _cuda_graphs_pipeline_problems.
    if not (s.graphs and s.layout == "thd" and not s.hybridep) or s.pipeline_graphs:
        return []
    return [
        "layout: 'thd' gives a row whose length changes every micro-batch, which CUDA graphs cannot replay; use "
        "layout='thd_static' (row padded to micro_batch_size * seq_length) or turn CUDA graphs off"
    ]


def _variable_seq_lengths_problems(s: _Settings, notes: list[str]) -> list[str]:
    """``variable_seq_lengths=True`` with CUDA graphs, unless Bridge's hook set it (then a note is appended)."""
    if not (s.graphs and getattr(s.model, "variable_seq_lengths", False)) or s.pipeline_graphs:
        return []
    if s.pp > 1 and bool(getattr(s.model, "_enable_in_batch_packing", False)):
        notes.append(
            "model.variable_seq_lengths=True was set by Megatron-Bridge's finalize() for in-batch packing with "
            "PP>1; the static layout keeps the row length fixed, p2p only exchanges shapes"
        )
        return []
    return [
        "model.variable_seq_lengths=True with CUDA graphs: variable sequence lengths contradict the static "
        "shapes CUDA graphs replay; set model.variable_seq_lengths=False (the static layouts do not need it)"
    ]


def _moe_allgather_problems(s: _Settings) -> list[str]:
    """``"thd"`` with MoE's allgather dispatcher over EP>1, which needs equal-sized token blocks per rank."""
    moe_allgather = bool(getattr(s.model, "num_moe_experts", None)) and s.dispatcher == "allgather"
    if not (moe_allgather and s.ep > 1 and s.layout == "thd"):
        return []
    return [
        f"layout: 'thd' with MoE moe_token_dispatcher_type='allgather' and expert_model_parallel_size={s.ep}: the "
        "allgather dispatcher gathers equal-sized token blocks across the expert-parallel ranks, which hold "
        "different micro-batches whose 'thd' rows differ in length; use layout='thd_static' or 'bshd', or "
        "moe_token_dispatcher_type='alltoall' / 'flex'"
    ]


def _moe_routing_problems(s: _Settings) -> list[str]:
    """Expert capacity or ``seq_aux_loss`` with a THD layout, without the MoE padding hook.

    Megatron-Core 0.19.2's token dropping lets padding take expert capacity and sizes it from every
    slot, and its ``seq_aux_loss`` is per ``(s, b)`` sequence (a THD row is one); the results then
    depend on the layout (docs/moe-routing.md). ``moe_padding.padding_mask_pre_wrap_hook`` makes both
    layout-independent; the step refuses the same combination at the first micro-batch.
    """
    from megatron.bridge_thd.moe_padding import padding_mask_pre_wrap_hook
    from megatron.bridge_thd.step import layout_dependent_moe_settings

    if s.layout not in THD_LAYOUTS or padding_mask_pre_wrap_hook in s.pre_wrap_hooks:
        return []
    return [
        f"{setting} with layout={s.layout!r}: padding would take expert capacity / seq_aux_loss would be one "
        "whole-row statistic, so the result would depend on the layout; register "
        "megatron.bridge_thd.moe_padding.padding_mask_pre_wrap_hook (cfg.model.register_pre_wrap_hook) before "
        "configure, or use layout='bshd'"
        for setting, _ in layout_dependent_moe_settings(s.model)
    ]


def _moe_overlap_problems(s: _Settings) -> list[str]:
    """MoE EP communication overlap: the step builds schedule plans only for ``"bshd"``, and only
    through the model's ``build_schedule_plan``."""
    # Megatron-Core 0.19.2 pipeline_parallel/combined_1f1b.py calls forward_step(..., return_schedule_plan=True)
    # when overlap_moe_expert_parallel_comm is on; megatron.bridge_thd's qwen3_vl_step.forward_step raises there
    # for a THD row (it carries packed_seq_params), and for "bshd" it calls model.build_schedule_plan.
    if s.moe_overlap is None:
        return []
    if s.layout in THD_LAYOUTS:
        return [
            f"{s.moe_overlap}=True with layout={s.layout!r}: Megatron-Core's combined 1F1B schedule "
            "(pipeline_parallel/combined_1f1b.py) then asks the forward step for a schedule plan "
            "(return_schedule_plan=True), and megatron.bridge_thd's step builds one only for the padded layout (it "
            f"raises at the first step for a THD row); set {s.moe_overlap}=False, or use layout='bshd' with a model "
            "that has build_schedule_plan (Megatron-Bridge 0.6.2's Qwen3VLModel has none)"
        ]
    model_class = s.built_model
    if model_class is not None and not hasattr(model_class, "build_schedule_plan"):
        # Megatron-Bridge 0.6.2's Qwen3VLModel (models/qwen_vl/modelling_qwen3_vl/model.py) has no
        # build_schedule_plan; its own step (models/qwen_vl/qwen3_vl_step.py) and ours call it for the plan.
        return [
            f"{s.moe_overlap}=True with layout={s.layout!r}: Megatron-Core's combined 1F1B schedule asks the "
            "forward step for a schedule plan (return_schedule_plan=True), which the step builds with "
            f"model.build_schedule_plan, and the model this provider builds ({model_class.__name__}, declared by "
            f"{type(s.model).__name__}.provide) has none, so the first step fails; set {s.moe_overlap}=False"
        ]
    return []


# ---- step 3: compute the changes, and find those that would overwrite an explicit setting ----


@dataclasses.dataclass(frozen=True)
class _Change:
    """One attribute to set; ``required=False`` skips an object that does not take it.

    ``why`` says why the layout needs ``value`` and ``alternative`` another way out, both for the
    refusal when the attribute holds a different value the user set explicitly; ``guarded=False``
    marks a change that may overwrite anything (Bridge's private hook).
    """

    obj: Any
    section: str
    name: str
    value: Any
    required: bool = True
    why: str = ""
    alternative: str = ""
    guarded: bool = True


@dataclasses.dataclass(frozen=True)
class _Override:
    """A planned change that would overwrite a value the user set explicitly."""

    change: _Change
    old: Any

    @property
    def setting(self) -> str:
        return f"{self.change.section}.{self.change.name}={self.old!r}"

    def refusal(self) -> str:
        change = self.change
        return (
            f"{self.setting} was set explicitly, but {change.why}; set it to {change.value!r} or remove the setting "
            f"(configure sets it){change.alternative}, or pass force=True to let configure overwrite it"
        )

    def warning(self) -> str:
        change = self.change
        return (
            f"bridge_thd.configure: force=True overwrites the explicit {self.setting} with {change.value!r}: "
            f"{change.why}"
        )


def _plan_changes(s: _Settings) -> tuple[list[_Change], list[str]]:
    """The attributes to set, in the order they are set, and the notes that explain them."""
    notes: list[str] = []
    changes = [*_dataset_changes(s), *_pipeline_changes(s, notes), *_hybridep_changes(s, notes),
               *_global_batch_changes(s)]
    return changes, notes


def _dataset_changes(s: _Settings) -> list[_Change]:
    """The dataset's packing flags, and ``pad_to_max_length`` where a fixed collate width is needed."""
    dataset, layout = s.dataset, s.layout
    packing_on = (
        f"configure turns in-batch packing on for every layout, and megatron.bridge_thd's step reads "
        f"dataset.enable_in_batch_packing and dataset.pack_sequences_in_batch as one switch, so False contradicts "
        f"layout {layout!r}"
    )
    changes = [
        _Change(dataset, "dataset", "enable_in_batch_packing", True, why=packing_on,
                alternative=", or do not call configure (train unpacked with Megatron-Bridge's own step)"),
        _Change(dataset, "dataset", "pack_sequences_in_batch", True, required=False, why=packing_on,
                alternative=", or do not call configure (train unpacked with Megatron-Bridge's own step)"),
        _Change(dataset, "dataset", "defer_in_batch_packing_to_step", True,
                why="with in-batch packing on, the collate then packs the micro-batch itself (cu_seqlens in the "
                "batch; Megatron-Bridge 0.6.2 data/datasets/direct_sft.py), and megatron.bridge_thd's step rejects "
                "packed batches",
                alternative=", or use Megatron-Bridge's vlm_step for collate-time packing"),
        _Change(dataset, "dataset", "packing_layout", layout,
                why=f"configure was called with layout={layout!r}, and the step reads its layout from here",
                alternative=", or call configure with that layout"),
        *([_Change(dataset, "dataset", "global_batch_packing", s.global_batch, guarded=False)]
          if s.global_batch is not None else []),
        _Change(dataset, "dataset", "skip_getting_attention_mask_from_dataset", False,
                why="the step takes each sample's real tokens from the dataset's 2D attention mask, which this "
                "flag asks the data path to leave out (a dataset that honours it gives the step no mask, and the "
                "step then fails at the first micro-batch)"),
    ]
    reasons = []
    # Megatron-Bridge 0.6.2 training/config.py validate(): pad_to_max_length forced for PP>1 or EP>1.
    if hasattr(dataset, "pad_to_max_length") and (s.pp > 1 or s.ep > 1):
        reasons.append(
            f"Megatron-Bridge 0.6.2's validate() forces it True for PP>1 or EP>1 (PP={s.pp}, EP={s.ep}; "
            "training/config.py)"
        )
    if s.graphs:
        # Every training graph needs a static token width (Bridge's comment for offline packing).
        reasons.append("CUDA graphs replay fixed shapes, so the collate must pad every micro-batch to seq_length")
    if reasons:
        changes.append(_Change(dataset, "dataset", "pad_to_max_length", True, why="; and ".join(reasons)))
    return changes


def _global_batch_changes(s: _Settings) -> list[_Change]:
    """Per-token loss normalisation, which makes the gradient independent of the placement."""
    if s.global_batch is None:
        return []
    why = ("global-batch packing gives micro-batches and DP ranks different token counts; Megatron-Core divides "
           "each micro-batch's loss by its own tokens and the number of micro-batches unless "
           "calculate_per_token_loss is set (pipeline_parallel/schedules.py forward_step), which would weigh a "
           "token by where it was placed; per-token normalisation over the whole step keeps loss and gradients "
           "those of Megatron-Bridge's own placement")
    changes = [_Change(s.model, "model", "calculate_per_token_loss", True, why=why,
                       alternative=", or turn global-batch packing off")]
    if s.ddp is not None and hasattr(s.ddp, "average_in_collective"):
        changes.append(_Change(
            s.ddp, "ddp", "average_in_collective", False,
            why="Megatron-Core's DistributedDataParallel refuses average_in_collective with calculate_per_token_loss "
                "(distributed/distributed_data_parallel.py)",
            alternative=", or turn global-batch packing off"))
    return changes


def _pipeline_changes(s: _Settings, notes: list[str]) -> list[_Change]:
    """For ``"thd"`` with PP>1, let p2p exchange shapes: ``variable_seq_lengths`` or Bridge's hook for it."""
    model = s.model
    if s.layout == "thd" and s.pp > 1:
        changes = []
        deferred_post_init = callable(getattr(model, "finalize", None))
        if deferred_post_init:
            # Bridge's validate() sets this private hook itself whenever in-batch packing is on.
            changes.append(_Change(model, "model", "_enable_in_batch_packing", True, guarded=False))
        if deferred_post_init and s.dispatcher == "allgather":
            notes.append(
                "model.variable_seq_lengths is set to True by the model config's finalize() (hook "
                "_enable_in_batch_packing): setting it before finalize() trips Megatron-Core's allgather-dispatcher "
                "check"
            )
        else:
            changes.append(_Change(
                model, "model", "variable_seq_lengths", True,
                why=f"layout 'thd' with pipeline_model_parallel_size={s.pp} sends a row whose length changes every "
                "micro-batch, so the pipeline stages must exchange shapes",
                alternative=", or use layout='thd_static' (fixed row length, no shape exchange)",
            ))
        return changes
    if s.pp > 1:
        notes.append(
            f"layout {s.layout!r} keeps a fixed row length; Megatron-Bridge 0.6.2's validate() still sets "
            "variable_seq_lengths=True for in-batch packing with PP>1 (p2p then exchanges shapes)"
        )
    return []


def _hybridep_changes(s: _Settings, notes: list[str]) -> list[_Change]:
    """For HybridEP without CUDA graphs, the padding of uneven dispatch inputs Bridge's validate sets."""
    if not (s.hybridep and not s.graphs):
        return []
    fields = [name for name in HYBRIDEP_PADDING_FIELDS if hasattr(s.model, name)] or [HYBRIDEP_PADDING_FIELDS[0]]
    notes.append(
        "HybridEP without CUDA graphs: per-rank token counts may differ; Megatron-Bridge 0.6.2 pads "
        f"uneven HybridEP dispatch inputs ({', '.join(fields)}=True), so layout {s.layout!r} is allowed"
    )
    why = (
        "packed rows give HybridEP different token counts per rank, and Megatron-Bridge 0.6.2's "
        "_enable_safe_hybridep_dispatch (models/transformer_config.py) sets it True itself for in-batch packing "
        "without CUDA graphs"
    )
    return [_Change(s.model, "model", name, True, required=False, why=why) for name in fields]


def _explicit_overrides(changes: list[_Change]) -> list[_Override]:
    """The planned changes that would replace a value the user set explicitly (see :func:`is_explicit`)."""
    overrides = []
    for change in changes:
        if change.guarded and is_explicit(change.obj, change.name):
            old = getattr(change.obj, change.name)
            if old != change.value:
                overrides.append(_Override(change, old))
    return overrides


# ---- step 4: apply them and log ----


def _apply(changes: list[_Change]) -> list[str]:
    """Set each attribute whose value differs; return a ``section.name: old -> new`` line per change made."""
    made: list[str] = []
    for change in changes:
        old = getattr(change.obj, change.name, _MISSING)
        if old is not _MISSING and old == change.value and type(old) is type(change.value):
            continue
        try:
            setattr(change.obj, change.name, change.value)
        except (AttributeError, TypeError) as error:
            if change.required:
                raise ValueError(
                    f"{change.section}.{change.name}: cannot be set on {type(change.obj).__name__} ({error}); "
                    f"set it to {change.value!r} yourself"
                ) from error
            continue
        made.append(f"{change.section}.{change.name}: {'unset' if old is _MISSING else repr(old)} -> {change.value!r}")
    return made


def _log(s: _Settings, changes: list[str], notes: list[str], overrides: list[_Override]) -> None:
    """Log at INFO the layout, the parallel sizes, what changed and the notes; a WARNING per forced overwrite."""
    logger.info(
        "bridge_thd.configure: layout=%s (PP=%d, EP=%d, CUDA graphs %s); changed: %s%s",
        s.layout,
        s.pp,
        s.ep,
        "on" if s.graphs else "off",
        "; ".join(changes) if changes else "nothing",
        "".join(f"\n  note: {note}" for note in notes),
    )
    for override in overrides:
        logger.warning("%s", override.warning())
