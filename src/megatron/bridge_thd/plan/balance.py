"""The planner with and without global-batch packing: predicted step time per layout when a step's
samples stay where Megatron-Bridge's sampler puts them (in-batch placement) and when
:func:`megatron.bridge_thd.batching.assign` places them across DP ranks and micro-batches.
Reasoning and the rest of the planner: docs/planner.md; the policy: docs/batching.md.

The samples form ``len(samples) // global_batch_size`` steps of consecutive samples (the remainder
is dropped). Each sample is truncated to ``seq_length`` as the step truncates it. Per step:

* **in-batch** (:func:`~megatron.bridge_thd.batching.in_batch_assignment`): rank ``r``'s ``j``-th
  micro-batch holds the step's samples ``(j * dp + r) * micro_batch_size + [0, micro_batch_size)``;
  ``thd_static`` rows are ``micro_batch_size * round_up(seq_length, align)`` slots
  (:func:`megatron.bridge_thd.layouts.static_row_length`).
* **packed** (global-batch packing, :func:`~megatron.bridge_thd.batching.assign` with the cost of
  :func:`~megatron.bridge_thd.batching.sample_cost`, Megatron-Bridge's own FLOPs terms): ``thd``
  into rows of ``micro_batch_size * round_up(seq_length, align)`` slots (the runtime's default
  bound); ``thd_static`` into the run's longest row, chosen from these steps by the runtime's own
  :func:`~megatron.bridge_thd.batching.sampler.row_length_for_steps` (smallest multiple of the
  alignment, grown by ~0.5%, at which every step fits), with up to ``row_buckets - 1`` shorter rows
  chosen as the runtime chooses them (:func:`static_rows_for_steps`: the aligned slots of every
  micro-batch the sampler forms in the longest row, :func:`~megatron.bridge_thd.batching.sampler.micro_batch_slots`,
  and the rows of least padding over them, :func:`~megatron.bridge_thd.batching.sampler.optimal_row_lengths`);
  each micro-batch takes the shortest row that holds it (``layouts.row_bucket``) and counts that row's
  slots (time, activation peak, padding). The placement itself is the longest row's, so the per-rank
  balance does not depend on ``row_buckets``. ``bshd`` has no packed figures: it lays out exactly
  ``micro_batch_size`` samples per micro-batch and ``configure`` refuses global-batch packing with it.

Time: each micro-batch's seconds by the time model (:mod:`.step_model`, docs/time-model.md: the row its layout
lays out, its samples' lengths and frames); a rank's time is the sum over its micro-batches; the **step time is the
slowest rank's** (every rank waits for it at the gradient sync) times the 1F1B bubble
``1 + (pp - 1) / micro_batches``, plus what a step spends once (the weight sync, the fitted per-step cost) and any
extra overhead, averaged over the steps. Per-rank cost
max / mean is :func:`~megatron.bridge_thd.batching.placement_stats`'s ``rank_imbalance`` with the
same per-sample cost, averaged over the steps.

CUDA graphs of the packed ``thd_static`` rows: :func:`~.memory.cuda_graph_bytes` (a model of Megatron-Core's
local graph manager, docs/planner.md), in :attr:`BalancePlan.graph_memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from megatron.bridge_thd import layouts
from megatron.bridge_thd.batching.policy import assign, in_batch_assignment, placement_stats
from megatron.bridge_thd.batching.sampler import micro_batch_slots, row_buckets_for_runs, row_length_for_steps
from megatron.bridge_thd.batching.sizes import SampleSizes
from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.presets import ModelSpec
from megatron.bridge_thd.cost.sample import frame_lengths, image_patches, sample_cost
from megatron.bridge_thd.plan.estimate import PlanSettings
from megatron.bridge_thd.plan.layouts import LAYOUT_ORDER, MicroBatch, layout_stats
from megatron.bridge_thd.plan.memory import GraphMemory, activation_bytes, cuda_graph_bytes
from megatron.bridge_thd.cost.sample_lengths import SampleLengths
from megatron.bridge_thd.plan.samples import check_seq_length
from megatron.bridge_thd.rules.run import RULES
from megatron.bridge_thd.rules.setup import Setup
from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS

__all__ = ["PLACEMENTS", "PlacementEstimate", "BalancePlan", "Step", "micro_batches_per_rank", "plan_steps", "static_row_for_steps",
           "static_rows_for_steps", "check_row_buckets", "step_assignments", "balance_plan"]

PLACEMENTS = ("in-batch", "packed")
# Layouts global-batch packing can place (configure refuses it with bshd).
PACKABLE = ("thd", "thd_static")


@dataclass(frozen=True)
class Step:
    """One step's samples: ``lengths`` (LLM tokens, truncated to ``seq_length``), ``patches`` (ViT
    patches per sample) and ``patches_squared`` (per sample, its ViT attention term per frame,
    ``batching.cost.image_patches``)."""

    lengths: tuple[int, ...]
    patches: tuple[int, ...]
    patches_squared: tuple[float, ...]
    frames: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class PlacementEstimate:
    """One layout under one placement, over all steps.

    ``row_length``: ``thd_static``'s row (slots; packed: the longest of :attr:`BalancePlan.static_rows`),
    None otherwise; ``slots``: mean token slots per micro-batch (packed ``thd_static``: the row each
    takes); ``padding``: 1 - real tokens / slots over all steps; ``rank_cost_imbalance`` /
    ``rank_time_imbalance``: per-rank cost (``sample_cost``) / time (the time model), max over mean, averaged
    over the steps; ``step_s``: the slowest rank's time, averaged over the steps; ``samples_per_s``:
    ``global_batch_size / step_s``; ``activation_peak``: bytes per GPU of the largest micro-batch, whose slots and
    patches are ``largest_micro_batch``;
    ``refused``: why the placement is not available for this layout (then every figure is NaN)."""

    layout: str
    placement: str
    row_length: int | None
    slots: float
    padding: float
    rank_cost_imbalance: float
    rank_time_imbalance: float
    step_s: float
    samples_per_s: float
    activation_peak: float
    refused: str = ""
    largest_micro_batch: tuple[int, int] = (0, 0)  # (slots, patches) of the micro-batch with the most activations


@dataclass(frozen=True)
class BalancePlan:
    """The planner's answer with and without global-batch packing: ``layouts[layout][placement]``.

    ``static_row``: the packed ``thd_static`` run's longest row; ``static_rows``: all its rows, ascending
    (at most ``row_buckets``, the last ``static_row``); ``static_row_use``: the share of the micro-batches
    that take each; ``graph_memory``: those rows as CUDA graphs (:func:`~.memory.cuda_graph_bytes`), None
    with PP > 1 (``graph_memory_note`` says why)."""

    spec: ModelSpec
    samples: SampleLengths
    settings: PlanSettings
    global_batch_size: int
    num_micro_batches: int
    steps: int
    capacity: int  # micro_batch_size * round_up(seq_length, align): in-batch thd_static row, packed thd bound
    static_row: int  # packed thd_static longest row, chosen from the steps
    cost_name: str
    layouts: dict[str, dict[str, PlacementEstimate]]
    static_rows: tuple[int, ...] = ()
    row_buckets: int = 1
    static_row_use: tuple[float, ...] = ()
    graph_memory: GraphMemory | None = None
    graph_memory_note: str = ""

    def __post_init__(self):
        if not self.static_rows:
            object.__setattr__(self, "static_rows", (self.static_row,))

    def speedup(self, layout: str) -> float:
        """In-batch step time over packed step time for ``layout`` (> 1: packing is faster)."""
        e = self.layouts[layout]
        return e["in-batch"].step_s / e["packed"].step_s


def micro_batches_per_rank(global_batch_size, micro_batch_size: int, dp: int, num_samples: int) -> int:
    """``global_batch_size / (micro_batch_size * dp)``, the micro-batches every DP rank runs per step.

    Raises:
        ValueError: naming ``--global-batch-size``: not an int >= 1, or larger than the ``num_samples`` samples; or
            the rule ``global_batch_size`` (not a multiple of ``micro_batch_size * dp``).
    """
    per_micro = micro_batch_size * dp
    check_int("--global-batch-size", global_batch_size)
    found = RULES["global_batch_size"].check(Setup(layout="thd", micro_batch_size=micro_batch_size, dp=dp,
                                                   global_batch_size=global_batch_size))
    if found:
        raise ValueError(f"--global-batch-size {global_batch_size}: {found[0]}")
    if global_batch_size > num_samples:
        raise ValueError(
            f"--global-batch-size {global_batch_size}: larger than the {num_samples} samples, so no step can be formed; "
            "pass more samples (--num-samples / --lengths) or a smaller global batch")
    return global_batch_size // per_micro


def plan_steps(samples: SampleLengths, global_batch_size: int, seq_length: int) -> list[Step]:
    """Consecutive global batches of ``samples`` (the remainder dropped), each sample truncated to
    ``seq_length`` (refused where that would cut an image, as the step refuses it)."""
    check_seq_length(samples, seq_length)
    steps = []
    for k in range(len(samples) // global_batch_size):
        idx = range(k * global_batch_size, (k + 1) * global_batch_size)
        patches, squared = image_patches([samples.grids[i] for i in idx])
        steps.append(Step(tuple(min(samples.tokens[i], seq_length) for i in idx), tuple(patches.tolist()),
                          tuple(squared.tolist()), tuple(frame_lengths(samples.grids[i]) for i in idx)))
    return steps


def _sizes(steps: list[Step]):
    return SampleSizes(torch.tensor([n for s in steps for n in s.lengths], dtype=torch.int64),
                       torch.tensor([p for s in steps for p in s.patches], dtype=torch.int64),
                       torch.tensor([q for s in steps for q in s.patches_squared], dtype=torch.float64), "planner")


def static_row_for_steps(steps: list[Step], *, dp: int, micro_batch_size: int, num_micro_batches: int, align: int,
                         cost=None, seed: int = 0) -> int:
    """``thd_static``'s row under global-batch packing: the runtime's own
    :func:`~megatron.bridge_thd.batching.sampler.row_length_for_steps` on these steps, each in
    Megatron-Bridge's draw order (no upper bound: a row above ``micro_batch_size * seq_length`` is
    reported, not refused)."""
    gbs = dp * micro_batch_size * num_micro_batches
    draws = [torch.arange(k * gbs, (k + 1) * gbs) for k in range(len(steps))]
    return row_length_for_steps(draws, sizes=_sizes(steps), dp_size=dp, num_micro_batches=num_micro_batches,
                                align_to=align, upper=None, cost=cost, seed=seed)


def check_row_buckets(row_buckets) -> int:
    """``row_buckets`` if it is an int >= 1.

    Raises:
        ValueError: naming ``--row-buckets``.
    """
    return check_int("--row-buckets", row_buckets, 1, f"how many thd_static rows global-batch packing may use (the "
                     f"runtime's default is {DEFAULT_ROW_BUCKETS})")


def static_rows_for_steps(steps: list[Step], *, row: int, row_buckets: int, dp: int, micro_batch_size: int,
                          num_micro_batches: int, align: int, cost=None, seed: int = 0) -> tuple[int, ...]:
    """``thd_static``'s rows under global-batch packing, ascending, the last ``row``
    (:func:`static_row_for_steps`), as the runtime chooses them (``batching.bridge.run_row_buckets``):
    the aligned slots of every micro-batch :func:`~megatron.bridge_thd.batching.assign` forms in rows of
    ``row`` (:func:`~megatron.bridge_thd.batching.sampler.micro_batch_slots`), then at most ``row_buckets``
    rows of least padding over them (:func:`~megatron.bridge_thd.batching.sampler.row_buckets_for_runs`)."""
    check_row_buckets(row_buckets)
    if row_buckets == 1:
        return (row,)
    gbs = dp * micro_batch_size * num_micro_batches
    draws = torch.arange(len(steps) * gbs, dtype=torch.int64).reshape(len(steps), gbs)
    run = micro_batch_slots(draws, sizes=_sizes(steps), dp_size=dp, num_micro_batches=num_micro_batches,
                            row_length=row, align_to=align, cost=cost, seed=seed)
    return row_buckets_for_runs([run], count=row_buckets, largest=row, align_to=align)


def step_assignments(step: Step, placement: str, *, dp: int, micro_batch_size: int, num_micro_batches: int,
                     row_length: int, align: int, cost=None, seed: int = 0):
    """``[rank][micro_batch] -> positions in the step`` for ``placement`` (:data:`PLACEMENTS`)."""
    if placement == "in-batch":
        return in_batch_assignment(len(step.lengths), dp_size=dp, micro_batch_size=micro_batch_size)
    if placement == "packed":
        return assign(list(step.lengths), dp_size=dp, num_micro_batches=num_micro_batches, row_length=row_length,
                      vision_patches=list(step.patches), vision_patches_squared=list(step.patches_squared),
                      align_to=align, seed=seed, cost=cost)
    raise ValueError(f"placement {placement!r} is not known; valid placements: {', '.join(PLACEMENTS)}")


def _ratio(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def _refused(layout: str, placement: str, why: str) -> PlacementEstimate:
    nan = float("nan")
    return PlacementEstimate(layout, placement, None, nan, nan, nan, nan, nan, nan, nan, why)


def _estimate(layout: str, placement: str, steps: list[Step], assignments, costs, *, static_rows, row_use: list[int],
              micro_seconds, model, micro_batches: int, settings: PlanSettings, align: int, row_length: int | None,
              global_batch_size: int) -> PlacementEstimate:
    """One layout under one placement over the steps: each micro-batch's slots (``static_rows``: the shortest of
    the packed ``thd_static`` rows that holds it, counted in ``row_use``), its time (the time model) and
    activations; the slowest rank per step (:meth:`~.step_model.StepModel.step`)."""
    par = settings.parallel
    step_times, time_ratios, cost_ratios, slots, real, count, peak = [], [], [], 0, 0, 0, 0.0
    largest = (0, 0)
    for s, assignment, step_costs in zip(steps, assignments, costs):
        rank_times = []
        for rank in assignment:
            seconds = 0.0
            for members in rank:
                lengths = tuple(s.lengths[i] for i in members)
                patches = sum(s.patches[i] for i in members)
                mb_slots, squared = layout_stats(layout, MicroBatch(lengths, patches, 0), settings.seq_length, par)
                if static_rows is not None:
                    bucket = min(layouts.row_bucket(static_rows, layouts.thd_slots(lengths, align)),
                                 len(static_rows) - 1)
                    row_use[bucket] += 1
                    mb_slots = layouts.static_row_length(len(lengths), seq_length=settings.seq_length, align=align,
                                                         row_length=static_rows[bucket])
                frames = tuple(s.frames[i] for i in members) if s.frames else ()
                t, act = micro_seconds(layout, lengths, frames, mb_slots, patches)
                seconds += t
                if act > peak:
                    peak, largest = act, (mb_slots, patches)
                slots += mb_slots
                real += sum(lengths)
                count += 1
            rank_times.append(seconds)
        step_times.append(model.step(rank_times, micro_batches) + settings.overhead_s)
        time_ratios.append(_ratio(rank_times))
        cost_ratios.append(placement_stats(assignment, list(s.lengths), costs=step_costs).rank_imbalance)
    step_s = sum(step_times) / len(step_times)
    return PlacementEstimate(layout, placement, row_length, slots / count, 1 - real / slots,
                             sum(cost_ratios) / len(cost_ratios), sum(time_ratios) / len(time_ratios), step_s,
                             global_batch_size / step_s, peak, largest_micro_batch=largest)


def balance_plan(spec: ModelSpec, samples: SampleLengths, settings: PlanSettings, global_batch_size: int | None = None,
                 seed: int = 0, row_buckets: int = DEFAULT_ROW_BUCKETS) -> BalancePlan:
    """Every layout of :data:`~.layouts.LAYOUT_ORDER` with in-batch placement and with global-batch packing
    (module docstring). ``global_batch_size`` defaults to ``micro_batch_size * micro_batches_per_step * DP``;
    ``row_buckets``: the most ``thd_static`` rows global-batch packing may use (the runtime's
    ``global_batch_packing.row_buckets``; 1: one row, the figures before row buckets).

    Raises:
        ValueError: a global batch that is not a multiple of ``micro_batch_size * DP`` or larger than
            the samples (naming ``--global-batch-size``), ``row_buckets`` not an int >= 1 (naming
            ``--row-buckets``), or a ``seq_length`` that cuts an image.
    """
    par, mbs = settings.parallel, settings.micro_batch_size
    check_row_buckets(row_buckets)
    if global_batch_size is None:
        global_batch_size = mbs * settings.micro_batches_per_step * par.dp
    n_mb = micro_batches_per_rank(global_batch_size, mbs, par.dp, len(samples))
    steps = plan_steps(samples, global_batch_size, settings.seq_length)
    align = par.thd_alignment()
    capacity = layouts.static_row_length(mbs, seq_length=settings.seq_length, align=align)
    cost = sample_cost(spec)
    row = static_row_for_steps(steps, dp=par.dp, micro_batch_size=mbs, num_micro_batches=n_mb, align=align,
                               cost=cost, seed=seed)
    rows = static_rows_for_steps(steps, row=row, row_buckets=row_buckets, dp=par.dp, micro_batch_size=mbs,
                                 num_micro_batches=n_mb, align=align, cost=cost, seed=seed)
    row_use = [0] * len(rows)
    model = settings.step_model(spec)

    @lru_cache(maxsize=None)
    def micro_seconds(layout: str, lengths: tuple[int, ...], frames, slots: int, patches: int) -> tuple[float, float]:
        act = activation_bytes(spec, par, slots, patches, n_mb).total
        row = slots if layout == "thd_static" else None
        return model.micro_batch(layout, lengths, frames, row).total, act

    costs = [cost(list(s.lengths), list(s.patches), list(s.patches_squared)).tolist() for s in steps]
    placed = {}  # (placement, row_length) -> per step assignment, shared by layouts with the same row
    out: dict[str, dict[str, PlacementEstimate]] = {}
    for layout in LAYOUT_ORDER:
        out[layout] = {}
        for placement in PLACEMENTS:
            if placement == "packed" and layout not in PACKABLE:
                out[layout][placement] = _refused(
                    layout, placement, f"{layout} lays out exactly micro_batch_size samples per micro-batch; "
                    "configure refuses global-batch packing with it")
                continue
            bound = row if (placement == "packed" and layout == "thd_static") else capacity
            key = (placement, bound)
            if key not in placed:
                placed[key] = [step_assignments(s, placement, dp=par.dp, micro_batch_size=mbs, num_micro_batches=n_mb,
                                                row_length=bound, align=align, cost=cost, seed=seed) for s in steps]
            static_rows = rows if (placement == "packed" and layout == "thd_static") else None
            out[layout][placement] = _estimate(
                layout, placement, steps, placed[key], costs, static_rows=static_rows, row_use=row_use,
                micro_seconds=micro_seconds, model=model, micro_batches=n_mb, settings=settings, align=align,
                row_length=(rows[-1] if static_rows else capacity) if layout == "thd_static" else None,
                global_batch_size=global_batch_size)
    try:
        graphs, note = cuda_graph_bytes(spec, par, rows), ""
    except ValueError as error:
        graphs, note = None, str(error)
    return BalancePlan(spec, samples, settings, global_batch_size, n_mb, len(steps), capacity, row, cost.name, out,
                       rows, row_buckets, tuple(n / sum(row_use) for n in row_use), graphs, note)
