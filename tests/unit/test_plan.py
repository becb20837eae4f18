"""bridge-thd plan: counts against hand computation, the trainer FLOPs formula term by term, the
memory formula on a hand case, errors, the PNG and the CLI."""

from __future__ import annotations

import json
import warnings

import pytest

from megatron.bridge_thd.plan.estimate import PlanSettings, plan
from megatron.bridge_thd.cost.sample_lengths import SampleLengths, load_lengths
from megatron.bridge_thd.plan.cli import main
from megatron.bridge_thd.cost.flops import flops_config, micro_batch_flops, moe_routed_tokens
from megatron.bridge_thd.plan.layouts import Parallel, layout_stats, micro_batches
from megatron.bridge_thd.cost.memory import layer_bytes_per_token, parameter_counts
from megatron.bridge_thd.plan.memory import cuda_graph_bytes, graph_static_bytes, model_state_bytes
from megatron.bridge_thd.cost.presets import ModelSpec, VisionSpec, get_preset, replace, spec_from_hf_config

warnings.simplefilter("ignore")

TINY = ModelSpec(name="tiny", hf_repo="none", num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                 kv_channels=4, ffn_hidden_size=16, vocab_size=128,
                 vision=VisionSpec(depth=1, hidden_size=4, num_heads=1, intermediate_size=8, out_hidden_size=8))


def _samples(*lengths, patches=0, image_end=None):
    """Samples with one image of ``patches`` patches each (if > 0), its tokens ending at ``image_end``."""
    return SampleLengths(tuple(lengths), tuple(((1, 2, patches // 2),) if patches else () for _ in lengths),
                         image_ends=None if image_end is None else (image_end,) * len(lengths))


def test_token_slots_and_attention_work_per_layout_by_hand():
    batch = micro_batches(_samples(5, 3, 9, 7), micro_batch_size=2, seq_length=8)
    # truncation: 9 -> 8; groups (5, 3), (8, 7)
    assert [b.lengths for b in batch] == [(5, 3), (8, 7)] and batch[1].truncated == 1
    one = Parallel(gpus=1)
    assert layout_stats("bshd", batch[0], 8, one) == (2 * 16, 2 * 16 * 16)  # width 5 -> 16 (Bridge's fp8 multiple)
    assert layout_stats("thd", batch[0], 8, one) == (8, 25 + 9)
    assert layout_stats("thd_static", batch[0], 8, one) == (16, 25 + 9)
    cp2 = Parallel(cp=2, gpus=2)  # align 4: 5 -> 8, 3 -> 4
    assert layout_stats("thd", batch[0], 8, cp2) == (12, 34)
    tp2cp2 = Parallel(tp=2, cp=2, gpus=4)  # align 2*cp*tp = 8 with sequence parallel
    assert layout_stats("thd", batch[0], 8, tp2cp2) == (16, 34)
    assert layout_stats("thd_static", batch[0], 10, tp2cp2) == (2 * 16, 34)
    assert layout_stats("thd", batch[0], 8, Parallel(tp=2, gpus=2, sequence_parallel=False)) == (8, 34)


@pytest.mark.parametrize("parallel", [Parallel(pp=2, gpus=2), Parallel(ep=2, gpus=2)])
def test_pp_or_ep_force_bshd_to_seq_length(parallel):
    (batch,) = micro_batches(_samples(5, 3), micro_batch_size=2, seq_length=100)
    assert layout_stats("bshd", batch, 100, parallel) == (200, 2 * 100**2)
    assert layout_stats("thd", batch, 100, parallel) == (8, 34)


def test_flops_terms_scale_with_the_right_accumulator():
    spec = get_preset("qwen3-vl-8b")
    cfg = flops_config(spec)
    base = micro_batch_flops(cfg, 2, 1000, 600_000, 0)
    doubled_sq = micro_batch_flops(cfg, 2, 1000, 1_200_000, 0)
    doubled_slots = micro_batch_flops(cfg, 2, 2000, 600_000, 0)
    assert base.vision == 0 and base.attention_core > 0
    assert doubled_sq.linear == pytest.approx(base.linear) and doubled_sq.attention_core == pytest.approx(2 * base.attention_core)
    # slots scale the linear terms; the attention core depends on sum s^2 only
    assert doubled_slots.linear == pytest.approx(2 * base.linear)
    assert doubled_slots.attention_core == pytest.approx(base.attention_core)


def test_flops_match_a_hand_evaluation_for_a_tiny_dense_model():
    h, q, kv, f, L, V = 8, 8, 4, 16, 2, 128  # padded vocab = 128 (multiple of 128)
    s, sq, b = 10, 60, 2
    linear = s * (6 * h * 3 * f * L + 6 * L * (h * (q + 2 * kv) + q * h) + 6 * h * V)
    attention = 6 * L * q * sq  # 3 (fwd+bwd) * 2 (FMA) * q * sum s^2 per layer (causal half of QK^T and AV)
    got = micro_batch_flops(flops_config(TINY), b, s, sq, 0)
    assert got.linear == pytest.approx(linear) and got.attention_core == pytest.approx(attention)
    # ViT per image: 8 h^2 + 4 h n + 4 h f per patch per layer, + merger, times 3
    n, hv, fv = 8, 4, 8
    vit_per_image = 3 * (n * (8 * hv**2 + 4 * hv * n + 4 * hv * fv) + (n // 4) * (2 * 16 * 16 + 2 * 16 * 8))
    assert micro_batch_flops(flops_config(TINY), b, s, sq, b * n).vision == pytest.approx(b * vit_per_image)


def test_moe_routed_tokens_are_slots_times_topk_per_layer():
    spec = get_preset("qwen3-vl-30b-a3b")
    assert moe_routed_tokens(spec, 1000) == 1000 * 8 * 48
    assert moe_routed_tokens(get_preset("qwen3-vl-8b"), 1000) == 0


def test_activation_formula_on_a_hand_case():
    # one attention layer: 4h norms + (2h + 2(q+2kv) + 2q + 4 heads) + MLP (2h + 6f)
    h, q, kv, f, heads = 8, 8, 4, 16, 2
    per_layer = 4 * h + (2 * h + 2 * (q + 2 * kv) + 2 * q + 4 * heads) + (2 * h + 6 * f)
    assert layer_bytes_per_token(TINY) == [per_layer, per_layer]
    assert layer_bytes_per_token(TINY, tp=2) == [per_layer / 2] * 2
    assert layer_bytes_per_token(TINY, tp=2, sequence_parallel=False) == [8 * h + (per_layer - 8 * h) / 2] * 2
    # Korthikanti check: MHA, f = 4h, two-matrix MLP -> 32h (their 34h without the dropout masks)
    mha = replace(TINY, num_query_groups=2, ffn_hidden_size=32)
    no_lse = layer_bytes_per_token(mha)[0] - 4 * 2
    assert no_lse - 2 * 32 == 32 * h  # our MLP is gated (4f + 2f); a plain MLP stores 2f + 2f


def test_cuda_graph_memory_of_several_rows_on_a_hand_case():
    # TINY: 216 activation bytes per token per layer (test above: 32 + 72 + 112), 2 layers -> 432 per token.
    # Static buffers per token: hidden states + gradients at the 3 layer boundaries, bf16 h = 8 -> 2 * 3 * 16,
    # and the fp32 rotary table of head dim 4 -> 16: 112 bytes.
    assert graph_static_bytes(TINY, Parallel(), 10) == 10 * 112
    g = cuda_graph_bytes(TINY, Parallel(), (10, 20, 40))
    assert g.layers == (10 * 432, 20 * 432, 40 * 432) and g.static == (10 * 112, 20 * 112, 40 * 112)
    # one shared pool: the longest row's activations + the shorter rows' static buffers; separate: every row's
    assert g.shared == 40 * 432 + (10 + 20) * 112 and g.separate == (10 + 20 + 40) * 432
    one = cuda_graph_bytes(TINY, Parallel(), (40,))
    assert one.shared == one.separate == 40 * 432
    # TP 2 with SP halves the hidden states (not the rotary table); CP 2 halves the tokens
    assert graph_static_bytes(TINY, Parallel(tp=2, gpus=2), 10) == 10 * (2 * 3 * 8 + 16)
    assert graph_static_bytes(TINY, Parallel(tp=2, gpus=2, sequence_parallel=False), 10) == 10 * 112
    assert graph_static_bytes(TINY, Parallel(cp=2, gpus=2), 10) == 5 * 112
    with pytest.raises(ValueError, match="PP > 1"):
        cuda_graph_bytes(TINY, Parallel(pp=2, gpus=2), (10, 20))


def test_model_states_count_the_named_sizes():
    assert sum(parameter_counts(get_preset("qwen3-vl-8b")).values()) == pytest.approx(8.7e9, rel=0.03)
    assert sum(parameter_counts(get_preset("qwen3-vl-30b-a3b")).values()) == pytest.approx(31e9, rel=0.03)
    assert sum(parameter_counts(get_preset("qwen3.5-vl-2b")).values()) == pytest.approx(2.0e9, rel=0.05)
    spec = get_preset("qwen3-vl-8b")
    one, eight = model_state_bytes(spec, Parallel(gpus=1)), model_state_bytes(spec, Parallel(gpus=8))
    params = sum(parameter_counts(spec).values())
    assert one == pytest.approx(18 * params) and eight == pytest.approx(params * (6 + 12 / 8))


def test_plan_rows_are_consistent():
    samples = _samples(*([300, 1200, 700, 2500] * 4), patches=400, image_end=120)
    p = plan(get_preset("qwen3-vl-8b"), samples, PlanSettings(2048, 4, Parallel(tp=2)))
    bshd, thd, static = (p.layouts[k] for k in ("bshd", "thd", "thd_static"))
    assert thd.slots == pytest.approx(300 + 1200 + 700 + 2048)  # align 2, all even
    assert bshd.slots == 4 * 2048 and static.slots == 4 * 2048
    assert thd.flops.vision == bshd.flops.vision > 0
    assert thd.flops.total < bshd.flops.total and thd.step_s < bshd.step_s and p.speedup() > 1
    assert thd.activation_peak < bshd.activation_peak


def test_bad_preset_and_sizes_raise_clear_errors():
    with pytest.raises(ValueError, match="valid presets: .*qwen3-vl-8b"):
        get_preset("qwen3-vl-7b")
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batches(_samples(3), micro_batch_size=0, seq_length=8)
    with pytest.raises(ValueError, match="not divisible by tp\\*cp\\*pp"):
        Parallel(tp=3, gpus=8)


def test_lengths_files_and_their_errors(tmp_path):
    good = tmp_path / "l.csv"
    good.write_text("text_tokens,images\n57,1x52x24\n10,\n")
    s = load_lengths(good)
    assert s.tokens == (57 + 52 * 24 // 4, 10) and s.patches(0) == 52 * 24
    js = tmp_path / "l.json"
    js.write_text(json.dumps({"samples": [{"text_tokens": 5, "images": [[1, 4, 4], [1, 2, 2]]}]}))
    assert load_lengths(js).tokens == (5 + 4 + 1,)
    bad = tmp_path / "bad.csv"
    bad.write_text("text_tokens,images\n57,1x52x24\nabc,1x4x4\n")
    with pytest.raises(ValueError, match=r"bad\.csv: line 3: field 'text_tokens'"):
        load_lengths(bad)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('[{"text_tokens": 5, "images": [[1, 4]]}]')
    with pytest.raises(ValueError, match=r"bad\.json: sample 0: field 'images'"):
        load_lengths(bad_json)
    with pytest.raises(ValueError, match="missing.json: lengths file not found"):
        load_lengths(tmp_path / "missing.json")


def test_hf_config_parses_into_the_preset_fields(tmp_path):
    config = {"text_config": {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
              "vision_config": {"depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
                                "patch_size": 16, "spatial_merge_size": 2, "out_hidden_size": 4096}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = spec_from_hf_config(path)
    preset = get_preset("qwen3-vl-8b")
    for field in ("num_layers", "hidden_size", "num_query_groups", "kv_channels", "ffn_hidden_size", "vocab_size", "vision"):
        assert getattr(spec, field) == getattr(preset, field)
    del config["text_config"]["vocab_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'vocab_size' is missing"):
        spec_from_hf_config(path)


def test_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron.bridge_thd.plan.plot import write_plot

    p = plan(get_preset("qwen3-vl-2b"), _samples(300, 900, 500, 1500, patches=200), PlanSettings(2048, 2))
    out = write_plot(p, tmp_path / "plan.png")
    assert out.stat().st_size > 1000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_three_layouts(capsys, tmp_path):
    assert main(["--model", "qwen3-vl-30b-a3b", "--num-samples", "64", "--ep", "8", "--png", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    for layout in ("| bshd |", "| thd |", "| thd_static |"):
        assert layout in out
    assert "forced to seq_length" in out
    assert main(["--model", "nope"]) == 2
    assert "valid presets" in capsys.readouterr().err
    assert main(["--model", "qwen3-vl-8b", "--ep", "2"]) == 2  # dense model


@pytest.mark.slow  # the fit table's placements: ~20 s
def test_calibration_prints_the_parameters_the_fit_and_the_held_out_tables(capsys):
    assert main(["--calibrate"]) == 0
    out = capsys.readouterr().out
    assert "| `per_step_s` |" in out and "| fitted on megatron-lm-dynamic-cp |" in out
    assert "Fit: Megatron-LM's dynamic context parallelism example" in out
    assert "Held out: Megatron-Bridge PR 3838" in out and "Held out: verl PR 6555" in out
    assert "| MBS 2 THD | 342 ms |" in out and "| bshd MBS 4 | out of memory |" in out


# --- seq_length that would cut images: refused, as the step refuses it -------------------------


def test_receipt_lengths_match_the_batches_the_step_sees():
    """receipt_lengths(n, seed) describes synthetic_receipt_batch(n, seed=seed) sample by sample:
    token counts, patches and where the image tokens end."""
    from megatron.bridge_thd.plan.samples import receipt_lengths
    from megatron.bridge_thd_cpu.data import ReceiptSpec, synthetic_receipt_batch

    samples = receipt_lengths(6, seed=5)
    batch = synthetic_receipt_batch(6, seed=5)
    keep = batch["attention_mask"].bool()
    assert samples.tokens == tuple(keep.sum(1).tolist())
    assert [samples.patches(i) for i in range(6)] == batch["visual_inputs"].image_grid_thw.prod(1).tolist()
    image = batch["tokens"] == ReceiptSpec().image_token_id
    last = image.shape[1] - image.flip(1).int().argmax(1)  # one past the last image token (right padding)
    assert samples.image_ends == tuple(last.tolist())


def test_planner_refuses_exactly_the_seq_lengths_the_step_refuses():
    """Around every sample's image end (and its length), the step's truncation check and the
    planner agree on which seq_length cuts an image."""
    from megatron.bridge_thd.plan.samples import receipt_lengths
    from megatron.bridge_thd.plan.samples import check_seq_length
    from megatron.bridge_thd.qwen3_vl_step import truncate_to_seq_length
    from megatron.bridge_thd_cpu.data import ReceiptSpec, synthetic_receipt_batch

    spec = ReceiptSpec()
    uncuttable_ids = (spec.image_token_id,)  # the receipts hold images only
    batch = synthetic_receipt_batch(4, seed=2)
    samples = receipt_lengths(4, seed=2)
    keep = batch["attention_mask"].bool()
    candidates = sorted({e + d for e in samples.image_ends for d in (-1, 0)} | {n - 1 for n in samples.tokens})
    refused_by_both = 0
    for seq_length in candidates:
        _, _, checks = truncate_to_seq_length(keep, batch["tokens"], seq_length, uncuttable_ids)
        step_refuses = any(bool(c.failed) for c in checks)
        try:
            check_seq_length(samples, seq_length)
            planner_refuses = False
        except ValueError:
            planner_refuses = True
        assert planner_refuses == step_refuses, seq_length
        refused_by_both += step_refuses
    assert 0 < refused_by_both < len(candidates)  # both outcomes were exercised
    # text-only truncation is fine for both: the micro-batches count the truncated tokens
    longest = max(samples.tokens)
    batches = micro_batches(samples, 4, longest - 3)
    assert batches[0].truncated == 3 and max(batches[0].lengths) == longest - 3


def test_cli_names_seq_length_the_cut_image_and_the_fix(capsys):
    assert main(["--model", "qwen3-vl-8b", "--num-samples", "256", "--seq-length", "512"]) == 2
    err = capsys.readouterr().err
    assert "bridge-thd plan: error: --seq-length 512 would cut images" in err
    assert "has image tokens up to token" in err and "Raise --seq-length to at least" in err


def test_lengths_files_without_image_end_refuse_a_possible_cut(tmp_path):
    path = tmp_path / "l.csv"
    path.write_text("text_tokens,images\n300,1x8x8\n500,\n")  # 316 and 500 tokens
    samples = load_lengths(path)
    assert samples.image_ends is None and samples.image_end(1) == 0
    micro_batches(samples, 1, 400)  # only the text-only sample is truncated: fine
    with pytest.raises(ValueError, match=r"--seq-length 300 may cut images.*sample 0.*'image_end'.*at least 316"):
        micro_batches(samples, 1, 300)
    path.write_text("text_tokens,images,image_end\n300,1x8x8,20\n500,,\n")  # image tokens end at 20
    samples = load_lengths(path)
    assert samples.image_ends == (20, None)
    assert micro_batches(samples, 2, 20)[0].truncated == 316 - 20 + 500 - 20
    with pytest.raises(ValueError, match=r"--seq-length 19 would cut images.*sample 0 \(316 tokens\).*up to token 20"):
        micro_batches(samples, 2, 19)
    js = tmp_path / "l.json"
    js.write_text(json.dumps([{"text_tokens": 5, "images": [[1, 4, 4]], "image_end": 3}]))
    with pytest.raises(ValueError, match=r"sample 0: field 'image_end': expected an int in \[4, 9\]"):
        load_lengths(js)
    js.write_text(json.dumps([{"text_tokens": 5, "image_end": 2}]))
    with pytest.raises(ValueError, match="field 'image_end': 2 for a sample without images"):
        load_lengths(js)
