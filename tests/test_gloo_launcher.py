"""The gloo launcher turns a hang into a failure: a world that never finishes (here its rank 0 would
wait forever on a peer that never answers, what a pipeline stage does when its neighbour crashed on
NCCL) is killed at one deadline for the whole world and reported, instead of leaving the suite stuck."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from megatron.bridge_thd.testbed.launcher import run_on_gloo

# The deadline counts from the processes' start. Each rank of run_on_gloo first imports torch,
# Megatron-Core and the CPU stack (about 13 s for two ranks on two idle cores, 30 s and more on a
# loaded machine), so with a short deadline the ranks are killed before rank 0 reaches its recv; as
# fn can never return, the world cannot finish either way and the launcher must report it at the
# deadline. 6 s: well above the parent's own work around the deadline (starting and killing two
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
