"""plan.peak_memory: model states from Megatron-Bridge's own estimator (hand-counted on a tiny model and
called directly), our activation and loss terms by hand, per-sample CP, and Megatron-Bridge PR 3838's four
Qwen3.5-VL 2B runs (8 x H100 80 GB)."""

from __future__ import annotations

import types
import warnings

import pytest

from megatron.bridge_thd.plan.layouts import Parallel, layout_stats, micro_batches
from megatron.bridge_thd.cost.memory import layer_bytes_per_token, vision_bytes_per_patch
from megatron.bridge_thd.plan.peak_memory import (loss_bytes_per_token, memory_config, mtp_bytes_per_token,
                                                  padded_vocab_size, peak_memory_bytes, row_slots_per_rank,
                                                  upstream_estimate)
from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec, get_preset, replace
from megatron.bridge_thd.plan.roofline import get_gpu
from megatron.bridge_thd.plan.samples import receipt_lengths

warnings.simplefilter("ignore")

TINY = ModelSpec(name="tiny", hf_repo="none", num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                 kv_channels=4, ffn_hidden_size=16, vocab_size=100,
                 vision=VisionSpec(depth=1, hidden_size=4, num_heads=1, intermediate_size=8, out_hidden_size=8))
DP8 = Parallel(gpus=8)


def test_model_states_are_the_upstream_estimators_count_by_hand():
    # Megatron-Bridge's _count_parameters for TINY: attention 2 h^2 (1 + g/a)(a d / h) = 2*64*1.5*1 = 192,
    # norms 4h = 32, SwiGLU 3 h f = 384 per layer; 2 layers + final norm 2h = 1232; embedding and output
    # (untied) 2 * h * 128 (vocab 100 padded to 128) = 2048. Distributed optimizer over DP 8: 6 + 12/8 bytes.
    params = 2 * (192 + 32 + 384) + 16 + 2048
    upstream = upstream_estimate(memory_config(TINY, DP8))
    assert upstream.total_parameters == params
    est = peak_memory_bytes(TINY, DP8, slots_per_rank=10, patches=0, reserved_bytes=0)
    assert est.model_states == pytest.approx(params * 7.5)
    assert est.mixer_states == 0  # plain GQA, no gate, no MTP: the upstream count is ours
    # Without the distributed optimizer: 18 bytes per parameter.
    plain = peak_memory_bytes(TINY, DP8, slots_per_rank=10, patches=0, distributed_optimizer=False, reserved_bytes=0)
    assert plain.model_states == pytest.approx(params * 18)


def test_mtp_layers_are_counted_upstream_and_their_eh_proj_by_us():
    # Upstream appends one dense layer per MTP layer (608 params); eh_proj (2h x h = 128) is ours.
    base = upstream_estimate(memory_config(TINY, DP8)).total_parameters
    assert upstream_estimate(memory_config(TINY, DP8, mtp_layers=1)).total_parameters == base + 608
    est = peak_memory_bytes(TINY, DP8, slots_per_rank=10, patches=0, mtp_layers=1, reserved_bytes=0)
    assert est.mixer_states == pytest.approx(128 * 7.5)


def test_gated_attention_and_gated_deltanet_parameters_are_added_to_the_upstream_count():
    # Output gate: h * q = 8 * 8 = 64 more per attention layer than upstream's GQA count.
    gated = replace(TINY, attention_output_gate=True)
    assert peak_memory_bytes(gated, DP8, slots_per_rank=1, patches=0).mixer_states == pytest.approx(2 * 64 * 7.5)
    # One Gated DeltaNet layer (qk = v = 2*4 = 8, nv = 2, conv 4): h(2qk + 2v + 2nv) + 4(2qk + v) + v h
    # = 8*36 + 4*24 + 64 = 448 vs upstream's 192 for the same layer.
    hybrid = replace(TINY, linear_attention_freq=(1, 0), linear_key_head_dim=4, linear_value_head_dim=4,
                     linear_num_key_heads=2, linear_num_value_heads=2)
    assert peak_memory_bytes(hybrid, DP8, slots_per_rank=1, patches=0).mixer_states == pytest.approx((448 - 192) * 7.5)


def test_vision_states_at_the_estimators_bytes_per_parameter():
    # TINY's ViT: depth 1 x (4 h^2 + 2 h f) = 64 + 64, merger (4*4)^2 + 16*8 = 384: 512 params.
    est = peak_memory_bytes(TINY, DP8, slots_per_rank=1, patches=0)
    assert est.vision_states == pytest.approx(512 * 7.5)


def test_loss_bytes_by_hand():
    v = 128  # padded vocab
    assert padded_vocab_size(TINY) == v and padded_vocab_size(TINY, tp=2) == 256
    assert loss_bytes_per_token(TINY) == 10 * v  # softmax + compiled kernel's fp32 buffer + bf16 grad
    assert loss_bytes_per_token(TINY, fused=False) == 6 * v  # forward 2V + 4V; backward 4V + 2V
    assert loss_bytes_per_token(TINY, mtp_layers=2) == 8 * v + 10 * v  # two MTP softmaxes held
    assert loss_bytes_per_token(TINY, tp=2) == 10 * 256 / 2


def test_activation_parts_by_hand():
    slots, patches = 40, 6
    est = peak_memory_bytes(TINY, DP8, slots_per_rank=slots, patches=patches, mtp_layers=1, reserved_bytes=1.0)
    assert est.decoder == pytest.approx(sum(layer_bytes_per_token(TINY)) * slots)
    assert est.vision == pytest.approx(vision_bytes_per_patch(TINY) * patches)
    assert est.output == 4 * 8 * slots
    # MTP: one TINY layer (it is full attention) + 12 h.
    assert est.mtp == pytest.approx((layer_bytes_per_token(TINY)[0] + 12 * 8) * slots)
    assert est.loss == (4 + 10) * 128 * slots
    parts = est.model_states + est.mixer_states + est.vision_states + est.decoder + est.mtp + est.vision + est.output
    assert est.total == pytest.approx(parts + est.loss + 1.0)
    assert est.fits(est.total) and not est.fits(est.total - 1)


def test_per_sample_cp_takes_the_rank_s_largest_row_over_its_cp():
    assert row_slots_per_rank([(8192, 4), (3000, 1), (4096, 2)]) == 3000
    cp4 = Parallel(cp=4, gpus=8)
    one = peak_memory_bytes(TINY, cp4, slots_per_rank=row_slots_per_rank([(400, 4)]), patches=0)
    assert one.decoder == pytest.approx(sum(layer_bytes_per_token(TINY)) * 100)
    # CP also shards the optimizer (DP 2 x CP 4 = 8 shards), as upstream does.
    assert one.model_states == pytest.approx(peak_memory_bytes(TINY, DP8, slots_per_rank=1, patches=0).model_states)


def test_pipeline_parallel_takes_the_larger_stage():
    pp2 = Parallel(pp=2, gpus=2)
    est = peak_memory_bytes(TINY, pp2, slots_per_rank=10, patches=0, micro_batches=4)
    last = layer_bytes_per_token(TINY)[-1] * 10 + 4 * 8 * 10 + 10 * 128 * 10
    first = layer_bytes_per_token(TINY)[0] * 10 * 2
    assert est.activations == pytest.approx(max(first, last))


def test_legacy_upstream_entry_point_is_used_when_the_structured_one_is_absent(monkeypatch):
    from megatron.bridge_thd.upstream import loading as upstream

    legacy = types.SimpleNamespace(compute_weight_and_optimizer_memory=lambda config: 1234.0)
    monkeypatch.setattr(upstream, "load_theoretical_memory_utils", lambda: legacy)
    est = peak_memory_bytes(TINY, DP8, slots_per_rank=1, patches=0)
    assert est.model_states == 1234.0 and est.upstream_parameters is None
    monkeypatch.setattr(upstream, "load_theoretical_memory_utils", lambda: types.SimpleNamespace())
    with pytest.raises(RuntimeError, match="estimate_training_memory"):
        peak_memory_bytes(TINY, DP8, slots_per_rank=1, patches=0)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="slots_per_rank"):
        peak_memory_bytes(TINY, DP8, slots_per_rank=0, patches=0)
    with pytest.raises(ValueError):
        peak_memory_bytes(TINY, DP8, slots_per_rank=1, patches=-1)


# --- Megatron-Bridge PR 3838: Qwen3.5-VL 2B SFT, cord_v2, 8 x H100 80 GB, seq_length 2048, DP 8, MTP 1 layer.
# BSHD force-pads every sample to 2048; THD holds the real tokens. The runs' peak: the largest micro-batch.
SEQ = 2048


def pr3838_estimate(layout: str, mbs: int):
    spec, samples = get_preset("qwen3.5-vl-2b"), receipt_lengths(800)
    estimates = []
    for batch in micro_batches(samples, mbs, SEQ):
        slots = mbs * SEQ if layout == "bshd" else layout_stats("thd", batch, SEQ, DP8)[0]
        estimates.append(peak_memory_bytes(spec, DP8, slots_per_rank=slots, patches=batch.patches, mtp_layers=1))
    return max(estimates, key=lambda e: e.total)


H100 = get_gpu("h100-sxm").memory_bytes


@pytest.mark.parametrize("layout, mbs", [("bshd", 2), ("thd", 2), ("thd", 4)])
def test_pr3838_runs_that_ran_fit_80_gb(layout, mbs):
    assert pr3838_estimate(layout, mbs).fits(H100)


@pytest.mark.xfail(strict=True, reason="the model, built from upstream code only, puts BSHD MBS 4 at ~64.5 GiB "
                   "(with 5.6 GiB assumed reserved) under 74.5 GiB; the GPU ran out of memory: a term is missing "
                   "(docs/planner.md, Memory model, PR 3838)")
def test_pr3838_bshd_mbs4_does_not_fit_80_gb():
    assert not pr3838_estimate("bshd", 4).fits(H100)


def test_pr3838_bshd_mbs4_is_the_largest_and_its_loss_buffers_the_largest_part():
    bshd4 = pr3838_estimate("bshd", 4)
    others = [pr3838_estimate(*row) for row in (("bshd", 2), ("thd", 2), ("thd", 4))]
    assert all(bshd4.total > e.total for e in others)
    # 8192 slots x (4 + 10) x 248320 bytes: the MTP head's softmax, the main one, the compiled backward's
    # fp32 buffer and the bf16 gradient.
    assert bshd4.loss == 8192 * 14 * 248320
    assert bshd4.loss > bshd4.decoder > bshd4.model_states
