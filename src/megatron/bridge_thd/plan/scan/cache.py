"""``bridge-thd scan``'s scan of a dataset (:func:`scan_dataset`: every distinct sample measured in forked loader
workers) and its cache (one JSON file per dataset, under ``batching.sizes``' key with the suffix
:data:`CACHE_SUFFIX`). Reasoning: docs/scan.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
import uuid
from pathlib import Path

from megatron.bridge_thd.batching.sizes import SIZES_CACHE_SUFFIX, collate_in_workers, repeat_period, sizes_cache_path
from megatron.bridge_thd.plan.scan.measuring import Scan, ScannedSample, _MeasureEach

__all__ = ["CACHE_SUFFIX", "scan_dataset"]

CACHE_SUFFIX = ".scan-v1.json"


def _to_json(scan: Scan) -> dict:
    return {"version": 1, "total": scan.total, "merge": scan.merge,
            "samples": [{"tokens": s.tokens, "spans": [list(p) for p in s.spans], "grids": [list(g) for g in s.grids],
                         "placeholders": s.placeholders, "image_end": s.image_end} for s in scan.samples]}


def _from_json(data: dict, path: Path) -> Scan:
    samples = tuple(ScannedSample(s["tokens"], tuple(tuple(p) for p in s["spans"]), tuple(tuple(g) for g in s["grids"]),
                                  s["placeholders"], s["image_end"]) for s in data["samples"])
    return Scan(samples, data["total"], data["merge"], path, True)


def _write_atomically(text: str, path: Path) -> None:
    """``text`` to ``path`` through a temporary name unique across hosts and processes, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    partial.write_text(text)
    partial.replace(path)


def scan_dataset(dataset, collate_fn=None, *, placeholder_ids: tuple[int, ...] = (), merge: int = 2,
                 num_workers: int = 1, cache_dir: str | Path | None = None, progress=None) -> Scan:
    """Every distinct sample of ``dataset`` measured (:func:`measure`) by ``collate_fn`` (default: the dataset's
    ``collate_fn``) in ``num_workers`` forked loader worker processes, or read from the cache.

    The cache file is ``batching.sizes.sizes_cache_path(...)``'s key (computed in a worker) with the suffix
    :data:`CACHE_SUFFIX` (the scan's own format: it holds the grids, not the sizes' vision term), under
    ``cache_dir`` (default ``batching.sizes.default_cache_dir()``).
    ``progress(done, total)`` is called after each chunk of a scan.
    """
    collate_fn = collate_fn if collate_fn is not None else dataset.collate_fn
    # Fork: the dataset's collate is often a closure (DirectSFTDataset's), which a spawned worker cannot unpickle.
    context = multiprocessing.get_context("fork")
    path = sizes_cache_path(dataset, collate_fn, seq_length=None, cache_dir=cache_dir, context=context)
    path = path.with_name(path.name.removesuffix(SIZES_CACHE_SUFFIX) + CACHE_SUFFIX)
    if path.is_file():
        return _from_json(json.loads(path.read_text()), path)
    period = repeat_period(dataset)
    start = time.perf_counter()
    samples: list = [None] * period
    chunk = max(1, min(64, period // (4 * max(1, num_workers)) or 1))
    done = 0
    for results in collate_in_workers(dataset, _MeasureEach(collate_fn, tuple(placeholder_ids)), list(range(period)),
                               num_workers=num_workers, context=context, chunk=chunk):
        for index, sample in results:
            samples[index] = sample
        done += len(results)
        if progress is not None:
            progress(done, period)
    scan = Scan(tuple(samples), len(dataset), merge, path, False, time.perf_counter() - start, max(1, num_workers))
    _write_atomically(json.dumps(_to_json(scan)), path)
    return scan
