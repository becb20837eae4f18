"""``bridge-thd scan``'s summary: the length distribution of a scan (percentiles, a text histogram) and what
Megatron-Bridge's collate would cut at a ``seq_length`` (:func:`over_length`). Reasoning: docs/scan.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.bridge_thd.plan.scan.measuring import Scan

__all__ = ["OverLength", "over_length", "histogram", "summary"]


@dataclass(frozen=True)
class OverLength:
    """What Megatron-Bridge's collate would cut at ``seq_length``, over the distinct samples: the ``samples``
    longer than it (indices), real and supervised tokens in all and lost, the samples that would lose every
    supervised token (``emptied``: the collate raises on their micro-batch) and those whose image / video tokens
    reach past it (``image_cut``: the step refuses them)."""

    seq_length: int
    samples: tuple[int, ...]
    tokens: int
    tokens_lost: int
    supervised: int
    supervised_lost: int
    emptied: tuple[int, ...]
    image_cut: tuple[int, ...]


def over_length(scan: Scan, seq_length: int) -> OverLength:
    """:class:`OverLength` of ``scan`` at ``seq_length`` (each row keeps its first ``seq_length`` tokens)."""
    over = tuple(i for i, s in enumerate(scan.samples) if s.tokens > seq_length)
    lost = sum(scan.samples[i].tokens - seq_length for i in over)
    supervised_lost = sum(scan.samples[i].supervised - scan.samples[i].supervised_within(seq_length) for i in over)
    emptied = tuple(i for i in over if scan.samples[i].supervised and not scan.samples[i].supervised_within(seq_length))
    image_cut = tuple(i for i in over if (scan.samples[i].image_end or 0) > seq_length)
    return OverLength(seq_length, over, sum(s.tokens for s in scan.samples), lost,
                      sum(s.supervised for s in scan.samples), supervised_lost, emptied, image_cut)


def _percentile(ordered: list[int], p: float) -> int:
    """Nearest rank: the smallest value with at least ``p`` percent of the values at or below it."""
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _nice_width(span: int, bins: int = 16) -> int:
    """The smallest 1, 2 or 5 x 10**k at least ``span / bins``."""
    target, scale = max(1, math.ceil(span / bins)), 1
    while True:
        for step in (1, 2, 5):
            if step * scale >= target:
                return step * scale
        scale *= 10


def histogram(values: list[int], seq_length: int, bar: int = 40) -> list[str]:
    """Text histogram of ``values`` in equal bins of a round width; the bin ``seq_length`` ends or falls in is
    marked."""
    width = _nice_width(max(values) + 1)
    counts: dict[int, int] = {}
    for v in values:
        counts[v // width] = counts.get(v // width, 0) + 1
    most, digits = max(counts.values()), len(str(max(values) // width * width + width - 1))
    lines = []
    for b in range(min(counts), max(counts) + 1):
        low, high = b * width, b * width + width - 1
        n = counts.get(b, 0)
        mark = ""
        if low <= seq_length <= high:
            mark = "  <- seq_length" + (" ends here" if seq_length == high else f" {seq_length} inside this bin")
        lines.append(f"  {low:>{digits}}-{high:<{digits}} {n:>6} {'#' * max(1 if n else 0, round(bar * n / most))}"
                     f"{mark}".rstrip())
    return lines


def _stats_row(name: str, values: list[int]) -> str:
    ordered = sorted(values)
    cells = [ordered[0], _percentile(ordered, 50), _percentile(ordered, 90), _percentile(ordered, 95),
             _percentile(ordered, 99), ordered[-1]]
    return f"| {name} | " + " | ".join(f"{v:,}" for v in cells) + f" | {sum(values) / len(values):,.1f} |"


def summary(scan: Scan, seq_length: int) -> str:
    """The length distribution (percentiles, histogram) and what a cut at ``seq_length`` would lose."""
    samples = scan.samples
    tokens = [s.tokens for s in samples]
    lines = ["untruncated lengths per distinct sample (nearest-rank percentiles):", "",
             "| per sample | min | p50 | p90 | p95 | p99 | max | mean |", "|---|---|---|---|---|---|---|---|",
             _stats_row("tokens", tokens), _stats_row("supervised tokens", [s.supervised for s in samples]),
             _stats_row("image / video tokens", [s.image_tokens(scan.merge) for s in samples]),
             _stats_row("images / videos", [len(s.grids) for s in samples]), "",
             "tokens per sample:"] + histogram(tokens, seq_length) + [""]
    cut = over_length(scan, seq_length)
    n = len(samples)
    if not cut.samples:
        lines.append(f"over seq_length {seq_length}: none of the {n} distinct samples (the longest has "
                     f"{max(tokens):,} tokens); Megatron-Bridge's collate cuts nothing")
    else:
        longest = max(cut.samples, key=lambda i: samples[i].tokens)
        s = samples[longest]
        lines += [
            f"over seq_length {seq_length}: {len(cut.samples)} of {n} distinct samples ({len(cut.samples) / n:.1%}); "
            f"Megatron-Bridge's collate would cut {cut.tokens_lost:,} of {cut.tokens:,} real tokens "
            f"({cut.tokens_lost / cut.tokens:.1%}) and {cut.supervised_lost:,} of {cut.supervised:,} supervised tokens "
            f"({cut.supervised_lost / max(1, cut.supervised):.1%})",
            f"  longest: sample {longest}, {s.tokens:,} tokens ({s.supervised:,} supervised, "
            f"{s.supervised - s.supervised_within(seq_length):,} of them cut); seq_length {max(tokens):,} keeps every "
            "sample whole",
            f"  samples left with no supervised token (Megatron-Bridge's collate raises on their micro-batch): "
            f"{len(cut.emptied)}" + (f" ({_listed(cut.emptied)})" if cut.emptied else ""),
            f"  samples whose image / video tokens would be cut (our step refuses them): {len(cut.image_cut)}"
            + (f" ({_listed(cut.image_cut)})" if cut.image_cut else ""),
            "  Megatron-Bridge's collate says nothing; with configure(...), overlong_samples decides: "
            "'truncate' (the default) cuts them and logs what is lost, 'drop' masks their loss, 'refuse' stops at the "
            "first",
        ]
    unknown = sum(1 for s in samples if s.grids and s.image_end is None)
    if unknown:
        lines.append(f"note: {unknown} samples with images have no image_end (the processor's placeholder token ids "
                     "are not known); the planner treats their images as possibly cut")
    mismatched = [i for i, s in enumerate(samples) if s.placeholders is not None
                  and s.placeholders != s.image_tokens(scan.merge)]
    if mismatched:
        lines.append(f"warning: {len(mismatched)} samples ({_listed(tuple(mismatched))}) have a placeholder count that "
                     f"differs from their grids' t*h*w/{scan.merge}**2; text_tokens in the file is derived from the "
                     "grids")
    return "\n".join(lines)


def _listed(indices: tuple[int, ...], most: int = 8) -> str:
    return "samples " + ", ".join(map(str, indices[:most])) + (" ..." if len(indices) > most else "")
