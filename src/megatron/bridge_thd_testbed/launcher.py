"""Run a function on N real processes over gloo with Megatron-Core's model-parallel groups.

Parallelism on the CPU is tested with real process groups: :func:`run_on_gloo` starts
``world_size`` processes, each initialises ``torch.distributed`` with the gloo backend and
Megatron-Core's ``parallel_state`` with the requested TP / CP / PP / EP sizes, calls ``fn(*args)``
inside :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`, and hands its return value back
(``torch.save`` through a temporary folder). Ranks that do not import Megatron-Bridge whole start
without NVIDIA ModelOpt (:func:`without_modelopt`). A rank that fails raises in the caller with its
traceback; a rank that hangs is killed after ``timeout`` seconds.

The ranks are forked by multiprocessing's forkserver, a fresh interpreter that imported torch and
Megatron-Core once (:mod:`~megatron.bridge_thd_testbed.forkserver_preload`): a spawned rank spent
5-10 s of a two-core machine on those imports, a 4-rank world about 20 s before its first line.
Each rank is a fresh process still: it takes the caller's current environment and import path,
imports the test's function, Megatron-Bridge and Megatron's training package itself, under its
patches, and creates its own process groups. The forkserver holds no
process group and starts no thread.

Before ``fn`` runs, a rank moves every object its imports made into the collector's permanent generation
(``gc.freeze()``, what Python's documentation advises for a process that forks): Megatron-Bridge's training loop
calls ``gc.collect()`` at the end of every ``train()``, and with Megatron-Bridge imported whole each call walked
~800,000 import-time objects that can never be garbage: a fifth of the CP-per-sample world's runs on two cores.
Objects made by ``fn`` are collected as before.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from megatron.bridge_thd.upstream.patches import Patch, applied
from megatron.bridge_thd_cpu.standalone import free_port

__all__ = ["run_on_gloo", "without_modelopt"]


def without_modelopt() -> Patch:
    """``sys.modules['modelopt']`` as missing, in a test-bed process that does not import Megatron-Bridge
    whole: Megatron's training package imports NVIDIA ModelOpt optionally (``megatron/training/
    checkpointing.py`` guards it with ``try / except ImportError``), and ModelOpt's plugins import
    transformers, diffusers and peft plugins, about 5 s of a rank's start-up that nothing in these
    processes uses."""
    return Patch(sys.modules, "modelopt", None,
                 "test-bed ranks without Megatron-Bridge whole: Megatron's optional ModelOpt import is skipped "
                 "(megatron.training.checkpointing guards it), ~5 s of imports per process nothing there uses")


def _context():
    """The forkserver, with :mod:`~megatron.bridge_thd_testbed.forkserver_preload` imported once for every world
    of this process."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["megatron.bridge_thd_testbed.forkserver_preload"])
    return context


def _worker(rank, world_size, port, sizes, payload, folder, whole_bridge, initialize, environment, path_entries,
            hybrid_cp=False):
    path = os.path.join(folder, f"rank{rank}.pt")
    try:
        # The caller's environment and import path as they are now (a forked rank would otherwise see the
        # forkserver's, taken when it started), as a spawned rank sees them.
        os.environ.clear()
        os.environ.update(environment)
        sys.path[:] = path_entries
        # torchrun's variables, for code that initialises the process group itself (Megatron-Bridge).
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(1)
        with contextlib.ExitStack() as stack:
            if not whole_bridge:
                stack.enter_context(applied([without_modelopt()]))
            # Unpickled here, not by multiprocessing: the function's module (and what it imports) loads
            # after the patch above.
            fn, args = pickle.loads(payload)
            if whole_bridge:
                from megatron.bridge_thd_cpu.bridge_package import bridge_package

                stack.enter_context(bridge_package())
                import megatron.bridge  # noqa: F401 - the whole package, before any bare load
            if initialize:
                torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
                from megatron.core import parallel_state

                parallel_state.initialize_model_parallel(
                    tensor_model_parallel_size=sizes["tp"],
                    pipeline_model_parallel_size=sizes["pp"],
                    context_parallel_size=sizes["cp"],
                    expert_model_parallel_size=sizes["ep"],
                    **({"hybrid_context_parallel": True} if hybrid_cp else {}),
                )
            from megatron.bridge_thd_cpu.stack import cpu_stack

            stack.enter_context(cpu_stack())
            gc.freeze()  # the imports' objects: never walked again by the loop's gc.collect() (module docstring)
            result = fn(*args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the caller with the traceback
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_on_gloo(fn, *args, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1,
                timeout: float = 300.0, whole_bridge: bool = False, initialize: bool = True,
                hybrid_cp: bool = False) -> list:
    """Call ``fn(*args)`` on ``tp * cp * pp * dp`` gloo processes and return every rank's result.

    Args:
        fn: a module-level function (it is pickled by reference); it runs after the process
            groups exist and inside ``cpu_stack()``.
        args: picklable arguments (tensors are fine).
        tp, cp, pp, ep, dp: Megatron-Core parallel sizes (expert parallelism is carved out of
            the data-parallel x context-parallel ranks, so ``ep`` must divide ``dp * cp``).
        timeout: seconds for the whole world (one deadline, not per process) before every
            process still alive is killed and an error is raised.
        whole_bridge: import Megatron-Bridge whole first, inside
            :func:`~megatron.bridge_thd_cpu.bridge_package.bridge_package` (kept for the call),
            for recipes, ``ConfigContainer`` and the training loop.
        initialize: create the gloo process group and Megatron-Core's groups; False leaves that to
            ``fn`` (Megatron-Bridge's own ``initialize_megatron``), with torchrun's ``RANK`` /
            ``WORLD_SIZE`` / ``MASTER_*`` / ``LOCAL_RANK`` set.
        hybrid_cp: build Megatron-Core's hybrid context-parallel groups too
            (``initialize_model_parallel(hybrid_context_parallel=True)``: aligned groups of 2, 4, ... DP x CP ranks).

    Returns:
        ``[result of rank 0, result of rank 1, ...]`` (global ranks).

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or did not finish in time.
    """
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp), ("ep", ep), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    if (dp * cp) % ep:
        raise ValueError(f"ep: {ep} must divide dp * cp = {dp * cp} (Megatron-Core carves expert parallelism out of them)")
    world_size = tp * cp * pp * dp
    sizes = dict(tp=tp, cp=cp, pp=pp, ep=ep)
    context = _context()
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory(prefix="bridge_thd_gloo_") as folder:
        port = free_port()
        processes = [
            context.Process(target=_worker, daemon=False,
                            args=(rank, world_size, port, sizes, payload, folder, whole_bridge, initialize,
                                  dict(os.environ), list(sys.path), hybrid_cp))
            for rank in range(world_size)
        ]
        # One deadline for the whole world, its start included: a hang anywhere (a stage waiting on a
        # peer's p2p, a collective a rank never joins) becomes a failure after `timeout` seconds, never
        # a stuck suite.
        deadline = time.monotonic() + timeout
        for process in processes:
            process.start()
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results, errors = [], []
        for rank in range(world_size):
            path = os.path.join(folder, f"rank{rank}.pt")
            if not os.path.exists(path):
                errors.append(f"rank {rank}: " + ("did not finish within timeout" if rank in hung else "exited without a result"))
                continue
            report = torch.load(path, weights_only=False)
            if report["ok"]:
                results.append(report["result"])
            else:
                errors.append(f"rank {rank}:\n{report['error']}")
        if errors:
            raise RuntimeError(f"run_on_gloo({getattr(fn, '__name__', fn)}, tp={tp}, cp={cp}, pp={pp}, ep={ep}, dp={dp}): " + "\n".join(errors))
        return results
