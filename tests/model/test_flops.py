"""The trainer's FLOPs for our micro-batches: the step feeds Megatron-Bridge 0.6.2's own
``accumulate_flops_metadata`` (``training/utils/flop_utils.py``, loaded on the CPU with placeholders
for its LoRA / ConfigContainer imports), and the trainer's ``resolve_global_flops_runtime_stats`` +
``num_floating_point_operations`` turn that into the FLOPs it logs."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from _real_model import receipt_batch

from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import step_run
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd.upstream import load_flop_utils

SEQ_LENGTH = 2048


@pytest.fixture(scope="module")
def flop_utils():
    return load_flop_utils()


@pytest.fixture(scope="module")
def setup():
    init_single_process_groups()
    with cpu_stack():
        config = tiny_qwen3_vl_config(seq_length=SEQ_LENGTH)
        yield config, build_qwen3_vl(config, seed=0), receipt_batch("left", batch_size=3)


def _trainer_stats(flop_utils, setup, layout):
    """What train.py computes after a step of this one micro-batch (accumulators start at 0)."""
    config, model, batch = setup
    with cpu_stack(), torch.no_grad():
        run = step_run(model, batch, layout, seq_length=SEQ_LENGTH)
    seqlen_sum, seqlen_sq_sum, patches, _, _ = flop_utils.resolve_global_flops_runtime_stats(
        run.state, data_parallel_size=1, dp_group=torch.distributed.group.WORLD
    )
    return seqlen_sum, seqlen_sq_sum, patches, run


def test_placeholders_do_not_outlive_the_load(flop_utils):
    assert "megatron.bridge.peft.lora" not in sys.modules
    assert "megatron.bridge.training.config" not in sys.modules
    assert not isinstance(object(), flop_utils.LoRA)


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_accumulated_stats_are_what_each_layout_computes(flop_utils, setup, layout):
    _, _, batch = setup
    seqlen_sum, seqlen_sq_sum, patches, run = _trainer_stats(flop_utils, setup, layout)
    lengths = batch["attention_mask"].sum(1).tolist()
    assert patches == int(batch["visual_inputs"].image_grid_thw.prod(-1).sum())
    if layout == "bshd":
        width = run.args["input_ids"].shape[1]
        assert (seqlen_sum, seqlen_sq_sum) == (len(lengths) * width, len(lengths) * width**2)
    else:
        # Linear terms: every slot of the row; attention: sum of s_i^2 over the real lengths.
        assert seqlen_sum == run.args["input_ids"].shape[1]
        assert seqlen_sq_sum == sum(n * n for n in lengths)
    if layout == "thd":
        assert seqlen_sum == sum(lengths)  # one process: align 1, no slot padding
    if layout == "thd_static":
        assert seqlen_sum == len(lengths) * SEQ_LENGTH


def test_trainer_flops_of_a_packed_micro_batch_equal_the_per_sample_formula(flop_utils, setup):
    """The language model's FLOPs for the packed micro-batch equal the same formula evaluated
    for each sample alone and summed; the padded layout costs more."""
    config, _, batch = setup
    cfg = SimpleNamespace(model=config, peft=None)
    lengths = batch["attention_mask"].sum(1).tolist()
    seqlen_sum, seqlen_sq_sum, _, _ = _trainer_stats(flop_utils, setup, "thd")
    packed = flop_utils.num_floating_point_operations(cfg, batch_size=len(lengths), seqlen_sum=seqlen_sum,
                                                      seqlen_squared_sum=seqlen_sq_sum, num_vision_patches=0)
    alone = sum(flop_utils.num_floating_point_operations(cfg, batch_size=1, seqlen_sum=n, seqlen_squared_sum=n * n,
                                                         num_vision_patches=0) for n in lengths)
    assert packed == pytest.approx(alone, rel=1e-12)
    padded_sum, padded_sq_sum, _, _ = _trainer_stats(flop_utils, setup, "bshd")
    padded = flop_utils.num_floating_point_operations(cfg, batch_size=len(lengths), seqlen_sum=padded_sum,
                                                      seqlen_squared_sum=padded_sq_sum, num_vision_patches=0)
    assert padded > packed
    # Without our feed the trainer would fall back to micro_batch_size * seq_length per micro-batch.
    fallback = flop_utils.num_floating_point_operations(cfg, batch_size=len(lengths))
    assert fallback > padded
