"""Opt-in: set a Megatron-Bridge config's packing flags consistently for ``megatron.bridge_thd``'s step.

::

    from megatron.bridge_thd.configure import configure
    from megatron.bridge_thd.qwen3_vl_step import forward_step

    cfg = configure(qwen3_vl_recipe_config(), layout="thd")   # same object, mutated
    finetune(cfg, forward_step_func=forward_step)

``configure`` takes a Megatron-Bridge ``ConfigContainer`` (or any object with ``cfg.dataset``, ``cfg.model`` and
``cfg.train`` shaped like it), checks the settings that decide how a micro-batch reaches the step, sets the flags, logs
what it changed at INFO and returns ``cfg``. Every check runs before anything is written: a config it refuses is left
untouched, and the ``ValueError`` lists each problem with the settings involved, what is wrong and how to fix it. A
value the user set explicitly is never overwritten silently: when it differs from what the layout needs,
``configure`` refuses; with ``force=True`` it overwrites it and logs one WARNING line per setting. Calling it twice
with the same layout is harmless (the second call changes nothing).

This module does one job: it reads the call, builds the settings record (``settings.merged_settings``), runs the rules
registered for ``configure`` on the facts read once (``rules.setup.read_setup``, ``rules.run.configure_problems``), plans the
flags' changes and, with nothing refused, applies and logs them. Each flag (its attribute, when and to what it is set,
why, its row of the table in docs/configure.md) is one record of ``configure_flags.FLAGS``; what a config already
holds and what its user set explicitly is read by :mod:`megatron.bridge_thd.settings`. docs/configure.md.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from megatron.bridge_thd.batching.bridge import loader_patch
from megatron.bridge_thd.configure_flags import FLAGS
from megatron.bridge_thd.layouts import LAYOUT_NAMES
from megatron.bridge_thd.packing_log import pretrain_patch
from megatron.bridge_thd.rules.run import configure_problems
from megatron.bridge_thd.rules.setup import (  # noqa: F401 - the predicates users import from here
    Setup,
    cuda_graphs_enabled,
    effective_cuda_graph_impl,
    read_setup,
    uses_hybridep,
)
from megatron.bridge_thd.settings import (
    MISSING,
    SETTINGS_ATTRIBUTE,
    CPPerSample,
    GlobalBatchPacking,
    HAND_SET_ATTRIBUTES,
    PackingSettings,
    explicit_value,
    hand_set_values,
    merged_settings,
    replaced_settings,
    storage_problems,
)
from megatron.bridge_thd.upstream.patches import apply_permanently
from megatron.bridge_thd.upstream.pinning import visual_inputs_pin_patch

__all__ = ["configure", "LAYOUT_NAMES", "cuda_graphs_enabled", "effective_cuda_graph_impl", "uses_hybridep",
           "RENAMED_ARGUMENTS"]

logger = logging.getLogger(__name__)

# configure's arguments that were renamed: the old keyword -> the new one and what it takes.
RENAMED_ARGUMENTS = {
    "dynamic_cp": ("cp_per_sample", "a settings.CPPerSample, or its max_tokens_per_rank as an int; False: off"),
}


def configure(cfg: Any, layout: str = "thd", *, cuda_graphs: bool | None = None, force: bool = False,
              global_batch_packing: Any = None, overlong_samples: str | None = None,
              length_fallback: str | None = None, cp_per_sample: Any = None, packing_log: bool | None = None,
              run_log: str | None = None, **renamed: Any) -> Any:
    """Set ``cfg``'s packing flags for ``megatron.bridge_thd.qwen3_vl_step.forward_step``.

    Args:
        cfg: a Megatron-Bridge ``ConfigContainer`` or an object shaped like it (``cfg.dataset``,
            ``cfg.model`` (its ``.transformer`` when it has one), ``cfg.train``, optionally
            ``cfg.comm_overlap`` and ``cfg.ddp``).
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
            holds (unset: off). (Named ``dynamic_cp`` before; that keyword is refused, naming this one.)
        packing_log: the ``packing/*`` figures in the run's loggers (docs/packing-logs.md); ``False``: off; ``None``:
            keep what the dataset holds (unset: on, a no-op without a logger).
        run_log: a path global rank 0 appends one JSON line per training iteration to (docs/packing-logs.md);
            ``None``: keep what the dataset holds (unset: none).

    For Megatron-Bridge's own config, Megatron-Bridge's ``_pretrain`` is wrapped once per process
    (``packing_log.pretrain_patch``): the run's callbacks gain the packing figures' callback when the settings and
    the configured loggers ask for it (decided once per run).

    ``layout`` and the arguments are stored as one record, ``dataset.bridge_thd``
    (:class:`megatron.bridge_thd.settings.PackingSettings`, validated when made; docs/settings.md); hand-set
    attributes it takes values from (``dataset.packing_layout``, ...) are cleared. Besides the flags, ``configure``
    gives Megatron-Bridge's ``GenericVisualInputs`` a ``pin_memory()`` so that its loader's pin thread pins the pixels
    too (``pinning.visual_inputs_pin_patch``, once per process).

    Returns:
        ``cfg`` itself, mutated.

    Raises:
        TypeError: a keyword ``configure`` does not take (a renamed one names its new name: :data:`RENAMED_ARGUMENTS`).
        ValueError: ``layout`` is not a known layout, a setting's value is not one the record takes, or the config
            contradicts the step (every problem found is listed; nothing is changed then).
    """
    _check_arguments(layout, cuda_graphs, force, renamed)
    dataset = _dataset(cfg)
    record = merged_settings(dataset, _given(layout, global_batch_packing, overlong_samples, length_fallback,
                                             cp_per_sample, packing_log, run_log))
    setup = read_setup(cfg, layout, cuda_graphs, settings=record)

    changes, notes = _plan(setup, _sections(cfg, setup), cleared=tuple(hand_set_values(dataset)))
    overrides = _overrides(changes, dataset, record)
    problems = configure_problems(setup) + storage_problems(dataset) + _resource_problems(record)
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


# ---- step 1: read the call ----


def _check_arguments(layout: Any, cuda_graphs: Any, force: Any, renamed: dict[str, Any]) -> None:
    """Refuse a keyword ``configure`` does not take, and a ``layout``, ``cuda_graphs`` or ``force`` it does not
    know."""
    for name in renamed:
        if name not in RENAMED_ARGUMENTS:
            raise TypeError(f"configure() got an unexpected keyword argument {name!r}")
        new, takes = RENAMED_ARGUMENTS[name]
        raise TypeError(f"configure(): the argument {name} was renamed {new}; pass {new}=... instead ({takes})")
    if not isinstance(layout, str) or layout not in LAYOUT_NAMES:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUT_NAMES}")
    if cuda_graphs not in (None, True, False):
        raise ValueError(f"cuda_graphs: {cuda_graphs!r}; pass None (read the model config), True or False")
    if not isinstance(force, bool):
        raise ValueError(f"force: {force!r}; pass True or False")


def _dataset(cfg: Any) -> Any:
    """``cfg.dataset``, which holds the settings record; a config without it or without ``cfg.model`` is refused."""
    try:
        dataset, model = cfg.dataset, cfg.model
    except AttributeError:
        dataset = model = None
    if dataset is None or model is None:
        raise ValueError("cfg: needs cfg.dataset and cfg.model (a Megatron-Bridge ConfigContainer or alike)")
    return dataset


def _given(layout: str, global_batch_packing: Any, overlong_samples: str | None, length_fallback: str | None,
           cp_per_sample: Any, packing_log: bool | None, run_log: str | None) -> dict[str, Any]:
    """The record's fields the call gives: ``layout`` and each argument not None."""
    arguments = {"overlong_samples": overlong_samples, "length_fallback": length_fallback,
                 "global_batch_packing": global_batch_packing, "cp_per_sample": cp_per_sample,
                 "packing_log": packing_log, "run_log": run_log}
    given = {"layout": layout, **{name: value for name, value in arguments.items() if value is not None}}
    if "global_batch_packing" in given:  # True: the default setting; False: off
        given["global_batch_packing"] = GlobalBatchPacking() if global_batch_packing is True else (
            global_batch_packing or None)
    if "cp_per_sample" in given:  # an int: the tokens per rank; False: off
        per_rank = isinstance(cp_per_sample, int) and not isinstance(cp_per_sample, bool)
        given["cp_per_sample"] = CPPerSample(cp_per_sample) if per_rank else (cp_per_sample or None)
    return given


def _sections(cfg: Any, s: Setup) -> dict[str, Any]:
    """The config objects ``configure`` writes to, by the flags' section names."""
    model = cfg.model
    return {
        "dataset": cfg.dataset,
        "model": getattr(model, "transformer", model),  # optional: a provider's transformer config, where it has one
        "ddp": cfg.ddp if s.has_average_in_collective else None,  # the one ddp flag is set where the setting exists
    }


def _resource_problems(record: PackingSettings) -> list[str]:
    """What the files and models the record names lack (checked once, here, where the record is made)."""
    batching, per_sample = record.global_batch_packing, record.cp_per_sample
    if batching is None:
        return []
    return batching.resource_problems() + ([] if per_sample is None else per_sample.resource_problems(
        batching.cost_model))


# ---- step 2: plan the changes, and find those that would overwrite an explicit setting ----


@dataclasses.dataclass(frozen=True)
class _Change:
    """One attribute to set; ``required=False`` skips an object that does not take it.

    ``why`` says why the layout needs ``value`` and ``alternative`` another way out, both for the
    refusal when the attribute holds a different value the user set explicitly; ``guarded=False``
    marks a change that may overwrite anything (Bridge's private hook, the record).
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


def _plan(s: Setup, sections: dict[str, Any], cleared: tuple[str, ...] = ()) -> tuple[list[_Change], list[str]]:
    """The attributes to set, in the order they are set (``configure_flags.FLAGS``), and the notes that explain them.

    Storing the record clears the hand-set attributes it took its values from (``cleared``, by record field): the
    record is then the one place that holds them (docs/settings.md)."""
    changes: list[_Change] = []
    notes: list[str] = []
    for flag in FLAGS:
        notes += flag.notes(s)
        if not flag.when(s):
            continue
        value, required, why, alternative = flag.evaluated(s)
        obj = sections[flag.section]
        changes.append(_Change(obj, flag.section, flag.name, value, required, why, alternative, flag.guarded))
        if flag.name == SETTINGS_ATTRIBUTE:
            changes += [_Change(obj, "dataset", HAND_SET_ATTRIBUTES[name], None, required=False, guarded=False)
                        for name in cleared]
    return changes, notes


def _overrides(changes: list[_Change], dataset: Any, record: PackingSettings) -> list[_Override]:
    """The planned changes that would replace a value the user set explicitly (``settings.explicit_value``), then the
    explicit values the record replaces (``settings.replaced_settings``)."""
    overrides = []
    for change in changes:
        old = explicit_value(change.obj, change.name) if change.guarded else MISSING
        if old is not MISSING and old != change.value:
            overrides.append(_Override(change, old))
    return overrides + [
        _Override(_Change(dataset, "dataset", replaced.name, replaced.new, why=replaced.why,
                          alternative=replaced.alternative), replaced.old)
        for replaced in replaced_settings(dataset, record)]


# ---- step 3: apply them and log ----


def _apply(changes: list[_Change]) -> list[str]:
    """Set each attribute whose value differs; return a ``section.name: old -> new`` line per change made."""
    made: list[str] = []
    for change in changes:
        old = getattr(change.obj, change.name, MISSING)  # optional: a flag the config may not hold yet
        if old is not MISSING and old == change.value and type(old) is type(change.value):
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
        made.append(f"{change.section}.{change.name}: {'unset' if old is MISSING else repr(old)} -> {change.value!r}")
    return made


def _wrap_loader_builder() -> None:
    """Megatron-Bridge's loader builder wrapped once per process (``batching.bridge.loader_patch``): the loaders'
    collate measures every row before its cut and applies the over-long policy, and global-batch packing places the
    steps. Done for Megatron-Bridge's own config (and whenever global-batch packing is on), whose loaders it builds."""
    apply_permanently(loader_patch())


def _wrap_pretrain() -> None:
    """Megatron-Bridge's ``_pretrain`` wrapped once per process (``packing_log.pretrain_patch``): a run whose settings
    and loggers ask for the packing figures gets their callback."""
    apply_permanently(pretrain_patch())


def _pin_visual_inputs(notes: list[str]) -> None:
    """Let Megatron-Bridge's loader pin the visual inputs in its pin thread (``pinning.visual_inputs_pin_patch``),
    or say why it cannot."""
    try:
        apply_permanently(visual_inputs_pin_patch())
    except ValueError as error:
        notes.append(f"visual inputs stay in pageable memory: {error}")


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
