"""Per-sample sizes known before collate: LLM tokens and ViT patches. Reasoning: docs/batching.md.

A placement policy needs every sample's size before the step draws it. :func:`dataset_sizes` takes
them, in this order, from

1. the dataset's own metadata: ``sample_lengths`` (``(N,)`` LLM tokens, text + image placeholders)
   and optionally ``sample_image_grids`` (per sample, its images' ``(t, h, w)`` patch grids);
2. a cache file written by an earlier scan of the same dataset, in this version's format
   (:data:`SIZES_CACHE_FORMAT`: its name and its contents carry it, so a file of another format is
   not found under the current key, and is refused if read);
3. a one-time scan: the dataset's own collate on each **distinct** sample alone, reading the real
   tokens from the 2D attention mask (capped at ``seq_length``: the step keeps the first
   ``seq_length``) and the patches from ``image_grid_thw`` / ``video_grid_thw``; written to the cache.

The scan and the cache key run the collate (and so the processor's tokenizer) **in loader worker
processes, never in the calling process**: Megatron-Bridge's loader workers are forked from the
training process later, and a Hugging Face fast tokenizer used in a parent before ``fork`` can
deadlock its forked children. A dataset that repeats its base examples (Megatron-Bridge's
``DirectSFTDataset``: index ``i`` is base example ``i % len(base)``) is scanned once per base example
(:func:`repeat_period`). A dataset wrapped by Megatron-Bridge's ``RandomSeedDataset`` is looked
through (``.dataset``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from torch.utils.data import DataLoader

from megatron.bridge_thd.cost.sample import image_patches
from megatron.bridge_thd.cost.sample_lengths import load_lengths
from megatron.bridge_thd.overlong import (LENGTHS_KEY, SUPERVISED, SUPERVISED_KEPT, TOKENS, VISION_CUT, OverlongCollate,
                                          supervision_emptied)

__all__ = ["SampleSizes", "dataset_sizes", "scan_sizes", "default_cache_dir", "is_global_rank_zero", "repeat_period",
           "sizes_cache_path", "read_cached_sizes", "write_cached_sizes", "scan_and_cache", "visual_grids", "file_sizes",
           "collate_in_workers", "SIZES_CACHE_FORMAT", "SIZES_CACHE_SUFFIX"]

logger = logging.getLogger(__name__)

# The sizes cache's format. 2: ``patches_squared`` is the per-frame ViT attention term
# (``sum t * (h * w)**2``); format 1 (files named ``<key>.pt``, without a ``format`` entry) held
# ``sum (t * h * w)**2``, a video's frames taken as one attention segment. A change to what the
# cached tensors mean raises it, so that no earlier file is read as the current quantity.
SIZES_CACHE_FORMAT = 2
SIZES_CACHE_SUFFIX = f".sizes-v{SIZES_CACHE_FORMAT}.pt"


@dataclass(frozen=True)
class SampleSizes:
    """Sizes of a dataset's distinct samples.

    ``lengths`` ``(M,)`` int64 LLM tokens that reach the step (at most ``seq_length``); ``patches`` ``(M,)``
    int64 ViT patches (sum over the sample's images and videos); ``patches_squared`` ``(M,)`` float64 its ViT
    attention term, ``sum t * (h * w)**2`` per frame (``cost.sample.image_patches``); ``source``: where they came from (metadata, a cache path, a scan); ``total``: the dataset's
    indices (None: ``M``), index ``i`` having the sizes of distinct sample ``i % M``; ``untruncated`` /
    ``supervised``: ``(M,)`` int64 real and supervised tokens before the collate's cut to ``seq_length``, where
    a scan measured them (``overlong.LENGTHS_KEY``), else None; ``supervised_kept``: ``(M,)`` int64 supervised tokens
    the cut keeps, and ``vision_cut``: ``(M,)`` bool, an image or video placeholder past the cut, where a scan
    measured them, else None.
    """

    lengths: torch.Tensor
    patches: torch.Tensor
    patches_squared: torch.Tensor
    source: str = ""
    total: int | None = None
    untruncated: torch.Tensor | None = None
    supervised: torch.Tensor | None = None
    supervised_kept: torch.Tensor | None = None
    vision_cut: torch.Tensor | None = None

    def over(self, seq_length: int) -> torch.Tensor:
        """``(K,)`` the distinct samples longer than ``seq_length`` before the cut (empty when not measured)."""
        if self.untruncated is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.nonzero(self.untruncated > seq_length).flatten()

    def vision_cut_samples(self) -> torch.Tensor:
        """``(K,)`` the distinct samples with an image or video placeholder past the cut (empty when not measured)."""
        if self.vision_cut is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.nonzero(self.vision_cut).flatten()

    def supervision_cut_samples(self, seq_length: int) -> torch.Tensor:
        """``(K,)`` the distinct samples longer than ``seq_length`` whose every supervised token lies past the cut
        (empty when not measured)."""
        if self.untruncated is None or self.supervised is None or self.supervised_kept is None:
            return torch.zeros(0, dtype=torch.int64)
        return torch.nonzero(supervision_emptied(self.untruncated, self.supervised, self.supervised_kept,
                                                 seq_length)).flatten()

    def __len__(self) -> int:
        return int(self.lengths.numel()) if self.total is None else self.total

    def distinct(self, index: torch.Tensor) -> torch.Tensor:
        """The distinct sample each dataset index of ``index`` (any shape) is."""
        return index % self.lengths.numel() if self.total is not None else index

    def take(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(lengths, patches, patches_squared)`` of the dataset indices ``index`` (any shape)."""
        distinct = self.distinct(index)
        return self.lengths[distinct], self.patches[distinct], self.patches_squared[distinct]

    def digest(self) -> str:
        """A short hash of every size (ranks compare it to agree before they place any step)."""
        digest = hashlib.sha256(f"{len(self)}|{self.lengths.numel()}".encode())
        for values in (self.lengths, self.patches, self.patches_squared):
            digest.update(values.contiguous().numpy().tobytes())
        return digest.hexdigest()[:24]


def is_global_rank_zero() -> bool:
    """True outside a process group and on its global rank 0 (where the package logs per-run lines)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/bridge_thd/sizes`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridge_thd" / "sizes"


def _base(dataset):
    # Megatron-Bridge's RandomSeedDataset (data/samplers.py) wraps the dataset for the cyclic sampler.
    return dataset.dataset if type(dataset).__name__ == "RandomSeedDataset" else dataset


def repeat_period(dataset) -> int:
    """How many distinct samples ``dataset`` has: index ``i`` is the same sample as ``i % period``.
    Megatron-Bridge's ``DirectSFTDataset`` (``data/datasets/direct_sft.py``) repeats its base examples
    to the length the trainer asks for (``train_iters * global_batch_size``): its period is the number
    of base examples. Any other dataset: its length."""
    base = _base(dataset)
    if type(base).__name__ != "DirectSFTDataset":
        return len(dataset)
    examples = getattr(base, "_base_examples", None)  # offers: the installed DirectSFTDataset's base examples
    return min(len(examples), len(dataset)) if isinstance(examples, list) and examples else len(dataset)


def _from_metadata(dataset) -> SampleSizes | None:
    base = _base(dataset)
    lengths = getattr(base, "sample_lengths", None)  # optional: a dataset's own length metadata
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1)
    if lengths.numel() != len(dataset):
        raise ValueError(f"dataset.sample_lengths: {lengths.numel()} entries for {len(dataset)} samples")
    grids = getattr(base, "sample_image_grids", None)  # optional: a dataset's own image-grid metadata
    if grids is None:
        zeros = torch.zeros_like(lengths)
        return SampleSizes(lengths, zeros, zeros.to(torch.float64), "dataset metadata (sample_lengths)")
    if len(grids) != len(dataset):
        raise ValueError(f"dataset.sample_image_grids: {len(grids)} entries for {len(dataset)} samples")
    patches, squared = image_patches(grids)
    return SampleSizes(lengths, patches, squared, "dataset metadata (sample_lengths, sample_image_grids)")


def _sample_sizes(batch: dict, seq_length: int | None,
                  index: int) -> tuple[int, list[tuple[int, int, int]], tuple[int, int, int, int]]:
    """Real tokens (at most ``seq_length``), image grids, and the collate's measures before its cut of one collated
    sample (a batch of one): real and supervised tokens, supervised tokens kept, vision placeholders cut (all -1
    where it was not measured)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.dim() != 2:
        raise ValueError(
            f"dataset sample {index}: the collate gives no 2D attention_mask, so its real length is unknown; give the "
            "dataset sample_lengths (and sample_image_grids) metadata, or set "
            "dataset.skip_getting_attention_mask_from_dataset=False")
    length = int(mask[0].to(torch.int64).sum())
    if seq_length is not None:
        length = min(length, seq_length)
    grids = visual_grids(batch)
    measures = batch.get(LENGTHS_KEY)
    if measures is None:
        return length, grids, (-1, -1, -1, -1)
    return length, grids, tuple(int(measures[row, 0]) for row in (TOKENS, SUPERVISED, SUPERVISED_KEPT, VISION_CUT))


def visual_grids(batch: dict) -> list[tuple[int, int, int]]:
    """The ``(t, h, w)`` patch grids of a collated batch's images, then its videos (``visual_inputs``)."""
    visual = batch.get("visual_inputs")
    normalizes = hasattr(visual, "normalized_for_model")  # duck: Megatron-Bridge's visual inputs, a dict, or None
    inputs = visual.normalized_for_model() if normalizes else (visual or {})
    grids = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = inputs.get(key) if isinstance(inputs, dict) else None
        if grid is not None:
            grids += [tuple(int(v) for v in row) for row in grid.reshape(-1, 3).tolist()]
    return grids


def _measuring(collate_fn):
    """``collate_fn`` with the rows measured before Megatron-Bridge's cut (``overlong.collate_patch``, applied in
    this worker when its Qwen-VL collate is loaded) under the scan's rule: no policy, never a refusal, the loader's
    placeholder ids (``overlong.OverlongCollate.for_scan``)."""
    return OverlongCollate.for_scan(collate_fn)


class _Indexed:
    """The dataset as ``(index, sample)`` pairs, for the scan's worker processes."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return index, self.dataset[index]


class _MeasureEach:
    """The scan's collate (runs in a worker): each sample collated alone and measured."""

    def __init__(self, collate_fn, seq_length):
        self.collate_fn, self.seq_length = collate_fn, seq_length

    def __call__(self, items):
        collate_fn = _measuring(self.collate_fn)
        return [(index, *_sample_sizes(collate_fn([sample]), self.seq_length, index)) for index, sample in items]


class _DigestEach:
    """The cache key's collate (runs in a worker): each sample collated alone, its tensors hashed."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, items):
        digests, collate_fn = [], _measuring(self.collate_fn)
        for _, sample in items:
            batch, digest = collate_fn([sample]), hashlib.sha256()
            for key in sorted(k for k, v in batch.items() if torch.is_tensor(v)):
                digest.update(key.encode())
                digest.update(batch[key].detach().cpu().contiguous().numpy().tobytes())
            digests.append(digest.hexdigest())
        return digests


def collate_in_workers(dataset, collate, indices: list[int], *, num_workers: int, context, chunk: int):
    """``collate`` over ``indices`` in chunks, run by ``max(1, num_workers)`` loader worker processes
    (``context``: a multiprocessing start method or context, None for the default): yields each
    chunk's result in order. The calling process never runs ``collate``."""
    chunks = [indices[k:k + chunk] for k in range(0, len(indices), chunk)]
    loader = DataLoader(_Indexed(dataset), batch_sampler=chunks, num_workers=max(1, num_workers),
                        collate_fn=collate, multiprocessing_context=context)
    yield from loader


def scan_sizes(dataset, collate_fn, *, seq_length: int | None = None, num_workers: int = 1, context=None,
               label: str = "", progress=None) -> SampleSizes:
    """Collate each distinct sample (:func:`repeat_period`) alone in worker processes and read its real
    tokens and image grids, and its real and supervised tokens before Megatron-Bridge's collate cuts it (one
    pass); progress goes to the log every tenth, and to ``progress(done, total)`` when given."""
    period = repeat_period(dataset)
    lengths, grids = [0] * period, [[] for _ in range(period)]
    measures = [(-1, -1, -1, -1)] * period  # untruncated, supervised, supervised kept, vision cut
    chunk = max(1, min(64, period // (4 * max(1, num_workers)) or 1))
    done, next_report = 0, period / 10
    for results in collate_in_workers(dataset, _MeasureEach(collate_fn, seq_length), list(range(period)),
                               num_workers=num_workers, context=context, chunk=chunk):
        for index, length, sample_grids, sample_measures in results:
            lengths[index], grids[index], measures[index] = length, sample_grids, sample_measures
        done += len(results)
        if progress is not None:
            progress(done, period)
        if period >= 1000 and next_report <= done < period:
            logger.info("bridge_thd.batching: lengths scan%s: %d of %d distinct samples", label, done, period)
            next_report += period / 10
    patches, squared = image_patches(grids)
    total = len(dataset) if period != len(dataset) else None
    measured = torch.tensor(measures, dtype=torch.int64).reshape(period, 4).T  # (4, period)
    untruncated, supervised, supervised_kept, vision_cut = (
        (None,) * 4 if period == 0 or int(measured.min()) < 0 else tuple(measured))
    return SampleSizes(torch.tensor(lengths, dtype=torch.int64), patches, squared,
                       f"scan of {period} distinct samples", total, untruncated, supervised, supervised_kept,
                       None if vision_cut is None else vision_cut != 0)


def _fingerprint(dataset, collate_fn, seq_length: int | None, *, context=None) -> str:
    """A key for the cache: the dataset's class, size and period, seq_length, and the first and last
    distinct samples as the collate gives them (a changed data set or processor changes them),
    collated in a worker process."""
    period = repeat_period(dataset)
    digest = hashlib.sha256(f"{type(_base(dataset)).__qualname__}|{len(dataset)}|{period}|{seq_length}".encode())
    for digests in collate_in_workers(dataset, _DigestEach(collate_fn), sorted({0, period - 1}), num_workers=1,
                               context=context, chunk=2):
        for part in digests:
            digest.update(part.encode())
    return digest.hexdigest()[:24]


def sizes_cache_path(dataset, collate_fn, *, seq_length: int | None = None, cache_dir: str | Path | None = None,
                     context=None) -> Path:
    """Where the scan of ``dataset`` is cached (the key is computed in a worker process): ``<key>`` +
    :data:`SIZES_CACHE_SUFFIX`, which names the format, so a file of an earlier format is not found (the
    dataset is scanned again)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / f"{_fingerprint(dataset, collate_fn, seq_length, context=context)}{SIZES_CACHE_SUFFIX}"


def read_cached_sizes(path: Path) -> SampleSizes | None:
    """The sizes cached at ``path``, or None if there is no such file.

    Raises:
        ValueError: the file is of another format than :data:`SIZES_CACHE_FORMAT` (an earlier version's
            ``patches_squared`` is another quantity), naming the file and what to do.
    """
    if not path.is_file():
        return None
    saved = torch.load(path)
    found = saved.get("format", 1) if isinstance(saved, dict) else None
    if found != SIZES_CACHE_FORMAT:
        raise ValueError(
            f"sizes cache {path}: format {found}, this version reads format {SIZES_CACHE_FORMAT} (its patches_squared "
            "is the vision attention term per frame, sum t * (h * w)**2); delete the file, and the dataset is "
            "scanned again")
    return SampleSizes(saved["lengths"], saved["patches"], saved["patches_squared"], f"cache {path}", saved.get("total"),
                       saved.get("untruncated"), saved.get("supervised"), saved.get("supervised_kept"),
                       saved.get("vision_cut"))


def write_cached_sizes(sizes: SampleSizes, path: Path) -> None:
    """Write ``sizes`` to ``path`` atomically (a temporary name unique across hosts and processes, then
    a rename), so that ranks reading or writing at once never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    torch.save({"format": SIZES_CACHE_FORMAT, "lengths": sizes.lengths, "patches": sizes.patches, "patches_squared": sizes.patches_squared,
                "total": sizes.total, "untruncated": sizes.untruncated, "supervised": sizes.supervised,
                "supervised_kept": sizes.supervised_kept, "vision_cut": sizes.vision_cut}, partial)
    partial.replace(path)


def file_sizes(path, dataset, *, seq_length: int | None, spatial_merge_size: int = 2,
               setting: str = "global_batch_packing.lengths_file") -> SampleSizes:
    """The sizes of ``dataset``'s distinct samples from a lengths file (``bridge-thd scan``'s, read by
    :func:`megatron.bridge_thd.cost.sample_lengths.load_lengths`, as the planner reads it): row ``i`` is distinct sample ``i`` (:func:`repeat_period`). ``lengths`` are the
    file's tokens cut to ``seq_length``; ``untruncated`` / ``supervised`` the file's; ``vision_cut`` from the file's
    ``image_end`` where it gives them (``supervised_kept`` is not in a lengths file: None).

    Raises:
        ValueError: the file does not read (naming it), or it has another number of samples than the dataset has
            distinct samples (naming ``setting``).
    """
    samples = load_lengths(path, spatial_merge_size=spatial_merge_size)
    period = repeat_period(dataset)
    if len(samples.tokens) != period:
        raise ValueError(
            f"{setting}: {path} holds {len(samples.tokens)} samples, but the dataset has {period} distinct samples; "
            "write the file from this dataset (bridge-thd scan --recipe ... --split ...), or unset the setting to "
            "scan it when the loaders are built")
    untruncated = torch.tensor(samples.tokens, dtype=torch.int64)
    patches, squared = image_patches([list(grids) for grids in samples.grids])
    supervised = None
    if samples.supervised is not None and all(n is not None for n in samples.supervised):
        supervised = torch.tensor(samples.supervised, dtype=torch.int64)
    lengths = untruncated if seq_length is None else untruncated.clamp(max=seq_length)
    return SampleSizes(lengths, patches, squared, f"lengths file {path}", len(dataset) if period != len(dataset) else None,
                       untruncated, supervised, vision_cut=_vision_cut_from_file(samples, seq_length))


def _vision_cut_from_file(samples, seq_length: int | None) -> torch.Tensor | None:
    """``(M,)`` bool, the sample's last image or video placeholder past ``seq_length``, from a lengths file's
    ``image_end`` (one past it); None where the file does not give it for every sample with images."""
    ends = [samples.image_end(i) for i in range(len(samples.tokens))]
    if seq_length is None or any(end is None for end in ends):
        return None
    return torch.tensor(ends, dtype=torch.int64) > seq_length


def dataset_sizes(dataset, collate_fn=None, *, seq_length: int | None = None, cache_dir: str | Path | None = None,
                  num_workers: int = 1, context=None, label: str = "", share=None) -> SampleSizes:
    """Every sample's sizes, from metadata, the cache or a one-time scan (module docstring).

    Args:
        num_workers, context: the scan's worker processes (at least one) and their start method.
        share: ``share(path, scan) -> SampleSizes`` decides who scans into the cache ``path`` and reads
            it (:func:`.bridge.shared_sizes`: one scan per node); None: this process, alone.

    Raises:
        ValueError: no metadata and no ``collate_fn`` to scan with, or metadata of the wrong length.
    """
    sizes = _from_metadata(dataset)
    if sizes is not None:
        return sizes
    if collate_fn is None:
        raise ValueError("dataset: it has no sample_lengths metadata and no collate_fn to scan it with; give one")
    path = sizes_cache_path(dataset, collate_fn, seq_length=seq_length, cache_dir=cache_dir, context=context)

    def scan() -> SampleSizes:
        return scan_and_cache(dataset, collate_fn, path, seq_length=seq_length, num_workers=num_workers,
                              context=context, label=label)

    if share is not None:
        return share(path, scan)
    cached = read_cached_sizes(path)
    return cached if cached is not None else scan()


def scan_and_cache(dataset, collate_fn, path: Path, *, seq_length: int | None, num_workers: int = 1, context=None,
                   label: str = "") -> SampleSizes:
    """:func:`scan_sizes`, written to ``path``, with a log line before and after."""
    period = repeat_period(dataset)
    logger.info("bridge_thd.batching: scanning the lengths of %d distinct samples (%d dataset indices)%s in %d worker "
                "process(es); cached at %s", period, len(dataset), label, max(1, num_workers), path)
    start = time.perf_counter()
    sizes = scan_sizes(dataset, collate_fn, seq_length=seq_length, num_workers=num_workers, context=context,
                       label=label)
    write_cached_sizes(sizes, path)
    logger.info("bridge_thd.batching: lengths scan%s done: %d distinct samples in %.1f s", label, period,
                time.perf_counter() - start)
    return SampleSizes(sizes.lengths, sizes.patches, sizes.patches_squared, f"{sizes.source} (cached at {path})",
                       sizes.total, sizes.untruncated, sizes.supervised, sizes.supervised_kept, sizes.vision_cut)
