"""Count the functions, modules and module changes one micro-batch passes through (``sys.setprofile``).

:func:`trace_calls` records, in call order, every call of a Python function whose code lives under one
folder (by default ``src/megatron/bridge_thd/``, the runtime) and :class:`CallPath` reduces the record to
four figures. :func:`step_call_paths` runs one micro-batch of Megatron-Bridge's real Qwen3-VL (CPU build)
through our ``forward_step`` up to ``model(**args)``, per layout; ``scripts/readme_figures.py`` renders it
(block ``step-path``, docs/step-plan.md).

What is one recorded call: a ``"call"`` event of the profiler (a Python frame starting) whose code object's
file is under the root. Not recorded: C functions (``"c_call"``); a generator resumed (a contextmanager's
exit, a ``next``): only its first start is a call; the code objects Python names in angle brackets
(``<genexpr>``, ``<listcomp>``, ``<module>``, ...), which are part of the function that holds them, with
the one exception of ``<lambda>``, a function. Code outside the root (torch, Megatron, ``functools``, a
dataclass's generated ``__init__``) is not recorded, but a call made through it still counts: its caller is
the innermost recorded function on the stack.

Never imported by the runtime (``megatron.bridge_thd``).
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

__all__ = ["Call", "CallPath", "RUNTIME_ROOT", "trace_calls", "step_call_paths", "STEP_PATH_LAYOUTS"]

# src/megatron/bridge_thd/: the runtime package, the code whose calls are counted by default.
RUNTIME_ROOT = Path(__file__).resolve().parents[1] / "bridge_thd"

_GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


@dataclass(frozen=True)
class Call:
    """One recorded call.

    Attributes:
        caller: module (``__name__``) of the innermost recorded function on the stack when the call was made;
            None for a call from outside the root (the entry point, or a callback whose stack holds no recorded
            function).
        module: module (``__name__``) of the function called.
        function: its qualified name (``to_device.<locals>.move``).
        line: the line its ``def`` starts on (two functions of one qualified name stay two).
    """

    caller: str | None
    module: str
    function: str
    line: int


@dataclass(frozen=True)
class CallPath:
    """The calls recorded, in call order, and the figures they give."""

    calls: tuple[Call, ...]

    @property
    def functions(self) -> int:
        """Distinct functions called: distinct ``(module, qualified name, line)``, however often each is called."""
        return len({(c.module, c.function, c.line) for c in self.calls})

    @property
    def modules(self) -> int:
        """Distinct modules those functions live in."""
        return len({c.module for c in self.calls})

    @property
    def module_changes(self) -> int:
        """Module changes in call order: consecutive recorded calls (the i-th and the (i+1)-th, whoever made
        them) whose functions live in different modules. A -> B -> back in A by a return, then a call in A,
        counts 1 (A to B), not 2: a return is no call."""
        return sum(a.module != b.module for a, b in zip(self.calls, self.calls[1:]))

    @property
    def cross_module_calls(self) -> int:
        """Calls whose caller (the innermost recorded function on the stack) lives in another module than the
        function called; a call from outside the root (``caller`` None) is none."""
        return sum(c.caller is not None and c.caller != c.module for c in self.calls)

    def figures(self) -> dict[str, int]:
        return {"functions": self.functions, "modules": self.modules, "module_changes": self.module_changes,
                "cross_module_calls": self.cross_module_calls}

    def module_names(self) -> list[str]:
        """The modules, in the order they are first entered."""
        return list(dict.fromkeys(c.module for c in self.calls))


class _Recorder:
    def __init__(self, root: Path):
        self.root = str(Path(root).resolve()) + "/"
        self.calls: list[Call] = []
        self.started: set[int] = set()  # id() of generator frames started (kept alive below, so ids stay unique)
        self.alive: list = []
        self.inside: dict[str, bool] = {}  # co_filename -> under the root
        self.on = True

    def _ours(self, code) -> bool:
        inside = self.inside.get(code.co_filename)
        if inside is None:
            path = code.co_filename
            inside = self.inside[path] = (not path.startswith("<")) and str(Path(path).resolve()).startswith(self.root)
        return inside

    def _counted(self, code) -> bool:
        return self._ours(code) and (not code.co_name.startswith("<") or code.co_name == "<lambda>")

    def __call__(self, frame, event, arg):
        if not self.on or event != "call":
            return
        code = frame.f_code
        if not self._counted(code):
            return
        if code.co_flags & _GENERATOR_FLAGS:
            if id(frame) in self.started:
                return  # a resumption, not a call
            self.started.add(id(frame))
            self.alive.append(frame)
        caller = None
        outer = frame.f_back
        while outer is not None:
            if self._counted(outer.f_code):
                caller = outer.f_globals.get("__name__")
                break
            outer = outer.f_back
        self.calls.append(Call(caller, frame.f_globals.get("__name__", "?"), code.co_qualname, code.co_firstlineno))


@contextmanager
def trace_calls(root: Path | str = RUNTIME_ROOT) -> Iterator["_Tracing"]:
    """Record the calls of functions under ``root`` made inside the block; ``tracing.path()`` is the
    :class:`CallPath` so far, ``tracing.stop()`` ends the record early (e.g. where the model is called).
    Replaces any profiler set before and restores it after."""
    recorder = _Recorder(Path(root))
    previous = sys.getprofile()
    sys.setprofile(recorder)
    tracing = _Tracing(recorder)
    try:
        yield tracing
    finally:
        sys.setprofile(previous)
        recorder.on = False
        recorder.alive.clear()


class _Tracing:
    def __init__(self, recorder: _Recorder):
        self._recorder = recorder

    def stop(self) -> None:
        self._recorder.on = False

    def path(self) -> CallPath:
        return CallPath(tuple(self._recorder.calls))


# --------------------------------------------------------------------------------------------
# One micro-batch of the step
# --------------------------------------------------------------------------------------------

STEP_PATH_LAYOUTS = ("thd", "thd_static", "bshd")
STEP_PATH_SEQ_LENGTH = 2048
STEP_PATH_BATCH = 3


class _ModelReached(Exception):
    pass


def step_call_paths(layouts=STEP_PATH_LAYOUTS, *, batch_on_host: bool = True, seq_length: int = STEP_PATH_SEQ_LENGTH,
                    batch_size: int = STEP_PATH_BATCH) -> dict[str, CallPath]:
    """Per layout, the calls one micro-batch makes in our runtime through ``qwen3_vl_step.forward_step``, from its
    entry to ``model(**args)`` (the model's ``forward`` is replaced by a function that ends the record and
    raises, so the model never runs).

    The micro-batch recorded is the run's second: the first builds the run's plan (kept on ``state``) and fills
    the step's one-off caches, so the second is what every later micro-batch runs, the same in any process
    whatever ran before. Megatron-Bridge's real tiny Qwen3-VL (CPU build), one process, ``minimal_state`` with
    ``packing_layout``, receipt batches with images (:func:`~megatron.bridge_thd_cpu.data.synthetic_receipt_batch`,
    right-padded, within ``seq_length``). ``batch_on_host``: the model's parameters on ``meta`` (a GPU's stand-in)
    and the batch on the host, the path of Megatron-Bridge's loader; else the model on the CPU with the batch (a
    batch already on the model's device, VERL's). Megatron-Bridge's FLOPs helpers read their sums on the host
    (impossible on ``meta``) and call none of our code: stand-ins with their signatures replace them, in both
    (:data:`_FLOP_STAND_INS`).
    """
    import logging

    from megatron.bridge_thd.qwen3_vl_step import forward_step
    from megatron.bridge_thd.upstream.loading import load_flop_utils
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups, minimal_state

    logger = logging.getLogger("megatron.bridge_thd")
    level = logger.level
    logger.setLevel(logging.ERROR)
    flop_utils = load_flop_utils()
    originals = {name: getattr(flop_utils, name) for name in _FLOP_STAND_INS if hasattr(flop_utils, name)}
    paths = {}
    try:
        for name, original in originals.items():
            setattr(flop_utils, name, _FLOP_STAND_INS[name](original))
        pg = init_single_process_groups()
        with cpu_stack():
            model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=seq_length), seed=0)
            if batch_on_host:
                model = model.to("meta")
            model.pg_collection = pg
            for layout in layouts:
                state = minimal_state(seq_length=seq_length, micro_batch_size=batch_size, packing_layout=layout)
                for seed in (1, 2):
                    batch = synthetic_receipt_batch(batch_size, seed=seed)
                    with trace_calls() as tracing:
                        def reached(*args, **kwargs):
                            tracing.stop()
                            raise _ModelReached

                        model.forward = reached
                        try:
                            forward_step(state, iter([batch]), model)
                        except _ModelReached:
                            pass
                        else:
                            raise RuntimeError("forward_step returned without calling the model")
                        finally:
                            del model.forward
                paths[layout] = tracing.path()
    finally:
        for name, original in originals.items():
            setattr(flop_utils, name, original)
        logger.setLevel(level)
    return paths


def _stand_in(original, returns):
    def stand_in(*args, **kwargs):
        return returns

    stand_in.__signature__ = inspect.signature(original)  # the step inspects the accumulator's parameters once
    stand_in.__name__ = stand_in.__qualname__ = original.__name__
    return stand_in


# Megatron-Bridge's FLOPs helpers the step calls, which read their sums on the host (impossible on ``meta``) and call
# none of our code: stand-ins with their signatures (``vision_patch_stats_from_grid_thw``: the 0.7 line's).
_FLOP_STAND_INS = {
    "accumulate_flops_metadata": lambda original: _stand_in(original, None),
    "vision_patch_stats_from_grid_thw": lambda original: _stand_in(original, (0, 0, 0)),
}
