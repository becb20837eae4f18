"""Global-batch packing's loaders as Megatron-Bridge's loop drives them.

The reference is Megatron-Bridge itself: its ``build_pretraining_data_loader`` (``data/samplers.py``)
builds each rank's loader, and its loop iterates a ``single`` loader once and a ``cyclic`` one through
``loaders.cyclic_iter`` (``data/loaders.py``, ``build_train_valid_test_data_iterators``), taking
``num_micro_batches`` micro-batches per step. Datasets whose length is not a multiple of the global
batch make steps run across epochs; resumes start the samplers at ``consumed_samples``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from megatron.bridge_thd.batching.bridge import check_ranks_agree, plan_loader, run_row_length
from megatron.bridge_thd.batching.bridge import global_batch_loader, run_row_buckets, run_static_rows
from megatron.bridge_thd.batching.policy import DoesNotFit, assign
from megatron.bridge_thd.batching.sampler import GlobalBatchSampler, first_unfit_step, row_length_for_steps
from megatron.bridge_thd.batching.sizes import SampleSizes, dataset_sizes
from megatron.bridge_thd.rules.setup import ModelFacts, Setup, read_setup
from megatron.bridge_thd.settings import GlobalBatchPacking
from megatron.bridge_thd.upstream.loading import load_bridge_module

SAMPLERS = load_bridge_module("data.samplers")
DP, MBS, NMB = 2, 2, 3
GBS = DP * MBS * NMB  # 12
ALIGN = 8


class Lengths:
    """A map-style dataset of indices carrying ``sample_lengths`` metadata."""

    def __init__(self, lengths):
        self.sample_lengths = list(lengths)

    def __len__(self):
        return len(self.sample_lengths)

    def __getitem__(self, index):
        return index


def _lengths(n, seed=0, high=120):
    rng = random.Random(seed)
    return [rng.randint(1, high) for _ in range(n)]


def _identity(batch):
    return batch


def _loader(kind, dataset, rank, consumed=0, dp=DP, mbs=MBS, num_workers=0):
    """Megatron-Bridge's own loader for DP rank ``rank`` (``build_pretraining_data_loader``)."""
    return SAMPLERS.build_pretraining_data_loader(dataset, consumed, kind, mbs, num_workers, True,
                                                  collate_fn=_identity, pin_memory=False, data_parallel_rank=rank,
                                                  data_parallel_size=dp)


def _as_loop(kind, loader):
    """The iterator Megatron-Bridge's loop makes of a loader (``build_train_valid_test_data_iterators``:
    ``iter(loader)`` for ``single``, ``iter(cyclic_iter(loader))`` for ``cyclic``)."""
    return iter(_cyclic_iter(loader)) if kind == "cyclic" else iter(loader)


def _cyclic_iter(iterable):
    """``megatron.bridge.data.loaders.cyclic_iter`` (the module imports the training config, so its
    three lines are mirrored here): re-iterate the loader forever."""
    while True:
        for x in iterable:
            yield x


def _loop_steps(iterators, steps, nmb=NMB):
    """Per step, the set of samples the ranks' iterators give it (``nmb`` micro-batches each)."""
    out = []
    for _ in range(steps):
        drawn = []
        try:
            for iterator in iterators:
                for _ in range(nmb):
                    drawn += list(next(iterator))
        except StopIteration:
            break
        out.append(sorted(int(i) for i in drawn))
    return out


def _setup(layout="thd_static", seq_length=128):
    """The run's facts the loader wrapper reads once (``rules.read_setup``): the layout and seq_length."""
    return Setup(layout=layout, model=ModelFacts(seq_length=seq_length), seq_lengths=(seq_length, seq_length))


def _ours(kind, dataset, *, consumed=0, steps=30, row_length=None, layout="thd_static"):
    """Per rank, global-batch packing's loader as the loader builder wrapper makes it (no process group:
    every rank's side computed here), and the run's row."""
    settings = GlobalBatchPacking(row_length=row_length, log=False)
    setup = _setup(layout)
    plans = [plan_loader(_loader(kind, dataset, rank, consumed), label="train", setup=setup, settings=settings,
                         dp_rank=rank, dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=steps)
             for rank in range(DP)]
    row = run_row_length(plans[:1], settings=settings, align=ALIGN, capacity=MBS * 128, cost=None,
                         static=layout == "thd_static")
    return [global_batch_loader(plan, settings=settings, row_length=row, static=layout == "thd_static", align=ALIGN,
                                cost=None, global_batch_size=GBS) for plan in plans], row, plans


@pytest.mark.parametrize("kind", ["single", "cyclic"])
@pytest.mark.parametrize("n", [30, 36, 53])
def test_each_step_holds_the_samples_megatron_bridges_loop_draws(kind, n):
    """Any dataset length (30 and 53 are no multiple of the global batch 12), across epochs (the cyclic
    sampler's epoch of 28 samples ends inside step 3): the same samples per step as Megatron-Bridge's
    own loaders driven as its loop drives them; placed within the row."""
    dataset = Lengths(_lengths(n))
    steps = 12
    theirs = _loop_steps([_as_loop(kind, _loader(kind, dataset, rank)) for rank in range(DP)], steps)
    loaders, row, _ = _ours(kind, dataset, steps=steps)
    ours = _loop_steps([_as_loop(kind, loader) for loader in loaders], steps)
    assert ours == theirs
    assert len(theirs) == (steps if kind == "cyclic" else n // GBS)
    if kind == "cyclic":
        # 12 steps of 12 from epochs of 28 or 36 or 52: every sample drawn, none twice within an epoch's draw.
        counts = torch.bincount(torch.tensor([i for step in ours for i in step]), minlength=n)
        assert int((counts > 0).sum()) >= n - (n % (DP * MBS))


@pytest.mark.parametrize("kind", ["single", "cyclic"])
def test_a_resume_continues_the_same_steps_with_the_same_row_and_placements(kind):
    """Resumed at step 4 (consumed 36 samples, past the cyclic sampler's first epoch of 28): the row is
    the uninterrupted run's (chosen from the whole run's draws, not the remaining ones) and every later
    micro-batch of every rank is the same, placement included."""
    dataset = Lengths(_lengths(90 if kind == "single" else 30, seed=3))
    steps, resume = 7, 3
    whole, row, _ = _ours(kind, dataset, steps=steps)
    resumed, resumed_row, _ = _ours(kind, dataset, consumed=resume * GBS, steps=steps)
    assert resumed_row == row
    for rank in range(DP):
        uninterrupted = [next(it) for it in [_as_loop(kind, whole[rank])] for _ in range(steps * NMB)]
        iterator = _as_loop(kind, resumed[rank])
        after = [next(iterator) for _ in range((steps - resume) * NMB)]
        assert after == uninterrupted[resume * NMB:]


def test_the_resumed_row_is_not_the_row_of_the_remaining_steps():
    """What the resume keeps matters: a long sample in step 1 sets the run's row; the steps left after
    a resume at step 3 alone would choose a shorter one (other shapes, other placements)."""
    lengths = _lengths(90, seed=3, high=60)
    lengths[0] = 250
    dataset = Lengths(lengths)
    _, row, _ = _ours("single", dataset, steps=7)
    _, resumed_row, plans = _ours("single", dataset, consumed=3 * GBS, steps=7)
    assert resumed_row == row >= 256 - ALIGN
    assert row_length_for_steps(plans[0].draws[3:], sizes=plans[0].sizes, dp_size=DP, num_micro_batches=NMB,
                                align_to=ALIGN, upper=MBS * 128) < row


def test_the_row_fits_every_step_of_the_whole_run_across_epochs():
    """A cyclic run of 40 steps over 53 samples (a dozen epochs): the chosen row places every one of
    its steps (checked here with ``assign`` itself), and a step the first epoch does not contain is
    what set it."""
    dataset = Lengths(_lengths(53, seed=5))
    steps = 40
    _, row, plans = _ours("cyclic", dataset, steps=steps)
    draws = plans[0].draws
    assert draws.shape == (steps, GBS)
    sizes = plans[0].sizes
    for step in draws:
        assign(sizes.take(step)[0], dp_size=DP, num_micro_batches=NMB, row_length=row, align_to=ALIGN)
    first_epoch = draws[:53 // GBS]
    assert row_length_for_steps(first_epoch, sizes=sizes, dp_size=DP, num_micro_batches=NMB, align_to=ALIGN) < row


def test_evaluation_loaders_are_checked_against_the_row_when_built():
    """A validation set of longer samples: the chosen row covers its steps (one row for the run), and
    a fixed row that does not is refused at build, naming the loader and the setting."""
    settings = GlobalBatchPacking(log=False)
    setup = _setup()
    train = Lengths(_lengths(60, seed=1, high=60))
    valid = Lengths(_lengths(48, seed=2, high=128))
    plans = [plan_loader(_loader("single", dataset, 0), label=label, setup=setup, settings=settings, dp_rank=0,
                         dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=4)
             for label, dataset in (("train", train), ("valid", valid))]
    train_alone = run_row_length(plans[:1], settings=settings, align=ALIGN, capacity=MBS * 128, cost=None, static=True)
    row = run_row_length(plans, settings=settings, align=ALIGN, capacity=MBS * 128, cost=None, static=True)
    assert row > train_alone
    for plan in plans:
        assert first_unfit_step(plan.draws, sizes=plan.sizes, dp_size=DP, num_micro_batches=NMB, row_length=row,
                                align_to=ALIGN) is None
    fixed = GlobalBatchPacking(row_length=train_alone, log=False)
    with pytest.raises(ValueError, match=r"of the valid loader .*; raise global_batch_packing\.row_length"):
        run_row_length(plans, settings=fixed, align=ALIGN, capacity=MBS * 128, cost=None, static=True)


def test_a_step_past_the_run_that_does_not_fit_is_not_an_error():
    """A loader's prefetch asks for steps past the run's end; one that does not fit the row gets
    Megatron-Bridge's own placement (with a warning) instead of stopping the run. A step of the run
    that does not fit is a DoesNotFit naming the loader, the step and the dataset index."""
    dataset = Lengths([8] * 24 + [120] * 12)
    loaders, row, plans = _ours("single", dataset, steps=2)
    assert row < 120 * MBS  # the third step's long samples do not fit the first two steps' row
    micro_batches = list(loaders[0])
    assert len(micro_batches) == 3 * NMB
    theirs = _loop_steps([_as_loop("single", _loader("single", dataset, rank)) for rank in range(DP)], 3)
    assert micro_batches[2 * NMB:] == [list(range(24 + j * DP * MBS, 24 + j * DP * MBS + MBS)) for j in range(NMB)]
    assert sorted(i for mb in micro_batches[2 * NMB:] for i in mb) == [i for i in theirs[2] if (i - 24) % 4 < 2]
    planned = GlobalBatchSampler([SAMPLERS.MegatronPretrainingSampler(36, 0, MBS, r, DP) for r in range(DP)], dp_rank=0,
                                 num_micro_batches=NMB, row_length=row, sizes=plans[0].sizes, static_row=True,
                                 align_to=ALIGN, log=False, planned_steps=3)
    with pytest.raises(DoesNotFit, match=r"train loader, step 3: .*\(dataset index\).*row_length"):
        list(planned)


def test_ranks_that_disagree_on_a_sample_are_refused_by_name():
    from megatron.bridge_thd_testbed.launcher import run_on_gloo

    results = run_on_gloo(_disagreeing_rank, dp=2, timeout=120)
    for message in results:
        assert "dataset sample 3: rank 0 has 40 tokens" in message and "rank 1 41" in message
        assert "sizes_cache" in message


def _disagreeing_rank():
    rank = torch.distributed.get_rank()
    lengths = torch.tensor([10, 20, 30, 40 + rank, 50])
    sizes = SampleSizes(lengths, torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.float64))
    check_ranks_agree(SampleSizes(torch.tensor([1, 2]), torch.zeros(2, dtype=torch.int64),
                                  torch.zeros(2, dtype=torch.float64)), label="train")  # agreeing: passes
    try:
        check_ranks_agree(sizes, label="train")
    except ValueError as error:
        return str(error)
    return "not refused"


def test_a_repeating_dataset_is_scanned_once_per_base_example(tmp_path):
    """Megatron-Bridge's DirectSFTDataset repeats its base examples to the trainer's length: 10,000
    indices over 7 examples are 7 collates, and index i has example i % 7's sizes."""
    direct_sft = load_bridge_module("data.datasets.direct_sft")
    examples = [{"n": n} for n in (5, 9, 3, 12, 7, 4, 11)]
    dataset = direct_sft.DirectSFTDataset(examples, 10_000, processor=None, collate_impl=_mask_collate)
    sizes = dataset_sizes(dataset, dataset.collate_fn, cache_dir=tmp_path)
    assert sizes.source.startswith("scan of 7 distinct samples") and len(sizes) == 10_000
    index = torch.tensor([0, 6, 7, 9_999])
    assert sizes.take(index)[0].tolist() == [5, 11, 5, examples[9_999 % 7]["n"]]
    again = dataset_sizes(dataset, dataset.collate_fn, cache_dir=tmp_path)
    assert again.source.startswith("cache") and len(again) == 10_000


def _mask_collate(batch, processor, **kwargs):
    (example,) = batch
    return {"attention_mask": torch.ones(1, example["n"], dtype=torch.int64)}


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_the_scan_runs_in_worker_processes(tmp_path, start_method):
    """Under either start method the collate (a tokenizer, in a real run) never runs in the calling
    process: a tokenizer used here before the loader forks its workers can deadlock them."""
    import os

    pids = tmp_path / "pids"
    sizes = dataset_sizes(_Indices(6), _PidCollate(str(pids)), cache_dir=tmp_path / "cache", num_workers=2,
                          context=start_method)
    assert sizes.lengths.tolist() == [3, 4, 5, 6, 7, 8]
    ran_in = {int(name) for name in os.listdir(pids)}
    assert ran_in and os.getpid() not in ran_in


class _Indices:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return index


class _PidCollate:
    """A collate that records the process it runs in (one file per process id under ``folder``)."""

    def __init__(self, folder):
        self.folder = folder

    def __call__(self, batch):
        import os

        (index,) = batch
        os.makedirs(self.folder, exist_ok=True)
        open(os.path.join(self.folder, str(os.getpid())), "w").close()
        return {"attention_mask": torch.ones(1, index + 3, dtype=torch.int64)}


# --- several static rows (row_buckets) ------------------------------------------------------------------


def _loop_micro_batches(loaders, steps):
    """Per rank, every micro-batch the loaders yield for ``steps`` steps, as Megatron-Bridge's loop takes them."""
    iterators = [iter(loader) for loader in loaders]
    return [[list(next(iterator)) for _ in range(steps * NMB)] for iterator in iterators]


@pytest.mark.parametrize("kind", ["single", "cyclic"])
def test_row_buckets_are_chosen_once_from_the_run_and_every_micro_batch_takes_the_shortest_that_holds_it(kind):
    """Four rows for a run of training and validation: chosen the same from fresh loaders (every rank and a
    resume choose alike), the longest the run's one row, each a multiple of the alignment; every micro-batch the
    loaders yield fits the longest, and no other choice of up to four rows (tried exhaustively over the
    micro-batches' own slot counts) gives those micro-batches fewer slots; each row's segments cover the samples
    of every micro-batch that takes it."""
    train, valid = Lengths(_lengths(60, seed=11)), Lengths(_lengths(36, seed=12, high=90))
    settings = GlobalBatchPacking(log=False)
    setup = _setup()

    def build(rank):
        return [plan_loader(_loader(kind, dataset, rank), label=label, setup=setup, settings=settings, dp_rank=rank,
                            dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=steps)
                for label, dataset, steps in (("train", train, 5), ("valid", valid, 3))]

    plans = build(0)
    row = run_row_length(plans, settings=settings, align=ALIGN, capacity=MBS * 128, cost=None, static=True)
    rows = run_row_buckets(plans, settings=settings, count=4, row_length=row, align=ALIGN, cost=None)
    assert rows == run_row_buckets(build(1), settings=settings, count=4, row_length=row, align=ALIGN, cost=None)
    assert run_row_buckets(plans, settings=settings, count=1, row_length=row, align=ALIGN, cost=None) == (row,)
    assert 1 < len(rows) <= 4 and rows[-1] == row and list(rows) == sorted(set(rows))
    assert all(length % ALIGN == 0 for length in rows)
    static_rows = run_static_rows(plans, row_lengths=rows, align=ALIGN, seq_length=128)
    assert [r.length for r in static_rows] == list(rows)

    slots = []
    for plan, steps in zip(plans, (5, 3)):
        loaders = [global_batch_loader(p, settings=settings, row_length=row, static=True, align=ALIGN, cost=None,
                                       global_batch_size=GBS, row_lengths=rows)
                   for p in [plan_loader(_loader(kind, plan.loader.dataset, r), label=plan.label, setup=setup,
                                         settings=settings, dp_rank=r, dp_size=DP, global_batch_size=GBS,
                                         micro_batch_size=MBS, steps=steps) for r in range(DP)]]
        for rank_batches in _loop_micro_batches(loaders, steps):
            for micro_batch in rank_batches:
                taken = sum(-(-plan.loader.dataset.sample_lengths[i] // ALIGN) * ALIGN for i in micro_batch)
                assert taken <= row
                shortest = next(r for r in static_rows if r.length >= taken)
                assert len(micro_batch) <= shortest.max_samples
                slots.append(taken)

    def total(choice):
        return sum(min(n for n in choice if n >= taken) for taken in slots)

    import itertools

    candidates = sorted(set(slots) - {row})
    best = min(total(tuple(c) + (row,)) for k in range(4) for c in itertools.combinations(candidates, k))
    assert total(rows) == best


def test_the_sampler_logs_the_slots_of_the_rows_its_micro_batches_take(caplog):
    import logging

    dataset = Lengths(_lengths(48, seed=13))
    settings = GlobalBatchPacking(log=True)
    plans = [plan_loader(_loader("single", dataset, rank), label="train", setup=_setup(), settings=settings, dp_rank=rank,
                         dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=4) for rank in range(DP)]
    row = run_row_length(plans[:1], settings=settings, align=ALIGN, capacity=MBS * 128, cost=None, static=True)
    rows = run_row_buckets(plans[:1], settings=settings, count=3, row_length=row, align=ALIGN, cost=None)
    loaders = [global_batch_loader(plan, settings=settings, row_length=row, static=True, align=ALIGN, cost=None,
                                   global_batch_size=GBS, row_lengths=rows) for plan in plans]
    with caplog.at_level(logging.INFO, logger="megatron.bridge_thd.batching.sampler"):
        per_rank = _loop_micro_batches(loaders, 4)
    lines = [r.getMessage() for r in caplog.records if "global-batch packing (train): step" in r.getMessage()]
    for step in range(4):
        taken = [sum(-(-dataset.sample_lengths[i] // ALIGN) * ALIGN for i in micro_batch)
                 for rank in per_rank for micro_batch in rank[step * NMB:(step + 1) * NMB]]
        real = sum(dataset.sample_lengths[i] for rank in per_rank for mb in rank[step * NMB:(step + 1) * NMB]
                   for i in mb)
        slots = sum(min(n for n in rows if n >= t) for t in taken)
        assert f"step {step + 1}: real tokens {real} in {slots} slots" in lines[step]


# --- sizes from a bridge-thd scan lengths file ----------------------------------------------------------------


def test_a_lengths_file_gives_the_training_sets_sizes_and_one_of_another_dataset_is_refused(tmp_path):
    import json

    # A dataset without size metadata (_Indices: its sizes would otherwise need a scan). Twelve samples: text tokens, one image of 1 x 4 x 6 patches (6 tokens at merge 2) on every third, and
    # supervised tokens; two of them longer than seq_length 128 before the cut.
    text = [30, 50, 140, 20, 70, 90, 10, 200, 40, 60, 80, 35]
    rows = [dict(text_tokens=t, images=[[1, 4, 6]] if i % 3 == 0 else [], supervised_tokens=t // 2)
            for i, t in enumerate(text)]
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps(rows))
    tokens = [t + (6 if i % 3 == 0 else 0) for i, t in enumerate(text)]
    settings = GlobalBatchPacking(lengths_file=str(path), log=False)
    plan = plan_loader(_loader("single", _Indices(12), 0), label="train", setup=_setup(), settings=settings, dp_rank=0,
                       dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=1)
    assert plan.sizes.untruncated.tolist() == tokens
    assert plan.sizes.lengths.tolist() == [min(n, 128) for n in tokens]
    assert plan.sizes.supervised.tolist() == [t // 2 for t in text]
    assert plan.sizes.patches.tolist() == [24 if i % 3 == 0 else 0 for i in range(12)]
    assert plan.sizes.over(128).tolist() == [2, 7]
    with pytest.raises(ValueError, match=r"lengths_file: .* holds 12 samples, but the dataset has 13 distinct samples"):
        plan_loader(_loader("single", _Indices(13), 0), label="train", setup=_setup(), settings=settings, dp_rank=0,
                    dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=1)
    # The vision tower's merge comes from the run's facts (rules.read_setup: the provider's vision_config here): at
    # merge 1 an image of 1 x 4 x 6 patches is 24 tokens.
    cfg = SimpleNamespace(dataset=SimpleNamespace(seq_length=128), train=SimpleNamespace(micro_batch_size=MBS),
                          model=SimpleNamespace(seq_length=128, vision_config=SimpleNamespace(spatial_merge_size=1),
                                                image_token_id=7, video_token_id=None))
    setup = read_setup(cfg, "thd_static")
    assert (setup.model.spatial_merge_size, setup.model.vision_token_ids) == (1, (7,))
    plan = plan_loader(_loader("single", _Indices(12), 0), label="train", setup=setup, settings=settings, dp_rank=0,
                       dp_size=DP, global_batch_size=GBS, micro_batch_size=MBS, steps=1)
    assert plan.sizes.untruncated.tolist() == [t + (24 if i % 3 == 0 else 0) for i, t in enumerate(text)]
    from megatron.bridge_thd.configure import configure

    # A lengths file that does not exist: configure refuses it when it makes the settings record (docs/settings.md),
    # before anything is written; the record itself, read on every rank, checks values only.
    missing = SimpleNamespace(dataset=SimpleNamespace(dataloader_type="cyclic", seq_length=128),
                              model=SimpleNamespace(seq_length=128), train=SimpleNamespace(micro_batch_size=2))
    with pytest.raises(ValueError, match=r"\n- global_batch_packing.lengths_file: '.*no.json' is not a file; write it "
                       r"with bridge-thd scan"):
        configure(missing, "thd_static", global_batch_packing=GlobalBatchPacking(lengths_file=str(tmp_path / "no.json")))
    assert getattr(missing.dataset, "bridge_thd", None) is None
