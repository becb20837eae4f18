"""``bridge-thd plan``: what THD packing buys before renting GPUs.

For a model preset (or a Hugging Face config.json), a per-sample length distribution and a
parallel layout, estimate per packing layout (``bshd``, ``thd``, ``thd_static``) the token slots,
attention work, trainer FLOPs (Megatron-Bridge's own formula), MoE routing, activation and
model-state memory per GPU, and the time model's step time (docs/time-model.md); and per layout the step time of the slowest
DP rank with Megatron-Bridge's in-batch placement and with global-batch packing (:mod:`.balance`,
docs/batching.md). Modules (import from them; this package exports nothing): :mod:`.samples`, :mod:`.layouts`,
:mod:`.memory`, :mod:`.peak_memory`, :mod:`.roofline`, :mod:`.step_model`, :mod:`.published`, :mod:`.fit`,
:mod:`.estimate`, :mod:`.balance`, :mod:`.answer`, :mod:`.report`, :mod:`.plot`,
:mod:`.calibrate`, :mod:`.plan_command` (``bridge-thd plan``), :mod:`.cli` (``bridge-thd``, its
commands), :mod:`.scan` (``bridge-thd scan``: a recipe's dataset as a lengths file); the model presets and the
FLOPs formula are the cost model's (:mod:`megatron.bridge_thd.cost.presets`, :mod:`megatron.bridge_thd.cost.flops`).
The planner stands on everything else (docs/architecture.md: floor 5); nothing of the runtime imports it.

API::

    from megatron.bridge_thd.cost.presets import get_preset
    from megatron.bridge_thd.plan.balance import balance_plan
    from megatron.bridge_thd.plan.estimate import PlanSettings, plan
    from megatron.bridge_thd.plan.layouts import Parallel
    from megatron.bridge_thd.plan.report import format_balance, format_plan
    from megatron.bridge_thd.plan.samples import receipt_lengths

    p = plan(get_preset("qwen3-vl-8b"), receipt_lengths(1024), PlanSettings(2048, 4, Parallel(tp=2)))
    print(format_plan(p)); p.speedup()
    b = balance_plan(get_preset("qwen3-vl-8b"), receipt_lengths(1024), PlanSettings(2048, 4, Parallel(tp=2)), 64)
    print(format_balance(b)); b.speedup("thd_static")
"""
