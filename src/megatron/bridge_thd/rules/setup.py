"""The facts every rule reads, read once from the configuration: :class:`Setup` and :class:`ModelFacts`.

This module is the only place the rules' facts are read from upstream configuration objects (Megatron-Bridge's
``ConfigContainer`` sections, Megatron-Core's ``TransformerConfig``). A rule reads a :class:`Setup` and nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from megatron.bridge_thd.adapters import ModelAdapter, family_of_model_class
from megatron.bridge_thd.layouts import LAYOUT_NAMES, bshd_alignment, thd_alignment
from megatron.bridge_thd.settings import GlobalBatchPacking, PackingSettings, settings_of

__all__ = ["Setup", "ModelFacts", "read_setup", "read_model_facts", "read_hook_setup", "cuda_graphs_enabled", "effective_cuda_graph_impl",
           "uses_hybridep", "uses_seq_aux_loss", "requested_layout", "bridge_packing_flag", "ROUTES_REAL_TOKENS_ONLY",
           "OFFLINE_PACKING", "HYBRIDEP_PADDING_FIELDS", "read_pad_id"]

# The mark of what makes a model's MoE routers see real tokens only: on moe_padding's pre-wrap hook and on the
# model classes it creates (the step reads it off the built model).
ROUTES_REAL_TOKENS_ONLY = "bridge_thd_routes_real_tokens_only"
# Offline (pre-packed dataset) settings: current names, then the older ``packed_sequence_specs``.
OFFLINE_PACKING = ("enable_offline_packing", "offline_packing_specs", "packed_sequence_specs")
# Megatron-Bridge's models/transformer_config.py _HYBRIDEP_PADDING_FIELDS: the names of HybridEP's padding of uneven
# dispatch inputs, by Megatron-Core version (the pinned one has only the first; docs/compatibility.md).
HYBRIDEP_PADDING_FIELDS = ("moe_hybridep_pad_uneven_dispatch_inputs", "moe_hybridep_pad_variable_tokens")


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


def uses_seq_aux_loss(config: Any) -> bool:
    """Whether ``moe_router_load_balancing_type`` (a name or a list of names) includes ``seq_aux_loss``."""
    return "seq_aux_loss" in _names(getattr(config, "moe_router_load_balancing_type", None))


def _names(value: Any) -> tuple[str, ...]:
    """A setting that holds a name or a list of names, as a tuple of names."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (value,)


def _graph_modules(model: Any) -> frozenset[str]:
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
    return frozenset(names)


def _graph_setting(model: Any) -> str:
    """The model setting that turns CUDA graphs on, as ``name=value`` for a message."""
    impl = getattr(model, "cuda_graph_impl", "none")
    if impl not in (None, "none"):
        return f"model.cuda_graph_impl={impl!r}"
    name = "enable_cuda_graph" if getattr(model, "enable_cuda_graph", False) else "external_cuda_graph"
    return f"model.{name}=True (Megatron-Core's post-init makes it cuda_graph_impl={effective_cuda_graph_impl(model)!r})"


def _setting(model: Any, model_root: Any, name: str, default: Any = None) -> Any:
    """A model setting from the transformer config, else the model section (a provider proxies it)."""
    value = getattr(model, name, None)
    if value is None:
        value = getattr(model_root, name, None)
    return default if value is None else value


def _size(model: Any, name: str) -> int:
    return int(getattr(model, name, 1) or 1)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the rules read of the transformer config (:func:`read_model_facts`).

    Attributes:
        seq_length: ``model.seq_length`` (None: not set).
        sequence_parallel, fp8, variable_seq_lengths: the settings of those names (``fp8``: a recipe is set).
        in_batch_packing_hook: Megatron-Bridge's private ``_enable_in_batch_packing`` hook is set.
        finalizes: the config has Megatron-Bridge's deferred post-init (``finalize()``).
        graphs: the config enables training CUDA graphs (:func:`cuda_graphs_enabled`).
        graph_impl: ``cuda_graph_impl`` after Megatron-Core's post-init (:func:`effective_cuda_graph_impl`).
        graph_setting: the setting that turns them on, as a message names it.
        graph_switches: ``cuda_graph_impl``, ``enable_cuda_graph``, ``external_cuda_graph`` as set, for messages.
        graph_modules: ``cuda_graph_modules`` as lower-case names (empty: the whole layer).
        hybridep: the flex dispatcher's HybridEP backend.
        dispatcher: ``moe_token_dispatcher_type``.
        experts: ``num_moe_experts`` (0 for a dense model).
        capacity_factor: ``moe_expert_capacity_factor``.
        token_drop_policy: ``moe_token_drop_policy``.
        load_balancing: ``moe_router_load_balancing_type`` as names.
        recompute_granularity, recompute_modules: the recompute settings.
        mlp_chunks: ``mlp_chunks_for_training``.
        moe_overlap: ``overlap_moe_expert_parallel_comm``.
        sizes: ``(tp, cp, pp, ep)`` from the ``*_parallel_size`` settings.
        class_name: the config's class (messages).
        cp_per_sample: ``hybrid_context_parallel`` (Megatron-Core's CP size per sample).
        max_tokens_per_rank: ``max_seqlen_per_dp_cp_rank`` (its per-rank token limit).
        per_token_loss: ``calculate_per_token_loss``.
        vision_dp_when_cp: ``vision_dp_when_cp`` (Megatron-Bridge's Qwen3-VL splits the vision tower over CP).
        mtp_layers: ``mtp_num_layers`` (0: none).
        linear_attention: ``experimental_attention_variant`` (Gated DeltaNet: ``"gated_delta_net"``, or ``"gdn"`` on
            the 0.7 line's Megatron-Core; None: none).
        linear_heads: ``(linear_num_key_heads, linear_num_value_heads)`` of a Gated DeltaNet (0: unset).
        hybridep_padding_fields: the names of :data:`HYBRIDEP_PADDING_FIELDS` the config has.
        has_vision_dp_when_cp: the config has ``vision_dp_when_cp`` (Megatron-Bridge's Qwen3-VL providers).
        spatial_merge_size: the vision tower's spatial merge (image tokens = patches / merge^2): the config's
            ``spatial_merge_size``, else its ``vision_config``'s, else Qwen-VL's 2.
        vision_token_ids: the image and video placeholder ids (``image_token_id``, ``video_token_id``) that are set.
        image_token_id, video_token_id, vision_start_token_id: the placeholder ids themselves (None: not set), as the
            model family's adapter reads them (``adapters.ModelAdapter.tokens``).
    """

    seq_length: int | None = None
    sequence_parallel: bool = False
    fp8: bool = False
    variable_seq_lengths: bool = False
    in_batch_packing_hook: bool = False
    finalizes: bool = False
    graphs: bool = False
    graph_impl: str = "none"
    graph_setting: str = ""
    graph_switches: str = ""
    graph_modules: frozenset[str] = frozenset()
    hybridep: bool = False
    dispatcher: str | None = None
    experts: int = 0
    capacity_factor: float | None = None
    token_drop_policy: str = "probs"
    load_balancing: tuple[str, ...] = ()
    recompute_granularity: str | None = None
    recompute_modules: tuple[str, ...] = ()
    mlp_chunks: int = 1
    moe_overlap: bool = False
    sizes: tuple[int, int, int, int] = (1, 1, 1, 1)
    class_name: str = ""
    cp_per_sample: bool = False
    max_tokens_per_rank: int | None = None
    per_token_loss: bool = False
    vision_dp_when_cp: bool = False
    mtp_layers: int = 0
    linear_attention: str | None = None
    linear_heads: tuple[int, int] = (0, 0)
    hybridep_padding_fields: tuple[str, ...] = ()
    has_vision_dp_when_cp: bool = False
    spatial_merge_size: int = 2
    vision_token_ids: tuple[int, ...] = ()
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None

    @property
    def seq_aux_loss(self) -> bool:
        return "seq_aux_loss" in self.load_balancing


def read_model_facts(model: Any, model_root: Any = None) -> ModelFacts:
    """The :class:`ModelFacts` of a transformer config (``model_root``: the model section a provider proxies,
    read where the config lacks a setting)."""
    return ModelFacts(
        seq_length=_setting(model, model_root, "seq_length"),
        sequence_parallel=bool(_setting(model, model_root, "sequence_parallel", False)),
        fp8=bool(_setting(model, model_root, "fp8", None)),  # Megatron: a recipe name or None
        variable_seq_lengths=bool(_setting(model, model_root, "variable_seq_lengths", False)),
        in_batch_packing_hook=bool(getattr(model, "_enable_in_batch_packing", False)),
        finalizes=callable(getattr(model, "finalize", None)),
        graphs=cuda_graphs_enabled(model),
        graph_impl=effective_cuda_graph_impl(model),
        graph_setting=_graph_setting(model),
        graph_switches=", ".join(f"{name}={getattr(model, name, None)!r}" for name in
                                 ("cuda_graph_impl", "enable_cuda_graph", "external_cuda_graph")),
        graph_modules=_graph_modules(model),
        hybridep=uses_hybridep(model),
        dispatcher=getattr(model, "moe_token_dispatcher_type", None),
        experts=int(getattr(model, "num_moe_experts", None) or 0),
        capacity_factor=getattr(model, "moe_expert_capacity_factor", None),
        token_drop_policy=getattr(model, "moe_token_drop_policy", None) or "probs",
        load_balancing=_names(getattr(model, "moe_router_load_balancing_type", None)),
        recompute_granularity=getattr(model, "recompute_granularity", None),
        recompute_modules=_names(getattr(model, "recompute_modules", None)),
        mlp_chunks=int(getattr(model, "mlp_chunks_for_training", 1) or 1),
        moe_overlap=bool(getattr(model, "overlap_moe_expert_parallel_comm", False)),
        sizes=tuple(_size(model, f"{name}_parallel_size") for name in  # type: ignore[arg-type]
                    ("tensor_model", "context", "pipeline_model", "expert_model")),
        class_name=type(model).__name__,
        cp_per_sample=bool(_setting(model, model_root, "hybrid_context_parallel", False)),
        max_tokens_per_rank=_setting(model, model_root, "max_seqlen_per_dp_cp_rank"),
        per_token_loss=bool(_setting(model, model_root, "calculate_per_token_loss", False)),
        vision_dp_when_cp=bool(_setting(model, model_root, "vision_dp_when_cp", False)),
        mtp_layers=int(_setting(model, model_root, "mtp_num_layers", 0) or 0),
        linear_attention=_setting(model, model_root, "experimental_attention_variant"),
        linear_heads=(int(_setting(model, model_root, "linear_num_key_heads", 0) or 0),
                      int(_setting(model, model_root, "linear_num_value_heads", 0) or 0)),
        hybridep_padding_fields=tuple(name for name in HYBRIDEP_PADDING_FIELDS if hasattr(model, name)),
        has_vision_dp_when_cp=hasattr(model, "vision_dp_when_cp"),
        spatial_merge_size=int(_setting(model, model_root, "spatial_merge_size")
                               or getattr(_setting(model, model_root, "vision_config"), "spatial_merge_size", None) or 2),
        vision_token_ids=tuple(int(i) for i in (_setting(model, model_root, "image_token_id"),
                                                _setting(model, model_root, "video_token_id")) if i is not None),
        image_token_id=_setting(model, model_root, "image_token_id"),
        video_token_id=_setting(model, model_root, "video_token_id"),
        vision_start_token_id=_setting(model, model_root, "vision_start_token_id"),
    )


def bridge_packing_flag(micro_batch_size: int | None) -> bool:
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
    (``dataset.pack_sequences_in_batch`` / ``enable_in_batch_packing``), else the settings' layout
    (:func:`megatron.bridge_thd.settings.settings_of`, default ``"thd"``)."""
    packing = bool(getattr(dataset, "pack_sequences_in_batch", False) or getattr(dataset, "enable_in_batch_packing",
                                                                              False))
    return settings_of(dataset).layout if packing else "bshd"


@dataclasses.dataclass(frozen=True)
class Setup:
    """The facts every rule reads (:func:`read_setup`): the configuration and what is resolved from it once.

    ``configure`` builds it from the config alone; the step builds it when it makes its plan, from the same config
    plus the built model's config, the process groups and the model itself (``built``); the planner from its options;
    the MoE hook from the model config alone. ``layout`` is the layout being judged: the one requested in
    ``configure``, the one that runs in the step.

    Attributes:
        layout: the layout judged.
        settings: the run's :class:`~megatron.bridge_thd.settings.PackingSettings` (its ``layout`` is the one asked
            for; the rules judge ``layout``).
        model: the transformer config's facts.
        tp, cp, pp, ep, dp: the parallel sizes (``dp`` None where unknown: ``configure``).
        cuda_graphs: ``configure``'s ``cuda_graphs`` argument as passed (None elsewhere).
        moe_overlap: the setting that turns MoE EP communication overlap on, if any.
        seq_lengths: ``(dataset.seq_length, model.seq_length)``.
        offline_packing: the offline packing settings that are on, as ``(name, repr(value))``.
        packing_buffer_size: ``dataset.packing_buffer_size`` (Energon's own packing, on where it is not None).
        dataloader_type: ``dataset.dataloader_type``.
        micro_batch_size, global_batch_size: ``train``'s.
        built_model: the model class the provider's ``provide()`` declares (``configure``) or the built one (step).
        built_model_plans: that class has ``build_schedule_plan`` (None: unknown).
        provider: the model section's class (messages).
        family: the model family (:mod:`megatron.bridge_thd.adapters`), when known.
        routes_real_tokens_only: the MoE routers see real tokens only (the padding-mask hook).
        row_lengths: ``thd_static`` under global-batch packing: the run's rows, ascending (the step).
        built: the model config is final (the step; the loaders, which Megatron-Bridge builds after its
            ``finalize()``; the hook): its ``variable_seq_lengths`` is read as it is, not foreseen.
        te_cp_padding_defect: the installed Transformer Engine's CP padding defect, if any (the step).
        length_fallback_pad_id: the pad id the length fallback reads (the step; None: none found).
        processor_path: ``dataset.hf_processor_path``, the Hugging Face processor of Megatron-Bridge's VLM datasets
            (None: the dataset has none; ``bridge-thd scan`` reads it).
        has_pad_to_max_length: the dataset config has ``pad_to_max_length`` (Megatron-Bridge's fixed collate width).
        has_average_in_collective: the config has a ``ddp`` section with ``average_in_collective``.
        check_nan, check_spiky: Megatron-Bridge's loss checks (``rerun_state_machine.check_for_nan_in_loss`` /
            ``check_for_spiky_loss``; its defaults without that section).
    """

    layout: str
    settings: PackingSettings = PackingSettings()
    model: ModelFacts = ModelFacts()
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int | None = None
    cuda_graphs: bool | None = None
    moe_overlap: str | None = None
    seq_lengths: tuple[int | None, int | None] = (None, None)
    offline_packing: tuple[tuple[str, str], ...] = ()
    packing_buffer_size: int | None = None
    dataloader_type: str | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    built_model: str | None = None
    built_model_plans: bool | None = None
    provider: str = ""
    family: ModelAdapter | None = None
    routes_real_tokens_only: bool = False
    row_lengths: tuple[int, ...] = ()
    built: bool = False
    te_cp_padding_defect: str | None = None
    length_fallback_pad_id: int | None = None
    processor_path: str | None = None
    has_pad_to_max_length: bool = False
    has_average_in_collective: bool = False
    check_nan: bool = True
    check_spiky: bool = False

    @property
    def cp_per_sample(self) -> bool:
        """A CP size per sample: asked for (``cp_per_sample``, which ``configure`` turns into the model's flag) or set on
        the model (``hybrid_context_parallel``)."""
        return self.settings.cp_per_sample is not None or self.model.cp_per_sample

    @property
    def global_batch(self) -> GlobalBatchPacking | None:
        return self.settings.global_batch_packing

    @property
    def graphs(self) -> bool:
        """CUDA graphs on, from the model config or ``configure``'s argument."""
        return self.model.graphs or bool(self.cuda_graphs)

    @property
    def bridge_packing_flag(self) -> bool:
        """Whether ``configure`` turns Megatron-Bridge's ``dataset.enable_in_batch_packing`` on (see
        :func:`bridge_packing_flag`)."""
        return bridge_packing_flag(self.micro_batch_size)

    @property
    def variable_lengths_on_build(self) -> bool:
        """PP>1 and the model config holds ``variable_seq_lengths=True`` when the model is built: set by the user, by
        Megatron-Bridge's ``finalize()`` through the hook its ``validate()`` sets for in-batch packing, or by
        ``configure`` for ``"thd"``; where the config is final (``built``), as it says."""
        if self.built:
            return self.pp > 1 and self.model.variable_seq_lengths
        return self.pp > 1 and (self.model.variable_seq_lengths or self.bridge_packing_flag or self.layout == "thd")

    @property
    def variable_lengths_when_run(self) -> bool:
        """Like :attr:`variable_lengths_on_build`, but the in-batch flag counts only where a ``finalize()`` will turn
        Megatron-Bridge's hook into ``variable_seq_lengths`` (its own model configs): a config without one keeps
        fixed pipeline shapes whatever the flag."""
        if self.built:
            return self.pp > 1 and self.model.variable_seq_lengths
        return self.pp > 1 and (self.model.variable_seq_lengths or self.layout == "thd"
                                or (self.bridge_packing_flag and self.model.finalizes))

    @property
    def pipeline_graphs(self) -> bool:
        """PP>1 with CUDA graphs in the model config and variable sequence lengths: Qwen3VLModel refuses to build."""
        return self.model.graph_impl != "none" and self.variable_lengths_on_build

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
        """Pipeline stages exchange fixed-shape buffers (PP>1 without ``variable_seq_lengths`` when the model is
        built)."""
        return self.pp > 1 and not self.variable_lengths_when_run

    @property
    def align(self) -> int:
        """The alignment of the judged layout: every THD slot's, or the padded layout's width divisor."""
        if self.layout == "bshd":
            return bshd_alignment(self.tp, self.cp)
        return thd_alignment(self.tp, self.cp, sequence_parallel=self.model.sequence_parallel, fp8=self.model.fp8)


def read_hook_setup(model_config: Any) -> Setup:
    """The :class:`Setup` the MoE padding hook judges: the model config alone, with routers that see real tokens
    only (what the hook makes them)."""
    return Setup(layout="thd", model=read_model_facts(model_config), routes_real_tokens_only=True, built=True)


def _moe_overlap_setting(cfg: Any, model: ModelFacts) -> str | None:
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
    return "model.overlap_moe_expert_parallel_comm" if model.moe_overlap else None


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


def _offline_packing(dataset: Any) -> tuple[tuple[str, str], ...]:
    """The offline packing settings that are on, as ``(name, repr(value))``."""
    values = ((name, getattr(dataset, name, None)) for name in OFFLINE_PACKING)
    return tuple((name, repr(value)) for name, value in values if value is not None and value is not False)


def read_setup(cfg: Any, layout: str, cuda_graphs: bool | None = None, global_batch: Any = None, *,
               settings: PackingSettings | None = None, model_config: Any = None, sizes: dict[str, int] | None = None,
               routes_real_tokens_only: bool | None = None, adapter: Any = None, row_lengths: tuple[int, ...] = (),
               built_model: type | None = None, te_cp_padding_defect: str | None = None,
               length_fallback_pad_id: int | None = None, dp: int | None = None, final: bool = False) -> Setup:
    """The :class:`Setup` of ``cfg`` for ``layout``.

    ``configure`` passes the config and the settings it is about to store (``settings``, or ``global_batch`` alone:
    the others then come from ``cfg.dataset``). The step also passes what only a built model knows: its
    ``model_config`` (read before ``cfg.model``), the process-group ``sizes`` (``tp``, ``cp``, ``pp``, ``ep``),
    whether its MoE routers see real tokens only, its ``adapter``, global-batch packing's rows, the model class it
    built, the Transformer Engine defect found and the length fallback's pad id. The loaders pass the DP size and
    ``final`` (Megatron-Bridge builds them after its ``finalize()``: the model config is read as it is).
    """
    dataset = getattr(cfg, "dataset", None)
    model_root = getattr(cfg, "model", None)
    if dataset is None or model_root is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    if layout not in LAYOUT_NAMES:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUT_NAMES}")
    if settings is None:  # the stored record (its layout is the one asked for; ``layout`` is the one judged)
        settings = settings_of(dataset)
        if global_batch is not None:
            settings = dataclasses.replace(settings, global_batch_packing=global_batch)
    # Bridge's validate reads the model's transformer config this way (GPTModelConfig proxies it).
    built = model_config is not None or final
    model = read_model_facts(model_config if model_config is not None else getattr(model_root, "transformer", model_root),
                             model_root)
    if routes_real_tokens_only is None:
        # moe_padding.padding_mask_pre_wrap_hook carries this mark.
        hooks = tuple(getattr(model_root, "_pre_wrap_hooks", None) or ())
        routes_real_tokens_only = any(getattr(hook, ROUTES_REAL_TOKENS_ONLY, False) for hook in hooks)
    tp, cp, pp, ep = model.sizes if sizes is None else (sizes["tp"], sizes["cp"], sizes["pp"], sizes["ep"])
    model_class = built_model if built_model is not None else _built_model_class(model_root)
    if adapter is None and model_class is not None:
        adapter = family_of_model_class(model_class)
    train = getattr(cfg, "train", None)
    rerun = getattr(cfg, "rerun_state_machine", None)
    return Setup(
        layout=layout, settings=settings, model=model, tp=tp, cp=cp, pp=pp, ep=ep, dp=dp, cuda_graphs=cuda_graphs,
        moe_overlap=_moe_overlap_setting(cfg, model),
        seq_lengths=(getattr(dataset, "seq_length", None), model.seq_length),
        offline_packing=_offline_packing(dataset), packing_buffer_size=getattr(dataset, "packing_buffer_size", None),
        dataloader_type=getattr(dataset, "dataloader_type", None),
        micro_batch_size=getattr(train, "micro_batch_size", None),
        global_batch_size=getattr(train, "global_batch_size", None),
        built_model=model_class.__name__ if model_class is not None else None,
        built_model_plans=hasattr(model_class, "build_schedule_plan") if model_class is not None else None,
        provider=type(model_root).__name__, family=adapter, routes_real_tokens_only=bool(routes_real_tokens_only),
        row_lengths=tuple(row_lengths), built=built, te_cp_padding_defect=te_cp_padding_defect,
        length_fallback_pad_id=length_fallback_pad_id, processor_path=getattr(dataset, "hf_processor_path", None),
        has_pad_to_max_length=hasattr(dataset, "pad_to_max_length"),
        has_average_in_collective=hasattr(getattr(cfg, "ddp", None), "average_in_collective"),
        check_nan=bool(getattr(rerun, "check_for_nan_in_loss", True)),
        check_spiky=bool(getattr(rerun, "check_for_spiky_loss", False)),
    )


def read_pad_id(tokenizer: Any, model_config: Any) -> int | None:
    """The pad id the length fallback ``"pad_token"`` reads: the tokenizer's (``pad_id``, then ``pad_token_id``), else
    the model config's (its ``text_config``'s where it has one); None where none is set."""
    pad_id = getattr(tokenizer, "pad_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(getattr(model_config, "text_config", model_config), "pad_token_id", None)
    return pad_id
