"""The gloo launcher turns a hang into a failure: a world that never finishes (here its rank 0 would
wait forever on a peer that never answers, what a pipeline stage does when its neighbour crashed on
NCCL) is killed at one deadline for the whole world and reported, instead of leaving the suite stuck.
Its ranks are forked from a forkserver that imported the heavy packages once; each still sees what a
spawned rank would: the caller's current environment, and CUDA as absent, not as a "bad fork"."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from megatron.bridge_thd_testbed.launcher import run_on_gloo

# The deadline counts from before the processes' start (the forkserver's own start, its imports, is
# inside it the first time), so with a short deadline the ranks may be killed before rank 0 reaches its
# recv; as fn can never return, the world cannot finish either way and the launcher must report it at
# the deadline. 6 s: well above the parent's own work around the deadline (starting and killing two
# processes, well under a second even on a loaded machine), so that "at least TIMEOUT" and "less than
# 2 x TIMEOUT" (one deadline per process would be 2 x TIMEOUT) are told apart with margin.
TIMEOUT = 6.0


def wait_for_a_message_from_rank_1():
    """Rank 0 waits for rank 1, which never sends: a p2p hang."""
    if torch.distributed.get_rank() == 0:
        torch.distributed.recv(torch.zeros(1), src=1)
    else:
        time.sleep(3600)
    return torch.distributed.get_rank()


@pytest.mark.parametrize("whole_bridge", [False, True], ids=["forkserver", "bridge-zygote"])
def test_a_hanging_world_fails_at_the_deadline(whole_bridge):
    if whole_bridge:
        run_on_gloo(rank_and_zygote, whole_bridge=True, initialize=False)  # the zygote's start is not the world's
    running_before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within timeout") as info:
        run_on_gloo(wait_for_a_message_from_rank_1, cp=2, timeout=TIMEOUT, whole_bridge=whole_bridge)
    elapsed = time.monotonic() - start
    # Every rank of the world is reported as hung, and killed: none is left running (a zygote's ranks are its
    # children, and it answers the next world).
    assert str(info.value).count("did not finish within timeout") == 2
    assert set(multiprocessing.active_children()) <= running_before
    if whole_bridge:
        assert run_on_gloo(rank_and_zygote, whole_bridge=True, initialize=False)[0]["rank"] == 0
    # It waited for the deadline, and only one deadline for the world, not one per process.
    assert TIMEOUT <= elapsed < 2 * TIMEOUT


def cuda_as_a_rank_sees_it():
    import os

    try:
        torch.cuda.init()
        error = None
    except RuntimeError as raised:
        error = str(raised)
    import huggingface_hub.constants

    return {"bad_fork": torch._C._cuda_isInBadFork(), "error": error,
            "variable": os.environ.get("BRIDGE_THD_LAUNCHER_PROBE"), "hub_cache": huggingface_hub.constants.HF_HUB_CACHE}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a rank meets on a machine without CUDA")
def test_a_rank_sees_the_callers_environment_and_no_bad_fork(monkeypatch, tmp_path):
    monkeypatch.setenv("BRIDGE_THD_LAUNCHER_PROBE", "set after the forkserver started")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "first"))
    run_on_gloo(cuda_as_a_rank_sees_it, dp=1)  # the forkserver is running (its environment has no probe)
    monkeypatch.setenv("BRIDGE_THD_LAUNCHER_PROBE", "set later still")
    # Hugging Face's hub fixes its cache folder when it is imported (what bridge_thd_cpu.hf_hub.offline_hub sets):
    # a rank imports it after taking the caller's environment, never inherits it from the forkserver.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "second"))
    for rank in run_on_gloo(cuda_as_a_rank_sees_it, dp=2):
        assert rank["variable"] == "set later still"
        assert rank["hub_cache"] == str(tmp_path / "second")
        # A spawned rank's error; a fork of a process that had asked the CUDA runtime would say
        # "Cannot re-initialize CUDA in forked subprocess" instead.
        assert not rank["bad_fork"]
        assert rank["error"] is not None and "forked subprocess" not in rank["error"]


def test_rendezvous_ports_are_outside_the_range_outgoing_connections_take():
    """A world's rendezvous ports are chosen before its runs and used minutes later: a port in the kernel's
    ephemeral range could by then be the local end of one of gloo's own connections (a CI run's sixth
    finetune() met EADDRINUSE). The ports are below that range, distinct, and free when chosen."""
    import socket

    from megatron.bridge_thd_cpu.standalone import free_ports

    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        ephemeral_start = int(handle.read().split()[0])
    ports = free_ports(40)
    assert len(set(ports)) == 40
    assert all(port < ephemeral_start for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def rank_and_zygote():
    import os
    import sys

    import huggingface_hub.constants

    return {"rank": int(os.environ["RANK"]), "parent": os.getppid(), "pid": os.getpid(),
            # Megatron-Bridge's __init__ ran before the rank's first line: its models are registered.
            "whole": "megatron.bridge.diffusion.models" in sys.modules and hasattr(sys.modules["megatron.bridge"],
                                                                                   "AutoBridge"),
            "per_test": os.environ.get("PYTEST_CURRENT_TEST"), "hub_cache": huggingface_hub.constants.HF_HUB_CACHE,
            "bad_fork": torch._C._cuda_isInBadFork()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a rank meets on a machine without CUDA")
def test_whole_bridge_worlds_of_one_environment_are_forked_from_one_zygote(monkeypatch):
    """Two whole-bridge worlds whose import environment is the same are forked from one process that imported
    Megatron-Bridge whole (not the caller): each rank is a fresh process with the package, no "bad fork", Hugging
    Face's hub settings as the caller has them, and the caller's current environment, here a per-test variable
    changed after the zygote started."""
    import os

    from megatron.bridge_thd_testbed.launcher import import_environment

    first = run_on_gloo(rank_and_zygote, dp=2, whole_bridge=True, initialize=False)
    key = import_environment()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "changed after the zygote started")
    assert import_environment() == key  # the per-test variable is no part of what imports read
    second = run_on_gloo(rank_and_zygote, dp=1, whole_bridge=True, initialize=False)
    ranks = first + second
    assert [rank["rank"] for rank in ranks] == [0, 1, 0]
    assert len({rank["parent"] for rank in ranks}) == 1 and ranks[0]["parent"] != os.getpid()
    assert len({rank["pid"] for rank in ranks}) == 3
    assert all(rank["whole"] and not rank["bad_fork"] for rank in ranks)
    assert second[0]["per_test"] == "changed after the zygote started"
    import huggingface_hub.constants

    assert {rank["hub_cache"] for rank in ranks} == {huggingface_hub.constants.HF_HUB_CACHE}


def test_a_bridge_zygote_is_chosen_by_what_imports_read(monkeypatch, tmp_path):
    """The key a zygote is kept under: the environment less pytest's per-test variable, and the import path. Hugging
    Face's hub settings change it; two offline-hub blocks (the recipes' worlds) give the same one."""
    from megatron.bridge_thd_cpu.hf_hub import offline_hub
    from megatron.bridge_thd_testbed.launcher import import_environment

    key = import_environment()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    assert import_environment() == key
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert import_environment() != key
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_environment() != key
    monkeypatch.undo()
    with offline_hub():
        offline = import_environment()
    assert offline != key and import_environment() == key
    with offline_hub():
        assert import_environment() == offline
