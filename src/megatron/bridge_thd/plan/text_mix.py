"""A long-tailed text SFT mix: what the planner and the bench draw to compare context parallelism per sample with a
static CP size on text (docs/cp-per-sample.md), beside the video mix (:mod:`.video_mix`).

Synthetic lengths from a documented distribution (an assumption, not a measurement; a ``bridge-thd scan`` lengths
file of a real set replaces it, ``--lengths``), shaped like the long-context SFT mixes dynamic-CP work is measured on
(most samples a few thousand tokens, a tail to the context length): each sample's tokens are
``clip(round(lognormal(median 1,500, sigma 1.3)), 1, 32,768)``, text only. About 3% of the draws are over 16,384
tokens and 1% sit at the 32,768 cap.
"""

from __future__ import annotations

import math

import torch

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.sample_lengths import SampleLengths

__all__ = ["text_mix_lengths", "TEXT_MIX"]

# (median tokens, sigma of log tokens, fewest tokens, most tokens)
TEXT_MIX = (1500, 1.3, 1, 32768)


def text_mix_lengths(num_samples: int, *, seed: int = 0) -> SampleLengths:
    """``num_samples`` seeded draws from the mix (module docstring)."""
    check_int("num_samples", num_samples)
    median, sigma, low, high = TEXT_MIX
    generator = torch.Generator().manual_seed(seed)
    draws = torch.empty(num_samples, dtype=torch.float64).log_normal_(mean=math.log(median), std=sigma,
                                                                       generator=generator)
    tokens = tuple(min(max(int(round(float(x))), low), high) for x in draws)
    return SampleLengths(tokens, tuple(() for _ in tokens),
                         source=f"synthetic long-tailed text mix (lognormal, median {median:,}, sigma {sigma}, "
                                f"{low}-{high:,} tokens, seed {seed})")
