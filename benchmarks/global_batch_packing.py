#!/usr/bin/env python
"""Global-batch packing against Megatron-Bridge's in-batch placement and VERL's balancer, on the CPU.

No model runs: every figure comes from per-sample lengths, Megatron-Bridge's FLOPs terms
(``batching.sample_cost``) and the placements themselves. Deterministic (fixed seeds) except the
wall times of table (d).

Setting: MBS 4, DP 8, global batch sizes 64 and 512 (2 and 16 micro-batches per rank); the steps are
consecutive global batches of each distribution (the remainder dropped); THD alignment 1 (TP = CP = 1);
models Qwen3-VL 8B and Qwen3-VL 30B-A3B (their cost coefficients; 30B-A3B with EP8 for the planner's
step time).

Distributions:

* ``receipts``: the planner's synthetic receipts, ``plan.samples.receipt_lengths(4096, 0)`` (one image
  each), seq_length 2048.
* ``long-tailed``: 4096 samples, ``random.Random(19)``: text tokens lognormal (median 400, sigma
  1.2: mean ~820, 1% above ~6,500), 0..6 images per sample (uniform), each image a ``(1, h, w)`` patch
  grid with h, w even in [12, 40] (36..400 LLM tokens), the images after an 8-token prompt; the text
  capped so that every sample fits seq_length 4096 (the cap is the heavy tail's end).
* ``doc-chart file``: ``benchmarks/data/global_batch_lengths.json`` (this script writes it, deterministic,
  ``random.Random(1919)``, in ``cost.sample_lengths.load_lengths`` format, loaded back through it): 2048
  samples, 60% document pages (1..8 page images of (1, 28..48, 20..36) patches, question + answer
  text lognormal median 180, sigma 0.8), 40% charts (1 image, 2 with probability 0.3, of (1, 24..48,
  32..56) patches, text lognormal median 120, sigma 0.7); image resolution lowered until the sample
  fits seq_length 2048.

Tables:

(a) ``thd_static`` static-row padding: in-batch placement (row ``micro_batch_size * seq_length``) vs
    global-batch packing (row chosen from the data by ``batching.sampler.choose_row_length``, as the
    runtime chooses it). Goal <= 5%.
(b) Per-rank cost max / mean (cost = ``sample_cost(model)``), mean over the steps (and the worst
    step): in-batch placement; ``batching.assign`` into ``thd`` rows (``micro_batch_size *
    seq_length``) and into the chosen static row; VERL 0.9.1: its DP balance (``_balance_batch``:
    ``get_seqlen_balanced_partitions(calculate_workload(s), dp, equal_size=True)``, Karmarkar-Karp on
    ``24576 * s + s^2`` of the tokens) then its micro-batches per rank (``rearrange_micro_batches``,
    real function, token cap ``micro_batch_size * seq_length``, the DP all-reduces of the micro-batch
    count emulated: every rank runs the same count, the smallest at which every rank fits). Goal <= 1.03.
(c) Vision-aware vs text-only balancing: ``assign`` with the full cost vs with ``cost.text_only()``
    (no ViT terms), both measured with the full cost.
(d) ``assign``'s wall time for one 4096-sample global batch (DP 8 x 128 micro-batches of 4), thd row and
    static row, and VERL's ``get_seqlen_balanced_partitions`` on the same lengths: median of repeats
    (this CPU, one process).
(e) The planner's predicted step time (``plan.balance.balance_plan``, 8 x H100 SXM, the time model, docs/time-model.md):
    the slowest DP rank's time, with and without global-batch packing, per layout (``thd_static``
    packed with one row, ``row_buckets=1``, as in (a)).
(f) ``thd_static`` padding with K static rows (``row_buckets``), K = 1, 2, 4, 8 (the runtime's default is 4):
    the rows chosen as the runtime chooses them (``batching.bridge.run_row_buckets``): the longest is (a)'s
    row (``row_length_for_steps``), the others ``batching.sampler.micro_batch_slots`` (the aligned slots of
    every micro-batch ``assign`` forms in the longest row, over the same draws) then
    ``batching.sampler.row_buckets_for_runs`` (``optimal_row_lengths``, count K). Padding = 1 - real tokens /
    slots over all steps, each micro-batch taking the shortest row that holds it
    (``placement_stats(row_lengths=...)`` on (b)'s static-row placements). The placement is the longest
    row's for every K, so the per-rank cost max / mean is (b)'s "assign (static row)". The planner
    (``balance_plan(row_buckets=K)``, checked to choose the same rows and padding) gives the ``thd_static``
    step time and its model of the K rows as CUDA graphs (``plan.memory.cuda_graph_bytes``, docs/planner.md:
    one graph of the longest row; K rows in Megatron-Core's shared pool; separate pools, an upper bound).
    Goal: <= 5% padding at GBS 64 with K = 4.

VERL's ``verl/utils/seqlen_balancing.py`` is loaded by file path as ``bridge_thd_testbed.verl_support`` loads its
``util.py``: from the cached verl 0.9.1 wheel (``pip download --no-deps verl==0.9.1`` into
``~/.cache/bridge_thd/verl-0.9.1/wheel`` if absent; only that file is extracted; nothing is installed).
The three ``verl`` names it imports at module level (``verl.protocol.DataProto``,
``verl.utils.tensordict_utils``, ``verl.utils.device.get_device_name``) get stand-ins for the load:
``DataProto`` is only used by ``prepare_dynamic_batch`` (not called), ``get_device_name`` only under an
initialised process group (none here), and ``tensordict_utils.index_select_tensor_dict`` is given a
stand-in that selects the rows of a dict of tensors.

Writes ``benchmarks/results/global_batch_packing.{json,md,png}`` (``--quick``: a smoke run, 256
samples, GBS 64, one model, every table including (f); writes nothing unless ``--out`` is given).

Usage:
    .venv/bin/python benchmarks/global_batch_packing.py [--quick] [--out DIR] [--repeats N] [--no-verl] [--write-data] [--render]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import types
import warnings
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import cpu_name, markdown  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning)
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402

from megatron.bridge_thd.batching.policy import assign, in_batch_assignment, placement_stats  # noqa: E402
from megatron.bridge_thd.cost.sample import sample_cost  # noqa: E402
from megatron.bridge_thd.batching.sampler import micro_batch_slots, row_buckets_for_runs, row_lower_bound  # noqa: E402
from megatron.bridge_thd.cost.presets import get_preset  # noqa: E402
from megatron.bridge_thd.plan.estimate import PlanSettings  # noqa: E402
from megatron.bridge_thd.plan.layouts import Parallel  # noqa: E402
from megatron.bridge_thd.batching.sizes import SampleSizes  # noqa: E402
from megatron.bridge_thd.layouts import row_bucket, thd_slots  # noqa: E402
from megatron.bridge_thd.plan.balance import balance_plan, plan_steps, static_row_for_steps  # noqa: E402
from megatron.bridge_thd.cost.sample_lengths import SampleLengths, load_lengths  # noqa: E402
from megatron.bridge_thd.plan.samples import receipt_lengths  # noqa: E402
from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DATA_FILE = HERE / "data" / "global_batch_lengths.json"
MODELS = ("qwen3-vl-8b", "qwen3-vl-30b-a3b")
MICRO_BATCH_SIZE, DP, ALIGN, SEED = 4, 8, 1, 0
GLOBAL_BATCH_SIZES = (64, 512)
VERL_VERSION = "0.9.1"
VERL_FILE = "verl/utils/seqlen_balancing.py"
PADDING_GOAL, IMBALANCE_GOAL = 0.05, 1.03
ROW_BUCKETS = (1, 2, 4, 8)  # table (f); the runtime's default is 4
DEFAULT_K = 4
GIB = 2**30


# --------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------


def long_tailed(n: int = 4096, seq_length: int = 4096, seed: int = 19) -> SampleLengths:
    """Lognormal text (median 400, sigma 1.2), 0..6 images of (1, 12..40, 12..40) patches after an
    8-token prompt, every sample capped at ``seq_length`` tokens (module docstring)."""
    rng = random.Random(seed)
    tokens, grids, ends = [], [], []
    for _ in range(n):
        images = tuple((1, 2 * rng.randint(6, 20), 2 * rng.randint(6, 20)) for _ in range(rng.randint(0, 6)))
        image_tokens = sum(h * w // 4 for _, h, w in images)
        prompt = 8
        text = max(prompt + 1, round(rng.lognormvariate(math.log(400), 1.2)))
        text = min(text, seq_length - image_tokens)
        tokens.append(text + image_tokens)
        grids.append(images)
        ends.append(prompt + image_tokens if images else 0)
    return SampleLengths(tuple(tokens), tuple(grids), source=f"long-tailed (n={n}, seed={seed})", image_ends=tuple(ends))


def doc_chart_samples(n: int = 2048, seq_length: int = 2048, seed: int = 1919) -> list[dict]:
    """Document / chart samples in ``load_lengths`` JSON form (module docstring)."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        if rng.random() < 0.6:
            text = max(16, round(rng.lognormvariate(math.log(180), 0.8)))
            images = [[1, 2 * rng.randint(14, 24), 2 * rng.randint(10, 18)] for _ in range(rng.randint(1, 8))]
        else:
            text = max(16, round(rng.lognormvariate(math.log(120), 0.7)))
            images = [[1, 2 * rng.randint(12, 24), 2 * rng.randint(16, 28)] for _ in range(1 if rng.random() < 0.7 else 2)]
        text = min(text, seq_length // 2)
        # lower the resolution (the largest image's height, by 2 patches) until the sample fits seq_length
        while text + sum(h * w // 4 for _, h, w in images) > seq_length:
            largest = max(images, key=lambda g: g[1] * g[2])
            largest[1] -= 2
        samples.append({"text_tokens": text, "images": images})
    return samples


def write_data_file(path: Path = DATA_FILE) -> Path:
    """Write the doc / chart lengths file (one sample per line, deterministic)."""
    samples = doc_chart_samples()
    lines = ",\n".join("  " + json.dumps(s, separators=(", ", ": ")) for s in samples)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        '{"description": "benchmarks/global_batch_packing.py: 2048 document (60%, 1-8 page images) and chart (40%, '
        '1-2 images) samples, random.Random(1919), every sample <= 2048 tokens (Qwen3-VL merge 2)",\n'
        f' "samples": [\n{lines}\n]}}\n')
    return path


def distributions(quick: bool):
    """``[(name, SampleLengths, seq_length, description)]``."""
    n = 256 if quick else 4096
    if not DATA_FILE.is_file():
        write_data_file()
    file_samples = load_lengths(DATA_FILE, 2)
    if quick:
        file_samples = SampleLengths(file_samples.tokens[:n], file_samples.grids[:n], file_samples.source)
    return [
        ("receipts", receipt_lengths(n, 0), 2048, f"plan.samples.receipt_lengths({n}, 0): synthetic receipts, one image each"),
        ("long-tailed", long_tailed(n), 4096, "lognormal text (median 400, sigma 1.2) + 0..6 images of 36..400 "
         "tokens, capped at 4096 tokens, random.Random(19)"),
        ("doc-chart file", file_samples, 2048, f"{DATA_FILE.relative_to(HERE.parent)}: documents (1-8 pages) and "
         "charts (1-2 images), random.Random(1919)"),
    ]


def summary(samples: SampleLengths) -> dict:
    tokens = sorted(samples.tokens)
    images = [len(g) for g in samples.grids]
    return {"samples": len(tokens), "mean_tokens": sum(tokens) / len(tokens), "median_tokens": tokens[len(tokens) // 2],
            "p99_tokens": tokens[int(0.99 * (len(tokens) - 1))], "max_tokens": tokens[-1],
            "images_per_sample": [min(images), max(images)], "mean_images": sum(images) / len(images)}


# --------------------------------------------------------------------------------------------
# VERL 0.9.1's seqlen_balancing.py, by file path
# --------------------------------------------------------------------------------------------


def _verl_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridge_thd" / f"verl-{VERL_VERSION}"


def find_verl_balancing() -> tuple[Path | None, str]:
    """VERL's ``seqlen_balancing.py`` (extracted from the cached or downloaded wheel) and how it was found."""
    cached = _verl_cache() / "seqlen_balancing.py"
    if cached.is_file():
        return cached, "cache"
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin and (Path(spec.origin).parent / "utils" / "seqlen_balancing.py").is_file():
        return Path(spec.origin).parent / "utils" / "seqlen_balancing.py", "installed verl"
    wheels = _verl_cache() / "wheel"
    how = "cached wheel"
    if not list(wheels.glob("verl-*.whl")):
        how = "downloaded wheel"
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "10",
                            f"verl=={VERL_VERSION}", "-d", str(wheels)], check=True, timeout=120, capture_output=True)
        except (subprocess.SubprocessError, OSError) as error:
            return None, f"verl {VERL_VERSION} could not be downloaded ({type(error).__name__})"
    try:
        wheel = next(wheels.glob("verl-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            cached.write_bytes(archive.read(VERL_FILE))
    except (StopIteration, KeyError, OSError) as error:
        return None, f"{VERL_FILE} not found in the verl {VERL_VERSION} wheel ({type(error).__name__})"
    return cached, how


def load_verl_balancing(path: Path):
    """Execute VERL's file as a stand-alone module, its three ``verl`` imports stubbed for the load
    (module docstring); ``sys.modules`` restored afterwards."""
    from megatron.bridge_thd_testbed.verl_support import load_with_stand_ins

    def no_device():
        raise RuntimeError("stand-in: get_device_name is only called under an initialised process group")

    def index_select_tensor_dict(batch, index):
        return {k: v[torch.as_tensor(index, dtype=torch.long)] for k, v in batch.items()}

    tensordict_utils = {"index_select_tensor_dict": index_select_tensor_dict}
    return load_with_stand_ins(path, "verl_seqlen_balancing", {
        "verl": {}, "verl.protocol": {"DataProto": object},
        "verl.utils.tensordict_utils": tensordict_utils,
        "verl.utils": {"tensordict_utils": types.SimpleNamespace(**tensordict_utils)},
        "verl.utils.device": {"get_device_name": no_device}})


def verl_placement(verl, lengths: list[int], *, dp: int, max_token_len: int):
    """VERL's placement of one step: ``_balance_batch`` (Karmarkar-Karp, equal sizes, on
    ``calculate_workload``), then each rank's ``rearrange_micro_batches`` with every rank at the same
    micro-batch count (VERL all-reduces MAX of the count and MIN of "every micro-batch within the
    token cap"; here the same search runs the real partition function for every rank).

    Returns ``([rank][micro_batch] -> positions in the step, micro-batches per rank)``."""
    seqlens = torch.tensor(lengths, dtype=torch.int64)
    workload = verl.calculate_workload(seqlens).tolist()
    ranks = verl.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    # The DP all-reduces of rearrange_micro_batches, done once over all ranks.
    per_rank = [[lengths[i] for i in rank] for rank in ranks]
    count = max(min(len(p), verl.ceildiv(sum(p), max_token_len)) for p in per_rank)

    def fits(p, k):
        parts = verl.get_seqlen_balanced_partitions(verl.calculate_workload(torch.tensor(p)).tolist(), k, equal_size=False)
        return all(sum(p[i] for i in part) <= max_token_len for part in parts)

    while not all(fits(p, count) for p in per_rank):
        count += 1
    placement = []
    for rank, p in zip(ranks, per_rank):
        width = max(p)
        mask = torch.arange(width)[None, :] < torch.tensor(p)[:, None]
        batch = {"input_ids": torch.zeros(len(p), width, dtype=torch.long), "attention_mask": mask}
        _, micro = verl.rearrange_micro_batches(batch, max_token_len, min_num_micro_batch=count)
        placement.append([[rank[i] for i in part] for part in micro])
    return placement, count


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def _mean(values):
    return sum(values) / len(values)


def row_bucket_rows(steps, row: int, *, n_mb: int, cost, count: int) -> tuple[int, ...]:
    """Table (f)'s rows for ``count`` buckets, as the runtime chooses them (``batching.bridge.run_row_buckets``):
    ``(row,)`` for one; else ``micro_batch_slots`` of the steps' draws (``steps`` consecutive global batches)
    placed in ``row``, then ``row_buckets_for_runs``."""
    if count == 1:
        return (row,)
    gbs = DP * MICRO_BATCH_SIZE * n_mb
    draws = torch.arange(len(steps) * gbs, dtype=torch.int64).reshape(len(steps), gbs)
    sizes = SampleSizes(torch.tensor([n for s in steps for n in s.lengths], dtype=torch.int64),
                        torch.tensor([p for s in steps for p in s.patches], dtype=torch.int64),
                        torch.tensor([q for s in steps for q in s.patches_squared], dtype=torch.float64), "benchmark")
    run = micro_batch_slots(draws, sizes=sizes, dp_size=DP, num_micro_batches=n_mb, row_length=row,
                            align_to=ALIGN, cost=cost, seed=SEED)
    return row_buckets_for_runs([run], count=count, largest=row, align_to=ALIGN)


def measure(name, samples, seq_length, model, gbs, verl) -> dict:
    """Tables (a), (b), (c), (e) and (f) for one distribution, model and global batch size."""
    cost = sample_cost(model)
    text_only = cost.text_only()
    n_mb = gbs // (MICRO_BATCH_SIZE * DP)
    steps = plan_steps(samples, gbs, seq_length)
    capacity = MICRO_BATCH_SIZE * seq_length
    row = static_row_for_steps(steps, dp=DP, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=n_mb, align=ALIGN,
                               cost=cost, seed=SEED)
    real = sum(sum(s.lengths) for s in steps)
    rows_total = len(steps) * DP * n_mb
    # No fixed row can be shorter than this: the fullest step's tokens over its rows (or its longest sample).
    bound = row_lower_bound([torch.tensor(s.lengths) for s in steps], rows=DP * n_mb, align_to=ALIGN)
    ratios = {k: [] for k in ("in_batch", "assign_thd", "assign_static", "verl", "assign_text_only")}
    micro_ratios = {k: [] for k in ("in_batch", "assign_thd", "assign_static", "verl")}
    verl_counts, verl_max_tokens, static_placements = [], [], []
    for step in steps:
        lengths = list(step.lengths)
        patches, squared = list(step.patches), list(step.patches_squared)
        costs = cost(lengths, patches, squared)

        def place(row_length, c=cost):
            return assign(lengths, dp_size=DP, num_micro_batches=n_mb, row_length=row_length, vision_patches=patches,
                          vision_patches_squared=squared, align_to=ALIGN, seed=SEED, cost=c)

        placements = {"in_batch": in_batch_assignment(gbs, dp_size=DP, micro_batch_size=MICRO_BATCH_SIZE),
                      "assign_thd": place(capacity), "assign_static": place(row),
                      "assign_text_only": place(capacity, text_only)}
        if verl is not None:
            placements["verl"], count = verl_placement(verl, lengths, dp=DP, max_token_len=capacity)
            verl_counts.append(count)
            verl_max_tokens.append(max(sum(lengths[i] for i in mb) for rank in placements["verl"] for mb in rank))
        static_placements.append(placements["assign_static"])
        for key, placement in placements.items():
            stats = placement_stats(placement, lengths, costs=costs)
            ratios[key].append(stats.rank_imbalance)
            if key in micro_ratios:
                micro_ratios[key].append(stats.micro_batch_imbalance)
    parallel = Parallel(gpus=8, ep=8) if get_preset(model).is_moe else Parallel(gpus=8)
    plan_settings = PlanSettings(seq_length, MICRO_BATCH_SIZE, parallel, n_mb)
    bp = balance_plan(get_preset(model), samples, plan_settings, gbs, seed=SEED, row_buckets=1)
    static = bp.layouts["thd_static"]
    # the planner computes the same static row and padding (one rule, two callers)
    assert bp.static_row == row and abs(static["packed"].padding - (1 - real / (rows_total * row))) < 1e-12
    planner = {f"{layout}/{placement}": (None if e.refused else {"step_ms": e.step_s * 1e3, "samples_per_s": e.samples_per_s,
                                                                  "rank_time_imbalance": e.rank_time_imbalance})
               for layout, placements in bp.layouts.items() for placement, e in placements.items()}
    buckets = []
    for count in ROW_BUCKETS:
        rows = row_bucket_rows(steps, row, n_mb=n_mb, cost=cost, count=count)
        slots, use = 0, [0] * len(rows)
        for step, placement in zip(steps, static_placements):
            slots += placement_stats(placement, list(step.lengths), row_lengths=rows, align_to=ALIGN).slots
            for rank in placement:
                for micro_batch in rank:
                    use[row_bucket(rows, thd_slots([step.lengths[i] for i in micro_batch], ALIGN))] += 1
        plan_k = bp if count == 1 else balance_plan(get_preset(model), samples, plan_settings, gbs, seed=SEED,
                                                   row_buckets=count)
        packed = plan_k.layouts["thd_static"]["packed"]
        # the planner chooses the same rows and counts the same slots
        assert plan_k.static_rows == rows and abs(packed.padding - (1 - real / slots)) < 1e-12, (rows, plan_k.static_rows)
        graphs = plan_k.graph_memory
        buckets.append({
            "count": count, "rows": list(rows), "row_use": [n / sum(use) for n in use], "padding": 1 - real / slots,
            "planner_thd_static_step_ms": packed.step_s * 1e3, "planner_activation_peak_gib": packed.activation_peak / GIB,
            "graph_memory_gib": None if graphs is None else {
                "one_graph_longest_row": graphs.layers[-1] / GIB, "shared_pool": graphs.shared / GIB,
                "separate_pools": graphs.separate / GIB}})
    return {
        "distribution": name, "model": model, "seq_length": seq_length, "global_batch_size": gbs,
        "micro_batches_per_rank": n_mb, "steps": len(steps),
        "static_row": {"in_batch": capacity, "packed": row, "lower_bound": bound},
        "static_padding": {"in_batch": 1 - real / (rows_total * capacity), "packed": 1 - real / (rows_total * row),
                           "lower_bound": 1 - real / (rows_total * bound)},
        "rank_cost_imbalance": {k: ({"mean": _mean(v), "worst": max(v)} if v else None) for k, v in ratios.items()},
        "micro_batch_cost_imbalance": {k: ({"mean": _mean(v), "worst": max(v)} if v else None)
                                       for k, v in micro_ratios.items()},
        "verl_micro_batches_per_rank": (min(verl_counts), max(verl_counts)) if verl_counts else None,
        "verl_max_micro_batch_tokens": max(verl_max_tokens) if verl_max_tokens else None,
        "planner_8xh100": planner,
        "row_buckets": buckets,
    }


def time_assign(samples, seq_length, model, repeats: int, verl) -> dict:
    """Table (d): one global batch of all ``samples`` (4096 in the full run) on DP 8."""
    gbs = len(samples) // (MICRO_BATCH_SIZE * DP) * (MICRO_BATCH_SIZE * DP)
    n_mb = gbs // (MICRO_BATCH_SIZE * DP)
    step = plan_steps(samples, gbs, seq_length)[0]
    cost = sample_cost(model)
    row = static_row_for_steps([step], dp=DP, micro_batch_size=MICRO_BATCH_SIZE, num_micro_batches=n_mb, align=ALIGN,
                               cost=cost, seed=SEED)
    lengths = torch.tensor(step.lengths, dtype=torch.int64)
    patches = torch.tensor(step.patches, dtype=torch.int64)
    squared = torch.tensor(step.patches_squared, dtype=torch.float64)

    def median_ms(fn):
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def run(row_length):
        return lambda: assign(lengths, dp_size=DP, num_micro_batches=n_mb, row_length=row_length,
                              vision_patches=patches, vision_patches_squared=squared, align_to=ALIGN, seed=SEED,
                              cost=cost)

    out = {"samples": gbs, "micro_batches_per_rank": n_mb, "repeats": repeats, "load_average_1min": os.getloadavg()[0],
           "assign_thd_ms": median_ms(run(MICRO_BATCH_SIZE * seq_length)), "static_row": row,
           "assign_static_ms": median_ms(run(row))}
    if verl is not None:
        workload = verl.calculate_workload(lengths).tolist()
        out["verl_kk_ms"] = median_ms(lambda: verl.get_seqlen_balanced_partitions(workload, DP, equal_size=True))
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------

_MODEL_NAMES = {"qwen3-vl-8b": "Qwen3-VL 8B", "qwen3-vl-30b-a3b": "Qwen3-VL 30B-A3B"}


def _pct(x):
    return f"{100 * x:.1f}%"


def render(results: dict) -> str:
    """The Markdown report from the results JSON."""
    p = results["parameters"]
    rows = results["rows"]
    out = [
        "# Global-batch packing vs in-batch placement and VERL's balancer",
        "",
        f"`benchmarks/global_batch_packing.py`{' --quick' if p['quick'] else ''}: MBS {p['micro_batch_size']}, "
        f"DP {p['dp']}, THD alignment {p['align']}, steps = consecutive global batches; cost per sample = "
        "`batching.sample_cost(model)` (Megatron-Bridge's FLOPs terms). CPU only, no model. "
        f"VERL: {results['verl']['status']}.",
        "",
        "Distributions:",
        "",
    ]
    for name, d in results["distributions"].items():
        out.append(f"- **{name}** (seq_length {d['seq_length']}): {d['description']}; {d['samples']} samples, mean "
                   f"{d['mean_tokens']:.0f} / median {d['median_tokens']} / p99 {d['p99_tokens']} / max {d['max_tokens']} "
                   f"tokens, {d['images_per_sample'][0]}-{d['images_per_sample'][1]} images per sample "
                   f"(mean {d['mean_images']:.2f})")
    out += ["", f"## (a) `thd_static` static-row padding (goal <= {PADDING_GOAL:.0%})", ""]
    out.append(markdown(
        ["distribution", "model", "GBS", "steps", "row in-batch", "padding in-batch", "row packed", "padding packed",
         "fixed-row floor: row", "floor: padding"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]), str(r["steps"]),
          f"{r['static_row']['in_batch']:,}", _pct(r["static_padding"]["in_batch"]), f"{r['static_row']['packed']:,}",
          _pct(r["static_padding"]["packed"]) + ("" if r["static_padding"]["packed"] <= PADDING_GOAL else " (over)"),
          f"{r['static_row']['lower_bound']:,}", _pct(r["static_padding"]["lower_bound"])]
         for r in rows]))
    out += ["", "Floor: the padding of the shortest row any placement could use for the whole run, "
            "max over steps of max(longest sample, ceil(step tokens / rows)): the row is fixed for the run and every "
            "rank runs the same number of micro-batches, so the step-to-step spread of tokens is padding for every "
            "step but the fullest one. `choose_row_length` starts there and grows by ~0.5% until every step fits."]
    out += ["", f"## (b) Per-rank cost max/mean, mean over steps (worst step) (goal <= {IMBALANCE_GOAL})", ""]

    def ratio(r, key, field="rank_cost_imbalance"):
        v = r[field][key]
        return "—" if v is None else f"{v['mean']:.3f} ({v['worst']:.3f})"

    out.append(markdown(
        ["distribution", "model", "GBS", "in-batch", "assign (thd row)", "assign (static row)", "VERL KK + rearrange",
         "VERL µb/rank"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]), ratio(r, "in_batch"),
          ratio(r, "assign_thd"), ratio(r, "assign_static"), ratio(r, "verl"),
          "—" if r["verl_micro_batches_per_rank"] is None else
          "-".join(str(x) for x in sorted(set(r["verl_micro_batches_per_rank"])))]
         for r in rows]))
    out += ["", "Per-micro-batch cost max/mean (all ranks), mean over steps (worst step); VERL's micro-batches are "
            "fewer and larger (token cap = MBS x seq_length), so its figure is over a different count:", ""]
    out.append(markdown(
        ["distribution", "model", "GBS", "in-batch", "assign (thd row)", "assign (static row)", "VERL"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]),
          ratio(r, "in_batch", "micro_batch_cost_imbalance"), ratio(r, "assign_thd", "micro_batch_cost_imbalance"),
          ratio(r, "assign_static", "micro_batch_cost_imbalance"), ratio(r, "verl", "micro_batch_cost_imbalance")]
         for r in rows]))
    out += ["", "## (c) Vision-aware vs text-only balancing (both measured with the full cost; per-rank max/mean)", ""]
    out.append(markdown(
        ["distribution", "model", "GBS", "in-batch", "assign, full cost", "assign, text-only cost"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]), ratio(r, "in_batch"),
          ratio(r, "assign_thd"), ratio(r, "assign_text_only")] for r in rows]))
    t = results["timing"]
    out += ["", f"## (d) Wall time of one global batch's placement ({t['cpu']})", ""]
    out.append(markdown(
        ["distribution", "model", "samples", "µb/rank", "assign, thd row (ms)", "assign, static row (ms)",
         "VERL KK, DP only (ms)", "repeats"],
        [[d["distribution"], _MODEL_NAMES[d["model"]], str(d["samples"]), str(d["micro_batches_per_rank"]),
          f"{d['assign_thd_ms']:.1f}", f"{d['assign_static_ms']:.1f}",
          "—" if "verl_kk_ms" not in d else f"{d['verl_kk_ms']:.1f}", str(d["repeats"])] for d in t["runs"]]))
    loads = ", ".join(f"{d['load_average_1min']:.1f}" for d in t["runs"] if "load_average_1min" in d)
    out += ["", "Median of the repeats after one warm-up call; wall time of one process on this CPU"
            + (f" (1-minute load average when timed: {loads}; other processes shared the machine)" if loads else "")
            + ".", "",
            "## (e) The planner's step time, 8 x H100 SXM (the time model, a model's figures; slowest DP rank, mean over steps)", "",
            "8B: TP1 DP8; 30B-A3B: EP8 DP8 (bshd forced to seq_length). ms per step; bshd has no packed figure "
            "(configure refuses global-batch packing with it).", ""]

    def ms(r, key):
        v = r["planner_8xh100"][key]
        return "—" if v is None else f"{v['step_ms']:.0f}"

    out.append(markdown(
        ["distribution", "model", "GBS", "bshd", "thd", "thd packed", "thd_static", "thd_static packed",
         "thd_static speed-up"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]), ms(r, "bshd/in-batch"),
          ms(r, "thd/in-batch"), ms(r, "thd/packed"), ms(r, "thd_static/in-batch"), ms(r, "thd_static/packed"),
          f"{r['planner_8xh100']['thd_static/in-batch']['step_ms'] / r['planner_8xh100']['thd_static/packed']['step_ms']:.2f}x"]
         for r in rows]))
    out += ["", "thd_static packed here: one row (row_buckets 1), as in (a); with K rows: (f).", ""]
    out += render_row_buckets(results)
    return "\n".join(out) + "\n"


def _bucket(r, count):
    return next((b for b in r.get("row_buckets", []) if b["count"] == count), None)


def render_row_buckets(results: dict) -> list[str]:
    """Table (f): thd_static padding with K static rows, the rows and the planner's CUDA-graph memory."""
    rows = [r for r in results["rows"] if r.get("row_buckets")]
    if not rows:
        return []
    counts = [b["count"] for b in rows[0]["row_buckets"]]
    small = min(r["global_batch_size"] for r in rows)
    out = [f"## (f) `thd_static` padding with K static rows (`row_buckets`; goal <= {PADDING_GOAL:.0%} at GBS {small} "
           f"with the default K = {DEFAULT_K})", "",
           "Rows chosen as the runtime chooses them: the longest is (a)'s row (`row_length_for_steps`); the others "
           "from the aligned slots of every micro-batch `assign` forms in it over the same steps "
           "(`micro_batch_slots`) by the exact least-padding programme (`optimal_row_lengths`, count K). Each "
           "micro-batch takes the shortest row that holds it (padding = 1 - real tokens / those rows' slots, over "
           "all steps). The placement is the longest row's for every K, so the per-rank cost max/mean is (b)'s "
           "`assign (static row)` for every K.", ""]

    def goal(r):
        b = _bucket(r, DEFAULT_K)
        if b is None:
            return "—"
        return ("met" if b["padding"] <= PADDING_GOAL else "missed") if r["global_batch_size"] == small else \
            ("yes" if b["padding"] <= PADDING_GOAL else "no")

    def imbalance(r):
        v = r["rank_cost_imbalance"]["assign_static"]
        return f"{v['mean']:.3f} ({v['worst']:.3f})" + ("" if v["worst"] <= IMBALANCE_GOAL else " (over 1.03)")

    out.append(markdown(
        ["distribution", "model", "GBS", *(f"padding K={k}" for k in counts), f"<= {PADDING_GOAL:.0%} at K={DEFAULT_K}",
         "rank cost max/mean, mean (worst step)"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]),
          *(_pct(_bucket(r, k)["padding"]) for k in counts), goal(r), imbalance(r)] for r in rows]))
    out += ["", "The rows per K (share of the micro-batches taking each), the planner's thd_static step time "
            "(8 x H100, as (e)) and its model of the rows as CUDA graphs of the decoder layers (Megatron-Core's local "
            "manager, PP=1; a model, not measured: docs/planner.md). GiB/GPU: one graph of the longest row (what "
            "K = 1 captures); the K rows' graphs in one shared pool (Megatron-Core's global mempool: the longest row's "
            "activations + the shorter rows' static buffers); separate pools (upper bound: every row's activations). "
            "Today the runtime captures graphs of one row only (row_buckets 1).", ""]

    def gib(b, key):
        g = b["graph_memory_gib"]
        return "—" if g is None else f"{g[key]:.1f}"

    out.append(markdown(
        ["distribution", "model", "GBS", "K", "rows (slots; share of micro-batches)", "padding", "thd_static ms/step",
         "graph GiB: longest row", "K rows, shared pool", "K rows, separate pools"],
        [[r["distribution"], _MODEL_NAMES[r["model"]], str(r["global_batch_size"]), str(b["count"]),
          ", ".join(f"{row:,} ({u:.0%})" for row, u in zip(b["rows"], b["row_use"])), _pct(b["padding"]),
          f"{b['planner_thd_static_step_ms']:.0f}", gib(b, "one_graph_longest_row"), gib(b, "shared_pool"),
          gib(b, "separate_pools")]
         for r in rows for b in r["row_buckets"]]))
    met = [f"{r['distribution']} ({_MODEL_NAMES[r['model']]})" for r in rows
           if r["global_batch_size"] == small and _bucket(r, DEFAULT_K) and _bucket(r, DEFAULT_K)["padding"] <= PADDING_GOAL]
    missed = [f"{r['distribution']} ({_MODEL_NAMES[r['model']]}, {_pct(_bucket(r, DEFAULT_K)['padding'])})" for r in rows
              if r["global_batch_size"] == small and _bucket(r, DEFAULT_K)
              and _bucket(r, DEFAULT_K)["padding"] > PADDING_GOAL]
    over = [f"{r['distribution']} ({_MODEL_NAMES[r['model']]}, GBS {r['global_batch_size']})" for r in rows
            if r["rank_cost_imbalance"]["assign_static"]["worst"] > IMBALANCE_GOAL]
    out += ["", f"Goal (<= {PADDING_GOAL:.0%} padding at GBS {small}, K = {DEFAULT_K}): met for "
            f"{'; '.join(met) or 'none'}; missed for {'; '.join(missed) or 'none'}. Per-rank cost max/mean <= "
            f"{IMBALANCE_GOAL} in every step: {'yes' if not over else 'no, over for ' + '; '.join(over)}."]
    return out


def headline(results: dict) -> str:
    """The short table for README.md and docs/batching.md (rendered by scripts/readme_figures.py):
    Qwen3-VL 8B, per distribution and global batch size: thd_static padding, per-rank cost max/mean
    (in-batch, VERL, assign, assign text-only) and the planner's 8 x H100 thd_static / thd step times."""
    rows = []
    for r in results["rows"]:
        if r["model"] != "qwen3-vl-8b":
            continue
        rank, planner = r["rank_cost_imbalance"], r["planner_8xh100"]

        def mean(key):
            return "—" if rank[key] is None else f"{rank[key]['mean']:.3f}"

        def step(layout):
            before, after = planner[f"{layout}/in-batch"], planner[f"{layout}/packed"]
            return f"{before['step_ms']:.0f} → {after['step_ms']:.0f}"

        four = next(b for b in r["row_buckets"] if b["count"] == DEFAULT_ROW_BUCKETS)
        rows.append([r["distribution"], str(r["global_batch_size"]),
                     f"{_pct(r['static_padding']['in_batch'])} → {_pct(r['static_padding']['packed'])} → "
                     f"{_pct(four['padding'])}",
                     mean("in_batch"), mean("verl"), mean("assign_thd"), mean("assign_text_only"),
                     step("thd_static"), step("thd")])
    return markdown(["distribution", "GBS", f"thd_static padding: in-batch → 1 row → {DEFAULT_ROW_BUCKETS} rows",
                     "rank cost max/mean: in-batch", "VERL KK", "assign", "assign text-only",
                     "8xH100 thd_static ms/step (1 row)", "8xH100 thd ms/step"], rows)


def headline_notes(results: dict) -> str:
    """The bullets under the headline table, every number from the results (both models)."""
    rows = results["rows"]

    def span(values, fmt):
        return f"{fmt(min(values))}-{fmt(max(values))}"

    def pct(x):
        return f"{100 * x:.1f}%"

    by_gbs = {}
    for r in rows:
        by_gbs.setdefault(r["global_batch_size"], []).append(r)
    gbs_small, gbs_large = min(by_gbs), max(by_gbs)
    padding = {g: [r["static_padding"]["packed"] for r in rs] for g, rs in by_gbs.items()}
    floor = {g: [r["static_padding"]["lower_bound"] for r in rs] for g, rs in by_gbs.items()}
    buckets = {g: [next(b["padding"] for b in r["row_buckets"] if b["count"] == DEFAULT_ROW_BUCKETS) for r in rs]
               for g, rs in by_gbs.items()}
    cases = sorted({(r["distribution"], r["global_batch_size"]) for r in rows})
    meets = {case: all(r["static_padding"]["packed"] <= PADDING_GOAL for r in rows
                       if (r["distribution"], r["global_batch_size"]) == case) for case in cases}
    met = [f"{d} at GBS {g}" for (d, g), ok in meets.items() if ok]
    missed = [f"{d} at GBS {g}" for (d, g), ok in meets.items() if not ok]
    rank = {key: [r["rank_cost_imbalance"][key]["mean"] for r in rows if r["rank_cost_imbalance"][key]]
            for key in ("in_batch", "assign_thd", "assign_static", "verl", "assign_text_only")}
    worst = max(r["rank_cost_imbalance"][k]["worst"] for r in rows for k in ("assign_thd", "assign_static"))
    three = lambda x: f"{x:.3f}"  # noqa: E731
    return "\n".join([
        f"* **Static-row padding** falls from {span([r['static_padding']['in_batch'] for r in rows], pct)} "
        f"(Megatron-Bridge's placement) to {span(padding[gbs_large], pct)} at a global batch of {gbs_large} and "
        f"{span(padding[gbs_small], pct)} at {gbs_small}. The row is fixed for the run and every rank runs the same "
        "number of micro-batches, so the spread of tokens from step to step is padding in every step but the "
        f"fullest: the shortest row any placement could use pads {span(floor[gbs_small], pct)} at GBS {gbs_small} "
        f"and {span(floor[gbs_large], pct)} at {gbs_large}. The {PADDING_GOAL:.0%} goal is met for "
        f"{'; '.join(met) or 'no case'} (both models); missed for {'; '.join(missed) or 'none'}.",
        f"* **{DEFAULT_ROW_BUCKETS} static rows** (`row_buckets`, the default): each micro-batch takes the shortest "
        f"of {DEFAULT_ROW_BUCKETS} rows chosen from the same draws, so padding falls to "
        f"{span(buckets[gbs_small], pct)} at GBS {gbs_small} and {span(buckets[gbs_large], pct)} at {gbs_large}, "
        f"below the shortest one row (the placement, and so the per-rank cost, is the one-row placement's; "
        "K = 1, 2, 4, 8 in table (f) of the results).",
        f"* **Per-rank cost max/mean** (mean over steps): {span(rank['assign_thd'] + rank['assign_static'], three)} "
        f"with `assign`, against {span(rank['in_batch'], three)} for Megatron-Bridge's placement and "
        f"{span(rank['verl'], three)} for VERL's Karmarkar-Karp on `24576 s + s^2` (verl 0.9.1's own functions). "
        f"The worst single step with `assign`: {worst:.3f}.",
        f"* **Vision-aware vs text-only**: the same placement balanced on the language model's cost alone gives "
        f"{span(rank['assign_text_only'], three)}, measured with the full cost.",
    ])


def write_plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return None
    rows = results["rows"]
    gbs_values = sorted({r["global_batch_size"] for r in rows})
    buckets = all(r.get("row_buckets") for r in rows)
    fig, axes = plt.subplots(len(gbs_values), 3 if buckets else 2, figsize=(22 if buckets else 15, 4.2 * len(gbs_values)),
                             squeeze=False)
    methods = [("in_batch", "in-batch", "tab:gray"), ("verl", "VERL KK", "tab:orange"),
               ("assign_text_only", "assign, text-only cost", "tab:olive"), ("assign_thd", "assign (thd row)", "tab:green"),
               ("assign_static", "assign (static row)", "tab:blue")]
    for line, gbs in enumerate(gbs_values):
        group = [r for r in rows if r["global_batch_size"] == gbs]
        labels = [f"{r['distribution']}\n{_MODEL_NAMES[r['model']]}" for r in group]
        ax = axes[line][0]
        width = 0.8 / len(methods)
        for k, (key, name, color) in enumerate(methods):
            values = [r["rank_cost_imbalance"][key]["mean"] if r["rank_cost_imbalance"][key] else 0 for r in group]
            ax.bar([i + (k - len(methods) / 2 + 0.5) * width for i in range(len(group))], values, width, label=name,
                   color=color)
        ax.axhline(IMBALANCE_GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {IMBALANCE_GOAL}")
        ax.set_ylim(0.98, max(1.1, max(r["rank_cost_imbalance"]["in_batch"]["mean"] for r in group) * 1.03))
        ax.set_xticks(range(len(group)), labels, fontsize=7)
        ax.set(title=f"per-rank cost max/mean (mean over steps), GBS {gbs}", ylabel="max / mean")
        ax.legend(fontsize=7, ncol=2)
        ax = axes[line][1]
        for k, (key, name, color) in enumerate((("in_batch", "in-batch (MBS x seq_length)", "tab:gray"),
                                                ("packed", "global-batch packing (row from data)", "tab:blue"))):
            values = [100 * r["static_padding"][key] for r in group]
            xs = [i + (k - 0.5) * 0.4 for i in range(len(group))]
            ax.bar(xs, values, 0.4, label=name, color=color)
            for x, v in zip(xs, values):
                ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
        floors = [100 * r["static_padding"]["lower_bound"] for r in group]
        ax.hlines(floors, [i + 0.0 for i in range(len(group))], [i + 0.4 for i in range(len(group))], colors="black",
                  linewidth=2, label="fixed-row floor")
        ax.axhline(100 * PADDING_GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {PADDING_GOAL:.0%}")
        ax.set_xticks(range(len(group)), labels, fontsize=7)
        ax.set(title=f"thd_static static-row padding (%), GBS {gbs}", ylabel="% of slots")
        ax.legend(fontsize=7)
        if buckets:
            ax = axes[line][2]
            counts = [b["count"] for b in group[0]["row_buckets"]]
            width = 0.8 / len(counts)
            colors = ["tab:blue", "tab:cyan", "tab:green", "tab:olive", "tab:purple"]
            for k, count in enumerate(counts):
                values = [100 * _bucket(r, count)["padding"] for r in group]
                xs = [i + (k - len(counts) / 2 + 0.5) * width for i in range(len(group))]
                ax.bar(xs, values, width, label=f"K = {count}" + (" (default)" if count == DEFAULT_K else ""),
                       color=colors[k % len(colors)])
                for x, v in zip(xs, values):
                    ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=5)
            ax.axhline(100 * PADDING_GOAL, color="tab:red", linestyle="--", linewidth=1, label=f"goal {PADDING_GOAL:.0%}")
            ax.set_xticks(range(len(group)), labels, fontsize=7)
            ax.set(title=f"thd_static padding (%) with K static rows, GBS {gbs}", ylabel="% of slots")
            ax.legend(fontsize=7)
    fig.suptitle(f"Global-batch packing: MBS {MICRO_BATCH_SIZE}, DP {DP}; benchmarks/global_batch_packing.py")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 256 samples, GBS 64, one model, 1 repeat; "
                        "writes nothing unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help="directory for global_batch_packing.{json,md,png} "
                        "(default benchmarks/results; none with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 7; --quick 1)")
    parser.add_argument("--write-data", action="store_true", help="rewrite benchmarks/data/global_batch_lengths.json")
    parser.add_argument("--no-verl", action="store_true", help="leave VERL's balancer out (no cache look-up, no download)")
    parser.add_argument("--render", action="store_true", help="only re-render the .md and .png from the results JSON")
    args = parser.parse_args(argv)
    if args.render:
        out = args.out or RESULTS
        results = json.loads((out / "global_batch_packing.json").read_text())
        (out / "global_batch_packing.md").write_text(render(results))
        write_plot(results, out / "global_batch_packing.png")
        print(render(results))
        return 0
    if args.write_data or not DATA_FILE.is_file():
        print(f"wrote {write_data_file()}", file=sys.stderr)
    repeats = args.repeats or (1 if args.quick else 7)
    models = MODELS[:1] if args.quick else MODELS
    gbs_values = GLOBAL_BATCH_SIZES[:1] if args.quick else GLOBAL_BATCH_SIZES
    path, how = (None, "left out (--no-verl)") if args.no_verl else find_verl_balancing()
    verl, status = None, how
    if path is not None:
        try:
            verl = load_verl_balancing(path)
            status = (f"verl {VERL_VERSION}'s own {VERL_FILE} ({how}), loaded by file path with stand-ins for "
                      "verl.protocol.DataProto, verl.utils.tensordict_utils and verl.utils.device")
        except Exception as error:  # noqa: BLE001 - report, run without VERL
            status = f"{VERL_FILE} did not load ({type(error).__name__}: {error})"
    print(f"VERL: {status}", file=sys.stderr)
    dists = distributions(args.quick)
    results = {
        "parameters": {"micro_batch_size": MICRO_BATCH_SIZE, "dp": DP, "align": ALIGN, "seed": SEED,
                       "global_batch_sizes": list(gbs_values), "models": list(models), "quick": args.quick,
                       "padding_goal": PADDING_GOAL, "imbalance_goal": IMBALANCE_GOAL,
                       "verl_max_token_len": "micro_batch_size * seq_length",
                       "planner": "plan.balance.balance_plan, h100-sxm, the time model (fitted parameters); 8B TP1 DP8, 30B-A3B EP8 DP8"},
        "verl": {"version": VERL_VERSION, "file": VERL_FILE, "status": status},
        "distributions": {}, "rows": [], "timing": {"cpu": cpu_name(), "runs": []},
    }
    for name, samples, seq_length, description in dists:
        results["distributions"][name] = {"seq_length": seq_length, "description": description, **summary(samples)}
        for model in models:
            for gbs in gbs_values:
                start = time.perf_counter()
                results["rows"].append(measure(name, samples, seq_length, model, gbs, verl))
                print(f"{name} {model} GBS {gbs}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    for name, samples, seq_length, _ in dists:
        if len(samples) >= (256 if args.quick else 4096):
            run = time_assign(samples, seq_length, models[0], repeats, verl)
            results["timing"]["runs"].append({"distribution": name, "model": models[0], **run})
    report = render(results)
    print(report)
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "global_batch_packing.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "global_batch_packing.md").write_text(report)
        png = write_plot(results, out / "global_batch_packing.png")
        print(f"wrote {out / 'global_batch_packing.json'}, .md{', .png' if png else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
