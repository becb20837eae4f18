"""Model adapters: what the packed step needs to know of a VLM family, behind one small protocol.

The step (:mod:`megatron.bridge_thd.step`) is family-agnostic: it captures the keep mask,
truncates, packs and calls the model. A family supplies the four things that differ
(:class:`ModelAdapter`); :data:`ADAPTERS` is the registry where the next family goes. Reasoning and
how to add one: docs/adapters.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron.bridge_thd.lengths import DeferredCheck
from megatron.bridge_thd.mrope import qwen3_vl_position_ids_deferred

__all__ = ["ModelAdapter", "Qwen3VLAdapter", "QWEN3_VL", "ADAPTERS", "register_adapter"]


class ModelAdapter(Protocol):
    """What the packed step needs from a model family.

    Attributes:
        name: registry key, e.g. ``"qwen3_vl"``.
    """

    name: str

    def uncuttable_token_ids(self, model_config: Any) -> tuple[int, ...]:
        """Token ids truncation to ``seq_length`` must not cut (vision placeholders: the vision tower
        emits one embedding per placeholder, so a cut one has no token to land on)."""

    def position_ids(self, tokens: torch.Tensor, keep: torch.Tensor, multi_modal: dict,
                     model_config: Any) -> tuple[torch.Tensor, list[DeferredCheck]]:
        """Per-sample position ids of the padded batch, each sample starting at 0.

        Args:
            tokens: ``(B, T)`` token ids.
            keep: ``(B, T)`` bool, True at real tokens (after truncation).
            multi_modal: the visual inputs the model gets (``image_grid_thw``, ...).

        Returns:
            ``(3, B, T)`` MRoPE (or ``(B, T)``) positions, and deferred checks read by the step's
            one host read; no host synchronisation here.
        """

    def p2p_decoder(self, model: Any) -> Any:
        """The module whose ``input_tensor`` holds what a receiving pipeline stage got (Megatron-Core's
        ``TransformerBlock.set_input_tensor``), or None."""


def _merge_size(model_config) -> int:
    vision_config = getattr(model_config, "vision_config", None)
    return getattr(model_config, "spatial_merge_size", None) or getattr(vision_config, "spatial_merge_size", 2)


@dataclass(frozen=True)
class Qwen3VLAdapter:
    """Qwen3-VL and Qwen3.5-VL (Megatron-Bridge 0.6.2's ``Qwen3VLModel`` serves both): image and
    video placeholders must not be cut; 3D MRoPE by Qwen3-VL's rule (:mod:`megatron.bridge_thd.mrope`,
    videos per frame); the decoder is ``language_model.decoder``."""

    name: str = "qwen3_vl"

    def vision_token_ids(self, model_config) -> dict[str, int]:
        return dict(
            image_token_id=model_config.image_token_id,
            video_token_id=model_config.video_token_id,
            vision_start_token_id=model_config.vision_start_token_id,
            spatial_merge_size=_merge_size(model_config),
        )

    def uncuttable_token_ids(self, model_config) -> tuple[int, ...]:
        return (model_config.image_token_id, model_config.video_token_id)

    def position_ids(self, tokens, keep, multi_modal, model_config):
        return qwen3_vl_position_ids_deferred(
            tokens, keep, multi_modal.get("image_grid_thw"), multi_modal.get("video_grid_thw"),
            **self.vision_token_ids(model_config),
        )

    def p2p_decoder(self, model):
        return getattr(getattr(model, "language_model", None), "decoder", None)


QWEN3_VL = Qwen3VLAdapter()
ADAPTERS: dict[str, ModelAdapter] = {QWEN3_VL.name: QWEN3_VL}


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add a family to :data:`ADAPTERS` (its ``name`` must be new); returns it."""
    for method in ("uncuttable_token_ids", "position_ids", "p2p_decoder"):
        if not callable(getattr(adapter, method, None)):
            raise TypeError(f"adapter: {type(adapter).__name__} has no {method}(); see ModelAdapter")
    if adapter.name in ADAPTERS:
        raise ValueError(f"adapter: a family named {adapter.name!r} is already registered")
    ADAPTERS[adapter.name] = adapter
    return adapter
