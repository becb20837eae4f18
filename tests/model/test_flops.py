"""The trainer's FLOPs for our micro-batches: the step feeds the installed Megatron-Bridge's own
``accumulate_flops_metadata`` (``training/utils/flop_utils.py``, loaded on the CPU with placeholders
for its LoRA / ConfigContainer imports), and the trainer's ``resolve_global_flops_runtime_stats`` +
``num_floating_point_operations`` (+ ``vit_flops_from_patch_stats`` where the line has exact vision
statistics: ``upstream_line.trainer_flops``) turn that into the FLOPs it logs.

The vision term is fed as the installed line's own step feeds it (``upstream_line().flops_vision_patch_stats``):
``vision_patch_stats`` (patch sum, squared sum per frame, merged tokens; zeros without media) or
``num_vision_patches``. The expected values come from the grids directly (``t * h * w`` per item)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from _real_model import collate_rows, receipt_batch

from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
from megatron.bridge_thd_cpu.parity import step_run
from megatron.bridge_thd_cpu.stack import cpu_stack
from megatron.bridge_thd_cpu.standalone import init_single_process_groups
from megatron.bridge_thd.upstream.loading import load_flop_utils
from megatron.bridge_thd.upstream.line import trainer_flops, upstream_line

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
    return (*_resolved(flop_utils, run.state), run)


def _resolved(flop_utils, state):
    """``(seqlen_sum, seqlen_squared_sum, vision)`` as the installed trainer resolves them; ``vision`` has
    ``num_vision_patches`` and, on the line with exact statistics, the three ``vision_*`` sums."""
    group = torch.distributed.group.WORLD
    if upstream_line().flops_runtime_stats_record:
        stats = flop_utils.resolve_global_flops_runtime_stats(state, data_parallel_size=1, dp_group=group,
                                                              include_vision_patch_stats=True)
        return stats.seqlen_sum, stats.seqlen_squared_sum, stats
    seqlen_sum, seqlen_sq_sum, patches, _, _ = flop_utils.resolve_global_flops_runtime_stats(
        state, data_parallel_size=1, dp_group=group)
    return seqlen_sum, seqlen_sq_sum, SimpleNamespace(num_vision_patches=patches)


def _expected_vision(grid: torch.Tensor, merge: int) -> tuple[int, int, int]:
    """(patch sum, sum over items of t * (h * w)^2 (attention within each frame), merged tokens)."""
    items = [tuple(int(v) for v in row) for row in grid]
    return (sum(t * h * w for t, h, w in items), sum(t * (h * w) ** 2 for t, h, w in items),
            sum(t * h * w // merge**2 for t, h, w in items))


def test_placeholders_do_not_outlive_the_load(flop_utils):
    assert "megatron.bridge.peft.lora" not in sys.modules
    assert "megatron.bridge.training.config" not in sys.modules
    assert not isinstance(object(), flop_utils.LoRA)


@pytest.mark.parametrize("layout", ["thd", "thd_static", "bshd"])
def test_accumulated_stats_are_what_each_layout_computes(flop_utils, setup, layout):
    _, _, batch = setup
    seqlen_sum, seqlen_sq_sum, vision, run = _trainer_stats(flop_utils, setup, layout)
    lengths = batch["attention_mask"].sum(1).tolist()
    grid = batch["visual_inputs"].image_grid_thw
    patch_sum, patch_squared_sum, merged = _expected_vision(grid, merge=2)
    if upstream_line().flops_vision_patch_stats:
        assert vision.has_exact_vision_stats and vision.num_vision_patches == 0  # as the line's own step feeds
        assert (vision.vision_patch_sum, vision.vision_patch_squared_sum, vision.vision_merged_token_sum) == (
            patch_sum, patch_squared_sum, merged)
    else:
        assert vision.num_vision_patches == patch_sum
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


def test_the_trainer_logs_the_vision_flops_of_the_grids(flop_utils, setup):
    """The whole step's FLOPs as the installed trainer computes them (``upstream_line.trainer_flops``) exceed
    the language model's formula by exactly the vision tower's FLOPs of these grids: by
    ``vit_flops_from_patch_stats`` of the grids' own statistics where the line has exact vision statistics,
    else by the legacy patch-count term ``num_floating_point_operations`` adds for ``num_vision_patches``."""
    config, _, batch = setup
    cfg = SimpleNamespace(model=config, peft=None)
    seqlen_sum, seqlen_sq_sum, _, run = _trainer_stats(flop_utils, setup, "thd")
    group = torch.distributed.group.WORLD
    logged = trainer_flops(flop_utils, cfg, run.state, batch_size=3, data_parallel_size=1, dp_group=group)
    language = flop_utils.num_floating_point_operations(cfg, batch_size=3, seqlen_sum=seqlen_sum,
                                                        seqlen_squared_sum=seqlen_sq_sum, num_vision_patches=0)
    patch_sum, patch_squared_sum, merged = _expected_vision(batch["visual_inputs"].image_grid_thw, merge=2)
    if upstream_line().flops_runtime_stats_record:
        vision = flop_utils.vit_flops_from_patch_stats(cfg, patch_sum=patch_sum, patch_squared_sum=patch_squared_sum,
                                                       merged_token_sum=merged)
    else:
        vision = flop_utils.num_floating_point_operations(
            cfg, batch_size=3, seqlen_sum=seqlen_sum, seqlen_squared_sum=seqlen_sq_sum,
            num_vision_patches=patch_sum) - language
    assert vision > 0
    assert logged == pytest.approx(language + vision, rel=1e-12)


def test_a_micro_batch_without_media_enters_the_vision_reduction_with_zeros(flop_utils, setup):
    """Where the line's own step feeds ``vision_patch_stats``, a rank whose micro-batch has no image still feeds
    ``(0, 0, 0)`` (and asks for the trainer's global reduction), or the data-parallel ranks would enter different
    collectives. On the line without it, nothing is fed and no reduction is asked for."""
    config, model, _ = setup
    text_only = collate_rows([[5, 6, 7, 8, 9], [10, 11, 12]], [[1.0] * 5, [1.0] * 3])
    with cpu_stack(), torch.no_grad():
        run = step_run(model, text_only, "thd", seq_length=SEQ_LENGTH)
    if upstream_line().flops_vision_patch_stats:
        assert getattr(run.state, "_flops_requires_global_reduce", False)
        assert [int(getattr(run.state, name, -1)) for name in (
            "_flops_vision_patch_sum", "_flops_vision_patch_sq_sum", "_flops_vision_merged_token_sum")] == [0, 0, 0]
    else:
        assert int(getattr(run.state, "_flops_vision_patches", 0)) == 0
