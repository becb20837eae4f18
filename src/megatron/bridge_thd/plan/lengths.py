"""Per-sample lengths the planner works on: LLM tokens and image patch grids.

A :class:`SampleLengths` is two aligned lists: ``tokens[i]``, the LLM sequence length of sample
i (text tokens + image tokens), and ``grids[i]``, its images' patch grids ``(t, h, w)`` in ViT
patches (before the ``spatial_merge``^2 merge; an image contributes ``t*h*w / merge^2`` LLM
tokens). Sources:

* :func:`receipt_lengths`: the embedded synthetic receipts (``megatron.bridge_thd.data``,
  cord_v2-like at seq_length 2048), drawn with the same sampler the demo uses;
* :func:`load_lengths`: a file, one of

  - JSON: ``[{"text_tokens": 57, "images": [[1, 52, 24]]}, ...]`` or ``{"samples": [...]}``;
    ``text_tokens`` counts every non-image token (prompt, answer, vision start/end markers,
    eos); ``images`` is optional (text-only sample);
  - CSV with a header ``text_tokens,images`` and ``images`` written ``1x52x24;1x16x16`` (empty:
    no image), e.g. ``57,1x52x24``.

A Megatron-Bridge dataset is not read directly (its loaders need the tokenizer, processor and
data on disk); dump ``text_tokens`` and ``image_grid_thw`` per sample into one of these formats.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SampleLengths", "receipt_lengths", "load_lengths"]


@dataclass(frozen=True)
class SampleLengths:
    """``tokens[i]``: LLM tokens of sample i (int >= 1); ``grids[i]``: its images' ``(t, h, w)``
    patch grids; ``source``: a label for tables and plots."""

    tokens: tuple[int, ...]
    grids: tuple[tuple[tuple[int, int, int], ...], ...]
    source: str = ""

    def __post_init__(self):
        if len(self.tokens) != len(self.grids):
            raise ValueError(f"SampleLengths: {len(self.tokens)} token counts but {len(self.grids)} grid lists")
        if not self.tokens:
            raise ValueError(f"SampleLengths {self.source!r}: no samples")

    def __len__(self) -> int:
        return len(self.tokens)

    def patches(self, i: int) -> int:
        """ViT patches of sample i (sum of t*h*w over its images)."""
        return sum(t * h * w for t, h, w in self.grids[i])


def receipt_lengths(num_samples: int, seed: int = 0) -> SampleLengths:
    """``num_samples`` draws from the synthetic receipt distribution of
    ``megatron.bridge_thd.data`` (same sampler, same seed convention as its batches)."""
    import torch

    from megatron.bridge_thd.data import ReceiptSpec, _sample

    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples: expected an int >= 1, got {num_samples!r}")
    generator = torch.Generator().manual_seed(seed)
    spec = ReceiptSpec()
    tokens, grids = [], []
    for _ in range(num_samples):
        sample_tokens, _, grid = _sample(generator, spec)
        tokens.append(len(sample_tokens))
        grids.append((tuple(grid),))
    return SampleLengths(tuple(tokens), tuple(grids), source=f"synthetic receipts (n={num_samples}, seed={seed})")


def _int(value, where: str, name: str, minimum: int) -> int:
    if isinstance(value, str):
        value = value.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: field {name!r}: expected an int >= {minimum}, got {value!r}")
    return value


def _grid(value, where: str) -> tuple[int, int, int]:
    if isinstance(value, str):
        value = value.strip().lower().split("x")
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{where}: field 'images': each grid must be (t, h, w), e.g. [1, 52, 24] or 1x52x24; got {value!r}")
    return tuple(_int(v, where, "images", 1) for v in value)


def _sample_tokens(text: int, grids, merge: int, where: str) -> int:
    image_tokens = 0
    for t, h, w in grids:
        if (h * w) % (merge * merge):
            raise ValueError(f"{where}: field 'images': grid {t}x{h}x{w} is not divisible by spatial_merge^2={merge * merge}")
        image_tokens += t * h * w // (merge * merge)
    total = text + image_tokens
    if total < 1:
        raise ValueError(f"{where}: sample has no tokens")
    return total


def _load_json(path: Path, merge: int):
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: line {error.lineno}: not valid JSON ({error.msg})") from None
    if isinstance(data, dict):
        data = data.get("samples")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of samples or {{\"samples\": [...]}}")
    for k, item in enumerate(data):
        where = f"{path}: sample {k}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object with 'text_tokens' and 'images', got {item!r}")
        if "text_tokens" not in item:
            raise ValueError(f"{where}: field 'text_tokens' is missing")
        grids = tuple(_grid(g, where) for g in item.get("images") or ())
        yield _sample_tokens(_int(item["text_tokens"], where, "text_tokens", 0), grids, merge, where), grids


def _load_csv(path: Path, merge: int):
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "text_tokens" not in reader.fieldnames:
            raise ValueError(f"{path}: line 1: header must name 'text_tokens' (and optionally 'images'), "
                             f"got {reader.fieldnames}")
        for row in reader:
            where = f"{path}: line {reader.line_num}"
            images = (row.get("images") or "").strip()
            grids = tuple(_grid(g, where) for g in images.split(";") if g.strip())
            yield _sample_tokens(_int(row["text_tokens"], where, "text_tokens", 0), grids, merge, where), grids


def load_lengths(path: str | Path, spatial_merge_size: int = 2) -> SampleLengths:
    """Read a JSON or CSV lengths file (format in the module docstring; ``.csv`` suffix = CSV).

    Raises:
        ValueError: missing file, bad syntax or a bad field, naming the file, line/sample and field.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: lengths file not found")
    loader = _load_csv if path.suffix.lower() == ".csv" else _load_json
    rows = list(loader(path, spatial_merge_size))
    if not rows:
        raise ValueError(f"{path}: no samples in the file")
    return SampleLengths(tuple(r[0] for r in rows), tuple(r[1] for r in rows), source=str(path))
