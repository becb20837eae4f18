"""The entry points: :func:`with_padding_mask` (one model chunk, in place) and the Megatron-Bridge pre-wrap hook
:func:`padding_mask_pre_wrap_hook`, which carries the mark ``rules.ROUTES_REAL_TOKENS_ONLY``."""

from __future__ import annotations

import logging
from typing import Any

from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron.bridge_thd.moe_padding.mask import declares_padding_mask
from megatron.bridge_thd.moe_padding.model import (
    CP_HELPERS,
    QWEN3_VL_MODEL_MODULE,
    PaddingMaskForward,
    padding_mask_class,
)
from megatron.bridge_thd.moe_padding.refusals import fail_if_unsupported
from megatron.bridge_thd.moe_padding.routers import moe_layers, use_padding_aware_modules
from megatron.bridge_thd.rules.setup import ROUTES_REAL_TOKENS_ONLY
from megatron.bridge_thd.upstream.loading import load_bridge_module

# The package's name, as before the split into modules: the log records keep their logger.
logger = logging.getLogger(__package__)


def with_padding_mask(model):
    """Make a Megatron-Bridge ``Qwen3VLModel`` take ``padding_mask`` and hand it to its MoE routers.

    In place: the model (or, for a wrapper chain such as DDP / ``Float16Module``, the innermost
    ``.module``) changes class to ``PaddingMask<Class>``, each MoE layer of its decoder to
    :class:`PaddingMaskMoELayer` and each router to :class:`PaddingMaskTopKRouter`; see
    docs/moe-padding-mask.md.

    Args:
        model: a Megatron-Bridge ``Qwen3VLModel`` (a model chunk), or a ``.module`` wrapper
            chain around one.

    Returns:
        ``model`` itself. Unchanged when it was passed through this function already, or when it is
        not a ``Qwen3VLModel`` and its ``forward`` declares ``padding_mask`` (Megatron-Core's ``GPTModel``).

    Raises:
        TypeError: ``model`` is not a Megatron-Bridge ``Qwen3VLModel`` (and declares no ``padding_mask``),
            or a decoder MoE layer is not Megatron-Core's ``MoELayer`` with its ``TopKRouter``.
        ValueError: a setting the registry's hook rules refuse (``rules``, place ``hook``: full recompute, CUDA
            graphs, chunked MLP, ...; the mask could not reach every router); the message names the setting and the
            fix.
    """
    if isinstance(model, (list, tuple)):
        raise TypeError("model: with_padding_mask takes one model chunk; for a list use padding_mask_pre_wrap_hook")
    core = model
    while hasattr(core, "module"):  # duck: a DDP / Float16Module wrapper chain, or the model itself
        core = core.module
    if isinstance(core, PaddingMaskForward) or not _is_a_qwen3_vl_model(core):
        return model
    config = core.config
    fail_if_unsupported(config)
    layers = moe_layers(core)
    use_padding_aware_modules(layers)
    _warn_if_the_mtp_block_has_moe_layers(core)
    core.__class__ = padding_mask_class(type(core))
    expert_bias = any(layer.mlp.router.enable_expert_bias for layer in layers)
    logger.info(
        "bridge_thd: %s.forward now declares padding_mask (True = padding); %d MoE layer(s) of the decoder get it%s",
        type(core).__name__,
        len(layers),
        "; expert-bias counts use it" if expert_bias else "",
    )
    return model


def _is_a_qwen3_vl_model(core) -> bool:
    """True for a Megatron-Bridge ``Qwen3VLModel`` (whose module has the CP helpers the mask is cut with); False,
    logged, for another model whose ``forward`` declares ``padding_mask``; TypeError otherwise."""
    model_module = load_bridge_module(QWEN3_VL_MODEL_MODULE)
    if not isinstance(core, model_module.Qwen3VLModel):
        if declares_padding_mask(core):  # e.g. Megatron-Core's GPTModel: its own path carries the mask
            logger.info("bridge_thd: %s.forward already declares padding_mask; left unchanged", type(core).__name__)
            return False
        raise TypeError(
            f"model: with_padding_mask takes Megatron-Bridge's Qwen3VLModel (or a .module wrapper chain around "
            f"one); got {type(core).__name__}, whose forward declares no padding_mask"
        )
    missing = [name for name in CP_HELPERS if not hasattr(model_module, name)]  # offers: the model module's CP helpers
    if missing:
        raise TypeError(
            f"model: this Megatron-Bridge's modelling_qwen3_vl/model.py lacks {missing}, which with_padding_mask uses "
            "to cut the mask like the model cuts its row; install the Megatron-Bridge release docs/compatibility.md names"
        )
    return True


def _warn_if_the_mtp_block_has_moe_layers(core) -> None:
    language_model = core.language_model
    mtp = getattr(language_model, "mtp", None)  # optional: only a stage that runs the MTP block has one
    if mtp is not None and any(isinstance(module, MoELayer) for module in mtp.modules()):
        logger.warning(
            "bridge_thd: with_padding_mask does not reach the MoE layers of the multi-token-prediction block; "
            "their routers still count padding tokens"
        )


def padding_mask_pre_wrap_hook(model_chunks: list[Any]) -> list[Any]:
    """Megatron-Bridge pre-wrap hook: :func:`with_padding_mask` on every model chunk.

    ``cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)`` (before ``finetune`` /
    ``pretrain``).
    """
    return [with_padding_mask(chunk) for chunk in model_chunks]


# rules.read_setup tells the hook among a config's pre-wrap hooks by this mark (rules.ROUTES_REAL_TOKENS_ONLY).
setattr(padding_mask_pre_wrap_hook, ROUTES_REAL_TOKENS_ONLY, True)
