"""Global-batch packing inside Megatron-Bridge's training loop. Reasoning: docs/batching.md.

The mechanism is the **batch sampler**: Megatron-Bridge builds each data loader with its own
per-rank sampler (``data/samplers.py``: ``MegatronPretrainingSampler`` for
``dataloader_type="single"``, ``MegatronPretrainingRandomSampler`` for ``"cyclic"``). After it has
built them (``data/loaders.py``, ``build_train_valid_test_data_loaders``), each loader is rebuilt
around a :class:`.sampler.GlobalBatchSampler` that draws every step from copies of that very
sampler, one per DP rank, and yields this rank's micro-batches of the placement. The dataset, the
collate, the workers and the resume point (``consumed_samples``) are Megatron-Bridge's own; the
steps and their samples are the ones its sampler draws; only their placement changes.

``configure(cfg, layout, global_batch_packing=GlobalBatchPacking(...))`` stores the setting as
the settings' ``global_batch_packing`` and applies :func:`loader_patch` once for the process (a
:class:`megatron.bridge_thd.upstream.patches.Patch` of ``loaders.build_train_valid_test_data_loaders``, a
no-op for a config without the setting).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from megatron.bridge_thd.batching.cp_per_sample import check_fits_the_world
from megatron.bridge_thd.batching.cp_per_sample_loader import CPRowSampler, RowCollate, RowDataset, StepPlacer
from megatron.bridge_thd.batching.sampler import (GlobalBatchSampler, cycles, first_unfit_step, micro_batch_slots,
                                                  rank_samplers, row_buckets_for_runs, row_length_for_steps, run_draws)
from megatron.bridge_thd.batching.sizes import dataset_sizes, file_sizes, is_global_rank_zero, read_cached_sizes
from megatron.bridge_thd.cost.sample import sample_cost
from megatron.bridge_thd.overlong import IndexedDataset, OverlongCollate
from megatron.bridge_thd.packing import round_up
from megatron.bridge_thd.packing_log import clear_placements, record_placement
from megatron.bridge_thd.rules.registry import LOADERS
from megatron.bridge_thd.rules.run import refuse
from megatron.bridge_thd.rules.rows import row_buckets
from megatron.bridge_thd.rules.setup import Setup, read_setup
from megatron.bridge_thd.settings import GlobalBatchPacking, holds_settings, settings_of
from megatron.bridge_thd.step.plan import ROWS_ATTRIBUTE, GlobalBatchRows, StaticRow
from megatron.bridge_thd.upstream.patches import Patch

__all__ = ["loader_patch", "global_batch_loader", "cp_per_sample_loader", "plan_loader", "run_row_length",
           "run_row_buckets", "run_static_rows", "check_overlong", "measure_overlong_samples", "with_sample_indices",
           "shared_sizes", "check_ranks_agree", "LoaderPlan"]

logger = logging.getLogger(__name__)


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _node_scanner() -> bool:
    """The rank that scans for its node: ``LOCAL_RANK`` 0 (torchrun sets it); without it every rank
    counts as its own node's."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def _any_rank(flag: bool) -> bool:
    flags = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(flags, bool(flag))
    return any(flags)


def _scan_once_per_node(path, scan):
    """``dataset_sizes``'s ``share``: global rank 0 scans into ``path`` while the others wait; then the
    first rank (``LOCAL_RANK`` 0) of each node that still cannot see the file scans; every rank reads it."""
    if torch.distributed.get_rank() == 0 and not path.is_file():
        scan()
    torch.distributed.barrier()
    if _any_rank(not path.is_file()):
        if not path.is_file() and _node_scanner():
            scan()
        torch.distributed.barrier()
    sizes = read_cached_sizes(path)
    if sizes is None:
        raise ValueError(f"global_batch_packing.sizes_cache: {path} is missing on this rank after its node's scan; "
                         "set global_batch_packing.sizes_cache to a directory every rank of a node shares")
    return sizes


def shared_sizes(loader, *, seq_length: int, cache_dir: str | None, label: str):
    """Every sample's sizes for ``loader``'s dataset, the same on every rank: metadata when the dataset
    has it; otherwise the cache, scanned once per node (:func:`_scan_once_per_node`) in loader worker
    processes started as the loader's are. Every rank calls it, in the same order of loaders."""
    return dataset_sizes(loader.dataset, loader.collate_fn, seq_length=seq_length, cache_dir=cache_dir,
                         num_workers=loader.num_workers or 0, context=loader.multiprocessing_context,
                         label=f" ({label} loader)",
                         share=_scan_once_per_node if _distributed() else None)


def check_ranks_agree(sizes, *, label: str) -> None:
    """Refuse to train when the ranks' sizes differ (each rank places every step from its own, so they
    would train different samples): one digest all-gathered; on a mismatch the sizes themselves, to
    name the first sample that differs and each rank's value."""
    if not _distributed():
        return
    world = torch.distributed.get_world_size()
    digests = [None] * world
    torch.distributed.all_gather_object(digests, sizes.digest())
    if len(set(digests)) == 1:
        return
    tables = [None] * world
    torch.distributed.all_gather_object(tables, (sizes.lengths.tolist(), sizes.patches.tolist(), len(sizes)))
    reference = tables[0]
    for rank, table in enumerate(tables):
        if table == reference:
            continue
        if table[2] != reference[2] or len(table[0]) != len(reference[0]):
            detail = f"rank 0 has {reference[2]} samples, rank {rank} {table[2]}"
        else:
            sample = next(i for i in range(len(table[0]))
                          if (table[0][i], table[1][i]) != (reference[0][i], reference[1][i]))
            detail = (f"dataset sample {sample}: rank 0 has {reference[0][sample]} tokens / {reference[1][sample]} "
                      f"patches, rank {rank} {table[0][sample]} / {table[1][sample]}")
        raise ValueError(
            f"global_batch_packing ({label} loader): the ranks disagree on the samples' sizes ({detail}); every rank "
            "places every step from its own sizes, so they would train other samples than Megatron-Bridge draws. "
            "Give every rank the same data and processor, or clear global_batch_packing.sizes_cache")
    raise ValueError(f"global_batch_packing ({label} loader): the ranks' size digests differ ({digests}); clear "
                     "global_batch_packing.sizes_cache")


def _listed(sizes, samples, *, with_supervised: bool = False) -> str:
    """``"i (n tokens), ..."`` for the first eight of ``samples`` (distinct sample indices), `` ...`` after more."""
    def one(i: int) -> str:
        extra = f", {int(sizes.supervised[i])} supervised, none before the cut" if with_supervised else ""
        return f"{i} ({int(sizes.untruncated[i])} tokens{extra})"

    return ", ".join(one(int(i)) for i in samples[:8].tolist()) + (" ..." if len(samples) > 8 else "")


def check_overlong(sizes, *, seq_length: int, policy: str | None, label: str) -> None:
    """The dataset's samples longer than ``seq_length`` before the collate's cut (the scan measured them), judged by
    the run's ``overlong_samples`` policy as the collate would judge them when drawn, but at build and by dataset
    index (docs/overlong-samples.md):

    * every policy: a sample with an image or video placeholder past the cut is refused;
    * ``"refuse"``: every over-long sample is refused;
    * ``"truncate"``: a sample whose every supervised token lies past the cut is refused;
    * otherwise the over-long samples are named once in the log (global rank 0): cut, or under ``"drop"`` dropped
      from the loss.
    """
    over = sizes.over(seq_length)
    if not len(over):
        return
    worst = int(sizes.untruncated[over].max())
    raise_to = f"raise dataset.seq_length and model.seq_length to at least {worst}"
    where = f"distinct sample(s) of the {label} dataset"
    if policy == "refuse":
        raise ValueError(
            f"overlong_samples='refuse': {len(over)} {where} are longer than seq_length={seq_length} before "
            f"Megatron-Bridge's collate would cut them: dataset samples {_listed(sizes, over)}. "
            f"{raise_to.capitalize()}, filter these samples, or set overlong_samples to 'truncate' or 'drop'")
    vision_cut = sizes.vision_cut_samples()
    if len(vision_cut):
        raise ValueError(
            f"overlong_samples={policy!r}: {len(vision_cut)} {where} have an image or video placeholder past "
            f"seq_length={seq_length}: dataset samples {_listed(sizes, vision_cut)}; the cut would leave the vision "
            f"tower's embeddings without their placeholders, under every overlong_samples policy. {raise_to.capitalize()}, "
            "lower the images' resolution (max_pixels), or filter these samples")
    emptied = sizes.supervision_cut_samples(seq_length)
    if policy == "truncate" and len(emptied):
        raise ValueError(
            f"overlong_samples='truncate': {len(emptied)} {where} have every supervised token past "
            f"seq_length={seq_length}: dataset samples {_listed(sizes, emptied, with_supervised=True)}; the cut would "
            "leave them nothing to train on (Megatron-Bridge's collate refuses them when drawn). Set "
            f"overlong_samples='drop' to keep them out of the loss, {raise_to}, or filter these samples")
    if is_global_rank_zero():
        lost = int((sizes.untruncated[over] - seq_length).sum())
        what = ("are dropped from the loss when drawn (overlong_samples='drop')" if policy == "drop" else
                f"are cut to it when drawn (overlong_samples={policy!r})")
        logger.warning("bridge_thd.batching (%s loader): %d %s longer than seq_length=%d %s: dataset samples %s; %d "
                       "real tokens over", label, len(over), where, seq_length, what, _listed(sizes, over), lost)


@dataclass
class LoaderPlan:
    """One loader of the run, as global-batch packing builds it: Megatron-Bridge's ``loader``, its
    sampler, the sizes, and the whole run's draws (``(S, N)``, from sample 0, whatever the resume
    point)."""

    label: str
    loader: Any
    sampler: Any
    dp_rank: int
    dp_size: int
    micro_batch_size: int
    num_micro_batches: int
    sizes: Any
    draws: Any


def plan_loader(loader, *, label: str, setup: Setup, settings: GlobalBatchPacking, dp_rank: int, dp_size: int,
                global_batch_size: int, micro_batch_size: int, steps: int) -> LoaderPlan:
    """Sizes (shared, checked across ranks) and the run's first ``steps`` draws of one loader (``setup``: the run's
    facts, for ``seq_length``, the over-long policy and the vision tower's spatial merge)."""
    inner = loader.batch_sampler
    # The rule global_batch_sampler refuses a dataloader_type without these samplers; this checks the argument.
    if type(inner).__name__ not in ("MegatronPretrainingSampler", "MegatronPretrainingRandomSampler"):
        raise TypeError(f"loader ({label}): its batch sampler is {type(inner).__name__}, not Megatron-Bridge's "
                        "MegatronPretrainingSampler / MegatronPretrainingRandomSampler")
    num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
    seq_length = setup.seq_length
    if label == "train" and settings.lengths_file is not None:
        sizes = file_sizes(settings.lengths_file, loader.dataset, seq_length=seq_length,
                           spatial_merge_size=setup.model.spatial_merge_size)
    else:
        sizes = shared_sizes(loader, seq_length=seq_length, cache_dir=settings.sizes_cache, label=label)
    check_ranks_agree(sizes, label=label)
    check_overlong(sizes, seq_length=seq_length, policy=setup.settings.overlong_samples, label=label)
    draws = run_draws(rank_samplers(inner, dp_size, from_start=True), num_micro_batches, max(steps, 1),
                      cycle=cycles(inner))
    return LoaderPlan(label, loader, inner, dp_rank, dp_size, micro_batch_size, num_micro_batches, sizes, draws)


def run_row_length(plans: list[LoaderPlan], *, settings: GlobalBatchPacking, align: int, capacity: int,
                   cost, static: bool) -> int:
    """The run's row: every loader's whole-run steps fit it.

    ``thd_static``: ``settings.row_length`` if set (refused, naming the loader and its step, when a step
    does not fit), else the smallest row at which every loader's steps fit (one static shape for
    training and evaluation alike). ``thd``: ``micro_batch_size * seq_length`` (``capacity``), checked.
    """
    def unfit(plan: LoaderPlan, row: int):
        if not len(plan.draws):
            return None
        return first_unfit_step(plan.draws, sizes=plan.sizes, dp_size=plan.dp_size,
                                num_micro_batches=plan.num_micro_batches, row_length=row, align_to=align, cost=cost,
                                seed=settings.seed)

    fixed = settings.row_length if static else None
    if static and fixed is None:
        rows = {plan.label: row_length_for_steps(plan.draws, sizes=plan.sizes, dp_size=plan.dp_size,
                                                 num_micro_batches=plan.num_micro_batches, align_to=align,
                                                 upper=capacity, cost=cost, seed=settings.seed, label=plan.label)
                for plan in plans if len(plan.draws)}
        row = max(rows.values())
        # One row for every loader: grow it until each loader's steps fit (placement is not monotone;
        # a loader whose own row this is was checked at it).
        while any(unfit(plan, row) is not None for plan in plans if rows.get(plan.label) != row):
            row = round_up(int(row * 1.005 + 1), align)
        if is_global_rank_zero():
            needs = ", ".join(f"{label} {value}" for label, value in rows.items())
            logger.info("bridge_thd.batching: thd_static row fixed at %d slots for the run (micro_batch_size * seq_length "
                        "= %d; each loader's whole run needs: %s; lengths from %s)", row, capacity, needs,
                        plans[0].sizes.source)
        return row
    row = fixed if fixed is not None else capacity
    for plan in plans:
        step = unfit(plan, row)
        if step is not None:
            setting = "global_batch_packing.row_length" if fixed is not None else "train.micro_batch_size"
            raise ValueError(
                f"global_batch_packing: step {step + 1} of the {plan.label} loader (dataset samples "
                f"{plan.draws[step].tolist()[:16]}...) does not fit {plan.dp_size * plan.num_micro_batches} rows of {row} "
                f"slots; raise {setting} (or leave row_length unset to choose it from the run's draws)")
    return row


def run_static_rows(plans: list[LoaderPlan], *, row_lengths, align: int, seq_length: int) -> tuple:
    """``thd_static``'s :class:`~megatron.bridge_thd.step.plan.StaticRow` for each of the run's ``row_lengths``
    (ascending): that many slots; as many segments as the most samples such a row can hold (the run's shortest
    drawn samples, aligned, until the row is full; at most a whole step), plus the tail; ``max_seqlen``
    ``round_up(seq_length, align)`` (a sample is at most ``seq_length`` long once collated), at most the row."""
    drawn = [plan.sizes.take(plan.draws.reshape(-1).unique())[0] for plan in plans if len(plan.draws)]
    slots = round_up(torch.cat(drawn), align).clamp(min=1).sort().values if drawn else torch.ones(1, dtype=torch.int64)
    filled = slots.cumsum(0)
    step_samples = max(plan.micro_batch_size * plan.num_micro_batches * plan.dp_size for plan in plans)
    rows = []
    for length in row_lengths:
        most = max(1, min(int((filled <= length).sum()), step_samples))
        rows.append(StaticRow(length=length, segments=most + 1, max_seqlen=min(length, round_up(seq_length, align))))
    return tuple(rows)


def run_row_buckets(plans: list[LoaderPlan], *, settings: GlobalBatchPacking, count: int, row_length: int, align: int,
                    cost) -> tuple[int, ...]:
    """``thd_static``'s rows for the run, ascending: ``row_length`` (every step fits it) and up to ``count - 1``
    shorter ones (``count``: ``rules.row_buckets``), chosen from how the sampler places every loader's whole-run
    steps in rows of ``row_length`` (:func:`.sampler.micro_batch_slots`, :func:`.sampler.row_buckets_for_runs`)."""
    if count == 1:
        return (row_length,)
    runs = [micro_batch_slots(plan.draws, sizes=plan.sizes, dp_size=plan.dp_size,
                              num_micro_batches=plan.num_micro_batches, row_length=row_length, align_to=align,
                              cost=cost, seed=settings.seed) for plan in plans]
    return row_buckets_for_runs(runs, count=count, largest=row_length, align_to=align)


def global_batch_loader(plan: LoaderPlan, *, settings: GlobalBatchPacking, row_length: int, static: bool, align: int,
                        cost, global_batch_size: int, row_lengths=None):
    """Megatron-Bridge's loader rebuilt around a :class:`.sampler.GlobalBatchSampler` (same dataset,
    collate, workers, pinned memory, prefetch); ``row_lengths``: ``thd_static``'s rows (the log's padding)."""
    loader, inner = plan.loader, plan.sampler
    sampler = GlobalBatchSampler(rank_samplers(inner, plan.dp_size), dp_rank=plan.dp_rank,
                                 num_micro_batches=plan.num_micro_batches, row_length=row_length, sizes=plan.sizes,
                                 static_row=static, align_to=align, seed=settings.seed, cost=cost, log=settings.log,
                                 label=plan.label, cycle=cycles(inner),
                                 first_step=inner.consumed_samples // global_batch_size + 1,
                                 planned_steps=len(plan.draws), row_lengths=row_lengths,
                                 on_step=_placement_recorder(plan.label))
    return _rebuilt(loader, loader.dataset, sampler, loader.collate_fn)


def _placement_recorder(label: str):
    """The training loader's per-step placement figures for the packing log (``packing_log.record_placement``: the
    ``packing/rank_cost_max_over_mean`` figure); None for the evaluation loaders."""
    if label != "train":
        return None
    clear_placements()  # a new run's training loader: the steps are numbered afresh
    return record_placement


def _rebuilt(loader, dataset, batch_sampler, collate_fn):
    """A ``DataLoader`` like Megatron-Bridge's ``loader`` (its workers, pinned memory, persistence, worker init, start
    method, timeout, prefetch) over ``dataset`` with ``batch_sampler`` and ``collate_fn``. A collate that judges
    over-long samples (``overlong.OverlongCollate``) gets each sample with its dataset index
    (``overlong.IndexedDataset``), to name refused samples by index and attach the indices for the step."""
    if isinstance(collate_fn, OverlongCollate) and not isinstance(dataset, IndexedDataset):
        dataset = IndexedDataset(dataset)
    extra = {} if not loader.num_workers else dict(prefetch_factor=loader.prefetch_factor)
    return DataLoader(dataset, batch_sampler=batch_sampler, num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory, collate_fn=collate_fn,
                      persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn,
                      multiprocessing_context=loader.multiprocessing_context, timeout=loader.timeout, **extra)


def cp_per_sample_loader(plan: LoaderPlan, *, cp_per_sample, global_batch_size: int, cost_model=None, tp: int = 1,
                   ep: int = 1, log: bool = True):
    """Megatron-Bridge's loader rebuilt for a CP size per sample (:mod:`.cp_per_sample_loader`): one item per step, this rank's
    rows of the step's placement (``cp_per_sample``, a :class:`~megatron.bridge_thd.settings.CPPerSample`: Megatron-Core's
    scheduler or ours on the time model, for ``cost_model`` / ``tp`` / ``ep``, chosen once here), each collated whole
    by the loader's collate (same dataset, workers, pinned memory, prefetch). A drawn sample longer than the whole DP
    x CP world holds is refused here, before training. Its log numbers the steps as the trainer does, from the
    sampler's resume point (``global_batch_size``: the loader's samples per step)."""
    max_tokens_per_rank = cp_per_sample.max_tokens_per_rank
    placer = StepPlacer.of(cp_per_sample, world=plan.dp_size, cost_model=cost_model, tp=tp, ep=ep)
    loader, inner = plan.loader, plan.sampler
    if len(plan.draws):
        drawn = plan.draws.reshape(-1).unique()
        check_fits_the_world(plan.sizes.take(drawn)[0].tolist(), world=plan.dp_size,
                             max_tokens_per_rank=max_tokens_per_rank, setting="cp_per_sample.max_tokens_per_rank",
                             names=[f"dataset sample {i} of the {plan.label} loader" for i in drawn.tolist()])
    sampler = CPRowSampler(rank_samplers(inner, plan.dp_size), rank=plan.dp_rank, num_micro_batches=plan.num_micro_batches,
                           sizes=plan.sizes, placer=placer, cycle=cycles(inner),
                           label=plan.label, log=log, first_step=inner.consumed_samples // global_batch_size + 1)
    return _rebuilt(loader, RowDataset(loader.dataset), sampler, RowCollate(loader.collate_fn))


def _log_rows(row_lengths: tuple[int, ...], count: int) -> None:
    if is_global_rank_zero():
        logger.info("bridge_thd.batching: thd_static rows for the run: %s slots (each micro-batch takes the shortest "
                    "that holds it; at most %d: global_batch_packing.row_buckets)",
                    ", ".join(str(length) for length in row_lengths), count)


def _run_steps(cfg) -> dict:
    """Steps each loader gives over the whole run: training ``train_iters``; validation one
    ``eval_iters`` per ``eval_interval`` plus the final one (Megatron-Bridge sizes its validation set
    the same way, ``loaders.get_train_valid_test_num_samples``); test ``eval_iters``."""
    train_iters = cfg.train.train_iters or 0
    eval_iters = cfg.validation.eval_iters or 0
    interval = cfg.validation.eval_interval
    valid = (train_iters // interval + 1) * eval_iters if interval else eval_iters
    return {"train": train_iters, "valid": valid, "test": eval_iters}


def measure_overlong_samples(loaders, policy: str, vision_token_ids: tuple[int, ...] = ()) -> None:
    """Each built loader's collate wrapped in ``overlong.OverlongCollate``: it measures every row before
    Megatron-Bridge's collate cuts it and applies the run's over-long ``policy`` (in the loader's workers)."""
    for loader in loaders:
        if loader is not None and not isinstance(loader.collate_fn, OverlongCollate):
            loader.collate_fn = OverlongCollate(loader.collate_fn, policy, vision_token_ids)


def with_sample_indices(loader):
    """``loader`` rebuilt (:func:`_rebuilt`: its own dataset, batch sampler and collate) so that its over-long
    collate gets dataset indices; a loader that is not a ``DataLoader`` with such a collate is returned as it is."""
    if not isinstance(loader, DataLoader) or not isinstance(loader.collate_fn, OverlongCollate):
        return loader
    return _rebuilt(loader, loader.dataset, loader.batch_sampler, loader.collate_fn)


def _global_batch_loaders(cfg, train_state, loaders, setup: Setup, *, dp_group, eval_group) -> tuple:
    """The loaders rebuilt around the placement (``setup``: the run's facts, its settings' ``global_batch_packing``
    set); under ``thd_static`` the run's rows go on Megatron-Bridge's ``train_state`` for the step's plan."""
    settings = setup.global_batch
    setup = replace(setup, dp=torch.distributed.get_world_size(group=dp_group))
    refuse(setup, LOADERS, "global_batch_packing: the loaders cannot be built")
    mbs, gbs = setup.micro_batch_size, setup.global_batch_size
    eval_mbs = cfg.validation.eval_micro_batch_size or mbs
    eval_gbs = cfg.validation.eval_global_batch_size or gbs
    groups = {"train": (dp_group, gbs, mbs), "valid": (eval_group, eval_gbs, eval_mbs),
              "test": (eval_group, eval_gbs, eval_mbs)}
    steps = _run_steps(cfg)
    plans = []
    for label, loader in zip(("train", "valid", "test"), loaders):
        if loader is None:
            continue
        group, global_batch, micro_batch = groups[label]
        plans.append(plan_loader(loader, label=label, setup=setup, settings=settings,
                                 dp_rank=torch.distributed.get_rank(group=group),
                                 dp_size=torch.distributed.get_world_size(group=group),
                                 global_batch_size=global_batch, micro_batch_size=micro_batch, steps=steps[label]))
    if not plans:
        return loaders
    if setup.settings.cp_per_sample is not None:
        built = {plan.label: cp_per_sample_loader(plan, cp_per_sample=setup.settings.cp_per_sample,
                                                  global_batch_size=groups[plan.label][1],
                                                  cost_model=settings.cost_model, tp=setup.tp, ep=setup.ep,
                                                  log=settings.log)
                 for plan in plans}
        return built.get("train"), built.get("valid"), built.get("test")
    align = setup.align  # the rules above refuse every layout but "thd" / "thd_static": every THD slot's alignment
    static = setup.layout == "thd_static"
    cost = sample_cost(settings.cost_model) if settings.cost_model is not None else None
    capacity = mbs * round_up(setup.seq_length, align)
    row = run_row_length(plans, settings=settings, align=align, capacity=capacity, cost=cost, static=static)
    row_lengths = None
    if static:
        count = row_buckets(setup)  # the setup judged above: layout "thd_static" here
        row_lengths = run_row_buckets(plans, settings=settings, count=count, row_length=row, align=align, cost=cost)
        _log_rows(row_lengths, count)
        # Where the step's plan reads the run's rows: Megatron-Bridge's runtime state, not the user's config.
        setattr(train_state, ROWS_ATTRIBUTE, GlobalBatchRows(run_static_rows(
            plans, row_lengths=row_lengths, align=align, seq_length=setup.seq_length)))
    built = {plan.label: global_batch_loader(plan, settings=settings, row_length=row, static=static, align=align,
                                             cost=cost, global_batch_size=groups[plan.label][1],
                                             row_lengths=row_lengths) for plan in plans}
    return built.get("train"), built.get("valid"), built.get("test")


def _wrap(original):
    """``build_train_valid_test_data_loaders`` whose loaders measure over-long samples when ``configure`` set the
    config up for our step (its settings record) and are rebuilt around the placement when
    the settings' ``global_batch_packing`` is set; the original otherwise."""

    def build_train_valid_test_data_loaders(cfg, train_state, *args, **kwargs):
        loaders = original(cfg, train_state, *args, **kwargs)
        if not holds_settings(cfg.dataset):
            return loaders
        run_settings = settings_of(cfg.dataset)
        # The run's facts, read once: Megatron-Bridge builds the loaders after its finalize(), the config is final. A
        # config without a model section has none (and no placeholder ids), which only global-batch packing needs.
        has_facts = cfg.model is not None or run_settings.global_batch_packing is not None
        setup = read_setup(cfg, run_settings.layout, settings=run_settings, final=True) if has_facts else None
        measure_overlong_samples(loaders, run_settings.overlong_samples, setup.model.vision_token_ids if setup else ())
        if run_settings.global_batch_packing is None:
            return tuple(with_sample_indices(loader) for loader in loaders)
        dp_group = kwargs.get("dp_group", args[1] if len(args) > 1 else None)
        return _global_batch_loaders(cfg, train_state, loaders, setup, dp_group=dp_group,
                                     eval_group=kwargs.get("eval_dp_group") or dp_group)

    build_train_valid_test_data_loaders.__wrapped__ = original
    build_train_valid_test_data_loaders.__doc__ = _wrap.__doc__
    return build_train_valid_test_data_loaders


_LOADER_PATCH: Patch | None = None


def loader_patch() -> Patch:
    """The one patch global-batch packing needs: Megatron-Bridge's ``data/loaders.py``
    ``build_train_valid_test_data_loaders``, as ``build_train_valid_test_data_iterators`` (same
    module) calls it, wrapped by :func:`_wrap`. One record per process, so that applying it again
    (``patches.apply_permanently``) changes nothing.

    Raises:
        ValueError: Megatron-Bridge cannot be imported here.
    """
    global _LOADER_PATCH
    if _LOADER_PATCH is None:
        try:
            from megatron.bridge.data import loaders  # Megatron-Bridge whole (Transformer Engine)
        except ImportError as error:
            raise ValueError(
                f"global_batch_packing: Megatron-Bridge's data loaders cannot be imported here ({error}); global-batch "
                "packing wraps megatron.bridge.data.loaders.build_train_valid_test_data_loaders") from error
        _LOADER_PATCH = Patch(
            loaders, "build_train_valid_test_data_loaders", _wrap(loaders.build_train_valid_test_data_loaders),
            "the loaders' collate measures over-long samples before its cut (megatron.bridge_thd.overlong), and "
            "global-batch packing rebuilds Megatron-Bridge's data loaders around a batch sampler that places each "
            "step's draws (megatron.bridge_thd.batching.bridge)")
    return _LOADER_PATCH
