"""Megatron-Bridge 0.6.2's own training loop on the CPU: its Qwen3-VL 8B recipe (``AutoBridge``
provider, ``ConfigContainer``), its cord_v2 data path with the Qwen3-VL collate, ``finetune()`` ->
``pretrain`` -> ``setup`` / ``train`` / ``train_step`` with Megatron-Core's DDP and optimizer,
checkpoint save and resume, at DP=2 over gloo, with the recipe's data loader workers (forked, as
under torchrun) and pinned memory, and its evaluation; only model size and device differ
(``bridge_thd_testbed.training.cpu_run_config``; docs/megatron-bridge-on-cpu.md).

Three steps drive the same recipe on the same data order: Megatron-Bridge's own
``qwen3_vl_step`` (the padded baseline), ours with ``thd`` and with ``thd_static``; and ``thd_static``
with global-batch packing (``configure(..., global_batch_packing=...)``), which places the same
steps' samples differently across the two ranks and their micro-batches, evaluated every
``EVAL_INTERVAL`` iterations, stopped at ``GLOBAL_RESUME_AT`` and resumed. The ``thd`` run and the global-batch
packing run also write TensorBoard and a run log, which test_packing_logs.py reads (the runs:
tests/_bridge_worlds.py, one world per session for the modules that read them).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

from _bridge_worlds import (  # noqa: E402
    EVAL_INTERVAL, EVAL_ITERS, GLOBAL, GLOBAL_BATCH, GLOBAL_RESUME_AT, ITERATIONS, MICRO_BATCH, RESUME_AT, SEQ_LENGTH,
    SHORT,
)
from _training_runs import run_losses, thd_losses  # noqa: E402

RELATIVE = 1e-5


@pytest.fixture(scope="module")
def ranks(training_world):
    """The runs (tests/_bridge_worlds.py: ``training_runs``), run once per session: test_packing_logs.py reads the
    packing figures of two of them."""
    return training_world.ranks


def _close(a, b):
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b))


def test_twenty_iterations_per_step_on_both_ranks(ranks):
    for rank in ranks:
        for name in ("megatron_bridge", "thd_static"):
            assert [row["iteration"] for row in rank[name]["iterations"]] == list(range(1, ITERATIONS + 1))
        assert [row["iteration"] for row in rank["thd_first"]["iterations"]] == list(range(1, RESUME_AT + 1))
        # The resumed run starts where the checkpoint left off, not from iteration 1.
        assert [row["iteration"] for row in rank["thd_resumed"]["iterations"]] == list(range(RESUME_AT + 1, ITERATIONS + 1))


def test_losses_equal_across_the_three_steps(ranks):
    rank = ranks[0]
    baseline = run_losses(rank, "megatron_bridge")
    for name, losses in (("thd_static", run_losses(rank, "thd_static")), ("thd", thd_losses(rank))):
        for iteration, (ours, theirs) in enumerate(zip(losses, baseline, strict=True), start=1):
            assert _close(ours, theirs), f"{name} iteration {iteration}: {ours} vs Megatron-Bridge's step {theirs}"


def test_loss_falls(ranks):
    for losses in (run_losses(ranks[0], "megatron_bridge"), run_losses(ranks[0], "thd_static"), thd_losses(ranks[0])):
        assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1


def test_resume_from_iteration_ten_gives_the_same_iteration_eleven(ranks):
    resumed = ranks[0]["thd_resumed"]["iterations"][0]
    assert resumed["iteration"] == RESUME_AT + 1
    for name in ("megatron_bridge", "thd_static"):
        uninterrupted = ranks[0][name]["iterations"][RESUME_AT]
        assert uninterrupted["iteration"] == RESUME_AT + 1
        assert _close(resumed["loss"], uninterrupted["loss"])
    # A resume that restarted the data or the optimiser would repeat iteration 1's loss instead.
    assert not _close(resumed["loss"], ranks[0]["thd_first"]["iterations"][0]["loss"])


def _micro_batches_per_iteration(run):
    per_iteration = GLOBAL_BATCH // (MICRO_BATCH * 2)
    counts = [batch for batch in run["micro_batches"] if batch["training"]]
    return [counts[i:i + per_iteration] for i in range(0, len(counts), per_iteration)]


def _thd(rank, part):
    first, resumed = rank["thd_first"], rank["thd_resumed"]
    if part == "iterations":
        return first["iterations"] + resumed["iterations"]
    return _micro_batches_per_iteration(first) + _micro_batches_per_iteration(resumed)


def test_logged_tokens_are_the_real_tokens_with_thd(ranks):
    """The trainer's FLOPs accounting sees each rank's real tokens (the collate's 2D mask) with our
    ``thd``; with Megatron-Bridge's step and with ``thd_static`` it counts every padded position its
    rows carry (two rows of seq_length per micro-batch: the linear layers do run on them)."""
    for rank in ranks:
        for row, batches in zip(_thd(rank, "iterations"), _thd(rank, "batches"), strict=True):
            assert row["flops_tokens"] == sum(batch["real_tokens"] for batch in batches)
        for name in ("megatron_bridge", "thd_static"):
            run = rank[name]
            for row, batches in zip(run["iterations"], _micro_batches_per_iteration(run), strict=True):
                assert row["flops_tokens"] == len(batches) * MICRO_BATCH * SEQ_LENGTH


def test_logged_flops_count_real_work(ranks):
    """Same data, same model: ``thd``'s FLOPs equal Megatron-Bridge's exactly on iterations where no
    sample of the global batch is padded, and are smaller on every other."""
    padded = [any(batch["real_tokens"] < MICRO_BATCH * SEQ_LENGTH for batch in first + second)
              for first, second in zip(_thd(ranks[0], "batches"), _thd(ranks[1], "batches"), strict=True)]
    assert any(padded), "the data has no padding: the comparison would prove nothing"
    theirs = ranks[0]["megatron_bridge"]["iterations"]
    for mine, baseline, has_padding in zip(_thd(ranks[0], "iterations"), theirs, padded, strict=True):
        assert mine["flops"] > 0
        if has_padding:
            assert mine["flops"] < baseline["flops"]
        else:
            assert mine["flops"] == pytest.approx(baseline["flops"], rel=1e-9)


def test_pipeline_and_context_parallel_thd_agree(ranks):
    """PP=2 and CP=2 over the same two ranks (DP=1 both, so the recipe's cyclic sampler gives them the
    same micro-batches): the same losses, iteration by iteration; and they train."""
    pp2 = [row["loss"] for row in ranks[-1]["pp2"]["iterations"]]  # the last stage holds the loss
    cp2 = [row["loss"] for row in ranks[0]["cp2"]["iterations"]]
    assert len(pp2) == len(cp2) == SHORT
    # Iteration 1 is the forward alone (no update yet): equal to 1e-5. Later iterations follow two
    # optimiser trajectories whose gradient sums differ in order (one rank sums a PP micro-batch's
    # gradients, CP all-reduces two halves), which Adam's normalised steps amplify: 1e-4.
    assert _close(pp2[0], cp2[0])
    for iteration, (a, b) in enumerate(zip(pp2, cp2, strict=True), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"iteration {iteration}: PP=2 {a} vs CP=2 {b}"
    assert [row["loss"] for row in ranks[1]["cp2"]["iterations"]] == cp2  # both CP ranks report the reduced loss
    assert cp2[-1] < cp2[0]


def _global(rank, part="iterations"):
    """The global-batch packing run, its stopped and resumed halves joined."""
    first, resumed = rank["thd_static_global_first"], rank["thd_static_global_resumed"]
    if part == "batches":
        return _micro_batches_per_iteration(first) + _micro_batches_per_iteration(resumed)
    return first[part] + resumed[part]


def _placement_log(lines, label="train"):
    """(rows chosen, {step: (real tokens, slots)}) from global-batch packing's log lines (global rank 0);
    steps past the run (the loader workers' prefetch) included."""
    rows = [tuple(int(n) for n in m.group(1).split(", "))
            for m in map(re.compile(r"thd_static rows for the run: ([\d, ]+) slots").search, lines) if m]
    steps = {}
    for m in map(re.compile(rf"\({label}\): step (\d+): real tokens (\d+) in (\d+) slots").search, lines):
        if m:
            steps.setdefault(int(m.group(1)), (int(m.group(2)), int(m.group(3))))
    return rows, steps


def test_global_batch_packing_trains_the_same_steps(ranks):
    """Same steps, same samples, across a stop at iteration 4 and its resume: per iteration the two
    ranks' real and supervised tokens add up to those of Megatron-Bridge's placement (both runs with
    per-token loss normalisation, which configure sets for global-batch packing); the placement differs
    (the ranks' shares change); the losses follow (iteration 1 to 1e-5, loss and gradient norm; later
    ones within 1e-4, the gradient sums' order differing as in the PP / CP comparison)."""
    for rank in ranks:
        assert [row["iteration"] for row in rank["thd_static_per_token"]["iterations"]] == list(range(1, GLOBAL + 1))
        assert [row["iteration"] for row in _global(rank)] == list(range(1, GLOBAL + 1))
    moved = False
    per_rank = {"thd_static_per_token": [_micro_batches_per_iteration(rank["thd_static_per_token"]) for rank in ranks],
                "thd_static_global": [_global(rank, "batches") for rank in ranks]}
    for iteration in range(GLOBAL):
        for key in ("real_tokens", "supervised_tokens"):
            totals = {name: sum(b[key] for rank in per_rank[name] for b in rank[iteration]) for name in per_rank}
            assert totals["thd_static_global"] == totals["thd_static_per_token"] > 0, (iteration + 1, key)
        shares = {name: [sum(b["real_tokens"] for b in rank[iteration]) for rank in per_rank[name]] for name in per_rank}
        moved |= shares["thd_static_global"] != shares["thd_static_per_token"]
    assert moved, "the placement never differed from Megatron-Bridge's: the comparison would prove nothing"
    ours = _global(ranks[0])
    theirs = ranks[0]["thd_static_per_token"]["iterations"]
    assert _close(ours[0]["loss"], theirs[0]["loss"]) and _close(ours[0]["grad_norm"], theirs[0]["grad_norm"])
    for iteration, (a, b) in enumerate(zip(ours, theirs, strict=True), start=1):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), f"iteration {iteration}: {a['loss']} vs {b['loss']}"


def test_global_batch_packing_evaluates_with_the_recipes_loader_workers(ranks):
    """Validation every 3 iterations (2 steps each), the final validation and the test set, through the
    loader workers with global-batch packing: every evaluation runs (none refused mid-run) and gives
    the loss of Megatron-Bridge's placement of the same samples (per-token, so placement-free)."""
    ours = _global(ranks[0], "evaluations")
    theirs = ranks[0]["thd_static_per_token"]["evaluations"]
    expected = [(False, i) for i in range(EVAL_INTERVAL, GLOBAL + 1, EVAL_INTERVAL)] + [(False, GLOBAL), (True, GLOBAL)]
    assert [(e["test"], e["iteration"]) for e in theirs] == expected
    assert [(e["test"], e["iteration"]) for e in ours] == expected
    for a, b in zip(ours, theirs, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(b["loss"]), (a, b)
    _, valid = _placement_log(_global(ranks[0], "placements"), "valid")
    assert set(range(1, (GLOBAL // EVAL_INTERVAL + 1) * EVAL_ITERS + 1)) <= set(valid)


def test_global_batch_packing_keeps_its_rows_and_step_count_across_a_resume(ranks):
    """The rows (the default four at most) are chosen from the whole run's draws (training and evaluation) when
    the loaders are built: the resumed run chooses the same rows as the uninterrupted start, its log continues at
    step 5, every micro-batch's real tokens per iteration match the log of the step it came from, and its slots
    are the shortest row holding it (alignment 1 here: TP = CP = 1, no FP8), as Megatron-Bridge's FLOPs count
    (rank 0's micro-batches) shows too."""
    first_rows, first_steps = _placement_log(ranks[0]["thd_static_global_first"]["placements"])
    resumed_rows, resumed_steps = _placement_log(ranks[0]["thd_static_global_resumed"]["placements"])
    assert len(first_rows) == len(resumed_rows) == 1 and first_rows == resumed_rows
    rows = first_rows[0]
    assert 1 < len(rows) <= 4 and list(rows) == sorted(rows) and rows[-1] <= MICRO_BATCH * SEQ_LENGTH
    assert min(first_steps) == 1 and min(resumed_steps) == GLOBAL_RESUME_AT + 1
    batches = [_global(rank, "batches") for rank in ranks]
    steps = {**first_steps, **{k: v for k, v in resumed_steps.items() if k > GLOBAL_RESUME_AT}}

    def row_of(batch):
        return min(n for n in rows if n >= batch["real_tokens"])

    for iteration, record in enumerate(_global(ranks[0]), start=1):
        real, slots = steps[iteration]
        assert real == sum(b["real_tokens"] for rank in batches for b in rank[iteration - 1])
        assert slots == sum(row_of(b) for rank in batches for b in rank[iteration - 1])
        assert record["flops_tokens"] == sum(row_of(b) for b in batches[0][iteration - 1])
    assert not ranks[1]["thd_static_global_first"]["placements"]  # one log, on global rank 0


def test_thd_static_is_static_in_everything_the_decoder_sees_inside_finetune(ranks):
    """Every micro-batch Megatron-Bridge's trainer hands our ``thd_static`` step, training and evaluation, gives
    the decoder one signature per run (``step.decoder_signature``: token inputs' shapes and dtypes, every
    ``PackedSeqParams`` field, the ``cu_seqlens`` count and ``max_seqlen`` included): in-batch, and under
    global-batch packing across its stop and resume one signature per row it chose (its rows have segments for the
    most samples a row can hold; micro-batches of 1 to 8 samples in one row are in tests/model/test_step_plan.py)."""
    rows = _placement_log(ranks[0]["thd_static_global_first"]["placements"])[0][0]
    for rank in ranks:
        for names, expected in ((("thd_static",), 1), (("thd_static_per_token",), 1),
                                (("thd_static_global_first", "thd_static_global_resumed"), len(rows))):
            batches = [batch for name in names for batch in rank[name]["micro_batches"]]
            assert batches and any(not batch["training"] for batch in batches), names  # evaluation is in it
            signatures = {batch["signature"] for batch in batches}
            assert len(signatures) == expected, (names, signatures)
            if expected > 1:  # each signature is one row's: its length is in the signature's token shapes
                assert {next(n for n in rows if f"(1, {n})" in signature) for signature in signatures} == set(rows)
    # The control: thd's row follows its micro-batch, so its signature changes.
    assert len({batch["signature"] for batch in ranks[0]["thd_first"]["micro_batches"]}) > 1
