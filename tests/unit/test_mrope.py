"""Qwen3-VL MRoPE positions: ``qwen3_vl_position_ids`` against Hugging Face and Megatron-Bridge.

Every sample's positions must equal Hugging Face's ``Qwen3VLModel.get_rope_index`` run on that
sample alone (the positions an unpacked, unpadded forward uses), whatever the padding; packed
into a THD row they must equal Megatron-Bridge 0.6.2's own packed ``get_rope_index``.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from _vlm_samples import (
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_START,
    collate,
    make_batch,
    sample_from_layout,
)
from megatron.bridge_thd import mrope
from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd.mrope import PADDING_POSITION, qwen3_vl_position_ids, qwen3_vl_position_ids_deferred
from megatron.bridge_thd_testbed.opcount import count_ops
from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL
from megatron.bridge_thd.upstream.loading import load_bridge_module

TOKEN_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START)

SAMPLE_LAYOUTS = {
    "text_only": [17],
    "one_image": [5, ("image", 4, 4), 6],
    "image_first": [("image", 8, 4), 3],
    "image_last": [4, ("image", 4, 8)],
    "several_images": [3, ("image", 8, 8), 2, ("image", 8, 8), 4, ("image", 8, 8), 1],
    "mixed_image_sizes": [2, ("image", 4, 12), ("image", 12, 4), 5, ("image", 12, 8), 3],
    "video": [4, ("video", 3, 4, 8), 5],
    "video_square_frames": [("video", 2, 8, 8), 2],
    "image_and_video": [3, ("image", 8, 4), 2, ("video", 2, 4, 4), 3],
    "video_then_image": [2, ("video", 1, 8, 4), 4, ("image", 12, 12), 2, ("image", 4, 4), 1],
}


@pytest.fixture(autouse=True, params=[False, True], ids=["device_code", "host_code"])
def on_host(request, monkeypatch):
    """Every test runs on both implementations of the one rule: torch ops where the data is (a batch on the
    model's device), and NumPy on the host (a host batch bound for a GPU)."""
    for name in ("qwen3_vl_position_ids", "qwen3_vl_position_ids_deferred"):
        monkeypatch.setattr(sys.modules[__name__], name, functools.partial(getattr(mrope, name), on_host=request.param))
    return request.param


@pytest.fixture(scope="module")
def hf_model():
    return ReferenceQwen3VL.tiny(seed=0).hf_model


@pytest.fixture(scope="module")
def bridge_rope():
    return load_bridge_module("models.qwen_vl.modelling_qwen3_vl.rope")


def hf_positions(hf_model, sample) -> torch.Tensor:
    """Hugging Face's positions of one sample alone: ``(3, L)``."""
    kw = sample.vision_kwargs()
    positions, _ = hf_model.model.get_rope_index(
        sample.ids(),
        sample.mm_token_type_ids(),
        image_grid_thw=kw["image_grid_thw"],
        video_grid_thw=kw["video_grid_thw"],
    )
    return positions[:, 0]


def our_positions(batch) -> torch.Tensor:
    return qwen3_vl_position_ids(
        batch.input_ids,
        batch.attention_mask,
        batch.image_grid_thw,
        batch.video_grid_thw,
        **TOKEN_IDS,
        spatial_merge_size=2,
    )


def degenerate_1d(length: int) -> torch.Tensor:
    return torch.arange(length)[None].expand(3, -1)


@pytest.mark.parametrize("name", list(SAMPLE_LAYOUTS))
def test_single_sample_matches_hugging_face(hf_model, name):
    sample = sample_from_layout(SAMPLE_LAYOUTS[name], seed=1)
    ours = our_positions(collate([sample]))
    assert ours.shape == (3, 1, len(sample))
    assert ours.dtype == torch.int64
    expected = hf_positions(hf_model, sample)
    assert torch.equal(ours[:, 0], expected), (name, ours[:, 0], expected)
    # Without a mask (every token real) gives the same.
    kw = sample.vision_kwargs()
    unmasked = qwen3_vl_position_ids(sample.ids(), None, kw["image_grid_thw"], kw["video_grid_thw"], **TOKEN_IDS)
    assert torch.equal(unmasked[:, 0], expected)


def test_video_frames_are_separate_items(hf_model):
    """A (t, h, w) video is t frames of (1, h, w) with text in between: the temporal channel
    does not count frames, each frame restarts at the running text position."""
    sample = sample_from_layout([1, ("video", 2, 4, 4)], seed=3)
    positions = our_positions(collate([sample]))[:, 0]
    assert torch.equal(positions, hf_positions(hf_model, sample))
    ids = torch.tensor(sample.input_ids)
    frame_starts = (ids == VIDEO_TOKEN).nonzero().flatten()[[0, 4]]
    # frame 1 starts after 1 text + 3 timestamp + vision_start = position 5; frame 2 after
    # frame 1 (advance 2) + vision_end + 3 timestamp + vision_start = 5 + 2 + 5 = 12.
    assert positions[:, frame_starts[0]].tolist() == [5, 5, 5]
    assert positions[:, frame_starts[1]].tolist() == [12, 12, 12]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_padded_batch_matches_hugging_face_per_sample(hf_model, padding_side):
    samples = [sample_from_layout(layout, seed=i) for i, layout in enumerate(SAMPLE_LAYOUTS.values())]
    batch = collate(samples, padding_side, row_length=max(len(s) for s in samples) + 3)
    ours = our_positions(batch)
    keep = batch.attention_mask.bool()
    assert torch.all(ours[:, ~keep] == PADDING_POSITION)
    for i, sample in enumerate(samples):
        assert torch.equal(ours[:, i, batch.token_slices[i]], hf_positions(hf_model, sample)), i
    # Hugging Face run on the padded batch itself agrees everywhere (it writes 0 at padding too).
    hf_batch, _ = hf_model.model.get_rope_index(
        batch.input_ids,
        batch.mm_token_type_ids(),
        image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.video_grid_thw,
        attention_mask=batch.attention_mask,
    )
    assert torch.equal(ours, hf_batch)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_batch_matches_hugging_face_per_sample(hf_model, padding_side, seed):
    batch = make_batch(seed, 16, 120, padding_side=padding_side, video_prob=0.4)
    assert any(s.image_grids for s in batch.samples) and any(not s.has_vision for s in batch.samples)
    ours = our_positions(batch)
    assert torch.all(ours[:, batch.attention_mask == 0] == PADDING_POSITION)
    for i, sample in enumerate(batch.samples):
        assert torch.equal(ours[:, i, batch.token_slices[i]], hf_positions(hf_model, sample)), i


def test_padding_holes_inside_text(hf_model):
    """The keep mask may hold padding anywhere (VERL packs a left-padded prompt and a
    right-padded response in one row): real tokens still get their per-sample positions."""
    sample = sample_from_layout([4, ("image", 8, 4), 3, ("video", 2, 4, 4), 3], seed=5)
    ids = sample.input_ids
    # Insert padding slots after text tokens that are neither a vision start nor in an item.
    holes_after = {1, 3, len(ids) - 2}
    row, keep = [], []
    for t, token in enumerate(ids):
        row.append(token)
        keep.append(1)
        if t in holes_after:
            assert token not in (IMAGE_TOKEN, VIDEO_TOKEN, VISION_START)
            row += [0, 0]
            keep += [0, 0]
    kw = sample.vision_kwargs()
    ours = qwen3_vl_position_ids(
        torch.tensor([row]), torch.tensor([keep]), kw["image_grid_thw"], kw["video_grid_thw"], **TOKEN_IDS
    )
    keep_t = torch.tensor(keep).bool()
    assert torch.equal(ours[:, 0, keep_t], hf_positions(hf_model, sample))
    assert torch.all(ours[:, 0, ~keep_t] == PADDING_POSITION)


@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("seed", [0, 3])
def test_packed_row_matches_megatron_bridge(bridge_rope, padding_side, seed):
    batch = make_batch(seed, 16, 120, padding_side=padding_side, video_prob=0.4)
    extra = sample_from_layout(SAMPLE_LAYOUTS["image_and_video"], seed=9)
    batch = collate(batch.samples + [extra], padding_side)
    packed = pack_bshd_to_thd(
        batch.input_ids, batch.attention_mask, position_ids=our_positions(batch), align_to=4
    )
    assert packed.padding_mask.any(), "the test needs alignment padding slots"
    bridge_positions, _ = bridge_rope.get_rope_index(
        2,
        IMAGE_TOKEN,
        VIDEO_TOKEN,
        VISION_START,
        input_ids=packed.input_ids,
        image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.video_grid_thw,
        packed_seq_params=packed.packed_seq_params,
    )
    assert bridge_positions.shape == packed.position_ids.shape == (3, 1, packed.input_ids.shape[1])
    real = ~packed.padding_mask[0]
    assert torch.equal(packed.position_ids[:, 0, real], bridge_positions[:, 0, real])
    assert torch.all(packed.position_ids[:, 0, ~real] == PADDING_POSITION)


def test_degenerate_1d_positions_differ_from_hugging_face(hf_model):
    """The check above can fail: plain 1D positions (arange per sample on all three channels,
    what a packer that ignores MRoPE produces) are wrong as soon as a sample holds an image."""
    text = sample_from_layout(SAMPLE_LAYOUTS["text_only"], seed=0)
    assert torch.equal(degenerate_1d(len(text)), hf_positions(hf_model, text))
    for name in ("one_image", "mixed_image_sizes", "video"):
        sample = sample_from_layout(SAMPLE_LAYOUTS[name], seed=1)
        assert not torch.equal(degenerate_1d(len(sample)), hf_positions(hf_model, sample)), name


def test_truncated_image_raises():
    sample = sample_from_layout([3, ("image", 8, 8), 2, ("image", 4, 4), 2], seed=2)
    cut = sample.input_ids.index(IMAGE_TOKEN) + 5  # inside the first image
    ids = torch.tensor([sample.input_ids[:cut]])
    grids = torch.tensor(sample.image_grids)
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen3_vl_position_ids(ids, None, grids, None, **TOKEN_IDS)
    # One grid missing for two images.
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen3_vl_position_ids(sample.ids(), None, grids[:1], None, **TOKEN_IDS)
    # Image tokens and no grid at all.
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen3_vl_position_ids(sample.ids(), None, None, None, **TOKEN_IDS)


def test_truncated_video_raises():
    sample = sample_from_layout([3, ("video", 2, 4, 8), 2], seed=2)
    ids = torch.tensor([sample.input_ids[:-6]])  # cut inside the last frame
    with pytest.raises(ValueError, match="video_grid_thw"):
        qwen3_vl_position_ids(ids, None, None, torch.tensor(sample.video_grids), **TOKEN_IDS)


def test_image_truncated_by_padding_raises():
    """An image whose tail is masked out as padding is a truncated image too."""
    sample = sample_from_layout([3, ("image", 8, 8), 2], seed=4)
    batch = collate([sample])
    mask = batch.attention_mask.clone()
    mask[0, sample.input_ids.index(IMAGE_TOKEN) + 3 :] = 0
    with pytest.raises(ValueError, match="image_grid_thw"):
        qwen3_vl_position_ids(batch.input_ids, mask, batch.image_grid_thw, None, **TOKEN_IDS)


def test_padding_hole_between_vision_start_and_image(hf_model):
    """A padding slot between the vision-start token and its image is still "any position":
    the image follows its vision-start token among the real tokens, so the positions are
    Hugging Face's (no ValueError)."""
    sample = sample_from_layout([3, ("image", 4, 8), 2], seed=6)
    ids = list(sample.input_ids)
    hole = ids.index(VISION_START) + 1
    row = ids[:hole] + [0] + ids[hole:]
    keep = [1] * hole + [0] + [1] * (len(ids) - hole)
    ours = qwen3_vl_position_ids(
        torch.tensor([row]), torch.tensor([keep]), torch.tensor(sample.image_grids), None, **TOKEN_IDS
    )
    keep_t = torch.tensor(keep).bool()
    assert torch.equal(ours[:, 0, keep_t], hf_positions(hf_model, sample))


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_videos_cost_no_host_sync(hf_model, padding_side, on_host):
    """Videos of 1-3 frames, images, text-only samples: positions (and the deferred checks) with
    no host read at all, and still Hugging Face's per sample. Hugging Face and Megatron-Bridge
    split videos per frame with ``repeat_interleave(grid, grid[:, 0])``, a host read. (The host code
    reads host memory by design: it runs only on a batch that is on the host.)"""
    if on_host:
        pytest.skip("the device code's property: the host code reads the host memory it runs on")
    batch = make_batch(7, 12, 120, padding_side=padding_side, video_prob=1.0)
    extra = sample_from_layout([2, ("video", 3, 8, 4), 1, ("image", 4, 8), 2, ("video", 2, 4, 4), 1], seed=11)
    batch = collate(batch.samples + [extra], padding_side)
    assert (batch.video_grid_thw[:, 0] > 1).any() and len(batch.video_grid_thw) >= 4
    with count_ops() as counts:
        positions, checks = qwen3_vl_position_ids_deferred(
            batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.video_grid_thw, **TOKEN_IDS,
            spatial_merge_size=2,
        )
    assert counts.host_syncs == 0, counts.sync_sites
    assert not any(bool(check.failed) for check in checks)
    for i, sample in enumerate(batch.samples):
        assert torch.equal(positions[:, i, batch.token_slices[i]], hf_positions(hf_model, sample)), i


def test_video_frame_boundaries_are_checked():
    """One frame of a video masked out as padding: the frame split by offset must not hide it."""
    sample = sample_from_layout([2, ("video", 3, 4, 8), 2], seed=8)
    batch = collate([sample])
    mask = batch.attention_mask.clone()
    second_frame = [t for t, token in enumerate(sample.input_ids) if token == VIDEO_TOKEN][8]
    mask[0, second_frame : second_frame + 8] = 0  # the whole second frame (8 tokens) is gone
    with pytest.raises(ValueError, match="video_grid_thw"):
        qwen3_vl_position_ids(batch.input_ids, mask, None, batch.video_grid_thw, **TOKEN_IDS)


@pytest.mark.parametrize("dtype", [torch.long, torch.float])
def test_a_mask_with_values_other_than_0_and_1_is_refused_as_by_the_step(dtype):
    """One 2D mask rule for the package (lengths.keep_mask_from_2d): 0 / 1 or bool; a 2 is an error
    naming the argument, never "non-zero = real"; the same mask as 0 / 1 is accepted."""
    ids = torch.tensor([[5, 6, 7, 0]])
    ids_kwargs = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252)
    mask = torch.tensor([[1, 2, 1, 0]], dtype=dtype)
    with pytest.raises(ValueError, match="attention_mask"):
        qwen3_vl_position_ids(ids, mask, **ids_kwargs)
    positions = qwen3_vl_position_ids(ids, (mask != 0).to(dtype), **ids_kwargs)
    assert positions[:, 0, :3].tolist() == [[0, 1, 2]] * 3
