"""Samples longer than ``seq_length``: their real lengths before Megatron-Bridge's collate cuts them, and one
policy for them (docs/overlong-samples.md).

Megatron-Bridge's VLM collate cuts every row to ``seq_length`` (``collators/sequence_padding.py``,
``pad_or_truncate_sequence_batch``) before any step sees the batch, and says nothing unless a row loses every
supervised token. :func:`collate_patch` wraps the call that cuts (``prepare_sequence_batch``, as the Qwen-VL
collate module calls it): just before the cut it measures each row from the processor's own 2D attention mask and
loss mask, applies the run's policy, and carries the measures with the batch as :data:`LENGTHS_KEY`, a
``(len(MEASURES), B)`` int64 tensor (:data:`MEASURES`). No second pass over the data: the numbers come from the
tensors the collate already built.

The policy (``overlong_samples``, set by ``configure(..., overlong_samples=...)``):

* ``"truncate"`` (the default, what Megatron-Bridge does): the collate cuts as before; the step counts the real
  and supervised tokens lost in its log, and says once, loudly, that samples are being cut. A sample whose every
  supervised token lies past the cut is refused (Megatron-Bridge's collate refuses it too, without naming the
  setting).
* ``"drop"``: an over-long sample's supervised tokens are masked before the cut, so it adds no loss and no
  gradient to the step; its tokens (cut) and its images still pass through the model, because its images are
  already part of the micro-batch's vision input. Counted in the log.
* ``"refuse"``: the collate raises, naming the sample (its row, and its dataset index where the loader knows it),
  its length and the settings that fix it; with global-batch packing the loaders refuse at build.

Under every policy a sample whose image or video placeholders lie past the cut is refused: cut, they would leave
the vision tower's embeddings without their tokens.

The collate runs in the loader's worker processes, so the rule travels with the loader's collate
(:class:`OverlongCollate`, picklable) rather than through the configuration.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron.bridge_thd.settings import OVERLONG_POLICIES, settings_of
from megatron.bridge_thd.upstream.patches import Patch, apply_permanently

__all__ = ["POLICIES", "DEFAULT_POLICY", "LENGTHS_KEY", "SAMPLE_INDEX_KEY", "MEASURES", "OverlongRule",
           "OverlongCollate", "IndexedSample", "IndexedDataset", "collate_patch", "measure_rows",
           "measure_in_this_process", "policy_of", "row_names", "supervision_emptied", "CutReport", "cut_report",
           "log_cut"]

logger = logging.getLogger(__name__)

POLICIES = OVERLONG_POLICIES
DEFAULT_POLICY = OVERLONG_POLICIES[0]
# The batch key the measures travel under: (len(MEASURES), B) int64, one row per name of MEASURES.
LENGTHS_KEY = "bridge_thd_untruncated"
# The rows of LENGTHS_KEY: real tokens before the cut, supervised tokens before the cut, 1 where the policy dropped
# the sample, supervised tokens the cut keeps, 1 where the cut would take image or video placeholders.
MEASURES = ("tokens", "supervised", "dropped", "supervised_kept", "vision_cut")
TOKENS, SUPERVISED, DROPPED, SUPERVISED_KEPT, VISION_CUT = range(len(MEASURES))
# The batch key of each row's dataset index, ``(B,)`` int64, where the loader knows them (IndexedDataset).
SAMPLE_INDEX_KEY = "bridge_thd_sample_index"
SETTING = "overlong_samples"


@dataclass(frozen=True)
class OverlongRule:
    """What the collate does with an over-long row, decided once per loader: ``policy`` (None: measure only) and the
    model's image and video placeholder ids (``vision_token_ids``; empty: a cut image cannot be seen here, and the
    step or the model refuses it). ``scan``: the lengths scan's rule (:meth:`for_scan`)."""

    policy: str | None
    vision_token_ids: tuple[int, ...] = ()
    scan: bool = False

    def for_scan(self) -> "OverlongRule":
        """The lengths scan's rule: measure only, never raise, and mask the supervision of a row the cut would leave
        without any, so that Megatron-Bridge's collate does not refuse a sample that is only being measured (the
        build-time check judges it by dataset index)."""
        return OverlongRule(None, self.vision_token_ids, scan=True)


_RULE: contextvars.ContextVar[OverlongRule | None] = contextvars.ContextVar("bridge_thd_overlong_rule", default=None)
_INDICES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("bridge_thd_sample_indices", default=None)


def policy_of(dataset: Any) -> str:
    """The run's policy: the settings' ``overlong_samples`` (:func:`megatron.bridge_thd.settings.settings_of`, which
    validates it), or the default."""
    return settings_of(dataset).overlong_samples


def row_names(rows: list[int], indices: list[int] | None) -> list[str]:
    """``"row r"``, or ``"row r (dataset sample i)"`` where the loader knows the rows' dataset indices."""
    return [f"row {r}" if indices is None else f"row {r} (dataset sample {indices[r]})" for r in rows]


def _vision_cut(tokens_ids: torch.Tensor | None, real: torch.Tensor, seq_length: int | None,
                vision_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``(B,)`` bool: the row's real tokens past column ``seq_length`` (right padding: the collate's cut) hold an
    image or video placeholder."""
    if tokens_ids is None or seq_length is None or not vision_token_ids or tokens_ids.shape[1] <= seq_length:
        return torch.zeros_like(real, dtype=torch.bool)
    past = tokens_ids[:, seq_length:]
    columns = torch.arange(seq_length, tokens_ids.shape[1])
    is_real = columns[None, :] < real[:, None]
    return (torch.isin(past, torch.tensor(vision_token_ids, dtype=past.dtype)) & is_real).any(dim=1)


def _measure(batch: dict, mask: torch.Tensor, sequence_length: int | None,
             vision_token_ids: tuple[int, ...]) -> torch.Tensor:
    """``(len(MEASURES), B)`` int64 of a right-padded collated batch, before the cut (``dropped`` still 0)."""
    real = mask.to(torch.int64).sum(dim=1)  # (B,)
    loss_mask = batch.get("loss_mask")
    supervised_at = (loss_mask != 0) if isinstance(loss_mask, torch.Tensor) else torch.zeros_like(mask, dtype=torch.bool)
    supervised = supervised_at.to(torch.int64).sum(dim=1)
    kept = supervised if sequence_length is None else supervised_at[:, :sequence_length].to(torch.int64).sum(dim=1)
    tokens_ids = batch.get("input_ids", batch.get("tokens"))
    vision_cut = _vision_cut(tokens_ids if isinstance(tokens_ids, torch.Tensor) else None, real, sequence_length,
                             vision_token_ids)
    return torch.stack([real, supervised, torch.zeros_like(real), kept, vision_cut.to(torch.int64)])


def _listed(rows: list[int], measures: torch.Tensor, indices: list[int] | None) -> str:
    """The refused rows, each named with its lengths: ``"row r (dataset sample i): n tokens (...)"``."""
    names = row_names(rows[:8], indices)
    listed = ", ".join(f"{name}: {int(measures[TOKENS, r])} tokens ({int(measures[SUPERVISED, r])} supervised, "
                       f"{int(measures[SUPERVISED_KEPT, r])} of them before the cut)" for name, r in zip(names, rows))
    return listed + (" ..." if len(rows) > 8 else "")


def supervision_emptied(tokens: torch.Tensor, supervised: torch.Tensor, supervised_kept: torch.Tensor,
                        sequence_length: int) -> torch.Tensor:
    """``(N,)`` bool: the sample is longer than ``sequence_length`` and has supervised tokens, none of them before the
    cut (each argument ``(N,)``: real tokens, supervised tokens, supervised tokens the cut keeps). The one rule the
    collate and global-batch packing's build-time check judge ``"truncate"`` by."""
    return (tokens > sequence_length) & (supervised > 0) & (supervised_kept == 0)


def _judge(measures: torch.Tensor, sequence_length: int, policy: str, indices: list[int] | None) -> None:
    """Raise where the run's policy refuses a row (module docstring), naming the rows, their lengths, ``seq_length``
    and the settings that fix it."""
    over = measures[TOKENS] > sequence_length
    longest = int(measures[TOKENS].max())
    if policy == "refuse" and bool(over.any()):
        rows = over.nonzero().flatten().tolist()
        raise ValueError(
            f"overlong_samples='refuse': {len(rows)} sample(s) of this micro-batch are longer than "
            f"seq_length={sequence_length} ({_listed(rows, measures, indices)}); Megatron-Bridge's collate would cut "
            f"them. Raise dataset.seq_length and model.seq_length to at least {longest}, filter these samples from the "
            "data, or set overlong_samples to 'truncate' (cut, as Megatron-Bridge does) or 'drop' (no loss from them)")
    vision_cut = measures[VISION_CUT] != 0
    if bool(vision_cut.any()):
        rows = vision_cut.nonzero().flatten().tolist()
        raise ValueError(
            f"overlong_samples={policy!r}: {len(rows)} sample(s) of this micro-batch have an image or video placeholder "
            f"past seq_length={sequence_length} ({_listed(rows, measures, indices)}); the cut would leave the vision "
            "tower's embeddings without their placeholders, which no overlong_samples policy allows. Raise "
            f"dataset.seq_length and model.seq_length to at least {longest}, lower the images' resolution "
            "(max_pixels), or filter these samples from the data")
    emptied = supervision_emptied(measures[TOKENS], measures[SUPERVISED], measures[SUPERVISED_KEPT], sequence_length)
    if policy == "truncate" and bool(emptied.any()):
        rows = emptied.nonzero().flatten().tolist()
        raise ValueError(
            f"overlong_samples='truncate': {len(rows)} sample(s) of this micro-batch have every supervised token past "
            f"seq_length={sequence_length} ({_listed(rows, measures, indices)}); the cut would leave them nothing to "
            "train on (Megatron-Bridge's collate refuses such rows too). Set overlong_samples='drop' to keep them out "
            f"of the loss; or raise dataset.seq_length and model.seq_length to at least {longest}, or filter these "
            "samples from the data")


def measure_rows(batch: dict, sequence_length: int | None, rule: OverlongRule | str | None,
                 indices: list[int] | None = None) -> None:
    """Measure each row of a collated batch before the cut, apply the rule's policy, and attach :data:`LENGTHS_KEY`
    (and :data:`SAMPLE_INDEX_KEY` when ``indices`` are known).

    ``batch``: ``input_ids`` / ``tokens`` ``(B, T)``, a 2D ``attention_mask`` (right-padded rows), ``loss_mask`` and
    ``labels`` ``(B, T)``. Without a 2D mask the lengths are unknown and nothing is attached. ``rule``: an
    :class:`OverlongRule` (its ``scan`` form: :meth:`OverlongRule.for_scan`), a policy name, or None (measure only,
    change nothing). ``indices``: the rows' dataset indices, named in refusals.

    Raises:
        ValueError: a row the policy refuses (``"refuse"``: longer than ``sequence_length``; every policy: an image or
            video placeholder past the cut; ``"truncate"``: every supervised token past the cut), naming the rows.
    """
    rule = OverlongRule(rule) if rule is None or isinstance(rule, str) else rule
    if indices is not None:
        batch[SAMPLE_INDEX_KEY] = torch.tensor(indices, dtype=torch.int64)
    mask = batch.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    measures = _measure(batch, mask, sequence_length, rule.vision_token_ids)
    over = measures[TOKENS] > sequence_length if sequence_length is not None else torch.zeros_like(measures[0],
                                                                                                    dtype=torch.bool)
    if rule.policy is not None and sequence_length is not None:
        _judge(measures, sequence_length, rule.policy, indices)
    if rule.policy == "drop":
        masked = over
        measures[DROPPED] = over.to(torch.int64)
    else:  # the scan keeps Megatron-Bridge's collate from refusing a row it would empty; nothing else is changed
        masked = over & (measures[SUPERVISED_KEPT] == 0) if rule.scan else torch.zeros_like(over)
    loss_mask = batch.get("loss_mask")
    if bool(masked.any()) and isinstance(loss_mask, torch.Tensor):
        batch["loss_mask"] = loss_mask.masked_fill(masked[:, None], 0)
        if isinstance(batch.get("labels"), torch.Tensor):
            batch["labels"] = batch["labels"].masked_fill(masked[:, None], -100)
    batch[LENGTHS_KEY] = measures


class IndexedSample:
    """A dataset sample with its dataset index, as :class:`IndexedDataset` hands it to :class:`OverlongCollate`."""

    __slots__ = ("index", "sample")

    def __init__(self, index: int, sample: Any):
        self.index, self.sample = index, sample


class IndexedDataset:
    """A loader's dataset whose samples carry their dataset index (:class:`IndexedSample`), so that the collate
    names refused samples by index and the step reads them (:data:`SAMPLE_INDEX_KEY`). Every other attribute is the
    dataset's."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        return IndexedSample(int(index), self.dataset[index])

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)  # duck: the wrapped dataset answers for every other attribute


class OverlongCollate:
    """A loader's collate with the run's rule: sets it for :func:`collate_patch` while ``collate_fn`` runs (in
    the loader's worker processes, started by fork or spawn alike: the rule travels with this object). Samples
    that come as :class:`IndexedSample` are unwrapped, their dataset indices named in refusals and attached."""

    def __init__(self, collate_fn: Callable, policy: str | OverlongRule, vision_token_ids: tuple[int, ...] = ()):
        rule = policy if isinstance(policy, OverlongRule) else OverlongRule(policy, tuple(vision_token_ids))
        if rule.policy not in POLICIES and not rule.scan:  # an argument check: the run's value is validated already
            raise ValueError(f"policy: {rule.policy!r}; expected one of {', '.join(map(repr, POLICIES))}")
        self.collate_fn, self.rule, self.policy = collate_fn, rule, rule.policy

    @classmethod
    def for_scan(cls, collate_fn: Callable) -> "OverlongCollate":
        """The lengths scan's collate of a loader's ``collate_fn`` (an :class:`OverlongCollate` or the plain one):
        the same collate under :meth:`OverlongRule.for_scan`, with the loader's placeholder ids."""
        if isinstance(collate_fn, OverlongCollate):
            return cls(collate_fn.collate_fn, collate_fn.rule.for_scan())
        return cls(collate_fn, OverlongRule(None).for_scan())

    def __call__(self, examples):
        measure_in_this_process()  # a spawned worker imports afresh
        indices = None
        if examples and all(isinstance(example, IndexedSample) for example in examples):
            indices = [example.index for example in examples]
            examples = [example.sample for example in examples]
        rule, named = _RULE.set(self.rule), _INDICES.set(indices)
        try:
            return self.collate_fn(examples)
        finally:
            _RULE.reset(rule)
            _INDICES.reset(named)


def _measured(original: Callable) -> Callable:
    def prepare_sequence_batch(batch, *, sequence_length=None, **kwargs):
        measure_rows(batch, sequence_length, _RULE.get(), _INDICES.get())
        return original(batch, sequence_length=sequence_length, **kwargs)

    prepare_sequence_batch.__wrapped__ = original
    return prepare_sequence_batch


_COLLATE_PATCH = None
_COLLATE_MODULE = "megatron.bridge.models.qwen_vl.data.collate_fn"


def measure_in_this_process() -> bool:
    """Apply :func:`collate_patch` here if Megatron-Bridge's Qwen-VL collate module is loaded (a collate of it being
    run, or unpickled into a worker, loads it); never import it for that (a whole Megatron-Bridge import costs
    seconds). Returns whether the collate is measured."""
    if _COLLATE_MODULE not in sys.modules:
        return False
    apply_permanently(collate_patch())
    return True



def collate_patch():
    """The :class:`~megatron.bridge_thd.upstream.patches.Patch` of ``prepare_sequence_batch`` as Megatron-Bridge's Qwen-VL
    collate module (``models/qwen_vl/data/collate_fn.py``, Qwen3-VL and Qwen3.5-VL) calls it; one per process."""
    global _COLLATE_PATCH
    if _COLLATE_PATCH is None:
        module = importlib.import_module(_COLLATE_MODULE)
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
    """What the collate and the step cut, from :data:`LENGTHS_KEY` ``(len(MEASURES), B)`` and what reached the model: real
    tokens kept ``(B,)`` and supervised tokens kept ``(B,)`` (host tensors: no sync)."""
    lost_tokens = (measures[TOKENS] - kept_tokens).clamp(min=0)
    dropped = measures[DROPPED] != 0
    lost_supervised = torch.where(dropped, measures[SUPERVISED], (measures[SUPERVISED] - kept_supervised).clamp(min=0))
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
