"""The ``finetune()`` worlds several modules of tests/bridge assert on, each run once per session when a test first
asks for it (the runs: tests/_bridge_worlds.py)."""

import pytest


@pytest.fixture(scope="session")
def training_world(tmp_path_factory):
    """2 ranks: test_training.py's runs (two of them also read by test_packing_logs.py), test_training_qwen35.py's."""
    pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")
    from _bridge_worlds import World, training_runs

    from megatron.bridge_thd_testbed.training import run_on_cpu

    workdir = tmp_path_factory.mktemp("cord_v2_run")
    return World(run_on_cpu(training_runs(workdir), workdir=workdir, world_size=2, timeout=900), workdir)


@pytest.fixture(scope="session")
def cp_per_sample_world(tmp_path_factory):
    """4 ranks: test_cp_per_sample_training.py's runs, two of them also read by test_packing_logs.py."""
    pytest.importorskip("omegaconf", reason="Megatron-Bridge's dependencies (the bridge-cpu extra) are not installed")
    from _bridge_worlds import World, cp_per_sample_runs

    from megatron.bridge_thd_testbed.training import run_on_cpu

    workdir = tmp_path_factory.mktemp("cp_per_sample_run")
    return World(run_on_cpu(cp_per_sample_runs(), workdir=workdir, world_size=4, timeout=900), workdir)
