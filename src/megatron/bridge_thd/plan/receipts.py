"""The synthetic receipt distribution: what the planner draws when it has no lengths file, and what the
CPU build's synthetic batches (``megatron.bridge_thd_cpu.data``) are made of.

cord_v2 (receipt photos with JSON parses) cannot be downloaded here, so the embedded default
draws samples from a documented distribution shaped like it at ``seq_length`` 2048:

* one receipt photo per sample, tall: merged grid height ``h' ~ U{14..34}`` and width
  ``w' ~ U{8..16}`` LLM tokens (the vision tower sees ``2h' x 2w'`` patches), so
  112-544 image tokens;
* a prompt of ``U{12..24}`` text tokens before the image, 2 after it;
* an answer (the JSON parse) of ``clip(lognormal(median 200, sigma 0.6), 32, 1100)`` tokens,
  the only supervised tokens.

Pure and dependency-light (torch's generator only): it is data, not test support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ReceiptSpec", "receipt_sample"]


@dataclass(frozen=True)
class ReceiptSpec:
    """Token ids and vision geometry of the model the batch is for (defaults: ``ReferenceQwen3VL.tiny``)."""

    image_token_id: int = 250
    vision_start_token_id: int = 252
    vision_end_token_id: int = 253
    eos_token_id: int = 254
    pad_token_id: int = 0
    text_vocab: int = 240
    spatial_merge_size: int = 2
    patch_features: int = 3 * 2 * 4 * 4


def receipt_sample(generator: torch.Generator, spec: ReceiptSpec) -> tuple[list[int], list[int], tuple[int, int, int]]:
    """One sample drawn from the receipt distribution (module docstring), advancing ``generator``.

    Returns:
        ``(tokens, supervised, grid)``: the sample's token ids, its 0 / 1 loss mask over the
        (already shifted) labels, and its image's patch grid ``(1, h, w)``. The planner draws its
        synthetic lengths with it (:func:`megatron.bridge_thd.plan.samples.receipt_lengths`).
    """
    def randint(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=generator))

    def text(n):
        return torch.randint(1, spec.text_vocab, (n,), generator=generator).tolist()

    merged_h, merged_w = randint(14, 34), randint(8, 16)
    answer_length = int(torch.empty(1).log_normal_(mean=torch.tensor(200.0).log().item(), std=0.6, generator=generator))
    answer_length = min(max(answer_length, 32), 1100)
    prompt = text(randint(12, 24))
    image = [spec.vision_start_token_id] + [spec.image_token_id] * (merged_h * merged_w) + [spec.vision_end_token_id]
    answer = text(answer_length) + [spec.eos_token_id]
    tokens = prompt + image + text(2) + answer
    # label[t] = token[t + 1]; supervised where that next token belongs to the answer
    supervised = [0] * (len(tokens) - len(answer) - 1) + [1] * len(answer) + [0]
    grid = (1, merged_h * spec.spatial_merge_size, merged_w * spec.spatial_merge_size)
    return tokens, supervised, grid
