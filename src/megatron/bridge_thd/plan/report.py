"""The planner's printed tables (markdown) for a :class:`~megatron.bridge_thd.plan.estimate.Plan` and, with
and without global-batch packing, a :class:`~megatron.bridge_thd.plan.balance.BalancePlan`."""

from __future__ import annotations

from megatron.bridge_thd.plan.estimate import Plan

__all__ = ["format_plan", "plan_table", "plan_summary", "balance_table", "balance_summary", "graph_memory_summary",
           "format_balance"]

GIB = 2**30


def _header(p: Plan) -> list[str]:
    s, par = p.settings, p.settings.parallel
    return [
        f"bridge-thd plan: {p.spec.name} ({p.spec.hf_repo}), {p.samples.source}",
        f"seq_length {s.seq_length}, micro_batch_size {s.micro_batch_size}, {s.micro_batches_per_step} micro-batch(es)"
        f"/step, {par.gpus} GPUs = TP{par.tp} x CP{par.cp} x PP{par.pp} x DP{par.dp}, EP{par.ep}, "
        f"SP {'on' if par.sp else 'off'}; thd slot alignment {par.thd_alignment()}, bshd width multiple "
        f"{par.bshd_divisor()}{' (forced to seq_length: PP>1 or EP>1)' if par.bshd_forced() else ''}",
        f"GPU {s.gpu.name} ({s.gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16, {s.gpu.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"{s.gpu.memory_bytes / 1e9:.0f} GB); step times from the time model ({s.time.source}; a model's figures, "
        f"fitted: {', '.join(s.time.fitted)}; docs/time-model.md)"
        + (f", extra overhead {s.overhead_s * 1e3:.0f} ms/step" if s.overhead_s else ""),
        f"real tokens per micro-batch {p.real_tokens:,.0f} (truncated by seq_length: {p.truncated_tokens} tokens in all); "
        f"model states {p.state_bytes / GIB:.1f} GiB/GPU + {s.reserved_bytes / GIB:.1f} GiB reserved",
        "",
    ]


def plan_table(p: Plan) -> str:
    """Markdown table: one row per layout, with per micro-batch means and per-GPU peaks."""
    lines = [
        "| layout | token slots/µb | padding | attn work Σs² | TFLOP/µb (linear + attn + ViT) | MoE routed/µb "
        "| act GiB/GPU | total GiB/GPU | step ms | samples/s | vs bshd |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = p.layouts["bshd"]
    for name, e in p.layouts.items():
        f = e.flops
        lines.append(
            f"| {name} | {e.slots:,.0f} | {1 - p.real_tokens / e.slots:.0%} | {e.attention_work:.3g} "
            f"| {f.total / 1e12:.1f} ({f.linear / 1e12:.1f} + {f.attention_core / 1e12:.1f} + {f.vision / 1e12:.1f}) "
            f"| {e.routed:.3g} | {e.activation_peak / GIB:.1f} | {e.memory_peak / GIB:.1f}{'' if e.fits else ' OOM'} "
            f"| {e.step_s * 1e3:.0f} | {e.samples_per_s:.1f} | {base.step_s / e.step_s:.2f}x |"
        )
    return "\n".join(lines)


def plan_summary(p: Plan) -> str:
    """One sentence: what ``thd`` saves over ``bshd`` and the predicted speed-up."""
    base, thd = p.layouts["bshd"], p.layouts["thd"]
    return (f"thd vs bshd: {1 - thd.slots / base.slots:.0%} fewer token slots, "
            f"{1 - thd.attention_work / base.attention_work:.0%} less attention work, "
            f"{1 - thd.flops.total / base.flops.total:.0%} fewer FLOPs; predicted speed-up {p.speedup():.2f}x.")


def format_plan(p: Plan, balance=None) -> str:
    """The header, :func:`plan_table` and :func:`plan_summary`; with ``balance`` (a
    :class:`~megatron.bridge_thd.plan.balance.BalancePlan`), :func:`format_balance` after them."""
    lines = _header(p) + [plan_table(p), "", plan_summary(p)]
    if balance is not None:
        lines += ["", format_balance(balance)]
    return "\n".join(lines)


_PLACEMENT_NAMES = {"in-batch": "in-batch (Megatron-Bridge)", "packed": "global-batch packing"}


def balance_table(b) -> str:
    """Markdown table: per layout, in-batch placement and global-batch packing (one row each)."""
    lines = [
        "| layout | placement | row slots | token slots/µb | padding | per-rank cost max/mean | per-rank time max/mean "
        "| act GiB/GPU (peak) | step ms (slowest rank) | samples/s | vs in-batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for layout, placements in b.layouts.items():
        base = placements["in-batch"]
        for name, e in placements.items():
            if e.refused:
                lines.append(f"| {layout} | {_PLACEMENT_NAMES[name]} | — | — | — | — | — | — | — | — | refused: {e.refused} |")
                continue
            row = f"{e.row_length:,}" if e.row_length is not None else "—"
            if layout == "thd_static" and name == "packed" and len(b.static_rows) > 1:
                row = f"{len(b.static_rows)} rows, longest {e.row_length:,}"
            lines.append(
                f"| {layout} | {_PLACEMENT_NAMES[name]} | {row} | {e.slots:,.0f} | {e.padding:.1%} "
                f"| {e.rank_cost_imbalance:.3f} | {e.rank_time_imbalance:.3f} | {e.activation_peak / GIB:.1f} "
                f"| {e.step_s * 1e3:.1f} | {e.samples_per_s:.1f} | {base.step_s / e.step_s:.2f}x |")
    return "\n".join(lines)


def balance_summary(b) -> str:
    """One sentence per packable layout: step time and padding without and with the policy."""
    parts = []
    for layout, placements in b.layouts.items():
        before, after = placements["in-batch"], placements["packed"]
        if after.refused:
            continue
        parts.append(f"{layout}: step {before.step_s * 1e3:.1f} -> {after.step_s * 1e3:.1f} ms "
                     f"({b.speedup(layout):.2f}x), padding {before.padding:.1%} -> {after.padding:.1%}, per-rank cost "
                     f"max/mean {before.rank_cost_imbalance:.3f} -> {after.rank_cost_imbalance:.3f}")
    return "Global-batch packing vs in-batch placement: " + "; ".join(parts) + "."


def graph_memory_summary(b) -> str:
    """One sentence: the packed ``thd_static`` rows as Megatron-Core's local CUDA graphs of the decoder layers
    (:func:`~megatron.bridge_thd.plan.memory.cuda_graph_bytes`, a model), against one graph of the longest row."""
    g = b.graph_memory
    if g is None:
        return f"CUDA graphs of the thd_static rows: not modelled ({b.graph_memory_note})."
    k = len(g.rows)
    text = (f"CUDA graphs of the decoder layers (Megatron-Core's local manager, PP=1; a model, not measured: "
            f"docs/planner.md): one graph of the longest row holds {g.layers[-1] / GIB:.1f} GiB/GPU of activations")
    if k == 1:
        return text + "."
    return (text + f"; the {k} rows' graphs in one shared pool (its global mempool) {g.shared / GIB:.1f} GiB/GPU "
            f"(+{(g.shared - g.layers[-1]) / GIB:.1f} GiB: the shorter rows' static buffers), in separate pools at most "
            f"{g.separate / GIB:.1f} GiB/GPU. Today the runtime captures CUDA graphs of one row only "
            "(row_buckets 1: Megatron-Core stops at a row shape first seen after the first iteration).")


def format_balance(b) -> str:
    """The with / without global-batch packing section: its header, :func:`balance_table` and
    :func:`balance_summary`."""
    s, par = b.settings, b.settings.parallel
    over = " (above micro_batch_size * seq_length: more memory than the recipe planned)" if b.static_row > b.capacity else ""
    if len(b.static_rows) > 1:
        use = ", ".join(f"{row:,} ({share:.0%})" for row, share in zip(b.static_rows, b.static_row_use))
        rows = (f"rows {use} slots (share of the micro-batches), chosen from these steps as the runtime chooses them "
                f"(row_buckets {b.row_buckets}: each micro-batch takes the shortest row that holds it; every step fits "
                f"the longest{over})")
    else:
        rows = f"{b.static_row:,} slots, chosen from these steps{over} (row_buckets {b.row_buckets})"
    header = [
        f"Global-batch packing (docs/batching.md): global batch {b.global_batch_size} = DP{par.dp} x "
        f"{b.num_micro_batches} micro-batch(es) x micro_batch_size {s.micro_batch_size}; {b.steps} step(s) of "
        f"consecutive samples; cost per sample: Megatron-Bridge's FLOPs terms ({b.cost_name})",
        f"thd_static row: in-batch micro_batch_size * seq_length = {b.capacity:,} slots; global-batch packing {rows}. "
        "Step time: the slowest DP rank's summed micro-batch times (the time model, docs/time-model.md), averaged over the steps",
        "",
    ]
    return "\n".join(header + [balance_table(b), "", balance_summary(b), graph_memory_summary(b)])
