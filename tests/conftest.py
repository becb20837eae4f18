"""The areas' markers, and the fixtures shared by the tests on Megatron-Bridge's real model (CPU build).

Each test gets its area's marker from the folder it lives in (``unit``, ``model``, ``parallel``, ``bridge``);
``parallel`` and ``bridge`` are also ``slow``, as is any test marked so in its module. ``make test-fast``
runs ``-m "not slow"``; ``make test`` runs everything (tests/README.md).
"""

import pathlib
import sys

import pytest

from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups

AREAS = ("unit", "model", "parallel", "bridge")
SLOW_AREAS = ("parallel", "bridge")
_HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        area = pathlib.Path(str(item.fspath)).resolve().relative_to(_HERE).parts[0]
        if area not in AREAS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{{{','.join(AREAS)}}}/, "
                                    f"not in tests/{area} (tests/README.md says which)")
        item.add_marker(area)
        if area in SLOW_AREAS:
            item.add_marker("slow")


@pytest.fixture(autouse=True)
def fresh_moe_metrics_tracker():
    """Each test starts with no MoE metrics tracker, as a new run does: Megatron-Core's tracker
    (``transformer/moe/moe_logging.py``) is one per process and sizes each metric by the first model that logs it,
    so a model of another depth logging the same metric later in the same process would index past it. Nothing is
    imported for it: only a tracker already loaded is reset."""
    moe_logging = sys.modules.get("megatron.core.transformer.moe.moe_logging")
    if moe_logging is not None and hasattr(moe_logging, "destroy_moe_metrics_tracker"):
        moe_logging.destroy_moe_metrics_tracker()
    yield


@pytest.fixture(scope="module")
def real_model_stack():
    """World-size-1 gloo process groups, and every CPU patch for the module's tests."""
    init_single_process_groups()
    with cpu_stack():
        yield
