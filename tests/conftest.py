"""Fixtures shared by the tests on Megatron-Bridge's real model (CPU build)."""

import pytest

from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups


@pytest.fixture(scope="module")
def real_model_stack():
    """World-size-1 gloo process groups, and every CPU patch for the module's tests."""
    init_single_process_groups()
    with cpu_stack():
        yield
