"""Batches for the tests on Megatron-Bridge 0.6.2's real ``Qwen3VLModel`` (CPU build): test-only
helpers. The parity helpers the tests and benchmarks share live in
:mod:`megatron.bridge_thd_cpu.parity`; import them from there.

Module-level functions only: the CP workers run them in spawned gloo processes.
"""

from __future__ import annotations

import torch

from megatron.bridge_thd_cpu.data import VisualInputs, synthetic_receipt_batch

IMAGE, VIDEO, VISION_START, VISION_END = 250, 251, 252, 253
TIMESTAMP_TOKENS = 3  # text tokens before each video frame ("<0.5 seconds>")
PATCH_FEATURES = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size**2 of the tiny tower
# Videos added to the receipt batches: sample -> patch grid (t, h, w). Frames differ in height and
# width (the MRoPE raster and max(h, w) advance), several frames each, two samples.
VIDEOS = {0: (3, 4, 8), 2: (2, 8, 4)}


class FakeGroup:
    """Stands in for a ``torch.distributed.ProcessGroup`` (``torch/distributed/distributed_c10d.py``)
    where only ``size()`` and ``rank()`` are read, as those methods return them."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def trimmed(batch: dict, lengths: list[int]) -> dict:
    """A right-padded receipt batch with sample i cut to its first ``lengths[i]`` tokens (past its
    image, so no image is cut); the cut tokens become padding."""
    batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    width = batch["tokens"].shape[1]
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    assert (keep <= batch["attention_mask"]).all(), "trimmed: lengths must not exceed the real lengths"
    batch["attention_mask"] = keep
    batch["tokens"] = torch.where(keep, batch["tokens"], 0)
    # The new last token predicts nothing; padding is never supervised.
    last = keep & ~torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    batch["labels"] = torch.where(keep & ~last, batch["labels"], -100)
    batch["loss_mask"] = torch.where(keep & ~last, batch["loss_mask"], 0.0)
    return batch


def receipt_batch(padding: str, seed: int = 1, batch_size: int = 3) -> dict:
    return synthetic_receipt_batch(batch_size, seed=seed, left_padding=padding == "left")


def collate_rows(rows: list[list[int]], loss_masks: list[list[float]], *, left: bool = False) -> dict:
    """Token rows of different lengths as one padded micro-batch, the way a collate pads them:
    ``tokens``, ``labels`` (label[t] = token[t + 1], -100 after the last), ``loss_mask``,
    ``attention_mask`` (bool keep mask), ``position_ids``, each ``(B, max length)``; right padding,
    or left padding with ``left``."""
    width = max(len(r) for r in rows)
    out = {
        "tokens": torch.zeros(len(rows), width, dtype=torch.long),
        "labels": torch.full((len(rows), width), -100, dtype=torch.long),
        "loss_mask": torch.zeros(len(rows), width),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.bool),
        "position_ids": torch.arange(width).expand(len(rows), -1).clone(),
    }
    for i, (tokens, loss_mask) in enumerate(zip(rows, loss_masks)):
        columns = slice(width - len(tokens), width) if left else slice(0, len(tokens))
        out["tokens"][i, columns] = torch.tensor(tokens)
        out["labels"][i, columns] = torch.tensor(tokens[1:] + [-100])
        out["loss_mask"][i, columns] = torch.tensor(loss_mask, dtype=torch.float)
        out["attention_mask"][i, columns] = True
    return out


def with_videos(batch: dict, videos: dict[int, tuple[int, int, int]] = VIDEOS, seed: int = 0) -> dict:
    """The batch with a video of patch grid ``(t, h, w)`` put in sample i (``videos[i]``) before
    its image, after its prompt, laid out as Qwen3-VL's processor does: per frame, timestamp text
    then ``<vision_start> <video> * (h * w / 4) <vision_end>``. Pixel rows and grids follow the
    order of appearance; the supervised answer tokens and the padding side are unchanged."""
    generator = torch.Generator().manual_seed(seed)
    keep = batch["attention_mask"] != 0
    left = bool(keep[:, -1].all()) and not bool(keep[:, 0].all())
    rows, masks, grids, pixels = [], [], [], []
    for i in range(keep.shape[0]):
        tokens = batch["tokens"][i][keep[i]].tolist()
        loss_mask = batch["loss_mask"][i][keep[i]].tolist()
        if i in videos:
            t, h, w = videos[i]
            inserted: list[int] = []
            for _ in range(t):
                inserted += torch.randint(1, 240, (TIMESTAMP_TOKENS,), generator=generator).tolist()
                inserted += [VISION_START] + [VIDEO] * (h * w // 4) + [VISION_END]
            at = tokens.index(VISION_START)  # after the prompt, before the image
            assert loss_mask[at - 1] == 0, "the video must not sit inside supervised text"
            tokens = tokens[:at] + inserted + tokens[at:]
            loss_mask = loss_mask[:at] + [0.0] * len(inserted) + loss_mask[at:]
            grids.append((t, h, w))
            pixels.append(torch.randn(t * h * w, PATCH_FEATURES, generator=generator))
        rows.append(tokens)
        masks.append(loss_mask)
    out = collate_rows(rows, masks, left=left)
    visual = batch["visual_inputs"]
    out["visual_inputs"] = VisualInputs(
        pixel_values=visual.pixel_values, image_grid_thw=visual.image_grid_thw,
        pixel_values_videos=torch.cat(pixels) if pixels else None,
        video_grid_thw=torch.tensor(grids, dtype=torch.long) if grids else None,
    )
    return out


def video_receipt_batch(padding: str, seed: int = 1, batch_size: int = 3) -> dict:
    """:func:`receipt_batch` with :data:`VIDEOS` added: images in every sample, videos in two."""
    return with_videos(receipt_batch(padding, seed=seed, batch_size=batch_size))


def last_slot_batch(cp_align: int = 8, seed: int = 1) -> dict:
    """Every sample's length a multiple of ``cp_align`` except the last one's: under CP the only
    alignment padding is in the last slot (the case TransformerEngine issue 3331 misses)."""
    batch = receipt_batch("right", seed=seed)
    lengths = batch["attention_mask"].sum(1).tolist()
    target = [n - n % cp_align for n in lengths[:-1]] + [lengths[-1] - lengths[-1] % cp_align - cp_align + 3]
    return trimmed(batch, target)


def all_padding_batch(width: int = 64) -> dict:
    """A micro-batch whose samples are all padding (no real token, no image)."""
    return {
        "tokens": torch.zeros(2, width, dtype=torch.long),
        "labels": torch.full((2, width), -100),
        "loss_mask": torch.zeros(2, width),
        "attention_mask": torch.zeros(2, width, dtype=torch.bool),
        "position_ids": torch.arange(width).expand(2, -1).clone(),
        "visual_inputs": VisualInputs(),
    }


def tiny_real_model(seq_length: int, *, device: str | None = None):
    """Megatron-Bridge's real tiny ``Qwen3VLModel`` (single-process groups attached as ``pg_collection``), built
    on the CPU; ``device="meta"`` moves its parameters there (the step's stand-in for a GPU)."""
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    pg = init_single_process_groups()
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=seq_length), seed=0)
    if device is not None:
        model = model.to(device)
    model.pg_collection = pg
    return model
