"""Running the rules: every rule module imported (so every rule is registered, in this order), then
:data:`RULES`, :func:`rules_for`, :func:`problems` and :func:`refuse` (docs/rules.md).

The places that judge a :class:`~megatron.bridge_thd.rules.setup.Setup` (``configure``, the planner, the step, the
MoE hook, the loaders) import what they run from here, so no place can run a partial registry.
"""

from __future__ import annotations

from types import MappingProxyType

# The rule modules register their rules on import.
from megatron.bridge_thd.rules import cp_per_sample, data, graphs, moe, rows
from megatron.bridge_thd.rules.registry import CONFIGURE, PLACES, REGISTERED, STEP, Rule
from megatron.bridge_thd.rules.setup import Setup

__all__ = ["RULES", "MODULE_ORDER", "rules_for", "problems", "refuse", "configure_problems", "step_problems"]

# The order configure lists problems in: by module in this order, then as each module defines its rules (whichever
# module was imported first elsewhere).
MODULE_ORDER = tuple(module.__name__ for module in (cp_per_sample, data, graphs, moe, rows))


def _in_order(registered: dict[str, Rule]) -> dict[str, Rule]:
    unknown = sorted({r.check.__module__ for r in registered.values()} - set(MODULE_ORDER))
    if unknown:
        raise ValueError(f"rule modules {unknown}: not in rules.run.MODULE_ORDER; add them there (and import them)")
    return dict(sorted(registered.items(), key=lambda item: MODULE_ORDER.index(item[1].check.__module__)))


# Every rule, by name, in the order above (read-only).
RULES = MappingProxyType(_in_order(REGISTERED))


def rules_for(place: str) -> tuple[Rule, ...]:
    """The rules run at ``place``, in registration order."""
    if place not in PLACES:
        raise ValueError(f"place: {place!r}; expected one of {PLACES}")
    return tuple(r for r in RULES.values() if place in r.places)


def problems(setup: Setup, place: str) -> list[str]:
    """Every problem the rules of ``place`` find in ``setup``."""
    return [problem for r in rules_for(place) for problem in r.check(setup)]


def refuse(setup: Setup, place: str, heading: str) -> None:
    """Raise one ``ValueError``, ``heading`` then each problem on its own line, when the rules of ``place`` find
    any in ``setup``."""
    found = problems(setup, place)
    if found:
        raise ValueError(f"{heading}:\n- " + "\n- ".join(found))


def configure_problems(s: Setup) -> list[str]:
    """Every problem ``configure`` refuses ``s`` for (the rules registered for ``configure``)."""
    return problems(s, CONFIGURE)


def step_problems(s: Setup) -> list[str]:
    """Every problem the step refuses its plan's ``s`` for (the rules registered for the step)."""
    return problems(s, STEP)
