"""Running recipes in their CPU mode: :func:`run_on_cpu` starts a gloo world whose ranks each run
:func:`_run_in_order` (passed to them by reference: it stays at module level here), which calls
:func:`run_recipe_on_cpu` (Megatron-Bridge's ``finetune()`` with our step and a per-iteration recorder) once
per run. Docs: docs/megatron-bridge-on-cpu.md.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from megatron.bridge_thd.reporting import counting_step, iteration_recorder, step_for
from megatron.bridge_thd_testbed.training.checkpoints import prepare_cpu_run, pretrained_load_check
from megatron.bridge_thd_testbed.training.recipes_on_cpu import (
    RECIPE,
    cpu_run_config,
    is_qwen3_vl_moe_recipe,
    is_qwen35_recipe,
    recipe_config,
)
from megatron.bridge_thd_testbed.training.trainer_on_cpu import cpu_training

__all__ = ["run_recipe_on_cpu", "run_on_cpu"]

def run_recipe_on_cpu(recipe: str, paths: dict, layout: str, *, train_iters: int, global_batch_size: int = 8,
                      micro_batch_size: int = 2, seq_length: int = 512, tp: int = 1, pp: int = 1, cp: int = 1,
                      save_interval: int | None = None, exit_interval: int | None = None,
                      run_name: str | None = None, count_tokens: bool = True,
                      global_batch_packing: dict | None = None, per_token_loss: bool = False,
                      eval_iters=RECIPE, eval_interval=RECIPE, num_workers=RECIPE, checkpoint: bool | str = True,
                      max_lr=RECIPE, check_pretrained_load: bool = False, cp_per_sample: int | None = None,
                      model_settings: dict | None = None, moe_padding: bool = False, tensorboard: bool = False,
                      run_log: str | None = None) -> dict:
    """Run Megatron-Bridge's ``finetune()`` on this rank for a recipe in its CPU mode
    (:func:`cpu_run_config`), with ``layout``'s step (:func:`megatron.bridge_thd.reporting.step_for`; ours after
    ``configure(cfg, layout)``). Call on every rank of a world started with
    ``run_on_gloo(..., whole_bridge=True, initialize=False)`` inside ``hf_hub.offline_hub()``; a run
    whose checkpoint folder already holds a checkpoint resumes from it.

    ``global_batch_packing``: the keywords of a ``settings.GlobalBatchPacking`` to turn it on
    (``sizes_cache`` defaults to ``workdir/sizes``); its per-step log lines are recorded.
    ``per_token_loss``: ``model.calculate_per_token_loss`` (and ``ddp.average_in_collective=False``,
    which Megatron-Core's DDP requires with it), as global-batch packing sets them.
    ``cp_per_sample``: ``configure``'s ``cp_per_sample`` (tokens per rank: a CP size per sample on the DP x CP ranks).
    ``model_settings``: model config fields set after the CPU mode's (a test's MoE router settings, e.g.).
    ``moe_padding``: register ``moe_padding.padding_mask_pre_wrap_hook`` as docs/moe-padding-mask.md says (the
    routers leave padding out of their statistics).
    ``tensorboard``: a real TensorBoard writer (``logger.tensorboard_dir`` = ``workdir/tensorboard/<run_name>``,
    written by the last rank, as Megatron-Bridge does); with our step the ``packing/*`` figures go there too.
    ``run_log``: ``configure``'s ``run_log`` (a path global rank 0 appends one JSON line per iteration to).
    ``max_lr``: :func:`cpu_run_config`'s. ``check_pretrained_load``: run :func:`pretrained_load_check`
    (its result under ``"pretrained_load"``).

    Returns:
        ``{"iterations": [recorded rows], "micro_batches": [real / supervised token counts],
        "placements": [global-batch packing log lines, global rank 0], "evaluations": [validation and
        test losses], "pretrained_load": the conversion check or None}``.
    """
    from megatron.bridge.training.finetune import finetune

    from megatron.bridge_thd.configure import configure

    os.chdir(paths["workdir"])  # the recipe's cord_v2 preset resolves its hub path from here
    cfg = cpu_run_config(recipe_config(recipe), paths, train_iters=train_iters, global_batch_size=global_batch_size,
                         micro_batch_size=micro_batch_size, seq_length=seq_length, tp=tp, pp=pp, cp=cp,
                         save_interval=save_interval, exit_interval=exit_interval,
                         run_name=run_name or f"{recipe}-{layout}", eval_iters=eval_iters, eval_interval=eval_interval,
                         num_workers=num_workers, checkpoint=checkpoint, max_lr=max_lr)
    for name, value in (model_settings or {}).items():
        setattr(cfg.model, name, value)
    if tensorboard:
        cfg.logger.tensorboard_dir = os.path.join(paths["workdir"], "tensorboard", run_name or f"{recipe}-{layout}")
    if moe_padding:
        from megatron.bridge_thd.moe_padding.hook import padding_mask_pre_wrap_hook

        cfg.model.register_pre_wrap_hook(padding_mask_pre_wrap_hook)
    if per_token_loss or global_batch_packing is not None or cp_per_sample is not None:
        # The recipes set ddp.average_in_collective=True explicitly; configure refuses to overwrite an
        # explicit setting, so a user turning global-batch packing on sets it, as here.
        cfg.ddp.average_in_collective = False
    if per_token_loss:
        cfg.model.calculate_per_token_loss = True
    placement = None
    if global_batch_packing is not None:
        from megatron.bridge_thd.settings import GlobalBatchPacking

        placement = GlobalBatchPacking(**{"sizes_cache": os.path.join(paths["workdir"], "sizes"),
                                          **global_batch_packing})
    if cp_per_sample is not None and placement is None:
        from megatron.bridge_thd.settings import GlobalBatchPacking

        placement = GlobalBatchPacking(sizes_cache=os.path.join(paths["workdir"], "sizes"))
    if layout != "megatron_bridge":
        cfg = configure(cfg, layout=layout, global_batch_packing=placement, cp_per_sample=cp_per_sample, run_log=run_log)
    counts: list = []
    step = counting_step(step_for(layout), counts) if count_tokens else step_for(layout)

    recorder = iteration_recorder()
    callbacks = [recorder]
    if check_pretrained_load:
        callbacks.append(pretrained_load_check(cfg.checkpoint.pretrained_checkpoint))
    with cpu_training(), _log_lines("megatron.bridge_thd.batching") as placements:
        try:
            finetune(cfg, forward_step_func=step, callbacks=callbacks)
        except SystemExit as stop:
            # exit_interval: the trainer saves a checkpoint and calls sys.exit(0), as a job ends;
            # here the rank goes on, so it releases what the job's exit would have.
            if stop.code not in (0, None) or exit_interval is None:
                raise
            from megatron.bridge.training.initialize import destroy_global_state

            destroy_global_state()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return {"iterations": recorder.rows, "micro_batches": counts, "placements": placements,
            "evaluations": recorder.evaluations,
            "pretrained_load": callbacks[1].result if check_pretrained_load else None}


@contextlib.contextmanager
def _log_lines(name: str, level: int = logging.INFO):
    """The lines of ``level`` and above the ``name`` logger tree emits inside the block, as strings."""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, target = _Keep(level), logging.getLogger(name)
    saved = target.level
    target.addHandler(handler)
    target.setLevel(level)
    try:
        yield lines
    finally:
        target.removeHandler(handler)
        target.setLevel(saved)


def _run_in_order(paths: dict, runs: list, ports: list, start_method: str = "fork") -> dict:
    """One rank's side of :func:`run_on_cpu`: each ``(key, recipe, layout, settings)`` in turn, with
    the data loader workers started by ``start_method``, set here explicitly: the test bed's ranks come
    from a forkserver and would otherwise take whatever start method their parent process chose; a rank
    torchrun starts is a fresh interpreter whose workers Linux forks, the setting the recipes' loader
    workers meet in a real run. ``ports``: one rendezvous port per run (``standalone.free_ports``). Each run's
    result also holds ``"wall_seconds"``, its wall time on this rank (what a test's runs cost)."""
    import multiprocessing
    import time

    multiprocessing.set_start_method(start_method, force=True)
    results = {}
    for (key, recipe, layout, settings), port in zip(runs, ports, strict=True):
        # Each finetune() makes and destroys its own process group: a fresh rendezvous port, the same on every rank.
        os.environ["MASTER_PORT"] = str(port)
        start = time.perf_counter()
        results[key] = dict(run_recipe_on_cpu(recipe, paths, layout, **settings),
                            wall_seconds=time.perf_counter() - start)
    return results


def run_on_cpu(runs: list, *, workdir, world_size: int = 2, timeout: float = 600.0, paths: dict | None = None,
               start_method: str = "fork") -> list:
    """Run Megatron-Bridge recipes in their CPU mode, one after another, on ``world_size`` gloo ranks.

    Args:
        runs: ``(key, recipe function name, layout or "megatron_bridge", settings)``; settings are
            :func:`run_recipe_on_cpu`'s keywords (``train_iters``, ``micro_batch_size``, ``pp``, ...).
        workdir: where the dataset, processor, tiny checkpoint and checkpoints go.
        paths: what :func:`prepare_cpu_run` returned, if it was already called for ``workdir``.
        start_method: how each rank's data loader workers start (``"fork"``, as under torchrun on Linux).

    Returns:
        Per rank, ``{key: run_recipe_on_cpu(...)}``.
    """
    from megatron.bridge_thd_cpu.hf_hub import offline_hub
    from megatron.bridge_thd_testbed.launcher import run_on_gloo
    from megatron.bridge_thd_cpu.standalone import free_ports

    recipes = [run[1] for run in runs]
    paths = paths or prepare_cpu_run(
        workdir, qwen3_vl=any(not is_qwen35_recipe(r) and not is_qwen3_vl_moe_recipe(r) for r in recipes),
        qwen35=any(map(is_qwen35_recipe, recipes)), qwen3_vl_moe=any(map(is_qwen3_vl_moe_recipe, recipes)))
    with offline_hub():
        return run_on_gloo(_run_in_order, paths, runs, free_ports(len(runs)), start_method, dp=world_size,
                           whole_bridge=True, initialize=False, timeout=timeout)
