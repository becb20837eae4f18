"""Megatron-Bridge's timers around the step's phases, as its own step runs them; nothing outside its trainer."""

from __future__ import annotations

import contextlib

__all__ = ["timer", "straggler_timer"]


def timer(state, name: str):
    """``state.timers(name)`` started and stopped around the block, or nothing without ``state.timers``."""
    timers = getattr(state, "timers", None)
    if timers is None:
        return contextlib.nullcontext()
    started = timers(name, log_level=2)

    @contextlib.contextmanager
    def running():
        started.start()
        try:
            yield
        finally:
            started.stop()

    return running()


def straggler_timer(state, **kwargs):
    """Megatron-Bridge's ``state.straggler_timer`` (called with ``bdata=True`` for the data phase),
    or nothing outside its trainer."""
    found = getattr(state, "straggler_timer", None)
    if found is None:
        return contextlib.nullcontext()
    return found(**kwargs) if kwargs else found
