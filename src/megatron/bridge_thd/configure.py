"""Set a Megatron-Bridge config's packing flags consistently for ``megatron.bridge_thd``'s step.

::

    from megatron.bridge_thd.configure import configure
    from megatron.bridge_thd.qwen3_vl_step import forward_step

    cfg = configure(qwen3_vl_recipe_config(), layout="thd")   # same object, mutated
    finetune(cfg, forward_step_func=forward_step)

``configure(cfg, layout="thd", *, cuda_graphs=None)`` takes a Megatron-Bridge ``ConfigContainer``
(or any object with ``cfg.dataset``, ``cfg.model`` and ``cfg.train`` shaped like it), checks the
settings that decide how a micro-batch reaches the step, sets the flags below, logs what it
changed at INFO and returns ``cfg``. Every check runs before anything is written: a config it
refuses is left untouched, and the ``ValueError`` lists each problem with the setting, what is
wrong and how to fix it. Calling it twice is harmless (the second call changes nothing).

Flags it sets
-------------

| Purpose | Megatron-Bridge 0.6.2 | Megatron-Bridge main (Aug 2026) | Set by `configure` to |
| --- | --- | --- | --- |
| in-batch packing on | `dataset.enable_in_batch_packing` | same | `True` |
| same switch, design name (alias) | `dataset.pack_sequences_in_batch` * | gone | `True` (where the object takes it) |
| collate leaves packing to the step | `dataset.defer_in_batch_packing_to_step` | same | `True` |
| layout of the packed row | `dataset.packing_layout` * (ours) | (ours) | `layout` |
| the dataset's 2D mask reaches the step | `dataset.skip_getting_attention_mask_from_dataset` | same | `False` |
| fixed collate width | `dataset.pad_to_max_length` | same (forced for PP>1 or EP>1) | `True` for PP>1 or EP>1 (Bridge's rule, where the field exists) and with CUDA graphs |
| pipeline p2p exchanges shapes | `model.variable_seq_lengths`, or the hook `model._enable_in_batch_packing` | same | `True` for `"thd"` with PP>1 (see Rules); not set for the static layouts |
| HybridEP pads uneven dispatch inputs | `model.moe_hybridep_pad_uneven_dispatch_inputs` (Megatron-Core 0.19.2) | `moe_hybridep_pad_variable_tokens` in Core versions that name it so (Bridge lists both) | `True` for HybridEP without CUDA graphs (what Bridge's validate sets itself) |

`*` not a field of Megatron-Bridge's dataset config dataclasses: set as a plain attribute, so
it is lost when the config is written to YAML and read back (re-run ``configure`` after loading).
``dataset.in_batch_packing_pad_to_multiple_of`` is left to Bridge's ``validate()`` (it computes
it from CP/SP); it only matters when the collate packs, which ``defer_in_batch_packing_to_step``
turns off. The step reads ``pack_sequences_in_batch`` or ``enable_in_batch_packing``; an input that
sets only one of them counts for both.

Rules
-----

* ``layout`` is ``"thd"`` (row length varies per micro-batch), ``"thd_static"`` (row padded to
  ``micro_batch_size * round_up(seq_length, align)``) or ``"bshd"`` (padded batch).
* ``micro_batch_size == 1`` is refused, as Megatron-Bridge 0.6.2 refuses it with
  ``enable_in_batch_packing`` (``training/config.py``, ``validate``): packing one sample gains
  nothing.
* Offline packing (``dataset.enable_offline_packing``, ``offline_packing_specs``, older
  ``packed_sequence_specs``) is refused: it is mutually exclusive with in-batch packing in Bridge,
  and its batches carry ``cu_seqlens``, which the step rejects.
* ``dataset.defer_in_batch_packing_to_step=False`` set explicitly is refused: the collate would
  pack the batch itself and the step rejects a packed batch. "Explicitly" means: on a dataclass,
  a value other than the field's default (the default, ``False``, is simply overwritten); on
  any other object (e.g. ``types.SimpleNamespace``), the attribute being present.
  ``pack_sequences_in_batch`` and ``enable_in_batch_packing`` both set explicitly to different
  values are refused the same way.
* Pipeline parallelism: ``"thd"`` needs ``variable_seq_lengths=True`` (stages exchange shapes,
  the row length changes per micro-batch; without it the step falls back to ``"thd_static"``).
  On a Bridge config with a deferred ``finalize()`` and the default ``allgather`` dispatcher,
  setting it before ``finalize()`` makes Megatron-Core's post-init raise ("Token dispatcher type:
  allgather does not support variable sequence length"), also for dense models; there
  ``configure`` sets ``model._enable_in_batch_packing = True`` instead, the hook through which
  Bridge's ``TransformerConfig.finalize()`` sets ``variable_seq_lengths=True`` after that check
  (``models/transformer_config.py``), exactly as Bridge's ``validate()`` does. ``"thd_static"``
  and ``"bshd"`` leave ``variable_seq_lengths`` alone, but note that Bridge 0.6.2's
  ``validate()`` sets the hook whenever ``enable_in_batch_packing`` is on, so after it
  ``variable_seq_lengths`` is ``True`` for every layout with PP>1 (the static row lengths stay
  fixed; p2p then exchanges shapes first, which costs a ``torch.cuda.synchronize()`` per exchange
  in Megatron-Core 0.19.2's ``p2p_communication._communicate_shapes``).
* CUDA graphs (``model.cuda_graph_impl`` not in ``(None, "none")``, ``model.enable_cuda_graph``,
  ``model.external_cuda_graph``, a legacy ``full_iteration`` ``cuda_graph_scope``, or
  ``cuda_graphs=True``) need a static layout: ``"thd"`` is refused (use ``"thd_static"``),
  ``variable_seq_lengths=True`` is refused unless Bridge's own hook set it, and
  ``pad_to_max_length`` is set so the collate width is fixed. ``cuda_graphs=False`` while the
  model config enables them is refused.
* HybridEP (``model.moe_token_dispatcher_type == "flex"`` and ``model.moe_flex_dispatcher_backend
  == "hybridep"``, Megatron-Core 0.19.2 ``TransformerConfig``): with CUDA graphs the dispatch
  inputs must be equal on every rank and capture-safe, so only ``"bshd"`` is accepted (``"thd"``
  rows differ in length per rank; ``"thd_static"`` rows are equal in length but this package
  does not support packed attention with HybridEP inside CUDA graphs). Without CUDA graphs THD is
  allowed: Bridge 0.6.2 pads uneven HybridEP dispatch inputs itself
  (``_enable_safe_hybridep_dispatch``), and ``configure`` sets the same padding field.
* MoE with the ``allgather`` dispatcher and ``expert_model_parallel_size > 1``: Megatron-Core's
  allgather dispatcher gathers equal-sized token blocks over the TP x EP group, and EP ranks hold
  different micro-batches, so ``"thd"`` (row length differs per rank) is refused; use
  ``"thd_static"``/``"bshd"`` or the ``alltoall``/``flex`` dispatcher.

The attention mask
------------------

The step needs each sample's real tokens, taken from the dataset's 2D attention mask.
``configure`` sets ``skip_getting_attention_mask_from_dataset=False`` for consistency with the
other Bridge steps, but nothing depends on it for Qwen-VL: Bridge 0.6.2's Qwen-VL collate
(``models/qwen_vl/data/collate_fn.py``) always emits ``attention_mask``, the flag only decides
whether Bridge's own ``qwen3_vl_step.get_batch_from_iterator`` moves it to the GPU, and
``megatron.bridge_thd``'s step reads ``batch["attention_mask"]`` whatever the flag says.

Testing note: Megatron-Bridge 0.6.2's ``training/config.py`` (``ConfigContainer``) cannot be
imported on a CPU-only machine without extra packages: it imports
``data.builders.direct_hf_sft`` -> ``data.sources.hf`` -> ``datasets`` (not installed), and
``data.builders.mock_vlm_sft`` needs ``PIL``, ``data.builders.energon`` needs
``megatron.energon``; and ``megatron.bridge_thd.upstream``'s bare-package loader skips package
``__init__`` files, so ``data.builders.gpt_sft``'s ``from megatron.bridge.data.packing import
PackedSequenceSpecs`` fails even with those stubbed. The tests therefore run ``configure`` on
``SimpleNamespace`` configs and on Bridge's real ``models.transformer_config.TransformerConfig``
(which loads), and check the packing conditions copied from ``training/config.py`` (with a test
that the copied lines are still in the installed file).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

__all__ = [
    "configure",
    "LAYOUTS",
    "STATIC_LAYOUTS",
    "cuda_graphs_enabled",
    "uses_hybridep",
    "is_explicit",
]

logger = logging.getLogger(__name__)

LAYOUTS = ("thd", "thd_static", "bshd")
STATIC_LAYOUTS = ("thd_static", "bshd")
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


def uses_hybridep(model: Any) -> bool:
    """Whether MoE tokens go through the flex dispatcher's HybridEP backend."""
    return (
        getattr(model, "moe_token_dispatcher_type", None) == "flex"
        and getattr(model, "moe_flex_dispatcher_backend", None) == "hybridep"
    )


def is_explicit(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` was set by the user, as far as can be told.

    On a dataclass field: its value differs from the field's default (a field without a plain
    default counts as explicit). Anything else present on the object counts as explicit.
    """
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        return False
    field = getattr(obj, "__dataclass_fields__", {}).get(name) if dataclasses.is_dataclass(obj) else None
    if field is None or field.default is dataclasses.MISSING:
        return True
    return value != field.default


def _size(model: Any, name: str) -> int:
    return int(getattr(model, name, 1) or 1)


def configure(cfg: Any, layout: str = "thd", *, cuda_graphs: bool | None = None) -> Any:
    """Set ``cfg``'s packing flags for ``megatron.bridge_thd.qwen3_vl_step.forward_step``.

    Args:
        cfg: a Megatron-Bridge ``ConfigContainer`` or an object shaped like it (``cfg.dataset``,
            ``cfg.model`` (its ``.transformer`` when it has one), ``cfg.train``).
        layout: ``"thd"``, ``"thd_static"`` or ``"bshd"`` (see the module docstring).
        cuda_graphs: ``None`` reads the model config; ``True`` declares CUDA graphs the model
            config does not show; ``False`` asserts none (refused if the model enables them).

    Returns:
        ``cfg`` itself, mutated.

    Raises:
        ValueError: ``layout`` is not a known layout, or the config contradicts the step (every
            problem found is listed; nothing is changed then).
    """
    _check_arguments(layout, cuda_graphs)
    settings = _read_settings(cfg, layout, cuda_graphs)

    problems, notes = _find_problems(settings)
    if problems:
        raise ValueError("configure: the config contradicts megatron.bridge_thd's step:\n- " + "\n- ".join(problems))

    # ---- everything checked: write ----
    changes, change_notes = _plan_changes(settings)
    changed = _apply(changes)
    _log(settings, changed, notes + change_notes)
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
    hybridep: bool
    dispatcher: Any


def _check_arguments(layout: Any, cuda_graphs: Any) -> None:
    """Refuse a ``layout`` or ``cuda_graphs`` argument that ``configure`` does not know."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs: {cuda_graphs!r}; pass None (read the model config), True or False")


def _read_settings(cfg: Any, layout: str, cuda_graphs: bool | None) -> _Settings:
    """Pick ``cfg``'s sections and the parallel sizes and switches the checks and writes depend on."""
    dataset = getattr(cfg, "dataset", None)
    model_root = getattr(cfg, "model", None)
    if dataset is None or model_root is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    # Bridge's validate reads the model's transformer config this way (GPTModelConfig proxies it).
    model = getattr(model_root, "transformer", model_root)
    model_graphs = cuda_graphs_enabled(model)
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
        hybridep=uses_hybridep(model),
        dispatcher=getattr(model, "moe_token_dispatcher_type", None),
    )


# ---- step 2: collect the problems (nothing is written yet) ----


def _find_problems(s: _Settings) -> tuple[list[str], list[str]]:
    """Run every check, in the order the error lists their problems; return (problems, notes)."""
    notes: list[str] = []
    problems = [
        *_cuda_graphs_argument_problems(s),
        *_offline_packing_problems(s.dataset),
        *_packing_switch_problems(s.dataset),
        *_micro_batch_size_problems(s.train),
        *_hybridep_problems(s),
        *_cuda_graphs_layout_problems(s),
        *_variable_seq_lengths_problems(s, notes),
        *_moe_allgather_problems(s),
    ]
    return problems, notes


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


def _packing_switch_problems(dataset: Any) -> list[str]:
    """Packing switches set explicitly against the step: the two names disagree, or packing not deferred."""
    problems = []
    # The two names of the packing switch.
    if is_explicit(dataset, "enable_in_batch_packing") and is_explicit(dataset, "pack_sequences_in_batch"):
        enable, pack = getattr(dataset, "enable_in_batch_packing"), getattr(dataset, "pack_sequences_in_batch")
        if bool(enable) != bool(pack):
            problems.append(
                f"dataset.pack_sequences_in_batch={pack!r} and dataset.enable_in_batch_packing={enable!r}: both names "
                "of the same switch are set, to different values; set one of them (configure turns packing on)"
            )

    defer = getattr(dataset, "defer_in_batch_packing_to_step", None)
    if is_explicit(dataset, "defer_in_batch_packing_to_step") and not defer:
        problems.append(
            f"dataset.defer_in_batch_packing_to_step={defer!r}: with in-batch packing on, the collate then packs "
            "the micro-batch itself (cu_seqlens in the batch), and megatron.bridge_thd's step rejects packed batches; "
            "set it to True or leave it unset (configure sets it), "
            "or use Megatron-Bridge's vlm_step for collate-time packing"
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


def _hybridep_problems(s: _Settings) -> list[str]:
    """HybridEP with CUDA graphs and a layout other than ``"bshd"``: dispatch inputs must match across ranks."""
    layout = s.layout
    if not (s.graphs and s.hybridep and layout != "bshd"):
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
    # With HybridEP, _hybridep_problems already reports "thd" (one problem, not two).
    if not (s.graphs and s.layout == "thd" and not s.hybridep):
        return []
    return [
        "layout: 'thd' gives a row whose length changes every micro-batch, which CUDA graphs cannot replay; use "
        "layout='thd_static' (row padded to micro_batch_size * seq_length) or turn CUDA graphs off"
    ]


def _variable_seq_lengths_problems(s: _Settings, notes: list[str]) -> list[str]:
    """``variable_seq_lengths=True`` with CUDA graphs, unless Bridge's hook set it (then a note is appended)."""
    if not (s.graphs and getattr(s.model, "variable_seq_lengths", False)):
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


# ---- step 3: compute the changes ----


@dataclasses.dataclass(frozen=True)
class _Change:
    """One attribute to set; ``required=False`` skips an object that does not take it."""

    obj: Any
    section: str
    name: str
    value: Any
    required: bool = True


def _plan_changes(s: _Settings) -> tuple[list[_Change], list[str]]:
    """The attributes to set, in the order they are set, and the notes that explain them."""
    notes: list[str] = []
    changes = [*_dataset_changes(s), *_pipeline_changes(s, notes), *_hybridep_changes(s, notes)]
    return changes, notes


def _dataset_changes(s: _Settings) -> list[_Change]:
    """The dataset's packing flags, and ``pad_to_max_length`` where a fixed collate width is needed."""
    dataset = s.dataset
    changes = [
        _Change(dataset, "dataset", "enable_in_batch_packing", True),
        _Change(dataset, "dataset", "pack_sequences_in_batch", True, required=False),
        _Change(dataset, "dataset", "defer_in_batch_packing_to_step", True),
        _Change(dataset, "dataset", "packing_layout", s.layout),
        _Change(dataset, "dataset", "skip_getting_attention_mask_from_dataset", False),
    ]
    # Megatron-Bridge 0.6.2 training/config.py validate(): pad_to_max_length forced for PP>1 or EP>1.
    if hasattr(dataset, "pad_to_max_length") and (s.pp > 1 or s.ep > 1):
        changes.append(_Change(dataset, "dataset", "pad_to_max_length", True))
    if s.graphs:
        # Every training graph needs a static token width (Bridge's comment for offline packing).
        changes.append(_Change(dataset, "dataset", "pad_to_max_length", True))
    return changes


def _pipeline_changes(s: _Settings, notes: list[str]) -> list[_Change]:
    """For ``"thd"`` with PP>1, let p2p exchange shapes: ``variable_seq_lengths`` or Bridge's hook for it."""
    model = s.model
    if s.layout == "thd" and s.pp > 1:
        changes = []
        deferred_post_init = callable(getattr(model, "finalize", None))
        if deferred_post_init:
            changes.append(_Change(model, "model", "_enable_in_batch_packing", True))
        if deferred_post_init and s.dispatcher == "allgather":
            notes.append(
                "model.variable_seq_lengths is set to True by the model config's finalize() (hook "
                "_enable_in_batch_packing): setting it before finalize() trips Megatron-Core's allgather-dispatcher "
                "check"
            )
        else:
            changes.append(_Change(model, "model", "variable_seq_lengths", True))
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
    return [_Change(s.model, "model", name, True, required=False) for name in fields]


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


def _log(s: _Settings, changes: list[str], notes: list[str]) -> None:
    """Log at INFO the layout, the parallel sizes, what changed and the notes."""
    logger.info(
        "bridge_thd.configure: layout=%s (PP=%d, EP=%d, CUDA graphs %s); changed: %s%s",
        s.layout,
        s.pp,
        s.ep,
        "on" if s.graphs else "off",
        "; ".join(changes) if changes else "nothing",
        "".join(f"\n  note: {note}" for note in notes),
    )
