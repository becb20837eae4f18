"""A batch sampler that places each step's samples by :func:`.policy.assign`. Reasoning: docs/batching.md.

:class:`GlobalBatchSampler` wraps Megatron-Bridge's own per-rank batch samplers, one per DP rank
(copies of the rank's sampler with the rank changed): for each step it draws ``num_micro_batches``
micro-batches from every rank's copy, exactly the samples Megatron-Bridge's loop would give the step
(:func:`step_draws`: a cyclic loader's step runs on into the next epoch, as its ``cyclic_iter`` does),
and yields this rank's micro-batches of the placement. Every rank computes the same placement from
the same draws, so no communication is needed.

:func:`run_draws` draws the whole run's steps from fresh copies (from sample 0, whatever the resume
point), and :func:`row_length_for_steps` picks a static row from them: the smallest multiple of the
alignment, from :func:`row_lower_bound` up, at which every step fits. A step whose samples total at
most ``rows * (row - longest)`` slots always fits (the placement can only fail when every row is
fuller than ``row - longest``), so only the other steps are placed to check them.

Several rows (``GlobalBatchPacking.row_buckets``): :func:`micro_batch_slots` places the run's distinct steps
in that row, as the sampler will, and :func:`optimal_row_lengths` chooses the shorter rows that give those
micro-batches the fewest slots, each taking the shortest row that holds it.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from megatron.bridge_thd.cost.sample import SampleCost
from megatron.bridge_thd.batching.policy import (DoesNotFit, aligned_lengths, assign, in_batch_assignment,
                                                 placement_stats, sample_costs)
from megatron.bridge_thd.batching.sizes import SampleSizes, is_global_rank_zero
from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.packing import ceil_div, round_up

__all__ = ["GlobalBatchSampler", "StepPlacement", "rank_samplers", "step_draws", "run_draws", "cycles",
           "choose_row_length", "row_length_for_steps", "row_lower_bound", "first_unfit_step", "distinct_steps",
           "is_global_rank_zero", "micro_batch_slots", "optimal_row_lengths", "row_buckets_for_runs"]

logger = logging.getLogger(__name__)


def rank_samplers(sampler, dp_size: int, *, from_start: bool = False) -> list:
    """Copies of a Megatron-Bridge batch sampler (``MegatronPretrainingSampler`` or
    ``MegatronPretrainingRandomSampler``, ``data/samplers.py``), one per DP rank: the rank is only
    read when iterating (``get_start_end_idx`` / the random sampler's ``__iter__``).

    ``from_start``: copies that draw the run from its first sample (``consumed_samples = 0``) and
    leave the dataset alone (the random sampler sets a ``RandomSeedDataset``'s epoch when iterated),
    for drawing a whole run ahead of training."""
    copies = []
    for rank in range(dp_size):
        twin = copy.copy(sampler)
        twin.data_parallel_rank = rank
        if from_start:
            twin.consumed_samples = 0
            if type(twin).__name__ == "MegatronPretrainingRandomSampler":  # the sampler that holds the dataset
                twin.dataset = None
        copies.append(twin)
    return copies


def cycles(sampler) -> bool:
    """Whether Megatron-Bridge's loop re-iterates this sampler's loader when it ends: ``cyclic``
    loaders are wrapped in ``cyclic_iter`` (``data/loaders.py``), ``single`` ones are iterated once."""
    return type(sampler).__name__ == "MegatronPretrainingRandomSampler"


def step_draws(samplers: Sequence, num_micro_batches: int, *, cycle: bool = False) -> Iterator[list[int]]:
    """Per step, the dataset indices every rank's sampler gives it, in Megatron-Bridge's order
    (micro-batch ``j`` of rank 0, rank 1, ..., then ``j + 1``).

    ``cycle`` (a ``cyclic`` loader): a sampler that ends is iterated again, as ``cyclic_iter`` does, so a
    step that starts in one epoch ends in the next (the random sampler's next ``__iter__`` starts the
    next epoch from its ``consumed_samples``). Otherwise the draws end when a sampler ends, as
    Megatron-Bridge's loop does (a step begun there is not trained).

    Raises:
        ValueError: a cycled sampler yields nothing at all.
    """
    iterators = [iter(s) for s in samplers]

    def draw(rank: int) -> list[int]:
        try:
            return list(next(iterators[rank]))
        except StopIteration:
            if not cycle:
                raise
            iterators[rank] = iter(samplers[rank])
            try:
                return list(next(iterators[rank]))
            except StopIteration:
                raise ValueError("global-batch packing: a cyclic sampler yielded no micro-batch in a whole epoch; "
                                 "the dataset is smaller than micro_batch_size * data-parallel size") from None

    while True:
        drawn: list[int] = []
        try:
            for _ in range(num_micro_batches):
                for rank in range(len(iterators)):
                    drawn += draw(rank)
        except StopIteration:
            if drawn:
                logger.warning("bridge_thd.batching: the samplers ended inside a step; its %d samples are not trained "
                               "(Megatron-Bridge's loop ends there too: a 'single' loader is iterated once)", len(drawn))
            return
        yield drawn


def run_draws(samplers: Sequence, num_micro_batches: int, steps: int, *, cycle: bool = False) -> torch.Tensor:
    """``(S, N)`` int64: the dataset indices of the first ``steps`` steps (``S <= steps``: fewer if the
    samplers end first) as :func:`step_draws` gives them; ``samplers`` are iterated here (pass copies
    from :func:`rank_samplers` with ``from_start=True`` for a whole run)."""
    draws = []
    for drawn in step_draws(samplers, num_micro_batches, cycle=cycle):
        draws.append(drawn)
        if len(draws) >= steps:
            break
    if not draws:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.tensor(draws, dtype=torch.int64)


def _assign_step(sizes: SampleSizes, index: torch.Tensor, *, dp_size: int, num_micro_batches: int, row_length: int,
                 align_to: int, seed: int, cost: SampleCost | None):
    """:func:`.policy.assign` on the samples ``index`` of ``sizes`` (one step's draws), errors naming
    each sample by its dataset index."""
    lengths, patches, squared = sizes.take(index)
    return assign(lengths, dp_size=dp_size, num_micro_batches=num_micro_batches, row_length=row_length,
                  vision_patches=patches, vision_patches_squared=squared, align_to=align_to, seed=seed, cost=cost,
                  names=[f"{int(i)} (dataset index)" for i in index.tolist()])


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
        static_row: True for ``thd_static`` (padding measured against the rows the micro-batches take).
        row_lengths: ``thd_static``'s rows, ascending, the last ``row_length`` (:func:`row_buckets_for_runs`);
            each micro-batch takes the smallest that holds it. None: ``(row_length,)``.
        align_to, seed, cost: as :func:`.policy.assign`.
        log: log one line per step on global rank 0 (``logging``, INFO).
        label: which loader, in the log line and errors (``"train"``, ``"valid"``, ``"test"``).
        cycle: the loop re-iterates this loader (:func:`cycles`, :func:`step_draws`).
        first_step: the run's number of the first step drawn (``consumed_samples / global batch + 1``
            after a resume), for the log and errors.
        planned_steps: the run's steps checked against ``row_length`` when the loader was built; a later
            step (only a loader's prefetch past the run's end asks for one) that does not fit is given
            Megatron-Bridge's own placement with a warning instead of stopping the run.
        setting: the setting an error tells the user to change.
        on_step: called with each step's :class:`StepPlacement` as it is placed (the figures of the log
            line, on every rank), e.g. ``records.append``; nothing is kept otherwise.
    """

    def __init__(self, samplers: Sequence, *, dp_rank: int, num_micro_batches: int, row_length: int,
                 sizes: SampleSizes, static_row: bool, align_to: int = 1, seed: int = 0,
                 cost: SampleCost | None = None, log: bool = True, label: str = "train", cycle: bool = False,
                 first_step: int = 1, planned_steps: int | None = None,
                 setting: str = "global_batch_packing.row_length", row_lengths: Sequence[int] | None = None,
                 on_step: Callable[[StepPlacement], None] | None = None):
        self.samplers, self.dp_rank, self.num_micro_batches = list(samplers), dp_rank, num_micro_batches
        self.row_length, self.sizes, self.static_row = row_length, sizes, static_row
        self.row_lengths = tuple(row_lengths) if row_lengths is not None else (row_length,)
        self.align_to, self.seed, self.cost, self.log, self.label = align_to, seed, cost, log, label
        self.cycle, self.step, self.planned_steps, self.setting = cycle, first_step, planned_steps, setting
        self.on_step = on_step

    def __len__(self) -> int:
        return len(self.samplers[self.dp_rank])

    def place(self, drawn: list[int]):
        """``[rank][micro_batch] -> dataset indices`` for the next step's draws."""
        index = torch.tensor(drawn, dtype=torch.int64)
        dp = len(self.samplers)
        try:
            placement = _assign_step(self.sizes, index, dp_size=dp, num_micro_batches=self.num_micro_batches,
                                     row_length=self.row_length, align_to=self.align_to, seed=self.seed,
                                     cost=self.cost)
        except DoesNotFit as error:
            if self.planned_steps is None or self.step <= self.planned_steps:
                raise DoesNotFit(f"global-batch packing, {self.label} loader, step {self.step}: {error} "
                                 f"(setting: {self.setting})") from error
            logger.warning("bridge_thd.batching (%s): step %d is past the run's %d steps (a prefetch) and does not fit "
                           "the row; it gets Megatron-Bridge's own placement: %s", self.label, self.step,
                           self.planned_steps, error)
            placement = in_batch_assignment(len(drawn), dp_size=dp,
                                            micro_batch_size=len(drawn) // (dp * self.num_micro_batches))
        self._record(index, placement)
        self.step += 1
        return [[[drawn[i] for i in row] for row in rank] for rank in placement]

    def _record(self, index: torch.Tensor, placement) -> None:
        logs = self.log and is_global_rank_zero()
        if not logs and self.on_step is None:
            return  # nobody reads the figures
        dp = len(self.samplers)
        lengths, patches, squared = self.sizes.take(index)
        costs = sample_costs(lengths, patches, squared, self.cost)
        row_lengths = self.row_lengths if self.static_row else None
        stats = placement_stats(placement, lengths, costs=costs, row_lengths=row_lengths, align_to=self.align_to)
        # Megatron-Bridge's own placement of the same draws (they come in its order: step_draws).
        own = in_batch_assignment(len(index), dp_size=dp, micro_batch_size=len(index) // (dp * self.num_micro_batches))
        in_batch = placement_stats(own, lengths, costs=costs, align_to=self.align_to)
        record = StepPlacement(self.step, stats.real_tokens, stats.slots, stats.padding,
                               stats.rank_imbalance, stats.micro_batch_imbalance, in_batch.rank_imbalance)
        if self.on_step is not None:
            self.on_step(record)
        if logs:
            logger.info(
                "bridge_thd global-batch packing (%s): step %d: real tokens %d in %d slots (padding %.1f%%); per-rank cost "
                "max/mean %.3f (in-batch placement of the same samples: %.3f); per-micro-batch max/mean %.3f",
                self.label, record.step, record.real_tokens, record.slots, 100 * record.padding, record.rank_imbalance,
                record.in_batch_rank_imbalance, record.micro_batch_imbalance)

    def __iter__(self) -> Iterator[list[int]]:
        for drawn in step_draws(self.samplers, self.num_micro_batches, cycle=self.cycle):
            yield from self.place(drawn)[self.dp_rank]


def _as_steps(steps) -> torch.Tensor:
    """Steps as one ``(S, N)`` int64 tensor (a list of equal-length ``(N,)`` tensors is stacked)."""
    if torch.is_tensor(steps):
        return steps
    steps = [torch.as_tensor(step, dtype=torch.int64) for step in steps]
    if len({len(step) for step in steps}) > 1:
        raise ValueError("steps: every step of a run draws the same number of samples (the global batch)")
    return torch.stack(steps) if steps else torch.zeros(0, 0, dtype=torch.int64)


def row_lower_bound(step_lengths, *, rows: int, align_to: int = 1) -> int:
    """No fixed row for these steps can be shorter: per step ``max(longest aligned sample,
    ceil(aligned tokens / rows))``, the largest over the steps, rounded up to ``align_to``.

    Args:
        step_lengths: ``(S, N)`` (or per step, ``(N,)``) the steps' samples' LLM tokens.
        rows: micro-batches per step over all ranks (``dp_size * num_micro_batches``).
    """
    slots = aligned_lengths(_as_steps(step_lengths), align_to)
    if slots.numel() == 0:
        return round_up(1, align_to)
    bound = max(int(slots.max()), int(ceil_div(slots.sum(dim=1), rows).max()))
    return round_up(bound, align_to)


def _check_lengths(lengths: torch.Tensor, draws: torch.Tensor, label: str) -> None:
    """Every drawn sample has a token (the scan gives 0 for an empty attention mask)."""
    if lengths.numel() and int(lengths.min()) < 1:
        step, position = divmod(int(torch.argmin(lengths.flatten())), lengths.shape[1])
        raise ValueError(
            f"global-batch packing{label}: dataset sample {int(draws[step, position])} has {int(lengths[step, position])} "
            "tokens (its attention mask is all padding); every sample needs at least one: remove it from the data")


def distinct_steps(draws: torch.Tensor, sizes: SampleSizes) -> torch.Tensor:
    """``(D,)`` int64: the position in ``draws`` ``(S, N)`` of each distinct step's first occurrence, in
    order. Steps of the same samples in the same order place alike (a repeating dataset repeats its
    steps), so each needs trying once."""
    return _step_classes(draws, sizes)[0]


def _step_classes(draws: torch.Tensor, sizes: SampleSizes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, repeats)``, both ``(D,)`` int64: each distinct step's first position in ``draws`` ``(S, N)``, in
    order (:func:`distinct_steps`), and how many of the ``S`` steps are that step."""
    if len(draws) < 2:
        return torch.arange(len(draws)), torch.ones(len(draws), dtype=torch.int64)
    _, inverse, counts = torch.unique(sizes.distinct(draws), dim=0, return_inverse=True, return_counts=True)
    first_of = torch.full((len(counts),), len(draws), dtype=torch.int64)
    first_of.scatter_reduce_(0, inverse, torch.arange(len(draws)), reduce="amin")
    order = torch.argsort(first_of)
    return first_of[order], counts[order]


def first_unfit_step(draws: torch.Tensor, *, sizes: SampleSizes, dp_size: int, num_micro_batches: int, row_length: int,
                     align_to: int = 1, cost: SampleCost | None = None, seed: int = 0,
                     first: int | None = None, candidates: torch.Tensor | None = None) -> int | None:
    """The position in ``draws`` ``(S, N)`` of a step that :func:`.policy.assign` cannot place in rows
    of ``row_length``, or None if every step fits. Each distinct step is tried once
    (``candidates``: :func:`distinct_steps`, computed here when not given); steps with at most
    ``rows * (row_length - longest)`` aligned slots fit without trying (module docstring); ``first``: a
    step to try before the others (the one that failed last)."""
    rows = dp_size * num_micro_batches
    candidates = distinct_steps(draws, sizes) if candidates is None else candidates
    slots = aligned_lengths(sizes.take(draws[candidates])[0], align_to)
    sure = slots.sum(dim=1) <= rows * (row_length - slots.max(dim=1).values)
    unsure = candidates[~sure].tolist()
    if first is not None and first in unsure:
        unsure.remove(first)
        unsure.insert(0, first)
    for step in unsure:
        try:
            _assign_step(sizes, draws[step], dp_size=dp_size, num_micro_batches=num_micro_batches,
                         row_length=row_length, align_to=align_to, seed=seed, cost=cost)
        except DoesNotFit:
            return step
    return None


def row_length_for_steps(steps, *, sizes: SampleSizes, dp_size: int, num_micro_batches: int,
                         align_to: int = 1, upper: int | None = None, cost: SampleCost | None = None,
                         seed: int = 0, label: str = "") -> int:
    """The smallest row (a multiple of ``align_to``) at which :func:`.policy.assign` places every step:
    start at :func:`row_lower_bound` and grow by ~0.5% while a step does not fit
    (:func:`first_unfit_step`).

    Args:
        steps: ``(S, N)`` (or per step, ``(N,)``) indices into ``sizes`` of each step's samples, in the
            sampler's order.
        upper: refuse a row above it (e.g. ``micro_batch_size * seq_length``, what the recipe's memory
            was planned for); None: no ceiling.
        label: the loader, for errors.

    Raises:
        ValueError: a sample without tokens, or the row would exceed ``upper``.
    """
    draws = _as_steps(steps)
    lengths = sizes.take(draws)[0]
    where = f" ({label} loader)" if label else ""
    _check_lengths(lengths, draws, where)
    row = row_lower_bound(lengths, rows=dp_size * num_micro_batches, align_to=align_to)
    candidates = distinct_steps(draws, sizes)
    failed = None
    # Every step is checked again at each new row: a greedy placement is not monotone in the row.
    while upper is None or row <= upper:
        failed = first_unfit_step(draws, sizes=sizes, dp_size=dp_size, num_micro_batches=num_micro_batches,
                                  row_length=row, align_to=align_to, cost=cost, seed=seed, first=failed,
                                  candidates=candidates)
        if failed is None:
            return row
        grown = round_up(int(row * 1.005 + 1), align_to)
        # The last try is the ceiling itself (the in-batch row always fits when no sample exceeds seq_length).
        row = grown if upper is None or row == upper else min(grown, upper)
    raise ValueError(
        f"row_length{where}: the run's steps need a row longer than {upper} slots (micro_batch_size * seq_length); "
        "set global_batch_packing.row_length, or raise train.micro_batch_size")


def choose_row_length(samplers: Sequence, *, num_micro_batches: int, sizes: SampleSizes, steps: int,
                      align_to: int = 1, upper: int | None = None, cost: SampleCost | None = None,
                      seed: int = 0, cycle: bool = False) -> int:
    """:func:`row_length_for_steps` of the run's first ``steps`` steps as ``samplers`` (fresh per-rank
    copies, iterated here) draw them.

    Raises:
        ValueError: no step drawn, or the row would exceed ``upper``.
    """
    draws = run_draws(samplers, num_micro_batches, steps, cycle=cycle)
    if not len(draws):
        raise ValueError("choose_row_length: the samplers drew no complete step; check global_batch_size and the data")
    return row_length_for_steps(draws, sizes=sizes, dp_size=len(samplers), num_micro_batches=num_micro_batches,
                                align_to=align_to, upper=upper, cost=cost, seed=seed)


def micro_batch_slots(draws: torch.Tensor, *, sizes: SampleSizes, dp_size: int, num_micro_batches: int,
                      row_length: int, align_to: int = 1, cost: SampleCost | None = None, seed: int = 0,
                      most_steps: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The aligned slots of every micro-batch :func:`.policy.assign` forms in rows of ``row_length``, as the
    sampler places the steps of ``draws`` ``(S, N)``, with how many micro-batches of the run each stands for.

    Each distinct step (:func:`distinct_steps`) is placed once and weighs as many steps as repeat it; past
    ``most_steps`` distinct steps an evenly spaced ``most_steps`` of them stand for all (a run of 10^5 random
    steps is placed in seconds, not minutes).

    Returns:
        ``(slots, weights)``: ``(M,)`` int64 and ``(M,)`` float64; ``weights`` sums to ``S * rows``.
    """
    rows = dp_size * num_micro_batches
    if not len(draws):
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.float64)
    first, repeats = _step_classes(draws, sizes)
    picked = torch.arange(len(first)) if len(first) <= most_steps else torch.linspace(
        0, len(first) - 1, most_steps).round().long()
    chosen, weight = first[picked], repeats[picked].to(torch.float64)
    weight = weight * (len(draws) / float(weight.sum()))
    slots, weights = [], []
    for step, w in zip(chosen.tolist(), weight.tolist()):
        lengths = aligned_lengths(sizes.take(draws[step])[0], align_to).tolist()
        placement = _assign_step(sizes, draws[step], dp_size=dp_size, num_micro_batches=num_micro_batches,
                                 row_length=row_length, align_to=align_to, seed=seed, cost=cost)
        slots += [sum(lengths[i] for i in micro_batch) for rank in placement for micro_batch in rank]
        weights += [w] * rows
    return torch.tensor(slots, dtype=torch.int64), torch.tensor(weights, dtype=torch.float64)


def optimal_row_lengths(slots: torch.Tensor, weights: torch.Tensor | None = None, *, count: int, largest: int,
                        align_to: int = 1, grid: int = 2048) -> tuple[int, ...]:
    """At most ``count`` row lengths, ascending, the last ``largest``, that minimise the weighted slots of
    micro-batches each taking the smallest row that holds it (``layouts.row_bucket``): padding, for fixed
    real tokens.

    Exact over the candidate rows (a 1-D k-medians-like dynamic programme, ``O(count * C^2)``): every
    shorter row is some micro-batch's slots (a row between two of them wastes slots). Past ``grid``
    distinct slot counts the candidates are the slots rounded up to a grain of ``largest / grid``
    (a multiple of ``align_to``), which costs at most that grain per micro-batch.

    Args:
        slots: ``(M,)`` each micro-batch's aligned slots, at most ``largest``.
        weights: ``(M,)`` how many micro-batches each stands for (default 1 each).
        count: the most rows (``count - 1`` below ``largest``); 1 gives ``(largest,)``.
    """
    check_int("count", count)
    slots = torch.as_tensor(slots, dtype=torch.int64).reshape(-1)
    if count == 1 or slots.numel() == 0:
        return (largest,)
    if int(slots.max()) > largest:
        raise ValueError(f"slots: a micro-batch of {int(slots.max())} slots does not fit the largest row ({largest})")
    weights = torch.ones(slots.numel(), dtype=torch.float64) if weights is None else torch.as_tensor(
        weights, dtype=torch.float64).reshape(-1)
    values, inverse = torch.unique(slots, return_inverse=True)
    if len(values) > grid:
        grain = round_up(ceil_div(largest, grid), align_to)
        values, inverse = torch.unique(torch.clamp(round_up(slots, grain), max=largest), return_inverse=True)
    mass = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, weights)
    m = len(values)
    v = values.to(torch.float64)
    n = torch.cat([torch.zeros(1, dtype=torch.float64), mass.cumsum(0)])  # (m + 1,) micro-batches below
    s = torch.cat([torch.zeros(1, dtype=torch.float64), (mass * v).cumsum(0)])  # (m + 1,) their slots
    i, j = torch.arange(m + 1)[:, None], torch.arange(m + 1)[None, :]
    # group(i, j): the micro-batches of values[i:j] in one row of values[j - 1] slots; its padding.
    group = v[(j - 1).clamp(min=0)] * (n[j] - n[i]) - (s[j] - s[i])
    group = torch.where(i < j, group, torch.inf)
    final = largest * (n[m] - n) - (s[m] - s)  # (m + 1,) values[i:] in the largest row
    # bests[k][j]: the least padding of values[:j] in k rows below the largest; choices[k - 1][j]: where its last
    # row's group starts.
    bests = [torch.cat([torch.zeros(1, dtype=torch.float64), torch.full((m,), torch.inf, dtype=torch.float64)])]
    choices = []
    for _ in range(count - 1):
        best, came_from = (bests[-1][:, None] + group).min(dim=0)
        bests.append(best)
        choices.append(came_from)
    totals = [float((best + final).min()) for best in bests]
    k = min(range(len(totals)), key=lambda k: (totals[k], k))  # ties: fewer rows
    cut, rows = int(torch.argmin(bests[k] + final)), []
    for k in range(k, 0, -1):
        rows.append(int(values[cut - 1]))
        cut = int(choices[k - 1][cut])
    return tuple(sorted(set(rows) | {largest}))


def row_buckets_for_runs(runs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, count: int, largest: int,
                         align_to: int = 1) -> tuple[int, ...]:
    """:func:`optimal_row_lengths` over several loaders' :func:`micro_batch_slots` together (one set of rows
    serves training and evaluation alike)."""
    runs = [run for run in runs if len(run[0])]
    if not runs:
        return (largest,)
    return optimal_row_lengths(torch.cat([slots for slots, _ in runs]), torch.cat([w for _, w in runs]),
                               count=count, largest=largest, align_to=align_to)
