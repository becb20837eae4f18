#!/usr/bin/env python
"""Regenerate the figures of README.md and docs/*.md from the scripts that produce them: no
hand-copied numbers.

A figure block in README.md or in a page docs/*.md is delimited by markers (on their own lines, or
inline in a sentence)::

    <!-- figures:NAME -->
    ...generated, never edited by hand...
    <!-- /figures:NAME -->

Each block stands in exactly one document (README.md or one docs page); the same rules hold
wherever it stands. Two kinds of block (:data:`BLOCKS`):

* **computed**: cheap and deterministic (op and host-sync counts, the planner's tables, which are
  pure arithmetic, ``configure``'s flag table from its records). Rendered here from the code;
  ``tests/unit/test_readme_figures.py`` recomputes them and fails when a document's copy is stale.
* **results**: timings and real-model figures that take minutes. Measured by ``make bench``
  (``benchmarks/bench_pack.py``, ``benchmarks/parity_report.py``) or by ``--run demo`` (``make
  demo``'s report), stored as JSON under ``benchmarks/results/``, committed, and rendered here by
  the measuring script's own renderer. The test checks that the document's block equals the rendering
  of the committed JSON (nobody edits it by hand), and that the op / sync counts in the committed
  benchmark results are still what the code does now. A block ``NAME`` not listed here is rendered
  by convention by ``render(results)`` of ``benchmarks/NAME_report.py`` from
  ``benchmarks/results/NAME.json`` (``-`` in NAME read as ``_``).

Usage::

    .venv/bin/python scripts/readme_figures.py              # rewrite every block of README.md and docs/*.md
    .venv/bin/python scripts/readme_figures.py --check      # exit 1 and list stale blocks
    .venv/bin/python scripts/readme_figures.py --run demo   # re-run the demo first (results/demo.json)
    .venv/bin/python scripts/readme_figures.py --plots      # also redraw docs/plan/*.png (matplotlib)

Only the text between a block's markers is replaced; each document is re-read right before it is
written, so edits to other sections made meanwhile are kept. A block that links to a file (the
planner's plots) renders the link relative to the document it stands in.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

MARKER = re.compile(r"<!-- figures:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /figures:(?P=name) -->", re.S)
OPEN = re.compile(r"<!-- /?figures:([\w.-]+) -->")


# --------------------------------------------------------------------------------------------
# Computed blocks
# --------------------------------------------------------------------------------------------


def _quiet_imports():
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron.core: no TE / Apex on the CPU


@functools.lru_cache(maxsize=None)
def _packer_counts() -> dict:
    """``{(mask, mode): (ops, host_syncs)}`` per call of ``pack_bshd_to_thd`` on the benchmark's
    batch (labels, loss_mask, 3D MRoPE), int and bool masks, dynamic and static; checked equal for
    B = 4 and 64."""
    _quiet_imports()
    import bench_pack

    from megatron.bridge_thd.packing import pack_bshd_to_thd
    from megatron.bridge_thd_testbed.opcount import count_ops

    counts = {}
    for batch_size in (4, 64):
        b = bench_pack.make_batch(batch_size, 256, "right", bench_pack.SEED)
        for mask_name, mask in (("int", b.attention_mask), ("bool", b.attention_mask.bool())):
            for mode, total in (("dynamic", None), ("static", batch_size * 256)):
                with count_ops() as c:
                    pack_bshd_to_thd(b.input_ids, mask, labels=b.labels, loss_mask=b.loss_mask,
                                     position_ids=b.position_ids, align_to=bench_pack.ALIGN_TO, total_length=total)
                counts.setdefault((mask_name, mode), set()).add((c.ops, c.host_syncs))
    for key, seen in counts.items():
        if len(seen) != 1:
            raise RuntimeError(f"pack_bshd_to_thd {key}: op / sync counts depend on B: {sorted(seen)}")
    return {key: next(iter(seen)) for key, seen in counts.items()}


def _syncs(n: int) -> str:
    return "no host sync" if n == 0 else f"{n} host sync" + ("s" if n > 1 else "")


def packer_ops() -> str:
    """Ops and host syncs per call of ``pack_bshd_to_thd``, dynamic and static, int and bool masks;
    identical for every B (docs/packer.md)."""
    counts = _packer_counts()
    di, ds = counts[("int", "dynamic")]
    db, _ = counts[("bool", "dynamic")]
    si, ss = counts[("int", "static")]
    sb, _ = counts[("bool", "static")]
    return (f"with labels, loss_mask and 3D MRoPE positions, dynamic mode dispatches {di} ops ({db} with a bool mask) "
            f"and {_syncs(ds)}, static mode {si} ops ({sb} with a bool mask) and {_syncs(ss)}, for any B")


def packer_ops_short() -> str:
    """The same counts, short, for the README's table (int mask)."""
    counts = _packer_counts()
    di, ds = counts[("int", "dynamic")]
    si, ss = counts[("int", "static")]
    return f"{di} ops and {_syncs(ds)} per call (static mode: {si} ops, {_syncs(ss)}) for any B"


STEP_SYNC_ROWS = [
    ("`thd`", "thd", "right", 0,
     "the packer's one read: row length, longest slot, real total (`pad_between_seqs`), every validity flag (mask, "
     "MRoPE placeholders vs grids, truncation cutting an image) and the truncation counts"),
    ("`thd_static` within `seq_length`", "thd_static", "left", 0,
     "nothing: the checks are device asserts (`RuntimeError` on the CPU, at the next sync on a GPU)"),
    ("`thd_static` wider than `seq_length`", "thd_static", "right", 5, "truncation counts and the image-cut check"),
    ("`bshd`", "bshd", "right", 0, "the validity flags and truncation counts"),
]


def _meta_copy_ops(model, batch, state) -> int:
    """Ops the step dispatches on ``meta`` tensors (a GPU's launches) for a host batch and a model on ``meta``; a
    host read of a ``meta`` tensor would raise, so completing proves no host sync."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch

    class DeviceOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            values = list(args) + list((kwargs or {}).values()) + [result]
            if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in values):
                DeviceOps.count += 1
            return result

    with DeviceOps():
        prepare_micro_batch(batch, model, state, model.pg_collection)
    return DeviceOps.count


def step_host_syncs() -> str:
    """Host syncs of the whole ``prepare_micro_batch`` on Megatron-Bridge's real model (CPU build): a batch
    already on the model's device, counted by ``opcount`` as ``tests/model/test_step_host_syncs.py`` counts them, and a
    batch on the host with the model on ``meta`` (``tests/model/test_step_plan.py``)."""
    _quiet_imports()
    import logging

    from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_testbed.opcount import count_ops
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state

    seq_length = 2048
    logger = logging.getLogger("megatron.bridge_thd")
    level = logger.level
    logger.setLevel(logging.ERROR)
    rows = ["| layout | batch on the host (Megatron-Bridge's loader): host syncs, device ops | batch on the model's "
            "device: host syncs | what that one read carries |", "|---|---|---|---|"]
    try:
        pg = init_single_process_groups()
        with cpu_stack():
            model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=seq_length), seed=0)
            meta_model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=seq_length), seed=0).to("meta")
            model.pg_collection = meta_model.pg_collection = pg
            for label, layout, padding, cut, what in STEP_SYNC_ROWS:
                batch = synthetic_receipt_batch(3, seed=1, left_padding=padding == "left")
                seq = int(batch["attention_mask"].sum(1).max()) - cut if cut else seq_length
                model.config.seq_length = meta_model.config.seq_length = seq
                state = minimal_state(seq_length=seq, micro_batch_size=3, packing_layout=layout)
                with count_ops() as counts:
                    prepare_micro_batch(batch, model, state, model.pg_collection)
                copies = _meta_copy_ops(meta_model, batch, state)
                rows.append(f"| {label} | 0, {copies} (copies) | {counts.host_syncs} | {what} |")
    finally:
        logger.setLevel(level)
    return "\n".join(rows)



STEP_PATH_PLACEMENTS = (("on the host (Megatron-Bridge's loader)", True), ("on the model's device (VERL)", False))


def step_path() -> str:
    """Functions, modules, module changes and cross-module calls of our runtime one micro-batch passes through in
    ``forward_step`` before ``model(**args)``, per layout, measured by ``sys.setprofile``
    (``bridge_thd_testbed.callpath.step_call_paths``: the run's second micro-batch, its plan already built)."""
    _quiet_imports()
    from megatron.bridge_thd_testbed.callpath import step_call_paths

    rows = ["| layout | batch arrives | functions | modules | module changes | cross-module calls |",
            "|---|---|---|---|---|---|"]
    modules = {}
    for where, on_host in STEP_PATH_PLACEMENTS:
        for layout, path in step_call_paths(batch_on_host=on_host).items():
            rows.append(f"| `{layout}` | {where} | {path.functions} | {path.modules} | {path.module_changes} | "
                        f"{path.cross_module_calls} |")
            found = path.module_names()
            if modules.setdefault(layout, found) != found:
                modules[f"{layout}, batch {where}"] = found
    items = [f"* `{layout}`: " + ", ".join(f"`{m.removeprefix('megatron.bridge_thd.')}`" for m in found)
             for layout, found in modules.items()]
    return "\n".join(rows + ["", "The modules of `megatron.bridge_thd` it enters, in the order it first enters them:",
                              "", *items])


def step_lines() -> str:
    """Lines of the ``step/`` package (the per-micro-batch path), as ``wc -l`` counts them: the total and the
    largest of its modules."""
    counts = {path.name: len(path.read_text().splitlines())
              for path in sorted((ROOT / "src" / "megatron" / "bridge_thd" / "step").glob("*.py"))}
    largest = max(counts, key=counts.get)
    return f"{sum(counts.values())} lines in {len(counts)} modules (the largest, `{largest}`, {counts[largest]})"


# The planner's README cases: synthetic receipts, micro-batch 4, 8 x H100.
PLAN_CASES = [
    ("qwen3-vl-8b", "Qwen3-VL 8B", dict(tp=2), "the Megatron-Bridge H100 SFT layout"),
    ("qwen3-vl-30b-a3b", "Qwen3-VL 30B-A3B", dict(ep=8), ""),
]
PLAN_SEQ_LENGTHS = (2048, 8192)
PLAN_SAMPLES, PLAN_SEED, PLAN_MBS = 1024, 0, 4


@functools.lru_cache(maxsize=None)
def _plans():
    _quiet_imports()
    from megatron.bridge_thd.cost.presets import get_preset
    from megatron.bridge_thd.plan.estimate import PlanSettings, plan
    from megatron.bridge_thd.plan.layouts import Parallel
    from megatron.bridge_thd.plan.samples import receipt_lengths

    samples = receipt_lengths(PLAN_SAMPLES, PLAN_SEED)
    out = {}
    for model, _, parallel, _ in PLAN_CASES:
        for seq_length in PLAN_SEQ_LENGTHS:
            out[(model, seq_length)] = plan(get_preset(model), samples,
                                            PlanSettings(seq_length, PLAN_MBS, Parallel(**parallel)))
    return out


def _layout_label(par, note: str) -> str:
    parts = []
    if par.tp > 1:
        parts.append(f"TP{par.tp}" + (" with SP" if par.sp else ""))
    parts += [f"{name.upper()}{getattr(par, name)}" for name in ("cp", "pp", "ep") if getattr(par, name) > 1]
    parts.append(f"DP{par.dp}")
    return ", ".join(parts) + (f"; {note}" if note else "")


def plan_tables(base: Path = ROOT) -> str:
    """The four planner tables with their headline and plot (linked relative to ``base``, the
    folder of the document the block stands in)."""
    from megatron.bridge_thd.plan.report import plan_summary, plan_table

    blocks = [f"Synthetic receipts (n = {PLAN_SAMPLES}, seed {PLAN_SEED}), micro-batch {PLAN_MBS}, 8xH100:"]
    for model, title, parallel, note in PLAN_CASES:
        for seq_length in PLAN_SEQ_LENGTHS:
            p = _plans()[(model, seq_length)]
            flags = "".join(f" --{k} {v}" for k, v in parallel.items())
            command = f"bridge-thd plan --model {model} --seq-length {seq_length} --micro-batch-size {PLAN_MBS}{flags}"
            blocks += [
                f"**{title} ({_layout_label(p.settings.parallel, note)}), seq_length {seq_length}, micro-batch "
                f"{PLAN_MBS}** (`{command}`) — {plan_summary(p)}",
                plan_table(p),
                f"![{model} {seq_length}]({_link(DOCS / 'plan' / f'{model}_{seq_length}.png', base)})",
            ]
    return "\n\n".join(blocks)


def _link(path: Path, base: Path) -> str:
    return Path(os.path.relpath(path, base)).as_posix()


def configure_flags() -> str:
    """``configure``'s flag table from its records (``configure_flags.FLAGS``, one row per flag), with the note on
    the attributes marked ``*``."""
    from megatron.bridge_thd.configure_flags import FLAGS, FLAGS_NOTE

    rows = ["| Purpose | Megatron-Bridge 0.6.2 | Megatron-Bridge main (Aug 2026) | Set by `configure` to |",
            "| --- | --- | --- | --- |"]
    for flag in FLAGS:
        cells = flag.row()
        if any("|" in cell or "\n" in cell for cell in cells):
            raise ValueError(f"configure_flags.FLAGS: a cell with '|' or a newline breaks the table: {flag.name}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n\n" + FLAGS_NOTE


def rules_table() -> str:
    """The registry of rules (``rules.run.RULES``): each rule, where it runs, the first line of its docstring."""
    from megatron.bridge_thd.rules.registry import PLACES
    from megatron.bridge_thd.rules.run import RULES

    rows = ["| Rule | Module | " + " | ".join(PLACES) + " | What it refuses |",
            "| --- | --- | " + " | ".join("---" for _ in PLACES) + " | --- |"]
    for name, rule in RULES.items():
        module = rule.check.__module__.rsplit(".", 1)[-1]
        marks = " | ".join("x" if place in rule.places else "" for place in PLACES)
        summary = rule.summary.replace("``", "`").replace("|", "\\|")
        rows.append(f"| `{name}` | `rules/{module}.py` | {marks} | {summary} |")
    return "\n".join(rows)


def plan_discussion() -> str:
    """The paragraph under the planner tables, its numbers from the same plans."""
    plans = _plans()
    dense, moe = PLAN_CASES[0][0], PLAN_CASES[1][0]
    dense_title, moe_title = PLAN_CASES[0][1].split()[-1], PLAN_CASES[1][1].split()[-1]
    lo, hi = PLAN_SEQ_LENGTHS[0], PLAN_SEQ_LENGTHS[-1]
    d_lo = plans[(dense, lo)]
    static = [plans[(dense, s)].speedup("thd_static") for s in PLAN_SEQ_LENGTHS]
    static_text = ("is *worse* than `bshd`" if max(static) < 1
                   else f"is at best {max(static):.2f}x `bshd`")
    saved = {s: 1 - plans[(moe, s)].layouts["thd"].slots / plans[(moe, s)].layouts["bshd"].slots for s in (lo, hi)}
    speed = {s: plans[(moe, s)].speedup() for s in (lo, hi)}
    moe_rows = [e for s in PLAN_SEQ_LENGTHS for e in plans[(moe, s)].layouts.values()]
    oom = sum(not e.fits for e in moe_rows)
    oom_text = "every" if oom == len(moe_rows) else f"{oom} of {len(moe_rows)}"
    state = plans[(moe, lo)].state_bytes / 2**30
    return (
        f"What the tables say: where nothing forces padding ({dense_title}: no PP, no EP) `thd` saves the padding of "
        f"the batch's longest sample ({d_lo.speedup():.2f}x predicted), and `thd_static` {static_text} (it pads to "
        "`micro_batch_size * seq_length`): use it only where PP/EP force the padded layout to `seq_length` anyway or "
        f"CUDA graphs need static shapes. Where EP>1 forces `seq_length` ({moe_title}), `thd` skips {saved[lo]:.0%} "
        f"({lo}) to {saved[hi]:.0%} ({hi}) of the token slots and is {speed[lo]:.2f}x to {speed[hi]:.2f}x faster by "
        f"the time model. The planner marks {oom_text} {moe_title} row OOM: with EP{plans[(moe, lo)].settings.parallel.ep} "
        f"on {plans[(moe, lo)].settings.parallel.gpus} GPUs it counts fp32 gradients and Adam states of the experts "
        f"unsharded ({state:.1f} GiB/GPU of model states); a distributed or precision-aware optimizer, which the "
        "recipe may rely on, is not modelled."
    )


def plan_gpu() -> str:
    """The GPU defaults and the time model quoted in the prose."""
    from megatron.bridge_thd.plan.estimate import PlanSettings
    from megatron.bridge_thd.plan.roofline import get_gpu

    g, time = get_gpu("h100-sxm"), PlanSettings(1, 1).time
    return (f"{g.bf16_flops / 1e12:.0f} TFLOP/s, {g.hbm_bytes_per_s / 1e12:.2f} TB/s, {g.memory_bytes / 1e9:.0f} GB; "
            f"step times from the time model, {time.source}")


def plan_calibration() -> str:
    """``bridge-thd plan --calibrate`` as it prints (Markdown tables)."""
    _quiet_imports()
    from megatron.bridge_thd.plan.calibrate import calibration_report

    return f"\n{calibration_report()}\n"


def plan_calibration_discussion() -> str:
    """The paragraph under the calibration, its numbers from the same reproductions."""
    _quiet_imports()
    from megatron.bridge_thd.cost.step_time import FITTED
    from megatron.bridge_thd.plan.published import TABLES, pr3838_memory

    held = [f for t in TABLES.values() if t.role == "held out" for f in t.reproduce(FITTED) if f.judged]
    ratios, times = [f for f in held if f.unit == "x"], [f for f in held if f.unit == "ms"]
    fit = [f for t in TABLES.values() if t.role == "fit" for f in t.reproduce(FITTED) if f.unit == "ms"]
    fit_rms = (sum(f.error ** 2 for f in fit) / len(fit)) ** 0.5
    wrong = [f"{layout} MBS {mbs}" for (layout, mbs), (ran, e, cap) in pr3838_memory().items() if e.fits(cap) != ran]
    return (
        f"What it says: fitted on one table (RMS error of its {len(fit)} step times {fit_rms:.1%}), the model predicts "
        f"{sum(f.within_bar for f in ratios)} of the {len(ratios)} held-out speed-up ratios within 15% (errors "
        f"{min(f.error for f in ratios):+.1%} to {max(f.error for f in ratios):+.1%}), and "
        f"{sum(f.within_bar for f in times)} of the {len(times)} absolute step times on a named GPU within 25% "
        f"(PR 3838: {min(f.error for f in times):+.0%} to {max(f.error for f in times):+.0%}): **the bar on absolute "
        "times is not met**. The fixed costs the fit finds on a 12-layer GPT do not carry over to a Megatron-Bridge VLM "
        "step with a vision tower, an MTP layer and Gated-DeltaNet kernels, and cord_v2's lengths are assumed. The "
        "memory model " + (f"gets {', '.join(wrong)} wrong (predicted to fit; the GPU ran out of memory)" if wrong
                           else "gets every run right") + ". A GPU calibration (benchmarks/gpu_calibrate.py) and "
        "one measured step replace the fitted and assumed parts (docs/time-model.md)."
    )


# --------------------------------------------------------------------------------------------
# Results blocks (rendered from benchmarks/results/*.json by the measuring script's renderer)
# --------------------------------------------------------------------------------------------


class MissingResults(RuntimeError):
    pass


def load_results(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        how = "--run demo" if name == "demo" else "make bench"
        raise MissingResults(f"{path.relative_to(ROOT)} is missing: produce it with `{how}`")
    return json.loads(path.read_text())


def bench_pack_block() -> str:
    import bench_pack

    results = load_results("bench_pack")
    if results.get("quick"):
        raise MissingResults("benchmarks/results/bench_pack.json comes from a --quick run; run `make bench`")
    return f"{bench_pack.render(results)}\n\n{bench_pack.summary(results)}"


def _parity(part: str) -> Callable[[], str]:
    def render() -> str:
        import parity_report

        results = load_results("parity_report")
        if part == "single":
            return f"{parity_report.single_table(results)}\n\n{parity_report.single_summary(results)}"
        return getattr(parity_report, f"{part}_table")(results)

    render.__doc__ = f"parity_report.py's {part} table, from benchmarks/results/parity_report.json."
    return render


def _edge_cases(part: str) -> Callable[[], str]:
    """``benchmarks/edge_cases_report.py``'s report split in two: the PP x CP table (with the
    environment line) for docs/pipeline-parallel.md, the MoE tables for docs/moe-routing.md."""

    def render() -> str:
        import edge_cases_report

        results = load_results("edge_cases")
        paragraphs = edge_cases_report.render(results).split("\n\n")
        if not (paragraphs[0].startswith("PP=2 x CP=2") and paragraphs[2].startswith("MoE")):
            raise RuntimeError("benchmarks/edge_cases_report.render() changed its order: update _edge_cases")
        env = paragraphs[-1]
        return "\n\n".join(paragraphs[:2] + [env] if part == "pp" else paragraphs[2:])

    render.__doc__ = f"edge_cases_report.py's {part} tables, from benchmarks/results/edge_cases.json."
    return render


DEMO_COMMAND = ["-m", "megatron.bridge_thd_cpu.demo", "--progress", "off"]


def run_demo() -> Path:
    """Run ``make demo``'s report (in a scratch directory, so its plot lands there) and store its
    output in ``benchmarks/results/demo.json``."""
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "PYTHONWARNINGS": "ignore"}
        done = subprocess.run([sys.executable, *DEMO_COMMAND], cwd=scratch, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the demo failed ({done.returncode}):\n{done.stderr[-3000:]}")
    path = RESULTS / "demo.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [line for line in done.stdout.splitlines() if not line.startswith("plot:")]
    path.write_text(json.dumps({"command": "python " + " ".join(DEMO_COMMAND), "stdout": "\n".join(lines)}, indent=1) + "\n")
    return path


def demo_block() -> str:
    return f"```\n{load_results('demo')['stdout'].strip()}\n```"


def demo_gflop() -> str:
    """The demo table's ``trainer GFLOP`` column, per layout (the report's first table: the layouts')."""
    lines = []
    for line in load_results("demo")["stdout"].splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    if "trainer GFLOP" not in header:
        raise MissingResults("benchmarks/results/demo.json has no 'trainer GFLOP' column: re-run with --run demo")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    col = header.index("trainer GFLOP")
    return ", ".join(f"`{row[0]}` {row[col]}" for row in cells) + " GFLOP"


# --------------------------------------------------------------------------------------------
# The registry, and document I/O
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    render: Callable[[], str]
    kind: str  # "computed" or "results"
    inline: bool = False
    source: str = ""


def _benchmark(module: str, function: str, results: str) -> Callable[[], str]:
    """``function(results)`` of ``benchmarks/<module>.py`` on ``benchmarks/results/<results>.json``."""

    def render() -> str:
        import importlib

        return getattr(importlib.import_module(module), function)(load_results(results))

    render.__doc__ = f"benchmarks/{module}.py's {function}() of benchmarks/results/{results}.json"
    return render


BLOCKS: dict[str, Block] = {
    "packer-ops": Block(packer_ops, "computed", inline=True, source="opcount.count_ops on pack_bshd_to_thd"),
    "packer-ops-short": Block(packer_ops_short, "computed", inline=True, source="opcount.count_ops on pack_bshd_to_thd"),
    "bench-pack": Block(bench_pack_block, "results", source="benchmarks/bench_pack.py -> results/bench_pack.json"),
    "step-host-syncs": Block(step_host_syncs, "computed", source="opcount over prepare_micro_batch, real model"),
    "step-path": Block(step_path, "computed", source="callpath.step_call_paths: sys.setprofile over forward_step"),
    "step-lines": Block(step_lines, "computed", inline=True, source="line count of src/megatron/bridge_thd/step/*.py"),
    "demo": Block(demo_block, "results", source="make demo (--run demo) -> results/demo.json"),
    "demo-gflop": Block(demo_gflop, "results", inline=True, source="results/demo.json"),
    "parity-single": Block(_parity("single"), "results", source="benchmarks/parity_report.py -> results/parity_report.json"),
    "parity-cp": Block(_parity("cp"), "results", source="benchmarks/parity_report.py -> results/parity_report.json"),
    "parity-pp": Block(_parity("pp"), "results", source="benchmarks/parity_report.py -> results/parity_report.json"),
    "plan-gpu": Block(plan_gpu, "computed", inline=True, source="plan.roofline / PlanSettings defaults (the time model)"),
    "plan-tables": Block(plan_tables, "computed", source="bridge-thd plan"),
    "plan-discussion": Block(plan_discussion, "computed", source="bridge-thd plan"),
    "plan-calibration": Block(plan_calibration, "computed", source="bridge-thd plan --calibrate"),
    "plan-calibration-discussion": Block(plan_calibration_discussion, "computed", source="bridge-thd plan --calibrate"),
    "configure-flags": Block(configure_flags, "computed", source="configure_flags.FLAGS"),
    "rules-table": Block(rules_table, "computed", source="rules.run.RULES (the registry)"),
    "edge-cases-pp": Block(_edge_cases("pp"), "results", source="benchmarks/edge_cases_report.py -> results/edge_cases.json"),
    "edge-cases-moe": Block(_edge_cases("moe"), "results", source="benchmarks/edge_cases_report.py -> results/edge_cases.json"),
    "global-batch-headline": Block(_benchmark("global_batch_packing", "headline", "global_batch_packing"), "results",
                                   source="benchmarks/global_batch_packing.py -> results/global_batch_packing.json"),
    "global-batch-step-time": Block(_benchmark("global_batch_step_time", "headline", "global_batch_step_time"),
                                    "results",
                                    source="benchmarks/global_batch_step_time.py -> results/global_batch_step_time.json"),
    "global-batch-notes": Block(_benchmark("global_batch_packing", "headline_notes", "global_batch_packing"), "results",
                                source="benchmarks/global_batch_packing.py -> results/global_batch_packing.json"),
}


def report_block(name: str) -> Block | None:
    """A results block by convention: ``NAME`` is rendered by ``render(results)`` of
    ``benchmarks/<name>_report.py`` from ``benchmarks/results/<name>.json`` (``-`` read as ``_``),
    so a new report needs no entry here."""
    stem = name.replace("-", "_")
    if not (ROOT / "benchmarks" / f"{stem}_report.py").is_file():
        return None

    def render() -> str:
        import importlib

        return importlib.import_module(f"{stem}_report").render(load_results(stem))

    render.__doc__ = f"benchmarks/{stem}_report.py's render() of benchmarks/results/{stem}.json"
    return Block(render, "results", source=f"benchmarks/{stem}_report.py -> results/{stem}.json")


def get_block(name: str) -> Block:
    block = BLOCKS.get(name) or report_block(name)
    if block is None:
        raise ValueError(f"unknown figure block {name!r}: neither in scripts/readme_figures.BLOCKS "
                         f"({', '.join(BLOCKS)}) nor a benchmarks/{name.replace('-', '_')}_report.py")
    return block


def wrap(name: str, text: str) -> str:
    """A block as it stands in a document, markers included."""
    sep = "" if get_block(name).inline else "\n\n"
    return f"<!-- figures:{name} -->{sep}{text}{sep}<!-- /figures:{name} -->"


def documents() -> list[Path]:
    """The documents that may hold figure blocks: README.md, then every docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _label(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def readme_blocks(text: str, where: str = "README") -> dict[str, str]:
    """``{name: body}`` of every block in ``text`` (the body between the markers, as is).

    Raises:
        ValueError: an unknown name, a name used twice, or a marker without its partner.
    """
    found: dict[str, str] = {}
    for m in MARKER.finditer(text):
        name = m.group("name")
        try:
            get_block(name)
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if name in found:
            raise ValueError(f"{where}: figure block {name!r} appears twice")
        found[name] = m.group("body")
    paired = sum(1 for _ in MARKER.finditer(text)) * 2
    if len(OPEN.findall(text)) != paired:
        raise ValueError(f"{where}: a figures marker has no partner (each <!-- figures:NAME --> needs its "
                         "<!-- /figures:NAME -->)")
    return found


def all_blocks(paths: list[Path] | None = None) -> dict[str, tuple[Path, str]]:
    """``{name: (document, body)}`` over every document (:func:`documents`).

    Raises:
        ValueError: as :func:`readme_blocks`, or a name that stands in two documents (one
            figure, one place).
    """
    found: dict[str, tuple[Path, str]] = {}
    for path in paths or documents():
        for name, body in readme_blocks(path.read_text(), _label(path)).items():
            if name in found:
                raise ValueError(f"figure block {name!r} stands in both {_label(found[name][0])} and {_label(path)}: "
                                 "a block belongs to one document (link to it from the other)")
            found[name] = (path, body)
    return found


def render_block(name: str, document: Path = README) -> str:
    """The block's full text, markers included, as it reads in ``document`` (links relative to it)."""
    render = get_block(name).render
    if "base" in inspect.signature(render).parameters:
        return wrap(name, render(base=document.parent))
    return wrap(name, render())


def update_readme(names: list[str] | None = None, check: bool = False, paths: list[Path] | None = None) -> list[str]:
    """Rewrite (or, with ``check``, only compare) the named blocks (None: every block of
    :data:`BLOCKS` and of the documents) in the document each stands in (``paths``: default
    README.md and docs/*.md); returns the stale names. Results that are missing are reported on
    stderr and leave their block as it is."""
    paths = paths or documents()
    located = all_blocks(paths)
    if names is None:
        names = list(dict.fromkeys([*BLOCKS, *located]))
    stale = []
    for name in names:
        if name not in located:
            print(f"{name}: no <!-- figures:{name} --> block in README.md or docs/*.md", file=sys.stderr)
    by_document: dict[Path, list[str]] = {}
    for name in names:
        if name in located:
            by_document.setdefault(located[name][0], []).append(name)
    for path, doc_names in by_document.items():
        rendered = {}
        for name in doc_names:
            try:
                rendered[name] = render_block(name, path)
            except MissingResults as error:
                print(f"{name}: {error}", file=sys.stderr)
        text = path.read_text()  # re-read right before writing: others may edit other sections
        present = readme_blocks(text, _label(path))
        changed = False
        for name, new in rendered.items():
            if name not in present:
                print(f"{name}: {_label(path)} no longer holds the block", file=sys.stderr)
                continue
            old = f"<!-- figures:{name} -->{present[name]}<!-- /figures:{name} -->"
            if old != new:
                stale.append(name)
                if check:
                    diff = difflib.unified_diff(old.splitlines(), new.splitlines(), _label(path), "rendered",
                                                lineterm="", n=1)
                    print("\n".join(list(diff)[:40]), file=sys.stderr)
                else:
                    text, changed = text.replace(old, new, 1), True
        if changed:
            path.write_text(text)
    return stale


def write_plots() -> list[Path]:
    from megatron.bridge_thd.plan.plot import write_plot

    return [write_plot(p, ROOT / "docs" / "plan" / f"{model}_{seq}.png") for (model, seq), p in _plans().items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"blocks to render (default: all in README.md and docs/*.md): {', '.join(BLOCKS)}, "
                        "and NAME for any benchmarks/NAME_report.py")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--run", action="append", default=[], choices=["demo"],
                        help="re-measure first: 'demo' runs make demo's report into benchmarks/results/demo.json")
    parser.add_argument("--plots", action="store_true", help="also redraw the planner's docs/plan/*.png")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in BLOCKS and report_block(n) is None]
    if unknown:
        parser.error(f"unknown block(s) {unknown}; known: {', '.join(BLOCKS)} and benchmarks/<name>_report.py")
    _quiet_imports()
    if "demo" in args.run:
        print(f"wrote {run_demo().relative_to(ROOT)}", file=sys.stderr)
    stale = update_readme(args.names or None, check=args.check)
    if args.plots:
        for path in write_plots():
            print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    if args.check:
        if stale:
            print(f"stale figure blocks: {', '.join(stale)}; run scripts/readme_figures.py", file=sys.stderr)
            return 1
        return 0
    print(f"README.md, docs/*.md: {'updated ' + ', '.join(stale) if stale else 'every figure block is current'}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
