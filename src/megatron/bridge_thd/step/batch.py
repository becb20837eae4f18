"""The step's first stage: the micro-batch's tensors read from Megatron-Bridge's batch dict, where they arrived
(nothing copied, nothing computed). Next: :mod:`megatron.bridge_thd.step.capture`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.bridge_thd.overlong import SAMPLE_INDEX_KEY

__all__ = ["Inputs", "read_batch"]


@dataclass
class Inputs:
    """The micro-batch as the iterator gave it, on the device it arrived on (nothing copied yet)."""

    tokens: torch.Tensor  # (B, T)
    labels: torch.Tensor | None  # (B, T), last pipeline stage only
    loss_mask: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor | None  # (B, T) or 4D
    multi_modal: dict  # the visual inputs as the model takes them (pixel_values, image_grid_thw, ...)
    sample_index: torch.Tensor | None = None  # (B,) dataset indices, where the loader attached them


def read_batch(batch: dict, is_last_stage: bool) -> Inputs:
    """The micro-batch's tensors, where they are."""
    if batch.get("cu_seqlens_q") is not None or batch.get("cu_seqlens") is not None:
        raise ValueError(
            "batch: this step packs the micro-batch itself; use an unpacked collate (no cu_seqlens in the batch)"
        )
    tokens = batch.get("tokens")
    if tokens is None:
        tokens = batch.get("input_ids")
    if tokens is None or tokens.dim() != 2:
        raise ValueError("batch: expected 'tokens' or 'input_ids' of shape (B, T)")
    labels = batch.get("labels") if is_last_stage else None
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones_like(tokens, dtype=torch.float)
    visual = batch.get("visual_inputs")
    multi_modal = visual.normalized_for_model() if visual is not None else {}
    multi_modal = {k: v for k, v in multi_modal.items() if v is not None}
    return Inputs(tokens, labels, loss_mask, batch.get("attention_mask"), multi_modal, batch.get(SAMPLE_INDEX_KEY))
