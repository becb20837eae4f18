"""The run's packing figures in Megatron-Bridge's own loggers, under ``packing/`` (docs/packing-logs.md).

Megatron-Bridge logs ``consumed_samples x seq_length`` (padding included); these figures show what packing bought.
Three parts:

* :class:`PackingTotals`, on ``state.bridge_thd_packing_totals``: the step (``step.forward._account``) adds each
  training micro-batch's :class:`~megatron.bridge_thd.step.prepare.PackingStats` there. Device tensors are summed on
  the device, host ints on the host: no host synchronisation, no collective per micro-batch.
* :class:`PackingLogCallback`, a Megatron-Bridge ``Callback``: at the end of each training step it closes the
  step's sums; at Megatron-Bridge's ``logger.log_interval`` it reduces the interval's sums over the data-parallel
  ranks in ONE ``all_reduce`` of one small tensor, reads them to the host ONCE, and writes the ``packing/*`` figures
  to the writers Megatron-Bridge's state holds (TensorBoard, W&B, MLflow, Comet) and, with ``run_log`` set, one
  :class:`~megatron.bridge_thd.run_log.RunLogRecord` line per iteration (global rank 0).
* :func:`pretrain_patch`, applied by ``configure``: Megatron-Bridge's ``training/pretrain.py`` ``_pretrain`` adds
  the callback to the run's ``CallbackManager`` when :func:`packing_log_wanted` says so, decided once per run from
  the settings (``packing_log``, ``run_log``) and the configured loggers.

Megatron-Bridge is imported when the callback is made, never at import.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import torch

from megatron.bridge_thd.rules.setup import Setup, read_setup
from megatron.bridge_thd.run_log import RunLogRecord
from megatron.bridge_thd.settings import holds_settings, settings_of
from megatron.bridge_thd.upstream.patches import Patch

__all__ = ["PackingTotals", "PackingLogCallback", "packing_log_wanted", "pretrain_patch", "record_placement",
           "clear_placements", "logger_configured",
           "TOTALS_ATTRIBUTE", "CP_SIZES", "figure_names"]

# Where the step finds this rank's sums (an attribute of Megatron-Bridge's GlobalState).
TOTALS_ATTRIBUTE = "bridge_thd_packing_totals"
# Summed on the device, per micro-batch (0-dim int64 tensors the step holds).
_DEVICE = ("real_tokens", "supervised_tokens", "attention_work", "truncated_tokens", "vision_patches")
# Summed on the host, per micro-batch.
_HOST = ("token_slots", "padded_slots", "micro_batches", "truncated_samples", "dropped_samples")
# Rows per CP size under a CP size per sample: one column per size.
CP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)

# Global-batch packing's per-step placement figures (the same on every rank), by the run's step number.
_PLACEMENTS: OrderedDict = OrderedDict()
_PLACEMENTS_KEPT = 4096


def record_placement(record) -> None:
    """Keep a training step's :class:`~megatron.bridge_thd.batching.sampler.StepPlacement` (the sampler's
    ``on_step``; the loader places ahead of the trainer, so the last few thousand are kept by step number)."""
    _PLACEMENTS[int(record.step)] = record
    while len(_PLACEMENTS) > _PLACEMENTS_KEPT:
        _PLACEMENTS.popitem(last=False)


def _on(value, like: torch.Tensor) -> torch.Tensor:
    """``value`` (a 0-dim tensor or a host int) as a 0-dim int64 tensor on ``like``'s device, without a copy back."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device, torch.int64)
    return like.new_full((), int(value), dtype=torch.int64)


def clear_placements() -> None:
    """Forget the placements kept so far (a new run: made before its loaders are built)."""
    _PLACEMENTS.clear()


def _vision_patches(forward_args: dict, like: torch.Tensor) -> torch.Tensor:
    """``sum(t * h * w)`` over the image and video grids, on ``like``'s device where the grids are (else 0)."""
    total = like.new_zeros((), dtype=torch.int64)
    for name in ("image_grid_thw", "video_grid_thw"):
        grid = forward_args.get(name)
        if isinstance(grid, torch.Tensor) and grid.numel() > 0 and grid.device == like.device:
            total = total + grid.to(torch.int64).prod(dim=-1).sum()
    return total


class PackingTotals:
    """One rank's per-iteration sums of its training micro-batches (see the module docstring)."""

    def __init__(self):
        self._current: torch.Tensor | None = None
        self._host = [0] * (len(_HOST) + len(CP_SIZES))
        self._device: torch.device | None = None
        self.device_rows: list[torch.Tensor] = []
        self.host_rows: list[list[int]] = []
        self.iterations: list[int] = []

    def add(self, stats, loss_mask: torch.Tensor | None, forward_args: dict, cp_size: int | None = None) -> None:
        """Add one micro-batch: device sums stay on the device (one ``stack`` and one add), host ints on the host.
        ``cp_size``: the row's CP size under a CP size per sample (counted once, by the row group's first rank)."""
        real = stats.real_tokens
        supervised = real.new_zeros((), dtype=torch.int64) if loss_mask is None else (loss_mask != 0).sum()
        values = torch.stack([real.to(torch.int64), _on(supervised, real), _on(stats.attention_work, real),
                              _on(stats.truncated_tokens, real), _vision_patches(forward_args, real)])
        self._current = values if self._current is None else self._current + values
        self._device = real.device
        self._host[0] += int(stats.processed_tokens)
        self._host[1] += int(stats.padded_tokens)
        self._host[2] += 1
        self._host[3] += int(stats.truncated_samples)
        self._host[4] += int(stats.dropped_samples)
        if cp_size is not None and cp_size in CP_SIZES:
            self._host[len(_HOST) + CP_SIZES.index(cp_size)] += 1

    def close_iteration(self, iteration: int) -> None:
        """The step ended: its sums become one row (zeros where this rank ran no training micro-batch)."""
        current = self._current
        if current is None:
            current = torch.zeros(len(_DEVICE), dtype=torch.int64, device=self._zeros_device())
        self.device_rows.append(current)
        self.host_rows.append(self._host)
        self.iterations.append(int(iteration))
        self._current, self._host = None, [0] * (len(_HOST) + len(CP_SIZES))

    def _zeros_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def reduce(self, group=None) -> list[dict]:
        """The closed iterations' sums over ``group`` (one ``all_reduce`` of one ``[iterations, figures]`` int64
        tensor) read to the host once, as one dict per iteration; the rows are then dropped."""
        if not self.iterations:
            return []
        device = self.device_rows[0].device
        table = torch.cat([torch.stack(self.device_rows),
                           torch.tensor(self.host_rows, dtype=torch.int64).to(device)], dim=1)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(table, group=group)
        values = table.tolist()
        names = _DEVICE + _HOST
        rows = []
        for iteration, row in zip(self.iterations, values, strict=True):
            figures = dict(zip(names, row[:len(names)], strict=True), iteration=iteration)
            figures["cp_per_sample_rows"] = {str(size): count for size, count in
                                             zip(CP_SIZES, row[len(names):], strict=True) if count}
            rows.append(figures)
        self.device_rows, self.host_rows, self.iterations = [], [], []
        return rows


def figure_names() -> tuple[str, ...]:
    """Every ``packing/*`` name the callback may write (``packing/cp_per_sample_rows_<k>`` for each CP size ``k``)."""
    return tuple(f"packing/{name}" for name in (
        "real_tokens_per_iteration", "supervised_tokens_per_iteration", "token_slots_per_iteration",
        "padded_slots_per_iteration", "padding_share", "attention_work_per_iteration",
        "truncated_tokens_per_iteration", "truncated_samples_per_iteration", "dropped_samples_per_iteration",
        "vision_patches_per_iteration", "real_tokens_per_second",
        "supervised_tokens_per_second", "token_slots_per_second", "real_tokens_per_second_per_gpu",
        "token_slots_per_second_per_gpu", "iteration_time", "rank_cost_max_over_mean",
        "in_batch_rank_cost_max_over_mean")) + tuple(f"packing/cp_per_sample_rows_{size}" for size in CP_SIZES)


def logger_configured(cfg: Any) -> bool:
    """Whether the run writes to any of Megatron-Bridge's loggers (TensorBoard, W&B, MLflow, Comet)."""
    return any(getattr(cfg.logger, name, None)  # optional: a logger config may leave a writer's setting out
               for name in ("tensorboard_dir", "wandb_project", "mlflow_experiment", "comet_project"))


def packing_log_wanted(cfg: Any) -> bool:
    """Decided once per run: our settings are held (``configure``), and either ``packing_log`` is on and a logger
    is configured, or ``run_log`` names a path."""
    dataset = cfg.dataset
    if dataset is None or not holds_settings(dataset):
        return False
    settings = settings_of(dataset)
    return bool(settings.run_log) or (settings.packing_log and logger_configured(cfg))


def _interval_seconds(state, since: float) -> float | None:
    """Seconds since Megatron-Bridge's last log line, as its ``interval-time`` timer holds them (read without a
    reset: the trainer reads and resets it right after, in ``training_log``); the wall clock since ``since`` where
    the timer cannot be read."""
    try:
        return float(state.timers("interval-time").elapsed(reset=False, barrier=False))
    except Exception:  # no timers (a hand-made state), or Megatron-Core's dummy timer at a lower log level
        return time.perf_counter() - since if since else None


def _parallel_sizes(setup: Setup) -> dict:
    """TP / CP / PP / EP / DP, micro-batch size, micro-batches per step, global batch, ``dataset.seq_length``, from
    the run's facts."""
    tp, cp, pp, ep = setup.tp, setup.cp, setup.pp, setup.ep
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    dp = max(world // (tp * cp * pp), 1)
    micro, global_batch = int(setup.micro_batch_size), int(setup.global_batch_size)
    return dict(tp=tp, cp=cp, pp=pp, ep=ep, dp=dp, micro_batch_size=micro,
                micro_batches_per_step=max(global_batch // (micro * dp), 1), global_batch_size=global_batch,
                seq_length=int(setup.seq_lengths[0]))


def _scalars(rows: list[dict], seconds: float | None, world: int) -> dict:
    """The ``packing/*`` figures of one logging interval: per-iteration means of the DP-summed rows."""
    n = len(rows)

    def mean(name):
        return sum(row[name] for row in rows) / n

    figures = {f"packing/{name}_per_iteration": mean(name) for name in (
        "real_tokens", "supervised_tokens", "attention_work", "truncated_tokens", "vision_patches")}
    figures["packing/token_slots_per_iteration"] = mean("token_slots")
    figures["packing/padded_slots_per_iteration"] = mean("padded_slots")
    figures["packing/truncated_samples_per_iteration"] = mean("truncated_samples")
    figures["packing/dropped_samples_per_iteration"] = mean("dropped_samples")
    slots = figures["packing/token_slots_per_iteration"]
    figures["packing/padding_share"] = 1.0 - figures["packing/real_tokens_per_iteration"] / slots if slots else 0.0
    if seconds:
        per_iteration = seconds / n
        figures["packing/iteration_time"] = per_iteration
        for name in ("real_tokens", "supervised_tokens", "token_slots"):
            figures[f"packing/{name}_per_second"] = figures[f"packing/{name}_per_iteration"] / per_iteration
        for name in ("real_tokens", "token_slots"):
            figures[f"packing/{name}_per_second_per_gpu"] = figures[f"packing/{name}_per_second"] / world
    placed = [_PLACEMENTS[row["iteration"]] for row in rows if row["iteration"] in _PLACEMENTS]
    if placed:
        figures["packing/rank_cost_max_over_mean"] = sum(p.rank_imbalance for p in placed) / len(placed)
        in_batch = sum(p.in_batch_rank_imbalance for p in placed) / len(placed)
        figures["packing/in_batch_rank_cost_max_over_mean"] = in_batch
    for size in CP_SIZES:
        counts = [row["cp_per_sample_rows"].get(str(size), 0) for row in rows]
        if any(counts):
            figures[f"packing/cp_per_sample_rows_{size}"] = sum(counts) / n
    return figures


def _write(state, figures: dict, iteration: int) -> None:
    """``figures`` to every writer Megatron-Bridge's state holds on this rank (it makes them on the last rank),
    with the calls its own ``training_log`` makes."""
    writer = state.tensorboard_logger
    if writer is not None:
        for name, value in figures.items():
            writer.add_scalar(name, value, iteration)
    wandb = state.wandb_logger
    if wandb is not None:
        wandb.log(figures, iteration)
    mlflow = state.mlflow_logger
    if mlflow is not None:
        # Names of one '/' and word characters: what Megatron-Bridge's MLflow sanitiser leaves unchanged.
        mlflow.log_metrics(dict(figures), step=iteration)
    comet = state.comet_logger
    if comet is not None:
        comet.log_metrics(figures, step=iteration)


def _make_callback_class():
    from megatron.bridge.training.callbacks import Callback  # Megatron-Bridge's training package: when first asked for

    class PackingLog(Callback):
        """See :class:`PackingLogCallback`."""

        def __init__(self):
            clear_placements()  # made before the run's loaders: no earlier run's placements are read
            self.totals = PackingTotals()
            self.logged: list[dict] = []  # what was written, per log event: {"iteration", "figures"} (tests, tools)
            self._since = 0.0
            self._run = None
            self._path = None
            self._writes = False

        def on_train_start(self, context):
            state = context.state
            setattr(state, TOTALS_ATTRIBUTE, self.totals)
            settings = settings_of(state.cfg.dataset)
            self._writes = settings.packing_log and logger_configured(state.cfg)
            self._path = settings.run_log
            # The run's facts, read once (the trainer starts after Megatron-Bridge's finalize(): the config is final).
            setup = read_setup(state.cfg, settings.layout, settings=settings, final=True)
            self._run = dict(_parallel_sizes(setup), layout=settings.layout)
            self._since = time.perf_counter()

        def on_train_step_end(self, context):
            state = context.state
            iteration = int(state.train_state.step) + 1  # the trainer counts the step after this event
            self.totals.close_iteration(iteration)
            if iteration % max(int(state.cfg.logger.log_interval or 1), 1) == 0:
                self._flush(state, iteration)

        def on_train_end(self, context):
            if self.totals.iterations:
                self._flush(context.state, self.totals.iterations[-1])
                writer = context.state.tensorboard_logger if self._writes else None
                if writer is not None:
                    writer.flush()  # the trainer flushed its writer before this event
            if getattr(context.state, TOTALS_ATTRIBUTE, None) is self.totals:  # optional: another run may have taken it
                delattr(context.state, TOTALS_ATTRIBUTE)

        def _flush(self, state, iteration: int) -> None:
            rows = self.totals.reduce(_reduction_group(state))
            # Read after the reduction, which every rank of the group has joined: like Megatron-Bridge's read of
            # the same timer behind a barrier, the time covers the slowest rank's step.
            seconds = _interval_seconds(state, self._since)
            self._since = time.perf_counter()
            if not rows or not any(row["micro_batches"] for row in rows):
                return  # not our step: nothing was recorded
            world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            figures = _scalars(rows, seconds, world)
            self.logged.append({"iteration": iteration, "figures": figures})
            if self._writes:
                _write(state, figures, iteration)
            if self._path and _global_rank() == 0:
                self._append_run_log(rows, None if seconds is None else seconds / len(rows))

        def _append_run_log(self, rows: list[dict], seconds: float | None) -> None:
            with open(self._path, "a", encoding="utf-8") as handle:
                for row in rows:
                    placed = _PLACEMENTS.get(row["iteration"])
                    record = RunLogRecord(
                        iteration=row["iteration"], iteration_time_s=seconds, **self._run,
                        **{name: int(row[name]) for name in _DEVICE + _HOST[:2] + _HOST[3:]},
                        rank_cost_max_over_mean=None if placed is None else float(placed.rank_imbalance),
                        cp_per_sample_rows=row["cp_per_sample_rows"] or None)
                    handle.write(record.to_json() + "\n")

    return PackingLog


_CALLBACK_CLASS = None


def _callback_class():
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is None:
        _CALLBACK_CLASS = _make_callback_class()
    return _CALLBACK_CLASS


def PackingLogCallback():  # noqa: N802 - a class made when first asked for (Megatron-Bridge imported then)
    """A Megatron-Bridge ``Callback`` that writes the ``packing/*`` figures (module docstring); ``.logged`` keeps
    what it computed on this rank per log event, ``.totals`` the sums not yet reduced."""
    return _callback_class()()


def _global_rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _reduction_group(state):
    """The ranks whose micro-batches make up the global batch, each once: the data-parallel group (the ranks of one
    model replica, TP / CP / PP, read the same micro-batch), or with a CP size per sample the data- and
    context-parallel group (each row is counted by its group's first rank only)."""
    if not torch.distributed.is_initialized():
        return None
    from megatron.core import parallel_state  # Megatron-Core's parallel state: only in a distributed run

    with_cp = settings_of(state.cfg.dataset).cp_per_sample is not None
    return parallel_state.get_data_parallel_group(with_context_parallel=with_cp)


def _with_packing_log(original):
    def _pretrain(state, forward_step_func, callback_manager=None, *args, **kwargs):
        if packing_log_wanted(state.cfg):
            from megatron.bridge.training.callbacks import CallbackManager  # Megatron-Bridge's training package

            callback_manager = callback_manager if callback_manager is not None else CallbackManager()
            installed = any(isinstance(getattr(fn, "__self__", None), _callback_class())  # duck: function or method
                            for fn in callback_manager.list_callbacks("on_train_step_end"))
            if not installed:
                callback_manager.add(PackingLogCallback())
        return original(state, forward_step_func, callback_manager, *args, **kwargs)

    _pretrain.__wrapped__ = original
    return _pretrain


_PRETRAIN_PATCH = None


def pretrain_patch():
    """The patch ``configure`` applies once per process (``patches.apply_permanently``): Megatron-Bridge's
    ``training/pretrain.py`` ``_pretrain`` (which ``pretrain`` and ``finetune`` call) adds a
    :func:`PackingLogCallback` to the run's callbacks when :func:`packing_log_wanted` says so; otherwise it calls
    the original unchanged.

    Raises:
        ValueError: Megatron-Bridge's ``training.pretrain`` cannot be imported here.
    """
    global _PRETRAIN_PATCH
    if _PRETRAIN_PATCH is None:
        try:
            from megatron.bridge.training import pretrain  # Megatron-Bridge's training package: when the patch is made
        except ImportError as error:
            raise ValueError(f"packing_log: Megatron-Bridge's training.pretrain cannot be imported here ({error}); set "
                             "packing_log=False to run without the packing figures") from error
        _PRETRAIN_PATCH = Patch(pretrain, "_pretrain", _with_packing_log(pretrain._pretrain),
                                "the run's callbacks gain megatron.bridge_thd.packing_log's callback (the packing/* "
                                "figures and the run log) when the settings ask for it")
    return _PRETRAIN_PATCH
