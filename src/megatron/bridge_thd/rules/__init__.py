"""Every rule that refuses a combination of settings, in one registry (docs/rules.md).

``configure`` (before the model exists), ``bridge-thd plan`` (from its options), the step (when it builds its
:class:`~megatron.bridge_thd.step.plan.StepPlan`), the MoE padding hook (when it installs its routers) and the
global-batch loaders read the same :class:`Setup` record and run the rules registered for them
(:mod:`.registry`), so they cannot disagree. The modules, by job:

* :mod:`.setup`: the facts (:class:`Setup`, :class:`ModelFacts`), read once from the configuration;
* :mod:`.registry`: the registry (:func:`~.registry.rule`, :func:`~.registry.problems`, :func:`~.registry.refuse`);
* :mod:`.data`, :mod:`.graphs`, :mod:`.moe`, :mod:`.rows`, :mod:`.cp_per_sample`: the rules, by subject.
"""

from __future__ import annotations

# The rule modules register their rules on import, in this order (the order configure lists problems in).
from megatron.bridge_thd.rules import cp_per_sample, data, graphs, moe, rows  # noqa: F401
from megatron.bridge_thd.rules.graphs import variable_lengths_set_by_bridge
from megatron.bridge_thd.rules.moe import layout_dependent_moe_settings
from megatron.bridge_thd.rules.registry import (
    CONFIGURE, HOOK, LOADERS, PLACES, PLANNER, RULES, STEP, Rule, problems, refuse, rules_for,
)
from megatron.bridge_thd.rules.rows import DEFAULT_ROW_BUCKETS, one_row_shape, row_buckets
from megatron.bridge_thd.rules.setup import (
    ROUTES_REAL_TOKENS_ONLY, ModelFacts, Setup, bridge_packing_flag, cuda_graphs_enabled, effective_cuda_graph_impl,
    read_hook_setup, read_model_facts, read_setup, requested_layout, uses_hybridep, uses_seq_aux_loss,
)

__all__ = [
    "Setup", "ModelFacts", "read_setup", "read_model_facts", "read_hook_setup", "Rule", "RULES", "PLACES", "CONFIGURE", "PLANNER",
    "STEP", "HOOK", "LOADERS", "rules_for", "problems", "refuse", "configure_problems", "step_problems",
    "cuda_graphs_enabled", "effective_cuda_graph_impl", "uses_hybridep", "uses_seq_aux_loss",
    "layout_dependent_moe_settings", "requested_layout", "bridge_packing_flag", "one_row_shape", "row_buckets",
    "DEFAULT_ROW_BUCKETS", "ROUTES_REAL_TOKENS_ONLY", "variable_lengths_set_by_bridge",
]


def configure_problems(s: Setup) -> list[str]:
    """Every problem ``configure`` refuses ``s`` for (the rules registered for ``configure``)."""
    return problems(s, CONFIGURE)


def step_problems(s: Setup) -> list[str]:
    """Every problem the step refuses its plan's ``s`` for (the rules registered for the step)."""
    return problems(s, STEP)
