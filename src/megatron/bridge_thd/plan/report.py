"""The planner's printed table (markdown) for a :class:`~megatron.bridge_thd.plan.estimate.Plan`."""

from __future__ import annotations

from megatron.bridge_thd.plan.estimate import Plan

__all__ = ["format_plan", "plan_table", "plan_summary"]

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
        f"{s.gpu.memory_bytes / 1e9:.0f} GB), assumed MFU {s.mfu:.0%}, fixed overhead {s.overhead_s * 1e3:.0f} ms/step",
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


def format_plan(p: Plan) -> str:
    """The header, :func:`plan_table` and :func:`plan_summary`."""
    return "\n".join(_header(p) + [plan_table(p), "", plan_summary(p)])
