"""Synthetic Qwen3-VL samples (text, images, videos) for the mrope / THD parity tests.

Written independently of ``megatron.bridge_thd``: samples are plain Python lists laid out the
way Qwen3-VL's processor lays them out, for the tiny model of ``ReferenceQwen3VL.tiny``:

* an image with patch grid ``(1, h, w)`` is ``[vision_start] + [image] * (h*w/4) + [vision_end]``;
* a video with grid ``(t, h, w)`` is, per frame, a few timestamp text tokens then
  ``[vision_start] + [video] * (h*w/4) + [vision_end]`` (Qwen3-VL separates frames with
  timestamps);
* pixel values are ``t*h*w`` rows of ``3 * 2 * 4 * 4 = 96`` features per item.

A batch concatenates the samples' pixel values and grids in order of appearance (row by row,
left to right within a row), pads the token rows on the right or on the left, and keeps the
slices that map each sample back to its own tokens, grids and pixel rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

IMAGE_TOKEN = 250
VIDEO_TOKEN = 251
VISION_START = 252
VISION_END = 253
PAD_TOKEN = 0
IGNORE_INDEX = -100
PLACEHOLDERS = (IMAGE_TOKEN, VIDEO_TOKEN)

PATCH_FEATURES = 3 * 2 * 4 * 4  # channels * temporal_patch_size * patch_size**2
MERGE = 2  # spatial_merge_size
IMAGE_SIDES = (4, 8, 12)  # patches per side (h, w even so that the 2x2 merge is exact)
VIDEO_SIDES = (4, 8)
TIMESTAMP_TOKENS = 3  # text tokens before each video frame ("<0.5 seconds>")


def _text(rng: random.Random, n: int) -> list[int]:
    # Ordinary text ids: never padding (0) nor one of the special ids 250..253.
    return [rng.randint(1, 249) for _ in range(n)]


def image_tokens(h: int, w: int) -> list[int]:
    return [VISION_START] + [IMAGE_TOKEN] * (h * w // (MERGE * MERGE)) + [VISION_END]


def video_tokens(rng: random.Random, t: int, h: int, w: int) -> list[int]:
    ids: list[int] = []
    for _ in range(t):
        ids += _text(rng, TIMESTAMP_TOKENS) + [VISION_START] + [VIDEO_TOKEN] * (h * w // (MERGE * MERGE)) + [VISION_END]
    return ids


def item_length(item: tuple) -> int:
    if item[0] == "image":
        _, h, w = item
        return h * w // (MERGE * MERGE) + 2
    _, t, h, w = item
    return t * (TIMESTAMP_TOKENS + h * w // (MERGE * MERGE) + 2)


@dataclass
class Sample:
    """One sample alone: its token ids, its grids and pixel rows in order of appearance."""

    input_ids: list[int]
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    pixel_values: torch.Tensor = field(default_factory=lambda: torch.zeros(0, PATCH_FEATURES))
    pixel_values_videos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, PATCH_FEATURES))

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def has_vision(self) -> bool:
        return bool(self.image_grids or self.video_grids)

    def ids(self) -> torch.Tensor:
        """``(1, L)`` token ids."""
        return torch.tensor([self.input_ids], dtype=torch.long)

    def mm_token_type_ids(self) -> torch.Tensor:
        """``(1, L)`` Hugging Face modality ids: 1 at image tokens, 2 at video tokens."""
        return mm_token_type_ids(self.ids())

    def vision_kwargs(self) -> dict:
        """pixel_values / image_grid_thw / pixel_values_videos / video_grid_thw (None when absent)."""
        return dict(
            pixel_values=self.pixel_values if self.image_grids else None,
            image_grid_thw=torch.tensor(self.image_grids, dtype=torch.long) if self.image_grids else None,
            pixel_values_videos=self.pixel_values_videos if self.video_grids else None,
            video_grid_thw=torch.tensor(self.video_grids, dtype=torch.long) if self.video_grids else None,
        )

    def labels(self) -> list[int]:
        """Shifted next-token labels: ``labels[t] = ids[t + 1]``; -100 at the last token and
        wherever the token or its target is an image/video placeholder."""
        ids = self.input_ids
        out = []
        for t in range(len(ids)):
            if t + 1 >= len(ids) or ids[t] in PLACEHOLDERS or ids[t + 1] in PLACEHOLDERS:
                out.append(IGNORE_INDEX)
            else:
                out.append(ids[t + 1])
        return out


def mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    types = torch.zeros_like(input_ids)
    types[input_ids == IMAGE_TOKEN] = 1
    types[input_ids == VIDEO_TOKEN] = 2
    return types


def sample_from_layout(layout: list, seed: int = 0) -> Sample:
    """Build a sample from a layout such as ``[5, ("image", 4, 8), 3, ("video", 2, 4, 4), 2]``.

    Ints are text runs of that many tokens, ``("image", h, w)`` an image of patch grid
    ``(1, h, w)``, ``("video", t, h, w)`` a video of t frames (each preceded by timestamp text).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    image_grids, video_grids = [], []
    for item in layout:
        if isinstance(item, int):
            ids += _text(rng, item)
        elif item[0] == "image":
            _, h, w = item
            ids += image_tokens(h, w)
            image_grids.append((1, h, w))
        elif item[0] == "video":
            _, t, h, w = item
            ids += video_tokens(rng, t, h, w)
            video_grids.append((t, h, w))
        else:
            raise ValueError(item)
    n_image_rows = sum(t * h * w for t, h, w in image_grids)
    n_video_rows = sum(t * h * w for t, h, w in video_grids)
    return Sample(
        input_ids=ids,
        image_grids=image_grids,
        video_grids=video_grids,
        pixel_values=torch.randn(n_image_rows, PATCH_FEATURES, generator=gen),
        pixel_values_videos=torch.randn(n_video_rows, PATCH_FEATURES, generator=gen),
    )


def random_layout(rng: random.Random, length: int, *, max_images: int = 3, video_prob: float = 0.0) -> list:
    """A layout of exactly ``length`` tokens with 0..max_images images of mixed sizes and an
    optional video; items that do not fit (leaving at least 2 text tokens) are dropped."""
    items: list[tuple] = [
        ("image", rng.choice(IMAGE_SIDES), rng.choice(IMAGE_SIDES)) for _ in range(rng.randint(0, max_images))
    ]
    if rng.random() < video_prob:
        items.append(("video", rng.randint(1, 3), rng.choice(VIDEO_SIDES), rng.choice(VIDEO_SIDES)))
    rng.shuffle(items)
    min_text = 2
    fitted, used = [], 0
    for item in items:
        if used + item_length(item) + min_text <= length:
            fitted.append(item)
            used += item_length(item)
    text = length - used
    # Split the text into len(fitted) + 1 runs (any may be empty, the first is not).
    cuts = sorted(rng.randint(1, text) for _ in range(len(fitted)))
    runs = [b - a for a, b in zip([0] + cuts, cuts + [text])]
    layout: list = [runs[0]]
    for item, run in zip(fitted, runs[1:]):
        layout += [item, run]
    return layout


@dataclass
class VLMBatch:
    """A padded batch of samples and the way back to each sample.

    Attributes:
        input_ids: ``(B, T)``; padding holds 0.
        attention_mask: ``(B, T)`` int64 keep mask (1 = real token).
        labels: ``(B, T)`` shifted next-token labels, -100 at padding, last tokens, placeholders.
        loss_mask: ``(B, T)`` float, 1 where the label is not -100.
        pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw: concatenated in order
            of appearance (None when the batch has none).
        samples: the samples alone.
        token_slices: ``token_slices[i]`` selects sample i's real tokens in row i.
        image_slices / pixel_slices: sample i's rows of image_grid_thw / pixel_values.
        video_slices / video_pixel_slices: the same for videos.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    samples: list[Sample]
    token_slices: list[slice]
    image_slices: list[slice]
    pixel_slices: list[slice]
    video_slices: list[slice]
    video_pixel_slices: list[slice]
    padding_side: str

    @property
    def batch_size(self) -> int:
        return len(self.samples)

    def vision_kwargs(self) -> dict:
        return dict(
            pixel_values=self.pixel_values,
            image_grid_thw=self.image_grid_thw,
            pixel_values_videos=self.pixel_values_videos,
            video_grid_thw=self.video_grid_thw,
        )

    def mm_token_type_ids(self) -> torch.Tensor:
        return mm_token_type_ids(self.input_ids) * self.attention_mask


def collate(samples: list[Sample], padding_side: str = "right", row_length: int | None = None) -> VLMBatch:
    """Pad samples into a batch (``padding_side`` "right" or "left")."""
    if padding_side not in ("right", "left"):
        raise ValueError(padding_side)
    batch_size = len(samples)
    width = max([len(s) for s in samples] + [0]) if row_length is None else row_length
    input_ids = torch.full((batch_size, width), PAD_TOKEN, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    labels = torch.full((batch_size, width), IGNORE_INDEX, dtype=torch.long)
    token_slices, image_slices, pixel_slices, video_slices, video_pixel_slices = [], [], [], [], []
    n_images = n_pixels = n_videos = n_video_pixels = 0
    for i, s in enumerate(samples):
        start = 0 if padding_side == "right" else width - len(s)
        sl = slice(start, start + len(s))
        input_ids[i, sl] = torch.tensor(s.input_ids, dtype=torch.long)
        attention_mask[i, sl] = 1
        labels[i, sl] = torch.tensor(s.labels(), dtype=torch.long)
        token_slices.append(sl)
        image_slices.append(slice(n_images, n_images + len(s.image_grids)))
        n_images += len(s.image_grids)
        pixel_slices.append(slice(n_pixels, n_pixels + len(s.pixel_values)))
        n_pixels += len(s.pixel_values)
        video_slices.append(slice(n_videos, n_videos + len(s.video_grids)))
        n_videos += len(s.video_grids)
        video_pixel_slices.append(slice(n_video_pixels, n_video_pixels + len(s.pixel_values_videos)))
        n_video_pixels += len(s.pixel_values_videos)
    image_grids = [g for s in samples for g in s.image_grids]
    video_grids = [g for s in samples for g in s.video_grids]
    return VLMBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).float(),
        pixel_values=torch.cat([s.pixel_values for s in samples]) if image_grids else None,
        image_grid_thw=torch.tensor(image_grids, dtype=torch.long) if image_grids else None,
        pixel_values_videos=torch.cat([s.pixel_values_videos for s in samples]) if video_grids else None,
        video_grid_thw=torch.tensor(video_grids, dtype=torch.long) if video_grids else None,
        samples=samples,
        token_slices=token_slices,
        image_slices=image_slices,
        pixel_slices=pixel_slices,
        video_slices=video_slices,
        video_pixel_slices=video_pixel_slices,
        padding_side=padding_side,
    )


def make_batch(
    seed: int,
    batch_size: int,
    max_length: int,
    *,
    min_length: int = 4,
    padding_side: str = "right",
    max_images: int = 3,
    video_prob: float = 0.0,
) -> VLMBatch:
    """B random samples of ``min_length..max_length`` tokens (one of them exactly
    ``max_length``, the row length), each with 0..max_images images of sizes h, w in
    {4, 8, 12} patches and, with probability ``video_prob``, a video."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_length, max_length) for _ in range(batch_size)]
    if batch_size:
        lengths[rng.randrange(batch_size)] = max_length
    samples = [
        sample_from_layout(
            random_layout(rng, n, max_images=max_images, video_prob=video_prob), seed=seed * 1000 + i
        )
        for i, n in enumerate(lengths)
    ]
    for s, n in zip(samples, lengths):
        assert len(s) == n
    return collate(samples, padding_side, row_length=max_length)
