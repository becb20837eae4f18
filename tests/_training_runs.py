"""Reading what ``bridge_thd_testbed.training.run_on_cpu`` returns per rank (shared by tests/bridge/test_training.py
and tests/bridge/test_training_qwen35.py)."""


def run_losses(rank: dict, run: str) -> list:
    """The loss of each iteration of one run on one rank."""
    return [row["loss"] for row in rank[run]["iterations"]]


def thd_losses(rank: dict) -> list:
    """The ``thd`` run stopped at its checkpoint and the run resumed from it, as one list of losses."""
    return run_losses(rank, "thd_first") + run_losses(rank, "thd_resumed")
