"""A batch sampler that places each step's samples by :func:`.policy.assign`. Reasoning: docs/batching.md.

:class:`GlobalBatchSampler` wraps Megatron-Bridge's own per-rank batch samplers, one per DP rank
(copies of the rank's sampler with the rank changed): for each step it draws ``num_micro_batches``
micro-batches from every rank's copy, exactly the samples Megatron-Bridge would give the step in
the same order of steps, and yields this rank's micro-batches of the placement. Every rank computes
the same placement from the same draws, so no communication is needed.

:func:`choose_row_length` picks a static row for the run from the same draws
(:func:`row_length_for_steps`): the smallest multiple of the alignment, from :func:`row_lower_bound`
up, at which every step of the run fits.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from megatron.bridge_thd.batching.cost import SampleCost
from megatron.bridge_thd.batching.policy import aligned_lengths, assign, in_batch_assignment, placement_stats, sample_costs
from megatron.bridge_thd.batching.sizes import SampleSizes, is_global_rank_zero
from megatron.bridge_thd.packing import round_up

__all__ = ["GlobalBatchSampler", "StepPlacement", "rank_samplers", "step_draws", "choose_row_length",
           "row_length_for_steps", "row_lower_bound", "is_global_rank_zero"]

logger = logging.getLogger(__name__)


def rank_samplers(sampler, dp_size: int) -> list:
    """Copies of a Megatron-Bridge batch sampler (``MegatronPretrainingSampler`` or
    ``MegatronPretrainingRandomSampler``, ``data/samplers.py``), one per DP rank: the rank is only
    read when iterating (``get_start_end_idx`` / the random sampler's ``__iter__``)."""
    copies = []
    for rank in range(dp_size):
        twin = copy.copy(sampler)
        twin.data_parallel_rank = rank
        copies.append(twin)
    return copies


def step_draws(samplers: Sequence, num_micro_batches: int) -> Iterator[list[int]]:
    """Per step, the dataset indices every rank's sampler gives it, in Megatron-Bridge's order
    (micro-batch ``j`` of rank 0, rank 1, ..., then ``j + 1``); ends when a sampler ends."""
    iterators = [iter(s) for s in samplers]
    while True:
        drawn: list[int] = []
        try:
            for _ in range(num_micro_batches):
                for iterator in iterators:
                    drawn += list(next(iterator))
        except StopIteration:
            if drawn:
                logger.warning("bridge_thd.batching: the samplers ended inside a step; its %d samples are not trained "
                               "(as with Megatron-Bridge's own samplers, whose loop ends there)", len(drawn))
            return
        yield drawn


def _assign_step(sizes: SampleSizes, index: torch.Tensor, *, dp_size: int, num_micro_batches: int, row_length: int,
                 align_to: int, seed: int, cost: SampleCost | None):
    """:func:`.policy.assign` on the samples ``index`` of ``sizes`` (one step's draws)."""
    return assign(sizes.lengths[index], dp_size=dp_size, num_micro_batches=num_micro_batches, row_length=row_length,
                  vision_patches=sizes.patches[index], vision_patches_squared=sizes.patches_squared[index],
                  align_to=align_to, seed=seed, cost=cost)


@dataclass(frozen=True)
class StepPlacement:
    """One step, as logged: ``step`` (1-based among the steps this sampler placed), real tokens,
    slots, padding, per-rank and per-micro-batch cost max / mean, and the same per-rank figure for
    Megatron-Bridge's own placement of the same samples."""

    step: int
    real_tokens: int
    slots: int
    padding: float
    rank_imbalance: float
    micro_batch_imbalance: float
    in_batch_rank_imbalance: float


class GlobalBatchSampler:
    """Yields this DP rank's micro-batches (lists of dataset indices), placed per step.

    Args:
        samplers: one Megatron-Bridge batch sampler per DP rank (:func:`rank_samplers`).
        dp_rank: this rank.
        num_micro_batches: micro-batches per rank per step.
        row_length: slots of one micro-batch's row.
        sizes: every dataset sample's sizes (:func:`.sizes.dataset_sizes`).
        static_row: True for ``thd_static`` (padding measured against ``row_length``).
        align_to, seed, cost: as :func:`.policy.assign`.
        log: log one line per step on global rank 0 (``logging``, INFO).
        label: which loader, in the log line (``"train"``, ``"valid"``, ``"test"``).
    """

    def __init__(self, samplers: Sequence, *, dp_rank: int, num_micro_batches: int, row_length: int,
                 sizes: SampleSizes, static_row: bool, align_to: int = 1, seed: int = 0,
                 cost: SampleCost | None = None, log: bool = True, label: str = "train"):
        self.samplers, self.dp_rank, self.num_micro_batches = list(samplers), dp_rank, num_micro_batches
        self.row_length, self.sizes, self.static_row = row_length, sizes, static_row
        self.align_to, self.seed, self.cost, self.log, self.label = align_to, seed, cost, log, label
        self.history: list[StepPlacement] = []

    def __len__(self) -> int:
        return len(self.samplers[self.dp_rank])

    def place(self, drawn: list[int]):
        """``[rank][micro_batch] -> dataset indices`` for one step's draws."""
        index = torch.tensor(drawn, dtype=torch.int64)
        placement = _assign_step(self.sizes, index, dp_size=len(self.samplers), num_micro_batches=self.num_micro_batches,
                                 row_length=self.row_length, align_to=self.align_to, seed=self.seed, cost=self.cost)
        self._record(index, placement)
        return [[[drawn[i] for i in row] for row in rank] for rank in placement]

    def _record(self, index: torch.Tensor, placement) -> None:
        sizes, dp = self.sizes, len(self.samplers)
        lengths = sizes.lengths[index]
        costs = sample_costs(lengths, sizes.patches[index], sizes.patches_squared[index], self.cost)
        row_length = self.row_length if self.static_row else None
        stats = placement_stats(placement, lengths, costs=costs, row_length=row_length, align_to=self.align_to)
        # Megatron-Bridge's own placement of the same draws (they come in its order: step_draws).
        own = in_batch_assignment(len(index), dp_size=dp, micro_batch_size=len(index) // (dp * self.num_micro_batches))
        in_batch = placement_stats(own, lengths, costs=costs, align_to=self.align_to)
        record = StepPlacement(len(self.history) + 1, stats.real_tokens, stats.slots, stats.padding,
                               stats.rank_imbalance, stats.micro_batch_imbalance, in_batch.rank_imbalance)
        self.history.append(record)
        if self.log and is_global_rank_zero():
            logger.info(
                "bridge_thd global-batch packing (%s): step %d: real tokens %d in %d slots (padding %.1f%%); per-rank cost "
                "max/mean %.3f (in-batch placement of the same samples: %.3f); per-micro-batch max/mean %.3f",
                self.label, record.step, record.real_tokens, record.slots, 100 * record.padding, record.rank_imbalance,
                record.in_batch_rank_imbalance, record.micro_batch_imbalance)

    def __iter__(self) -> Iterator[list[int]]:
        for drawn in step_draws(self.samplers, self.num_micro_batches):
            yield from self.place(drawn)[self.dp_rank]


def row_lower_bound(step_lengths, *, rows: int, align_to: int = 1) -> int:
    """No fixed row for these steps can be shorter: per step ``max(longest aligned sample,
    ceil(aligned tokens / rows))``, the largest over the steps, rounded up to ``align_to``.

    Args:
        step_lengths: per step, ``(N,)`` its samples' LLM tokens.
        rows: micro-batches per step over all ranks (``dp_size * num_micro_batches``).
    """
    bound = 0
    for lengths in step_lengths:
        slots = aligned_lengths(lengths, align_to)
        bound = max(bound, int(slots.max()), -(-int(slots.sum()) // rows))
    return round_up(bound, align_to)


def row_length_for_steps(steps: Sequence[torch.Tensor], *, sizes: SampleSizes, dp_size: int, num_micro_batches: int,
                         align_to: int = 1, upper: int | None = None, cost: SampleCost | None = None,
                         seed: int = 0) -> int:
    """The smallest row (a multiple of ``align_to``) at which :func:`.policy.assign` places every step:
    start at :func:`row_lower_bound` and grow by ~0.5% while a step does not fit.

    Args:
        steps: per step, the ``(N,)`` indices into ``sizes`` of its samples, in the sampler's order.
        upper: refuse a row above it (e.g. ``micro_batch_size * seq_length``, what the recipe's memory
            was planned for); None: no ceiling.

    Raises:
        ValueError: the row would exceed ``upper``.
    """
    row = row_lower_bound([sizes.lengths[index] for index in steps], rows=dp_size * num_micro_batches,
                          align_to=align_to)

    def fits(index: torch.Tensor) -> bool:
        try:
            _assign_step(sizes, index, dp_size=dp_size, num_micro_batches=num_micro_batches, row_length=row,
                         align_to=align_to, seed=seed, cost=cost)
        except ValueError:
            return False
        return True

    # Every step is checked again at each new row: a greedy placement is not monotone in the row.
    while upper is None or row <= upper:
        if all(fits(index) for index in steps):
            return row
        grown = round_up(int(row * 1.005 + 1), align_to)
        # The last try is the ceiling itself (the in-batch row always fits when no sample exceeds seq_length).
        row = grown if upper is None or row == upper else min(grown, upper)
    raise ValueError(
        f"row_length: the run's steps need a row longer than {upper} slots (micro_batch_size * seq_length); "
        "set dataset.global_batch_packing.row_length, or raise train.micro_batch_size")


def choose_row_length(samplers: Sequence, *, num_micro_batches: int, sizes: SampleSizes, steps: int,
                      align_to: int = 1, upper: int | None = None, cost: SampleCost | None = None,
                      seed: int = 0) -> int:
    """:func:`row_length_for_steps` of the run's first ``steps`` steps as ``samplers`` (fresh per-rank
    copies, iterated here) draw them.

    Raises:
        ValueError: no step drawn, or the row would exceed ``upper``.
    """
    draws = []
    for drawn in step_draws(samplers, num_micro_batches):
        draws.append(torch.tensor(drawn, dtype=torch.int64))
        if len(draws) >= steps:
            break
    if not draws:
        raise ValueError("choose_row_length: the samplers drew no complete step; check global_batch_size and the data")
    return row_length_for_steps(draws, sizes=sizes, dp_size=len(samplers), num_micro_batches=num_micro_batches,
                                align_to=align_to, upper=upper, cost=cost, seed=seed)
