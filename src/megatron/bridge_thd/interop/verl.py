"""Drop-in replacements for VERL's packed-sequence helpers (``verl/models/mcore/util.py``; the
VERL release they are checked against: docs/compatibility.md).

A VERL user swaps one import (``megatron.bridge_thd.verl`` is the public alias of this module)::

    # from verl.models.mcore.util import preprocess_packed_seqs, postprocess_packed_seqs
    from megatron.bridge_thd.verl import preprocess_packed_seqs, postprocess_packed_seqs

Signatures, return types, packed layout, alignment (FP8 included), zigzag CP split and CP gather
are VERL's. What differs, on purpose: vectorised (op count independent of B, one host sync per
call where VERL makes 3 + B); real and padded boundaries kept apart (``pad_between_seqs``), so
alignment slots are never counted as tokens; any 0 / 1 mask dtype under the step's rule
(:func:`megatron.bridge_thd.lengths.keep_mask_from_2d`); an all-padding micro-batch gives one
aligned padding segment; a mismatched output or mask, and FP8 padding on VERL's vision-model
call, are a ``ValueError`` where VERL crashes or unpacks the wrong slots. Contract, gradients
under CP, proofs and figures: docs/verl.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.context_parallel import thd_partition_indices
from megatron.bridge_thd.lengths import DeferredCheck, keep_mask_from_2d, raise_failed_checks
from megatron.bridge_thd.packing import (
    pack_bshd_to_thd,
    required_alignment,
    round_up,
    scatter_into_row,
    thd_packed_seq_params,
)

__all__ = ["preprocess_packed_seqs", "postprocess_packed_seqs"]

# VERL's FP8 padding: the whole row must be a multiple of align * 128 for Transformer Engine.
_FP8_ROW_FACTOR = 128


def _parallel_sizes() -> tuple[int, int, int, object]:
    """(tp_size, cp_size, cp_rank, cp_group) from Megatron-Core's ``parallel_state``, as VERL reads
    them; (1, 1, 0, None) when the model-parallel groups are not initialised (a single process)."""
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return 1, 1, 0, None
    cp_size = mpu.get_context_parallel_world_size()
    cp_group = mpu.get_context_parallel_group() if cp_size > 1 else None
    return mpu.get_tensor_model_parallel_world_size(), cp_size, mpu.get_context_parallel_rank(), cp_group


def _model_builds_the_row() -> bool:
    """Whether a ``pre_process=False`` call here means that the model packs the padded batch
    itself: True on the first pipeline stage (and without pipeline parallelism), where a model
    with embeddings runs. In the pinned VERL the only such call is ``model_forward_gen(vision_model=True)``
    (and its fused twin): it hands the padded ``(B, T)`` ids and mask to the model. On a later
    stage ``pre_process=False`` is the text-model path (hidden states arrive from the stage that
    packed the row with these very boundaries); with virtual pipeline stages the chunk is unknown
    here, so False."""
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized() or mpu.get_pipeline_model_parallel_world_size() == 1:
        return True
    return mpu.get_pipeline_model_parallel_rank() == 0 and mpu.get_virtual_pipeline_model_parallel_world_size() is None


def _check_flag(name: str, value) -> bool:
    # A string such as "False" would be truthy: accept only real booleans (and 0 / 1).
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ValueError(f"{name}: expected a bool, got {value!r}")


def _check_mask(attention_mask, batch_size: int, seq_len: int) -> None:
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"attention_mask: expected a (B, T) torch.Tensor, got {type(attention_mask).__name__}; "
            "convert it with torch.as_tensor"
        )
    if tuple(attention_mask.shape) != (batch_size, seq_len):
        raise ValueError(
            f"attention_mask: expected shape ({batch_size}, {seq_len}) (one 0/1 entry per token of input_ids), "
            f"got {tuple(attention_mask.shape)}"
        )



def _pack_trailing(values: torch.Tensor, packed_index: torch.Tensor, row_length: int) -> torch.Tensor:
    """``(B, T, *F)`` -> ``(1, N, *F)`` with the packer's scatter (trailing dims moved in front)."""
    batch_size, seq_len, *features = values.shape
    flat = values.reshape(batch_size, seq_len, -1).permute(2, 0, 1)  # (F, B, T)
    row = scatter_into_row(flat, packed_index, row_length, 0)  # (F, 1, N)
    return row.permute(1, 2, 0).reshape(1, row_length, *features)


def preprocess_packed_seqs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pre_process: bool = True,
    use_fp8_padding: bool = False,
) -> tuple[torch.Tensor, PackedSeqParams]:
    """Pack a padded batch into this CP rank's share of one THD row (VERL's signature).

    Args:
        input_ids: ``(B, T)`` token ids, or ``(B, T, *F)`` per-token values (VERL packs labels,
            masks, hidden states and ``position_ids.permute(1, 2, 0)`` with the same call).
        attention_mask: ``(B, T)`` 0/1 keep mask (bool, int or float), real tokens at any
            positions: VERL's left-padded prompt + right-padded response.
        pre_process: False (a pipeline stage without embeddings): return ``input_ids`` as it
            came, with the packed metadata, as VERL does.
        use_fp8_padding: align slots to ``lcm(align, 16)`` and the row to ``align * 128``.

    Returns:
        input_ids_rmpad: ``(1, N / cp, *F)``, this CP rank's zigzag share of the packed row
            (padding slots 0); ``input_ids`` itself when ``pre_process`` is False.
        packed_seq_params: ``PackedSeqParams(qkv_format="thd")``: ``cu_seqlens_q`` / ``_kv``
            ``(B + 1,)`` int32 real boundaries, ``cu_seqlens_q_padded`` / ``_kv_padded``
            ``(B + 1,)`` int32 aligned boundaries of the full row (last entry N), ``max_seqlen_q``
            / ``_kv`` the longest aligned slot, ``pad_between_seqs`` True when any slot holds
            padding. For a batch without any real token, one extra segment of ``align`` padding
            slots (``(B + 2,)`` boundaries) keeps the row non-empty.

    Raises:
        ValueError: bad shapes, dtypes or flags, or a mask with values other than 0 / 1, naming
            the argument.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() < 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids: expected a (B, T) or (B, T, ...) tensor, got {shape}; add a batch dimension")
    batch_size, seq_len = input_ids.shape[:2]
    if batch_size == 0:
        raise ValueError("input_ids: the batch is empty (B = 0); skip the micro-batch instead")
    _check_mask(attention_mask, batch_size, seq_len)
    pre_process = _check_flag("pre_process", pre_process)
    use_fp8_padding = _check_flag("use_fp8_padding", use_fp8_padding)
    if use_fp8_padding and not pre_process and _model_builds_the_row():
        # Megatron-Bridge's Qwen3VLModel packs a padded (B > 1, T) batch itself with its own
        # preprocess_packed_seqs (slots of tp * cp * 2, no FP8 rule): the FP8 boundaries returned
        # here would describe a longer row than the one it attends over (IndexError / reads past
        # the row). Refused before anything runs, whatever the batch.
        raise ValueError(
            "use_fp8_padding: True with pre_process=False on the first pipeline stage: the model will pack the "
            "padded (B, T) batch itself (VERL's model_forward_gen(vision_model=True) passes input_ids and "
            "attention_mask to Megatron-Bridge's Qwen3VLModel, which packs them into slots of tp * cp * 2 without "
            "FP8 padding), so FP8 boundaries (slots of lcm(align, 16), row stretched to align * 128) would not "
            "describe the row it attends over. Fix: call the model with the packed row instead (pre_process=True: "
            "input_ids_rmpad and the packed 3D MRoPE position_ids, VERL's text-model call, which Qwen3VLModel "
            "accepts at any CP size), or set use_fp8_padding=False for this model (VERL sets it for fp8 "
            "'e4m3' / 'hybrid')"
        )

    tp_size, cp_size, cp_rank, _ = _parallel_sizes()
    # VERL aligns to tp (with or without sequence parallelism) times 2 * cp: the project's rule
    # with sequence_parallel=True.
    align = required_alignment(tp_size, cp_size, sequence_parallel=True)
    slot_align = required_alignment(tp_size, cp_size, sequence_parallel=True, fp8=use_fp8_padding)

    mask = attention_mask.to(input_ids.device)
    # The last sample's real length rides along the packer's one host read: it sizes the
    # stretched last slot's max_seqlen under FP8 padding.
    host_values = (mask[-1] != 0).sum().reshape(1) if use_fp8_padding else None
    # The packer takes (B, T) ids; trailing-dim values are scattered with its packed_index below.
    ids_2d = input_ids if input_ids.dim() == 2 else input_ids.flatten(2)[..., 0]
    packed = pack_bshd_to_thd(
        ids_2d,
        mask,
        align_to=slot_align,
        min_length=slot_align,
        # The mask's 0/1 check (lengths.keep_mask_from_2d, the step's rule) rides the packer's read.
        host_values=host_values,
    )
    row_length = packed.padding_mask.shape[-1]
    cu_seqlens, cu_seqlens_padded = packed.cu_seqlens, packed.cu_seqlens_padded
    max_seqlen, pad_between_seqs = packed.max_seqlen, packed.packed_seq_params.pad_between_seqs

    full_length = row_length
    if use_fp8_padding:
        full_length = round_up(row_length, align * _FP8_ROW_FACTOR)
        if full_length != row_length:
            # VERL stretches the last slot (not an extra segment), so the row keeps B + 1 segments.
            stretch = full_length - row_length
            extra_segment = cu_seqlens_padded.numel() == batch_size + 2
            last_slot = row_length if extra_segment else round_up(packed.host_values[0], slot_align)
            max_seqlen = max(max_seqlen, last_slot + stretch)
            cu_seqlens_padded = torch.cat([cu_seqlens_padded[:-1], cu_seqlens_padded.new_full((1,), full_length)])
            pad_between_seqs = True

    params = thd_packed_seq_params(cu_seqlens, cu_seqlens_padded, max_seqlen, pad_between_seqs)
    if not pre_process:
        return input_ids, params

    if input_ids.dim() == 2:
        row = packed.input_ids
    else:
        row = _pack_trailing(input_ids, packed.packed_index, row_length)
    if full_length != row_length:
        row = torch.cat([row, row.new_zeros((1, full_length - row_length, *row.shape[2:]))], dim=1)
    if cp_size > 1:
        row = row.index_select(1, thd_partition_indices(cu_seqlens_padded, full_length, cp_size, cp_rank))
    return row, params


def _gather_over_cp(output: torch.Tensor, cp_size: int, cp_rank: int, group) -> torch.Tensor:
    """``(1, n, ...)`` local rows of every CP rank -> ``(1, cp * n, ...)``, rank-major.

    As VERL: the other ranks' shards are gathered detached and this rank's shard is the input
    itself, so autograd reaches this rank's shard only (see the module docstring).
    """
    parts = [torch.empty_like(output) for _ in range(cp_size)]
    dist.all_gather(parts, output.detach().contiguous(), group=group)
    parts[cp_rank] = output
    return torch.cat(parts, dim=1)


def postprocess_packed_seqs(
    output: torch.Tensor,
    packed_seq_params: PackedSeqParams,
    attention_mask: torch.Tensor,
    batch_size: int,
    seq_len: int,
    post_process: bool = True,
) -> torch.Tensor:
    """Unpack this CP rank's model output back to the padded batch (VERL's signature).

    Args:
        output: ``(1, N / cp, *F)`` this rank's per-slot output (logits, log-probs, values), in
            the local order :func:`preprocess_packed_seqs` produced.
        packed_seq_params: the params :func:`preprocess_packed_seqs` returned (VERL's own work
            too: real boundaries equal to the padded ones are accepted).
        attention_mask: ``(B, T)`` the mask given to :func:`preprocess_packed_seqs`.
        batch_size, seq_len: B and T.
        post_process: False (a pipeline stage without the output layer): return ``output``.

    Returns:
        ``(B, T, *F)``: every real position gets its slot's value, padding positions 0. Under CP
        the output is all-gathered over the CP group first. Differentiable with respect to
        ``output`` (this rank's shard; see the module docstring).

    Raises:
        ValueError: bad shapes, or an output / mask that does not match ``packed_seq_params``
            (checked with one host read), naming the argument.
    """
    if not _check_flag("post_process", post_process):
        return output
    check_int("batch_size", batch_size, 1)
    check_int("seq_len", seq_len, 0)
    if not isinstance(output, torch.Tensor) or output.dim() < 2 or output.shape[0] != 1:
        shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"output: expected this rank's packed row (1, N / cp, ...), got {shape}")
    _check_mask(attention_mask, batch_size, seq_len)
    if not isinstance(packed_seq_params, PackedSeqParams):
        raise ValueError(f"packed_seq_params: expected the PackedSeqParams preprocess_packed_seqs returned, got "
                         f"{type(packed_seq_params).__name__}")
    cu_real, cu_padded = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
    if cu_padded is None:
        cu_padded = cu_real
    if not isinstance(cu_padded, torch.Tensor) or cu_padded.dim() != 1 or cu_padded.numel() < batch_size + 1:
        raise ValueError(
            "packed_seq_params: expected cu_seqlens_q_padded (or cu_seqlens_q) of at least batch_size + 1 = "
            f"{batch_size + 1} boundaries; pass the params preprocess_packed_seqs returned for this batch"
        )

    _, cp_size, cp_rank, cp_group = _parallel_sizes()
    local_length = output.shape[1]
    row_length = local_length * cp_size
    device = output.device
    mask = attention_mask.to(device)
    # The step's rule (one rule, one error): bool or 0/1 values, checked in this call's host read.
    keep, mask_checks = keep_mask_from_2d(mask, "attention_mask")
    cu = cu_padded.to(device=device, dtype=torch.int64)
    starts, slots = cu[:batch_size], cu[1 : batch_size + 1] - cu[:batch_size]
    lengths = keep.sum(dim=1)

    checks = mask_checks + [
        DeferredCheck(
            cu[-1] != row_length,
            f"output: {local_length} slots on each of {cp_size} CP ranks do not make the packed row of "
            "packed_seq_params (cu_seqlens_q_padded[-1]); pass this rank's output for this very batch (a model "
            "that packed the padded batch itself, as Megatron-Bridge's Qwen3VLModel does on VERL's vision-model call, "
            "builds its own row: with one sample, or with use_fp8_padding=True under virtual pipeline stages)",
        ),
        DeferredCheck(
            (lengths > slots).any(),
            "attention_mask: more real tokens than packed_seq_params has slots for; pass the mask given "
            "to preprocess_packed_seqs",
        ),
    ]
    # VERL's own params carry the padded boundaries as the real ones (the same tensor); ours
    # carry the real ones, which must match the mask.
    if isinstance(cu_real, torch.Tensor) and cu_real is not cu_padded:
        cu_r = cu_real.to(device=device, dtype=torch.int64)
        checks.append(DeferredCheck(
            (cu_r[1 : batch_size + 1] - cu_r[:batch_size] != lengths).any(),
            "attention_mask: its real lengths differ from packed_seq_params.cu_seqlens_q; pass the mask "
            "given to preprocess_packed_seqs",
        ))
    # The one host read of this call.
    raise_failed_checks(checks)

    # Offset of each real token inside its sample's slot of the full row.
    offset = keep.cumsum(dim=1) - 1
    if cp_size > 1:
        values = _gather_over_cp(output, cp_size, cp_rank, cp_group)[0]
        # Where the zigzag split put the slot: chunk c of the sample's 2cp chunks lives on rank
        # c (first half of its local piece) or 2cp-1-c (second half).
        chunk = (slots // (2 * cp_size)).clamp_min(1)[:, None]
        c = torch.div(offset, chunk, rounding_mode="floor")
        second = c >= cp_size
        rank = torch.where(second, 2 * cp_size - 1 - c, c)
        local = starts[:, None] // cp_size + offset - c * chunk + second * chunk
        index = rank * local_length + local
    else:
        values = output[0]
        index = starts[:, None] + offset
    # Logits (N, V) are the largest tensor of the step: no padded copy of them (as the packer's
    # gather_from_row would make); padding positions read slot 0 and are zeroed in place.
    unpacked = values[index.masked_fill(~keep, 0)]
    return unpacked.masked_fill_(~keep.view(*keep.shape, *([1] * (unpacked.dim() - 2))), 0)
