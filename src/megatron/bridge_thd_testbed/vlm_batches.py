"""Padded VLM micro-batches of a chosen size and width, with images or videos (benchmarks).

:func:`megatron.bridge_thd_cpu.data.synthetic_receipt_batch` draws receipt-like samples whose
lengths the receipt distribution fixes (about 300 to 1700 tokens). The step benchmarks need a
batch of ``B`` samples padded to a width ``T`` (``seq_length``) for several ``T``, so this module
draws each sample's real length first and fits the media and the answer into it:

* real length ``L ~ U{T/4 .. T}`` (the longest sample is at most ``T``: nothing is truncated);
* a prompt of ``U{12..24}`` text tokens, then (``media="videos"``) one video, then one image,
  2 text tokens, the answer (the rest of ``L``) and eos; only the answer and eos are supervised;
* the image: a receipt photo's merged grid ``h' ~ U{14..34}``, ``w' ~ U{8..16}``, its height cut
  so that it takes at most ``L / 2`` tokens; patch grid ``(1, 2h', 2w')``;
* the video (``media="videos"``, every sample): ``t ~ U{2..4}`` temporal patches of a merged
  ``U{4..8} x U{4..8}`` grid, laid out per frame as Qwen3-VL's processor does (3 timestamp text
  tokens, ``<vision_start> <video> * (h' w') <vision_end>``), cut to at most ``L / 4`` tokens;
  patch grid ``(t, 2h', 2w')``.

Token ids and the patch width are those of the tiny test-bed model (:class:`~megatron.bridge_thd.
bridge_thd_cpu.data.ReceiptSpec`). Samples are a pure function of the seed. Building is a host-side
Python loop: never time it.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd_cpu.data import ReceiptSpec, VisualInputs, batch_dict

__all__ = ["MEDIA", "VIDEO_TOKEN_ID", "TIMESTAMP_TOKENS", "vlm_batch"]

MEDIA = ("images", "videos")
VIDEO_TOKEN_ID = 251  # the tiny model's video placeholder (bridge_thd_cpu.model.VIDEO_TOKEN_ID)
TIMESTAMP_TOKENS = 3  # text tokens before each video frame ("<0.5 seconds>")


def _randint(generator: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _text(generator: torch.Generator, n: int, spec: ReceiptSpec) -> list[int]:
    return torch.randint(1, spec.text_vocab, (n,), generator=generator).tolist()


def _sample(generator: torch.Generator, length: int, media: str, spec: ReceiptSpec):
    """One sample of exactly ``length`` tokens: ``(tokens, supervised, image_grid, video_grid)``."""
    merge = spec.spatial_merge_size
    prompt = _text(generator, _randint(generator, 12, 24), spec)
    video, video_grid = [], None
    if media == "videos":
        t, vh, vw = _randint(generator, 2, 4), _randint(generator, 4, 8), _randint(generator, 4, 8)
        per_frame = TIMESTAMP_TOKENS + 2 + vh * vw
        t = max(1, min(t, (length // 4) // per_frame))
        for _ in range(t):
            video += _text(generator, TIMESTAMP_TOKENS, spec)
            video += [spec.vision_start_token_id] + [VIDEO_TOKEN_ID] * (vh * vw) + [spec.vision_end_token_id]
        video_grid = (t, vh * merge, vw * merge)
    merged_h, merged_w = _randint(generator, 14, 34), _randint(generator, 8, 16)
    merged_h = max(1, min(merged_h, (length // 2) // merged_w))
    image = [spec.vision_start_token_id] + [spec.image_token_id] * (merged_h * merged_w) + [spec.vision_end_token_id]
    head = prompt + video + image + _text(generator, 2, spec)
    answer_length = max(1, length - len(head) - 1)
    answer = _text(generator, answer_length, spec) + [spec.eos_token_id]
    tokens = head + answer
    # label[t] = token[t + 1]; supervised where that next token belongs to the answer
    supervised = [0] * (len(head) - 1) + [1] * len(answer) + [0]
    return tokens, supervised, (1, merged_h * merge, merged_w * merge), video_grid


def vlm_batch(batch_size: int, width: int, *, media: str = "images", seed: int = 0, left_padding: bool = False,
              spec: ReceiptSpec = ReceiptSpec()) -> dict:
    """A Megatron-Bridge VLM micro-batch of ``batch_size`` samples padded to ``width`` (module docstring).

    Args:
        batch_size: B.
        width: T: every tensor is ``(B, T)``; real lengths are drawn from ``U{T/4 .. T}``.
        media: ``"images"`` (one image per sample) or ``"videos"`` (one video and one image per sample).
        seed: samples are a pure function of the seed (and of B, T, media).
        left_padding: pad on the left instead of the right.

    Returns:
        dict with ``tokens``, ``labels`` (-100 at padding), ``loss_mask`` (float), ``attention_mask``
        (bool keep mask), ``position_ids`` (``(B, T)`` arange) and ``visual_inputs``
        (:class:`~megatron.bridge_thd_cpu.data.VisualInputs`: pixel rows and grids of the
        images, and of the videos with ``media="videos"``, in order of appearance).
    """
    if media not in MEDIA:
        raise ValueError(f"media: {media!r} is not one of {MEDIA}")
    if width < 128:
        raise ValueError(f"width: {width} is too narrow for a prompt, an image and an answer; use >= 128")
    generator = torch.Generator().manual_seed(seed)
    samples = [_sample(generator, _randint(generator, width // 4, width), media, spec) for _ in range(batch_size)]
    tokens = torch.full((batch_size, width), spec.pad_token_id, dtype=torch.long)
    labels = torch.full((batch_size, width), -100, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, width)
    keep = torch.zeros(batch_size, width, dtype=torch.bool)
    for i, (sample_tokens, supervised, _, _) in enumerate(samples):
        n = len(sample_tokens)
        assert n <= width, (n, width)
        columns = slice(width - n, width) if left_padding else slice(0, n)
        tokens[i, columns] = torch.tensor(sample_tokens)
        labels[i, columns] = torch.tensor(sample_tokens[1:] + [-100])
        loss_mask[i, columns] = torch.tensor(supervised, dtype=torch.float)
        keep[i, columns] = True
    image_grids = torch.tensor([s[2] for s in samples], dtype=torch.long)
    visual = VisualInputs(
        pixel_values=torch.randn(int(image_grids.prod(-1).sum()), spec.patch_features, generator=generator),
        image_grid_thw=image_grids,
    )
    if media == "videos":
        video_grids = torch.tensor([s[3] for s in samples], dtype=torch.long)
        visual.pixel_values_videos = torch.randn(int(video_grids.prod(-1).sum()), spec.patch_features,
                                                 generator=generator)
        visual.video_grid_thw = video_grids
    return batch_dict(tokens, labels, loss_mask, keep, visual)
