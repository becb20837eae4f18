"""``bridge-thd scan``'s output: the planner's lengths file (JSON, or CSV) with the scan's extra fields per sample.
Reasoning: docs/scan.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron.bridge_thd.plan.scan.cache import _write_atomically
from megatron.bridge_thd.plan.scan.measuring import Scan

__all__ = ["FORMAT", "lengths_document", "write_lengths"]

FORMAT = "bridge-thd lengths"


def lengths_document(scan: Scan, source: dict | None = None) -> dict:
    """The planner's JSON lengths file (``cost.sample_lengths.load_lengths``) with the scan's extra fields: per sample
    ``index``, ``tokens`` (untruncated), ``text_tokens`` (``tokens`` minus the image tokens, ``t*h*w/merge**2``
    per grid), ``supervised_tokens``, ``images`` (image then video grids), ``image_end`` (where known) and
    ``supervised_spans``."""
    rows = []
    for index, s in enumerate(scan.samples):
        row = {"index": index, "tokens": s.tokens, "text_tokens": s.tokens - s.image_tokens(scan.merge),
               "supervised_tokens": s.supervised, "images": [list(g) for g in s.grids]}
        if s.image_end is not None:
            row["image_end"] = s.image_end
        row["supervised_spans"] = [list(p) for p in s.spans]
        rows.append(row)
    return {"format": FORMAT, "version": 1, **(source or {}), "spatial_merge_size": scan.merge, "untruncated": True,
            "distinct_samples": len(scan.samples), "dataset_indices": scan.total, "samples": rows}


def write_lengths(scan: Scan, path: str | Path, source: dict | None = None) -> Path:
    """Write the lengths file: JSON (:func:`lengths_document`), or CSV for a ``.csv`` path (columns
    ``text_tokens,images,image_end,tokens,supervised_tokens``)."""
    path = Path(path)
    document = lengths_document(scan, source)
    if path.suffix.lower() == ".csv":
        lines = ["text_tokens,images,image_end,tokens,supervised_tokens"]
        for row in document["samples"]:
            images = ";".join("x".join(str(v) for v in g) for g in row["images"])
            lines.append(f"{row['text_tokens']},{images},{row.get('image_end', '')},{row['tokens']},"
                         f"{row['supervised_tokens']}")
        _write_atomically("\n".join(lines) + "\n", path)
    else:  # the header indented, then one sample per line
        rows = document.pop("samples")
        head = json.dumps(document, indent=1)[:-2]
        body = ",\n".join("  " + json.dumps(row) for row in rows)
        _write_atomically(f'{head},\n "samples": [\n{body}\n ]\n}}\n', path)
    return path
