"""Peak memory per GPU: model states from Megatron-Bridge's own estimator, activations and the loss's buffers ours.

* Model states (bf16 weights, fp32 grads, Adam states): Megatron-Bridge's ``estimate_training_memory``
  (``training/utils/theoretical_memory_utils.py``, loaded by
  :func:`megatron.bridge_thd.upstream.loading.load_theoretical_memory_utils`) on the namespace :func:`memory_config`
  builds from a :class:`ModelSpec` and a :class:`Parallel`, ``include_activation=False``. It counts the
  language model only, every mixer as grouped-query attention without an output gate: ``mixer_states`` adds
  ours for the difference (Gated DeltaNet layers, the output gate, the MTP layers' ``eh_proj``),
  ``vision_states`` the vision tower, both at the estimator's own bytes per parameter.
* Activations: ours, per token slot of the rank's largest micro-batch (the upstream formula assumes selective
  recomputation and ``seq_length * micro_batch_size`` tokens): the decoder layers
  (:func:`~.memory.layer_bytes_per_token`), the MTP layers, the vision tower's patches
  (:func:`~.memory.vision_bytes_per_patch`), the output layer's inputs, and the loss's fp32 copies of the
  logits at their peak (Megatron-Core's ``fusions/fused_cross_entropy.py`` or
  ``tensor_parallel/cross_entropy.py``).
* ``reserved``: CUDA context, NCCL buffers, allocator fragmentation: one assumed number.

Every term, the upstream code it models and the assumptions: docs/planner.md (Memory model).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch.nn.functional as F

from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.plan.layouts import Parallel
from megatron.bridge_thd.cost.memory import (layer_bytes_per_token, mixer_parameters, parameter_counts,
                                             vision_bytes_per_patch)
from megatron.bridge_thd.cost.presets import ModelSpec, replace
from megatron.bridge_thd.upstream import loading

__all__ = ["DEFAULT_RESERVED_BYTES", "MemoryEstimate", "memory_config", "upstream_estimate", "padded_vocab_size",
           "loss_bytes_per_token", "mtp_bytes_per_token", "output_input_bytes_per_token", "row_slots_per_rank",
           "peak_memory_bytes"]

# Assumed (not derived from code): CUDA context, NCCL communicator buffers, cuBLAS / cuDNN workspaces and the
# caching allocator's fragmentation, per GPU. The planner's long-standing default (estimate.PlanSettings).
DEFAULT_RESERVED_BYTES = 6e9


def memory_config(spec: ModelSpec, parallel: Parallel, *, mtp_layers: int = 0, seq_length: int = 4096,
                  micro_batch_size: int = 1, distributed_optimizer: bool = True) -> SimpleNamespace:
    """The fields Megatron-Bridge's ``estimate_training_memory`` reads (``config.model``, ``config.train``,
    ``config.optimizer``, ``config.data_parallel_size``), from ``spec`` and ``parallel``: SwiGLU MLPs (its
    ``gated_linear_unit`` with ``activation_func = F.silu``), expert TP = TP, vocabulary padded to 128 * TP
    (Megatron's default ``make_vocab_size_divisible_by``), no uneven / virtual pipeline stages."""
    model = SimpleNamespace(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels, vocab_size=spec.vocab_size, make_vocab_size_divisible_by=128,
        should_pad_vocab=True, share_embeddings_and_output_weights=spec.tie_word_embeddings,
        gated_linear_unit=True, activation_func=F.silu,
        num_moe_experts=spec.num_moe_experts, moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_topk=spec.moe_router_topk or None, moe_layer_freq=1, moe_latent_size=None,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        mtp_num_layers=mtp_layers or None, seq_length=seq_length,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.tp, virtual_pipeline_model_parallel_size=None,
        num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
        sequence_parallel=parallel.sp, recompute_granularity="selective",
    )
    return SimpleNamespace(model=model, train=SimpleNamespace(micro_batch_size=micro_batch_size),
                           optimizer=SimpleNamespace(use_distributed_optimizer=distributed_optimizer),
                           ddp=SimpleNamespace(use_distributed_optimizer=distributed_optimizer),
                           data_parallel_size=parallel.dp)


def upstream_estimate(config: SimpleNamespace, num_microbatches: int | None = None, *,
                      include_activation: bool = False):
    """Megatron-Bridge's own estimate for ``config`` (:func:`memory_config`): its ``TrainingMemoryEstimate``.

    Detects what the installed module offers: ``estimate_training_memory(config, num_microbatches,
    include_activation=...)`` (structured), or else the older ``compute_weight_and_optimizer_memory(config)``
    (model states only, returned as a one-component namespace of the same shape).

    Raises:
        RuntimeError: the installed module has neither.
    """
    module = loading.load_theoretical_memory_utils()
    estimate = getattr(module, "estimate_training_memory", None)  # offers: the structured estimator (newer lines)
    if estimate is not None and "include_activation" in inspect.signature(estimate).parameters:
        return estimate(config, num_microbatches, include_activation=include_activation)
    legacy = getattr(module, "compute_weight_and_optimizer_memory", None)  # offers: the older states-only one
    if legacy is None or include_activation:
        raise RuntimeError("Megatron-Bridge's theoretical_memory_utils offers neither estimate_training_memory("
                           "..., include_activation=...) nor (for model states) compute_weight_and_optimizer_memory")
    states = float(legacy(config))
    component = SimpleNamespace(name="weight and optimizer", memory_bytes=states, bytes_per_parameter=None)
    return SimpleNamespace(model_state_components=(component,), activation=None, total_parameters=None,
                           weight_and_optimizer_bytes=states, total_memory_bytes=states)


def padded_vocab_size(spec: ModelSpec, tp: int = 1) -> int:
    """The vocabulary Megatron pads to (a multiple of 128 * TP), as the output layer and the loss see it."""
    multiple = 128 * tp
    return -(-spec.vocab_size // multiple) * multiple


def loss_bytes_per_token(spec: ModelSpec, tp: int = 1, *, mtp_layers: int = 0, fused: bool = True) -> float:
    """Peak bytes per token of the logits and the loss's copies of them, per GPU (``V`` = padded vocab / tp).

    Megatron-Core's cross entropy casts the bf16 logits to one fp32 copy and turns it into the softmax in
    place, which it saves for backward (``calculate_logits_max``, ``calculate_predicted_logits``,
    ``ctx.save_for_backward``). Each MTP head's loss runs first (``process_mtp_loss``) and keeps its softmax,
    ``4V``, until the gradient reaches it, after the main loss's backward. Main loss, forward: the bf16 logits
    (``2V``, alive in ``GPTModel._postprocess``) and the fp32 copy (``4V``): ``6V``. Backward, fused (the
    recipe's ``cross_entropy_loss_fusion`` with ``"native"``, ``fusions/fused_cross_entropy.py``,
    ``calculate_gradients`` under ``torch.compile``): the saved softmax, the compiled kernel's fp32 buffer for
    the ``index_put`` result and the bf16 gradient it returns: ``4V + 4V + 2V``; unfused (in place, then the
    fp32 -> bf16 cast of the gradient): ``4V + 2V``.
    """
    vocab = padded_vocab_size(spec, tp) / tp
    backward = (4 + 4 + 2) * vocab if fused else (4 + 2) * vocab
    return 4 * vocab * mtp_layers + max(6 * vocab, backward)


def output_input_bytes_per_token(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = True) -> float:
    """The final norm's input and the output layer's input (its ``ColumnParallelLinear`` saves it), bf16."""
    return 4 * spec.hidden_size / (tp if sequence_parallel or tp == 1 else 1)


def mtp_bytes_per_token(spec: ModelSpec, tp: int = 1, sequence_parallel: bool = True, mtp_layers: int = 0) -> float:
    """Activation bytes per token of ``mtp_layers`` MTP layers (Megatron-Core's
    ``MultiTokenPredictionLayer``): the norms' inputs (embedding, hidden: ``4h``), ``eh_proj``'s concatenated
    input (``4h``), one full-attention decoder layer (:func:`~.memory.layer_bytes_per_token` of a
    full-attention layer; assumed: Qwen3.5's checkpoint's MTP layer has ``self_attn``) and the head's final
    norm and output-layer inputs (``4h``)."""
    one = replace(spec, num_layers=1, linear_attention_freq=None)
    split = tp if sequence_parallel or tp == 1 else 1
    return mtp_layers * (layer_bytes_per_token(one, tp, sequence_parallel)[0] + 12 * spec.hidden_size / split)


def row_slots_per_rank(rows) -> float:
    """A rank's largest share of a micro-batch: ``max(slots / cp)`` over its ``(slots, cp)`` rows (per-sample
    CP: each row split over its own CP group)."""
    return max(slots / cp for slots, cp in rows)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per GPU by part. ``model_states``: Megatron-Bridge's estimator (language model);
    ``mixer_states`` / ``vision_states``: ours, at its bytes per parameter; ``decoder``, ``mtp``, ``vision``,
    ``output``: activations kept for backward; ``loss``: the logits' copies at their peak; ``reserved``:
    assumed. ``upstream_parameters``: the parameters the estimator counted."""

    model_states: float
    mixer_states: float
    vision_states: float
    decoder: float
    mtp: float
    vision: float
    output: float
    loss: float
    reserved: float
    upstream_parameters: float | None = None

    @property
    def states(self) -> float:
        return self.model_states + self.mixer_states + self.vision_states

    @property
    def activations(self) -> float:
        return self.decoder + self.mtp + self.vision + self.output + self.loss

    @property
    def total(self) -> float:
        return self.states + self.activations + self.reserved

    def fits(self, gpu_bytes: float) -> bool:
        return self.total <= gpu_bytes

    def margin(self, gpu_bytes: float) -> float:
        """``gpu_bytes - total`` (negative: out of memory)."""
        return gpu_bytes - self.total


def _upstream_mixer_parameters(spec: ModelSpec) -> float:
    # theoretical_memory_utils._count_parameters: 2 h^2 (1 + g / a) (a d / h) = h (2 q + 2 kv) per layer.
    q, kv = spec.num_attention_heads * spec.kv_channels, spec.num_query_groups * spec.kv_channels
    return spec.hidden_size * (2 * q + 2 * kv)


def _mixer_correction(spec: ModelSpec, mtp_layers: int) -> float:
    """Parameters the estimator's count misses: every decoder layer's mixer as ours counts it minus its GQA
    count, the same for each MTP layer (a full-attention layer), plus each MTP layer's ``eh_proj`` (2h x h)."""
    upstream = _upstream_mixer_parameters(spec)
    layers = sum(mixer_parameters(spec, bool(linear)) - upstream for linear in spec.linear_layer_pattern())
    return layers + mtp_layers * (mixer_parameters(spec, False) - upstream + 2 * spec.hidden_size**2)


def peak_memory_bytes(spec: ModelSpec, parallel: Parallel, *, slots_per_rank: float, patches: int,
                      micro_batches: int = 1, mtp_layers: int = 0, fused_cross_entropy: bool = True,
                      distributed_optimizer: bool = True,
                      reserved_bytes: float = DEFAULT_RESERVED_BYTES) -> MemoryEstimate:
    """Peak memory of one GPU (module docstring; docs/planner.md for every term).

    Args:
        slots_per_rank: token slots this rank holds of its largest micro-batch (BSHD: ``B x W``; THD: the
            row's slots), already divided by the row's CP size (:func:`row_slots_per_rank`).
        patches: vision-tower patches of that micro-batch on this rank.
        micro_batches: micro-batches per step per DP replica (PP: the 1F1B in-flight count).
        mtp_layers: the recipe's ``mtp_num_layers``.
        fused_cross_entropy: the recipe's ``cross_entropy_loss_fusion`` (``"native"``).
        reserved_bytes: CUDA context, NCCL, fragmentation (assumed; :data:`DEFAULT_RESERVED_BYTES`).
    """
    if slots_per_rank <= 0:
        raise ValueError(f"slots_per_rank must be positive, got {slots_per_rank}")
    check_int("patches", patches, 0)
    check_int("micro_batches", micro_batches)
    check_int("mtp_layers", mtp_layers, 0)
    tp, pp, sp = parallel.tp, parallel.pp, parallel.sp
    upstream = upstream_estimate(memory_config(spec, parallel, mtp_layers=mtp_layers,
                                               distributed_optimizer=distributed_optimizer), micro_batches)
    dense = upstream.model_state_components[0]
    per_param = dense.bytes_per_parameter
    if per_param is None:  # the legacy entry point gives no breakdown: the same rule (6 + 12 / shards)
        per_param = 6 + 12 / (parallel.dp * parallel.cp) if distributed_optimizer else 18
    mixer_states = _mixer_correction(spec, mtp_layers) / (tp * pp) * per_param
    vision_states = parameter_counts(spec)["vision"] / tp * per_param

    per_layer = layer_bytes_per_token(spec, tp, sp)
    tokens = slots_per_rank
    vision = vision_bytes_per_patch(spec, tp) * patches
    last = dict(mtp=mtp_bytes_per_token(spec, tp, sp, mtp_layers) * tokens,
                output=output_input_bytes_per_token(spec, tp, sp) * tokens,
                loss=loss_bytes_per_token(spec, tp, mtp_layers=mtp_layers, fused=fused_cross_entropy) * tokens)
    if pp == 1:
        acts = dict(decoder=sum(per_layer) * tokens, vision=vision, **last)
    else:
        stage = len(per_layer) // pp
        in_flight = min(pp, micro_batches)
        first = dict(decoder=sum(per_layer[:stage]) * tokens * in_flight, vision=vision * in_flight,
                     mtp=0.0, output=0.0, loss=0.0)
        final = dict(decoder=sum(per_layer[-stage:]) * tokens, vision=0.0, **last)
        acts = max(first, final, key=lambda d: sum(d.values()))
    return MemoryEstimate(model_states=float(upstream.weight_and_optimizer_bytes), mixer_states=mixer_states,
                          vision_states=vision_states, reserved=float(reserved_bytes),
                          upstream_parameters=upstream.total_parameters, **acts)
