"""A static THD row between pipeline stages whose p2p buffers have Megatron-Core's fixed
``(seq_length / cp, micro_batch_size, H)`` shape: the row a stage receives viewed as the ``(S, 1, H)`` THD row it
holds, and the row it sends shaped as the next stage's buffer."""

from __future__ import annotations

import torch

__all__ = ["view_received_row_as_thd", "shape_for_next_stage"]


def view_received_row_as_thd(decoder) -> None:
    """On a receiving stage, view the ``(S, micro_batch_size, H)`` buffer Megatron-Core filled
    (``TransformerBlock.set_input_tensor``) as the ``(S * micro_batch_size, 1, H)`` THD row it holds.
    The view keeps the buffer as the autograd leaf the schedule reads ``.grad`` from."""
    received = getattr(decoder, "input_tensor", None)
    if received is not None and received.dim() == 3 and received.shape[1] != 1:
        decoder.input_tensor = received.reshape(-1, 1, received.shape[-1])


def shape_for_next_stage(output: torch.Tensor, p2p_micro_batch_size: int) -> torch.Tensor:
    """The (CP-local) row a stage sends, in the ``(S, micro_batch_size, H)`` shape of the next stage's buffer."""
    return output.reshape(-1, p2p_micro_batch_size, output.shape[-1])
