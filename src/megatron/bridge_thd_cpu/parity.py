"""Check packing on your own batches against Megatron-Bridge's real model, on a laptop.

Runs the replacement ``forward_step`` on a model built by :mod:`megatron.bridge_thd_cpu.model`
(or any Megatron-Bridge ``Qwen3VLModel``) and each sample alone through the same model, and
compares per-token log-probabilities and gradients. Used by the tests and the parity report
(``benchmarks/parity_report.py``). Run it inside :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`.
"""

from __future__ import annotations

import re

from types import SimpleNamespace

import torch

from megatron.bridge_thd.lengths import keep_mask_from_attention_mask
from megatron.bridge_thd.qwen3_vl_step import forward_step
from megatron.bridge_thd_cpu.standalone import minimal_state

__all__ = [
    "Recorder",
    "keep_mask",
    "sample_inputs",
    "per_sample_token_losses",
    "step_run",
    "per_sample_from_output",
    "max_abs_dlogp",
    "masked_loss_sum",
    "per_sample_losses_and_gradients",
    "gradients",
    "worst_relative_gradient_error",
    "global_expert_name",
]

IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 250, 251
SEQ_LENGTH = 2048


class Recorder(torch.nn.Module):
    """A wrapper like Megatron's DDP / Float16Module: the step unwraps ``.module`` for the config
    and the signature and calls the wrapper, which records the arguments and delegates."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls: list[dict] = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        return self.module(**kwargs)


def keep_mask(batch: dict) -> torch.Tensor:
    """``(B, T)`` bool, True at real tokens, from the batch's ``attention_mask`` as the step reads
    it: a 2D keep mask (bool, or 0 / 1 values of an int or float dtype) or a 4D
    Megatron mask (True = masked)."""
    tokens = batch["tokens"]
    keep, _ = keep_mask_from_attention_mask(batch["attention_mask"], *tokens.shape)
    return keep


def _items_of_sample(tokens: torch.Tensor, keep: torch.Tensor, i: int, token_id: int, grids: torch.Tensor,
                     pixels: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Sample i's grids and pixel rows of one modality: the items after those of samples < i, in
    order of appearance (``t * h * w / merge**2`` tokens and ``t * h * w`` pixel rows each)."""
    tokens_before = int((tokens[:i] == token_id)[keep[:i]].sum())
    tokens_through = tokens_before + int((tokens[i] == token_id)[keep[i]].sum())
    ends = (grids.prod(-1) // merge**2).cumsum(0).tolist()
    first = sum(1 for e in ends if e <= tokens_before)
    last = sum(1 for e in ends if e <= tokens_through)
    if last <= first:
        return None
    patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
    return grids[first:last], pixels[patch_ends[first] : patch_ends[last]]


def sample_inputs(batch: dict, i: int, image_token_id: int = IMAGE_TOKEN_ID, merge: int = 2,
                  video_token_id: int = VIDEO_TOKEN_ID) -> dict:
    """Sample i of a Megatron-Bridge VLM batch alone, as the model takes an unpacked batch of one
    (``input_ids``, ``labels``, ``loss_mask`` ``(1, n_i)``; its images and videos in order of
    appearance, as ``pixel_values`` / ``image_grid_thw`` and ``pixel_values_videos`` /
    ``video_grid_thw``). ``attention_mask`` may be any mask the step takes (see :func:`keep_mask`)."""
    keep = keep_mask(batch)
    tokens = batch["tokens"]
    args = dict(input_ids=tokens[i][keep[i]][None], labels=batch["labels"][i][keep[i]][None],
                loss_mask=batch["loss_mask"][i][keep[i]][None])
    visual = batch["visual_inputs"]
    for token_id, grids, pixels, grid_name, pixel_name in (
        (image_token_id, visual.image_grid_thw, visual.pixel_values, "image_grid_thw", "pixel_values"),
        (video_token_id, getattr(visual, "video_grid_thw", None), getattr(visual, "pixel_values_videos", None),
         "video_grid_thw", "pixel_values_videos"),
    ):
        if grids is None:
            continue
        items = _items_of_sample(tokens, keep, i, token_id, grids, pixels, merge)
        if items is not None:
            args[grid_name], args[pixel_name] = items
    return args


def per_sample_token_losses(model, batch: dict) -> list[torch.Tensor]:
    """Each sample alone through the model (it computes its own MRoPE positions): per-token
    -log p(label) at every real token, ``(n_i,)`` each."""
    return [model(**sample_inputs(batch, i))[0] for i in range(batch["tokens"].shape[0])]


def step_run(model, batch: dict, layout: str, *, seq_length: int = SEQ_LENGTH, micro_batch_size: int | None = None,
             **settings):
    """``forward_step`` on the model (through a DDP-like recorder).

    Returns:
        loss: the loss function's sum; num_tokens; output; loss_mask; args: the forward
        arguments the model got; state.
    """
    recorder = Recorder(model)
    state = minimal_state(seq_length=seq_length, micro_batch_size=micro_batch_size or batch["tokens"].shape[0],
                          packing_layout=layout, **settings)
    output, loss_function = forward_step(state, iter([batch]), recorder)
    loss, num_tokens, _ = loss_function(output)
    return SimpleNamespace(loss=loss, num_tokens=num_tokens, output=output, loss_mask=loss_function.args[0],
                           args=recorder.calls[-1], state=state)


def per_sample_from_output(run, batch: dict) -> list[torch.Tensor]:
    """Sample i's per-token values from the step's output, in order of its real tokens."""
    lengths = keep_mask(batch).sum(1).tolist()
    params = run.args["packed_seq_params"]
    if params is None:  # bshd: right-aligned re-lay, sample i in row i
        return [run.output[i, :n] for i, n in enumerate(lengths)]
    starts = params.cu_seqlens_q_padded.tolist()
    return [run.output[0, s : s + n] for s, n in zip(starts, lengths)]


def max_abs_dlogp(packed: list[torch.Tensor], alone: list[torch.Tensor], batch: dict) -> float:
    """max |dlogp| over every real token that has a label (per-token losses are -log p)."""
    worst = 0.0
    keep = keep_mask(batch)
    for i, (p, a) in enumerate(zip(packed, alone)):
        labelled = batch["labels"][i][keep[i]] != -100
        if labelled.any():
            worst = max(worst, float((p - a)[labelled].abs().max()))
    return worst


def masked_loss_sum(token_losses: list[torch.Tensor], batch: dict) -> float:
    """What Megatron-Bridge's masked loss sums over the samples: ``sum_i (losses_i * loss_mask_i)``
    over each sample's real tokens (``token_losses[i]``: ``(n_i,)``)."""
    keep = keep_mask(batch)
    return sum(float((loss * batch["loss_mask"][i][keep[i]]).sum()) for i, loss in enumerate(token_losses))


def per_sample_losses_and_gradients(model, batch: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each sample alone, forward and backward of its masked loss sum: per-token losses
    ``(n_i,)`` each, and the parameter gradients summed over the samples (the model's gradients
    are cleared before and after)."""
    model.zero_grad(set_to_none=True)
    losses = []
    for i in range(batch["tokens"].shape[0]):
        args = sample_inputs(batch, i)
        token_losses = model(**args)
        (token_losses * args["loss_mask"]).sum().backward()
        losses.append(token_losses[0].detach())
    summed = gradients(model)
    model.zero_grad(set_to_none=True)
    return losses, summed


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for name, p in model.named_parameters()}


def worst_relative_gradient_error(grads: dict, reference: dict) -> tuple[float, str]:
    """max over parameters of ||g - g_ref|| / ||g_ref|| (parameters with a zero reference
    gradient must have a zero gradient: their error is ||g||)."""
    worst, where = 0.0, ""
    for name, ref in reference.items():
        diff = float((grads[name] - ref).norm())
        scale = float(ref.norm())
        error = diff / scale if scale > 0 else diff
        if error > worst:
            worst, where = error, name
    return worst, where


_LOCAL_EXPERT = re.compile(r"(.*\.local_experts\.)(\d+)(\..*)")


def global_expert_name(name: str, ep_rank: int, per_rank: int) -> str:
    """A parameter name of an expert-parallel rank with its expert index made global
    (``...local_experts.k...`` on EP rank r is expert ``r * per_rank + k``), so that a rank's
    weights and gradients line up with the EP = 1 model's; other names are unchanged."""
    match = _LOCAL_EXPERT.match(name)
    return name if match is None else f"{match.group(1)}{ep_rank * per_rank + int(match.group(2))}{match.group(3)}"

