"""Rules on rows and placement: fixed pipeline shapes, static rows, global-batch packing, the model family and the
stack (docs/rules.md, docs/batching.md)."""

from __future__ import annotations

from megatron.bridge_thd.packing import round_up
from megatron.bridge_thd.rules.registry import CONFIGURE, LOADERS, PLANNER, STEP, rule
from megatron.bridge_thd.rules.setup import Setup
from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS

__all__ = ["one_row_shape", "row_buckets", "DEFAULT_ROW_BUCKETS"]


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
    requested = s.global_batch.row_buckets if s.global_batch is not None else None
    if requested is not None:
        return requested
    return 1 if one_row_shape(s) else DEFAULT_ROW_BUCKETS


@rule(CONFIGURE, PLANNER, STEP)
def _static_pipeline(s: Setup) -> list[str]:
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
            f"global_batch_packing.row_length: {s.row_length} slots, but without variable_seq_lengths the "
            f"pipeline's fixed buffers hold train.micro_batch_size * model.seq_length = {mbs} x {seq_length} slots; "
            f"set row_length to {mbs * round_up(seq_length, align)} (or leave it unset), or set "
            "model.variable_seq_lengths=True")
    return problems


@rule(STEP)
def _row_lengths(s: Setup) -> list[str]:
    """Several recorded ``thd_static`` rows where only one row shape can run."""
    if len(s.row_lengths) < 2 or s.layout != "thd_static" or not one_row_shape(s):
        return []
    return [f"global_batch_packing.row_buckets: the loaders chose {len(s.row_lengths)} rows "
            f"({', '.join(map(str, s.row_lengths))} slots), but {one_row_shape(s)}; set row_buckets=1"]


@rule(CONFIGURE, PLANNER, LOADERS)
def _global_batch_layout(s: Setup) -> list[str]:
    """Global-batch packing with the padded layout, which lays out exactly ``micro_batch_size`` samples."""
    if s.global_batch is None or s.layout in ("thd", "thd_static"):
        return []
    return [f"global_batch_packing: layout {s.layout!r} lays out exactly train.micro_batch_size samples per "
            "micro-batch, but global-batch packing gives each micro-batch as many samples as fit its row; use layout "
            "'thd' or 'thd_static'"]


@rule(CONFIGURE, LOADERS)
def _global_batch_sampler(s: Setup) -> list[str]:
    """Global-batch packing draws from Megatron-Bridge's ``single`` / ``cyclic`` samplers only."""
    if s.global_batch is None or s.dataloader_type in ("single", "cyclic"):
        return []
    return [f"dataset.dataloader_type: {s.dataloader_type!r}; global-batch packing draws each step from "
            "Megatron-Bridge's 'single' or 'cyclic' sampler ('batch' splits a per-rank global batch into equal "
            "micro-batches in the training step, 'external' has no sampler to draw from); set it to 'cyclic' (or "
            "'single')"]


@rule(CONFIGURE, PLANNER, LOADERS)
def _global_batch_row_buckets(s: Setup) -> list[str]:
    """Several ``thd_static`` rows asked for where only one row shape can run."""
    buckets = s.global_batch.row_buckets if s.global_batch is not None else None
    if buckets is None or buckets <= 1 or s.layout != "thd_static" or not one_row_shape(s):
        return []
    return [f"global_batch_packing.row_buckets: {buckets} rows, but {one_row_shape(s)}; set row_buckets=1 "
            "(or leave it unset: then one row)"]


@rule(PLANNER, LOADERS)
def _global_batch_size(s: Setup) -> list[str]:
    """``train.global_batch_size`` not a multiple of ``micro_batch_size * DP`` (Megatron-Bridge's rule)."""
    gbs, mbs, dp = s.global_batch_size, s.micro_batch_size, s.dp
    if gbs is None or mbs is None or dp is None or gbs % (mbs * dp) == 0:
        return []
    per_micro = mbs * dp
    return [f"train.global_batch_size: {gbs} is not a multiple of micro_batch_size * DP = {mbs} x {dp} = {per_micro} "
            "(Megatron-Bridge's rule: every DP rank runs the same number of micro-batches); set it to e.g. "
            f"{max(per_micro, gbs // per_micro * per_micro)}"]


@rule(CONFIGURE, STEP)
def _model_family(s: Setup) -> list[str]:
    """A layout or parallel size the model family cannot take (the adapter's ``takes_*`` facts)."""
    family = s.family
    if family is None:
        return []
    problems = []
    if s.layout == "thd_static" and not family.takes_thd_static:
        problems.append(
            f"layout='thd_static' with {family.display_name}: {family.model_class} rebuilds positions "
            "per THD segment and needs a real token in every segment, and the static row's tail has none; use "
            "layout='thd' (with model.variable_seq_lengths=True under PP) or 'bshd'")
    if s.cp > 1 and not family.takes_context_parallel:
        problems.append(
            f"context_parallel_size={s.cp} with {family.display_name}: {family.model_class} has no context-parallel "
            "split of its input (its recipes set CP=1); set context_parallel_size=1")
    return problems


@rule(STEP)
def _te_cp_padding(s: Setup) -> list[str]:
    """Context parallelism with packed rows on a Transformer Engine that gives NaN gradients for all-padding chunks."""
    if s.te_cp_padding_defect is None or s.layout == "bshd" or s.cp <= 1:
        return []
    return [s.te_cp_padding_defect]


@rule(STEP)
def _length_fallback_pad_id(s: Setup) -> list[str]:
    """The ``pad_token`` length fallback without a pad id to read."""
    if s.settings.length_fallback != "pad_token" or s.length_fallback_pad_id is not None:
        return []
    return ["length_fallback='pad_token' (dataset.bridge_thd, or the hand-set dataset.packing_length_fallback) needs a "
            "pad id from state.tokenizer (pad_id / pad_token_id) or the model config (pad_token_id); none is set. Set "
            "the tokenizer's pad id, or let the dataset's mask reach the step "
            "(dataset.skip_getting_attention_mask_from_dataset=False) and drop the fallback"]
