"""Opt-in: hand the packed row's padding mask to the MoE routers of Megatron-Bridge's Qwen3-VL.

On one line of Megatron-Bridge ``Qwen3VLModel.forward`` declares no ``padding_mask``, so its routers count
every padding slot of a packed row (alignment padding, the ``thd_static`` tail, BSHD pad columns) in the
aux loss, z-loss and expert-bias statistics. On the other it declares one and derives it from the THD
boundaries when omitted, but with host reads, refusing zero-length segments, and Megatron-Core's router
still crashes with expert bias, fills expert capacity with padding and computes ``seq_aux_loss`` over the
whole row (docs/compatibility.md, ``upstream_line.model_takes_padding_mask``). :func:`.hook.with_padding_mask`
makes both the same, through one mechanism: padding-aware subclasses, assigned in place (same parameters
and state-dict keys). The model becomes ``PaddingMask<Class>``, whose ``forward`` takes ``padding_mask``
(True = padding; derived from the boundaries without a host read when omitted), hands it to the model's
own ``padding_mask`` where the model declares one (cut for CP as the model expects), and for the duration
of the call makes the mask, cut as the model cuts its hidden states (CP, SP), available through one
context variable; each decoder MoE
layer becomes :class:`.routers.PaddingMaskMoELayer` (takes that mask; from there Megatron-Core's own path
carries it to the router) and its router :class:`.routers.PaddingMaskTopKRouter` (expert-bias counts that
take the mask, capacity from the real tokens, ``seq_aux_loss`` per sample). Usage, before
Megatron wraps the model::

    from megatron.bridge_thd.moe_padding.hook import padding_mask_pre_wrap_hook
    cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)   # or: model = with_padding_mask(model)

Refused with the setting named: full recompute, CUDA graphs, ``mlp_chunks_for_training > 1``.
Models other than Megatron-Bridge's ``Qwen3VLModel`` that declare ``padding_mask`` (Megatron-Core's
``GPTModel``) are returned unchanged. Details, the upstream bug
worked around, why subclasses of the built model rather than a layer spec, what is not covered:
docs/moe-padding-mask.md, docs/moe-routing.md.

Modules, by job: :mod:`.mask` (the padding mask and the sample index of a THD row, from its boundaries),
:mod:`.capacity` (expert capacity from the real tokens), :mod:`.forward_padding` (the one context variable from
the model's forward to its MoE layers), :mod:`.routers` (the padding-aware ``MoELayer`` and ``TopKRouter``),
:mod:`.model` (the ``PaddingMask<Class>`` factory and its forward), :mod:`.refusals` (the settings refused),
:mod:`.hook` (:func:`.hook.with_padding_mask`, :func:`.hook.padding_mask_pre_wrap_hook`).
"""
