"""Gated DeltaNet under context parallelism: the tiny Qwen3.5-VL (Megatron-Bridge's Qwen3VLModel
with Megatron-Core 0.19.2's GDN layers on the pure-torch varlen kernels) at CP = 2 over gloo.

Megatron-Core's GDN runs CP through a head-parallel all-to-all (every rank gets the whole row for
its share of heads) and needs every physical segment divisible by the CP size
(``_resolve_cu_seqlens``); the step's ``2 * cp`` alignment meets that. Loss sum, token count and
every gradient (all-reduced over the CP group) must equal the CP = 1 run. fp64, as in
test_qwen35_parity.py: in fp32 Megatron-Core's GDN casts leave ~1e-5 relative noise on small
gradients.
"""

from __future__ import annotations

import pytest
import torch
from _real_model import last_slot_batch, receipt_batch

from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.parity import gradients, step_run, worst_relative_gradient_error
from megatron.bridge_thd_cpu.qwen35 import build_qwen35_vl, gdn_layers, tiny_qwen35_vl_config
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups

# (batch, layout): left padding in a static row (its tail a padding segment), and padding only in
# the last slot of a dynamic row.
COMBOS = [("left", "thd_static"), ("last-slot", "thd")]
# The step's seq_length: the static row is micro_batch_size x seq_length slots. The receipt batches are 601 wide,
# so 608 (a multiple of CP 2's alignment 4) gives the left-padded pair a row of 1216 with a tail segment of 104
# padding slots. The pure-torch GDN recurrence runs token by token over the longest segment, so the default 2048
# (a tail of ~3000 slots) cost five times as much and proved nothing more.
SEQ_LENGTH = 608


def _cases():
    return [("left", receipt_batch("left", batch_size=2)), ("last-slot", last_slot_batch(cp_align=4))]


def _run(state_dict, batch, layout, cp):
    model = build_qwen35_vl(tiny_qwen35_vl_config(cp=cp), seed=0).double()
    model.load_state_dict(state_dict)
    assert gdn_layers(model), "the model must carry Gated DeltaNet layers"
    run = step_run(model, batch, layout, seq_length=SEQ_LENGTH)
    run.loss.backward()
    grads = gradients(model)
    totals = torch.stack([run.loss.detach(), run.num_tokens.double()])
    if cp > 1:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        torch.distributed.all_reduce(totals, group=group)
        for g in grads.values():
            torch.distributed.all_reduce(g, group=group)
    return dict(loss=float(totals[0]), num_tokens=int(totals[1]), grads=grads)


def gdn_cp_worker(state_dict, cases, cp):
    batches = dict(cases)
    return {(name, layout): _run(state_dict, batches[name], layout, cp) for name, layout in COMBOS}


@pytest.fixture(scope="module")
def runs():
    init_single_process_groups()
    cases = _cases()
    with cpu_stack():
        state_dict = build_qwen35_vl(tiny_qwen35_vl_config(), seed=0).double().state_dict()
        reference = gdn_cp_worker(state_dict, cases, 1)
    ranks = run_on_gloo(gdn_cp_worker, state_dict, cases, 2, cp=2, timeout=600)
    return reference, ranks


@pytest.mark.parametrize("name,layout", COMBOS)
def test_gdn_cp2_equals_cp1(runs, name, layout):
    reference, ranks = runs
    expected = reference[name, layout]
    assert expected["num_tokens"] > 0
    if layout == "thd_static":  # the static row ends in a padding segment (its premise)
        mask = dict(_cases())[name]["attention_mask"]
        assert mask.shape[1] <= SEQ_LENGTH and mask.sum() < mask.shape[0] * SEQ_LENGTH
    for rank, results in enumerate(ranks):
        got = results[name, layout]
        assert got["num_tokens"] == expected["num_tokens"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)  # the loss sum is reduced in fp32
        error, where = worst_relative_gradient_error(got["grads"], expected["grads"])
        assert error <= 1e-5, f"rank {rank}: {where} relative gradient error {error:.2e}"
