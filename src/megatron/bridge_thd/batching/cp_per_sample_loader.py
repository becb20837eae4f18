"""The loaders of a CP size per sample inside Megatron-Bridge's training loop (docs/cp-per-sample.md).

Megatron-Core's hybrid-CP schedule (``hybrid_context_parallel_forward_backward``) reads **one item per step** from
the data iterator: ``({row id: row batch}, row id groups)``. These loaders yield exactly that, built from Megatron-
Bridge's own pieces, as global-batch packing builds its loaders (:mod:`.bridge`):

* the steps and their samples are the ones Megatron-Bridge's sampler draws (copies of it, one per DP x CP rank,
  :func:`.sampler.step_draws`), from its resume point;
* each step is placed from the scanned sizes by the run's :class:`StepPlacer`, chosen once from
  ``CPPerSample.placement``: :func:`.cp_per_sample.place_with_cp_per_sample` (Megatron-Core's ``BalancedCPScheduler``) or
  :func:`.time_placement.place_by_time` (the time model), identically on every rank, so no rank sends another a
  sample;
* every rank loads the **whole** samples of its rows through Megatron-Bridge's dataset and collates each row with
  its collate (tokens, labels, masks, pixels, grids: a sample moves with everything it owns), in the loader's
  workers, with its pinned memory.

The placement travels with the data: the batch sampler yields :class:`RowKey` s, the dataset wrapper returns each
sample with its key, and the collate groups them by row, so prefetching workers cannot mix up rows and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from megatron.bridge_thd.batching.cp_per_sample import CPPerSamplePlacement, place_with_cp_per_sample
from megatron.bridge_thd.batching.sampler import step_draws
from megatron.bridge_thd.batching.sizes import SampleSizes, is_global_rank_zero
from megatron.bridge_thd.batching.time_placement import RowPricer, place_by_time, works_from_sizes
from megatron.bridge_thd.overlong import IndexedSample, OverlongCollate

__all__ = ["RowKey", "StepPlacer", "CPRowSampler", "RowDataset", "RowCollate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowKey:
    """One sample of a step's row, as the batch sampler hands it to the loader.

    Attributes:
        index: the dataset index.
        row: the row's id in the step (its position in the placement's rows).
        groups: the step's row id groups, ``[group][rank] -> row ids`` (the same tuple in every key of a step).
    """

    index: int
    row: int
    groups: tuple[tuple[tuple[int, ...], ...], ...]


@dataclass(frozen=True)
class StepPlacer:
    """How the run places each step under a CP size per sample, decided once (:meth:`of`); the per-step path only
    calls it.

    Attributes:
        world: the DP x CP world size.
        max_tokens_per_rank: ``CPPerSample.max_tokens_per_rank``.
        pricer: the time model (``placement="time"``: :func:`.time_placement.place_by_time`), or None (Megatron-Core's
            ``BalancedCPScheduler``).
    """

    world: int
    max_tokens_per_rank: int
    pricer: object = None

    @classmethod
    def of(cls, settings, *, world: int, cost_model=None, tp: int = 1, ep: int = 1) -> "StepPlacer":
        """The placer ``settings`` (a :class:`~megatron.bridge_thd.settings.CPPerSample`) names on a world of
        ``world`` DP x CP ranks; ``cost_model``: ``global_batch_packing.cost_model`` (read when ``settings.model`` is
        None); ``tp`` / ``ep``: the run's tensor- and expert-parallel sizes (the time model's)."""
        if settings.placement == "megatron":
            return cls(world, settings.max_tokens_per_rank)
        model = settings.model if settings.model is not None else cost_model
        return cls(world, settings.max_tokens_per_rank, RowPricer.of(model, settings.gpu, tp=tp, ep=ep))

    def __call__(self, lengths, patches=None, patches_squared=None) -> CPPerSamplePlacement:
        """One step's placement from its samples' sizes: ``(n,)`` tokens, ViT patches and patches^2 summed over each
        sample's images (``SampleSizes.take``)."""
        if self.pricer is None:
            return place_with_cp_per_sample(lengths, world=self.world, max_tokens_per_rank=self.max_tokens_per_rank)
        return place_by_time(works_from_sizes(lengths, patches, patches_squared), world=self.world,
                             max_tokens_per_rank=self.max_tokens_per_rank, pricer=self.pricer)


class CPRowSampler:
    """Yields, per step, this rank's :class:`RowKey` s: the samples of every row the rank runs.

    Args:
        samplers: one Megatron-Bridge batch sampler per DP x CP rank (:func:`.sampler.rank_samplers`).
        rank: this rank's DP x CP index.
        num_micro_batches: micro-batches per rank per step in Megatron-Bridge's own placement (a step draws
            ``num_micro_batches * micro_batch_size`` samples per rank).
        sizes: every dataset sample's sizes (the sizes placed by).
        placer: the run's :class:`StepPlacer` (its world is ``len(samplers)``).
        cycle: the loop re-iterates this loader (:func:`.sampler.cycles`).
        label: which loader (errors, log).
        log: one line per step on global rank 0.
        first_step: the run's number of the first step drawn (``consumed_samples // global batch + 1`` after a
            resume, as :class:`.sampler.GlobalBatchSampler` numbers them), for the log.

    Attributes:
        step: the run's number of the next step placed.
    """

    def __init__(self, samplers: Sequence, *, rank: int, num_micro_batches: int, sizes: SampleSizes,
                 placer: StepPlacer, cycle: bool = False, label: str = "train", log: bool = True,
                 first_step: int = 1):
        if placer.world != len(samplers):
            raise ValueError(f"CPRowSampler: the placer's world ({placer.world}) is not the {len(samplers)} samplers")
        self.samplers, self.rank, self.num_micro_batches = list(samplers), rank, num_micro_batches
        self.sizes, self.placer, self.cycle = sizes, placer, cycle
        self.label, self.log, self.step = label, log, first_step

    def __len__(self) -> int:
        return len(self.samplers[self.rank]) // self.num_micro_batches

    def keys(self, drawn: list[int]) -> list[RowKey]:
        """This rank's keys for one step's draws."""
        lengths, patches, squared = (t.tolist() for t in self.sizes.take(torch.tensor(drawn, dtype=torch.int64)))
        placement = self.placer(lengths, patches, squared)
        groups = tuple(tuple(tuple(ids) for ids in ranks) for ranks in placement.row_id_groups())
        if self.log and is_global_rank_zero():
            sizes = placement.cp_size_of()
            priced = ("" if placement.step_s is None else f"; priced {placement.step_s * 1e3:.1f} ms, busy max / mean "
                      f"{placement.imbalance:.3f}" + (f" ({placement.reason})" if placement.reason else ""))
            logger.info(
                "bridge_thd CP per sample (%s): step %d: %d samples in %d rows, %d groups; samples per CP size %s "
                "(placement %s%s)", self.label, self.step, len(drawn), len(placement.rows), placement.groups,
                {k: list(sizes.values()).count(k) for k in sorted(set(sizes.values()))}, placement.placed_by, priced)
        self.step += 1
        return [RowKey(drawn[sample], row_id, groups) for row_id, row in enumerate(placement.rows)
                if self.rank in row.ranks for sample in row.samples]

    def __iter__(self) -> Iterator[list[RowKey]]:
        for drawn in step_draws(self.samplers, self.num_micro_batches, cycle=self.cycle):
            yield self.keys(drawn)


class RowDataset:
    """Megatron-Bridge's dataset read by :class:`RowKey`: each sample with its key."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key: RowKey):
        return key, self.dataset[key.index]


class RowCollate:
    """One step's item for Megatron-Core's hybrid-CP schedule: each row's samples collated whole by Megatron-Bridge's
    collate (``collate_fn``), keyed by row id, with the step's row id groups. Runs in the loader's workers."""

    def __init__(self, collate_fn: Callable):
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[RowKey, object]]) -> tuple[dict[int, dict], list[list[list[int]]]]:
        # The over-long rule's collate (overlong.OverlongCollate) names refused samples by dataset index.
        indexed = isinstance(self.collate_fn, OverlongCollate)
        rows: dict[int, list] = {}
        for key, sample in items:
            rows.setdefault(key.row, []).append(IndexedSample(key.index, sample) if indexed else sample)
        groups = [[list(ids) for ids in ranks] for ranks in items[0][0].groups]
        return {row: self.collate_fn(samples) for row, samples in rows.items()}, groups
