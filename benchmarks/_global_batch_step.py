"""Helpers of ``global_batch_step_time.py``: the step batches (a pure function of distribution and
step, so the parent and both ranks build the same samples without shipping pixels between
processes), the tiny model's cost spec, and the per-rank worker that ``run_on_gloo`` calls.

Kept in its own module so the spawned ranks import the worker by name (``benchmarks/`` is on the
parent's ``sys.path``, which spawn hands to its children) whatever name the script runs under.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from megatron.bridge_thd_cpu.data import ReceiptSpec, VisualInputs, select_samples, synthetic_receipt_batch

SEQ_LENGTH = 2048
MICRO_BATCH_SIZE = 4
DP = 2
GLOBAL_BATCH_SIZE = 16  # 2 micro-batches of 4 per rank
NUM_LAYERS = 2  # the DP equality test's depth
LAYOUT_NAMES = ("thd", "thd_static")
PLACEMENTS = ("in_batch", "global")
FLOOR_REPEATS = 5

# "skewed": per step, a pool of SKEW_POOL receipts; its SKEW_LONG longest and the
# GLOBAL_BATCH_SIZE - SKEW_LONG shortest, in a seeded random order (the sampler's order).
SKEW_POOL, SKEW_LONG, SKEW_SEED_BASE = 64, 3, 100_000

DISTRIBUTIONS = {
    "receipts": f"synthetic_receipt_batch({GLOBAL_BATCH_SIZE}, seed=step): receipt-like, one image each",
    "skewed": (f"per step, from synthetic_receipt_batch({SKEW_POOL}, seed={SKEW_SEED_BASE}+step): its {SKEW_LONG} "
               f"longest and {GLOBAL_BATCH_SIZE - SKEW_LONG} shortest samples, shuffled (torch.randperm, seed=step): "
               f"a few long samples among short ones every step"),
}


def step_batch(distribution: str, step: int) -> dict:
    """The global batch of ``step`` (``GLOBAL_BATCH_SIZE`` samples, in the order the sampler drew them)."""
    if distribution == "receipts":
        return synthetic_receipt_batch(GLOBAL_BATCH_SIZE, seed=step)
    if distribution == "skewed":
        pool = synthetic_receipt_batch(SKEW_POOL, seed=SKEW_SEED_BASE + step)
        order = torch.argsort(pool["attention_mask"].sum(1), descending=True, stable=True).tolist()
        chosen = order[:SKEW_LONG] + order[-(GLOBAL_BATCH_SIZE - SKEW_LONG):]
        shuffle = torch.randperm(GLOBAL_BATCH_SIZE, generator=torch.Generator().manual_seed(step)).tolist()
        return select_samples(pool, [chosen[i] for i in shuffle])
    raise ValueError(f"distribution: {distribution!r} is not one of {sorted(DISTRIBUTIONS)}")


def sample_sizes(batch: dict) -> tuple[list[int], list[int], list[float]]:
    """Per sample: LLM tokens, ViT patches and patches^2 (one image per sample in both distributions)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    grids = batch["visual_inputs"].image_grid_thw
    if grids.shape[0] != len(lengths):
        raise ValueError(f"expected one image per sample, got {grids.shape[0]} images for {len(lengths)} samples")
    patches = grids.prod(-1).tolist()
    return lengths, patches, [float(p) * p for p in patches]


def minimal_micro_batch(samples: int = MICRO_BATCH_SIZE) -> dict:
    """A micro-batch of ``samples`` minimal samples (16 text tokens, a 2 x 2-token image, 16 answer
    tokens, eos: 38 tokens, 16 ViT patches each): the step's cost when tokens are (almost) none."""
    spec = ReceiptSpec()
    text = [1 + i % (spec.text_vocab - 1) for i in range(16)]
    sample = (text + [spec.vision_start_token_id] + [spec.image_token_id] * 4 + [spec.vision_end_token_id] + text
              + [spec.eos_token_id])
    tokens = torch.tensor([sample] * samples)
    width = tokens.shape[1]
    loss_mask = torch.zeros(samples, width)
    loss_mask[:, -len(text) - 2:-1] = 1.0  # the labels of the answer and eos
    grids = torch.tensor([[1, 2 * spec.spatial_merge_size, 2 * spec.spatial_merge_size]] * samples)
    generator = torch.Generator().manual_seed(0)
    return {
        "tokens": tokens,
        "labels": torch.cat([tokens[:, 1:], torch.full((samples, 1), -100)], dim=1),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(samples, width, dtype=torch.bool),
        "position_ids": torch.arange(width).expand(samples, -1).clone(),
        "visual_inputs": VisualInputs(pixel_values=torch.randn(int(grids.prod(-1).sum()), spec.patch_features,
                                                               generator=generator), image_grid_thw=grids),
    }


def tiny_model_spec(num_layers: int = NUM_LAYERS):
    """A planner ``ModelSpec`` with the tiny test-bed Qwen3-VL's sizes (``bridge_thd_cpu.model``), for
    ``batching.sample_cost``."""
    from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec
    from megatron.bridge_thd_cpu.model import tiny_language_settings
    from megatron.bridge_thd_cpu.reference import TINY_VISION_CONFIG

    lm, v = tiny_language_settings(), TINY_VISION_CONFIG
    vision = VisionSpec(depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
                        intermediate_size=v["intermediate_size"], patch_size=v["patch_size"],
                        temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["spatial_merge_size"],
                        out_hidden_size=v["out_hidden_size"])
    return ModelSpec(name=f"tiny-qwen3-vl-{num_layers}l (testbed)", hf_repo="", num_layers=num_layers,
                     hidden_size=lm["hidden_size"], num_attention_heads=lm["num_attention_heads"],
                     num_query_groups=lm["num_query_groups"], kv_channels=lm["kv_channels"],
                     ffn_hidden_size=lm["ffn_hidden_size"], vocab_size=lm["vocab_size"], vision=vision)


def step_time_worker(schedule_plan: list[dict], threads: int) -> dict:
    """On each DP rank: build the tiny real ``Qwen3VLModel`` once, then for every entry of
    ``schedule_plan`` (in order, the same on both ranks) run this rank's micro-batches through
    Megatron-Core's schedule (forward + backward), timed between a barrier and the schedule's return.

    ``schedule_plan`` entries: ``distribution``, ``step``, ``layout``, ``placement``, ``assignment``
    (``[rank][micro_batch] -> sample positions``), ``row_length`` (``thd_static`` global: the run's
    fixed row; None otherwise). Returns ``threads`` (torch's intra-op threads), ``runs`` (per entry:
    every rank's wall seconds, process CPU seconds (``time.process_time``), real tokens and the token
    slots the step processed (``PackingStats.processed_tokens``); the DP group's loss sum and
    supervised tokens; the layouts the step reported) and ``floor_cpu_seconds`` (this rank's CPU
    seconds of a step of minimal samples, :func:`minimal_micro_batch`, per repeat).
    """
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.bridge_thd.settings import GlobalBatchPacking
    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.standalone import minimal_state

    torch.set_num_threads(threads)
    rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    group = parallel_state.get_data_parallel_group()
    model = build_qwen3_vl(tiny_qwen3_vl_config(num_layers=NUM_LAYERS, seq_length=SEQ_LENGTH), seed=0)
    # What Megatron-Bridge's model provider sets on every model it builds (models/model_provider.py);
    # Megatron-Core's PP = 1 schedule (forward_backward_no_pipelining) reads it.
    model.model_type = ModelType.encoder_or_decoder
    schedule = get_forward_backward_func()  # PP = 1: forward_backward_no_pipelining, as the trainer runs it
    batches: dict[tuple[str, int], dict] = {}
    out = []

    def timed(micro_batches, layout, setting):
        state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=MICRO_BATCH_SIZE, packing_layout=layout,
                              global_batch_packing=setting)
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier(group=group)
        start, cpu_start = time.perf_counter(), time.process_time()
        losses = schedule(forward_step_func=partial(forward_step, state), data_iterator=iter(micro_batches),
                          model=[model], num_microbatches=len(micro_batches), seq_length=SEQ_LENGTH,
                          micro_batch_size=MICRO_BATCH_SIZE, forward_only=False)
        return time.perf_counter() - start, time.process_time() - cpu_start, state, losses

    for entry in schedule_plan:
        key = (entry["distribution"], entry["step"])
        if key not in batches:
            batches.clear()  # the plan is ordered by step: one step's batch at a time
            batches[key] = step_batch(*key)
        micro_batches = [select_samples(batches[key], rows) for rows in entry["assignment"][rank]]
        tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
        setting = GlobalBatchPacking(row_length=entry["row_length"]) if entry["row_length"] is not None else None
        seconds, cpu_seconds, state, losses = timed(micro_batches, entry["layout"], setting)
        # Every rank's times (one-hot sums), the DP group's loss sum and supervised tokens; outside the timing.
        per_rank = torch.zeros(size, dtype=torch.float64)
        per_rank[rank] = seconds
        per_rank_cpu = torch.zeros(size, dtype=torch.float64)
        per_rank_cpu[rank] = cpu_seconds
        rank_tokens = torch.zeros(size, dtype=torch.float64)
        rank_tokens[rank] = tokens
        rank_slots = torch.zeros(size, dtype=torch.float64)
        rank_slots[rank] = sum(s.processed_tokens for s in state.bridge_thd_stats)
        totals = torch.tensor([sum(float(e["lm loss"][0]) for e in losses),
                               sum(float(e["lm loss"][1]) for e in losses)], dtype=torch.float64)
        for tensor in (per_rank, per_rank_cpu, rank_tokens, rank_slots, totals):
            torch.distributed.all_reduce(tensor, group=group)
        out.append(dict(rank_seconds=per_rank.tolist(), rank_cpu_seconds=per_rank_cpu.tolist(),
                        rank_real_tokens=[int(x) for x in rank_tokens.tolist()],
                        rank_slots=[int(x) for x in rank_slots.tolist()],
                        loss_sum=float(totals[0]), loss_tokens=int(totals[1]),
                        layouts=sorted({s.layout for s in state.bridge_thd_stats})))
    # The floor: a step of the same shape (2 micro-batches of 4 samples) whose samples are minimal, so
    # what remains is the per-step cost that does not depend on tokens (dispatch, the packer, the loss).
    floor = [timed([minimal_micro_batch()] * (GLOBAL_BATCH_SIZE // (MICRO_BATCH_SIZE * size)), "thd", None)[1]
             for _ in range(FLOOR_REPEATS)]
    return {"threads": torch.get_num_threads(), "runs": out, "floor_cpu_seconds": floor,
            "floor_tokens": int(minimal_micro_batch()["attention_mask"].sum())}
