"""Token slots and attention work of each packing layout for one micro-batch, by the layout
contract the step builds rows by (:mod:`megatron.bridge_thd.layouts`).

For a micro-batch of B samples with real lengths ``s_i`` (LLM tokens, truncated to
``seq_length``), collated to the longest sample:

* ``bshd``: ``(B, W)`` with ``W = layouts.bshd_width(max_i s_i, ...)`` (Megatron-Bridge's
  padded width, ``seq_length`` when PP > 1 or EP > 1). Slots ``B * W``; attention ``B * W^2``.
* ``thd``: one row of real tokens, slot i ``round_up(s_i, a)``, ``a = layouts.thd_alignment``.
  Slots ``sum_i round_up(s_i, a)``; attention ``sum_i s_i^2``.
* ``thd_static``: ``layouts.static_row_length`` slots; attention ``sum_i s_i^2``.

"Slots" are what the linear layers (QKV, MLP, logits) process; "attention work" is what the
trainer's ``seqlen_squared_sum`` accumulator holds for the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.bridge_thd import layouts
from megatron.bridge_thd.cost.sample import frame_lengths
from megatron.bridge_thd.checks import check_int
from megatron.bridge_thd.cost.sample_lengths import SampleLengths
from megatron.bridge_thd.plan.samples import check_seq_length

__all__ = ["LAYOUT_ORDER", "Parallel", "MicroBatch", "micro_batches", "layout_stats"]

# The order the planner estimates and lists the layouts in: the baseline first.
LAYOUT_ORDER = ("bshd",) + tuple(name for name in layouts.LAYOUT_NAMES if name != "bshd")


@dataclass(frozen=True)
class Parallel:
    """Parallel layout: ``gpus`` = tp * cp * pp * dp; EP splits experts over the DP x CP ranks.
    ``sequence_parallel`` defaults to on whenever tp > 1 (Megatron's usual setting); ``fp8`` aligns
    THD slots to 16 as the step does with an FP8 recipe."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    gpus: int = 8
    sequence_parallel: bool | None = None
    fp8: bool = False

    def __post_init__(self):
        for name, value in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp), ("ep", self.ep), ("gpus", self.gpus)):
            check_int(name, value)
        if self.gpus % (self.tp * self.cp * self.pp):
            raise ValueError(f"gpus={self.gpus} is not divisible by tp*cp*pp={self.tp * self.cp * self.pp}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*cp={self.dp * self.cp} (gpus / (tp*pp))")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.cp * self.pp)

    @property
    def sp(self) -> bool:
        return self.tp > 1 if self.sequence_parallel is None else bool(self.sequence_parallel and self.tp > 1)

    def thd_alignment(self) -> int:
        return layouts.thd_alignment(self.tp, self.cp, sequence_parallel=self.sp, fp8=self.fp8)

    def bshd_divisor(self) -> int:
        return layouts.bshd_alignment(self.tp, self.cp)

    def bshd_forced(self) -> bool:
        return self.pp > 1 or self.ep > 1


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: ``lengths`` real LLM tokens per sample (truncated), ``patches`` ViT
    patches in it, ``truncated`` tokens cut by ``seq_length``, ``frames`` each sample's ViT frames
    (patches per frame, :func:`megatron.bridge_thd.cost.step_time.frame_lengths`)."""

    lengths: tuple[int, ...]
    patches: int
    truncated: int
    frames: tuple[tuple[int, ...], ...] = ()


def micro_batches(samples: SampleLengths, micro_batch_size: int, seq_length: int) -> list[MicroBatch]:
    """Consecutive groups of ``micro_batch_size`` samples (the remainder is dropped, as with
    ``drop_last``), each sample truncated to ``seq_length`` as the step truncates it (its first
    ``seq_length`` tokens).

    Raises:
        ValueError: bad sizes, or a ``seq_length`` whose truncation would cut an image of any sample
            (the step refuses those micro-batches; :func:`~.samples.check_seq_length`).
    """
    check_int("micro_batch_size", micro_batch_size)
    check_int("seq_length", seq_length)
    check_seq_length(samples, seq_length)
    count = len(samples) // micro_batch_size
    if count == 0:
        raise ValueError(f"micro_batch_size={micro_batch_size} is larger than the {len(samples)} samples; "
                         "pass more samples (--num-samples) or a smaller micro-batch")
    batches = []
    for k in range(count):
        idx = range(k * micro_batch_size, (k + 1) * micro_batch_size)
        raw = [samples.tokens[i] for i in idx]
        lengths = tuple(min(n, seq_length) for n in raw)
        batches.append(MicroBatch(lengths, sum(samples.patches(i) for i in idx), sum(raw) - sum(lengths),
                                  tuple(frame_lengths(samples.grids[i]) for i in idx)))
    return batches



def layout_stats(layout: str, batch: MicroBatch, seq_length: int, parallel: Parallel) -> tuple[int, int]:
    """``(token_slots, attention_work)`` of ``batch`` in ``layout``: the trainer's
    ``seqlen_sum`` and ``seqlen_squared_sum`` for this micro-batch (tokens, tokens^2)."""
    b = len(batch.lengths)
    if layout == "bshd":
        width = layouts.bshd_width(max(batch.lengths), seq_length=seq_length, tp=parallel.tp, cp=parallel.cp,
                                   pp=parallel.pp, ep=parallel.ep)
        return b * width, b * width * width
    real_sq = sum(n * n for n in batch.lengths)
    align = parallel.thd_alignment()
    if layout == "thd":
        return layouts.thd_slots(batch.lengths, align), real_sq
    if layout == "thd_static":
        return layouts.static_row_length(b, seq_length=seq_length, align=align), real_sq
    raise ValueError(f"layout {layout!r} is not known; valid layouts: {', '.join(LAYOUT_ORDER)}")
