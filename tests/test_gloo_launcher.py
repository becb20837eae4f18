"""The gloo launcher turns a hang into a failure: a rank blocked on a peer that never answers
(what a pipeline stage does when its neighbour crashed on NCCL) is killed at one deadline for the
whole world and reported, instead of leaving the suite stuck."""

from __future__ import annotations

import time

import pytest
import torch

from megatron.bridge_thd.testbed.launcher import run_on_gloo


def wait_for_a_message_from_rank_1():
    """Rank 0 waits for rank 1, which never sends: a p2p hang."""
    if torch.distributed.get_rank() == 0:
        torch.distributed.recv(torch.zeros(1), src=1)
    else:
        time.sleep(3600)
    return torch.distributed.get_rank()


def test_a_hanging_world_fails_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not finish within timeout"):
        run_on_gloo(wait_for_a_message_from_rank_1, cp=2, timeout=20)
    # One deadline for the world, not one per process (that would be 2 x 20 s).
    assert time.monotonic() - start < 40
