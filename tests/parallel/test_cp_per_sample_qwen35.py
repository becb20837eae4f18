"""A CP size per sample for Qwen3.5-VL (Gated DeltaNet and full attention) over real processes: 4 gloo ranks,
Megatron-Core's hybrid context-parallel groups, its scheduler and schedule (``forward_backward_no_pipelining``),
Megatron-Bridge's real ``Qwen3VLModel`` with the Qwen3.5 hybrid block (``megatron.bridge_thd_cpu.qwen35``) and
``vision_dp_when_cp``: the step of tests/parallel/test_cp_per_sample.py (a row on 4 ranks, two on 2, short ones on 1).

Megatron-Core's ``GatedDeltaNet`` fixes its CP size at build (``self.cp_size = pg_collection.cp.size()``, and the
head split ``feat_dim_split`` from it); :func:`~megatron.bridge_thd.cp_per_sample.bound_cp_group` gives it the
row's size with the row's group. Its head-parallel all-to-all gives each of ``k`` ranks ``1/k`` of the heads, so the
GDN key and value head counts here (4 and 8) divide by every CP size of the step.

The loss sum, the token count and every parameter gradient, summed over the 4 ranks, must equal the same samples at
CP = 1 on one process. fp64, as in test_qwen35_context_parallel.py: in fp32 Megatron-Core's GDN casts leave ~1e-5
relative noise on small gradients.
"""

from __future__ import annotations

import pytest
from _real_model import FakeGroup
from _cp_per_sample import cp1_reference as _cp1_reference
from _cp_per_sample import MAX_TOKENS_PER_RANK, SEQ_LENGTH, WORLD, place, run_hybrid_step, samples

from megatron.bridge_thd.cp_per_sample import bound_cp_group, find_cp_group_holders
from megatron.bridge_thd_cpu.parity import worst_relative_gradient_error
from megatron.bridge_thd_cpu.qwen35 import build_qwen35_vl, gdn_layers, tiny_qwen35_vl_config
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd_testbed.launcher import run_on_gloo

GRAD_TOLERANCE = 1e-5
# GDN heads split over the row's CP group: 4 key heads and 8 value heads (grouped 1:2, like 16/32) divide by 1, 2, 4.
GDN_HEADS = dict(linear_num_key_heads=4, linear_num_value_heads=8)


def _config(**overrides):
    return tiny_qwen35_vl_config(seq_length=SEQ_LENGTH, **GDN_HEADS, **overrides)


def _hybrid_config():
    return _config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=MAX_TOKENS_PER_RANK, vision_dp_when_cp=True)


def _build(config):
    model = build_qwen35_vl(config, seed=0).double()
    assert len(gdn_layers(model)) == 2, "the model must carry Gated DeltaNet layers"
    return model


def hybrid_worker(state_dict, step_samples, placement="megatron"):
    """Every rank: the step's rows through Megatron-Core's hybrid-CP schedule, then the sums over the world; what
    each GDN layer ran with."""
    model = _build(_hybrid_config())
    model.load_state_dict(state_dict)
    gdn = gdn_layers(model)
    built = [(m.cp_size, m.feat_dim_split, m.gated_delta_rule) for m in gdn]
    gdn_calls = []
    for m in gdn:
        m.register_forward_pre_hook(lambda module, args: gdn_calls.append(
            (module.cp_size, module.pg_collection.cp.size(), module.gated_delta_rule is built[0][2])))
    result = run_hybrid_step(model, step_samples, placement)
    calls = result.pop("calls")
    return dict(result, row_cp_sizes=[int(p.local_cp_size) for p in calls], gdn_calls=gdn_calls,
                holders_restored=all(getattr(h, n) is model.pg_collection.cp
                                     for h, n in find_cp_group_holders(model).places),
                gdn_restored=[(m.cp_size, m.feat_dim_split, m.gated_delta_rule) for m in gdn] == built)


@pytest.fixture(scope="module")
def cp1_reference():
    """The same samples on one process at CP = 1: one packed THD row, its loss sum, tokens and gradients."""
    return _cp1_reference(lambda: _build(_config()))


def test_cp_per_sample_equals_cp1_on_qwen35(cp1_reference):
    """Megatron-Core's placement: every rank a row of CP 4, then 2, then 1. Ours on the time model makes the same
    rows in the same order per rank (one group instead of three; test_cp_per_sample.py checks both and runs both on
    the dense model), so it runs there only."""
    state_dict, expected = cp1_reference
    assert all([row.cp_size for row in place(samples(), "megatron").rows_of(rank)] == [4, 2, 1]
               for rank in range(WORLD))
    ranks = run_on_gloo(hybrid_worker, state_dict, samples(), "megatron", dp=WORLD, hybrid_cp=True, timeout=600)
    assert expected["num_tokens"] > 0
    for rank, got in enumerate(ranks):
        assert got["row_cp_sizes"] == [4, 2, 1], rank
        # Both GDN layers ran each row at its CP size, with its group and the kernel the build bound.
        assert got["gdn_calls"] == [(4, 4, True)] * 2 + [(2, 2, True)] * 2 + [(1, 1, True)] * 2, rank
        assert got["holders_restored"] and got["gdn_restored"], rank
        assert got["num_tokens"] == expected["num_tokens"], rank
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6), rank
        error, where = worst_relative_gradient_error(got["grads"], expected["grads"])
        assert error <= GRAD_TOLERANCE, f"rank {rank}: {where} relative gradient error {error:.2e}"


def test_bound_cp_group_gives_gated_deltanet_the_rows_size():
    """Each GDN layer's ``cp_size`` is found (and nothing else that merely equals 1) and, bound, re-derives its head
    split for the row's size; the kernel it was built with stays; everything is restored, also after a failure."""
    init_single_process_groups()
    with cpu_stack():
        model = _build(_config())
    holders = find_cp_group_holders(model)
    gdn = gdn_layers(model)
    assert holders.sizes == tuple((m, "cp_size") for m in gdn)
    built = [dict(vars(m)) for m in gdn]
    with bound_cp_group(holders, FakeGroup(2)):
        for m, before in zip(gdn, built):
            assert m.cp_size == 2 and m.pg_collection.cp.size() == 2
            assert m.feat_dim_split == tuple(d // 2 for d in before["feat_dim_split"])
            assert m.gated_delta_rule is before["gated_delta_rule"]
    with pytest.raises(RuntimeError), bound_cp_group(holders, FakeGroup(4)):
        raise RuntimeError("a forward that fails")
    for m, before in zip(gdn, built):
        assert {k: v for k, v in vars(m).items()} == before
