"""Expert capacity from the real tokens of a row: Megatron-Core's ``"probs"`` token dropping with padding
taking no capacity (docs/moe-routing.md, "Expert capacity")."""

from __future__ import annotations

import torch


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
