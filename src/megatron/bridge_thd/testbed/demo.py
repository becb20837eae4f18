"""The main job (``make demo``): the replacement forward step on a tiny Qwen3-VL, three layouts.

Builds a tiny random Qwen3-VL — by default Megatron-Bridge 0.6.2's own ``Qwen3VLModel`` on the
CPU (``megatron.bridge_thd.testbed``), or with ``--model hf`` the Hugging Face reference
``ReferenceQwen3VL.tiny()`` — and synthetic receipt-like micro-batches, runs
:func:`megatron.bridge_thd.qwen3_vl_step.forward_step` in ``bshd``, ``thd`` and
``thd_static``, runs every sample alone through the same model, and prints the losses (equal),
the largest log-probability difference against the per-sample run, and the tokens and attention
work each layout spends.
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
    # Megatron-Core 0.19.2's TransformerConfig.__post_init__: Megatron-Bridge 0.6.2's Qwen3-VL
    # provider still sets the deprecated "full" CUDA-graph scope; no CUDA graph is captured here.
    warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
    # NVIDIA ModelOpt's quantization kernels (modelopt/torch/quantization/tensor_quant.py) are decorated
    # with torch.jit.script, which this torch deprecates, when Megatron's training package (loaded with
    # Megatron-Bridge's flop_utils) imports ModelOpt: nothing the demo runs uses them.
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=FutureWarning)
    # hyper_comm_grid.py: absl is optional and not installed.
    warnings.filterwarnings("ignore", message="absl.logging is not installed", category=UserWarning)
    # gpt_model.py logs a deprecation notice (GPTModel -> HybridModel) for every model it builds:
    # Megatron-Bridge 0.6.2's Qwen3VLModel is built on GPTModel; nothing for the demo's user to do.
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

from megatron.bridge_thd.qwen3_vl_step import LAYOUTS, forward_step  # noqa: E402
from megatron.bridge_thd.testbed.data import synthetic_receipt_batch  # noqa: E402
from megatron.bridge_thd.testbed.reference import ReferenceQwen3VL  # noqa: E402
from megatron.bridge_thd.testbed.standalone import init_single_process_groups, minimal_state  # noqa: E402


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
    from megatron.bridge_thd.testbed.parity import per_sample_token_losses

    losses = per_sample_token_losses(model, batch)
    keep = batch["attention_mask"]
    return [loss[batch["loss_mask"][i][keep[i]] > 0] for i, loss in enumerate(losses)]


MODELS = {
    "bridge": "Megatron-Bridge 0.6.2 Qwen3VLModel on the CPU",
    "hf": "Hugging Face Qwen3-VL reference",
}


def _demo_model(kind: str, seed: int, seq_length: int):
    """(model, per-sample reference function, context the forward runs in)."""
    if kind == "hf":
        return ReferenceQwen3VL.tiny(seed=seed), _per_sample_token_losses, contextlib.nullcontext()
    from megatron.bridge_thd.testbed.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd.testbed.stack import cpu_stack

    config = tiny_qwen3_vl_config(seq_length=seq_length)
    return build_qwen3_vl(config, seed=seed), _bridge_per_sample_token_losses, cpu_stack()


def run_demo(micro_batches: int, micro_batch_size: int, seq_length: int, seed: int, progress: bool,
             model_kind: str = "bridge", return_results: bool = False):
    """The report text (and, with ``return_results``, the per-layout figures behind it)."""
    if model_kind not in MODELS:
        raise ValueError(f"model_kind: {model_kind!r} is not one of {sorted(MODELS)}")
    init_single_process_groups()
    model, per_sample, stack = _demo_model(model_kind, seed, seq_length)
    with stack:
        results = _run_layouts(model, per_sample, micro_batches, micro_batch_size, seq_length, seed, progress)
    report = _report(results, model, model_kind, micro_batches, micro_batch_size, seq_length)
    return (report, results) if return_results else report


def _trainer_flops(model, state, batch_size: int, **override) -> float | None:
    """The FLOPs Megatron-Bridge's trainer logs for the step, from the accumulators our step fed
    (``training/utils/flop_utils.py``); None for a model without a Megatron config (HF)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "num_layers"):
        return None
    from types import SimpleNamespace

    from megatron.bridge_thd.upstream import load_flop_utils

    flop_utils = load_flop_utils()
    seqlen_sum, seqlen_sq_sum, patches, _, _ = flop_utils.resolve_global_flops_runtime_stats(
        state, data_parallel_size=1, dp_group=torch.distributed.group.WORLD
    )
    stats = dict(seqlen_sum=seqlen_sum, seqlen_squared_sum=seqlen_sq_sum, num_vision_patches=patches, **override)
    return float(flop_utils.num_floating_point_operations(SimpleNamespace(model=config, peft=None), batch_size, **stats))


def _run_layouts(model, per_sample, micro_batches, micro_batch_size, seq_length, seed, progress) -> dict:
    batches = [synthetic_receipt_batch(micro_batch_size, seed=seed + k) for k in range(micro_batches)]
    bar = _Progress(micro_batches * (len(LAYOUTS) + 1), progress)
    results = {}
    with torch.no_grad():
        alone = []
        for batch in batches:
            alone.append(torch.cat(per_sample(model, batch)))
            bar.step("per-sample reference")
        alone = torch.cat(alone)
        for layout in LAYOUTS:
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
    trainer's GFLOP) to ``path``; returns where it went, or why it did not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'megatron-bridge-thd[plot]')"
    layouts = list(results)
    panels = [("token slots", "processed"), ("attention work sum(s_i^2)", "work"), ("trainer GFLOP", "flops")]
    panels = [(title, key) for title, key in panels if all(results[l][key] is not None for l in layouts)]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    colors = {"bshd": "tab:gray", "thd": "tab:green", "thd_static": "tab:blue"}
    for axis, (title, key) in zip(axes, panels):
        values = [results[l][key] / (1e9 if key == "flops" else 1) for l in layouts]
        bars = axis.bar(layouts, values, color=[colors.get(l, "tab:orange") for l in layouts])
        axis.bar_label(bars, labels=[f"{v:,.2f}" if key == "flops" else f"{v:,.0f}" for v in values], fontsize=8)
        axis.set_title(title)
    figure.suptitle("megatron-bridge-thd demo: work per layout on the demo micro-batches")
    figure.tight_layout()
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
                        help="bridge: Megatron-Bridge 0.6.2's Qwen3VLModel built on the CPU (default); "
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
