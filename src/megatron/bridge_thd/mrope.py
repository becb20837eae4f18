"""Qwen3-VL 3D MRoPE positions, per sample, for any padding layout.

Qwen3-VL's rule (Hugging Face ``Qwen3VLModel.get_rope_index``, Megatron-Bridge
``modelling_qwen3_vl/rope.get_rope_index``), applied to the real tokens of each sample:

* a text token takes position p on all three channels (temporal, height, width), then p += 1;
* the ``t*h*w`` tokens of one image (or one video frame: Qwen3-VL separates frames with
  timestamp text, so a ``(t, h, w)`` video is t frames of ``(1, h, w)``) take
  ``(p + t_i, p + h_i, p + w_i)`` in raster order over the merged grid
  ``(t, h / merge, w / merge)``; afterwards p += max(h, w) / merge.

Every sample starts at 0. No host synchronisation: every tensor is sized by the token batch or
by the grids' row counts (videos are never expanded into a per-frame table, whose size
``sum(t)`` only a host read could give); the validity checks are deferred to the caller's read.
Packed through ``pack_bshd_to_thd`` the result becomes ``(3, 1, N)`` positions that restart per
sample, never the degenerate 1D expansion (three equal channels) that silently drops the image
layout.
"""

from __future__ import annotations

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
        spatial_merge_size=spatial_merge_size,
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

    def tokens_in(grids: torch.Tensor) -> int:
        # Only for the error message: computed once a check has failed, never on the good path.
        return int((grids[:, 0] * (grids[:, 1] // spatial_merge_size) * (grids[:, 2] // spatial_merge_size)).sum())

    checks = mask_checks + [
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
    return positions, checks
