"""The step's plan: everything decided once per run, as one frozen record (docs/step-plan.md).

In the spirit of Megatron-Core's ``PackedSeqParams``: data only. :func:`build_step_plan` reads the config (through
:mod:`megatron.bridge_thd.rules`' ``Setup``), the built model (its config, its ``forward`` signature, its MoE
routing), the process groups and the model family's adapter once, runs the refusal rules, checks the static rows
the packer will take, and returns a :class:`StepPlan`. The per-micro-batch path
(:mod:`~megatron.bridge_thd.step.prepare`, :mod:`~megatron.bridge_thd.step.forward`) reads only the plan: no config
lookups, no signature inspection, no re-validation.

What global-batch packing decides when the loaders are built (the run's static row) reaches the plan through
:class:`GlobalBatchRows`, recorded on Megatron-Bridge's ``state.train_state`` (runtime state, not the user's
config) by :mod:`megatron.bridge_thd.batching.bridge`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass
import torch

from megatron.bridge_thd.adapters import ModelAdapter, VisionTokens
from megatron.bridge_thd.layouts import layout_for, static_row_length, thd_alignment
from megatron.bridge_thd.packing import check_static_row, round_up
from megatron.bridge_thd.rules.moe import layout_dependent_moe_settings
from megatron.bridge_thd.rules.registry import STEP
from megatron.bridge_thd.rules.run import refuse
from megatron.bridge_thd.rules.setup import (
    ROUTES_REAL_TOKENS_ONLY, read_model_facts, read_pad_id, read_setup, requested_layout,
)
from megatron.bridge_thd.settings import settings_of
from megatron.bridge_thd.cp_per_sample import CPPerSampleStep, find_cp_group_holders
from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.line import upstream_line
from megatron.bridge_thd.upstream.te_compat import te_cp_padding_verdict

__all__ = ["StaticRow", "GlobalBatchRows", "StepPlan", "build_step_plan", "in_batch_static_row", "unwrap_model",
           "OPTIONAL_MODEL_EXTRAS", "ROWS_ATTRIBUTE"]

logger = logging.getLogger(__name__)

# Extras a model may take under these exact parameter names; never passed into **kwargs.
OPTIONAL_MODEL_EXTRAS = ("padding_mask", "rope_cu_seqlens")
# Where global-batch packing records its rows: an attribute of Megatron-Bridge's TrainState.
ROWS_ATTRIBUTE = "bridge_thd_rows"


@dataclass(frozen=True)
class StaticRow:
    """A THD row that is static for CUDA graphs: the same in every micro-batch of a run.

    Attributes:
        length: N, the row's token slots.
        segments: S, the number of segments; ``cu_seqlens`` and ``cu_seqlens_padded`` always have S + 1
            entries. A micro-batch of B samples fills B segments, the row's tail one more, and the rest are
            zero-length segments at N (what Megatron-Core's ``pad_thd_for_cuda_graph`` does).
        max_seqlen: ``max_seqlen_q`` / ``max_seqlen_kv``, a bound of every real segment (a multiple of the
            alignment).
    """

    length: int
    segments: int
    max_seqlen: int

    @property
    def max_samples(self) -> int:
        """The most samples a micro-batch may carry (one segment is the tail)."""
        return self.segments - 1


def in_batch_static_row(micro_batch_size: int, seq_length: int, align: int) -> StaticRow:
    """``thd_static`` with Megatron-Bridge's own placement: ``micro_batch_size`` slots of ``round_up(seq_length,
    align)``, one segment per sample plus the tail."""
    length = static_row_length(micro_batch_size, seq_length=seq_length, align=align)  # the planner's count too
    return StaticRow(length=length, segments=micro_batch_size + 1, max_seqlen=round_up(seq_length, align))


@dataclass(frozen=True)
class GlobalBatchRows:
    """What global-batch packing decided for ``thd_static`` when the loaders were built: the run's rows, by
    ascending length (``global_batch_packing.row_buckets`` at most); a micro-batch takes the shortest
    that holds its aligned tokens (``layouts.row_bucket``)."""

    rows: tuple[StaticRow, ...]

    def __post_init__(self):
        if not self.rows or list(self.rows) != sorted(self.rows, key=lambda row: row.length) or len(
                {row.length for row in self.rows}) != len(self.rows):
            raise ValueError(f"rows: expected distinct StaticRows by ascending length, got {self.rows!r}")


@dataclass(frozen=True)
class StepPlan:
    """Everything the per-micro-batch path needs, decided once (:func:`build_step_plan`).

    Attributes:
        layout: the layout that runs (``"thd"``, ``"thd_static"`` or ``"bshd"``).
        tp, cp, pp, ep: the process-group sizes.
        seq_length: what samples are truncated to.
        align: every THD slot's alignment, or the padded layout's width divisor.
        micro_batch_size: ``train.micro_batch_size`` (None outside a trainer).
        static_rows: ``thd_static``: the run's rows by ascending length (one, unless global-batch packing chose
            several: each micro-batch takes the shortest that holds it); empty otherwise (and for a static row
            sized per batch outside a trainer).
        fixed_p2p_shapes: pipeline stages exchange fixed-shape buffers (PP>1 without ``variable_seq_lengths``).
        p2p_micro_batch_size: ``thd_static`` with fixed p2p shapes: the batch size of those buffers.
        extras: the optional extras the model's ``forward`` declares (passed); ``extras_refused``: the others.
        padding_mask_cut_for_cp: the step cuts ``padding_mask`` for context parallelism before the call: where
            Megatron-Bridge's ``Qwen3VLModel`` declares ``padding_mask`` itself (``upstream_line``) it takes a given
            mask cut as it cuts its row, and no hook (``moe_padding.with_padding_mask``) cuts it (CP > 1 only).
        tokens: the family's constants (the adapter's ``tokens(model_config)``: vision token ids, merge size).
        uncuttable: the token ids truncation to ``seq_length`` must not cut (``tokens.uncuttable``).
        adapter: the model family (:mod:`megatron.bridge_thd.adapters`).
        pad_token_id: the pad id lengths fall back to without a mask (``length_fallback=
            "pad_token"``), or None (a batch without a mask is refused).
        overlong_samples: the over-long policy (``overlong_samples``, :mod:`megatron.bridge_thd.overlong`),
            which the loaders' collate applies; the step logs what it cut.
        check_nan, check_spiky: Megatron-Bridge's loss checks (``rerun_state_machine``).
        device: where the model's parameters are.
        model_name: the model's class name (logs).
        builds_schedule_plan: the model has ``build_schedule_plan`` (Megatron-Core's MoE overlap schedule plan,
            ``return_schedule_plan``).
        cp_per_sample: Megatron-Core's ``hybrid_context_parallel``: a CP size per row, the alignment of each and where
            the model keeps its CP group (:class:`~megatron.bridge_thd.cp_per_sample.CPPerSampleStep`); None
            otherwise.
    """

    layout: str
    tp: int
    cp: int
    pp: int
    ep: int
    seq_length: int
    align: int
    micro_batch_size: int | None
    static_rows: tuple[StaticRow, ...]
    fixed_p2p_shapes: bool
    p2p_micro_batch_size: int | None
    extras: tuple[str, ...]
    extras_refused: tuple[str, ...]
    padding_mask_cut_for_cp: bool
    tokens: VisionTokens
    uncuttable: tuple[int, ...]
    adapter: ModelAdapter
    pad_token_id: int | None
    overlong_samples: str
    check_nan: bool
    check_spiky: bool
    device: torch.device
    model_name: str
    builds_schedule_plan: bool
    cp_per_sample: CPPerSampleStep | None = None

    @property
    def packed(self) -> bool:
        return self.layout != "bshd"

    @property
    def static_row(self) -> StaticRow | None:
        """The longest of :attr:`static_rows` (the one every micro-batch fits), or None."""
        return self.static_rows[-1] if self.static_rows else None

    def for_row_cp(self, cp_size: int) -> StepPlan:
        """The plan for a row on ``cp_size`` ranks under a CP size per row: that CP size and its alignment."""
        if self.cp_per_sample is None:
            raise ValueError("for_row_cp: this plan has one CP size for every row")
        return dataclasses.replace(self, cp=cp_size, align=self.cp_per_sample.alignment(cp_size))

    @property
    def static_row_lengths(self) -> tuple[int, ...]:
        """The lengths of :attr:`static_rows`, ascending (``layouts.row_bucket`` reads them)."""
        return tuple(row.length for row in self.static_rows)


def unwrap_model(model):
    """The model inside its DDP / Float16Module wrappers."""
    while hasattr(model, "module"):  # duck: a wrapper (DDP, Float16Module) or the model itself
        model = model.module
    return model


def declared_extras(model) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Which optional extras the model's ``forward`` declares by name, and which it cannot take.

    A name that would only land in ``**kwargs`` counts as not accepted: Megatron-Bridge's ``Qwen3VLModel.forward``
    hands its ``**kwargs`` on to the language model, which raises ``TypeError`` on a name it does not declare.
    """
    parameters = inspect.signature(unwrap_model(model).forward).parameters
    named = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    accepted = tuple(name for name in OPTIONAL_MODEL_EXTRAS if name in named)
    return accepted, tuple(name for name in OPTIONAL_MODEL_EXTRAS if name not in named)


def _group_sizes(pg_collection) -> tuple[dict[str, int], int | None]:
    """The sizes of the TP, CP, PP and EP groups (1 where there is none), and the data-parallel size (with CP = 1
    under hybrid CP: every DP x CP rank), or None without a DP group."""
    names = ("tp", "cp", "pp", "ep", "dp")
    groups = {name: getattr(pg_collection, name, None) for name in names}  # optional: a group the collection lacks
    sizes = {name: group.size() if group is not None else 1 for name, group in groups.items() if name != "dp"}
    return sizes, groups["dp"].size() if groups["dp"] is not None else None


def _fallback_pad_id(tokenizer, model_config, fallback: str | None) -> int | None:
    """The pad id of the length fallback ``"pad_token"`` (``rules.setup.read_pad_id``: tokenizer, then model config),
    or None when the fallback is off or no pad id is set (the rule ``length_fallback_pad_id`` refuses the latter)."""
    if fallback != "pad_token":
        return None
    pad_id = read_pad_id(tokenizer, model_config)
    if pad_id is not None:
        logger.info("bridge_thd: without an attention mask, lengths = 1 + last position whose id != pad id %d", pad_id)
    return pad_id


def _te_cp_padding_defect(layout: str, cp: int) -> str | None:
    """The installed Transformer Engine's CP padding defect for a THD layout under CP (TransformerEngine issue 2186,
    docs/te-cp-padding.md), detected once; None where there is none or it cannot arise."""
    if layout == "bshd" or cp <= 1:
        return None
    accepted, reason = te_cp_padding_verdict(cp)
    return None if accepted else reason


def _static_rows(recorded: tuple[StaticRow, ...], layout: str, micro_batch_size: int | None, seq_length: int,
                 align: int) -> tuple[StaticRow, ...]:
    """``thd_static``'s rows: global-batch packing's (``recorded`` when the loaders were built), else the in-batch one.
    None for the other layouts, and outside a trainer without a micro-batch size (sized per batch then). Each row is
    checked once here as the packer would check it at every micro-batch (``packing.check_static_row``)."""
    if layout != "thd_static":
        return ()
    rows = recorded
    if not rows and micro_batch_size is not None:
        rows = (in_batch_static_row(micro_batch_size, seq_length, align),)
    for row in rows:
        check_static_row(row.length, row.segments, row.max_seqlen, align)
    return rows


def _resolved_layout(cfg, sizes: dict[str, int], variable_seq_lengths: bool) -> str:
    requested = requested_layout(cfg.dataset)
    layout = layout_for(requested, pp=sizes["pp"], variable_seq_lengths=variable_seq_lengths)
    if layout != requested:
        # Pipeline stages exchange fixed-shape buffers; a row whose length changes every micro-batch would make
        # send and recv disagree and hang.
        logger.warning(
            "bridge_thd: pipeline parallelism without model.variable_seq_lengths: switching packing_layout %r -> %r "
            "(fixed row length). Set variable_seq_lengths=True to keep 'thd'.", requested, layout)
    return layout


def build_step_plan(state, model, pg_collection, adapter) -> StepPlan:
    """Decide everything once: the layout, the sizes, the static row, the extras, the family's constants; refuse
    (``ValueError`` listing every problem) what the rules refuse.

    Args:
        state: Megatron-Bridge ``GlobalState`` (``state.cfg``, ``state.tokenizer``, ``state.train_state``).
        model: the model chunk (or its wrappers).
        pg_collection: process groups (``tp``, ``cp``, ``pp``, ``ep``).
        adapter: the model family (:mod:`megatron.bridge_thd.adapters`).
    """
    core = unwrap_model(model)
    model_config = getattr(core, "config", None)  # optional: a model chunk without a config
    cfg = state.cfg
    settings = settings_of(cfg.dataset)
    sizes, dp = _group_sizes(pg_collection)
    layout = _resolved_layout(cfg, sizes, read_model_facts(model_config, cfg.model).variable_seq_lengths)
    parts = ("tokenizer", "train_state")
    tokenizer, train_state = (getattr(state, name, None) for name in parts)  # optional: a stand-in state lacks them
    recorded = getattr(train_state, ROWS_ATTRIBUTE, None)  # optional: only where global-batch packing built loaders
    recorded = recorded.rows if isinstance(recorded, GlobalBatchRows) else ()
    setup = read_setup(cfg, layout, settings=settings, model_config=model_config, sizes=sizes, adapter=adapter,
                       built_model=type(core),
                       routes_real_tokens_only=_routes_real_tokens_only(core),
                       row_lengths=tuple(row.length for row in recorded),
                       te_cp_padding_defect=_te_cp_padding_defect(layout, sizes["cp"]),
                       length_fallback_pad_id=_fallback_pad_id(tokenizer, model_config, settings.length_fallback),
                       dp=dp)
    refuse(setup, STEP, "bridge_thd: the configuration cannot run this step")
    _warn_padded_moe_routing(setup)
    extras, refused = declared_extras(model)
    tokens = adapter.tokens(setup.model)
    plan = StepPlan(
        layout=layout, tp=setup.tp, cp=setup.cp, pp=setup.pp, ep=setup.ep, seq_length=setup.seq_length,
        align=setup.align, micro_batch_size=setup.micro_batch_size,
        static_rows=_static_rows(recorded, layout, setup.micro_batch_size, setup.seq_length, setup.align),
        fixed_p2p_shapes=setup.fixed_p2p_shapes,
        p2p_micro_batch_size=setup.micro_batch_size if layout == "thd_static" and setup.fixed_p2p_shapes else None,
        extras=extras, extras_refused=refused,
        padding_mask_cut_for_cp="padding_mask" in extras and setup.cp > 1 and not setup.routes_real_tokens_only
        and _takes_a_cp_local_padding_mask(core),
        tokens=tokens, uncuttable=tokens.uncuttable, adapter=adapter,
        pad_token_id=setup.length_fallback_pad_id, overlong_samples=settings.overlong_samples,
        check_nan=setup.check_nan, check_spiky=setup.check_spiky,
        device=next(core.parameters()).device, model_name=type(core).__name__,
        builds_schedule_plan=bool(setup.built_model_plans),
        cp_per_sample=_cp_per_sample(setup, core, pg_collection),
    )
    _log_plan(plan)
    return plan


def _cp_per_sample(setup, core, pg_collection) -> CPPerSampleStep | None:
    """Under ``hybrid_context_parallel``: the CP sizes a row may run with (1, 2, 4, ... the DP x CP world, Megatron-
    Core's hybrid groups), each one's alignment, and where the model keeps its CP group. None otherwise."""
    if not setup.model.cp_per_sample:
        return None
    world = pg_collection.dp_cp.size()
    sizes = [1]
    while sizes[-1] < world:
        sizes.append(2 * sizes[-1])
    alignments = tuple((k, thd_alignment(setup.tp, k, sequence_parallel=setup.model.sequence_parallel,
                                         fp8=setup.model.fp8)) for k in sizes)
    return CPPerSampleStep(world=world, alignments=alignments, holders=find_cp_group_holders(core))


def _routes_real_tokens_only(core) -> bool:
    """The model's MoE routers see real tokens only: the mark of the model classes ``moe_padding`` builds
    (``rules.ROUTES_REAL_TOKENS_ONLY``)."""
    return bool(getattr(core, ROUTES_REAL_TOKENS_ONLY, False))  # optional: only moe_padding's models carry the mark


def _takes_a_cp_local_padding_mask(core) -> bool:
    """Megatron-Bridge's ``Qwen3VLModel`` where it declares ``padding_mask`` (``upstream_line().model_takes_padding_mask``)
    cuts for context parallelism only the mask it derives; a mask it is given must already be the rank's. Other
    models that declare it (Megatron-Core's ``GPTModel``, the CPU reference) take the full row's."""
    if not upstream_line().model_takes_padding_mask:
        return False
    return isinstance(core, load_bridge_module("models.qwen_vl.modelling_qwen3_vl.model").Qwen3VLModel)


def _warn_padded_moe_routing(setup) -> None:
    """The padded layout with layout-dependent MoE settings: what Megatron-Bridge's own step runs, so only logged."""
    settings = layout_dependent_moe_settings(setup.model)
    if setup.layout == "bshd" and settings and not setup.routes_real_tokens_only:
        setting, why = settings[0]
        logger.warning("bridge_thd: %s with the padded layout: padding counts as tokens (%s); register "
                       "megatron.bridge_thd.moe_padding.hook.padding_mask_pre_wrap_hook to exclude it", setting, why)


def _log_plan(plan: StepPlan) -> None:
    logger.info(
        "bridge_thd: step plan: layout=%s (TP=%d CP=%d PP=%d EP=%d), seq_length=%d, align=%d, static rows %s; extras "
        "passed to %s.forward: %s; not declared by it (so not passed, never into **kwargs): %s%s",
        plan.layout, plan.tp, plan.cp, plan.pp, plan.ep, plan.seq_length, plan.align, list(plan.static_rows) or None,
        plan.model_name, list(plan.extras) or "none", list(plan.extras_refused) or "none",
        " (Megatron-Bridge's Qwen3VLModel declares no padding_mask: an MoE router counts padding slots as tokens)"
        if "padding_mask" in plan.extras_refused else "")
