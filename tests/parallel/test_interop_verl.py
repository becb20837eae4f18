"""VERL's packed-sequence helpers, vectorised (``megatron.bridge_thd.interop.verl``).

Unit part (no model): on random VERL-layout masks (left-padded prompt + right-padded response)
of several dtypes, the packed row holds exactly the real tokens in order at aligned slots, the
real and padded boundaries are the ones the mask defines (expectations written from the
definition in plain Python, CP rows re-assembled by the zigzag rule written out here), unpacking
round-trips, bad input raises ValueError naming the argument, and the op count does not depend on
B with at most one host sync per call. FP8 padding where the model packs the batch itself is
refused; a 2D mask value other than 0 / 1 is one error with one message for the step and the
drop-in (``lengths.keep_mask_from_2d``), at the host-sync counts of a 0/1 mask.

Real-model part: Megatron-Bridge 0.6.2's ``Qwen3VLModel`` (CPU build) called the two ways VERL
calls it (:mod:`megatron.bridge_thd_testbed.verl_support`): the packed call (``input_ids_rmpad``,
packed 3D MRoPE ``position_ids``, ``packed_seq_params``, no labels) at CP = 1 (this process), 2 and
4 (gloo, one spawn each), with FP8 padding at CP = 1 and 2; VERL's own vision-model call (the
padded batch to the model, which packs it) at CP = 1 and 2. Per-token log-probabilities of the
response tokens and the parameter gradients of a loss taken through ``postprocess_packed_seqs``
equal each sample run alone. When VERL 0.9.1's ``util.py`` can be found (installed,
``BRIDGE_THD_VERL_UTIL``, or downloaded into the cache), our rows and boundaries are checked
against VERL's own functions, which run the same calls.
"""

from __future__ import annotations

import math

import pytest
from _packing_helpers import round_up
import torch

import megatron.bridge_thd.interop.verl as verl_interop
from megatron.bridge_thd.lengths import keep_mask_from_attention_mask, raise_failed_checks
from megatron.bridge_thd_testbed import verl_support
from megatron.bridge_thd_testbed.launcher import run_on_gloo
from megatron.bridge_thd_testbed.opcount import count_ops
from megatron.bridge_thd_testbed.verl_support import (
    DEFAULT_SPECS,
    find_verl_util,
    load_verl_util,
    per_sample_response_logp,
    summed_gradient_error,
    train_vs_rollout,
    verl_vlm_batch,
    vlm_path_forward,
)

DLOGP_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
FP8_ROW_FACTOR = 128  # VERL's _compute_fp8_thd_align_size: the row is a multiple of align * 128


# ---------------------------------------------------------------------------------------------
# VERL-layout batches and the expectations, from the definition


def verl_layout_mask(batch: int, prompt_width: int, response_width: int, seed: int, dtype=torch.bool) -> torch.Tensor:
    """``(B, P + R)``: prompt lengths in [1, P] left-padded, response lengths in [0, R] right-padded."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, prompt_width + 1, (batch,), generator=gen)
    response = torch.randint(0, response_width + 1, (batch,), generator=gen)
    keep = torch.cat([
        torch.arange(prompt_width)[None, :] >= (prompt_width - prompt)[:, None],
        torch.arange(response_width)[None, :] < response[:, None],
    ], dim=1)
    return keep.to(dtype)




def expected_layout(keep: torch.Tensor, tp: int, cp: int, fp8: bool) -> tuple[list[int], list[int]]:
    """VERL's alignment rule written out: (real cu_seqlens, padded cu_seqlens)."""
    align = tp * cp * 2 if cp > 1 else tp
    slot_align = math.lcm(align, 16) if fp8 else align
    lengths = [int(sum(bool(v) for v in row)) for row in keep.tolist()]
    real, padded = [0], [0]
    for n in lengths:
        real.append(real[-1] + n)
        padded.append(padded[-1] + round_up(n, slot_align))
    if fp8:
        padded[-1] = round_up(padded[-1], align * 128)
    return real, padded


def zigzag_assemble(local_rows: list[list], cu_padded: list[int]) -> list:
    """The full row from every rank's local row: rank r holds chunks r and 2cp-1-r of every segment."""
    cp = len(local_rows)
    full = [None] * cu_padded[-1]
    cursor = [0] * cp
    for start, end in zip(cu_padded[:-1], cu_padded[1:]):
        chunk = (end - start) // (2 * cp)
        for r in range(cp):
            for c in (r, 2 * cp - 1 - r):
                for j in range(chunk):
                    full[start + c * chunk + j] = local_rows[r][cursor[r]]
                    cursor[r] += 1
    assert all(cursor[r] == len(local_rows[r]) for r in range(cp))
    return full


class _FakeParallelState:
    """Megatron-Core's ``parallel_state`` (``megatron/core/parallel_state.py``) as the sizes and
    ranks its getters return for a TP x CP (x PP, virtual PP) layout, for preprocess only (no
    collective is issued there)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def set(self, tp: int, cp: int, rank: int, pp: int = 1, pp_rank: int = 0, vpp: int | None = None):
        from megatron.core import parallel_state

        for name, value in (
            ("model_parallel_is_initialized", True),
            ("get_tensor_model_parallel_world_size", tp),
            ("get_context_parallel_world_size", cp),
            ("get_context_parallel_rank", rank),
            ("get_context_parallel_group", None),
            ("get_pipeline_model_parallel_world_size", pp),
            ("get_pipeline_model_parallel_rank", pp_rank),
            ("get_virtual_pipeline_model_parallel_world_size", vpp),
        ):
            self.monkeypatch.setattr(parallel_state, name, lambda value=value: value)


@pytest.fixture
def fake_mpu(monkeypatch):
    return _FakeParallelState(monkeypatch)


MASK_DTYPES = [torch.bool, torch.int64, torch.int32, torch.uint8, torch.float32, torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# unit: packing layout


@pytest.mark.parametrize("dtype", MASK_DTYPES)
@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_packed_row_holds_real_tokens_in_order_at_aligned_slots(fake_mpu, dtype, tp, cp, fp8):
    seed = 7 * tp + cp + 13 * fp8 + MASK_DTYPES.index(dtype)
    keep = verl_layout_mask(6, 9, 17, seed=seed)
    ids = torch.randint(1, 1000, keep.shape, generator=torch.Generator().manual_seed(seed)) * keep
    mask = keep.to(dtype)
    real, padded = expected_layout(keep, tp, cp, fp8)

    local_rows = []
    for rank in range(cp):
        fake_mpu.set(tp, cp, rank)
        row, params = verl_interop.preprocess_packed_seqs(ids, mask, use_fp8_padding=fp8)
        assert row.shape == (1, padded[-1] // cp) and row.dtype == ids.dtype
        assert params.qkv_format == "thd"
        assert params.cu_seqlens_q.tolist() == real and params.cu_seqlens_kv.tolist() == real
        assert params.cu_seqlens_q_padded.tolist() == padded and params.cu_seqlens_kv_padded.tolist() == padded
        assert params.cu_seqlens_q.dtype == torch.int32 and params.cu_seqlens_q_padded.dtype == torch.int32
        assert params.max_seqlen_q == max(b - a for a, b in zip(padded[:-1], padded[1:]))
        assert params.pad_between_seqs == (real != padded)
        local_rows.append(row[0].tolist())

    full = zigzag_assemble(local_rows, padded) if cp > 1 else local_rows[0]
    for i in range(keep.shape[0]):
        tokens = ids[i][keep[i]].tolist()
        slot = full[padded[i] : padded[i + 1]]
        assert slot[: len(tokens)] == tokens
        assert all(v == 0 for v in slot[len(tokens) :])
    # Every slot's length is a multiple of the alignment (the last one of align * 128 under FP8).
    align = tp * cp * 2 if cp > 1 else tp
    assert all((b - a) % (math.lcm(align, 16) if fp8 else align) == 0 for a, b in zip(padded[:-2], padded[1:-1]))


@pytest.mark.parametrize("trailing", [(3,), (2, 5)])
def test_trailing_dims_are_packed_like_the_ids(fake_mpu, trailing):
    """VERL packs (B, T, ...) values with the same call (position_ids.permute(1, 2, 0), hidden states)."""
    keep = verl_layout_mask(5, 6, 11, seed=3)
    values = torch.randn(*keep.shape, *trailing)
    for cp in (1, 2):
        _, padded = expected_layout(keep, 1, cp, False)
        rows = []
        for rank in range(cp):
            fake_mpu.set(1, cp, rank)
            row, _ = verl_interop.preprocess_packed_seqs(values, keep.long())
            assert row.shape == (1, padded[-1] // cp, *trailing)
            rows.append(list(row[0].unbind(0)))
        full = zigzag_assemble(rows, padded) if cp > 1 else rows[0]
        for i in range(keep.shape[0]):
            real = values[i][keep[i]]
            got = torch.stack(full[padded[i] : padded[i + 1]])
            assert torch.equal(got[: real.shape[0]], real)
            assert got[real.shape[0] :].abs().sum() == 0


def test_mask_dtypes_give_identical_results():
    keep = verl_layout_mask(7, 8, 12, seed=11)
    ids = torch.randint(1, 99, keep.shape) * keep
    reference = verl_interop.preprocess_packed_seqs(ids, keep)
    for dtype in MASK_DTYPES[1:]:
        row, params = verl_interop.preprocess_packed_seqs(ids, keep.to(dtype))
        assert torch.equal(row, reference[0]), dtype
        assert torch.equal(params.cu_seqlens_q, reference[1].cu_seqlens_q), dtype


def test_pre_process_false_returns_input_and_the_same_metadata(fake_mpu):
    fake_mpu.set(2, 2, 1)
    keep = verl_layout_mask(4, 5, 9, seed=2)
    ids = torch.randint(1, 99, keep.shape) * keep
    same, params = verl_interop.preprocess_packed_seqs(ids, keep, pre_process=False)
    _, reference = verl_interop.preprocess_packed_seqs(ids, keep)
    assert same is ids
    assert torch.equal(params.cu_seqlens_q_padded, reference.cu_seqlens_q_padded)
    assert torch.equal(params.cu_seqlens_q, reference.cu_seqlens_q)


@pytest.mark.parametrize("fp8", [False, True])
def test_all_padding_batch_gives_one_aligned_padding_segment(fake_mpu, fp8):
    """VERL would return an empty (1, 0) row; ours is one padding segment of the alignment (2 * cp
    = 4 slots; under FP8 the row is stretched to 4 * 128), split over the 2 ranks."""
    fake_mpu.set(1, 2, 0)
    ids = torch.zeros(3, 10, dtype=torch.long)
    row, params = verl_interop.preprocess_packed_seqs(ids, torch.zeros(3, 10), use_fp8_padding=fp8)
    length = 4 * 128 if fp8 else 4
    assert row.shape == (1, length // 2) and row.abs().sum() == 0
    assert params.cu_seqlens_q_padded.tolist() == [0, 0, 0, 0, length]
    assert params.cu_seqlens_q.tolist() == [0, 0, 0, 0, 0]
    assert params.max_seqlen_q == length
    assert params.pad_between_seqs is True


# ---------------------------------------------------------------------------------------------
# unit: unpacking (CP = 1 here; CP = 2 and 4 in the gloo workers below)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("fp8", [False, True])
def test_postprocess_round_trips_values_with_zeros_at_padding(dtype, fp8):
    keep = verl_layout_mask(6, 7, 15, seed=5)
    batch, width = keep.shape
    values = torch.randn(batch, width, 4, requires_grad=True)
    row, params = verl_interop.preprocess_packed_seqs(values.detach(), keep.to(dtype), use_fp8_padding=fp8)
    row.requires_grad_(True)
    out = verl_interop.postprocess_packed_seqs(row, params, keep.to(dtype), batch, width)
    assert out.shape == (batch, width, 4)
    assert torch.equal(out.detach(), torch.where(keep[..., None], values.detach(), 0.0))
    # Autograd: each real slot gets its position's upstream gradient, padding slots none.
    upstream = torch.randn(batch, width, 4)
    out.backward(upstream)
    _, padded = expected_layout(keep, 1, 1, fp8)
    expected = torch.zeros_like(row)
    for i in range(batch):
        n = int(keep[i].sum())
        expected[0, padded[i] : padded[i] + n] = upstream[i][keep[i]]
    assert torch.equal(row.grad, expected)


def test_postprocess_post_process_false_returns_output():
    output = torch.randn(1, 5, 3)
    params = verl_interop.preprocess_packed_seqs(torch.ones(1, 5, dtype=torch.long), torch.ones(1, 5))[1]
    assert verl_interop.postprocess_packed_seqs(output, params, torch.ones(1, 5), 1, 5, post_process=False) is output


def test_alias_module_reexports_the_same_functions():
    from megatron.bridge_thd import verl

    assert verl.preprocess_packed_seqs is verl_interop.preprocess_packed_seqs
    assert verl.postprocess_packed_seqs is verl_interop.postprocess_packed_seqs
    assert set(verl.__all__) == {"preprocess_packed_seqs", "postprocess_packed_seqs"}


# ---------------------------------------------------------------------------------------------
# unit: bad input


def _good():
    keep = verl_layout_mask(3, 4, 6, seed=1)
    ids = torch.randint(1, 99, keep.shape) * keep
    row, params = verl_interop.preprocess_packed_seqs(ids, keep)
    return ids, keep, row, params


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(input_ids=torch.arange(5)), "input_ids"),
        (dict(input_ids=[[1, 2]]), "input_ids"),
        (dict(input_ids=torch.zeros(0, 10, dtype=torch.long), attention_mask=torch.zeros(0, 10)), "input_ids"),
        (dict(attention_mask=torch.ones(3, 9)), "attention_mask"),
        (dict(attention_mask=torch.ones(3, 10, 1)), "attention_mask"),
        (dict(attention_mask=[[1] * 10] * 3), "attention_mask"),
        (dict(attention_mask=torch.full((3, 10), 2)), "attention_mask"),  # not 0/1
        (dict(attention_mask=torch.full((3, 10), 0.5)), "attention_mask"),
        (dict(pre_process="False"), "pre_process"),
        (dict(use_fp8_padding=None), "use_fp8_padding"),
    ],
)
def test_preprocess_bad_input_names_the_argument(kwargs, name):
    args = dict(input_ids=torch.ones(3, 10, dtype=torch.long), attention_mask=torch.ones(3, 10, dtype=torch.bool))
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{name}"):
        verl_interop.preprocess_packed_seqs(**args)


def test_postprocess_bad_input_names_the_argument():
    ids, keep, row, params = _good()
    batch, width = keep.shape
    out = torch.randn(1, row.shape[1], 2)
    post = verl_interop.postprocess_packed_seqs
    with pytest.raises(ValueError, match="^output"):
        post(out[0], params, keep, batch, width)
    with pytest.raises(ValueError, match="^output"):  # a row of another length
        post(torch.randn(1, row.shape[1] + 1, 2), params, keep, batch, width)
    with pytest.raises(ValueError, match="^packed_seq_params"):
        post(out, None, keep, batch, width)
    with pytest.raises(ValueError, match="^attention_mask"):
        post(out, params, keep, batch, width + 1)
    with pytest.raises(ValueError, match="^batch_size"):
        post(out, params, keep, 0, width)
    other = keep.clone()
    flip = int(torch.nonzero(~other[0])[0])
    other[0, flip] = True  # one more real token than preprocess saw
    with pytest.raises(ValueError, match="^attention_mask"):
        post(out, params, other, batch, width)
    with pytest.raises(ValueError, match="^post_process"):
        post(out, params, keep, batch, width, post_process="yes")


# ---------------------------------------------------------------------------------------------
# unit: op counts and host syncs


def _count(fn) -> object:
    with count_ops() as counts:
        fn()
    return counts


@pytest.mark.parametrize("tp,cp,rank", [(1, 1, 0), (2, 2, 1), (1, 4, 3)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("trailing", [(), (3,)])
@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_preprocess_op_count_independent_of_batch_size_one_sync(fake_mpu, tp, cp, rank, fp8, trailing, dtype):
    fake_mpu.set(tp, cp, rank)
    results = []
    for batch in (4, 64):
        keep = verl_layout_mask(batch, 16, 48, seed=batch)
        values = torch.randint(1, 99, (*keep.shape, *trailing))
        results.append(_count(lambda: verl_interop.preprocess_packed_seqs(values, keep.to(dtype), use_fp8_padding=fp8)))
    assert results[0].ops > 0
    assert results[0].by_op == results[1].by_op
    assert [r.host_syncs for r in results] == [1, 1], [r.sync_sites for r in results]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_postprocess_op_count_independent_of_batch_size_one_sync(dtype):
    results = []
    for batch in (4, 64):
        keep = verl_layout_mask(batch, 16, 48, seed=batch)
        row, params = verl_interop.preprocess_packed_seqs(torch.ones(keep.shape, dtype=torch.long), keep)
        output = torch.randn(1, row.shape[1], 8)
        mask = keep.to(dtype)
        results.append(_count(lambda: verl_interop.postprocess_packed_seqs(output, params, mask, *keep.shape)))
    assert results[0].by_op == results[1].by_op
    assert [r.host_syncs for r in results] == [1, 1], [r.sync_sites for r in results]


# ---------------------------------------------------------------------------------------------
# VERL's own functions (skipped when verl's util.py cannot be found)


@pytest.fixture(scope="module")
def verl_util_path():
    path, how = find_verl_util()
    if path is None:
        pytest.skip(f"VERL comparison skipped: {how} (set BRIDGE_THD_VERL_UTIL to verl/models/mcore/util.py)")
    return path


@pytest.fixture(scope="module")
def verl_util(verl_util_path):
    return load_verl_util(verl_util_path)


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_same_rows_and_padded_layout_as_verl(fake_mpu, verl_util, tp, cp, fp8):
    """VERL's functions read the same (faked) parallel_state: the local rows, padded boundaries
    and max_seqlen are VERL's; only the real boundaries differ (VERL's equal its padded ones)."""
    keep = verl_layout_mask(6, 9, 23, seed=tp + cp + fp8)
    ids = torch.randint(1, 999, keep.shape) * keep
    positions = torch.randint(0, 60, (3, *keep.shape))
    for rank in range(cp):
        fake_mpu.set(tp, cp, rank)
        theirs_row, theirs = verl_util.preprocess_packed_seqs(ids, keep, True, fp8)
        ours_row, ours = verl_interop.preprocess_packed_seqs(ids, keep.long(), True, fp8)
        assert torch.equal(ours_row, theirs_row)
        assert torch.equal(ours.cu_seqlens_q_padded, theirs.cu_seqlens_q_padded)
        assert ours.max_seqlen_q == theirs.max_seqlen_q
        assert torch.equal(theirs.cu_seqlens_q, theirs.cu_seqlens_q_padded)
        theirs_pos = verl_util.preprocess_packed_seqs(positions.permute(1, 2, 0), keep, True, fp8)[0]
        ours_pos = verl_interop.preprocess_packed_seqs(positions.permute(1, 2, 0), keep, True, fp8)[0]
        assert torch.equal(ours_pos, theirs_pos)
    if cp == 1:
        output = torch.randn(1, ours_row.shape[1], 5)
        assert torch.equal(
            verl_interop.postprocess_packed_seqs(output, ours, keep, *keep.shape),
            verl_util.postprocess_packed_seqs(output, ours, keep, *keep.shape),
        )


def test_counter_sees_verls_per_sample_syncs(fake_mpu, verl_util):
    """The counter can fail: VERL's loop syncs 3 + B times in preprocess and its op count grows."""
    fake_mpu.set(1, 1, 0)
    results = []
    for batch in (4, 16):
        keep = verl_layout_mask(batch, 8, 24, seed=batch)
        ids = torch.ones(keep.shape, dtype=torch.long)
        results.append(_count(lambda: verl_util.preprocess_packed_seqs(ids, keep)))
    assert [r.host_syncs for r in results] == [3 + 4, 3 + 16]
    assert results[1].ops > results[0].ops


def test_verl_crashes_on_an_int_mask_where_ours_does_not(fake_mpu, verl_util):
    fake_mpu.set(1, 1, 0)
    keep = verl_layout_mask(4, 6, 10, seed=9)
    ids = torch.randint(1, 99, keep.shape) * keep
    with pytest.raises((RuntimeError, IndexError)):
        verl_util.preprocess_packed_seqs(ids, keep.long())
    assert torch.equal(verl_interop.preprocess_packed_seqs(ids, keep.long())[0], verl_util.preprocess_packed_seqs(ids, keep)[0])


# ---------------------------------------------------------------------------------------------
# unit: FP8 padding when the model packs the batch itself (VERL's vision-model call)


FP8_REFUSAL = "^use_fp8_padding: True with pre_process=False on the first pipeline stage"


@pytest.mark.parametrize("tp,cp,pp,pp_rank,vpp", [(1, 1, 1, 0, None), (2, 2, 1, 0, None), (1, 2, 2, 0, None)])
def test_fp8_padding_for_a_model_that_packs_itself_is_refused(fake_mpu, tp, cp, pp, pp_rank, vpp):
    """``pre_process=False`` where a model with embeddings runs (no PP, or the first stage) is
    VERL's vision-model call: the model packs the padded batch with its own alignment, so FP8
    boundaries cannot describe its row. Refused before anything runs, for any batch."""
    keep = verl_layout_mask(4, 6, 10, seed=3)
    ids = torch.randint(1, 99, keep.shape) * keep
    for rank in range(cp):
        fake_mpu.set(tp, cp, rank, pp=pp, pp_rank=pp_rank, vpp=vpp)
        with pytest.raises(ValueError, match=FP8_REFUSAL) as error:
            verl_interop.preprocess_packed_seqs(ids, keep, False, True)
        assert "use_fp8_padding=False" in str(error.value) and "pre_process=True" in str(error.value)
        # Without FP8 padding, or when we pack (pre_process=True), the same call is fine.
        verl_interop.preprocess_packed_seqs(ids, keep, False, False)
        verl_interop.preprocess_packed_seqs(ids, keep, True, True)


@pytest.mark.parametrize("pp_rank,vpp", [(1, None), (0, 2)])
def test_fp8_padding_on_a_later_pipeline_stage_gives_the_first_stages_boundaries(fake_mpu, pp_rank, vpp):
    """A text model's later stage (``pre_process=False``: hidden states arrive from the stage that
    packed the row) must get the FP8 boundaries of the first stage's row; with virtual stages the
    chunk is unknown here, so the call is not refused either."""
    keep = verl_layout_mask(5, 6, 12, seed=8)
    ids = torch.randint(1, 99, keep.shape) * keep
    real, padded = expected_layout(keep, 2, 2, True)
    for rank in range(2):
        fake_mpu.set(2, 2, rank, pp=2, pp_rank=pp_rank, vpp=vpp)
        same, params = verl_interop.preprocess_packed_seqs(ids, keep, False, True)
        assert same is ids
        assert params.cu_seqlens_q_padded.tolist() == padded and params.cu_seqlens_q.tolist() == real


# ---------------------------------------------------------------------------------------------
# unit: one 2D mask rule for the step and the VERL drop-in (lengths.keep_mask_from_2d)


def _error_text(fn) -> str:
    with pytest.raises(ValueError) as error:
        fn()
    return str(error.value)


@pytest.fixture(scope="module")
def step_model():
    """The tiny real model for ``prepare_micro_batch`` (only its config, signature and device are read)."""
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    pg = init_single_process_groups()
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(seq_length=1024), seed=0)
    model.pg_collection = pg
    return model


def _prepare(model, batch: dict, layout: str):
    from megatron.bridge_thd.qwen3_vl_step import prepare_micro_batch
    from megatron.bridge_thd_cpu.standalone import minimal_state

    state = minimal_state(seq_length=1024, micro_batch_size=batch["tokens"].shape[0], packing_layout=layout)
    with count_ops() as counts:
        prepared = prepare_micro_batch(batch, model, state, model.pg_collection)
    return prepared, counts.host_syncs


def _receipts() -> dict:
    from megatron.bridge_thd_cpu.data import synthetic_receipt_batch

    return synthetic_receipt_batch(3, seed=1, left_padding=True)


@pytest.mark.parametrize("bad", [2, 0.5, -1, float("nan")])
def test_a_mask_value_other_than_0_or_1_is_one_error_for_step_and_verl(step_model, bad):
    """The step used to take any non-zero entry as real while the VERL drop-in refused it: now one
    rule and one message (naming the argument, the bad value and the fix) for the step's
    ``prepare_micro_batch``, the packer's mask reader, and VERL's pre- and postprocess."""
    batch = _receipts()
    keep = batch["attention_mask"]
    dtype = torch.int64 if isinstance(bad, int) else torch.float32
    mask = keep.to(dtype)
    mask[1, int(keep[1].nonzero()[3])] = bad  # one real token marked with the bad value
    batch = {**batch, "attention_mask": mask}

    step = _error_text(lambda: _prepare(step_model, batch, "thd"))
    def rule():
        raise_failed_checks(keep_mask_from_attention_mask(mask, *mask.shape)[1])

    ids = batch["tokens"] * keep
    row, params = verl_interop.preprocess_packed_seqs(ids, keep)
    texts = [
        step,
        _error_text(rule),
        _error_text(lambda: verl_interop.preprocess_packed_seqs(ids, mask)),
        _error_text(lambda: verl_interop.postprocess_packed_seqs(row.float(), params, mask, *mask.shape)),
    ]
    assert texts == [step] * 4, texts
    assert step.startswith("attention_mask: a 2D keep mask must be bool or hold only 0 and 1")
    assert "(attention_mask != 0)" in step  # the fix
    shown = "nan" if bad != bad else str(bad)
    assert f"found [{shown}]" in step  # the bad value


def test_the_static_step_checks_the_mask_on_the_device(step_model):
    """``thd_static`` never reads the host: the same check is a device assert with the same message."""
    batch = _receipts()
    mask = batch["attention_mask"].long()
    mask[0, -1] = 2
    with pytest.raises(RuntimeError, match="attention_mask: a 2D keep mask must be bool or hold only 0 and 1"):
        _prepare(step_model, {**batch, "attention_mask": mask}, "thd_static")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_a_0_1_mask_of_any_dtype_equals_the_bool_mask_at_the_same_host_syncs(step_model, dtype):
    """Float 0. / 1. (and int) masks are accepted by both and give what the bool mask gives; the
    check rides the existing reads (step: 1 in ``thd``, 0 in ``thd_static``; VERL: 1 per call)."""
    batch = _receipts()
    keep = batch["attention_mask"]
    other = {**batch, "attention_mask": keep.to(dtype)}
    for layout, syncs in (("thd", 1), ("thd_static", 0)):
        (expected, n_bool), (got, n_other) = _prepare(step_model, batch, layout), _prepare(step_model, other, layout)
        assert n_bool == n_other == syncs
        for name in ("input_ids", "labels", "position_ids"):
            assert torch.equal(got.forward_args[name], expected.forward_args[name]), (layout, name)
        for name in ("cu_seqlens_q", "cu_seqlens_q_padded"):
            assert torch.equal(getattr(got.forward_args["packed_seq_params"], name),
                               getattr(expected.forward_args["packed_seq_params"], name))
    ids = batch["tokens"] * keep
    row, params = verl_interop.preprocess_packed_seqs(ids, keep)
    with count_ops() as counts:
        row_other, params_other = verl_interop.preprocess_packed_seqs(ids, keep.to(dtype))
    assert counts.host_syncs == 1 and torch.equal(row_other, row)
    assert torch.equal(params_other.cu_seqlens_q, params.cu_seqlens_q)
    values = torch.randn(1, row.shape[1], 2)
    with count_ops() as counts:
        out = verl_interop.postprocess_packed_seqs(values, params, keep.to(dtype), *keep.shape)
    assert counts.host_syncs == 1
    assert torch.equal(out, verl_interop.postprocess_packed_seqs(values, params, keep, *keep.shape))


# ---------------------------------------------------------------------------------------------
# the real model: VERL layout with images, CP = 1, 2, 4


def _unit_checks_under_cp(cp: int) -> dict:
    """Round trip, gradient and op counts of postprocess on this rank (real CP group)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_context_parallel_rank()
    keep = verl_layout_mask(6, 7, 19, seed=21)
    values = torch.randn(*keep.shape, 3, generator=torch.Generator().manual_seed(4))  # same on every rank
    row, params = verl_interop.preprocess_packed_seqs(values, keep.float())
    row.requires_grad_(True)
    out = verl_interop.postprocess_packed_seqs(row, params, keep.float(), *keep.shape)
    round_trip = torch.equal(out.detach(), torch.where(keep[..., None], values, 0.0))
    # d(sum(out * w))/d(row) = w at this rank's own slots: the same gather as the values (a
    # differently seeded w, packed by preprocess, is what each slot must receive).
    weights = torch.randn(*keep.shape, 3, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    expected_grad = verl_interop.preprocess_packed_seqs(torch.where(keep[..., None], weights, 0.0), keep)[0]
    counts = []
    for batch in (4, 32):
        k = verl_layout_mask(batch, 8, 24, seed=batch)
        r, p = verl_interop.preprocess_packed_seqs(torch.ones(k.shape, dtype=torch.long), k)
        o = torch.randn(1, r.shape[1], 2)
        with count_ops() as c:
            verl_interop.postprocess_packed_seqs(o, p, k, *k.shape)
        counts.append((dict(c.by_op), c.host_syncs))
    return dict(rank=rank, round_trip=round_trip, grad_ok=torch.equal(row.grad, expected_grad), counts=counts)


@pytest.fixture(scope="module")
def real_model():
    """Weights, the batch, the per-sample reference (log-probs and gradients) and every CP run:
    CP = 1 and 2 with both VERL calls (packed, vision) with and without FP8 padding, CP = 4 the
    packed call only."""
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.parity import gradients
    from megatron.bridge_thd_cpu.stack import cpu_stack
    from megatron.bridge_thd_cpu.standalone import init_single_process_groups

    init_single_process_groups()
    batch = verl_vlm_batch()
    verl_path, verl_how = find_verl_util()
    worker = verl_support.real_model_worker
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        alone = per_sample_response_logp(model, batch)
        model.zero_grad(set_to_none=True)
        sum(a.sum() for a in alone).backward()
        reference_grads = gradients(model)
        state_dict = model.state_dict()
        runs = {1: [worker(state_dict, batch, verl_path, 1)]}
    runs[2] = run_on_gloo(worker, state_dict, batch, verl_path, 2, True, True, _unit_checks_under_cp, cp=2, timeout=300)
    runs[4] = run_on_gloo(worker, state_dict, batch, verl_path, 4, False, False, _unit_checks_under_cp, cp=4,
                          timeout=300)
    return dict(batch=batch, alone=[a.detach() for a in alone], reference_grads=reference_grads, runs=runs,
                verl_how=verl_how, state_dict=state_dict)


def _assert_equals_each_sample_alone(real_model, cp: int, call: str, helpers: str = "ours") -> None:
    """Every rank's response log-probs within the bars, past each response's end exactly 0, and
    the gradients summed over the CP ranks within the bar."""
    alone = real_model["alone"]
    ranks = real_model["runs"][cp]
    for rank, result in enumerate(ranks):
        logp = result[helpers][call]["logp"]
        figures = train_vs_rollout(logp, alone)
        assert figures["max"] <= DLOGP_TOLERANCE, (cp, call, rank, figures)
        assert figures["mult"] - 1.0 <= DLOGP_TOLERANCE, (cp, call, rank, figures)
        for i, a in enumerate(alone):
            assert logp[i, a.numel() :].abs().sum() == 0
    error, where = summed_gradient_error(ranks, (helpers, call), real_model["reference_grads"])
    assert error <= GRAD_TOLERANCE, f"cp={cp} {call}: {where} relative gradient error {error:.2e}"


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_response_logp_and_gradients_equal_each_sample_alone(real_model, cp):
    """VERL's text-model call with our helpers. Every CP rank takes the loss over the gathered
    batch; summed over the CP group (as Megatron's gradient reduction does) the parameter
    gradients are the per-sample ones."""
    alone = real_model["alone"]
    assert sum(a.numel() for a in alone) == sum(real_model["batch"]["response_lengths"]) > 0
    _assert_equals_each_sample_alone(real_model, cp, "packed")
    real_tokens = int(real_model["batch"]["attention_mask"].sum())
    ranks = real_model["runs"][cp]
    for result in ranks:
        # Attention is told the real token count; the row holds alignment padding on top under CP.
        assert result["ours"]["packed"]["tokens_as_real"] == real_tokens
        assert result["ours"]["packed"]["row_length"] % (2 * cp if cp > 1 else 1) == 0
        if cp > 1:
            assert result["ours"]["packed"]["row_length"] > real_tokens
    if cp > 1:
        # Each rank alone holds only its shard's share: the gather is not differentiated twice.
        alone_error, _ = summed_gradient_error(ranks[:1], ("ours", "packed"), real_model["reference_grads"])
        assert alone_error > 1e-3


@pytest.mark.parametrize("cp", [1, 2])
def test_verls_vision_model_call_equals_each_sample_alone(real_model, cp):
    """VERL's own Qwen-VL call (``model_forward_gen(vision_model=True)``: our metadata, the padded
    batch to the model, which packs it after the vision tower and computes MRoPE itself) at CP = 1
    and over gloo at CP = 2: log-probs and summed gradients equal each sample alone, and the CP = 2
    log-probs equal the CP = 1 ones."""
    _assert_equals_each_sample_alone(real_model, cp, "vision")
    if cp > 1:
        cp1 = real_model["runs"][1][0]["ours"]["vision"]["logp"]
        for result in real_model["runs"][cp]:
            assert (result["ours"]["vision"]["logp"] - cp1).abs().max() <= DLOGP_TOLERANCE


@pytest.mark.parametrize("cp", [1, 2])
def test_fp8_padding_on_the_packed_call_equals_each_sample_alone(real_model, cp):
    """``use_fp8_padding=True`` on the packed call: slots of lcm(align, 16), the row stretched to a
    multiple of align * 128 (VERL's rule), and still the per-sample log-probs and gradients;
    attention is told the real token count, not the stretched row."""
    _assert_equals_each_sample_alone(real_model, cp, "packed_fp8")
    align = 2 * cp if cp > 1 else 1
    real_tokens = int(real_model["batch"]["attention_mask"].sum())
    for result in real_model["runs"][cp]:
        fp8 = result["ours"]["packed_fp8"]
        assert fp8["row_length"] % (align * FP8_ROW_FACTOR) == 0 and fp8["row_length"] > real_tokens
        assert fp8["tokens_as_real"] == real_tokens


@pytest.mark.parametrize("cp", [1, 2])
def test_fp8_padding_on_the_vision_call_is_refused_where_verls_crashes(real_model, cp):
    """On VERL's vision-model call the model packs the padded batch itself (no FP8 padding), so
    FP8 boundaries describe a longer row than the model's: ours refuses with a ValueError naming
    the setting and the fix; VERL's own helpers run into the model and crash in attention."""
    for result in real_model["runs"][cp]:
        outcome = result["ours"]["vision_fp8"]
        assert outcome.get("error") == "ValueError", outcome
        assert outcome["message"].startswith("use_fp8_padding: True with pre_process=False"), outcome
    if cp == 1:
        theirs = real_model["runs"][1][0].get("verl")
        if theirs is None:
            pytest.skip(f"VERL comparison skipped: {real_model['verl_how']}")
        assert theirs["vision_fp8"].get("error") == "IndexError", theirs["vision_fp8"]


@pytest.mark.parametrize("cp", [2, 4])
def test_postprocess_gather_under_cp(real_model, cp):
    ranks = real_model["runs"][cp]
    assert sorted(r["extra"]["rank"] for r in ranks) == list(range(cp))
    for r in ranks:
        unit = r["extra"]
        assert unit["round_trip"] and unit["grad_ok"], unit
        (ops_small, syncs_small), (ops_large, syncs_large) = unit["counts"]
        assert ops_small == ops_large and syncs_small == syncs_large == 1


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_verl_helpers_on_the_same_batch(real_model, cp):
    """VERL's own functions on the same model and batch: same local rows; their log-probs also
    match (alignment slots sit after each sample's real tokens and attention is causal), on the
    packed call and (CP = 1, 2) on the vision-model call and the packed call with FP8 padding."""
    ranks = real_model["runs"][cp]
    if "verl" not in ranks[0]:
        pytest.skip(f"VERL comparison skipped: {real_model['verl_how']} (run benchmarks/bench_verl.py once, or set "
                    "BRIDGE_THD_VERL_UTIL to verl/models/mcore/util.py)")
    for r in ranks:
        assert r["same_row_as_verl"]
        # VERL tells attention that every slot of the row is a real token (alignment padding too).
        theirs, ours = r["verl"]["packed"], r["ours"]["packed"]
        assert theirs["tokens_as_real"] == theirs["row_length"] == ours["row_length"]
    for call in ("packed", "vision", "packed_fp8") if cp < 4 else ("packed",):
        _assert_equals_each_sample_alone(real_model, cp, call, helpers="verl")


def test_verls_vision_model_call_with_one_sample_is_refused(real_model):
    """With one sample Megatron-Bridge 0.6.2 no longer recognises the padded (1, T) batch
    (``input_ids.size(0) > 1``) and runs it as a packed row; our postprocess refuses the
    mismatched output instead of unpacking wrong log-probs."""
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd_cpu.stack import cpu_stack

    helpers = (verl_interop.preprocess_packed_seqs, verl_interop.postprocess_packed_seqs)
    with cpu_stack(), torch.no_grad():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        model.load_state_dict(real_model["state_dict"])
        single = verl_vlm_batch(specs=DEFAULT_SPECS[:1])
        assert not single["attention_mask"].all()  # padding in the one row
        with pytest.raises(ValueError, match="^output"):
            vlm_path_forward(model, single, *helpers)
