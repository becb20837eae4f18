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

A rank that needs Megatron-Bridge whole (``whole_bridge=True``: recipes, ``ConfigContainer``, ``finetune()``) is forked
instead from a *bridge zygote*: one process, forked from that forkserver, that took the caller's environment and
import path, imported Megatron-Bridge whole inside
:func:`~megatron.bridge_thd_cpu.bridge_package.bridge_package` (held for its life) and then only forks worlds. The
import is ~7 CPU seconds a process; every whole-bridge world of a session paid it once per rank, and now pays it once
per zygote. A zygote is kept for each import environment (the caller's environment less pytest's per-test variable,
and its import path: what the imports may read, Hugging Face's hub settings among them); a world whose environment
differs gets a zygote of its own, started then (two are kept, the suite meets two; the oldest is stopped for a
third). Each rank is still a fresh process that has imported Megatron-Bridge
and nothing else: it takes the caller's current environment, creates its own process groups and runs ``fn``. The
zygote starts its world's ranks with the ``fork`` method, keeps the world's one deadline and kills what hangs, as the
caller does for the other ranks; it is stopped when the caller's interpreter exits.

Before ``fn`` runs, a rank moves every object its imports made into the collector's permanent generation
(``gc.freeze()``, what Python's documentation advises for a process that forks): Megatron-Bridge's training loop
calls ``gc.collect()`` at the end of every ``train()``, and with Megatron-Bridge imported whole each call walked
~800,000 import-time objects that can never be garbage: a fifth of the CP-per-sample world's runs on two cores.
Objects made by ``fn`` are collected as before.
"""

from __future__ import annotations

import atexit
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

__all__ = ["run_on_gloo", "without_modelopt", "import_environment"]


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
            if not whole_bridge:  # a whole-bridge rank's zygote imported Megatron-Bridge whole already
                stack.enter_context(applied([without_modelopt()]))
            # Unpickled here, not by multiprocessing: the function's module (and what it imports) loads
            # after the patch above.
            fn, args = pickle.loads(payload)
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


# pytest's variable naming the running test: set anew for each test, read by no import.
_PER_TEST_VARIABLES = frozenset({"PYTEST_CURRENT_TEST"})
# Seconds a zygote may take to import Megatron-Bridge whole, and beyond a world's deadline to report it.
_ZYGOTE_START_TIMEOUT, _ZYGOTE_GRACE = 600.0, 60.0


def _run_world(context, ranks: list, timeout: float) -> list[int]:
    """Start one process per rank (``_worker(*rank_args)``), join them all by one deadline ``timeout`` seconds from
    now, kill any still alive; the ranks that were."""
    processes = [context.Process(target=_worker, args=rank_args, daemon=False) for rank_args in ranks]
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
    return hung


def import_environment() -> tuple:
    """What the imports of a process started now may read: the caller's environment, less pytest's per-test
    variable, and its import path. Two worlds with the same share a bridge zygote."""
    variables = tuple(sorted((name, value) for name, value in os.environ.items() if name not in _PER_TEST_VARIABLES))
    return variables, tuple(sys.path)


def _zygote_main(connection, environment: dict, path_entries: list) -> None:
    """The bridge zygote: import Megatron-Bridge whole under the given environment, then run each world it is sent
    (``(ranks, timeout)``; ``None`` stops it), answering ``("hung", [ranks])``."""
    try:
        os.environ.clear()
        os.environ.update(environment)
        sys.path[:] = path_entries
        from megatron.bridge_thd_cpu.bridge_package import bridge_package
        from megatron.bridge_thd_testbed.forkserver_preload import device_count_without_the_runtime

        stand_ins = contextlib.ExitStack()  # held for the zygote's life (this frame's): its ranks run inside it
        stand_ins.enter_context(bridge_package())
        with device_count_without_the_runtime():  # no "bad fork" for the ranks (forkserver_preload's docstring)
            import megatron.bridge  # noqa: F401 - the whole package, before any bare load
        gc.freeze()  # shared, never walked by a rank's collector (module docstring)
    except BaseException:  # noqa: BLE001 - reported to the caller with the traceback
        connection.send(("failed", traceback.format_exc()))
        return
    connection.send(("ready", None))
    fork = mp.get_context("fork")
    while (request := connection.recv()) is not None:
        ranks, timeout = request
        connection.send(("hung", _run_world(fork, ranks, timeout)))


class _BridgeZygote:
    """The caller's handle on one bridge zygote (:func:`_zygote_main`)."""

    def __init__(self, key: tuple):
        self.key = key
        self.connection, theirs = mp.Pipe()
        self.process = _context().Process(target=_zygote_main, args=(theirs, dict(os.environ), list(sys.path)),
                                          daemon=False)  # a daemonic process may not start the ranks
        self.process.start()
        theirs.close()
        kind, detail = self._answer(_ZYGOTE_START_TIMEOUT, "import Megatron-Bridge whole")
        if kind != "ready":
            self.stop()
            raise RuntimeError(f"the bridge zygote could not import Megatron-Bridge whole:\n{detail}")

    def _answer(self, seconds: float, doing: str):
        if not self.connection.poll(seconds):
            self.stop()
            raise RuntimeError(f"the bridge zygote did not {doing} within {seconds:.0f} s")
        try:
            return self.connection.recv()
        except EOFError:
            self.stop()
            raise RuntimeError(f"the bridge zygote exited while it was to {doing}") from None

    def run_world(self, ranks: list, timeout: float) -> list[int]:
        """The ranks forked from the zygote, run to the world's one deadline; the ranks that hung (killed)."""
        self.connection.send((ranks, timeout))
        _, hung = self._answer(timeout + _ZYGOTE_GRACE, "run its world")
        return hung

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.connection.send(None)
            self.process.join(10.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        if _ZYGOTES.get(self.key) is self:
            del _ZYGOTES[self.key]


# One zygote per import environment (the suite meets two: the offline hub's and the plain one), oldest stopped first.
_ZYGOTES: dict = {}
_MAX_ZYGOTES = 2


def _bridge_zygote() -> _BridgeZygote:
    """The live zygote for the caller's import environment, started if there is none."""
    key = import_environment()
    zygote = _ZYGOTES.get(key)
    if zygote is not None and zygote.process.is_alive():
        return zygote
    if zygote is not None:
        zygote.stop()
    while len(_ZYGOTES) >= _MAX_ZYGOTES:
        next(iter(_ZYGOTES.values())).stop()
    _ZYGOTES[key] = zygote = _BridgeZygote(key)
    return zygote


@atexit.register
def _stop_zygotes() -> None:
    for zygote in list(_ZYGOTES.values()):
        zygote.stop()


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
        whole_bridge: ranks with Megatron-Bridge imported whole, inside
            :func:`~megatron.bridge_thd_cpu.bridge_package.bridge_package` (kept for the call), for recipes,
            ``ConfigContainer`` and the training loop: forked from the bridge zygote of the caller's import
            environment (module docstring), started for the first such world.
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
    payload = pickle.dumps((fn, args))
    with tempfile.TemporaryDirectory(prefix="bridge_thd_gloo_") as folder:
        port = free_port()
        ranks = [(rank, world_size, port, sizes, payload, folder, whole_bridge, initialize, dict(os.environ),
                  list(sys.path), hybrid_cp) for rank in range(world_size)]
        # One deadline for the whole world, its start included: a hang anywhere (a stage waiting on a
        # peer's p2p, a collective a rank never joins) becomes a failure after `timeout` seconds, never
        # a stuck suite.
        hung = _bridge_zygote().run_world(ranks, timeout) if whole_bridge else _run_world(_context(), ranks, timeout)
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
