"""A CP size per sample inside Megatron-Bridge's ``finetune()`` on 4 gloo ranks: its Qwen3-VL 8B recipe in its CPU mode
(cord_v2 receipts, the recipe's loader workers forked and pinned memory, evaluation), ``configure(cfg, "thd",
cp_per_sample=M)``: Megatron-Core's hybrid groups (built by Megatron-Bridge's initialize from the model flag), its
``BalancedCPScheduler`` placing each step on 1, 2 or 4 ranks per sample, its hybrid-CP schedule running the rows, our
loaders (``batching.cp_per_sample_loader``) and step.

The run is stopped after its first iteration and resumed from its checkpoint. The reference is the same run at static
CP = 1 (DP = 4, in-batch ``thd``, per-token loss): the recipe's cyclic loader
draws a step's samples per DP rank (``data_sharding``), so the same DP world draws the same samples, which a static CP
of 4 (DP = 1) would not. Every iteration's loss and gradient norm and the validation loss must be equal (per-token
loss over the whole step in both runs; the sums differ only in the order of reduction).

The MoE model runs the same way (its Qwen3-VL 30B-A3B recipe in CPU mode: the tiny MoE checkpoint, 4 experts, top-2,
aux loss 1e-2, z-loss 1e-3, the ``moe_padding`` hook registered as docs/moe-padding-mask.md says), against its own run
at static CP = 1 (DP = 4). The aux loss and z-loss are statistics of the tokens a router sees together, a row, so the
reference must run the same rows, and it does, for a reason independent of the code under test: both runs draw one
sample per micro-batch (``micro_batch_size=1``; the same samples per step, from the same DP world), static CP = 1 runs
each micro-batch as a row of that one sample, and the receipts (367-512 tokens) need 2 or 4 ranks at 240 tokens per
rank, none of them 1, so the placement puts each in a row of its own (asserted from its log: as many rows as
samples). Then every router statistic is over the same tokens in both runs, and loss and gradient norm must be equal
per iteration; a row's statistics reduced over other ranks than the row's, or its aux-loss gradient scaled by another
token count, would move the gradient norm (and with it the next iteration's loss). Expert bias stays off here: Megatron-Bridge itself cannot load a Hugging Face Qwen3-VL
MoE checkpoint into a model with expert bias (the router's ``expert_bias`` buffer has no mapping, and its loader then
stops on an empty conversion task, with or without this package); tests/parallel/test_cp_per_sample_moe.py holds the
expert-bias counts of a step to CP = 1's.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")

from _bridge_worlds import CP_ITERATIONS as ITERATIONS  # noqa: E402
from _bridge_worlds import GLOBAL_BATCH  # noqa: E402

RELATIVE = 1e-5


@pytest.fixture(scope="module")
def ranks(cp_per_sample_world):
    """The runs (tests/_bridge_worlds.py: ``cp_per_sample_runs``; the MoE runs last), run once per session:
    test_packing_logs.py reads the dense runs' packing figures."""
    return cp_per_sample_world.ranks


def _rows(rank: dict, key: str) -> list[dict]:
    """A run's iterations; ``"dynamic"``: the stopped run's and the resumed run's, joined."""
    if key == "dynamic":
        return rank["dynamic_first"]["iterations"] + rank["dynamic_resumed"]["iterations"]
    return rank[key]["iterations"]


def _losses(rank: dict, key: str) -> list[float]:
    return [row["loss"] for row in _rows(rank, key)]


def test_the_steps_ran_with_several_cp_sizes(ranks):
    lines = [line for key in ("dynamic_first", "dynamic_resumed") for line in ranks[0][key]["placements"]
             if "CP per sample (train)" in line]
    assert len(lines) >= ITERATIONS
    sizes = set()
    for line in lines:
        sizes |= {int(k) for k in re.findall(r"(\d+): \d+", line.split("per CP size")[1])}
    assert {2, 4} <= sizes, lines


def test_losses_equal_static_cp(ranks):
    """Training and validation losses and gradient norms."""
    assert [row["iteration"] for row in _rows(ranks[0], "dynamic")] == list(range(1, ITERATIONS + 1))
    dynamic, static = _losses(ranks[0], "dynamic"), _losses(ranks[0], "static_cp1")
    assert len(dynamic) == len(static) == ITERATIONS
    for a, b in zip(dynamic, static):
        assert a == pytest.approx(b, rel=RELATIVE), (dynamic, static)
    norms = [[row["grad_norm"] for row in _rows(ranks[0], key)] for key in ("dynamic", "static_cp1")]
    assert norms[0] == pytest.approx(norms[1], rel=RELATIVE), norms
    evaluations = [[e["loss"] for e in ranks[0][key]["evaluations"]] for key in ("dynamic_resumed", "static_cp1")]
    assert evaluations[0] and evaluations[0] == pytest.approx(evaluations[1], rel=RELATIVE), evaluations


def test_flops_count_each_row_once(ranks):
    """Only a row's first rank feeds Megatron-Bridge's FLOPs accounting: the step's FLOPs are static CP's up to the
    alignment padding (2k per sample here, none there), not a row counted once per rank of its group."""
    flops = [[row["flops"] for row in _rows(ranks[0], key)] for key in ("dynamic", "static_cp1")]
    for dynamic, static in zip(*flops):
        assert abs(dynamic - static) <= 0.05 * static, flops


def _train_steps(rank: dict, key: str) -> list[int]:
    """The step numbers of a run's training-loader log lines (the loader prefetches past the run's end)."""
    return [int(step) for line in rank[key]["placements"] for step in re.findall(r"\(train\): step (\d+):", line)]


def test_the_resumed_loader_numbers_its_steps_as_the_trainer(ranks):
    """The loader's log counts on after a resume: the resumed run's first step is the trainer's iteration 2."""
    first, resumed = _train_steps(ranks[0], "dynamic_first"), _train_steps(ranks[0], "dynamic_resumed")
    assert first[:ITERATIONS] == list(range(1, ITERATIONS + 1)), first
    assert resumed[:ITERATIONS - 1] == list(range(2, ITERATIONS + 1)), resumed


def test_moe_rows_hold_one_sample_each(ranks):
    """The reference's premise: every training step of the MoE run placed each sample in a row of its own, on 2 or
    4 ranks."""
    lines = [line for line in ranks[0]["moe_dynamic"]["placements"] if "CP per sample (train)" in line][:ITERATIONS]
    assert len(lines) == ITERATIONS, lines
    for line in lines:
        samples, rows = map(int, re.search(r"(\d+) samples in (\d+) rows", line).groups())
        assert samples == rows == GLOBAL_BATCH, line
        assert {int(k) for k in re.findall(r"(\d+): \d+", line.split("per CP size")[1])} <= {2, 4}, line


def test_moe_losses_equal_static_cp(ranks):
    """The MoE model's loss (the language-model loss; the aux loss and z-loss reach the gradients) and gradient norm
    per iteration equal static CP = 1's."""
    dynamic, static = (ranks[0][key]["iterations"] for key in ("moe_dynamic", "moe_static_cp1"))
    assert [row["iteration"] for row in dynamic] == [row["iteration"] for row in static] == list(
        range(1, ITERATIONS + 1))
    for name in ("loss", "grad_norm"):
        values = [[row[name] for row in run] for run in (dynamic, static)]
        assert values[0] == pytest.approx(values[1], rel=RELATIVE), (name, values)
