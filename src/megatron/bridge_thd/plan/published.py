"""Published GPU measurements the time model is judged on, each reproduced from its stated setup (docs/time-model.md).

A :class:`PublishedTable` holds a source's figures as published and reproduces them with the time model
(:mod:`megatron.bridge_thd.cost.step_time`) from what the source states: the model, the GPUs, the parallel
layout, the length distribution, the schedulers. What a source leaves unstated and a reproduction must still fix is
an *assumption*, listed with the table. Tables have a *role*: ``fit`` tables are the only ones the fitted parameters
are fitted on (:mod:`.fit`); ``held out`` tables are predicted from those parameters and judged against the bar
(speed-up ratios within 15%, absolute step times within 25% where the GPU is named).

Registry: :data:`TABLES` (key -> table), read with :func:`get_table`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from megatron.bridge_thd.batching.cp_per_sample import place_with_cp_per_sample
from megatron.bridge_thd.cost.step_time import (
    Link, Machine, SampleWork, TimeParameters, get_machine, model_shape, row_time, sample_work)
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.plan.peak_memory import peak_memory_bytes
from megatron.bridge_thd.plan.samples import receipt_lengths
from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec, get_preset, replace
from megatron.bridge_thd.plan.step_model import sync_seconds

__all__ = ["Figure", "PublishedTable", "TABLES", "get_table", "RATIO_BAR", "TIME_BAR", "dp_balanced_packs",
           "lognormal_lengths", "cord_v2_lengths", "pr3838_memory", "PlacedRow", "static_cp_rows", "balanced_cp_rows",
           "rows_seconds", "SENSITIVITY", "reproduce_with"]

RATIO_BAR = 0.15  # a held-out speed-up ratio within 15% of the published one
TIME_BAR = 0.25  # a held-out absolute step time within 25% where the GPU is named


@dataclass(frozen=True)
class Figure:
    """One published figure beside its prediction: ``unit`` is ``"ms"`` (a step time) or ``"x"`` (a ratio);
    ``absolute``: an absolute time on a named GPU (judged by :data:`TIME_BAR`), else a ratio (:data:`RATIO_BAR`) or
    a time on an unnamed GPU (reported, not judged)."""

    label: str
    published: float
    predicted: float
    unit: str
    judged: bool = True

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    @property
    def bar(self) -> float:
        return TIME_BAR if self.unit == "ms" else RATIO_BAR

    @property
    def within_bar(self) -> bool:
        return abs(self.error) <= self.bar


@dataclass(frozen=True)
class PublishedTable:
    """A source's table: ``title``, ``source`` (where it is published), ``setup`` (what it states), ``assumptions``
    (what the reproduction fixes that it does not), ``role`` (``"fit"`` or ``"held out"``) and ``reproduce``
    (time parameters -> :class:`Figure` s)."""

    key: str
    title: str
    source: str
    setup: str
    assumptions: tuple[str, ...]
    role: str
    reproduce: Callable[[TimeParameters], list[Figure]] = field(compare=False, repr=False)


def lognormal_lengths(count: int, *, mean: float, sigma: float, low: int, high: int, seed: int = 0) -> list[int]:
    """Megatron-LM's mock variable-length generator (``megatron/training/datasets/sft_dataset.py``,
    ``MockSFTLowLevelDataset``: ``np.random.seed(seed)``, ``mu = log(mean) - sigma^2 / 2``, lognormal, clipped to
    ``[low, high]``, cast to int), its first ``count`` lengths."""
    np.random.seed(seed)
    mu = math.log(mean) - sigma ** 2 / 2
    return np.clip(np.random.lognormal(mu, sigma, size=count), low, high).astype(int).tolist()


def dp_balanced_packs(lengths: Sequence[int], *, capacity: int, dp: int) -> list[list[list[int]]]:
    """Megatron-Core's ``DpBalancedScheduler.get_groups_and_subsamples`` (``megatron/core/datasets/data_schedule.py``):
    the global batch packed in its order into packs of at most ``capacity`` tokens, singletons split off the last
    packs until the count is a multiple of ``dp``, micro-batch ``i`` giving pack ``i * dp + r`` to DP rank ``r``.

    Returns:
        ``[rank][micro_batch] -> positions in lengths``.
    """
    packs, current, total = [], [], 0
    for i, n in enumerate(lengths):
        if total + n <= capacity:
            current.append(i)
            total += n
        else:
            packs.append(current)
            current, total = [i], n
    if current:
        packs.append(current)
    if len(packs) % dp:
        missing, i = dp - len(packs) % dp, len(packs) - 1
        while missing:
            if len(packs[i]) > 1:
                packs.append([packs[i].pop()])
                missing -= 1
            else:
                i -= 1
    return [[packs[m * dp + r] for m in range(len(packs) // dp)] for r in range(dp)]


@dataclass(frozen=True)
class PlacedRow:
    """One row of a step as a scheduler placed it: its ``works``, ``cp`` size, ``group`` (rows of a group run
    between two barriers) and ``ranks`` (positions in the DP x CP world)."""

    works: tuple[SampleWork, ...]
    cp: int
    group: int
    ranks: tuple[int, ...]


def static_cp_rows(works: Sequence[SampleWork], *, cp: int, dp: int, capacity: int) -> list[PlacedRow]:
    """Static CP ``cp`` with Megatron-Core's dp_balanced packing (:func:`dp_balanced_packs`): DP rank ``r``'s packs
    on ranks ``r * cp ... r * cp + cp - 1``, one group (no barrier until the step ends)."""
    placed = dp_balanced_packs([w.tokens for w in works], capacity=capacity, dp=dp)
    return [PlacedRow(tuple(works[i] for i in pack), cp, 0, tuple(range(r * cp, (r + 1) * cp)))
            for r, rank in enumerate(placed) for pack in rank]


def balanced_cp_rows(works: Sequence[SampleWork], *, world: int, max_tokens_per_rank: int) -> list[PlacedRow]:
    """CP per sample placed by Megatron-Core's ``BalancedCPScheduler``
    (:func:`megatron.bridge_thd.batching.cp_per_sample.place_with_cp_per_sample`), its groups behind barriers."""
    placement = place_with_cp_per_sample([w.tokens for w in works], world=world,
                                         max_tokens_per_rank=max_tokens_per_rank)
    return [PlacedRow(tuple(works[i] for i in row.samples), row.cp_size, row.group, row.ranks)
            for row in placement.rows]


def rows_seconds(shape, rows: Sequence[PlacedRow], machine: Machine, params: TimeParameters, *, world: int,
                 tp: int = 1, ep: int = 1) -> float:
    """A step's forward-backward seconds for placed rows: per group the slowest rank's rows back to back, the groups
    one after another."""
    groups = 1 + max(row.group for row in rows)
    busy = [[0.0] * world for _ in range(groups)]
    for row in rows:
        seconds = row_time(shape, row.works, machine, params, cp=row.cp, tp=tp, ep=ep,
                           align=2 * row.cp if row.cp > 1 else 1).total
        for rank in row.ranks:
            busy[row.group][rank] += seconds
    return sum(max(group) for group in busy)


# -- Megatron-LM's dynamic-CP benchmark example (fit) -------------------------------------------------------------

_DCP_MEASURED = {  # GPUs: (baseline static CP4 ms, dynamic CP ms), 10% trimmed means of iterations 11-30
    4: (195.269, 151.906), 8: (220.119, 155.850), 16: (226.775, 187.125), 32: (286.206, 208.088),
    64: (271.988, 181.912)}
_GPT_12L = ModelSpec(name="gpt-12l-2048 (Megatron-LM dynamic-CP example)", hf_repo="benchmark_dcp.sh", num_layers=12,
                     hidden_size=2048, num_attention_heads=16, num_query_groups=16, kv_channels=128,
                     ffn_hidden_size=5461, vocab_size=131072,
                     vision=VisionSpec(depth=0, hidden_size=16, num_heads=1, intermediate_size=16, out_hidden_size=2048))
# The GPU the source does not name: four GPUs per node and a NeMo 26.02 container read as a GB200 NVL72 rack (one
# NVLink domain across its trays), with B200's dense bf16 peak, HBM and NVLink 5 figures (assumption 1 of the table).
_FIT_MACHINE = Machine("GB200 NVL72 (assumed)", 2250e12, 8.0e12, 186e9, Link(740e9, 10e-6), Link(740e9, 10e-6),
                       gpus_per_node=72)


@lru_cache(maxsize=None)
def _megatron_dcp_steps(gpus: int) -> tuple[tuple[list[PlacedRow], list[PlacedRow]], ...]:
    """Iterations 11-30 of the example at ``gpus`` GPUs: per step, the static CP4 rows and the CP-per-sample rows."""
    dp = gpus // 4
    gbs = 8 * dp
    lengths = lognormal_lengths(30 * gbs, mean=1024, sigma=1.5, low=128, high=8192)
    steps = []
    for step in range(10, 30):
        works = [sample_work(n) for n in lengths[step * gbs:(step + 1) * gbs]]
        steps.append((static_cp_rows(works, cp=4, dp=dp, capacity=4 * 2048),
                      balanced_cp_rows(works, world=gpus, max_tokens_per_rank=2048)))
    return tuple(steps)


def _megatron_dcp(params: TimeParameters) -> list[Figure]:
    shape = model_shape(_GPT_12L)
    figures = []
    for gpus, (published_static, published_dynamic) in _DCP_MEASURED.items():
        fixed = sync_seconds(_GPT_12L, Parallel(cp=4, gpus=gpus), _FIT_MACHINE) + params.per_step_s
        static, dynamic = [], []
        for static_rows, dynamic_rows in _megatron_dcp_steps(gpus):
            static.append(rows_seconds(shape, static_rows, _FIT_MACHINE, params, world=gpus) + fixed)
            dynamic.append(rows_seconds(shape, dynamic_rows, _FIT_MACHINE, params, world=gpus) + fixed)
        static_ms, dynamic_ms = (1e3 * sum(t) / len(t) for t in (static, dynamic))
        figures += [Figure(f"{gpus} GPUs, static CP4 (dp_balanced)", published_static, static_ms, "ms", judged=False),
                    Figure(f"{gpus} GPUs, dynamic CP", published_dynamic, dynamic_ms, "ms", judged=False),
                    Figure(f"{gpus} GPUs, speed-up", published_static / published_dynamic, static_ms / dynamic_ms, "x")]
    return figures


# -- Megatron-Bridge PR 3838: packing against padding on Qwen3.5-VL 2B (held out) -------------------------------

_PR3838_MEASURED = {("bshd", 2): 363.0, ("thd", 2): 342.0, ("bshd", 4): None, ("thd", 4): 505.0}
_PR3838_DOCUMENT_TOKENS = 1000  # "documents of ~1000 tokens" (PR 3481, the same author, the same recipe family)


def cord_v2_lengths(count: int, seed: int = 0, mean_tokens: int = _PR3838_DOCUMENT_TOKENS) -> list[SampleWork]:
    """cord_v2 as the reproduction assumes it: the planner's synthetic receipts (:func:`~.samples.receipt_lengths`),
    each sample's text and image height scaled by one factor so the mean sample is ``mean_tokens``."""
    receipts = receipt_lengths(count, seed)
    factor = mean_tokens / (sum(receipts.tokens) / count)
    works = []
    for tokens, grids in zip(receipts.tokens, receipts.grids):
        (t, h, w), = grids
        image = t * h * w // 4
        scaled_h = max(2, 2 * round(h * factor / 2))
        works.append(sample_work(round((tokens - image) * factor) + t * scaled_h * w // 4, [(t, scaled_h, w)]))
    return works


def _cord_v2_at(seq_length: int, count: int = 2048, seed: int = 0, **assumptions) -> list[SampleWork]:
    """:func:`cord_v2_lengths` with each sample cut to ``seq_length`` tokens, as the recipe's collate cuts it."""
    return [w if w.tokens <= seq_length else SampleWork(seq_length, w.patches, w.frames)
            for w in cord_v2_lengths(count, seed, **assumptions)]


def _force_padded(works: Sequence[SampleWork], layout: str, seq_length: int) -> list[SampleWork]:
    """A micro-batch padded to ``seq_length`` per sample: ``bshd`` attends over the padding (one row per sample of
    ``seq_length`` tokens), ``thd`` computes it in the GEMMs but its ``cu_seqlens`` stop at the real tokens."""
    if layout == "bshd":
        return [SampleWork(seq_length, w.patches, w.frames) for w in works]
    return [x for w in works for x in (w, SampleWork(seq_length - w.tokens, attended=False)) if x.tokens > 0]


def _pr3838(params: TimeParameters, mean_tokens: int = _PR3838_DOCUMENT_TOKENS) -> list[Figure]:
    spec = replace(get_preset("qwen3.5-vl-2b"), mtp_num_layers=1)
    shape, machine, seq_length = model_shape(spec), get_machine("h100-sxm"), 2048
    fixed = sync_seconds(spec, Parallel(gpus=8), machine) + params.per_step_s
    works = _cord_v2_at(seq_length, mean_tokens=mean_tokens)
    predicted = {}
    for (layout, mbs) in _PR3838_MEASURED:
        gbs, times = 8 * mbs, []
        for start in range(0, len(works) - gbs + 1, gbs):
            step = works[start:start + gbs]
            busy = [row_time(shape, _force_padded(step[r * mbs:(r + 1) * mbs], layout, seq_length), machine,
                             params).total for r in range(8)]
            times.append(max(busy) + fixed)
        predicted[(layout, mbs)] = 1e3 * sum(times) / len(times)
    figures = [Figure(f"MBS {mbs} {'padded (BSHD)' if layout == 'bshd' else 'THD'}", published,
                      predicted[(layout, mbs)], "ms") for (layout, mbs), published in _PR3838_MEASURED.items()
               if published is not None]
    m = _PR3838_MEASURED
    figures += [Figure("MBS 2: padded / THD step time", m[("bshd", 2)] / m[("thd", 2)],
                       predicted[("bshd", 2)] / predicted[("thd", 2)], "x"),
                Figure("THD: MBS 4 / MBS 2 step time", m[("thd", 4)] / m[("thd", 2)],
                       predicted[("thd", 4)] / predicted[("thd", 2)], "x"),
                Figure("THD MBS 4 samples/s over padded MBS 2", (32 / m[("thd", 4)]) / (16 / m[("bshd", 2)]),
                       (32 / predicted[("thd", 4)]) / (16 / predicted[("bshd", 2)]), "x")]
    return figures


# -- verl PR 6555: dynamic CP against static CP4 on Qwen3-30B-A3B SFT (held out) --------------------------------

_VERL_MEASURED = (209.97e3, 337.16e3)  # tokens/s, static CP4 and dynamic CP, steps 3-25
_VERL_GPUS, _VERL_GLOBAL_BATCH, _VERL_STEPS = 8, 64, 23


@lru_cache(maxsize=None)
def _verl_steps(mean: int = 2048, sigma: float = 1.5, global_batch: int = _VERL_GLOBAL_BATCH
                ) -> tuple[tuple[list[PlacedRow], list[PlacedRow]], ...]:
    lengths = lognormal_lengths(_VERL_STEPS * global_batch, mean=mean, sigma=sigma, low=1024, high=16384)
    steps = []
    for step in range(_VERL_STEPS):
        works = [sample_work(n) for n in lengths[step * global_batch:(step + 1) * global_batch]]
        steps.append((static_cp_rows(works, cp=4, dp=_VERL_GPUS // 4, capacity=4 * 4096),
                      balanced_cp_rows(works, world=_VERL_GPUS, max_tokens_per_rank=4096)))
    return tuple(steps)


def _verl(params: TimeParameters, mean: int = 2048, sigma: float = 1.5,
          global_batch: int = _VERL_GLOBAL_BATCH) -> list[Figure]:
    spec = replace(get_preset("qwen3-vl-30b-a3b"), vision=VisionSpec(depth=0, hidden_size=16, num_heads=1,
                                                                     intermediate_size=16, out_hidden_size=2048))
    shape, machine = model_shape(spec), get_machine("h100-sxm")
    fixed = sync_seconds(spec, Parallel(cp=4, ep=8, gpus=_VERL_GPUS), machine) + params.per_step_s
    static = dynamic = 0.0
    for static_rows, dynamic_rows in _verl_steps(mean, sigma, global_batch):
        static += rows_seconds(shape, static_rows, machine, params, world=_VERL_GPUS, ep=8) + fixed
        dynamic += rows_seconds(shape, dynamic_rows, machine, params, world=_VERL_GPUS, ep=8) + fixed
    return [Figure("dynamic CP over static CP4, tokens/s", _VERL_MEASURED[1] / _VERL_MEASURED[0], static / dynamic,
                   "x")]


def pr3838_memory(num_samples: int = 2048, seed: int = 0) -> dict:
    """PR 3838's four runs by the memory model (:func:`~.peak_memory.peak_memory_bytes`) on the reproduction's
    lengths: ``{(layout, mbs): (ran on the GPU, MemoryEstimate of the largest micro-batch, GPU bytes)}``."""
    spec = replace(get_preset("qwen3.5-vl-2b"), mtp_num_layers=1)
    machine, seq_length, parallel = get_machine("h100-sxm"), 2048, Parallel(gpus=8)
    works = _cord_v2_at(seq_length, num_samples, seed)
    out = {}
    for (layout, mbs), published in _PR3838_MEASURED.items():
        estimates = []
        for start in range(0, len(works) - mbs + 1, mbs):
            batch = works[start:start + mbs]
            slots = mbs * seq_length  # force-pad: both layouts hold seq_length slots per sample
            estimates.append(peak_memory_bytes(spec, parallel, slots_per_rank=slots,
                                               patches=sum(w.patches for w in batch), mtp_layers=1))
        out[(layout, mbs)] = (published is not None, max(estimates, key=lambda e: e.total), machine.memory_bytes)
    return out


MEGATRON_DCP = PublishedTable(
    key="megatron-lm-dynamic-cp",
    title="Megatron-LM's dynamic context parallelism example: static CP4 against dynamic CP, 4 to 64 GPUs",
    source="NVIDIA/Megatron-LM PR 5123, examples/dynamic_context_parallel/README.md and benchmark_dcp.sh",
    setup=("GPT, 12 layers, hidden 2048, FFN 8192, 16 heads (head dim 128), vocabulary 131072; bf16, Transformer Engine, "
           "flash attention, no recompute; TP 1, PP 1, CP 4, DP = GPUs / 4; micro-batch 1, 8 micro-batches, global "
           "batch 8 x DP; max_seqlen_per_dp_cp_rank 2048; lengths lognormal (mean 1024, sigma 1.5, seed 0) clipped to "
           "[128, 8192]; baseline dp_balanced packing at static CP4, dynamic CP default_dynamic_cp (min CP 1); 10% "
           "trimmed mean of iterations 11-30; four GPUs per node"),
    assumptions=(
        "the GPU is not named: four GPUs per node read as a GB200 NVL72 rack, one NVLink domain, B200 figures",
        "the FFN's GeLU MLP (2 x 2048 x 8192 per token) as a gated one of 5461 (3 x 2048 x 5461): the same FLOPs",
        "the lengths in the generator's order, iterations 11-30 as global batches 10-29 (Megatron's shuffling not "
        "reproduced)",
        "dynamic CP placed by the installed Megatron-Core's BalancedCPScheduler (the example's default_dynamic_cp is "
        "its packing-aware successor on Megatron-LM's dev branch)",
    ),
    role="fit", reproduce=_megatron_dcp)

PR3838 = PublishedTable(
    key="megatron-bridge-pr3838",
    title="Megatron-Bridge PR 3838: THD packing against padding, Qwen3.5-VL 2B SFT on cord_v2, 8 x H100",
    source="NVIDIA-NeMo/Megatron-Bridge PR 3838 (closed unmerged; commit a7079c48287e)",
    setup=("Qwen3.5-VL 2B SFT, cord_v2, 1 node x 8 H100, seq_length 2048, 'force-pad to seq_length'; MBS 2 / GBS 16: "
           "padded 363 ms/iter, THD 342; MBS 4 / GBS 32: padded out of memory, THD 505; the recipe of its base "
           "commit: TP 1, PP 1 (DP 8), MTP 1 layer, no recompute, distributed Adam, no gradient-sync overlap"),
    assumptions=(
        "cord_v2's lengths are not stated: the synthetic receipts scaled to the ~1000-token documents the same author "
        "states for this recipe family (PR 3481)",
        "force-pad: every sample padded to 2048 slots; the padded rows attend over the padding, the THD rows' "
        "cu_seqlens stop at the real tokens",
        "the Qwen3.5 2B vision tower's sizes as the planner's preset has them",
    ),
    role="held out", reproduce=_pr3838)

VERL_6555 = PublishedTable(
    key="verl-pr6555",
    title="verl PR 6555: dynamic context parallelism against static CP4, Qwen3-30B-A3B SFT",
    source="verl-project/verl PR 6555 (merged; commit 38f43722531d), its description and docs/advance/"
           "dynamic_context_parallel.rst",
    setup=("Qwen3-30B-A3B SFT, TP 1, PP 1, EP 8, static CP4, bf16, max_seqlen_per_dp_cp_rank 4096 (a 16,384-token "
           "packed budget per CP4 group); 'long-tail sequence lengths from 1K to 16K', the same batches for both; "
           "steps 3-25: static CP4 209.97K tokens/s, dynamic CP 337.16K tokens/s (+60.6%)"),
    assumptions=(
        "the GPUs are not named: 8 H100 SXM in one node (the fewest EP 8 and CP 4 need: DP 2)",
        "the lengths are not given beyond their range: Megatron-LM's lognormal generator (sigma 1.5, mean 2048) "
        "clipped to [1024, 16384]",
        "the global batch is not given: 64 samples, 23 steps",
        "static CP4 packed by Megatron-Core's dp_balanced at 16,384 tokens; dynamic CP placed by the installed "
        "Megatron-Core's BalancedCPScheduler (verl's runs Megatron-Core's default_dynamic_cp, its packing-aware "
        "successor)",
        "the language model of the Qwen3-VL 30B-A3B preset (the same sizes as Qwen3-30B-A3B), text only",
    ),
    role="held out", reproduce=_verl)

TABLES: dict[str, PublishedTable] = {t.key: t for t in (MEGATRON_DCP, PR3838, VERL_6555)}


# Each held-out table's reproduction under other values of what its source leaves unstated (docs/time-model.md,
# "How much the assumptions move it"): (table key, the assumption, {value label: keyword arguments}).
SENSITIVITY = (
    ("megatron-bridge-pr3838", "cord_v2's mean sample (tokens)",
     {"700": dict(mean_tokens=700), "1000 (used)": dict(mean_tokens=1000), "1300": dict(mean_tokens=1300)}),
    ("verl-pr6555", "lengths: lognormal mean, sigma (in 1K-16K)",
     {"1536, 1.5": dict(mean=1536), "2048, 1.5 (used)": dict(mean=2048), "3072, 1.5": dict(mean=3072),
      "2048, 1.0": dict(sigma=1.0)}),
    ("verl-pr6555", "global batch (samples)",
     {"32": dict(global_batch=32), "64 (used)": dict(global_batch=64), "128": dict(global_batch=128)}),
)


def reproduce_with(key: str, params: TimeParameters, **assumptions) -> list[Figure]:
    """Table ``key`` reproduced under other ``assumptions`` (:data:`SENSITIVITY`)."""
    return {"megatron-bridge-pr3838": _pr3838, "verl-pr6555": _verl}[key](params, **assumptions)


def get_table(key: str) -> PublishedTable:
    """The table called ``key``; ValueError listing the known ones otherwise."""
    if key not in TABLES:
        raise ValueError(f"published table {key!r} is not known; known: {', '.join(TABLES)}")
    return TABLES[key]
