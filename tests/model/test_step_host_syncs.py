"""Host synchronisations of the whole ``prepare_micro_batch`` (everything the step does between the
data iterator and the model), counted by ``opcount`` on Megatron-Bridge's real model.

On a GPU each counted read stalls the host until the device catches up, on every pipeline stage:
dynamic ``thd`` needs exactly one (the row length sizes the output, and every validity flag and
the truncation counts ride in it), ``thd_static`` within ``seq_length`` needs none. Videos add
none: a batch with videos costs what the same batch with images only costs.
"""

from __future__ import annotations

import pytest
import torch
from _real_model import receipt_batch, tiny_real_model, trimmed, video_receipt_batch

from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch
from megatron.bridge_thd_testbed.opcount import count_ops
from megatron.bridge_thd_cpu.standalone import minimal_state

SEQ_LENGTH = 2048


@pytest.fixture(scope="module")
def model():
    return tiny_real_model(SEQ_LENGTH)


def _syncs(model, batch, layout, seq_length=SEQ_LENGTH, overlong_samples=None):
    state = minimal_state(seq_length=seq_length, micro_batch_size=batch["tokens"].shape[0], packing_layout=layout)
    if overlong_samples is not None:
        state.cfg.dataset.overlong_samples = overlong_samples
    model.config.seq_length = seq_length
    try:
        with count_ops() as counts:
            prepared = prepare_micro_batch(batch, model, state, model.pg_collection)
    finally:
        model.config.seq_length = SEQ_LENGTH
    return counts, prepared


def _with_4d_mask(batch):
    keep = batch["attention_mask"].bool()
    width = keep.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal[None] & keep[:, None, :] & keep[:, :, None]
    return {**batch, "attention_mask": (~allowed)[:, None]}


@pytest.mark.parametrize("padding", ["right", "left"])
def test_dynamic_thd_reads_the_host_once(model, padding):
    counts, prepared = _syncs(model, receipt_batch(padding), "thd")
    assert counts.host_syncs == 1, counts.sync_sites
    assert prepared.forward_args["packed_seq_params"] is not None


def test_dynamic_thd_with_a_4d_mask_reads_the_host_once(model):
    counts, _ = _syncs(model, _with_4d_mask(receipt_batch("right")), "thd")
    assert counts.host_syncs == 1, counts.sync_sites


def test_dynamic_thd_that_truncates_still_reads_the_host_once(model, caplog):
    batch = receipt_batch("right")
    longest = int(batch["attention_mask"].sum(1).max())
    counts, prepared = _syncs(model, batch, "thd", seq_length=longest - 5)
    assert counts.host_syncs == 1, counts.sync_sites
    assert int(prepared.stats.truncated_tokens) == 5
    assert any("truncated 5 real tokens" in r.getMessage() for r in caplog.records)


def test_static_thd_within_seq_length_never_reads_the_host(model):
    counts, prepared = _syncs(model, receipt_batch("left"), "thd_static")
    assert counts.host_syncs == 0, counts.sync_sites
    assert prepared.forward_args["input_ids"].shape[1] == 3 * SEQ_LENGTH


def test_static_thd_checks_are_device_asserts(model):
    """No read, but a bad batch still stops: the check runs on the device (RuntimeError on the
    CPU, at the next synchronisation on a GPU) with the same message."""
    batch = receipt_batch("right")
    batch = {**batch, "visual_inputs": type(batch["visual_inputs"])(
        pixel_values=batch["visual_inputs"].pixel_values, image_grid_thw=batch["visual_inputs"].image_grid_thw[:-1])}
    with pytest.raises(RuntimeError, match="image_grid_thw"):
        _syncs(model, batch, "thd_static")
    with pytest.raises(ValueError, match="image_grid_thw"):
        _syncs(model, batch, "thd")


def test_bshd_reads_the_host_once(model):
    counts, _ = _syncs(model, receipt_batch("right"), "bshd")
    assert counts.host_syncs == 1, counts.sync_sites


def test_truncation_that_cuts_an_image_is_refused_in_the_one_read(model):
    batch = trimmed(receipt_batch("right"), receipt_batch("right")["attention_mask"].sum(1).tolist())
    lengths = batch["attention_mask"].sum(1).tolist()
    with pytest.raises(ValueError, match=rf"seq_length=20 .*\(row 0: {lengths[0]} tokens, row 1: {lengths[1]} tokens, "
                                         rf"row 2: {lengths[2]} tokens\)"):
        _syncs(model, batch, "thd", seq_length=20)


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_every_policy_that_cuts_reads_the_host_once(model, policy):
    """The over-long policy's checks ride in the one read; drop's loss mask is a device op."""
    batch = receipt_batch("right")
    longest = int(batch["attention_mask"].sum(1).max())
    counts, prepared = _syncs(model, batch, "thd", seq_length=longest - 5, overlong_samples=policy)
    assert counts.host_syncs == 1, counts.sync_sites
    assert int(prepared.stats.truncated_tokens) == 5


@pytest.mark.parametrize("policy", ["truncate", "drop", "refuse"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_a_video_straddling_the_cut_is_refused_under_every_policy(model, policy, padding):
    """A cut inside a sample's video frames: refused, naming the row, whatever the policy, before the model."""
    batch = video_receipt_batch(padding)
    video = model.config.video_token_id
    keep = batch["attention_mask"].bool()
    real = [batch["tokens"][i][keep[i]] for i in range(keep.shape[0])]
    row = next(i for i, tokens in enumerate(real) if (tokens == video).any())
    columns = (real[row] == video).nonzero().flatten()
    seq_length = int(columns[len(columns) // 2])  # inside the video's placeholders
    with pytest.raises(ValueError) as info:
        _syncs(model, batch, "thd", seq_length=seq_length, overlong_samples=policy)
    message = str(info.value)
    assert message.startswith(f"overlong_samples={policy!r}: samples of this micro-batch")
    assert f"row {row}: {len(real[row])} tokens" in message and f"seq_length={seq_length}" in message


# Images only: thd 1, thd_static 0, bshd 1 (the tests above). Videos must add nothing.
SYNCS_PER_LAYOUT = {"thd": 1, "thd_static": 0, "bshd": 1}


@pytest.mark.parametrize("layout", list(SYNCS_PER_LAYOUT))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_videos_add_no_host_sync(model, layout, padding):
    """Two videos of several frames (and an image per sample): the same count as images only.
    Splitting videos into frames the way Hugging Face does (``repeat_interleave`` by ``t``
    without ``output_size``) would add one read in every layout."""
    batch = video_receipt_batch(padding)
    assert batch["visual_inputs"].video_grid_thw[:, 0].gt(1).all()
    counts, prepared = _syncs(model, batch, layout)
    assert counts.host_syncs == SYNCS_PER_LAYOUT[layout], counts.sync_sites
    assert torch.equal(prepared.forward_args["video_grid_thw"], batch["visual_inputs"].video_grid_thw)
    assert torch.equal(prepared.forward_args["pixel_values_videos"], batch["visual_inputs"].pixel_values_videos)


def test_frame_expansion_without_output_size_is_counted():
    """The counter sees the formulation this step avoids: Hugging Face's and Megatron-Bridge's
    ``get_rope_index`` split ``video_grid_thw`` per frame with a data-sized ``repeat_interleave``."""
    grid = torch.tensor([[3, 4, 8], [2, 8, 4]])
    with count_ops() as counts:
        torch.repeat_interleave(grid, grid[:, 0], dim=0)
    assert counts.host_syncs == 1, counts.sync_sites
    with count_ops() as counts:
        torch.repeat_interleave(grid, grid[:, 0], dim=0, output_size=5)
    assert counts.host_syncs == 0, counts.sync_sites
