"""Megatron-Bridge's FLOPs accounting fed as its own step feeds it, with the packed row's real boundaries
(``training/utils/flop_utils``), what it takes decided once. Everything stays on the device: no host
synchronisation."""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch

from megatron.bridge_thd.upstream.loading import load_flop_utils
from megatron.bridge_thd.upstream.line import upstream_line

__all__ = ["accumulate_flops", "accumulate_no_flops"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _FlopFeed:
    """What the installed Megatron-Bridge's FLOPs accounting takes, decided once (not per micro-batch)."""

    flop_utils: Any  # training/utils/flop_utils
    takes_unpadded: bool  # accumulate_flops_metadata takes cu_seqlens_unpadded
    takes_patch_stats: bool  # vision_patch_stats, not num_vision_patches (upstream_line.flops_vision_patch_stats)


@functools.lru_cache(maxsize=1)
def _flop_feed() -> _FlopFeed | None:
    """The installation's FLOPs helpers and what they take, or None when it has none."""
    try:
        flop_utils = load_flop_utils()
    except ImportError as exc:  # an installation without the FLOPs helpers: nothing to feed
        logger.warning("bridge_thd: Megatron-Bridge's flop_utils cannot be loaded (%s); FLOPs not reported", exc)
        return None
    takes_unpadded = "cu_seqlens_unpadded" in inspect.signature(flop_utils.accumulate_flops_metadata).parameters
    return _FlopFeed(flop_utils, takes_unpadded, upstream_line().flops_vision_patch_stats)


def _vision_flops_feed(feed: _FlopFeed, forward_args: dict, spatial_merge_size: int) -> dict:
    """The vision term, as the installed Megatron-Bridge's own step feeds it (``feed.takes_patch_stats``):
    ``vision_patch_stats`` (patch sum, squared sum per frame, merged tokens, summed over the image and video grids by
    its ``vision_patch_stats_from_grid_thw``; zeros without media, so that every data-parallel rank enters the
    trainer's reduction), or ``num_vision_patches`` (``sum(t * h * w)``, None without media) where it takes no stats."""
    grids = [grid for grid in (forward_args.get("image_grid_thw"), forward_args.get("video_grid_thw"))
             if grid is not None and grid.numel() > 0]
    if feed.takes_patch_stats:
        stats = (0, 0, 0)
        for grid in grids:
            delta = feed.flop_utils.vision_patch_stats_from_grid_thw(grid, spatial_merge_size=spatial_merge_size)
            stats = tuple(total + part for total, part in zip(stats, delta, strict=True))
        return dict(vision_patch_stats=stats)
    patches = None
    for grid in grids:
        count = grid.prod(dim=-1).sum()
        patches = count if patches is None else patches + count
    return dict(num_vision_patches=patches)


def accumulate_flops(state, model, forward_args: dict, spatial_merge_size: int = 2) -> None:
    """Feed Megatron-Bridge's FLOPs accounting as its own step does, with the real boundaries.

    ``training/utils/flop_utils.accumulate_flops_metadata`` adds, per micro-batch, the token
    slots the model processes (``tokens.shape[0] * tokens.shape[1]``: the THD row, or the padded
    ``B * W``) for the linear terms, the attention term ``sum(s_i^2)`` over the real segment
    lengths (it prefers ``cu_seqlens_unpadded``), and the vision term (:func:`_vision_flops_feed`).
    The trainer resets and reads these ``state._flops_*`` accumulators every step. Everything
    stays on the device: no host synchronisation.
    """
    feed = _flop_feed()
    if feed is None:
        return
    params = forward_args.get("packed_seq_params")
    kwargs = dict(vp_stage=feed.flop_utils.get_model_chunk_vp_stage(model),
                  **_vision_flops_feed(feed, forward_args, spatial_merge_size))
    if params is not None:
        kwargs["cu_seqlens"] = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if feed.takes_unpadded:
            kwargs["cu_seqlens_unpadded"] = params.cu_seqlens_q
    feed.flop_utils.accumulate_flops_metadata(state, forward_args["input_ids"], **kwargs)


def accumulate_no_flops(state, model, forward_args: dict) -> None:
    """Enter the trainer's FLOPs reduction with nothing: a rank of a row's CP group other than its first (CP per
    sample). Megatron-Bridge sums the step's accumulators over every DP rank (under hybrid CP every DP x CP rank) and
    all-reduces only where a THD feed asked for it (``_flops_requires_global_reduce``), so every rank must feed, and
    only one rank per row may count the row. Fed as an empty THD micro-batch: no token slots, one empty segment, no
    vision."""
    feed = _flop_feed()
    if feed is None:
        return
    tokens = forward_args["input_ids"][:, :0]
    empty = tokens.new_zeros(2, dtype=torch.int32)
    kwargs = dict(vp_stage=feed.flop_utils.get_model_chunk_vp_stage(model), cu_seqlens=empty,
                  **_vision_flops_feed(feed, {}, 1))
    if feed.takes_unpadded:
        kwargs["cu_seqlens_unpadded"] = empty
    feed.flop_utils.accumulate_flops_metadata(state, tokens, **kwargs)
