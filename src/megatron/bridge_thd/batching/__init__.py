"""Batching policies: which of a step's samples go to which DP rank and micro-batch. Reasoning and
figures: docs/batching.md. Import from the modules:

* :mod:`.policy`: the placement (``assign``), Megatron-Bridge's own for comparison
  (``in_batch_assignment``), and its measures (``placement_stats``); what a sample costs is
  :mod:`megatron.bridge_thd.cost.sample` (``sample_cost``, from Megatron-Bridge's own FLOPs terms).
* :mod:`.sizes`: every sample's tokens and patches before collate (metadata, a lengths file, cache or one scan).
* :mod:`.sampler`: the batch sampler that places Megatron-Bridge's own draws step by step, and the
  static row chosen from them.
* :mod:`.cp_per_sample`, :mod:`.time_placement`, :mod:`.cp_per_sample_loader`: a CP size per sample, placed by
  Megatron-Core's scheduler or on the time model, and the loader that yields each rank's rows.
* :mod:`.bridge`: the loader wrapper that puts the sampler into Megatron-Bridge's loop (the setting
  ``configure(..., global_batch_packing=...)`` stores is :class:`megatron.bridge_thd.settings.GlobalBatchPacking`).

A policy only places the samples Megatron-Bridge's sampler drew for a step; the step, the packer
and the layout contract keep seeing one micro-batch at a time and never import this package.
"""
