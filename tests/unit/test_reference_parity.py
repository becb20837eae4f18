"""Packed == unpacked: the THD reference forward against every sample run alone.

"Alone" is the unmodified Hugging Face Qwen3-VL forward on one sample (no padding, Hugging
Face's own MRoPE from ``mm_token_type_ids``): the ground truth a packed or padded batch must
reproduce. For each real token we compare the full log-softmax and the log-probability of the
next token (the label), through

    token_mult_prob_error = mean over real tokens with a next token of exp(|logp_a - logp_b|)

which is 1 for identical models. Degenerate 1D positions (what a packer that ignores MRoPE
feeds the model) must be caught by the same check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from _vlm_samples import IGNORE_INDEX, VLMBatch, collate, make_batch, sample_from_layout
from megatron.bridge_thd.packing import pack_bshd_to_thd, unpack_thd_to_bshd
from megatron.bridge_thd_cpu.reference import ReferenceQwen3VL

MAX_LOGPROB_DIFF = 1e-4
MAX_TOKEN_MULT_PROB_ERROR = 1.0001
DEGENERATE_MIN_DIFF = 1e-2
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-7
ALIGN = 8

IMAGE_AND_VIDEO = [3, ("image", 8, 4), 2, ("video", 2, 4, 4), 3, ("image", 4, 12), 1]
BATCH_SEEDS = {1: 101, 4: 104, 16: 116}
ROW_LENGTH = {1: 96, 4: 100, 16: 120}


def parity_batch(batch_size: int, padding_side: str = "right") -> VLMBatch:
    """Random samples (0-3 images of mixed sizes, some videos, 4..row-length tokens); batches
    of 4+ also hold one sample with images and a video together."""
    seed, row = BATCH_SEEDS[batch_size], ROW_LENGTH[batch_size]
    if batch_size == 1:
        samples = [sample_from_layout([7, ("image", 12, 8), 20, ("image", 4, 4), 30], seed=seed)]
    else:
        samples = make_batch(seed, batch_size - 1, row, video_prob=0.3).samples
        samples.append(sample_from_layout(IMAGE_AND_VIDEO, seed=seed))
    batch = collate(samples, padding_side, row_length=max(row, max(len(s) for s in samples)))
    assert any(s.image_grids for s in batch.samples)
    if batch_size >= 4:
        assert any(s.video_grids for s in batch.samples) and any(not s.has_vision for s in batch.samples)
    return batch


def token_mult_prob_error(logp_a: torch.Tensor, logp_b: torch.Tensor) -> float:
    return torch.exp((logp_a - logp_b).abs()).mean().item()


def next_token_logprobs(logits: torch.Tensor, input_ids: list[int]) -> torch.Tensor:
    """``(L, V)`` logits of one sample -> ``(L - 1,)`` log-probabilities of the next tokens."""
    targets = torch.tensor(input_ids[1:], dtype=torch.long)
    return logits[:-1].float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]


def compare(per_sample_logits: list[torch.Tensor], alone: list[torch.Tensor], batch: VLMBatch) -> dict:
    """Per-sample max |log_softmax difference| and batch token_mult_prob_error."""
    max_diff, logp_a, logp_b = [], [], []
    for logits, reference, sample in zip(per_sample_logits, alone, batch.samples):
        assert logits.shape == reference.shape == (len(sample), reference.shape[-1])
        diff = (logits.float().log_softmax(-1) - reference.float().log_softmax(-1)).abs().max().item()
        max_diff.append(diff)
        logp_a.append(next_token_logprobs(logits, sample.input_ids))
        logp_b.append(next_token_logprobs(reference, sample.input_ids))
    per_sample_error = [token_mult_prob_error(a, b) for a, b in zip(logp_a, logp_b)]
    return dict(
        max_diff=max_diff,
        error=token_mult_prob_error(torch.cat(logp_a), torch.cat(logp_b)),
        per_sample_error=per_sample_error,
    )


def assert_parity(result: dict, label: str) -> None:
    print(
        f"\n[parity] {label}: max|dlogp|={max(result['max_diff']):.3e} "
        f"token_mult_prob_error={result['error']:.8f} (worst sample {max(result['per_sample_error']):.8f})"
    )
    assert max(result["max_diff"]) <= MAX_LOGPROB_DIFF, (label, result["max_diff"])
    assert result["error"] <= MAX_TOKEN_MULT_PROB_ERROR, (label, result["error"])
    assert max(result["per_sample_error"]) <= MAX_TOKEN_MULT_PROB_ERROR, (label, result["per_sample_error"])


def hf_alone_logits(ref: ReferenceQwen3VL, sample) -> torch.Tensor:
    """The unmodified Hugging Face forward on one sample: ``(L, V)``."""
    return ref.hf_model(
        input_ids=sample.ids(), mm_token_type_ids=sample.mm_token_type_ids(), **sample.vision_kwargs()
    ).logits[0]


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return ReferenceQwen3VL.tiny(seed=0)


@pytest.fixture(scope="module")
def moe():
    torch.manual_seed(0)
    return ReferenceQwen3VL.tiny(seed=0, moe=True)


_ALONE_CACHE: dict = {}


def alone_logits(ref: ReferenceQwen3VL, batch_size: int) -> list[torch.Tensor]:
    key = (id(ref), batch_size)
    if key not in _ALONE_CACHE:
        batch = parity_batch(batch_size)
        with torch.no_grad():
            _ALONE_CACHE[key] = [hf_alone_logits(ref, s) for s in batch.samples]
    return _ALONE_CACHE[key]


def packed_logits(ref, batch: VLMBatch, *, mode: str, positions: str) -> tuple[list[torch.Tensor], object]:
    """Pack the batch (align_to=8, dynamic or static row), run the THD forward, unpack."""
    if positions == "explicit":
        position_ids = ref.position_ids(batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.video_grid_thw)
    elif positions == "degenerate_1d":
        text_positions = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0) * batch.attention_mask
        position_ids = text_positions[None].expand(3, -1, -1)
    else:
        position_ids = None
    total_length = None
    if mode == "static":
        slots = sum(-(-len(s) // ALIGN) * ALIGN for s in batch.samples)
        total_length = slots + 3 * ALIGN  # a tail segment without real tokens
    packed = pack_bshd_to_thd(
        batch.input_ids,
        batch.attention_mask,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        position_ids=position_ids,
        align_to=ALIGN,
        total_length=total_length,
    )
    assert packed.padding_mask.any(), "the case needs alignment padding slots"
    if mode == "static":
        assert packed.input_ids.shape == (1, total_length)
    with torch.no_grad():
        logits = ref(
            packed.input_ids,
            position_ids=packed.position_ids,
            packed_seq_params=packed.packed_seq_params,
            padding_mask=packed.padding_mask,
            **batch.vision_kwargs(),
        )
    assert logits.shape[:2] == packed.input_ids.shape
    unpacked = unpack_thd_to_bshd(logits, packed)
    return [unpacked[i, batch.token_slices[i]] for i in range(batch.batch_size)], packed


PACKED_CASES = [
    (1, "dynamic", "internal", "right"),
    (4, "dynamic", "explicit", "right"),
    (4, "static", "internal", "left"),
    (16, "dynamic", "internal", "right"),
    (16, "dynamic", "explicit", "left"),
    (16, "static", "explicit", "right"),
]


@pytest.mark.parametrize("batch_size,mode,positions,padding_side", PACKED_CASES)
def test_packed_logits_match_samples_alone(dense, batch_size, mode, positions, padding_side):
    batch = parity_batch(batch_size, padding_side)
    per_sample, _ = packed_logits(dense, batch, mode=mode, positions=positions)
    result = compare(per_sample, alone_logits(dense, batch_size), batch)
    assert_parity(result, f"dense packed B={batch_size} {mode} positions={positions} {padding_side}-padded input")


@pytest.mark.parametrize("batch_size", [4, 16])
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_bshd_padded_logits_match_samples_alone(dense, batch_size, padding_side):
    batch = parity_batch(batch_size, padding_side)
    with torch.no_grad():
        logits = dense(batch.input_ids, attention_mask=batch.attention_mask, **batch.vision_kwargs())
    per_sample = [logits[i, batch.token_slices[i]] for i in range(batch_size)]
    result = compare(per_sample, alone_logits(dense, batch_size), batch)
    assert_parity(result, f"dense BSHD B={batch_size} {padding_side}-padded")


def test_degenerate_1d_positions_are_caught(dense):
    """The check can fail: with 1D positions (three equal channels) every sample holding an
    image or video drifts far beyond the tolerance, text-only samples stay exact."""
    batch = parity_batch(16)
    per_sample, _ = packed_logits(dense, batch, mode="dynamic", positions="degenerate_1d")
    result = compare(per_sample, alone_logits(dense, 16), batch)
    vision = [i for i, s in enumerate(batch.samples) if s.has_vision]
    text = [i for i, s in enumerate(batch.samples) if not s.has_vision]
    vision_diff = [result["max_diff"][i] for i in vision]
    vision_error = [result["per_sample_error"][i] for i in vision]
    print(
        f"\n[parity] dense packed B=16 degenerate 1D positions: vision samples min/max max|dlogp|="
        f"{min(vision_diff):.3e}/{max(vision_diff):.3e}, batch token_mult_prob_error={result['error']:.6f}, "
        f"vision samples worst token_mult_prob_error={max(vision_error):.6f}"
    )
    assert min(vision_diff) > DEGENERATE_MIN_DIFF, vision_diff
    assert result["error"] > MAX_TOKEN_MULT_PROB_ERROR
    assert max(result["max_diff"][i] for i in text) <= MAX_LOGPROB_DIFF


def _masked_loss_grads(ref, loss_fn) -> dict[str, torch.Tensor]:
    ref.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    grads = {
        name: p.grad.detach().clone()
        for name, p in ref.hf_model.named_parameters()
        if p.grad is not None and p.grad.abs().sum() > 0
    }
    ref.zero_grad(set_to_none=True)
    return grads, loss.detach()


def test_gradients_match_samples_alone(dense):
    batch = parity_batch(4)
    packed = pack_bshd_to_thd(
        batch.input_ids,
        batch.attention_mask,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        position_ids=dense.position_ids(batch.input_ids, batch.attention_mask, batch.image_grid_thw, batch.video_grid_thw),
        align_to=ALIGN,
    )

    def packed_loss():
        per_token = dense(
            packed.input_ids,
            position_ids=packed.position_ids,
            labels=packed.labels,
            loss_mask=packed.loss_mask,
            packed_seq_params=packed.packed_seq_params,
            padding_mask=packed.padding_mask,
            **batch.vision_kwargs(),
        )
        return (per_token * packed.loss_mask).sum()

    def alone_loss():
        total = 0.0
        for sample in batch.samples:
            logits = hf_alone_logits(dense, sample)
            labels = torch.tensor(sample.labels())
            per_token = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
            total = total + (per_token * (labels != IGNORE_INDEX).float()).sum()
        return total

    g_packed, loss_packed = _masked_loss_grads(dense, packed_loss)
    g_alone, loss_alone = _masked_loss_grads(dense, alone_loss)
    torch.testing.assert_close(loss_packed, loss_alone, rtol=1e-5, atol=0)
    assert set(g_packed) == set(g_alone)
    # Every parameter, the vision tower's included, takes part in this batch.
    assert set(g_alone) == {name for name, _ in dense.hf_model.named_parameters()}
    assert any(name.startswith("model.visual.") for name in g_alone)
    worst = 0.0
    for name, g in g_alone.items():
        err = (g_packed[name] - g).norm().item()
        ref_norm = g.norm().item()
        worst = max(worst, err / ref_norm)
        assert err <= GRAD_RTOL * ref_norm + GRAD_ATOL, (name, err, ref_norm)
    print(f"\n[parity] gradients B=4: {len(g_alone)} params, worst relative error {worst:.3e}, loss {loss_alone.item():.4f}")


def test_moe_packed_logits_match_samples_alone(moe):
    batch = parity_batch(16)
    per_sample, _ = packed_logits(moe, batch, mode="dynamic", positions="internal")
    result = compare(per_sample, alone_logits(moe, 16), batch)
    assert_parity(result, "MoE packed B=16 dynamic")


def test_moe_router_counts_exclude_padding(moe):
    batch = parity_batch(16)
    with torch.no_grad():
        alone_counts = 0
        for sample in batch.samples:
            moe(sample.ids(), **sample.vision_kwargs())
            alone_counts = alone_counts + moe.router_token_counts
        packed = pack_bshd_to_thd(batch.input_ids, batch.attention_mask, align_to=ALIGN)
        n_padding = int(packed.padding_mask.sum())
        assert n_padding > 0
        kwargs = dict(packed_seq_params=packed.packed_seq_params, **batch.vision_kwargs())
        moe(packed.input_ids, padding_mask=packed.padding_mask, **kwargs)
        packed_counts = moe.router_token_counts
        moe(packed.input_ids, **kwargs)
        counts_with_padding = moe.router_token_counts
        moe(batch.input_ids, attention_mask=batch.attention_mask, **batch.vision_kwargs())
        bshd_counts = moe.router_token_counts

    text_config = moe.config.text_config
    n_real = sum(len(s) for s in batch.samples)
    assert alone_counts.shape == (text_config.num_hidden_layers, text_config.num_experts)
    assert torch.all(alone_counts.sum(-1) == n_real * text_config.num_experts_per_tok)
    assert torch.equal(packed_counts, alone_counts)
    assert torch.equal(bshd_counts, alone_counts)
    # The check can fail: counting the alignment padding slots inflates the totals.
    assert not torch.equal(counts_with_padding, alone_counts)
    assert torch.all(counts_with_padding.sum(-1) == (n_real + n_padding) * text_config.num_experts_per_tok)
