#!/usr/bin/env python
"""Per-micro-batch host cost of the packed step's public entry point,
``megatron.bridge_thd.qwen3_vl_step.prepare_micro_batch(batch, model, state, pg_collection)``, on
Megatron-Bridge 0.6.2's real tiny ``Qwen3VLModel`` on the CPU (``bridge_thd_cpu.model.build_qwen3_vl``).

For each layout (``thd``, ``thd_static``, ``bshd``) x B (8, 32) x T (2048, 4096) x media (images,
videos) it reports:

* host ms: the median wall time of one ``prepare_micro_batch`` call (``time.perf_counter``) over
  ``--repeats`` calls after ``--warmup`` calls, with ``torch.set_num_threads(--threads)`` (1 by
  default, for stability); the three layouts of a (B, T, media) are timed interleaved, one call
  each per round in a rotating order, so drift of the machine's load hits them alike. The median
  process CPU time (``time.process_time``) is stored too: with one thread it is the call's own
  compute, largely insensitive to other processes taking the cores. A fixed calibration workload
  (:func:`calibration_workload`) is timed in the same rounds: host ms / calibration ms compares runs
  made at different times, under different loads (``--label before`` and ``--label after``);
* host batch: the same call with the batch on the host, as Megatron-Bridge's loader yields it, and the
  model on ``meta`` (a GPU's stand-in): its median wall time in the same rounds (all the host work of
  a GPU run's step: the row built on the host, then copied), its host syncs (a host read of a
  ``meta`` tensor raises) and its ops on ``meta`` tensors (the copies);
* ops, kernels and host syncs of one call (``bridge_thd_testbed.opcount.count_ops``: aten ops dispatched; of
  them the ones that would launch a GPU kernel (views, allocations, wrapped numbers left out); host reads,
  data-sized ops and blocking copies between devices, each once), and the tensor constructors
  given host data and an explicit device (``device_constructors``: each a blocking host-to-device
  copy when the device is a GPU, invisible as a copy on the CPU);
* beside them, the model's own host reads and ops: the vision tower on the same pixel inputs
  (Megatron-Bridge's ``reorganize_inputs`` + ``vision_model``, what ``Qwen3VLModel.forward`` runs
  first; its inputs do not depend on the layout, so it is counted once per (B, media), on the
  T=2048 batch: its reads are per image and per video frame, the same at T=4096, where one count
  takes up to 20 s; ``--vision-all-widths`` counts every T), and
  the full ``model(**prepared.forward_args)`` (no_grad) for B=8, T=2048 in every layout and media
  only: on a small CPU machine one full forward takes 5-40 s (the CPU attention stand-in is dense
  per segment), too slow for every configuration. The CPU attention stand-in's own reads
  (``bridge_thd_cpu.attention``, 2 per attention call; Transformer Engine has other ones) are counted
  apart and left out of the model's figure.

Batches: ``bridge_thd_testbed.vlm_batches.vlm_batch(B, T, media=..., seed=B + T)``: right padded to T, real
lengths ``U{T/4 .. T}``, one image per sample (``images``), or one video of 2-4 temporal patches
and one image per sample (``videos``); ``seq_length = T`` (nothing is truncated). A floor row
(B=8, T=256) shows the host cost that does not grow with B x T (Python and dispatch overhead).

Then a breakdown of one configuration (B=8, T=2048, images, ``thd``; and the same with
``seq_length = T - 256``, which truncates): per bridge_thd function (innermost frame of the
package, test bed excluded), the aten ops it dispatched and their summed run time, the inclusive
wall time of each function under ``cProfile`` (which adds its own overhead), and where each host
sync was made.

On the CPU the "device" is the CPU: a call's host time includes its kernels' compute, which grows
with B x T; on a GPU each op is a kernel launch (a few microseconds of host time) and each host
sync stalls the host until the device has caught up. No assertion is made about any timing.

Results: ``benchmarks/results/step_host_time.json`` (one entry per ``--label``; a new run replaces
its label's entry and keeps the others) and ``.md`` (rendered from the json: side by side columns
for every label stored, ``before`` then ``after`` first).

Usage:
    .venv/bin/python benchmarks/step_host_time.py --label before
    .venv/bin/python benchmarks/step_host_time.py --label after
    .venv/bin/python benchmarks/step_host_time.py --quick       # B=8, T=2048 only; writes nothing
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import logging
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import cpu_name, markdown  # noqa: E402

warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
warnings.filterwarnings("ignore", category=UserWarning, message=r".*(Transformer Engine|Apex|absl).*")

from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch  # noqa: E402

try:  # the step's plan and its host path; absent on the "before" commit
    from megatron.bridge_thd.adapters import QWEN3_VL  # noqa: E402
    from megatron.bridge_thd.step.prepare import prepare_with_plan  # noqa: E402
    from megatron.bridge_thd.step.plan import build_step_plan  # noqa: E402
except ImportError:
    prepare_with_plan = build_step_plan = QWEN3_VL = None
from megatron.bridge_thd_cpu import attention as test_attention  # noqa: E402
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config  # noqa: E402
from megatron.bridge_thd_testbed.opcount import _NO_KERNEL_OPS, count_ops  # noqa: E402
from megatron.bridge_thd_cpu.stack import QWEN3_VL_MODEL_MODULE, cpu_stack  # noqa: E402
from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state  # noqa: E402
from megatron.bridge_thd_testbed.vlm_batches import MEDIA, vlm_batch  # noqa: E402
from megatron.bridge_thd.upstream.loading import load_bridge_module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS_JSON = ROOT / "benchmarks" / "results" / "step_host_time.json"
RESULTS_MD = RESULTS_JSON.with_suffix(".md")
LAYOUT_NAMES = ("thd", "thd_static", "bshd")
BATCH_SIZES = (8, 32)
WIDTHS = (2048, 4096)
FLOOR = (8, 256)  # (B, T) of the floor rows: a tiny batch, the host cost that does not grow with B x T
FULL_FORWARD = {(8, 2048)}  # (B, T) whose full forward is counted (every layout and media)
VISION_WIDTH = 2048  # T of the batch whose pixels the vision tower is counted on, per (B, media)
PROFILE = dict(batch_size=8, width=2048, media="images", layout="thd")
TRUNCATE_BY = 256  # the truncating breakdown: seq_length = T - TRUNCATE_BY
LABEL_ORDER = ("before", "after")
PACKAGE = os.sep + os.path.join("megatron", "bridge_thd") + os.sep


# --------------------------------------------------------------------------------------------
# Model, batches, one call
# --------------------------------------------------------------------------------------------


def build_model():
    pg = init_single_process_groups()
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=max(WIDTHS)), seed=0)
    model.pg_collection = pg
    return model


def make_state(model, batch: dict, layout: str, seq_length: int):
    """The step reads ``seq_length`` from the model's config first: set it for this configuration. Where the step
    has a plan (``step_plan``), it is built here, once, as the forward step builds it once per run."""
    model.config.seq_length = seq_length
    state = minimal_state(seq_length=seq_length, micro_batch_size=batch["tokens"].shape[0], packing_layout=layout)
    if prepare_with_plan is not None:
        state.bench_plan = build_step_plan(state, model, model.pg_collection, QWEN3_VL)
    return state


def call(model, batch: dict, state):
    if prepare_with_plan is not None:
        return prepare_with_plan(batch, state.bench_plan)
    return prepare_micro_batch(batch, model, state, model.pg_collection)


class _MetaOps(TorchDispatchMode):
    """The ops that touch a ``meta`` tensor: with the model on ``meta`` and the batch on the host, what a GPU
    would launch (a host read of a ``meta`` tensor raises, so a call that completes made no host sync)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        values = list(args) + list((kwargs or {}).values()) + [result]
        if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in values):
            self.ops[func.overloadpacket.__name__] += 1
        return result


def measure_host_batch(meta_model, batch: dict, layout: str, width: int) -> dict:
    """The batch on the host, the model on ``meta`` (Megatron-Bridge's loader and a GPU): host syncs and device
    ops of one call; None where the step predates its host path."""
    if prepare_with_plan is None:
        return dict(host_batch_syncs=None, host_batch_device_ops=None)
    state = make_state(meta_model, batch, layout, width)
    with _MetaOps() as meta:
        try:
            call(meta_model, batch, state)
            syncs = 0
        except (RuntimeError, NotImplementedError):  # a host read of a device tensor
            syncs = None
    return dict(host_batch_syncs=syncs, host_batch_device_ops=sum(meta.ops.values()),
                host_batch_device_op_names=dict(meta.ops))


def describe_sites(sites: list[str]) -> dict[str, int]:
    return dict(Counter(sites).most_common())


# --------------------------------------------------------------------------------------------
# The step: counts and interleaved timing
# --------------------------------------------------------------------------------------------


_CALIBRATION_X = torch.arange(8 * 2048).view(8, 2048)
_CALIBRATION_KEEP = (_CALIBRATION_X % 5) != 0
CALIBRATION = "calibration"


def calibration_workload() -> None:
    """A fixed torch workload (150 small ops on (8, 2048) tensors, about what the step does at B=8,
    T=2048), timed in the same rounds as the step: host ms / calibration ms compares runs made at
    different times (another label, another load on a shared machine)."""
    x, keep = _CALIBRATION_X, _CALIBRATION_KEEP
    for _ in range(15):
        y = torch.where(keep, x, 0).cumsum(1)
        z = ((y * 3 + 1) % 2048).clamp(max=2047)
        w = y.gather(1, z)
        v = torch.stack([w, y, z]).amax(0)
        (v - w).sum()
        keep.any(1)


HOST_BATCH = "host batch: "  # prefix of the timed calls with the batch on the host and the model on meta


def measure_step(model, batch: dict, width: int, repeats: int, warmup: int, meta_model=None) -> dict[str, dict]:
    """Per layout: ops, syncs and host time of the batch already on the model's device; with ``meta_model`` (where
    the step has its host path) also the host time of the batch on the host bound for the model on ``meta``, what
    Megatron-Bridge's loader and a GPU give the step; all timed in the same interleaved rounds."""
    states = {layout: make_state(model, batch, layout, width) for layout in LAYOUT_NAMES}
    calls = {layout: (lambda s=states[layout]: call(model, batch, s)) for layout in LAYOUT_NAMES}
    if meta_model is not None and prepare_with_plan is not None:
        for layout in LAYOUT_NAMES:
            meta_state = make_state(meta_model, batch, layout, width)
            calls[HOST_BATCH + layout] = lambda s=meta_state: call(meta_model, batch, s)
    calls[CALIBRATION] = calibration_workload
    for _ in range(warmup):
        calibration_workload()
    out = {}
    for layout in LAYOUT_NAMES:
        for _ in range(warmup):
            call(model, batch, states[layout])
        with count_ops() as counts:
            prepared = call(model, batch, states[layout])
        out[layout] = dict(
            ops=counts.ops,
            kernels=counts.kernels,
            host_syncs=counts.host_syncs,
            sync_sites=describe_sites(counts.sync_sites),
            sync_locations=describe_sites(counts.sync_locations),
            device_constructors=counts.device_constructors,
            row_slots=int(prepared.forward_args["input_ids"].numel()),
            prepared=prepared,
        )
    wall, cpu = defaultdict(list), defaultdict(list)
    gc.collect()
    gc.disable()
    try:
        names = tuple(calls)
        for name in names:
            for _ in range(warmup):
                calls[name]()
        for round_ in range(repeats):
            order = names[round_ % len(names):] + names[: round_ % len(names)]
            for layout in order:
                model.config.seq_length = width
                if meta_model is not None:
                    meta_model.config.seq_length = width
                c0, t0 = time.process_time(), time.perf_counter()
                calls[layout]()
                t1, c1 = time.perf_counter(), time.process_time()
                wall[layout].append((t1 - t0) * 1e3)
                cpu[layout].append((c1 - c0) * 1e3)
    finally:
        gc.enable()
    calibration_ms = statistics.median(wall[CALIBRATION])
    for layout in LAYOUT_NAMES:
        q = statistics.quantiles(wall[layout], n=4) if len(wall[layout]) > 1 else [wall[layout][0]] * 3
        host_ms = statistics.median(wall[layout])
        out[layout].update(host_ms=host_ms, host_ms_quartiles=[q[0], q[2]],
                           host_cpu_ms=statistics.median(cpu[layout]), calibration_ms=calibration_ms,
                           host_over_calibration=host_ms / calibration_ms)
        if HOST_BATCH + layout in wall:
            host_batch_ms = statistics.median(wall[HOST_BATCH + layout])
            out[layout].update(host_batch_ms=host_batch_ms, host_batch_over_calibration=host_batch_ms / calibration_ms)
    return out


# --------------------------------------------------------------------------------------------
# The model's own reads
# --------------------------------------------------------------------------------------------


class _AttentionCounts:
    """Counts the CPU attention stand-in's own ops and reads (nested in the forward's count)."""

    def __init__(self):
        self.calls, self.ops, self.host_syncs = 0, 0, 0

    def __enter__(self):
        original = self.original = test_attention.thd_cp_attention

        def counted(*args, **kwargs):
            with count_ops() as counts:
                result = original(*args, **kwargs)
            self.calls += 1
            self.ops += counts.ops
            self.host_syncs += counts.host_syncs
            return result

        test_attention.thd_cp_attention = counted
        return self

    def __exit__(self, *exc):
        test_attention.thd_cp_attention = self.original
        return False


def count_vision_tower(model, forward_args: dict) -> dict:
    """Megatron-Bridge's ``reorganize_inputs`` + ``vision_model`` on the forward's pixel inputs."""
    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    t0 = time.perf_counter()
    with cpu_stack(), torch.no_grad(), _AttentionCounts() as attention, count_ops() as counts:
        vision_data, vision_grid_thw, _ = model_module.reorganize_inputs(
            input_ids=forward_args["input_ids"],
            pixel_values=forward_args.get("pixel_values"),
            pixel_values_videos=forward_args.get("pixel_values_videos"),
            image_grid_thw=forward_args.get("image_grid_thw"),
            video_grid_thw=forward_args.get("video_grid_thw"),
            image_input_mask=None,
            video_input_mask=None,
            image_token_id=model.image_token_id,
            video_token_id=model.video_token_id,
            square_merge_size=model.square_merge_size,
        )
        model.vision_model(hidden_states=vision_data, grid_thw=vision_grid_thw)
    return _model_counts(counts, attention, time.perf_counter() - t0)


def count_forward(model, forward_args: dict) -> dict:
    t0 = time.perf_counter()
    with cpu_stack(), torch.no_grad(), _AttentionCounts() as attention, count_ops() as counts:
        model(**forward_args)
    return _model_counts(counts, attention, time.perf_counter() - t0)


def _model_counts(counts, attention: _AttentionCounts, seconds: float) -> dict:
    return dict(
        ops=counts.ops - attention.ops,
        kernels_with_test_attention=counts.kernels,
        host_syncs=counts.host_syncs - attention.host_syncs,
        test_attention=dict(calls=attention.calls, ops=attention.ops, host_syncs=attention.host_syncs),
        sync_sites=describe_sites(counts.sync_sites),
        top_sync_locations=dict(Counter(counts.sync_locations).most_common(12)),
        seconds=round(seconds, 2),
    )


# --------------------------------------------------------------------------------------------
# Breakdown of one configuration by bridge_thd function
# --------------------------------------------------------------------------------------------


def _package_frame(frame) -> str | None:
    while frame is not None:
        filename = frame.f_code.co_filename
        if PACKAGE in filename:  # the runtime package (the CPU build and test bed are packages of their own)
            return f"{Path(filename).name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


class _OpsByFunction(TorchDispatchMode):
    """Each dispatched op, its run time, attributed to the innermost bridge_thd function."""

    def __init__(self):
        super().__init__()
        self.ops, self.kernels, self.seconds = Counter(), Counter(), defaultdict(float)
        self.by_op = defaultdict(Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        owner = _package_frame(sys._getframe(1)) or "(outside bridge_thd)"
        t0 = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        self.seconds[owner] += time.perf_counter() - t0
        name = func.overloadpacket.__name__
        self.ops[owner] += 1
        self.kernels[owner] += name not in _NO_KERNEL_OPS
        self.by_op[owner][name] += 1
        return result


def breakdown(model, batch: dict, layout: str, seq_length: int, repeats: int) -> dict:
    state = make_state(model, batch, layout, seq_length)
    for _ in range(3):
        call(model, batch, state)
    with count_ops() as counts:
        call(model, batch, state)
    attribution = _OpsByFunction()
    with attribution:
        for _ in range(repeats):
            call(model, batch, state)
    profiler = cProfile.Profile()
    model.config.seq_length = seq_length
    profiler.enable()
    for _ in range(repeats):
        call(model, batch, state)
    profiler.disable()
    inclusive = {}
    for (filename, _, name), (_, _, _, cumulative, _) in pstats.Stats(profiler).stats.items():
        if PACKAGE in filename:  # the runtime package (the CPU build and test bed are packages of their own)
            key = f"{Path(filename).name}:{name}"
            inclusive[key] = inclusive.get(key, 0.0) + cumulative * 1e3 / repeats
    functions = sorted(set(attribution.ops) | set(inclusive), key=lambda k: -inclusive.get(k, 0.0))
    by_file = defaultdict(lambda: [0, 0.0, 0])
    for key, n in attribution.ops.items():
        by_file[key.split(":")[0]][0] += n / repeats
        by_file[key.split(":")[0]][1] += attribution.seconds[key] * 1e3 / repeats
        by_file[key.split(":")[0]][2] += attribution.kernels[key] / repeats
    return dict(
        layout=layout, seq_length=seq_length, repeats=repeats,
        host_syncs=counts.host_syncs, sync_sites=describe_sites(counts.sync_sites),
        sync_locations=describe_sites(counts.sync_locations), device_constructors=counts.device_constructors,
        ops=counts.ops, kernels=counts.kernels,
        functions=[
            dict(function=key, ops=attribution.ops.get(key, 0) / repeats,
                 kernels=attribution.kernels.get(key, 0) / repeats,
                 by_op={op: n / repeats for op, n in attribution.by_op[key].most_common()},
                 op_ms=attribution.seconds.get(key, 0.0) * 1e3 / repeats,
                 inclusive_ms=inclusive.get(key))
            for key in functions
        ],
        files=[dict(file=k, ops=v[0], op_ms=v[1], kernels=v[2]) for k, v in sorted(by_file.items(), key=lambda kv: -kv[1][1])],
    )


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _labels(runs: dict) -> list[str]:
    return [label for label in LABEL_ORDER if label in runs] + [label for label in runs if label not in LABEL_ORDER]


def _key(row: dict) -> tuple:
    return (row["layout"], row["batch_size"], row["width"], row["media"])


def _fmt(value, spec: str = "") -> str:
    return "—" if value is None else format(value, spec)


def render(results: dict) -> str:
    runs = results["runs"]
    labels = _labels(runs)
    lines = [
        "# Host cost of `prepare_micro_batch` per micro-batch (tiny Qwen3-VL, CPU)",
        "",
        "`benchmarks/step_host_time.py` (method in its docstring): Megatron-Bridge 0.6.2's real `Qwen3VLModel` "
        "(tiny), `megatron.bridge_thd.qwen3_vl_step.prepare_micro_batch` on batches of "
        "`bridge_thd_testbed.vlm_batches.vlm_batch(B, T, media)` (right padded to T, real lengths U{T/4..T}, one image per "
        "sample; `videos`: one video of 2-4 temporal patches and one image per sample), `seq_length = T`.",
        "",
    ]
    for label in labels:
        run = runs[label]
        lines.append(
            f"- **{label}**: commit {run['commit']}{' (+ uncommitted changes)' if run.get('dirty') else ''}, "
            f"{run['date']}; {run['cpu']}; torch {run['torch']}, {run['threads']} torch thread(s); "
            f"{run['repeats']} timed calls per layout after {run['warmup']} warm-up; 1-minute load average "
            f"{run['load_average'][0]:.1f} at start, {run['load_average'][1]:.1f} at end; calibration workload "
            f"{run['calibration_ms']:.2f} ms (median over the run); run took {run['seconds']:.0f} s."
        )
    lines += [
        "",
        "host ms: median wall time of one call (the json also has the quartiles and the median process CPU "
        "time). host / cal.: host ms over the median time of a fixed torch workload (150 small ops on (8, 2048) "
        "tensors) timed in the same rounds: compare labels by this ratio when the machine's load differed "
        "between their runs. On the CPU the device is the CPU, "
        "so these include the kernels' compute (it grows with B x T); on a GPU each kernel is a launch (a few "
        "microseconds of host time) and each host sync stalls the host until the device has caught up. ops / syncs: `bridge_thd_testbed.opcount.count_ops` of one call. H2D ctors: "
        "`torch.tensor(host data, device=...)` calls (a blocking host-to-device copy each when the device is a "
        "GPU; not in the syncs). kernels: the ops that would launch a GPU kernel (`OpCounts.kernels`: views, "
        "allocations and wrapped Python numbers left out). These columns are the batch already on the model's "
        "device (here the CPU: VERL, custom iterators); where the step has a plan (`after`) it is built once, as "
        "the forward step builds it once per run. host batch: the batch on the host as Megatron-Bridge's loader "
        "yields it and the model on `meta` (a GPU's stand-in: a host read of a `meta` tensor raises, so 0 syncs "
        "means the call completed; device ops: the ops on `meta` tensors, the copies; host ms: the median wall "
        "time of that call, timed in the same rounds, which is all the host work a GPU run's step does: the row "
        "is built on the host, MRoPE positions by the host code (`mrope`, `on_host`), then copied). ViT syncs / ops: the model's own vision tower (`reorganize_inputs` + "
        f"`vision_model`, the CPU attention stand-in's reads left out) on the pixel inputs of the T={VISION_WIDTH} "
        "batch of the same B and media, the same for every layout (its reads are per image and per video frame: "
        "they depend on B and the media, not on T). "
        f"T={FLOOR[1]} rows: the floor, a batch so small that the time is the step's host overhead (Python, "
        "dispatch), what does not grow with B x T.",
        "",
    ]

    def cols(name):
        return [f"{name} ({label})" for label in labels] if len(labels) > 1 else [name]

    header = ["layout", "B", "T", "media", *cols("host ms"), *cols("host / cal."), *cols("ops"), *cols("kernels"),
              *cols("syncs"),
              *cols("H2D ctors"), *cols("host batch: host ms"), *cols("host batch: host / cal."),
              *cols("host batch: syncs"), *cols("host batch: device ops"), "ViT syncs", "ViT ops"]
    by_label = {label: {_key(r): r for r in runs[label]["configs"]} for label in labels}
    vision = {}  # (B, T, media) and (B, media) -> the first label's count
    for label in labels:
        for row in runs[label].get("vision_tower", []):
            vision.setdefault((row["batch_size"], row["width"], row["media"]), row)
            vision.setdefault((row["batch_size"], row["media"]), row)
    keys = []
    for label in labels:
        keys += [k for k in by_label[label] if k not in keys]
    keys.sort(key=lambda k: (k[1], k[2], MEDIA.index(k[3]), LAYOUT_NAMES.index(k[0])))
    rows = []
    for key in keys:
        cells = [key[0], str(key[1]), str(key[2]), key[3]]
        for metric, spec in (("host_ms", ".1f"), ("host_over_calibration", ".2f"), ("ops", "d"), ("kernels", "d"),
                             ("host_syncs", "d"),
                             ("device_constructors", "d"), ("host_batch_ms", ".1f"),
                             ("host_batch_over_calibration", ".2f"), ("host_batch_syncs", "d"),
                             ("host_batch_device_ops", "d")):
            cells += [_fmt(by_label[label].get(key, {}).get(metric), spec) for label in labels]
        v = vision.get(key[1:]) or vision.get((key[1], key[3]))
        cells += [_fmt(v and v["host_syncs"], "d"), _fmt(v and v["ops"], "d")]
        rows.append(cells)
    lines += [markdown(header, rows), ""]

    # Where each layout's syncs come from (latest label first).
    lines += ["Host syncs of the step, by site and location (one call):", ""]
    rows = []
    for label in labels:
        seen = {}
        for row in runs[label]["configs"]:
            sites = "; ".join(f"{k} x{v}" for k, v in row["sync_locations"].items()) or "none"
            seen.setdefault((row["layout"], row["media"]), sites)
        for (layout, media), sites in seen.items():
            rows.append([label, layout, media, sites])
    lines += [markdown(["label", "layout", "media", "sync locations (the same for every B and T)"], rows), ""]

    # The model's own reads.
    lines += [
        "The model's own host reads and ops per micro-batch (no_grad). Full forward only at "
        f"{', '.join(f'B={b}, T={t}' for b, t in sorted(FULL_FORWARD))}: on this machine one full forward takes "
        "5-40 s (the CPU attention stand-in is dense per segment), too slow for every configuration; elsewhere "
        "the vision tower alone (table above). The CPU attention stand-in's own reads (2 per attention call, "
        "test bed only) are left out and shown apart.",
        "",
    ]
    rows = []
    for label in labels:
        for row in runs[label].get("full_forward", []):
            att = row["test_attention"]
            rows.append([label, row["layout"], str(row["batch_size"]), str(row["width"]), row["media"],
                         str(row["host_syncs"]), str(row["ops"]), f"{att['host_syncs']} / {att['ops']}"])
        for row in runs[label].get("vision_tower", []):
            att = row["test_attention"]
            rows.append([label, "ViT only", str(row["batch_size"]), str(row["width"]), row["media"],
                         str(row["host_syncs"]), str(row["ops"]), f"{att['host_syncs']} / {att['ops']}"])
    if rows:
        lines += [markdown(["label", "forward", "B", "T", "media", "model syncs", "model ops",
                            "CPU attention stand-in syncs / ops"], rows), ""]
    for label in labels:
        first = next(iter(runs[label].get("vision_tower", [])), None)
        if first:
            where = "; ".join(f"`{k.rsplit('/', 1)[-1]}` x{v}" for k, v in first["top_sync_locations"].items())
            lines += [f"Where the vision tower's reads are ({label}, B={first['batch_size']}, T={first['width']}, "
                      f"{first['media']}; files of Megatron-Bridge's `models/qwen_vl/modelling_qwen3_vl/` unless "
                      f"named; most frequent first): {where}", ""]
            break

    # Breakdown.
    for label in labels:
        for name, item in runs[label].get("breakdown", {}).items():
            lines += [
                f"Breakdown ({label}): {name}: {item['ops']} ops ({item['kernels']} kernels), {item['host_syncs']} host syncs "
                f"({'; '.join(f'{k} x{v}' for k, v in item['sync_locations'].items()) or 'none'}), "
                f"{item['device_constructors']} H2D ctors. Per bridge_thd function (innermost frame of the package): "
                "ops and kernels it dispatched and their summed run time (ms, mean of "
                f"{item['repeats']} calls), and its inclusive wall time under cProfile (ms; cProfile adds overhead "
                "to every Python call, and on a loaded machine a preemption lands on whatever function runs: read "
                "small figures loosely).",
                "",
                markdown(["file", "ops", "kernels", "op ms", "share of op time"],
                         [[f["file"], f"{f['ops']:.0f}", f"{f['kernels']:.0f}", f"{f['op_ms']:.2f}",
                           f"{100 * f['op_ms'] / max(sum(g['op_ms'] for g in item['files']), 1e-9):.0f}%"]
                          for f in item["files"]]),
                "",
                markdown(["function", "ops", "kernels", "op ms", "inclusive ms (cProfile)"],
                         [[f["function"], f"{f['ops']:.0f}", f"{f['kernels']:.0f}", f"{f['op_ms']:.2f}",
                           _fmt(f["inclusive_ms"], ".2f")]
                          for f in item["functions"] if f["ops"] or (f["inclusive_ms"] or 0) >= 0.05]),
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    logging.getLogger("megatron.bridge_thd").setLevel(logging.WARNING)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    model = build_model()
    meta_model = build_model().to("meta")
    meta_model.pg_collection = model.pg_collection
    grid = [(8, 2048)] if args.quick else [FLOOR] + [(b, t) for b in BATCH_SIZES for t in WIDTHS]
    configs, vision_rows, forward_rows = [], [], []
    for batch_size, width in grid:
        for media in MEDIA:
            batch = vlm_batch(batch_size, width, media=media, seed=batch_size + width)
            measured = measure_step(model, batch, width, args.repeats, args.warmup, meta_model)
            for layout in LAYOUT_NAMES:
                row = measured[layout]
                prepared = row.pop("prepared")
                row.update(measure_host_batch(meta_model, batch, layout, width))
                configs.append(dict(layout=layout, batch_size=batch_size, width=width, media=media,
                                    real_tokens=int(batch["attention_mask"].sum()), **row))
                print(f"B={batch_size:<3d} T={width} {media:6s} {layout:10s} host {row['host_ms']:7.2f} ms "
                      f"(CPU {row['host_cpu_ms']:7.2f})  ops {row['ops']:4d}  syncs {row['host_syncs']}  "
                      f"H2D ctors {row['device_constructors']}", flush=True)
                if args.model != "none" and (batch_size, width) in FULL_FORWARD:
                    forward_rows.append(dict(layout=layout, batch_size=batch_size, width=width, media=media,
                                             **count_forward(model, prepared.forward_args)))
                    print(f"    full forward: {forward_rows[-1]['host_syncs']} syncs, {forward_rows[-1]['ops']} "
                          f"ops ({forward_rows[-1]['seconds']} s)", flush=True)
            if args.model != "none" and (width == VISION_WIDTH or args.vision_all_widths):
                vision_rows.append(dict(batch_size=batch_size, width=width, media=media,
                                        **count_vision_tower(model, prepared.forward_args)))
                print(f"    vision tower: {vision_rows[-1]['host_syncs']} syncs, {vision_rows[-1]['ops']} ops "
                      f"({vision_rows[-1]['seconds']} s)", flush=True)
    profile_batch = vlm_batch(PROFILE["batch_size"], PROFILE["width"], media=PROFILE["media"],
                              seed=PROFILE["batch_size"] + PROFILE["width"])
    name = f"B={PROFILE['batch_size']}, T={PROFILE['width']}, {PROFILE['media']}, {PROFILE['layout']}"
    breakdowns = {
        f"{name}, seq_length={PROFILE['width']}": breakdown(model, profile_batch, PROFILE["layout"], PROFILE["width"],
                                                            args.profile_repeats),
        f"{name}, seq_length={PROFILE['width'] - TRUNCATE_BY} (truncates)": breakdown(
            model, profile_batch, PROFILE["layout"], PROFILE["width"] - TRUNCATE_BY, args.profile_repeats),
    }
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src"))
    return dict(
        label=args.label, commit=commit, dirty=dirty,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpu=cpu_name(), python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads(),
        repeats=args.repeats, warmup=args.warmup, load_average=[load_start, os.getloadavg()[0]],
        calibration_ms=statistics.median(row["calibration_ms"] for row in configs),
        seconds=time.perf_counter() - started,
        configs=configs, vision_tower=vision_rows, full_forward=forward_rows, breakdown=breakdowns,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="current", help="name of this run in the results (e.g. before, after)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per layout and configuration")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable timings)")
    parser.add_argument("--model", choices=("vision", "none"), default="vision",
                        help="count the model's reads (vision tower everywhere, full forward at B=8, T=2048) or not")
    parser.add_argument("--vision-all-widths", action="store_true",
                        help=f"count the vision tower at every T, not only T={VISION_WIDTH} (slow)")
    parser.add_argument("--quick", action="store_true", help="B=8, T=2048 only; writes no results file")
    parser.add_argument("--json", type=Path, default=RESULTS_JSON)
    args = parser.parse_args(argv)
    result = run(args)
    if args.quick:
        print(render({"runs": {args.label: result}}))
        return
    stored = json.loads(args.json.read_text()) if args.json.exists() else {"benchmark": "step_host_time", "runs": {}}
    stored["runs"][args.label] = result
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(stored, indent=1) + "\n")
    report = render(stored)
    args.json.with_suffix(".md").write_text(report)
    print(report)
    print(f"wrote {args.json} and {args.json.with_suffix('.md')}")


if __name__ == "__main__":
    main()
