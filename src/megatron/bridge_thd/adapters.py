"""Model adapters: what the packed step needs to know of a VLM family, behind one small protocol.

The step (:mod:`megatron.bridge_thd.step`) is family-agnostic: it captures the keep mask,
truncates, packs and calls the model. A family supplies the four things that differ
(:class:`ModelAdapter`); a family's step is ``step.forward.make_forward_step(adapter)``, handed to
Megatron-Bridge as its ``forward_step_func``. Reasoning and how to add one: docs/adapters.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron.bridge_thd.lengths import DeferredCheck
from megatron.bridge_thd.mrope import qwen3_vl_position_ids_deferred

__all__ = ["ModelAdapter", "VisionTokens", "Qwen3VLAdapter", "Qwen25VLAdapter", "QWEN3_VL", "QWEN25_VL",
           "FAMILY_BY_MODEL_CLASS", "family_of_model_class"]


class ModelAdapter(Protocol):
    """What the packed step needs from a model family.

    Attributes:
        name: the family's name, e.g. ``"qwen3_vl"``.
    """

    name: str

    def tokens(self, facts: Any) -> VisionTokens:
        """The family's constants, from the model's facts (``rules.setup.ModelFacts``, read once from its config)
        when the step builds its plan."""

    def position_ids(self, tokens: torch.Tensor, keep: torch.Tensor, multi_modal: dict,
                     ids: VisionTokens, *, on_host: bool = False) -> tuple[torch.Tensor | None, list[DeferredCheck]]:
        """Per-sample position ids of the padded batch, each sample starting at 0, or None when the
        model computes them itself from the packed row.

        Args:
            tokens: ``(B, T)`` token ids.
            keep: ``(B, T)`` bool, True at real tokens (after truncation).
            multi_modal: the visual inputs the model gets (``image_grid_thw``, ...).
            ids: the family's constants (:meth:`tokens`).
            on_host: the batch is on the host and the step copies the finished row to the model's device:
                compute there with host code (every tensor is on the CPU).

        Returns:
            ``(3, B, T)`` MRoPE (or ``(B, T)``) positions or None, and deferred checks read by the
            step's one host read; no host synchronisation here.
        """

    def p2p_decoder(self, model: Any) -> Any:
        """The module whose ``input_tensor`` holds what a receiving pipeline stage got (Megatron-Core's
        ``TransformerBlock.set_input_tensor``), or None."""

    # What the family's model can take, read by the rule ``model_family`` (megatron.bridge_thd.rules), which
    # refuses the rest before anything is built.
    display_name: str  # how messages name the family
    model_class: str  # Megatron-Bridge's model class, as messages name it
    takes_thd_static: bool  # a segment without a real token (the static row's tail) is fine
    takes_context_parallel: bool  # the model splits its input for context parallelism

    def data_checks(self, layout: str, keep: torch.Tensor) -> list[DeferredCheck]:
        """Deferred checks on the micro-batch the family's model needs (read in the step's one host
        read), e.g. that no sample is empty."""


@dataclass(frozen=True)
class VisionTokens:
    """A VLM family's constants: its vision placeholder ids and the vision tower's patch merge size.

    ``uncuttable``: the ids truncation to ``seq_length`` must not cut (the vision tower emits one embedding per
    placeholder, so a cut one has no token to land on).
    """

    image_token_id: int
    video_token_id: int
    vision_start_token_id: int | None
    spatial_merge_size: int

    @property
    def uncuttable(self) -> tuple[int, int]:
        return (self.image_token_id, self.video_token_id)


def _vision_tokens(facts) -> VisionTokens:
    """The placeholder ids and merge size of a model, from its facts (``rules.setup.ModelFacts``, read once)."""
    for name, value in (("image_token_id", facts.image_token_id), ("video_token_id", facts.video_token_id)):
        if value is None:
            raise ValueError(f"bridge_thd: the model config sets no {name}; a Qwen-VL model config carries its image "
                             f"and video placeholder ids: set {name} (the Hugging Face config's value)")
    return VisionTokens(image_token_id=facts.image_token_id, video_token_id=facts.video_token_id,
                        vision_start_token_id=facts.vision_start_token_id, spatial_merge_size=facts.spatial_merge_size)


@dataclass(frozen=True)
class Qwen3VLAdapter:
    """Qwen3-VL and Qwen3.5-VL (Megatron-Bridge's ``Qwen3VLModel`` serves both): image and
    video placeholders must not be cut; 3D MRoPE by Qwen3-VL's rule (:mod:`megatron.bridge_thd.mrope`,
    videos per frame); the decoder is ``language_model.decoder``."""

    name: str = "qwen3_vl"
    display_name: str = "Qwen3-VL"
    model_class: str = "Megatron-Bridge's Qwen3VLModel"
    takes_thd_static: bool = True
    takes_context_parallel: bool = True

    def tokens(self, facts) -> VisionTokens:
        return _vision_tokens(facts)

    def position_ids(self, tokens, keep, multi_modal, ids, *, on_host=False):
        return qwen3_vl_position_ids_deferred(
            tokens, keep, multi_modal.get("image_grid_thw"), multi_modal.get("video_grid_thw"),
            image_token_id=ids.image_token_id, video_token_id=ids.video_token_id,
            vision_start_token_id=ids.vision_start_token_id, spatial_merge_size=ids.spatial_merge_size,
            on_host=on_host,
        )

    def p2p_decoder(self, model):
        return getattr(getattr(model, "language_model", None), "decoder", None)  # duck: a pipeline stage without them

    def data_checks(self, layout, keep):
        return []


@dataclass(frozen=True)
class Qwen25VLAdapter:
    """Qwen2.5-VL (Megatron-Bridge's ``Qwen25VLModel``, ``models/qwen_vl/modeling_qwen25_vl.py``).

    Its ``forward`` computes MRoPE itself on a THD row: one row per segment (real lengths from
    ``cu_seqlens_q``, starts from ``cu_seqlens_q_padded``), Hugging Face's ``get_rope_index`` on each
    (videos scale time by ``tokens_per_second * second_per_grid_ts``), zeros in the alignment gaps;
    the ``position_ids`` it is given are ignored, so the step computes none. What the model cannot
    take is refused: a segment without a real token (``packed_seq_utils.py``: the ``thd_static``
    tail, an all-padding sample) and context parallelism (the pinned Megatron-Bridge has no CP split for it;
    docs/compatibility.md).
    docs/qwen25-vl.md.
    """

    name: str = "qwen2_5_vl"
    display_name: str = "Qwen2.5-VL"
    model_class: str = "Megatron-Bridge's Qwen25VLModel"
    takes_thd_static: bool = False  # it rebuilds positions per THD segment and needs a real token in each
    takes_context_parallel: bool = False  # no context-parallel split of its input (its recipes set CP=1)

    def tokens(self, facts) -> VisionTokens:
        return _vision_tokens(facts)

    def position_ids(self, tokens, keep, multi_modal, ids, *, on_host=False):
        return None, []

    def p2p_decoder(self, model):
        return getattr(getattr(model, "language_model", None), "decoder", None)  # duck: a pipeline stage without them

    def data_checks(self, layout, keep):
        if layout != "thd":
            return []
        empty = keep.sum(dim=1) == 0
        return [DeferredCheck(
            empty.any(),
            "batch: a sample without any real token in a 'thd' micro-batch for Qwen2.5-VL: Megatron-Bridge's "
            "Qwen25VLModel needs a real token in every THD segment (packed_seq_utils.py); drop empty samples in the "
            "dataset or use layout='bshd'",
            lambda: f"samples {empty.nonzero().flatten().tolist()}",
        )]


QWEN3_VL = Qwen3VLAdapter()
QWEN25_VL = Qwen25VLAdapter()
# The family of each Megatron-Bridge model class a provider may declare it builds (configure reads it).
FAMILY_BY_MODEL_CLASS: dict[str, ModelAdapter] = {"Qwen3VLModel": QWEN3_VL, "Qwen25VLModel": QWEN25_VL}


def family_of_model_class(model_class: type) -> ModelAdapter | None:
    """The family of a model class (by its name, the class or a base of it), or None."""
    for cls in model_class.__mro__:
        if cls.__name__ in FAMILY_BY_MODEL_CLASS:
            return FAMILY_BY_MODEL_CLASS[cls.__name__]
    return None
