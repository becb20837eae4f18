"""Global-batch packing inside Megatron-Bridge's training loop. Reasoning: docs/batching.md.

The mechanism is the **batch sampler**: Megatron-Bridge 0.6.2 builds each data loader with its own
per-rank sampler (``data/samplers.py``: ``MegatronPretrainingSampler`` for
``dataloader_type="single"``, ``MegatronPretrainingRandomSampler`` for ``"cyclic"``). After it has
built them (``data/loaders.py``, ``build_train_valid_test_data_loaders``), each loader is rebuilt
around a :class:`.sampler.GlobalBatchSampler` that draws every step from copies of that very
sampler, one per DP rank, and yields this rank's micro-batches of the placement. The dataset, the
collate, the workers and the resume point (``consumed_samples``) are Megatron-Bridge's own; the
steps and their samples are the ones its sampler draws; only their placement changes.

``configure(cfg, layout, global_batch_packing=GlobalBatchPacking(...))`` stores the setting as
``cfg.dataset.global_batch_packing`` and applies :func:`loader_patch` once for the process (a
:class:`megatron.bridge_thd.patches.Patch` of ``loaders.build_train_valid_test_data_loaders``, a
no-op for a config without the setting).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.bridge_thd.patches import Patch

__all__ = ["GlobalBatchPacking", "loader_patch", "global_batch_loader"]

logger = logging.getLogger(__name__)


@dataclass
class GlobalBatchPacking:
    """The run's global-batch packing setting (``cfg.dataset.global_batch_packing``).

    Attributes:
        cost_model: what a sample costs: a planner preset name (``"qwen3-vl-8b"``), a Hugging Face
            ``config.json`` path or a ``plan.presets.ModelSpec``; None balances on VERL's
            tokens-and-attention proxy ``s + s^2 / 24576`` (no vision term).
        row_length: ``thd_static``: the run's fixed row in slots; None: chosen from the lengths scan
            when the loader is built (written back here, where the step reads it). ``thd``: the most
            slots a micro-batch may take; None: ``micro_batch_size * seq_length``.
        sizes_cache: directory for the one-time lengths scan (default ``~/.cache/bridge_thd/sizes``).
        seed: tie-breaking seed of the placement.
        log: one log line per step on global rank 0 (real tokens, padding, per-rank imbalance).
    """

    cost_model: Any = None
    row_length: int | None = None
    sizes_cache: str | None = None
    seed: int = 0
    log: bool = True


def _alignment(cfg) -> int:
    from megatron.bridge_thd.layouts import thd_alignment

    model = cfg.model
    return thd_alignment(getattr(model, "tensor_model_parallel_size", 1) or 1,
                         getattr(model, "context_parallel_size", 1) or 1,
                         sequence_parallel=bool(getattr(model, "sequence_parallel", False)),
                         fp8=bool(getattr(model, "fp8", None)))


def global_batch_loader(loader, *, settings: GlobalBatchPacking, cfg, dp_rank: int, dp_size: int,
                        global_batch_size: int, micro_batch_size: int, steps: int, choose_row: bool,
                        label: str = "train"):
    """Megatron-Bridge's ``loader`` rebuilt around a :class:`.sampler.GlobalBatchSampler` (same dataset,
    collate, workers); ``choose_row``: pick ``settings.row_length`` from this loader's draws."""
    from torch.utils.data import DataLoader

    from megatron.bridge_thd.batching.cost import sample_cost
    from megatron.bridge_thd.batching.sampler import GlobalBatchSampler, choose_row_length, is_global_rank_zero, rank_samplers
    from megatron.bridge_thd.batching.sizes import dataset_sizes
    from megatron.bridge_thd.packing import round_up

    inner = loader.batch_sampler
    if type(inner).__name__ not in ("MegatronPretrainingSampler", "MegatronPretrainingRandomSampler"):
        raise ValueError(
            f"dataset.dataloader_type: global-batch packing draws from Megatron-Bridge's 'single' / 'cyclic' samplers, "
            f"but this loader's sampler is {type(inner).__name__}")
    num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
    seq_length = cfg.model.seq_length
    align = _alignment(cfg)
    static = getattr(cfg.dataset, "packing_layout", "thd") == "thd_static"
    sizes = dataset_sizes(loader.dataset, loader.collate_fn, seq_length=seq_length,
                          cache_dir=Path(settings.sizes_cache) if settings.sizes_cache else None)
    cost = sample_cost(settings.cost_model) if settings.cost_model is not None else None
    capacity = micro_batch_size * round_up(seq_length, align)
    if static and settings.row_length is None and choose_row:
        settings.row_length = choose_row_length(rank_samplers(inner, dp_size), num_micro_batches=num_micro_batches,
                                                sizes=sizes, steps=steps, align_to=align, upper=capacity,
                                                cost=cost, seed=settings.seed)
        if is_global_rank_zero():
            logger.info("bridge_thd.batching: thd_static row fixed at %d slots for the run (micro_batch_size * seq_length "
                        "= %d; lengths from %s)", settings.row_length, capacity, sizes.source)
    row_length = settings.row_length if settings.row_length is not None else capacity
    sampler = GlobalBatchSampler(rank_samplers(inner, dp_size), dp_rank=dp_rank, num_micro_batches=num_micro_batches,
                                 row_length=row_length, sizes=sizes, static_row=static, align_to=align,
                                 seed=settings.seed, cost=cost, log=settings.log, label=label)
    return DataLoader(loader.dataset, batch_sampler=sampler, num_workers=loader.num_workers,
                      pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
                      persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn)


def _wrap(original):
    """``build_train_valid_test_data_loaders`` that rebuilds its loaders around the placement when
    ``cfg.dataset.global_batch_packing`` is set, and is the original otherwise."""

    def build_train_valid_test_data_loaders(cfg, train_state, *args, **kwargs):
        loaders = original(cfg, train_state, *args, **kwargs)
        settings = getattr(cfg.dataset, "global_batch_packing", None)
        if settings is None:
            return loaders
        import torch

        dp_group = kwargs.get("dp_group", args[1] if len(args) > 1 else None)
        eval_group = kwargs.get("eval_dp_group") or dp_group
        train, valid, test = loaders
        mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
        eval_mbs = getattr(cfg.validation, "eval_micro_batch_size", None) or mbs
        eval_gbs = getattr(cfg.validation, "eval_global_batch_size", None) or gbs
        eval_iters = getattr(cfg.validation, "eval_iters", 0) or 0
        rank, size = torch.distributed.get_rank(group=dp_group), torch.distributed.get_world_size(group=dp_group)
        erank, esize = torch.distributed.get_rank(group=eval_group), torch.distributed.get_world_size(group=eval_group)
        steps = max(cfg.train.train_iters - train_state.step, 1)
        if train is not None:
            train = global_batch_loader(train, settings=settings, cfg=cfg, dp_rank=rank, dp_size=size,
                                        global_batch_size=gbs, micro_batch_size=mbs, steps=steps, choose_row=True)
        if valid is not None:
            valid = global_batch_loader(valid, settings=settings, cfg=cfg, dp_rank=erank, dp_size=esize,
                                        global_batch_size=eval_gbs, micro_batch_size=eval_mbs, steps=eval_iters,
                                        choose_row=train is None, label="valid")
        if test is not None:
            test = global_batch_loader(test, settings=settings, cfg=cfg, dp_rank=erank, dp_size=esize,
                                       global_batch_size=eval_gbs, micro_batch_size=eval_mbs, steps=eval_iters,
                                       choose_row=train is None and valid is None, label="test")
        return train, valid, test

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
            from megatron.bridge.data import loaders
        except ImportError as error:
            raise ValueError(
                f"global_batch_packing: Megatron-Bridge's data loaders cannot be imported here ({error}); global-batch "
                "packing wraps megatron.bridge.data.loaders.build_train_valid_test_data_loaders") from error
        _LOADER_PATCH = Patch(
            loaders, "build_train_valid_test_data_loaders", _wrap(loaders.build_train_valid_test_data_loaders),
            "global-batch packing rebuilds Megatron-Bridge's data loaders around a batch sampler that places each "
            "step's draws (megatron.bridge_thd.batching.bridge)")
    return _LOADER_PATCH
