"""Helpers for tests on Megatron-Bridge 0.6.2's real ``Qwen3VLModel`` (CPU build).

Module-level functions only: the CP workers run them in spawned gloo processes.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron.bridge_thd.data import VisualInputs, synthetic_receipt_batch
from megatron.bridge_thd.qwen3_vl_step import forward_step
from megatron.bridge_thd.standalone import minimal_state

IMAGE, VISION_START = 250, 252
SEQ = 2048


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


def trimmed(batch: dict, lengths: list[int]) -> dict:
    """A right-padded receipt batch with sample i cut to its first ``lengths[i]`` tokens (past its
    image, so no image is cut); the cut tokens become padding."""
    batch = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    width = batch["tokens"].shape[1]
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    assert (keep <= batch["attention_mask"]).all(), "trimmed: lengths must not exceed the real lengths"
    batch["attention_mask"] = keep
    batch["tokens"] = torch.where(keep, batch["tokens"], 0)
    # The new last token predicts nothing; padding is never supervised.
    last = keep & ~torch.cat([keep[:, 1:], torch.zeros_like(keep[:, :1])], dim=1)
    batch["labels"] = torch.where(keep & ~last, batch["labels"], -100)
    batch["loss_mask"] = torch.where(keep & ~last, batch["loss_mask"], 0.0)
    return batch


def receipt_batch(padding: str, seed: int = 1, batch_size: int = 3) -> dict:
    return synthetic_receipt_batch(batch_size, seed=seed, left_padding=padding == "left")


def last_slot_batch(cp_align: int = 8, seed: int = 1) -> dict:
    """Every sample's length a multiple of ``cp_align`` except the last one's: under CP the only
    alignment padding is in the last slot (the case TransformerEngine issue 3331 misses)."""
    batch = receipt_batch("right", seed=seed)
    lengths = batch["attention_mask"].sum(1).tolist()
    target = [n - n % cp_align for n in lengths[:-1]] + [lengths[-1] - lengths[-1] % cp_align - cp_align + 3]
    return trimmed(batch, target)


def all_padding_batch(width: int = 64) -> dict:
    """A micro-batch whose samples are all padding (no real token, no image)."""
    return {
        "tokens": torch.zeros(2, width, dtype=torch.long),
        "labels": torch.full((2, width), -100),
        "loss_mask": torch.zeros(2, width),
        "attention_mask": torch.zeros(2, width, dtype=torch.bool),
        "position_ids": torch.arange(width).expand(2, -1).clone(),
        "visual_inputs": VisualInputs(),
    }


def sample_inputs(batch: dict, i: int) -> dict:
    """Sample i alone, as Megatron-Bridge's model takes an unpacked batch of one."""
    keep = batch["attention_mask"][i].bool()
    ids = batch["tokens"][i][keep]
    grids = batch["visual_inputs"].image_grid_thw
    pixels = batch["visual_inputs"].pixel_values
    args = dict(input_ids=ids[None], labels=batch["labels"][i][keep][None], loss_mask=batch["loss_mask"][i][keep][None])
    if grids is not None:
        # Images in order of appearance: sample i's are those after the image tokens of samples < i.
        tokens_per_image = grids.prod(-1) // 4
        image_tokens = [int((batch["tokens"][j][batch["attention_mask"][j].bool()] == IMAGE).sum()) for j in range(i + 1)]
        ends = tokens_per_image.cumsum(0).tolist()
        first = sum(1 for e in ends if e <= sum(image_tokens[:i]))
        last = sum(1 for e in ends if e <= sum(image_tokens))
        patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
        if last > first:
            args.update(pixel_values=pixels[patch_ends[first] : patch_ends[last]], image_grid_thw=grids[first:last])
    return args


def per_sample_token_losses(model, batch: dict) -> list[torch.Tensor]:
    """Each sample alone through the model (it computes its own MRoPE positions): per-token
    -log p(label) at every real token, ``(n_i,)`` each."""
    return [model(**sample_inputs(batch, i))[0] for i in range(batch["tokens"].shape[0])]


def step_run(model, batch: dict, layout: str, *, seq_length: int = SEQ, micro_batch_size: int | None = None,
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
    lengths = batch["attention_mask"].sum(1).tolist()
    params = run.args["packed_seq_params"]
    if params is None:  # bshd: right-aligned re-lay, sample i in row i
        return [run.output[i, :n] for i, n in enumerate(lengths)]
    starts = params.cu_seqlens_q_padded.tolist()
    return [run.output[0, s : s + n] for s, n in zip(starts, lengths)]


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
