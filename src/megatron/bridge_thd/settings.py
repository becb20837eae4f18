"""Everything ``megatron.bridge_thd`` adds to a run, in one typed, frozen record (docs/settings.md).

:class:`PackingSettings` holds the packed layout, the over-long policy, global-batch packing, the length
fallback and a CP size per sample. It is validated when it is made: a value outside what a field takes is refused then, naming the setting,
what was wrong and what to set. ``configure`` makes it from its arguments and stores it as
``cfg.dataset.bridge_thd`` (:data:`SETTINGS_ATTRIBUTE`); the step's plan, the loaders and the rules read it with
:func:`settings_of`, the one reader. Whether these settings are *compatible with the rest of the run* (CUDA graphs,
pipeline shapes, MoE dispatch, ...) is the rules' job (:mod:`megatron.bridge_thd.rules`), not the record's.

A configuration made by hand, without ``configure``, may instead carry the four values as plain attributes of
``cfg.dataset`` (``packing_layout``, ``overlong_samples``, ``global_batch_packing``, ``packing_length_fallback``,
the names earlier releases of this package set): :func:`settings_of` reads them into the same record, through the
same validation. With the record present, such an attribute that says something else is refused.

What a config already holds is read here too, in one place: the stored record, the hand-set attributes, whether a
value was set explicitly (:func:`is_explicit`), and how ``configure``'s arguments are reconciled with them
(:func:`merged_settings`: the record it stores; :func:`replaced_settings`: the explicit values that record replaces).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from megatron.bridge_thd.checks import is_int_at_least
from megatron.bridge_thd.cost.sample import sample_cost
from megatron.bridge_thd.cost.step_time import MACHINES, model_shape
from megatron.bridge_thd.layouts import LAYOUT_NAMES

__all__ = ["PackingSettings", "GlobalBatchPacking", "CPPerSample", "settings_of", "holds_settings", "hand_set_values",
           "stored_settings", "merged_settings", "replaced_settings", "Replaced", "storage_problems", "is_explicit",
           "explicit_value", "MISSING", "SETTINGS_ATTRIBUTE", "OVERLONG_POLICIES", "LENGTH_FALLBACKS",
           "DEFAULT_ROW_BUCKETS", "CP_PER_SAMPLE_PLACEMENTS", "HAND_SET_ATTRIBUTES"]

# Where configure stores the record: an attribute of cfg.dataset.
SETTINGS_ATTRIBUTE = "bridge_thd"
# What happens to a sample longer than seq_length (docs/overlong-samples.md); the first is the default.
OVERLONG_POLICIES = ("truncate", "drop", "refuse")
# How lengths are read from a batch without an attention mask: None refuses such a batch (docs/lengths.md).
LENGTH_FALLBACKS = (None, "pad_token")
# Rows a thd_static run under global-batch packing may use when row_buckets is left unset.
DEFAULT_ROW_BUCKETS = 4
# Who places a step under a CP size per sample (CPPerSample.placement); the first is the default.
CP_PER_SAMPLE_PLACEMENTS = ("megatron", "time")


@dataclass(frozen=True)
class GlobalBatchPacking:
    """The run's global-batch packing setting (``PackingSettings.global_batch_packing``; docs/batching.md).

    Attributes:
        cost_model: what a sample costs: a planner preset name (``"qwen3-vl-8b"``), a Hugging Face
            ``config.json`` path or a ``plan.presets.ModelSpec``; None balances on VERL's
            tokens-and-attention proxy ``s + s^2 / 24576`` (no vision term).
        row_length: ``thd_static``: the run's fixed row in slots, checked against every loader's whole
            run when the loaders are built; None: the smallest row that fits every loader's whole run
            (training and evaluation), chosen then (never written back here: the step's plan reads it from
            ``train_state``); a resumed run chooses the same. ``thd``: ``micro_batch_size * seq_length``, checked likewise.
        row_buckets: ``thd_static``: how many fixed row lengths the run may use. The longest is the row above;
            up to ``row_buckets - 1`` shorter ones are chosen with it from the same draws, to least padding
            (:func:`megatron.bridge_thd.batching.sampler.optimal_row_lengths`), and each micro-batch takes the
            shortest that holds it. Each row is static in everything the decoder sees (length, ``cu_seqlens``
            count, ``max_seqlen``). 1: one row for the run. None (default): :data:`DEFAULT_ROW_BUCKETS`, or 1
            where only one row shape can run (fixed pipeline p2p shapes, CUDA graphs: ``rules.one_row_shape``),
            where a value above 1 is refused. ``thd`` ignores it (its row follows each micro-batch).
        lengths_file: the training set's sizes from a ``bridge-thd scan`` lengths file of it (docs/scan.md) instead of
            a scan when the loaders are built; refused when its sample count is not the dataset's. The validation and
            test sets are scanned (or read from the cache) as without it.
        sizes_cache: directory for the one-time lengths scan (default ``~/.cache/bridge_thd/sizes``); a
            directory shared by a node's ranks lets one scan serve them.
        seed: tie-breaking seed of the placement.
        log: one log line per step on global rank 0 (real tokens, padding, per-rank imbalance).
    """

    cost_model: Any = None  # a preset name, a config.json path or a plan.presets.ModelSpec (the planner's type)
    row_length: int | None = None
    row_buckets: int | None = None
    lengths_file: str | None = None
    sizes_cache: str | None = None
    seed: int = 0
    log: bool = True

    def problems(self) -> list[str]:
        """What is wrong with the values themselves (each naming the setting and what to set); empty when
        nothing is. Pure: the files the setting names are checked by :meth:`resource_problems`."""
        problems = []
        if self.row_length is not None and not is_int_at_least(self.row_length, 1):
            problems.append(f"global_batch_packing.row_length: {self.row_length!r}; expected None (chosen from the "
                            "data) or an int >= 1")
        if self.row_buckets is not None and not is_int_at_least(self.row_buckets, 1):
            problems.append(f"global_batch_packing.row_buckets: {self.row_buckets!r}; expected None (the default: "
                            f"{DEFAULT_ROW_BUCKETS}, or 1 where only one row shape can run) or an int >= 1")
        if not is_int_at_least(self.seed, 0):
            problems.append(f"global_batch_packing.seed: {self.seed!r}; expected an int >= 0")
        return problems

    def resource_problems(self) -> list[str]:
        """What the files and presets the setting names lack, checked once where the setting is made (``configure``)
        rather than wherever the record is read: a ``lengths_file`` that is not a file, a ``cost_model`` the cost
        module cannot read."""
        problems = []
        if self.lengths_file is not None and not os.path.isfile(str(self.lengths_file)):
            problems.append(f"global_batch_packing.lengths_file: {self.lengths_file!r} is not a file; write it with "
                            "bridge-thd scan (docs/scan.md), or unset it to scan the data when the loaders are built")
        if self.cost_model is not None:
            try:
                sample_cost(self.cost_model)
            except (ValueError, OSError) as error:
                problems.append(f"global_batch_packing.cost_model: {error}")
        return problems


@dataclass(frozen=True)
class CPPerSample:
    """A context-parallel size per sample (``PackingSettings.cp_per_sample``; docs/cp-per-sample.md): Megatron-Core's hybrid
    context parallelism. Each step's samples are placed on aligned blocks of 1, 2, 4, ... DP x CP ranks, packed per
    block into THD rows, and run by Megatron-Core's hybrid-CP schedule.

    Attributes:
        max_tokens_per_rank: the most tokens of one sample a rank holds (Megatron-Core's
            ``max_seqlen_per_dp_cp_rank``): a sample of ``n`` tokens runs on a power of two of ranks ``k`` with
            ``n <= k * max_tokens_per_rank`` (at least the smallest such; larger where the placement chooses), and a
            row on ``k`` ranks holds at most ``k * max_tokens_per_rank`` slots. An even int >= 2.
        placement: who places each step: ``"megatron"`` (the default: Megatron-Core's ``BalancedCPScheduler``, by
            ``s^2 / k``, groups behind barriers; needs nothing else) or ``"time"`` (ours,
            ``batching.time_placement.place_by_time``: CP sizes, blocks and rows chosen to minimise the step's time
            as the time model prices it, one group without barriers; needs ``model`` and ``gpu``).
        model: ``"time"``: the model the rows are priced for, as ``global_batch_packing.cost_model`` takes it (a
            planner preset name, a ``config.json`` path or a ``plan.presets.ModelSpec``); None reads
            ``global_batch_packing.cost_model``.
        gpu: ``"time"``: the GPU the rows are priced on (``batching.step_time.MACHINES``: ``"h100-sxm"``, ...).
    """

    max_tokens_per_rank: int
    placement: str = "megatron"
    model: Any = None
    gpu: str | None = None

    def problems(self) -> list[str]:
        """What is wrong with the values themselves (naming the setting and what to set); empty when nothing is."""
        problems = []
        value = self.max_tokens_per_rank
        if not is_int_at_least(value, 2) or value % 2:
            problems.append(f"cp_per_sample.max_tokens_per_rank: {value!r}; expected an even int >= 2 (the most tokens "
                            "of one sample a rank holds; every row is cut in 2 x CP chunks)")
        if self.placement not in CP_PER_SAMPLE_PLACEMENTS:
            problems.append(f"cp_per_sample.placement: {self.placement!r}; expected one of "
                            f"{', '.join(map(repr, CP_PER_SAMPLE_PLACEMENTS))} (Megatron-Core's scheduler, or ours on the "
                            "time model)")
        elif self.placement == "time" and self.gpu is None:
            problems.append(f"cp_per_sample.gpu: placement 'time' prices each row on the run's GPU; set gpu to one of "
                            f"{', '.join(map(repr, MACHINES))}, or placement='megatron'")
        if self.gpu is not None and str(self.gpu).strip().lower() not in MACHINES:
            problems.append(f"cp_per_sample.gpu: {self.gpu!r} has no time model; expected one of "
                            f"{', '.join(map(repr, MACHINES))}")
        if self.placement == "megatron" and (self.gpu is not None or self.model is not None):
            problems.append("cp_per_sample.model / cp_per_sample.gpu: set, but placement 'megatron' (Megatron-Core's "
                            "scheduler) does not read them; set placement='time', or unset them")
        return problems

    def resource_problems(self, cost_model: Any = None) -> list[str]:
        """``"time"``: whether the time model can read the model (``model``, else ``cost_model``, the run's
        ``global_batch_packing.cost_model``), checked once where the setting is made (``configure``)."""
        model = self.model if self.model is not None else cost_model
        if self.placement != "time" or model is None:
            return []
        try:
            model_shape(model)
        except (ValueError, OSError) as error:
            return [f"cp_per_sample.model: {error}"]
        return []


@dataclass(frozen=True)
class PackingSettings:
    """What ``megatron.bridge_thd`` adds to a run, validated when made (``ValueError`` listing every problem).

    Attributes:
        layout: the packed layout the step runs: ``"thd"``, ``"thd_static"`` or ``"bshd"`` (docs/configure.md).
            The step runs ``"bshd"`` whatever this says while in-batch packing is off
            (``dataset.enable_in_batch_packing`` / ``pack_sequences_in_batch``), and ``"thd_static"`` for ``"thd"``
            under pipeline parallelism without ``model.variable_seq_lengths`` (``layouts.layout_for``).
        overlong_samples: what happens to a sample longer than ``seq_length``: ``"truncate"`` (Megatron-Bridge's
            cut, counted in the log), ``"drop"`` (no loss from it) or ``"refuse"`` (docs/overlong-samples.md).
        global_batch_packing: place each step's samples across DP ranks and micro-batches (docs/batching.md), or
            None: Megatron-Bridge's own placement.
        length_fallback: ``"pad_token"``: a batch without an attention mask has right-padded lengths read from the
            pad id; None: such a batch is refused (docs/lengths.md).
        cp_per_sample: a CP size per sample (:class:`CPPerSample`, docs/cp-per-sample.md), placed from the lengths global-batch
            packing scans (so it needs ``global_batch_packing``, whose scan settings it uses); None: one CP size.
        packing_log: write the ``packing/*`` figures (real tokens, token slots, padding share, ...) to the loggers
            the run configured (TensorBoard, W&B, MLflow, Comet) at ``logger.log_interval`` (docs/packing-logs.md);
            on by default, a no-op without a logger; False: off.
        run_log: a path global rank 0 appends one JSON line per training iteration to (``run_log.RunLogRecord``,
            docs/packing-logs.md); None (default): no run log.
    """

    layout: str = "thd"
    overlong_samples: str = OVERLONG_POLICIES[0]
    global_batch_packing: GlobalBatchPacking | None = None
    length_fallback: str | None = None
    cp_per_sample: CPPerSample | None = None
    packing_log: bool = True
    run_log: str | None = None

    def __post_init__(self):
        problems = self._log_problems()
        if not isinstance(self.layout, str) or self.layout not in LAYOUT_NAMES:
            problems.append(f"layout: {self.layout!r} is not one of {LAYOUT_NAMES}")
        if self.overlong_samples not in OVERLONG_POLICIES:
            problems.append(f"overlong_samples: {self.overlong_samples!r}; expected one of "
                            f"{', '.join(map(repr, OVERLONG_POLICIES))}")
        if self.length_fallback not in LENGTH_FALLBACKS:
            problems.append(f"length_fallback: {self.length_fallback!r}; expected None (a batch without an attention "
                            "mask is refused) or 'pad_token'")
        batching = self.global_batch_packing
        if batching is not None and not isinstance(batching, GlobalBatchPacking):
            problems.append(f"global_batch_packing: {batching!r}; expected None or a GlobalBatchPacking (configure's "
                            "argument also takes True)")
        elif batching is not None:
            problems += batching.problems()
        if self.cp_per_sample is not None and not isinstance(self.cp_per_sample, CPPerSample):
            problems.append(f"cp_per_sample: {self.cp_per_sample!r}; expected None or a CPPerSample (configure's argument also "
                            "takes the tokens per rank as an int)")
        elif self.cp_per_sample is not None:
            problems += self.cp_per_sample.problems()
            if batching is None:
                problems.append("cp_per_sample: places each step from its samples' lengths, which global-batch packing "
                                "scans; set global_batch_packing too (configure sets its default)")
            elif (self.cp_per_sample.placement == "time" and self.cp_per_sample.model is None
                  and batching.cost_model is None):
                problems.append("cp_per_sample.model: placement 'time' prices each row with the run's model; set "
                                "cp_per_sample.model or global_batch_packing.cost_model (a preset name such as "
                                "'qwen3-vl-8b', a config.json path or a ModelSpec), or placement='megatron'")
        if problems:
            raise ValueError("dataset.bridge_thd (megatron.bridge_thd's settings):\n- " + "\n- ".join(problems))

    def _log_problems(self) -> list[str]:
        """``packing_log`` and ``run_log`` (each naming the setting, what was wrong and what to set)."""
        problems = []
        if not isinstance(self.packing_log, bool):
            problems.append(f"packing_log: {self.packing_log!r}; expected True (the packing/* figures in the run's "
                            "loggers, the default) or False (off)")
        if self.run_log is not None and (not isinstance(self.run_log, (str, os.PathLike)) or not str(self.run_log)):
            problems.append(f"run_log: {self.run_log!r}; expected None (no run log) or a file path global rank 0 "
                            "appends one JSON line per iteration to")
        elif self.run_log is not None and os.path.isdir(str(self.run_log)):
            problems.append(f"run_log: {self.run_log!r} is a directory; expected a file path (e.g. "
                            f"{os.path.join(str(self.run_log), 'run_log.jsonl')!r}) or None")
        return problems




# ---- what a config holds: the stored record, hand-set attributes, the values a user set explicitly ----

# The plain cfg.dataset attributes a hand-made configuration may carry instead of the record, by field.
HAND_SET_ATTRIBUTES = {
    "layout": "packing_layout",
    "overlong_samples": "overlong_samples",
    "global_batch_packing": "global_batch_packing",
    "length_fallback": "packing_length_fallback",
}
# An attribute that is absent, or a default that cannot be told (:func:`explicit_value`).
MISSING = object()


def stored_settings(dataset: Any) -> Any:
    """``dataset.bridge_thd`` as it stands: the record ``configure`` stored, or None (:func:`settings_of` refuses
    anything else there)."""
    return getattr(dataset, SETTINGS_ATTRIBUTE, None)  # optional: absent until configure stores the record


def hand_set_values(dataset: Any) -> dict[str, Any]:
    """The hand-set attributes of ``dataset`` that hold a value, by :class:`PackingSettings` field."""
    values = {name: getattr(dataset, attribute, None)  # optional: a hand-made config's attributes (docs/settings.md)
              for name, attribute in HAND_SET_ATTRIBUTES.items()}
    return {name: value for name, value in values.items() if value is not None}


def holds_settings(dataset: Any) -> bool:
    """Whether ``dataset`` holds our settings: the record ``configure`` stores, or hand-set attributes."""
    return stored_settings(dataset) is not None or bool(hand_set_values(dataset))


def settings_of(dataset: Any) -> PackingSettings:
    """The run's settings: ``dataset.bridge_thd`` (set by ``configure``), else the record of the hand-set
    attributes (:data:`HAND_SET_ATTRIBUTES`; unset ones keep the defaults).

    Raises:
        ValueError: a hand-set value the record does not take, or one that contradicts the stored record.
    """
    record = stored_settings(dataset)
    hand_set = hand_set_values(dataset)
    if record is None:
        try:
            return PackingSettings(**hand_set)
        except ValueError as error:
            named = ", ".join(f"dataset.{HAND_SET_ATTRIBUTES[name]}={value!r}" for name, value in hand_set.items())
            raise ValueError(f"the hand-set settings of cfg.dataset ({named}; each read as the record's field of the "
                             f"same name, packing_layout as layout): {error}") from None
    if not isinstance(record, PackingSettings):
        raise ValueError(f"dataset.{SETTINGS_ATTRIBUTE}: {record!r}; expected a megatron.bridge_thd.settings."
                         "PackingSettings (configure stores one)")
    contradicting = [f"dataset.{HAND_SET_ATTRIBUTES[name]}={value!r}" for name, value in hand_set.items()
                     if value != vars(record)[name]]
    if contradicting:
        raise ValueError(f"{', '.join(contradicting)} contradicts dataset.{SETTINGS_ATTRIBUTE} ({record}), which "
                         "configure stored; remove the attribute, or call configure again with the value you want (its "
                         "argument of the same name: layout, overlong_samples, global_batch_packing, length_fallback)")
    return record


def merged_settings(dataset: Any, given: dict[str, Any]) -> PackingSettings:
    """The record ``configure`` stores, validated when made: the fields ``given`` (its arguments); a field not given
    keeps the stored record's value, else a hand-set attribute's, else the default. A CP size per sample without
    global-batch packing gets global-batch packing's default (the scan its placement reads the lengths from)."""
    stored = stored_settings(dataset)
    held = dict(vars(stored)) if isinstance(stored, PackingSettings) else hand_set_values(dataset)
    merged = {**held, **given}
    if merged.get("cp_per_sample") is not None and merged.get("global_batch_packing") is None:
        merged["global_batch_packing"] = GlobalBatchPacking()
    try:
        return PackingSettings(**merged)
    except ValueError as error:
        kept = {} if isinstance(stored, PackingSettings) else {
            name: value for name, value in held.items() if name not in given}
        if not kept:
            raise
        named = ", ".join(f"dataset.{HAND_SET_ATTRIBUTES[name]}={value!r}" for name, value in kept.items())
        raise ValueError(f"configure: the record takes {named} from the hand-set settings: {error}") from None


class Replaced(NamedTuple):
    """A value the user set explicitly that the record ``configure`` stores replaces (refused unless ``force``)."""

    name: str  # the dataset attribute, as a message names it: ``bridge_thd.layout``, ``packing_layout``, ...
    old: Any
    new: Any
    why: str  # why the record holds ``new``
    alternative: str  # another way out, for the refusal


def replaced_settings(dataset: Any, record: PackingSettings) -> list[Replaced]:
    """The values ``record`` replaces that the user set explicitly: a stored record's other layout, and each hand-set
    attribute (a class default counts as not set, :func:`is_explicit`) that says something else than the record."""
    replaced = []
    stored = stored_settings(dataset)
    if isinstance(stored, PackingSettings) and stored.layout != record.layout:
        replaced.append(_layout_replaced(f"{SETTINGS_ATTRIBUTE}.layout", stored.layout, record.layout))
    for name, value in hand_set_values(dataset).items():
        attribute, wanted = HAND_SET_ATTRIBUTES[name], vars(record)[name]
        if value == wanted or not is_explicit(dataset, attribute):
            continue
        replaced.append(_layout_replaced(attribute, value, wanted) if name == "layout" else Replaced(
            attribute, value, wanted,
            why=f"configure stores {name}={wanted!r} in dataset.{SETTINGS_ATTRIBUTE}, the one place it is read from",
            alternative=f", or call configure with {name}={value!r}"))
    return replaced


def _layout_replaced(name: str, old: str, layout: str) -> Replaced:
    return Replaced(name, old, layout, why=f"configure was called with layout={layout!r}, and the step reads its "
                    "layout from here", alternative=", or call configure with that layout")


def storage_problems(dataset: Any) -> list[str]:
    """A dataset object that cannot hold the settings record (``configure`` checks it before writing anything)."""
    cls = type(dataset)
    try:
        vars(dataset)  # refused for an object without a __dict__
        takes_attributes = True
    except TypeError:
        slots = {name for klass in cls.__mro__ for name in vars(klass).get("__slots__", ())}
        takes_attributes = SETTINGS_ATTRIBUTE in slots
    if takes_attributes and not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
        return []
    return [f"cfg.dataset: a {cls.__name__} takes no new attribute, so configure cannot store its settings "
            f"record dataset.{SETTINGS_ATTRIBUTE} (docs/settings.md); use a dataset config that does "
            f"(Megatron-Bridge's dataset configs do), or give the class a {SETTINGS_ATTRIBUTE!r} slot"]


def _default_value(obj: Any, name: str) -> Any:
    """The value ``obj.name`` holds when nobody set it, or :data:`MISSING` when that cannot be told.

    In this order: the dataclass field's plain default; the default of the class constructor's
    parameter of that name (Megatron-Bridge's ``GPTDatasetConfig`` takes
    ``skip_getting_attention_mask_from_dataset`` in its own ``__init__``, not as a field); a plain
    class attribute. A field built by ``default_factory`` or a required one has no default here.
    """
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and name in cls.__dataclass_fields__:
        default = cls.__dataclass_fields__[name].default
        return MISSING if default is dataclasses.MISSING else default
    try:
        parameter = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):  # builtins such as SimpleNamespace have no signature
        parameter = None
    if parameter is not None:
        return MISSING if parameter.default is inspect.Parameter.empty else parameter.default
    for klass in cls.__mro__:
        if name in vars(klass):
            default = vars(klass)[name]
            descriptor = inspect.isfunction(default) or inspect.ismethoddescriptor(default) or inspect.isdatadescriptor(
                default)
            return MISSING if descriptor else default  # a property or a method is no default
    return MISSING


def explicit_value(obj: Any, name: str) -> Any:
    """``obj.name`` when the user set it, as far as can be told, else :data:`MISSING` (docs/configure.md, "How set
    explicitly is told").

    Present and different from its default (:func:`_default_value`); present without a known default (a
    ``types.SimpleNamespace`` attribute, a required field) counts as explicit. A value equal to the default cannot be
    told from the default and counts as not set.
    """
    value = getattr(obj, name, MISSING)  # optional: a setting the user's config may lack
    if value is MISSING:
        return MISSING
    default = _default_value(obj, name)
    return value if default is MISSING or value != default else MISSING


def is_explicit(obj: Any, name: str) -> bool:
    """Whether ``obj.name`` was set by the user, as far as can be told (:func:`explicit_value`)."""
    return explicit_value(obj, name) is not MISSING
