"""Opt-in: set a Megatron-Bridge config's packing flags consistently for ``megatron.bridge_thd``'s step.

::

    from megatron.bridge_thd.configure import configure
    from megatron.bridge_thd.qwen3_vl_step import forward_step

    cfg = configure(qwen3_vl_recipe_config(), layout="thd")   # same object, mutated
    finetune(cfg, forward_step_func=forward_step)

``configure(cfg, layout="thd", *, cuda_graphs=None, force=False, global_batch_packing=None,
overlong_samples=None, length_fallback=None)`` takes a Megatron-Bridge
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
from megatron.bridge_thd.rules.graphs import variable_lengths_set_by_bridge
from megatron.bridge_thd.rules.run import configure_problems
from megatron.bridge_thd.rules.setup import (  # noqa: F401 - the predicates users import from here
    Setup,
    cuda_graphs_enabled,
    effective_cuda_graph_impl,
    read_setup,
    uses_hybridep,
)
from megatron.bridge_thd.settings import (
    HAND_SET_ATTRIBUTES,
    SETTINGS_ATTRIBUTE,
    CPPerSample, GlobalBatchPacking,
    PackingSettings,
    field_names,
    hand_set_values,
)

__all__ = [
    "configure",
    "LAYOUT_NAMES",
    "cuda_graphs_enabled",
    "effective_cuda_graph_impl",
    "uses_hybridep",
    "is_explicit",
]

logger = logging.getLogger(__name__)


class FlagRule(NamedTuple):
    """One flag ``configure`` sets: a row of the flag table in ``docs/configure.md``."""

    purpose: str
    name_pinned: str  # the pinned Megatron-Bridge / Megatron-Core release (docs/compatibility.md)
    name_main: str  # Megatron-Bridge main (Aug 2026)
    set_to: str  # what configure sets it to


# Markdown cells. ``*``: not a field of Megatron-Bridge's dataset config dataclasses (FLAG_RULES_NOTE).
FLAG_RULES: tuple[FlagRule, ...] = (
    FlagRule("in-batch packing on", "`dataset.enable_in_batch_packing`", "same",
             "`True`; `False` with `train.micro_batch_size=1` (Bridge's `validate()` refuses it there; "
             "[one sample](#a-micro-batch-of-one-sample))"),
    FlagRule("same switch, design name (alias)", "`dataset.pack_sequences_in_batch` *", "gone",
             "`True` (where the object takes it; required with `train.micro_batch_size=1`, where it is the step's "
             "only switch)"),
    FlagRule("collate leaves packing to the step", "`dataset.defer_in_batch_packing_to_step`", "same", "`True`"),
    FlagRule("megatron.bridge_thd's settings: the layout, the over-long policy, global-batch packing, the length "
             "fallback", "`dataset.bridge_thd` * (ours: a `settings.PackingSettings`)", "(ours)",
             "a record of `layout` and the `overlong_samples` / `global_batch_packing` / `length_fallback` arguments "
             "([settings.md](settings.md))"),
    FlagRule("the dataset's 2D mask reaches the step", "`dataset.skip_getting_attention_mask_from_dataset`", "same",
             "`False`"),
    FlagRule("fixed collate width", "`dataset.pad_to_max_length`", "same (forced for PP>1 or EP>1)",
             "`True` for PP>1 or EP>1 (Bridge's rule, where the field exists) and with CUDA graphs"),
    FlagRule("pipeline p2p exchanges shapes",
             "`model.variable_seq_lengths`, or the hook `model._enable_in_batch_packing`", "same",
             '`True` for `"thd"` with PP>1; not set for the static layouts'),
    FlagRule("HybridEP pads uneven dispatch inputs",
             "`model.moe_hybridep_pad_uneven_dispatch_inputs` (Megatron-Core)",
             "`moe_hybridep_pad_variable_tokens` in Core versions that name it so (Bridge lists both)",
             "`True` for HybridEP without CUDA graphs (what Bridge sets itself: in `validate()` for in-batch "
             "packing, or in the model config's `finalize()` for every HybridEP config, by line)"),
    FlagRule("loss normalised per token over the whole step", "`model.calculate_per_token_loss`", "same",
             "`True` with global-batch packing"),
    FlagRule("DDP sums gradients (required with per-token loss)", "`ddp.average_in_collective`", "same",
             "`False` with global-batch packing"),
    FlagRule("a CP size per sample (Megatron-Core's hybrid context parallelism)",
             "`model.hybrid_context_parallel`, `model.max_seqlen_per_dp_cp_rank`, `model.vision_dp_when_cp`", "same",
             "`True`, `cp_per_sample.max_tokens_per_rank`, `True` with `cp_per_sample` (global-batch packing is on with it)"),
)
FLAG_RULES_NOTE = (
    "`*` not a field of Megatron-Bridge's dataset config dataclasses: set as a plain attribute, so it is lost "
    "when the config is written to YAML and read back (re-run `configure` after loading)."
)

# Megatron-Bridge's models/transformer_config.py _HYBRIDEP_PADDING_FIELDS (the pinned Megatron-Core has only
# the first; docs/compatibility.md).
HYBRIDEP_PADDING_FIELDS = ("moe_hybridep_pad_uneven_dispatch_inputs", "moe_hybridep_pad_variable_tokens")
_MISSING = object()


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


def configure(cfg: Any, layout: str = "thd", *, cuda_graphs: bool | None = None, force: bool = False,
              global_batch_packing: Any = None, overlong_samples: str | None = None,
              length_fallback: str | None = None, cp_per_sample: Any = None, packing_log: bool | None = None,
              run_log: str | None = None) -> Any:
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
        global_batch_packing: ``True`` or a :class:`megatron.bridge_thd.settings.GlobalBatchPacking`: place each
            step's samples across DP ranks and micro-batches (docs/batching.md), and Megatron-Bridge's loader
            builder is wrapped once for the process (``batching.bridge.loader_patch``); ``False``: Megatron-Bridge's
            own placement (in-batch packing); ``None``: keep what the dataset holds (unset: off).
        overlong_samples: what happens to a sample longer than ``seq_length`` (docs/overlong-samples.md):
            ``"truncate"`` (Megatron-Bridge's cut, counted in the log), ``"drop"`` (no loss from it) or
            ``"refuse"``; None keeps what the dataset holds (unset: ``"truncate"``). For Megatron-Bridge's own
            config the loader builder is wrapped once per process (``batching.bridge.loader_patch``): the loaders'
            collate measures every row before its cut.
        length_fallback: ``"pad_token"``: a batch without an attention mask has right-padded lengths read from the
            pad id (docs/megatron-bridge-step.md); None keeps what the dataset holds (unset: such a batch is refused).
        cp_per_sample: a CP size per sample (docs/cp-per-sample.md): a :class:`megatron.bridge_thd.settings.CPPerSample`
            or its ``max_tokens_per_rank`` as an int; Megatron-Core's hybrid context parallelism places and runs each
            step (``model.hybrid_context_parallel`` and its settings are set), on loaders global-batch packing builds
            (its default is set when ``global_batch_packing`` is not); ``False``: off; ``None``: keep what the dataset
            holds (unset: off).
        packing_log: the ``packing/*`` figures in the run's loggers (docs/packing-logs.md); ``False``: off; ``None``:
            keep what the dataset holds (unset: on, a no-op without a logger).
        run_log: a path global rank 0 appends one JSON line per training iteration to (docs/packing-logs.md);
            ``None``: keep what the dataset holds (unset: none).

    For Megatron-Bridge's own config, Megatron-Bridge's ``_pretrain`` is wrapped once per process
    (``packing_log.pretrain_patch``): the run's callbacks gain the packing figures' callback when the settings and
    the configured loggers ask for it (decided once per run).

    ``layout`` and the three arguments are stored as one record, ``dataset.bridge_thd``
    (:class:`megatron.bridge_thd.settings.PackingSettings`, validated when made; docs/settings.md); hand-set
    attributes it takes values from (``dataset.packing_layout``, ...) are cleared. Besides the flags, ``configure``
    gives Megatron-Bridge's ``GenericVisualInputs`` a ``pin_memory()`` so that its loader's pin thread pins the pixels
    too (``pinning.visual_inputs_pin_patch``, once per process).

    Returns:
        ``cfg`` itself, mutated.

    Raises:
        ValueError: ``layout`` is not a known layout, a setting's value is not one the record takes, or the config
            contradicts the step (every problem found is listed; nothing is changed then).
    """
    _check_arguments(layout, cuda_graphs, force)
    sections = _sections(cfg)
    record = _settings(sections.dataset, layout, global_batch_packing, overlong_samples, length_fallback, cp_per_sample,
                       packing_log=packing_log, run_log=run_log)
    setup = read_setup(cfg, layout, cuda_graphs, settings=record)

    problems = configure_problems(setup) + _record_problems(sections.dataset) + (
        record.global_batch_packing.resource_problems() if record.global_batch_packing is not None else []) + (
        record.cp_per_sample.resource_problems(record.global_batch_packing.cost_model)
        if record.cp_per_sample is not None and record.global_batch_packing is not None else [])
    changes, notes = _plan_changes(setup, sections, record)
    overrides = _explicit_overrides(changes) + _settings_overrides(sections.dataset, record)
    if not force:
        problems += [override.refusal() for override in overrides]
    if problems:
        raise ValueError("configure: the config contradicts megatron.bridge_thd's step:\n- " + "\n- ".join(problems))

    # ---- everything checked: write ----
    changed = _apply(changes)
    if record.global_batch_packing is not None or type(cfg).__module__.startswith("megatron.bridge"):
        _wrap_loader_builder()
    if type(cfg).__module__.startswith("megatron.bridge") and (record.packing_log or record.run_log):
        _wrap_pretrain()
    _pin_visual_inputs(notes)
    _log(setup, changed, notes, overrides)
    return cfg


class _Sections(NamedTuple):
    """The config objects ``configure`` writes to."""

    dataset: Any
    model: Any  # the transformer config (a provider's ``.transformer`` when it has one)
    ddp: Any


def _sections(cfg: Any) -> _Sections:
    dataset, model = getattr(cfg, "dataset", None), getattr(cfg, "model", None)
    if dataset is None or model is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    return _Sections(dataset, getattr(model, "transformer", model), getattr(cfg, "ddp", None))


def _settings(dataset: Any, layout: str, global_batch_packing: Any, overlong_samples: str | None,
              length_fallback: str | None, cp_per_sample: Any = None, *, packing_log: bool | None = None,
              run_log: str | None = None) -> PackingSettings:
    """The record ``configure`` stores, validated when made: ``layout`` and each argument given; a field not given
    keeps the stored record's value, else a hand-set attribute's (docs/settings.md), else the default. A hand-set
    value that differs from the result is an explicit setting :func:`_settings_overrides` refuses (``force`` lifts)."""
    stored = getattr(dataset, SETTINGS_ATTRIBUTE, None)
    held = {name: getattr(stored, name) for name in field_names()} if isinstance(stored, PackingSettings) else {}
    hand_set = hand_set_values(dataset)
    given: dict[str, Any] = {"layout": layout}
    if overlong_samples is not None:
        given["overlong_samples"] = overlong_samples
    if length_fallback is not None:
        given["length_fallback"] = length_fallback
    if packing_log is not None:
        given["packing_log"] = packing_log
    if run_log is not None:
        given["run_log"] = run_log
    if global_batch_packing is not None:
        given["global_batch_packing"] = GlobalBatchPacking() if global_batch_packing is True else (
            global_batch_packing or None)
    if cp_per_sample is not None:
        given["cp_per_sample"] = CPPerSample(cp_per_sample) if isinstance(cp_per_sample, int) and not isinstance(
            cp_per_sample, bool) else (cp_per_sample or None)
    merged = {**hand_set, **held, **given}
    if merged.get("cp_per_sample") is not None and merged.get("global_batch_packing") is None:
        merged["global_batch_packing"] = GlobalBatchPacking()  # the scan the placement reads its lengths from
    try:
        return PackingSettings(**merged)
    except ValueError as error:
        kept = {name: value for name, value in hand_set.items() if name not in held and name not in given}
        if not kept:
            raise
        named = ", ".join(f"dataset.{HAND_SET_ATTRIBUTES[name]}={value!r}" for name, value in kept.items())
        raise ValueError(f"configure: the record takes {named} from the hand-set settings: {error}") from None


def _settings_overrides(dataset: Any, record: PackingSettings) -> list[_Override]:
    """The values the record replaces that the user set explicitly: a stored record's other layout, and each hand-set
    attribute (a class default counts as not set, :func:`is_explicit`) that says something else than the record."""
    overrides = []
    stored = getattr(dataset, SETTINGS_ATTRIBUTE, None)
    if isinstance(stored, PackingSettings) and stored.layout != record.layout:
        overrides.append(_Override(_layout_change(dataset, f"{SETTINGS_ATTRIBUTE}.layout", record.layout), stored.layout))
    for name, attribute in HAND_SET_ATTRIBUTES.items():
        value, wanted = getattr(dataset, attribute, None), getattr(record, name)
        if value is None or value == wanted or not is_explicit(dataset, attribute):
            continue
        change = _layout_change(dataset, attribute, wanted) if name == "layout" else _Change(
            dataset, "dataset", attribute, wanted,
            why=f"configure stores {name}={wanted!r} in dataset.{SETTINGS_ATTRIBUTE}, the one place it is read from",
            alternative=f", or call configure with {name}={value!r}")
        overrides.append(_Override(change, value))
    return overrides


def _layout_change(dataset: Any, name: str, layout: str) -> _Change:
    return _Change(dataset, "dataset", name, layout,
                   why=f"configure was called with layout={layout!r}, and the step reads its layout from here",
                   alternative=", or call configure with that layout")


def _record_problems(dataset: Any) -> list[str]:
    """A dataset object that cannot hold the settings record (checked before anything is written)."""
    takes_attributes = hasattr(dataset, "__dict__") or SETTINGS_ATTRIBUTE in _slots(type(dataset))
    frozen = getattr(getattr(type(dataset), "__dataclass_params__", None), "frozen", False)
    if takes_attributes and not frozen:
        return []
    return [f"cfg.dataset: a {type(dataset).__name__} takes no new attribute, so configure cannot store its settings "
            f"record dataset.{SETTINGS_ATTRIBUTE} (docs/settings.md); use a dataset config that does (Megatron-Bridge's "
            f"dataset configs do), or give the class a {SETTINGS_ATTRIBUTE!r} slot"]


def _slots(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__slots__", ())}


def _wrap_loader_builder() -> None:
    """Megatron-Bridge's loader builder wrapped once per process (``batching.bridge.loader_patch``): the loaders'
    collate measures every row before its cut and applies the over-long policy, and global-batch packing places the
    steps. Done for Megatron-Bridge's own config (and whenever global-batch packing is on), whose loaders it builds."""
    from megatron.bridge_thd.batching.bridge import loader_patch
    from megatron.bridge_thd.upstream.patches import apply_permanently

    apply_permanently(loader_patch())


def _wrap_pretrain() -> None:
    """Megatron-Bridge's ``_pretrain`` wrapped once per process (``packing_log.pretrain_patch``): a run whose settings
    and loggers ask for the packing figures gets their callback."""
    from megatron.bridge_thd.packing_log import pretrain_patch
    from megatron.bridge_thd.upstream.patches import apply_permanently

    apply_permanently(pretrain_patch())


def _pin_visual_inputs(notes: list[str]) -> None:
    """Let Megatron-Bridge's loader pin the visual inputs in its pin thread (``pinning.visual_inputs_pin_patch``),
    or say why it cannot."""
    from megatron.bridge_thd.upstream.patches import apply_permanently
    from megatron.bridge_thd.upstream.pinning import visual_inputs_pin_patch

    try:
        apply_permanently(visual_inputs_pin_patch())
    except ValueError as error:
        notes.append(f"visual inputs stay in pageable memory: {error}")


# ---- step 1: read the settings (rules.read_setup); step 2: the problems (rules.configure_problems) ----


def _check_arguments(layout: Any, cuda_graphs: Any, force: Any) -> None:
    """Refuse a ``layout``, ``cuda_graphs`` or ``force`` argument that ``configure`` does not know."""
    if not isinstance(layout, str) or layout not in LAYOUT_NAMES:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUT_NAMES}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs: {cuda_graphs!r}; pass None (read the model config), True or False")
    if not isinstance(force, bool):
        raise ValueError(f"force: {force!r}; pass True or False")


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


def _plan_changes(s: Setup, sections: _Sections, record: PackingSettings) -> tuple[list[_Change], list[str]]:
    """The attributes to set, in the order they are set, and the notes that explain them."""
    notes: list[str] = _micro_batch_one_notes(s) + _graph_notes(s)
    changes = [*_dataset_changes(s, sections.dataset), *_settings_changes(sections.dataset, record),
               *_pipeline_changes(s, sections.model, notes), *_dense_dispatcher_changes(s, sections.model),
               *_hybridep_changes(s, sections.model, notes), *_global_batch_changes(s, sections),
               *_cp_per_sample_changes(record, sections.model)]
    return changes, notes


def _graph_notes(s: Setup) -> list[str]:
    """Why ``variable_seq_lengths=True`` with CUDA graphs is accepted where Megatron-Bridge set it."""
    if not variable_lengths_set_by_bridge(s):
        return []
    return ["model.variable_seq_lengths=True was set by Megatron-Bridge's finalize() for in-batch packing with PP>1; "
            "the static layout keeps the row length fixed, p2p only exchanges shapes"]


def _settings_changes(dataset: Any, record: PackingSettings) -> list[_Change]:
    """The record, stored as ``dataset.bridge_thd``; the hand-set attributes it took its values from are cleared
    (the record is then the one place that holds them)."""
    cleared = [_Change(dataset, "dataset", attribute, None, required=False, guarded=False)
               for attribute in HAND_SET_ATTRIBUTES.values() if getattr(dataset, attribute, None) is not None]
    return [_Change(dataset, "dataset", SETTINGS_ATTRIBUTE, record, guarded=False), *cleared]


# What one sample per micro-batch gives each layout (docs/configure.md, "A micro-batch of one sample").
_ONE_SAMPLE = {
    "thd": "a row of the one sample's real tokens: the collate's pad tail (up to seq_length where pad_to_max_length "
           "is on, as for PP>1 or EP>1) is not computed",
    "thd_static": "a row of seq_length slots, the sample and a padding tail: the same slots as 'bshd', with THD "
                  "attention and a fixed shape",
    "bshd": "the padded (1, width) layout Megatron-Bridge's own step runs",
}


def _micro_batch_one_notes(s: Setup) -> list[str]:
    """What ``train.micro_batch_size=1`` means for the layout (and for global-batch packing)."""
    if s.bridge_packing_flag:
        return []
    notes = [f"train.micro_batch_size=1: dataset.enable_in_batch_packing stays False (Megatron-Bridge refuses it with "
             f"one sample); the step's switch dataset.pack_sequences_in_batch runs layout {s.layout!r}: "
             f"{_ONE_SAMPLE[s.layout]}"]
    if s.global_batch is not None:
        notes.append("global-batch packing with train.micro_batch_size=1: every micro-batch holds one sample (a step "
                     "has as many micro-batches as samples), so it packs nothing and only balances the DP ranks")
    return notes


def _dataset_changes(s: Setup, dataset: Any) -> list[_Change]:
    """The dataset's packing flags, and ``pad_to_max_length`` where a fixed collate width is needed."""
    layout = s.layout
    packing_on = (
        f"configure turns in-batch packing on for every layout, and megatron.bridge_thd's step reads "
        f"dataset.enable_in_batch_packing and dataset.pack_sequences_in_batch as one switch, so False contradicts "
        f"layout {layout!r}"
    )
    unpacked = ", or do not call configure (train unpacked with Megatron-Bridge's own step)"
    if s.bridge_packing_flag:
        bridge_flag = _Change(dataset, "dataset", "enable_in_batch_packing", True, why=packing_on, alternative=unpacked)
    else:
        # A micro-batch of one sample: Megatron-Bridge's validate() refuses its flag, the step needs only its own
        # switch (rules.bridge_packing_flag; docs/configure.md "A micro-batch of one sample").
        bridge_flag = _Change(
            dataset, "dataset", "enable_in_batch_packing", False,
            why="with train.micro_batch_size=1 Megatron-Bridge's ConfigContainer.validate() refuses "
            "enable_in_batch_packing=True (it wants two samples to pack), and megatron.bridge_thd's step does not need "
            "it: its own switch dataset.pack_sequences_in_batch turns the layout on",
            alternative=", or raise train.micro_batch_size to 2 or more")
    changes = [
        bridge_flag,
        # The step's own switch: with Megatron-Bridge's flag off (micro-batch size 1) the only one, so required
        # for the packed layouts (the step reads "bshd" when neither name is on).
        _Change(dataset, "dataset", "pack_sequences_in_batch", True,
                required=not s.bridge_packing_flag and layout != "bshd", why=packing_on, alternative=unpacked),
        _Change(dataset, "dataset", "defer_in_batch_packing_to_step", True,
                why="with in-batch packing on, the collate then packs the micro-batch itself (cu_seqlens in the "
                "batch; Megatron-Bridge's data/datasets/direct_sft.py), and megatron.bridge_thd's step rejects "
                "packed batches",
                alternative=", or use Megatron-Bridge's vlm_step for collate-time packing"),
        _Change(dataset, "dataset", "skip_getting_attention_mask_from_dataset", False,
                why="the step takes each sample's real tokens from the dataset's 2D attention mask, which this "
                "flag asks the data path to leave out (a dataset that honours it gives the step no mask, and the "
                "step then fails at the first micro-batch)"),
    ]
    reasons = []
    # Megatron-Bridge's ConfigContainer.validate() (training/config.py): pad_to_max_length forced for PP>1 or EP>1.
    if hasattr(dataset, "pad_to_max_length") and (s.pp > 1 or s.ep > 1):
        reasons.append(
            f"Megatron-Bridge's validate() forces it True for PP>1 or EP>1 (PP={s.pp}, EP={s.ep}; "
            "training/config.py)"
        )
    if s.graphs:
        # Every training graph needs a static token width (Bridge's comment for offline packing).
        reasons.append("CUDA graphs replay fixed shapes, so the collate must pad every micro-batch to seq_length")
    if reasons:
        changes.append(_Change(dataset, "dataset", "pad_to_max_length", True, why="; and ".join(reasons)))
    return changes


def _global_batch_changes(s: Setup, sections: _Sections) -> list[_Change]:
    """Per-token loss normalisation, which makes the gradient independent of the placement."""
    if s.global_batch is None:
        return []
    cp_per_sample = s.settings.cp_per_sample is not None
    turn_off = ", or turn cp_per_sample off" if cp_per_sample else ", or turn global-batch packing off"
    why = ("cp_per_sample places each step with global-batch packing, " if cp_per_sample else "") + (
           "global-batch packing gives micro-batches and DP ranks different token counts; Megatron-Core divides "
           "each micro-batch's loss by its own tokens and the number of micro-batches unless "
           "calculate_per_token_loss is set (pipeline_parallel/schedules.py forward_step), which would weigh a "
           "token by where it was placed; per-token normalisation over the whole step keeps loss and gradients "
           "those of Megatron-Bridge's own placement")
    changes = [_Change(sections.model, "model", "calculate_per_token_loss", True, why=why, alternative=turn_off)]
    if sections.ddp is not None and hasattr(sections.ddp, "average_in_collective"):
        changes.append(_Change(
            sections.ddp, "ddp", "average_in_collective", False,
            why=("cp_per_sample needs per-token loss, and " if cp_per_sample else "")
            + "Megatron-Core's DistributedDataParallel refuses average_in_collective with calculate_per_token_loss "
              "(distributed/distributed_data_parallel.py)",
            alternative=turn_off))
    return changes


def _cp_per_sample_changes(record: PackingSettings, model: Any) -> list[_Change]:
    """A CP size per sample: Megatron-Core's hybrid context parallelism on, its per-rank limit, and the vision tower's
    frames split over a row's ranks rather than repeated on each (docs/cp-per-sample.md)."""
    if record.cp_per_sample is None:
        return []
    limit = record.cp_per_sample.max_tokens_per_rank
    why = ("cp_per_sample runs each step through Megatron-Core's hybrid-CP schedule, which Megatron-Bridge's "
           "initialize builds the hybrid groups for from this flag")
    changes = [
        _Change(model, "model", "hybrid_context_parallel", True, why=why, alternative=", or turn cp_per_sample off"),
        _Change(model, "model", "max_seqlen_per_dp_cp_rank", limit,
                why=f"cp_per_sample places samples at {limit} tokens per rank, the limit this setting names",
                alternative=f", or call configure with cp_per_sample={getattr(model, 'max_seqlen_per_dp_cp_rank', None)!r}"),
    ]
    if hasattr(model, "vision_dp_when_cp"):
        changes.append(_Change(model, "model", "vision_dp_when_cp", True, required=False,
                               why="a row's ranks split the vision tower's frames instead of each running all of them"))
    return changes


def _dense_dispatcher_changes(s: Setup, model: Any) -> list[_Change]:
    """A dense model whose config will hold ``variable_seq_lengths=True`` (``"thd"`` or Bridge's in-batch flag, with
    PP>1) leaves the ``'allgather'`` dispatcher it never uses for ``'alltoall'``: Megatron-Core's config check refuses
    the pair even without experts, and Megatron-Bridge's setup may finalize the model config again after validate()
    turned ``variable_seq_lengths`` on. (With experts: the rule ``moe_allgather`` refuses.)"""
    if not (s.pp > 1 and (s.layout == "thd" or s.bridge_packing_flag) and s.model.finalizes
            and s.model.dispatcher == "allgather" and not s.model.experts):
        return []
    return [_Change(
        model, "model", "moe_token_dispatcher_type", "alltoall", required=False,
        why="Megatron-Core's config check refuses variable_seq_lengths=True with the 'allgather' dispatcher even for a "
        "model without experts, and Megatron-Bridge's setup finalizes the model config again after validate() turned "
        "variable_seq_lengths on (in-batch packing with PP>1); a dense model dispatches no token, so nothing else "
        "changes",
        alternative=", or set pipeline_model_parallel_size=1")]


def _pipeline_changes(s: Setup, model: Any, notes: list[str]) -> list[_Change]:
    """For ``"thd"`` with PP>1, let p2p exchange shapes: ``variable_seq_lengths`` or Bridge's hook for it."""
    if s.layout == "thd" and s.pp > 1:
        changes = []
        deferred_post_init = s.model.finalizes
        if deferred_post_init:
            # Bridge's validate() sets this private hook itself whenever in-batch packing is on.
            changes.append(_Change(model, "model", "_enable_in_batch_packing", True, guarded=False))
        if deferred_post_init and s.model.dispatcher == "allgather":
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
    if s.pp > 1 and s.bridge_packing_flag:
        notes.append(
            f"layout {s.layout!r} keeps a fixed row length; Megatron-Bridge's validate() still sets "
            "variable_seq_lengths=True for in-batch packing with PP>1 (p2p then exchanges shapes)"
        )
    elif s.pp > 1 and not s.model.variable_seq_lengths:
        notes.append(
            f"layout {s.layout!r} with train.micro_batch_size=1 keeps variable_seq_lengths off: the pipeline stages "
            "exchange fixed (seq_length, 1, hidden) buffers, which the row fills exactly"
        )
    return []


def _hybridep_changes(s: Setup, model: Any, notes: list[str]) -> list[_Change]:
    """For HybridEP without CUDA graphs, the padding of uneven dispatch inputs Bridge sets itself."""
    if not (s.model.hybridep and not s.graphs):
        return []
    fields = [name for name in HYBRIDEP_PADDING_FIELDS if hasattr(model, name)] or [HYBRIDEP_PADDING_FIELDS[0]]
    notes.append(
        "HybridEP without CUDA graphs: per-rank token counts may differ; Megatron-Bridge pads "
        f"uneven HybridEP dispatch inputs ({', '.join(fields)}=True), so layout {s.layout!r} is allowed"
    )
    why = "packed rows give HybridEP different token counts per rank, and " + _bridge_hybridep_padding()
    return [_Change(model, "model", name, True, required=False, why=why) for name in fields]


def _bridge_hybridep_padding() -> str:
    """Where the installed Megatron-Bridge turns HybridEP's padding on itself (``upstream_line``'s seam)."""
    from megatron.bridge_thd.upstream.line import upstream_line

    try:
        from_validate = upstream_line().hybridep_dispatch_takes_uses_thd
    except ImportError:  # no Megatron-Bridge installed: say what either line does
        from_validate = None
    if from_validate is None:
        return ("Megatron-Bridge's _enable_safe_hybridep_dispatch (models/transformer_config.py) sets it True itself "
                "without CUDA graphs")
    if from_validate:
        return ("Megatron-Bridge's _enable_safe_hybridep_dispatch (models/transformer_config.py, called by "
                "ConfigContainer.validate()) sets it True itself for in-batch packing without CUDA graphs")
    return ("Megatron-Bridge's _enable_safe_hybridep_dispatch (models/transformer_config.py, called by "
            "TransformerConfig.finalize()) sets it True itself for every HybridEP config without CUDA graphs")


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


def _log(s: Setup, changes: list[str], notes: list[str], overrides: list[_Override]) -> None:
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


