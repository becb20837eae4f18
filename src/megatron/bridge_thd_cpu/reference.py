"""A CPU reference for packed Qwen3-VL: THD attention and a Megatron-signature wrapper.

Megatron-Core models need CUDA to build, so the reference is the Hugging Face Qwen3-VL
implementation (dense or MoE, weights untouched) whose language-model attention is switched,
for the duration of a packed forward, to :func:`thd_attention`, which follows Transformer
Engine's THD semantics. The vision tower keeps its own per-image bidirectional attention.
``transformers`` is imported lazily: the package itself does not depend on it.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from megatron.bridge_thd.lengths import keep_mask_from_attention_mask, raise_failed_checks
from megatron.bridge_thd.mrope import qwen3_vl_position_ids
from megatron.bridge_thd.packing import gather_from_row, scatter_into_row, segment_index

__all__ = ["thd_attention", "ReferenceQwen3VL", "ATTENTION_NAME", "TINY_VISION_CONFIG", "TINY_TEXT_CONFIG",
           "tiny_hf_qwen3_vl_config"]

TINY_VISION_CONFIG = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
)
"""The tiny vision tower shared by :meth:`ReferenceQwen3VL.tiny` and the CPU build of
Megatron-Bridge's model (``megatron.bridge_thd_cpu.model``)."""

TINY_TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
"""The tiny language model's geometry (Hugging Face ``text_config`` fields), shared by
:meth:`ReferenceQwen3VL.tiny` and the CPU training checkpoint (``bridge_thd_testbed.training``)."""

_TINY_MOE_TEXT_CONFIG = dict(moe_intermediate_size=32, num_experts_per_tok=2, decoder_sparse_step=1)


def tiny_hf_qwen3_vl_config(*, text: dict, vision: dict, tokens: dict, moe: bool = False):
    """A Hugging Face tiny Qwen3-VL (or Qwen3-VL-MoE) config and its model class.

    Args:
        text: ``text_config`` fields on top of :data:`TINY_TEXT_CONFIG` (vocabulary, layers, ids;
            ``num_experts`` with ``moe``).
        vision: ``vision_config`` fields on top of :data:`TINY_VISION_CONFIG`.
        tokens: the top-level token ids (image, video, vision start / end).
        moe: mixture-of-experts text model (top-2 of ``text["num_experts"]``, experts of 32).

    Returns:
        ``(config, model class)``.
    """
    import copy

    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text_config = dict(copy.deepcopy(TINY_TEXT_CONFIG), **(_TINY_MOE_TEXT_CONFIG if moe else {}), **text)
    vision_config = dict(copy.deepcopy(TINY_VISION_CONFIG), **vision)
    config_cls, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration) if moe else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    config = config_cls(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **tokens)
    return config, model_cls


ATTENTION_NAME = "megatron_bridge_thd_reference"
"""Name under which :func:`thd_attention` is registered with ``transformers.AttentionInterface``."""

# Forward kwargs that carry THD metadata to the attention function. Hugging Face passes a
# model's **kwargs to the vision tower too, where "cu_seqlens" would be taken as the vision
# boundaries, so these names are our own.
_KWARG_CU_Q = "thd_cu_seqlens_q"
_KWARG_CU_KV = "thd_cu_seqlens_kv"
_KWARG_CU_Q_PADDED = "thd_cu_seqlens_q_padded"
_KWARG_CU_KV_PADDED = "thd_cu_seqlens_kv_padded"
_KWARG_MAX_SEQLEN = "thd_max_seqlen"


def thd_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_kv: torch.Tensor,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Attention over a packed THD row with Transformer Engine's semantics.

    Sample i's queries sit at ``[cu_q_padded[i], cu_q_padded[i] + len_q_i)`` and its keys at
    ``[cu_kv_padded[i], cu_kv_padded[i] + len_kv_i)``; a query sees only keys of its own sample
    (causal: key offset <= query offset, top-left aligned, TE's ``"causal"``). Slots past a
    sample's real length are padding: they are never attended to and their output is 0.

    Args:
        q: ``(Nq, H, D)``; k, v: ``(Nkv, Hkv, D)`` with H a multiple of Hkv (GQA: query head h
            uses kv head ``h // (H / Hkv)``).
        cu_seqlens_q, cu_seqlens_kv: ``(S + 1,)`` real boundaries.
        cu_seqlens_q_padded, cu_seqlens_kv_padded: ``(S + 1,)`` physical boundaries; None means
            equal to the real ones.
        causal: causal within each sample.
        softmax_scale: defaults to ``1 / sqrt(D)``.
        max_seqlen: an upper bound of the real lengths; computed (one host read) when None.

    Returns:
        ``(Nq, H, D)`` attention output, 0 at padding slots.
    """
    num_q, heads, head_dim = q.shape
    num_kv, kv_heads, _ = k.shape
    if heads % kv_heads:
        raise ValueError(f"k: {kv_heads} kv heads do not divide {heads} query heads")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError("cu_seqlens_kv: must describe as many samples as cu_seqlens_q")
    if max_seqlen is None:
        max_seqlen = int(torch.cat([cu_seqlens_q.diff(), cu_seqlens_kv.diff(), cu_seqlens_q.new_zeros(1)]).max())
    q_index, q_valid = segment_index(cu_seqlens_q, cu_seqlens_q_padded, row_length=num_q, max_seqlen=max_seqlen)
    kv_index, kv_valid = segment_index(cu_seqlens_kv, cu_seqlens_kv_padded, row_length=num_kv, max_seqlen=max_seqlen)

    # (N, H, D) -> (S, H, L, D)
    q_s = gather_from_row(q, q_index).transpose(1, 2)
    k_s = gather_from_row(k, kv_index).transpose(1, 2)
    v_s = gather_from_row(v, kv_index).transpose(1, 2)
    group = heads // kv_heads
    k_s, v_s = k_s.repeat_interleave(group, dim=1), v_s.repeat_interleave(group, dim=1)
    allowed = kv_valid[:, None, :].expand(-1, max_seqlen, -1)
    if causal:
        allowed = allowed & torch.ones(max_seqlen, max_seqlen, dtype=torch.bool, device=q.device).tril()
    # Padding queries attend to every slot so that no softmax row is empty; their output is dropped.
    allowed = allowed | ~q_valid[:, :, None]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    out = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=allowed[:, None], scale=scale)
    out = out.transpose(1, 2)  # (S, L, H, D)
    row = q.new_zeros(num_q + 1, heads, head_dim)
    row = row.index_put((q_index.flatten(),), out.reshape(-1, heads, head_dim) * q_valid.reshape(-1, 1, 1))
    return row[:num_q]


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``transformers.AttentionInterface`` adapter: ``(1, H, N, D)`` in, ``(1, N, H, D)`` out."""
    if query.shape[0] != 1:
        raise ValueError("thd reference attention: a packed THD row has batch size 1")
    out = thd_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kwargs[_KWARG_CU_Q],
        kwargs[_KWARG_CU_KV],
        kwargs.get(_KWARG_CU_Q_PADDED),
        kwargs.get(_KWARG_CU_KV_PADDED),
        causal=True,
        softmax_scale=scaling,
        max_seqlen=kwargs.get(_KWARG_MAX_SEQLEN),
    )
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    # Boundaries come from cu_seqlens; a dense (N, N) mask would only cost memory.
    return None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


@contextlib.contextmanager
def _language_model_attention(text_config, name: str):
    """Switch only the language model's attention; the vision config keeps its own."""
    previous = text_config._attn_implementation
    text_config._attn_implementation = name
    try:
        yield
    finally:
        text_config._attn_implementation = previous


class ReferenceQwen3VL(torch.nn.Module):
    """A Hugging Face Qwen3-VL (dense or MoE) behind Megatron-Bridge's ``Qwen3VLModel.forward``.

    Without ``packed_seq_params`` it runs ordinary padded BSHD. With it, ``input_ids`` is one
    ``(1, N)`` THD row and the language model attends through :func:`thd_attention`.
    """

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        _register_attention()
        self.hf_model = hf_model
        self.config = hf_model.config
        self.router_token_counts: torch.Tensor | None = None
        """``(layers, experts)`` tokens routed to each expert in the last forward, padding
        excluded; None for a dense model."""
        self._routing: list[torch.Tensor] = []
        self._routers = [m for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
        for router in self._routers:
            router.register_forward_hook(self._record_routing)

    def _record_routing(self, module, inputs, outputs) -> None:
        self._routing.append(outputs[2])  # (tokens, top_k) selected experts

    @classmethod
    def tiny(cls, seed: int = 0, moe: bool = False, dtype: torch.dtype = torch.float32) -> "ReferenceQwen3VL":
        """A small random Qwen3-VL (no download): 3 text layers, GQA, deepstack, 2 vision blocks.

        Token ids: vocabulary 256; image 250, video 251, vision start 252, vision end 253,
        padding 0. Vision: patch 4, temporal patch 2, merge 2 (one LLM token per 2x2 patches).
        """
        config, model_cls = tiny_hf_qwen3_vl_config(
            text=dict(vocab_size=256, num_hidden_layers=3, max_position_embeddings=4096, pad_token_id=0,
                      **(dict(num_experts=8) if moe else {})),
            vision={},
            tokens=dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253),
            moe=moe,
        )
        config._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = model_cls(config).to(dtype).eval()
        return cls(model)

    @property
    def spatial_merge_size(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def position_ids(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`qwen3_vl_position_ids` with this model's token ids: ``(3, B, T)``."""
        return qwen3_vl_position_ids(
            input_ids,
            attention_mask,
            image_grid_thw,
            video_grid_thw,
            image_token_id=self.config.image_token_id,
            video_token_id=self.config.video_token_id,
            vision_start_token_id=self.config.vision_start_token_id,
            spatial_merge_size=self.spatial_merge_size,
        )

    def _packed_position_ids(self, input_ids, packed_seq_params, image_grid_thw, video_grid_thw) -> torch.Tensor:
        """Per-sample MRoPE positions laid on the packed row: ``(3, 1, N)``."""
        row_length = input_ids.shape[1]
        index, valid = segment_index(
            packed_seq_params.cu_seqlens_q,
            packed_seq_params.cu_seqlens_q_padded,
            row_length=row_length,
            max_seqlen=packed_seq_params.max_seqlen_q,
        )
        per_sample = self.position_ids(gather_from_row(input_ids[0], index), valid, image_grid_thw, video_grid_thw)
        return scatter_into_row(per_sample, index, row_length, 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        packed_seq_params=None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Megatron-Bridge ``Qwen3VLModel.forward`` semantics on the CPU.

        Args:
            input_ids: ``(B, T)`` padded batch, or ``(1, N)`` THD row with ``packed_seq_params``.
            position_ids: ``(3, B, T)`` / ``(3, 1, N)`` MRoPE ids; anything else (None, 2D
                text positions) is replaced by per-sample MRoPE computed from ``input_ids``.
            attention_mask: BSHD only: ``(B, T)`` keep mask or 4D Megatron mask. Ignored with
                ``packed_seq_params`` (the boundaries say everything).
            labels: ``(B, T)`` next-token targets, already shifted (Megatron convention).
            loss_mask: accepted for signature parity; the loss function applies it.
            packed_seq_params: ``PackedSeqParams`` with ``qkv_format="thd"``.
            padding_mask: ``(B, T)`` bool, True = padding: tokens the MoE router must not count.

        Returns:
            logits ``(B, S, V)`` without labels; per-token cross-entropy ``(B, S)`` with labels
            (0 where the label is -100).
        """
        packed = packed_seq_params is not None
        keep = None
        if packed:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids: a THD row has shape (1, N), got {tuple(input_ids.shape)}")
        elif attention_mask is not None:
            keep, checks = keep_mask_from_attention_mask(attention_mask, *input_ids.shape)
            raise_failed_checks(checks)
        if position_ids is None or position_ids.dim() != 3 or position_ids.shape[0] != 3:
            if packed:
                position_ids = self._packed_position_ids(input_ids, packed_seq_params, image_grid_thw, video_grid_thw)
            else:
                position_ids = self.position_ids(input_ids, keep, image_grid_thw, video_grid_thw)

        model_kwargs = dict(
            input_ids=input_ids,
            position_ids=position_ids,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            pixel_values_videos=pixel_values_videos,
            video_grid_thw=video_grid_thw,
            use_cache=False,
        )
        self._routing = []
        if packed:
            model_kwargs.update(
                {
                    _KWARG_CU_Q: packed_seq_params.cu_seqlens_q,
                    _KWARG_CU_KV: packed_seq_params.cu_seqlens_kv,
                    _KWARG_CU_Q_PADDED: packed_seq_params.cu_seqlens_q_padded,
                    _KWARG_CU_KV_PADDED: packed_seq_params.cu_seqlens_kv_padded,
                    _KWARG_MAX_SEQLEN: max(packed_seq_params.max_seqlen_q, packed_seq_params.max_seqlen_kv),
                }
            )
            with _language_model_attention(self.config.text_config, ATTENTION_NAME):
                logits = self.hf_model(**model_kwargs).logits
        else:
            model_kwargs["attention_mask"] = None if keep is None else keep.long()
            logits = self.hf_model(**model_kwargs).logits

        if self._routers:
            if padding_mask is None:
                padding_mask = torch.zeros_like(input_ids, dtype=torch.bool) if keep is None else ~keep
            self.router_token_counts = self._count_routed_tokens(padding_mask)
        if labels is None:
            return logits
        return F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-100
        ).view_as(labels)

    def _count_routed_tokens(self, padding_mask: torch.Tensor) -> torch.Tensor:
        num_experts = self.config.text_config.num_experts
        real = ~padding_mask.flatten()
        counts = [
            torch.bincount(selected[real].flatten(), minlength=num_experts) for selected in self._routing
        ]
        return torch.stack(counts)
