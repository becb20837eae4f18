"""``bridge-thd scan``: a Megatron-Bridge recipe's dataset, measured sample by sample through its own provider,
processor and collate, written as the planner's lengths file, with a summary. This module is the command: its
options (:func:`build_parser`), :func:`run`, :func:`main` and the planner's prediction; what runs is
:mod:`megatron.bridge_thd.plan.scan`'s docstring. Reasoning: docs/scan.md.

Where it runs: the CPU build's scan environment (``megatron.bridge_thd_cpu.scan_environment``), the one entry of the
CPU build the planner reaches, imported by :func:`run` alone: Megatron-Bridge importable whole on a machine without
Transformer Engine, and with ``--cpu-tiny`` its local cord_v2-shaped data and tiny processor, the hub offline.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

from megatron.bridge_thd.batching.sizes import default_cache_dir
from megatron.bridge_thd.plan.plan_command import build_parser as plan_parser
from megatron.bridge_thd.plan.plan_command import run as plan_run
from megatron.bridge_thd.plan.scan.cache import scan_dataset
from megatron.bridge_thd.plan.scan.lengths_file import write_lengths
from megatron.bridge_thd.plan.scan.lengths_summary import summary
from megatron.bridge_thd.plan.scan.recipe import (
    RECIPE_MODULE, SPLITS, _gpus_of, _preset_for, _processor_facts, build_split, recipe_config, recipe_setup)
from megatron.bridge_thd.rules.setup import Setup

__all__ = ["CPU_TINY_RECIPE", "build_parser", "run", "main"]

CPU_TINY_RECIPE = "qwen3_vl_8b_sft_2gpu_h100_bf16_config"


def _positive(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
        return value

    parse.__name__ = name
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-thd scan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None,
                   help=f"a Megatron-Bridge recipe function: a name in {RECIPE_MODULE} (e.g. {CPU_TINY_RECIPE}) or "
                   f"package.module:function; required unless --cpu-tiny (default there: {CPU_TINY_RECIPE})")
    p.add_argument("--split", choices=SPLITS, default="train", help="which dataset of the recipe (default train)")
    p.add_argument("--seq-length", type=_positive("seq_length"), default=None,
                   help="the length the summary and the planner cut at (default: the recipe's dataset.seq_length)")
    p.add_argument("--out", default="lengths.json", help="the lengths file (default lengths.json; .csv: CSV)")
    p.add_argument("--cache-dir", default=None,
                   help="where scans are cached (default $XDG_CACHE_HOME/bridge_thd/sizes, global-batch packing's)")
    p.add_argument("--workers", type=_positive("workers"), default=max(1, min(8, (os.cpu_count() or 2) // 2)),
                   help="loader worker processes that collate (default: half the CPUs, at most 8)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", help="planner preset for the prediction (default: the one whose hub repository is "
                       "the recipe's hf_processor_path)")
    model.add_argument("--hf-config", help="a Hugging Face config.json for the prediction instead of a preset")
    p.add_argument("--gpus", type=_positive("gpus"), default=None,
                   help="GPUs of the run for the prediction (default: the recipe name's N in '_Ngpu_', else 8)")
    p.add_argument("--gpu", default="h100-sxm", help="GPU for the planner's time model (bridge-thd plan --list-models)")
    p.add_argument("--no-plan", action="store_true", help="skip the planner's prediction")
    p.add_argument("--cpu-tiny", action="store_true",
                   help="on this machine: the test bed's local cord_v2-shaped data and tiny Qwen3-VL processor "
                   "(patch 16, as Qwen3-VL) in place of the hub's, offline")
    p.add_argument("--workdir", default=None,
                   help="--cpu-tiny: where its data and processor are written once (default: "
                   "$XDG_CACHE_HOME/bridge_thd/cpu-tiny)")
    p.add_argument("--cpu-tiny-samples", type=_positive("cpu_tiny_samples"), default=64,
                   help="--cpu-tiny: train rows of the local data (default 64, as the CPU runs; every fourth is long)")
    return p


class _Progress:
    """A stderr progress line: rewritten in place on a terminal, else one line per tenth."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.next_tenth = time.perf_counter(), 0

    def __call__(self, done: int, total: int) -> None:
        rate = done / max(1e-9, time.perf_counter() - self.start)
        line = f"bridge-thd scan: {done}/{total} distinct samples ({done / total:.0%}, {rate:.1f}/s)"
        if self.stream.isatty():
            self.stream.write("\r" + line + ("\n" if done == total else ""))
        elif done * 10 >= self.next_tenth * total or done == total:
            self.stream.write(line + "\n")
            self.next_tenth = done * 10 // total + 1
        self.stream.flush()


def _prediction(args, setup: Setup, lengths: Path, seq_length: int) -> str:
    """The planner on the lengths file, with the recipe's micro / global batch size and parallel layout (``setup``:
    the recipe's facts, :func:`~.recipe.recipe_setup`): the lines ``bridge-thd plan`` prints, after the command that
    prints them."""
    if args.hf_config:
        model = ["--hf-config", str(Path(args.hf_config).resolve())]
    else:
        name = args.model or _preset_for(setup.processor_path)
        if name is None:
            return (f"planner: no preset has the recipe's processor {setup.processor_path!r} as its hub repository; "
                    "give --model PRESET or --hf-config config.json for a prediction")
        model = ["--model", name]
    gpus = args.gpus or _gpus_of(args.recipe) or 8
    argv = model + ["--lengths", str(lengths), "--seq-length", str(seq_length),
                    "--micro-batch-size", str(setup.micro_batch_size),
                    "--global-batch-size", str(setup.global_batch_size),
                    "--tp", str(setup.tp), "--pp", str(setup.pp), "--cp", str(setup.cp), "--ep", str(setup.ep),
                    "--gpus", str(gpus), "--gpu", args.gpu]
    if not setup.model.sequence_parallel:
        argv.append("--no-sequence-parallel")
    command = "bridge-thd plan " + " ".join(argv)
    try:
        return f"planner ({command}):\n\n" + plan_run(plan_parser().parse_args(argv))
    except ValueError as error:
        return f"planner ({command}): refused: {error}"


def run(args) -> str:
    """The scan (:mod:`megatron.bridge_thd.plan.scan`'s docstring): the summary text; writes ``args.out``."""
    if args.recipe is None:
        if not args.cpu_tiny:
            raise ValueError("--recipe: required (a Megatron-Bridge recipe function such as "
                             f"{CPU_TINY_RECIPE}), unless --cpu-tiny")
        args.recipe = CPU_TINY_RECIPE
    out = Path(args.out).resolve()
    cache_dir = Path(args.cache_dir).resolve() if args.cache_dir else None
    workdir = None
    if args.cpu_tiny:
        workdir = Path(args.workdir).resolve() if args.workdir else default_cache_dir().parent / "cpu-tiny"
    # The CPU build (optional beside the runtime: Megatron-Bridge whole without Transformer Engine, --cpu-tiny's data).
    from megatron.bridge_thd_cpu.scan_environment import cpu_tiny_processor, scan_environment

    with scan_environment(cpu_tiny_workdir=workdir):
        cfg = recipe_config(args.recipe)
        dataset_config = cfg.dataset
        setup = recipe_setup(cfg)
        seq_length = args.seq_length or setup.seq_lengths[0] or setup.seq_lengths[1]
        processor = setup.processor_path
        if args.cpu_tiny:
            if not hasattr(dataset_config, "hf_processor_path"):  # duck: only a Hugging Face dataset has a processor
                raise ValueError(f"--cpu-tiny: {args.recipe}'s dataset is a {type(dataset_config).__name__}; the "
                                 "local cord_v2 data replaces a DirectHFSFTDatasetConfig's hub data and processor only")
            processor = dataset_config.hf_processor_path = cpu_tiny_processor(workdir, args.cpu_tiny_samples)
        dataset = build_split(cfg, args.split)
        placeholder_ids, merge = _processor_facts(dataset)
        scan = scan_dataset(dataset, placeholder_ids=placeholder_ids, merge=merge or 2, num_workers=args.workers,
                            cache_dir=cache_dir, progress=_Progress())
        source = {"recipe": args.recipe, "split": args.split, "dataset": type(dataset_config).__name__,
                  "processor": processor, "cpu_tiny": bool(args.cpu_tiny)}
        write_lengths(scan, out, source)
        where = "local cord_v2-shaped data, tiny processor" if args.cpu_tiny else f"processor {setup.processor_path}"
        head = [f"bridge-thd scan: {args.recipe}, {args.split} split ({type(dataset_config).__name__}, {where})",
                f"{len(scan.samples):,} distinct samples ({scan.total:,} dataset indices the run draws from); "
                f"spatial merge {scan.merge}" + ("" if merge else " (assumed: the processor does not say)"),
                (f"read from the cache {scan.cached} (no sample collated again)" if scan.from_cache else
                 f"scanned in {scan.seconds:.1f} s by {scan.workers} worker process(es); cached at {scan.cached}"),
                f"wrote {out}", "", ""]
        text = "\n".join(head) + summary(scan, seq_length)
        if not args.no_plan:
            text += "\n\n" + _prediction(args, setup, out, seq_length)
    return text


def main(argv: list[str] | None = None) -> int:
    """Entry point (``bridge-thd scan ...``); returns the exit status (0 ok, 2 bad input with a one-line error on
    stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    try:
        # What Megatron-Bridge prints or logs to stdout while it imports and builds goes to stderr: stdout holds
        # the summary alone.
        with contextlib.redirect_stdout(sys.stderr):
            text = run(args)
    except ValueError as error:
        print(f"bridge-thd scan: error: {error}", file=sys.stderr)
        return 2
    print(text, file=stdout)
    return 0
