"""The planner's per-sample lengths: the synthetic receipts, and the check that a ``seq_length`` cuts no image.

A :class:`~megatron.bridge_thd.cost.sample_lengths.SampleLengths` (with its file reader,
:func:`~megatron.bridge_thd.cost.sample_lengths.load_lengths`, below both the planner and global-batch packing)
is aligned lists of each sample's LLM tokens, image patch grids and where its image tokens end. The step keeps
each sample's first ``seq_length`` tokens and refuses a micro-batch where that cuts an image or video token
(``step.truncate_to_seq_length``), so :func:`check_seq_length` refuses such a ``seq_length`` here too. Sources:

* :func:`receipt_lengths`: the embedded synthetic receipts (:mod:`megatron.bridge_thd.plan.receipts`,
  cord_v2-like at seq_length 2048), drawn with the same sampler the demo uses;
* :func:`~megatron.bridge_thd.cost.sample_lengths.load_lengths`: a JSON or CSV lengths file (format there).

``bridge-thd scan`` (:mod:`.scan`, docs/scan.md) writes such a JSON file from a Megatron-Bridge
recipe's own dataset, processor and collate.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.sample_lengths import SampleLengths
from megatron.bridge_thd.plan.receipts import ReceiptSpec, receipt_sample

__all__ = ["receipt_lengths", "check_seq_length"]


def check_seq_length(samples: SampleLengths, seq_length: int) -> None:
    """Refuse a ``seq_length`` whose truncation would cut an image of some sample, as the step does.

    The step keeps each sample's first ``seq_length`` tokens and raises when a dropped token is an
    image or video placeholder (``step.truncate_to_seq_length``): sample i is refused
    exactly when ``image_end(i) > seq_length``. Every sample is checked (with shuffling, any sample
    can land in a micro-batch). Where ``image_end`` is not known, a sample with images longer than
    ``seq_length`` is refused too (it might be cut).

    Raises:
        ValueError: naming ``--seq-length``, the sample whose image reaches furthest, and the fix.
    """
    cut, unknown = [], []
    for i, n in enumerate(samples.tokens):
        if n <= seq_length:
            continue
        end = samples.image_end(i)
        if end is None:
            unknown.append(i)
        elif end > seq_length:
            cut.append(i)
    source = f" ({samples.source})" if samples.source else ""
    step = ("the step keeps each sample's first seq_length tokens and refuses a micro-batch where that cuts an "
            "image or video token")
    if cut:
        worst = max(cut, key=lambda i: (samples.image_ends[i], samples.tokens[i]))
        end = samples.image_ends[worst]
        raise ValueError(
            f"--seq-length {seq_length} would cut images: {step}. {len(cut)} of {len(samples)} samples"
            f"{source} have image tokens past token {seq_length}; the furthest, sample {worst} "
            f"({samples.tokens[worst]} tokens), has image tokens up to token {end}, so its image tokens "
            f"{seq_length}-{end - 1} would be cut. Raise --seq-length to at least {end} (every image whole; "
            f"{max(samples.tokens)} keeps every sample whole), lower the image resolution (max_pixels), or filter "
            "these samples out of the data set")
    if unknown:
        worst = max(unknown, key=lambda i: samples.tokens[i])
        raise ValueError(
            f"--seq-length {seq_length} may cut images: {step}. {len(unknown)} of {len(samples)} samples"
            f"{source} with images are longer than {seq_length} tokens and the lengths give no "
            f"'image_end' for them (the longest, sample {worst}, has {samples.tokens[worst]} tokens), so the "
            f"planner cannot tell whether their images would be cut. Add 'image_end' (one past the sample's last "
            f"image / video token) to the lengths file, or raise --seq-length to at least {samples.tokens[worst]}")


def receipt_lengths(num_samples: int, seed: int = 0) -> SampleLengths:
    """``num_samples`` draws from the synthetic receipt distribution of
    ``megatron.bridge_thd.plan.receipts`` (the sampler the CPU build's synthetic batches use, same seed convention)."""
    check_int("num_samples", num_samples)
    generator = torch.Generator().manual_seed(seed)
    spec = ReceiptSpec()
    tokens, grids, ends = [], [], []
    for _ in range(num_samples):
        sample_tokens, _, grid = receipt_sample(generator, spec)
        tokens.append(len(sample_tokens))
        grids.append((tuple(grid),))
        ends.append(len(sample_tokens) - sample_tokens[::-1].index(spec.image_token_id))
    return SampleLengths(tuple(tokens), tuple(grids), source=f"synthetic receipts (n={num_samples}, seed={seed})",
                         image_ends=tuple(ends))
