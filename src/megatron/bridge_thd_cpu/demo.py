"""The main job (``make demo``): the replacement forward step on a tiny Qwen3-VL, three layouts.

Builds a tiny random Qwen3-VL — by default Megatron-Bridge's own ``Qwen3VLModel`` on the
CPU (``megatron.bridge_thd_cpu``), or with ``--model hf`` the Hugging Face reference
``ReferenceQwen3VL.tiny()`` — and synthetic receipt-like micro-batches, runs
:func:`megatron.bridge_thd.qwen3_vl_step.forward_step` in ``bshd``, ``thd`` and
``thd_static``, runs every sample alone through the same model, and prints the losses (equal),
the largest log-probability difference against the per-sample run, and the tokens and attention
work each layout spends. Then, from the same samples' lengths alone (no model run), global-batch
packing beside Megatron-Bridge's in-batch placement for a simulated DP 2
(:func:`placement_comparison`): token slots, padding and per-rank cost max / mean.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
import warnings


class _DropMessages(logging.Filter):
    """Drops a logger's records whose message starts with one of ``prefixes`` (others pass)."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _silence_cpu_build_noise() -> None:
    """The demo's first screen is its report: silence what the CPU build of Megatron-Core /
    Megatron-Bridge says on every run, before the imports and the model build that say it. Each
    filter matches one message (nothing else from those modules is hidden, and the report is
    printed to stdout, which no filter touches)."""
    # Megatron-Core's layer specs (models/backends.py, gpt_layer_specs.py, vit_layer_specs.py,
    # heterogeneous_layer_specs.py) warn at import that Apex is absent: expected, the CPU build uses
    # torch norms on purpose.
    warnings.filterwarnings("ignore", message="Apex is not installed", category=UserWarning)
    # megatron.training's common_utils (loaded by Megatron-Bridge's flop_utils) and Megatron-Core's
    # optimizer modules warn that neither Transformer Engine nor Apex is installed: TE cannot be
    # installed without CUDA; the demo uses neither.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
    # transformer_engine_spec_provider.py, when the CPU stack builds the MoE spec: TE is absent
    # (version 0.0.0), and the local linear experts are what the CPU build wants.
    warnings.filterwarnings("ignore", message="Only transformer-engine>=", category=UserWarning)
    # Megatron-Core's TransformerConfig.__post_init__: Megatron-Bridge's Qwen3-VL
    # provider still sets the deprecated "full" CUDA-graph scope; no CUDA graph is captured here.
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    # NVIDIA ModelOpt's quantization kernels (modelopt/torch/quantization/tensor_quant.py) are decorated
    # with torch.jit.script, which this torch deprecates, when Megatron's training package (loaded with
    # Megatron-Bridge's flop_utils) imports ModelOpt: nothing the demo runs uses them.
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
    # hyper_comm_grid.py: absl is optional and not installed.
    warnings.filterwarnings("ignore", message="absl.logging is not installed", category=UserWarning)
    # gpt_model.py logs a deprecation notice (GPTModel -> HybridModel) for every model it builds:
    # Megatron-Bridge's Qwen3VLModel is built on GPTModel; nothing for the demo's user to do.
    logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(_DropMessages("GPTModel IS DEPRECATED"))
    # rerun_state_machine.py logs at WARNING that it initialises itself (disabled) on the first
    # forward: the demo does not use Megatron's rerun machinery.
    logging.getLogger("megatron.core.rerun_state_machine").addFilter(
        _DropMessages("Implicit initialization of Rerun State Machine", "RerunStateMachine initialized in mode"))
    # torch.utils.cpp_extension logs "No CUDA runtime is found" when nvcc is on PATH without a GPU;
    # it only matters for compiling CUDA extensions, which the demo never does. (Under
    # ``python -m`` the package's own import may have emitted it already.)
    logging.getLogger("torch.utils.cpp_extension").addFilter(_DropMessages("No CUDA runtime is found"))


_silence_cpu_build_noise()

import torch  # noqa: E402  (after the filters above)

from megatron.bridge_thd.qwen3_vl_step import LAYOUT_NAMES, forward_step  # noqa: E402
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch  # noqa: E402
from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL  # noqa: E402
from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state  # noqa: E402


class _Progress:
    """A one-line progress bar on stderr (only drawn on a terminal or when forced)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            elapsed = time.perf_counter() - self.start
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<24} {elapsed:5.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _per_sample_token_losses(model: ReferenceQwen3VL, batch: dict) -> list[torch.Tensor]:
    """Per-token losses of each sample run alone through the unmodified HF model, at supervised tokens."""
    keep = batch["attention_mask"]
    grids = batch["visual_inputs"].image_grid_thw
    pixels = batch["visual_inputs"].pixel_values
    patch_ends = grids.prod(-1).cumsum(0).tolist()
    out = []
    for i in range(batch["tokens"].shape[0]):
        ids = batch["tokens"][i][keep[i]][None]
        labels = batch["labels"][i][keep[i]]
        supervised = batch["loss_mask"][i][keep[i]] > 0
        start = patch_ends[i - 1] if i else 0
        mm_types = (ids == model.config.image_token_id).int()
        logits = model.hf_model(
            input_ids=ids, pixel_values=pixels[start : patch_ends[i]], image_grid_thw=grids[i : i + 1], mm_token_type_ids=mm_types
        ).logits[0]
        losses = torch.nn.functional.cross_entropy(logits.float(), labels.clamp(min=0), reduction="none")
        out.append(losses[supervised])
    return out


def _bridge_per_sample_token_losses(model, batch: dict) -> list[torch.Tensor]:
    """Each sample alone through Megatron-Bridge's model (its own positions), at supervised tokens."""
    from megatron.bridge_thd_cpu.parity import per_sample_token_losses

    losses = per_sample_token_losses(model, batch)
    keep = batch["attention_mask"]
    return [loss[batch["loss_mask"][i][keep[i]] > 0] for i, loss in enumerate(losses)]


MODELS = {
    "bridge": "Megatron-Bridge's Qwen3VLModel on the CPU",
    "hf": "Hugging Face Qwen3-VL reference",
}


def _demo_model(kind: str, seed: int, seq_length: int):
    """(model, per-sample reference function, context the forward runs in)."""
    if kind == "hf":
        return ReferenceQwen3VL.tiny(seed=seed), _per_sample_token_losses, contextlib.nullcontext()
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack

    config = tiny_qwen3_vl_config(seq_length=seq_length)
    return build_qwen3_vl(config, seed=seed), _bridge_per_sample_token_losses, cpu_stack()


def demo_batches(micro_batches: int, micro_batch_size: int, seed: int) -> list[dict]:
    """The demo's micro-batches: ``micro_batch_size`` synthetic receipts each, seeds ``seed``, ``seed + 1``, ..."""
    return [synthetic_receipt_batch(micro_batch_size, seed=seed + k) for k in range(micro_batches)]


def run_demo(micro_batches: int, micro_batch_size: int, seq_length: int, seed: int, progress: bool,
             model_kind: str = "bridge", return_results: bool = False):
    """The report text (and, with ``return_results``, the figures behind it: per layout, and under
    ``"global_batch"`` :func:`placement_comparison` of the same samples, None where its placement refuses them)."""
    if model_kind not in MODELS:
        raise ValueError(f"model_kind: {model_kind!r} is not one of {sorted(MODELS)}")
    init_single_process_groups()
    batches = demo_batches(micro_batches, micro_batch_size, seed)
    model, per_sample, stack = _demo_model(model_kind, seed, seq_length)
    with stack:
        results = _run_layouts(model, per_sample, batches, micro_batch_size, seq_length, progress)
    lengths = torch.cat([batch["attention_mask"].sum(1) for batch in batches])
    patches = torch.cat([batch["visual_inputs"].image_grid_thw.prod(-1) for batch in batches])
    report = _report(results, model, model_kind, micro_batches, micro_batch_size, seq_length)
    try:
        comparison = placement_comparison(lengths, patches, micro_batch_size=micro_batch_size, seq_length=seq_length)
        report += "\n\n" + placement_report(comparison)
    except ValueError as error:  # the run would refuse these samples too (batching.policy.DoesNotFit)
        comparison = None
        report += f"\n\nGlobal-batch packing: not compared, its placement refuses these samples: {error}"
    if return_results:
        return report, dict(results, global_batch=comparison)
    return report


# The data-parallel size the demo's placement comparison simulates (its one process runs no DP).
SIMULATED_DP = 2


def placement_comparison(lengths, patches=None, *, micro_batch_size: int, seq_length: int,
                         dp_size: int = SIMULATED_DP, seed: int = 0) -> dict:
    """Megatron-Bridge's in-batch placement against global-batch packing, for the demo's samples as one
    step of a run on ``dp_size`` ranks (no model run: lengths only).

    The step is every sample, in the demo's order (Megatron-Bridge's sampler order); the simulated
    micro-batch size is ``micro_batch_size / dp_size``, so each of the demo's micro-batches is split over
    the ranks and every rank runs as many micro-batches as the demo did (``dp_size`` 1 when
    ``micro_batch_size`` is not a multiple of it). Lengths are capped at ``seq_length`` (the step keeps
    the first ``seq_length`` tokens), alignment 1 (TP = CP = 1), cost ``GlobalBatchPacking``'s default
    (VERL's proxy ``s + s^2 / 24576``). Rows are chosen as the runtime chooses them
    (``batching.bridge``): ``thd`` places into rows of ``micro_batch_size * seq_length``; ``thd_static``
    into the row :func:`~megatron.bridge_thd.batching.sampler.row_length_for_steps` gives (at most that),
    measured with that one row and with the up to ``rules.DEFAULT_ROW_BUCKETS`` rows
    :func:`~megatron.bridge_thd.batching.sampler.micro_batch_slots` and
    :func:`~megatron.bridge_thd.batching.sampler.optimal_row_lengths` choose from the placement.

    Returns:
        ``{"dp_size", "micro_batch_size", "num_micro_batches", "global_batch_size", "lengths", "rows"}``;
        ``rows``: per placement ``{"label", "placement", "layout", "assignment", "row_lengths"`` (None:
        each micro-batch's own tokens)``, "slots", "padding", "rank_imbalance"}``, in-batch first.
    """
    from megatron.bridge_thd.batching.policy import assign, in_batch_assignment, placement_stats, sample_costs
    from megatron.bridge_thd.batching.sampler import micro_batch_slots, optimal_row_lengths, row_length_for_steps
    from megatron.bridge_thd.batching.sizes import SampleSizes
    from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS

    lengths = torch.as_tensor(lengths, dtype=torch.int64).clamp(max=seq_length)
    patches = torch.zeros_like(lengths) if patches is None else torch.as_tensor(patches, dtype=torch.int64)
    dp = dp_size if micro_batch_size % dp_size == 0 else 1
    mbs = micro_batch_size // dp
    num_micro_batches = len(lengths) // (dp * mbs)
    capacity = mbs * seq_length
    costs = sample_costs(lengths)
    rows = []

    def add(label, placement, layout, assignment, row_lengths):
        stats = placement_stats(assignment, lengths, costs=costs, row_lengths=row_lengths)
        rows.append(dict(label=label, placement=placement, layout=layout, assignment=assignment,
                         row_lengths=row_lengths, slots=stats.slots, padding=stats.padding,
                         rank_imbalance=stats.rank_imbalance))

    in_batch = in_batch_assignment(len(lengths), dp_size=dp, micro_batch_size=mbs)
    add("Megatron-Bridge in-batch, thd_static", "in-batch", "thd_static", in_batch, (capacity,))
    add("Megatron-Bridge in-batch, thd", "in-batch", "thd", in_batch, None)
    placed = dict(dp_size=dp, num_micro_batches=num_micro_batches, seed=seed)
    add("global-batch packing, thd", "global", "thd", assign(lengths, row_length=capacity, **placed), None)
    sizes = SampleSizes(lengths, patches, patches.to(torch.float64) ** 2, source="the demo's samples")
    draws = torch.arange(len(lengths))[None]
    row = row_length_for_steps(draws, sizes=sizes, dp_size=dp, num_micro_batches=num_micro_batches, upper=capacity,
                               seed=seed)
    static = assign(lengths, row_length=row, **placed)
    add("global-batch packing, thd_static, 1 row", "global", "thd_static", static, (row,))
    slots, weights = micro_batch_slots(draws, sizes=sizes, dp_size=dp, num_micro_batches=num_micro_batches,
                                       row_length=row, seed=seed)
    buckets = optimal_row_lengths(slots, weights, count=DEFAULT_ROW_BUCKETS, largest=row)
    add(f"global-batch packing, thd_static, up to {DEFAULT_ROW_BUCKETS} rows", "global", "thd_static", static, buckets)
    return dict(dp_size=dp, micro_batch_size=mbs, num_micro_batches=num_micro_batches, global_batch_size=len(lengths),
                lengths=lengths, rows=rows)


def _micro_batches(comparison: dict) -> str:
    n, mbs = comparison["num_micro_batches"], comparison["micro_batch_size"]
    return f"{n} micro-batch{'es' if n > 1 else ''} of {mbs}"


def _short_label(row: dict) -> str:
    """A placement's plot label: two short lines."""
    which = "in-batch" if row["placement"] == "in-batch" else "global-batch"
    rows = "" if row["row_lengths"] is None or row["placement"] == "in-batch" else f", {len(row['row_lengths'])} row"
    return f"{which}\n{row['layout']}{rows}{'s' if rows and len(row['row_lengths']) > 1 else ''}"


def _rows_text(row_lengths) -> str:
    return "each micro-batch's tokens" if row_lengths is None else ", ".join(str(n) for n in row_lengths)


def placement_report(comparison: dict) -> str:
    """The report's lines for :func:`placement_comparison`."""
    c = comparison
    lines = [
        f"Global-batch packing (docs/batching.md), from these {c['global_batch_size']} samples' lengths (no model run): "
        f"one step of a simulated DP {c['dp_size']} x {_micro_batches(c)} (global batch {c['global_batch_size']}), "
        "in the demo's sample order; per-rank cost s + s^2/24576 (GlobalBatchPacking's default); rows chosen as at "
        "run time.",
        "",
        "| placement | rows (slots) | token slots | padding | per-rank cost max/mean |",
        "|---|---|---|---|---|",
    ]
    for r in c["rows"]:
        lines.append(f"| {r['label']} | {_rows_text(r['row_lengths'])} | {r['slots']} | {r['padding']:.1%} | "
                     f"{r['rank_imbalance']:.3f} |")
    by_label = {r["label"]: r for r in c["rows"]}
    static_in, thd_in = by_label["Megatron-Bridge in-batch, thd_static"], by_label["Megatron-Bridge in-batch, thd"]
    one, many = c["rows"][-2:]  # global-batch packing, thd_static: one row, up to DEFAULT_ROW_BUCKETS
    thd_global = by_label["global-batch packing, thd"]
    lines += [
        "",
        f"thd_static padding: {static_in['padding']:.1%} in Megatron-Bridge's placement (rows of micro_batch_size * "
        f"seq_length), {one['padding']:.1%} with global-batch packing's one row, {many['padding']:.1%} with its "
        f"{len(many['row_lengths'])} row{'s' if len(many['row_lengths']) > 1 else ''}; per-rank cost max/mean {thd_in['rank_imbalance']:.3f} in Megatron-Bridge's "
        f"placement, {thd_global['rank_imbalance']:.3f} (thd) and {one['rank_imbalance']:.3f} (thd_static) with "
        "global-batch packing.",
    ]
    return "\n".join(lines)


def _trainer_flops(model, state, batch_size: int) -> float | None:
    """The FLOPs Megatron-Bridge's trainer logs for the step, from the accumulators our step fed, as the
    installed trainer computes them (``upstream_line.trainer_flops``); None for a model without a Megatron
    config (HF)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "num_layers"):
        return None
    from types import SimpleNamespace

    from megatron.bridge_thd.upstream.loading import load_flop_utils
    from megatron.bridge_thd.upstream.line import trainer_flops

    return trainer_flops(load_flop_utils(), SimpleNamespace(model=config, peft=None), state, batch_size=batch_size,
                         data_parallel_size=1, dp_group=torch.distributed.group.WORLD)


def _run_layouts(model, per_sample, batches, micro_batch_size, seq_length, progress) -> dict:
    micro_batches = len(batches)
    bar = _Progress(micro_batches * (len(LAYOUT_NAMES) + 1), progress)
    results = {}
    with torch.no_grad():
        alone = []
        for batch in batches:
            alone.append(torch.cat(per_sample(model, batch)))
            bar.step("per-sample reference")
        alone = torch.cat(alone)
        for layout in LAYOUT_NAMES:
            state = minimal_state(seq_length=seq_length, micro_batch_size=micro_batch_size, packing_layout=layout)
            loss_sum, tokens, supervised_losses, seconds = 0.0, 0, [], 0.0
            for batch in batches:
                start = time.perf_counter()
                output, loss_function = forward_step(state, iter([batch]), model)
                seconds += time.perf_counter() - start
                loss, num_tokens, _ = loss_function(output)
                loss_sum += float(loss)
                tokens += int(num_tokens)
                loss_mask = loss_function.args[0]
                supervised_losses.append(output.reshape(-1)[loss_mask.reshape(-1) > 0])
                bar.step(layout)
            stats = state.bridge_thd_stats
            results[layout] = dict(
                loss=loss_sum,
                tokens=tokens,
                max_dlogp=float((torch.cat(supervised_losses) - alone).abs().max()),
                processed=sum(s.processed_tokens for s in stats),
                real=sum(int(s.real_tokens) for s in stats),
                work=sum(int(s.attention_work) for s in stats),
                padded=sum(s.padded_tokens for s in stats),
                padded_work=sum(s.padded_attention_work for s in stats),
                seconds=seconds,
                flops=_trainer_flops(model, state, micro_batches * micro_batch_size),
            )
    bar.close()
    return results


def _report(results, model, model_kind, micro_batches, micro_batch_size, seq_length) -> str:
    bshd = results["bshd"]
    forced_tokens = micro_batches * micro_batch_size * seq_length
    forced_work = micro_batches * micro_batch_size * seq_length**2
    lines = [
        f"megatron-bridge-thd demo: tiny random Qwen3-VL, {MODELS[model_kind]} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params), "
        f"{micro_batches} micro-batches x {micro_batch_size} synthetic receipts, seq_length {seq_length}",
        f"real tokens {bshd['real']}, supervised tokens {bshd['tokens']}; Megatron-Bridge's padded layout: "
        f"{bshd['padded']} token slots (batch width), {forced_tokens} when PP>1 or EP>1 force seq_length",
        "",
        "| layout | loss sum | supervised | max abs dlogp vs per-sample | token slots | attention work sum(s^2) | work vs bshd | work vs bshd@seq_length | trainer GFLOP | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, r in results.items():
        flops = "n/a" if r["flops"] is None else f"{r['flops'] / 1e9:.2f}"
        lines.append(
            f"| {layout} | {r['loss']:.4f} | {r['tokens']} | {r['max_dlogp']:.2e} | {r['processed']} | {r['work']:,} | "
            f"{r['work'] / bshd['work']:.1%} | {r['work'] / forced_work:.1%} | {flops} | {r['seconds']:.2f} |"
        )
    thd = results["thd"]
    lines += [
        "",
        f"THD skips {1 - thd['work'] / bshd['work']:.0%} of the attention work and {1 - thd['processed'] / bshd['processed']:.0%} "
        f"of the token slots of the padded batch; against a batch force-padded to seq_length {seq_length} "
        f"it skips {1 - thd['work'] / forced_work:.0%} of the attention work and {1 - thd['processed'] / forced_tokens:.0%} of the token slots.",
        f"Loss sums agree across layouts to {max(abs(r['loss'] - bshd['loss']) for r in results.values()):.2e}; "
        "thd_static runs the same row padded to a fixed length (its tail is one extra empty segment).",
    ]
    if bshd["flops"] is not None:
        lines.append(
            "trainer GFLOP: what Megatron-Bridge's trainer logs for these micro-batches (flop_utils, vision included) "
            "from what the step feeds it; without that feed it would assume micro_batch_size * seq_length tokens."
        )
    return "\n".join(lines)


def write_demo_plot(results: dict, path: str) -> str:
    """Bars of the three layouts' work on the demo batches (token slots, attention work, the
    trainer's GFLOP) and, with ``results["global_batch"]`` (:func:`placement_comparison`), a second row:
    the token slots and per-rank cost max / mean of each placement, to ``path``; returns where it went,
    or why it did not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'megatron-bridge-thd[plot]')"
    comparison = results.get("global_batch")
    layouts = [l for l in results if l != "global_batch"]
    panels = [("token slots", "processed"), ("attention work sum(s_i^2)", "work"), ("trainer GFLOP", "flops")]
    panels = [(title, key) for title, key in panels if all(results[l][key] is not None for l in layouts)]
    width = 4 * len(panels)
    figure = plt.figure(figsize=(max(width, 12), 6.8 if comparison else 3.2), layout="constrained")
    grid = figure.add_gridspec(2 if comparison else 1, 2 * len(panels))
    colors = {"bshd": "tab:gray", "thd": "tab:green", "thd_static": "tab:blue"}
    for index, (title, key) in enumerate(panels):
        axis = figure.add_subplot(grid[0, 2 * index:2 * index + 2])
        values = [results[l][key] / (1e9 if key == "flops" else 1) for l in layouts]
        bars = axis.bar(layouts, values, color=[colors.get(l, "tab:orange") for l in layouts])
        axis.bar_label(bars, labels=[f"{v:,.2f}" if key == "flops" else f"{v:,.0f}" for v in values], fontsize=8)
        axis.set_title(title)
    if comparison:
        rows = comparison["rows"]
        labels = [_short_label(r) for r in rows]
        row_colors = [("tab:gray" if r["placement"] == "in-batch" else "tab:purple") for r in rows]
        setting = f"DP {comparison['dp_size']} x {_micro_batches(comparison)} (simulated)"
        half = len(panels)
        for column, (title, key, text) in enumerate([
                (f"token slots, {setting}", "slots", lambda r: f"{r['slots']:,}\n{r['padding']:.1%} pad"),
                ("per-rank cost max / mean", "rank_imbalance", lambda r: f"{r['rank_imbalance']:.3f}")]):
            axis = figure.add_subplot(grid[1, column * half:(column + 1) * half])
            bars = axis.bar(range(len(rows)), [r[key] for r in rows], color=row_colors)
            axis.bar_label(bars, labels=[text(r) for r in rows], fontsize=7)
            axis.set_xticks(range(len(rows)), labels, fontsize=7)
            axis.set_title(title, fontsize=10)
            values = [r[key] for r in rows]
            if key == "rank_imbalance":
                bottom = min(0.95, min(values) - 0.02)
                axis.set_ylim(bottom, max(values) + 0.2 * (max(values) - bottom))
            else:
                axis.set_ylim(0, 1.2 * max(values))
    figure.suptitle("megatron-bridge-thd demo: work per layout on the demo micro-batches"
                    + ("; below, in-batch vs global-batch packing of the same samples" if comparison else ""))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per layout (default 2)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch (default 8)")
    parser.add_argument("--seq-length", type=int, default=2048, help="model.seq_length (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--plot", default="bridge_thd_demo.png",
                        help="where to write the plot of the layouts' work (default bridge_thd_demo.png; '' for none)")
    parser.add_argument("--model", choices=sorted(MODELS), default="bridge",
                        help="bridge: Megatron-Bridge's Qwen3VLModel built on the CPU (default); "
                             "hf: the Hugging Face reference")
    args = parser.parse_args(argv)
    for name in ("micro_batches", "micro_batch_size", "seq_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    progress = sys.stderr.isatty() if args.progress == "auto" else args.progress == "on"
    report, results = run_demo(args.micro_batches, args.micro_batch_size, args.seq_length, args.seed, progress,
                               args.model, return_results=True)
    print(report)
    if args.plot:
        print(write_demo_plot(results, args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
