"""Argument checks shared by the package: one rule, one message.

An integer argument is an ``int`` (never a ``bool``, which Python counts as one: ``True`` would
pass as 1) no smaller than its minimum. The message names the argument, says what was expected and
what came, then, where the caller gives one, what to set::

    align_to: expected an int >= 1, got 0; use required_alignment(tp, cp, ...)
"""

from __future__ import annotations

__all__ = ["is_int_at_least", "check_int"]


def is_int_at_least(value, minimum: int) -> bool:
    """True when ``value`` is an ``int`` (not a ``bool``) and ``>= minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_int(name: str, value, minimum: int = 1, hint: str = "") -> int:
    """``value`` when it is an ``int`` (not a ``bool``) ``>= minimum``.

    Args:
        name: how the user knows the argument (``"align_to"``, ``"--row-buckets"``,
            ``"config.json: field 'hidden_size'"``).
        value: what was passed.
        minimum: the smallest accepted value.
        hint: what to set, appended after ``"; "`` (empty: nothing appended).

    Raises:
        ValueError: ``"{name}: expected an int >= {minimum}, got {value!r}[; {hint}]"``.
    """
    if not is_int_at_least(value, minimum):
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}" + (f"; {hint}" if hint else ""))
    return value
