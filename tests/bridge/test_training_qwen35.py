"""Megatron-Bridge 0.6.2's own training loop on its Qwen3.5-VL 2B recipe, on the CPU: the recipe function
(``qwen35_vl_2b_sft_1gpu_h100_bf16_config``) with a tiny Hugging Face Qwen3.5-VL
(``Qwen3_5ForConditionalGeneration.save_pretrained``: one Gated DeltaNet layer, then one full-attention
layer; Qwen3.5's vision geometry) converted by Megatron-Bridge's ``AutoBridge`` (its ``Qwen35VLBridge``
and ``Qwen35VLModelProvider``), the recipe's cord_v2 data path and Qwen-VL collate, and ``finetune()``
at DP=2 over gloo, checkpoint save and resume included (``bridge_thd_testbed.training.qwen35_training_runs``;
docs/megatron-bridge-on-cpu.md, section "Qwen3.5-VL").

Three steps drive the same recipe on the same data order: Megatron-Bridge's own ``qwen3_vl_step`` (the
padded baseline), ours with ``thd`` (stopped at ``RESUME_AT`` and resumed from its checkpoint) and with
``thd_static``. Gated DeltaNet runs through the test bed's pure-torch varlen kernels (``bridge_thd_cpu.gdn``:
fla's contract, fp64 inside on the CPU).
"""

from __future__ import annotations

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

from _bridge_worlds import GLOBAL_BATCH, MICRO_BATCH, QWEN35, SEQ_LENGTH  # noqa: E402
from _bridge_worlds import QWEN35_ITERATIONS as ITERATIONS  # noqa: E402
from _bridge_worlds import QWEN35_RESUME_AT as RESUME_AT  # noqa: E402
from _training_runs import run_losses, thd_losses  # noqa: E402

RELATIVE = 1e-5


@pytest.fixture(scope="module")
def ranks(training_world):
    """The runs (``qwen35_training_runs``), run once per session in test_training.py's DP=2 world, after its runs
    (tests/_bridge_worlds.py): per rank, by their own keys."""
    return [{key.removeprefix(QWEN35): run for key, run in rank.items() if key.startswith(QWEN35)}
            for rank in training_world.ranks]


def _relative(a, b):
    return abs(a - b) / max(abs(a), abs(b))


def test_the_recipe_trains_the_hybrid_model_converted_from_the_hugging_face_checkpoint(ranks):
    """The model ``finetune()`` trains is the Qwen3.5-VL provider's hybrid: a Gated DeltaNet layer then a
    gated-attention layer (MRoPE), with every parameter filled from the tiny checkpoint by Megatron-Bridge's
    conversion (every tensor read, every parameter covered, the bridge's export giving each tensor back)."""
    for rank in ranks:
        check = rank["megatron_bridge"]["pretrained_load"]
        assert check["layers"] == ["GatedDeltaNet", "Qwen3VLSelfAttention"]
        assert check["parameters"] > 0 and check["tensors"] > 0
        assert check["unmapped_parameters"] == [] and check["unused_tensors"] == []
        assert check["exported_missing"] == []
        assert check["max_abs_diff"] <= 1e-6


def test_every_run_reaches_its_iterations_on_both_ranks(ranks):
    for rank in ranks:
        for name in ("megatron_bridge", "thd_static"):
            assert [row["iteration"] for row in rank[name]["iterations"]] == list(range(1, ITERATIONS + 1))
        assert [row["iteration"] for row in rank["thd_first"]["iterations"]] == list(range(1, RESUME_AT + 1))
        # The resumed run starts where the checkpoint left off, not from iteration 1.
        assert [row["iteration"] for row in rank["thd_resumed"]["iterations"]] == list(range(RESUME_AT + 1,
                                                                                              ITERATIONS + 1))


def test_the_data_carries_padding(ranks):
    """Some micro-batch holds fewer real tokens than its padded rows: the three steps see different layouts."""
    batches = [b for rank in ranks for b in rank["megatron_bridge"]["micro_batches"] if b["training"]]
    assert len(batches) == 2 * ITERATIONS * GLOBAL_BATCH // (2 * MICRO_BATCH)
    assert any(b["real_tokens"] < MICRO_BATCH * SEQ_LENGTH for b in batches)


def test_losses_equal_across_the_three_steps(ranks):
    rank = ranks[0]
    baseline = run_losses(rank, "megatron_bridge")
    for name, losses in (("thd_static", run_losses(rank, "thd_static")), ("thd", thd_losses(rank))):
        for iteration, (ours, theirs) in enumerate(zip(losses, baseline, strict=True), start=1):
            assert _relative(ours, theirs) <= RELATIVE, f"{name} iteration {iteration}: {ours} vs {theirs}"


def test_loss_falls(ranks):
    for losses in (run_losses(ranks[0], "megatron_bridge"), run_losses(ranks[0], "thd_static"), thd_losses(ranks[0])):
        assert losses[-1] < losses[0] - 0.1 and sum(losses[-2:]) < sum(losses[:2]) - 0.2


def test_resume_gives_the_same_next_iteration(ranks):
    resumed = ranks[0]["thd_resumed"]["iterations"][0]
    assert resumed["iteration"] == RESUME_AT + 1
    for name in ("megatron_bridge", "thd_static"):
        uninterrupted = ranks[0][name]["iterations"][RESUME_AT]
        assert uninterrupted["iteration"] == RESUME_AT + 1
        assert _relative(resumed["loss"], uninterrupted["loss"]) <= RELATIVE
    # A resume that restarted the data or the optimiser would not continue the uninterrupted runs.
    assert _relative(resumed["loss"], ranks[0]["thd_first"]["iterations"][0]["loss"]) > 1e-3


def test_logged_tokens_are_the_real_tokens_with_thd(ranks):
    """The trainer's FLOPs accounting sees each rank's real tokens with ``thd`` (the collate's 2D mask) and
    every padded position with Megatron-Bridge's step."""
    per_iteration = GLOBAL_BATCH // (2 * MICRO_BATCH)
    for rank in ranks:
        for names, padded in ((("thd_first", "thd_resumed"), False), (("megatron_bridge",), True)):
            rows = [row for name in names for row in rank[name]["iterations"]]
            batches = [b for name in names for b in rank[name]["micro_batches"] if b["training"]]
            for i, row in enumerate(rows):
                step = batches[i * per_iteration:(i + 1) * per_iteration]
                expected = len(step) * MICRO_BATCH * SEQ_LENGTH if padded else sum(b["real_tokens"] for b in step)
                assert row["flops_tokens"] == expected
