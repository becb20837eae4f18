"""Per-sample training cost from Megatron-Bridge's own FLOPs terms. Reasoning: docs/batching.md.

A sample of ``s`` LLM tokens whose images and videos have ``(t_k, h_k, w_k)`` patch grids costs (fwd + bwd)::

    cost = per_token * s + per_token_squared * s**2
           + per_patch * sum_k t_k * h_k * w_k + per_patch_squared * sum_k t_k * (h_k * w_k)**2

The four coefficients are read off Megatron-Bridge's ``training/utils/flop_utils.py``
(``num_floating_point_operations`` for the language model, ``vit_flops`` for the vision tower) by
evaluating them at a few points, so the cost follows the formula the trainer logs:

* ``per_token``: projections, MLP / experts (top-k), logits and the Gated-DeltaNet layers of a
  Qwen3.5 hybrid: everything linear in ``s``;
* ``per_token_squared``: the causal attention core of the *full-attention* layers only (zero
  contribution from Gated-DeltaNet layers, which the formula counts as linear);
* ``per_patch``: the ViT layers' projections and MLP and the patch merger;
* ``per_patch_squared``: the ViT's bidirectional attention, within each *frame*: an image is one
  frame (``t = 1``), a video of ``t`` frames is ``t`` attention segments of ``h * w`` patches each,
  never one segment of ``t * h * w``. That is how the vision model is built: Megatron-Bridge's
  ``Qwen3VLVisionModel.build_packed_seq_params`` makes its ``cu_seqlens`` from
  ``repeat_interleave(h * w, t)`` ("each frame is a sequence"), and Hugging Face's Qwen3-VL vision
  model does the same; attention never crosses a frame, an image or a video. :func:`image_patches`
  is the one definition of the term; reasoning and the FLOPs the trainer logs: docs/batching.md.

The language model's cost is per real sample: in a THD row attention never crosses a sample
boundary, so a micro-batch costs the sum of its samples' costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from megatron.bridge_thd.cost.flops import flops_config
from megatron.bridge_thd.cost.presets import ModelSpec, get_preset, spec_from_hf_config
from megatron.bridge_thd.upstream.loading import load_flop_utils

__all__ = ["SampleCost", "sample_cost", "image_patches", "frame_lengths"]

# Evaluation points: powers of two keep every term an exact integer in double precision, and
# the patch points are multiples of any spatial_merge_size**2 (the merger floors patches / merge^2).
_TOKENS = 1 << 16
_SQUARED = 1 << 32
_PATCHES = 1 << 12


@dataclass(frozen=True)
class SampleCost:
    """Coefficients of the per-sample cost (module docstring); units: FLOPs, fwd + bwd, one sample.

    ``name`` says where they came from (a preset or a config path) for tables and logs.
    """

    per_token: float
    per_token_squared: float
    per_patch: float = 0.0
    per_patch_squared: float = 0.0
    name: str = ""

    def __call__(self, lengths, patches=None, patches_squared=None) -> torch.Tensor:
        """Cost of each sample.

        Args:
            lengths: ``(N,)`` LLM tokens per sample (text + image placeholder tokens).
            patches: ``(N,)`` ViT patches per sample (sum over its images), or None (no images).
            patches_squared: ``(N,)`` the sample's ViT attention term, ``sum t * (h * w)**2`` over its
                images and videos (:func:`image_patches`), or None: each sample's patches are taken as
                one image of one frame.

        Returns:
            ``(N,)`` float64 FLOPs.
        """
        s = torch.as_tensor(lengths, dtype=torch.float64)
        cost = self.per_token * s + self.per_token_squared * s * s
        if patches is not None:
            p = torch.as_tensor(patches, dtype=torch.float64)
            q = p * p if patches_squared is None else torch.as_tensor(patches_squared, dtype=torch.float64)
            cost = cost + self.per_patch * p + self.per_patch_squared * q
        return cost

    def text_only(self) -> "SampleCost":
        """The same model with the vision tower's cost left out (what a text-only balancer sees)."""
        return SampleCost(self.per_token, self.per_token_squared, 0.0, 0.0, f"{self.name} (text only)")


def frame_lengths(grids: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Each frame's ViT patches for a sample's ``(t, h, w)`` grids: ``t`` frames of ``h * w`` per grid, the segments
    of the vision model's own ``cu_seqlens`` (``repeat_interleave(h * w, t)``)."""
    return tuple(int(h) * int(w) for t, h, w in grids for _ in range(int(t)))


def image_patches(grids: Sequence[Sequence[Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, its ViT patches and its ViT attention term (module docstring): the one definition of
    the term, used by the runtime's sample sizes and by the planner.

    A grid ``(t, h, w)`` (an image: ``t = 1``; a video: ``t`` frames) has ``t * h * w`` patches and
    attends within each frame, ``t`` segments of ``h * w`` patches: its squared term is
    ``t * (h * w)**2``, the sum of the squared segment lengths of the vision model's ``cu_seqlens``.

    Args:
        grids: per sample, its images' and videos' ``(t, h, w)`` patch grids (``image_grid_thw`` /
            ``video_grid_thw`` rows).

    Returns:
        ``patches`` ``(N,)`` int64 (``sum t * h * w``) and ``patches_squared`` ``(N,)`` float64
        (``sum t * (h * w)**2``).
    """
    frames = [[(int(t), int(h) * int(w)) for t, h, w in sample] for sample in grids]
    patches = torch.tensor([sum(t * hw for t, hw in sample) for sample in frames], dtype=torch.int64)
    squared = torch.tensor([float(sum(t * hw * hw for t, hw in sample)) for sample in frames], dtype=torch.float64)
    return patches, squared


def resolve_model_spec(model):
    """The planner's ``ModelSpec`` of ``model``: a preset name, a Hugging Face ``config.json`` path or a ``ModelSpec``.

    Raises:
        ValueError: an unknown preset name or an unreadable config (naming it).
    """
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, (str, Path)) and (str(model).endswith(".json") or Path(model).is_file()):
        return spec_from_hf_config(model)
    if isinstance(model, str):
        return get_preset(model)
    raise ValueError(f"model: expected a preset name, a config.json path or a ModelSpec, got {model!r}")


def sample_cost(model) -> SampleCost:
    """The cost coefficients of a model, from Megatron-Bridge's FLOPs formula.

    Args:
        model: a planner preset name (``bridge-thd plan --list-models``, e.g. ``"qwen3-vl-8b"``),
            a path to a Hugging Face ``config.json``, or a :class:`megatron.bridge_thd.cost.presets.ModelSpec`.

    Raises:
        ValueError: an unknown preset name or an unreadable config (naming it).
    """
    spec = resolve_model_spec(model)
    flop_utils = load_flop_utils()
    cfg = flops_config(spec, tensor_parallel=1)

    def language(tokens: int, squared: int) -> float:
        return float(flop_utils.num_floating_point_operations(
            cfg, batch_size=1, seqlen_sum=tokens, seqlen_squared_sum=squared, num_vision_patches=0))

    def vision(patches: int) -> float:
        return float(flop_utils.vit_flops(cfg, 1, patches))

    per_token = language(_TOKENS, 0) / _TOKENS
    per_token_squared = (language(_TOKENS, _SQUARED) - language(_TOKENS, 0)) / _SQUARED
    # vit(p) = c p + d p^2 at p and 2p: d = (vit(2p) - 2 vit(p)) / (2 p^2), c = (vit(p) - d p^2) / p.
    one, two = vision(_PATCHES), vision(2 * _PATCHES)
    per_patch_squared = (two - 2 * one) / (2 * _PATCHES * _PATCHES)
    per_patch = (one - per_patch_squared * _PATCHES * _PATCHES) / _PATCHES
    return SampleCost(per_token, per_token_squared, per_patch, per_patch_squared, spec.name)
