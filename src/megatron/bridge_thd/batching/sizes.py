"""Per-sample sizes known before collate: LLM tokens and ViT patches. Reasoning: docs/batching.md.

A placement policy needs every sample's size before the step draws it. :func:`dataset_sizes` takes
them, in this order, from

1. the dataset's own metadata: ``sample_lengths`` (``(N,)`` LLM tokens, text + image placeholders)
   and optionally ``sample_image_grids`` (per sample, its images' ``(t, h, w)`` patch grids);
2. a cache file written by an earlier scan of the same dataset;
3. a one-time scan: the dataset's own collate on each sample alone, reading the real tokens from the
   2D attention mask (capped at ``seq_length``: the step keeps the first ``seq_length``) and the
   patches from ``image_grid_thw`` / ``video_grid_thw``; written to the cache.

A dataset wrapped by Megatron-Bridge's ``RandomSeedDataset`` is looked through (``.dataset``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron.bridge_thd.batching.cost import image_patches

__all__ = ["SampleSizes", "dataset_sizes", "scan_sizes", "default_cache_dir", "is_global_rank_zero"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleSizes:
    """``lengths`` ``(N,)`` int64 LLM tokens; ``patches`` ``(N,)`` int64 ViT patches (sum over the
    sample's images); ``patches_squared`` ``(N,)`` float64 sum over its images of patches^2;
    ``source``: where they came from (metadata, a cache path, a scan)."""

    lengths: torch.Tensor
    patches: torch.Tensor
    patches_squared: torch.Tensor
    source: str = ""

    def __len__(self) -> int:
        return int(self.lengths.numel())


def is_global_rank_zero() -> bool:
    """True outside a process group and on its global rank 0 (where the package logs per-run lines)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/bridge_thd/sizes`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridge_thd" / "sizes"


def _base(dataset):
    # Megatron-Bridge's RandomSeedDataset (data/samplers.py) wraps the dataset for the cyclic sampler.
    return getattr(dataset, "dataset", dataset) if type(dataset).__name__ == "RandomSeedDataset" else dataset


def _from_metadata(dataset) -> SampleSizes | None:
    base = _base(dataset)
    lengths = getattr(base, "sample_lengths", None)
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    if lengths.numel() != len(dataset):
        raise ValueError(f"dataset.sample_lengths: {lengths.numel()} entries for {len(dataset)} samples")
    grids = getattr(base, "sample_image_grids", None)
    if grids is None:
        zeros = torch.zeros_like(lengths)
        return SampleSizes(lengths, zeros, zeros.to(torch.float64), "dataset metadata (sample_lengths)")
    if len(grids) != len(dataset):
        raise ValueError(f"dataset.sample_image_grids: {len(grids)} entries for {len(dataset)} samples")
    patches, squared = image_patches(grids)
    return SampleSizes(lengths, patches, squared, "dataset metadata (sample_lengths, sample_image_grids)")


def _sample_sizes(batch: dict, seq_length: int | None, index: int) -> tuple[int, list[tuple[int, int, int]]]:
    """Real tokens and image grids of one collated sample (a batch of one)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        raise ValueError(
            f"dataset sample {index}: the collate gives no 2D attention_mask, so its real length is unknown; give the "
            "dataset sample_lengths (and sample_image_grids) metadata, or set "
            "dataset.skip_getting_attention_mask_from_dataset=False")
    length = int(mask[0].to(torch.int64).sum())
    if seq_length is not None:
        length = min(length, seq_length)
    visual = batch.get("visual_inputs")
    inputs = visual.normalized_for_model() if hasattr(visual, "normalized_for_model") else (visual or {})
    grids = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = inputs.get(key) if isinstance(inputs, dict) else None
        if grid is not None:
            grids += [tuple(int(v) for v in row) for row in grid.reshape(-1, 3).tolist()]
    return length, grids


def scan_sizes(dataset, collate_fn, *, seq_length: int | None = None) -> SampleSizes:
    """Collate each sample alone and read its real tokens and image grids (one pass, host only)."""
    lengths, grids = [], []
    for index in range(len(dataset)):
        length, sample_grids = _sample_sizes(collate_fn([dataset[index]]), seq_length, index)
        lengths.append(length)
        grids.append(sample_grids)
    patches, squared = image_patches(grids)
    return SampleSizes(torch.tensor(lengths, dtype=torch.int64), patches, squared, "scan")


def _fingerprint(dataset, collate_fn, seq_length: int | None) -> str:
    """A key for the cache: the dataset's class and size, seq_length, and the first and last samples
    as the collate gives them (a changed data set or processor changes them)."""
    digest = hashlib.sha256(f"{type(_base(dataset)).__qualname__}|{len(dataset)}|{seq_length}".encode())
    for index in sorted({0, len(dataset) - 1}):
        batch = collate_fn([dataset[index]])
        for key in sorted(k for k, v in batch.items() if torch.is_tensor(v)):
            digest.update(key.encode())
            digest.update(batch[key].detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:24]


def dataset_sizes(dataset, collate_fn=None, *, seq_length: int | None = None,
                  cache_dir: str | Path | None = None) -> SampleSizes:
    """Every sample's sizes, from metadata, the cache or a one-time scan (module docstring).

    Raises:
        ValueError: no metadata and no ``collate_fn`` to scan with, or metadata of the wrong length.
    """
    sizes = _from_metadata(dataset)
    if sizes is not None:
        return sizes
    if collate_fn is None:
        raise ValueError("dataset: it has no sample_lengths metadata and no collate_fn to scan it with; give one")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"{_fingerprint(dataset, collate_fn, seq_length)}.pt"
    if path.is_file():
        saved = torch.load(path)
        return SampleSizes(saved["lengths"], saved["patches"], saved["patches_squared"], f"cache {path}")
    if is_global_rank_zero():
        logger.info("bridge_thd.batching: scanning %d samples for their lengths (once; cached at %s)", len(dataset), path)
    sizes = scan_sizes(dataset, collate_fn, seq_length=seq_length)
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"lengths": sizes.lengths, "patches": sizes.patches, "patches_squared": sizes.patches_squared}, partial)
    partial.replace(path)  # atomic: ranks scanning at once never read a half-written file
    return SampleSizes(sizes.lengths, sizes.patches, sizes.patches_squared, f"scan (cached at {path})")
