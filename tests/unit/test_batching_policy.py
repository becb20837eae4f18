"""The placement contract of ``batching.policy.assign`` (docs/batching.md, "The contract a policy follows").

Every expectation is computed here from the contract itself (exactly once, no empty micro-batch,
aligned tokens within the row, the same micro-batch count per rank, determinism, refusals), from
Megatron-Bridge 0.6.2's real ``MegatronPretrainingSampler`` (``data/samplers.py``) for the in-batch
placement, or by hand; never from numbers the package printed.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from megatron.bridge_thd.batching import policy
from megatron.bridge_thd.cost.sample import SampleCost
from megatron.bridge_thd.batching.policy import assign, in_batch_assignment, placement_stats
from megatron.bridge_thd.plan.samples import receipt_lengths
from megatron.bridge_thd.upstream.loading import load_bridge_module

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _check_contract(result, lengths, *, dp_size, num_micro_batches, row_length, align_to):
    """The output half of the contract, checked from first principles."""
    assert isinstance(result, list) and len(result) == dp_size
    seen = []
    for rank in result:
        assert len(rank) == num_micro_batches, "every rank holds num_micro_batches micro-batches"
        for micro in rank:
            assert micro, "no micro-batch is empty"
            assert sum(_round_up(lengths[i], align_to) for i in micro) <= row_length
            seen += micro
    assert sorted(seen) == list(range(len(lengths))), "every sample exactly once"


@st.composite
def feasible_steps(draw):
    """A step that certainly fits: row_length >= longest aligned sample + ceil(aligned total / rows).

    At that row any rule that puts a sample into *some* row with room succeeds: a sample of x slots
    finds no room only if every row holds > row_length - x slots, i.e. more than the total.
    """
    dp = draw(st.integers(1, 4))
    nmb = draw(st.integers(1, 4))
    rows = dp * nmb
    align = draw(st.sampled_from([1, 2, 8, 64]))
    n = draw(st.integers(rows, rows * 4))
    lengths = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    slots = [_round_up(s, align) for s in lengths]
    need = max(slots) + -(-sum(slots) // rows)
    row = need + draw(st.integers(0, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    return lengths, dp, nmb, row, align, seed


@PROPERTY
@given(feasible_steps())
def test_assign_contract_on_feasible_steps(step):
    lengths, dp, nmb, row, align, seed = step
    result = assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align, seed=seed)
    _check_contract(result, lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align)


@PROPERTY
@given(st.data())
def test_assign_any_row_either_places_validly_or_refuses(data):
    """Near the lower bound a step may or may not fit; either the output keeps the contract or a
    ValueError says so. Never an out-of-row micro-batch, a dropped sample or another exception."""
    dp = data.draw(st.integers(1, 3))
    nmb = data.draw(st.integers(1, 3))
    rows = dp * nmb
    align = data.draw(st.sampled_from([1, 4, 16]))
    lengths = data.draw(st.lists(st.integers(1, 200), min_size=rows, max_size=rows * 5))
    slots = [_round_up(s, align) for s in lengths]
    lower = max(max(slots), -(-sum(slots) // rows))
    row = data.draw(st.integers(max(1, lower - 20), lower + 60))
    try:
        result = assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align)
    except ValueError as error:
        assert "row_length" in str(error)
        # Below the lower bound a refusal is certain; at or above it is only allowed.
        return
    assert row >= lower, "a placement below the lower bound cannot keep every row within row_length"
    _check_contract(result, lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align)


@FEW
@given(feasible_steps(), st.booleans())
def test_assign_is_deterministic_for_a_seed(step, as_tensor):
    lengths, dp, nmb, row, align, seed = step
    patches = [(7 * i) % 13 * 4 for i in range(len(lengths))]
    cost = SampleCost(1.0, 1.0 / 4096, 0.25, 1e-3)
    kwargs = dict(dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align, seed=seed,
                  vision_patches=patches, cost=cost)
    first = assign(list(lengths), **kwargs)
    again = assign(torch.tensor(lengths) if as_tensor else list(lengths), **kwargs)
    assert first == again
    _check_contract(first, lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align)


def test_assign_equal_lengths_every_seed_gives_full_rows():
    # 12 equal samples, 6 rows of room for exactly 2: whatever the seed breaks ties with, each row holds 2.
    for seed in range(5):
        result = assign([10] * 12, dp_size=3, num_micro_batches=2, row_length=20, seed=seed)
        _check_contract(result, [10] * 12, dp_size=3, num_micro_batches=2, row_length=20, align_to=1)
        assert all(len(micro) == 2 for rank in result for micro in rank)


# --- refusals -------------------------------------------------------------------------------------


@FEW
@given(st.data())
def test_a_sample_longer_than_the_row_is_named(data):
    n = data.draw(st.integers(4, 30))
    row = data.draw(st.integers(16, 200))
    lengths = data.draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    bad = data.draw(st.integers(0, n - 1))
    lengths[bad] = row + data.draw(st.integers(1, 50))
    with pytest.raises(ValueError) as error:
        assign(lengths, dp_size=2, num_micro_batches=2, row_length=row)
    message = str(error.value)
    assert "row_length" in message
    assert re.search(rf"\bsample {bad}\b", message), message


def test_a_sample_whose_aligned_length_exceeds_the_row_is_named():
    # Sample 3 has 5 tokens <= row_length 6, but takes 8 slots aligned to 4.
    lengths = [1, 2, 3, 5, 1, 2]
    with pytest.raises(ValueError) as error:
        assign(lengths, dp_size=2, num_micro_batches=1, row_length=6, align_to=4)
    assert re.search(r"\bsample 3\b", str(error.value)) and "row_length" in str(error.value)
    # The same step without alignment fits.
    _check_contract(assign(lengths, dp_size=2, num_micro_batches=1, row_length=7), lengths,
                    dp_size=2, num_micro_batches=1, row_length=7, align_to=1)


@FEW
@given(st.data())
def test_a_step_larger_than_all_rows_is_refused(data):
    dp = data.draw(st.integers(1, 3))
    nmb = data.draw(st.integers(1, 3))
    rows = dp * nmb
    align = data.draw(st.sampled_from([1, 8]))
    row = data.draw(st.integers(64, 256))
    n = data.draw(st.integers(rows, rows * 6))
    per = row // align * align  # every sample fits a row on its own ...
    lengths = data.draw(st.lists(st.integers(max(1, per // 2), per), min_size=n, max_size=n))
    assume(sum(_round_up(s, align) for s in lengths) > rows * row)  # ... but not all of them together
    with pytest.raises(ValueError, match="row_length"):
        assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=align)


def test_a_step_exactly_filling_all_rows_is_placed():
    # The boundary of the previous test: 8 samples of 25 aligned slots, 4 rows of 50.
    lengths = [25, 21, 25, 17, 24, 25, 25, 23]
    result = assign(lengths, dp_size=2, num_micro_batches=2, row_length=50, align_to=25)
    _check_contract(result, lengths, dp_size=2, num_micro_batches=2, row_length=50, align_to=25)
    with pytest.raises(ValueError, match="row_length"):
        assign(lengths + [1], dp_size=2, num_micro_batches=2, row_length=50, align_to=25)


@pytest.mark.parametrize("dp, nmb, n", [(2, 2, 3), (4, 1, 1), (3, 5, 14), (1, 2, 1)])
def test_fewer_samples_than_micro_batches_is_refused(dp, nmb, n):
    with pytest.raises(ValueError):
        assign([5] * n, dp_size=dp, num_micro_batches=nmb, row_length=1000)
    # One more sample than that fits (the boundary).
    _check_contract(assign([5] * (dp * nmb), dp_size=dp, num_micro_batches=nmb, row_length=1000), [5] * (dp * nmb),
                    dp_size=dp, num_micro_batches=nmb, row_length=1000, align_to=1)


@pytest.mark.parametrize("name", ["dp_size", "num_micro_batches", "row_length", "align_to"])
@pytest.mark.parametrize("value", [0, -1, -8, True, False, 2.0, "4", None])
def test_bad_arguments_are_refused_by_name(name, value):
    kwargs = dict(dp_size=2, num_micro_batches=2, row_length=64, align_to=1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        assign([8] * 8, **kwargs)


@pytest.mark.parametrize("lengths", [[4, 0, 4, 4], [4, 4, -3, 4]])
def test_empty_or_negative_samples_are_refused(lengths):
    with pytest.raises(ValueError, match="lengths"):
        assign(lengths, dp_size=2, num_micro_batches=2, row_length=64)


# --- Megatron-Bridge's own placement --------------------------------------------------------------


@pytest.mark.parametrize("dp, mbs, nmb", [(1, 1, 3), (2, 1, 2), (4, 2, 3), (3, 3, 1), (8, 4, 2)])
def test_in_batch_assignment_is_megatron_bridges_sampler(dp, mbs, nmb):
    """Rank r's j-th micro-batch from the real MegatronPretrainingSampler (one per rank), minus the
    step's first position, equals in_batch_assignment's [r][j], for several steps of a run."""
    samplers = load_bridge_module("data.samplers")
    gbs = dp * mbs * nmb
    steps = 3
    total = steps * gbs + 5  # a ragged tail, which drop_last drops
    expected = in_batch_assignment(gbs, dp_size=dp, micro_batch_size=mbs)
    for step in range(steps):
        consumed = step * gbs
        for rank in range(dp):
            sampler = samplers.MegatronPretrainingSampler(
                total_samples=total, consumed_samples=consumed, micro_batch_size=mbs, data_parallel_rank=rank,
                data_parallel_size=dp, drop_last=True)
            drawn = iter(sampler)
            for j in range(nmb):
                assert [i - consumed for i in next(drawn)] == expected[rank][j]
    # The positions cover 0..GBS-1 once.
    assert sorted(i for rank in expected for micro in rank for i in micro) == list(range(gbs))


def test_in_batch_assignment_refuses_a_ragged_step():
    with pytest.raises(ValueError, match="num_samples"):
        in_batch_assignment(10, dp_size=4, micro_batch_size=1)


# --- balance on the receipt distribution ------------------------------------------------------------

SEQ_LENGTH = 2048  # the receipts are cord_v2-like at seq_length 2048 (plan.samples.receipt_lengths)
# A hand-made cost with every term of the module's formula (tokens, s^2, patches, patches^2).
VISION_COST = SampleCost(per_token=1.0, per_token_squared=1.0 / 24576, per_patch=0.4, per_patch_squared=2e-4)


def _receipts(seed: int):
    samples = receipt_lengths(512, seed)
    lengths = list(samples.tokens)
    patches = [sum(t * h * w for t, h, w in g) for g in samples.grids]
    squared = [sum(t * (h * w) ** 2 for t, h, w in g) for g in samples.grids]  # attention within each frame
    return lengths, patches, squared


def _costs(kind, lengths, patches, squared):
    if kind == "default":  # assign's documented default: VERL's s + s^2 / 24576
        return [s + s * s / 24576 for s in lengths]
    c = VISION_COST
    return [c.per_token * s + c.per_token_squared * s * s + c.per_patch * p + c.per_patch_squared * q
            for s, p, q in zip(lengths, patches, squared)]


def _rank_imbalance(result, costs):
    per_rank = [sum(costs[i] for micro in rank for i in micro) for rank in result]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


@pytest.mark.parametrize("kind", ["default", "vision"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mbs", [1, 2, 4, 8])
def test_balance_beats_in_batch_on_receipts(kind, seed, mbs):
    lengths, patches, squared = _receipts(seed)
    dp, gbs = 8, 512
    nmb = gbs // (dp * mbs)
    row = mbs * SEQ_LENGTH
    costs = _costs(kind, lengths, patches, squared)
    kwargs = {} if kind == "default" else dict(vision_patches=patches, vision_patches_squared=squared, cost=VISION_COST)
    result = assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, seed=seed, **kwargs)
    _check_contract(result, lengths, dp_size=dp, num_micro_batches=nmb, row_length=row, align_to=1)
    ours = _rank_imbalance(result, costs)
    theirs = _rank_imbalance(in_batch_assignment(gbs, dp_size=dp, micro_batch_size=mbs), costs)
    assert ours <= theirs
    assert ours < 1.03


TIGHT_CASES = [(seed, mbs, align, kind) for seed in (0, 1, 2) for mbs, align in ((4, 1), (8, 1), (4, 8))
               for kind in ("default", "vision")]


def _tight_case(seed, mbs, align, kind):
    """A static row 5% above the mean aligned tokens per row (rounded up to the alignment)."""
    lengths, patches, squared = _receipts(seed)
    dp, gbs = 8, 512
    nmb = gbs // (dp * mbs)
    slots = [_round_up(s, align) for s in lengths]
    tight = _round_up(math.ceil(1.05 * sum(slots) / (dp * nmb)), align)
    assert tight >= max(slots)  # else no placement exists; the case would test nothing
    kwargs = {} if kind == "default" else dict(vision_patches=patches, vision_patches_squared=squared, cost=VISION_COST)
    result = assign(lengths, dp_size=dp, num_micro_batches=nmb, row_length=tight, align_to=align, seed=seed, **kwargs)
    _check_contract(result, lengths, dp_size=dp, num_micro_batches=nmb, row_length=tight, align_to=align)


def test_tight_static_row_still_fits(monkeypatch):
    """Every tight case is placed within its row; and some of them only by the first-fit-decreasing
    fallback (counted through the module attribute assign calls), so the fallback is what is tested."""
    calls = []
    original = policy._first_fit_decreasing

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(policy, "_first_fit_decreasing", counted)
    for case in TIGHT_CASES:
        _tight_case(*case)
    assert calls, "no tight case needed the fallback"
    # A loose row (micro_batch_size * seq_length) never needs it.
    calls.clear()
    lengths, patches, squared = _receipts(0)
    assign(lengths, dp_size=8, num_micro_batches=16, row_length=4 * SEQ_LENGTH, vision_patches=patches,
           vision_patches_squared=squared, cost=VISION_COST)
    assert not calls


# --- placement_stats ----------------------------------------------------------------------------------


def test_placement_stats_by_hand():
    lengths = [3, 5, 2, 7, 1, 4]
    placement = [[[0, 1], [2]], [[3], [4, 5]]]  # 2 ranks x 2 micro-batches
    # Cost = lengths (default). Ranks: 3+5+2 = 10, 7+1+4 = 12 (mean 11). Micro-batches: 8, 2, 7, 5 (mean 5.5).
    thd = placement_stats(placement, lengths, align_to=4)
    assert thd.real_tokens == 22
    assert thd.slots == 4 + 8 + 4 + 8 + 4 + 4  # each length rounded up to 4
    assert thd.padding == pytest.approx(1 - 22 / 32)
    assert thd.rank_imbalance == pytest.approx(12 / 11)
    assert thd.micro_batch_imbalance == pytest.approx(8 / 5.5)
    assert thd.rank_cost == pytest.approx((10, 12))
    # A static row of 10 slots: 4 micro-batches x 10.
    static = placement_stats(placement, lengths, row_length=10)
    assert (static.real_tokens, static.slots) == (22, 40)
    assert static.padding == pytest.approx(1 - 22 / 40)
    # Explicit costs: ranks 1+2+3 = 6 and 4+5+6 = 15 (mean 10.5); micro-batches 3, 3, 4, 11 (mean 5.25).
    weighted = placement_stats(placement, lengths, costs=[1, 2, 3, 4, 5, 6])
    assert weighted.rank_cost == pytest.approx((6, 15))
    assert weighted.rank_imbalance == pytest.approx(15 / 10.5)
    assert weighted.micro_batch_imbalance == pytest.approx(11 / 5.25)
    assert weighted.slots == 22 and weighted.padding == pytest.approx(0.0)


@pytest.mark.parametrize("cost", [SampleCost(0.0, 0.0), SampleCost(0.0, 0.0, per_patch=1.0, per_patch_squared=0.0)],
                         ids=["zero", "vision-only"])
def test_samples_of_zero_cost_still_fill_every_micro_batch(cost):
    """The contract holds for any cost, including one that is zero for some samples: a vision-only
    cost (``per_token = per_token_squared = 0``) on text-only samples, or all-zero coefficients.

    src bug (policy._longest_processing_time): a row's load does not grow when it receives a
    zero-cost sample, so the heap hands the same row out again and other rows stay empty;
    e.g. 4 samples of 5 tokens, 2 ranks x 2 micro-batches, row 100, SampleCost(0, 0) gives
    ``[[[0, 1, 3, 2], []], [[], []]]``.
    """
    lengths = [5, 5, 5, 5, 9, 3]
    patches = [0, 0, 0, 0, 0, 16]  # one sample with an image, the rest text only
    result = assign(lengths, dp_size=2, num_micro_batches=2, row_length=100, vision_patches=patches, cost=cost)
    _check_contract(result, lengths, dp_size=2, num_micro_batches=2, row_length=100, align_to=1)
