"""The registry of rules: each rule once, tagged with the places that run it (docs/rules.md).

A rule is a function of a :class:`~megatron.bridge_thd.rules.setup.Setup` that returns the problems it finds as
messages (the setting, what is wrong, what to set); it never raises and never writes. :func:`rule` registers one
with its places, in :data:`REGISTERED`, as the rule modules are imported. This module is the rule modules' side:
what runs the rules (:data:`~megatron.bridge_thd.rules.run.RULES`, :func:`~megatron.bridge_thd.rules.run.problems`,
:func:`~megatron.bridge_thd.rules.run.refuse`) is :mod:`megatron.bridge_thd.rules.run`, which imports every rule
module first. The places:

* ``configure``: before the model exists, from the config alone;
* ``planner``: ``bridge-thd plan``, from its options;
* ``step``: when the step builds its plan, from the config, the built model and the process groups;
* ``hook``: when the MoE padding hook installs its routers, from the model config;
* ``loaders``: when global-batch packing builds the loaders.

``configure`` runs every rule a later place runs that its facts can decide, so what it accepts the step and the
hook accept (``tests/unit/test_rules.py`` checks the tags and the messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron.bridge_thd.rules.setup import Setup

__all__ = ["Rule", "rule", "REGISTERED", "PLACES", "CONFIGURE", "PLANNER", "STEP", "HOOK", "LOADERS"]

CONFIGURE, PLANNER, STEP, HOOK, LOADERS = "configure", "planner", "step", "hook", "loaders"
PLACES = (CONFIGURE, PLANNER, STEP, HOOK, LOADERS)


@dataclass(frozen=True)
class Rule:
    """One rule: its name, the places that run it and the check.

    Attributes:
        name: the function's name without a leading underscore (docs/rules.md lists them).
        places: where it runs (:data:`PLACES`).
        check: ``Setup -> list[str]``, the problems found (empty: none).
    """

    name: str
    places: frozenset[str]
    check: Callable[[Setup], list[str]]

    @property
    def summary(self) -> str:
        """The first paragraph of the check's docstring, on one line."""
        return " ".join((self.check.__doc__ or "").strip().split("\n\n")[0].split())


# Every rule registered so far, by name, in registration order (the order configure's error lists problems in).
# Complete once every rule module is imported: read it as rules.run.RULES, which imports them.
REGISTERED: dict[str, Rule] = {}


def rule(*places: str) -> Callable[[Callable[[Setup], list[str]]], Callable[[Setup], list[str]]]:
    """Register the decorated check as a :class:`Rule` run at ``places``."""
    unknown = set(places) - set(PLACES)
    if not places or unknown:
        raise ValueError(f"places: {sorted(unknown) or 'none'}; expected some of {PLACES}")

    def register(check: Callable[[Setup], list[str]]) -> Callable[[Setup], list[str]]:
        name = check.__name__.lstrip("_")
        if name in REGISTERED:
            raise ValueError(f"rule {name!r}: registered twice")
        REGISTERED[name] = Rule(name, frozenset(places), check)
        return check

    return register

