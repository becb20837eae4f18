"""``batching.cp_per_sample.place_with_cp_per_sample``: a CP size per sample from Megatron-Core's ``BalancedCPScheduler``.

Every expectation comes from the placement's contract (each sample once, aligned power-of-two blocks, a row's slots
its samples' lengths aligned to ``2k``, at most ``k * max_tokens_per_rank`` slots a row, a CP size no smaller than
the smallest power of two that holds the sample, one block per rank per group, determinism), from Megatron-Core's
own ``BalancedCPScheduler.gpus_needed`` evaluated here, or from reasoning by hand (the worked example); never from
what the module printed.
"""

from __future__ import annotations

import math
import random
import re
import subprocess
import sys

import pytest

from megatron.bridge_thd.batching.cp_per_sample import (
    CPRow,
    CPPerSamplePlacement,
    TooLongForTheWorld,
    cp_slots,
    place_with_cp_per_sample,
)

WORLDS = (1, 2, 4, 8)
MAX_TOKENS = (8, 64, 256, 1000, 4096)


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _slots(length: int, world: int) -> int:
    """The scheduler's view of a sample: its length aligned to ``2 * world`` (no alignment on one rank)."""
    return _round_up(length, 2 * world) if world > 1 else length


def _smallest_cp(slots: int, max_tokens: int) -> int:
    """The smallest power of two ``k`` with ``slots <= k * max_tokens`` (integers only)."""
    k = 1
    while slots > k * max_tokens:
        k *= 2
    return k


def _row_slots(lengths, samples, k: int) -> int:
    align = 2 * k if k > 1 else 1
    return sum(_round_up(lengths[s], align) for s in samples)


class _Group:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def _scheduler(max_tokens: int, world: int):
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    return BalancedCPScheduler(max_tokens, _Group(world))


def _long_tailed(rng: random.Random, world: int, max_tokens: int) -> list[int]:
    """Log-normal lengths around half a rank's limit, clipped to what the world holds."""
    n = rng.randint(1, 40)
    sigma = rng.choice((0.5, 1.0, 1.5, 2.0))
    return [max(1, min(int(rng.lognormvariate(math.log(max_tokens / 2), sigma)), world * max_tokens))
            for _ in range(n)]


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        world, max_tokens = rng.choice(WORLDS), rng.choice(MAX_TOKENS)
        yield _long_tailed(rng, world, max_tokens), world, max_tokens


def _check_invariants(placement: CPPerSamplePlacement, lengths, world: int, max_tokens: int) -> None:
    where = (lengths, world, max_tokens)
    assert placement.world == world and placement.max_tokens_per_rank == max_tokens
    # Every sample in exactly one row.
    placed = [s for row in placement.rows for s in row.samples]
    assert sorted(placed) == list(range(len(lengths))), where
    cp_of = placement.cp_size_of()
    assert sorted(cp_of) == list(range(len(lengths)))
    for row in placement.rows:
        k = len(row.ranks)
        assert row.cp_size == k
        # An aligned power-of-two block inside the world.
        assert k >= 1 and k & (k - 1) == 0 and k <= world, (row, where)
        b = row.ranks[0] // k
        assert row.ranks == tuple(range(b * k, (b + 1) * k)), (row, where)
        assert row.ranks[-1] < world
        assert row.samples and list(row.samples) == sorted(set(row.samples))
        # All its samples on its CP size; its slots are theirs aligned to 2k (1 for k == 1), within the cap.
        assert all(cp_of[s] == k for s in row.samples)
        assert row.slots == _row_slots(lengths, row.samples, k), (row, where)
        assert row.slots <= k * max_tokens, (row, where)
        assert row.slots_per_rank * k == row.slots  # each sample's slots divide by 2k, so the row's by k
        # The scheduler may raise a sample's CP size, never lower it below the smallest that holds it.
        for s in row.samples:
            assert k >= _smallest_cp(_slots(lengths[s], world), max_tokens), (s, row, where)
    # Rows by group, then by first rank; groups numbered 0.. without a gap.
    keys = [(row.group, row.ranks[0]) for row in placement.rows]
    assert keys == sorted(keys)
    groups = sorted({row.group for row in placement.rows})
    assert groups == list(range(placement.groups))
    for group in groups:
        blocks = {row.ranks for row in placement.rows if row.group == group}
        ranks = [r for block in blocks for r in block]
        # Within a group no rank is in two blocks; upstream's fill step leaves no rank idle.
        assert len(ranks) == len(set(ranks)), (group, blocks, where)
        assert sorted(ranks) == list(range(world)), (group, blocks, where)


def test_cp_slots_aligns_to_twice_the_world():
    for world in WORLDS + (16,):
        for length in (1, 2, 3, 2 * world - 1, 2 * world, 2 * world + 1, 999, 1000, 4097):
            assert cp_slots(length, world) == _slots(length, world)
    assert cp_slots(7, 1) == 7 and cp_slots(7, 2) == 8 and cp_slots(7, 4) == 8 and cp_slots(9, 4) == 16


def test_invariants_over_random_long_tailed_steps():
    count = 0
    for lengths, world, max_tokens in _cases(300, seed=20240601):
        placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
        _check_invariants(placement, lengths, world, max_tokens)
        # Same input, same placement (a fresh scheduler each call; no state carried over).
        assert place_with_cp_per_sample(list(lengths), world=world, max_tokens_per_rank=max_tokens) == placement
        count += 1
    assert count == 300


def test_invariants_with_samples_of_every_cp_size():
    """Lengths drawn per CP class (just above half a class to just under it), so large CP sizes are common."""
    rng = random.Random(7)
    for _ in range(150):
        world = rng.choice((4, 8, 16))
        max_tokens = rng.choice((64, 100, 256))
        classes = [c for c in (1, 2, 4, 8, 16) if c <= world]
        lengths = []
        for _ in range(rng.randint(1, 20)):
            c = rng.choice(classes)
            lengths.append(rng.randint((c // 2) * max_tokens + 1 if c > 1 else 1, c * max_tokens - 2 * world))
        placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
        _check_invariants(placement, lengths, world, max_tokens)


def test_rows_of_groups_and_cp_size_of_agree_with_rows():
    for lengths, world, max_tokens in _cases(60, seed=99):
        placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
        assert placement.groups == 1 + max(row.group for row in placement.rows)
        assert placement.cp_size_of() == {s: len(row.ranks) for row in placement.rows for s in row.samples}
        seen = {}
        for rank in range(world):
            mine = placement.rows_of(rank)
            assert mine == tuple(row for row in placement.rows if rank in row.ranks)
            # In order of groups, and within one group all on one block.
            assert [row.group for row in mine] == sorted(row.group for row in mine)
            for group in {row.group for row in mine}:
                assert len({row.ranks for row in mine if row.group == group}) == 1
            for row in mine:
                seen[row] = seen.get(row, 0) + 1
        # Each row is run by exactly its cp_size ranks; no rank is asked for a row it is not in.
        assert sum(seen.values()) == sum(row.cp_size for row in placement.rows)
        assert all(seen[row] == row.cp_size for row in placement.rows)
        assert placement.rows_of(world) == ()


def test_empty_step():
    placement = place_with_cp_per_sample([], world=4, max_tokens_per_rank=8)
    assert placement.rows == () and placement.groups == 0 and placement.cp_size_of() == {}


_FRESH = ("from megatron.bridge_thd.batching.cp_per_sample import place_with_cp_per_sample as p; "
          "print(repr(p({lengths!r}, world={world}, max_tokens_per_rank={max_tokens})))")


def test_deterministic_in_a_fresh_process():
    lengths, world, max_tokens = [900, 17, 3000, 250, 251, 64, 1, 1999, 512, 700, 33, 4000, 2], 8, 512
    here = repr(place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens))
    out = subprocess.run([sys.executable, "-c", _FRESH.format(lengths=lengths, world=world, max_tokens=max_tokens)],
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == here


# --- the CP size rule against Megatron-Core's gpus_needed -------------------------------------------------------

def test_smallest_cp_is_megatron_cores_gpus_needed():
    """Our integer rule is upstream's ``max(1, 2 ** ceil(log2(slots / max)))`` on the values the module passes."""
    for max_tokens in (2, 64, 256, 1000):
        scheduler = _scheduler(max_tokens, 64)
        edges = {k * max_tokens + d for k in (1, 2, 4, 8, 16, 32, 64) for d in (-1, 0, 1)}
        for slots in sorted(edges | set(range(1, 3 * max_tokens, max(1, max_tokens // 7)))):
            if 1 <= slots <= 64 * max_tokens:
                assert scheduler.gpus_needed(slots) == _smallest_cp(slots, max_tokens), (slots, max_tokens)


@pytest.mark.parametrize("max_tokens", [64, 256, 1000])
def test_lone_sample_gets_upstream_cp_size_where_fill_cannot_raise_it(max_tokens):
    """A lone sample: on the smallest world that holds it, its CP size is exactly ``gpus_needed(cp_slots)``, which
    is that world (so upstream's fill step has no idle rank to raise it into); on larger worlds it is never less,
    and the fill step spreads it over the whole world (no rank idle); on smaller worlds it is refused."""
    rng = random.Random(max_tokens)
    lengths = {1, 2, max_tokens - 1, max_tokens, max_tokens + 1, 2 * max_tokens, 2 * max_tokens + 1,
               4 * max_tokens - 3, 8 * max_tokens, 8 * max_tokens + 1}
    lengths |= {rng.randint(1, 16 * max_tokens) for _ in range(25)}
    for length in sorted(lengths):
        fits = [w for w in (1, 2, 4, 8, 16, 32) if _slots(length, w) <= w * max_tokens]
        smallest = fits[0]
        needed = _scheduler(max_tokens, smallest).gpus_needed(cp_slots(length, smallest))
        assert needed == smallest == _smallest_cp(_slots(length, smallest), max_tokens), length
        placement = place_with_cp_per_sample([length], world=smallest, max_tokens_per_rank=max_tokens)
        assert placement.cp_size_of() == {0: needed}, length
        for world in fits[1:]:
            placement = place_with_cp_per_sample([length], world=world, max_tokens_per_rank=max_tokens)
            lower = _scheduler(max_tokens, world).gpus_needed(cp_slots(length, world))
            assert placement.cp_size_of()[0] >= lower
            assert placement.rows == (CPRow(0, tuple(range(world)), (0,), _row_slots([length], (0,), world)),)
        for world in (1, 2, 4, 8, 16):
            if world < smallest:
                with pytest.raises(TooLongForTheWorld):
                    place_with_cp_per_sample([length], world=world, max_tokens_per_rank=max_tokens)


def test_samples_that_fill_the_world_keep_upstream_cp_size():
    """``world / k`` samples that each need exactly ``k`` ranks (and nothing else): they fill the world in one
    group, no rank idle, so the fill step raises none; each gets exactly ``gpus_needed`` on an aligned block."""
    max_tokens = 256
    for world in (2, 4, 8, 16):
        for k in (1, 2, 4, 8):
            if k > world:
                continue
            low = (k // 2) * max_tokens + 1 if k > 1 else 1
            lengths = [low + 2 * world * i for i in range(world // k)]
            lengths = [n for n in lengths if _slots(n, world) <= k * max_tokens]
            if len(lengths) != world // k:
                continue
            placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
            scheduler = _scheduler(max_tokens, world)
            for s, n in enumerate(lengths):
                assert scheduler.gpus_needed(cp_slots(n, world)) == k
            assert placement.cp_size_of() == {s: k for s in range(len(lengths))}, (world, k, lengths)
            assert placement.groups == 1
            assert sorted(row.ranks for row in placement.rows) == [tuple(range(b * k, (b + 1) * k))
                                                                  for b in range(world // k)]


# --- the worked example -------------------------------------------------------------------------------------------

def test_worked_example():
    """Lengths [900, 400, 380, 100, 90, 80, 60, 50], world 4, 256 tokens a rank.

    cp_slots aligns to 2 * 4 = 8: 904, 400, 384, 104, 96, 80, 64, 56. 904 > 2 * 256 = 512 and <= 1024: CP 4.
    400 and 384 lie in (256, 512]: CP 2. The rest are <= 256: CP 1.
    Group 0: the scheduler goes longest first; sample 0 takes all 4 ranks, no other sample needs 4, so it runs alone.
    Group 1: sample 1 takes the free ranks (0, 1); sample 2 opens (2, 3) (a fresh block's load 0 beats (0, 1)'s);
    no rank is free and no CP-1 block exists, so the CP-1 samples wait.
    Group 2: the five CP-1 samples on four ranks: 104, 96, 80, 64 open ranks 0..3 in turn; 56 joins the least
    loaded (rank 3, 64^2); rows on CP 1 take the real lengths (no alignment): 60 + 50 = 110 <= 256.
    """
    lengths = [900, 400, 380, 100, 90, 80, 60, 50]
    placement = place_with_cp_per_sample(lengths, world=4, max_tokens_per_rank=256)
    assert placement.cp_size_of() == {0: 4, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    assert placement.groups == 3
    assert placement.rows[0] == CPRow(0, (0, 1, 2, 3), (0,), 904)
    assert [row for row in placement.rows if row.group == 1] == [CPRow(1, (0, 1), (1,), 400),
                                                                  CPRow(1, (2, 3), (2,), 380)]
    assert placement.rows == (
        CPRow(0, (0, 1, 2, 3), (0,), 904),
        CPRow(1, (0, 1), (1,), 400),
        CPRow(1, (2, 3), (2,), 380),
        CPRow(2, (0,), (3,), 100),
        CPRow(2, (1,), (4,), 90),
        CPRow(2, (2,), (5,), 80),
        CPRow(2, (3,), (6, 7), 110),
    )
    assert placement.rows_of(3) == (placement.rows[0], placement.rows[2], placement.rows[6])
    assert placement.rows[0].slots_per_rank == 226 and placement.rows[1].slots_per_rank == 200


# --- refusals -------------------------------------------------------------------------------------------------------

def _sufficient(message: str) -> int:
    found = re.search(r"at least (\d+)", message)
    assert found, message
    return int(found.group(1))


def test_too_long_for_the_world_names_the_fix_and_the_fix_works():
    # world 4 at 256: 1024 slots; 1024 itself fits, 1025 -> round_up(1025, 8) = 1032 > 1024 does not.
    ok = place_with_cp_per_sample([10, 1024, 1021], world=4, max_tokens_per_rank=256)
    assert ok.cp_size_of()[1] == 4 and ok.cp_size_of()[2] == 4
    with pytest.raises(TooLongForTheWorld) as info:
        place_with_cp_per_sample([10, 1025, 30], world=4, max_tokens_per_rank=256)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "max_tokens_per_rank" in message and "sample 1" in message
    assert _sufficient(message) == 258  # ceil(1032 / 4); 257 gives 1028 < 1032
    placed = place_with_cp_per_sample([10, 1025, 30], world=4, max_tokens_per_rank=_sufficient(message))
    assert placed.cp_size_of()[1] == 4
    with pytest.raises(TooLongForTheWorld):
        place_with_cp_per_sample([10, 1025, 30], world=4, max_tokens_per_rank=_sufficient(message) - 1)


@pytest.mark.parametrize("lengths, world, max_tokens, worst, least", [
    ([5, 1100, 2000, 3], 4, 256, 2, 500),  # worst: round_up(2000, 8) = 2000 -> 500 a rank
    ([257], 1, 256, 0, 257),  # one rank: no alignment, 257 slots
    ([515, 10], 2, 256, 0, 258),  # round_up(515, 4) = 516 -> 258
    ([1, 70000, 2, 65537], 8, 4096, 1, 8750),  # round_up(70000, 16) = 70000 -> 8750
])
def test_too_long_names_the_worst_sample_and_a_value_that_works(lengths, world, max_tokens, worst, least):
    with pytest.raises(TooLongForTheWorld) as info:
        place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
    message = str(info.value)
    assert "max_tokens_per_rank" in message and f"sample {worst} " in message
    assert _sufficient(message) == least
    placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=least)
    _check_invariants(placement, lengths, world, least)


@pytest.mark.parametrize("kwargs, name", [
    (dict(lengths=[5], world=3, max_tokens_per_rank=8), "world"),
    (dict(lengths=[5], world=6, max_tokens_per_rank=8), "world"),
    (dict(lengths=[5], world=12, max_tokens_per_rank=8), "world"),
    (dict(lengths=[5], world=0, max_tokens_per_rank=8), "world"),
    (dict(lengths=[5], world=-4, max_tokens_per_rank=8), "world"),
    (dict(lengths=[5], world=1, max_tokens_per_rank=1), "max_tokens_per_rank"),
    (dict(lengths=[5], world=4, max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(lengths=[5, 0, 3], world=4, max_tokens_per_rank=8), "lengths[1]"),
    (dict(lengths=[5, 3, -2], world=2, max_tokens_per_rank=8), "lengths[2]"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    lengths = kwargs.pop("lengths")
    with pytest.raises(ValueError) as info:
        place_with_cp_per_sample(lengths, **kwargs)
    assert not isinstance(info.value, TooLongForTheWorld)
    assert str(info.value).startswith(name), str(info.value)


# --- the row split --------------------------------------------------------------------------------------------------

def _first_fit_decreasing(slots: dict[int, int], capacity: int) -> list[tuple[int, ...]]:
    rows, used = [], []
    for s in sorted(slots, key=lambda s: (-slots[s], s)):
        for i in range(len(rows)):
            if used[i] + slots[s] <= capacity:
                rows[i].append(s)
                used[i] += slots[s]
                break
        else:
            rows.append([s])
            used.append(slots[s])
    return sorted(tuple(sorted(row)) for row in rows)


def test_one_rank_over_the_cap_splits_into_rows_within_it():
    """World 1: every sample on rank 0 at CP 1, 200 tokens for a 100-token cap. First fit, longest first:
    60 | 50 | 40 -> row of 60 (100) | 30 -> row of 50 (80) | 20 -> row of 50 (100): rows {60, 40}, {50, 30, 20}."""
    lengths = [60, 50, 40, 30, 20]
    placement = place_with_cp_per_sample(lengths, world=1, max_tokens_per_rank=100)
    assert all(row.ranks == (0,) for row in placement.rows)
    assert all(row.slots <= 100 for row in placement.rows)
    assert sum(row.slots for row in placement.rows) == 200
    assert len(placement.rows) >= 2
    assert sorted((row.group, row.samples) for row in placement.rows) == [(0, (0, 2)), (0, (1, 3, 4))]


def test_many_small_samples_split_per_block_and_group():
    """More CP-1 tokens per rank than the cap: within each group and block, the rows are the block's samples
    packed first fit, longest first, into ``k * max`` slots (the documented rule, re-implemented here)."""
    rng = random.Random(3)
    split = 0
    for world, max_tokens in ((1, 64), (1, 1000), (2, 100), (4, 256), (8, 64)):
        lengths = [rng.randint(1, max_tokens) for _ in range(30 * world)]
        placement = place_with_cp_per_sample(lengths, world=world, max_tokens_per_rank=max_tokens)
        _check_invariants(placement, lengths, world, max_tokens)
        by_block: dict[tuple, list[CPRow]] = {}
        for row in placement.rows:
            by_block.setdefault((row.group, row.ranks), []).append(row)
        for (group, ranks), rows in by_block.items():
            k = len(ranks)
            slots = {s: _round_up(lengths[s], 2 * k if k > 1 else 1) for row in rows for s in row.samples}
            assert sorted(row.samples for row in rows) == _first_fit_decreasing(slots, k * max_tokens)
            assert len(rows) >= math.ceil(sum(slots.values()) / (k * max_tokens))
            split += len(rows) > 1
    assert split > 0  # some block did need several rows


# --- upstream's misaligned blocks, moved to aligned ranks -----------------------------------------------------------

def test_a_block_the_scheduler_leaves_misaligned_is_moved_to_aligned_ranks():
    """Here Megatron-Core's scheduler puts sample 5 (cp_slots 288, CP 4; trimmed from an earlier group and re-queued
    last) on ranks (2, 3, 4, 5) of group 2, after sample 4 took (0, 1): not one of its hybrid groups (aligned
    blocks), so its schedule would run it with the wrong partners. The placement keeps the scheduler's choice (which
    samples run together, their CP sizes, the group) and moves the blocks to aligned ranks, largest first."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    lengths = [134, 310, 146, 332, 31, 278, 139, 126, 164]  # cp_slots (align 16): 144 320 160 336 32 288 144 128 176
    slots = [cp_slots(n, 8) for n in lengths]

    class Group:
        def size(self):
            return 8

    _, upstream = BalancedCPScheduler(100, Group()).get_groups_and_subsamples(list(enumerate(slots)), None)
    holders = {}
    for rank, samples in enumerate(upstream[2]):
        for sample in samples:
            holders.setdefault(sample, []).append(rank)
    assert holders[5] == [2, 3, 4, 5]  # the scheduler's misaligned block (this test's premise)
    placement = place_with_cp_per_sample(lengths, world=8, max_tokens_per_rank=100)
    _check_invariants(placement, lengths, 8, 100)
    # The scheduler's decisions are kept: per group, which samples and with how many ranks.
    for group, rank_samples in enumerate(upstream):
        expected = {}
        for samples in rank_samples:
            for sample in samples:
                expected[sample] = expected.get(sample, 0) + 1
        placed = {s: row.cp_size for row in placement.rows if row.group == group for s in row.samples}
        assert placed == expected
    (row,) = [row for row in placement.rows if 5 in row.samples]
    assert row.group == 2 and row.ranks == (0, 1, 2, 3)  # the largest block first, at offset 0
