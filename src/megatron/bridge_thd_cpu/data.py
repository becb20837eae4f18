"""Synthetic receipt-like VLM micro-batches in Megatron-Bridge's batch format.

The embedded default draws samples from the synthetic receipt distribution of
:mod:`megatron.bridge_thd.plan.receipts` (shaped like cord_v2 at ``seq_length`` 2048).

Samples are ``[prompt] <vision_start> <image>*n <vision_end> [2 tokens] [answer] [eos]``,
labels are the next token (Megatron convention: already shifted), ``loss_mask`` is 1 where the
label is an answer or eos token. Batches are right padded to the longest sample (as
Megatron-Bridge's collate does) or, with ``left_padding=True``, left padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.bridge_thd.plan.receipts import ReceiptSpec, receipt_sample

__all__ = ["VisualInputs", "ReceiptSpec", "receipt_sample", "synthetic_receipt_batch", "padding_free_batch",
           "select_samples"]


@dataclass
class VisualInputs:
    """The ``visual_inputs`` entry of a Megatron-Bridge VLM batch.

    The field names are those of Megatron-Bridge's ``GenericVisualInputs``
    (``training/utils/visual_inputs.py``) and of ``Qwen3VLModel.forward``.

    Attributes:
        pixel_values: ``(P, C * temporal_patch * patch * patch)`` flattened patches of all images.
        image_grid_thw: ``(I, 3)`` patch grid of each image, in order of appearance.
        pixel_values_videos: ``(P_v, C * temporal_patch * patch * patch)`` flattened patches of
            all videos (``t * h * w`` rows per video).
        video_grid_thw: ``(V, 3)`` patch grid of each video, in order of appearance.
    """

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        fields = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        return {name: getattr(self, name) for name in fields if getattr(self, name) is not None}


def synthetic_receipt_batch(
    batch_size: int,
    *,
    seed: int = 0,
    spec: ReceiptSpec = ReceiptSpec(),
    left_padding: bool = False,
    pad_to: int | None = None,
) -> dict:
    """One Megatron-Bridge VLM micro-batch of receipt-like samples.

    Args:
        batch_size: B.
        seed: samples are a pure function of the seed.
        left_padding: pad on the left instead of the right.
        pad_to: pad to this width instead of the longest sample (must be >= it).

    Returns:
        dict with ``tokens``, ``labels`` (-100 at padding), ``loss_mask`` (float),
        ``attention_mask`` (bool keep mask), ``position_ids`` (``(B, T)`` arange, as datasets emit
        them), ``visual_inputs`` (:class:`VisualInputs`), all ``(B, T)`` unless stated.
    """
    generator = torch.Generator().manual_seed(seed)
    samples = [receipt_sample(generator, spec) for _ in range(batch_size)]
    width = max(len(tokens) for tokens, _, _ in samples)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to: {pad_to} is shorter than the longest sample ({width}); raise it")
        width = pad_to
    tokens = torch.full((batch_size, width), spec.pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, width)
    keep = torch.zeros(batch_size, width, dtype=torch.bool)
    for i, (sample_tokens, supervised, _) in enumerate(samples):
        n = len(sample_tokens)
        columns = slice(width - n, width) if left_padding else slice(0, n)
        tokens[i, columns] = torch.tensor(sample_tokens)
        labels[i, columns] = torch.tensor(sample_tokens[1:] + [-100])
        loss_mask[i, columns] = torch.tensor(supervised, dtype=torch.float)
        keep[i, columns] = True
    grids = torch.tensor([grid for _, _, grid in samples], dtype=torch.long)
    pixel_values = torch.randn(int(grids.prod(-1).sum()), spec.patch_features, generator=generator)
    return batch_dict(tokens, labels, loss_mask, keep, VisualInputs(pixel_values=pixel_values, image_grid_thw=grids))


def batch_dict(tokens, labels, loss_mask, keep, visual_inputs) -> dict:
    """Megatron-Bridge's VLM micro-batch dict of ``(B, T)`` tensors, with its plain ``position_ids``."""
    batch_size, width = tokens.shape
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "attention_mask": keep,
        "position_ids": torch.arange(width).expand(batch_size, -1).clone(),
        "visual_inputs": visual_inputs,
    }


def padding_free_batch(batch: dict, multiple: int = 16) -> dict:
    """A right-padded batch cut to one length without any padding: every sample's first ``L`` tokens,
    ``L`` = the shortest sample's length rounded down to ``multiple`` (16: the padded layout rounds
    its width to 16, as Megatron-Bridge's step does, so no padding column appears either). The cut
    samples' last token predicts nothing, so it is not supervised.

    Args:
        batch: a right-padded micro-batch (``tokens``, ``labels``, ``loss_mask``, ``attention_mask``
            ``(B, T)``; other entries are kept as they are).

    Returns:
        The ``(B, L)`` batch (new tensors).
    """
    keep = batch["attention_mask"].bool()
    length = int(keep.sum(1).min()) // multiple * multiple
    if length == 0 or not keep[:, :length].all():
        raise ValueError(f"batch: needs right padding and samples of at least {multiple} tokens")
    cut = {k: (v[:, :length].clone() if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in batch.items()}
    cut["labels"][:, -1] = -100
    cut["loss_mask"] = cut["loss_mask"].float()
    cut["loss_mask"][:, -1] = 0.0
    return cut



def select_samples(batch: dict, indices, *, image_token_id: int = ReceiptSpec.image_token_id,
                   spatial_merge_size: int = ReceiptSpec.spatial_merge_size) -> dict:
    """The micro-batch of samples ``indices`` of ``batch`` (a :func:`synthetic_receipt_batch`), as a
    collate would give them: right-padded to the longest selected sample, with their images' patch
    grids and pixel rows. A sample's images are the next grids in order whose merged token counts
    add up to its image tokens.

    Returns:
        the same keys as ``batch``, ``(len(indices), T')``.
    """
    keep, grids = batch["attention_mask"].bool(), batch["visual_inputs"].image_grid_thw
    per_grid_tokens = (grids.prod(-1) // spatial_merge_size**2).tolist()
    per_grid_rows = grids.prod(-1).tolist()
    owner, starts, grid, row = [], [], 0, 0
    for i in range(keep.shape[0]):
        need = int(((batch["tokens"][i] == image_token_id) & keep[i]).sum())
        mine = []
        while need > 0:
            mine.append((grid, row))
            need -= per_grid_tokens[grid]
            row += per_grid_rows[grid]
            grid += 1
        owner.append(mine)
    indices = list(indices)
    lengths = [int(keep[i].sum()) for i in indices]
    width = max(lengths)
    out = {}
    for key in ("tokens", "labels", "loss_mask", "attention_mask"):
        fill = -100 if key == "labels" else 0
        rows = torch.full((len(indices), width), fill, dtype=batch[key].dtype)
        for k, i in enumerate(indices):
            rows[k, : lengths[k]] = batch[key][i][keep[i]]
        out[key] = rows
    out["position_ids"] = torch.arange(width).expand(len(indices), -1).clone()
    chosen = [g for i in indices for g in owner[i]]
    pixel_rows = [batch["visual_inputs"].pixel_values[r: r + per_grid_rows[g]] for g, r in chosen]
    out["visual_inputs"] = VisualInputs(
        pixel_values=torch.cat(pixel_rows) if pixel_rows else None,
        image_grid_thw=grids[[g for g, _ in chosen]] if chosen else None)
    return out
