"""``bridge-thd plan``: what packing buys for a model, a length distribution and a parallel layout.

The command's options (:func:`build_parser`) and what it prints for them (:func:`run`); ``bridge-thd`` itself
(:mod:`.cli`) dispatches here, and ``bridge-thd scan`` (:mod:`.scan`) runs :func:`run` on the lengths file it writes.

Examples::

    bridge-thd plan --model qwen3-vl-8b --seq-length 8192 --micro-batch-size 4 --tp 2 --png plan.png
    bridge-thd plan --model qwen3-vl-8b --global-batch-size 64     # with / without global-batch packing
    bridge-thd plan --model qwen3-vl-8b --global-batch-size 64 --row-buckets 1   # one thd_static row
    bridge-thd plan --hf-config config.json --lengths lengths.csv --seq-length 4096 --tp 4 --pp 2
    bridge-thd plan --calibrate
    python -m megatron.bridge_thd.plan --list-models
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.presets import PRESETS, get_preset, spec_from_hf_config
from megatron.bridge_thd.cost.step_time import (
    FITTED, MACHINES, get_machine, load_time_parameters, time_parameters_to_dict)
from megatron.bridge_thd.plan.answer import best_first, cp_per_sample_candidates, format_candidates, rank_candidates
from megatron.bridge_thd.plan.balance import balance_plan, check_row_buckets, micro_batches_per_rank
from megatron.bridge_thd.plan.calibrate import calibration_report
from megatron.bridge_thd.plan.cp_per_sample import compare_cp, format_cp_comparison
from megatron.bridge_thd.plan.estimate import PlanSettings, plan
from megatron.bridge_thd.plan.fit_log import fit_run_log, format_log_fit
from megatron.bridge_thd.plan.layouts import LAYOUT_ORDER, Parallel
from megatron.bridge_thd.plan.plot import write_plot
from megatron.bridge_thd.plan.report import format_plan
from megatron.bridge_thd.plan.roofline import GPUS, get_gpu
from megatron.bridge_thd.cost.sample_lengths import load_lengths
from megatron.bridge_thd.plan.samples import receipt_lengths
from megatron.bridge_thd.plan.text_mix import text_mix_lengths
from megatron.bridge_thd.plan.video_mix import video_mix_lengths
from megatron.bridge_thd.rules.registry import PLANNER
from megatron.bridge_thd.rules.rows import row_buckets as runtime_row_buckets
from megatron.bridge_thd.rules.run import problems
from megatron.bridge_thd.rules.setup import ModelFacts, Setup
from megatron.bridge_thd.run_log import read_run_log
from megatron.bridge_thd.settings import DEFAULT_ROW_BUCKETS, GlobalBatchPacking, PackingSettings

__all__ = ["build_parser", "list_presets", "run", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bridge-thd plan", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="bridge-thd --help: every command (bridge-thd scan: the lengths file of a Megatron-Bridge "
                                "recipe's dataset)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", default="qwen3-vl-8b", help="preset name (--list-models)")
    model.add_argument("--hf-config", help="a Hugging Face config.json instead of a preset")
    p.add_argument("--list-models", action="store_true", help="print the presets and GPUs and exit")
    p.add_argument("--lengths", help="JSON / CSV per-sample lengths file: text_tokens, images, optional image_end "
                   "(default: synthetic receipts)")
    p.add_argument("--num-samples", type=int, default=1024, help="synthetic receipts to draw (default 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seq-length", type=int, default=2048,
                   help="model.seq_length (default 2048); refused if truncating a sample to it would cut an image, "
                   "as the step refuses it")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step per DP replica (default 1, or --global-batch-size / "
                   "(micro_batch_size * DP))")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step, a multiple of micro_batch_size * DP (default micro_batch_size * "
                   "micro-batches * DP); the steps are consecutive global batches of the samples, placed with and "
                   "without global-batch packing (docs/batching.md)")
    p.add_argument("--row-buckets", type=int, default=None, metavar="K",
                   help=f"most thd_static rows global-batch packing may use (the runtime's "
                   f"global_batch_packing.row_buckets; default as there: {DEFAULT_ROW_BUCKETS}, or 1 where only "
                   "one row shape can run, as with fixed pipeline shapes); each micro-batch takes the shortest that "
                   "holds it")
    for name in ("tp", "cp", "pp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8, help="total GPUs (DP = gpus / (tp*cp*pp))")
    p.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    p.add_argument("--gpu", default="h100-sxm", help="GPU of the time model and the memory check (--list-models)")
    p.add_argument("--time-params", metavar="JSON",
                   help="the time model's parameters measured on your GPU (benchmarks/gpu_calibrate.py writes them); "
                   "default: published rates and the parameters fitted on published step times (docs/time-model.md)")
    p.add_argument("--fit-log", metavar="JSONL",
                   help="fit the time model's fixed costs on a run log (PackingSettings.run_log: one line per "
                   "iteration) and say how well it predicted that run (docs/time-model.md)")
    p.add_argument("--write-params", metavar="JSON", help="with --fit-log: write the fitted parameters here "
                   "(the file --time-params reads)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="extra fixed per-step overhead beyond the time model's (default 0)")
    p.add_argument("--rank", action="store_true",
                   help="every layout, placement, micro-batch size, static CP size and thd_static row buckets that fits, "
                   "by predicted samples/s, with step time and peak memory per GPU (needs --global-batch-size; with "
                   "--cp-per-sample TOKENS, CP per sample too)")
    p.add_argument("--png", help="write the figure here (needs matplotlib)")
    p.add_argument("--calibrate", action="store_true",
                   help="the time model against published GPU measurements: the fit table and the held-out tables, "
                   "predicted beside published (docs/time-model.md)")
    p.add_argument("--cp-per-sample", type=int, default=None, metavar="TOKENS",
                   help="compare static CP 1, 2, 4, ... with a CP size per sample (Megatron-Core's scheduler and ours "
                   "on the time model) at TOKENS tokens of a sample per rank (Megatron-Core's max_seqlen_per_dp_cp_rank) "
                   "instead of the layouts, every way priced by the time model (docs/cp-per-sample.md); without --lengths "
                   "it draws the synthetic video mix (plan/video_mix.py)")
    p.add_argument("--text-mix", action="store_true",
                   help="with --cp-per-sample: draw the synthetic long-tailed text mix (plan/text_mix.py) instead")
    return p


def list_presets() -> str:
    """``--list-models``: the presets and the GPUs."""
    lines = ["presets:"] + [f"  {name:22s} {spec.hf_repo}" for name, spec in PRESETS.items()]
    lines += ["GPUs:"] + [f"  {g.name:10s} {g.bf16_flops / 1e12:.0f} TFLOP/s bf16, {g.hbm_bytes_per_s / 1e12:.2f} TB/s, "
                          f"{g.memory_bytes / 1e9:.0f} GB" for g in GPUS.values()]
    return "\n".join(lines)


def run(args) -> str:
    """The plan for parsed options (:func:`build_parser`): the text ``bridge-thd plan`` prints.

    Raises:
        ValueError: bad input, in one line naming the option.
    """
    spec = spec_from_hf_config(args.hf_config) if args.hf_config else get_preset(args.model)
    if args.fit_log:
        return _fit_log(args, spec)
    if args.write_params:
        raise ValueError("--write-params: only with --fit-log (the parameters it writes are the fit's)")
    if args.cp_per_sample is not None and not args.rank:
        return _cp_per_sample(args, spec)
    samples = (load_lengths(args.lengths, spec.vision.spatial_merge_size) if args.lengths
               else receipt_lengths(args.num_samples, args.seed))
    parallel = Parallel(tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, gpus=args.gpus,
                        sequence_parallel=not args.no_sequence_parallel)
    if args.ep > 1 and not spec.is_moe:
        raise ValueError(f"--ep {args.ep}: {spec.name} is a dense model (no experts); use --ep 1")
    if args.row_buckets is not None:
        check_row_buckets(args.row_buckets)
    if args.overhead_ms < 0:
        raise ValueError(f"--overhead-ms: expected >= 0, got {args.overhead_ms}")
    micro_batches = args.micro_batches
    if micro_batches is not None:
        check_int("--micro-batches", micro_batches)
    if args.global_batch_size is not None:
        implied = micro_batches_per_rank(args.global_batch_size, args.micro_batch_size, parallel.dp, len(samples))
        if micro_batches is not None and micro_batches != implied:
            raise ValueError(
                f"--global-batch-size {args.global_batch_size} and --micro-batches {micro_batches} disagree: "
                f"micro_batch_size * micro-batches * DP = {args.micro_batch_size} x {micro_batches} x {parallel.dp} = "
                f"{args.micro_batch_size * micro_batches * parallel.dp}; give one of them")
        micro_batches = implied
    settings = PlanSettings(args.seq_length, args.micro_batch_size, parallel, micro_batches or 1,
                            get_gpu(args.gpu), time_parameters(args), args.overhead_ms / 1e3)
    global_batch_size = args.global_batch_size or args.micro_batch_size * (micro_batches or 1) * parallel.dp
    if args.rank:
        return _rank(args, spec, samples, settings)
    refused, row_buckets = planner_refusals(spec, settings, global_batch_size, args.row_buckets)
    result = plan(spec, samples, settings)
    text = format_plan(result, balance_plan(spec, samples, settings, args.global_batch_size, seed=args.seed,
                                                 row_buckets=row_buckets))
    text += "".join(f"\nrefused by the step for layout {layout!r} (docs/rules.md): {problem}"
                    for layout, found in refused.items() for problem in found)
    if args.png:
        try:
            text += f"\nwrote {write_plot(result, args.png)}"
        except ImportError as error:
            text += f"\n{error}"
    return text


def _rank(args, spec, samples, settings) -> str:
    """``--rank``: every candidate that fits, best first (plan/answer.py)."""
    if args.global_batch_size is None:
        raise ValueError("--rank: give --global-batch-size (the candidates vary the micro-batch size and CP size at "
                         "a fixed global batch)")
    candidates = rank_candidates(spec, samples, settings, args.global_batch_size, seed=args.seed)
    if args.cp_per_sample is not None:
        check_int("--cp-per-sample", args.cp_per_sample, 2)
        candidates = best_first(candidates + cp_per_sample_candidates(spec, samples, settings, args.global_batch_size,
                                                                      args.cp_per_sample))
    return (f"bridge-thd plan --rank: {spec.name}, {samples.source}, {len(samples)} samples, global batch "
            f"{args.global_batch_size}, {settings.parallel.gpus} x {settings.gpu.name}, TP {settings.parallel.tp}, "
            f"PP {settings.parallel.pp}, EP {settings.parallel.ep}, seq_length {settings.seq_length}\n\n"
            + format_candidates(candidates, settings))


def _fit_log(args, spec) -> str:
    """``--fit-log JSONL``: the fixed costs fitted on a run log (plan/fit_log.py), optionally written."""
    try:
        records = read_run_log(args.fit_log)
    except FileNotFoundError:
        raise ValueError(f"--fit-log {args.fit_log}: no such file; set PackingSettings.run_log in the run") from None
    fit = fit_run_log(records, spec, get_machine(args.gpu), time_parameters(args), source=str(args.fit_log))
    text = f"bridge-thd plan --fit-log {args.fit_log}: {spec.name} on {args.gpu}\n\n" + format_log_fit(fit)
    if args.write_params:
        with open(args.write_params, "w") as handle:
            json.dump(time_parameters_to_dict(fit.params), handle, indent=1)
        text += f"\nwrote {args.write_params}: bridge-thd plan --time-params {args.write_params} ..."
    return text


def time_parameters(args):
    """The time model's parameters for ``args``: ``--time-params`` over the fitted ones, or the fitted ones."""
    get_machine(args.gpu)  # the time model knows this GPU (ValueError naming the known ones otherwise)
    return load_time_parameters(args.time_params) if args.time_params else FITTED


def _cp_per_sample(args, spec) -> str:
    """``--cp-per-sample TOKENS``: static CP against a CP size per sample by Megatron-Core's scheduler and by ours, every
    way priced by the time model (plan/cp_per_sample.py); ``--text-mix``: the synthetic text mix instead of the video
    mix."""
    check_int("--cp-per-sample", args.cp_per_sample, 2)
    if args.pp != 1 or args.cp != 1:
        raise ValueError("--cp-per-sample: compares CP sizes itself on a DP x CP world of --gpus / --tp ranks; leave --cp "
                         "and --pp at 1 (Megatron-Core's CP per sample runs without pipeline parallelism)")
    if args.gpu not in MACHINES:
        raise ValueError(f"--gpu {args.gpu}: --cp-per-sample prices rows with the time model, which knows "
                         f"{', '.join(MACHINES)}")
    if args.lengths:
        samples = load_lengths(args.lengths, spec.vision.spatial_merge_size)
    elif args.text_mix:
        samples = text_mix_lengths(args.num_samples, seed=args.seed)
    else:
        samples = video_mix_lengths(args.num_samples, seed=args.seed)
    global_batch_size = args.global_batch_size or args.micro_batch_size * (args.micro_batches or 1) * args.gpus
    estimates = compare_cp(spec, samples, gpus=args.gpus, tp=args.tp, global_batch_size=global_batch_size,
                           max_tokens_per_rank=args.cp_per_sample, gpu=args.gpu,
                           params=time_parameters(args))
    return (f"{spec.name}, {samples.source}: {len(samples.tokens)} samples, steps of {global_batch_size}, "
            f"{args.gpus} x {args.gpu} (TP {args.tp}), the time model ({time_parameters(args).source}; docs/time-model.md)\n\n"
            + format_cp_comparison(estimates, max_tokens_per_rank=args.cp_per_sample))


def planner_setup(layout: str, spec, settings, global_batch_size: int, row_buckets: int | None):
    """The rules' :class:`~megatron.bridge_thd.rules.setup.Setup` of a plan for ``layout``: the model config and the run
    as ``configure`` would set them up from the plan's options (the THD layouts with global-batch packing of
    ``row_buckets`` rows, as the plan's balance table compares them)."""
    par = settings.parallel
    model = ModelFacts(seq_length=settings.seq_length, sequence_parallel=par.sp, fp8=par.fp8,
                       experts=spec.num_moe_experts or 0, sizes=(par.tp, par.cp, par.pp, par.ep))
    # The planner compares global-batch packing with in-batch placement for the THD layouts; "bshd" runs in-batch.
    global_batch = GlobalBatchPacking(row_buckets=row_buckets) if layout != "bshd" else None
    return Setup(layout=layout, settings=PackingSettings(layout=layout, global_batch_packing=global_batch), model=model, tp=par.tp, cp=par.cp, pp=par.pp, ep=par.ep, dp=par.dp,
        seq_lengths=(settings.seq_length, settings.seq_length), micro_batch_size=settings.micro_batch_size,
        global_batch_size=global_batch_size)


def planner_refusals(spec, settings, global_batch_size: int, row_buckets: int | None
                     ) -> tuple[dict[str, list[str]], int]:
    """What the registry's planner rules refuse, by layout, and the ``thd_static`` rows global-batch packing uses
    (``row_buckets``, or the runtime's default for this setup).

    Raises:
        ValueError: a problem every layout has (e.g. the global batch size), listed.
    """
    setups = {layout: planner_setup(layout, spec, settings, global_batch_size, row_buckets) for layout in LAYOUT_ORDER}
    refused = {layout: problems(setup, PLANNER) for layout, setup in setups.items()}
    common = [problem for problem in refused[LAYOUT_ORDER[0]] if all(problem in found for found in refused.values())]
    if common:
        raise ValueError("; ".join(common))
    return {layout: found for layout, found in refused.items() if found}, runtime_row_buckets(setups["thd_static"])


def main(argv: list[str] | None = None) -> int:
    """``bridge-thd plan ...`` (the arguments after ``plan``); returns the exit status (0 ok, 2 bad input with a
    one-line error on stderr)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if args.list_models:
                print(list_presets())
            elif args.calibrate:
                print(calibration_report())
            else:
                print(run(args))
    except ValueError as error:
        print(f"bridge-thd plan: error: {error}", file=sys.stderr)
        return 2
    return 0
