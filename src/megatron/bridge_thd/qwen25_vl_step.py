"""Drop-in ``forward_step`` for Megatron-Bridge's Qwen2.5-VL training with real THD packing.

Replaces Megatron-Bridge's ``vlm_step`` for ``Qwen25VLModel``::

    from megatron.bridge_thd.qwen25_vl_step import forward_step
    finetune(config, forward_step_func=forward_step)

The family-agnostic step (:mod:`megatron.bridge_thd.step`) bound to the Qwen2.5-VL adapter
(:data:`megatron.bridge_thd.adapters.QWEN25_VL`): ``thd`` and ``bshd`` layouts, CP = 1. See
docs/adapters.md and docs/qwen25-vl.md.
"""

from megatron.bridge_thd.adapters import QWEN25_VL
from megatron.bridge_thd.step.forward import make_forward_step

__all__ = ["forward_step"]

forward_step = make_forward_step(QWEN25_VL)
