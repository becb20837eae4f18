"""``bridge-thd scan``: a Megatron-Bridge recipe's dataset, measured sample by sample through its own provider,
processor and collate, written as the planner's lengths file, with a summary. Reasoning: docs/scan.md.

Examples::

    bridge-thd scan --recipe qwen3_vl_8b_sft_2gpu_h100_bf16_config --out lengths.json
    bridge-thd scan --recipe qwen35_vl_2b_sft_1gpu_h100_bf16_config --split validation --seq-length 2048
    bridge-thd scan --recipe my.recipes.module:my_recipe_config --model qwen3-vl-8b --gpus 16
    bridge-thd scan --cpu-tiny --seq-length 1280        # this machine: local cord_v2 data, tiny processor

What runs: the recipe function builds its ``ConfigContainer``; its ``cfg.dataset`` goes, unchanged but for three
settings, to the provider Megatron-Bridge's trainer would pick (``data.utils.get_dataset_provider``) with the
sample counts the trainer would ask for (``data.loaders.get_train_valid_test_num_samples``); each **distinct**
sample of the chosen split (``batching.sizes.repeat_period``) is collated alone by the dataset's own collate in
loader worker processes (forked: never in this process, as ``batching.sizes`` scans), and read:

* its real tokens: the 2D attention mask's sum (right-padded rows);
* its supervised tokens, as spans of the collate's (shifted) loss mask, so that what a cut at any ``seq_length``
  keeps is exact;
* its image and video patch grids (``image_grid_thw`` / ``video_grid_thw``) and where its image / video
  placeholder tokens end (the processor's ``image_token_id`` / ``video_token_id``).

The three settings changed, none of which changes a sample's tokens: ``seq_length`` is set out of reach
(:data:`NO_CUT`) so that the collate cuts nothing (the lengths are the untruncated ones; what Megatron-Bridge's
collate would cut at ``--seq-length`` is computed from them, as ``pad_or_truncate_sequence_batch`` keeps each
row's first ``seq_length`` columns), ``pad_to_max_length`` is off, and in-batch packing is deferred to the step
(``defer_in_batch_packing_to_step``, as ``configure(layout=...)`` sets it: the collate then gives each row's 2D
mask). The scan is cached under the key ``batching.sizes`` computes (dataset class, size, period and the first
and last samples as the collate gives them, collated in a worker), so one scan serves every ``--seq-length``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import math
import os
import re
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ScannedSample", "Scan", "OverLength", "build_parser", "main", "run", "measure", "scan_dataset",
           "recipe_config", "build_split", "lengths_document", "write_lengths", "summary", "over_length", "histogram",
           "RECIPE_MODULE", "CPU_TINY_RECIPE", "NO_CUT"]

RECIPE_MODULE = "megatron.bridge.recipes.qwen_vl.h100"  # where a bare recipe name is looked up
CPU_TINY_RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"
NO_CUT = 2**31 - 1  # the scan's dataset seq_length: no sample is cut
CACHE_SUFFIX = ".scan-v1.json"
SPLITS = ("train", "validation", "test")
FORMAT = "bridge-thd lengths"


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


# --- one sample, in a worker ------------------------------------------------------------------------------------


def _spans(row) -> tuple[tuple[int, int], ...]:
    """Half-open runs of the nonzero positions of a 1D tensor."""
    import torch

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
    import torch

    from megatron.bridge_thd.batching.sizes import visual_grids

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


# --- the cache --------------------------------------------------------------------------------------------------


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

    The cache file is ``batching.sizes.sizes_cache_path(...)`` (its key computed in a worker) with the suffix
    :data:`CACHE_SUFFIX`, under ``cache_dir`` (default ``batching.sizes.default_cache_dir()``).
    ``progress(done, total)`` is called after each chunk of a scan.
    """
    import multiprocessing

    from megatron.bridge_thd.batching.sizes import collate_in_workers, repeat_period, sizes_cache_path

    collate_fn = collate_fn if collate_fn is not None else dataset.collate_fn
    # Fork: the dataset's collate is often a closure (DirectSFTDataset's), which a spawned worker cannot unpickle.
    context = multiprocessing.get_context("fork")
    path = sizes_cache_path(dataset, collate_fn, seq_length=None, cache_dir=cache_dir, context=context)
    path = path.with_name(path.stem + CACHE_SUFFIX)
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


# --- the lengths file -------------------------------------------------------------------------------------------


def lengths_document(scan: Scan, source: dict | None = None) -> dict:
    """The planner's JSON lengths file (``plan.samples.load_lengths``) with the scan's extra fields: per sample
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


# --- the summary ------------------------------------------------------------------------------------------------


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
            "  Megatron-Bridge's collate says nothing; with configure(...), dataset.overlong_samples decides: "
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


# --- the recipe ---------------------------------------------------------------------------------------------------


def recipe_config(name: str):
    """The recipe function ``name`` (in :data:`RECIPE_MODULE`, or ``module:function``) called: its
    ``ConfigContainer``.

    Raises:
        ValueError: naming ``--recipe``, with close names, when there is no such function.
    """
    module_name, _, function = name.rpartition(":") if ":" in name else (RECIPE_MODULE, ":", name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--recipe {name!r}: cannot import {module_name!r} ({error})") from None
    recipe = getattr(module, function, None)
    if not callable(recipe):
        known = [n for n in getattr(module, "__all__", dir(module)) if n.endswith("_config")]
        close = difflib.get_close_matches(function, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(sorted(known)[:3])}"
        raise ValueError(f"--recipe {name!r}: {module_name} has no recipe function {function!r}{hint} "
                         "(another module's: --recipe package.module:function)")
    return recipe()


def _gpus_of(recipe: str) -> int | None:
    match = re.search(r"_(\d+)gpu_", recipe)
    return int(match.group(1)) if match else None


def _preset_for(path: str | None) -> str | None:
    """The planner preset whose Hugging Face repository is ``path`` (the recipe's processor path), if any."""
    from megatron.bridge_thd.plan.presets import PRESETS

    return next((name for name, spec in PRESETS.items() if path and spec.hf_repo == path), None)


def build_split(cfg, split: str):
    """``cfg.dataset``'s ``split`` as the trainer's provider builds it, with the scan's settings (module
    docstring); the other splits are not built.

    Raises:
        ValueError: naming ``--split`` when the recipe asks for no samples of it.
    """
    from megatron.bridge.data.loaders import get_train_valid_test_num_samples
    from megatron.bridge.data.utils import get_dataset_provider

    dataset_config = cfg.dataset
    counts = list(get_train_valid_test_num_samples(cfg))
    which = SPLITS.index(split)
    if counts[which] <= 0:
        raise ValueError(f"--split {split}: the recipe asks for no {split} samples (train_iters, eval_iters, "
                         "eval_interval and the batch sizes decide how many); scan another split")
    counts = [count if k == which else 0 for k, count in enumerate(counts)]
    dataset_config.seq_length = NO_CUT
    for name, value in (("pad_to_max_length", False), ("defer_in_batch_packing_to_step", True)):
        if hasattr(dataset_config, name):
            setattr(dataset_config, name, value)
    if hasattr(dataset_config, "finalize"):
        dataset_config.finalize()
    tokenizer = None
    if getattr(dataset_config, "hf_processor_path", None) is None and getattr(cfg, "tokenizer", None) is not None:
        from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(cfg.tokenizer)
        if hasattr(dataset_config, "tokenizer"):
            dataset_config.tokenizer = tokenizer
    built = get_dataset_provider(dataset_config)(counts, dataset_config, tokenizer=tokenizer, pg_collection=None)
    dataset = built[which]
    if dataset is None:
        raise ValueError(f"--split {split}: the provider built no {split} dataset for {type(dataset_config).__name__}")
    return dataset


def _processor_facts(dataset) -> tuple[tuple[int, ...], int | None]:
    """The dataset's processor's image / video placeholder token ids and spatial merge size, where it has them
    (attributes only: the tokenizer is not run in this process)."""
    processor = getattr(dataset, "_processor", None) or getattr(dataset, "processor", None)
    ids = tuple(int(v) for v in (getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None))
                if isinstance(v, int))
    merge = None
    for part in ("image_processor", "video_processor"):
        value = getattr(getattr(processor, part, None), "merge_size", None)
        if isinstance(value, int):
            merge = value
            break
    return ids, merge


# --- the command ------------------------------------------------------------------------------------------------


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
        return value

    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-thd scan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None,
                   help=f"a Megatron-Bridge recipe function: a name in {RECIPE_MODULE} (e.g. {CPU_TINY_RECIPE}) or "
                   f"package.module:function; required unless --cpu-tiny (default there: {CPU_TINY_RECIPE})")
    p.add_argument("--split", choices=SPLITS, default="train", help="which dataset of the recipe (default train)")
    p.add_argument("--seq-length", type=_positive("seq_length"), default=None,
                   help="the length the summary and the planner cut at (default: the recipe's dataset.seq_length)")
    p.add_argument("--out", default="lengths.json", help="the lengths file (default lengths.json; .csv: CSV)")
    p.add_argument("--cache-dir", default=None,
                   help="where scans are cached (default $XDG_CACHE_HOME/bridge_thd/sizes, global-batch packing's)")
    p.add_argument("--workers", type=_positive("workers"), default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="loader worker processes that collate (default: half the CPUs, at most 8)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="planner preset for the prediction (default: the one whose hub repository is "
                       "the recipe's hf_processor_path)")
    model.add_argument("--hf-config", help="a Hugging Face config.json for the prediction instead of a preset")
    p.add_argument("--gpus", type=_positive("gpus"), default=None,
                   help="GPUs of the run for the prediction (default: the recipe name's N in '_Ngpu_', else 8)")
    p.add_argument("--gpu", default="h100-sxm", help="GPU for the planner's roofline (bridge-thd plan --list-models)")
    p.add_argument("--no-plan", action="store_true", help="skip the planner's prediction")
    p.add_argument("--cpu-tiny", action="store_true",
                   help="on this machine: the test bed's local cord_v2-shaped data and tiny Qwen3-VL processor "
                   "(patch 16, as Qwen3-VL) in place of the hub's, offline")
    p.add_argument("--workdir", default=None,
                   help="--cpu-tiny: where its data and processor are written once (default: "
                   "$XDG_CACHE_HOME/bridge_thd/cpu-tiny)")
    p.add_argument("--cpu-tiny-samples", type=_positive("cpu_tiny_samples"), default=64,
                   help="--cpu-tiny: train rows of the local data (default 64, as the CPU runs; every fourth is long)")
    return p


class _Progress:
    """A stderr progress line: rewritten in place on a terminal, else one line per tenth."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.next_tenth = time.perf_counter(), 0

    def __call__(self, done: int, total: int) -> None:
        rate = done / max(1e-9, time.perf_counter() - self.start)
        line = f"bridge-thd scan: {done}/{total} distinct samples ({done / total:.0%}, {rate:.1f}/s)"
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if done == total else ""))
        elif done * 10 >= self.next_tenth * total or done == total:
            self.stream.write(line + "\n")
            self.next_tenth = done * 10 // total + 1
        self.stream.flush()


def _cpu_tiny_data(workdir: Path, n_train: int) -> str:
    """The test bed's cord_v2-shaped data under ``workdir/naver-clova-ix/cord-v2`` and its tiny processor
    (``workdir/processor``), written unless already there with these settings; returns the processor path."""
    settings = {"n_train": n_train, "n_val": max(2, n_train // 8), "seed": 0, "patch_size": 16}
    marker = workdir / "cpu-tiny.json"
    if not marker.is_file() or json.loads(marker.read_text()) != settings:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # In a child: building the processor trains and runs its fast tokenizer, which must not have run in this
        # process when the scan forks its workers (batching.sizes: a deadlock risk in the forked children).
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            pool.submit(_write_cpu_tiny_data, str(workdir), settings).result()
        marker.write_text(json.dumps(settings))
    return str(workdir / "processor")


def _write_cpu_tiny_data(workdir: str, settings: dict) -> None:
    from megatron.bridge_thd_cpu.cord_v2 import tiny_qwen3_vl_processor, write_cord_v2_preset_layout

    write_cord_v2_preset_layout(workdir, n_train=settings["n_train"], n_val=settings["n_val"], seed=settings["seed"])
    tiny_qwen3_vl_processor(os.path.join(workdir, "processor"), patch_size=settings["patch_size"])


@contextlib.contextmanager
def _environment(args):
    """Megatron-Bridge importable whole on this machine (``bridge_thd_cpu.bridge_package``: nothing is stood in where
    Transformer Engine is installed); with ``--cpu-tiny``, the hub offline with the recipes' model configs
    (``bridge_thd_cpu.hf_hub.offline_hub``), datasets offline, and the working directory ``workdir`` (where the
    recipes' ``cord_v2`` preset finds the local copy). All restored on exit. Hugging Face's hub reads its environment
    when first imported: in a process that imported it before, the caller makes it offline (the tests do)."""
    with contextlib.ExitStack() as stack:
        if "megatron.bridge" not in sys.modules or getattr(sys.modules["megatron.bridge"], "__file__", None) is None:
            from megatron.bridge_thd_cpu.bridge_package import bridge_package

            stack.enter_context(bridge_package())
        if args.cpu_tiny:
            from megatron.bridge_thd_cpu.hf_hub import offline_hub

            stack.enter_context(offline_hub())
            saved = os.environ.get("HF_DATASETS_OFFLINE")
            os.environ["HF_DATASETS_OFFLINE"] = "1"
            stack.callback(lambda: os.environ.pop("HF_DATASETS_OFFLINE") if saved is None
                           else os.environ.__setitem__("HF_DATASETS_OFFLINE", saved))
            stack.callback(os.chdir, os.getcwd())
            args.workdir.mkdir(parents=True, exist_ok=True)
            os.chdir(args.workdir)
        yield


def _prediction(args, cfg, lengths: Path, seq_length: int, processor_path: str | None) -> str:
    """The planner on the lengths file, with the recipe's micro / global batch size and parallel layout: the
    lines ``bridge-thd plan`` prints, after the command that prints them."""
    from megatron.bridge_thd.plan.plan_command import build_parser as plan_parser
    from megatron.bridge_thd.plan.plan_command import run as plan_run

    if args.hf_config:
        model = ["--hf-config", str(Path(args.hf_config).resolve())]
    else:
        name = args.model or _preset_for(processor_path)
        if name is None:
            return (f"planner: no preset has the recipe's processor {processor_path!r} as its hub repository; give "
                    "--model PRESET or --hf-config config.json for a prediction")
        model = ["--model", name]
    m = cfg.model
    gpus = args.gpus or _gpus_of(args.recipe) or 8
    argv = model + ["--lengths", str(lengths), "--seq-length", str(seq_length),
                    "--micro-batch-size", str(cfg.train.micro_batch_size),
                    "--global-batch-size", str(cfg.train.global_batch_size),
                    "--tp", str(getattr(m, "tensor_model_parallel_size", 1) or 1),
                    "--pp", str(getattr(m, "pipeline_model_parallel_size", 1) or 1),
                    "--cp", str(getattr(m, "context_parallel_size", 1) or 1),
                    "--ep", str(getattr(m, "expert_model_parallel_size", 1) or 1),
                    "--gpus", str(gpus), "--gpu", args.gpu]
    if not getattr(m, "sequence_parallel", True):
        argv.append("--no-sequence-parallel")
    command = "bridge-thd plan " + " ".join(argv)
    try:
        return f"planner ({command}):\n\n" + plan_run(plan_parser().parse_args(argv))
    except ValueError as error:
        return f"planner ({command}): refused: {error}"


def run(args) -> str:
    """The scan (module docstring): the summary text; writes ``args.out``."""
    if args.recipe is None:
        if not args.cpu_tiny:
            raise ValueError("--recipe: required (a Megatron-Bridge recipe function such as "
                             f"{CPU_TINY_RECIPE}), unless --cpu-tiny")
        args.recipe = CPU_TINY_RECIPE
    out = Path(args.out).resolve()
    cache_dir = Path(args.cache_dir).resolve() if args.cache_dir else None
    if args.cpu_tiny:
        from megatron.bridge_thd.batching.sizes import default_cache_dir

        args.workdir = Path(args.workdir).resolve() if args.workdir else default_cache_dir().parent / "cpu-tiny"
    with _environment(args):
        cfg = recipe_config(args.recipe)
        dataset_config = cfg.dataset
        processor_path = getattr(dataset_config, "hf_processor_path", None)
        seq_length = args.seq_length or getattr(dataset_config, "seq_length", None) or cfg.model.seq_length
        if args.cpu_tiny:
            if not hasattr(dataset_config, "hf_processor_path"):
                raise ValueError(f"--cpu-tiny: {args.recipe}'s dataset is a {type(dataset_config).__name__}; the "
                                 "local cord_v2 data replaces a DirectHFSFTDatasetConfig's hub data and processor only")
            dataset_config.hf_processor_path = _cpu_tiny_data(args.workdir, args.cpu_tiny_samples)
        dataset = build_split(cfg, args.split)
        placeholder_ids, merge = _processor_facts(dataset)
        scan = scan_dataset(dataset, placeholder_ids=placeholder_ids, merge=merge or 2, num_workers=args.workers,
                            cache_dir=cache_dir, progress=_Progress())
        source = {"recipe": args.recipe, "split": args.split, "dataset": type(dataset_config).__name__,
                  "processor": getattr(dataset_config, "hf_processor_path", None), "cpu_tiny": bool(args.cpu_tiny)}
        write_lengths(scan, out, source)
        where = "local cord_v2-shaped data, tiny processor" if args.cpu_tiny else f"processor {processor_path}"
        head = [f"bridge-thd scan: {args.recipe}, {args.split} split ({type(dataset_config).__name__}, {where})",
                f"{len(scan.samples):,} distinct samples ({scan.total:,} dataset indices the run draws from); "
                f"spatial merge {scan.merge}" + ("" if merge else " (assumed: the processor does not say)"),
                (f"read from the cache {scan.cached} (no sample collated again)" if scan.from_cache else
                 f"scanned in {scan.seconds:.1f} s by {scan.workers} worker process(es); cached at {scan.cached}"),
                f"wrote {out}", "", ""]
        text = "\n".join(head) + summary(scan, seq_length)
        if not args.no_plan:
            text += "\n\n" + _prediction(args, cfg, out, seq_length, processor_path)
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point (``bridge-thd scan ...``); returns the exit status (0 ok, 2 bad input with a one-line error on
    stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    try:
        # What Megatron-Bridge prints or logs to stdout while it imports and builds goes to stderr: stdout holds
        # the summary alone.
        with contextlib.redirect_stdout(sys.stderr):
            text = run(args)
    except ValueError as error:
        print(f"bridge-thd scan: error: {error}", file=sys.stderr)
        return 2
    print(text, file=stdout)
    return 0
