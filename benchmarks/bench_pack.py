#!/usr/bin/env python
"""Benchmark ``pack_bshd_to_thd`` against two per-sample slice loops, on the CPU.

For each (B, T) the script builds a realistic padded batch (real lengths drawn uniformly from
[T/8, T] with a fixed seed; input_ids, labels, loss_mask and MRoPE position_ids (3, B, T)) and
packs it with:

* ``ours (dynamic)``: ``pack_bshd_to_thd(..., align_to=8)``, row length read from the data;
* ``ours (static)``: same with ``total_length=B*T`` (no host sync);
* ``seed PR loop``: the per-sample slice loop of the closed Megatron-Bridge PR 3838 (written
  fresh from its description): ``mask.sum(1).tolist()``, then per sample
  ``packed[start:start+len] = x[i, :len]`` for ids, labels, loss_mask and each position channel,
  slot starts aligned to ``align_to``. Right padding only.
* ``verl loop``: verl's ``preprocess_packed_seqs`` pattern (written fresh from its description):
  seqlens from the mask, aligned slots, then per sample a boolean gather
  ``x[i][mask[i].bool()]`` copied into ``packed[cu_padded[i]:cu_padded[i]+len_i]``; its real
  cu_seqlens are the padded ones.

For each it reports aten ops dispatched and host syncs per call (``opcount.count_ops``) and the
median wall time per call (``time.perf_counter``). All implementations are checked once per
configuration to produce the same packed row at real slots. A second, smaller table uses the
VERL layout (left-padded prompt + right-padded response), where the seed loop does not apply.

CPU timings only show the host-side cost; on a GPU, ops ~ kernel launches and host syncs ~
stream stalls, which is what the op / sync columns are for. Timing lives here, never in tests.

A full run writes the measured values to ``benchmarks/results/bench_pack.json``; the printed
report and the README block (``scripts/readme_figures.py``) are both rendered from them by
:func:`render` / :func:`summary`, so the README never holds a hand-copied figure.

Usage:
    .venv/bin/python benchmarks/bench_pack.py [--quick] [--output PATH] [--json PATH] [--threads N] [--no-verl-layout]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import markdown  # noqa: E402

# megatron.core warns about missing Transformer Engine / Apex on import; irrelevant here.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
from megatron.bridge_thd.packing import pack_bshd_to_thd
from megatron.bridge_thd_testbed.opcount import count_ops

ALIGN_TO = 8  # e.g. CP=4 -> 2 * cp = 8
VOCAB = 151_936  # Qwen vocabulary size; real token ids are drawn from [1, VOCAB)
SEED = 1234
CONTENDED_CORES = 0.3  # other processes' CPU use (cores) above which a timing is retried
MAX_ATTEMPTS = 3
RESULTS = Path(__file__).resolve().parent / "results" / "bench_pack.json"
CONFIGS = [(b, t) for t in (2048, 8192) for b in (4, 16, 64)]  # right-padded table
VERL_CONFIGS = [(b, 2048) for b in (4, 16, 64)]  # VERL-layout table
QUICK_CONFIGS = [(4, 2048)]
QUIET_PROBE_S = 1.0  # length of one "is the machine quiet?" probe before a retry


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) int64, 0 at padding
    attention_mask: torch.Tensor  # (B, T) int64 keep mask (HF style)
    labels: torch.Tensor  # (B, T) int64, -100 at padding
    loss_mask: torch.Tensor  # (B, T) float32
    position_ids: torch.Tensor  # (3, B, T) int64 MRoPE


def make_batch(batch_size: int, seq_len: int, layout: str, seed: int) -> Batch:
    """A padded batch whose real lengths are uniform in [T/8, T].

    layout "right": real tokens first, padding after. layout "verl": the first T/4 columns are a
    left-padded prompt, the rest a right-padded response (VERL's rollout layout).
    """
    g = torch.Generator().manual_seed(seed)
    cols = torch.arange(seq_len)
    if layout == "right":
        lengths = torch.randint(seq_len // 8, seq_len + 1, (batch_size,), generator=g)
        keep = cols[None, :] < lengths[:, None]
    elif layout == "verl":
        prompt_w = seq_len // 4
        resp_w = seq_len - prompt_w
        p_len = torch.randint(max(1, prompt_w // 8), prompt_w + 1, (batch_size,), generator=g)
        r_len = torch.randint(max(1, resp_w // 8), resp_w + 1, (batch_size,), generator=g)
        prompt_keep = cols[None, :prompt_w] >= (prompt_w - p_len)[:, None]
        resp_keep = cols[None, :resp_w] < r_len[:, None]
        keep = torch.cat([prompt_keep, resp_keep], dim=1)
    else:
        raise ValueError(layout)
    tokens = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    input_ids = torch.where(keep, tokens, 0)
    labels = torch.where(keep, torch.roll(tokens, -1, dims=1), -100)
    loss_mask = keep.float()
    base = (keep.long().cumsum(1) - 1).clamp_min(0) * keep
    # Three distinct channels (temporal, height, width) so that a channel mix-up is caught.
    position_ids = torch.stack([base, base // 2, base // 3])
    return Batch(input_ids, keep.long(), labels, loss_mask, position_ids)


# --------------------------------------------------------------------------------------------
# Implementations. Each returns (input_ids (1, N), labels, loss_mask, position_ids (3, 1, N),
# cu_seqlens, cu_seqlens_padded).
# --------------------------------------------------------------------------------------------


def ours_dynamic(b: Batch):
    p = pack_bshd_to_thd(
        b.input_ids, b.attention_mask, labels=b.labels, loss_mask=b.loss_mask,
        position_ids=b.position_ids, align_to=ALIGN_TO,
    )
    return p.input_ids, p.labels, p.loss_mask, p.position_ids, p.cu_seqlens, p.cu_seqlens_padded


def ours_static(b: Batch):
    batch_size, seq_len = b.input_ids.shape
    p = pack_bshd_to_thd(
        b.input_ids, b.attention_mask, labels=b.labels, loss_mask=b.loss_mask,
        position_ids=b.position_ids, align_to=ALIGN_TO, total_length=batch_size * seq_len,
    )
    return p.input_ids, p.labels, p.loss_mask, p.position_ids, p.cu_seqlens, p.cu_seqlens_padded


def _round_up_int(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def seed_pr_loop(b: Batch, align_to: int = ALIGN_TO, pad_token_id: int = 0):
    """Megatron-Bridge PR 3838 style: host lengths, one slice copy per sample and tensor.

    Assumes right padding (sample i's real tokens are x[i, :len_i]).
    """
    input_ids, mask = b.input_ids, b.attention_mask
    device = input_ids.device
    lens = mask.sum(1).tolist()  # the one host sync
    starts, total = [], 0
    for n in lens:
        starts.append(total)
        total += _round_up_int(n, align_to)
    packed_ids = input_ids.new_full((1, total), pad_token_id)
    packed_labels = b.labels.new_full((1, total), -100)
    packed_loss = b.loss_mask.new_zeros((1, total))
    packed_pos = b.position_ids.new_zeros((3, 1, total))
    for i, (s, n) in enumerate(zip(starts, lens)):
        packed_ids[0, s : s + n] = input_ids[i, :n]
        packed_labels[0, s : s + n] = b.labels[i, :n]
        packed_loss[0, s : s + n] = b.loss_mask[i, :n]
        for c in range(3):
            packed_pos[c, 0, s : s + n] = b.position_ids[c, i, :n]
    cu, cu_pad = [0], [0]
    for n in lens:
        cu.append(cu[-1] + n)
        cu_pad.append(cu_pad[-1] + _round_up_int(n, align_to))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=device)
    cu_seqlens_padded = torch.tensor(cu_pad, dtype=torch.int32, device=device)
    return packed_ids, packed_labels, packed_loss, packed_pos, cu_seqlens, cu_seqlens_padded


def verl_loop(b: Batch, align_to: int = ALIGN_TO):
    """verl ``preprocess_packed_seqs`` style: boolean gather per sample and tensor."""
    input_ids, mask = b.input_ids, b.attention_mask
    batch_size = input_ids.shape[0]
    device = input_ids.device
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    pad_size = (align_to - seqlens % align_to) % align_to
    seqlens_padded = seqlens + pad_size
    cu_seqlens_padded = torch.zeros(batch_size + 1, dtype=torch.int32, device=device)
    cu_seqlens_padded[1:] = torch.cumsum(seqlens_padded, dim=0)
    max_seqlen = seqlens_padded.max().item()  # noqa: F841  (verl reads it for PackedSeqParams)
    seqlens_host = seqlens.tolist()
    cu_padded_host = cu_seqlens_padded.tolist()
    total = cu_padded_host[-1]
    packed_ids = torch.zeros((1, total), dtype=input_ids.dtype, device=device)
    packed_labels = torch.full((1, total), -100, dtype=b.labels.dtype, device=device)
    packed_loss = torch.zeros((1, total), dtype=b.loss_mask.dtype, device=device)
    packed_pos = torch.zeros((3, 1, total), dtype=b.position_ids.dtype, device=device)
    for i in range(batch_size):
        n = seqlens_host[i]
        s = cu_padded_host[i]
        m = mask[i].bool()
        packed_ids[0, s : s + n] = input_ids[i][m]
        packed_labels[0, s : s + n] = b.labels[i][m]
        packed_loss[0, s : s + n] = b.loss_mask[i][m]
        packed_pos[:, 0, s : s + n] = b.position_ids[:, i][:, m]
    # verl sets the real cu_seqlens equal to the padded ones.
    return packed_ids, packed_labels, packed_loss, packed_pos, cu_seqlens_padded, cu_seqlens_padded


IMPLS: dict[str, Callable] = {
    "ours (dynamic)": ours_dynamic,
    "ours (static)": ours_static,
    "seed PR loop": seed_pr_loop,
    "verl loop": verl_loop,
}
VERL_IMPLS = ["ours (dynamic)", "ours (static)", "verl loop"]


# --------------------------------------------------------------------------------------------
# Verification, counting, timing
# --------------------------------------------------------------------------------------------


def verify(b: Batch, results: dict[str, tuple]) -> None:
    """Every implementation must put the same values at the same real slots."""
    ref = results["ours (dynamic)"]
    cu_pad = ref[5].long()
    cu = ref[4].long()
    n_row = ref[0].shape[-1]
    assert n_row == int(cu_pad[-1])
    real = torch.zeros(n_row, dtype=torch.bool)
    for i in range(len(cu) - 1):  # slot i holds len_i real tokens starting at cu_pad[i]
        real[int(cu_pad[i]) : int(cu_pad[i]) + int(cu[i + 1] - cu[i])] = True
    assert int(real.sum()) == int(b.attention_mask.sum())
    # Independent reference for the real tokens in row order.
    expected_ids = b.input_ids[b.attention_mask.bool()]
    assert torch.equal(ref[0][0, real], expected_ids), "ours: wrong tokens at real slots"
    for name, out in results.items():
        ids, labels, loss, pos, _, cu_p = out
        assert ids.shape[-1] >= n_row, name
        assert torch.equal(cu_p.long()[: len(cu_pad)], cu_pad), f"{name}: cu_seqlens_padded differs"
        assert torch.equal(ids[0, :n_row][real], ref[0][0, real]), f"{name}: input_ids differ at real slots"
        assert torch.equal(labels[0, :n_row][real], ref[1][0, real]), f"{name}: labels differ"
        assert torch.equal(loss[0, :n_row][real], ref[2][0, real]), f"{name}: loss_mask differs"
        assert torch.equal(pos[:, 0, :n_row][:, real], ref[3][:, 0, real]), f"{name}: position_ids differ"


def count(fn: Callable, b: Batch) -> tuple[int, int]:
    with count_ops() as c:
        fn(b)
    return c.ops, c.host_syncs


def time_medians_ms(
    fns: dict[str, Callable], b: Batch, *, warmup: int, min_reps: int, max_reps: int, budget_s: float
) -> dict[str, tuple[float, int]]:
    """Median wall time per call of each implementation, in ms, and the sample count.

    The implementations are timed interleaved (one call each per round, rotating the order),
    so that slow drifts (frequency scaling, background load) hit all of them alike. Heavy
    contention is detected separately (see :class:`OtherLoad`).
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name](b)
    gc.collect()
    samples: dict[str, list[float]] = {name: [] for name in names}
    budget = budget_s * len(names)
    start = time.perf_counter()
    rounds = 0
    while rounds < max_reps and (rounds < min_reps or time.perf_counter() - start < budget):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name](b)
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: (statistics.median(v) * 1e3, len(v)) for name, v in samples.items()}


class OtherLoad:
    """CPU used by *other* processes while a block runs, in cores (Linux /proc/stat).

    On a shared machine another busy process makes torch's intra-op parallel regions wait for
    a scheduler time slice (tens of ms), which swamps sub-millisecond timings; measuring it
    lets the script retry a configuration and flag rows that stayed contended.
    """

    def __init__(self):
        self.cores = float("nan")

    @staticmethod
    def _busy_s() -> float | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user/nice
        return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._busy0, self._own0, self._t0 = self._busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1 = self._busy_s()
        if busy1 is not None and self._busy0 is not None:
            wall = max(time.perf_counter() - self._t0, 1e-9)
            other = (busy1 - self._busy0) - (time.process_time() - self._own0)
            self.cores = max(other, 0.0) / wall
        return False


class QuietWaiter:
    """Before a retry, wait (within a budget shared by the whole run) for a quiet probe window."""

    def __init__(self, budget_s: float):
        self.left = budget_s

    def wait(self, threshold: float) -> None:
        while self.left > 0:
            t0 = time.perf_counter()
            with OtherLoad() as load:
                time.sleep(min(QUIET_PROBE_S, self.left))
            self.left -= time.perf_counter() - t0
            if not load.cores > threshold:
                return


def contention_threshold() -> float:
    """Other processes may use the cores torch's threads leave free, plus a little."""
    return max((os.cpu_count() or 1) - torch.get_num_threads(), 0) + CONTENDED_CORES


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def counted_rows(configs, layout: str, impl_names: list[str]) -> list[dict]:
    """Ops and host syncs per call of each implementation (no timing): deterministic, cheap.

    ``tests/unit/test_readme_figures.py`` recomputes these to check the committed results."""
    rows = []
    for batch_size, seq_len in configs:
        b = make_batch(batch_size, seq_len, layout, SEED + batch_size * 100_003 + seq_len)
        for name in impl_names:
            ops, syncs = count(IMPLS[name], b)
            rows.append(dict(B=batch_size, T=seq_len, impl=name, ops=ops, host_syncs=syncs))
    return rows


def run_table(
    configs, layout: str, impl_names: list[str], timing: dict, progress, max_attempts: int, waiter: "QuietWaiter",
) -> list[dict]:
    rows = []
    for batch_size, seq_len in configs:
        b = make_batch(batch_size, seq_len, layout, SEED + batch_size * 100_003 + seq_len)
        outs = {name: IMPLS[name](b) for name in impl_names}
        verify(b, outs)
        del outs
        fns = {name: IMPLS[name] for name in impl_names}
        threshold = contention_threshold()
        for attempt in range(max_attempts):
            with OtherLoad() as load:
                times = time_medians_ms(fns, b, **timing)
            if not load.cores > threshold:  # also true for nan (no /proc/stat)
                break
            progress(f"  [{layout}] B={batch_size} T={seq_len}: other processes used {load.cores:.2f} cores "
                     f"during timing (attempt {attempt + 1}/{max_attempts})")
            if attempt + 1 < max_attempts:
                waiter.wait(threshold)
        contended = bool(load.cores > threshold)
        for name in impl_names:
            ops, syncs = count(IMPLS[name], b)
            ms, reps = times[name]
            rows.append(dict(B=batch_size, T=seq_len, impl=name, ops=ops, host_syncs=syncs, ms=ms, reps=reps,
                             contended=contended))
            progress(f"  [{layout}] B={batch_size} T={seq_len} {name}: {ops} ops, {syncs} syncs, {ms:.3f} ms (n={reps})")
    return rows


# --------------------------------------------------------------------------------------------
# Rendering (pure: results dict in, markdown out; scripts/readme_figures.py uses these)
# --------------------------------------------------------------------------------------------

TABLE_INTROS = {
    "right": "Packing a right-padded batch (real lengths ~ U[T/8, T], seed {seed}) with labels, loss_mask and MRoPE "
             "position_ids (3, B, T), align_to={align_to}. Ratio = time / seed PR loop time (< 1 is faster). On a GPU "
             "every op is a kernel launch and every host sync a stream stall; CPU times show host cost only.",
    "verl": "VERL layout (left-padded prompt of width T/4 + right-padded response); the seed PR loop does not support "
            "it. Ratio = time / verl loop time.",
}


def _table(table: dict) -> str:
    ratio = {"seed PR loop": "ratio vs seed loop", "verl loop": "ratio vs verl loop"}[table["reference"]]
    header = ["B", "T", "impl", "ops/call", "host syncs/call", "CPU ms/call (median)", ratio]
    ref = {(r["B"], r["T"]): r["ms"] for r in table["rows"] if r["impl"] == table["reference"]}
    rows = []
    for r in table["rows"]:
        flag = "*" if r["contended"] else ""
        rows.append([str(r["B"]), str(r["T"]), r["impl"], str(r["ops"]), str(r["host_syncs"]), f"{r['ms']:.3f}{flag}",
                     f"{r['ms'] / ref[(r['B'], r['T'])]:.2f}x{flag}"])
    return markdown(header, rows)


def render(results: dict) -> str:
    """The report this script prints (and the README's benchmark block)."""
    parts = []
    for table in results["tables"]:
        parts += [TABLE_INTROS[table["layout"]].format(**results), "", _table(table), ""]
    if any(r["contended"] for t in results["tables"] for r in t["rows"]):
        parts += [
            f"* other processes used > {results['contention_threshold']:.1f} CPU cores (the cores torch's threads "
            f"leave free + {CONTENDED_CORES}) while this row was timed, even after {results['max_attempts']} "
            "attempt(s): its times are unreliable. With > 1 torch thread an implementation that enters intra-op "
            "parallel regions waits for a scheduler time slice and can look many times slower. Re-run on a quiet "
            "machine, or with --threads 1.",
            "",
        ]
    parts += [results["env"], f"total runtime {results['total_runtime_s']:.1f} s"]
    return "\n".join(parts)


def _span(values, fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def summary(results: dict) -> str:
    """The paragraph under the tables, every number taken from ``results``."""
    rows = next(t for t in results["tables"] if t["layout"] == "right")["rows"]
    by = {(r["B"], r["T"], r["impl"]): r for r in rows}
    configs = sorted({(r["B"], r["T"]) for r in rows}, key=lambda c: (c[1], c[0]))
    sizes = sorted({b for b, _ in configs})
    t0 = min(t for _, t in configs)
    ops = {impl: sorted({r["ops"] for r in rows if r["impl"] == impl}) for impl in ("ours (dynamic)", "ours (static)")}
    syncs = {impl: sorted({r["host_syncs"] for r in rows if r["impl"] == impl}) for impl in ops}

    def one(values):
        return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"

    def syncs_text(values):
        return {0: "none", 1: "one"}.get(values[-1], str(values[-1])) if len(values) == 1 else one(values)

    dyn, stat = syncs["ours (dynamic)"], syncs["ours (static)"]
    text = (f"Ours dispatches the same {one(ops['ours (dynamic)'])} ops ({one(ops['ours (static)'])} in static mode) "
            f"whatever B is, with {syncs_text(dyn)} host sync{'' if dyn == [1] else 's'} ({syncs_text(stat)} in static "
            "mode)")
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]

        def slope(impl, key):
            return (by[(large, t0, impl)][key] - by[(small, t0, impl)][key]) / (large - small)

        text += (f"; the seed PR's slice loop launches {slope('seed PR loop', 'ops'):.0f} more ops per sample and "
                 f"verl's loop {slope('verl loop', 'host_syncs'):.0f} more host syncs per sample (one per tensor: its "
                 "boolean gathers)")
    ratios = {(b, t, impl): by[(b, t, impl)]["ms"] / by[(b, t, "seed PR loop")]["ms"]
              for b, t in configs for impl in ops}
    worst = max(ratios, key=ratios.get)
    best = min(ratios, key=ratios.get)
    verl = [by[(b, t, impl)]["ms"] / by[(b, t, "verl loop")]["ms"] for b, t in configs for impl in ops]
    why = "; with few samples each of our scatters still reads every padded position" if worst[0] == sizes[0] else ""
    text += (". On the CPU a slice is a memcpy, so the seed loop is hard to beat there: ours takes at worst "
             f"{ratios[worst]:.2f}x its time (B={worst[0]}, T={worst[1]}, {worst[2][6:-1]}{why}) and at best "
             f"{ratios[best]:.2f}x (B={best[0]}, "
             f"T={best[1]}, {best[2][6:-1]}); against verl's loop it takes {_span(verl, '.2f')}x the time. The method "
             "(timings interleaved, contention detection) is in `benchmarks/README.md`; CPU timings on a shared "
             "machine vary from run to run.")
    if any(r["contended"] for r in rows):
        text += " Rows marked * were timed while other processes used the CPU: their times are unreliable."
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: B=4, T=2048, few repeats")
    parser.add_argument("--output", type=Path, help="also write the tables to this file")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"write the measured values here (default: {RESULTS} for a full run, nowhere with --quick); "
                        "scripts/readme_figures.py renders the README block from it")
    parser.add_argument("--no-verl-layout", action="store_true", help="skip the VERL-layout table")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads(N) (default: leave torch's default). On a shared, busy machine "
        "intra-op parallel regions can stall for a scheduler time slice; --threads 1 avoids that",
    )
    parser.add_argument(
        "--max-wait", type=float, default=60.0,
        help="seconds the whole run may spend waiting for a quiet machine before retrying a contended "
        "configuration (default 60; --quick never waits)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    json_path = args.json if args.json is not None or args.quick else RESULTS

    if args.quick:
        configs = QUICK_CONFIGS
        timing = dict(warmup=2, min_reps=5, max_reps=20, budget_s=0.1)
        max_attempts = 1
        waiter = QuietWaiter(0.0)
    else:
        configs = CONFIGS
        timing = dict(warmup=3, min_reps=15, max_reps=300, budget_s=1.0)
        max_attempts = MAX_ATTEMPTS
        waiter = QuietWaiter(args.max_wait)

    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    t_start = time.perf_counter()
    torch.manual_seed(SEED)

    tables = [dict(layout="right", reference="seed PR loop",
                   rows=run_table(configs, "right", list(IMPLS), timing, progress, max_attempts, waiter))]
    if not args.no_verl_layout:
        verl_configs = configs if args.quick else VERL_CONFIGS
        tables.append(dict(layout="verl", reference="verl loop",
                           rows=run_table(verl_configs, "verl", VERL_IMPLS, timing, progress, max_attempts, waiter)))
    results = dict(
        script="benchmarks/bench_pack.py", quick=args.quick, seed=SEED, align_to=ALIGN_TO,
        env=(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU {cpu_model()} "
             f"({os.cpu_count()} logical cores), python {platform.python_version()}"),
        contention_threshold=contention_threshold(), max_attempts=max_attempts,
        tables=tables, total_runtime_s=round(time.perf_counter() - t_start, 1),
    )
    text = render(results)
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
