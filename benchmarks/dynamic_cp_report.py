"""Static context parallelism against a CP size per sample on a long-tailed video mix (docs/dynamic-cp.md).

For each case (model, tokens of a sample per rank), on 8 x H100 SXM (TP 1, PP 1) with steps of 64 samples drawn
from the synthetic video mix (``megatron.bridge_thd.plan.video_mix``: 25% videos of 4 s to 6.4 min, the rest
receipts; an assumption, not a measured data set): static CP 1 / 2 / 4 / 8 with global-batch packing, and CP per
sample placed by Megatron-Core's ``BalancedCPScheduler`` (``megatron.bridge_thd.batching.dynamic_cp``). Per way: the
planner's step time (roofline at 40% MFU plus a K/V communication model at NVLink bandwidth, no overlap), per-rank
busy time max / mean, each rank's peak activation tokens, padding and the CP sizes used
(``megatron.bridge_thd.plan.dynamic_cp``). No timing is measured: the figures are the planner's model.

The values go to ``benchmarks/results/dynamic_cp.json``; the docs block ``dynamic-cp`` is rendered from it by
:func:`render` (``scripts/readme_figures.py``).

    .venv/bin/python benchmarks/dynamic_cp_report.py [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "dynamic_cp.json"
CASES = (("qwen3-vl-2b", 16384), ("qwen3-vl-8b", 16384), ("qwen3-vl-8b", 32768))
SETTING = dict(num_samples=512, video_share=0.25, seed=0, gpus=8, gpu="h100-sxm", global_batch_size=64, mfu=0.40)


def measure() -> dict:
    from megatron.bridge_thd.plan.dynamic_cp import compare_cp
    from megatron.bridge_thd.plan.presets import get_preset
    from megatron.bridge_thd.plan.roofline import get_gpu
    from megatron.bridge_thd.plan.video_mix import video_mix_lengths

    samples = video_mix_lengths(SETTING["num_samples"], video_share=SETTING["video_share"], seed=SETTING["seed"])
    tokens = sorted(samples.tokens)
    cases = []
    for model, limit in CASES:
        estimates = compare_cp(get_preset(model), samples, gpus=SETTING["gpus"], global_batch_size=SETTING[
            "global_batch_size"], max_tokens_per_rank=limit, gpu=get_gpu(SETTING["gpu"]), mfu=SETTING["mfu"])
        cases.append(dict(model=model, max_tokens_per_rank=limit,
                          estimates=[dataclasses.asdict(e) for e in estimates]))
    return dict(setting=SETTING, source=samples.source,
                lengths=dict(median=tokens[len(tokens) // 2], p90=tokens[int(0.9 * len(tokens))], max=tokens[-1],
                             over_10k=sum(n > 10_000 for n in tokens)),
                cases=cases)


def render(results: dict) -> str:
    from megatron.bridge_thd.plan.dynamic_cp import CPEstimate, format_cp_comparison

    s, lengths = results["setting"], results["lengths"]
    lines = [f"{results['source']}: {s['num_samples']} samples (median {lengths['median']:,} tokens, 90th percentile "
             f"{lengths['p90']:,}, longest {lengths['max']:,}; {lengths['over_10k']} over 10,000), steps of "
             f"{s['global_batch_size']} on {s['gpus']} x {s['gpu']}, MFU {s['mfu']:.0%}."]
    for case in results["cases"]:
        estimates = [CPEstimate(**{**e, "cp_sizes": tuple(tuple(pair) for pair in e["cp_sizes"])})
                     for e in case["estimates"]]
        lines += ["", f"**{case['model']}**", "", format_cp_comparison(estimates,
                                                                       max_tokens_per_rank=case["max_tokens_per_rank"])]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    results = measure()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))


if __name__ == "__main__":
    main()
