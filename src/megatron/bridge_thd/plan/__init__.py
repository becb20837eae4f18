"""``bridge-thd plan``: what THD packing buys before renting GPUs.

For a model preset (or a Hugging Face config.json), a per-sample length distribution and a
parallel layout, estimate per packing layout (``bshd``, ``thd``, ``thd_static``) the token slots,
attention work, trainer FLOPs (Megatron-Bridge's own formula), MoE routing, activation and
model-state memory per GPU, and the time model's step time (docs/time-model.md); and per layout the step time of the slowest
DP rank with Megatron-Bridge's in-batch placement and with global-batch packing (:mod:`.balance`,
docs/batching.md). Modules: :mod:`.presets`, :mod:`.samples`, :mod:`.layouts`, :mod:`.flops`,
:mod:`.memory`, :mod:`.peak_memory`, :mod:`.roofline`, :mod:`.step_model`, :mod:`.published`, :mod:`.fit`,
:mod:`.estimate`, :mod:`.balance`, :mod:`.answer`, :mod:`.report`, :mod:`.plot`,
:mod:`.calibrate`, :mod:`.plan_command` (``bridge-thd plan``), :mod:`.cli` (``bridge-thd``, its
commands), :mod:`.scan` (``bridge-thd scan``: a recipe's dataset as a lengths file).

API::

    from megatron.bridge_thd.plan import PlanSettings, Parallel, get_preset, receipt_lengths, plan, format_plan
    p = plan(get_preset("qwen3-vl-8b"), receipt_lengths(1024), PlanSettings(2048, 4, Parallel(tp=2)))
    print(format_plan(p)); p.speedup()
    b = balance_plan(get_preset("qwen3-vl-8b"), receipt_lengths(1024), PlanSettings(2048, 4, Parallel(tp=2)), 64)
    print(format_balance(b)); b.speedup("thd_static")
"""

import warnings

with warnings.catch_warnings():  # megatron.core's import-time notices (no TE / Apex on CPU)
    warnings.simplefilter("ignore")
    from megatron.bridge_thd.plan.balance import BalancePlan, balance_plan
    from megatron.bridge_thd.plan.estimate import Plan, PlanSettings, plan
    from megatron.bridge_thd.plan.layouts import LAYOUT_ORDER, Parallel
    from megatron.bridge_thd.cost.presets import PRESETS, ModelSpec, get_preset, spec_from_hf_config
    from megatron.bridge_thd.plan.report import format_balance, format_plan
    from megatron.bridge_thd.cost.sample_lengths import SampleLengths, load_lengths
    from megatron.bridge_thd.plan.samples import receipt_lengths

__all__ = ["Plan", "PlanSettings", "plan", "LAYOUT_ORDER", "Parallel", "SampleLengths", "load_lengths", "receipt_lengths",
           "PRESETS", "ModelSpec", "get_preset", "spec_from_hf_config", "format_plan", "BalancePlan", "balance_plan",
           "format_balance"]


