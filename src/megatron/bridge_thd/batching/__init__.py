"""Batching policies: which of a step's samples go to which DP rank and micro-batch. Reasoning and
figures: docs/batching.md.

* :mod:`.cost`: what a sample costs, from Megatron-Bridge's own FLOPs terms (``sample_cost``).
* :mod:`.policy`: the placement (``assign``), Megatron-Bridge's own for comparison
  (``in_batch_assignment``), and its measures (``placement_stats``).
* :mod:`.sizes`: every sample's tokens and patches before collate (metadata, cache or one scan).
* :mod:`.sampler`: the batch sampler that places Megatron-Bridge's own draws step by step, and the
  static row chosen from them.
* :mod:`.bridge`: the setting ``configure(..., global_batch_packing=...)`` stores and the loader
  wrapper that puts the sampler into Megatron-Bridge's loop.

A policy only places the samples Megatron-Bridge's sampler drew for a step; the step, the packer
and the layout contract keep seeing one micro-batch at a time and never import this package.
"""

from megatron.bridge_thd.cost.sample import SampleCost, image_patches, sample_cost
from megatron.bridge_thd.batching.policy import Assignment, PlacementStats, assign, in_batch_assignment, placement_stats

__all__ = ["SampleCost", "sample_cost", "image_patches", "Assignment", "assign", "in_batch_assignment",
           "PlacementStats", "placement_stats"]
