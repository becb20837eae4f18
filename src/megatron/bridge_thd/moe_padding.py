"""Opt-in: hand the packed row's padding mask to the MoE routers of Megatron-Bridge 0.6.2's Qwen3-VL.

0.6.2's ``Qwen3VLModel.forward`` declares no ``padding_mask``, so its routers count every padding
slot of a packed row (alignment padding, the ``thd_static`` tail, BSHD pad columns) in the aux
loss, z-loss and expert-bias statistics. :func:`with_padding_mask` gives a 0.6.2 model what
Megatron-Bridge main's has: the model's class becomes ``PaddingMask<Class>`` (same parameters and
state-dict keys) whose ``forward`` declares ``padding_mask`` (True = padding); the mask, cut as the
model cuts its row (CP, SP), reaches every MoE router of the decoder; padding also stays out of
expert capacity and ``seq_aux_loss`` is per sample. Usage, before Megatron wraps the model::

    from megatron.bridge_thd.moe_padding import padding_mask_pre_wrap_hook
    cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)   # or: model = with_padding_mask(model)

Refused with the setting named: full recompute, CUDA graphs, ``mlp_chunks_for_training > 1``.
Models that already declare ``padding_mask`` are returned unchanged. Details, the upstream bug
worked around, what is not covered: docs/moe-padding-mask.md, docs/moe-routing.md; the patches
and per-instance bindings: docs/patches.md.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import types
from typing import Any

import torch

from megatron.bridge_thd.patches import Patch, apply_permanently
from megatron.bridge_thd.rules import uses_seq_aux_loss
from megatron.bridge_thd.upstream import load_bridge_module

__all__ = [
    "with_padding_mask",
    "padding_mask_pre_wrap_hook",
    "declares_padding_mask",
    "padding_mask_from_packed_seq_params",
    "PaddingMaskForward",
]

logger = logging.getLogger(__name__)

_QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"
# The 0.6.2 helpers the model itself uses to cut its row for context parallelism; the mask is
# cut with the same functions so that it lines up with the hidden states token for token.
_CP_HELPERS = ("_is_packed_input_pre_sharded", "_split_if_full_sequence", "get_packed_seq_cp_partition_indices")
_SUBCLASSES: dict[type, type] = {}


def declares_padding_mask(model) -> bool:
    """True when ``model.forward`` takes a parameter named ``padding_mask`` (not via ``**kwargs``)."""
    parameters = inspect.signature(model.forward).parameters
    parameter = parameters.get("padding_mask")
    return parameter is not None and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)


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
    segment = torch.searchsorted(cu_physical[1:], positions, right=True)
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
            f"config.cuda_graph_impl={cuda_graph_impl!r}: CUDA-graphed transformer layers bypass module hooks, so "
            "with_padding_mask cannot hand the padding mask to their MoE routers. Set cuda_graph_impl='none' or do "
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
    from megatron.core.transformer.moe.moe_layer import MoELayer

    language_model = getattr(model, "language_model", None)
    decoder = getattr(language_model, "decoder", None)
    if decoder is None:
        return []
    return [layer for layer in decoder.layers if isinstance(getattr(layer, "mlp", None), MoELayer)]


def _apply_expert_bias_with_token_mask(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """``TopKRouter._apply_expert_bias`` with the ``(tokens,)`` mask as ``(tokens, 1)``.

    Megatron-Core 0.19.2 computes ``routing_map & (~padding_mask)`` with ``routing_map`` of shape
    ``(tokens, experts)`` and the flattened ``(tokens,)`` mask, which does not broadcast. The
    column view makes it drop every padding token's row; the rest is Megatron-Core's method.
    """
    if padding_mask is not None and padding_mask.dim() == 1:
        padding_mask = padding_mask.unsqueeze(-1)
    return type(self)._apply_expert_bias(self, routing_map, padding_mask)


def _fix_expert_bias(layers: list) -> None:
    for layer in layers:
        router = layer.mlp.router
        if not getattr(router, "enable_expert_bias", False):
            continue
        if not callable(getattr(type(router), "_apply_expert_bias", None)):
            raise ValueError(
                "config.moe_router_enable_expert_bias=True: the router class "
                f"{type(router).__name__} has no _apply_expert_bias to fix for the padding mask (this module targets "
                "Megatron-Core 0.19.2's TopKRouter). Set moe_router_enable_expert_bias=False or do not use "
                "with_padding_mask."
            )
        # A bound method on the instance: it shadows the class method for this router only
        # (state dicts and other models are untouched).
        router._apply_expert_bias = types.MethodType(_apply_expert_bias_with_token_mask, router)


# The padding mask of the router call in progress ((tokens,) bool, True = padding), for the token
# dropping Megatron-Core's TopKRouter.routing calls without it; and the samples of the THD row in
# the model forward in progress (see _thd_samples).
_ROUTING_PADDING: contextvars.ContextVar = contextvars.ContextVar("bridge_thd_routing_padding", default=None)
_THD_SAMPLES: contextvars.ContextVar = contextvars.ContextVar("bridge_thd_thd_samples", default=None)


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


_UPSTREAM_TOKEN_DROPPING = None


def _token_dropping(routing_probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                    pad_to_capacity=False):
    """Stands in for ``megatron.core.transformer.moe.router.apply_router_token_dropping``: inside a
    router of a :func:`with_padding_mask` model that got a mask, :func:`capacity_token_dropping`;
    anywhere else Megatron-Core's own function, unchanged."""
    padding_mask = _ROUTING_PADDING.get()
    if padding_mask is None:
        return _UPSTREAM_TOKEN_DROPPING(routing_probs, routing_map, router_topk=router_topk,
                                        capacity_factor=capacity_factor, drop_policy=drop_policy,
                                        pad_to_capacity=pad_to_capacity)
    return capacity_token_dropping(routing_probs, routing_map, padding_mask, router_topk=router_topk,
                                   capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity)


def _token_dropping_patch() -> Patch:
    from megatron.core.transformer.moe import router as router_module

    return Patch(router_module, "apply_router_token_dropping", _token_dropping,
                 "TopKRouter.routing calls it without the padding mask: capacity from the real tokens, padding takes none")


def _install_token_dropping() -> None:
    """Point Megatron-Core's router module at :func:`_token_dropping`, permanently and once
    (:func:`megatron.bridge_thd.patches.apply_permanently`); it defers to the original whenever no
    mask is in flight."""
    global _UPSTREAM_TOKEN_DROPPING
    _UPSTREAM_TOKEN_DROPPING = apply_permanently(_token_dropping_patch())


def _routing_with_padding(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
    """``TopKRouter.routing`` with the call's padding mask visible to the token dropping.

    The mask arrives as the routing argument itself (also when ``recompute_modules=['moe']``
    re-runs the router in the backward pass), so dropping is the same in both passes."""
    token = _ROUTING_PADDING.set(None if padding_mask is None else padding_mask.reshape(-1))
    try:
        return type(self).routing(self, logits, padding_mask=padding_mask)
    finally:
        _ROUTING_PADDING.reset(token)


def _apply_seq_aux_loss_per_sample(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
                                   with_padding_mask=False):
    """``TopKRouter._apply_seq_aux_loss`` per sample of a THD row (``router.py``).

    Megatron-Core folds the batch dimension into the experts: ``(s, b * E)``, a switch loss per
    sequence, divided by ``b``. A THD row reaches the router as one sequence (``b = 1``), so it
    would become a whole-row statistic. Here each token's scores and routing go to its sample's
    block, ``(samples, E)`` summed per sample, with ``b`` = the number of samples of the
    micro-batch (zero-length samples count, as all-padding rows of the padded layout do; padding
    segments such as the static tail do not): Megatron-Core's own formula on the same numbers.
    Outside a THD forward (the padded layout, ``b > 1``) it is Megatron-Core's method unchanged.
    """
    samples = _THD_SAMPLES.get()
    if samples is None or bsz != 1:
        return type(self)._apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz,
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
        probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group, valid_token_count=local_num_tokens * num_samples,
    )


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


def _fix_routers(layers: list) -> None:
    """Per router instance (state dicts and other models untouched): token dropping that sees the
    padding mask, and seq_aux_loss per sample of a THD row."""
    for layer in layers:
        router = layer.mlp.router
        config = router.config
        if getattr(config, "moe_expert_capacity_factor", None) is not None:
            _install_token_dropping()
            router.routing = types.MethodType(_routing_with_padding, router)
        if uses_seq_aux_loss(config):
            router._apply_seq_aux_loss = types.MethodType(_apply_seq_aux_loss_per_sample, router)


class PaddingMaskForward:
    """Mixin of the classes :func:`with_padding_mask` creates; its ``forward`` is set per class."""

    # Read by the step (by name, without importing this module): the routers of this model keep
    # padding out of expert capacity and compute seq_aux_loss per sample of a THD row.
    bridge_thd_routes_real_tokens_only = True

    def _padding_mask_for_layers(self, padding_mask: torch.Tensor, input_ids, packed_seq_params, *,
                                 dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """The mask cut the way the model cuts its hidden states: ``(b, s_local)`` bool.

        ``padding_mask`` has the shape of ``input_ids``: ``(1, N)`` for a THD row, ``(B, T)`` for
        BSHD, the rank-local row for pre-sharded THD input. Context parallelism: the THD row is
        cut with the model's own ``get_packed_seq_cp_partition_indices`` (zigzag per segment),
        BSHD with its ``_split_if_full_sequence``. Sequence parallelism: rank r of the TP group
        keeps the r-th of ``tp`` equal chunks of the sequence, as
        ``scatter_to_sequence_parallel_region`` does with the hidden states.
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
        cp_group = self.pg_collection.cp
        cp_size = cp_group.size()
        if cp_size > 1:
            helpers = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
            cp_rank = cp_group.rank()
            if packed_seq_params is not None:
                # Pre-sharded THD input is already rank-local, and so is its mask.
                if not helpers._is_packed_input_pre_sharded(input_ids, packed_seq_params, cp_size=cp_size):
                    index = helpers.get_packed_seq_cp_partition_indices(
                        packed_seq_params,
                        total_tokens=input_ids.size(1),
                        cp_size=cp_size,
                        cp_rank=cp_rank,
                        device=input_ids.device,
                        cp_group=cp_group,
                    )
                    mask = mask.index_select(1, index)
            else:
                mask, _ = helpers._split_if_full_sequence(
                    mask, cp_size=cp_size, seq_dim=1, cp_rank=cp_rank, full_sequence_length=input_ids.size(1)
                )
        tp_size = self.pg_collection.tp.size()
        if getattr(self.config, "sequence_parallel", False) and tp_size > 1:
            length = mask.size(1)
            if length % tp_size:
                raise ValueError(
                    f"padding_mask: the rank-local sequence of {length} tokens is not divisible by the "
                    f"tensor-parallel size {tp_size} (sequence parallelism); align the row to tp"
                )
            chunk = length // tp_size
            mask = mask.narrow(1, self.pg_collection.tp.rank() * chunk, chunk)
        return mask.contiguous()

    @contextlib.contextmanager
    def _padding_mask_hooks(self, layers: list, mask: torch.Tensor):
        """For the duration of one forward: the MoE ``layers`` get ``padding_mask=mask`` and their
        routers report whether it arrived."""
        arrived = {id(layer.mlp.router): 0 for layer in layers}
        missing: list[int] = []

        def layer_hook(module, args, kwargs):
            if kwargs.get("padding_mask") is not None:
                return None  # a caller that already passes one keeps it
            hidden_states = kwargs.get("hidden_states", args[0] if args else None)
            if hidden_states is not None and tuple(mask.shape) != (hidden_states.shape[1], hidden_states.shape[0]):
                raise ValueError(
                    f"padding_mask: the rank-local mask has shape {tuple(mask.shape)} but layer {module.layer_number} "
                    f"sees hidden states of shape {tuple(hidden_states.shape)} (s, b, h); expected (b, s)"
                )
            kwargs = dict(kwargs)
            kwargs["padding_mask"] = mask
            return args, kwargs

        def router_hook(module, args, kwargs):
            given = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            if given is None:
                missing.append(module.layer_number)
            else:
                arrived[id(module)] += 1

        handles = []
        try:
            for layer in layers:
                handles.append(layer.register_forward_pre_hook(layer_hook, with_kwargs=True))
                handles.append(layer.mlp.router.register_forward_pre_hook(router_hook, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
        never = [layer.layer_number for layer in layers if not arrived[id(layer.mlp.router)]]
        if missing or never:
            raise RuntimeError(
                f"with_padding_mask: the MoE routers of layers {sorted(set(missing + never))} ran without the padding "
                "mask (a code path that drops the layer's padding_mask keyword, e.g. CUDA graphs or chunked MLP); "
                "their load-balancing statistics would count padding tokens"
            )

    def _forward_with_padding_mask(self, base_forward, base_signature, args, kwargs, padding_mask):
        _fail_if_unsupported(self.config)
        layers = _moe_layers(self)
        if not layers:  # a dense model, or a pipeline stage without MoE layers: nothing to hand over
            return base_forward(self, *args, **kwargs)
        bound = base_signature.bind(self, *args, **kwargs).arguments
        input_ids = bound.get("input_ids")
        packed_seq_params = bound.get("packed_seq_params")
        if (
            padding_mask is None
            and packed_seq_params is not None
            and input_ids is not None
            and input_ids.dim() == 2
            and input_ids.size(0) == 1
        ):
            # As Megatron-Bridge main does: a THD row without an explicit mask gets the one its
            # boundaries imply. Pre-sharded CP input is rank-local while its boundaries describe
            # the full row: no mask is derived for it.
            cp_size = self.pg_collection.cp.size()
            helpers = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
            if cp_size == 1 or not helpers._is_packed_input_pre_sharded(input_ids, packed_seq_params, cp_size=cp_size):
                padding_mask = padding_mask_from_packed_seq_params(packed_seq_params, input_ids.size(1))
        if padding_mask is None:
            return base_forward(self, *args, **kwargs)
        mask = self._padding_mask_for_layers(padding_mask, input_ids, packed_seq_params)
        samples = None
        if packed_seq_params is not None and tuple(padding_mask.shape) == tuple(input_ids.shape) \
                and input_ids.size(0) == 1 and uses_seq_aux_loss(self.config):
            segment, num_samples = thd_sample_index(packed_seq_params, input_ids.size(1))
            # Cut exactly as the mask (and the hidden states): CP zigzag, SP scatter.
            local = self._padding_mask_for_layers(segment, input_ids, packed_seq_params, dtype=torch.int64)
            samples = (local.transpose(0, 1), packed_seq_params.cu_seqlens_q.numel() - 1, num_samples)
        token = _THD_SAMPLES.set(samples)
        try:
            with self._padding_mask_hooks(layers, mask):
                return base_forward(self, *args, **kwargs)
        finally:
            _THD_SAMPLES.reset(token)


def _signature_with_padding_mask(base_forward) -> inspect.Signature:
    """The base ``forward`` signature plus ``padding_mask`` (keyword-only, before ``**kwargs``)."""
    signature = inspect.signature(base_forward)
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
    # Module-level name: pickle finds the class by reference.
    globals()[name] = subclass
    _SUBCLASSES[cls] = subclass
    return subclass


def with_padding_mask(model):
    """Make a Megatron-Bridge 0.6.2 ``Qwen3VLModel`` take ``padding_mask`` and hand it to its MoE routers.

    In place: the model (or, for a wrapper chain such as DDP / ``Float16Module``, the innermost
    ``.module``) changes class to ``PaddingMask<Class>``; see docs/moe-padding-mask.md.

    Args:
        model: a Megatron-Bridge 0.6.2 ``Qwen3VLModel`` (a model chunk), or a ``.module`` wrapper
            chain around one.

    Returns:
        ``model`` itself. Unchanged when its ``forward`` already declares ``padding_mask``
        (Megatron-Bridge main's ``Qwen3VLModel``, Megatron-Core's ``GPTModel``, a model already
        passed through this function).

    Raises:
        TypeError: ``model`` is not a Megatron-Bridge ``Qwen3VLModel`` (and declares no ``padding_mask``).
        ValueError: ``recompute_granularity='full'``, ``cuda_graph_impl`` other than ``'none'`` or
            ``mlp_chunks_for_training > 1`` (the mask could not reach every router); the message
            names the setting and the fix.
    """
    if isinstance(model, (list, tuple)):
        raise TypeError("model: with_padding_mask takes one model chunk; for a list use padding_mask_pre_wrap_hook")
    core = model
    while hasattr(core, "module"):
        core = core.module
    if declares_padding_mask(core):
        logger.info("bridge_thd: %s.forward already declares padding_mask; left unchanged", type(core).__name__)
        return model
    model_module = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
    if not isinstance(core, model_module.Qwen3VLModel):
        raise TypeError(
            f"model: with_padding_mask takes Megatron-Bridge 0.6.2's Qwen3VLModel (or a .module wrapper chain around "
            f"one); got {type(core).__name__}, whose forward declares no padding_mask"
        )
    missing = [name for name in _CP_HELPERS if not hasattr(model_module, name)]
    if missing:
        raise TypeError(
            f"model: this Megatron-Bridge's modelling_qwen3_vl/model.py lacks {missing}, which with_padding_mask uses "
            "to cut the mask like the model cuts its row; it targets Megatron-Bridge 0.6.2"
        )
    config = core.config
    _fail_if_unsupported(config)
    layers = _moe_layers(core)
    _fix_expert_bias(layers)
    _fix_routers(layers)
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
    ``pretrain``); chunks whose ``forward`` already declares ``padding_mask`` are left as they are.
    """
    return [with_padding_mask(chunk) for chunk in model_chunks]
