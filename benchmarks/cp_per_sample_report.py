"""Static context parallelism against a CP size per sample on a long-tailed video mix and a long-tailed text mix, at
8, 32 and 64 GPUs (docs/cp-per-sample.md).

For each case (mix, GPUs), qwen3-vl-8b on H100 SXM (8 per node: CP groups above 8 cross nodes; TP 1, PP 1) at 16,384
tokens of a sample per rank, steps of 4 samples per GPU: static CP 1, 2, 4, ... up to the world with global-batch
packing, CP per sample placed by Megatron-Core's ``BalancedCPScheduler`` (groups behind barriers) and by ours
(``batching.time_placement.place_by_time``). Every way's rows are priced by the time model
(``batching.step_time.row_time``, its published and fitted parameters as they stand, docs/time-model.md) and run as
the schedule runs them (``plan.cp_per_sample``). Per way: step time, per-rank busy time max / mean, each rank's peak
activation tokens, padding and the CP sizes used. No timing is measured: the figures are the time model's.

The mixes are synthetic (``plan.video_mix``: 25% videos of 4 s to 6.4 min, the rest receipts; ``plan.text_mix``:
lognormal lengths, median 1,500, 1 to 32,768 tokens): an assumption, not a measured data set. The values go to
``benchmarks/results/cp_per_sample.json``; the docs block ``cp-per-sample`` is rendered from it by :func:`render`
(``scripts/readme_figures.py``).

    .venv/bin/python benchmarks/cp_per_sample_report.py [--json PATH]
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "cp_per_sample.json"
MIXES = ("video", "text")
GPUS = (8, 32, 64)
SETTING = dict(model="qwen3-vl-8b", max_tokens_per_rank=16384, gpu="h100-sxm", samples_per_gpu=4, steps=3,
               video_share=0.25, seed=0)


def _mix(name: str, num_samples: int):
    from megatron.bridge_thd.plan.text_mix import text_mix_lengths
    from megatron.bridge_thd.plan.video_mix import video_mix_lengths

    if name == "video":
        return video_mix_lengths(num_samples, video_share=SETTING["video_share"], seed=SETTING["seed"])
    return text_mix_lengths(num_samples, seed=SETTING["seed"])


def measure() -> dict:
    from megatron.bridge_thd.cost.step_time import FITTED
    from megatron.bridge_thd.plan.cp_per_sample import compare_cp

    cases = []
    for mix in MIXES:
        for gpus in GPUS:
            batch = SETTING["samples_per_gpu"] * gpus
            samples = _mix(mix, batch * SETTING["steps"])
            tokens = sorted(samples.tokens)
            started = time.perf_counter()
            estimates = compare_cp(SETTING["model"], samples, gpus=gpus, global_batch_size=batch,
                                   max_tokens_per_rank=SETTING["max_tokens_per_rank"], gpu=SETTING["gpu"])
            cases.append(dict(mix=mix, gpus=gpus, global_batch_size=batch, source=samples.source,
                              seconds=round(time.perf_counter() - started, 1),
                              lengths=dict(samples=len(tokens), median=tokens[len(tokens) // 2],
                                           p90=tokens[int(0.9 * len(tokens))], max=tokens[-1],
                                           over_limit=sum(n > SETTING["max_tokens_per_rank"] for n in tokens)),
                              estimates=[dataclasses.asdict(e) for e in estimates]))
    return dict(setting=SETTING, parameters=FITTED.source, cases=cases)


def render(results: dict) -> str:
    from megatron.bridge_thd.plan.cp_per_sample import CPEstimate, format_cp_comparison

    s = results["setting"]
    lines = [f"{s['model']} on {s['gpu']} (8 per node), at most {s['max_tokens_per_rank']:,} tokens of a sample per "
             f"rank, steps of {s['samples_per_gpu']} samples per GPU, {s['steps']} steps per case; every row priced "
             f"by the time model ({results['parameters']}): a model's figures, not a measurement."]
    for case in results["cases"]:
        n = case["lengths"]
        estimates = [CPEstimate(**{**e, "cp_sizes": tuple(tuple(pair) for pair in e["cp_sizes"])})
                     for e in case["estimates"]]
        lines += ["", f"**{case['mix']} mix, {case['gpus']} GPUs** ({case['source']}: {n['samples']} samples, median "
                      f"{n['median']:,} tokens, 90th percentile {n['p90']:,}, longest {n['max']:,}; "
                      f"{n['over_limit']} over the limit; steps of {case['global_batch_size']})", "",
                  format_cp_comparison(estimates, max_tokens_per_rank=s["max_tokens_per_rank"])]
    return "\n".join(lines)


def main(argv=None) -> None:
    from _tables import report_main

    report_main(__doc__, RESULTS, measure, render, argv)


if __name__ == "__main__":
    main()
