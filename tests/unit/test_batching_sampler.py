"""``batching.sampler`` and ``batching.sizes`` over Megatron-Bridge 0.6.2's REAL per-rank samplers.

The reference in every case is ``megatron.bridge.data.samplers`` itself (``MegatronPretrainingSampler``,
``MegatronPretrainingRandomSampler`` with and without data sharding), one instance per DP rank as
Megatron-Bridge builds them: the global-batch sampler must train the same steps with the same
samples and change only where each sample goes. Sizes, costs and bounds are computed here by hand.
"""

from __future__ import annotations

import logging
import math
import random

import pytest
import torch
from torch.utils.data import DataLoader

from _datasets import ListDataset
from megatron.bridge_thd.cost.sample import SampleCost
from megatron.bridge_thd.batching.policy import assign
from megatron.bridge_thd.batching.sampler import GlobalBatchSampler, choose_row_length, rank_samplers
from megatron.bridge_thd.batching.sizes import dataset_sizes
from megatron.bridge_thd.upstream.loading import load_bridge_module

SAMPLERS = load_bridge_module("data.samplers")

DP, MBS, NMB = 4, 2, 3
GBS = DP * MBS * NMB  # 24
N = 110  # 13 rounds of DP * MBS = 8 samples: 4 whole steps of 24, then a step the samplers end inside
WHOLE_STEPS = 4
ALIGN = 8
SEQ_LENGTH = 128
ROW = MBS * SEQ_LENGTH  # thd: the most slots a micro-batch may take
KINDS = ["single", "cyclic-sharded", "cyclic-unsharded"]
COST = SampleCost(per_token=1.0, per_token_squared=1.0 / 512, per_patch=0.5, per_patch_squared=1e-3)


class TinyDataset:
    """A map-style dataset of indices carrying the size metadata global-batch packing reads."""

    def __init__(self, lengths, grids=None):
        self.sample_lengths = list(lengths)
        if grids is not None:
            self.sample_image_grids = [list(g) for g in grids]

    def __len__(self):
        return len(self.sample_lengths)

    def __getitem__(self, index):
        return index


def _tiny(n=N, seed=0):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 120) for _ in range(n)]
    grids = [[(1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 5)) for _ in range(rng.randint(0, 2))] for _ in range(n)]
    return TinyDataset(lengths, grids)


def _real(kind, dataset, rank, *, consumed=0, dp=DP, mbs=MBS):
    """The sampler Megatron-Bridge builds for DP rank ``rank`` (data/samplers.py)."""
    if kind == "single":
        return SAMPLERS.MegatronPretrainingSampler(total_samples=len(dataset), consumed_samples=consumed,
                                                   micro_batch_size=mbs, data_parallel_rank=rank,
                                                   data_parallel_size=dp, drop_last=True)
    return SAMPLERS.MegatronPretrainingRandomSampler(dataset, total_samples=len(dataset), consumed_samples=consumed,
                                                     micro_batch_size=mbs, data_parallel_rank=rank,
                                                     data_parallel_size=dp, data_sharding=kind == "cyclic-sharded")


def _steps(micro_batches, nmb=NMB):
    """A rank's micro-batches, grouped by step (whole steps only)."""
    return [micro_batches[k * nmb:(k + 1) * nmb] for k in range(len(micro_batches) // nmb)]


def _real_steps(kind, dataset, *, consumed=0):
    """Per rank, per step, the micro-batches Megatron-Bridge's own samplers give."""
    return [_steps(list(_real(kind, dataset, rank, consumed=consumed))) for rank in range(DP)]


def _ours(kind, dataset, *, consumed=0, row=ROW, static=False, cost=COST, seed=0, records=None):
    """Per rank: its GlobalBatchSampler (built, as in a run, from that rank's own real sampler). ``records``:
    a list per rank that collects the rank's StepPlacement records (its ``on_step``)."""
    sizes = dataset_sizes(dataset)
    return [GlobalBatchSampler(rank_samplers(_real(kind, dataset, rank, consumed=consumed), DP), dp_rank=rank,
                               num_micro_batches=NMB, row_length=row, sizes=sizes, static_row=static,
                               align_to=ALIGN, seed=seed, cost=cost, log=False,
                               on_step=None if records is None else records[rank].append) for rank in range(DP)]


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


def _patches(dataset, i):
    return sum(t * h * w for t, h, w in dataset.sample_image_grids[i])


def _squared(grids):
    """The ViT attention term: within each frame, ``t`` frames of ``h * w`` patches per grid."""
    return sum(t * (h * w) ** 2 for t, h, w in grids)


def _cost(dataset, i):
    s = dataset.sample_lengths[i]
    grids = dataset.sample_image_grids[i]
    return (COST.per_token * s + COST.per_token_squared * s * s + COST.per_patch * _patches(dataset, i)
            + COST.per_patch_squared * _squared(grids))


@pytest.mark.parametrize("kind", KINDS)
def test_same_steps_same_samples_only_placement_differs(kind):
    dataset = _tiny()
    real = _real_steps(kind, dataset)
    ours = [list(sampler) for sampler in _ours(kind, dataset)]
    for rank in range(DP):
        # Every rank: exactly NMB micro-batches per step, and only the steps the samplers complete.
        assert len(ours[rank]) == WHOLE_STEPS * NMB
        assert len(real[rank]) >= WHOLE_STEPS
    placed_differently = False
    for step in range(WHOLE_STEPS):
        ours_step = [micro for rank in range(DP) for micro in ours[rank][step * NMB:(step + 1) * NMB]]
        real_step = [micro for rank in range(DP) for micro in real[rank][step]]
        flat = [i for micro in ours_step for i in micro]
        assert len(flat) == len(set(flat)) == GBS, "every drawn sample exactly once in its step"
        assert sorted(flat) == sorted(i for micro in real_step for i in micro), f"step {step}: other samples"
        for micro in ours_step:
            assert micro and sum(_aligned(dataset.sample_lengths[i]) for i in micro) <= ROW
        placed_differently |= sorted(map(sorted, ours_step)) != sorted(map(sorted, real_step))
    assert placed_differently, "the lengths vary; some step should be placed otherwise than in-batch"


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_agree_without_talking(kind):
    """Every rank computes the whole placement; rank r yields rank r's part of it, so the per-rank
    samplers' histories are equal and their yields are disjoint."""
    dataset = _tiny(seed=3)
    records = [[] for _ in range(DP)]
    samplers = _ours(kind, dataset, records=records)
    yields = [list(s) for s in samplers]
    assert records[0] and all(r == records[0] for r in records[1:])
    for step in range(WHOLE_STEPS):
        per_rank = [{i for micro in yields[r][step * NMB:(step + 1) * NMB] for i in micro} for r in range(DP)]
        assert sum(len(p) for p in per_rank) == len(set().union(*per_rank)) == GBS


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("resume_at", [1, 3])
def test_resume_gives_the_remaining_steps(kind, resume_at):
    """Samplers built with consumed_samples = k * GBS (Megatron-Bridge's resume point) give steps
    k+1.. of a fresh run: the same samples and the same placement."""
    dataset = _tiny(seed=1)
    fresh = [list(s) for s in _ours(kind, dataset)]
    resumed = [list(s) for s in _ours(kind, dataset, consumed=resume_at * GBS)]
    for rank in range(DP):
        assert resumed[rank] == fresh[rank][resume_at * NMB:]
        assert len(resumed[rank]) == (WHOLE_STEPS - resume_at) * NMB


def test_a_data_loader_over_the_sampler_yields_its_micro_batches():
    dataset = _tiny(seed=2)
    sampler = _ours("cyclic-sharded", dataset)[1]
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=list)
    expected = list(_ours("cyclic-sharded", dataset)[1])
    assert [list(batch) for batch in loader] == expected


# --- the static row ---------------------------------------------------------------------------------


def _draws(kind, dataset, steps):
    """Per step, the indices the real samplers draw, from fresh instances."""
    real = _real_steps(kind, dataset)
    return [[i for rank in range(DP) for micro in real[rank][step] for i in micro] for step in range(steps)]


def _first(iterable, n):
    iterator = iter(iterable)
    return [next(iterator) for _ in range(n)]


def _lower_bound(dataset, draws):
    rows = DP * NMB
    bound = 0
    for drawn in draws:
        slots = [_aligned(dataset.sample_lengths[i]) for i in drawn]
        bound = max(bound, max(slots), math.ceil(sum(slots) / rows))
    return bound


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("steps", [1, 3, 99])
def test_choose_row_length_fits_every_drawn_step(kind, steps):
    dataset = _tiny(seed=4)
    sizes = dataset_sizes(dataset)
    row = choose_row_length(rank_samplers(_real(kind, dataset, 0), DP), num_micro_batches=NMB, sizes=sizes,
                            steps=steps, align_to=ALIGN, cost=COST)
    draws = _draws(kind, dataset, min(steps, WHOLE_STEPS))
    assert row % ALIGN == 0
    assert row >= _lower_bound(dataset, draws)
    for drawn in draws:
        lengths = [dataset.sample_lengths[i] for i in drawn]
        placement = assign(lengths, dp_size=DP, num_micro_batches=NMB, row_length=row, align_to=ALIGN, cost=COST,
                           vision_patches=[_patches(dataset, i) for i in drawn])
        for rank in placement:
            for micro in rank:
                assert sum(_aligned(lengths[i]) for i in micro) <= row
    # A run of those steps is then placed at that row (here, where steps covers the run: all of them).
    for sampler in _ours(kind, dataset, row=row, static=True):
        placed = _steps(list(sampler)) if steps >= WHOLE_STEPS else _steps(list(_first(sampler, steps * NMB)))
        assert len(placed) == min(steps, WHOLE_STEPS)
    # A row bound below it is refused, naming the setting.
    with pytest.raises(ValueError, match="row_length"):
        choose_row_length(rank_samplers(_real(kind, dataset, 0), DP), num_micro_batches=NMB, sizes=sizes,
                          steps=steps, align_to=ALIGN, upper=_lower_bound(dataset, draws) - 1, cost=COST)
    assert choose_row_length(rank_samplers(_real(kind, dataset, 0), DP), num_micro_batches=NMB, sizes=sizes,
                             steps=steps, align_to=ALIGN, upper=row, cost=COST) == row


def test_choose_row_length_is_the_bound_when_the_bound_fits():
    # Every sample 13 tokens (16 slots aligned to 8): each row takes MBS samples, 2 * 16 = 32 slots.
    dataset = TinyDataset([13] * 64)
    row = choose_row_length(rank_samplers(_real("single", dataset, 0), DP), num_micro_batches=NMB,
                            sizes=dataset_sizes(dataset), steps=2, align_to=ALIGN)
    assert row == MBS * 16


def test_choose_row_length_without_a_whole_step():
    dataset = _tiny(n=GBS - 1)
    with pytest.raises(ValueError, match="no complete step"):
        choose_row_length(rank_samplers(_real("single", dataset, 0), DP), num_micro_batches=NMB,
                          sizes=dataset_sizes(dataset), steps=4, align_to=ALIGN)


# --- history ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["single", "cyclic-sharded"])
@pytest.mark.parametrize("static", [False, True])
def test_history_measures_the_placement(kind, static):
    dataset = _tiny(seed=5)
    row = ROW if not static else _lower_bound(dataset, _draws(kind, dataset, WHOLE_STEPS)) + 8 * ALIGN
    records = [[] for _ in range(DP)]
    samplers = _ours(kind, dataset, row=row, static=static, records=records)
    yields = [list(s) for s in samplers]
    real = _real_steps(kind, dataset)
    history = records[0]
    assert [h.step for h in history] == list(range(1, WHOLE_STEPS + 1))

    def imbalance(values):
        return max(values) / (sum(values) / len(values))

    for step, record in enumerate(history):
        ours = [yields[r][step * NMB:(step + 1) * NMB] for r in range(DP)]
        samples = [i for rank in ours for micro in rank for i in micro]
        real_tokens = sum(dataset.sample_lengths[i] for i in samples)
        slots = DP * NMB * row if static else sum(_aligned(dataset.sample_lengths[i]) for i in samples)
        assert record.real_tokens == real_tokens
        assert record.slots == slots
        assert record.padding == pytest.approx(1 - real_tokens / slots)
        assert record.rank_imbalance == pytest.approx(
            imbalance([sum(_cost(dataset, i) for micro in rank for i in micro) for rank in ours]))
        assert record.micro_batch_imbalance == pytest.approx(
            imbalance([sum(_cost(dataset, i) for i in micro) for rank in ours for micro in rank]))
        assert record.in_batch_rank_imbalance == pytest.approx(
            imbalance([sum(_cost(dataset, i) for micro in real[r][step] for i in micro) for r in range(DP)]))
        assert record.rank_imbalance <= record.in_batch_rank_imbalance


def test_history_is_logged_on_rank_zero(caplog):
    dataset = _tiny(seed=6)
    sizes = dataset_sizes(dataset)
    records = []
    sampler = GlobalBatchSampler(rank_samplers(_real("single", dataset, 0), DP), dp_rank=0, num_micro_batches=NMB,
                                 row_length=ROW, sizes=sizes, static_row=False, align_to=ALIGN, log=True,
                                 on_step=records.append)
    with caplog.at_level(logging.INFO, logger="megatron.bridge_thd.batching.sampler"):
        list(sampler)
    lines = [r.getMessage() for r in caplog.records if "global-batch packing" in r.getMessage()]
    assert len(lines) == WHOLE_STEPS
    assert f"real tokens {records[0].real_tokens} " in lines[0]


# --- sizes ---------------------------------------------------------------------------------------------


def test_sizes_from_metadata():
    grids = [[(1, 2, 4)], [], [(2, 2, 2), (1, 4, 4)]]
    sizes = dataset_sizes(TinyDataset([10, 3, 40], grids))
    assert sizes.lengths.tolist() == [10, 3, 40]
    assert sizes.patches.tolist() == [8, 0, 8 + 16]
    # (2, 2, 2) is 2 frames of 4 patches: 2 * 4^2, not 8^2.
    assert sizes.patches_squared.tolist() == [64.0, 0.0, 2 * 16.0 + 256.0]
    assert "metadata" in sizes.source and len(sizes) == 3
    text_only = dataset_sizes(TinyDataset([5, 6]))
    assert text_only.patches.tolist() == [0, 0] and text_only.patches_squared.tolist() == [0.0, 0.0]
    # Megatron-Bridge's RandomSeedDataset (the cyclic sampler's wrapper) is looked through.
    wrapped = dataset_sizes(SAMPLERS.RandomSeedDataset(TinyDataset([10, 3, 40], grids), seed=7))
    assert wrapped.lengths.tolist() == [10, 3, 40] and wrapped.patches.tolist() == [8, 0, 24]


def test_global_batch_packing_costs_a_video_below_one_image_of_its_patches():
    """The costs global-batch packing balances (``sample_costs`` on the dataset's sizes, as the sampler computes
    them): a video of 4 frames of 8 x 8 patches against an image of 16 x 16, the same 256 patches and 80 tokens; the
    video's vision attention is 4 * 64^2, the image's 256^2."""
    from megatron.bridge_thd.cost.sample import sample_cost
    from megatron.bridge_thd.batching.policy import sample_costs

    sizes = dataset_sizes(TinyDataset([80, 80], [[(4, 8, 8)], [(1, 16, 16)]]))
    cost = sample_cost("qwen3-vl-8b")
    video, image = sample_costs(*sizes.take(torch.arange(2)), cost=cost).tolist()
    assert video < image
    assert image - video == pytest.approx(cost.per_patch_squared * (256**2 - 4 * 64**2), rel=1e-9)


class Sized(TinyDataset):
    """Metadata for some samples of a dataset of ``size`` samples."""

    def __init__(self, size, lengths, grids=None):
        super().__init__(lengths, grids)
        self.size = size

    def __len__(self):
        return self.size


def test_metadata_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="sample_lengths"):
        dataset_sizes(Sized(3, [1, 2]))
    with pytest.raises(ValueError, match="sample_lengths"):
        dataset_sizes(Sized(3, [1, 2, 3, 4]))
    with pytest.raises(ValueError, match="sample_image_grids"):
        dataset_sizes(Sized(3, [1, 2, 3], [[], []]))
    with pytest.raises(ValueError, match="collate_fn"):
        dataset_sizes([1, 2, 3])  # no metadata, nothing to scan with


ITEMS = [
    dict(real=30, pad=2, images=[(1, 4, 4)]),
    dict(real=7, pad=0, images=[]),
    dict(real=200, pad=8, images=[(1, 6, 8), (1, 2, 2)]),  # longer than SCAN_SEQ: capped
    dict(real=64, pad=0, images=[], videos=[(2, 4, 4)]),
    dict(real=12, pad=20, images=[(1, 2, 6)]),
    dict(real=99, pad=1, images=[(1, 8, 8)]),
]
SCAN_SEQ = 128


class CountingCollate:
    """A collate like Megatron-Bridge's VLM collates: a 2D attention_mask (1 = real token) and the
    images' grids in ``visual_inputs`` (a plain dict or Megatron-Bridge's GenericVisualInputs)."""

    def __init__(self, mask=True):
        self.calls, self.mask = 0, mask

    def __call__(self, batch):
        (item,) = batch
        self.calls += 1
        width = item["real"] + item["pad"]
        out = {"input_ids": torch.arange(width).unsqueeze(0)}
        if self.mask:
            out["attention_mask"] = (torch.arange(width) < item["real"]).to(torch.int64).unsqueeze(0)
        visual = {}
        if item["images"]:
            visual["image_grid_thw"] = torch.tensor(item["images"])
        if item.get("videos"):
            visual["video_grid_thw"] = torch.tensor(item["videos"])
        if visual and len(item["images"]) == 2:  # the real container, Qwen-batched [B, N, 3] grids
            visual_inputs = load_bridge_module("training.utils.visual_inputs")
            visual = visual_inputs.GenericVisualInputs(image_grid_thw=visual["image_grid_thw"].unsqueeze(0))
        out["visual_inputs"] = visual or None
        return out


def _expected_scan(items, seq_length):
    lengths = [min(item["real"], seq_length) for item in items]
    grids = [item["images"] + item.get("videos", []) for item in items]
    return lengths, [sum(t * h * w for t, h, w in g) for g in grids], [float(_squared(g)) for g in grids]


def test_sizes_by_scan_are_cached(tmp_path):
    dataset, collate = ListDataset(ITEMS), CountingCollate()
    cache = tmp_path / "sizes"
    first = dataset_sizes(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)
    lengths, patches, squared = _expected_scan(ITEMS, SCAN_SEQ)
    assert first.lengths.tolist() == lengths
    assert first.patches.tolist() == patches
    assert first.patches_squared.tolist() == squared
    assert first.source.startswith(f"scan of {len(ITEMS)} distinct samples")
    # The collate (a tokenizer, in a real run) ran in worker processes only, never in this one.
    assert collate.calls == 0
    assert len(list(cache.glob("*.pt"))) == 1

    second = dataset_sizes(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)
    assert second.source.startswith("cache"), "the scan ran again"
    assert (second.lengths.tolist(), second.patches.tolist(), second.patches_squared.tolist()) == (
        lengths, patches, squared)

    # Another seq_length is another scan (its lengths are capped differently).
    other = dataset_sizes(dataset, collate, seq_length=None, cache_dir=cache)
    assert other.source.startswith("scan")
    assert other.lengths.tolist() == [item["real"] for item in ITEMS]
    assert len(list(cache.glob("*.pt"))) == 2


def test_a_cache_of_the_earlier_format_is_not_read_as_the_per_frame_term(tmp_path):
    """A cache written before the vision term was per frame (format 1: ``<key>.pt``, no ``format`` entry, its
    ``patches_squared`` ``sum (t * h * w)**2``) is not used: the dataset is scanned again into a file of the
    current format, and the old file, read directly, is refused naming its format."""
    from megatron.bridge_thd.batching import sizes as sizes_module

    dataset, collate = ListDataset(ITEMS), CountingCollate()
    cache = tmp_path / "sizes"
    cache.mkdir()
    key = sizes_module._fingerprint(dataset, collate, SCAN_SEQ)
    lengths, patches, squared = _expected_scan(ITEMS, SCAN_SEQ)
    per_grid = [float(sum((t * h * w) ** 2 for t, h, w in item["images"] + item.get("videos", []))) for item in ITEMS]
    assert per_grid != squared, "ITEMS must hold a video, or the two terms agree"
    old = cache / f"{key}.pt"  # what the earlier version wrote, under the name it gave it
    torch.save({"lengths": torch.tensor(lengths), "patches": torch.tensor(patches),
                "patches_squared": torch.tensor(per_grid, dtype=torch.float64), "total": None}, old)

    sizes = dataset_sizes(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)
    assert sizes.source.startswith("scan"), "the earlier format's file was read"
    assert sizes.patches_squared.tolist() == squared
    path = sizes_module.sizes_cache_path(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)
    assert path != old and path.name == key + sizes_module.SIZES_CACHE_SUFFIX and path.is_file()
    assert torch.load(path)["format"] == sizes_module.SIZES_CACHE_FORMAT
    again = dataset_sizes(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)
    assert again.source.startswith("cache") and again.patches_squared.tolist() == squared

    # The old file under the current name (copied by hand, say) is refused, not read.
    old.replace(path)
    with pytest.raises(ValueError, match=f"format 1, this version reads format {sizes_module.SIZES_CACHE_FORMAT}"):
        dataset_sizes(dataset, collate, seq_length=SCAN_SEQ, cache_dir=cache)


def test_sizes_cache_defaults_to_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dataset_sizes(ListDataset(ITEMS), CountingCollate(), seq_length=SCAN_SEQ)
    assert len(list((tmp_path / "bridge_thd" / "sizes").glob("*.pt"))) == 1


@pytest.mark.slow  # loader workers started for the scan
def test_scan_needs_a_2d_attention_mask(tmp_path):
    with pytest.raises(ValueError, match="attention_mask"):
        dataset_sizes(ListDataset(ITEMS), CountingCollate(mask=False), cache_dir=tmp_path)

    def one_d(batch):
        out = CountingCollate()(batch)
        out["attention_mask"] = out["attention_mask"][0]
        return out

    with pytest.raises(ValueError, match="attention_mask"):
        dataset_sizes(ListDataset(ITEMS), one_d, cache_dir=tmp_path)
    assert not list(tmp_path.glob("*.pt")), "nothing cached from a failed scan"


# --- rows of several lengths (row_buckets) ---------------------------------------------------------------


def _padding_of(rows, slots, weights=None):
    weights = weights or [1] * len(slots)
    return sum(w * (min(n for n in rows if n >= s) - s) for s, w in zip(slots, weights))


@pytest.mark.parametrize("seed", range(6))
def test_optimal_row_lengths_equal_an_exhaustive_search(seed):
    import itertools

    from megatron.bridge_thd.batching.sampler import optimal_row_lengths

    rng = random.Random(seed)
    largest = rng.choice([24, 32, 40]) * ALIGN
    slots = [rng.randint(1, largest // ALIGN) * ALIGN for _ in range(rng.randint(3, 14))]
    weights = [rng.choice([1, 2, 5]) for _ in slots]
    for count in (1, 2, 3, 4):
        rows = optimal_row_lengths(torch.tensor(slots), torch.tensor(weights, dtype=torch.float64), count=count,
                                   largest=largest, align_to=ALIGN)
        assert rows[-1] == largest and len(rows) <= count and list(rows) == sorted(set(rows))
        # Every row between two aligned slot counts, over all choices of count - 1 shorter rows.
        best = min(_padding_of(tuple(c) + (largest,), slots, weights) for k in range(count)
                   for c in itertools.combinations(range(ALIGN, largest, ALIGN), k))
        assert _padding_of(rows, slots, weights) == best


def test_optimal_row_lengths_on_a_coarse_grid_lose_at_most_a_grain_per_micro_batch():
    from megatron.bridge_thd.batching.sampler import optimal_row_lengths

    rng = random.Random(7)
    largest = 16384
    slots = [rng.randint(1, largest // ALIGN) * ALIGN for _ in range(3000)]  # more distinct counts than the grid
    exact = optimal_row_lengths(torch.tensor(slots), count=4, largest=largest, align_to=ALIGN, grid=10**6)
    coarse = optimal_row_lengths(torch.tensor(slots), count=4, largest=largest, align_to=ALIGN, grid=256)
    grain = -(-largest // 256)
    assert all(n % ALIGN == 0 for n in coarse) and coarse[-1] == largest
    assert _padding_of(exact, slots) <= _padding_of(coarse, slots) <= _padding_of(exact, slots) + grain * len(slots)


def test_optimal_row_lengths_refuse_what_cannot_be_placed():
    from megatron.bridge_thd.batching.sampler import optimal_row_lengths

    with pytest.raises(ValueError, match="count: expected an int >= 1"):
        optimal_row_lengths(torch.tensor([8]), count=0, largest=64)
    with pytest.raises(ValueError, match="a micro-batch of 72 slots does not fit the largest row"):
        optimal_row_lengths(torch.tensor([8, 72]), count=2, largest=64)
    assert optimal_row_lengths(torch.tensor([16, 16, 64]), count=4, largest=64) == (16, 64)  # fewer when fewer differ


def test_micro_batch_slots_are_the_placements_micro_batches_weighted_by_repeats():
    from megatron.bridge_thd.batching.sampler import micro_batch_slots, run_draws

    dataset = _tiny(seed=8)
    sizes = dataset_sizes(dataset)
    draws = run_draws(rank_samplers(_real("single", dataset, 0), DP), NMB, WHOLE_STEPS)
    repeated = torch.cat([draws, draws[:1]])  # the first step again: weighs twice
    slots, weights = micro_batch_slots(repeated, sizes=sizes, dp_size=DP, num_micro_batches=NMB, row_length=ROW,
                                       align_to=ALIGN, cost=COST)
    expected, expected_weights = [], []
    for step, drawn in enumerate(draws.tolist()):
        lengths = [dataset.sample_lengths[i] for i in drawn]
        placement = assign(lengths, dp_size=DP, num_micro_batches=NMB, row_length=ROW, align_to=ALIGN, cost=COST,
                           vision_patches=[_patches(dataset, i) for i in drawn],
                           vision_patches_squared=[_squared(dataset.sample_image_grids[i]) for i in drawn])
        expected += [sum(_aligned(lengths[i]) for i in micro) for rank in placement for micro in rank]
        expected_weights += [2.0 if step == 0 else 1.0] * (DP * NMB)
    assert slots.tolist() == expected and weights.tolist() == expected_weights
    sampled, sampled_weights = micro_batch_slots(repeated, sizes=sizes, dp_size=DP, num_micro_batches=NMB,
                                                 row_length=ROW, align_to=ALIGN, cost=COST, most_steps=2)
    assert len(sampled) == 2 * DP * NMB and float(sampled_weights.sum()) == pytest.approx(len(repeated) * DP * NMB)
