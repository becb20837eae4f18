"""What one micro-batch cost, for logging: :class:`PackingStats` (token slots and attention work of the layout
that ran against the padded one's) and :func:`decoder_signature` (what a CUDA-graph manager compares). Device
tensors stay where they are: no host synchronisation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.bridge_thd.step.capture import Captured
from megatron.bridge_thd.step.rows import Built, padded_width
from megatron.bridge_thd.step.plan import StepPlan

__all__ = ["PackingStats", "decoder_signature", "packing_stats"]


@dataclass
class PackingStats:
    """Per micro-batch bookkeeping for logging (tensors on the batch's device: no sync).

    Attributes:
        layout: the layout that ran.
        real_tokens: 0-dim, real tokens in the micro-batch (after truncation).
        processed_tokens: int, token slots the model processes (row length or B * T).
        padded_tokens: int, token slots of the padded BSHD layout, ``B * T_bshd``.
        attention_work: 0-dim, sum over samples of ``s_i ** 2`` actually computed
            (``B * T_bshd ** 2`` for BSHD).
        padded_attention_work: int, ``B * T_bshd ** 2``, what the padded layout computes.
        truncated_tokens: 0-dim, real tokens cut because a sample exceeded ``seq_length``.
        signature: what a CUDA-graph manager compares of what the decoder sees (:func:`decoder_signature`);
            in ``thd_static`` the same for every micro-batch of a run.
        truncated_samples / dropped_samples: host ints, the micro-batch's samples the over-long policy cut to
            ``seq_length`` / dropped from the loss, from the lengths the collate measured before its cut
            (``overlong.LENGTHS_KEY``, a host tensor); 0 where the batch carries none.
    """

    layout: str
    real_tokens: torch.Tensor
    processed_tokens: int
    padded_tokens: int
    attention_work: torch.Tensor
    padded_attention_work: int
    truncated_tokens: torch.Tensor
    signature: tuple = ()
    truncated_samples: int = 0
    dropped_samples: int = 0


_DECODER_INPUTS = ("input_ids", "position_ids", "labels", "loss_mask")
_PACKED_SEQ_FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                      "max_seqlen_q", "max_seqlen_kv", "pad_between_seqs")


def decoder_signature(forward_args: dict) -> tuple:
    """``((name, value), ...)`` of the token-level inputs and each ``PackedSeqParams`` field: a tensor as
    ``(shape, dtype)``, anything else as it is. Megatron-Core's CUDA-graph managers replay a captured graph only
    for arguments equal in exactly these (docs/cuda-graphs.md). Host metadata only: no device read."""
    def describe(value):
        return (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else value

    params = forward_args.get("packed_seq_params")
    return (tuple((name, describe(forward_args.get(name))) for name in _DECODER_INPUTS)
            + tuple((name, describe(getattr(params, name, None))) for name in _PACKED_SEQ_FIELDS))


def packing_stats(captured: Captured, built: Built, forward_args: dict, plan: StepPlan,
                  cut_samples: tuple[int, int] = (0, 0)) -> PackingStats:
    """The micro-batch's :class:`PackingStats`: what the layout that ran processes (``forward_args`` on the model's
    device) against the padded layout's ``B * W`` slots; ``cut_samples``: (truncated, dropped) samples, host ints
    (:func:`~megatron.bridge_thd.step.capture.overlong_sample_counts`)."""
    batch_size = captured.batch_size
    width = padded_width(captured, plan)
    return PackingStats(
        layout=plan.layout,
        real_tokens=captured.keep.sum(),
        processed_tokens=forward_args["input_ids"].numel(),
        padded_tokens=batch_size * width,
        attention_work=built.attention_work,
        padded_attention_work=batch_size * width**2,
        truncated_tokens=(captured.keep.new_zeros((), dtype=torch.int64) if captured.truncated is None
                          else captured.truncated.sum()),
        signature=decoder_signature(forward_args),
        truncated_samples=cut_samples[0],
        dropped_samples=cut_samples[1],
    )
