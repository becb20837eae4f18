"""The padding-aware MoE layer and router: Megatron-Core's ``MoELayer`` and ``TopKRouter`` subclassed (the router
with a copy of Megatron-Core's ``routing`` step that keeps capacity to the real tokens), and the in-place class
change of a model's decoder MoE layers to them."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter

from megatron.bridge_thd.moe_padding.capacity import capacity_token_dropping
from megatron.bridge_thd.moe_padding.forward_padding import FORWARD_PADDING
from megatron.bridge_thd.upstream.loading import load_bridge_module


def moe_layers(model) -> list:
    """The decoder's MoE ``TransformerLayer`` s on this pipeline stage (empty without a language model)."""
    language_model = model.language_model  # None on a Qwen3VLModel built without one
    if language_model is None:
        return []
    return [layer for layer in language_model.decoder.layers if isinstance(layer.mlp, MoELayer)]


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
        forward_padding = FORWARD_PADDING.get()
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
    * The load-balancing losses' gradient scale under per-token loss with context parallelism: the group's valid
      tokens, counted exactly (:meth:`_apply_aux_loss`; Megatron-Core's count is the group's times its size);
      for ``global_aux_loss`` the same over data parallelism too (:meth:`_apply_global_aux_loss`).
    * Refuses to route without a mask inside the forward of a :func:`with_padding_mask` model (a
      code path dropped it: its statistics would count padding).

    Without a mask, or in the padded layout, every method is Megatron-Core's.
    """

    def forward(self, input: torch.Tensor, padding_mask: torch.Tensor | None = None):
        if padding_mask is None and FORWARD_PADDING.get() is not None:
            raise RuntimeError(
                f"with_padding_mask: the MoE router of layer {self.layer_number} ran without the padding mask (a "
                "code path that drops the MoE layer's padding_mask, e.g. CUDA graphs or chunked MLP); its "
                "load-balancing statistics would count padding tokens"
            )
        return super().forward(input, padding_mask=padding_mask)

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """``TopKRouter._apply_aux_loss`` with the valid tokens of the reduce group counted exactly.

        Megatron-Core's ``get_tokens_per_expert_and_token_count`` all-reduces the per-expert counts in place
        (``mappings._reduce`` mutates a contiguous input) and then reads the rank's own token count from the same
        tensor, so under context parallelism with a padding mask the "local" count is the group's and the loss's
        gradient is scaled ``group size`` times too much (measured: exactly 2x at CP = 2). Its scale, ``local valid
        tokens x group size``, also stands in for the group's valid tokens only when every rank holds as many,
        which a THD row cut for CP does not. Here the counts are reduced from a copy and the scale is the group's
        valid tokens (``valid_token_count = total / group size``). Without a mask, Megatron-Core's method.
        """
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0 or not with_padding_mask:
            return super()._apply_aux_loss(probs, scores_for_aux_loss, routing_map, with_padding_mask=with_padding_mask)
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

        group = self.tp_cp_group
        global_counts = reduce_from_tensor_model_parallel_region(routing_map.sum(dim=0).clone(), group)
        total_num_tokens = global_counts.sum() / self.topk
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=global_counts, total_num_tokens=total_num_tokens,
            topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )
        return self.attach_and_log_load_balancing_loss(probs, coeff, aux_loss, "load_balancing_loss", group,
                                                       valid_token_count=total_num_tokens / group.size())

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        """``TopKRouter._apply_global_aux_loss`` (``megatron/core/transformer/moe/router.py``) with the valid tokens
        counted exactly.

        Line for line Megatron-Core's method: the per-expert counts all-reduced over the TP x DP x CP group, added to
        the running ``global_tokens_per_expert`` (``ga_steps`` micro-batches, reset by Megatron-Core's
        ``reset_global_aux_loss_tracker``), the switch loss of this rank's scores ``(tokens, experts)`` against their
        average, the micro-batch's group-wide valid tokens as ``total_num_tokens``, logged over that group without
        the DP average. What differs is the count: Megatron-Core reads the rank's "local" valid tokens from the
        counts it has just all-reduced in place (``get_tokens_per_expert_and_token_count``, see
        :meth:`_apply_aux_loss`), so with a padding mask the gradient scale is the whole TP x DP x CP group's tokens
        and the loss's gradient is that group's size times too large (measured: exactly 2x at DP = 2 and at
        CP = 2). Here the counts are reduced from a copy and ``valid_token_count`` is the valid tokens of this rank's
        TP x CP group over its size, the scale :meth:`_apply_aux_loss` gives (the rank's own valid tokens at
        TP = CP = 1, what Megatron-Core's method passes without a mask). Without a mask, Megatron-Core's method.
        """
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0 or not with_padding_mask:
            return super()._apply_global_aux_loss(probs, scores_for_aux_loss, routing_map,
                                                  with_padding_mask=with_padding_mask)
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
        from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

        local_counts = routing_map.sum(dim=0)
        global_counts = reduce_from_tensor_model_parallel_region(local_counts.clone(), self.tp_dp_cp_group)
        total_num_tokens = global_counts.sum() / self.topk

        self.global_tokens_per_expert += global_counts
        self.ga_steps += 1
        averaged_tokens_per_expert = self.global_tokens_per_expert / self.ga_steps

        global_aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=averaged_tokens_per_expert, total_num_tokens=total_num_tokens,
            topk=self.topk, num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion,
        )
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, global_aux_loss, "global_load_balancing_loss", self.tp_dp_cp_group, needs_dp_avg=False,
            valid_token_count=self._tp_cp_valid_tokens(local_counts) / self.tp_cp_group.size(),
        )

    def _tp_cp_valid_tokens(self, local_counts: torch.Tensor) -> torch.Tensor:
        """The valid tokens this rank's TP x CP group routes, ``()``, from the rank's per-expert counts
        ``(experts,)`` (padding rows of the aux-loss routing map are zero), all-reduced from a copy."""
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        return reduce_from_tensor_model_parallel_region(local_counts.sum().clone(), self.tp_cp_group) / self.topk

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
        elif self.routing_type == "quantile_balancing":  # the hook's rules refuse it before any forward
            assert padding_mask is None, "Quantile balancing routing does not support padding masks yet."
            probs, routing_map = self.quantile_balancing(logits)
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
        forward_padding = FORWARD_PADDING.get()
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
        # Reduced from a copy: Megatron-Core's all-reduce mutates a contiguous input in place (see _apply_aux_loss).
        global_counts = reduce_from_tensor_model_parallel_region(counts.reshape(-1).clone(), self.tp_cp_group)
        total_num_tokens = global_counts.sum() / (self.topk * num_samples)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores.reshape(1, -1), tokens_per_expert=global_counts, total_num_tokens=total_num_tokens,
            topk=self.topk, num_experts=experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion,
        ) / num_samples
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group,
            valid_token_count=total_num_tokens * num_samples / self.tp_cp_group.size(),
        )


def use_padding_aware_modules(layers: list) -> None:
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
    if layers:
        register_for_weight_conversion()
    for layer in layers:
        layer.mlp.__class__ = PaddingMaskMoELayer
        layer.mlp.router.__class__ = PaddingMaskTopKRouter


def register_for_weight_conversion() -> None:
    """Tell Megatron-Bridge's weight conversion the layout of :class:`PaddingMaskTopKRouter`'s weight.

    Its ``AutoMapping`` (``models/conversion/param_mapping.py``) finds a weight's tensor-parallel layout from the
    class name of the module holding it, in a registry that lists ``TopKRouter`` as replicated; any other name is
    refused ("Cannot determine parallelism type"). The routers are changed before Megatron-Bridge loads a Hugging
    Face checkpoint into the model (the hook runs when the model is built, ``finetune()`` loads after), so without
    this the load of a Qwen3-VL MoE checkpoint fails. The router's weight is whole on every TP rank, as
    ``TopKRouter``'s: registered as replicated (once per process; registering again changes nothing).
    """
    try:
        mapping = load_bridge_module("models.conversion.param_mapping").AutoMapping
    except ModuleNotFoundError:  # no Megatron-Bridge here (a Megatron-Core model outside its loop): nothing converts
        return
    mapping.register_module_type(PaddingMaskTopKRouter.__name__, "replicated")
