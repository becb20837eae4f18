"""The step of the CP-per-sample tests (tests/parallel/test_cp_per_sample*.py): its samples, their collation as
Megatron-Bridge's VLM collate hands them to the step, and the world and row limit they are placed with."""

from __future__ import annotations

import torch
from _vlm_samples import collate, sample_from_layout

from megatron.bridge_thd_cpu.data import VisualInputs

WORLD = 4
MAX_TOKENS_PER_RANK = 64
SEQ_LENGTH = 512

# Text runs, images ("image", h, w patches) and videos ("video", frames, h, w): 166, 88, 95 tokens and five
# of 21-39. At 64 tokens per rank the first needs 4 ranks, the next two 2 (Megatron-Core's gpus_needed).
LAYOUTS = [
    [10, ("video", 6, 8, 8), 30],
    [8, ("image", 8, 12), 20, ("video", 2, 4, 8), 8],
    [6, ("video", 3, 8, 4), 30, ("image", 4, 8), 10],
    [5, ("image", 4, 4), 12],
    [20, ("image", 8, 4), 6],
    [30],
    [4, ("image", 4, 8), 25],
    [12, ("image", 4, 4), 3],
]


# The placements the equality tests run: Megatron-Core's scheduler, and ours on the time model (qwen3-vl-8b's shape
# on an H100: at these tiny lengths it gives every rank rows of CP 4, 2 and 1 in one group, in one global order).
PLACEMENTS = ("megatron", "time")
TIME_MODEL = ("qwen3-vl-8b", "h100-sxm")


def place(step_samples, placement: str = "megatron"):
    """The step's placement by ``placement`` (:data:`PLACEMENTS`), from the samples' lengths."""
    lengths = [len(s) for s in step_samples]
    if placement == "megatron":
        from megatron.bridge_thd.batching.cp_per_sample import place_with_cp_per_sample

        return place_with_cp_per_sample(lengths, world=WORLD, max_tokens_per_rank=MAX_TOKENS_PER_RANK)
    from megatron.bridge_thd.cost.step_time import SampleWork
    from megatron.bridge_thd.batching.time_placement import RowPricer, place_by_time

    return place_by_time([SampleWork(n) for n in lengths], world=WORLD, max_tokens_per_rank=MAX_TOKENS_PER_RANK,
                         pricer=RowPricer.of(*TIME_MODEL))


def samples():
    return [sample_from_layout(layout, seed=i) for i, layout in enumerate(LAYOUTS)]


def bridge_batch(samples) -> dict:
    """Samples collated whole, as Megatron-Bridge's VLM collate hands them to the step (right padding)."""
    batch = collate(samples)
    width = batch.input_ids.shape[1]
    return {
        "tokens": batch.input_ids,
        "labels": batch.labels,
        "loss_mask": batch.loss_mask,
        "attention_mask": batch.attention_mask.bool(),
        "position_ids": torch.arange(width).expand(len(samples), -1).clone(),
        "visual_inputs": VisualInputs(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                                      pixel_values_videos=batch.pixel_values_videos,
                                      video_grid_thw=batch.video_grid_thw),
    }


def run_hybrid_step(model, step_samples, placement: str = "megatron") -> dict:
    """On every rank of a hybrid-CP world: the step's rows (placed by ``placement``, :func:`place`) through
    Megatron-Core's ``forward_backward_no_pipelining``
    (dispatching to its hybrid-CP schedule) with our forward step, then the loss sum, token count and gradients
    summed over the world (what per-token loss and DDP sum). ``calls``: the ``PackedSeqParams`` of each forward."""
    from functools import partial

    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd_cpu.parity import gradients
    from megatron.bridge_thd_cpu.standalone import minimal_state

    model.model_type = ModelType.encoder_or_decoder  # what Megatron-Bridge's get_model sets, the schedule reads
    placement = place(step_samples, placement)
    item = placement.schedule_item(torch.distributed.get_rank(),
                                   lambda row: bridge_batch([step_samples[i] for i in row.samples]))
    state = minimal_state(seq_length=SEQ_LENGTH, micro_batch_size=1)
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["packed_seq_params"]),
                                    with_kwargs=True)
    reports = forward_backward_no_pipelining(
        forward_step_func=partial(forward_step, state), data_iterator=iter([item]), model=[model],
        num_microbatches=1, seq_length=SEQ_LENGTH, micro_batch_size=1)
    totals = torch.stack([sum(r["lm loss"][0] for r in reports), sum(r["lm loss"][1] for r in reports)]).double()
    grads = gradients(model)
    torch.distributed.all_reduce(totals)
    for g in grads.values():
        torch.distributed.all_reduce(g)
    return dict(loss=float(totals[0]), num_tokens=int(totals[1]), grads=grads, calls=calls)


def cp1_reference(build) -> tuple[dict, dict]:
    """The step's samples on one process at CP = 1, one packed THD row through our step: the model's weights (what
    every rank loads) and its loss sum, tokens and gradients. ``build()`` makes the model (inside the CPU stack)."""
    from megatron.bridge_thd_cpu.parity import gradients, step_run
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    init_single_process_groups()
    with cpu_stack():
        model = build()
        run = step_run(model, bridge_batch(samples()), "thd", seq_length=SEQ_LENGTH)
        run.loss.backward()
        return model.state_dict(), dict(loss=float(run.loss), num_tokens=int(run.num_tokens), grads=gradients(model))
