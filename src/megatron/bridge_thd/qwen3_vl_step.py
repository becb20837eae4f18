"""Drop-in ``forward_step`` for Megatron-Bridge's Qwen3-VL and Qwen3.5-VL training with real THD packing.

Replaces ``megatron.bridge.models.qwen_vl.qwen3_vl_step.forward_step``::

    from megatron.bridge_thd.qwen3_vl_step import forward_step
    finetune(config, forward_step_func=forward_step)

The step itself is family-agnostic (:mod:`megatron.bridge_thd.step`); this module binds it to the
Qwen3-VL adapter (:data:`megatron.bridge_thd.adapters.QWEN3_VL`) and keeps the step's names users import from
here. See docs/megatron-bridge-step.md.
"""

from megatron.bridge_thd.adapters import QWEN3_VL
from megatron.bridge_thd.layouts import LAYOUT_NAMES
from megatron.bridge_thd.step.forward import forward_step
from megatron.bridge_thd.step.prepare import (  # noqa: F401 - truncate_to_seq_length: users import it from here
    PackingStats,
    PreparedMicroBatch,
    prepare_micro_batch,
    prepare_with_plan,
    truncate_to_seq_length,
)

__all__ = ["forward_step", "prepare_micro_batch", "prepare_with_plan", "PackingStats", "PreparedMicroBatch", "LAYOUT_NAMES", "QWEN3_VL"]


