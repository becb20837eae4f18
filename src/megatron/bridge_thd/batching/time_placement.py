"""CP per sample placed by the time model (docs/cp-per-sample.md, "Placement").

Megatron-Core's ``BalancedCPScheduler`` places by ``s^2 / k`` and runs its groups behind barriers. This placement
prices every row with :func:`megatron.bridge_thd.cost.step_time.row_time` (GEMMs with the weight-read floor,
attention by chunk length, the ViT per frame, the CP ring's exposed steps, fixed costs) and minimises the step's
time as that model prices it:

1. **CP sizes** (:func:`choose_cp_sizes`): each sample's CP size ``k`` is a power of two between the smallest that
   holds it at ``max_tokens_per_rank`` and the world. For a threshold ``T`` every sample takes the smallest ``k``
   whose time is at most ``T``; the thresholds whose lower bound ``max(rank-seconds / W, longest row)`` is least are
   kept as candidates (with the smallest sizes, ``T`` infinite). Sizes are raised, longest sample first, until they
   can cover every rank.
2. **Blocks and rows** (:func:`_greedy`): longest sample first, each goes to the aligned block of ``k`` ranks where
   it *finishes* first: a new row starting when all the block's ranks are free, or appended to the row that is the
   last on every rank of that block (consecutive samples of a block in one row of at most ``k *
   max_tokens_per_rank`` slots, aligned ``2k``), where the merged row ends sooner (the weight reads and fixed costs
   are paid once per row).
3. **Every rank a row** (:func:`_cover_idle_ranks`): a rank left without a row (Megatron-Core's schedule needs one
   on every rank) is covered by widening the nearest row to the aligned block that holds both.
4. **The best candidate** by the simulated step (:func:`~megatron.bridge_thd.batching.cp_per_sample.timeline`: rows
   in one global order, each starting when all its ranks are free), then refined (:func:`_widen_the_critical_rows`):
   the longest sample on the busiest rank gets twice its CP size while that shortens the step.

Everything runs in **one group** (no barrier): every rank runs its rows in ascending row id, one global order, so
the collectives of rows on overlapping ranks cannot deadlock. Pure host arithmetic, deterministic (ties broken by
position), no communication: every rank computes the same placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from megatron.bridge_thd.cost import step_time
from megatron.bridge_thd.batching.cp_per_sample import (
    CPRow, CPPerSamplePlacement, check_fits_the_world, timeline,
)
from megatron.bridge_thd.cost.step_time import Machine, ModelShape, SampleWork, TimeParameters
from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.packing import required_alignment, round_up

__all__ = ["RowPricer", "place_by_time", "choose_cp_sizes", "works_from_sizes", "BALANCE_TARGET"]

# The per-rank busy max / mean the placement reports as reached (or says why not).
BALANCE_TARGET = 1.05
# How many of the best CP-size candidates (by their lower bound) are placed and simulated.
CANDIDATES = 4


@dataclass(frozen=True)
class RowPricer:
    """A row's seconds on each of its ranks by the time model: the model's shape, the GPU and the parameters.

    Attributes:
        shape: :func:`~megatron.bridge_thd.cost.step_time.model_shape` of the model.
        machine: the GPU and its node (:func:`~megatron.bridge_thd.cost.step_time.get_machine`).
        params: the time model's parameters (:data:`~megatron.bridge_thd.cost.step_time.FITTED` by default).
        tp, ep: the run's tensor- and expert-parallel sizes (the DP x CP world is ``gpus / tp``).
    """

    shape: ModelShape
    machine: Machine
    params: TimeParameters
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, model: Any, gpu: str, *, tp: int = 1, ep: int = 1,
           params: TimeParameters | None = None) -> "RowPricer":
        """``model`` as ``model_shape`` takes it (a preset name, a ``config.json`` path, a ``ModelSpec``), ``gpu`` a
        known machine name; ``params`` None: the time model's fitted parameters (``step_time.FITTED``)."""
        return cls(step_time.model_shape(model), step_time.get_machine(gpu),
                   params if params is not None else step_time.FITTED, tp, ep)

    def parts(self, works: Sequence[SampleWork], cp: int) -> step_time.RowTime:
        """One micro-batch (forward and backward) of a row of ``works`` at CP ``cp``, aligned ``2 cp``, by part."""
        return step_time.row_time(self.shape, works, self.machine, self.params, cp=cp, tp=self.tp, ep=self.ep,
                                  align=required_alignment(cp_size=cp))

    def seconds(self, works: Sequence[SampleWork], cp: int) -> float:
        """:meth:`parts`' total."""
        return self.parts(works, cp).total


def works_from_sizes(lengths: Sequence[int], patches: Sequence[int] | None = None,
                     patches_squared: Sequence[float] | None = None) -> list[SampleWork]:
    """``(n,)`` :class:`SampleWork` from the sizes the loaders scan (tokens, ViT patches and the sum over a sample's
    images of patches^2, :class:`~megatron.bridge_thd.batching.sizes.SampleSizes`). The scan keeps no frames: a
    sample's patches are taken as equal frames of ``patches_squared / patches`` patches (exact for one image, or
    images of one size; a video counts as one frame of all its patches, which overprices its ViT attention)."""
    works = []
    for i, tokens in enumerate(lengths):
        p = int(patches[i]) if patches is not None else 0
        q = float(patches_squared[i]) if patches_squared is not None else float(p * p)
        if p <= 0 or q <= 0:
            works.append(SampleWork(int(tokens)))
            continue
        frame = max(1, round(q / p))
        count = max(1, round(p / frame))
        works.append(SampleWork(int(tokens), p, (frame,) * count))
    return works


class _Prices:
    """Each sample's seconds alone at each CP size (cached), and a row's at its CP size.

    A row's ViT attention is the sum of its frames' (``row_time`` prices each frame on its own), so a row of several
    samples is priced without its frames plus each sample's cached ViT-attention part: the same total, without
    pricing every frame of the row again for each sample tried in it.
    """

    def __init__(self, works: Sequence[SampleWork], pricer: RowPricer, sizes: Sequence[int]):
        self.pricer = pricer
        self.works = list(works)
        self.frameless = [SampleWork(w.tokens, w.patches) for w in self.works]
        parts = [{k: pricer.parts([w], k) for k in sizes} for w in self.works]
        self.alone = [{k: p.total for k, p in by_k.items()} for by_k in parts]
        self.vision = [{k: p.vision for k, p in by_k.items()} for by_k in parts]

    def row(self, samples: Sequence[int], k: int) -> float:
        if len(samples) == 1:
            return self.alone[samples[0]][k]
        frameless = self.pricer.parts([self.frameless[s] for s in samples], k)
        return frameless.total - frameless.vision + sum(self.vision[s][k] for s in samples)


def _smallest_cp(tokens: int, limit: int, world: int) -> int:
    k = 1
    while round_up(tokens, required_alignment(cp_size=k)) > k * limit and k < world:
        k *= 2
    return k


def _cover(ks: list[int], prices: _Prices, world: int) -> list[int]:
    """``ks`` raised, the longest sample at its size first, until their sizes add up to the world (a placement
    cannot give every rank a row otherwise)."""
    ks = list(ks)
    while sum(ks) < world:
        open_ = [s for s in range(len(ks)) if ks[s] < world]
        s = max(open_, key=lambda i: (prices.alone[i][ks[i]], -i))
        ks[s] *= 2
    return ks


def _bound(ks: Sequence[int], prices: _Prices, world: int) -> float:
    """A lower bound of the step at CP sizes ``ks``: the rank-seconds spread evenly, or the longest sample."""
    spans = [prices.alone[s][k] for s, k in enumerate(ks)]
    return max(sum(k * t for k, t in zip(ks, spans)) / world, max(spans))


def choose_cp_sizes(prices: _Prices, smallest: Sequence[int], world: int, count: int = CANDIDATES) -> list[list[int]]:
    """Candidate CP sizes per sample, best lower bound first (module docstring, step 1).

    Args:
        prices: each sample's seconds alone per CP size.
        smallest: ``(n,)`` each sample's smallest CP size at the token limit.
        world: the DP x CP world size.
        count: how many candidates.

    Returns:
        Up to ``count`` distinct lists of ``(n,)`` CP sizes (powers of two, ``smallest[i] <= k <= world``); the first
        is the smallest sizes (covered), then the thresholds by their bound.
    """
    sizes = [k for k in prices.alone[0]] if prices.alone else []
    thresholds = sorted({prices.alone[s][k] for s in range(len(smallest)) for k in sizes if k >= smallest[s]},
                        reverse=True)
    scored = {}
    for threshold in [math.inf] + thresholds:
        ks = []
        for s, low in enumerate(smallest):
            k = low
            while k < world and prices.alone[s][k] > threshold:
                k *= 2
            ks.append(k)
        ks = tuple(_cover(ks, prices, world))
        if ks not in scored:
            scored[ks] = (_bound(ks, prices, world), len(scored))
    first = tuple(_cover(list(smallest), prices, world))
    ranked = sorted((ks for ks in scored if ks != first), key=lambda ks: scored[ks])
    return [list(first)] + [list(ks) for ks in ranked[:count - 1]]


@dataclass
class _Row:
    ranks: tuple[int, ...]
    samples: list[int]
    slots: int
    seconds: float
    start: float


def _greedy(ks: Sequence[int], prices: _Prices, lengths: Sequence[int], world: int, limit: int,
            widest_first: bool) -> list[_Row]:
    """Longest sample first (``widest_first``: largest CP size first, then longest), each where it finishes first:
    a new row on an aligned block, or appended to the row that is last on every rank of its block (module
    docstring, step 2). Returns the rows in run order."""
    if widest_first:
        order = sorted(range(len(ks)), key=lambda s: (-ks[s], -prices.alone[s][ks[s]], s))
    else:
        order = sorted(range(len(ks)), key=lambda s: (-prices.alone[s][ks[s]], -ks[s], s))
    free, last = [0.0] * world, [None] * world
    rows: list[_Row] = []
    for s in order:
        k = ks[s]
        slots = round_up(int(lengths[s]), required_alignment(cp_size=k))
        options = []  # (finish, kind: 0 appended / 1 new row, offset, the row's seconds, its start)
        for offset in range(0, world, k):
            start = max(free[offset:offset + k])
            options.append((start + prices.alone[s][k], 1, offset, prices.alone[s][k], start))
        # Appending to the block's last row ends no sooner than that row does (a row's time only grows with its
        # samples): only blocks free before the best finish so far are priced, soonest first.
        for free_at, _, offset, _, _ in sorted(options):
            if free_at - prices.alone[s][k] >= min(options)[0]:
                break
            j, block = last[offset], tuple(range(offset, offset + k))
            if j is not None and rows[j].ranks == block and all(last[r] == j for r in block) \
                    and rows[j].slots + slots <= k * limit:
                merged = prices.row(rows[j].samples + [s], k)
                options.append((rows[j].start + merged, 0, offset, merged, rows[j].start))
        finish, kind, offset, seconds, start = min(options)
        block = tuple(range(offset, offset + k))
        if kind == 0:
            row = rows[last[offset]]
            row.samples.append(s)
            row.slots += slots
            row.seconds = seconds
        else:
            rows.append(_Row(block, [s], slots, seconds, start))
        for r in block:
            free[r], last[r] = finish, (last[offset] if kind == 0 else len(rows) - 1)
    return rows


def _cover_idle_ranks(rows: list[_Row], prices: _Prices, lengths: Sequence[int], world: int,
                      limit: int) -> list[_Row]:
    """Every rank given a row (module docstring, step 3): for a rank without one, the smallest aligned block around
    it that holds some row's ranks; of the rows inside that block, the longest (a single row when it holds samples
    that still fit) is widened to the whole block. Each pass covers at least the idle rank."""
    while True:
        held = {r for row in rows for r in row.ranks}
        idle = [r for r in range(world) if r not in held]
        if not idle:
            return rows
        rank, size = idle[0], 2
        while True:
            lo = rank - rank % size
            inside = [i for i, row in enumerate(rows) if lo <= row.ranks[0] and row.ranks[-1] < lo + size]
            fits = [i for i in inside
                    if sum(round_up(int(lengths[s]), required_alignment(cp_size=size)) for s in rows[i].samples) <= size * limit]
            if fits:
                break
            if size >= world:
                raise RuntimeError(f"place_by_time: rank {rank} has no row and no row can be widened to cover it")
            size *= 2
        i = max(fits, key=lambda j: (rows[j].seconds, -j))
        row = rows[i]
        row.ranks = tuple(range(lo, lo + size))
        row.slots = sum(round_up(int(lengths[s]), required_alignment(cp_size=size)) for s in row.samples)
        row.seconds = prices.row(row.samples, size)


def _place(ks: Sequence[int], prices: _Prices, lengths: Sequence[int], world: int, limit: int) -> tuple:
    """The rows for CP sizes ``ks``, the better of the two orders (module docstring, steps 2-3), simulated:
    ``(step seconds, busy per rank, rows, CPRows, ks)``."""
    best = None
    for widest_first in (False, True):
        rows = _cover_idle_ranks(_greedy(ks, prices, lengths, world, limit, widest_first), prices, lengths, world,
                                 limit)
        cp_rows = _as_cp_rows(rows)
        seconds = {id(row): rows[i].seconds for i, row in enumerate(cp_rows)}
        step, busy = timeline(cp_rows, world, lambda row: seconds[id(row)])
        if best is None or step < best[0]:
            best = (step, busy, rows, cp_rows, tuple(ks))
    return best


def _widen_the_critical_rows(best: tuple, prices: _Prices, lengths: Sequence[int], world: int, limit: int,
                             tries: int = 8) -> tuple:
    """Local refinement (module docstring, step 4): the longest sample on the busiest rank gets twice its CP size,
    kept while the simulated step gets shorter, at most ``tries`` times."""
    for _ in range(tries):
        step, busy, rows, _, ks = best
        worst = max(range(world), key=lambda r: (busy[r], -r))
        mine = [s for row in rows if worst in row.ranks for s in row.samples if ks[s] < world]
        if not mine:
            return best
        s = max(mine, key=lambda i: (prices.alone[i][ks[i]], -i))
        tried = _place([2 * k if i == s else k for i, k in enumerate(ks)], prices, lengths, world, limit)
        if tried[0] >= step:
            return best
        best = tried
    return best


def _as_cp_rows(rows: Sequence[_Row]) -> tuple[CPRow, ...]:
    return tuple(CPRow(0, row.ranks, tuple(sorted(row.samples)), row.slots) for row in rows)


def _reason(placement_rows: Sequence[_Row], busy: Sequence[float], world: int, target: float) -> str:
    """Why busy max / mean is above ``target`` (empty when it is not): one sample that alone takes most of a mean
    rank's time, or rows too few and coarse for the ranks."""
    mean = sum(busy) / world
    ratio = max(busy) / mean if mean else 1.0
    if ratio <= target:
        return ""
    worst = max(range(world), key=lambda r: (busy[r], -r))
    longest = max((row for row in placement_rows if worst in row.ranks), key=lambda row: row.seconds)
    head = f"busy max / mean {ratio:.3f} > {target}"
    if len(longest.samples) == 1 and longest.seconds >= 0.5 * mean:
        where = "all the world's" if len(longest.ranks) == world else f"its {len(longest.ranks)}"
        return (f"{head}: sample {longest.samples[0]} alone takes {longest.seconds * 1e3:.1f} ms on {where} ranks, "
                f"{longest.seconds / mean:.0%} of a mean rank's {mean * 1e3:.1f} ms: one sample dominates the step, "
                "and widening it did not shorten the step")
    return (f"{head}: the step's {sum(len(row.samples) for row in placement_rows)} samples make "
            f"{len(placement_rows)} rows, too coarse for {world} ranks (rank {worst}'s longest row takes "
            f"{longest.seconds / mean:.0%} of a mean rank's {mean * 1e3:.1f} ms); no shorter step spreads them "
            "more evenly")


def place_by_time(works: Sequence[SampleWork], *, world: int, max_tokens_per_rank: int, pricer: RowPricer,
                  target: float = BALANCE_TARGET) -> CPPerSamplePlacement:
    """Place one step's samples on a DP x CP world of ``world`` ranks with a CP size per sample, by the time model.

    Args:
        works: ``(n,)`` each sample's tokens, patches and frames (:func:`~.step_time.sample_work`,
            :func:`works_from_sizes`); ``n >= 1``.
        world: the DP x CP world size, a power of two.
        max_tokens_per_rank: a row on ``k`` ranks holds at most ``k * max_tokens_per_rank`` slots, an even int.
        pricer: the time model of the run's model and GPU.
        target: the busy max / mean reported as balanced.

    Returns:
        The rows in run order, all in group 0: every sample in exactly one row, every row on an aligned block of a
        power of two of ranks, at most ``cp_size * max_tokens_per_rank`` slots (each sample aligned ``2 cp_size``),
        every rank with at least one row; ``busy`` ``(world,)``, ``step_s`` and ``reason`` (non-empty when busy
        max / mean is above ``target``).

    Raises:
        TooLongForTheWorld: a sample longer than the world holds (naming it and the fix).
        ValueError: a bad argument.
    """
    check_int("world", world)
    check_int("max_tokens_per_rank", max_tokens_per_rank, 2)
    if world & (world - 1):
        raise ValueError(f"world: {world} is not a power of two; Megatron-Core's hybrid groups are 2, 4, ... ranks")
    if not works:
        raise ValueError("works: a step needs at least one sample")
    lengths = [check_int(f"works[{i}].tokens", int(w.tokens)) for i, w in enumerate(works)]
    check_fits_the_world(lengths, world=world, max_tokens_per_rank=max_tokens_per_rank)
    sizes = [2 ** i for i in range(int(math.log2(world)) + 1)]
    prices = _Prices(works, pricer, sizes)
    smallest = [_smallest_cp(n, max_tokens_per_rank, world) for n in lengths]
    best = None
    for ks in choose_cp_sizes(prices, smallest, world):
        best = min(best or (math.inf,), _place(ks, prices, lengths, world, max_tokens_per_rank))
    best = _widen_the_critical_rows(best, prices, lengths, world, max_tokens_per_rank)
    step, busy, rows, cp_rows, _ = best
    return CPPerSamplePlacement(cp_rows, world, max_tokens_per_rank, placed_by="time", busy=tuple(busy), step_s=step,
                              reason=_reason(rows, busy, world, target))
