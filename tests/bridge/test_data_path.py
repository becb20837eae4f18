"""The real data path: a cord_v2-shaped dataset made here, read by Megatron-Bridge 0.6.2's own
``cord_v2`` preset, its direct-HF SFT provider, its Qwen3-VL collate (with a processor built here)
and its data loader / iterator, into our step on the tiny real ``Qwen3VLModel``.

Everything of Megatron-Bridge runs unmodified in fresh gloo processes (``run_on_gloo(whole_bridge=True,
initialize=True)``, DP=2): ``_sft_common_vlm()``'s ``DirectHFSFTDatasetConfig`` with its
``HFDatasetSourceConfig(dataset_name="cord_v2")`` (only ``hf_processor_path``, the two flags
``configure(layout="thd")`` sets on a dataset, CPU loader settings and a shorter ``seq_length``
changed), found on disk as
``naver-clova-ix/cord-v2`` under the working directory, and ``setup_data_iterators`` as the trainer
calls it (one scoped patch: its flags tensor on the CPU). One world computes everything once (a
module fixture); each test asserts on its part. Expected values come from the parquet files and
from Megatron-Bridge's own collate run without a sequence length, never from our step.
Reasoning: docs/cord-v2-data-path.md.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron.bridge_thd_cpu.cord_v2 import (
    PROCESSOR_TOKEN_IDS,
    tiny_qwen3_vl_processor,
    write_cord_v2_preset_layout,
)
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_testbed.training import TRAINING_VISION_GEOMETRY

# Qwen3-VL's own patch geometry (patch 16, temporal 2, merge 2), for the processor and the model alike.
# Megatron-Bridge's collate resizes every image to at least QWEN_VL_MIN_PIXELS = 200704 pixels
# (smart_resize with factor patch * merge = 32, ceil on each side): an image is at least
# 200704 / 32**2 = 196 tokens, and, the receipts' aspect ratio being at most 3 (32-96 px wide,
# 48-96 px tall, rounded by qwen_vl_utils to multiples of 28), at most
# (200704 + 32 * 448 * (3**0.5 + 3**-0.5) + 32**2) / 32**2 < 230 tokens.
PATCH = TRAINING_VISION_GEOMETRY["patch_size"]
TEMPORAL_PATCH = TRAINING_VISION_GEOMETRY["temporal_patch_size"]
MERGE = TRAINING_VISION_GEOMETRY["spatial_merge_size"]
# seq_length, a multiple of pad_to_multiple_of=128 (so that a cut batch is exactly this wide) between
# the longest possible short row and the shortest possible long row:
# * a short row (1-6 menu items) is at most 229 + 43 + 880 = 1152 tokens: the image at most 229; the
#   chat framing 43 ("<|im_start|>user\n<|vision_start|>", "<|vision_end|>Describe this image.<|im_end|>\n",
#   "<|im_start|>assistant\n", "<|im_end|>\n": 6 special tokens and 37 bytes of text); the answer's
#   json2token text at most 880 bytes (6 items of at most 99 bytes each, "<s_unitprice>59,500</s_unitprice>
#   <s_price>178,500</s_price><s_nm>CHEESE CAKE</s_nm><s_cnt>3</s_cnt>", 5 "<sep/>", "<s_menu></s_menu>",
#   sub_total at most 107 and total at most 132 bytes with a subtotal of at most 6 x 178,500); a
#   byte-level BPE token is at least one byte;
# * a long row (40-55 items, write_cord_v2's long_items) is more than 40 x 32 + 196 = 1476 tokens: the
#   byte-level pre-tokenizer (GPT-2 regex) splits every item into at least 32 pieces that BPE never
#   merges across (per tag nm / cnt / price 9: "<" or "><", "s", "_", the key, ">", "</", "s", "_", the
#   key; and the values: the name at least 1, the count 1, the price, at least "2,500", 3), and the
#   image is at least 196 tokens.
# 1152 itself would do; the next multiple, 1280 (10 x 128), leaves a margin on both sides.
SEQ_LENGTH = 1280
# A seq_length that ends inside every image: the image placeholders start after 3 to 7 tokens
# ("<|im_start|>", "user\n" in 1 to 5, "<|vision_start|>") and run for at least 196, so a cut at any
# length in (7, 3 + 196) keeps part of the image only; 128 is the one multiple of pad_to_multiple_of there.
IMAGE_CUT_LENGTH = 128
DP, MICRO_BATCH = 2, 2  # micro_batch_size 2 is _sft_common_vlm's
N_TRAIN, N_VAL = 4, 2  # every second row long: with DP=2 each rank's one micro-batch holds one long row
MODEL_RANK = 0  # the DP rank that runs the model (the step, and each sample alone)


def _json2token(obj) -> str:
    """Donut's target serialisation, written here from its definition (sorted keys, reversed)."""
    if isinstance(obj, dict):
        return "".join(f"<s_{k}>{_json2token(obj[k])}</s_{k}>" for k in sorted(obj, reverse=True))
    if isinstance(obj, list):
        return "<sep/>".join(_json2token(v) for v in obj)
    return str(obj)


def _plain_batch(batch: dict) -> dict:
    """A Megatron-Bridge batch as plain tensors (its GenericVisualInputs cannot be unpickled here)."""
    visual = batch["visual_inputs"]
    out = {k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out["visual_type"] = type(visual).__name__
    out.update({f"visual.{k}": v.clone() for k, v in visual.normalized_for_model().items() if v is not None})
    return out


def _data_path_worker(root: str) -> dict:
    """One DP rank: Megatron-Bridge's provider, collate, loader and iterator; our step on the batch."""
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    os.chdir(root)  # where "naver-clova-ix/cord-v2" is a folder
    from megatron.bridge.data.loaders import setup_data_iterators
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.models.qwen_vl.data.collate_fn import qwen2_5_collate_fn
    from megatron.bridge.recipes.common import _sft_common_vlm
    from megatron.bridge.training.state import TrainState
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bridge_thd.upstream.patches import applied
    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd_cpu.cord_v2 import model_token_settings
    from megatron.bridge_thd_testbed.training import cpu_training_patches
    from megatron.bridge_thd_cpu.data import VisualInputs
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import Recorder, sample_inputs
    from megatron.bridge_thd_cpu.standalone import minimal_state

    cfg = _sft_common_vlm()
    dataset = cfg.dataset
    dataset.hf_processor_path = os.path.join(root, "processor")
    dataset.seq_length = SEQ_LENGTH  # and the model's below (0.6.2 requires the two to be equal)
    # What configure(cfg, layout="thd") sets on the dataset (configure_flags.FLAGS).
    dataset.defer_in_batch_packing_to_step = True
    dataset.skip_getting_attention_mask_from_dataset = False
    # CPU test bed: the collate in this process, nothing pinned.
    dataset.num_workers, dataset.pin_memory, dataset.persistent_workers = 0, False, False
    dataset.finalize()
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 1, MICRO_BATCH * DP, MICRO_BATCH
    cfg.validation.eval_iters = 1

    pg = ProcessGroupCollection.use_mpu_process_groups()
    provider = get_dataset_provider(dataset)
    built = {}

    def recording_provider(counts, config, tokenizer=None, pg_collection=None):
        # The provider, called by the loader exactly as setup() binds it; the datasets are kept.
        built["datasets"] = provider(counts, config, tokenizer=tokenizer, pg_collection=pg_collection)
        built["counts"] = list(counts)
        return built["datasets"]

    with applied(cpu_training_patches()):  # the loader makes its flags on 'cuda'
        train_iter, valid_iter, test_iter = setup_data_iterators(
            cfg=cfg, train_state=TrainState(), model_length=1,
            train_valid_test_datasets_provider=recording_provider, dp_group=pg.dp)
    batch = next(train_iter)
    train_ds, valid_ds, test_ds = built["datasets"]
    processor = train_ds._processor

    # (a) what the provider made of the parquet rows
    examples = {
        split: [
            {"image_size": ex["conversation"][0]["content"][0]["image"].size,
             "image_type": type(ex["conversation"][0]["content"][0]["image"]).__name__,
             "roles": [turn["role"] for turn in ex["conversation"]],
             "prompt": ex["conversation"][0]["content"][1]["text"],
             "answer": ex["conversation"][1]["content"][0]["text"]}
            for ex in ds._base_examples
        ]
        for split, ds in (("train", train_ds), ("validation", valid_ds), ("test", test_ds))
    }
    # Each train example alone through the same collate with no sequence length: its full length.
    full = [_plain_batch(qwen2_5_collate_fn([ex], processor, sequence_length=None)) for ex in train_ds._base_examples]

    # (c'), before the model: a seq_length that ends inside an image, through the same collate. A
    # cord_v2 sample is one user turn (image, prompt) and one answer, so such a cut also removes
    # every supervised token.
    short_example = next(ex for ex, f in zip(train_ds._base_examples, full) if f["attention_mask"].sum() <= SEQ_LENGTH)
    cut_error = None
    try:
        qwen2_5_collate_fn([short_example], processor, sequence_length=IMAGE_CUT_LENGTH,
                           pad_to_multiple_of=dataset.pad_to_multiple_of)
    except ValueError as error:
        cut_error = str(error)
    result = {
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "counts": built["counts"],
        "lengths": {"train": len(train_ds), "validation": len(valid_ds), "test": len(test_ds)},
        "examples": examples,
        "processor": {"type": type(processor).__name__, "image_token_id": processor.image_token_id,
                      "vocab": len(processor.tokenizer)},
        "iterators": [type(it).__name__ for it in (train_iter, valid_iter, test_iter)],
        "batch": _plain_batch(batch),
        "full": full,
        "cut_error": cut_error,
    }
    if result["dp_rank"] != MODEL_RANK:
        return result
    # (c), (d): our step on this rank's batch, with the tiny real model built with the processor's ids.
    # The other rank has returned by now: its core is free (the CPU test attention is dense).
    torch.set_num_threads(2)
    config = tiny_qwen3_vl_config(seq_length=SEQ_LENGTH, **TRAINING_VISION_GEOMETRY, **model_token_settings())
    for name, value in TRAINING_VISION_GEOMETRY.items():  # the vision tower is built from this config
        setattr(config.vision_config, name, value)
    model = build_qwen3_vl(config, seed=0)
    state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH)
    recorder = Recorder(model)
    with torch.no_grad():  # values only: the loss is compared, not its gradients
        output, loss_function = forward_step(state, iter([batch]), recorder)
        loss, num_tokens, _ = loss_function(output)
    args = recorder.calls[-1]
    stats = state.bridge_thd_stats[-1]

    # each sample alone through the same model (it computes its own MRoPE positions)
    visual = batch["visual_inputs"]
    view = dict(tokens=batch["input_ids"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                attention_mask=batch["attention_mask"],
                visual_inputs=VisualInputs(pixel_values=visual.pixel_values, image_grid_thw=visual.image_grid_thw))
    alone = []
    with torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            inputs = sample_inputs(view, i, image_token_id=PROCESSOR_TOKEN_IDS["image_token_id"], merge=MERGE,
                                   video_token_id=PROCESSOR_TOKEN_IDS["video_token_id"])
            alone.append(float((model(**inputs)[0] * inputs["loss_mask"][0]).sum()))

    result["step"] = {
        "cu_seqlens": args["packed_seq_params"].cu_seqlens_q.clone(),
        "cu_seqlens_padded": args["packed_seq_params"].cu_seqlens_q_padded.clone(),
        "input_ids": args["input_ids"].clone(), "real_tokens": int(stats.real_tokens),
        "truncated_tokens": int(stats.truncated_tokens), "loss": float(loss), "num_tokens": int(num_tokens)}
    result["alone"] = alone
    return result


@pytest.fixture(scope="module")
def receipts(tmp_path_factory):
    root = tmp_path_factory.mktemp("cord_v2")
    write_cord_v2_preset_layout(root, n_train=N_TRAIN, n_val=N_VAL, seed=0, long_every=2)
    tiny_qwen3_vl_processor(root / "processor", patch_size=PATCH)
    return root


@pytest.fixture(scope="module")
def ranks(receipts):
    return run_on_gloo(_data_path_worker, str(receipts), dp=DP, whole_bridge=True, initialize=True, timeout=300)


def _parquet_rows(receipts, split):
    """(image size, ground truth) of each row, read from the parquet file with pyarrow and PIL."""
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    table = pq.read_table(receipts / "naver-clova-ix" / "cord-v2" / "data" / f"{split}-00000-of-00001.parquet")
    rows = table.to_pylist()
    return [(Image.open(io.BytesIO(row["image"]["bytes"])).size, json.loads(row["ground_truth"])) for row in rows]


def _row_of(batch_tokens: torch.Tensor, kept: int, full: list[dict]) -> int:
    """Which train example a batch row is: the one whose full token sequence starts with its kept tokens."""
    matches = [j for j, f in enumerate(full) if f["input_ids"].shape[1] >= kept
               and torch.equal(f["input_ids"][0, :kept], batch_tokens[:kept])]
    assert len(matches) >= 1, "a batch row matches no train example"
    return matches[0]


# (a) -------------------------------------------------------------------------------------------

def test_provider_reads_every_split_with_images_and_the_ground_truth_as_answer(ranks, receipts):
    for rank in ranks:
        assert rank["processor"] == {"type": "Qwen3VLProcessor", "image_token_id": PROCESSOR_TOKEN_IDS["image_token_id"],
                                     "vocab": PROCESSOR_TOKEN_IDS["vocab_size"]}
        for split, count in (("train", N_TRAIN), ("validation", N_VAL), ("test", N_VAL)):
            rows = _parquet_rows(receipts, split)
            examples = rank["examples"][split]
            assert len(examples) == count == len(rows)
            for example, (size, truth) in zip(examples, rows):
                assert example["roles"] == ["user", "assistant"]
                assert example["image_size"] == size and "Image" in example["image_type"]
                assert example["prompt"] == "Describe this image."  # the cord_v2 adapter's default prompt
                assert example["answer"] == _json2token(truth["gt_parse"])
        # the runtime datasets are the loader's target sizes over the rows (wrapping around)
        train_target, valid_target, test_target = rank["counts"]
        assert train_target == MICRO_BATCH * DP  # train_iters 1 x global batch
        assert rank["lengths"] == {"train": train_target, "validation": valid_target, "test": test_target}


# (b) -------------------------------------------------------------------------------------------

def test_loader_yields_unpacked_batches_with_the_2d_mask_for_our_step(ranks):
    assert sorted(rank["dp_rank"] for rank in ranks) == list(range(DP))
    seen = []
    for rank in ranks:
        assert rank["dp_size"] == DP
        assert rank["iterators"][0] == "RerunDataIterator"
        batch = rank["batch"]
        assert batch["visual_type"] == "GenericVisualInputs"
        width = batch["input_ids"].shape[1]
        for key in ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids"):
            assert batch[key].shape == (MICRO_BATCH, width), key
        assert "cu_seqlens" not in batch and "cu_seqlens_q" not in batch  # packing deferred to the step
        assert set(batch["attention_mask"].unique().tolist()) <= {0, 1}
        assert width <= SEQ_LENGTH and width % 128 == 0  # pad_to_multiple_of=128, cut at seq_length
        grids = batch["visual.image_grid_thw"]
        assert grids.shape == (MICRO_BATCH, 3)  # one receipt photo per sample
        assert batch["visual.pixel_values"].shape == (int(grids.prod(-1).sum()), 3 * TEMPORAL_PATCH * PATCH * PATCH)
        keep = batch["attention_mask"].bool()
        for i in range(MICRO_BATCH):
            seen.append(_row_of(batch["input_ids"][i], int(keep[i].sum()), rank["full"]))
    assert sorted(seen) == list(range(N_TRAIN))  # DP shards: every train row exactly once


# (c) -------------------------------------------------------------------------------------------

def test_over_long_samples_are_cut_by_megatron_bridge_collate_before_our_step(ranks):
    """Megatron-Bridge's collate truncates every sequence tensor, the 2D mask included, to
    dataset.seq_length (which 0.6.2 requires to equal model.seq_length): the step sees the cut row
    as a full-length sample and nothing for it to truncate. The cut is silent upstream (it raises
    only when a row loses every supervised token). Measured here, per long row."""
    long_rows = 0
    for rank in ranks:
        batch = rank["batch"]
        keep = batch["attention_mask"].bool()
        for i in range(MICRO_BATCH):
            f = rank["full"][_row_of(batch["input_ids"][i], int(keep[i].sum()), rank["full"])]
            full_length, kept = int(f["attention_mask"].sum()), int(keep[i].sum())
            image_tokens = int(f["visual.image_grid_thw"].prod(-1).sum()) // MERGE**2
            row = batch["input_ids"][i][keep[i]]
            # no image is cut: every placeholder of the sample reaches the step, with its pixels
            assert int((row == PROCESSOR_TOKEN_IDS["image_token_id"]).sum()) == image_tokens
            assert torch.equal(batch["visual.image_grid_thw"][i], f["visual.image_grid_thw"][0])
            if full_length <= SEQ_LENGTH:
                assert kept == full_length
                assert torch.equal(batch["loss_mask"][i][keep[i]], f["loss_mask"][0])
                continue
            long_rows += 1
            # the long row arrives cut to seq_length; its tail is gone before the step runs
            assert batch["input_ids"].shape[1] == SEQ_LENGTH and kept == SEQ_LENGTH
            lost_supervised = float(f["loss_mask"].sum() - batch["loss_mask"][i].sum())
            assert full_length - SEQ_LENGTH > 0 and lost_supervised > 0
            assert lost_supervised == float(f["loss_mask"][0, SEQ_LENGTH:].sum())
            # the end of the answer (and its <|im_end|>) never reaches the model
            assert int(f["input_ids"][0, full_length - 2]) == PROCESSOR_TOKEN_IDS["eos_token_id"]
            assert PROCESSOR_TOKEN_IDS["eos_token_id"] not in row[-64:].tolist()
    assert long_rows == DP  # one long row per rank (every second train row is long)


def test_our_step_captures_the_mask_it_receives_and_truncates_nothing_more(ranks):
    rank = next(r for r in ranks if r["dp_rank"] == MODEL_RANK)
    batch, step = rank["batch"], rank["step"]
    keep = batch["attention_mask"].bool()
    assert step["cu_seqlens"].diff().tolist() == keep.sum(1).tolist()
    assert SEQ_LENGTH in step["cu_seqlens"].diff().tolist()  # this rank's long row, already cut upstream
    assert step["truncated_tokens"] == 0 and step["real_tokens"] == int(keep.sum())
    # the row the model gets: each sample's real tokens in order, in its (aligned) slot
    for i, start in enumerate(step["cu_seqlens_padded"][:-1].tolist()):
        n = int(keep[i].sum())
        assert torch.equal(step["input_ids"][0, start:start + n], batch["input_ids"][i][keep[i]])


def test_a_seq_length_inside_an_image_is_refused_by_megatron_bridge_collate(ranks):
    """A cut inside a cord_v2 image also cuts the whole answer after it: Megatron-Bridge's collate
    refuses the batch itself (``pad_or_truncate_sequence_batch``), before any step; no batch with a
    cut image reaches our step on this data path."""
    for rank in ranks:
        assert rank["cut_error"] is not None
        assert "removed every supervised token" in rank["cut_error"] and f"to {IMAGE_CUT_LENGTH} tokens" in rank["cut_error"]


# (d) -------------------------------------------------------------------------------------------

def test_packed_loss_equals_the_sum_of_each_sample_alone(ranks):
    rank = next(r for r in ranks if r["dp_rank"] == MODEL_RANK)
    step, alone = rank["step"], rank["alone"]
    assert step["num_tokens"] == int(rank["batch"]["loss_mask"].sum())
    assert step["loss"] == pytest.approx(sum(alone), rel=1e-5, abs=1e-4)
    # the row holds real tokens only (thd): fewer slots than the padded batch
    assert step["input_ids"].shape[1] == int(step["cu_seqlens_padded"][-1]) < rank["batch"]["input_ids"].numel()
