#!/usr/bin/env python
"""Global-batch packing's build-time and per-step costs at the recipes' scale, on the CPU.

No model runs. Three measurements:

(1) **The lengths scan** (``batching.sizes.dataset_sizes``) of a Megatron-Bridge ``DirectSFTDataset``
    (``data/datasets/direct_sft.py``, the real class) over 1,000 base examples with
    ``target_length = 10,000,000``: 10^7 dataset indices, as Megatron-Bridge sizes a recipe's training
    set (``train_iters * global_batch_size``), index ``i`` being base example ``i % 1000``.

    * *before* (what the previous code did): every dataset index collated once, alone, in the calling
      process, its real tokens read from the 2D attention mask. 10^7 collates cannot run here: the
      per-collate time is the mean over the first 2,000 indices (each base example twice), collated
      in this process exactly as the scan measures a sample (``sizes._sample_sizes``), times 10^7
      (**extrapolated**).
    * *after, cold*: ``dataset_sizes(dataset, dataset.collate_fn, seq_length=4096, cache_dir=<empty
      temporary directory>, num_workers=2)``: the cache key (the first and last distinct sample,
      collated in one loader worker process) and the scan of the 1,000 distinct samples in 2 loader
      worker processes, written to the cache. Checked: 10^7 sizes, source "scan of 1000 distinct
      samples ...", and the scanned lengths equal the generator's.
    * *after, warm*: the same call again: the cache key (one worker) and the cache read.

    The collate is a stand-in, ``collate_impl(batch, processor, **kwargs)`` below (module level,
    deterministic, picklable), for a Qwen-VL-like collate: per example it "tokenizes" the text (a
    dictionary look-up per word: a Python tokenizer's loop, cheaper than a real one) and "preprocesses"
    each image (a ``(3, 14h, 14w)`` float pixel tensor filled, normalised per channel and cut into ``h * w``
    patches of ``3 * 14 * 14`` values, as an image processor does after decoding and resizing);
    then ``input_ids`` / ``labels`` / a 2D ``attention_mask`` padded to the batch's longest, and
    ``visual_inputs`` with ``pixel_values`` and ``image_grid_thw`` ``[[1, h, w], ...]``. About 1-5 ms
    a sample on this CPU (table (1) gives the measured mean); a real processor (image decoding, resizing,
    a chat template) costs more, so *before* is, if anything, understated.

    Base examples: ``global_batch_packing.long_tailed(1000, 4096, seed=19)``: lognormal text (median
    400, sigma 1.2), 0..6 images of ``(1, 12..40, 12..40)`` patches (36..400 LLM tokens at merge 2)
    after an 8-token prompt, every sample capped at 4,096 tokens.

(2) **The whole run's draws and its row**, at the recipe's scale: Megatron-Bridge's real samplers
    (``data/samplers.py``) over the 10^7 indices of (1), DP 8, micro-batch size 4, one micro-batch per
    rank (global batch 32, 312,500 steps = 10^7 / 32):

    * ``single``: ``MegatronPretrainingSampler``, ``run_draws(..., cycle=False)``;
    * ``cyclic``: ``MegatronPretrainingRandomSampler(data_sharding=True)``, ``run_draws(..., cycle=True)``.

    Timed: ``run_draws(rank_samplers(sampler, 8, from_start=True), 1, 312500, cycle=...)`` and then
    ``row_length_for_steps(draws, sizes=sizes, dp_size=8, num_micro_batches=1, align_to=8,
    upper=4 * 4096)`` (default cost: VERL's ``s + s^2 / 24576``), what ``bridge.plan_loader`` and
    ``bridge.run_row_length`` run when the loaders are built. Each is first timed on the run's first
    30,000 steps; when that, scaled linearly to the whole run, exceeds 60 s, the whole-run figure is
    that **extrapolation** (said in the table) and the row is computed on the first 30,000 steps, with
    a check that they hold every distinct step of the run (then the row is the whole run's: the row
    search depends only on the steps' contents, a step's content being its distinct samples in order).

(3) **Placement time per step** (``batching.policy.assign``, default cost, ``align_to = 8``) for one
    step of 4,096 and of 16,384 samples (``long_tailed(n, 4096, seed=19)``'s LLM tokens) on three
    layouts: DP 8 x MBS 4 (many rows of 4 samples), DP 8 x 4 micro-batches (32 rows of n/32 samples)
    and DP 64 x 4 micro-batches (256 rows of n/256 samples); at a *tight* static row (the step's own
    ``row_length_for_steps``: the smallest row it fits) and at a *loose* one (``micro_batch_size *
    seq_length``, seq_length 4096); median of 3 runs. Also ``row_length_for_steps`` over 3 steps of
    16,384 samples (``long_tailed(3 * 16384, 4096, seed=19)`` in 3 consecutive steps) per layout, one
    run each.

Threads: torch runs on ``--threads`` intra-op threads (default 1: torchrun's default
``OMP_NUM_THREADS=1`` per rank, and the loader workers' setting). On a shared machine a busy process
makes torch's intra-op parallel regions wait for a scheduler time slice (``benchmarks/README.md``);
the *threads* line of table (3) times one placement with torch's default thread count to show it.
Wall times of one process; the machine's 1-minute load average is recorded at the start and the end.

Writes ``benchmarks/results/global_batch_scale.{json,md}`` (``--quick``: a smoke run at 3.2 x 10^5
indices, 100 base examples and steps of 1,024 / 2,048 samples; writes nothing unless ``--out`` is given).

Usage:
    .venv/bin/python benchmarks/global_batch_scale.py [--quick] [--out DIR] [--threads N] [--render]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import cpu_name, markdown  # noqa: E402
from global_batch_packing import long_tailed  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

from megatron.bridge_thd.batching import sizes as sizes_module  # noqa: E402
from megatron.bridge_thd.batching.policy import assign  # noqa: E402
from megatron.bridge_thd.batching.sampler import rank_samplers, row_length_for_steps, run_draws  # noqa: E402
from megatron.bridge_thd.batching.sizes import SampleSizes, dataset_sizes  # noqa: E402
from megatron.bridge_thd.upstream.loading import load_bridge_module  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SEQ_LENGTH, DP, MICRO_BATCH_SIZE, ALIGN, SEED = 4096, 8, 4, 8, 19
PATCH, MERGE, PROMPT_TOKENS, IMAGE_TOKEN, PAD_TOKEN = 14, 2, 8, 1, 0
SCAN_WORKERS, REPEATS, SCALE_LIMIT_S = 2, 3, 60.0
FULL = {"base_examples": 1000, "target_length": 10_000_000, "before_indices": 2000, "pilot_steps": 30_000,
        "placement_samples": (4096, 16384), "row_steps": 3}
QUICK = {"base_examples": 100, "target_length": 320_000, "before_indices": 200, "pilot_steps": 3_000,
         "placement_samples": (1024, 2048), "row_steps": 3}
# (name, dp_size, how the step is cut: ("mbs", micro_batch_size) or ("nmb", micro-batches per rank))
PARALLEL_SETUPS = (("DP 8 x MBS 4", 8, ("mbs", 4)), ("DP 8 x 4 µb", 8, ("nmb", 4)), ("DP 64 x 4 µb", 64, ("nmb", 4)))


# --------------------------------------------------------------------------------------------
# The stand-in VLM collate and its data set
# --------------------------------------------------------------------------------------------


class StandInProcessor:
    """What the collate needs of a processor: a word -> id vocabulary and the image normalisation."""

    def __init__(self, vocabulary: list[str]):
        self.vocab = {word: i + 2 for i, word in enumerate(vocabulary)}
        self.mean = torch.tensor([0.481, 0.458, 0.408]).view(3, 1, 1)
        self.std = torch.tensor([0.269, 0.261, 0.276]).view(3, 1, 1)


def _pixel_patches(grid, processor: StandInProcessor, out: torch.Tensor) -> None:
    """One image's ``(h * w, 3 * PATCH * PATCH)`` normalised patches, written into ``out`` (an image
    processor's work after decoding and resizing: the rescaled pixels, normalised per channel and cut
    into patches)."""
    _, h, w = grid
    pixels = torch.full((3, h * PATCH, w * PATCH), (h * w % 255) / 255.0)
    pixels = pixels.sub_(processor.mean).div_(processor.std)
    out.view(h, w, 3, PATCH, PATCH).copy_(pixels.view(3, h, PATCH, w, PATCH).permute(1, 3, 0, 2, 4))


def collate_impl(batch: list[dict], processor: StandInProcessor, **kwargs) -> dict:
    """Stand-in VLM collate (module docstring): ``input_ids``, ``labels``, 2D ``attention_mask``,
    ``visual_inputs`` (``pixel_values``, ``image_grid_thw``); truncated at ``sequence_length``."""
    limit = kwargs.get("sequence_length")
    grids = [list(grid) for example in batch for grid in example["images"]]
    pixel_values = torch.empty(sum(h * w for _, h, w in grids), 3 * PATCH * PATCH)
    sequences, start = [], 0
    for example in batch:
        text = torch.tensor([processor.vocab[word] for word in example["text"].split()], dtype=torch.long)
        images = []
        for grid in example["images"]:
            _pixel_patches(grid, processor, pixel_values[start:start + grid[1] * grid[2]])
            start += grid[1] * grid[2]
            images.append(torch.full((grid[1] * grid[2] // MERGE ** 2,), IMAGE_TOKEN, dtype=torch.long))
        ids = torch.cat([text[:PROMPT_TOKENS], *images, text[PROMPT_TOKENS:]]) if images else text
        sequences.append(ids[:limit] if limit else ids)
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(batch), width), PAD_TOKEN, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, :len(ids)] = ids
        attention_mask[row, :len(ids)] = 1
    labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE_TOKEN), -100)
    visual = {"pixel_values": pixel_values, "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3)}
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "visual_inputs": visual}


def base_examples(n: int) -> tuple[list[dict], list[str], list[int]]:
    """``n`` examples with ``long_tailed``'s sizes: ``(examples, vocabulary, LLM tokens per example)``."""
    samples = long_tailed(n, SEQ_LENGTH, seed=SEED)
    rng = random.Random(SEED)
    vocabulary = [f"w{i}" for i in range(32_000)]
    examples = []
    for tokens, grids in zip(samples.tokens, samples.grids):
        text = tokens - sum(h * w // MERGE ** 2 for _, h, w in grids)
        examples.append({"text": " ".join(rng.choices(vocabulary, k=text)), "images": [tuple(g) for g in grids]})
    return examples, vocabulary, list(samples.tokens)


def direct_sft_dataset(examples: list[dict], vocabulary: list[str], target_length: int):
    """Megatron-Bridge's ``DirectSFTDataset`` over ``examples``, repeated to ``target_length`` indices."""
    direct_sft = load_bridge_module("data.datasets.direct_sft")
    return direct_sft.DirectSFTDataset(examples, target_length, StandInProcessor(vocabulary), collate_impl=collate_impl,
                                       sequence_length=SEQ_LENGTH)


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def measure_scan(config: dict):
    """Table (1): the per-index collate in the calling process (extrapolated) and ``dataset_sizes``
    cold and warm. Returns ``(results, dataset, sizes)``."""
    examples, vocabulary, expected = base_examples(config["base_examples"])
    dataset = direct_sft_dataset(examples, vocabulary, config["target_length"])
    count = config["before_indices"]

    def collate_each():
        return [sizes_module._sample_sizes(dataset.collate_fn([dataset[i]]), SEQ_LENGTH, i) for i in range(count)]

    measured, before_s = _timed(collate_each)
    per_collate = before_s / count
    with tempfile.TemporaryDirectory(prefix="bridge_thd_sizes_") as cache:
        def sizes_call():
            return dataset_sizes(dataset, dataset.collate_fn, seq_length=SEQ_LENGTH, cache_dir=cache,
                                 num_workers=SCAN_WORKERS)

        sizes, cold_s = _timed(sizes_call)
        warm, warm_s = _timed(sizes_call)
    period = config["base_examples"]
    assert len(sizes) == config["target_length"], (len(sizes), config["target_length"])
    assert sizes.source.startswith(f"scan of {period} distinct samples"), sizes.source
    assert sizes.lengths.tolist() == expected and warm.lengths.tolist() == expected
    assert [length for length, _ in measured] == [expected[i % period] for i in range(count)]
    image_counts = [len(e["images"]) for e in examples]
    return {
        "dataset": {"class": type(dataset).__name__, "base_examples": period, "indices": len(dataset),
                    "mean_tokens": sum(expected) / period, "max_tokens": max(expected),
                    "mean_images": sum(image_counts) / period},
        "before": {"collated_indices": count, "seconds": before_s, "ms_per_collate": 1e3 * per_collate,
                   "extrapolated_seconds": per_collate * len(dataset)},
        "cold": {"seconds": cold_s, "source": sizes.source.split(" (cached at")[0], "sizes": len(sizes)},
        "warm": {"seconds": warm_s, "source": "cache", "sizes": len(warm)},
        "workers": SCAN_WORKERS,
    }, dataset, sizes


def _samplers(dataset, kind: str):
    samplers = load_bridge_module("data.samplers")
    common = dict(total_samples=len(dataset), consumed_samples=0, micro_batch_size=MICRO_BATCH_SIZE,
                  data_parallel_rank=0, data_parallel_size=DP)
    if kind == "single":
        return samplers.MegatronPretrainingSampler(**common, drop_last=True)
    return samplers.MegatronPretrainingRandomSampler(dataset, **common, data_sharding=True)


def _distinct_steps(draws: torch.Tensor, period: int) -> int:
    """Steps whose contents (distinct samples, in order) differ."""
    return int(torch.unique(draws % period, dim=0).shape[0])


def measure_run(dataset, sizes: SampleSizes, kind: str, config: dict) -> dict:
    """Table (2) for one sampler kind: the whole run's draws and its row (module docstring: a step count
    over 60 s is measured on the first ``pilot_steps`` steps and scaled linearly)."""
    steps = len(dataset) // (DP * MICRO_BATCH_SIZE)
    pilot, cycle = min(config["pilot_steps"], steps), kind == "cyclic"

    def draw(n):
        return run_draws(rank_samplers(_samplers(dataset, kind), DP, from_start=True), 1, n, cycle=cycle)

    def row(draws):
        return row_length_for_steps(draws, sizes=sizes, dp_size=DP, num_micro_batches=1, align_to=ALIGN,
                                    upper=MICRO_BATCH_SIZE * SEQ_LENGTH)

    pilot_draws, pilot_draw_s = _timed(lambda: draw(pilot))
    draws, draw_s, draws_measured = pilot_draws, pilot_draw_s * steps / pilot, pilot
    if draw_s <= SCALE_LIMIT_S and pilot < steps:
        (draws, draw_s), draws_measured = _timed(lambda: draw(steps)), steps
    assert len(draws) == draws_measured, (len(draws), draws_measured)
    pilot_row, pilot_row_s = _timed(lambda: row(draws[:pilot]))
    row_length, row_s, row_measured = pilot_row, pilot_row_s * steps / pilot, pilot
    if row_s <= SCALE_LIMIT_S and pilot < len(draws):
        (row_length, row_s), row_measured = _timed(lambda: row(draws)), len(draws)
    period = sizes.lengths.numel()
    distinct = _distinct_steps(draws, period)
    distinct_in_row = distinct if row_measured == len(draws) else _distinct_steps(draws[:row_measured], period)
    tokens = int(sizes.take(draws)[0].sum())
    return {"sampler": kind, "steps": steps, "global_batch_size": DP * MICRO_BATCH_SIZE,
            "draws": {"measured_steps": draws_measured, "seconds": draw_s, "extrapolated": draws_measured < steps,
                      "pilot_seconds": pilot_draw_s, "pilot_steps": pilot},
            "row": {"row_length": row_length, "measured_steps": row_measured, "seconds": row_s,
                    "extrapolated": row_measured < steps, "pilot_seconds": pilot_row_s,
                    "whole_run_row": distinct_in_row == distinct and len(draws) == steps,
                    "padding": 1 - tokens / (len(draws) * DP * row_length),
                    "in_batch_padding": 1 - tokens / (len(draws) * DP * MICRO_BATCH_SIZE * SEQ_LENGTH)},
            "distinct_steps": {"in_draws": distinct, "draws": len(draws), "in_row_steps": distinct_in_row}}


def _layout(n: int, dp: int, cut) -> tuple[int, int]:
    """``(num_micro_batches, micro_batch_size)`` of an ``n``-sample step on ``dp`` ranks."""
    how, value = cut
    return (n // (dp * value), value) if how == "mbs" else (value, n // (dp * value))


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        times.append(_timed(fn)[1] * 1e3)
    return statistics.median(times)


def measure_placement(n: int, name: str, dp: int, cut, repeats: int) -> dict:
    """Table (3), one row: ``assign`` on an ``n``-sample step at the tight and the loose row."""
    lengths = torch.tensor(long_tailed(n, SEQ_LENGTH, seed=SEED).tokens, dtype=torch.int64)
    zeros = torch.zeros_like(lengths)
    sizes = SampleSizes(lengths, zeros, zeros.to(torch.float64), f"long_tailed({n})")
    nmb, mbs = _layout(n, dp, cut)
    tight, search_s = _timed(lambda: row_length_for_steps(torch.arange(n)[None], sizes=sizes, dp_size=dp,
                                                          num_micro_batches=nmb, align_to=ALIGN))
    rows = {"tight": tight, "loose": mbs * SEQ_LENGTH}
    out = {"samples": n, "layout": name, "dp": dp, "num_micro_batches": nmb, "micro_batch_size": mbs,
           "rows": dp * nmb, "samples_per_row": n / (dp * nmb), "tight_row_search_s": search_s, "repeats": repeats}
    for which, row in rows.items():
        out[which] = {"row_length": row, "assign_ms": _median_ms(
            lambda: assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=ALIGN), repeats)}
    return out


def measure_row_search(n: int, steps: int, name: str, dp: int, cut) -> dict:
    """``row_length_for_steps`` over ``steps`` consecutive steps of ``n`` samples (one run)."""
    lengths = torch.tensor(long_tailed(steps * n, SEQ_LENGTH, seed=SEED).tokens, dtype=torch.int64)
    zeros = torch.zeros_like(lengths)
    sizes = SampleSizes(lengths, zeros, zeros.to(torch.float64), f"long_tailed({steps * n})")
    nmb, _ = _layout(n, dp, cut)
    row, seconds = _timed(lambda: row_length_for_steps(torch.arange(steps * n).view(steps, n), sizes=sizes,
                                                       dp_size=dp, num_micro_batches=nmb, align_to=ALIGN))
    return {"layout": name, "samples": n, "steps": steps, "row_length": row, "seconds": seconds}


def measure_threads(n: int, threads: int) -> dict:
    """One ``assign`` (DP 8 x 4 µb, tight row) at ``threads`` and at torch's default thread count."""
    name, dp, cut = PARALLEL_SETUPS[1]
    lengths = torch.tensor(long_tailed(n, SEQ_LENGTH, seed=SEED).tokens, dtype=torch.int64)
    zeros = torch.zeros_like(lengths)
    nmb, _ = _layout(n, dp, cut)
    row = row_length_for_steps(torch.arange(n)[None], sizes=SampleSizes(lengths, zeros, zeros.to(torch.float64)),
                               dp_size=dp, num_micro_batches=nmb, align_to=ALIGN)
    out = {"layout": name, "samples": n, "row_length": row}
    for label, count in (("set", threads), ("default", os.cpu_count() or 1)):
        torch.set_num_threads(count)
        out[label] = {"threads": count, "assign_ms": _timed(
            lambda: assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=ALIGN))[1] * 1e3}
    torch.set_num_threads(threads)
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    return f"{s:.1f} s" if s >= 1 else f"{1e3 * s:.0f} ms"


def render_scan(scan: dict) -> str:
    """Table (1)."""
    d, before = scan["dataset"], scan["before"]
    rows = [
        ["before: every index collated in the calling process", f"{d['indices']:,}",
         f"**{_seconds(before['extrapolated_seconds'])}** (extrapolated)",
         f"{before['ms_per_collate']:.2f} ms per collate (mean of {before['collated_indices']:,} indices collated "
         f"here, {_seconds(before['seconds'])}) x {d['indices']:,} indices"],
        [f"after, cold: scan of the distinct samples in {scan['workers']} worker processes", f"{d['base_examples']:,} + 2",
         f"**{_seconds(scan['cold']['seconds'])}**", "measured: cache key (2 collates, 1 worker) + scan + cache write; "
         f"{scan['cold']['sizes']:,} sizes, source \"{scan['cold']['source']}\""],
        ["after, warm: cache hit", "2", f"**{_seconds(scan['warm']['seconds'])}**",
         "measured: cache key (2 collates, 1 worker) + cache read"],
    ]
    return markdown(["lengths", "collates", "time", "how"], rows)


def render_runs(runs: list[dict]) -> str:
    """Table (2)."""
    rows = []
    for r in runs:
        draws, row = r["draws"], r["row"]

        def when(part):
            return ("measured" if not part["extrapolated"] else
                    f"extrapolated: {_seconds(part['pilot_seconds'])} for {part['measured_steps']:,} steps x "
                    f"{r['steps'] / part['measured_steps']:.2f}")

        rows.append([r["sampler"], f"{r['steps']:,}", f"**{_seconds(draws['seconds'])}** ({when(draws)})",
                     f"{row['row_length']:,}" + ("" if row["whole_run_row"] else " (first steps only)"),
                     f"**{_seconds(row['seconds'])}** ({when(row)})", f"{100 * row['padding']:.1f}%",
                     f"{100 * row['in_batch_padding']:.1f}%",
                     f"{r['distinct_steps']['in_draws']:,} of {r['distinct_steps']['draws']:,}"])
    return markdown(["sampler", "steps", "run_draws", "row", "row_length_for_steps", "padding at the row",
                     "padding at MBS x seq_length", "distinct steps"], rows)


def render_placement(placements: list[dict], searches: list[dict], threads: dict) -> str:
    """Table (3) and the row searches."""
    out = [markdown(
        ["samples", "layout", "rows x samples/row", "tight row", "assign, tight (ms)", "loose row", "assign, loose (ms)"],
        [[f"{p['samples']:,}", p["layout"], f"{p['rows']:,} x {p['samples_per_row']:g}", f"{p['tight']['row_length']:,}",
          f"{p['tight']['assign_ms']:.0f}", f"{p['loose']['row_length']:,}", f"{p['loose']['assign_ms']:.0f}"]
         for p in placements])]
    out += ["", "`row_length_for_steps` over several steps (one run each):", "", markdown(
        ["layout", "steps x samples", "row", "time"],
        [[s["layout"], f"{s['steps']} x {s['samples']:,}", f"{s['row_length']:,}", f"**{_seconds(s['seconds'])}**"]
         for s in searches])]
    out += ["", f"Threads: one `assign` ({threads['layout']}, {threads['samples']:,} samples, tight row "
            f"{threads['row_length']:,}) took {threads['set']['assign_ms']:.0f} ms with {threads['set']['threads']} torch "
            f"thread(s) and {threads['default']['assign_ms']:.0f} ms with {threads['default']['threads']} (torch's default "
            "here), on this shared machine."]
    return "\n".join(out)


def render(results: dict) -> str:
    """The Markdown report from the results JSON."""
    m, p = results["machine"], results["parameters"]
    scan = results["scan"]
    out = [
        "# Global-batch packing at the recipes' scale: build time and per-step cost",
        "",
        f"`benchmarks/global_batch_scale.py`{' --quick' if p['quick'] else ''}, {m['date']}: {m['cpu']} "
        f"({m['cores']} cores), torch {m['torch']} on {m['torch_threads']} intra-op thread(s); 1-minute load average "
        f"{m['load_average_start']:.1f} at the start, {m['load_average_end']:.1f} at the end (other processes shared "
        f"the machine); the script ran {results['run_seconds']:.0f} s. Wall times of one process; CPU only, no model.",
        "",
        f"## (1) Lengths of a `DirectSFTDataset` of {scan['dataset']['indices']:,} indices over "
        f"{scan['dataset']['base_examples']:,} base examples (seq_length {p['seq_length']})",
        "",
        f"Stand-in VLM collate (module docstring): mean {scan['dataset']['mean_tokens']:.0f} / max "
        f"{scan['dataset']['max_tokens']} tokens, {scan['dataset']['mean_images']:.1f} images per example.",
        "",
        render_scan(scan),
        "",
        f"## (2) The whole run's draws and its `thd_static` row: DP {p['dp']}, MBS {p['micro_batch_size']}, one "
        f"micro-batch per rank (global batch {p['dp'] * p['micro_batch_size']}), align {p['align']}, row ceiling "
        f"{p['micro_batch_size'] * p['seq_length']:,}",
        "",
        render_runs(results["runs"]),
        "",
        f"Extrapolated: timed on the run's first steps and scaled linearly (a figure over {SCALE_LIMIT_S:.0f} s). The "
        "row on the first steps is the whole run's when they hold every distinct step of the run (a step's content: "
        "its distinct samples in order; `DirectSFTDataset` index i is base example i mod "
        f"{scan['dataset']['base_examples']:,}). Padding: 1 - the run's real tokens / (steps x {p['dp']} rows x row).",
        "",
        f"## (3) `assign` per step (default cost, align {p['align']}; median of {p['repeats']} runs)",
        "",
        "Tight row: the step's own `row_length_for_steps` (the smallest row it fits); loose row: MBS x seq_length.",
        "",
        render_placement(results["placements"], results["row_searches"], results["threads"]),
    ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def run(config: dict, quick: bool, threads: int) -> dict:
    """Every measurement, in the order of the module docstring."""
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    scan, dataset, sizes = measure_scan(config)
    print(f"(1) scan: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    runs = []
    for kind in ("single", "cyclic"):
        runs.append(measure_run(dataset, sizes, kind, config))
        print(f"(2) {kind}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    placements = [measure_placement(n, name, dp, cut, 1 if quick else REPEATS)
                  for n in config["placement_samples"] for name, dp, cut in PARALLEL_SETUPS]
    largest = config["placement_samples"][-1]
    searches = [measure_row_search(largest, config["row_steps"], name, dp, cut) for name, dp, cut in PARALLEL_SETUPS]
    threads_result = measure_threads(largest, threads)
    print(f"(3) placement: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "date": datetime.date.today().isoformat(),
                    "python": platform.python_version(), "torch": torch.__version__, "torch_threads": threads,
                    "load_average_start": load_start, "load_average_end": os.getloadavg()[0]},
        "parameters": {"quick": quick, "seq_length": SEQ_LENGTH, "dp": DP, "micro_batch_size": MICRO_BATCH_SIZE,
                       "align": ALIGN, "seed": SEED, "scan_workers": SCAN_WORKERS, "repeats": 1 if quick else REPEATS,
                       "scale_limit_s": SCALE_LIMIT_S, **{k: v for k, v in config.items()}},
        "scan": scan, "runs": runs, "placements": placements, "row_searches": searches, "threads": threads_result,
        "run_seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (3.2e5 indices, 100 base examples, steps of "
                        "1,024 / 2,048 samples, 1 repeat); writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help="directory for global_batch_scale.{json,md} (default "
                        "benchmarks/results; none with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--render", action="store_true", help="only re-render the .md from the results JSON")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if args.render:
        results = json.loads(((out or RESULTS) / "global_batch_scale.json").read_text())
    else:
        torch.set_num_threads(args.threads)
        results = run(QUICK if args.quick else FULL, args.quick, args.threads)
    report = render(results)
    print(report)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        if not args.render:
            (out / "global_batch_scale.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "global_batch_scale.md").write_text(report)
        print(f"wrote {out / 'global_batch_scale.json'}, .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
