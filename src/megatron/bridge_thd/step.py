"""The packed forward step for Megatron-Bridge VLMs, family-agnostic (docs/megatron-bridge-step.md).

Data flow: batch -> keep mask (captured before any pad/truncate helper) -> truncation check ->
the family's position ids (:mod:`megatron.bridge_thd.adapters`) -> the layout's strategy
(:mod:`megatron.bridge_thd.layouts`: a packed THD row or the padded batch) -> model ->
Megatron-Bridge's masked loss. :func:`make_forward_step` binds a family;
``megatron.bridge_thd.qwen3_vl_step.forward_step`` is the Qwen3-VL / Qwen3.5-VL drop-in.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable

import torch

from megatron.bridge_thd.adapters import QWEN3_VL, ModelAdapter
from megatron.bridge_thd.layouts import LAYOUT_NAMES as LAYOUTS
from megatron.bridge_thd.layouts import bshd_alignment, bshd_width, layout_for, static_row_length, thd_alignment
from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_attention_mask, raise_failed_checks
from megatron.bridge_thd.packing import pack_bshd_to_thd, round_up, scatter_into_row
from megatron.bridge_thd.te_compat import check_te_cp_padding
from megatron.bridge_thd.upstream import load_bridge_module, load_flop_utils

__all__ = ["make_forward_step", "forward_step", "PackingStats", "LAYOUTS", "prepare_micro_batch", "PreparedMicroBatch"]

logger = logging.getLogger(__name__)

# Extras a model may take under these exact parameter names; never passed into **kwargs.
OPTIONAL_MODEL_EXTRAS = ("padding_mask", "rope_cu_seqlens")
_logged_once: set[str] = set()


def _log_once(key: str, message: str, level: int = logging.INFO) -> None:
    if key not in _logged_once:
        _logged_once.add(key)
        logger.log(level, message)


@dataclass
class PackingStats:
    """Per micro-batch bookkeeping for logging (tensors stay on the device: no sync).

    Attributes:
        layout: the layout that ran.
        real_tokens: 0-dim, real tokens in the micro-batch (after truncation).
        processed_tokens: int, token slots the model processes (row length or B * T).
        padded_tokens: int, token slots of the padded BSHD layout, ``B * T_bshd``.
        attention_work: 0-dim, sum over samples of ``s_i ** 2`` actually computed
            (``B * T_bshd ** 2`` for BSHD).
        padded_attention_work: int, ``B * T_bshd ** 2``, what the padded layout computes.
        truncated_tokens: 0-dim, real tokens cut because a sample exceeded ``seq_length``.
    """

    layout: str
    real_tokens: torch.Tensor
    processed_tokens: int
    padded_tokens: int
    attention_work: torch.Tensor
    padded_attention_work: int
    truncated_tokens: torch.Tensor


@dataclass
class PreparedMicroBatch:
    """What the step hands the model and the loss, built by :func:`prepare_micro_batch`."""

    forward_args: dict[str, Any]
    loss_mask: torch.Tensor
    stats: PackingStats
    # Set for a static THD row under pipeline parallelism without variable_seq_lengths: the
    # micro_batch_size of Megatron-Core's p2p buffers (seq_length / cp, micro_batch_size, H).
    p2p_micro_batch_size: int | None = None


def _cfg(state, section: str, name: str, default=None):
    return getattr(getattr(state.cfg, section, None), name, default)


def _model_setting(model_config, state, name: str, default=None):
    """A model setting from the model's config, else ``state.cfg.model``."""
    value = getattr(model_config, name, None)
    return value if value is not None else _cfg(state, "model", name, default)


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def declared_extras(model) -> tuple[list[str], list[str]]:
    """Which optional extras the model's ``forward`` declares by name, and which it cannot take.

    A name that would only land in ``**kwargs`` counts as not accepted: Megatron-Bridge 0.6.2's
    ``Qwen3VLModel.forward`` hands its ``**kwargs`` on to the language model
    (``Qwen3VLGPTModel.forward``), which raises ``TypeError`` on a name it does not declare.
    """
    parameters = inspect.signature(_unwrap(model).forward).parameters
    named = {name for name, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    accepted = [name for name in OPTIONAL_MODEL_EXTRAS if name in named]
    return accepted, [name for name in OPTIONAL_MODEL_EXTRAS if name not in named]


def _sizes(pg_collection) -> dict[str, int]:
    def size(name):
        group = getattr(pg_collection, name, None)
        return group.size() if group is not None else 1

    return {name: size(name) for name in ("tp", "cp", "pp", "ep")}


def resolve_layout(state, pp_size: int, variable_seq_lengths: bool) -> str:
    """The layout this step runs, from ``dataset.pack_sequences_in_batch`` / ``enable_in_batch_packing``
    and ``dataset.packing_layout``."""
    packing = bool(
        _cfg(state, "dataset", "pack_sequences_in_batch", False) or _cfg(state, "dataset", "enable_in_batch_packing", False)
    )
    if not packing:
        return "bshd"
    requested = _cfg(state, "dataset", "packing_layout", None) or "thd"
    layout = layout_for(requested, pp=pp_size, variable_seq_lengths=variable_seq_lengths)
    if layout != requested:
        # Pipeline stages exchange fixed-shape buffers; a row whose length changes every
        # micro-batch would make send and recv disagree and hang.
        _log_once(
            "pp_static",
            "bridge_thd: pipeline parallelism without model.variable_seq_lengths: switching packing_layout "
            f"{requested!r} -> {layout!r} (fixed row length). Set variable_seq_lengths=True to keep 'thd'.",
            logging.WARNING,
        )
    return layout


def capture_keep_mask(batch: dict, tokens: torch.Tensor, state, model_config) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """The ``(B, T)`` keep mask, taken from the dataset's mask before any pad/truncate helper,
    and its deferred validity checks (a 2D mask: only 0 / 1 values; a 4D one: causal with padding).

    Without a mask, lengths are derived from the pad token only when the user opted in with
    ``dataset.packing_length_fallback = "pad_token"``; the pad id comes from the tokenizer or the
    model config, never a guess.
    """
    attention_mask = batch.get("attention_mask")
    if attention_mask is not None:
        return keep_mask_from_attention_mask(attention_mask.to(tokens.device, non_blocking=True), *tokens.shape)
    if _cfg(state, "dataset", "packing_length_fallback", None) != "pad_token":
        raise ValueError(
            "attention_mask: the batch carries no attention mask, so real sample lengths are unknown. Set "
            "dataset.skip_getting_attention_mask_from_dataset=False so the dataset's 2D mask reaches the step "
            "(recommended), or set dataset.packing_length_fallback='pad_token' to derive right-padded lengths "
            "from the tokenizer's pad id."
        )
    tokenizer = getattr(state, "tokenizer", None)
    pad_id = getattr(tokenizer, "pad_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        text_config = getattr(model_config, "text_config", model_config)
        pad_id = getattr(text_config, "pad_token_id", None)
    if pad_id is None:
        raise ValueError(
            "dataset.packing_length_fallback: 'pad_token' needs a pad id from state.tokenizer (pad_id / "
            "pad_token_id) or the model config (pad_token_id); none is set. Enable the dataset mask instead."
        )
    _log_once("fallback", f"bridge_thd: no attention mask; lengths = 1 + last position whose id != pad id {pad_id}")
    is_content = tokens != pad_id
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    real_length = torch.where(is_content, positions + 1, 0).amax(dim=1)
    return positions[None, :] < real_length[:, None], []


def truncate_to_seq_length(
    keep: torch.Tensor, tokens: torch.Tensor, seq_length: int, uncuttable_ids
) -> tuple[torch.Tensor, torch.Tensor | None, list[DeferredCheck]]:
    """Keep each sample's first ``seq_length`` real tokens, unless that would cut an image.

    ``uncuttable_ids``: the family's token ids truncation must not cut (its adapter's
    ``uncuttable_token_ids``: image and video placeholders).

    Returns:
        keep: ``(B, T)`` the truncated keep mask.
        truncated: ``(B,)`` real tokens dropped per sample, or None when the batch is no wider
            than ``seq_length`` (nothing can be cut, nothing needs reading).
        checks: fails when a cut part holds image or video tokens (the vision tower would emit
            embeddings for placeholders that no longer exist); read by the caller.
    """
    if tokens.shape[1] <= seq_length:
        return keep, None, []
    rank = keep.cumsum(dim=1) - 1
    kept = keep & (rank < seq_length)
    dropped = keep & ~kept
    is_vision = torch.isin(tokens, torch.tensor(list(uncuttable_ids), device=tokens.device))
    cut_vision = (dropped & is_vision).any(dim=1)
    check = DeferredCheck(
        cut_vision.any(),
        f"seq_length: samples of this micro-batch are longer than seq_length={seq_length} and truncating them would "
        "cut an image or video. Raise seq_length, lower the image resolution (max_pixels), or filter these samples "
        "in the dataset",
        lambda: f"samples {cut_vision.nonzero().flatten().tolist()}",
    )
    return kept, dropped.sum(dim=1), [check]


def _log_truncation(truncated: list[int] | None, seq_length: int) -> None:
    if truncated and any(truncated):
        logger.warning(
            "bridge_thd: truncated %s real tokens (per sample: %s) to seq_length=%d; no image was cut",
            sum(truncated), truncated, seq_length,
        )


def relay_right_padded(values: torch.Tensor, keep: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``(..., B, T)`` -> ``(..., B, width)``: each sample's real tokens first, then ``fill``.

    One scatter; a sample's k-th real token lands in column k. Used by the BSHD layout so that
    left-padded or truncated samples reach the model in the causal-safe right-padded form.
    """
    batch_size = keep.shape[0]
    row_length = batch_size * width
    rank = keep.cumsum(dim=1) - 1
    index = torch.where(keep, torch.arange(batch_size, device=keep.device)[:, None] * width + rank, row_length)
    row = scatter_into_row(values, index, row_length, fill)  # (..., 1, B * width)
    return row.reshape(*values.shape[:-2], batch_size, width)


@dataclass
class StepSettings:
    """What the step needs to know of the configuration and the process groups."""

    sizes: dict[str, int]
    seq_length: int
    variable_seq_lengths: bool
    fp8: bool
    sequence_parallel: bool
    layout: str
    micro_batch_size: int | None
    # thd_static under global-batch packing: the run's fixed row (dataset.global_batch_packing.row_length,
    # set by configure or chosen from the lengths scan when the loader is built); None: sized from the batch.
    row_length: int | None = None


def _step_settings(state, model_config, pg_collection) -> StepSettings:
    sizes = _sizes(pg_collection)
    seq_length = _model_setting(model_config, state, "seq_length") or _cfg(state, "dataset", "seq_length")
    if seq_length is None:
        raise ValueError("model.seq_length: not set; the step needs it to bound sample lengths")
    variable_seq_lengths = bool(_model_setting(model_config, state, "variable_seq_lengths", False))
    return StepSettings(
        sizes=sizes,
        seq_length=seq_length,
        variable_seq_lengths=variable_seq_lengths,
        fp8=bool(_model_setting(model_config, state, "fp8", None)),  # Megatron: a recipe name or None
        sequence_parallel=bool(_model_setting(model_config, state, "sequence_parallel", False)),
        layout=resolve_layout(state, sizes["pp"], variable_seq_lengths),
        micro_batch_size=_cfg(state, "train", "micro_batch_size", None),
        row_length=getattr(_cfg(state, "dataset", "global_batch_packing", None), "row_length", None),
    )


def _batch_on_device(batch: dict, device, is_last_stage: bool):
    """tokens ``(B, T)``, labels (last stage only), loss_mask, visual inputs, copied without
    blocking the host (the data loader pins them)."""
    if batch.get("cu_seqlens_q") is not None or batch.get("cu_seqlens") is not None:
        raise ValueError(
            "batch: this step packs the micro-batch itself; use an unpacked collate (no cu_seqlens in the batch)"
        )
    tokens = batch.get("tokens")
    if tokens is None:
        tokens = batch.get("input_ids")
    if tokens is None or tokens.dim() != 2:
        raise ValueError("batch: expected 'tokens' or 'input_ids' of shape (B, T)")
    tokens = tokens.to(device, non_blocking=True)
    labels = batch.get("labels")
    labels = labels.to(device, non_blocking=True) if labels is not None and is_last_stage else None
    loss_mask = batch.get("loss_mask")
    loss_mask = (
        loss_mask.to(device, non_blocking=True) if loss_mask is not None else torch.ones_like(tokens, dtype=torch.float)
    )
    visual = batch.get("visual_inputs")
    multi_modal = visual.normalized_for_model() if visual is not None else {}
    multi_modal = {k: v.to(device, non_blocking=True) for k, v in multi_modal.items() if v is not None}
    return tokens, labels, loss_mask, multi_modal


def _read_now(checks: list[DeferredCheck], truncated: torch.Tensor | None) -> list[int] | None:
    """One host read of every deferred check and the truncation counts (layouts without the
    packer's read); nothing at all when there is nothing to read."""
    if not checks and truncated is None:
        return None
    flags = [check.failed.to(torch.int64).reshape(1) for check in checks]
    host = torch.cat(flags + ([truncated.to(torch.int64)] if truncated is not None else [])).tolist()
    raise_failed_checks(checks, host[: len(checks)])
    return host[len(checks) :] if truncated is not None else None


def _bshd_forward_args(tokens, labels, loss_mask, mrope, keep, width: int) -> tuple[dict, dict]:
    """The padded layout: samples re-laid right-padded (causal-safe) in ``(B, width)``."""
    loss_mask = relay_right_padded(loss_mask, keep, width, 0)
    forward_args = dict(
        input_ids=relay_right_padded(tokens, keep, width, 0),
        labels=None if labels is None else relay_right_padded(labels, keep, width, -100),
        position_ids=None if mrope is None else relay_right_padded(mrope, keep, width, 0),
        attention_mask=None,
        packed_seq_params=None,
        loss_mask=loss_mask,
    )
    return forward_args, {"padding_mask": ~relay_right_padded(keep, keep, width, False)}


def _thd_forward_args(packed) -> tuple[dict, dict]:
    forward_args = dict(
        input_ids=packed.input_ids,
        labels=packed.labels,
        position_ids=packed.position_ids,
        attention_mask=None,
        packed_seq_params=packed.packed_seq_params,
        loss_mask=packed.loss_mask,
    )
    return forward_args, {"padding_mask": packed.padding_mask, "rope_cu_seqlens": packed.cu_seqlens_padded}


def _pass_declared_extras(model, forward_args: dict, extras: dict, layout: str) -> None:
    """Hand each extra to the model only under a parameter name its ``forward`` declares."""
    core_model = _unwrap(model)
    accepted, not_accepted = declared_extras(model)
    for name in accepted:
        if name in extras:
            forward_args[name] = extras[name]
    _log_once(
        f"extras:{type(core_model).__name__}:{layout}",
        f"bridge_thd: layout={layout}; extras passed to {type(core_model).__name__}.forward: {accepted or 'none'}; "
        f"not declared by it (so not passed, never into **kwargs): {not_accepted or 'none'}"
        + (
            " (Megatron-Bridge <= 0.6.2's Qwen3VLModel declares no padding_mask: an MoE router counts padding "
            "slots as tokens)"
            if "padding_mask" in not_accepted
            else ""
        ),
    )


def uses_seq_aux_loss(config) -> bool:
    """Whether ``moe_router_load_balancing_type`` (a name or a list of names) includes ``seq_aux_loss``."""
    balancing = getattr(config, "moe_router_load_balancing_type", None)
    return "seq_aux_loss" in (balancing if isinstance(balancing, (list, tuple)) else [balancing])


def layout_dependent_moe_settings(config) -> list[tuple[str, str]]:
    """The MoE settings of ``config`` whose result depends on the layout unless the routers see real
    tokens only, as ``(setting, why)``; empty for a dense model.

    Megatron-Core 0.19.2's token dropping (``moe_expert_capacity_factor``) sizes the capacity from
    every slot and lets padding compete for it, and its ``seq_aux_loss`` reshapes the router's
    ``(s, b)`` tokens per sequence, so a THD row (``b = 1``) becomes one whole-row statistic. Both
    are made layout-independent by :func:`megatron.bridge_thd.moe_padding.with_padding_mask`
    (docs/moe-routing.md). Read by the step and by ``configure``.
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


def check_moe_routing(model_config, core_model, layout: str) -> None:
    """Refuse MoE settings whose result would depend on the layout (before the first forward):
    :func:`layout_dependent_moe_settings` with a THD layout on a model whose routers do not see
    real tokens only; the padded layout (what Megatron-Bridge's own step runs) only logs it."""
    settings = layout_dependent_moe_settings(model_config)
    if not settings or getattr(core_model, "bridge_thd_routes_real_tokens_only", False):
        return
    setting, why = settings[0]
    if layout == "bshd":
        _log_once("moe_routing_bshd", f"bridge_thd: {setting} with the padded layout: padding counts as tokens ({why}); "
                  "register megatron.bridge_thd.moe_padding.padding_mask_pre_wrap_hook to exclude it", logging.WARNING)
        return
    raise ValueError(
        f"{setting} with dataset.packing_layout={layout!r}: {why} (measured on the tiny MoE model in "
        "docs/moe-routing.md). Register megatron.bridge_thd.moe_padding.padding_mask_pre_wrap_hook "
        "(cfg.model.register_pre_wrap_hook) so the routers see real tokens only, or set dataset.packing_layout='bshd'."
    )


@dataclass
class _Captured:
    """What every layout strategy starts from: the micro-batch on the device, its keep mask after
    truncation, the family's positions and the checks still to read."""

    tokens: torch.Tensor  # (B, T)
    labels: torch.Tensor | None  # (B, T), last pipeline stage only
    loss_mask: torch.Tensor  # (B, T)
    keep: torch.Tensor  # (B, T) bool, real tokens after truncation
    positions: torch.Tensor | None  # (3, B, T) or (B, T); None: the model computes its own
    truncated: torch.Tensor | None  # (B,) real tokens cut, None when nothing can be cut
    mask_checks: list[DeferredCheck]
    truncation_checks: list[DeferredCheck]
    position_checks: list[DeferredCheck]
    settings: StepSettings
    multi_modal: dict  # the visual inputs, on the device, as the model takes them

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def fixed_p2p_shapes(self) -> bool:
        return self.settings.sizes["pp"] > 1 and not self.settings.variable_seq_lengths


@dataclass
class _Built:
    """What a layout strategy hands back."""

    forward_args: dict
    extras: dict
    attention_work: torch.Tensor  # 0-dim, sum of s_i^2 the attention computes
    p2p_micro_batch_size: int | None = None


def _padded_width(c: _Captured) -> int:
    sizes = c.settings.sizes
    return bshd_width(c.tokens.shape[1], seq_length=c.settings.seq_length, tp=sizes["tp"], cp=sizes["cp"],
                      pp=sizes["pp"], ep=sizes["ep"])


def _build_padded(c: _Captured) -> _Built:
    """``bshd``: the padded batch as Megatron-Bridge's own step lays it out; one host read."""
    width, seq_length = _padded_width(c), c.settings.seq_length
    if c.fixed_p2p_shapes:
        _check_static_pipeline_row(c.batch_size, c.settings.micro_batch_size or c.batch_size, seq_length,
                                   bshd_alignment(c.settings.sizes["tp"], c.settings.sizes["cp"]), "bshd")
    checks = c.mask_checks + c.truncation_checks + c.position_checks
    _log_truncation(_read_now(checks, c.truncated), seq_length)
    forward_args, extras = _bshd_forward_args(c.tokens, c.labels, c.loss_mask, c.positions, c.keep, width)
    return _Built(forward_args, extras, torch.tensor(c.batch_size * width**2, device=c.tokens.device))


def _build_packed(c: _Captured) -> _Built:
    """``thd`` / ``thd_static``: one THD row; one host read (``thd``) or none (``thd_static`` within
    ``seq_length``: the checks become device asserts)."""
    settings, sizes, seq_length = c.settings, c.settings.sizes, c.settings.seq_length
    # TransformerEngine issue 2186 (docs/te-cp-padding.md): refused before any row is built on
    # Hopper with cuDNN < 9.18; detected once, nothing at all when cp = 1.
    check_te_cp_padding(sizes["cp"])
    align = thd_alignment(sizes["tp"], sizes["cp"], sequence_parallel=settings.sequence_parallel, fp8=settings.fp8)
    checks = c.mask_checks + c.truncation_checks + c.position_checks
    total_length, p2p_micro_batch_size = None, None
    if settings.layout == "thd_static":
        micro_batch_size = settings.micro_batch_size or c.batch_size
        if c.fixed_p2p_shapes:
            p2p_micro_batch_size = micro_batch_size
            _check_static_pipeline_row(c.batch_size, micro_batch_size, seq_length, align, "thd_static",
                                       settings.row_length)
        total_length = static_row_length(c.batch_size, seq_length=seq_length, align=align,
                                         micro_batch_size=micro_batch_size, row_length=settings.row_length)
        if c.truncated is not None:  # a truncating static batch: one read for the report
            _log_truncation(_read_now(c.truncation_checks, c.truncated), seq_length)
            checks = c.mask_checks + c.position_checks  # the truncation check was just read
    packed = pack_bshd_to_thd(
        c.tokens, c.keep, labels=c.labels, loss_mask=c.loss_mask, position_ids=c.positions, align_to=align,
        total_length=total_length,
        # A micro-batch of padding only still reaches the model as one aligned padding segment.
        min_length=align,
        checks=checks, host_values=c.truncated if total_length is None else None,
    )
    _log_truncation(packed.host_values, seq_length)
    forward_args, extras = _thd_forward_args(packed)
    return _Built(forward_args, extras, (c.keep.sum(dim=1).to(torch.int64) ** 2).sum(), p2p_micro_batch_size)


# One strategy per layout (layouts.LAYOUTS names them).
_STRATEGIES = {"thd": _build_packed, "thd_static": _build_packed, "bshd": _build_padded}


def _capture(batch: dict, model, state, pg_collection, is_last_stage: bool, adapter: ModelAdapter) -> _Captured:
    """batch -> device tensors, keep mask (before any pad/truncate helper could drop a 2D mask),
    truncation, the family's positions."""
    core_model = _unwrap(model)
    model_config = getattr(core_model, "config", None)
    tokens, labels, loss_mask, multi_modal = _batch_on_device(batch, next(core_model.parameters()).device, is_last_stage)
    settings = _step_settings(state, model_config, pg_collection)
    check_moe_routing(model_config, core_model, settings.layout)
    adapter.check_supported(settings.layout, settings.sizes)
    keep, mask_checks = capture_keep_mask(batch, tokens, state, model_config)
    keep, truncated, truncation_checks = truncate_to_seq_length(
        keep, tokens, settings.seq_length, adapter.uncuttable_token_ids(model_config)
    )
    positions, position_checks = adapter.position_ids(tokens, keep, multi_modal, model_config)
    position_checks = position_checks + adapter.data_checks(settings.layout, keep)
    return _Captured(tokens, labels, loss_mask, keep, positions, truncated, mask_checks, truncation_checks,
                     position_checks, settings, multi_modal)


def prepare_micro_batch(
    batch: dict,
    model,
    state,
    pg_collection,
    *,
    is_last_stage: bool = True,
    adapter: ModelAdapter = QWEN3_VL,
) -> PreparedMicroBatch:
    """Everything between the data iterator and ``model(**forward_args)``.

    Host synchronisations: one in ``thd`` (the packer's read carries the row length, every
    validity flag — mask, positions vs grids, truncation — and the truncation counts), none in
    ``thd_static`` when the batch is no wider than ``seq_length`` (checks become device asserts),
    one in ``bshd`` and in a truncating ``thd_static``.

    Args:
        batch: Megatron-Bridge's VLM micro-batch dict: ``tokens``/``input_ids`` ``(B, T)``,
            ``labels``, ``loss_mask``, ``attention_mask`` (2D keep mask or 4D), ``position_ids``,
            ``visual_inputs`` (with ``normalized_for_model()``).
        model: the model chunk (or its DDP / Float16Module wrapper); its device and ``forward``
            signature are used.
        state: Megatron-Bridge ``GlobalState`` (only ``state.cfg`` and ``state.tokenizer`` are read).
        pg_collection: process groups (``tp``, ``cp``, ``pp``, ``ep``).
        adapter: the model family (:mod:`megatron.bridge_thd.adapters`).
    """
    captured = _capture(batch, model, state, pg_collection, is_last_stage, adapter)
    built = _STRATEGIES[captured.settings.layout](captured)
    forward_args = built.forward_args
    forward_args.update(captured.multi_modal)
    _pass_declared_extras(model, forward_args, built.extras, captured.settings.layout)
    width, batch_size = _padded_width(captured), captured.batch_size
    lengths = captured.keep.sum(dim=1)
    stats = PackingStats(
        layout=captured.settings.layout,
        real_tokens=lengths.sum(),
        processed_tokens=forward_args["input_ids"].numel(),
        padded_tokens=batch_size * width,
        attention_work=built.attention_work,
        padded_attention_work=batch_size * width**2,
        truncated_tokens=(captured.keep.new_zeros((), dtype=torch.int64) if captured.truncated is None
                          else captured.truncated.sum()),
    )
    return PreparedMicroBatch(forward_args=forward_args, loss_mask=forward_args["loss_mask"], stats=stats,
                              p2p_micro_batch_size=built.p2p_micro_batch_size)


def _check_static_pipeline_row(batch_size: int, micro_batch_size: int, seq_length: int, align: int,
                               layout: str, row_length: int | None = None) -> None:
    """What a stage sends must fill Megatron-Core's p2p buffers exactly (checked before the first
    model forward, so before any send: a mismatch would otherwise fail on the receiving stage, or
    hang it on NCCL).

    Without ``variable_seq_lengths`` every stage allocates its receive buffer as
    ``(seq_length / cp [/ tp with SP], micro_batch_size, H)`` (``pipeline_parallel/schedules.py``,
    ``get_tensor_shapes``), so a static row must hold exactly ``micro_batch_size * seq_length``
    slots (each CP rank then sends its ``1 / cp`` of them), and the padded layout exactly
    ``micro_batch_size`` samples of ``seq_length``. Under global-batch packing (``row_length`` set)
    a row holds any number of samples, so the row length itself must be that many slots.
    """
    if row_length is not None and round_up(row_length, align) != micro_batch_size * round_up(seq_length, align):
        raise ValueError(
            f"dataset.global_batch_packing.row_length: {row_length} slots, but without variable_seq_lengths the "
            f"pipeline's fixed buffers hold train.micro_batch_size * model.seq_length = {micro_batch_size} x "
            f"{seq_length} slots; set row_length to {micro_batch_size * round_up(seq_length, align)} (or leave it "
            "unset), or set model.variable_seq_lengths=True"
        )
    if seq_length % align:
        what = "a static row" if layout != "bshd" else "the padded (B, seq_length) layout"
        raise ValueError(
            f"model.seq_length: {seq_length} is not a multiple of the {layout} alignment {align} (TP/CP/SP/FP8), so "
            f"{what} cannot fill the pipeline's fixed (seq_length, micro_batch_size, H) buffers; set seq_length to "
            f"{math.ceil(seq_length / align) * align}, or set model.variable_seq_lengths=True"
        )
    if row_length is None and (batch_size > micro_batch_size or (layout == "bshd" and batch_size != micro_batch_size)):
        raise ValueError(
            f"batch: {batch_size} samples for train.micro_batch_size={micro_batch_size}, the batch size of the "
            f"pipeline's fixed buffers ({layout} needs "
            + ("exactly that many" if layout == "bshd" else "at most that many")
            + "); set train.micro_batch_size to the data loader's batch size, or set model.variable_seq_lengths=True"
        )


def _view_received_row_as_thd(decoder) -> None:
    """On a receiving stage, view the ``(S, micro_batch_size, H)`` buffer Megatron-Core filled
    (``TransformerBlock.set_input_tensor``) as the ``(S * micro_batch_size, 1, H)`` THD row it holds.
    The view keeps the buffer as the autograd leaf the schedule reads ``.grad`` from."""
    received = getattr(decoder, "input_tensor", None)
    if received is not None and received.dim() == 3 and received.shape[1] != 1:
        decoder.input_tensor = received.reshape(-1, 1, received.shape[-1])


@functools.lru_cache(maxsize=1)
def _flop_feed():
    """``(flop_utils, whether accumulate_flops_metadata takes cu_seqlens_unpadded)``, or None when
    the installation has no FLOPs helpers; decided once, not per micro-batch."""
    try:
        flop_utils = load_flop_utils()
    except ImportError as exc:  # an installation without the FLOPs helpers: nothing to feed
        logger.warning("bridge_thd: Megatron-Bridge's flop_utils cannot be loaded (%s); FLOPs not reported", exc)
        return None
    return flop_utils, "cu_seqlens_unpadded" in inspect.signature(flop_utils.accumulate_flops_metadata).parameters


def accumulate_flops(state, model, forward_args: dict) -> None:
    """Feed Megatron-Bridge's FLOPs accounting as its own step does, with the real boundaries.

    ``training/utils/flop_utils.accumulate_flops_metadata`` adds, per micro-batch, the token
    slots the model processes (``tokens.shape[0] * tokens.shape[1]``: the THD row, or the padded
    ``B * W``) for the linear terms, the attention term ``sum(s_i^2)`` over the real segment
    lengths (it prefers ``cu_seqlens_unpadded``), and the vision patches (``sum(t * h * w)``).
    The trainer resets and reads these ``state._flops_*`` accumulators every step. Everything
    stays on the device: no host synchronisation.
    """
    feed = _flop_feed()
    if feed is None:
        return
    flop_utils, takes_unpadded = feed
    params = forward_args.get("packed_seq_params")
    patches = None
    for grid in (forward_args.get("image_grid_thw"), forward_args.get("video_grid_thw")):
        if grid is not None and grid.numel() > 0:
            count = grid.prod(dim=-1).sum()
            patches = count if patches is None else patches + count
    kwargs = dict(vp_stage=flop_utils.get_model_chunk_vp_stage(model), num_vision_patches=patches)
    if params is not None:
        kwargs["cu_seqlens"] = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if takes_unpadded:
            kwargs["cu_seqlens_unpadded"] = params.cu_seqlens_q
    flop_utils.accumulate_flops_metadata(state, forward_args["input_ids"], **kwargs)


def _timer(state, name: str):
    timers = getattr(state, "timers", None)
    if timers is None:
        return contextlib.nullcontext()
    timer = timers(name, log_level=2)

    @contextlib.contextmanager
    def running():
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    return running()


def _straggler_timer(state, **kwargs):
    """Megatron-Bridge's ``state.straggler_timer`` (called with ``bdata=True`` for the data phase),
    or nothing outside its trainer."""
    timer = getattr(state, "straggler_timer", None)
    if timer is None:
        return contextlib.nullcontext()
    return timer(**kwargs) if kwargs else timer


def make_forward_step(adapter: ModelAdapter):
    """The Megatron-Bridge ``forward_step`` for one model family (:mod:`megatron.bridge_thd.adapters`).

    The returned function has Megatron-Bridge's step signature ``(state, data_iterator, model,
    return_schedule_plan=False)`` (the trainer inspects it to pass ``state``)."""

    def forward_step(state, data_iterator: Iterable, model, return_schedule_plan: bool = False):
        return _forward_step(state, data_iterator, model, return_schedule_plan, adapter)

    forward_step.__doc__ = _forward_step.__doc__
    forward_step.__qualname__ = forward_step.__name__ = "forward_step"
    forward_step.adapter = adapter
    return forward_step


def _forward_step(
    state,
    data_iterator: Iterable,
    model,
    return_schedule_plan: bool,
    adapter: ModelAdapter,
) -> tuple[torch.Tensor, partial]:
    """Megatron-Bridge forward step with real THD packing.

    Args:
        state: Megatron-Bridge ``GlobalState``.
        data_iterator: yields Megatron-Bridge VLM batch dicts.
        model: the model chunk (for Qwen3-VL: Megatron-Bridge's ``Qwen3VLModel`` or any module with
            its ``forward`` signature, e.g. :class:`~megatron.bridge_thd.testbed.reference.ReferenceQwen3VL`).
        return_schedule_plan: MoE overlap scheduling; BSHD layout only.

    Returns:
        ``(output_tensor, loss_function)``; ``loss_function`` is Megatron-Bridge's
        ``create_masked_next_token_loss_function`` over the packed loss mask. The micro-batch's
        :class:`PackingStats` is appended to ``state.bridge_thd_stats`` when that list exists.
    """
    if isinstance(model, list):
        raise ValueError("model: forward_step takes one model chunk, as Megatron's schedules pass it, not a list")
    pg_utils = load_bridge_module("training.utils.pg_utils")
    losses = load_bridge_module("training.losses")
    from megatron.core.pipeline_parallel.utils import is_pp_last_stage

    pg_collection = pg_utils.get_pg_collection(model)
    is_last_stage = is_pp_last_stage(pg_collection.pp)
    # As Megatron-Bridge's step: "batch-generator" and the straggler timer's data phase cover
    # fetching the batch and its (non-blocking) device copies, here with the packing that
    # follows them.
    with _timer(state, "batch-generator"), _straggler_timer(state, bdata=True):
        batch = next(data_iterator)
        prepared = prepare_micro_batch(batch, model, state, pg_collection, is_last_stage=is_last_stage,
                                       adapter=adapter)
    accumulate_flops(state, model, prepared.forward_args)
    stats_log = getattr(state, "bridge_thd_stats", None)
    if isinstance(stats_log, list):
        stats_log.append(prepared.stats)

    check_nan = bool(_cfg(state, "rerun_state_machine", "check_for_nan_in_loss", True))
    check_spiky = bool(_cfg(state, "rerun_state_machine", "check_for_spiky_loss", False))
    loss_mask = prepared.loss_mask
    args = prepared.forward_args
    if return_schedule_plan:
        if args["packed_seq_params"] is not None:
            raise ValueError(
                "return_schedule_plan: MoE overlap schedule plans take the padded layout; set "
                "dataset.packing_layout='bshd' with overlap_moe_expert_parallel_comm"
            )
        core_model = _unwrap(model)
        if not hasattr(core_model, "build_schedule_plan"):
            raise ValueError(
                f"return_schedule_plan: {type(core_model).__name__} has no build_schedule_plan (Megatron-Core's "
                "GPTModel has one; Megatron-Bridge 0.6.2's Qwen3VLModel does not), so MoE overlap schedule plans "
                "cannot be built for it; turn off overlap_moe_expert_parallel_comm"
            )
        plan = core_model.build_schedule_plan(
            args["input_ids"], args["position_ids"], None, labels=args["labels"], loss_mask=loss_mask
        )
        return plan, losses.create_masked_next_token_loss_function(loss_mask, check_nan, check_spiky)

    if prepared.p2p_micro_batch_size is not None:
        _view_received_row_as_thd(adapter.p2p_decoder(_unwrap(model)))
    with _straggler_timer(state):
        output = model(**args)
    if isinstance(output, tuple):
        # Under CP Megatron-Bridge's Qwen3VLModel shards the row itself and, because it was given
        # loss_mask, returns the matching CP-local mask (models/qwen_vl/modelling_qwen3_vl/model.py),
        # on every pipeline stage.
        output, loss_mask = output
    if prepared.p2p_micro_batch_size is not None and not is_last_stage:
        # The (CP-local) row goes to the next stage in the shape its receive buffer has.
        output = output.reshape(-1, prepared.p2p_micro_batch_size, output.shape[-1])
    # Earlier pipeline stages return hidden states (s, b, h); the last returns per-token values.
    if is_last_stage and output.dim() >= 2 and tuple(output.shape[:2]) != tuple(loss_mask.shape):
        raise ValueError(
            f"model: returned an output of shape {tuple(output.shape)} for a loss mask of shape "
            f"{tuple(loss_mask.shape)}; a model that shards the sequence for context parallelism must return "
            "(output, local_loss_mask) when it is given loss_mask, as Megatron-Bridge's Qwen3VLModel does"
        )
    return output, losses.create_masked_next_token_loss_function(loss_mask, check_nan, check_spiky)


# Qwen3-VL / Qwen3.5-VL: the drop-in name (megatron.bridge_thd.qwen3_vl_step.forward_step).
forward_step = make_forward_step(QWEN3_VL)
