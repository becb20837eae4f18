"""Samples longer than ``seq_length`` on Megatron-Bridge 0.6.2's real data path: its ``cord_v2`` preset, provider,
Qwen3-VL collate, loader builder and iterator (as tests/bridge/test_data_path.py builds them), with our loader
builder wrapper (``batching.bridge.loader_patch``) as ``configure`` installs it, one world per run, each policy of
``dataset.overlong_samples`` in turn.

The expected numbers are independent of our code: each sample's full length and supervised tokens come from
Megatron-Bridge's own collate run on it alone without a sequence length; what is lost is those minus the first
``seq_length`` columns. Reasoning: docs/overlong-samples.md.
"""

from __future__ import annotations

import functools
import logging
import os

import pytest
import torch

from megatron.bridge_thd.settings import PackingSettings, settings_of
from megatron.bridge_thd_cpu.cord_v2 import PROCESSOR_TOKEN_IDS, tiny_qwen3_vl_processor, write_cord_v2_preset_layout
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_testbed.training import TRAINING_VISION_GEOMETRY

# As tests/bridge/test_data_path.py: 1280 lies between the longest short receipt (1152 tokens at most) and the
# shortest long one (more than 1476), so every long receipt is cut and no short one.
SEQ_LENGTH = 1280
MICRO_BATCH = 2
POLICIES = ("truncate", "drop", "refuse")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _batch_for(policy: str, root: str, *, seq_length: int = SEQ_LENGTH, model=None, global_batch: bool = False):
    """Megatron-Bridge's first training batch with our loader wrapper and ``policy``, or the error it raises, and
    where: ``"build"`` (the loaders) or ``"collate"`` (the first batch). ``model``: the run's model provider (its
    placeholder ids), None as ``_sft_common_vlm`` leaves it; ``global_batch``: global-batch packing's loaders."""
    from megatron.bridge.data.loaders import setup_data_iterators
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.recipes.common import _sft_common_vlm
    from megatron.bridge.training.state import TrainState
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron.bridge_thd.batching.bridge import loader_patch
    from megatron.bridge_thd.upstream.patches import applied
    from megatron.bridge_thd.settings import GlobalBatchPacking
    from megatron.bridge_thd_testbed.training import cpu_training_patches

    cfg = _sft_common_vlm()
    cfg.model = model
    dataset = cfg.dataset
    dataset.hf_processor_path = os.path.join(root, "processor")
    dataset.seq_length = seq_length
    # What configure(cfg, layout="thd", overlong_samples=policy) sets on the dataset (configure_flags.FLAGS).
    dataset.defer_in_batch_packing_to_step, dataset.skip_getting_attention_mask_from_dataset = True, False
    packing = GlobalBatchPacking(sizes_cache=os.path.join(root, "sizes"), log=False) if global_batch else None
    dataset.bridge_thd = PackingSettings(layout="thd", overlong_samples=policy, global_batch_packing=packing)
    dataset.num_workers, dataset.pin_memory, dataset.persistent_workers = 0, False, False
    dataset.finalize()
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = 1, MICRO_BATCH, MICRO_BATCH
    cfg.validation.eval_iters = 1
    provider = get_dataset_provider(dataset)
    built = {}

    def recording_provider(counts, config, tokenizer=None, pg_collection=None):
        built["datasets"] = provider(counts, config, tokenizer=tokenizer, pg_collection=pg_collection)
        return built["datasets"]

    with applied(cpu_training_patches() + [loader_patch()]):
        try:
            train_iter, _, _ = setup_data_iterators(
                cfg=cfg, train_state=TrainState(), model_length=1, train_valid_test_datasets_provider=recording_provider,
                dp_group=ProcessGroupCollection.use_mpu_process_groups().dp)
        except ValueError as error:
            return None, built["datasets"][0], ("build", str(error))
        try:
            return next(train_iter), built["datasets"][0], None
        except ValueError as error:
            return None, built["datasets"][0], ("collate", str(error))


# Cuts of the preset's receipts (each: a short prompt, one image, the answer; measured from the full collates in the
# tests): at 240 every image is whole and some samples' answers start past the cut; at 210 some images are cut.
SUPERVISION_CUT, IMAGE_CUT = 240, 210
CASES = [(SUPERVISION_CUT, policy) for policy in POLICIES] + [(IMAGE_CUT, policy) for policy in POLICIES]


def _policy_cases(root: str, config) -> dict:
    """Each (seq_length, policy) of :data:`CASES` on the in-batch path and in global-batch packing's loaders: the
    error and where it was raised, or the first batch's measures and loss mask, and the package's log lines."""
    from megatron.bridge_thd.overlong import LENGTHS_KEY, SAMPLE_INDEX_KEY

    logger = logging.getLogger("megatron.bridge_thd")
    cases = {}
    for seq_length, policy in CASES:
        for path in ("in-batch", "global-batch"):
            handler, level = _Lines(), logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            try:
                config.seq_length = seq_length
                batch, _, error = _batch_for(policy, root, seq_length=seq_length, model=config,
                                             global_batch=path == "global-batch")
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            entry = {"error": error, "lines": handler.lines}
            if batch is not None:
                entry.update(measures=batch[LENGTHS_KEY].clone(), loss_mask=batch["loss_mask"].clone(),
                             indices=batch[SAMPLE_INDEX_KEY].tolist())
            cases[seq_length, policy, path] = entry
    return cases


def _overlong_worker(root: str) -> dict:
    """Every policy on one rank: the batch, what our step logs and its loss; each sample alone; the lengths scan."""
    import multiprocessing

    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    os.chdir(root)
    # Loader workers (and the lengths scan's) start as in a rank torchrun starts: forked (the test bed's ranks come
    # from a forkserver; training.runner sets the same).
    multiprocessing.set_start_method("fork", force=True)
    from megatron.bridge.models.qwen_vl.data.collate_fn import qwen2_5_collate_fn

    from megatron.bridge_thd.batching.bridge import check_overlong
    from megatron.bridge_thd.batching.sizes import repeat_period, scan_sizes
    from megatron.bridge_thd.overlong import LENGTHS_KEY, SAMPLE_INDEX_KEY
    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd_cpu.cord_v2 import model_token_settings
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.standalone import minimal_state

    torch.set_num_threads(2)
    config = tiny_qwen3_vl_config(seq_length=SEQ_LENGTH, **TRAINING_VISION_GEOMETRY, **model_token_settings())
    for name, value in TRAINING_VISION_GEOMETRY.items():
        setattr(config.vision_config, name, value)
    model = build_qwen3_vl(config, seed=0)
    logger = logging.getLogger("megatron.bridge_thd")
    result = {}
    for policy in POLICIES:
        batch, train_ds, error = _batch_for(policy, root)
        entry = {"error": None if error is None else error[1], "error_at": None if error is None else error[0]}
        if batch is not None:
            handler, level = _Lines(), logger.level
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH)
            state.cfg.dataset.overlong_samples = policy
            try:
                with torch.no_grad():
                    output, loss_function = forward_step(state, iter([batch]), model)
                    loss, num_tokens, _ = loss_function(output)
            finally:
                logger.removeHandler(handler)
                logger.setLevel(level)
            entry.update(measures=batch[LENGTHS_KEY].clone(), loss_mask=batch["loss_mask"].clone(),
                         labels=batch["labels"].clone(), input_ids=batch["input_ids"].clone(),
                         sample_index=batch[SAMPLE_INDEX_KEY].tolist(),
                         attention_mask=batch["attention_mask"].clone(), loss=float(loss), num_tokens=int(num_tokens),
                         lines=handler.lines)
        result[policy] = entry
    processor = train_ds._processor
    # Each drawn sample alone, cut the same way: Megatron-Bridge's collate on that example alone at seq_length, through
    # the same step and model (the reference for the per-sample losses).
    result["alone"] = {}
    for index in result["truncate"]["sample_index"]:
        example = train_ds._base_examples[index % len(train_ds._base_examples)]
        alone = qwen2_5_collate_fn([example], processor, sequence_length=SEQ_LENGTH)
        state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=1)
        with torch.no_grad():
            output, loss_function = forward_step(state, iter([alone]), model)
            loss, num_tokens, _ = loss_function(output)
        result["alone"][index] = (float(loss), int(num_tokens))
    result["full"] = [
        {key: value.clone() for key, value in qwen2_5_collate_fn([ex], processor, sequence_length=None).items()
         if isinstance(value, torch.Tensor)} for ex in train_ds._base_examples]
    # The global-batch lengths scan (collates in a worker process) sees the lengths before the cut.
    sizes = scan_sizes(train_ds, train_ds.collate_fn, seq_length=SEQ_LENGTH, num_workers=1, context="fork")
    result["sizes"] = (sizes.lengths.clone(), sizes.untruncated.clone(), sizes.supervised.clone())
    # bridge-thd scan's lengths file of the same dataset, read back as global-batch packing's lengths_file reads it.
    from megatron.bridge_thd.batching.sizes import file_sizes
    from megatron.bridge_thd.plan.scan.cache import scan_dataset
    from megatron.bridge_thd.plan.scan.lengths_file import write_lengths

    # The scan collates uncut, as bridge-thd scan builds the recipe's dataset (seq_length out of reach).
    uncut = functools.partial(qwen2_5_collate_fn, processor=processor, sequence_length=None)
    written = write_lengths(scan_dataset(train_ds, uncut, merge=2, num_workers=1, placeholder_ids=(
        config.image_token_id, config.video_token_id),
                                         cache_dir=os.path.join(root, "scan-cache")), os.path.join(root, "lengths.json"))
    from_file = file_sizes(written, train_ds, seq_length=SEQ_LENGTH)
    result["file_sizes"] = {name: (getattr(from_file, name), getattr(sizes, name))
                            for name in ("lengths", "untruncated", "supervised", "patches", "patches_squared",
                                         "vision_cut")}
    result["file_vision_cut"] = file_sizes(written, train_ds, seq_length=IMAGE_CUT).vision_cut.clone()
    try:
        check_overlong(sizes, seq_length=SEQ_LENGTH, policy="refuse", label="train")
        result["build_refusal"] = None
    except ValueError as refusal:
        result["build_refusal"] = str(refusal)
    result["cases"] = _policy_cases(root, config)
    result["period"] = repeat_period(train_ds)  # the training set's distinct samples (its first indices)
    return result


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("cord_v2_overlong")
    write_cord_v2_preset_layout(root, n_train=4, n_val=2, seed=0, long_every=2)
    tiny_qwen3_vl_processor(root / "processor", patch_size=TRAINING_VISION_GEOMETRY["patch_size"])
    return run_on_gloo(_overlong_worker, str(root), dp=1, whole_bridge=True, initialize=True, timeout=300)[0]


def _rows(world, policy):
    """Per batch row: (full length, full supervised tokens, supervised tokens past seq_length), from the full
    collate of the example whose tokens the row starts with."""
    entry, rows = world[policy], []
    for i in range(MICRO_BATCH):
        kept = int(entry["attention_mask"][i].sum())
        match = next(f for f in world["full"] if torch.equal(f["input_ids"][0, :kept], entry["input_ids"][i, :kept]))
        rows.append((int(match["attention_mask"].sum()), int((match["loss_mask"] != 0).sum()),
                     int((match["loss_mask"][0, SEQ_LENGTH:] != 0).sum())))
    return rows


def test_the_collate_carries_each_samples_lengths_before_its_cut(world):
    rows = _rows(world, "truncate")
    assert any(full > SEQ_LENGTH for full, _, _ in rows) and any(full <= SEQ_LENGTH for full, _, _ in rows)
    measures = world["truncate"]["measures"]
    assert measures[0].tolist() == [full for full, _, _ in rows]
    assert measures[1].tolist() == [supervised for _, supervised, _ in rows]
    assert measures[2].tolist() == [0, 0]
    assert world["truncate"]["input_ids"].shape[1] == SEQ_LENGTH  # Megatron-Bridge still cut the long row


def test_truncate_cuts_as_megatron_bridge_does_and_counts_the_loss_in_the_log(world):
    rows = _rows(world, "truncate")
    lost = sum(full - SEQ_LENGTH for full, _, _ in rows if full > SEQ_LENGTH)
    lost_supervised = sum(past for full, _, past in rows if full > SEQ_LENGTH)
    lines = world["truncate"]["lines"]
    warnings = [text for level, text in lines if level == "WARNING" and "longer than seq_length" in text]
    assert len(warnings) == 1 and "overlong_samples='truncate' cuts them" in warnings[0]
    assert "Set overlong_samples='refuse'" in warnings[0]
    assert (f"bridge_thd: 1 over-long sample(s) cut to seq_length={SEQ_LENGTH}: {lost} real tokens and {lost_supervised} "
            "supervised tokens lost") in [text for _, text in lines]
    assert lost > 0 and lost_supervised > 0


def test_drop_takes_the_sample_out_of_the_loss(world):
    truncated, dropped = world["truncate"], world["drop"]
    rows = _rows(world, "drop")
    long_row = next(i for i, (full, _, _) in enumerate(rows) if full > SEQ_LENGTH)
    assert dropped["measures"][2].tolist() == [int(i == long_row) for i in range(MICRO_BATCH)]
    assert not dropped["loss_mask"][long_row].any() and (dropped["labels"][long_row] == -100).all()
    short = 1 - long_row
    assert torch.equal(dropped["loss_mask"][short], truncated["loss_mask"][short])
    # The loss counts the short sample's supervised tokens only (the same batch rows as under truncate).
    assert dropped["num_tokens"] == int(truncated["loss_mask"][short].sum())
    assert dropped["loss"] < truncated["loss"]
    assert (f"bridge_thd: dropped 1 over-long sample(s) from the loss ({rows[long_row][1]} supervised tokens; "
            f"{rows[long_row][0] - SEQ_LENGTH} real tokens cut to seq_length={SEQ_LENGTH})") in [
                text for _, text in dropped["lines"]]


@pytest.mark.parametrize("policy", ["truncate", "drop"])
def test_the_micro_batchs_loss_is_each_samples_alone_cut_the_same_way(world, policy):
    """truncate: the micro-batch's loss and tokens are the sum of each sample alone, cut by Megatron-Bridge's collate
    at seq_length; drop: the same without the over-long samples."""
    entry = world[policy]
    kept = [index for row, index in enumerate(entry["sample_index"])
            if policy == "truncate" or not entry["measures"][2, row]]
    assert policy == "truncate" or len(kept) < MICRO_BATCH  # drop takes a sample out
    assert entry["loss"] == pytest.approx(sum(world["alone"][i][0] for i in kept), rel=1e-5)
    assert entry["num_tokens"] == sum(world["alone"][i][1] for i in kept)


def test_refuse_stops_at_the_first_over_long_sample_with_its_length_and_the_fix(world):
    error = world["refuse"]["error"]
    full = max(f["attention_mask"].sum().item() for f in world["full"][:MICRO_BATCH])
    assert error is not None and f"longer than seq_length={SEQ_LENGTH}" in error
    assert f"{int(full)} tokens" in error and "dataset.seq_length and model.seq_length" in error
    assert error.startswith("overlong_samples='refuse': ") and "set overlong_samples to 'truncate'" in error
    # The loader wrapper hands the collate each sample's dataset index: the refusal names it.
    drawn = world["truncate"]["sample_index"]
    long_row = next(row for row in range(MICRO_BATCH) if world["truncate"]["measures"][0, row] > SEQ_LENGTH)
    assert f"row {long_row} (dataset sample {drawn[long_row]}): {int(full)} tokens" in error


def test_the_lengths_scan_sees_the_untruncated_lengths_and_refuses_by_dataset_index(world):
    lengths, untruncated, supervised = world["sizes"]
    # The run's training set: as many indices as the run draws, index i being base example i % 4.
    examples = [world["full"][i % len(world["full"])] for i in range(len(untruncated))]
    full = [int(f["attention_mask"].sum()) for f in examples]
    assert untruncated.tolist() == full
    assert supervised.tolist() == [int((f["loss_mask"] != 0).sum()) for f in examples]
    assert lengths.tolist() == [min(n, SEQ_LENGTH) for n in full]
    over = [i for i, n in enumerate(full) if n > SEQ_LENGTH]
    refusal = world["build_refusal"]
    assert over and refusal is not None
    assert f"{len(over)} distinct sample(s) of the train dataset" in refusal
    assert all(f"{i} ({full[i]} tokens)" in refusal for i in over)


def _full_measures(world) -> list[dict]:
    """Per distinct sample, from Megatron-Bridge's collate run on it alone without a sequence length: its real
    tokens, supervised tokens, first supervised column and last image or video placeholder column."""
    from megatron.bridge_thd_cpu.cord_v2 import PROCESSOR_TOKEN_IDS

    vision_ids = torch.tensor([PROCESSOR_TOKEN_IDS["image_token_id"], PROCESSOR_TOKEN_IDS["video_token_id"]])
    rows = []
    for full in world["full"]:
        ids, supervised = full["input_ids"][0], (full["loss_mask"][0] != 0)
        rows.append(dict(tokens=int(full["attention_mask"].sum()), supervised=int(supervised.sum()),
                         first_supervised=int(supervised.nonzero().min()),
                         last_vision=int(torch.isin(ids, vision_ids).nonzero().max())))
    return rows


def _expected(world, seq_length: int) -> dict[str, list[int]]:
    """The training set's distinct samples each rule concerns at ``seq_length``, from :func:`_full_measures`."""
    full = _full_measures(world)[:world["period"]]
    over = [i for i, f in enumerate(full) if f["tokens"] > seq_length]
    return {"over": over,
            "vision_cut": [i for i in over if full[i]["last_vision"] >= seq_length],
            "emptied": [i for i in over if full[i]["first_supervised"] >= seq_length and full[i]["supervised"] > 0]}


def test_the_cases_cover_each_rule(world):
    at_supervision_cut, at_image_cut = _expected(world, SUPERVISION_CUT), _expected(world, IMAGE_CUT)
    assert at_supervision_cut["emptied"] and not at_supervision_cut["vision_cut"]
    assert set(at_supervision_cut["emptied"]) < set(at_supervision_cut["over"])  # some keep a part of their answer
    assert at_image_cut["vision_cut"] and set(at_image_cut["vision_cut"]) < set(at_image_cut["over"])


def _named(message: str, samples: list[int], full: list[dict], *, period: int) -> list[int]:
    """The distinct samples among ``range(period)`` the build-time refusal names by dataset index and length."""
    return [i for i in range(period) if f"{i} ({full[i]['tokens']} tokens" in message]


@pytest.mark.parametrize("seq_length,policy", CASES)
def test_global_batch_packing_judges_every_sample_by_the_policy_when_the_loaders_are_built(world, seq_length, policy):
    """The lengths scan measures every sample (before the fix it raised Megatron-Bridge's "removed every supervised
    token" while the loaders were built); the build refuses by dataset index what the policy refuses, or logs it."""
    case, full = world["cases"][seq_length, policy, "global-batch"], _full_measures(world)
    expected, period = _expected(world, seq_length), world["period"]
    if policy == "refuse":
        refused, rule = expected["over"], "longer than"
    elif expected["vision_cut"]:
        refused, rule = expected["vision_cut"], "have an image or video placeholder past"
    elif policy == "truncate":
        refused, rule = expected["emptied"], "have every supervised token past"
    else:
        refused, rule = [], None
    if refused:
        where, message = case["error"]
        assert where == "build" and message.startswith(f"overlong_samples={policy!r}: {len(refused)} distinct sample(s) "
                                                       "of the train dataset")
        assert f"{rule} seq_length={seq_length}" in message
        assert _named(message, refused, full, period=period) == refused
        assert "Megatron-Bridge's collate" in message or "max_pixels" in message
        return
    assert case["error"] is None
    # drop: every over-long sample is named by dataset index in the build log, and its rows carry no supervision.
    logged = [text for level, text in case["lines"]
              if "(train loader)" in text and "are dropped from the loss when drawn" in text]
    assert len(logged) == 1 and _named(logged[0], expected["over"], full, period=period) == expected["over"]
    rows_over = [index % period in expected["over"] for index in case["indices"]]
    assert case["measures"][2].tolist() == [int(flag) for flag in rows_over]
    assert [bool(case["loss_mask"][row].any()) for row in range(MICRO_BATCH)] == [not flag for flag in rows_over]


@pytest.mark.parametrize("seq_length,policy", CASES)
def test_the_in_batch_collate_judges_each_row_by_the_policy_naming_its_dataset_index(world, seq_length, policy):
    case, expected, period = world["cases"][seq_length, policy, "in-batch"], _expected(world, seq_length), world["period"]
    drawn = world["truncate"]["sample_index"]  # the first micro-batch's dataset indices (the loader attaches them)
    assert len(drawn) == MICRO_BATCH
    concerned = {"refuse": expected["over"]}.get(policy, expected["vision_cut"] or (
        expected["emptied"] if policy == "truncate" else []))
    refused_rows = [row for row, index in enumerate(drawn) if index % period in concerned]
    if not refused_rows:
        assert case["error"] is None
        return
    where, message = case["error"]
    assert where == "collate" and message.startswith(f"overlong_samples={policy!r}: {len(refused_rows)} sample(s) of "
                                                     f"this micro-batch")
    for row, index in enumerate(drawn):
        assert (f"row {row} (dataset sample {index})" in message) == (row in refused_rows)


# --- the pieces, without a world ----------------------------------------------------------------------


def _identity(examples):
    return examples


def test_the_policy_travels_with_a_picklable_collate_and_bad_values_are_refused():
    import pickle

    from megatron.bridge_thd.configure import configure
    from megatron.bridge_thd.overlong import OverlongCollate, policy_of
    from types import SimpleNamespace

    copy = pickle.loads(pickle.dumps(OverlongCollate(_identity, "drop")))  # a spawned loader worker gets this
    assert copy.policy == "drop" and copy.collate_fn is _identity
    with pytest.raises(ValueError, match=r"policy: 'cut'; expected one of 'truncate', 'drop', 'refuse'"):
        OverlongCollate(_identity, "cut")
    # Hand-set: the refusal names the attribute the user set, then the record's own words.
    with pytest.raises(ValueError, match=r"^the hand-set settings of cfg.dataset \(dataset.overlong_samples='skip'; .*\): "
                       r"dataset.bridge_thd \(megatron.bridge_thd's settings\):\n- overlong_samples: "
                       r"'skip'; expected one of 'truncate', 'drop', 'refuse'"):
        policy_of(SimpleNamespace(overlong_samples="skip"))
    assert policy_of(SimpleNamespace()) == "truncate"
    cfg = SimpleNamespace(dataset=SimpleNamespace(seq_length=4096), train=SimpleNamespace(micro_batch_size=2),
                          model=SimpleNamespace(pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                                                seq_length=4096))
    with pytest.raises(ValueError, match=r"overlong_samples: 'cut'; expected one of"):
        configure(cfg, "thd", overlong_samples="cut")
    assert settings_of(configure(cfg, "thd", overlong_samples="refuse").dataset).overlong_samples == "refuse"
    assert policy_of(cfg.dataset) == "refuse"


def test_rows_are_measured_from_the_2d_mask_before_the_cut():
    from megatron.bridge_thd.overlong import LENGTHS_KEY, MEASURES, measure_rows

    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 0, 0, 0, 0]], dtype=torch.float)
    batch = {"attention_mask": mask, "loss_mask": loss_mask, "labels": torch.zeros(2, 6, dtype=torch.long)}
    measure_rows(batch, 4, "drop")
    assert MEASURES == ("tokens", "supervised", "dropped", "supervised_kept", "vision_cut")
    # Row 0: 5 real tokens, 3 supervised (columns 2-4), 2 of them before the cut at 4; dropped. Row 1: within.
    assert batch[LENGTHS_KEY].tolist() == [[5, 2], [3, 1], [1, 0], [2, 1], [0, 0]]
    assert batch["loss_mask"][0].sum() == 0 and (batch["labels"][0] == -100).all() and batch["loss_mask"][1].sum() == 1
    with pytest.raises(ValueError, match=r"^overlong_samples='refuse': 1 sample\(s\) of this micro-batch are longer "
                                         r"than seq_length=4 \(row 0: 5 tokens \(3 supervised, 2 of them before the "
                                         r"cut\)\)"):
        measure_rows({"attention_mask": mask, "loss_mask": loss_mask}, 4, "refuse")
    no_mask = {"loss_mask": loss_mask}
    measure_rows(no_mask, 4, "refuse")  # the real lengths are unknown without a 2D mask: nothing to judge
    assert LENGTHS_KEY not in no_mask


IMAGE_ID, VIDEO_ID = 7, 8


def _row_batch(rows: list[list[int]], supervised: list[list[int]]) -> dict:
    """A right-padded collated batch of the given token rows (0 = padding) and 0 / 1 loss masks."""
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    loss_mask = torch.tensor([row + [0] * (width - len(row)) for row in supervised], dtype=torch.float)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "loss_mask": loss_mask,
            "labels": torch.where(loss_mask != 0, ids, -100)}


@pytest.mark.parametrize("policy", ["truncate", "drop", "refuse"])
@pytest.mark.parametrize("vision_id", [IMAGE_ID, VIDEO_ID])
def test_an_image_or_video_straddling_the_cut_is_refused_under_every_policy(policy, vision_id):
    from megatron.bridge_thd.overlong import OverlongRule, measure_rows

    # Row 1's placeholders run from column 2 to 5, across the cut at 4; row 0's lie before it.
    batch = _row_batch([[1, IMAGE_ID, IMAGE_ID, 2, 3, 4], [1, 2, vision_id, vision_id, vision_id, vision_id, 5]],
                       [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1]])
    with pytest.raises(ValueError) as info:
        measure_rows(batch, 4, OverlongRule(policy, (IMAGE_ID, VIDEO_ID)), indices=[40, 41])
    message = str(info.value)
    if policy == "refuse":  # refuse names every over-long sample first
        assert message.startswith("overlong_samples='refuse': 2 sample(s) of this micro-batch are longer than")
    else:
        assert message.startswith(f"overlong_samples={policy!r}: 1 sample(s) of this micro-batch have an image or "
                                  "video placeholder past seq_length=4 (row 1 (dataset sample 41): 7 tokens")
        assert "row 0" not in message and "max_pixels" in message


def test_a_sample_whose_supervision_lies_past_the_cut_is_refused_by_truncate_and_dropped_by_drop():
    from megatron.bridge_thd.overlong import DROPPED, LENGTHS_KEY, OverlongRule, measure_rows

    def batch():
        return _row_batch([[1, 2, 3, 4, 5, 6], [1, 2, 3]], [[0, 0, 0, 0, 1, 1], [0, 1, 1]])

    with pytest.raises(ValueError, match=r"^overlong_samples='truncate': 1 sample\(s\) of this micro-batch have every "
                                         r"supervised token past seq_length=4 \(row 0: 6 tokens \(2 supervised, 0 of "
                                         r"them before the cut\)\); .*Set overlong_samples='drop'"):
        measure_rows(batch(), 4, OverlongRule("truncate"))
    dropped = batch()
    measure_rows(dropped, 4, OverlongRule("drop"))
    assert dropped[LENGTHS_KEY][DROPPED].tolist() == [1, 0] and dropped["loss_mask"][0].sum() == 0
    # The lengths scan measures it and refuses nothing; it masks the row only so that Megatron-Bridge's collate,
    # which refuses a row the cut empties, lets the measuring pass (the build-time check judges it by index).
    scanned = batch()
    measure_rows(scanned, 4, OverlongRule(None).for_scan())
    assert scanned[LENGTHS_KEY][:, 0].tolist() == [6, 2, 0, 0, 0] and scanned["loss_mask"][0].sum() == 0
    # Measuring without a rule changes nothing.
    plain = batch()
    measure_rows(plain, 4, None)
    assert torch.equal(plain["loss_mask"], batch()["loss_mask"])


def test_the_collate_unwraps_indexed_samples_for_megatron_bridges_collate():
    from megatron.bridge_thd.overlong import IndexedDataset, OverlongCollate

    seen = {}

    def collate(examples):
        seen["examples"] = examples
        return {"examples": examples}

    dataset = IndexedDataset([[1, 2], [3, 4, 5]])
    OverlongCollate(collate, "truncate")([dataset[1], dataset[0]])
    assert seen["examples"] == [[3, 4, 5], [1, 2]]  # Megatron-Bridge's collate gets the samples themselves
    assert len(dataset) == 2 and dataset.dataset == [[1, 2], [3, 4, 5]]


def test_bridge_thd_scans_file_gives_global_batch_packing_the_sizes_its_own_scan_measures(world):
    for name, (from_file, scanned) in world["file_sizes"].items():
        assert torch.equal(from_file, scanned), name
    # Its image_end tells which samples a cut splits an image of (the build-time check refuses those by index).
    expected = _expected(world, IMAGE_CUT)["vision_cut"]
    assert world["file_vision_cut"].nonzero().flatten().tolist() == expected and expected
