"""``batching.time_placement.place_by_time``: a CP size per sample balanced on the time model.

Every expectation comes from the placement's contract (each sample once, aligned power-of-two blocks, a row's slots
its samples' lengths aligned to ``2k`` and at most ``k * max_tokens_per_rank``, a CP size at least the smallest that
holds the sample, one group in which every rank has a row, the simulated step and busy times it reports), or from
the comparison it is built for: never slower than Megatron-Core's ``BalancedCPScheduler`` (its groups behind
barriers) as the same ``step_time.row_time`` prices both. That comparison is a real one on seeded mixes: it can fail.
"""

from __future__ import annotations

import random

import pytest

from megatron.bridge_thd.batching.cp_per_sample import TooLongForTheWorld, place_with_cp_per_sample, timeline
from megatron.bridge_thd.cost.step_time import SampleWork, sample_work
from megatron.bridge_thd.batching.time_placement import RowPricer, _Prices, place_by_time, works_from_sizes

LIMIT = 16384


@pytest.fixture(scope="module")
def pricer():
    return RowPricer.of("qwen3-vl-8b", "h100-sxm")


def _video_mix(n: int, seed: int) -> list[SampleWork]:
    from megatron.bridge_thd.plan.video_mix import video_mix_lengths

    mix = video_mix_lengths(n, seed=seed)
    return [sample_work(tokens, grids) for tokens, grids in zip(mix.tokens, mix.grids)]


def _text_mix(n: int, seed: int) -> list[SampleWork]:
    from megatron.bridge_thd.plan.text_mix import text_mix_lengths

    return [SampleWork(tokens) for tokens in text_mix_lengths(n, seed=seed).tokens]


def _smallest_cp(tokens: int, limit: int) -> int:
    k = 1
    while -(-tokens // (2 * k if k > 1 else 1)) * (2 * k if k > 1 else 1) > k * limit:
        k *= 2
    return k


def check_contract(placement, works, world: int, limit: int) -> None:
    lengths = [w.tokens for w in works]
    placed = sorted(s for row in placement.rows for s in row.samples)
    assert placed == list(range(len(works))), "every sample in exactly one row"
    assert placement.groups == 1 and placement.placed_by == "time"
    for row in placement.rows:
        k = row.cp_size
        assert k & (k - 1) == 0 and row.ranks == tuple(range(row.ranks[0], row.ranks[0] + k)), row
        assert row.ranks[0] % k == 0 and row.ranks[-1] < world, row
        align = 2 * k if k > 1 else 1
        assert row.slots == sum(-(-lengths[s] // align) * align for s in row.samples), row
        assert row.slots <= k * limit, row
        assert all(k >= _smallest_cp(lengths[s], limit) for s in row.samples), row
    groups = placement.row_id_groups()  # raises when a rank has no row
    assert all(ids for ids in groups[0]) and all(ids == sorted(ids) for ids in groups[0])
    assert len(placement.busy) == world and placement.step_s >= max(placement.busy) > 0
    if placement.imbalance > 1.05:
        assert placement.reason.startswith("busy max / mean"), placement.reason
    else:
        assert placement.reason == ""


def _priced(placement, works, pricer) -> float:
    step, _ = timeline(placement.rows, placement.world,
                       lambda row: pricer.seconds([works[s] for s in row.samples], row.cp_size))
    return step


@pytest.mark.parametrize("world, per_rank, mix, seed", [
    (8, 8, "video", 0), (8, 4, "video", 1), (16, 4, "text", 0), (32, 4, "video", 2), (4, 2, "text", 3),
])
def test_contract_and_never_slower_than_megatron_cores_scheduler(pricer, world, per_rank, mix, seed):
    works = (_video_mix if mix == "video" else _text_mix)(world * per_rank, seed)
    ours = place_by_time(works, world=world, max_tokens_per_rank=LIMIT, pricer=pricer)
    check_contract(ours, works, world, LIMIT)
    # The reported step and busy times are the rows' row_time, simulated.
    assert ours.step_s == pytest.approx(_priced(ours, works, pricer), rel=1e-9)
    theirs = place_with_cp_per_sample([w.tokens for w in works], world=world, max_tokens_per_rank=LIMIT)
    assert ours.step_s <= _priced(theirs, works, pricer)


def test_balanced_where_the_samples_allow(pricer):
    """64 draws of the video mix on 8 ranks: many short samples to fill around the long ones."""
    works = _video_mix(64, 0)
    placement = place_by_time(works, world=8, max_tokens_per_rank=LIMIT, pricer=pricer)
    assert placement.imbalance <= 1.05 and placement.reason == ""


def test_the_reason_where_the_samples_do_not_allow(pricer):
    """17 samples of 16,000 tokens on 16 ranks: no way to give every rank the same busy time at the shortest step;
    the placement says so instead of missing silently."""
    works = [SampleWork(16000)] * 17
    placement = place_by_time(works, world=16, max_tokens_per_rank=LIMIT, pricer=pricer)
    check_contract(placement, works, 16, LIMIT)
    assert placement.imbalance > 1.05
    assert "busy max / mean" in placement.reason and "16 ranks" in placement.reason


@pytest.mark.parametrize("world, tokens", [(8, [100]), (8, [3000, 200]), (16, [16000, 16000, 16000]),
                                           (4, [30, 40, 50]), (32, [9000] * 5)])
def test_every_rank_has_a_row_with_fewer_samples_than_ranks(pricer, world, tokens):
    """Fewer samples than ranks: CP sizes are raised (or rows widened) until every rank runs a row, as
    Megatron-Core's schedule needs."""
    works = [SampleWork(n) for n in tokens]
    placement = place_by_time(works, world=world, max_tokens_per_rank=LIMIT, pricer=pricer)
    check_contract(placement, works, world, LIMIT)
    assert sum(row.cp_size for row in placement.rows) >= world


def test_a_sample_longer_than_the_world_is_refused(pricer):
    with pytest.raises(TooLongForTheWorld, match="max_tokens_per_rank"):
        place_by_time([SampleWork(5 * LIMIT)], world=4, max_tokens_per_rank=LIMIT, pricer=pricer)
    with pytest.raises(ValueError, match="power of two"):
        place_by_time([SampleWork(10)], world=6, max_tokens_per_rank=LIMIT, pricer=pricer)


def test_deterministic(pricer):
    works = _video_mix(64, 5)
    a = place_by_time(works, world=16, max_tokens_per_rank=LIMIT, pricer=pricer)
    b = place_by_time(list(works), world=16, max_tokens_per_rank=LIMIT, pricer=pricer)
    assert a == b


def test_a_rows_price_without_its_frames_is_the_row_time(pricer):
    """The placement prices merged rows without their frames plus each sample's ViT-attention part: the same as
    pricing the row whole (this holds while row_time sums the ViT attention over frames)."""
    rng = random.Random(0)
    works = [sample_work(rng.randint(100, 9000), [(rng.randint(1, 40), 28, 28)]) for _ in range(6)]
    prices = _Prices(works, pricer, [1, 2, 4, 8])
    for k in (1, 2, 4, 8):
        assert prices.row([0, 2, 3, 5], k) == pytest.approx(pricer.seconds([works[i] for i in (0, 2, 3, 5)], k),
                                                            rel=1e-12)


def test_works_from_sizes():
    works = works_from_sizes([100, 200], [64, 0], [64 * 64 / 2, 0.0])  # two frames of 32 patches; no image
    assert works[0] == SampleWork(100, 64, (32, 32)) and works[1] == SampleWork(200)


def test_the_placer_is_chosen_once_from_the_setting():
    from megatron.bridge_thd.batching.cp_per_sample_loader import StepPlacer
    from megatron.bridge_thd.settings import CPPerSample

    megatron = StepPlacer.of(CPPerSample(64), world=4)
    assert megatron.pricer is None and megatron([166, 88, 95, 23]).placed_by == "megatron"
    timed = StepPlacer.of(CPPerSample(64, placement="time", gpu="h100-sxm"), world=4, cost_model="qwen3-vl-2b")
    placement = timed([166, 88, 95, 23], [0, 0, 0, 0], [0.0] * 4)
    assert placement.placed_by == "time" and placement.step_s > 0


def test_the_setting_is_validated():
    from megatron.bridge_thd.settings import CPPerSample, GlobalBatchPacking, PackingSettings

    assert CPPerSample(64).problems() == []
    assert "cp_per_sample.placement: 'fast'" in CPPerSample(64, placement="fast").problems()[0]
    assert "cp_per_sample.gpu: placement 'time'" in CPPerSample(64, placement="time").problems()[0]
    assert "has no time model" in CPPerSample(64, placement="time", gpu="tpu").problems()[0]
    assert "does not read them" in CPPerSample(64, gpu="h100-sxm").problems()[0]
    with pytest.raises(ValueError, match="cp_per_sample.model: placement 'time'"):
        PackingSettings(cp_per_sample=CPPerSample(64, placement="time", gpu="h100-sxm"),
                        global_batch_packing=GlobalBatchPacking())
    PackingSettings(cp_per_sample=CPPerSample(64, placement="time", gpu="h100-sxm"),
                    global_batch_packing=GlobalBatchPacking(cost_model="qwen3-vl-8b"))
    assert CPPerSample(64, placement="time", gpu="h100-sxm", model="no-such-model").resource_problems()[0].startswith(
        "cp_per_sample.model:")


def test_the_rules_take_the_cost_model_as_the_time_placements_model():
    """global_batch_packing.cost_model is refused with Megatron-Core's scheduler (it has nothing to apply to) and read
    as the time model's model by placement 'time'."""
    from megatron.bridge_thd.rules import run as rules
    from megatron.bridge_thd.rules.registry import CONFIGURE
    from megatron.bridge_thd.rules.setup import Setup
    from megatron.bridge_thd.settings import CPPerSample, GlobalBatchPacking, PackingSettings

    def found(cp_per_sample):
        settings = PackingSettings(cp_per_sample=cp_per_sample, global_batch_packing=GlobalBatchPacking(cost_model="qwen3-vl-8b"))
        return rules.problems(Setup(layout="thd", settings=settings, seq_lengths=(8192, 8192), dataloader_type="single"),
                              CONFIGURE)

    refused = found(CPPerSample(256))
    assert len(refused) == 1 and "global_batch_packing.cost_model='qwen3-vl-8b'" in refused[0]
    assert found(CPPerSample(256, placement="time", gpu="h100-sxm")) == []
