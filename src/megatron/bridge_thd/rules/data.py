"""Rules on what reaches the step: offline and Energon packing, the sequence lengths (docs/rules.md)."""

from __future__ import annotations

from megatron.bridge_thd.rules.registry import CONFIGURE, STEP, rule
from megatron.bridge_thd.rules.setup import Setup


@rule(CONFIGURE)
def _offline_packing(s: Setup) -> list[str]:
    """Offline packing settings that are on: batches would arrive pre-packed with cu_seqlens."""
    return [
        f"dataset.{name}: set ({value}), but offline packing and in-batch packing are mutually "
        "exclusive (Megatron-Bridge refuses both) and pre-packed batches carry cu_seqlens, which this step rejects; "
        "set dataset.enable_offline_packing=False and dataset.offline_packing_specs=None (the pinned "
        "Megatron-Bridge's names; packed_sequence_specs=None in older releases), or keep offline packing with "
        "Megatron-Bridge's own step"
        for name, value in s.offline_packing
    ]


@rule(CONFIGURE, STEP)
def _energon_packing(s: Setup) -> list[str]:
    """Energon's own packing on (``dataset.packing_buffer_size``): batches would arrive as rows it packed already."""
    if s.packing_buffer_size is None:
        return []
    return [
        f"dataset.packing_buffer_size: set ({s.packing_buffer_size!r}), which turns on Energon's own packing: its "
        "loader bin-packs samples into rows of micro-batch 1 with cu_seqlens before any step sees them, and this step "
        "packs each micro-batch itself (a batch that carries cu_seqlens is refused; Megatron-Bridge also refuses "
        "Energon packing with defer_in_batch_packing_to_step, which configure sets). Set "
        "dataset.packing_buffer_size=None so that this step packs every micro-batch (global_batch_packing balances "
        "the rows across ranks), or keep Energon's packing with Megatron-Bridge's own vlm_step"
    ]


@rule(CONFIGURE)
def _seq_lengths_agree(s: Setup) -> list[str]:
    """``dataset.seq_length`` and ``model.seq_length`` both set, to different values."""
    dataset_length, model_length = s.seq_lengths
    if dataset_length is None or model_length is None or dataset_length == model_length:
        return []
    # Megatron-Bridge's ConfigContainer.validate asserts equality only for five dataset config classes
    # (docs/compatibility.md).
    return [
        f"dataset.seq_length={dataset_length!r} and model.seq_length={model_length!r} differ: the collate pads and "
        "truncates to dataset.seq_length, while megatron.bridge_thd's step truncates samples and sizes static rows "
        "by model.seq_length (qwen3_vl_step._step_settings) and the pipeline schedule sizes its p2p buffers by it "
        "(training/train.py); Megatron-Bridge's ConfigContainer.validate checks the two only for some dataset "
        "configs. Set dataset.seq_length and model.seq_length to the same value"
    ]


@rule(CONFIGURE, STEP)
def _seq_length_set(s: Setup) -> list[str]:
    """No ``model.seq_length``: the step bounds sample lengths and sizes static rows by it."""
    if s.seq_length is not None:
        return []
    return ["model.seq_length: not set; the step needs it to bound sample lengths and size static rows; set "
            "model.seq_length (and dataset.seq_length) to the collate's width"]
