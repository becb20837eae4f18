"""Batches for the tests on Megatron-Bridge 0.6.2's real ``Qwen3VLModel`` (CPU build).

Module-level functions only: the CP workers run them in spawned gloo processes.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd.cpu.parity import (  # noqa: F401 - re-exported for the tests
    gradients,
    masked_loss_sum,
    max_abs_dlogp,
    per_sample_from_output,
    per_sample_losses_and_gradients,
    per_sample_token_losses,
    sample_inputs,
    step_run,
    worst_relative_gradient_error,
)
from megatron.bridge_thd.data import VisualInputs, synthetic_receipt_batch

IMAGE = 250


class FakeGroup:
    """Stands in for a ``torch.distributed.ProcessGroup`` (``torch/distributed/distributed_c10d.py``)
    where only ``size()`` and ``rank()`` are read, as those methods return them."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def trimmed(batch: dict, lengths: list[int]) -> dict:
    """A right-padded receipt batch with sample i cut to its first ``lengths[i]`` tokens (past its
    image, so no image is cut); the cut tokens become padding."""
    batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    width = batch["tokens"].shape[1]
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    assert (keep <= batch["attention_mask"]).all(), "trimmed: lengths must not exceed the real lengths"
    batch["attention_mask"] = keep
    batch["tokens"] = torch.where(keep, batch["tokens"], 0)
    # The new last token predicts nothing; padding is never supervised.
    last = keep & ~torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    batch["labels"] = torch.where(keep & ~last, batch["labels"], -100)
    batch["loss_mask"] = torch.where(keep & ~last, batch["loss_mask"], 0.0)
    return batch


def receipt_batch(padding: str, seed: int = 1, batch_size: int = 3) -> dict:
    return synthetic_receipt_batch(batch_size, seed=seed, left_padding=padding == "left")


def last_slot_batch(cp_align: int = 8, seed: int = 1) -> dict:
    """Every sample's length a multiple of ``cp_align`` except the last one's: under CP the only
    alignment padding is in the last slot (the case TransformerEngine issue 3331 misses)."""
    batch = receipt_batch("right", seed=seed)
    lengths = batch["attention_mask"].sum(1).tolist()
    target = [n - n % cp_align for n in lengths[:-1]] + [lengths[-1] - lengths[-1] % cp_align - cp_align + 3]
    return trimmed(batch, target)


def all_padding_batch(width: int = 64) -> dict:
    """A micro-batch whose samples are all padding (no real token, no image)."""
    return {
        "tokens": torch.zeros(2, width, dtype=torch.long),
        "labels": torch.full((2, width), -100),
        "loss_mask": torch.zeros(2, width),
        "attention_mask": torch.zeros(2, width, dtype=torch.bool),
        "position_ids": torch.arange(width).expand(2, -1).clone(),
        "visual_inputs": VisualInputs(),
    }
