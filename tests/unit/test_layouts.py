"""The layout contract (megatron.bridge_thd.layouts) is the one the step builds rows by and the
planner counts by: for the same micro-batch and parallel settings, the planner's token slots are
the length of what the step hands the model, in every layout, with FP8 on and off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _real_model import FakeGroup

from megatron.bridge_thd import layouts
from megatron.bridge_thd.plan.layouts import MicroBatch, Parallel, layout_stats
from megatron.bridge_thd.step.prepare import prepare_micro_batch
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL
from megatron.bridge_thd_cpu.standalone import minimal_state

SEQ = 2048


@pytest.fixture(scope="module")
def model():
    return ReferenceQwen3VL.tiny(seed=0)


def _collated(seed: int) -> dict:
    """A right-padded micro-batch collated to its longest sample (as Megatron-Bridge's collate pads)."""
    batch = synthetic_receipt_batch(4, seed=seed)
    width = int(batch["attention_mask"].sum(1).max())
    return {k: (v[:, :width] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in batch.items()}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tp,cp,sp,pp", [(1, 1, False, 1), (2, 1, True, 1), (1, 2, False, 1), (2, 2, True, 1),
                                         (1, 1, False, 2)])
@pytest.mark.parametrize("layout", layouts.LAYOUT_NAMES)
def test_planner_slots_equal_what_the_step_builds(model, layout, tp, cp, sp, pp, fp8):
    batch = _collated(seed=3)
    lengths = tuple(int(n) for n in batch["attention_mask"].sum(1))
    pg = SimpleNamespace(tp=FakeGroup(tp), cp=FakeGroup(cp), pp=FakeGroup(pp), ep=FakeGroup(1))
    state = minimal_state(seq_length=SEQ, micro_batch_size=4, packing_layout=layout, fp8="hybrid" if fp8 else None,
                          sequence_parallel=sp, variable_seq_lengths=True)
    prepared = prepare_micro_batch(batch, model, state, pg)
    slots, attention = layout_stats(layout, MicroBatch(lengths, 0, 0), SEQ,
                                    Parallel(tp=tp, cp=cp, pp=pp, gpus=tp * cp * pp, sequence_parallel=sp, fp8=fp8))
    assert prepared.stats.layout == layout
    assert prepared.forward_args["input_ids"].numel() == slots
    assert int(prepared.stats.attention_work) == attention


def test_layout_names_are_one_list_everywhere():
    from megatron.bridge_thd import configure, qwen3_vl_step
    from megatron.bridge_thd.plan import layouts as plan_layouts

    assert qwen3_vl_step.LAYOUT_NAMES == configure.LAYOUT_NAMES == layouts.LAYOUT_NAMES == tuple(layouts.LAYOUTS)
    assert set(plan_layouts.LAYOUT_ORDER) == set(layouts.LAYOUTS) and plan_layouts.LAYOUT_ORDER[0] == "bshd"


@pytest.mark.parametrize("requested,pp,variable,expected", [
    ("thd", 1, False, "thd"), ("thd", 2, True, "thd"), ("thd", 2, False, "thd_static"),
    ("thd_static", 2, False, "thd_static"), ("bshd", 2, False, "bshd"),
])
def test_layout_for(requested, pp, variable, expected):
    assert layouts.layout_for(requested, pp=pp, variable_seq_lengths=variable) == expected


def test_an_unknown_layout_is_refused_naming_the_setting():
    from megatron.bridge_thd.settings import PackingSettings, settings_of

    # A run's layout comes from the settings record, which refuses an unknown one when it is made (hand-set too).
    refusal = r"dataset.bridge_thd \(megatron.bridge_thd's settings\):\n- layout: 'sbhd' is not one of \('thd', " \
        r"'thd_static', 'bshd'\)"
    with pytest.raises(ValueError, match="^" + refusal):
        PackingSettings(layout="sbhd")
    # Hand-set: the message names the attribute the user set, then the record's refusal.
    with pytest.raises(ValueError, match=r"^the hand-set settings of cfg.dataset \(dataset.packing_layout='sbhd'; .*\): "
                       + refusal):
        settings_of(SimpleNamespace(packing_layout="sbhd"))
    # layout_for's own argument check names its argument.
    with pytest.raises(ValueError, match=r"^requested: 'sbhd' is not one of \('thd', 'thd_static', 'bshd'\)"):
        layouts.layout_for("sbhd", pp=1, variable_seq_lengths=False)


def test_bshd_width_is_megatron_bridges():
    """Megatron-Bridge 0.6.2's _pad_and_pack_qwen3_vl_step: divisor tp * 2cp (CP) or tp, lcm 16
    (use_fp8_padding=True), seq_length when PP or EP > 1."""
    assert layouts.bshd_width(601, seq_length=2048, tp=1, cp=1, pp=1, ep=1) == 608
    assert layouts.bshd_width(601, seq_length=2048, tp=4, cp=4, pp=1, ep=1) == 608  # lcm(32, 16) = 32 -> 608
    assert layouts.bshd_width(611, seq_length=2048, tp=4, cp=4, pp=1, ep=1) == 640
    assert layouts.bshd_width(601, seq_length=2048, tp=1, cp=1, pp=2, ep=1) == 2048
    assert layouts.bshd_width(4000, seq_length=2048, tp=1, cp=1, pp=1, ep=8) == 2048
