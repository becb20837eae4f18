"""A CP size per sample for the MoE Qwen3-VL over real processes: 4 gloo ranks, Megatron-Core's hybrid groups,
scheduler and schedule, Megatron-Bridge's real ``Qwen3VLModel`` with 4 experts (top-2, sigmoid scores, aux loss
1e-2, z-loss 1e-3, expert bias) and the padding-aware routers (``moe_padding.with_padding_mask``), the step of
tests/parallel/test_cp_per_sample.py (a row on 4 ranks, two on 2, short ones on 1).

What must hold, and the reference each is held to:

* The aux loss and z-loss are statistics of the tokens a router sees together, the row: the reference is each row
  of the placement run alone at CP = 1 (one process, the same rows), its loss summed over rows. The step binds the
  row's group as the routers' TP x CP group (TP = 1), so a row's statistics are reduced over the ranks that hold it;
  the padding-aware router scales the losses' gradient by the group's exact valid-token count. Loss, token count and
  every gradient summed over the 4 ranks must equal the reference's sums (relative gradient error <= 1e-5).
* The expert-bias token counts are per token: summed over the ranks they equal the per-row counts summed.
"""

from __future__ import annotations

import pytest
import torch
from _cp_per_sample import MAX_TOKENS_PER_RANK, SEQ_LENGTH, WORLD, bridge_batch, place, run_hybrid_step, samples

from megatron.bridge_thd.moe_padding.hook import with_padding_mask
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import gradients, step_run, worst_relative_gradient_error
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd_testbed.launcher import run_on_gloo

GRAD_TOLERANCE = 1e-5
MOE = dict(moe=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_router_enable_expert_bias=True,
           moe_router_score_function="sigmoid")


def _config(**overrides):
    return tiny_qwen3_vl_config(seq_length=SEQ_LENGTH, **MOE, **overrides)


def _counts(model) -> torch.Tensor:
    """``(layers, experts)``: the tokens each router sent to each expert (the expert-bias counts)."""
    return torch.stack([layer.mlp.router.local_tokens_per_expert.clone() for layer in model.language_model.decoder.layers])


def moe_worker(state_dict, step_samples, placement="megatron"):
    """Every rank: the wrapped MoE model, the step's rows through Megatron-Core's hybrid-CP schedule; the sums over
    the world, the expert-bias counts summed over the world, and the routers' TP x CP group sizes they ran with."""
    model = build_qwen3_vl(_config(hybrid_context_parallel=True, max_seqlen_per_dp_cp_rank=MAX_TOKENS_PER_RANK,
                                   vision_dp_when_cp=True), seed=0)
    model.load_state_dict(state_dict)
    with_padding_mask(model)
    routers = [layer.mlp.router for layer in model.language_model.decoder.layers]
    group_sizes = []
    routers[0].register_forward_pre_hook(lambda module, args: group_sizes.append(module.tp_cp_group.size()))
    result = run_hybrid_step(model, step_samples, placement)
    counts = _counts(model)
    torch.distributed.all_reduce(counts)
    result.pop("calls")
    return dict(result, counts=counts, group_sizes=group_sizes,
                restored=all(router.tp_cp_group.size() == 1 for router in routers))


@pytest.fixture(scope="module")
def per_row_reference():
    """Megatron-Core's placement's reference, computed once (the aux-loss tests read its weights):
    :func:`_per_row_reference`."""
    return _per_row_reference("megatron")


def _per_row_reference(placed_by: str):
    """Each row of the placement (by ``placed_by``) alone at CP = 1 on one process (the same weights): loss,
    tokens and gradients summed over the rows, the expert-bias counts summed, and the placement."""
    init_single_process_groups()
    step_samples = samples()
    placement = place(step_samples, placed_by)
    with cpu_stack():
        model = build_qwen3_vl(_config(), seed=0)
        state_dict = {name: value.clone() if value is not None else None for name, value in model.state_dict().items()}
        with_padding_mask(model)
        loss, tokens = 0.0, 0
        for row in placement.rows:
            run = step_run(model, bridge_batch([step_samples[i] for i in row.samples]), "thd", seq_length=SEQ_LENGTH)
            run.loss.backward()
            loss, tokens = loss + float(run.loss), tokens + int(run.num_tokens)
        return state_dict, dict(loss=loss, num_tokens=tokens, grads=gradients(model), counts=_counts(model),
                                rows=len(placement.rows), placement=placement, placed_by=placed_by)


def test_cp_per_sample_moe_equals_each_row_at_cp1(per_row_reference):
    """Megatron-Core's placement. Ours on the time model makes the same rows (the same samples, so the same per-row
    reference) in the same order per rank (test_cp_per_sample.py checks it and runs both placements on the dense
    model), so it runs there only."""
    state_dict, expected = per_row_reference
    assert expected["rows"] == 7 and expected["num_tokens"] > 0
    ranks = run_on_gloo(moe_worker, state_dict, samples(), expected["placed_by"], dp=WORLD, hybrid_cp=True,
                        timeout=600)
    for rank, got in enumerate(ranks):
        # The routers reduced over the row's ranks: 4, then 2, then 1; and were given back their own group.
        assert got["group_sizes"] == [row.cp_size for row in expected["placement"].rows_of(rank)] == [4, 2, 1], rank
        assert got["restored"], rank
        assert torch.equal(got["counts"], expected["counts"]), rank
        assert got["num_tokens"] == expected["num_tokens"], rank
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6), rank
        error, where = worst_relative_gradient_error(got["grads"], expected["grads"])
        assert error <= GRAD_TOLERANCE, f"rank {rank}: {where} relative gradient error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# the load-balancing loss's gradient under a static CP group (the router fix the rows above rely on)


def aux_gradient_worker(state_dict, cp, coeff, wrapped, balancing="aux_loss"):
    """One row (the long video sample) at a static CP size: the first router's weight gradient, summed over the CP
    group, with the load-balancing loss ``balancing`` at ``coeff`` (z-loss off)."""
    from megatron.core import parallel_state

    settings = dict(MOE, moe_aux_loss_coeff=coeff, moe_z_loss_coeff=0.0, moe_router_load_balancing_type=balancing)
    model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=SEQ_LENGTH, cp=cp, **settings), seed=0)
    model.load_state_dict(state_dict)
    if wrapped:
        with_padding_mask(model)
    run = step_run(model, bridge_batch(samples()[:1]), "thd", seq_length=SEQ_LENGTH)
    run.loss.backward()
    router = model.language_model.decoder.layers[0].mlp.router
    if balancing == "global_aux_loss" and coeff:
        assert float(router.ga_steps) == 1  # the global aux loss ran (once: one micro-batch)
    grad = router.weight.grad.clone()
    if cp > 1:
        torch.distributed.all_reduce(grad, group=parallel_state.get_context_parallel_group())
    return grad


BALANCINGS = ("aux_loss", "global_aux_loss")
# Each balancing with the load-balancing loss on and off (its share of the gradient is the difference).
AUX_CASES = tuple((balancing, coeff) for balancing in BALANCINGS for coeff in (1e-2, 0.0))


def aux_gradients_worker(state_dict, cp, wrapped):
    """:func:`aux_gradient_worker` for every case of :data:`AUX_CASES`, in order, in one process (one world)."""
    from megatron.core.transformer.moe import moe_logging

    grads = []
    for balancing, coeff in AUX_CASES:
        moe_logging.destroy_moe_metrics_tracker()  # each case a fresh run (tests/conftest.py says why)
        grads.append(aux_gradient_worker(state_dict, cp, coeff, wrapped, balancing))
    return grads


@pytest.fixture(scope="module")
def aux_parts(per_row_reference):
    """By balancing: the load-balancing loss's share of the first router weight's gradient (with the loss minus
    without it) at CP = 1 on one process and at static CP = 2 (one world runs every case of :data:`AUX_CASES`)."""
    state_dict, _ = per_row_reference
    with cpu_stack():
        cp1 = aux_gradients_worker(state_dict, 1, True)
    cp2 = run_on_gloo(aux_gradients_worker, state_dict, 2, True, cp=2, timeout=300)[0]
    return {balancing: (cp1[2 * i] - cp1[2 * i + 1], cp2[2 * i] - cp2[2 * i + 1])
            for i, balancing in enumerate(BALANCINGS)}


@pytest.mark.parametrize("balancing", BALANCINGS)
def test_the_aux_loss_gradient_under_static_cp_equals_cp1(aux_parts, balancing):
    """Megatron-Core's ``get_tokens_per_expert_and_token_count`` all-reduces the per-expert counts in place and then
    reads the rank's token count from them: with a padding mask under CP its aux-loss gradient is ``CP`` times too
    large (measured with Megatron-Core's method: exactly 2x at CP = 2, for ``aux_loss`` and for ``global_aux_loss``,
    whose group, TP x DP x CP, is the CP group here). The padding-aware router counts from a copy; at CP = 1 it is
    Megatron-Core's method on the same numbers. (``global_aux_loss`` at DP = 2 too, over rows of unequal real
    tokens: tests/parallel/test_moe_global_aux_loss.py.)"""
    reference, wrapped = aux_parts[balancing]
    assert reference.norm() > 0
    # A difference of two gradients: compared as a whole (Megatron-Core's count gave exactly 2x here).
    assert float((wrapped - reference).norm() / reference.norm()) <= 1e-5
