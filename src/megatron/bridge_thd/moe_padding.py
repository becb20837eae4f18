"""Opt-in: hand the packed row's padding mask to the MoE routers of Megatron-Bridge's Qwen3-VL.

On one line of Megatron-Bridge ``Qwen3VLModel.forward`` declares no ``padding_mask``, so its routers count
every padding slot of a packed row (alignment padding, the ``thd_static`` tail, BSHD pad columns) in the
aux loss, z-loss and expert-bias statistics. On the other it declares one and derives it from the THD
boundaries when omitted, but with host reads, refusing zero-length segments, and Megatron-Core's router
still crashes with expert bias, fills expert capacity with padding and computes ``seq_aux_loss`` over the
whole row (docs/compatibility.md, ``upstream_line.model_takes_padding_mask``). :func:`with_padding_mask`
makes both the same, through one mechanism: padding-aware subclasses, assigned in place (same parameters
and state-dict keys). The model becomes ``PaddingMask<Class>``, whose ``forward`` takes ``padding_mask``
(True = padding; derived from the boundaries without a host read when omitted), hands it to the model's
own ``padding_mask`` where the model declares one (cut for CP as the model expects), and for the duration
of the call makes the mask, cut as the model cuts its hidden states (CP, SP), available through one
context variable; each decoder MoE
layer becomes :class:`PaddingMaskMoELayer` (takes that mask; from there Megatron-Core's own path
carries it to the router) and its router :class:`PaddingMaskTopKRouter` (expert-bias counts that
take the mask, capacity from the real tokens, ``seq_aux_loss`` per sample). Usage, before
Megatron wraps the model::

    from megatron.bridge_thd.moe_padding import padding_mask_pre_wrap_hook
    cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)   # or: model = with_padding_mask(model)

Refused with the setting named: full recompute, CUDA graphs, ``mlp_chunks_for_training > 1``.
Models other than Megatron-Bridge's ``Qwen3VLModel`` that declare ``padding_mask`` (Megatron-Core's
``GPTModel``) are returned unchanged. Details, the upstream bug
worked around, why subclasses of the built model rather than a layer spec, what is not covered:
docs/moe-padding-mask.md, docs/moe-routing.md.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from typing import Any, NamedTuple

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from megatron.bridge_thd.context_parallel import cut_for_context_parallel
from megatron.bridge_thd.lengths import seq_idx
from megatron.bridge_thd.rules import ROUTES_REAL_TOKENS_ONLY, uses_seq_aux_loss
from megatron.bridge_thd.upstream import load_bridge_module
from megatron.bridge_thd.upstream_line import takes_parameter, upstream_line

__all__ = [
    "with_padding_mask",
    "padding_mask_pre_wrap_hook",
    "declares_padding_mask",
    "padding_mask_from_packed_seq_params",
    "PaddingMaskForward",
    "PaddingMaskMoELayer",
    "PaddingMaskTopKRouter",
    "capacity_token_dropping",
    "thd_sample_index",
]

logger = logging.getLogger(__name__)

_QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"
# The helpers the model itself uses to cut its row for context parallelism; the mask is
# cut with the same functions so that it lines up with the hidden states token for token.
_CP_HELPERS = ("_is_packed_input_pre_sharded", "_split_if_full_sequence", "get_packed_seq_cp_partition_indices")
_SUBCLASSES: dict[type, type] = {}


def declares_padding_mask(model) -> bool:
    """True when ``model.forward`` takes a parameter named ``padding_mask`` (not via ``**kwargs``)."""
    return takes_parameter(model.forward, "padding_mask")


def padding_mask_from_packed_seq_params(packed_seq_params, total_tokens: int) -> torch.Tensor:
    """The ``(1, N)`` padding mask of a packed THD row, from its boundaries.

    Slot ``j`` of physical segment ``i`` (``[cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1])``)
    is real when ``j - cu_seqlens_q_padded[i] < cu_seqlens_q[i + 1] - cu_seqlens_q[i]``; slots past
    the last physical boundary are padding. Zero-length segments (an all-padding sample, the
    ``thd_static`` tail) are allowed. Pure tensor ops: no host synchronisation.

    Args:
        packed_seq_params: Megatron-Core ``PackedSeqParams`` (``cu_seqlens_q``, optionally
            ``cu_seqlens_q_padded``) of the full row.
        total_tokens: N, the row length.

    Returns:
        ``(1, N)`` bool, True = padding.
    """
    cu_real, cu_physical, segment, inside = _physical_segments(packed_seq_params, total_tokens)
    offset = torch.arange(total_tokens, device=cu_real.device) - cu_physical[segment]
    real = inside & (offset < cu_real[segment + 1] - cu_real[segment])
    return (~real).unsqueeze(0)


def _physical_segments(packed_seq_params, total_tokens: int):
    """The boundaries of a THD row (int64) and the physical segment of each of its N slots.

    Returns:
        cu_real, cu_physical: ``(S + 1,)`` int64 (``cu_seqlens_q``, ``cu_seqlens_q_padded`` or the
            real ones when unset).
        segment: ``(N,)`` int64, the segment whose physical slot holds the slot (slots at or past
            the last boundary: the last segment).
        inside: ``(N,)`` bool, False for slots at or past the last boundary.
    """
    cu_real = packed_seq_params.cu_seqlens_q
    cu_physical = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu_physical is None:
        cu_physical = cu_real
    if cu_real is None or cu_real.dim() != 1 or cu_physical.shape != cu_real.shape or cu_real.numel() < 2:
        raise ValueError(
            "packed_seq_params: cu_seqlens_q (and cu_seqlens_q_padded when set) must be 1-D boundaries of the "
            "same length >= 2 to derive the padding mask; pass padding_mask explicitly instead"
        )
    cu_real = cu_real.to(torch.int64)
    cu_physical = cu_physical.to(torch.int64)
    segments = cu_real.numel() - 1
    positions = torch.arange(total_tokens, device=cu_real.device)
    # right=True: a slot on a boundary belongs to the segment that starts there (zero-length
    # segments are skipped); slots at or past the last boundary get index == segments.
    segment = seq_idx(cu_physical, positions)
    return cu_real, cu_physical, segment.clamp_max(segments - 1), segment < segments


def _fail_if_unsupported(config) -> None:
    """Settings under which the mask cannot reach every router (docs/moe-padding-mask.md)."""
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError(
            "config.recompute_granularity='full': the decoder re-runs its layers in the backward pass, after "
            "with_padding_mask's forward has returned, so the recomputed MoE routers would run without the padding "
            "mask. Use recompute_granularity='selective' (recompute_modules=['moe'] keeps the mask) or None, "
            "or do not use with_padding_mask."
        )
    cuda_graph_impl = getattr(config, "cuda_graph_impl", "none")
    if cuda_graph_impl not in (None, "none"):
        raise ValueError(
            f"config.cuda_graph_impl={cuda_graph_impl!r}: CUDA-graphed transformer layers replay captured kernels instead "
            "of running their MoE layer's Python forward, so with_padding_mask cannot hand the padding mask to their "
            "MoE routers. Set cuda_graph_impl='none' or do "
            "not use with_padding_mask."
        )
    chunks = getattr(config, "mlp_chunks_for_training", 1) or 1
    if chunks > 1:
        raise ValueError(
            f"config.mlp_chunks_for_training={chunks}: Megatron-Core's chunked MLP path calls the MoE layer without "
            "padding_mask. Set mlp_chunks_for_training=1 or do not use with_padding_mask."
        )
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        policy = getattr(config, "moe_token_drop_policy", "probs")
        if policy != "probs":
            raise ValueError(
                f"config.moe_token_drop_policy={policy!r} with moe_expert_capacity_factor: 'position' keeps the "
                "earliest tokens of the router's token order, which is sequence-major (s, b) in the padded layout and "
                "sample-major in a THD row, so the kept tokens depend on the layout by definition. Use "
                "moe_token_drop_policy='probs' (Megatron-Core's default) or do not use with_padding_mask."
            )
    recompute_modules = getattr(config, "recompute_modules", None) or []
    if uses_seq_aux_loss(config) and getattr(config, "recompute_granularity", None) == "selective" \
            and "moe" in recompute_modules:
        raise ValueError(
            "config.moe_router_load_balancing_type='seq_aux_loss' with recompute_modules=['moe']: the recomputed "
            "routers run in the backward pass, after with_padding_mask's forward has returned, without the sample "
            "boundaries of the THD row, so their seq_aux_loss would be a whole-row statistic. Drop 'moe' from "
            "recompute_modules, or use another load-balancing type."
        )


def _moe_layers(model) -> list:
    """The decoder's MoE ``TransformerLayer`` s on this pipeline stage (empty without a language model)."""
    language_model = getattr(model, "language_model", None)
    decoder = getattr(language_model, "decoder", None)
    if decoder is None:
        return []
    return [layer for layer in decoder.layers if isinstance(getattr(layer, "mlp", None), MoELayer)]


def capacity_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    padding_mask: torch.Tensor,
    *,
    router_topk: int,
    capacity_factor: float,
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron-Core's ``apply_router_token_dropping`` (``moe_utils.py``, policy ``"probs"``) over the
    real tokens only: padding takes no capacity, and the capacity comes from the real token count.

    Each expert keeps the ``ceil(real_tokens * topk / experts * capacity_factor)`` routed real
    tokens of highest probability, what Megatron-Core keeps for a batch holding only the real
    tokens; so every layout of the same samples (THD, static THD, padded) keeps the same tokens.
    The capacity is a device tensor (no host synchronisation): one ``topk`` with the static bound
    ``get_capacity(tokens * topk, ...)`` (capacity from every slot, never smaller), then a rank test.

    Args:
        routing_probs: ``(tokens, experts)`` probabilities of the selected experts (0 elsewhere).
        routing_map: ``(tokens, experts)`` bool, the top-k selection.
        padding_mask: ``(tokens,)`` bool, True = padding.
        pad_to_capacity: ``moe_pad_expert_input_to_capacity``: every expert gets exactly the static
            bound of slots (static shapes); the slots past the real capacity carry probability 0.

    Returns:
        ``(probs, routing_map)`` after dropping, shapes as given.
    """
    from megatron.core.transformer.moe.moe_utils import get_capacity

    num_tokens, num_experts = routing_probs.shape
    real = ~padding_mask.reshape(num_tokens, 1)
    routed = routing_map & real
    real_tokens = real.sum().to(torch.float64)
    capacity = torch.ceil(real_tokens * router_topk / num_experts * capacity_factor)
    bound = min(num_tokens, get_capacity(num_tokens=num_tokens * router_topk, num_experts=num_experts,
                                         capacity_factor=capacity_factor))
    # Routed real tokens first, by probability; everything else (padding included) after them.
    key = torch.where(routed, routing_probs, torch.full_like(routing_probs, -1.0))
    _, order = torch.topk(key, k=bound, dim=0, sorted=True)  # (bound, experts)
    within = torch.arange(bound, device=key.device)[:, None] < capacity
    in_bound = torch.zeros_like(routed).scatter(0, order, True)
    kept = torch.zeros_like(routed).scatter(0, order, within.expand(bound, num_experts)) & routed
    final_map = in_bound if pad_to_capacity else kept
    return routing_probs * kept, final_map


def thd_sample_index(packed_seq_params, total_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sample each slot of a THD row belongs to, and how many samples the row holds.

    A segment is a sample unless it is a padding segment: physical length > 0 and no real token
    (the ``thd_static`` tail, the aligned segment of an all-padding micro-batch, Energon's
    sequence-parallel dummy). Zero-length segments (all-padding samples) are samples. Pure tensor
    ops, no host synchronisation.

    Returns:
        ``(1, N)`` int64 physical segment of each slot (slots past the last boundary: the last
        segment), and a 0-dim int64 count of samples.
    """
    cu_real, cu_physical, segment, _ = _physical_segments(packed_seq_params, total_tokens)
    padding_segment = (cu_real.diff() == 0) & (cu_physical.diff() > 0)
    return segment.unsqueeze(0), (~padding_segment).sum()


class _ForwardPadding(NamedTuple):
    """What a :func:`with_padding_mask` model's forward hands its MoE layers and routers."""

    # (b, s_local) bool, True = padding, cut exactly as the model cuts its hidden states.
    mask: torch.Tensor
    # For seq_aux_loss of a THD row: (sample of each token (s_local, b) int64, segments, 0-dim sample
    # count), cut like the mask; None otherwise (see thd_sample_index).
    samples: tuple | None


# The one channel from the model to its MoE layers: set by PaddingMaskForward.forward for the
# duration of the call (Megatron-Bridge's Qwen3-VL decoder calls its layers without padding_mask), read by
# PaddingMaskMoELayer.forward (the mask) and PaddingMaskTopKRouter._apply_seq_aux_loss (the samples).
_FORWARD_PADDING: contextvars.ContextVar[_ForwardPadding | None] = contextvars.ContextVar(
    "bridge_thd_forward_padding", default=None
)


class PaddingMaskMoELayer(MoELayer):
    """Megatron-Core's ``MoELayer`` that, inside the forward of a :func:`with_padding_mask` model, takes that
    forward's mask (``(b, s_local)``, True = padding, cut as the hidden states are).

    Where the model declares no ``padding_mask``, its decoder calls the layer without one; where it declares it,
    the decoder hands on the model's argument, and the forward's mask (the same tokens, cut by the same
    helpers) is used all the same, so both lines route on one mask. From there on the mask follows
    Megatron-Core's own path: ``MoELayer.forward`` transposes it to ``(s, b)`` and hands it to the router, and
    with ``recompute_modules=['moe']`` checkpoints the layer with the mask as an argument, so the recomputed
    router sees it too. Outside such a forward it is Megatron-Core's ``MoELayer`` unchanged.
    """

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask: torch.Tensor | None = None):
        forward_padding = _FORWARD_PADDING.get()
        if forward_padding is not None:
            padding_mask = forward_padding.mask
            if tuple(padding_mask.shape) != (hidden_states.shape[1], hidden_states.shape[0]):
                raise ValueError(
                    f"padding_mask: the rank-local mask has shape {tuple(padding_mask.shape)} but the MoE layer "
                    f"{self.layer_number} sees hidden states of shape {tuple(hidden_states.shape)} (s, b, h); "
                    "expected (b, s)"
                )
        return super().forward(hidden_states, intermediate_tensors, padding_mask=padding_mask)


class PaddingMaskTopKRouter(TopKRouter):
    """Megatron-Core's ``TopKRouter`` made layout-independent for a padding mask (True = padding).

    * Expert-bias counts: Megatron-Core computes ``routing_map & (~padding_mask)`` with the mask
      flattened to ``(tokens,)`` against ``(tokens, experts)``, which raises (or, with as many tokens
      as experts, masks the wrong axis); here the mask is ``(tokens, 1)``.
    * Expert capacity (``moe_expert_capacity_factor``) with a mask: :func:`capacity_token_dropping`
      (capacity from the real tokens, padding takes none) instead of Megatron-Core's
      ``apply_router_token_dropping``, in this class's own :meth:`routing`.
    * ``seq_aux_loss`` in the forward of a THD row: per sample (:meth:`_apply_seq_aux_loss`).
    * Refuses to route without a mask inside the forward of a :func:`with_padding_mask` model (a
      code path dropped it: its statistics would count padding).

    Without a mask, or in the padded layout, every method is Megatron-Core's.
    """

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is None and _FORWARD_PADDING.get() is not None:
            raise RuntimeError(
                f"with_padding_mask: the MoE router of layer {self.layer_number} ran without the padding mask (a "
                "code path that drops the MoE layer's padding_mask, e.g. CUDA graphs or chunked MLP); its "
                "load-balancing statistics would count padding tokens"
            )
        return super().forward(input, padding_mask=padding_mask)

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is not None and padding_mask.dim() == 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return super()._apply_expert_bias(routing_map, padding_mask=padding_mask)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is None or self.config.moe_expert_capacity_factor is None:
            return super().routing(logits, padding_mask=padding_mask)
        return self._routing_with_real_token_capacity(logits, padding_mask)

    def _routing_with_real_token_capacity(self, logits: torch.Tensor, padding_mask: torch.Tensor):
        """Megatron-Core's ``TopKRouter.routing`` step for step, with :func:`capacity_token_dropping`
        (the mask, recomputed tokens included, is the routing argument itself) where it calls
        ``apply_router_token_dropping``."""
        from megatron.core.transformer.moe.moe_utils import (
            compute_routing_scores_for_aux_loss,
            topk_routing_with_score_function,
        )

        config = self.config
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, config.num_moe_experts)
        padding_mask = padding_mask.reshape(-1)
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        if self.routing_type == "sinkhorn":
            probs, routing_map = self.sinkhorn_load_balancing(logits)
        elif self.routing_type == "quantile_balancing":
            raise ValueError("config.moe_router_load_balancing_type: quantile balancing does not support padding masks")
        else:
            probs, routing_map = topk_routing_with_score_function(
                logits, self.topk, use_pre_softmax=config.moe_router_pre_softmax,
                num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
                scaling_factor=config.moe_router_topk_scaling_factor, score_function=self.score_function,
                expert_bias=self.expert_bias, fused=config.moe_router_fusion, router_replay=self.router_replay,
            )
        probs, routing_map = capacity_token_dropping(
            probs, routing_map, padding_mask, router_topk=self.topk, capacity_factor=config.moe_expert_capacity_factor,
            pad_to_capacity=config.moe_pad_expert_input_to_capacity,
        )
        if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
            routing_map_for_aux_loss, scores_for_aux_loss = compute_routing_scores_for_aux_loss(
                logits, self.topk, self.score_function, fused=config.moe_router_fusion, padding_mask=padding_mask,
            )
            probs = self._apply_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss, with_padding_mask=True)
            probs = self._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss, seq_length, bsz,
                                             with_padding_mask=True)
            probs = self._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map_for_aux_loss,
                                                with_padding_mask=True)
        self._apply_expert_bias(routing_map, padding_mask=padding_mask)
        return probs, routing_map

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        """``TopKRouter._apply_seq_aux_loss`` per sample of a THD row.

        Megatron-Core folds the batch dimension into the experts: ``(s, b * E)``, a switch loss per
        sequence, divided by ``b``. A THD row reaches the router as one sequence (``b = 1``), so it
        would become a whole-row statistic. Here each token's scores and routing go to its sample's
        block, ``(samples, E)`` summed per sample, with ``b`` = the number of samples of the
        micro-batch (zero-length samples count, as all-padding rows of the padded layout do; padding
        segments such as the static tail do not): Megatron-Core's own formula on the same numbers.
        Outside a THD forward (the padded layout, ``b > 1``) it is Megatron-Core's method unchanged.
        """
        forward_padding = _FORWARD_PADDING.get()
        samples = None if forward_padding is None else forward_padding.samples
        if samples is None or bsz != 1:
            return super()._apply_seq_aux_loss(probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                               with_padding_mask=with_padding_mask)
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        sample_of_token, num_slots, num_samples = samples
        experts = self.config.num_moe_experts
        index = sample_of_token.reshape(-1)
        scores = scores_for_aux_loss.new_zeros(num_slots, experts).index_add(0, index, scores_for_aux_loss)
        counts = scores_for_aux_loss.new_zeros(num_slots, experts).index_add(0, index, routing_map.to(scores.dtype))
        global_counts = reduce_from_tensor_model_parallel_region(counts.reshape(-1), self.tp_cp_group)
        local_num_tokens = counts.sum() / (self.topk * num_samples)
        total_num_tokens = global_counts.sum() / (self.topk * num_samples)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores.reshape(1, -1), tokens_per_expert=global_counts, total_num_tokens=total_num_tokens,
            topk=self.topk, num_experts=experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion,
        ) / num_samples
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group,
            valid_token_count=local_num_tokens * num_samples,
        )


def _use_padding_aware_modules(layers: list) -> None:
    """Each MoE layer of ``layers`` becomes a :class:`PaddingMaskMoELayer` and its router a
    :class:`PaddingMaskTopKRouter` (in place: parameters, buffers and state-dict keys unchanged).
    Every layer is checked before any changes."""
    for layer in layers:
        moe, router = layer.mlp, layer.mlp.router
        if type(moe) not in (MoELayer, PaddingMaskMoELayer) or type(router) not in (TopKRouter, PaddingMaskTopKRouter):
            raise TypeError(
                f"model: with_padding_mask takes MoE layers built as Megatron-Core's MoELayer with its TopKRouter; "
                f"layer {layer.layer_number} has {type(moe).__name__} with {type(router).__name__}"
            )
    for layer in layers:
        layer.mlp.__class__ = PaddingMaskMoELayer
        layer.mlp.router.__class__ = PaddingMaskTopKRouter


class PaddingMaskForward:
    """Mixin of the classes :func:`with_padding_mask` creates; its ``forward`` is set per class."""

    # Read by the step (by name, without importing this module): the routers of this model keep
    # padding out of expert capacity and compute seq_aux_loss per sample of a THD row.
    bridge_thd_routes_real_tokens_only = True

    def _padding_mask_for_model(self, padding_mask: torch.Tensor, input_ids, packed_seq_params, *,
                                dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """The mask cut the way the model cuts its row for context parallelism: ``(b, s_cp)`` ``dtype``.

        ``padding_mask`` has the shape of ``input_ids``: ``(1, N)`` for a THD row, ``(B, T)`` for
        BSHD, the rank-local row for pre-sharded THD input. The THD row is cut with the model's own
        ``get_packed_seq_cp_partition_indices`` (zigzag per segment), BSHD with its
        ``_split_if_full_sequence``. This is what a model that declares ``padding_mask`` itself
        takes as its argument (it cuts only the mask it derives, and scatters either for SP).
        """
        if input_ids is None:
            raise ValueError("padding_mask: given without input_ids; the model needs input_ids to place the mask")
        if tuple(padding_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"padding_mask: shape {tuple(padding_mask.shape)} does not match input_ids {tuple(input_ids.shape)}; "
                "pass one flag per input token (True = padding), before any context-parallel split"
            )
        mask = padding_mask.to(device=input_ids.device, dtype=dtype)
        if packed_seq_params is not None and input_ids.dim() == 2 and input_ids.size(0) > 1:
            raise ValueError(
                "padding_mask: legacy packed BSHD input (packed_seq_params with input_ids of "
                f"{input_ids.size(0)} rows, re-packed inside the model) is not supported; pack into one THD row "
                "(megatron.bridge_thd.qwen3_vl_step.forward_step does) or drop padding_mask"
            )
        return cut_for_context_parallel(mask, input_ids, packed_seq_params, self.pg_collection.cp).contiguous()

    def _padding_mask_for_layers(self, model_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`_padding_mask_for_model`'s mask cut the way the model cuts its hidden states for sequence
        parallelism: rank r of the TP group keeps the r-th of ``tp`` equal chunks of the sequence, as
        ``scatter_to_sequence_parallel_region`` does. ``(b, s_local)``."""
        tp_size = self.pg_collection.tp.size()
        if not (getattr(self.config, "sequence_parallel", False) and tp_size > 1):
            return model_mask
        length = model_mask.size(1)
        if length % tp_size:
            raise ValueError(
                f"padding_mask: the rank-local sequence of {length} tokens is not divisible by the "
                f"tensor-parallel size {tp_size} (sequence parallelism); align the row to tp"
            )
        chunk = length // tp_size
        return model_mask.narrow(1, self.pg_collection.tp.rank() * chunk, chunk).contiguous()

    def _forward_with_padding_mask(self, base_forward, base_signature, args, kwargs, padding_mask):
        _fail_if_unsupported(self.config)
        native = upstream_line().model_takes_padding_mask
        layers = _moe_layers(self)
        if not layers and not native:  # a dense model, or a pipeline stage without MoE layers: nothing to hand over
            return base_forward(self, *args, **kwargs)
        bound = base_signature.bind(self, *args, **kwargs).arguments
        input_ids = bound.get("input_ids")
        packed_seq_params = bound.get("packed_seq_params")
        if padding_mask is None:
            padding_mask = _derived_padding_mask(self, input_ids, packed_seq_params)
        if padding_mask is None:
            return base_forward(self, *args, **kwargs)
        model_mask = self._padding_mask_for_model(padding_mask, input_ids, packed_seq_params)
        if native:
            # The model's own argument: it then derives nothing (no host read) and carries the mask to its
            # decoder (scattered for SP where it scatters its hidden states).
            kwargs = {**kwargs, "padding_mask": model_mask}
        if not layers:
            return base_forward(self, *args, **kwargs)
        samples = None
        if packed_seq_params is not None and input_ids.size(0) == 1 and uses_seq_aux_loss(self.config):
            segment, num_samples = thd_sample_index(packed_seq_params, input_ids.size(1))
            # Cut exactly as the mask (and the hidden states): CP zigzag, SP scatter.
            local = self._padding_mask_for_layers(
                self._padding_mask_for_model(segment, input_ids, packed_seq_params, dtype=torch.int64))
            samples = (local.transpose(0, 1), packed_seq_params.cu_seqlens_q.numel() - 1, num_samples)
        # For the duration of the call its MoE layers (PaddingMaskMoELayer) take the mask from here.
        token = _FORWARD_PADDING.set(_ForwardPadding(self._padding_mask_for_layers(model_mask), samples))
        try:
            return base_forward(self, *args, **kwargs)
        finally:
            _FORWARD_PADDING.reset(token)


def _derived_padding_mask(model, input_ids, packed_seq_params) -> torch.Tensor | None:
    """As Megatron-Bridge's model does when it declares ``padding_mask``: a THD row without an explicit mask
    gets the one its boundaries imply (zero-length segments allowed, no host read). Pre-sharded CP input is
    rank-local while its boundaries describe the full row: no mask is derived for it (None)."""
    if packed_seq_params is None or input_ids is None or input_ids.dim() != 2 or input_ids.size(0) != 1:
        return None
    cp_size = model.pg_collection.cp.size()
    helpers = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
    if cp_size > 1 and helpers._is_packed_input_pre_sharded(input_ids, packed_seq_params, cp_size=cp_size):
        return None
    return padding_mask_from_packed_seq_params(packed_seq_params, input_ids.size(1))


def _signature_with_padding_mask(base_forward) -> inspect.Signature:
    """The base ``forward`` signature plus ``padding_mask`` (keyword-only, before ``**kwargs``), unless it declares
    one already."""
    signature = inspect.signature(base_forward)
    if takes_parameter(base_forward, "padding_mask"):
        return signature
    parameters = list(signature.parameters.values())
    new = inspect.Parameter(
        "padding_mask", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None"
    )
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    return signature.replace(parameters=parameters[:at] + [new] + parameters[at:])


def _padding_mask_class(cls: type) -> type:
    """``PaddingMask<cls>``: ``cls`` with a ``forward`` that declares ``padding_mask`` (cached)."""
    subclass = _SUBCLASSES.get(cls)
    if subclass is not None:
        return subclass
    base_forward = cls.forward
    base_signature = inspect.signature(base_forward)

    def forward(self, *args, padding_mask: torch.Tensor | None = None, **kwargs):
        return self._forward_with_padding_mask(base_forward, base_signature, args, kwargs, padding_mask)

    name = f"PaddingMask{cls.__name__}"
    forward.__signature__ = _signature_with_padding_mask(base_forward)
    forward.__qualname__ = f"{name}.forward"
    forward.__doc__ = (
        f"{cls.__name__}.forward with ``padding_mask``: ``(b, s)`` bool, the shape of ``input_ids``, True = "
        "padding (derived from ``packed_seq_params`` for a THD row when omitted). The MoE routers of the decoder "
        "leave padding tokens out of their aux-loss, z-loss and expert-bias statistics; outputs are unchanged. "
        "See megatron.bridge_thd.moe_padding.\n\n" + (cls.forward.__doc__ or "")
    )
    subclass = type(name, (PaddingMaskForward, cls), {"forward": forward, "__module__": __name__, "__qualname__": name})
    _SUBCLASSES[cls] = subclass
    return subclass


def with_padding_mask(model):
    """Make a Megatron-Bridge ``Qwen3VLModel`` take ``padding_mask`` and hand it to its MoE routers.

    In place: the model (or, for a wrapper chain such as DDP / ``Float16Module``, the innermost
    ``.module``) changes class to ``PaddingMask<Class>``, each MoE layer of its decoder to
    :class:`PaddingMaskMoELayer` and each router to :class:`PaddingMaskTopKRouter`; see
    docs/moe-padding-mask.md.

    Args:
        model: a Megatron-Bridge ``Qwen3VLModel`` (a model chunk), or a ``.module`` wrapper
            chain around one.

    Returns:
        ``model`` itself. Unchanged when it was passed through this function already, or when it is
        not a ``Qwen3VLModel`` and its ``forward`` declares ``padding_mask`` (Megatron-Core's ``GPTModel``).

    Raises:
        TypeError: ``model`` is not a Megatron-Bridge ``Qwen3VLModel`` (and declares no ``padding_mask``),
            or a decoder MoE layer is not Megatron-Core's ``MoELayer`` with its ``TopKRouter``.
        ValueError: ``recompute_granularity='full'``, ``cuda_graph_impl`` other than ``'none'`` or
            ``mlp_chunks_for_training > 1`` (the mask could not reach every router); the message
            names the setting and the fix.
    """
    if isinstance(model, (list, tuple)):
        raise TypeError("model: with_padding_mask takes one model chunk; for a list use padding_mask_pre_wrap_hook")
    core = model
    while hasattr(core, "module"):
        core = core.module
    if isinstance(core, PaddingMaskForward):
        return model
    model_module = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
    if not isinstance(core, model_module.Qwen3VLModel):
        if declares_padding_mask(core):  # e.g. Megatron-Core's GPTModel: its own path carries the mask
            logger.info("bridge_thd: %s.forward already declares padding_mask; left unchanged", type(core).__name__)
            return model
        raise TypeError(
            f"model: with_padding_mask takes Megatron-Bridge's Qwen3VLModel (or a .module wrapper chain around "
            f"one); got {type(core).__name__}, whose forward declares no padding_mask"
        )
    missing = [name for name in _CP_HELPERS if not hasattr(model_module, name)]
    if missing:
        raise TypeError(
            f"model: this Megatron-Bridge's modelling_qwen3_vl/model.py lacks {missing}, which with_padding_mask uses "
            "to cut the mask like the model cuts its row; install the Megatron-Bridge release docs/compatibility.md names"
        )
    config = core.config
    _fail_if_unsupported(config)
    layers = _moe_layers(core)
    _use_padding_aware_modules(layers)
    mtp = getattr(getattr(core, "language_model", None), "mtp", None)
    if mtp is not None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        if any(isinstance(module, MoELayer) for module in mtp.modules()):
            logger.warning(
                "bridge_thd: with_padding_mask does not reach the MoE layers of the multi-token-prediction block; "
                "their routers still count padding tokens"
            )
    core.__class__ = _padding_mask_class(type(core))
    expert_bias = any(getattr(layer.mlp.router, "enable_expert_bias", False) for layer in layers)
    logger.info(
        "bridge_thd: %s.forward now declares padding_mask (True = padding); %d MoE layer(s) of the decoder get it%s",
        type(core).__name__,
        len(layers),
        "; expert-bias counts use it" if expert_bias else "",
    )
    return model


def padding_mask_pre_wrap_hook(model_chunks: list[Any]) -> list[Any]:
    """Megatron-Bridge pre-wrap hook: :func:`with_padding_mask` on every model chunk.

    ``cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)`` (before ``finetune`` /
    ``pretrain``).
    """
    return [with_padding_mask(chunk) for chunk in model_chunks]


# rules.read_setup tells the hook among a config's pre-wrap hooks by this mark (rules.ROUTES_REAL_TOKENS_ONLY).
setattr(padding_mask_pre_wrap_hook, ROUTES_REAL_TOKENS_ONLY, True)
