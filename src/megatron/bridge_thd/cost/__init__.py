"""The cost model: what a sample and a row cost, below both the batching policies and the planner.

* :mod:`.presets`: the model specs (:class:`~.presets.ModelSpec`, the planner's presets, a ``config.json`` reader);
* :mod:`.flops`: the trainer's own FLOPs formula, fed a spec;
* :mod:`.sample`: what one sample costs (:func:`~.sample.sample_cost`, :func:`~.sample.image_patches`);
* :mod:`.step_time`: the time model, a rank's row on a named GPU (docs/time-model.md).

It imports neither :mod:`megatron.bridge_thd.batching` nor :mod:`megatron.bridge_thd.plan`; both import it.
"""
