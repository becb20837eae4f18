"""Context parallelism per sample: which ranks run which samples, and with which CP size (docs/cp-per-sample.md).

Megatron-Core's ``BalancedCPScheduler`` (``pipeline_parallel/hybrid_cp_schedule.py``) takes one step's samples and
returns a sequence of *groups*; the groups run one after another (Megatron-Core's hybrid-CP schedule puts a barrier
between them), and in each group every rank of the DP x CP world runs its samples, each sample on an aligned
power-of-two block of ranks: its CP size ``k``, the smallest that keeps ``max_tokens_per_rank`` tokens or fewer on a
rank (raised where that leaves no rank idle). This module calls the scheduler as is on the step's slot lengths and
turns its answer into *rows*: per group and block, the block's samples packed into THD rows of at most
``k * max_tokens_per_rank`` slots (the scheduler bounds one sample per rank, not a rank's total), each row run by
the block's ``k`` ranks.

Pure host code on lengths: every rank computes the same placement from the same lengths (the scheduler sorts and
assigns without randomness or communication). Shapes and counts in the docstrings; no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.packing import required_alignment, round_up

__all__ = ["CPRow", "CPPerSamplePlacement", "cp_slots", "timeline", "check_fits_the_world", "place_with_cp_per_sample",
           "TooLongForTheWorld"]


class TooLongForTheWorld(ValueError):
    """A sample needs more ranks than the DP x CP world has at the per-rank token limit."""


@dataclass(frozen=True)
class CPRow:
    """One THD row of a step under CP per sample.

    Attributes:
        group: the scheduler's group (groups run one after another, in this order).
        ranks: the DP x CP ranks that run the row, ascending (an aligned block of ``cp_size`` ranks).
        samples: the row's samples, as positions in the step's lengths.
        slots: the row's token slots, each sample's length aligned to ``2 * cp_size`` (1 for CP size 1).
    """

    group: int
    ranks: tuple[int, ...]
    samples: tuple[int, ...]
    slots: int

    @property
    def cp_size(self) -> int:
        return len(self.ranks)

    @property
    def slots_per_rank(self) -> int:
        """The slots each of the row's ranks holds (its ``1 / cp_size`` of the row)."""
        return self.slots // self.cp_size


@dataclass(frozen=True)
class CPPerSamplePlacement:
    """A step's rows under CP per sample (:func:`place_with_cp_per_sample`).

    Attributes:
        rows: every row, in the order the ranks run them: by group, then (Megatron-Core's scheduler) by first rank,
            or (:func:`~megatron.bridge_thd.batching.time_placement.place_by_time`) by when the row starts.
        world: the DP x CP world size.
        max_tokens_per_rank: the per-rank token limit the scheduler placed by.
        placed_by: ``"megatron"`` (``BalancedCPScheduler``) or ``"time"`` (the time model).
        busy: ``(world,)`` each rank's seconds of row time as the time model prices it, where the placement was
            priced (``"time"``), else empty.
        step_s: the step's seconds as priced (rows back to back, a row starting when all its ranks are free,
            barriers between groups), or None.
        reason: why busy max / mean is above the placement's target, empty when it is not (or was not priced).
    """

    rows: tuple[CPRow, ...]
    world: int
    max_tokens_per_rank: int
    placed_by: str = "megatron"
    busy: tuple[float, ...] = ()
    step_s: float | None = None
    reason: str = ""

    @property
    def imbalance(self) -> float | None:
        """Per-rank busy time max / mean, where priced."""
        if not self.busy or not sum(self.busy):
            return None
        return max(self.busy) / (sum(self.busy) / len(self.busy))

    @property
    def groups(self) -> int:
        return 1 + max((row.group for row in self.rows), default=-1)

    def rows_of(self, rank: int) -> tuple[CPRow, ...]:
        """The rows ``rank`` runs, in order."""
        return tuple(row for row in self.rows if rank in row.ranks)

    def cp_size_of(self) -> dict[int, int]:
        """Each sample's CP size, by position."""
        return {sample: row.cp_size for row in self.rows for sample in row.samples}

    def row_id_groups(self) -> list[list[list[int]]]:
        """The rows as Megatron-Core's hybrid-CP schedule reads its ``sample_id_groups``: ``[group][rank]`` -> the
        ids (positions in :attr:`rows`) of the rows that rank runs in that group, in order. The schedule gives a row
        as many ranks as lists hold its id (its CP size) and runs one forward per row.

        Raises:
            RuntimeError: a rank has no row in some group (the schedule runs every rank's last row of the last group
                outside its loop, and every group behind a barrier of all ranks; the scheduler fills every rank).
        """
        groups: list[list[list[int]]] = [[[] for _ in range(self.world)] for _ in range(self.groups)]
        for row_id, row in enumerate(self.rows):
            for rank in row.ranks:
                groups[row.group][rank].append(row_id)
        idle = [(group, rank) for group, ranks in enumerate(groups) for rank, ids in enumerate(ranks) if not ids]
        if idle:
            raise RuntimeError(f"place_with_cp_per_sample: ranks without a row in a group (group, rank) {idle}; "
                               "Megatron-Core's hybrid-CP schedule needs a row on every rank in every group")
        return groups

    def schedule_item(self, rank: int, row_batch) -> tuple[dict[int, dict], list[list[list[int]]]]:
        """One step's item for Megatron-Core's hybrid-CP schedule on ``rank``: ``({row id: row batch}, row id
        groups)``, what ``hybrid_context_parallel_forward_backward`` reads with one ``next`` per step. Only the rank's
        own rows are built (the schedule reads no other).

        Args:
            rank: this rank's DP x CP index.
            row_batch: ``CPRow -> dict``, the row's micro-batch (its samples collated whole: tokens, labels, masks,
                pixels, grids), which the step packs into one THD row.
        """
        groups = self.row_id_groups()
        mine = {row_id for group in groups for row_id in group[rank]}
        return {row_id: row_batch(self.rows[row_id]) for row_id in sorted(mine)}, groups


def cp_slots(length: int, world: int) -> int:
    """A sample's slots as the scheduler sees them: ``length`` aligned to ``2 * world``, which every CP size up to
    ``world`` divides (the scheduler then never gives a sample a CP size its aligned length does not fit)."""
    return round_up(length, required_alignment(cp_size=world))


class _Group:
    """The scheduler's DP x CP group as it reads it: its size."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _blocks(rank_samples: Sequence[Sequence[int]], group: int) -> list[tuple[tuple[int, ...], list[int]]]:
    """The blocks of one scheduler group, each on aligned ranks, with their samples (scheduler order).

    A block is the set of ranks the scheduler gave some samples (ranks holding the same samples). The scheduler can
    leave a block on ranks that are not one of Megatron-Core's hybrid groups (e.g. ranks 2-5 of 8, after a trimmed
    sample is re-queued behind a smaller one), which its schedule would then run with the wrong partners. The
    blocks are moved, keeping the scheduler's choice of samples and CP sizes, to aligned ranks: largest first, each
    at the next free offset (an offset that every smaller power of two divides).
    """
    holders: dict[int, list[int]] = {}
    for rank, samples in enumerate(rank_samples):
        for sample in samples:
            holders.setdefault(sample, []).append(rank)
    blocks: dict[tuple[int, ...], list[int]] = {}
    for sample, ranks in holders.items():
        blocks.setdefault(tuple(ranks), []).append(sample)
    used = [rank for block in blocks for rank in block]
    if len(used) != len(set(used)) or any(len(block) & (len(block) - 1) for block in blocks):
        raise RuntimeError(f"BalancedCPScheduler's group {group} gives a rank two blocks or a block that is not a power "
                           f"of two ({sorted(blocks)}); Megatron-Core's hybrid groups cannot run it")
    aligned, offset = [], 0
    for block in sorted(blocks, key=lambda b: (-len(b), b)):
        aligned.append((tuple(range(offset, offset + len(block))), blocks[block]))
        offset += len(block)
    return sorted(aligned)


def _rows_of_block(group: int, block: tuple[int, ...], samples: list[int], lengths: Sequence[int],
                   capacity: int) -> list[CPRow]:
    """A block's samples in rows of at most ``capacity`` slots: first fit, in decreasing slots (ties by position)."""
    align = required_alignment(cp_size=len(block))  # a row of that CP size: TP 1, no SP / FP8
    slots = {sample: round_up(int(lengths[sample]), align) for sample in samples}
    rows: list[list[int]] = []
    used: list[int] = []
    too_long = [sample for sample in samples if slots[sample] > capacity]
    if too_long:  # the scheduler's CP size of a sample always holds it; a change upstream would show here
        raise RuntimeError(f"BalancedCPScheduler gave samples {too_long} of group {group} {len(block)} ranks, which hold "
                           f"{capacity} slots, fewer than they take")
    for sample in sorted(samples, key=lambda s: (-slots[s], s)):
        for index, total in enumerate(used):
            if total + slots[sample] <= capacity:
                rows[index].append(sample)
                used[index] += slots[sample]
                break
        else:
            rows.append([sample])
            used.append(slots[sample])
    return [CPRow(group, block, tuple(sorted(row)), total) for row, total in zip(rows, used)]


def timeline(rows: Sequence[CPRow], world: int, seconds) -> tuple[float, list[float]]:
    """The step as the hybrid-CP schedule runs ``rows``: each rank runs its rows in order, a row starts when all its
    ranks are free, and every group starts when the previous one has ended on every rank (the barrier).

    Args:
        rows: the rows in run order (their ``group`` ascending).
        world: the DP x CP world size.
        seconds: ``CPRow -> float``, the row's seconds on each of its ranks.

    Returns:
        ``(step seconds, (world,) busy seconds per rank)``.
    """
    free, busy, group = [0.0] * world, [0.0] * world, None
    for row in rows:
        if group is not None and row.group != group:
            free = [max(free)] * world
        group = row.group
        took = seconds(row)
        finish = max(free[rank] for rank in row.ranks) + took
        for rank in row.ranks:
            free[rank] = finish
            busy[rank] += took
    return max(free, default=0.0), busy


def check_fits_the_world(lengths: Sequence[int], *, world: int, max_tokens_per_rank: int,
                         names: Sequence[str] | None = None, setting: str = "max_tokens_per_rank") -> list[int]:
    """Each sample's slots as the scheduler sees them (:func:`cp_slots`), refusing a sample the whole world cannot hold.

    Args:
        lengths: ``(n,)`` tokens per sample.
        world, max_tokens_per_rank: as :func:`place_with_cp_per_sample`.
        names: how the message names each sample (default ``"sample i"``).
        setting: the setting the message names.

    Raises:
        TooLongForTheWorld: naming the longest such sample, how many do not fit and a ``max_tokens_per_rank`` that
            holds them.
    """
    slots = [cp_slots(int(n), world) for n in lengths]
    limit = world * max_tokens_per_rank
    over = [i for i, s in enumerate(slots) if s > limit]
    if over:
        worst = max(over, key=lambda i: slots[i])
        name = names[worst] if names is not None else f"sample {worst}"
        raise TooLongForTheWorld(
            f"{setting}: {name} has {int(lengths[worst])} tokens ({slots[worst]} slots aligned to 2 x {world}), more "
            f"than the {world} ranks hold at {max_tokens_per_rank} tokens per rank ({limit}); {len(over)} sample(s) "
            f"do not fit. Raise max_tokens_per_rank to at least {math.ceil(slots[worst] / world)}, use more ranks, "
            "or filter these samples")
    return slots


def place_with_cp_per_sample(lengths: Sequence[int], *, world: int, max_tokens_per_rank: int) -> CPPerSamplePlacement:
    """Place one step's samples on a DP x CP world of ``world`` ranks with a CP size per sample.

    Args:
        lengths: ``(n,)`` each sample's tokens (its real length; >= 1).
        world: the DP x CP world size, a power of two (Megatron-Core builds its hybrid groups of 2, 4, ... ranks
            and the whole world).
        max_tokens_per_rank: the most tokens of one sample a rank holds (Megatron-Core's
            ``max_seqlen_per_dp_cp_rank``), a multiple of 2.

    Returns:
        The rows: every sample in exactly one row, every row on an aligned block of ranks whose size is its
        samples' CP size, no row longer than ``cp_size * max_tokens_per_rank`` slots.

    Raises:
        TooLongForTheWorld: a sample longer than ``world * max_tokens_per_rank`` slots (naming it and the fix).
        ValueError: a bad argument.
    """
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    check_int("world", world)
    check_int("max_tokens_per_rank", max_tokens_per_rank, 2)
    if world & (world - 1):
        raise ValueError(f"world: {world} is not a power of two; Megatron-Core's hybrid groups are 2, 4, ... ranks")
    lengths = [check_int(f"lengths[{i}]", int(n)) for i, n in enumerate(lengths)]
    slots = check_fits_the_world(lengths, world=world, max_tokens_per_rank=max_tokens_per_rank)
    scheduler = BalancedCPScheduler(max_tokens_per_rank, _Group(world))
    _, sample_id_groups = scheduler.get_groups_and_subsamples(list(enumerate(slots)), None)
    rows = []
    for group, rank_samples in enumerate(sample_id_groups):
        for block, samples in _blocks(rank_samples, group):
            rows += _rows_of_block(group, block, samples, lengths, len(block) * max_tokens_per_rank)
    placed = sorted(sample for row in rows for sample in row.samples)
    if placed != list(range(len(lengths))):
        raise RuntimeError(f"BalancedCPScheduler placed samples {placed}, not each of the {len(lengths)} once")
    return CPPerSamplePlacement(tuple(rows), world, max_tokens_per_rank)
