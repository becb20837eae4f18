"""``bridge-thd scan``'s measurement: one collated sample as a :class:`ScannedSample` (:func:`measure`), run in the
loader workers by :class:`_MeasureEach`, and a scanned split (:class:`Scan`). Reasoning: docs/scan.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.bridge_thd.batching.sizes import visual_grids

__all__ = ["ScannedSample", "Scan", "measure"]


@dataclass(frozen=True)
class ScannedSample:
    """One distinct sample as its collate gives it, before any cut: ``tokens`` real tokens; ``spans`` its
    supervised (loss mask) positions as half-open ``(start, end)`` runs; ``grids`` its images' then videos'
    ``(t, h, w)`` patch grids; ``placeholders`` its image / video placeholder tokens and ``image_end`` one past
    the last (0 without; both None where the placeholder token ids are not known)."""

    tokens: int
    spans: tuple[tuple[int, int], ...]
    grids: tuple[tuple[int, int, int], ...]
    placeholders: int | None
    image_end: int | None

    @property
    def supervised(self) -> int:
        return sum(end - start for start, end in self.spans)

    def supervised_within(self, length: int) -> int:
        """Supervised tokens among the first ``length`` positions (what a cut to ``length`` keeps)."""
        return sum(max(0, min(end, length) - start) for start, end in self.spans)

    def image_tokens(self, merge: int) -> int:
        """LLM tokens of its images / videos: ``t * h * w / merge**2`` each."""
        return sum(t * h * w // (merge * merge) for t, h, w in self.grids)


@dataclass(frozen=True)
class Scan:
    """A scanned split: its distinct ``samples`` (dataset index ``i`` is distinct sample ``i % len(samples)``),
    ``total`` dataset indices, the processor's spatial ``merge``, where the scan is ``cached`` and whether it was
    read from there (``from_cache``), and the scan's ``seconds`` (0 from the cache)."""

    samples: tuple[ScannedSample, ...]
    total: int
    merge: int
    cached: Path | None = None
    from_cache: bool = False
    seconds: float = 0.0
    workers: int = 1


def _spans(row) -> tuple[tuple[int, int], ...]:
    """Half-open runs of the nonzero positions of a 1D tensor."""
    positions = torch.nonzero(row != 0).flatten().tolist()
    spans, start = [], None
    for k, p in enumerate(positions):
        if start is None:
            start = p
        if k + 1 == len(positions) or positions[k + 1] != p + 1:
            spans.append((start, p + 1))
            start = None
    return tuple(spans)


def measure(batch: dict, index: int, placeholder_ids: tuple[int, ...] = ()) -> ScannedSample:
    """One collated sample (a batch of one, not cut) as a :class:`ScannedSample`.

    Raises:
        ValueError: no 2D attention mask, or one that is not right-padded (naming the dataset index).
    """
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"dataset sample {index}: the collate gives no 2D attention_mask, so its real length is "
                         "unknown (bridge-thd scan reads a collate that pads rows, not one that packs them)")
    real = mask[0] != 0
    tokens = int(real.sum())
    if not bool(real[:tokens].all()):
        raise ValueError(f"dataset sample {index}: its attention mask is not right-padded (real tokens are not the "
                         "row's first columns); Megatron-Bridge's cut to seq_length keeps the first columns, so the "
                         "scan cannot say what it keeps")
    loss_mask = batch.get("loss_mask")
    if not isinstance(loss_mask, torch.Tensor):
        labels = batch.get("labels")
        loss_mask = labels != -100 if isinstance(labels, torch.Tensor) else torch.zeros_like(mask)
    grids = visual_grids(batch)
    placeholders = image_end = None
    ids = batch.get("input_ids", batch.get("tokens"))
    if placeholder_ids and isinstance(ids, torch.Tensor):
        where = torch.nonzero(torch.isin(ids[0, :tokens], torch.tensor(placeholder_ids, dtype=ids.dtype))).flatten()
        placeholders = int(where.numel())
        image_end = int(where[-1]) + 1 if placeholders else 0
    return ScannedSample(tokens, _spans(loss_mask[0]), tuple(grids), placeholders, image_end)


class _MeasureEach:
    """The scan's collate in a worker: each sample collated alone and measured."""

    def __init__(self, collate_fn, placeholder_ids: tuple[int, ...]):
        self.collate_fn, self.placeholder_ids = collate_fn, placeholder_ids

    def __call__(self, items):
        return [(index, measure(self.collate_fn([sample]), index, self.placeholder_ids)) for index, sample in items]
