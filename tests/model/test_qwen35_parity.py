"""Packing parity on a tiny Qwen3.5-VL (Gated DeltaNet + full attention, vision tower), built the
way Megatron-Bridge 0.6.2 builds it (``bridge_thd_cpu.qwen35``) with the pure-torch varlen GDN kernels.

``forward_step`` in ``thd`` (with 16-token fp8 alignment padding in every slot),
``thd_static`` (plus a static tail segment) and ``bshd`` must equal each sample run alone
through the same model: per-token log-probabilities, loss sums, token counts, gradients. A
control runs the GDN layers over the packed row without boundaries and must fail visibly.
"""

from __future__ import annotations

import pytest
import torch
from _real_model import trimmed

import megatron.core.ssm.gated_delta_net.gdn as gdn_module
from megatron.bridge_thd_cpu.data import synthetic_receipt_batch
from megatron.bridge_thd_cpu.parity import (
    gradients,
    masked_loss_sum,
    max_abs_dlogp,
    per_sample_from_output,
    per_sample_losses_and_gradients,
    per_sample_token_losses,
    step_run,
    worst_relative_gradient_error,
)
from megatron.bridge_thd_cpu.qwen35 import build_qwen35_vl, gdn_layers, tiny_qwen35_vl_config

DLOGP_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
SEQ_LENGTH = 320  # thd_static: a 3 x 320 row, so a static tail of ~190 padding tokens
FP8 = dict(fp8="hybrid")  # 16-token alignment: every slot below carries alignment padding

# (layout, settings): thd with per-slot alignment padding, thd_static with padding and a static
# tail, thd unaligned, bshd.
CASES = {
    "thd_aligned": ("thd", FP8),
    "thd": ("thd", {}),
    "thd_static_aligned": ("thd_static", FP8),
    "bshd": ("bshd", {}),
}


# World-size-1 process groups and the CPU patches, for every test here (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("real_model_stack")


@pytest.fixture(scope="module")
def model():
    return build_qwen35_vl(tiny_qwen35_vl_config(seq_length=SEQ_LENGTH), seed=0)


@pytest.fixture(scope="module")
def model64():
    """The same model in fp64 (for gradients: in fp32 the smallest-gradient parameters, the GDN
    ``A_log`` of layer 0, sum many cancelling per-token terms and land at ~1e-5 relative from
    shape-dependent fp32 rounding alone; in fp64 the packed-vs-alone error is ~1e-7, the floor
    set by the fp32 casts inside Megatron-Core's GDN, ``_compute_g_and_beta`` and the gated norm)."""
    return build_qwen35_vl(tiny_qwen35_vl_config(seq_length=SEQ_LENGTH), seed=0).double()


@pytest.fixture(scope="module")
def batch():
    # Three image samples cut shortly after their images (lengths 259, 281, 227: none a multiple
    # of 16), right padded.
    return trimmed(synthetic_receipt_batch(3, seed=6), [259, 281, 227])


@pytest.fixture(scope="module")
def batch64(batch):
    batch = dict(batch)
    visual = batch["visual_inputs"]
    batch["visual_inputs"] = type(visual)(**{**vars(visual), "pixel_values": visual.pixel_values.double()})
    return batch


@pytest.fixture(scope="module")
def alone(model, batch):
    with torch.no_grad():
        return per_sample_token_losses(model, batch)


def _run(model, batch, case):
    layout, settings = CASES[case]
    return step_run(model, batch, layout, seq_length=SEQ_LENGTH, **settings)


def test_model_is_hybrid(model):
    kinds = [type(layer.self_attention).__name__ for layer in model.language_model.decoder.layers]
    assert kinds == ["GatedDeltaNet", "Qwen3VLSelfAttention", "GatedDeltaNet", "Qwen3VLSelfAttention"]
    assert all(layer.gated_delta_rule.__module__ == "megatron.bridge_thd_cpu.gdn" for layer in gdn_layers(model))


@pytest.mark.parametrize("case", list(CASES))
def test_per_token_logp_equals_each_sample_alone(model, batch, alone, case):
    with torch.no_grad():
        run = _run(model, batch, case)
    params = run.args["packed_seq_params"]
    if CASES[case][1]:
        padded = (params.cu_seqlens_q_padded[1:4] - params.cu_seqlens_q_padded[:3]).tolist()
        assert padded != batch["attention_mask"].sum(1).tolist()  # the slots carry alignment padding
    if case.startswith("thd_static"):
        cu, cu_padded = params.cu_seqlens_q, params.cu_seqlens_q_padded
        assert cu[-1] == cu[-2] and cu_padded[-1] > cu_padded[-2]  # a static tail without real tokens
    packed = per_sample_from_output(run, batch)
    assert [p.numel() for p in packed] == [a.numel() for a in alone]
    worst = max_abs_dlogp(packed, alone, batch)
    print(f"{case}: max |dlogp| packed vs alone = {worst:.3e}")
    assert worst <= DLOGP_TOLERANCE
    assert float(run.loss) == pytest.approx(masked_loss_sum(alone, batch), rel=1e-6)
    assert int(run.num_tokens) == int(batch["loss_mask"].sum())


@pytest.fixture(scope="module")
def reference_gradients(model64, batch64):
    return per_sample_losses_and_gradients(model64, batch64)[1]


@pytest.mark.parametrize("case", ["thd_aligned", "thd_static_aligned", "bshd"])
def test_gradients_equal_each_sample_alone(model64, batch64, reference_gradients, case):
    model64.zero_grad(set_to_none=True)
    _run(model64, batch64, case).loss.backward()
    packed = gradients(model64)
    model64.zero_grad(set_to_none=True)
    for name in ("A_log", "dt_bias", "conv1d.weight", "in_proj.weight", "vision_model"):
        assert any(float(g.abs().max()) > 0 for n, g in reference_gradients.items() if name in n), name
    error, where = worst_relative_gradient_error(packed, reference_gradients)
    print(f"{case}: worst relative gradient error = {error:.3e} ({where})")
    assert error <= GRAD_TOLERANCE, f"{where}: relative gradient error {error:.2e}"


def test_gdn_without_boundaries_control_fails(model, batch, alone, monkeypatch):
    """The GDN kernels run over the whole packed row (cu_seqlens dropped): the conv window and the
    recurrent state of sample k flow into sample k+1, far beyond tolerance."""

    def without_boundaries(kernel):
        def run(*args, cu_seqlens=None, **kwargs):
            return kernel(*args, **kwargs)

        return run

    monkeypatch.setattr(gdn_module, "causal_conv1d", without_boundaries(gdn_module.causal_conv1d))
    for layer in gdn_layers(model):
        monkeypatch.setattr(layer, "gated_delta_rule", without_boundaries(layer.gated_delta_rule))
    with torch.no_grad():
        run = _run(model, batch, "thd_aligned")
    packed = per_sample_from_output(run, batch)
    first = max_abs_dlogp(packed[:1], alone[:1], batch)
    worst = max_abs_dlogp(packed, alone, batch)
    print(f"leak control: max |dlogp| = {worst:.3e} (first sample {first:.3e})")
    assert first <= DLOGP_TOLERANCE  # causal: the first sample has nothing before it
    assert worst > 1e-3


@pytest.mark.parametrize("case", ["thd_aligned", "thd_static_aligned"])
def test_moe_per_token_logp_equals_each_sample_alone(batch, case, moe_model_and_alone):
    """The MoE variant (Qwen35VLMoEModelProvider's shape: every layer's MLP is 4 experts, top-2)."""
    moe_model, moe_alone = moe_model_and_alone
    assert any("experts" in name for name, _ in moe_model.named_parameters())
    with torch.no_grad():
        run = _run(moe_model, batch, case)
    worst = max_abs_dlogp(per_sample_from_output(run, batch), moe_alone, batch)
    print(f"moe {case}: max |dlogp| packed vs alone = {worst:.3e}")
    assert worst <= DLOGP_TOLERANCE
    assert int(run.num_tokens) == int(batch["loss_mask"].sum())


@pytest.fixture(scope="module")
def moe_model_and_alone(batch):
    moe_model = build_qwen35_vl(tiny_qwen35_vl_config(moe=True, seq_length=SEQ_LENGTH), seed=0)
    with torch.no_grad():
        return moe_model, per_sample_token_losses(moe_model, batch)


def test_gdn_layer_equals_megatron_torch_fallback_on_one_sequence(model, monkeypatch):
    """On one unpacked sequence, a GDN layer through our kernels equals the same layer through
    Megatron-Core's own deterministic-mode path (``F.conv1d`` + ``torch_chunk_gated_delta_rule``),
    which cannot take cu_seqlens: the kernels are wired in as Megatron-Core calls fla's."""
    from megatron.bridge_thd_cpu.gdn import megatron_torch_rule

    torch_chunk_gated_delta_rule = megatron_torch_rule()

    layer = gdn_layers(model)[0]
    hidden = torch.randn(70, 2, model.language_model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = layer(hidden, attention_mask=None)
        monkeypatch.setattr(layer.config, "deterministic_mode", True)
        monkeypatch.setattr(layer, "gated_delta_rule", torch_chunk_gated_delta_rule)
        theirs, _ = layer(hidden, attention_mask=None)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().max() > 1e-3
