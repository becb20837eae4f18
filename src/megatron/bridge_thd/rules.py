"""Every rule that refuses a combination of settings, in one module (docs/step-plan.md).

``configure`` (before the model exists), the step (when it builds its :class:`~megatron.bridge_thd.step_plan.StepPlan`)
and the planner read the same :class:`Setup` record and call the same rule functions, so they cannot disagree. A rule
takes a :class:`Setup` and returns the problems it finds as messages (setting, what is wrong, what to set); it
never raises and never writes. :func:`configure_problems` runs every rule; :data:`STEP_RULES` are the ones whose
facts the step also knows once the model is built (the configure-only rules are about settings the step never
sees: offline packing, the DDP and comm-overlap sections, the model provider's hooks).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any

from megatron.bridge_thd.checks import is_int_at_least
from megatron.bridge_thd.layouts import LAYOUT_NAMES, THD_LAYOUTS, bshd_alignment, thd_alignment
from megatron.bridge_thd.packing import round_up

__all__ = [
    "Setup",
    "read_setup",
    "configure_problems",
    "step_problems",
    "STEP_RULES",
    "cuda_graphs_enabled",
    "effective_cuda_graph_impl",
    "uses_hybridep",
    "uses_seq_aux_loss",
    "layout_dependent_moe_settings",
    "requested_layout",
    "one_row_shape",
    "row_buckets",
    "DEFAULT_ROW_BUCKETS",
]

# Offline (pre-packed dataset) settings: current names, then the older ``packed_sequence_specs``.
_OFFLINE_PACKING = ("enable_offline_packing", "offline_packing_specs", "packed_sequence_specs")


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

    The same test as Megatron-Bridge's ``_enable_safe_hybridep_dispatch``
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
    """``model.cuda_graph_impl`` as Megatron-Core's ``TransformerConfig.__post_init__`` leaves it.

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


def _size(model: Any, name: str) -> int:
    return int(getattr(model, name, 1) or 1)



@dataclasses.dataclass(frozen=True)
class Setup:
    """The facts every rule reads: the configuration's sections and what is resolved from them once.

    ``configure`` builds it from the config alone (:func:`read_setup`); the step builds it when it makes its plan,
    from the same config plus the built model's config, the process groups and the model itself. ``layout`` is
    the layout being judged: the one requested in ``configure``, the one that runs in the step.
    """

    layout: str
    cuda_graphs: bool | None  # configure's argument as passed (None in the step)
    dataset: Any
    model: Any  # the transformer config (the built model's in the step)
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
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    fp8: bool = False
    variable_seq_lengths: bool = False
    micro_batch_size: int | None = None
    routes_real_tokens_only: bool = False  # the MoE routers see real tokens only (the padding-mask hook)
    adapter: Any = None  # the model family (megatron.bridge_thd.adapters), when known
    row_lengths: tuple[int, ...] = ()  # thd_static under global-batch packing: the run's rows, ascending

    @property
    def bridge_packing_flag(self) -> bool:
        """Whether ``configure`` turns Megatron-Bridge's ``dataset.enable_in_batch_packing`` on (see
        :func:`bridge_packing_flag`)."""
        return bridge_packing_flag(self.micro_batch_size)

    @property
    def variable_lengths_on_build(self) -> bool:
        """PP>1 and the model config will hold ``variable_seq_lengths=True`` when the model is built: set by the
        user, by Megatron-Bridge's ``finalize()`` through the hook its ``validate()`` sets for in-batch packing, or
        by ``configure`` for ``"thd"``."""
        return self.pp > 1 and (self.variable_seq_lengths or self.bridge_packing_flag or self.layout == "thd")

    @property
    def pipeline_graphs(self) -> bool:
        """PP>1 with CUDA graphs in the model config and variable sequence lengths: Qwen3VLModel refuses to build
        (see the check)."""
        return self.graph_impl != "none" and self.variable_lengths_on_build

    @property
    def seq_length(self) -> int | None:
        """The model's ``seq_length`` (what the step truncates to and sizes static rows by)."""
        return self.seq_lengths[1] if self.seq_lengths[1] is not None else self.seq_lengths[0]

    @property
    def row_length(self) -> int | None:
        """Global-batch packing's longest ``thd_static`` row (the one every micro-batch fits), or None."""
        return self.row_lengths[-1] if self.row_lengths else None

    @property
    def fixed_p2p_shapes(self) -> bool:
        """Pipeline stages exchange fixed-shape buffers (PP>1 without ``variable_seq_lengths``)."""
        return self.pp > 1 and not self.variable_seq_lengths

    @property
    def align(self) -> int:
        """The alignment of the judged layout: every THD slot's, or the padded layout's width divisor."""
        if self.layout == "bshd":
            return bshd_alignment(self.tp, self.cp)
        return thd_alignment(self.tp, self.cp, sequence_parallel=self.sequence_parallel, fp8=self.fp8)


def _moe_overlap_setting(cfg: Any, model: Any) -> str | None:
    """The setting that turns MoE EP communication overlap on as Megatron-Bridge resolves it, or None.

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



def _setting(model: Any, model_root: Any, name: str, default: Any = None) -> Any:
    """A model setting from the transformer config, else the model section (a provider proxies it)."""
    value = getattr(model, name, None)
    if value is None:
        value = getattr(model_root, name, None)
    return default if value is None else value


# The mark of what makes a model's MoE routers see real tokens only: on moe_padding's pre-wrap hook and on the
# model classes it creates (the step reads it off the built model).
ROUTES_REAL_TOKENS_ONLY = "bridge_thd_routes_real_tokens_only"


def read_setup(cfg: Any, layout: str, cuda_graphs: bool | None = None, global_batch: Any = None, *,
               model_config: Any = None, sizes: dict[str, int] | None = None,
               routes_real_tokens_only: bool | None = None, adapter: Any = None,
               row_lengths: tuple[int, ...] = ()) -> Setup:
    """The :class:`Setup` of ``cfg`` for ``layout``.

    ``configure`` passes the config alone. The step also passes what only a built model knows: its
    ``model_config`` (read before ``cfg.model``), the process-group ``sizes`` (``tp``, ``cp``, ``pp``, ``ep``),
    whether its MoE routers see real tokens only, its ``adapter`` and global-batch packing's rows.
    """
    dataset = getattr(cfg, "dataset", None)
    model_root = getattr(cfg, "model", None)
    if dataset is None or model_root is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    # Bridge's validate reads the model's transformer config this way (GPTModelConfig proxies it).
    model = model_config if model_config is not None else getattr(model_root, "transformer", model_root)
    model_graphs = cuda_graphs_enabled(model)
    model_seq_length = _setting(model, model_root, "seq_length")
    hooks = tuple(getattr(model_root, "_pre_wrap_hooks", None) or ())
    if routes_real_tokens_only is None:
        # moe_padding.padding_mask_pre_wrap_hook carries this mark (read by name: moe_padding imports this module).
        routes_real_tokens_only = any(getattr(hook, ROUTES_REAL_TOKENS_ONLY, False) for hook in hooks)
    if sizes is None:
        sizes = {name: _size(model, f"{long}_parallel_size") for name, long in
                 (("tp", "tensor_model"), ("cp", "context"), ("pp", "pipeline_model"), ("ep", "expert_model"))}
    return Setup(
        layout=layout,
        cuda_graphs=cuda_graphs,
        dataset=dataset,
        model=model,
        train=getattr(cfg, "train", None),
        pp=sizes["pp"],
        ep=sizes["ep"],
        tp=sizes["tp"],
        cp=sizes["cp"],
        model_graphs=model_graphs,
        graphs=model_graphs or bool(cuda_graphs),
        graph_impl=effective_cuda_graph_impl(model),
        hybridep=uses_hybridep(model),
        dispatcher=getattr(model, "moe_token_dispatcher_type", None),
        moe_overlap=_moe_overlap_setting(cfg, model),
        seq_lengths=(getattr(dataset, "seq_length", None), model_seq_length),
        pre_wrap_hooks=hooks,
        built_model=_built_model_class(model_root),
        global_batch=global_batch,
        ddp=getattr(cfg, "ddp", None),
        sequence_parallel=bool(_setting(model, model_root, "sequence_parallel", False)),
        fp8=bool(_setting(model, model_root, "fp8", None)),  # Megatron: a recipe name or None
        variable_seq_lengths=bool(_setting(model, model_root, "variable_seq_lengths", False)),
        micro_batch_size=getattr(getattr(cfg, "train", None), "micro_batch_size", None),
        routes_real_tokens_only=bool(routes_real_tokens_only),
        adapter=adapter,
        row_lengths=tuple(row_lengths),
    )


def bridge_packing_flag(micro_batch_size: Any) -> bool:
    """Whether ``configure`` turns Megatron-Bridge's own ``dataset.enable_in_batch_packing`` on: for every layout,
    except with ``train.micro_batch_size`` 1.

    Megatron-Bridge's flag does three things: its collate packs the micro-batch unless
    ``defer_in_batch_packing_to_step`` (``configure`` defers, the step packs), its ``validate()`` sets the model
    config's ``_enable_in_batch_packing`` hook (``variable_seq_lengths`` for PP>1) and its ``validate()`` refuses
    micro-batch size 1. The step reads its own switch (``dataset.pack_sequences_in_batch``, either name turns it
    on), and ``configure`` sets the hook itself where the layout needs it (``"thd"`` with PP>1), so with a
    micro-batch of one sample the flag stays off and the step still runs the requested layout (docs/configure.md).
    """
    return micro_batch_size != 1


def requested_layout(dataset: Any) -> str:
    """The layout the configuration asks for: ``"bshd"`` when in-batch packing is off
    (``dataset.pack_sequences_in_batch`` / ``enable_in_batch_packing``), else ``dataset.packing_layout``
    (default ``"thd"``)."""
    packing = bool(getattr(dataset, "pack_sequences_in_batch", False) or getattr(dataset, "enable_in_batch_packing",
                                                                              False))
    if not packing:
        return "bshd"
    requested = getattr(dataset, "packing_layout", None) or "thd"
    if requested not in LAYOUT_NAMES:
        raise ValueError(f"dataset.packing_layout: {requested!r} is not one of {LAYOUT_NAMES}")
    return requested


def _built_model_class(provider: Any) -> type | None:
    """The class a Megatron-Bridge model provider's ``provide()`` declares it returns, or None.

    Read from the return annotation (resolved in the provider module's namespace when it is a string,
    as under ``from __future__ import annotations``); nothing is imported or built. Megatron-Bridge's
    Qwen-VL providers (``models/qwen_vl/qwen3_vl_provider.py``, ``qwen35_vl_provider.py``)
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



def configure_problems(s: Setup) -> tuple[list[str], list[str]]:
    """Every rule, in the order ``configure``'s error lists their problems; returns (problems, notes)."""
    notes: list[str] = []
    problems = [
        *_cuda_graphs_argument_problems(s),
        *_offline_packing_problems(s.dataset),
        *_seq_length_problems(s),
        *_cuda_graphs_pipeline_problems(s),
        *_hybridep_problems(s),
        *_cuda_graphs_layout_problems(s),
        *_cuda_graphs_scope_problems(s),
        *_variable_seq_lengths_problems(s, notes),
        *_moe_allgather_problems(s),
        *_moe_overlap_problems(s),
        *_moe_routing_problems(s),
        *_global_batch_problems(s),
        *_adapter_problems(s),
    ]
    return problems, notes


def step_problems(s: Setup) -> list[str]:
    """The rules of :data:`STEP_RULES` on the step's :class:`Setup` (the layout that runs)."""
    return [problem for rule in STEP_RULES for problem in rule(s)]


# Rows a thd_static run under global-batch packing may use when row_buckets is left unset.
DEFAULT_ROW_BUCKETS = 4


def one_row_shape(s: Setup) -> str | None:
    """Why this setup can run one ``thd_static`` row shape only (fixed pipeline p2p buffers, CUDA graphs), or
    None when several can run."""
    if s.fixed_p2p_shapes:
        return ("without model.variable_seq_lengths the pipeline stages exchange fixed-shape buffers, which hold one "
                "row shape")
    if s.graphs:
        return ("with CUDA graphs Megatron-Core's graph manager captures its graphs in the first iteration and stops "
                "the run at a row shape first seen later")
    return None


def row_buckets(s: Setup) -> int:
    """How many ``thd_static`` rows global-batch packing chooses: ``global_batch_packing.row_buckets``, or unset
    :data:`DEFAULT_ROW_BUCKETS` (1 where :func:`one_row_shape` says only one can run)."""
    requested = getattr(s.global_batch, "row_buckets", None)
    if requested is not None:
        return requested
    return 1 if one_row_shape(s) else DEFAULT_ROW_BUCKETS


def _row_lengths_problems(s: Setup) -> list[str]:
    """Several recorded ``thd_static`` rows where only one row shape can run."""
    if len(s.row_lengths) < 2 or s.layout != "thd_static" or not one_row_shape(s):
        return []
    return [f"dataset.global_batch_packing.row_buckets: the loaders chose {len(s.row_lengths)} rows "
            f"({', '.join(map(str, s.row_lengths))} slots), but {one_row_shape(s)}; set row_buckets=1"]


def _global_batch_problems(s: Setup) -> list[str]:
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
    if row is not None and not is_int_at_least(row, 1):
        problems.append(f"global_batch_packing.row_length: {row!r}; expected None (chosen from the data) or an int >= 1")
    buckets = g.row_buckets
    if buckets is not None and not is_int_at_least(buckets, 1):
        problems.append(f"global_batch_packing.row_buckets: {buckets!r}; expected None (the default: "
                        f"{DEFAULT_ROW_BUCKETS}, or 1 where only one row shape can run) or an int >= 1")
    elif buckets is not None and buckets > 1 and s.layout == "thd_static" and one_row_shape(s):
        problems.append(f"dataset.global_batch_packing.row_buckets: {buckets} rows, but {one_row_shape(s)}; set "
                        "row_buckets=1 (or leave it unset: then one row)")
    lengths_file = getattr(g, "lengths_file", None)
    if lengths_file is not None and not os.path.isfile(str(lengths_file)):
        problems.append(f"global_batch_packing.lengths_file: {lengths_file!r} is not a file; write it with bridge-thd "
                        "scan (docs/scan.md), or unset it to scan the data when the loaders are built")
    if g.cost_model is not None:
        from megatron.bridge_thd.batching.cost import sample_cost

        try:
            sample_cost(g.cost_model)
        except (ValueError, OSError) as error:
            problems.append(f"global_batch_packing.cost_model: {error}")
    return problems


def _cuda_graphs_argument_problems(s: Setup) -> list[str]:
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
                "set dataset.enable_offline_packing=False and dataset.offline_packing_specs=None "
                "(the pinned Megatron-Bridge's names; packed_sequence_specs=None in older releases), or keep offline packing with Megatron-Bridge's own step"
            )
    return problems


def _seq_length_problems(s: Setup) -> list[str]:
    """``dataset.seq_length`` and ``model.seq_length`` both set, to different values."""
    dataset_length, model_length = s.seq_lengths
    if dataset_length is None or model_length is None or dataset_length == model_length:
        return []
    # Megatron-Bridge's ConfigContainer.validate asserts equality only for five dataset config classes
    # (docs/compatibility.md).
    return [
        f"dataset.seq_length={dataset_length!r} and model.seq_length={model_length!r} differ: the collate pads and "
        "truncates to dataset.seq_length, while megatron.bridge_thd's step truncates samples and sizes static rows "
        "by model.seq_length (qwen3_vl_step._step_settings) and the pipeline schedule sizes its p2p buffers by it "
        "(training/train.py); Megatron-Bridge's ConfigContainer.validate checks the two only for some dataset configs. Set "
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


def _cuda_graphs_pipeline_problems(s: Setup) -> list[str]:
    """CUDA graphs in the model config with PP>1 and variable sequence lengths: Qwen3VLModel asserts at build."""
    # Megatron-Bridge's models/qwen_vl/modelling_qwen3_vl/model.py, in
    # Qwen3VLModel._expose_language_model_for_cuda_graph_helper (called by __init__): when the
    # language model config's cuda_graph_impl != "none" it asserts `not config.variable_seq_lengths`.
    # With Megatron-Bridge's in-batch packing flag on (every layout configure sets up, except with micro-batch
    # size 1: bridge_packing_flag) ConfigContainer.validate (training/config.py) sets
    # transformer_config._enable_in_batch_packing, and TransformerConfig.finalize (models/transformer_config.py)
    # turns that into variable_seq_lengths=True when pipeline_model_parallel_size > 1 (docs/compatibility.md);
    # configure sets the same hook for "thd" with PP>1 itself.
    # Any cuda_graph_impl counts ("local", "transformer_engine", "full_iteration", or the deprecated
    # switches mapped to them), dense or MoE; PP=1 leaves variable_seq_lengths alone.
    if not s.pipeline_graphs:
        return []
    if s.variable_seq_lengths:
        why = "model.variable_seq_lengths=True is set"
        fix = "set model.variable_seq_lengths=False with a static layout, or "
    elif s.bridge_packing_flag:
        why = ("for in-batch packing with PP>1 its ConfigContainer.validate() and TransformerConfig.finalize() set "
               f"variable_seq_lengths=True whatever the layout ({s.layout!r} included)")
        fix = ""
    else:
        why = "layout 'thd' with PP>1 needs variable_seq_lengths=True (its row length changes every micro-batch)"
        fix = "use layout='thd_static' or 'bshd' (with train.micro_batch_size=1 they keep fixed p2p shapes), or "
    return [
        f"{_graph_setting(s.model)} with model.pipeline_model_parallel_size={s.pp}: Megatron-Bridge's "
        "Qwen3VLModel asserts at build that CUDA graphs run without model.variable_seq_lengths "
        f"(Qwen3VLModel._expose_language_model_for_cuda_graph_helper), and {why}; {fix}set "
        "model.cuda_graph_impl='none' (and enable_cuda_graph / external_cuda_graph False) or "
        "model.pipeline_model_parallel_size=1"
    ]


def _hybridep_problems(s: Setup) -> list[str]:
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


def _cuda_graphs_layout_problems(s: Setup) -> list[str]:
    """``"thd"`` with CUDA graphs, which cannot replay a row whose length changes."""
    # With HybridEP, _hybridep_problems already reports "thd"; with PP>1, _cuda_graphs_pipeline_problems.
    if not (s.graphs and s.layout == "thd" and not s.hybridep) or s.pipeline_graphs:
        return []
    return [
        "layout: 'thd' gives a row whose length changes every micro-batch, which CUDA graphs cannot replay; use "
        "layout='thd_static' (row padded to micro_batch_size * seq_length) or turn CUDA graphs off"
    ]


def _graph_modules(model: Any) -> set[str]:
    """``cuda_graph_modules`` (or the deprecated ``cuda_graph_scope``) as lower-case names; empty = the whole layer
    (Megatron-Core's default ``"full"`` becomes ``[]`` in its post-init)."""
    value = getattr(model, "cuda_graph_modules", None) or getattr(model, "cuda_graph_scope", None) or []
    items = value if isinstance(value, (list, tuple)) else [value]
    names = set()
    for item in items:
        for name in (item.split(",") if isinstance(item, str) else [getattr(item, "name", str(item))]):
            name = name.strip().lower()
            if name and name != "full":
                names.add(name)
    return names


def _cuda_graphs_scope_problems(s: Setup) -> list[str]:
    """``thd_static`` with a CUDA-graph implementation or scope that cannot replay a THD row (docs/cuda-graphs.md).

    Megatron-Core's Transformer-Engine path asserts ``packed_seq_params is None`` when attention is inside the
    graph (``transformer_layer.py``, ``_te_cuda_graph_replay``); with attention outside it captures the hidden
    states as ``(seq_length, micro_batch_size, H)``, which a THD row ``(N, 1, H)`` matches only for one sample of
    ``seq_length``. ``full_iteration`` replays the whole iteration without comparing any argument (and captures
    the vision tower, which reads the host). ``"local"`` compares every argument and takes the static row.
    """
    # "thd" with graphs and PP>1 with graphs are refused by their own rules.
    if not s.graphs or s.layout != "thd_static" or s.pipeline_graphs:
        return []
    impl, modules = s.graph_impl, _graph_modules(s.model)
    if impl == "full_iteration":
        return ["model.cuda_graph_impl='full_iteration' with layout 'thd_static': the full-iteration graph replays "
                "without comparing its arguments, so a micro-batch's THD metadata would not be its own, and it "
                "captures the vision tower, which reads the host; set model.cuda_graph_impl='local' (it compares "
                "every argument and replays the static row), or layout='bshd'"]
    if impl != "transformer_engine":
        return []
    if not modules or "attn" in modules:
        return [f"model.cuda_graph_impl='transformer_engine' with cuda_graph_modules={sorted(modules) or 'full'} and "
                "layout 'thd_static': Megatron-Core's Transformer-Engine graph path asserts packed_seq_params is None "
                "when attention is inside the graph (transformer_layer.py _te_cuda_graph_replay); set "
                "model.cuda_graph_impl='local', or model.cuda_graph_modules=['mlp'] with train.micro_batch_size=1, "
                "or layout='bshd'"]
    if s.micro_batch_size not in (None, 1) or s.global_batch is not None or s.row_length is not None:
        return [f"model.cuda_graph_impl='transformer_engine' with cuda_graph_modules={sorted(modules)} and layout "
                "'thd_static': the graphs capture the hidden states as (seq_length, micro_batch_size, hidden), which "
                "a THD row (N, 1, hidden) matches only for one sample of seq_length; set train.micro_batch_size=1 "
                "(without global-batch packing), or model.cuda_graph_impl='local', or layout='bshd'"]
    return []


def _variable_seq_lengths_problems(s: Setup, notes: list[str]) -> list[str]:
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


def _moe_allgather_problems(s: Setup) -> list[str]:
    """``"thd"`` with MoE's allgather dispatcher over EP>1, which needs equal-sized token blocks per rank; or under
    PP>1, where the row's length travels with ``variable_seq_lengths``, which the dispatcher refuses."""
    moe_allgather = bool(getattr(s.model, "num_moe_experts", None)) and s.dispatcher == "allgather"
    variable_lengths = s.pp > 1 and (s.layout == "thd" or s.bridge_packing_flag)
    if moe_allgather and variable_lengths and not (s.layout == "thd" and s.ep > 1):
        return [
            f"layout: {s.layout!r} with MoE moe_token_dispatcher_type='allgather' and pipeline_model_parallel_size="
            f"{s.pp}: the stages exchange the row's changing length (variable_seq_lengths=True, set for in-batch "
            "packing under PP), which Megatron-Core's config check refuses for the allgather dispatcher once "
            "Megatron-Bridge's setup finalizes the model config again; set moe_token_dispatcher_type='alltoall' / "
            "'flex'" + (", or use layout='thd_static' with train.micro_batch_size=1" if s.layout == "thd" else
                        ", or train.micro_batch_size=1 (no in-batch flag, fixed shapes)")
        ]
    if not (moe_allgather and s.ep > 1 and s.layout == "thd"):
        return []
    return [
        f"layout: 'thd' with MoE moe_token_dispatcher_type='allgather' and expert_model_parallel_size={s.ep}: the "
        "allgather dispatcher gathers equal-sized token blocks across the expert-parallel ranks, which hold "
        "different micro-batches whose 'thd' rows differ in length; use layout='thd_static' or 'bshd', or "
        "moe_token_dispatcher_type='alltoall' / 'flex'"
    ]


def uses_seq_aux_loss(config) -> bool:
    """Whether ``moe_router_load_balancing_type`` (a name or a list of names) includes ``seq_aux_loss``."""
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    return "seq_aux_loss" in (balancing if isinstance(balancing, (list, tuple)) else [balancing])


def layout_dependent_moe_settings(config) -> list[tuple[str, str]]:
    """The MoE settings of ``config`` whose result depends on the layout unless the routers see real
    tokens only, as ``(setting, why)``; empty for a dense model.

    Megatron-Core's token dropping (``moe_expert_capacity_factor``) sizes the capacity from every slot and lets
    padding compete for it, and its ``seq_aux_loss`` reshapes the router's ``(s, b)`` tokens per sequence, so a
    THD row (``b = 1``) becomes one whole-row statistic. Both are made layout-independent by
    :func:`megatron.bridge_thd.moe_padding.with_padding_mask` (docs/moe-routing.md).
    """
    if not getattr(config, "num_moe_experts", None):
        return []
    settings = []
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        settings.append((
            f"model.moe_expert_capacity_factor={capacity}",
            "padding slots compete with real tokens for expert capacity and the capacity is sized from every slot "
            "(the thd_static tail is most of the row), so the tokens dropped and the loss depend on the layout",
        ))
    if uses_seq_aux_loss(config):
        settings.append((
            "model.moe_router_load_balancing_type='seq_aux_loss'",
            "Megatron-Core computes seq_aux_loss per (s, b) sequence and a THD row is one sequence, so it becomes a "
            "whole-row statistic instead of a per-sample one",
        ))
    return settings


def _moe_routing_problems(s: Setup) -> list[str]:
    """Expert capacity or ``seq_aux_loss`` with a THD layout on routers that also see padding.

    Megatron-Core's token dropping lets padding take expert capacity and sizes it from every slot, and its
    ``seq_aux_loss`` is per ``(s, b)`` sequence (a THD row is one); the results then depend on the layout
    (docs/moe-routing.md). ``moe_padding.padding_mask_pre_wrap_hook`` makes both layout-independent.
    """
    if s.layout not in THD_LAYOUTS or s.routes_real_tokens_only:
        return []
    return [
        f"{setting} with dataset.packing_layout={s.layout!r}: {why}, so the result would depend on the layout "
        "(measured on the tiny MoE model in docs/moe-routing.md); register "
        "megatron.bridge_thd.moe_padding.padding_mask_pre_wrap_hook (cfg.model.register_pre_wrap_hook) so the "
        "routers see real tokens only, or set dataset.packing_layout='bshd'"
        for setting, why in layout_dependent_moe_settings(s.model)
    ]


def _seq_length_set_problems(s: Setup) -> list[str]:
    """No ``model.seq_length``: the step bounds sample lengths and sizes static rows by it."""
    if s.seq_length is not None:
        return []
    return ["model.seq_length: not set; the step needs it to bound sample lengths and size static rows; set "
            "model.seq_length (and dataset.seq_length) to the collate's width"]


def _static_pipeline_problems(s: Setup) -> list[str]:
    """A fixed-shape pipeline (PP>1 without ``variable_seq_lengths``) that the layout cannot fill exactly.

    Every stage allocates its receive buffer as ``(seq_length / cp [/ tp with SP], micro_batch_size, H)``
    (Megatron-Core ``pipeline_parallel/schedules.py``, ``get_tensor_shapes``), so ``seq_length`` must be a
    multiple of the layout's alignment, and a global-batch row must hold exactly ``micro_batch_size * seq_length``
    slots (each CP rank then sends its ``1 / cp`` of them).
    """
    if not s.fixed_p2p_shapes or s.layout == "thd" or s.seq_length is None:
        return []
    align, seq_length = s.align, s.seq_length
    problems = []
    if seq_length % align:
        what = "a static row" if s.layout != "bshd" else "the padded (B, seq_length) layout"
        problems.append(
            f"model.seq_length: {seq_length} is not a multiple of the {s.layout} alignment {align} (TP/CP/SP/FP8), "
            f"so {what} cannot fill the pipeline's fixed (seq_length, micro_batch_size, H) buffers; set seq_length "
            f"to {round_up(seq_length, align)}, or set model.variable_seq_lengths=True")
    mbs = s.micro_batch_size
    if s.row_length is not None and mbs is not None and round_up(s.row_length, align) != mbs * round_up(
            seq_length, align):
        problems.append(
            f"dataset.global_batch_packing.row_length: {s.row_length} slots, but without variable_seq_lengths the "
            f"pipeline's fixed buffers hold train.micro_batch_size * model.seq_length = {mbs} x {seq_length} slots; "
            f"set row_length to {mbs * round_up(seq_length, align)} (or leave it unset), or set "
            "model.variable_seq_lengths=True")
    return problems


def _adapter_problems(s: Setup) -> list[str]:
    """A layout or parallel size the model family cannot take (the adapter's ``check_supported``)."""
    if s.adapter is None:
        return []
    try:
        s.adapter.check_supported(s.layout, {"tp": s.tp, "cp": s.cp, "pp": s.pp, "ep": s.ep})
    except ValueError as refusal:
        return [str(refusal)]
    return []


def _moe_overlap_problems(s: Setup) -> list[str]:
    """MoE EP communication overlap: the step builds schedule plans only for ``"bshd"``, and only
    through the model's ``build_schedule_plan``."""
    # Megatron-Core's pipeline_parallel/combined_1f1b.py calls forward_step(..., return_schedule_plan=True)
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
            "that has build_schedule_plan (Megatron-Bridge's Qwen3VLModel has none)"
        ]
    model_class = s.built_model
    if model_class is not None and not hasattr(model_class, "build_schedule_plan"):
        # Megatron-Bridge's Qwen3VLModel (models/qwen_vl/modelling_qwen3_vl/model.py) has no
        # build_schedule_plan; its own step (models/qwen_vl/qwen3_vl_step.py) and ours call it for the plan.
        return [
            f"{s.moe_overlap}=True with layout={s.layout!r}: Megatron-Core's combined 1F1B schedule asks the "
            "forward step for a schedule plan (return_schedule_plan=True), which the step builds with "
            f"model.build_schedule_plan, and the model this provider builds ({model_class.__name__}, declared by "
            f"{type(s.model).__name__}.provide) has none, so the first step fails; set {s.moe_overlap}=False"
        ]
    return []


# The rules the step runs when it builds its plan: every rule whose facts a built model and its process groups
# give (the others judge sections the step never reads).
STEP_RULES = (
    _seq_length_set_problems,
    _hybridep_problems,
    _cuda_graphs_layout_problems,
    _cuda_graphs_scope_problems,
    _moe_allgather_problems,
    _moe_routing_problems,
    _static_pipeline_problems,
    _row_lengths_problems,
    _adapter_problems,
)
