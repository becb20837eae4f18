"""A long-tailed video SFT mix: what the planner and the bench draw to compare context parallelism per sample with a
static CP size (docs/cp-per-sample.md).

No video SFT set can be downloaded here, so the lengths are synthetic, from a documented distribution (an
assumption, not a measurement; a ``bridge-thd scan`` lengths file of a real set replaces it, ``--lengths``):

* ``1 - video_share`` of the samples are the planner's synthetic receipts (:mod:`.receipts`: one photo, a few hundred
  to ~1,700 tokens);
* ``video_share`` are videos: a duration of ``clip(lognormal(median 45 s, sigma 1.0), 4 s, 900 s)``, sampled as
  Qwen3-VL's video processor does by default (2 frames per second, at most 768 frames, 448 x 448 frames of
  16-pixel patches, 2 frames per temporal patch, 2 x 2 spatial merge): ``t = frames / 2`` temporal patches of
  ``28 x 28`` patches, ``196`` LLM tokens each, plus a 6-token timestamp per temporal patch, a 30-token prompt and
  a ``clip(lognormal(median 150, sigma 0.6), 16, 1024)``-token answer. A 45-second clip is about 9,000 tokens; the
  768-frame cap (6.4 minutes at 2 fps) bounds a video at about 77,000.
"""

from __future__ import annotations

import math

import torch

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.sample_lengths import SampleLengths
from megatron.bridge_thd.plan.samples import receipt_lengths

__all__ = ["video_mix_lengths", "VIDEO_GEOMETRY"]

# (fps, most frames, frames per temporal patch, patches per frame side, spatial merge, timestamp tokens)
VIDEO_GEOMETRY = (2, 768, 2, 28, 2, 6)


def _video(generator: torch.Generator) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    fps, most_frames, per_temporal_patch, side, merge, stamp = VIDEO_GEOMETRY
    duration = float(torch.empty(1).log_normal_(mean=math.log(45.0), std=1.0, generator=generator))
    frames = min(most_frames, max(per_temporal_patch, round(min(max(duration, 4.0), 900.0) * fps)))
    t = frames // per_temporal_patch
    answer = float(torch.empty(1).log_normal_(mean=math.log(150.0), std=0.6, generator=generator))
    tokens = t * (side * side // (merge * merge) + stamp) + 30 + min(max(int(answer), 16), 1024)
    return tokens, ((t, side, side),)


def video_mix_lengths(num_samples: int, *, video_share: float = 0.25, seed: int = 0) -> SampleLengths:
    """``num_samples`` draws from the mix (module docstring): receipts and videos, in a seeded random order."""
    check_int("num_samples", num_samples)
    if not 0 <= video_share <= 1:
        raise ValueError(f"video_share: expected a fraction in [0, 1], got {video_share!r}")
    generator = torch.Generator().manual_seed(seed)
    videos = round(num_samples * video_share)
    receipts = receipt_lengths(num_samples - videos, seed) if videos < num_samples else None
    drawn = [_video(generator) for _ in range(videos)]
    tokens = [n for n, _ in drawn] + (list(receipts.tokens) if receipts else [])
    grids = [g for _, g in drawn] + (list(receipts.grids) if receipts else [])
    order = torch.randperm(num_samples, generator=generator).tolist()
    return SampleLengths(tuple(tokens[i] for i in order), tuple(grids[i] for i in order),
                         source=f"synthetic video mix ({video_share:.0%} videos, seed {seed})")
