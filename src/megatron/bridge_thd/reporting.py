"""What a recipe run reports, as Megatron-Bridge ``Callback``s and a forward-step wrapper: per iteration the
trainer's loss, gradient norm, FLOPs, FLOPs tokens, wall time and peak memory (:func:`iteration_recorder`);
per micro-batch the real and supervised tokens the step took and, with our step, the decoder's signature
(:func:`counting_step`); and the forward step of a run by layout name (:func:`step_for`).

Used by the recipe scripts (``recipes/``) on a GPU and by the CPU runs of the test bed alike. Megatron-Bridge
is imported when a callback is made, never at import. Nothing here changes what the step or the trainer
computes.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["step_for", "iteration_recorder", "counting_step"]


def step_for(layout: str):
    """The forward step of a run: ``"megatron_bridge"`` is Megatron-Bridge's own
    ``qwen3_vl_step.forward_step`` (the padded baseline); any layout name is ours."""
    if layout == "megatron_bridge":
        return importlib.import_module("megatron.bridge.models.qwen_vl.qwen3_vl_step").forward_step
    return importlib.import_module("megatron.bridge_thd.qwen3_vl_step").forward_step


def _peak_memory_bytes() -> int:
    """Peak memory so far: the device's allocator peak on a GPU, the process's maximum resident
    set on the CPU."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def iteration_recorder():
    """A Megatron-Bridge ``Callback`` recording, per iteration, what the trainer logs: the reduced
    loss, the gradient norm, the model FLOPs the trainer added (``floating_point_operations_so_far``,
    DP-global), the sequence tokens its FLOPs accounting saw on this rank (``_flops_seqlen_sum``)
    and the step's wall time."""
    import time

    from megatron.bridge.training.callbacks import Callback

    class Recorder(Callback):
        # The trainer adds a step's FLOPs after on_train_step_end fires (train.py), so a step's
        # FLOPs are read at the next step's start (or at the end of training).
        def __init__(self):
            self.rows = []
            self.evaluations = []  # per evaluation: {"test": bool, "iteration", "loss"}
            self._start = None

        def _evaluated(self, context, test: bool):
            losses = context.total_loss_dict or {}
            loss = losses.get("lm loss")
            self.evaluations.append({"test": test, "iteration": int(context.state.train_state.step),
                                     "loss": None if loss is None else float(loss)})

        def on_eval_end(self, context):
            self._evaluated(context, test=False)

        def on_test_end(self, context):
            self._evaluated(context, test=True)

        def _close_previous(self, state):
            if self.rows and self.rows[-1]["flops"] is None:
                self.rows[-1]["flops"] = float(state.train_state.floating_point_operations_so_far) - self._flops

        def on_train_step_start(self, context):
            self._close_previous(context.state)
            self._flops = float(context.state.train_state.floating_point_operations_so_far)
            self._start = time.perf_counter()

        def on_train_step_end(self, context):
            state = context.state
            loss = context.loss_dict.get("lm loss") if context.loss_dict else None
            self.rows.append({
                "iteration": int(state.train_state.step) + 1,  # the trainer counts the step after this event
                "loss": float(loss) if loss is not None else None,
                "grad_norm": None if context.grad_norm is None else float(context.grad_norm),
                "flops": None,
                "flops_tokens": int(getattr(state, "_flops_seqlen_sum", 0)),  # offers: the trainer's FLOPs tokens
                "seconds": time.perf_counter() - self._start,
                "peak_memory_bytes": _peak_memory_bytes(),
            })

        def on_train_end(self, context):
            self._close_previous(context.state)

        def on_checkpoint_save(self, context):
            # exit_interval saves and exits (sys.exit) without on_train_end; the step's FLOPs are in by then.
            self._close_previous(context.state)

    return Recorder()


class _RealTokenCounter:
    """Wraps the trainer's data iterator: counts the real tokens (the collate's 2D attention mask)
    and the supervised tokens (``loss_mask``) of every micro-batch this rank's step takes."""

    def __init__(self, iterator, counts: list, training: bool = True):
        self.iterator, self.counts, self.training = iterator, counts, training

    def __iter__(self):
        return self

    def __next__(self):
        from megatron.core import parallel_state

        batch = next(self.iterator)
        mask = batch.get("attention_mask")
        self.counts.append({
            # The ranks of one model replica (TP / CP / PP) read the same micro-batch: count it once.
            "counted": (parallel_state.get_tensor_model_parallel_rank() == 0
                        and parallel_state.get_context_parallel_rank() == 0
                        and parallel_state.get_pipeline_model_parallel_rank() == 0),
            "real_tokens": None if mask is None or mask.dim() != 2 else int(mask.bool().sum()),
            "supervised_tokens": int(batch["loss_mask"].bool().sum()) if "loss_mask" in batch else None,
            "samples": int(next(batch[k] for k in ("tokens", "input_ids") if k in batch).shape[0]),
            "training": self.training,  # False: an evaluation's micro-batch
        })
        return batch

    def __getattr__(self, name):
        return getattr(self.iterator, name)  # duck: the wrapped iterator answers for every other attribute


def counting_step(step, counts: list):
    """``step`` with its data iterator wrapped by :class:`_RealTokenCounter` (``counts`` receives one
    entry per micro-batch this rank takes, training or evaluation, as the model's mode says, with the
    decoder's signature and the token slots it processed when the step is ours); same signature, so the trainer injects the same arguments."""
    import functools

    @functools.wraps(step)
    def counted(state, data_iterator, model, *args, **kwargs):
        if data_iterator is not None:
            training = bool(getattr(model, "training", True))  # duck: one model chunk (its mode) or a list of them
            data_iterator = _RealTokenCounter(data_iterator, counts, training=training)
        if not isinstance(getattr(state, "bridge_thd_stats", None), list):  # optional: our step's list, once made
            state.bridge_thd_stats = []  # our step appends each micro-batch's PackingStats here
        before = len(state.bridge_thd_stats)
        result = step(state, data_iterator, model, *args, **kwargs)
        if data_iterator is not None and len(state.bridge_thd_stats) > before:
            # What the decoder saw (step.decoder_signature): in thd_static one value for the whole run.
            stats = state.bridge_thd_stats.pop()
            counts[-1]["signature"] = repr(stats.signature)
            counts[-1]["token_slots"] = int(stats.processed_tokens)  # a host int: no read back
        return result

    return counted
