"""Qwen3-VL 3D MRoPE positions, per sample, for any padding layout.

Qwen3-VL's rule (Hugging Face ``Qwen3VLModel.get_rope_index``, Megatron-Bridge
``modelling_qwen3_vl/rope.get_rope_index``), applied to the real tokens of each sample:

* a text token takes position p on all three channels (temporal, height, width), then p += 1;
* the ``t*h*w`` tokens of one image (or one video frame: Qwen3-VL separates frames with
  timestamp text, so a ``(t, h, w)`` video is t frames of ``(1, h, w)``) take
  ``(p + t_i, p + h_i, p + w_i)`` in raster order over the merged grid
  ``(t, h / merge, w / merge)``; afterwards p += max(h, w) / merge.

Every sample starts at 0. Two implementations of the one rule, chosen by where the data is:

* on the device (a batch already on the model's device: VERL, custom iterators): torch ops with no
  host synchronisation: every tensor is sized by the token batch or by the grids' row counts
  (videos are never expanded into a per-frame table, whose size ``sum(t)`` only a host read could
  give); the validity checks are deferred to the caller's read;
* on the host (``on_host=True``: the batch arrives on the host, as Megatron-Bridge's loader hands it,
  and the step copies the finished row to the device): NumPy over the vision tokens only, their
  indices read directly (a read of host memory is no synchronisation), in a handful of array
  operations, each far cheaper than a dispatched torch op on such small arrays.
Packed through ``pack_bshd_to_thd`` the result becomes ``(3, 1, N)`` positions that restart per
sample, never the degenerate 1D expansion (three equal channels) that silently drops the image
layout.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_2d, raise_failed_checks

__all__ = ["qwen3_vl_position_ids", "qwen3_vl_position_ids_deferred", "PADDING_POSITION"]

PADDING_POSITION = 0
"""Position written at padding positions (the value Hugging Face uses); attention never reads it."""


def _vision_positions(
    is_vision_token: torch.Tensor, grid_thw: torch.Tensor, spatial_merge_size: int, *, frames: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token layout of the vision items (images, or videos) of a batch.

    Items are consumed in order: row by row, left to right, as the vision tower emits them.

    With ``frames=True`` (videos) each ``(t, h, w)`` item is t frames of ``(1, h, w)``, each frame
    placed on its own like an image (Qwen3-VL separates frames with timestamp text). The frame of
    a token comes from its offset inside the video (``offset // (h' * w')``), never from a
    per-frame grid table: that table (``repeat_interleave(grid, grid[:, 0])``, as Hugging Face
    builds it) has ``sum(t)`` rows, a size only a host read of the grids can give. Every tensor
    here has the shape of the token batch or of the ``(K, 3)`` grid, both known on the host.

    Args:
        is_vision_token: ``(B, T)`` bool, real tokens of this modality.
        grid_thw: ``(K, 3)`` patch grid of each item.
        frames: place each temporal slice of an item separately (videos).

    Returns:
        offsets: ``(3, B, T)`` (t, h, w) of each token inside its item's (or frame's) merged grid
            (0 elsewhere).
        advance: ``(B, T)`` how far the item (frame) moves the text position, put on its last token.
        first_token: ``(B, T)`` bool, the first token of each item (frame).
        token_count_error: 0-dim bool, True when the tokens do not match the grids.
        With no grid at all the first three are None (nothing to add) and the error is "any token".
    """
    grid = grid_thw.to(device=is_vision_token.device, dtype=torch.int64)
    if len(grid) == 0:  # a shape, known on the host: no item of this modality, nothing to lay out
        return None, None, None, is_vision_token.any()
    merged = grid[:, 1:] // spatial_merge_size  # (K, 2): merged height, width
    tokens_per_frame = merged.prod(dim=1)
    tokens_per_item = grid[:, 0] * tokens_per_frame
    item_end = tokens_per_item.cumsum(0)
    # One row per item, gathered once per token: where the item starts, the unit laid out on the merged
    # grid (a whole item, or one frame of it), its merged height and width, and how far it moves the text.
    table = torch.stack([item_end - tokens_per_item, tokens_per_frame if frames else tokens_per_item,
                         merged[:, 0], merged[:, 1], merged.amax(dim=1)], dim=1)

    # rank: index of each token among the batch's tokens of this modality; item: which grid.
    rank = is_vision_token.flatten().cumsum(0).view_as(is_vision_token) - 1
    item = torch.searchsorted(item_end, rank.clamp(min=0), right=True).clamp(max=len(grid) - 1)
    start, unit, height, width, moves = table[item].unbind(-1)
    offset = rank - start
    if frames:
        offset = offset % unit  # offset inside the token's frame (the frame is offset // unit)
    offsets = torch.stack([offset // (height * width), offset // width % height, offset % width])
    offsets = torch.where(is_vision_token, offsets, 0)
    is_last = is_vision_token & (offset == unit - 1)
    advance = torch.where(is_last, moves, 0)
    first_token = is_vision_token & (offset == 0)
    token_count_error = is_vision_token.sum() != item_end[-1]
    return offsets, advance, first_token, token_count_error


def _orphan_items(input_ids: torch.Tensor, keep: torch.Tensor, item_first: torch.Tensor,
                  vision_start_token_id: int) -> torch.Tensor:
    """0-dim bool: some image or video (``item_first`` ``(B, T)``, its first tokens) does not follow a vision-start
    token. The token before an item is the previous *real* token: padding may sit anywhere."""
    columns = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    last_real = torch.where(keep, columns, -1).cummax(dim=1).values
    previous_real = torch.nn.functional.pad(last_real[:, :-1], (1, 0), value=-1)
    previous_token = torch.where(previous_real >= 0, input_ids.gather(1, previous_real.clamp(min=0)), -1)
    return (item_first & (previous_token != vision_start_token_id)).any()


def qwen3_vl_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    on_host: bool = False,
) -> torch.Tensor:
    """Qwen3-VL MRoPE positions of every sample of a padded batch.

    The arguments of :func:`qwen3_vl_position_ids_deferred`.

    Returns:
        ``(3, B, T)`` int64 positions (temporal, height, width); each sample starts at 0;
        padding positions hold :data:`PADDING_POSITION`.

    Raises:
        ValueError: when the placeholder tokens do not match the grids (an image cut by
            truncation, a missing grid) or an image does not follow a vision-start token. This
            check reads one summary tensor on the host.
    """
    positions, checks = qwen3_vl_position_ids_deferred(
        input_ids, attention_mask, image_grid_thw, video_grid_thw, image_token_id=image_token_id,
        video_token_id=video_token_id, vision_start_token_id=vision_start_token_id,
        spatial_merge_size=spatial_merge_size, on_host=on_host,
    )
    raise_failed_checks(checks)
    return positions


def qwen3_vl_position_ids_deferred(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    *,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    on_host: bool = False,
) -> tuple[torch.Tensor, list[DeferredCheck]]:
    """Qwen3-VL MRoPE positions of every sample of a padded batch, checks left to the caller.

    Args:
        input_ids: ``(B, T)`` token ids, image/video placeholders already expanded (one token
            per merged patch, as Qwen3-VL's processor emits them).
        attention_mask: ``(B, T)`` keep mask (bool, or 0 / 1 values) at any positions; None = all real.
        image_grid_thw: ``(I, 3)`` patch grids of the batch's images in order of appearance.
        video_grid_thw: ``(V, 3)`` patch grids of the batch's videos in order of appearance.
        image_token_id, video_token_id, vision_start_token_id: the model config's ids.
        spatial_merge_size: the vision config's patch merge size.
        on_host: compute with NumPy (every tensor on the CPU); the result is the same.

    Returns:
        positions: ``(3, B, T)`` int64 (temporal, height, width); each sample starts at 0;
            padding positions hold :data:`PADDING_POSITION`.
        checks: :class:`~megatron.bridge_thd.lengths.DeferredCheck` s, failed when the
            placeholder tokens do not match the grids (an image cut by truncation, a missing
            grid) or an image does not follow a vision-start token. No host read happens here:
            the step reads them with the packer's one read (or asserts them on the device).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected (B, T), got {tuple(input_ids.shape)}")
    if attention_mask is None:
        keep, mask_checks = torch.ones_like(input_ids, dtype=torch.bool), []
    else:  # the package's one 2D mask rule: bool, or 0 / 1 values (lengths.keep_mask_from_2d)
        keep, mask_checks = keep_mask_from_2d(attention_mask)
    if keep.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask: shape {tuple(keep.shape)} does not match input_ids {tuple(input_ids.shape)}"
        )
    is_image = keep & (input_ids == image_token_id)
    is_video = keep & (input_ids == video_token_id)
    empty_grid = torch.zeros(0, 3, dtype=torch.int64, device=input_ids.device)
    image_grids = empty_grid if image_grid_thw is None else image_grid_thw
    video_grids = empty_grid if video_grid_thw is None else video_grid_thw
    if on_host:
        positions, image_error, video_error, orphan_item = _positions_on_host(
            input_ids, keep, is_image, is_video, image_grids, video_grids, vision_start_token_id, spatial_merge_size)
    else:
        positions, image_error, video_error, orphan_item = _positions_on_device(
            input_ids, keep, is_image, is_video, image_grids, video_grids, vision_start_token_id, spatial_merge_size)
    return positions, mask_checks + _checks(is_image, is_video, image_grids, video_grids, image_error, video_error,
                                            orphan_item, vision_start_token_id, spatial_merge_size)


def _positions_on_device(input_ids, keep, is_image, is_video, image_grids, video_grids, vision_start_token_id,
                         spatial_merge_size):
    """Torch ops, no host read: ``(3, B, T)`` positions and the three 0-dim bool failure flags (image tokens vs
    grids, video tokens vs grids, an item without a vision-start token before it)."""
    image_offsets, image_advance, image_first, image_error = _vision_positions(
        is_image, image_grids, spatial_merge_size
    )
    video_offsets, video_advance, video_first, video_error = _vision_positions(
        is_video, video_grids, spatial_merge_size, frames=True
    )
    present = [part for part in ((image_offsets, image_advance, image_first), (video_offsets, video_advance,
                                                                                video_first)) if part[0] is not None]
    is_text = keep & ~is_image & ~is_video
    advance = is_text.long()
    for _, item_advance, _ in present:
        advance = advance + item_advance
    # Exclusive prefix sum: the position where each token's text run or vision item starts.
    positions = (advance.cumsum(dim=1) - advance).unsqueeze(0)
    for item_offsets, _, _ in present:
        positions = positions + item_offsets
    positions = torch.where(keep, positions, PADDING_POSITION).expand(3, -1, -1)

    firsts = [first for _, _, first in present]
    orphan_item = _orphan_items(input_ids, keep, firsts[0] if len(firsts) == 1 else firsts[0] | firsts[1],
                                vision_start_token_id) if firsts else keep.new_zeros(())
    return positions, image_error, video_error, orphan_item


def _host_items(is_vision: np.ndarray, grids: np.ndarray, merge: int, frames: bool):
    """The vision tokens of one modality laid out on the host.

    Args:
        is_vision: ``(B * T,)`` bool, the real tokens of this modality.
        grids: ``(K, 3)`` int64 patch grids.
        frames: place each temporal slice separately (videos).

    Returns:
        ``(index, offsets, last, moves, first, error)``: the flat indices ``(N,)`` of the tokens, their
        ``(3, N)`` (t, h, w) offsets, the flat indices of each unit's (item's or frame's) last token and how
        far it moves the text position, the flat indices of each unit's first token, and whether the
        tokens do not match the grids (then nothing else is laid out).
    """
    index = np.flatnonzero(is_vision)
    merged = grids[:, 1:] // merge
    per_frame = merged[:, 0] * merged[:, 1]
    per_item = grids[:, 0] * per_frame
    if len(index) != int(per_item.sum()):
        empty = np.zeros(0, dtype=np.int64)
        return empty, np.zeros((3, 0), dtype=np.int64), empty, empty, empty, True
    unit_length = per_frame if frames else per_item
    units = grids[:, 0] if frames else np.ones(len(grids), dtype=np.int64)
    unit_of_item = np.repeat(np.arange(len(grids)), units)  # (U,) the item of each unit
    unit_tokens = unit_length[unit_of_item]
    unit_end = np.cumsum(unit_tokens)
    unit_start = unit_end - unit_tokens
    token_unit = np.repeat(np.arange(len(unit_of_item)), unit_tokens)
    offset = np.arange(len(index)) - unit_start[token_unit]
    width = merged[unit_of_item, 1][token_unit]
    area = per_frame[unit_of_item][token_unit]
    offsets = np.stack([offset // area, offset % area // width, offset % width])
    moves = merged.max(axis=1)[unit_of_item]
    return index, offsets, index[unit_end - 1], moves, index[unit_start], False


def _positions_on_host(input_ids, keep, is_image, is_video, image_grids, video_grids, vision_start_token_id,
                       spatial_merge_size):
    """:func:`_positions_on_device` with NumPy on host tensors: the same ``(3, B, T)`` positions and flags."""
    batch, width = input_ids.shape
    keep_flat, image_flat, video_flat = (mask.numpy().ravel() for mask in (keep, is_image, is_video))
    image = _host_items(image_flat, image_grids.numpy().astype(np.int64), spatial_merge_size, False)
    video = _host_items(video_flat, video_grids.numpy().astype(np.int64), spatial_merge_size, True)
    advance = (keep_flat & ~image_flat & ~video_flat).astype(np.int64)
    for _, _, last, moves, _, _ in (image, video):
        advance[last] += moves
    advance = advance.reshape(batch, width)
    start = (np.cumsum(advance, axis=1) - advance).ravel()  # where each token's text run or unit starts
    positions = np.broadcast_to(start, (3, start.size)).copy()
    for index, offsets, _, _, _, _ in (image, video):
        positions[:, index] += offsets
    positions[:, ~keep_flat] = PADDING_POSITION
    firsts = np.concatenate([image[4], video[4]])
    # The token before an item is the previous real token of its sample (padding may sit anywhere).
    real = np.flatnonzero(keep_flat)
    rank_of_first = np.searchsorted(real, firsts)
    previous = real[np.maximum(rank_of_first - 1, 0)]
    has_previous = (rank_of_first > 0) & (previous // width == firsts // width)
    ids = input_ids.numpy().ravel()
    orphan = bool(np.any(~has_previous | (ids[previous] != vision_start_token_id)))
    return (torch.from_numpy(positions.reshape(3, batch, width)), torch.tensor(image[5]), torch.tensor(video[5]),
            torch.tensor(orphan))


def _checks(is_image, is_video, image_grids, video_grids, image_error, video_error, orphan_item,
            vision_start_token_id, spatial_merge_size) -> list[DeferredCheck]:
    def tokens_in(grids: torch.Tensor) -> int:
        # Only for the error message: computed once a check has failed, never on the good path.
        return int((grids[:, 0] * (grids[:, 1] // spatial_merge_size) * (grids[:, 2] // spatial_merge_size)).sum())

    return [
        DeferredCheck(
            image_error,
            "image_grid_thw: the real image tokens of the batch do not match its grids; pass one grid per image in "
            "order of appearance, and never truncate inside an image",
            lambda: f"{int(is_image.sum())} image tokens, grids describe {tokens_in(image_grids)}",
        ),
        DeferredCheck(
            video_error,
            "video_grid_thw: the real video tokens of the batch do not match its grids; pass one grid per video in "
            "order of appearance, and never truncate inside a video",
            lambda: f"{int(is_video.sum())} video tokens, grids describe {tokens_in(video_grids)}",
        ),
        DeferredCheck(
            orphan_item,
            f"input_ids: an image or video starts without a vision-start token ({vision_start_token_id}) right "
            "before it; check image_token_id / vision_start_token_id against the model config",
        ),
    ]
