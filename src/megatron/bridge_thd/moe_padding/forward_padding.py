"""The one channel from a :func:`~megatron.bridge_thd.moe_padding.hook.with_padding_mask` model's forward to its MoE
layers and routers: a single context variable, set for the duration of the call."""

from __future__ import annotations

import contextvars
from typing import NamedTuple

import torch


class ForwardPadding(NamedTuple):
    """What a :func:`with_padding_mask` model's forward hands its MoE layers and routers."""

    # (b, s_local) bool, True = padding, cut exactly as the model cuts its hidden states.
    mask: torch.Tensor
    # For seq_aux_loss of a THD row: (sample of each token (s_local, b) int64, segments, 0-dim sample
    # count), cut like the mask; None otherwise (see thd_sample_index).
    samples: tuple | None


# The one channel from the model to its MoE layers: set by PaddingMaskForward.forward for the
# duration of the call (Megatron-Bridge's Qwen3-VL decoder calls its layers without padding_mask), read by
# PaddingMaskMoELayer.forward (the mask) and PaddingMaskTopKRouter._apply_seq_aux_loss (the samples).
FORWARD_PADDING: contextvars.ContextVar[ForwardPadding | None] = contextvars.ContextVar(
    "bridge_thd_forward_padding", default=None
)
