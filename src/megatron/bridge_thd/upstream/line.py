"""Where Megatron-Bridge's lines differ (0.6 and 0.7 with the Megatron-Core each pins): decided once.

Every difference the package acts on is one field of :class:`UpstreamLine`, read off the installed
code by what it offers (a parameter in a signature, a module attribute), never by a version
string, and decided the first time :func:`upstream_line` is called. The step's plan,
``configure``, the MoE padding hook and the CPU build read these fields; nothing else inspects
upstream for a line difference. Each seam, what differs and why: docs/compatibility.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types

from megatron.bridge_thd.upstream.loading import load_bridge_module, load_flop_utils

__all__ = ["UpstreamLine", "upstream_line", "takes_parameter", "trainer_flops"]

_QWEN3_VL_MODEL_MODULE = "models.qwen_vl.modelling_qwen3_vl.model"
_QWEN3_VL_ATTENTION_MODULE = "models.qwen_vl.modelling_qwen3_vl.attention"


@dataclasses.dataclass(frozen=True)
class UpstreamLine:
    """What the installed upstream offers, one field per seam (docs/compatibility.md)."""

    # Qwen3VLModel.forward declares padding_mask (True = padding) and, when it is omitted, derives
    # it from the logical vs physical THD boundaries itself (host reads; refuses zero-length
    # segments). Without it the model has no padding_mask and the hook adds one.
    model_takes_padding_mask: bool
    # flop_utils.accumulate_flops_metadata takes vision_patch_stats (patch sum, squared sum,
    # merged tokens, from vision_patch_stats_from_grid_thw) beside num_vision_patches.
    flops_vision_patch_stats: bool
    # flop_utils.resolve_global_flops_runtime_stats returns a GlobalFlopsRuntimeStats record
    # (attributes) instead of a tuple.
    flops_runtime_stats_record: bool
    # models/transformer_config._enable_safe_hybridep_dispatch takes uses_thd (called from
    # ConfigContainer.validate()); without it, TransformerConfig.finalize() calls it with the config only.
    hybridep_dispatch_takes_uses_thd: bool
    # The Megatron-Core module that defines torch_chunk_gated_delta_rule (the Gated DeltaNet's
    # deterministic torch rule): ssm/gated_delta_net/common.py, later gdn.py.
    gdn_torch_rule_module: str | None
    # modelling_qwen3_vl/attention.py binds Transformer Engine's TEDotProductAttention and tests the
    # core attention against it with isinstance (TE gets Qwen's 2D keep mask as a masked-token mask).
    qwen3_vl_attention_tests_te_attention: bool
    # Megatron-Core's multi_token_prediction calls is_inference_column_parallel_linear on eh_proj: an
    # isinstance test against the inference-optimized linears, subclasses of TE's.
    mtp_tests_inference_linear: bool

    def describe(self) -> list[str]:
        """One ``name=value`` line per seam, for logs and ``bridge-thd`` reports."""
        return [f"{name}={value!r}" for name, value in dataclasses.asdict(self).items()]


def takes_parameter(function, name: str) -> bool:
    """True when ``function`` declares a parameter called ``name`` (not through ``**kwargs``)."""
    parameter = inspect.signature(function).parameters.get(name)
    return parameter is not None and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)


def _model_takes_padding_mask() -> bool:
    model_module = load_bridge_module(_QWEN3_VL_MODEL_MODULE)
    return takes_parameter(model_module.Qwen3VLModel.forward, "padding_mask")


def _flop_utils() -> types.ModuleType | None:
    try:
        return load_flop_utils()
    except ImportError:
        return None


def _hybridep_dispatch_takes_uses_thd() -> bool:
    transformer_config = load_bridge_module("models.transformer_config")
    dispatch = getattr(transformer_config, "_enable_safe_hybridep_dispatch", None)  # offers: the HybridEP guard
    return dispatch is not None and takes_parameter(dispatch, "uses_thd")


def _gdn_torch_rule_module() -> str | None:
    import importlib

    for name in ("megatron.core.ssm.gated_delta_net.gdn", "megatron.core.ssm.gated_delta_net.common",
                 "megatron.core.ssm.gated_delta_net"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        rule = getattr(module, "torch_chunk_gated_delta_rule", None)  # offers: the GDN torch rule
        if rule is not None:
            return rule.__module__  # where it is defined, not where it is re-imported
    return None


def _qwen3_vl_attention_tests_te_attention() -> bool:
    return hasattr(load_bridge_module(_QWEN3_VL_ATTENTION_MODULE), "TEDotProductAttention")  # offers: TE's test


def _mtp_tests_inference_linear() -> bool:
    import megatron.core.transformer.multi_token_prediction as multi_token_prediction

    return hasattr(multi_token_prediction, "is_inference_column_parallel_linear")  # offers: the MTP linear test


@functools.cache
def upstream_line() -> UpstreamLine:
    """The installed upstream's seams, read once per process (see :class:`UpstreamLine`)."""
    flop_utils = _flop_utils()
    return UpstreamLine(
        model_takes_padding_mask=_model_takes_padding_mask(),
        flops_vision_patch_stats=flop_utils is not None
        and takes_parameter(flop_utils.accumulate_flops_metadata, "vision_patch_stats"),
        flops_runtime_stats_record=flop_utils is not None
        and hasattr(flop_utils, "GlobalFlopsRuntimeStats"),  # offers: the trainer's FLOPs statistics record
        hybridep_dispatch_takes_uses_thd=_hybridep_dispatch_takes_uses_thd(),
        gdn_torch_rule_module=_gdn_torch_rule_module(),
        qwen3_vl_attention_tests_te_attention=_qwen3_vl_attention_tests_te_attention(),
        mtp_tests_inference_linear=_mtp_tests_inference_linear(),
    )


def trainer_flops(flop_utils, cfg, state, *, batch_size: int, data_parallel_size: int, dp_group) -> float:
    """The FLOPs Megatron-Bridge's trainer adds for a step from the ``state._flops_*`` accumulators, as the
    installed ``training/train.py`` computes them: ``resolve_global_flops_runtime_stats`` then
    ``num_floating_point_operations``, plus, where the stats come as a ``GlobalFlopsRuntimeStats`` record
    with exact vision statistics, ``vit_flops_from_patch_stats`` (``upstream_line().flops_runtime_stats_record``).

    Args:
        flop_utils: Megatron-Bridge's ``training/utils/flop_utils.py`` (:func:`load_flop_utils`).
        cfg: what the trainer passes as its config (``model``, ``peft``).
        state: the object carrying the accumulators.
        batch_size: the step's global batch size.
        data_parallel_size, dp_group: the data-parallel group the trainer reduces over.
    """
    if not upstream_line().flops_runtime_stats_record:
        seqlen_sum, seqlen_squared_sum, patches, *_ = flop_utils.resolve_global_flops_runtime_stats(
            state, data_parallel_size=data_parallel_size, dp_group=dp_group)
        return float(flop_utils.num_floating_point_operations(
            cfg, batch_size, seqlen_sum=seqlen_sum, seqlen_squared_sum=seqlen_squared_sum, num_vision_patches=patches))
    stats = flop_utils.resolve_global_flops_runtime_stats(
        state, data_parallel_size=data_parallel_size, dp_group=dp_group, include_vision_patch_stats=True)
    flops = flop_utils.num_floating_point_operations(
        cfg, batch_size=batch_size, seqlen_sum=stats.seqlen_sum, seqlen_squared_sum=stats.seqlen_squared_sum,
        num_vision_patches=0 if stats.has_exact_vision_stats else stats.num_vision_patches)
    if stats.has_exact_vision_stats:
        flops += flop_utils.vit_flops_from_patch_stats(
            cfg, patch_sum=stats.vision_patch_sum, patch_squared_sum=stats.vision_patch_squared_sum,
            merged_token_sum=stats.vision_merged_token_sum)
    return float(flops)
