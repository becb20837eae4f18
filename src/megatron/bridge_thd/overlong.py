"""Samples longer than ``seq_length``: their real lengths before Megatron-Bridge's collate cuts them, and one
policy for them (docs/overlong-samples.md).

Megatron-Bridge's VLM collate cuts every row to ``seq_length`` (``collators/sequence_padding.py``,
``pad_or_truncate_sequence_batch``) before any step sees the batch, and says nothing unless a row loses every
supervised token. :func:`collate_patch` wraps the call that cuts (``prepare_sequence_batch``, as the Qwen-VL
collate module calls it): just before the cut it measures each row from the processor's own 2D attention mask and
loss mask, applies the run's policy, and carries the measures with the batch as :data:`LENGTHS_KEY`, a ``(3, B)``
int64 tensor: real tokens before the cut, supervised tokens before the cut, 1 where the policy dropped the sample.
No second pass over the data: the numbers come from the tensors the collate already built.

The policy (``overlong_samples``, set by ``configure(..., overlong_samples=...)``):

* ``"truncate"`` (the default, what Megatron-Bridge does): the collate cuts as before; the step counts the real
  and supervised tokens lost in its log, and says once, loudly, that samples are being cut.
* ``"drop"``: an over-long sample's supervised tokens are masked before the cut, so it adds no loss and no
  gradient to the step; its tokens (cut) and its images still pass through the model, because its images are
  already part of the micro-batch's vision input. Counted in the log.
* ``"refuse"``: the collate raises, naming the sample's row in the micro-batch, its length and the settings
  that fix it; with global-batch packing the loaders refuse at build, naming dataset indices.

The collate runs in the loader's worker processes, so the policy travels with the loader's collate
(:class:`OverlongCollate`, picklable) rather than through the configuration.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable

import torch

from megatron.bridge_thd.settings import OVERLONG_POLICIES, settings_of

__all__ = ["POLICIES", "DEFAULT_POLICY", "LENGTHS_KEY", "OverlongCollate", "collate_patch", "measure_rows",
           "measure_in_this_process",
           "policy_of", "CutReport", "cut_report", "log_cut"]

logger = logging.getLogger(__name__)

POLICIES = OVERLONG_POLICIES
DEFAULT_POLICY = OVERLONG_POLICIES[0]
# The batch key the measures travel under: (3, B) int64 = tokens before the cut, supervised tokens before the cut,
# dropped (0 / 1).
LENGTHS_KEY = "bridge_thd_untruncated"
SETTING = "overlong_samples"

_POLICY: contextvars.ContextVar[str | None] = contextvars.ContextVar("bridge_thd_overlong_policy", default=None)


def policy_of(dataset: Any) -> str:
    """The run's policy: the settings' ``overlong_samples`` (:func:`megatron.bridge_thd.settings.settings_of`, which
    validates it), or the default."""
    return settings_of(dataset).overlong_samples


def measure_rows(batch: dict, sequence_length: int | None, policy: str | None) -> None:
    """Measure each row of a collated batch before the cut, apply ``policy``, and attach :data:`LENGTHS_KEY`.

    ``batch``: ``input_ids`` / ``tokens`` ``(B, T)``, a 2D ``attention_mask`` (right-padded rows), ``loss_mask`` and
    ``labels`` ``(B, T)``. Without a 2D mask the lengths are unknown and nothing is attached. ``policy`` None: measure
    only (the lengths scan).

    Raises:
        ValueError: ``policy == "refuse"`` and a row is longer than ``sequence_length``.
    """
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    tokens = mask.to(torch.int64).sum(dim=1)  # (B,)
    loss_mask = batch.get("loss_mask")
    supervised = (loss_mask != 0).to(torch.int64).sum(dim=1) if isinstance(loss_mask, torch.Tensor) else torch.zeros_like(
        tokens)
    over = tokens > sequence_length if sequence_length is not None else torch.zeros_like(tokens, dtype=torch.bool)
    if policy == "refuse" and bool(over.any()):
        rows = over.nonzero().flatten().tolist()
        listed = ", ".join(f"row {r}: {int(tokens[r])} tokens ({int(supervised[r])} supervised)" for r in rows[:8])
        raise ValueError(
            f"{SETTING}='refuse': {len(rows)} sample(s) of this micro-batch are longer than seq_length={sequence_length} "
            f"({listed}); Megatron-Bridge's collate would cut them. Raise dataset.seq_length and model.seq_length to at "
            f"least {int(tokens[over].max())}, filter these samples from the data, or set {SETTING} to 'truncate' "
            "(cut, as Megatron-Bridge does) or 'drop' (no loss from them)")
    dropped = over if policy == "drop" else torch.zeros_like(over)
    if bool(dropped.any()) and isinstance(loss_mask, torch.Tensor):
        batch["loss_mask"] = loss_mask.masked_fill(dropped[:, None], 0)
        if isinstance(batch.get("labels"), torch.Tensor):
            batch["labels"] = batch["labels"].masked_fill(dropped[:, None], -100)
    batch[LENGTHS_KEY] = torch.stack([tokens, supervised, dropped.to(torch.int64)])


class OverlongCollate:
    """A loader's collate with the run's policy: sets it for :func:`collate_patch` while ``collate_fn`` runs (in
    the loader's worker processes, started by fork or spawn alike: the policy travels with this object)."""

    def __init__(self, collate_fn: Callable, policy: str):
        if policy not in POLICIES:  # an argument check: the run's value comes from the validated settings
            raise ValueError(f"policy: {policy!r}; expected one of {', '.join(map(repr, POLICIES))}")
        self.collate_fn, self.policy = collate_fn, policy

    def __call__(self, examples):
        measure_in_this_process()  # a spawned worker imports afresh
        token = _POLICY.set(self.policy)
        try:
            return self.collate_fn(examples)
        finally:
            _POLICY.reset(token)


def _measured(original: Callable) -> Callable:
    def prepare_sequence_batch(batch, *, sequence_length=None, **kwargs):
        measure_rows(batch, sequence_length, _POLICY.get())
        return original(batch, sequence_length=sequence_length, **kwargs)

    prepare_sequence_batch.__wrapped__ = original
    return prepare_sequence_batch


_COLLATE_PATCH = None
_COLLATE_MODULE = "megatron.bridge.models.qwen_vl.data.collate_fn"


def measure_in_this_process() -> bool:
    """Apply :func:`collate_patch` here if Megatron-Bridge's Qwen-VL collate module is loaded (a collate of it being
    run, or unpickled into a worker, loads it); never import it for that (a whole Megatron-Bridge import costs
    seconds). Returns whether the collate is measured."""
    import sys

    if _COLLATE_MODULE not in sys.modules:
        return False
    from megatron.bridge_thd.patches import apply_permanently

    apply_permanently(collate_patch())
    return True



def collate_patch():
    """The :class:`~megatron.bridge_thd.patches.Patch` of ``prepare_sequence_batch`` as Megatron-Bridge's Qwen-VL
    collate module (``models/qwen_vl/data/collate_fn.py``, Qwen3-VL and Qwen3.5-VL) calls it; one per process."""
    global _COLLATE_PATCH
    if _COLLATE_PATCH is None:
        import importlib

        module = importlib.import_module(_COLLATE_MODULE)

        from megatron.bridge_thd.patches import Patch

        _COLLATE_PATCH = Patch(module, "prepare_sequence_batch", _measured(module.prepare_sequence_batch),
                               "measure each row before Megatron-Bridge's collate cuts it to seq_length, apply the "
                               "over-long policy, carry the lengths with the batch (megatron.bridge_thd.overlong)")
    return _COLLATE_PATCH


class CutReport:
    """One micro-batch's over-long samples, as read on the host: ``samples`` cut or dropped, real ``tokens`` and
    ``supervised`` tokens lost, ``dropped`` samples."""

    __slots__ = ("samples", "tokens", "supervised", "dropped")

    def __init__(self, samples: int, tokens: int, supervised: int, dropped: int):
        self.samples, self.tokens, self.supervised, self.dropped = samples, tokens, supervised, dropped


def cut_report(measures: torch.Tensor, kept_tokens: torch.Tensor, kept_supervised: torch.Tensor) -> CutReport:
    """What the collate and the step cut, from :data:`LENGTHS_KEY` ``(3, B)`` and what reached the model: real
    tokens kept ``(B,)`` and supervised tokens kept ``(B,)`` (host tensors: no sync)."""
    lost_tokens = (measures[0] - kept_tokens).clamp(min=0)
    dropped = measures[2] != 0
    lost_supervised = torch.where(dropped, measures[1], (measures[1] - kept_supervised).clamp(min=0))
    samples = int(((lost_tokens > 0) | dropped).sum())
    return CutReport(samples, int(lost_tokens.sum()), int(lost_supervised.sum()), int(dropped.sum()))


_ANNOUNCED = False


def log_cut(report: CutReport, *, policy: str, seq_length: int) -> None:
    """The log of one micro-batch's cut: once per process a WARNING that says what happens and how to change it,
    then one INFO line per micro-batch that lost anything."""
    global _ANNOUNCED
    if not report.samples:
        return
    if not _ANNOUNCED:
        _ANNOUNCED = True
        what = ("cuts them, as Megatron-Bridge does" if policy == "truncate" else
                "masks their supervised tokens, so they add no loss and no gradient (their cut tokens and images still "
                "run)")
        logger.warning(
            "bridge_thd: samples longer than seq_length=%d reach the step; %s=%r %s. Tokens and supervised tokens lost "
            "are logged per micro-batch. Set %s='refuse' to stop at the first one, or raise seq_length.",
            seq_length, SETTING, policy, what, SETTING)
    if policy == "drop":
        logger.info("bridge_thd: dropped %d over-long sample(s) from the loss (%d supervised tokens; %d real tokens cut "
                    "to seq_length=%d)", report.dropped, report.supervised, report.tokens, seq_length)
    else:
        logger.info("bridge_thd: %d over-long sample(s) cut to seq_length=%d: %d real tokens and %d supervised tokens "
                    "lost", report.samples, seq_length, report.tokens, report.supervised)
