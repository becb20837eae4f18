"""``PaddingMask<Class>``: the model class whose ``forward`` takes ``padding_mask``, cuts it as the model cuts
its row (CP) and hidden states (SP), and holds it in the context variable for the duration of the call."""

from __future__ import annotations

import inspect

import torch

from megatron.bridge_thd.context_parallel import cut_for_context_parallel
from megatron.bridge_thd.moe_padding.forward_padding import FORWARD_PADDING, ForwardPadding
from megatron.bridge_thd.moe_padding.mask import padding_mask_from_packed_seq_params, thd_sample_index
from megatron.bridge_thd.moe_padding.refusals import fail_if_unsupported
from megatron.bridge_thd.moe_padding.routers import moe_layers
from megatron.bridge_thd.rules.setup import uses_seq_aux_loss
from megatron.bridge_thd.upstream.loading import load_bridge_module
from megatron.bridge_thd.upstream.line import takes_parameter, upstream_line

QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"
# The helpers the model itself uses to cut its row for context parallelism; the mask is
# cut with the same functions so that it lines up with the hidden states token for token.
CP_HELPERS = ("_is_packed_input_pre_sharded", "_split_if_full_sequence", "get_packed_seq_cp_partition_indices")
_SUBCLASSES: dict[type, type] = {}


class PaddingMaskForward:
    """Mixin of the classes :func:`with_padding_mask` creates; its ``forward`` is set per class."""

    # Read by the step (by name, without importing this module): the routers of this model keep
    # padding out of expert capacity and compute seq_aux_loss per sample of a THD row.
    bridge_thd_routes_real_tokens_only = True

    def _padding_mask_for_model(self, padding_mask: torch.Tensor, input_ids, packed_seq_params, *,
                                dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """The mask cut the way the model cuts its row for context parallelism: ``(b, s_cp)`` ``dtype``.

        ``padding_mask`` has the shape of ``input_ids``: ``(1, N)`` for a THD row, ``(B, T)`` for
        BSHD, the rank-local row for pre-sharded THD input. The THD row is cut with the model's own
        ``get_packed_seq_cp_partition_indices`` (zigzag per segment), BSHD with its
        ``_split_if_full_sequence``. This is what a model that declares ``padding_mask`` itself
        takes as its argument (it cuts only the mask it derives, and scatters either for SP).
        """
        if input_ids is None:
            raise ValueError("padding_mask: given without input_ids; the model needs input_ids to place the mask")
        if tuple(padding_mask.shape) != tuple(input_ids.shape):
            raise ValueError(
                f"padding_mask: shape {tuple(padding_mask.shape)} does not match input_ids {tuple(input_ids.shape)}; "
                "pass one flag per input token (True = padding), before any context-parallel split"
            )
        mask = padding_mask.to(device=input_ids.device, dtype=dtype)
        if packed_seq_params is not None and input_ids.dim() == 2 and input_ids.size(0) > 1:
            raise ValueError(
                "padding_mask: legacy packed BSHD input (packed_seq_params with input_ids of "
                f"{input_ids.size(0)} rows, re-packed inside the model) is not supported; pack into one THD row "
                "(megatron.bridge_thd.qwen3_vl_step.forward_step does) or drop padding_mask"
            )
        return cut_for_context_parallel(mask, input_ids, packed_seq_params, self.pg_collection.cp).contiguous()

    def _padding_mask_for_layers(self, model_mask: torch.Tensor) -> torch.Tensor:
        """:meth:`_padding_mask_for_model`'s mask cut the way the model cuts its hidden states for sequence
        parallelism: rank r of the TP group keeps the r-th of ``tp`` equal chunks of the sequence, as
        ``scatter_to_sequence_parallel_region`` does. ``(b, s_local)``."""
        tp_size = self.pg_collection.tp.size()
        if not (self.config.sequence_parallel and tp_size > 1):
            return model_mask
        length = model_mask.size(1)
        if length % tp_size:
            raise ValueError(
                f"padding_mask: the rank-local sequence of {length} tokens is not divisible by the "
                f"tensor-parallel size {tp_size} (sequence parallelism); align the row to tp"
            )
        chunk = length // tp_size
        return model_mask.narrow(1, self.pg_collection.tp.rank() * chunk, chunk).contiguous()

    def _forward_with_padding_mask(self, base_forward, base_signature, args, kwargs, padding_mask):
        fail_if_unsupported(self.config)
        native = upstream_line().model_takes_padding_mask
        layers = moe_layers(self)
        if not layers and not native:  # a dense model, or a pipeline stage without MoE layers: nothing to hand over
            return base_forward(self, *args, **kwargs)
        bound = base_signature.bind(self, *args, **kwargs).arguments
        input_ids = bound.get("input_ids")
        packed_seq_params = bound.get("packed_seq_params")
        if padding_mask is None:
            padding_mask = _derived_padding_mask(self, input_ids, packed_seq_params)
        if padding_mask is None:
            return base_forward(self, *args, **kwargs)
        model_mask = self._padding_mask_for_model(padding_mask, input_ids, packed_seq_params)
        if native:
            # The model's own argument: it then derives nothing (no host read) and carries the mask to its
            # decoder (scattered for SP where it scatters its hidden states).
            kwargs = {**kwargs, "padding_mask": model_mask}
        if not layers:
            return base_forward(self, *args, **kwargs)
        samples = None
        if packed_seq_params is not None and input_ids.size(0) == 1 and uses_seq_aux_loss(self.config):
            segment, num_samples = thd_sample_index(packed_seq_params, input_ids.size(1))
            # Cut exactly as the mask (and the hidden states): CP zigzag, SP scatter.
            local = self._padding_mask_for_layers(
                self._padding_mask_for_model(segment, input_ids, packed_seq_params, dtype=torch.int64))
            samples = (local.transpose(0, 1), packed_seq_params.cu_seqlens_q.numel() - 1, num_samples)
        # For the duration of the call its MoE layers (PaddingMaskMoELayer) take the mask from here.
        token = FORWARD_PADDING.set(ForwardPadding(self._padding_mask_for_layers(model_mask), samples))
        try:
            return base_forward(self, *args, **kwargs)
        finally:
            FORWARD_PADDING.reset(token)


def _derived_padding_mask(model, input_ids, packed_seq_params) -> torch.Tensor | None:
    """As Megatron-Bridge's model does when it declares ``padding_mask``: a THD row without an explicit mask
    gets the one its boundaries imply (zero-length segments allowed, no host read). Pre-sharded CP input is
    rank-local while its boundaries describe the full row: no mask is derived for it (None)."""
    if packed_seq_params is None or input_ids is None or input_ids.dim() != 2 or input_ids.size(0) != 1:
        return None
    cp_size = model.pg_collection.cp.size()
    helpers = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    if cp_size > 1 and helpers._is_packed_input_pre_sharded(input_ids, packed_seq_params, cp_size=cp_size):
        return None
    return padding_mask_from_packed_seq_params(packed_seq_params, input_ids.size(1))


def _signature_with_padding_mask(base_forward) -> inspect.Signature:
    """The base ``forward`` signature plus ``padding_mask`` (keyword-only, before ``**kwargs``), unless it declares
    one already."""
    signature = inspect.signature(base_forward)
    if takes_parameter(base_forward, "padding_mask"):
        return signature
    parameters = list(signature.parameters.values())
    new = inspect.Parameter(
        "padding_mask", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="torch.Tensor | None"
    )
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    return signature.replace(parameters=parameters[:at] + [new] + parameters[at:])


def padding_mask_class(cls: type) -> type:
    """``PaddingMask<cls>``: ``cls`` with a ``forward`` that declares ``padding_mask`` (cached)."""
    subclass = _SUBCLASSES.get(cls)
    if subclass is not None:
        return subclass
    base_forward = cls.forward
    base_signature = inspect.signature(base_forward)

    def forward(self, *args, padding_mask: torch.Tensor | None = None, **kwargs):
        return self._forward_with_padding_mask(base_forward, base_signature, args, kwargs, padding_mask)

    name = f"PaddingMask{cls.__name__}"
    forward.__signature__ = _signature_with_padding_mask(base_forward)
    forward.__qualname__ = f"{name}.forward"
    forward.__doc__ = (
        f"{cls.__name__}.forward with ``padding_mask``: ``(b, s)`` bool, the shape of ``input_ids``, True = "
        "padding (derived from ``packed_seq_params`` for a THD row when omitted). The MoE routers of the decoder "
        "leave padding tokens out of their aux-loss, z-loss and expert-bias statistics; outputs are unchanged. "
        "See megatron.bridge_thd.moe_padding.hook.\n\n" + (cls.forward.__doc__ or "")
    )
    namespace = {"forward": forward, "__module__": __name__, "__qualname__": name}
    subclass = type(name, (PaddingMaskForward, cls), namespace)
    _SUBCLASSES[cls] = subclass
    return subclass
