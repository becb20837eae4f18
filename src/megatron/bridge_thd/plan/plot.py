"""PNG of a plan: the length histogram with ``seq_length`` marked, and per-layout bars of token
slots, FLOPs and peak memory per GPU. matplotlib is optional (``pip install matplotlib``)."""

from __future__ import annotations

from pathlib import Path

from megatron.bridge_thd.plan.estimate import Plan

__all__ = ["write_plot"]


def write_plot(p: Plan, path: str | Path) -> Path:
    """Write the figure to ``path`` (PNG) and return it.

    Raises:
        ImportError: matplotlib is missing (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("bridge-thd plan: the PNG needs matplotlib; pip install matplotlib "
                          "(or megatron-bridge-thd[plot]); the table above is complete without it") from error
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(p.layouts)
    colors = ["tab:gray", "tab:green", "tab:blue"][: len(names)]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    axes[0].hist(p.samples.tokens, bins=40, color="tab:blue")
    axes[0].axvline(p.settings.seq_length, color="tab:red", linestyle="--", label=f"seq_length {p.settings.seq_length}")
    axes[0].set(title="sample lengths (LLM tokens)", xlabel="tokens", ylabel="samples")
    axes[0].legend()
    panels = [
        ("token slots / micro-batch", [e.slots for e in p.layouts.values()], "slots"),
        ("TFLOP / micro-batch (fwd+bwd)", [e.flops.total / 1e12 for e in p.layouts.values()], "TFLOP"),
        ("peak memory / GPU (GiB)", [e.memory_peak / 2**30 for e in p.layouts.values()], "GiB"),
    ]
    for ax, (title, values, unit) in zip(axes[1:], panels):
        ax.bar(names, values, color=colors)
        ax.set(title=title, ylabel=unit)
        for x, v in enumerate(values):
            ax.text(x, v, f"{v:,.0f}" if v >= 100 else f"{v:.1f}", ha="center", va="bottom")
    axes[3].axhline(p.settings.gpu.memory_bytes / 2**30, color="tab:red", linestyle="--", label=p.settings.gpu.name)
    axes[3].legend()
    par = p.settings.parallel
    fig.suptitle(f"{p.spec.name}: seq_length {p.settings.seq_length}, MBS {p.settings.micro_batch_size}, "
                 f"TP{par.tp} CP{par.cp} PP{par.pp} EP{par.ep} on {par.gpus} GPUs; thd speed-up {p.speedup():.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
