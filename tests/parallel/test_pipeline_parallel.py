"""Pipeline parallelism with Megatron-Core 0.19.2's own 1F1B schedule over gloo processes.

``forward_backward_pipelining_without_interleaving`` runs our ``forward_step`` on Megatron-Bridge
0.6.2's real ``Qwen3VLModel`` split over two stages (vision tower and layers 0-1 on the first,
layers 2-3, the norm and the output layer on the second), weights equal to the PP=1 model's by
global layer index. For ``thd`` with ``variable_seq_lengths=True`` and for every static
configuration the step accepts (``thd_static``, ``thd`` switched to ``thd_static``, ``bshd``,
all with ``variable_seq_lengths=False`` and micro_batch_size 2, where Megatron-Core's p2p buffers
are ``(seq_length, micro_batch_size, H)``), the losses and every gradient equal the PP=1 run; and
the same with PP=2 x CP=2 (four ranks, buffers ``(seq_length / cp, micro_batch_size, H)``).
"""

from __future__ import annotations

import pytest
from _real_model import receipt_batch

from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
from megatron.bridge_thd_testbed.pipeline import pipeline_step
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups

NUM_LAYERS = 4
MICRO_BATCH_SIZE = 2
SEQ_LENGTH = 2048
CONFIGS = [("thd", True), ("thd_static", False), ("thd", False), ("bshd", False)]


def pp_worker(full_state_dict, batches, configs):
    return {config: pipeline_step(full_state_dict, batches, *config, num_layers=NUM_LAYERS,
                                  micro_batch_size=MICRO_BATCH_SIZE, seq_length=SEQ_LENGTH) for config in configs}


@pytest.fixture(scope="module")
def batches():
    return [receipt_batch("right", seed=1, batch_size=MICRO_BATCH_SIZE),
            receipt_batch("left", seed=2, batch_size=MICRO_BATCH_SIZE)]


@pytest.fixture(scope="module")
def full_state_dict():
    init_single_process_groups()
    with cpu_stack():
        return build_qwen3_vl(tiny_qwen3_vl_config(num_layers=NUM_LAYERS, seq_length=SEQ_LENGTH), seed=0).state_dict()


@pytest.fixture(scope="module")
def reference(full_state_dict, batches):
    """PP = 1, CP = 1: this process, the same schedule."""
    with cpu_stack():
        return pp_worker(full_state_dict, batches, CONFIGS)


@pytest.fixture(scope="module")
def pp_ranks(full_state_dict, batches):
    return run_on_gloo(pp_worker, full_state_dict, batches, CONFIGS, pp=2, timeout=600)


@pytest.fixture(scope="module")
def pp_cp_ranks(full_state_dict, batches):
    """PP = 2 x CP = 2: four gloo ranks (global ranks 0-1 the first stage, 2-3 the last, as
    Megatron-Core orders tp-cp-ep-dp-pp), each CP rank of a stage holding its zigzag share."""
    return run_on_gloo(pp_worker, full_state_dict, batches, CONFIGS, pp=2, cp=2, timeout=600)


def _assert_equal_to_reference(expected, first, last, batches, config):
    assert first["losses"] == []  # only the last stage reports losses
    assert len(last["losses"]) == len(batches)
    for got, want in zip(last["losses"], expected["losses"]):
        loss, tokens = got["lm loss"]
        want_loss, want_tokens = want["lm loss"]
        assert int(tokens) == int(want_tokens) > 0
        assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    # Every parameter lives on exactly one stage; together they are the PP=1 model's.
    assert set(first["grads"]).isdisjoint(last["grads"])
    grads = {**first["grads"], **last["grads"]}
    assert set(grads) == set(expected["grads"])
    error, where = worst_relative_gradient_error(grads, expected["grads"])
    assert error <= 1e-5, f"{where}: relative gradient error {error:.2e}"
    # Without variable_seq_lengths the step runs a static row (thd switches to thd_static).
    expected_layout = "thd_static" if config == ("thd", False) else config[0]
    assert first["layouts"] == last["layouts"] == [expected_layout]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-variable={c[1]}" if isinstance(c, tuple) else c)
def test_pp2_equals_pp1(reference, pp_ranks, batches, config):
    _assert_equal_to_reference(reference[config], pp_ranks[0][config], pp_ranks[1][config], batches, config)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c[0]}-variable={c[1]}" if isinstance(c, tuple) else c)
def test_pp2_cp2_equals_pp1_cp1(reference, pp_cp_ranks, batches, config):
    """Megatron-Bridge's Qwen3VLModel returns ``(output, cp_local_loss_mask)`` on every stage under
    CP; the first stage must unpack it before shaping what it sends (it used to crash there, and
    on NCCL its peer would have waited forever)."""
    for cp_rank in range(2):
        first, last = pp_cp_ranks[cp_rank][config], pp_cp_ranks[2 + cp_rank][config]
        _assert_equal_to_reference(reference[config], first, last, batches, config)
