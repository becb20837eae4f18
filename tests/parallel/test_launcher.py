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


def test_a_hanging_world_fails_at_the_deadline():
    running_before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within timeout") as info:
        run_on_gloo(wait_for_a_message_from_rank_1, cp=2, timeout=TIMEOUT)
    elapsed = time.monotonic() - start
    # Every rank of the world is reported as hung, and killed: none is left running.
    assert str(info.value).count("did not finish within timeout") == 2
    assert set(multiprocessing.active_children()) <= running_before
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
