"""Every patch of an upstream name, and the one way they are applied. Reasoning: docs/patches.md.

A :class:`Patch` is a record ``(owner, name, replacement, why)``: ``owner.name`` (or
``owner[name]`` when ``owner`` is a mapping such as ``sys.modules``) becomes ``replacement``.
:func:`applied` sets a list of them for a ``with`` block and restores each on exit;
:func:`apply_permanently` sets one for the rest of the process, idempotently. Nothing is applied
at import, and this module imports nothing beyond the standard library.

The patches (targets, where they are built and applied, why; one line each in docs/patches.md):

* Scoped, test bed only: ``bridge_thd_cpu/stack.py`` ``cpu_patches()``, applied by ``cpu_stack()``, for
  Megatron-Bridge's real models on a CPU without CUDA / Transformer Engine (TE) / fla:
  ``torch.cuda.current_device`` (the ropes place ``inv_freq`` on it); the TE names
  ``modelling_qwen3_vl/model.py`` binds at import, ``get_vit_layer_with_transformer_engine_spec``,
  ``TENorm``, ``TEColumnParallelLinear``, ``TERowParallelLinear``; ``megatron.core.utils.tex`` (the
  THD CP split); ``torch`` as ``schedules``, ``p2p_communication``, ``hybrid_cp_schedule`` and
  ``token_dispatcher`` see it, and ``token_dispatcher.maybe_move_tensor_to_cpu`` (CUDA tensors, syncs, streams,
  split sizes); ``torch`` as ``modelling_qwen3_vl/utils.py`` sees it (an uneven ``all_gather`` on gloo);
  Gated DeltaNet without fla: ``gated_delta_net.common`` ``HAVE_FLA``, ``causal_conv1d``,
  ``l2norm``, ``chunk_gated_delta_rule``, ``get_cuda_rng_tracker``, ``gated_delta_net.gdn``
  ``causal_conv1d``, ``chunk_gated_delta_rule`` (every ``torch.compile`` function, Gated DeltaNet's methods
  among them, runs eagerly in the block: torch's ``set_stance("force_eager")``, not a record); the TE classes upstream tests with ``isinstance``, which
  are ``MagicMock`` objects without TE: the Qwen3-VL attention's ``attention.TEDotProductAttention``
  (the CPU THD core attention) and ``inference_layers`` ``InferenceColumnParallelLinear``,
  ``InferenceLayerNormColumnParallelLinear`` (classes no object is an instance of).
* Scoped, test bed only: ``bridge_thd_testbed/training/trainer_on_cpu.py`` ``cpu_training_patches()``, applied by
  ``cpu_training()``, for Megatron-Bridge's ``finetune()`` on the CPU: the provider's
  ``get_gpt_layer_with_transformer_engine_spec``; the Qwen3.5-VL provider's
  ``get_transformer_block_with_experimental_attention_variant_spec`` (the test bed's local hybrid
  Gated DeltaNet / attention block); ``initialize.compile_helpers`` (the wheel ships
  ``helpers_cpp`` prebuilt, no Makefile); ``torch`` as the trainer modules of ``TRAINER_MODULES``
  see it; ``torch.Tensor.cuda``; ``tensor_parallel.random`` ``_set_cuda_rng_state`` /
  ``_get_cuda_rng_state`` (the CPU generator).
* Scoped, test bed only: ``bridge_thd_testbed/launcher.py`` ``without_modelopt()``, applied in each gloo rank that
  does not import Megatron-Bridge whole: ``sys.modules['modelopt']`` as missing (Megatron's training
  package imports NVIDIA ModelOpt optionally; ~5 s of a rank's start-up).
* Scoped, test bed only: ``bridge_thd_testbed/qwen25_vl.py`` ``qwen25_vl_import_patches()``:
  ``sys.modules['omegaconf']``, a placeholder while the Qwen2.5-VL provider is imported (only
  when omegaconf is absent).
* Scoped: ``upstream/loading.py`` ``load_flop_utils()``: ``sys.modules['megatron.bridge.peft.lora']`` and
  ``sys.modules['megatron.bridge.training.config']``, placeholders while ``flop_utils`` is
  imported (only without TE); ``load_theoretical_memory_utils()``: ``sys.modules['megatron.bridge.training.config']``,
  a placeholder while ``theoretical_memory_utils`` is imported (only without TE).
* Permanent (:func:`apply_permanently`): ``batching/bridge.py`` ``loader_patch()``, applied by
  ``configure`` for a Megatron-Bridge config or with ``global_batch_packing=...``:
  ``megatron.bridge.data.loaders`` ``build_train_valid_test_data_loaders`` (gives a configured run's loaders
  the over-long policy, and rebuilds them around global-batch packing's batch sampler when
  the settings' ``global_batch_packing`` is set; the original's result otherwise).
* Permanent (:func:`apply_permanently`): ``overlong.py`` ``collate_patch()``, applied in the process that runs a
  loader's ``OverlongCollate`` or the lengths scan: ``megatron.bridge.models.qwen_vl.data.collate_fn``
  ``prepare_sequence_batch`` (measures every row before the cut, applies the over-long policy, then the original).

* Permanent (:func:`apply_permanently`): ``upstream/pinning.py`` ``visual_inputs_pin_patch()``, applied by
  ``configure``: ``megatron.bridge.training.utils.visual_inputs.GenericVisualInputs`` ``pin_memory``
  (a new method: the loader's pin thread then pins the visual inputs too).

* Permanent (:func:`apply_permanently`): ``packing_log.py`` ``pretrain_patch()``, applied by ``configure`` for a
  Megatron-Bridge config with ``packing_log`` on or ``run_log`` set: ``megatron.bridge.training.pretrain``
  ``_pretrain`` (adds the packing figures' callback to the run's callbacks when the settings and loggers ask for it).

Not a patch of a name, listed so that nothing that changes upstream objects is hidden:
``bridge_thd_cpu/bridge_package.py`` ``bridge_package()`` serves import-time stand-ins for
``transformer_engine`` / ``nvidia_resiliency_ext`` to Megatron-Bridge's unguarded imports;
``upstream/loading.py`` puts a ``sys.meta_path`` finder first (once; Megatron-Bridge's packages load
without their ``__init__`` when TE is absent); ``moe_padding.with_padding_mask`` changes the class of the user's
model to ``PaddingMask<Class>`` and of its decoder's MoE layers and routers to
``PaddingMaskMoELayer`` / ``PaddingMaskTopKRouter`` (subclasses of Megatron-Core's; nothing is bound
on an instance and no upstream name is replaced).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch", "applied", "apply_permanently"]

_ABSENT = object()  # the name did not exist before the patch: restoring removes it
_lock = threading.RLock()
# (id(owner), name) -> [owner, original, depth] for names an applied() block has set.
_active: dict[tuple[int, str], list] = {}
# (id(owner), name) -> (owner, original) for names apply_permanently has set.
_permanent: dict[tuple[int, str], tuple[Any, Any]] = {}


@dataclass(frozen=True)
class Patch:
    """``owner.name`` (``owner[name]`` for a mapping) becomes ``replacement``; ``why`` says why.

    Example::

        Patch(torch.cuda, "current_device", lambda: torch.device("cpu"),
              "Megatron-Core's rope places inv_freq on torch.cuda.current_device()")
    """

    owner: Any
    name: str
    replacement: Any
    why: str

    @property
    def target(self) -> str:
        """``module.name``, ``module.Class.name`` or ``sys.modules['name']``: for docs and errors."""
        if self.owner is sys.modules:
            return f"sys.modules[{self.name!r}]"
        if isinstance(self.owner, type):
            return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.name}"
        return f"{getattr(self.owner, '__name__', type(self.owner).__name__)}.{self.name}"  # duck: module or object


def _key(patch: Patch) -> tuple[int, str]:
    return id(patch.owner), patch.name


def _get(owner, name: str):
    if isinstance(owner, MutableMapping):
        return owner.get(name, _ABSENT)
    return getattr(owner, name, _ABSENT)  # duck: the name a patch sets, absent where the patch adds it


def _set(owner, name: str, value) -> None:
    if isinstance(owner, MutableMapping):
        if value is _ABSENT:
            owner.pop(name, None)
        else:
            owner[name] = value
    elif value is _ABSENT:
        with contextlib.suppress(AttributeError):  # the name the patch added, gone already if someone removed it
            delattr(owner, name)
    else:
        setattr(owner, name, value)


@contextlib.contextmanager
def applied(patches: Iterable[Patch]):
    """Set every patch for the duration of the block, then restore each name (in reverse order).

    Re-entrant: a name that an enclosing ``applied`` block has already set is left as that block
    set it (the inner block does nothing for it), so nested blocks of the same patches are no-ops
    and the outermost block restores the originals.
    """
    patches = list(patches)
    mine: list[tuple[int, str]] = []
    with _lock:
        try:
            for patch in patches:
                key = _key(patch)
                if key in _active:
                    _active[key][2] += 1
                else:
                    _active[key] = [patch.owner, _get(patch.owner, patch.name), 1]
                    _set(patch.owner, patch.name, patch.replacement)
                mine.append(key)
        except BaseException:
            _release(mine)
            raise
    try:
        yield
    finally:
        with _lock:
            _release(mine)


def _release(keys: list[tuple[int, str]]) -> None:
    for key in reversed(keys):
        entry = _active[key]
        entry[2] -= 1
        if not entry[2]:
            owner, name = entry[0], key[1]
            _set(owner, name, entry[1])
            del _active[key]


def apply_permanently(patch: Patch):
    """Set ``patch`` for the rest of the process; idempotent (a second call changes nothing).

    Returns:
        The value the patch replaced when it was applied (the upstream original), so that the
        replacement can defer to it.
    """
    with _lock:
        key = _key(patch)
        if _get(patch.owner, patch.name) is patch.replacement:
            return _permanent[key][1]
        original = _get(patch.owner, patch.name)
        _permanent[key] = (patch.owner, original)
        _set(patch.owner, patch.name, patch.replacement)
        return original
