"""The run log: one JSON line per training iteration, written by global rank 0 to the path of the setting
``PackingSettings.run_log`` (docs/packing-logs.md), for the planner to fit its step-time model on a real run.

The format lives here, in the runtime (never in ``megatron.bridge_thd.plan``, which the runtime does not import):
:class:`RunLogRecord` (one line; :meth:`RunLogRecord.to_json` / :meth:`RunLogRecord.from_json`) and
:func:`read_run_log`. The field names are stable: a new field is added with a default, none is renamed or removed
without raising :data:`FORMAT_VERSION` (version 2 renamed ``cp_rows`` to ``cp_per_sample_rows``; a version-1 line
is read with its ``cp_rows`` as ``cp_per_sample_rows``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

__all__ = ["RunLogRecord", "read_run_log", "FORMAT_VERSION"]

FORMAT_VERSION = 2
# Older lines' names of fields since renamed: {old name: field}.
_RENAMED = {"cp_rows": "cp_per_sample_rows"}


@dataclass(frozen=True)
class RunLogRecord:
    """One training iteration of a run, as the run log holds it (one JSON object per line).

    Token figures are summed over the data-parallel ranks and the iteration's micro-batches (the whole global
    batch; under a CP size per sample over the data- and context-parallel ranks, each row once), as the
    ``packing/*`` figures are reduced.

    Attributes:
        version: :data:`FORMAT_VERSION` of the line.
        iteration: the trainer's iteration number (1-based, as Megatron-Bridge logs it).
        iteration_time_s: seconds per iteration as Megatron-Bridge logs its ``iteration-time``: its
            ``interval-time`` timer over the iterations since the last log line, divided by their count (so every
            iteration of one logging interval carries the interval's mean; ``logger.log_interval=1`` gives each
            iteration its own time); None where the timer could not be read.
        layout: the layout the step ran (``"thd"``, ``"thd_static"``, ``"bshd"``).
        tp, cp, pp, ep, dp: tensor-, context-, pipeline-, expert- and data-parallel sizes.
        micro_batch_size: samples per micro-batch (``train.micro_batch_size``).
        micro_batches_per_step: micro-batches per rank per step (``global_batch_size / (micro_batch_size * dp)``).
        global_batch_size: samples per step (``train.global_batch_size``).
        seq_length: ``dataset.seq_length``.
        token_slots: token slots the model processed (row lengths, or ``B * T``), summed.
        real_tokens: real (non-padding) tokens, after any over-long cut, summed.
        supervised_tokens: tokens with a loss (the packed ``loss_mask``), summed.
        attention_work: sum over samples of ``s ** 2`` the attention computed (``B * T ** 2`` for BSHD), summed.
        padded_slots: token slots Megatron-Bridge's padded BSHD layout would process for the same micro-batches.
        truncated_tokens: real tokens the over-long policy cut (``seq_length`` exceeded), summed.
        vision_patches: ViT patches (``sum(t * h * w)`` over the image and video grids), summed.
        truncated_samples / dropped_samples: samples the over-long policy cut to ``seq_length`` / dropped from the
            loss, from the lengths the collate measured before its cut, summed (0 in a line written before they
            were logged).
        rank_cost_max_over_mean: under global-batch packing, the step's per-rank cost max / mean as placed (the
            same on every rank); None otherwise.
        cp_per_sample_rows: under a CP size per sample, rows the step ran per CP size (``{"1": n, "2": m, ...}``);
            None otherwise (``cp_rows`` in a version-1 line).
    """

    iteration: int
    iteration_time_s: float | None
    layout: str
    tp: int
    cp: int
    pp: int
    ep: int
    dp: int
    micro_batch_size: int
    micro_batches_per_step: int
    global_batch_size: int
    seq_length: int
    token_slots: int
    real_tokens: int
    supervised_tokens: int
    attention_work: int
    padded_slots: int
    truncated_tokens: int
    vision_patches: int
    rank_cost_max_over_mean: float | None = None
    cp_per_sample_rows: dict | None = None
    truncated_samples: int = 0
    dropped_samples: int = 0
    version: int = field(default=FORMAT_VERSION)

    def to_json(self) -> str:
        """The record as one line of JSON (no newline), keys in field order."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> RunLogRecord:
        """The record of one line :meth:`to_json` wrote; keys this version does not know are ignored (a newer
        writer's additions), an older line's name of a renamed field is read as the field, a missing required key is
        an error naming it.

        Raises:
            ValueError: the line is not a JSON object, lacks a field, or has a newer :data:`FORMAT_VERSION`.
        """
        try:
            values = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"run log: a line is not JSON ({error}): {line[:80]!r}") from None
        if not isinstance(values, dict):
            raise ValueError(f"run log: a line is not a JSON object: {line[:80]!r}")
        if int(values.get("version", FORMAT_VERSION)) > FORMAT_VERSION:
            raise ValueError(f"run log: a line of format version {values['version']}; this reader knows up to "
                             f"{FORMAT_VERSION} (update megatron-bridge-thd)")
        known = {f.name for f in fields(cls)}
        values = {_RENAMED.get(name, name): value for name, value in values.items()
                  if not (name in _RENAMED and _RENAMED[name] in values)}
        try:
            return cls(**{name: value for name, value in values.items() if name in known})
        except TypeError as error:
            raise ValueError(f"run log: a line lacks a field ({error}): {line[:80]!r}") from None


def read_run_log(path) -> list[RunLogRecord]:
    """Every record of the run log at ``path``, in order (blank lines skipped).

    Raises:
        ValueError: a line that is not a record (its number named).
    """
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append(RunLogRecord.from_json(line))
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return records
