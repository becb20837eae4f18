"""One fresh process with Megatron-Bridge imported whole (``run_on_gloo(whole_bridge=True)``), shared
by ``test_package.py`` (what the import did) and ``test_recipes.py`` (the recipe
cases): importing the package costs ~12 s a process, so the suite pays it once for both."""

from __future__ import annotations

import functools

from megatron.bridge_thd_cpu.hf_hub import offline_hub
from megatron.bridge_thd_testbed.launcher import run_on_gloo


def _inspect_import():
    import sys

    from megatron.bridge_thd_cpu.bridge_package import StandInCalled, is_stand_in, stood_in_packages

    import megatron.bridge.models.qwen_vl.modelling_qwen3_vl.transformer_block as qwen3_vl_block
    import megatron.bridge.peft.lora_layers as lora_layers
    import megatron.bridge.training.comm_overlap as comm_overlap
    import megatron.bridge.training.finetune  # noqa: F401 - pretrain imports nvidia_resiliency_ext
    import megatron.core.extensions.transformer_engine as mcore_te
    import megatron.core.tensor_parallel.random as mcore_random

    holders = sorted(name for name, module in list(sys.modules.items())
                     if any(is_stand_in(value) for value in list(getattr(module, "__dict__", {}).values())))
    try:
        lora_layers.te.Linear(4, 4)
        called = "no error"
    except StandInCalled as error:
        called = str(error)
    try:
        import transformer_engine  # noqa: F401
        absent = False
    except ImportError:
        absent = True
    from megatron.bridge_thd_testbed.training import cpu_training_patches

    return {
        "training_patches": [(record.target, record.why, record.owner is sys.modules, record.name)
                             for record in cpu_training_patches()],
        "stood_in": stood_in_packages(),
        "holders": holders,
        "resident": sorted(n for n in sys.modules if n.split(".")[0] in ("transformer_engine", "nvidia_resiliency_ext")),
        "have_te": {"megatron.core.extensions.transformer_engine": mcore_te.HAVE_TE,
                    "megatron.bridge.training.comm_overlap": comm_overlap.HAVE_TE,
                    "modelling_qwen3_vl.transformer_block": qwen3_vl_block.HAVE_TE,
                    "megatron.core.tensor_parallel.random": getattr(mcore_random, "HAVE_TE", False)},
        "called": called,
        "absent_in_block": absent,
        "package_file": sys.modules["megatron.bridge"].__file__,
    }


def _worker():
    import test_recipes  # tests/bridge/test_recipes.py (its folder is on the path once pytest collected it)

    package = _inspect_import()  # first: before any recipe is built
    return {"package": package, "recipes": test_recipes.all_cases()}


@functools.lru_cache(maxsize=1)
def fresh_bridge_process() -> dict:
    """``{"package": ..., "recipes": ...}``, computed once per test session."""
    with offline_hub():
        [result] = run_on_gloo(_worker, whole_bridge=True, initialize=False, timeout=300)
    return result
