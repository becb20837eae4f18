"""Tests of ``megatron.bridge_thd_cpu.data.synthetic_receipt_batch`` against its documented format.

Expected values are derived here from the documented sample layout
``[prompt] <vision_start> <image>*n <vision_end> [2 tokens] [answer] [eos]`` and Megatron's
convention (labels already shifted, loss_mask 1 where the label is an answer or eos token).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron.bridge_thd_cpu.data import ReceiptSpec, VisualInputs, synthetic_receipt_batch

IMAGE, VISION_START, VISION_END, EOS, PAD = 250, 252, 253, 254, 0
MERGE = 2
PATCH_FEATURES = 3 * 2 * 4 * 4


def _real(batch, i):
    keep = batch["attention_mask"][i]
    return {k: batch[k][i][keep] for k in ("tokens", "labels", "loss_mask")}


def _layout(tokens: list[int]) -> dict:
    """Positions of the structural tokens of one sample (real tokens only)."""
    vs = tokens.index(VISION_START)
    ve = tokens.index(VISION_END)
    return dict(vision_start=vs, vision_end=ve, image_tokens=ve - vs - 1, eos=len(tokens) - 1)


@pytest.fixture(scope="module")
def batch():
    return synthetic_receipt_batch(6, seed=3)


@pytest.fixture(scope="module")
def big_batch():
    return synthetic_receipt_batch(200, seed=11)


def test_shapes_and_types(batch):
    B = 6
    T = batch["tokens"].shape[1]
    for key in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"):
        assert batch[key].shape == (B, T), key
    assert batch["tokens"].dtype == torch.long
    assert batch["labels"].dtype == torch.long
    assert batch["loss_mask"].is_floating_point()
    assert batch["attention_mask"].dtype == torch.bool
    assert torch.equal(batch["position_ids"], torch.arange(T).expand(B, -1))
    assert isinstance(batch["visual_inputs"], VisualInputs)
    # right padded to the longest sample: some sample fills the width, every keep row is a prefix
    lengths = batch["attention_mask"].sum(1)
    assert int(lengths.max()) == T
    for i in range(B):
        n = int(lengths[i])
        assert batch["attention_mask"][i, :n].all() and not batch["attention_mask"][i, n:].any()
        assert (batch["tokens"][i, n:] == PAD).all()
        assert (batch["labels"][i, n:] == -100).all()
        assert (batch["loss_mask"][i, n:] == 0).all()


def test_labels_are_next_tokens(batch):
    for i in range(batch["tokens"].shape[0]):
        real = _real(batch, i)
        tokens, labels = real["tokens"], real["labels"]
        assert torch.equal(labels[:-1], tokens[1:])
        assert int(labels[-1]) == -100


def test_sample_structure(batch):
    for i in range(batch["tokens"].shape[0]):
        tokens = _real(batch, i)["tokens"].tolist()
        lay = _layout(tokens)
        # prompt U{12..24} text tokens before the image
        assert 12 <= lay["vision_start"] <= 24
        assert all(1 <= t < 240 for t in tokens[: lay["vision_start"]])
        # image placeholders are contiguous between start and end
        assert all(t == IMAGE for t in tokens[lay["vision_start"] + 1 : lay["vision_end"]])
        assert tokens.count(IMAGE) == lay["image_tokens"]
        assert tokens.count(VISION_START) == 1 and tokens.count(VISION_END) == 1
        # 2 text tokens after the image, then the answer, then exactly one eos at the end
        assert tokens[-1] == EOS and tokens.count(EOS) == 1
        assert all(1 <= t < 240 for t in tokens[lay["vision_end"] + 1 : -1])
        assert PAD not in tokens


def test_loss_mask_only_on_answer_and_eos_labels(batch):
    for i in range(batch["tokens"].shape[0]):
        real = _real(batch, i)
        tokens = real["tokens"].tolist()
        lay = _layout(tokens)
        answer_start = lay["vision_end"] + 3  # 2 text tokens after vision_end
        n = len(tokens)
        # label[t] = token[t+1] is an answer / eos token iff t + 1 >= answer_start
        expected = torch.tensor([1.0 if t + 1 >= answer_start and t + 1 < n else 0.0 for t in range(n)])
        assert torch.equal(real["loss_mask"], expected), f"sample {i}"
        supervised = real["labels"][real["loss_mask"] > 0]
        assert int(supervised[-1]) == EOS
        assert (supervised[:-1] != EOS).all()
        assert (supervised != IMAGE).all() and (supervised != -100).all()


def test_image_tokens_match_grids_and_pixels(batch):
    grids = batch["visual_inputs"].image_grid_thw
    pixels = batch["visual_inputs"].pixel_values
    B = batch["tokens"].shape[0]
    assert grids.shape == (B, 3)
    assert (grids[:, 0] == 1).all()
    for i in range(B):  # grid rows in sample order
        t, h, w = grids[i].tolist()
        assert h % MERGE == 0 and w % MERGE == 0
        assert int((_real(batch, i)["tokens"] == IMAGE).sum()) == t * h * w // (MERGE * MERGE)
    assert pixels.shape == (int(grids.prod(-1).sum()), PATCH_FEATURES)
    assert pixels.dtype == torch.float32
    assert batch["visual_inputs"].normalized_for_model().keys() == {"pixel_values", "image_grid_thw"}


def test_left_padding_same_content_at_the_end():
    right = synthetic_receipt_batch(5, seed=7)
    left = synthetic_receipt_batch(5, seed=7, left_padding=True)
    assert left["tokens"].shape == right["tokens"].shape
    T = right["tokens"].shape[1]
    for i in range(5):
        n = int(right["attention_mask"][i].sum())
        assert int(left["attention_mask"][i].sum()) == n
        assert not left["attention_mask"][i, : T - n].any() and left["attention_mask"][i, T - n :].all()
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(left[key][i, T - n :], right[key][i, :n]), key
        assert (left["tokens"][i, : T - n] == PAD).all()
        assert (left["labels"][i, : T - n] == -100).all()
        assert (left["loss_mask"][i, : T - n] == 0).all()
    assert torch.equal(left["visual_inputs"].pixel_values, right["visual_inputs"].pixel_values)
    assert torch.equal(left["visual_inputs"].image_grid_thw, right["visual_inputs"].image_grid_thw)


def test_deterministic_per_seed():
    a = synthetic_receipt_batch(3, seed=5)
    b = synthetic_receipt_batch(3, seed=5)
    c = synthetic_receipt_batch(3, seed=6)
    for key in ("tokens", "labels", "loss_mask", "attention_mask"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["visual_inputs"].pixel_values, b["visual_inputs"].pixel_values)
    assert torch.equal(a["visual_inputs"].image_grid_thw, b["visual_inputs"].image_grid_thw)
    different = a["tokens"].shape != c["tokens"].shape or not torch.equal(a["tokens"], c["tokens"])
    assert different
    assert not torch.equal(a["visual_inputs"].image_grid_thw, c["visual_inputs"].image_grid_thw) or not torch.equal(
        a["visual_inputs"].pixel_values, c["visual_inputs"].pixel_values
    )


def test_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    synthetic_receipt_batch(2, seed=0)
    assert torch.equal(torch.rand(4), expected)


def test_pad_to():
    natural = synthetic_receipt_batch(3, seed=2)
    width = natural["tokens"].shape[1]
    exact = synthetic_receipt_batch(3, seed=2, pad_to=width)
    assert torch.equal(exact["tokens"], natural["tokens"])
    wide = synthetic_receipt_batch(3, seed=2, pad_to=width + 37)
    assert wide["tokens"].shape == (3, width + 37)
    assert torch.equal(wide["tokens"][:, :width], natural["tokens"])
    assert (wide["tokens"][:, width:] == PAD).all() and not wide["attention_mask"][:, width:].any()
    wide_left = synthetic_receipt_batch(3, seed=2, pad_to=width + 37, left_padding=True)
    assert wide_left["attention_mask"][:, -1].all()
    with pytest.raises(ValueError, match="pad_to"):
        synthetic_receipt_batch(3, seed=2, pad_to=width - 1)


def test_distribution_bounds(big_batch):
    grids = big_batch["visual_inputs"].image_grid_thw
    merged_h, merged_w = grids[:, 1] // MERGE, grids[:, 2] // MERGE
    assert ((merged_h >= 14) & (merged_h <= 34)).all()
    assert ((merged_w >= 8) & (merged_w <= 16)).all()
    image_counts, answer_lengths, prompt_lengths = [], [], []
    for i in range(200):
        real = _real(big_batch, i)
        tokens = real["tokens"].tolist()
        lay = _layout(tokens)
        image_counts.append(lay["image_tokens"])
        prompt_lengths.append(lay["vision_start"])
        answer_lengths.append(int(real["loss_mask"].sum()) - 1)  # supervised = answer + eos
        assert lay["image_tokens"] == int(merged_h[i] * merged_w[i])
    assert 112 <= min(image_counts) and max(image_counts) <= 544
    assert 32 <= min(answer_lengths) and max(answer_lengths) <= 1100
    assert 12 <= min(prompt_lengths) and max(prompt_lengths) <= 24
    # the distribution is not degenerate and its answer median is near the documented 200
    assert len(set(image_counts)) > 20 and len(set(answer_lengths)) > 50
    assert 150 <= statistics.median(answer_lengths) <= 270
    assert len(set(prompt_lengths)) > 5


def test_custom_spec_ids():
    spec = ReceiptSpec(image_token_id=100, vision_start_token_id=101, vision_end_token_id=102, eos_token_id=103,
                       pad_token_id=7, text_vocab=50)
    batch = synthetic_receipt_batch(2, seed=0, spec=spec)
    keep = batch["attention_mask"]
    assert (batch["tokens"][~keep] == 7).all()
    for i in range(2):
        tokens = batch["tokens"][i][keep[i]]
        assert int(tokens[-1]) == 103
        assert int((tokens == 101).sum()) == 1 and int((tokens == 102).sum()) == 1
        t, h, w = batch["visual_inputs"].image_grid_thw[i].tolist()
        assert int((tokens == 100).sum()) == t * h * w // 4
