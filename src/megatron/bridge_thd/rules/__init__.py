"""Every rule that refuses a combination of settings, in one registry (docs/rules.md).

``configure`` (before the model exists), ``bridge-thd plan`` (from its options), the step (when it builds its
:class:`~megatron.bridge_thd.step.plan.StepPlan`), the MoE padding hook (when it installs its routers) and the
global-batch loaders read the same :class:`~.setup.Setup` record and run the rules registered for them, so they
cannot disagree. The modules, by job (import from them; this package exports nothing):

* :mod:`.setup`: the facts (:class:`~.setup.Setup`, :class:`~.setup.ModelFacts`), read once from the configuration;
* :mod:`.registry`: how a rule module registers a rule (:func:`~.registry.rule`, the places);
* :mod:`.run`: every rule module imported, and what runs them (:data:`~.run.RULES`, :func:`~.run.problems`,
  :func:`~.run.refuse`);
* :mod:`.data`, :mod:`.graphs`, :mod:`.moe`, :mod:`.rows`, :mod:`.cp_per_sample`: the rules, by subject.
"""
