"""Packing parity on Megatron-Bridge 0.6.2's own ``Qwen25VLModel`` (Qwen2.5-VL), built on the CPU
(``bridge_thd_testbed.qwen25_vl``): a second VLM family through the package's packing seam.

One micro-batch of 3 right-padded samples of different lengths (every sample holds an image; the
second holds two, the third also a 2-frame video, so Qwen2.5-VL's temporal rule
``t * tokens_per_second * second_per_grid_ts`` is exercised) is packed into ONE THD row by
:func:`megatron.bridge_thd.packing.pack_bshd_to_thd` (4-token alignment, so real and padded
boundaries differ) and must equal each sample run alone (batch of one, unpacked, the model's own
position computation): per-token log-probabilities, loss sums, gradients.

Qwen25VLModel.forward always computes its MRoPE ids itself (``modeling_qwen25_vl.py:216-257``)
from the row, the grids and ``packed_seq_params``; the ``position_ids`` it is given are ignored.
The positions the packer packs (each sample's own ``get_rope_index``, stacked ``(3, B, T)``) must
equal what the model computes on the packed row. See docs/qwen25-vl.md.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _real_model import collate_rows

from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd_cpu.parity import gradients, worst_relative_gradient_error
from megatron.bridge_thd_testbed.qwen25_vl import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    build_qwen25_vl,
    tiny_qwen25_vl_config,
)

DLOGP_TOLERANCE = 1e-5  # the bars of tests/model/test_real_model_parity.py (measured: ~5e-7 both)
GRAD_TOLERANCE = 1e-5
CONTROL_MIN = 1e-3
ALIGN = 4
PATCH_FEATURES = 3 * 2 * 4 * 4  # in_channels * temporal_patch_size * patch_size**2 of the tiny tower
MERGE = 2
EOS = 254
# Per sample: prompt length, vision items in order ("image"/"video", patch grid (t, h, w)), answer
# length. Grids not multiples of the 2 x 2 merged window (e.g. 6 x 10) exercise the tower's window padding.
SAMPLES = [
    (7, [("image", (1, 8, 12))], 40),
    (5, [("image", (1, 12, 8)), ("image", (1, 6, 10))], 25),
    (9, [("video", (2, 8, 8)), ("image", (1, 6, 10))], 70),
]
SECOND_PER_GRID_TS = 1.0  # with tokens_per_second 2: temporal positions step by 2 per frame


# World-size-1 process groups and the CPU patches, for every test here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_model_stack")


def _batch(seed: int = 0) -> dict:
    """3 right-padded samples laid out as Qwen2.5-VL's processor does: ``<vision_start>``, one
    placeholder per merged token (``t * h * w / 4``), ``<vision_end>``; labels the next token,
    supervised on the answer only."""
    generator = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(1, 240, (n,), generator=generator).tolist()

    rows, supervised, images, videos = [], [], [], []
    for prompt, items, answer in SAMPLES:
        tokens = text(prompt)
        for kind, (t, h, w) in items:
            placeholder = IMAGE_TOKEN_ID if kind == "image" else VIDEO_TOKEN_ID
            tokens += [VISION_START_TOKEN_ID] + [placeholder] * (t * h * w // MERGE**2) + [VISION_END_TOKEN_ID]
            tokens += text(2)
            pixels = torch.randn(t * h * w, PATCH_FEATURES, generator=generator)
            (images if kind == "image" else videos).append(((t, h, w), pixels))
        prefix = len(tokens)
        tokens += text(answer) + [EOS]
        # label[k] = token[k + 1]; supervised where that token belongs to the answer
        supervised.append([0] * (prefix - 1) + [1] * (answer + 1) + [0])
        rows.append(tokens)
    batch = collate_rows(rows, supervised)
    batch["pixel_values"] = torch.cat([p for _, p in images])
    batch["image_grid_thw"] = torch.tensor([g for g, _ in images])
    batch["pixel_values_videos"] = torch.cat([p for _, p in videos])
    batch["video_grid_thw"] = torch.tensor([g for g, _ in videos])
    batch["second_per_grid_ts"] = torch.full((len(videos),), SECOND_PER_GRID_TS)
    return batch


def _visual_of_sample(batch: dict, i: int) -> dict:
    """Sample i's images and videos, in order of appearance, as the model's keyword arguments."""
    out = {}
    counts = {"image": [sum(k == "image" for k, _ in items) for _, items, _ in SAMPLES],
              "video": [sum(k == "video" for k, _ in items) for _, items, _ in SAMPLES]}
    for kind, grid_name, pixel_name in (("image", "image_grid_thw", "pixel_values"),
                                        ("video", "video_grid_thw", "pixel_values_videos")):
        first, count = sum(counts[kind][:i]), counts[kind][i]
        if not count:
            continue
        grids = batch[grid_name]
        rows = [0] + grids.prod(-1).cumsum(0).tolist()
        out[grid_name] = grids[first : first + count]
        out[pixel_name] = batch[pixel_name][rows[first] : rows[first + count]]
        if kind == "video":
            out["second_per_grid_ts"] = batch["second_per_grid_ts"][first : first + count]
    return out


def _sample_args(batch: dict, i: int) -> dict:
    keep = batch["attention_mask"][i]
    return dict(input_ids=batch["tokens"][i][keep][None], labels=batch["labels"][i][keep][None],
                loss_mask=batch["loss_mask"][i][keep][None], **_visual_of_sample(batch, i))


def _mm_token_type_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """0 text, 1 image, 2 video: as Qwen25VLModel.forward builds them (modeling_qwen25_vl.py:229-231)."""
    types = torch.zeros_like(input_ids, dtype=torch.int)
    types[input_ids == IMAGE_TOKEN_ID] = 1
    types[input_ids == VIDEO_TOKEN_ID] = 2
    return types


def per_sample_positions(model, batch: dict) -> torch.Tensor:
    """``(3, B, T)`` MRoPE ids: each sample's own ``get_rope_index`` (Hugging Face's
    ``Qwen2_5_VLModel.get_rope_index``, bound to the model) on that sample alone; 0 at padding."""
    keep = batch["attention_mask"]
    positions = torch.zeros(3, *keep.shape, dtype=torch.long)
    for i in range(keep.shape[0]):
        visual = _visual_of_sample(batch, i)
        ids = batch["tokens"][i][keep[i]][None]
        ids_3d, _ = model.get_rope_index(ids, _mm_token_type_ids(ids), visual.get("image_grid_thw"),
                                         visual.get("video_grid_thw"),
                                         second_per_grid_ts=visual.get("second_per_grid_ts"))
        positions[:, i, : ids.shape[1]] = ids_3d[:, 0]
    return positions


def pack(model, batch: dict, **settings):
    return pack_bshd_to_thd(batch["tokens"], batch["attention_mask"], labels=batch["labels"],
                            loss_mask=batch["loss_mask"], position_ids=per_sample_positions(model, batch),
                            **{"align_to": ALIGN, **settings})


def packed_args(packed, batch: dict, **replace) -> dict:
    args = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                labels=packed.labels, loss_mask=packed.loss_mask, packed_seq_params=packed.packed_seq_params,
                pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"],
                pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"],
                second_per_grid_ts=batch["second_per_grid_ts"])
    args.update(replace)
    return args


def per_sample_of_row(output: torch.Tensor, packed, batch: dict) -> list[torch.Tensor]:
    """Sample i's per-token losses from the packed ``(1, N)`` output, at its real slots."""
    starts = packed.cu_seqlens_padded.tolist()
    return [output[0, s : s + int(n)] for s, n in zip(starts, batch["attention_mask"].sum(1))]


def max_abs_dlogp(packed: list[torch.Tensor], alone: list[torch.Tensor], batch: dict) -> list[float]:
    """Per sample: max |dlogp| over its supervised tokens (per-token losses are -log p)."""
    worst = []
    for i, (p, a) in enumerate(zip(packed, alone)):
        keep = batch["attention_mask"][i]
        supervised = batch["loss_mask"][i][keep] > 0
        worst.append(float((p - a)[supervised].abs().max()))
    return worst


def loss_sums(token_losses: list[torch.Tensor], batch: dict) -> list[float]:
    keep = batch["attention_mask"]
    return [float((loss * batch["loss_mask"][i][keep[i]]).sum()) for i, loss in enumerate(token_losses)]


@pytest.fixture(scope="module")
def model():
    return build_qwen25_vl(tiny_qwen25_vl_config(), seed=0)


@pytest.fixture(scope="module")
def batch():
    return _batch()


@pytest.fixture(scope="module")
def alone(model, batch):
    """Per-sample per-token losses ``(n_i,)`` and the parameter gradients of the masked loss sums,
    each sample run alone (unpacked, batch of one, the model computes its own positions)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(batch["tokens"].shape[0]):
        args = _sample_args(batch, i)
        token_losses = model(**args)
        assert token_losses.shape == args["input_ids"].shape  # per-token losses (b, s)
        (token_losses * args["loss_mask"]).sum().backward()
        losses.append(token_losses[0].detach())
    summed = gradients(model)
    model.zero_grad(set_to_none=True)
    return losses, summed


def test_model_is_bridge_qwen25_vl_with_hf_vision_tower(model):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    assert type(model).__module__ == "megatron.bridge.models.qwen_vl.modeling_qwen25_vl"
    assert type(model).__name__ == "Qwen25VLModel"
    assert isinstance(model.visual, Qwen2_5_VisionTransformerPretrainedModel)
    assert type(model.language_model).__name__ == "GPTModel"
    # The pipeline p2p buffer: set_input_tensor -> language_model -> decoder.
    received = torch.zeros(4, 1, 64)
    model.set_input_tensor(received)
    try:
        assert model.language_model.decoder.input_tensor is received and model.decoder is model.language_model.decoder
    finally:
        model.set_input_tensor(None)


def test_packed_row_equals_each_sample_alone(model, batch, alone):
    """Per-token log-probabilities, loss sums and gradients of the packed row equal each sample
    alone; the positions the model computes on the row equal the packed per-sample positions."""
    reference_losses, reference_grads = alone
    packed = pack(model, batch)
    assert not torch.equal(packed.cu_seqlens, packed.cu_seqlens_padded)  # alignment padding in slots
    seen = {}
    language_forward = model.language_model.forward

    def recording(**kwargs):  # Qwen25VLModel calls language_model.forward(...) directly: no hooks run
        seen.update(kwargs)
        return language_forward(**kwargs)

    model.language_model.forward = recording
    try:
        model.zero_grad(set_to_none=True)
        output = model(**packed_args(packed, batch))
        (output * packed.loss_mask).sum().backward()
    finally:
        del model.language_model.forward
    grads = gradients(model)
    model.zero_grad(set_to_none=True)

    assert output.shape == packed.input_ids.shape
    assert torch.equal(seen["position_ids"], packed.position_ids)
    per_sample = per_sample_of_row(output.detach(), packed, batch)
    dlogp = max_abs_dlogp(per_sample, reference_losses, batch)
    assert max(dlogp) <= DLOGP_TOLERANCE, dlogp
    assert loss_sums(per_sample, batch) == pytest.approx(loss_sums(reference_losses, batch), rel=1e-6)
    assert any(float(g.abs().max()) > 0 for name, g in reference_grads.items() if name.startswith("visual."))
    error, where = worst_relative_gradient_error(grads, reference_grads)
    assert error <= GRAD_TOLERANCE, f"{where}: relative gradient error {error:.2e}"


def test_video_temporal_positions_scale_with_tokens_per_second(model, batch):
    """Qwen2.5-VL's rule (transformers 5.12.1 ``Qwen2_5_VLModel.get_rope_index``): a video's
    temporal id steps by ``tokens_per_second * int(second_per_grid_ts)`` per frame, an image's
    is constant; the text after a vision item resumes at its start + max(h, w) / merge."""
    positions = per_sample_positions(model, batch)[:, 2]
    tokens = batch["tokens"][2]
    video = (tokens == VIDEO_TOKEN_ID).nonzero().flatten()
    t, h, w = batch["video_grid_thw"][0].tolist()
    start = int(positions[0, video[0]])
    per_frame = h * w // MERGE**2
    step = model.config.vision_config.tokens_per_second * int(SECOND_PER_GRID_TS)
    assert step == 2
    assert positions[0, video].tolist() == [start + f * step for f in range(t) for _ in range(per_frame)]
    after = int(video[-1]) + 1  # <vision_end>
    assert int(positions[0, after]) == start + max(h, w) // MERGE
    image = (tokens == IMAGE_TOKEN_ID).nonzero().flatten()
    assert len(set(positions[0, image].tolist())) == 1


def test_explicit_position_ids_are_ignored(model, batch):
    """Qwen25VLModel.forward overwrites its ``position_ids`` argument (modeling_qwen25_vl.py:235):
    garbage positions give the identical output."""
    packed = pack(model, batch)
    with torch.no_grad():
        expected = model(**packed_args(packed, batch))
        garbage = torch.randint(0, 1000, packed.position_ids.shape)
        assert torch.equal(model(**packed_args(packed, batch, position_ids=garbage)), expected)


def test_static_row_tail_is_refused_and_a_real_tail_works(model, batch, alone):
    """A static row (``total_length``) ends in a segment with no real token; Megatron-Bridge's
    ``unpack_mcore_thd_tensor_for_position_ids`` refuses it (``packed_seq_utils.py:176-177``).
    Declaring the tail's padding real (its real length = its slot length) runs: the tail is
    one more text segment of pad tokens, attended only by itself and never supervised."""
    total = (3 * batch["tokens"].shape[1] + 4 * ALIGN) // ALIGN * ALIGN
    packed = pack(model, batch, total_length=total)
    params = packed.packed_seq_params
    assert int(params.cu_seqlens_q[-1]) == int(params.cu_seqlens_q[-2])  # empty tail segment
    with torch.no_grad():
        with pytest.raises(ValueError, match="non-empty"):
            model(**packed_args(packed, batch))
        real_tail = params.cu_seqlens_q.clone()
        real_tail[-1] = real_tail[-2] + total - params.cu_seqlens_q_padded[-2]  # tail length: its whole slot
        params = dataclasses.replace(params, cu_seqlens_q=real_tail, cu_seqlens_kv=real_tail)
        output = model(**packed_args(packed, batch, packed_seq_params=params))
    dlogp = max_abs_dlogp(per_sample_of_row(output, packed, batch), alone[0], batch)
    assert max(dlogp) <= DLOGP_TOLERANCE, dlogp
    # The same refusal for a sample with no real token (a zero-length segment mid-row).
    empty = {k: (torch.cat([v, torch.zeros_like(v[:1])]) if k in ("tokens", "loss_mask", "attention_mask") else v)
             for k, v in batch.items()}
    empty["labels"] = torch.cat([batch["labels"], torch.full_like(batch["labels"][:1], -100)])
    packed = pack_bshd_to_thd(empty["tokens"], empty["attention_mask"], align_to=ALIGN)
    assert int(packed.cu_seqlens.diff()[-1]) == 0
    with torch.no_grad(), pytest.raises(ValueError, match="non-empty"):
        model(**packed_args(packed, empty, labels=None, loss_mask=None, position_ids=None))


def test_one_segment_control_fails(model, batch, alone):
    """The check can fail: the same row as one segment (no sample boundaries, so samples 2 and 3
    attend to the samples before them and their positions continue) moves their log-probabilities
    far beyond tolerance."""
    packed = pack(model, batch, align_to=1)
    n = packed.input_ids.shape[1]
    whole = torch.tensor([0, n], dtype=torch.int32)
    params = dataclasses.replace(packed.packed_seq_params, cu_seqlens_q=whole, cu_seqlens_kv=whole,
                                 cu_seqlens_q_padded=whole, cu_seqlens_kv_padded=whole, max_seqlen_q=n,
                                 max_seqlen_kv=n)
    with torch.no_grad():
        output = model(**packed_args(packed, batch, packed_seq_params=params))
    dlogp = max_abs_dlogp(per_sample_of_row(output, packed, batch), alone[0], batch)
    assert dlogp[0] <= DLOGP_TOLERANCE and min(dlogp[1:]) > CONTROL_MIN, dlogp


def test_text_only_positions_control_fails(model, batch, alone, monkeypatch):
    """The check sees the MRoPE layout: 1D per-sample positions copied to the three channels (what
    a naive packer emits; they still restart per sample) move every sample far beyond tolerance."""

    def text_only(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                  second_per_grid_ts=None, attention_mask=None):
        flat = (attention_mask.long().cumsum(1) - 1).clamp(min=0) if attention_mask is not None else (
            torch.arange(input_ids.shape[1]).expand_as(input_ids))
        return flat.expand(3, -1, -1).clone(), None

    packed = pack(model, batch)
    monkeypatch.setattr(model, "get_rope_index", text_only)
    with torch.no_grad():
        output = model(**packed_args(packed, batch))
    dlogp = max_abs_dlogp(per_sample_of_row(output, packed, batch), alone[0], batch)
    assert min(dlogp) > CONTROL_MIN, dlogp


def test_later_pipeline_stage_recomputes_positions_from_ids_and_grids(model, batch):
    """A stage without ``pre_process`` (no vision tower, no embedding) takes the received hidden
    states through ``set_input_tensor`` and still computes the MRoPE ids itself
    (modeling_qwen25_vl.py:216-257): it needs the packed ``input_ids``, ``packed_seq_params``, the
    grids and ``second_per_grid_ts``, not the pixels. Its output equals the full model's; without
    the grids it cannot place the image tokens."""
    stage = build_qwen25_vl(tiny_qwen25_vl_config(), pre_process=False, seed=0)
    weights = {k: v for k, v in model.language_model.state_dict().items() if not k.startswith("embedding.")}
    stage.language_model.load_state_dict(weights, strict=True)  # the same layers, no embedding
    packed = pack(model, batch)
    seen = {}
    language_forward = model.language_model.forward

    def recording(**kwargs):
        seen.update(kwargs)
        return language_forward(**kwargs)

    model.language_model.forward = recording
    try:
        with torch.no_grad():
            expected = model(**packed_args(packed, batch))
    finally:
        del model.language_model.forward
    no_pixels = dict(pixel_values=None, pixel_values_videos=None)
    stage.set_input_tensor(seen["decoder_input"])
    try:
        with torch.no_grad():
            assert torch.equal(stage(**packed_args(packed, batch, **no_pixels)), expected)
            with pytest.raises(TypeError, match="not an iterator"):  # next(None): no grid for the image run
                stage(**packed_args(packed, batch, **no_pixels, image_grid_thw=None))
    finally:
        stage.set_input_tensor(None)


def test_image_positions_follow_the_package_qwen3_rule_videos_do_not(model, batch):
    """For images Qwen2.5-VL's rule (transformers 5.12.1) is the Qwen3-VL rule of
    ``megatron.bridge_thd.mrope``: ``(p, p + i, p + j)``, then p += max(h, w) / merge. A Qwen2.5-VL
    video is one placeholder run with temporal ids ``p + f * tokens_per_second * second_per_grid_ts``;
    the Qwen3-VL rule wants a vision-start token before every frame and refuses it."""
    from megatron.bridge_thd import mrope

    rule = dict(image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                vision_start_token_id=VISION_START_TOKEN_ID, spatial_merge_size=MERGE)
    images_only = 2  # samples 0 and 1 hold images only (their 3 grids come first)
    ours = mrope.qwen3_vl_position_ids(batch["tokens"][:images_only], batch["attention_mask"][:images_only],
                                       batch["image_grid_thw"][:3], **rule)
    assert torch.equal(ours, per_sample_positions(model, batch)[:, :images_only])
    with pytest.raises(ValueError, match="vision-start"):
        mrope.qwen3_vl_position_ids(batch["tokens"], batch["attention_mask"], batch["image_grid_thw"],
                                    batch["video_grid_thw"], **rule)


# ---------------------------------------------------------------------------------------------
# The drop-in step for this family (megatron.bridge_thd.qwen25_vl_step: the step + QWEN25_VL adapter)


def _bridge_batch(batch: dict) -> dict:
    """The micro-batch as Megatron-Bridge's VLM iterator yields it: visual tensors in its own
    ``GenericVisualInputs`` (``training/utils/visual_inputs.py``)."""
    from megatron.bridge_thd.upstream.loading import load_bridge_module

    visual = load_bridge_module("training.utils.visual_inputs").GenericVisualInputs(
        pixel_values=batch["pixel_values"], pixel_values_videos=batch["pixel_values_videos"],
        image_grid_thw=batch["image_grid_thw"], video_grid_thw=batch["video_grid_thw"],
        second_per_grid_ts=batch["second_per_grid_ts"],
    )
    return dict(tokens=batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                attention_mask=batch["attention_mask"], visual_inputs=visual)


def _step(model, batch, layout, **settings):
    from megatron.bridge_thd.qwen25_vl_step import forward_step
    from megatron.bridge_thd_cpu.standalone import minimal_state

    state = minimal_state(seq_length=512, micro_batch_size=batch["tokens"].shape[0], packing_layout=layout,
                          **settings)
    output, loss_function = forward_step(state, iter([_bridge_batch(batch)]), model)
    return output, loss_function, state.bridge_thd_stats[-1]


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_drop_in_step_equals_each_sample_alone(model, batch, alone, layout):
    """The family-agnostic step with the Qwen2.5-VL adapter: the same bars as Qwen3-VL's
    (max |dlogp| and gradients within 1e-5 of each sample alone), through Megatron-Bridge's masked
    loss; ``thd`` runs with an FP8 alignment of 16 so that real and padded boundaries differ."""
    reference_losses, reference_grads = alone
    model.zero_grad(set_to_none=True)
    output, loss_function, stats = _step(model, batch, layout, fp8="hybrid" if layout == "thd" else None)
    loss, num_tokens, _ = loss_function(output)
    loss.backward()
    grads = gradients(model)
    model.zero_grad(set_to_none=True)
    assert stats.layout == layout
    lengths = batch["attention_mask"].sum(1).tolist()
    if layout == "thd":
        slots = [-(-n // 16) * 16 for n in lengths]  # each sample's slot, aligned to 16
        assert tuple(output.shape) == (1, sum(slots))
        starts = [sum(slots[:i]) for i in range(len(slots))]
        per_sample = [output[0, s : s + n].detach() for s, n in zip(starts, lengths)]
    else:
        per_sample = [output[i, :n].detach() for i, n in enumerate(lengths)]
    assert max(max_abs_dlogp(per_sample, reference_losses, batch)) <= DLOGP_TOLERANCE
    assert int(num_tokens) == int(batch["loss_mask"].sum())
    assert float(loss) == pytest.approx(sum(loss_sums(reference_losses, batch)), rel=1e-6)
    error, where = worst_relative_gradient_error(grads, reference_grads)
    assert error <= GRAD_TOLERANCE, f"{where}: relative gradient error {error:.2e}"


def test_drop_in_step_refuses_what_the_model_cannot_take(model, batch):
    with pytest.raises(ValueError, match="thd_static.*real token in every segment"):
        _step(model, batch, "thd_static")
    empty = dict(batch, attention_mask=batch["attention_mask"].clone())
    empty["attention_mask"][0] = False
    with pytest.raises(ValueError, match="without any real token"):
        _step(model, empty, "thd")
