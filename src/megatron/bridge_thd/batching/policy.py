"""Global-batch packing: place one step's samples on DP ranks and micro-batches. Reasoning: docs/batching.md.

:func:`assign` is the policy. It sees the samples Megatron-Bridge's sampler drew for one step (their
lengths and, optionally, image patches), and returns, per DP rank, per micro-batch, the indices of
the samples that go there. Each micro-batch becomes one THD row of at most ``row_length`` slots.

The placement, in two steps:

1. **Micro-batches** (``dp_size * num_micro_batches`` rows of ``row_length`` slots): longest-
   processing-time first on the cost (:mod:`.cost`): samples in decreasing cost, each into the
   cheapest row that still has room for its aligned tokens. The first rows each receive one of the
   costliest samples, so no row is empty. If a sample finds no row with room (a tight static row),
   the placement restarts first-fit-decreasing on tokens (each sample into the first row with room),
   which fills rows to within a few percent of the mean; if that fails too, the step does not fit
   and the error says by how much. Cost then balances only across ranks (step 2).
   Then the costliest row swaps (or gives) one sample with one of the eight cheapest rows while
   that lowers the pair's maximum within ``row_length`` (at most ``2 * rows`` swaps).
2. **Ranks**: the rows in decreasing cost, each to the cheapest rank that has fewer than
   ``num_micro_batches`` rows, so every rank has the same number of micro-batches and per-rank
   cost is balanced as well as per-row cost.

:func:`in_batch_assignment` is what Megatron-Bridge's samplers do (consecutive ``micro_batch_size``
slices per rank), for comparison; :func:`placement_stats` measures either.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron.bridge_thd.cost.sample import SampleCost
from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.layouts import row_bucket
from megatron.bridge_thd.packing import ceil_div, round_up

__all__ = ["Assignment", "assign", "in_batch_assignment", "PlacementStats", "placement_stats", "aligned_lengths",
           "sample_costs", "DoesNotFit"]

# [rank][micro_batch] -> sample indices (positions in the step's ``lengths``).
Assignment = list[list[list[int]]]


class DoesNotFit(ValueError):
    """The step's samples do not fit its rows (a sample longer than ``row_length``, or all of them
    together). Its own class, so that a row search catches this and nothing else: a bad argument or a
    sample of zero tokens stays a plain ``ValueError`` with its own message."""


def aligned_lengths(lengths, align_to: int) -> torch.Tensor:
    """``(N,)`` int64: each length rounded up to ``align_to``, the slots it takes in a THD row
    (``layouts.thd_slots``)."""
    return round_up(torch.as_tensor(lengths, dtype=torch.int64), align_to)


def sample_costs(lengths, vision_patches=None, vision_patches_squared=None, cost: SampleCost | None = None):
    """``(N,)`` float64 cost per sample: ``cost(...)``, or without one VERL's tokens-and-attention
    proxy ``s + s^2 / 24576`` (its ``24576 * s + s^2`` scaled to tokens; no vision term)."""
    if cost is not None:
        return cost(lengths, vision_patches, vision_patches_squared)
    s = torch.as_tensor(lengths, dtype=torch.float64)
    return s + s * s / 24576.0


def _check_inputs(lengths: torch.Tensor, dp_size, num_micro_batches, row_length, align_to, vision_patches,
                  vision_patches_squared, names):
    for name, value in (("dp_size", dp_size), ("num_micro_batches", num_micro_batches), ("row_length", row_length),
                        ("align_to", align_to)):
        check_int(name, value)
    if lengths.dim() != 1:
        raise ValueError(f"lengths: expected a 1-D sequence of per-sample token counts, got shape {tuple(lengths.shape)}")
    if lengths.numel() and int(lengths.min()) < 1:
        bad = int(torch.argmin(lengths))
        raise ValueError(f"lengths: sample {names[bad]} has {int(lengths[bad])} tokens; every sample needs at least one "
                         "(an empty sample has nothing to train: remove it from the data)")
    rows = dp_size * num_micro_batches
    if lengths.numel() < rows:
        raise ValueError(
            f"lengths: {lengths.numel()} samples cannot fill dp_size * num_micro_batches = {rows} micro-batches (each "
            "needs at least one sample); draw at least that many samples per step (global_batch_size)")
    for name, values in (("vision_patches", vision_patches), ("vision_patches_squared", vision_patches_squared)):
        if values is not None and len(values) != lengths.numel():
            raise ValueError(f"{name}: {len(values)} entries for {lengths.numel()} samples")


def _too_long(slots: torch.Tensor, lengths: torch.Tensor, row_length: int, align_to: int, names) -> None:
    over = torch.nonzero(slots > row_length).flatten().tolist()
    if over:
        worst = max(over, key=lambda i: int(lengths[i]))
        listed = [names[i] for i in over[:8]]
        raise DoesNotFit(
            f"lengths: {len(over)} sample(s) cannot fit a row of row_length={row_length} slots: sample {names[worst]} "
            f"has {int(lengths[worst])} tokens ({int(slots[worst])} slots aligned to {align_to}); samples "
            f"{listed}{' ...' if len(over) > 8 else ''}. Raise row_length to at least {int(slots.max())}; nothing is "
            "dropped or truncated")


def _longest_processing_time(order: list[int], cost: list[float], slots: list[int], rows: int,
                             row_length: int) -> list[list[int]] | None:
    """Each sample (in ``order``) into the cheapest row with room; None when one finds none."""
    # (cost so far, samples so far, row): cheapest first, then the emptiest, so that samples of zero
    # cost (a vision-only cost on text samples) still spread over the rows and none is left empty.
    heap = [(0.0, 0, r) for r in range(rows)]
    room = [row_length] * rows
    members: list[list[int]] = [[] for _ in range(rows)]
    # The smallest sample still to come: a row with less room can take none of them and leaves the heap.
    smallest_after = list(itertools.accumulate(reversed([slots[i] for i in order]), min))[::-1]
    for position, i in enumerate(order):
        skipped = []
        while heap and room[heap[0][2]] < slots[i]:
            if room[heap[0][2]] < smallest_after[position]:
                heapq.heappop(heap)  # full for good
                continue
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        load, count, r = heapq.heappop(heap)
        members[r].append(i)
        room[r] -= slots[i]
        heapq.heappush(heap, (load + cost[i], count + 1, r))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return members


def _first_fit_decreasing(order: list[int], slots: list[int], rows: int, row_length: int) -> list[list[int]] | None:
    """Each sample (in decreasing slots) into the first row with room (a max-room segment tree, so
    O(log rows) per sample); None when none has room. Rows left empty then take the smallest sample
    of a row holding several (it fits: an empty row has all its room)."""
    size = 1 << max(rows - 1, 0).bit_length()
    room = [0] * (2 * size)  # room[size + r]: free slots of row r; inner nodes: max of children
    room[size:size + rows] = [row_length] * rows
    for node in range(size - 1, 0, -1):
        room[node] = max(room[2 * node], room[2 * node + 1])
    members: list[list[int]] = [[] for _ in range(rows)]
    for i in sorted(order, key=lambda i: -slots[i]):
        if room[1] < slots[i]:
            return None
        node = 1
        while node < size:  # leftmost leaf with room
            node = 2 * node if room[2 * node] >= slots[i] else 2 * node + 1
        members[node - size].append(i)
        room[node] -= slots[i]
        node //= 2
        while node:
            room[node] = max(room[2 * node], room[2 * node + 1])
            node //= 2
    for empty in [r for r in range(rows) if not members[r]]:
        donor = max((r for r in range(rows) if len(members[r]) > 1), key=lambda r: len(members[r]))
        smallest = min(members[donor], key=lambda i: slots[i])
        members[donor].remove(smallest)
        members[empty].append(smallest)
    return members


# A pair of rows with more candidate swaps than this is searched by cost order (:func:`_nearest_swap`)
# instead of exhaustively: a few samples per row (the usual micro-batch) stay exact, hundreds per row
# (a large global batch on few ranks) stay fast.
_EXHAUSTIVE_PAIRS = 256
_SWAP_WINDOW = 4


def _exhaustive_swap(members, high, lows, cost, slots, row_cost, row_slots, row_length):
    """Best ``(a, b, low)`` (``b`` None: move ``a`` alone) between row ``high`` and each of ``lows`` (in
    that order) by trying every pair; None if none lowers the pair's maximum below ``row_cost[high]``."""
    best, best_peak = None, row_cost[high] * (1 - 1e-12)
    for low in lows:
        for a in members[high]:
            for b in ([None] if len(members[high]) > 1 else []) + members[low]:
                cb, sb = (0.0, 0) if b is None else (cost[b], slots[b])
                if row_slots[low] - sb + slots[a] > row_length or row_slots[high] - slots[a] + sb > row_length:
                    continue
                peak = max(row_cost[high] - cost[a] + cb, row_cost[low] - cb + cost[a])
                if peak < best_peak:
                    best, best_peak = (a, b, low), peak
    return best


def _nearest_swap(members, high, lows, cost_t, slots_t, row_cost, row_slots, row_length):
    """:func:`_exhaustive_swap` for large rows, vectorised over ``lows``: for each ``a`` only the
    ``2 * _SWAP_WINDOW`` samples of each other row whose cost is nearest to the ideal ``cost[a] -
    (row_cost[high] - row_cost[low]) / 2`` (one batched sorted search), and the move of ``a`` alone."""
    a_index = torch.tensor(members[high], dtype=torch.int64)
    width = max(len(members[low]) for low in lows)
    # (P, width) each low row's samples in increasing cost; padding costs +inf and never fits.
    b_index = torch.zeros(len(lows), width, dtype=torch.int64)
    b_cost = torch.full((len(lows), width), torch.inf, dtype=torch.float64)
    for p, low in enumerate(lows):
        index = torch.tensor(members[low], dtype=torch.int64)
        order = torch.argsort(cost_t[index], stable=True)
        b_index[p, :len(index)], b_cost[p, :len(index)] = index[order], cost_t[index[order]]
    b_slots = torch.where(torch.isinf(b_cost), row_length + 1, slots_t[b_index])
    high_cost, high_slots = row_cost[high], row_slots[high]
    low_cost = torch.tensor([row_cost[low] for low in lows], dtype=torch.float64)[:, None, None]
    low_slots = torch.tensor([row_slots[low] for low in lows], dtype=torch.int64)[:, None, None]
    ca, sa = cost_t[a_index][None, :, None], slots_t[a_index][None, :, None]
    ideal = ca[..., 0] - (high_cost - low_cost[..., 0]) / 2  # (P, ka)
    position = torch.searchsorted(b_cost, ideal.contiguous())
    near = (position[..., None] + torch.arange(-_SWAP_WINDOW, _SWAP_WINDOW)).clamp(0, width - 1)  # (P, ka, 2w)
    cb = torch.gather(b_cost[:, None, :].expand(-1, len(a_index), -1), 2, near)
    sb = torch.gather(b_slots[:, None, :].expand(-1, len(a_index), -1), 2, near)
    fits = (low_slots - sb + sa <= row_length) & (high_slots - sa + sb <= row_length) & torch.isfinite(cb)
    swap = torch.where(fits, torch.maximum(high_cost - ca + cb, low_cost - cb + ca), torch.inf)
    move_fits = (low_slots[..., 0] + sa[..., 0] <= row_length) & (len(a_index) > 1)
    move = torch.where(move_fits, torch.maximum(high_cost - ca[..., 0], low_cost[..., 0] + ca[..., 0]), torch.inf)
    # Per low row, the move first then the swaps (the exhaustive search's order); the first minimum wins.
    peaks = torch.cat([move[..., None], swap], dim=2).flatten()
    best = int(torch.argmin(peaks))
    if not float(peaks[best]) < high_cost * (1 - 1e-12):
        return None
    p, rest = divmod(best, len(a_index) * (2 * _SWAP_WINDOW + 1))
    a_row, column = divmod(rest, 2 * _SWAP_WINDOW + 1)
    b = None if column == 0 else int(b_index[p, near[p, a_row, column - 1]])
    return members[high][a_row], b, lows[p]


def _refine(members: list[list[int]], cost: list[float], slots: list[int], row_length: int,
            rounds: int, partners: int = 8) -> None:
    """Lower the costliest row by the best single swap (or move) with one of the ``partners``
    cheapest rows that keeps both within ``row_length``; stop when none lowers the pair's maximum.
    Large rows are searched by cost order (:func:`_nearest_swap`). The costliest and cheapest rows
    come from two heaps whose stale entries are skipped (ties to the lower row index, as ``max`` and
    ``heapq.nsmallest`` over the rows would give), so a round costs O(log rows). In place; no row is
    left empty."""
    row_cost = [sum(cost[i] for i in row) for row in members]
    row_slots = [sum(slots[i] for i in row) for row in members]
    highest = [(-c, r) for r, c in enumerate(row_cost)]
    lowest = [(c, r) for r, c in enumerate(row_cost)]
    heapq.heapify(highest)
    heapq.heapify(lowest)
    tensors = None
    for _ in range(rounds):
        while -highest[0][0] != row_cost[highest[0][1]]:
            heapq.heappop(highest)
        high = highest[0][1]
        cheapest, seen = [], set()
        while lowest and len(cheapest) < partners:
            entry = heapq.heappop(lowest)
            if entry[0] == row_cost[entry[1]] and entry[1] not in seen:
                cheapest.append(entry)
                seen.add(entry[1])
        for entry in cheapest:
            heapq.heappush(lowest, entry)
        lows = [r for _, r in cheapest if r != high]
        if not lows:
            return
        if len(members[high]) * (max(len(members[low]) for low in lows) + 1) > _EXHAUSTIVE_PAIRS:
            tensors = tensors or (torch.tensor(cost, dtype=torch.float64), torch.tensor(slots, dtype=torch.int64))
            best = _nearest_swap(members, high, lows, *tensors, row_cost, row_slots, row_length)
        else:
            best = _exhaustive_swap(members, high, lows, cost, slots, row_cost, row_slots, row_length)
        if best is None:
            return
        a, b, low = best
        for sample, source, target in [(a, high, low)] + ([] if b is None else [(b, low, high)]):
            members[source].remove(sample)
            members[target].append(sample)
            row_cost[source] -= cost[sample]
            row_cost[target] += cost[sample]
            row_slots[source] -= slots[sample]
            row_slots[target] += slots[sample]
        for row in (high, low):
            heapq.heappush(highest, (-row_cost[row], row))
            heapq.heappush(lowest, (row_cost[row], row))


def _rows_to_ranks(members: list[list[int]], row_cost: list[float], dp_size: int,
                   num_micro_batches: int) -> Assignment:
    """Rows in decreasing cost, each to the cheapest rank with a free micro-batch place; within a
    rank the costliest micro-batch first."""
    heap = [(0.0, rank) for rank in range(dp_size)]
    ranks: Assignment = [[] for _ in range(dp_size)]
    for r in sorted(range(len(members)), key=lambda r: -row_cost[r]):
        load, rank = heapq.heappop(heap)
        ranks[rank].append(members[r])
        if len(ranks[rank]) < num_micro_batches:
            heapq.heappush(heap, (load + row_cost[r], rank))
    return ranks


def assign(lengths, *, dp_size: int, num_micro_batches: int, row_length: int, vision_patches=None,
           vision_patches_squared=None, align_to: int = 1, seed: int = 0,
           cost: SampleCost | None = None, names: Sequence | None = None) -> Assignment:
    """Place one step's samples on ``dp_size`` ranks x ``num_micro_batches`` micro-batches.

    Args:
        lengths: ``(N,)`` LLM tokens per sample (text + image placeholder tokens), in the order the
            sampler drew them; the returned indices are positions in it.
        dp_size: data-parallel ranks.
        num_micro_batches: micro-batches per rank per step (Megatron-Bridge's
            ``global_batch_size / (micro_batch_size * dp_size)``); the same on every rank.
        row_length: slots of one micro-batch's THD row; every micro-batch's aligned tokens fit it.
        vision_patches: ``(N,)`` ViT patches per sample (sum over its images), or None.
        vision_patches_squared: ``(N,)`` sum over each sample's images of patches^2, or None (each
            sample's patches one image).
        align_to: each sample takes ``round_up(length, align_to)`` slots (``layouts.thd_alignment``).
        seed: breaks ties between equal costs (a seeded permutation), so equal inputs and seeds give
            equal placements.
        cost: the per-sample cost (:func:`.cost.sample_cost`); None balances on
            ``s + s^2 / 24576``, VERL's tokens-and-attention proxy scaled to tokens.
        names: how errors name each sample (e.g. its dataset index); default its position.

    Returns:
        ``[rank][micro_batch] -> [sample index, ...]``: every sample exactly once, no micro-batch empty.

    Raises:
        ValueError: a bad argument or a sample without tokens.
        DoesNotFit: a sample longer than ``row_length`` (named; nothing is dropped), or samples that
            together do not fit ``dp_size * num_micro_batches`` rows.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.int64).reshape(-1) if not torch.is_tensor(lengths) else lengths
    names = list(range(lengths.numel())) if names is None else list(names)
    _check_inputs(lengths, dp_size, num_micro_batches, row_length, align_to, vision_patches, vision_patches_squared,
                  names)
    slots = aligned_lengths(lengths, align_to)
    _too_long(slots, lengths, row_length, align_to, names)
    rows = dp_size * num_micro_batches
    if int(slots.sum()) > rows * row_length:
        raise DoesNotFit(
            f"row_length: this step's {lengths.numel()} samples take {int(slots.sum())} aligned slots, more than "
            f"dp_size * num_micro_batches * row_length = {rows} x {row_length} = {rows * row_length}; raise row_length "
            f"to at least {ceil_div(int(slots.sum()), rows)} (or the micro-batches per step)")
    costs = sample_costs(lengths, vision_patches, vision_patches_squared, cost)
    # Ties broken by a seeded permutation: decreasing cost, then the permutation's rank.
    tiebreak = torch.randperm(lengths.numel(), generator=torch.Generator().manual_seed(seed)).tolist()
    cost_list, slot_list = costs.tolist(), slots.tolist()
    order = sorted(range(lengths.numel()), key=lambda i: (-cost_list[i], tiebreak[i]))
    members = _longest_processing_time(order, cost_list, slot_list, rows, row_length)
    if members is None:
        members = _first_fit_decreasing(order, slot_list, rows, row_length)
    if members is None:
        raise DoesNotFit(
            f"row_length: this step's samples ({int(slots.sum())} aligned slots, longest {int(slots.max())}) do not "
            f"fit {rows} rows of {row_length} slots with any placement tried (longest-processing-time on cost, then "
            f"first-fit-decreasing on tokens); raise row_length (e.g. to {int(row_length * 1.1) + align_to})")
    _refine(members, cost_list, slot_list, row_length, rounds=2 * rows)
    row_cost = [sum(cost_list[i] for i in row) for row in members]
    ranks = _rows_to_ranks(members, row_cost, dp_size, num_micro_batches)
    return [sorted(rank, key=lambda row: -sum(cost_list[i] for i in row)) for rank in ranks]


def in_batch_assignment(num_samples: int, *, dp_size: int, micro_batch_size: int) -> Assignment:
    """Megatron-Bridge's placement of a step's ``num_samples`` samples (its samplers' order): micro-batch
    ``j`` of rank ``r`` holds positions ``j * micro_batch_size * dp_size + r * micro_batch_size + [0, micro_batch_size)``."""
    per_step = micro_batch_size * dp_size
    if num_samples % per_step:
        raise ValueError(f"num_samples: {num_samples} is not a multiple of micro_batch_size * dp_size = {per_step}")
    return [[list(range(j * per_step + r * micro_batch_size, j * per_step + (r + 1) * micro_batch_size))
             for j in range(num_samples // per_step)] for r in range(dp_size)]


@dataclass(frozen=True)
class PlacementStats:
    """One step's placement, measured.

    ``real_tokens``: sum of lengths; ``slots``: token slots the rows hold (``row_length`` per
    micro-batch for a static row, the aligned tokens otherwise); ``padding``: 1 - real / slots;
    ``rank_imbalance``: max / mean of per-rank cost; ``micro_batch_imbalance``: max / mean of per-
    micro-batch cost (over all ranks); ``rank_cost``: per-rank cost.
    """

    real_tokens: int
    slots: int
    padding: float
    rank_imbalance: float
    micro_batch_imbalance: float
    rank_cost: tuple[float, ...]


def placement_stats(assignment: Assignment, lengths, *, costs=None, row_length: int | None = None,
                    row_lengths: Sequence[int] | None = None, align_to: int = 1) -> PlacementStats:
    """Measure an assignment; ``costs`` ``(N,)`` per sample (default: the lengths); ``row_length``
    set for a static row (slots = row_length per micro-batch); ``row_lengths`` (ascending) for static
    rows of several lengths (each micro-batch takes the smallest that holds it, ``layouts.row_bucket``);
    neither for ``thd`` (aligned tokens)."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    costs = lengths.to(torch.float64) if costs is None else torch.as_tensor(costs, dtype=torch.float64)
    cost_list, slot_list = costs.tolist(), aligned_lengths(lengths, align_to).tolist()
    rows = (row_length,) if row_length is not None else tuple(row_lengths) if row_lengths is not None else None
    rank_cost, micro_cost, slots = [], [], 0
    for rank in assignment:
        per_micro = [sum(cost_list[i] for i in row) for row in rank]
        micro_cost += per_micro
        rank_cost.append(sum(per_micro))
        taken = [sum(slot_list[i] for i in row) for row in rank]
        slots += sum(taken if rows is None else [rows[min(row_bucket(rows, n), len(rows) - 1)] for n in taken])
    real = int(lengths.sum())

    def imbalance(values):
        mean = sum(values) / len(values)
        return max(values) / mean if mean > 0 else 1.0

    return PlacementStats(real, slots, 1.0 - real / slots if slots else 0.0, imbalance(rank_cost),
                          imbalance(micro_cost), tuple(rank_cost))
