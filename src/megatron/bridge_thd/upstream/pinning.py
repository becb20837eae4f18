"""Pinned visual inputs: Megatron-Bridge's loader pins every tensor of a batch except the visual ones.

PyTorch's ``DataLoader(pin_memory=True)`` pins, in its pin-memory thread, tensors, mappings, sequences and any
object with a ``pin_memory()`` method. Megatron-Bridge's ``GenericVisualInputs`` (a dataclass of the processor's
tensors: ``pixel_values``, ``image_grid_thw``, ...) has none, so its pixels stay in pageable memory and their copy
to the GPU waits for the stream. :func:`visual_inputs_pin_patch` gives the class that method (a new name, nothing
replaced), so the loader's own pin thread pins them off the training thread. ``configure`` applies it
(docs/patches.md, docs/step-plan.md).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.patches import Patch

__all__ = ["visual_inputs_pin_patch", "pin_visual_inputs"]


def pin_visual_inputs(visual_inputs):
    """A copy of ``visual_inputs`` (a dataclass of tensors and None) with every tensor in pinned memory."""
    values = vars(visual_inputs)  # a plain dataclass: its fields are its instance attributes
    pinned = {field.name: values[field.name].pin_memory() for field in dataclasses.fields(visual_inputs)
              if isinstance(values[field.name], torch.Tensor)}
    return dataclasses.replace(visual_inputs, **pinned)


def visual_inputs_pin_patch() -> Patch:
    """``GenericVisualInputs.pin_memory`` (absent upstream) as :func:`pin_visual_inputs`.

    Raises:
        ValueError: Megatron-Bridge's visual inputs cannot be imported here.
    """
    try:
        visual_inputs = load_bridge_module("training.utils.visual_inputs")
    except ImportError as error:
        raise ValueError(f"pin_memory: Megatron-Bridge's GenericVisualInputs cannot be imported here ({error})") from error
    return Patch(visual_inputs.GenericVisualInputs, "pin_memory", pin_visual_inputs,
                 "Megatron-Bridge's loader pins a batch's tensors in its pin thread only through a pin_memory() method, "
                 "which GenericVisualInputs lacks, so pixels were copied from pageable memory (a stream wait)")
