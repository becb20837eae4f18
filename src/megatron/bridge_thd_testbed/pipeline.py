"""One training step of Megatron-Bridge's real Qwen3-VL under Megatron-Core's own pipeline schedule.

Runs Megatron-Core's ``forward_backward_pipelining_without_interleaving`` with
:func:`megatron.bridge_thd.qwen3_vl_step.forward_step` on this rank's stage of the model built by
:func:`~megatron.bridge_thd_cpu.model.build_qwen3_vl` (vision tower on the first stage, the output
layer on the last), its weights taken from a full (PP = 1) state dict by global layer index.
Call it on every rank of a gloo world (``bridge_thd_testbed.launcher.run_on_gloo(pipeline_step, ..., pp=2)``), or
in a world of one for the PP = 1 reference with the same schedule.
"""

from __future__ import annotations

import re
from functools import partial

import torch

from megatron.bridge_thd.qwen3_vl_step import forward_step
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.standalone import minimal_state

__all__ = ["pipeline_step", "global_parameter_name"]

_LAYER = re.compile(r"language_model\.decoder\.layers\.(\d+)\.(.*)")


def global_parameter_name(name: str, layer_offset: int) -> str:
    """A stage's parameter name with its decoder layer index made global (``layers.0`` on the
    second of two 4-layer stages is ``layers.2``)."""
    match = _LAYER.match(name)
    if match is None:
        return name
    return f"language_model.decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}"


def pipeline_step(full_state_dict: dict, batches: list[dict], layout: str, variable_seq_lengths: bool, *,
                  num_layers: int = 4, micro_batch_size: int = 2, seq_length: int = 2048,
                  static_rows=()) -> dict:
    """One step of ``len(batches)`` micro-batches on this rank's pipeline stage (and CP rank).

    Args:
        full_state_dict: the PP = 1 model's weights (``build_qwen3_vl(tiny_qwen3_vl_config(
            num_layers=...))``).
        batches: Megatron-Bridge VLM micro-batches, each of ``micro_batch_size`` samples.
        layout, variable_seq_lengths: the settings' ``layout`` and ``model.variable_seq_lengths``.
        static_rows: global-batch packing's ``step_plan.StaticRow``s for ``thd_static`` (ascending; micro-batches
            may then hold any number of samples, up to a row's segments, each taking the shortest row that holds it).

    Returns:
        ``losses``: what the schedule returns (per micro-batch ``{"lm loss": (sum, tokens)}`` on
        the last stage, empty elsewhere), summed over the CP group; ``grads``: this stage's
        gradients by global parameter name, summed over the CP group; ``layouts``: the layouts the step ran;
        ``rows``: the token slots the step gave the model, per micro-batch in order (forward passes only).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    rank = parallel_state.get_pipeline_model_parallel_rank()
    size = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    config = tiny_qwen3_vl_config(num_layers=num_layers, pp=size, cp=cp, variable_seq_lengths=variable_seq_lengths,
                                  seq_length=seq_length)
    model = build_qwen3_vl(config, pre_process=rank == 0, post_process=rank == size - 1)
    offset = rank * num_layers // size
    model.load_state_dict({name: full_state_dict[global_parameter_name(name, offset)] for name in model.state_dict()})
    state = minimal_state(seq_length=seq_length, micro_batch_size=micro_batch_size, packing_layout=layout,
                          variable_seq_lengths=variable_seq_lengths, static_rows=static_rows)
    losses = forward_backward_pipelining_without_interleaving(
        forward_step_func=partial(forward_step, state), data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
    )
    grads = {global_parameter_name(name, offset): (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in model.named_parameters()}
    losses = [{k: v.clone() for k, v in entry.items()} for entry in losses]
    if cp > 1:
        # Each CP rank holds its share of every sample: loss sums and token counts add up over the
        # CP group (Megatron-Core's per-token loss reduction), and so do gradients (Megatron's DDP
        # reduces over data x context parallel ranks).
        group = parallel_state.get_context_parallel_group()
        for tensor in [v for entry in losses for v in entry.values()] + list(grads.values()):
            torch.distributed.all_reduce(tensor, group=group)
    return dict(losses=losses, grads=grads, layouts=sorted({s.layout for s in state.bridge_thd_stats}),
                rows=[s.processed_tokens for s in state.bridge_thd_stats])
