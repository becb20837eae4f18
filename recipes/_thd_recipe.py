"""What the recipe scripts share: a Megatron-Bridge recipe config, our packing flags, our step, and a
tiny CPU mode that runs the same code path on this machine (only model size and device differ).

GPU node (the recipe as shipped, with Transformer Engine and hub access)::

    torchrun --nproc-per-node 8 recipes/qwen3_vl_8b_cord_v2_thd.py --layout thd [--report run.json]

Any machine, no GPU (tiny Qwen3-VL, or tiny Qwen3.5-VL for the Qwen3.5-VL recipe, a local cord_v2-shaped
dataset and processor, gloo ranks)::

    python recipes/qwen3_vl_8b_cord_v2_thd.py --cpu-tiny --layout thd --train-iters 4
    python recipes/qwen35_vl_2b_cord_v2_thd.py --cpu-tiny --layout thd --train-iters 4

``--layout megatron_bridge`` runs Megatron-Bridge's own ``qwen3_vl_step`` on the recipe as shipped
(the padded baseline, no ``configure``). ``--global-batch-packing MODEL`` turns global-batch packing on
with MODEL's cost (a planner preset, a ``config.json``, or ``tokens`` for VERL's proxy; docs/batching.md);
``--cp-per-sample TOKENS`` a CP size per sample at TOKENS tokens per rank (docs/cp-per-sample.md, ``--layout thd``); both
set ``ddp.average_in_collective=False``, which per-token loss needs and the recipes set True. ``--report`` writes the per-iteration records (loss,
FLOPs, tokens, seconds, peak memory) as JSON; docs/megatron-bridge-on-cpu.md.
"""

import argparse
import importlib
import json
import os

LAYOUT_CHOICES = ["thd", "thd_static", "bshd", "megatron_bridge"]


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=LAYOUT_CHOICES, default="thd")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the recipe's (CPU mode: 2)")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the recipe's (CPU mode: 512)")
    parser.add_argument("--train-iters", type=int, default=None, help="default: the recipe's (CPU mode: 4)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default: the recipe's (CPU mode: micro-batch size x ranks x 2)")
    parser.add_argument("--eval-iters", type=int, default=None,
                        help="default: the recipe's (its validation and test steps per evaluation)")
    parser.add_argument("--eval-interval", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--report", default=None,
                        help="write the per-iteration records here (JSON; on GPUs one file per rank, PATH.rank<r>.json)")
    parser.add_argument("--global-batch-packing", default=None, metavar="MODEL",
                        help="place each step's samples across DP ranks and micro-batches, balanced on MODEL's cost "
                        "(planner preset such as qwen3-vl-8b, a config.json, or 'tokens'); not with "
                        "--layout bshd / megatron_bridge")
    parser.add_argument("--cp-per-sample", type=int, default=None, metavar="TOKENS",
                        help="a CP size per sample, at most TOKENS tokens of a sample per rank (docs/cp-per-sample.md); "
                        "--layout thd only")
    parser.add_argument("--cpu-tiny", action="store_true", help="run on this CPU: tiny model, local data, gloo")
    parser.add_argument("--nproc", type=int, default=2, help="CPU mode: data-parallel gloo ranks")
    parser.add_argument("--workdir", default=None, help="CPU mode: where data, processor and checkpoints go")
    args = parser.parse_args(argv)
    if args.global_batch_packing is not None and args.layout in ("bshd", "megatron_bridge"):
        parser.error(f"--global-batch-packing: needs --layout thd or thd_static, not {args.layout!r}")
    if args.cp_per_sample is not None and args.layout != "thd":
        parser.error(f"--cp-per-sample: needs --layout thd, not {args.layout!r}")
    return args


def global_batch_setting(model):
    """``GlobalBatchPacking``'s keywords for ``--global-batch-packing MODEL`` (None: off)."""
    if model is None:
        return None
    return {"cost_model": None if model == "tokens" else model}


def config(base_config, layout: str, micro_batch_size=None, seq_length=None, train_iters=None,
           global_batch_packing=None, global_batch_size=None, cp_per_sample=None):
    """``base_config()`` with the given sizes; for our layouts, packing set by ``configure`` (in-batch
    packing deferred to our step, the dataset's 2D mask, variable_seq_lengths under PP, HybridEP
    padding; global-batch packing's keywords and ``cp_per_sample``'s tokens per rank when given; contradictions
    refused)."""
    from megatron.bridge_thd.configure import configure

    cfg = base_config()
    if seq_length is not None:
        cfg.model.seq_length = cfg.dataset.seq_length = seq_length
    if micro_batch_size is not None:
        cfg.train.micro_batch_size = micro_batch_size
    if global_batch_size is not None:
        cfg.train.global_batch_size = global_batch_size
    if train_iters is not None:
        cfg.train.train_iters = train_iters
    if layout == "megatron_bridge":
        return cfg
    if global_batch_packing is None and cp_per_sample is None:
        return configure(cfg, layout=layout)
    from megatron.bridge_thd.settings import GlobalBatchPacking

    cfg.ddp.average_in_collective = False  # per-token loss (configure sets it) needs DDP to sum
    placement = GlobalBatchPacking(**global_batch_packing) if global_batch_packing is not None else None
    return configure(cfg, layout=layout, global_batch_packing=placement, cp_per_sample=cp_per_sample)


def _write(report, path):
    if path:
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1)


def run_cpu_tiny(recipe_name: str, args) -> dict:
    import tempfile

    from megatron.bridge_thd_testbed.training import run_on_cpu

    settings = dict(train_iters=args.train_iters or 4, micro_batch_size=args.micro_batch_size or 2,
                    seq_length=args.seq_length or 512)
    settings["global_batch_size"] = args.global_batch_size or settings["micro_batch_size"] * args.nproc * 2
    if args.global_batch_packing is not None:
        settings["global_batch_packing"] = global_batch_setting(args.global_batch_packing)
    if args.cp_per_sample is not None:
        settings["cp_per_sample"] = args.cp_per_sample
    # The recipe's loader workers, pinned memory and evaluation stay; only what is given changes.
    if args.eval_iters is not None:
        settings["eval_iters"] = args.eval_iters
    if args.eval_interval is not None:
        settings["eval_interval"] = args.eval_interval
    workdir = args.workdir or tempfile.mkdtemp(prefix="bridge_thd_cpu_tiny_")
    ranks = run_on_cpu([(args.layout, recipe_name, args.layout, settings)], workdir=workdir, world_size=args.nproc)
    report = {"recipe": recipe_name, "layout": args.layout, "cpu_tiny": True, "settings": settings,
              "global_batch_packing": args.global_batch_packing, "cp_per_sample": args.cp_per_sample,
              "ranks": [rank[args.layout] for rank in ranks]}
    _write(report, args.report)
    for row in ranks[-1][args.layout]["iterations"]:
        print(f"iteration {row['iteration']:3d} | lm loss {row['loss']:.6f} | model TFLOPs {row['flops'] / 1e12:.6f} "
              f"| tokens {row['flops_tokens']} | {row['seconds'] * 1000:.1f} ms")
    return report


def main(recipe_module: str, recipe_name: str, argv=None):
    args = parse(argv)
    if args.cpu_tiny:
        return run_cpu_tiny(recipe_name, args)
    import torch
    from megatron.bridge.training.finetune import finetune

    from megatron.bridge_thd.reporting import counting_step, iteration_recorder, step_for

    base_config = getattr(importlib.import_module(recipe_module), recipe_name)
    cfg = config(base_config, args.layout, args.micro_batch_size, args.seq_length, args.train_iters,
                 global_batch_setting(args.global_batch_packing), args.global_batch_size, args.cp_per_sample)
    if args.eval_iters is not None:
        cfg.validation.eval_iters = args.eval_iters
    if args.eval_interval is not None:
        cfg.validation.eval_interval = args.eval_interval
    recorder = iteration_recorder()
    report = {"recipe": recipe_name, "layout": args.layout, "cpu_tiny": False, "oom": False,
              "global_batch_packing": args.global_batch_packing, "cp_per_sample": args.cp_per_sample,
              "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size,
              "seq_length": cfg.model.seq_length, "world_size": int(os.environ.get("WORLD_SIZE", "1"))}
    counts = []
    try:
        finetune(cfg, forward_step_func=counting_step(step_for(args.layout), counts), callbacks=[recorder])
    except torch.OutOfMemoryError:
        report["oom"] = True
    report.update(iterations=recorder.rows, micro_batches=counts, rank=int(os.environ.get("RANK", "0")))
    if args.report:  # every rank: its own real tokens; the last pipeline stage also holds the loss
        _write(report, f"{args.report}.rank{report['rank']}.json")
    return report
