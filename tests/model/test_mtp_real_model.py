"""Multi-token prediction on Megatron-Bridge 0.6.2's real ``Qwen3VLModel`` carrying an MTP layer.

Megatron-Bridge's ``Qwen3VLGPTModel`` hands Megatron-Core's MTP the *physical* boundaries
(``text_model.py``, ``_get_mtp_packed_seq_params``), so ``roll_tensor`` rolls each padded slot:
the last real token of a sample takes its slot's first padding value (label -100, loss mask 0,
pad id 0), which is what the per-sample roll gives it. This proves it per token: the MTP head's
per-token loss on a packed row equals each sample run alone, at every position the rolled loss
mask supervises, with and without alignment padding, in ``thd``, ``thd_static`` and ``bshd``,
and over gloo at CP = 2 (where Megatron-Core exchanges the boundary tokens between ranks).
"""

from __future__ import annotations

import pytest
import torch
from _real_model import receipt_batch

from megatron.bridge_thd.context_parallel import thd_partition_indices
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import per_sample_from_output, sample_inputs, step_run
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups

TOLERANCE = 1e-5


def _mtp_model(cp: int = 1):
    """The tiny model with one MTP layer; its language model records every per-token loss it
    computes (Megatron-Core computes the MTP head's loss first, then the main one)."""
    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=cp, mtp_num_layers=1, mtp_loss_scaling_factor=0.1), seed=0)
    language_model = model.language_model
    original = language_model.compute_language_model_loss
    model.token_losses = []

    def recording(labels, logits):
        loss = original(labels, logits)
        model.token_losses.append(loss.detach())
        return loss

    language_model.compute_language_model_loss = recording
    return model


def _mtp_supervised(batch, i):
    """Sample i's MTP targets: the loss mask rolled left by one within the sample."""
    mask = batch["loss_mask"][i][batch["attention_mask"][i].bool()]
    return torch.cat([mask[1:], mask.new_zeros(1)]) > 0


def _alone(model, batch):
    out = []
    for i in range(batch["tokens"].shape[0]):
        model.token_losses.clear()
        with torch.no_grad():
            model(**sample_inputs(batch, i))
        assert len(model.token_losses) == 2, "expected the MTP loss and the main loss"
        out.append(model.token_losses[0][0])
    return out


@pytest.fixture(scope="module")
def setup():
    init_single_process_groups()
    with cpu_stack():
        model = _mtp_model()
        batch = receipt_batch("left")
        yield model, batch, _alone(model, batch)


@pytest.mark.parametrize("layout,settings", [("thd", {}), ("thd", {"fp8": "hybrid"}), ("thd_static", {"fp8": "hybrid"}),
                                             ("bshd", {})])
def test_packed_mtp_loss_equals_each_sample_alone(setup, layout, settings):
    model, batch, alone = setup
    model.token_losses.clear()
    with cpu_stack(), torch.no_grad():
        run = step_run(model, batch, layout, **settings)
    params = run.args["packed_seq_params"]
    if settings:  # fp8 alignment: every slot but an aligned one carries padding
        assert params.pad_between_seqs and not torch.equal(params.cu_seqlens_q[:-1], params.cu_seqlens_q_padded[:-1])
    run.output = model.token_losses[0]
    packed = per_sample_from_output(run, batch)
    errors = [float((p - a)[_mtp_supervised(batch, i)].abs().max()) for i, (p, a) in enumerate(zip(packed, alone))]
    assert max(errors) <= TOLERANCE


def test_mtp_control_global_roll_differs(setup):
    """The check can fail: the MTP loss at a sample's positions is not the same as that of a row
    whose samples were never separated (one segment for the whole row, as a global roll and a
    cross-sample attention would see it)."""
    model, batch, alone = setup
    with cpu_stack(), torch.no_grad():
        run = step_run(model, batch, "thd")
        args = dict(run.args)
        params = args["packed_seq_params"]
        n = args["input_ids"].shape[1]
        whole = torch.tensor([0, n], dtype=torch.int32)
        args["packed_seq_params"] = type(params)(
            qkv_format="thd", cu_seqlens_q=whole, cu_seqlens_kv=whole, cu_seqlens_q_padded=whole,
            cu_seqlens_kv_padded=whole, max_seqlen_q=n, max_seqlen_kv=n,
        )
        model.token_losses.clear()
        model(**args)
    run.output = model.token_losses[0]
    packed = per_sample_from_output(run, batch)
    errors = [float((p - a)[_mtp_supervised(batch, i)].abs().max()) for i, (p, a) in enumerate(zip(packed, alone))]
    assert max(errors[1:]) > 1e-3  # every sample after the first sees its predecessors


def mtp_cp_worker(state_dict, batch, cp):
    model = _mtp_model(cp=cp)
    model.load_state_dict(state_dict)
    model.token_losses.clear()
    with torch.no_grad():
        run = step_run(model, batch, "thd")
    params = run.args["packed_seq_params"]
    n = run.args["input_ids"].shape[1]
    rank = torch.distributed.get_rank()
    return dict(local=model.token_losses[0][0], index=thd_partition_indices(params.cu_seqlens_q_padded, n, cp, rank),
                starts=params.cu_seqlens_q_padded.tolist(), row=n)


@pytest.mark.slow  # a gloo world of two ranks
def test_cp2_mtp_loss_equals_each_sample_alone(setup):
    model, batch, alone = setup
    ranks = run_on_gloo(mtp_cp_worker, model.state_dict(), batch, 2, cp=2, timeout=600)
    row = torch.full((ranks[0]["row"],), float("nan"))
    for result in ranks:
        row[result["index"]] = result["local"]
    lengths = batch["attention_mask"].sum(1).tolist()
    starts = ranks[0]["starts"]
    for i, (start, n) in enumerate(zip(starts, lengths)):
        supervised = _mtp_supervised(batch, i)
        assert supervised.any()
        assert float((row[start : start + n] - alone[i])[supervised].abs().max()) <= TOLERANCE
