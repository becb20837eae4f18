"""Per-sample lengths, LLM tokens and image patch grids, and the lengths file that holds them.

A :class:`SampleLengths` is aligned lists: ``tokens[i]``, the LLM sequence length of sample
i (text tokens + image tokens), ``grids[i]``, its images' patch grids ``(t, h, w)`` in ViT
patches (before the ``spatial_merge``^2 merge; an image contributes ``t*h*w / merge^2`` LLM
tokens), and ``image_ends[i]``, where its image tokens end: one past its last image / video
placeholder token (0 without images; None where the source does not say). Below both the planner
(:mod:`megatron.bridge_thd.plan.samples`) and global-batch packing (``global_batch_packing.lengths_file``,
:func:`megatron.bridge_thd.batching.sizes.file_sizes`), which read it.

:func:`load_lengths` reads a file, one of

* JSON: ``[{"text_tokens": 57, "images": [[1, 52, 24]]}, ...]`` or ``{"samples": [...]}``;
  ``text_tokens`` counts every non-image token (prompt, answer, vision start/end markers,
  eos); ``images`` is optional (text-only sample); ``image_end`` is optional: one past the
  position of the sample's last image / video token (e.g. 3 prompt tokens, a vision start
  marker and 312 image tokens: 316). Without it, a sample longer than ``seq_length`` that has
  images is refused (the planner cannot tell whether truncation would cut its image).
  Optional, checked when given: ``tokens``, the sample's whole length (must equal
  ``text_tokens`` + its image tokens at the model's ``spatial_merge``: a file written for another
  merge size is refused), and ``supervised_tokens`` (its loss-bearing tokens, at most ``tokens``;
  kept in :attr:`SampleLengths.supervised`);
* CSV with a header ``text_tokens,images`` (optionally ``image_end``, ``tokens``,
  ``supervised_tokens``) and ``images`` written ``1x52x24;1x16x16`` (empty: no image), e.g.
  ``57,1x52x24``.

``bridge-thd scan`` (docs/scan.md) writes such a JSON file from a Megatron-Bridge recipe's own dataset, processor
and collate.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from megatron.bridge_thd.checks import check_int

__all__ = ["SampleLengths", "load_lengths"]


@dataclass(frozen=True)
class SampleLengths:
    """``tokens[i]``: LLM tokens of sample i (int >= 1); ``grids[i]``: its images' ``(t, h, w)``
    patch grids; ``source``: a label for tables and plots; ``image_ends``: per sample, one past its
    last image / video token (0 without images, None: not known), or None (none known);
    ``supervised``: per sample, its supervised (loss-bearing) tokens (None: not known), or None."""

    tokens: tuple[int, ...]
    grids: tuple[tuple[tuple[int, int, int], ...], ...]
    source: str = ""
    image_ends: tuple[int | None, ...] | None = None
    supervised: tuple[int | None, ...] | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.grids):
            raise ValueError(f"SampleLengths: {len(self.tokens)} token counts but {len(self.grids)} grid lists")
        if not self.tokens:
            raise ValueError(f"SampleLengths {self.source!r}: no samples")
        if self.image_ends is not None:
            if len(self.image_ends) != len(self.tokens):
                raise ValueError(f"SampleLengths: {len(self.tokens)} token counts but {len(self.image_ends)} image ends")
            for i, end in enumerate(self.image_ends):
                if end is not None and not (1 if self.grids[i] else 0) <= end <= (self.tokens[i] if self.grids[i] else 0):
                    raise ValueError(f"SampleLengths {self.source!r}: sample {i}: image_end {end} must be in "
                                     f"[1, {self.tokens[i]}] (its token count) with images, 0 without")
        if self.supervised is not None:
            if len(self.supervised) != len(self.tokens):
                raise ValueError(f"SampleLengths: {len(self.tokens)} token counts but {len(self.supervised)} "
                                 "supervised counts")
            for i, n in enumerate(self.supervised):
                if n is not None and not 0 <= n <= self.tokens[i]:
                    raise ValueError(f"SampleLengths {self.source!r}: sample {i}: {n} supervised tokens must be in "
                                     f"[0, {self.tokens[i]}] (its token count)")

    def __len__(self) -> int:
        return len(self.tokens)

    def patches(self, i: int) -> int:
        """ViT patches of sample i (sum of t*h*w over its images)."""
        return sum(t * h * w for t, h, w in self.grids[i])

    def image_end(self, i: int) -> int | None:
        """One past sample i's last image / video token: 0 without images, None if not known."""
        if not self.grids[i]:
            return 0
        return None if self.image_ends is None else self.image_ends[i]


def _int(value, where: str, name: str, minimum: int) -> int:
    if isinstance(value, str):
        value = value.strip()
        if value.lstrip("-").isdigit():
            value = int(value)
    return check_int(f"{where}: field {name!r}", value, minimum)


def _grid(value, where: str) -> tuple[int, int, int]:
    if isinstance(value, str):
        value = value.strip().lower().split("x")
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"{where}: field 'images': each grid must be (t, h, w), e.g. [1, 52, 24] or 1x52x24; got {value!r}")
    return tuple(_int(v, where, "images", 1) for v in value)


def _absent(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _file_sample(text: int, grids, image_end, merge: int, where: str, tokens=None,
                 supervised=None) -> tuple[int, tuple, int | None, int | None]:
    """``(tokens, grids, image_end, supervised)`` of one sample; ``image_end`` / ``tokens`` / ``supervised`` are
    the raw optional fields (None: absent)."""
    image_tokens = 0
    for t, h, w in grids:
        if (h * w) % (merge * merge):
            raise ValueError(f"{where}: field 'images': grid {t}x{h}x{w} is not divisible by spatial_merge^2={merge * merge}")
        image_tokens += t * h * w // (merge * merge)
    total = text + image_tokens
    if total < 1:
        raise ValueError(f"{where}: sample has no tokens")
    if not _absent(tokens) and _int(tokens, where, "tokens", 1) != total:
        raise ValueError(f"{where}: field 'tokens': {_int(tokens, where, 'tokens', 1)}, but text_tokens {text} + "
                         f"{image_tokens} image tokens at spatial_merge={merge} make {total}: the file was written for "
                         "another spatial merge size than this model's, or its fields disagree")
    count = None
    if not _absent(supervised):
        count = _int(supervised, where, "supervised_tokens", 0)
        if count > total:
            raise ValueError(f"{where}: field 'supervised_tokens': {count} is more than the sample's {total} tokens")
    if _absent(image_end):
        return total, grids, None, count
    end = _int(image_end, where, "image_end", 0)
    if not grids and end != 0:
        raise ValueError(f"{where}: field 'image_end': {end} for a sample without images (expected 0 or no value)")
    if grids and not image_tokens <= end <= total:
        raise ValueError(f"{where}: field 'image_end': expected an int in [{image_tokens}, {total}] (the sample's "
                         f"image tokens .. its token count), got {end}")
    return total, grids, end, count


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
        yield _file_sample(_int(item["text_tokens"], where, "text_tokens", 0), grids, item.get("image_end"), merge,
                           where, item.get("tokens"), item.get("supervised_tokens"))


def _load_csv(path: Path, merge: int):
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or "text_tokens" not in reader.fieldnames:
            raise ValueError(f"{path}: line 1: header must name 'text_tokens' (and optionally 'images', 'image_end', "
                             f"'tokens', 'supervised_tokens'), got {reader.fieldnames}")
        for row in reader:
            where = f"{path}: line {reader.line_num}"
            images = (row.get("images") or "").strip()
            grids = tuple(_grid(g, where) for g in images.split(";") if g.strip())
            yield _file_sample(_int(row["text_tokens"], where, "text_tokens", 0), grids, row.get("image_end"), merge,
                               where, row.get("tokens"), row.get("supervised_tokens"))


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
    ends, supervised = tuple(r[2] for r in rows), tuple(r[3] for r in rows)
    return SampleLengths(tuple(r[0] for r in rows), tuple(r[1] for r in rows), source=str(path),
                         image_ends=None if all(e is None for e in ends) else ends,
                         supervised=None if all(n is None for n in supervised) else supervised)
