"""``bridge-thd scan`` on the local cord_v2-shaped data the CPU runs use (``--cpu-tiny``: Megatron-Bridge 0.6.2's
Qwen3-VL 8B recipe, its cord_v2 preset found on disk, the tiny processor with Qwen3-VL's patch 16).

One fresh process with Megatron-Bridge imported whole (``run_on_gloo(whole_bridge=True)``, the hub offline with
the recipes' model configs) runs the CLI twice (a scan, then the cache), once with the Qwen3.5-VL 2B recipe, once
with an unknown recipe, the ``bridge-thd plan`` command the summary names, and then, independently of the scan,
collates every train sample alone with Megatron-Bridge's own Qwen collate: without a sequence length (its full
length, supervised tokens, grids and image placeholders) and at seq_length 1280 (what the cut keeps). 1280 cuts
every long receipt and no short one (docs/cord-v2-data-path.md). Reasoning: docs/scan.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re

import pytest

from _datasets import ListDataset
from megatron.bridge_thd.cost.sample_lengths import load_lengths
from megatron.bridge_thd.plan.cli import main
from megatron.bridge_thd_cpu.hf_hub import offline_hub
from megatron.bridge_thd_testbed.launcher import run_on_gloo

SEQ_LENGTH = 1280
SAMPLES = 32  # the recipe's global batch (32) fits, so the planner's prediction is made
MERGE = 2
IMAGE_TOKEN_ID = 510  # bridge_thd_cpu.cord_v2.PROCESSOR_TOKEN_IDS


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _scan_worker(root: str) -> dict:
    import torch

    common = ["scan", "--cpu-tiny", "--workdir", root, "--cpu-tiny-samples", str(SAMPLES), "--cache-dir",
              os.path.join(root, "cache"), "--seq-length", str(SEQ_LENGTH), "--workers", "2"]
    first = _cli(common + ["--out", os.path.join(root, "lengths.json")])
    second = _cli(common + ["--out", os.path.join(root, "lengths.csv"), "--no-plan"])
    qwen35 = _cli(common + ["--recipe", "qwen35_vl_2b_sft_1gpu_h100_bf16_config",
                            "--out", os.path.join(root, "qwen35.json")])
    unknown = _cli(["scan", "--recipe", "qwen3_vl_8b_sft_2gpu_h100_bf16", "--no-plan"])
    # The planner's command the summary names, run as bridge-thd plan (here: Megatron-Bridge is imported already).
    command = re.search(r"^planner \(bridge-thd plan (.+)\):$", first[1], re.M)
    plan = _cli(["plan"] + command.group(1).split()) if command else None
    # Independently of the scan: Megatron-Bridge's provider for the recipe's dataset, then each sample alone
    # through its Qwen collate, uncut and cut.
    from megatron.bridge.data.utils import get_dataset_provider
    from megatron.bridge.models.qwen_vl.data.collate_fn import qwen2_5_collate_fn
    from megatron.bridge.recipes.qwen_vl.h100 import qwen3_vl_8b_sft_2gpu_h100_bf16_config

    cfg = qwen3_vl_8b_sft_2gpu_h100_bf16_config()
    config = cfg.dataset
    config.hf_processor_path = os.path.join(root, "processor")
    os.chdir(root)
    train, _, _ = get_dataset_provider(config)([SAMPLES, 0, 0], config, tokenizer=None, pg_collection=None)
    samples = []
    for example in train._base_examples:
        full = qwen2_5_collate_fn([example], train._processor, sequence_length=None)
        cut = qwen2_5_collate_fn([example], train._processor, sequence_length=SEQ_LENGTH,
                                 pad_to_multiple_of=config.pad_to_multiple_of)
        ids = full["input_ids"][0]
        samples.append({
            "tokens": int(full["attention_mask"].sum()),
            "supervised": int((full["loss_mask"] != 0).sum()),
            "grids": full["visual_inputs"].image_grid_thw.reshape(-1, 3).tolist(),
            "image_end": int(torch.nonzero(ids == IMAGE_TOKEN_ID).flatten()[-1]) + 1,
            "kept": int(cut["attention_mask"].sum()),
            "kept_supervised": int((cut["loss_mask"] != 0).sum()),
        })
    return {"first": first, "second": second, "unknown": unknown, "plan": plan, "qwen35": qwen35, "samples": samples,
            "cache": sorted(os.listdir(os.path.join(root, "cache")))}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("scan")


@pytest.fixture(scope="module")
def scanned(root):
    with offline_hub():
        (result,) = run_on_gloo(_scan_worker, str(root), dp=1, whole_bridge=True, initialize=False, timeout=300)
    return result


def test_lengths_file_holds_each_sample_as_collated_alone(scanned, root):
    code, _, _ = scanned["first"]
    assert code == 0
    document = json.loads((root / "lengths.json").read_text())
    rows, expected = document["samples"], scanned["samples"]
    assert [row["index"] for row in rows] == list(range(SAMPLES)) and len(expected) == SAMPLES
    assert document["untruncated"] is True and document["spatial_merge_size"] == MERGE
    for row, sample in zip(rows, expected):
        image_tokens = sum(t * h * w for t, h, w in sample["grids"]) // MERGE**2
        assert row["tokens"] == sample["tokens"]
        assert row["supervised_tokens"] == sample["supervised"]
        assert row["images"] == sample["grids"]
        assert row["image_end"] == sample["image_end"]
        assert row["text_tokens"] == sample["tokens"] - image_tokens
        # the supervised spans say what a cut keeps: here, at seq_length
        kept = sum(max(0, min(end, SEQ_LENGTH) - start) for start, end in row["supervised_spans"])
        assert kept == sample["kept_supervised"]
    # the data set has both kinds of row, so the cut below is a real one
    assert any(s["tokens"] > SEQ_LENGTH for s in expected) and any(s["tokens"] <= SEQ_LENGTH for s in expected)


def test_summary_counts_what_megatron_bridge_collate_cuts(scanned):
    expected = scanned["samples"]
    over = [s for s in expected if s["tokens"] > SEQ_LENGTH]
    tokens, supervised = sum(s["tokens"] for s in expected), sum(s["supervised"] for s in expected)
    lost = sum(s["tokens"] - s["kept"] for s in expected)
    supervised_lost = sum(s["supervised"] - s["kept_supervised"] for s in expected)
    assert lost == sum(s["tokens"] - SEQ_LENGTH for s in over)  # the cut keeps the first seq_length tokens
    _, text, _ = scanned["first"]
    assert (f"over seq_length {SEQ_LENGTH}: {len(over)} of {SAMPLES} distinct samples" in text), text
    assert (f"would cut {lost:,} of {tokens:,} real tokens" in text
            and f"and {supervised_lost:,} of {supervised:,} supervised tokens" in text), text
    longest = max(s["tokens"] for s in expected)
    assert f"seq_length {longest:,} keeps every sample whole" in text
    assert "(our step refuses them): 0" in text  # every image ends long before 1280
    # the distribution: nearest-rank percentiles of the independent lengths
    ordered = sorted(s["tokens"] for s in expected)
    row = re.search(r"^\| tokens \| (.+) \|$", text, re.M).group(1).split(" | ")
    assert [int(v.replace(",", "")) for v in row[:6]] == [ordered[0], ordered[15], ordered[28], ordered[30],
                                                           ordered[31], ordered[31]]
    histogram = [int(line.split()[1]) for line in text.splitlines() if re.match(r"^\s+\d+-\d+\s+\d+", line)]
    assert sum(histogram) == SAMPLES


def test_planner_reads_the_file_and_the_prediction_is_bridge_thd_plan(scanned, root):
    samples = load_lengths(root / "lengths.json")
    expected = scanned["samples"]
    assert samples.tokens == tuple(s["tokens"] for s in expected)
    assert samples.supervised == tuple(s["supervised"] for s in expected)
    assert samples.image_ends == tuple(s["image_end"] for s in expected)
    assert [list(map(list, g)) for g in samples.grids] == [s["grids"] for s in expected]
    csv = load_lengths(root / "lengths.csv")  # the second run's CSV
    assert (csv.tokens, csv.grids, csv.image_ends, csv.supervised) == (
        samples.tokens, samples.grids, samples.image_ends, samples.supervised)
    _, text, _ = scanned["first"]
    # the recipe's model (its processor's hub repository), batch sizes, layout and GPUs (its name's '2gpu')
    command = re.search(r"^planner \(bridge-thd plan (.+)\):$", text, re.M).group(1).split()
    assert command == ["--model", "qwen3-vl-8b", "--lengths", str(root / "lengths.json"), "--seq-length",
                       str(SEQ_LENGTH), "--micro-batch-size", "2", "--global-batch-size", "32", "--tp", "2", "--pp",
                       "1", "--cp", "1", "--ep", "1", "--gpus", "2", "--gpu", "h100-sxm", "--no-sequence-parallel"]
    code, plan_text, _ = scanned["plan"]
    assert code == 0
    assert text.rstrip("\n").endswith(plan_text.rstrip("\n")), "the prediction is not what bridge-thd plan prints"


def test_another_recipe_scans_its_own_dataset_for_its_own_model(scanned, root):
    code, text, _ = scanned["qwen35"]
    assert code == 0, text
    assert "bridge-thd scan: qwen35_vl_2b_sft_1gpu_h100_bf16_config, train split" in text
    # the same local rows and processor as the 8B recipe's: the same lengths; the recipe's sample count differs,
    # so the cache key does too (a scan of its own)
    rows = json.loads((root / "qwen35.json").read_text())["samples"]
    assert rows == json.loads((root / "lengths.json").read_text())["samples"]
    assert "scanned in" in text
    command = re.search(r"^planner \(bridge-thd plan (.+)\):$", text, re.M).group(1)
    assert command.startswith("--model qwen3.5-vl-2b ") and "--micro-batch-size 4 " in command
    assert "--gpus 1 " in command and "| thd |" in text


def test_second_run_reads_the_cache(scanned, root):
    code, first, first_err = scanned["first"]
    code2, second, second_err = scanned["second"]
    assert code == code2 == 0
    path = re.search(r"cached at (\S+)$", first, re.M).group(1)
    assert f"read from the cache {path} (no sample collated again)" in second
    assert os.path.basename(path) in scanned["cache"] and len(scanned["cache"]) == 2  # + the Qwen3.5 recipe's
    assert f"{SAMPLES}/{SAMPLES} distinct samples (100%" in first_err  # progress on stderr
    assert "distinct samples (" not in second_err
    # the same summary from the cache
    cut = re.compile(r"^over seq_length.*$", re.M)
    assert cut.search(first).group(0) == cut.search(second).group(0)


def test_bad_input_names_the_option(scanned, capsys):
    code, _, err = scanned["unknown"]
    assert code == 2
    assert ("bridge-thd scan: error: --recipe 'qwen3_vl_8b_sft_2gpu_h100_bf16': megatron.bridge.recipes.qwen_vl.h100 "
            "has no recipe function" in err and "did you mean qwen3_vl_8b_sft_2gpu_h100_bf16_config" in err), err
    for value in ("0", "-4"):
        with pytest.raises(SystemExit) as stop:
            main(["scan", "--cpu-tiny", "--seq-length", value])
        assert stop.value.code == 2
        assert f"argument --seq-length: expected an int >= 1, got {value}" in capsys.readouterr().err
    assert main(["scan", "--no-plan"]) == 2
    assert "--recipe: required" in capsys.readouterr().err


# --- the measure itself, on a collate of our own (no Megatron-Bridge) -------------------------------------------


class _CountingCollate:
    """A collate like Megatron-Bridge's VLM collates (right-padded 2D mask, shifted loss mask, grids in
    ``visual_inputs``); counts its calls in the process that runs it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, batch):
        import torch

        (item,) = batch
        self.calls += 1
        width = item["real"] + item["pad"]
        ids = torch.full((1, width), 7)
        ids[0, item["placeholders"]] = 99
        loss_mask = torch.zeros(1, width)
        for start, end in item["spans"]:
            loss_mask[0, start:end] = 1
        visual = {}
        if item["images"]:
            visual["image_grid_thw"] = torch.tensor(item["images"])
        if item["videos"]:
            visual["video_grid_thw"] = torch.tensor(item["videos"])
        mask = (torch.arange(width) < item["real"]).to(torch.int64)[None]
        return {"input_ids": ids, "attention_mask": mask if item.get("mask", True) else None, "loss_mask": loss_mask,
                "visual_inputs": visual or None}


ITEMS = [
    dict(real=40, pad=24, spans=[(10, 14), (20, 39)], images=[[1, 4, 4]], videos=[], placeholders=[2, 3, 4, 5]),
    dict(real=9, pad=0, spans=[(3, 8)], images=[], videos=[], placeholders=[]),
    dict(real=30, pad=2, spans=[(25, 29)], images=[[1, 2, 2]], videos=[[2, 2, 2]], placeholders=[1, 20, 21]),
]


@pytest.fixture
def plain_collate(monkeypatch):
    """The cache key's worker collates as given: ``batching.sizes._measuring`` would first import Megatron-Bridge's
    Qwen-VL collate module there to patch it (~10 s a process without Megatron-Bridge already imported), and this
    collate is not Megatron-Bridge's. Forked workers inherit the patched name."""
    from megatron.bridge_thd.batching import sizes

    monkeypatch.setattr(sizes, "_measuring", lambda collate_fn: collate_fn)


def test_scan_measures_in_workers_only_and_caches(tmp_path, plain_collate):
    from megatron.bridge_thd.plan.scan.cache import scan_dataset
    from megatron.bridge_thd.plan.scan.lengths_summary import over_length, summary

    collate, seen = _CountingCollate(), []
    scan = scan_dataset(ListDataset(ITEMS), collate, placeholder_ids=(99,), merge=2, num_workers=2, cache_dir=tmp_path,
                        progress=lambda done, total: seen.append((done, total)))
    assert collate.calls == 0, "the collate ran in the calling process"
    assert not scan.from_cache and seen[-1] == (3, 3)
    assert [s.tokens for s in scan.samples] == [40, 9, 30]
    assert [s.spans for s in scan.samples] == [((10, 14), (20, 39)), ((3, 8),), ((25, 29),)]
    assert [s.supervised for s in scan.samples] == [23, 5, 4]
    assert [s.grids for s in scan.samples] == [((1, 4, 4),), (), ((1, 2, 2), (2, 2, 2))]
    assert [(s.placeholders, s.image_end) for s in scan.samples] == [(4, 6), (0, 0), (3, 22)]
    assert [s.image_tokens(2) for s in scan.samples] == [4, 0, 3]
    # a cut at 21: sample 0 keeps 4 + 1 of its 23 supervised tokens, sample 2 none of 4 (emptied) and its video's
    # placeholders end at 22 (cut)
    cut = over_length(scan, 21)
    assert (cut.samples, cut.tokens_lost, cut.supervised_lost, cut.emptied, cut.image_cut) == (
        (0, 2), 19 + 9, 18 + 4, (2,), (2,))
    text = summary(scan, 21)
    assert "over seq_length 21: 2 of 3 distinct samples" in text and "would cut 28 of 79 real tokens" in text
    assert "(Megatron-Bridge's collate raises on their micro-batch): 1 (samples 2)" in text
    again = scan_dataset(ListDataset(ITEMS), collate, placeholder_ids=(99,), merge=2, cache_dir=tmp_path,
                         progress=lambda done, total: seen.append("scanned again"))
    assert again.from_cache and again.cached == scan.cached and again.samples == scan.samples
    assert "scanned again" not in seen
    # The scan's cache holds grids, not the sizes' vision term: its name carries its own format only.
    from megatron.bridge_thd.plan.scan.cache import CACHE_SUFFIX
    assert scan.cached.name.endswith(CACHE_SUFFIX) and ".sizes-v" not in scan.cached.name


def test_scan_refuses_a_collate_without_a_right_padded_2d_mask(tmp_path, plain_collate):
    from megatron.bridge_thd.plan.scan.cache import scan_dataset
    from megatron.bridge_thd.plan.scan.measuring import measure

    with pytest.raises(ValueError, match="dataset sample 1: the collate gives no 2D attention_mask"):
        scan_dataset(ListDataset([ITEMS[0], dict(ITEMS[1], mask=False)]), _CountingCollate(), cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.scan-v1.json")), "nothing cached from a failed scan"
    import torch

    left = {"attention_mask": torch.tensor([[0, 0, 1, 1]]), "loss_mask": torch.tensor([[0, 0, 1, 0]])}
    with pytest.raises(ValueError, match="dataset sample 5: its attention mask is not right-padded"):
        measure(left, 5)


def test_lengths_file_fields_tokens_and_supervised_tokens_are_checked(tmp_path):
    path = tmp_path / "l.json"
    path.write_text(json.dumps([{"text_tokens": 10, "images": [[1, 4, 4]], "tokens": 14, "supervised_tokens": 6}]))
    assert load_lengths(path).supervised == (6,) and load_lengths(path).tokens == (14,)
    # read for a model whose merge is 4 instead of 2: the image is 1 token, not 4
    with pytest.raises(ValueError, match=r"l\.json: sample 0: field 'tokens': 14, but text_tokens 10 \+ 1 image tokens "
                                         r"at spatial_merge=4 make 11"):
        load_lengths(path, spatial_merge_size=4)
    path.write_text(json.dumps([{"text_tokens": 10, "supervised_tokens": 11}]))
    with pytest.raises(ValueError, match="field 'supervised_tokens': 11 is more than the sample's 10 tokens"):
        load_lengths(path)
    csv = tmp_path / "l.csv"
    csv.write_text("text_tokens,images,image_end,tokens,supervised_tokens\n10,1x4x4,6,14,6\n9,,0,9,\n")
    samples = load_lengths(csv)
    assert samples.tokens == (14, 9) and samples.supervised == (6, None) and samples.image_ends == (6, 0)
