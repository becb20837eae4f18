"""VERL's packed-sequence helpers, vectorised (``megatron.bridge_thd.interop.verl``).

Unit part (no model): on random VERL-layout masks (left-padded prompt + right-padded response)
of several dtypes, the packed row holds exactly the real tokens in order at aligned slots, the
real and padded boundaries are the ones the mask defines (expectations written from the
definition in plain Python, CP rows re-assembled by the zigzag rule written out here), unpacking
round-trips, bad input raises ValueError naming the argument, and the op count does not depend on
B with at most one host sync per call.

Real-model part: Megatron-Bridge 0.6.2's ``Qwen3VLModel`` (CPU build) called the way VERL calls
it (``input_ids_rmpad``, packed 3D MRoPE ``position_ids``, ``packed_seq_params``, no labels), at
CP = 1 (this process), 2 and 4 (gloo, one spawn each): per-token log-probabilities of the response
tokens and the parameter gradients of a loss taken through ``postprocess_packed_seqs`` equal each
sample run alone. When VERL 0.9.1's ``util.py`` can be found (installed, ``BRIDGE_THD_VERL_UTIL``,
or downloaded into the cache), our rows and boundaries are checked against VERL's own functions.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

import megatron.bridge_thd.interop.verl as verl_interop
from megatron.bridge_thd.cpu.launcher import run_on_gloo
from megatron.bridge_thd.opcount import count_ops

IMAGE, VIDEO, VISION_START, VISION_END = 250, 251, 252, 253
PATCH_FEATURES = 3 * 2 * 4 * 4  # channels * temporal patch * patch * patch of the tiny model
DLOGP_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
VERL_VERSION = "0.9.1"


# ---------------------------------------------------------------------------------------------
# VERL's own util.py, loaded by file path (never the package: its __init__ needs ray)


def _verl_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridge_thd" / f"verl-{VERL_VERSION}"


@functools.lru_cache(maxsize=None)
def find_verl_util(download: bool = True) -> tuple[str | None, str]:
    """Path of VERL's ``verl/models/mcore/util.py`` and how it was found (or why not).

    Looks at ``BRIDGE_THD_VERL_UTIL``, an installed ``verl`` (``find_spec`` of the top-level
    package does not execute it), the cache the benchmark fills, then tries ``pip download``.
    """
    env = os.environ.get("BRIDGE_THD_VERL_UTIL")
    if env:
        return (env, "BRIDGE_THD_VERL_UTIL") if Path(env).is_file() else (None, f"BRIDGE_THD_VERL_UTIL={env} is not a file")
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "models" / "mcore" / "util.py"
        if path.is_file():
            return str(path), "installed verl"
    cached = _verl_cache_dir() / "util.py"
    if cached.is_file():
        return str(cached), "cache"
    if not download:
        return None, "verl is not installed and not cached"
    wheels = _verl_cache_dir() / "wheel"
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "5", "--retries", "0",
             f"verl=={VERL_VERSION}", "-d", str(wheels)],
            check=True, timeout=30, capture_output=True,
        )
        wheel = next(wheels.glob("verl-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            cached.write_bytes(archive.read("verl/models/mcore/util.py"))
        return str(cached), "downloaded"
    except (subprocess.SubprocessError, OSError, StopIteration, KeyError) as error:
        return None, f"verl {VERL_VERSION} is not installed and could not be downloaded ({type(error).__name__})"


def load_verl_util(path: str):
    """Execute VERL's util.py as a stand-alone module; the two ``verl.utils`` names it imports are
    stubbed for the duration of the load (``sys.modules`` restored afterwards)."""
    names = ("verl", "verl.utils", "verl.utils.device", "verl.utils.model")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
    sys.modules["verl.utils.device"].is_npu_available = False
    sys.modules["verl.utils.model"].CausalLMOutputForPPO = object
    try:
        spec = importlib.util.spec_from_file_location("verl_mcore_util", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, module_before in saved.items():
            if module_before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_before
    return module


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


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


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
    ranks its getters return for a TP x CP layout, for preprocess only (no collective is issued
    there)."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def set(self, tp: int, cp: int, rank: int):
        from megatron.core import parallel_state

        for name, value in (
            ("model_parallel_is_initialized", True),
            ("get_tensor_model_parallel_world_size", tp),
            ("get_context_parallel_world_size", cp),
            ("get_context_parallel_rank", rank),
            ("get_context_parallel_group", None),
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
# the real model: VERL layout with images, CP = 1, 2, 4


DEFAULT_SPECS = (  # (text before, image grids (h, w), text after, response length)
    (3, ((4, 8),), 2, 11),
    (6, (), 3, 17),
    (2, ((8, 8), (4, 4)), 1, 1),
    (4, ((4, 4),), 5, 8),
)


def verl_vlm_batch(seed: int = 0, specs=DEFAULT_SPECS) -> dict:
    """Samples in VERL's layout: left-padded prompt (text, images after a vision-start token) +
    right-padded response. Images of grids (1, h, w), h and w even: h * w / 4 tokens each. The
    default: four samples, one prompt without image, one with two, one response of a single token.

    Returns a dict: ``input_ids`` / ``attention_mask`` ``(B, P + R)``, ``prompt_width`` P,
    ``pixel_values`` ``(sum h * w, 96)``, ``image_grid_thw`` ``(I, 3)`` in order of appearance,
    ``prompt_lengths`` / ``response_lengths``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(1, 240, (n,), generator=gen).tolist()

    prompts, responses, grids = [], [], []
    for before, images, after, response_length in specs:
        prompt = text(before)
        for h, w in images:
            prompt += [VISION_START] + [IMAGE] * (h * w // 4) + [VISION_END] + text(1)
            grids.append((1, h, w))
        prompts.append(prompt + text(after))
        responses.append(text(response_length))
    prompt_width = max(map(len, prompts)) + 3
    response_width = max(map(len, responses)) + 2
    batch = len(specs)
    ids = torch.zeros(batch, prompt_width + response_width, dtype=torch.long)
    keep = torch.zeros(batch, prompt_width + response_width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[i, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        ids[i, prompt_width : prompt_width + len(response)] = torch.tensor(response)
        keep[i, prompt_width - len(prompt) : prompt_width + len(response)] = True
    grid = torch.tensor(grids)
    return dict(
        input_ids=ids, attention_mask=keep, prompt_width=prompt_width,
        pixel_values=torch.randn(int(grid.prod(-1).sum()), PATCH_FEATURES, generator=gen), image_grid_thw=grid,
        prompt_lengths=[len(p) for p in prompts], response_lengths=[len(r) for r in responses],
    )


def response_logp(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """VERL's log-probs of the response tokens from (B, T, V) logits: position t - 1 predicts t.

    Returns ``(B, R)``; entries past a response's length are 0."""
    width = batch["prompt_width"]
    targets = batch["input_ids"][:, width:]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    return logp * batch["attention_mask"][:, width:]


def per_sample_response_logp(model, batch: dict) -> list[torch.Tensor]:
    """Each sample alone and unpadded (the model computes its own MRoPE positions): ``(r_i,)`` each."""
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
    out, images_before = [], 0
    for i in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i]]
        n_images = int((ids == VISION_START).sum())
        kwargs = {}
        if n_images:
            first, last = images_before, images_before + n_images
            kwargs = dict(pixel_values=pixels[patch_ends[first] : patch_ends[last]], image_grid_thw=grids[first:last])
        images_before += n_images
        logits = model(input_ids=ids[None], **kwargs)[0]
        p = batch["prompt_lengths"][i]
        logp = torch.log_softmax(logits[p - 1 : -1].float(), dim=-1).gather(-1, ids[p:, None])[:, 0]
        out.append(logp)
    return out


def packed_forward(model, batch: dict, pre, post) -> tuple[torch.Tensor, object]:
    """The model called as VERL calls it: packed ids, packed 3D MRoPE positions (computed on the
    padded batch, packed with the same call), packed_seq_params, no labels; logits unpacked.

    Returns ``(B, T, V)`` logits and the ``PackedSeqParams`` the model got."""
    from megatron.bridge_thd.mrope import qwen3_vl_position_ids

    ids, keep = batch["input_ids"], batch["attention_mask"]
    positions = qwen3_vl_position_ids(
        ids, keep, batch["image_grid_thw"], image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START
    )
    input_ids_rmpad, params = pre(ids, keep, True, False)
    position_ids = pre(positions.permute(1, 2, 0), keep, True, False)[0].permute(2, 0, 1).contiguous()
    output = model(input_ids=input_ids_rmpad, position_ids=position_ids, packed_seq_params=params,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return post(output, params, keep, *keep.shape), params


def vlm_path_forward(model, batch: dict, pre, post) -> torch.Tensor:
    """VERL's own call for vision models (``model_forward_gen(vision_model=True)``): metadata only
    (``pre_process=False``), the padded ``(B, T)`` ids and mask go to the model, which packs them
    itself after the vision embedding (Megatron-Bridge's ``legacy_packed_bshd`` path) and computes
    its MRoPE positions (``position_ids=None``). Returns ``(B, T, V)`` logits."""
    ids, keep = batch["input_ids"], batch["attention_mask"]
    _, params = pre(ids, keep, False, False)
    output = model(input_ids=ids, attention_mask=keep, position_ids=None, packed_seq_params=params,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return post(output, params, keep, *keep.shape)


def _grads(model) -> dict:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _loss_grads(model, logp: torch.Tensor) -> dict:
    """Gradients of the summed response log-probs (what a policy-gradient loss differentiates)."""
    model.zero_grad(set_to_none=True)
    logp.sum().backward()
    return _grads(model)


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


def real_model_worker(state_dict: dict, batch: dict, verl_path: str | None, cp: int) -> dict:
    """One CP rank (or the test process at CP = 1): our helpers and, if given, VERL's on the real
    model; unit checks of the CP gather. Module level: pickled by reference for spawn."""
    from megatron.bridge_thd.cpu.model import build_qwen3_vl, tiny_qwen3_vl_config

    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=cp), seed=0)
    model.load_state_dict(state_dict)
    result = {}
    helpers = {"ours": (verl_interop.preprocess_packed_seqs, verl_interop.postprocess_packed_seqs)}
    if verl_path is not None:
        verl_util = load_verl_util(verl_path)
        helpers["verl"] = (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs)
    for name, (pre, post) in helpers.items():
        logits, params = packed_forward(model, batch, pre, post)
        logp = response_logp(logits, batch)
        # What attention (and a MoE router) is told is real: the last real boundary.
        result[name] = dict(logp=logp.detach(), grads=_loss_grads(model, logp),
                            tokens_as_real=int(params.cu_seqlens_q[-1]), row_length=int(params.cu_seqlens_q_padded[-1]))
    if verl_path is not None:
        ids, keep = batch["input_ids"], batch["attention_mask"]
        ours_row, ours = verl_interop.preprocess_packed_seqs(ids, keep)
        theirs_row, theirs = helpers["verl"][0](ids, keep)
        result["same_row_as_verl"] = torch.equal(ours_row, theirs_row) and torch.equal(
            ours.cu_seqlens_q_padded, theirs.cu_seqlens_q_padded
        )
    result["unit"] = _unit_checks_under_cp(cp) if cp > 1 else None
    return result


@pytest.fixture(scope="module")
def real_model():
    """Weights, the batch, the per-sample reference (log-probs and gradients) and every CP run."""
    from megatron.bridge_thd.cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd.cpu.stack import cpu_stack
    from megatron.bridge_thd.standalone import init_single_process_groups

    init_single_process_groups()
    batch = verl_vlm_batch()
    verl_path, verl_how = find_verl_util()
    with cpu_stack():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        alone = per_sample_response_logp(model, batch)
        model.zero_grad(set_to_none=True)
        sum(a.sum() for a in alone).backward()
        reference_grads = _grads(model)
        state_dict = model.state_dict()
        runs = {1: [real_model_worker(state_dict, batch, verl_path, 1)]}
    for cp in (2, 4):
        runs[cp] = run_on_gloo(real_model_worker, state_dict, batch, verl_path, cp, cp=cp, timeout=300)
    return dict(batch=batch, alone=[a.detach() for a in alone], reference_grads=reference_grads, runs=runs,
                verl_how=verl_how, state_dict=state_dict)


def train_vs_rollout(packed: torch.Tensor, alone: list[torch.Tensor]) -> dict:
    """mean / max |dlogp| and token_mult_prob_error over the response tokens."""
    diffs = torch.cat([(packed[i, : a.numel()] - a).abs() for i, a in enumerate(alone)]).double()
    return dict(mean=float(diffs.mean()), max=float(diffs.max()), mult=float(diffs.exp().mean()))


def _relative_grad_error(grads: dict, reference: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, ref in reference.items():
        scale = float(ref.norm())
        error = float((grads[name] - ref).norm()) / (scale if scale > 0 else 1.0)
        if error > worst:
            worst, where = error, name
    return worst, where


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_response_logp_equals_each_sample_alone(real_model, cp):
    alone = real_model["alone"]
    assert sum(a.numel() for a in alone) == sum(real_model["batch"]["response_lengths"]) > 0
    for rank, result in enumerate(real_model["runs"][cp]):
        logp = result["ours"]["logp"]
        figures = train_vs_rollout(logp, alone)
        assert figures["max"] <= DLOGP_TOLERANCE, (cp, rank, figures)
        assert figures["mult"] - 1.0 <= DLOGP_TOLERANCE, (cp, rank, figures)
        # Past each response's end the unpacked logits are padding (0): masked out, exactly 0.
        for i, a in enumerate(alone):
            assert logp[i, a.numel() :].abs().sum() == 0
        # Attention is told the real token count; the row holds alignment padding on top under CP.
        real_tokens = int(real_model["batch"]["attention_mask"].sum())
        assert result["ours"]["tokens_as_real"] == real_tokens
        assert result["ours"]["row_length"] % (2 * cp if cp > 1 else 1) == 0
        if cp > 1:
            assert result["ours"]["row_length"] > real_tokens


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gradients_through_postprocess_equal_each_sample_alone(real_model, cp):
    """Every CP rank takes the loss over the gathered batch; summed over the CP group (as
    Megatron's gradient reduction does) the parameter gradients are the per-sample ones."""
    ranks = real_model["runs"][cp]
    summed = {name: sum(r["ours"]["grads"][name] for r in ranks) for name in real_model["reference_grads"]}
    error, where = _relative_grad_error(summed, real_model["reference_grads"])
    assert error <= GRAD_TOLERANCE, f"cp={cp}: {where} relative gradient error {error:.2e}"
    if cp > 1:
        # Each rank alone holds only its shard's share: the gather is not differentiated twice.
        alone_error, _ = _relative_grad_error(ranks[0]["ours"]["grads"], real_model["reference_grads"])
        assert alone_error > 1e-3


@pytest.mark.parametrize("cp", [2, 4])
def test_postprocess_gather_under_cp(real_model, cp):
    ranks = real_model["runs"][cp]
    assert sorted(r["unit"]["rank"] for r in ranks) == list(range(cp))
    for r in ranks:
        unit = r["unit"]
        assert unit["round_trip"] and unit["grad_ok"], unit
        (ops_small, syncs_small), (ops_large, syncs_large) = unit["counts"]
        assert ops_small == ops_large and syncs_small == syncs_large == 1


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_verl_helpers_on_the_same_batch(real_model, cp):
    """VERL's own functions on the same model and batch: same local rows; their log-probs also
    match (alignment slots sit after each sample's real tokens and attention is causal)."""
    ranks = real_model["runs"][cp]
    if "verl" not in ranks[0]:
        pytest.skip(f"VERL comparison skipped: {real_model['verl_how']} (run benchmarks/bench_verl.py once, or set "
                    "BRIDGE_THD_VERL_UTIL to verl/models/mcore/util.py)")
    for r in ranks:
        assert r["same_row_as_verl"]
        # VERL tells attention that every slot of the row is a real token (alignment padding too).
        assert r["verl"]["tokens_as_real"] == r["verl"]["row_length"] == r["ours"]["row_length"]
        assert train_vs_rollout(r["verl"]["logp"], real_model["alone"])["max"] <= DLOGP_TOLERANCE
    summed = {name: sum(r["verl"]["grads"][name] for r in ranks) for name in real_model["reference_grads"]}
    error, where = _relative_grad_error(summed, real_model["reference_grads"])
    assert error <= GRAD_TOLERANCE, f"cp={cp}: {where} relative gradient error {error:.2e}"


def test_verls_vision_model_call_with_our_params(real_model):
    """VERL's actual Qwen-VL call with our metadata: equal to each sample alone. With one sample
    Megatron-Bridge 0.6.2 no longer recognises the padded (1, T) batch (``input_ids.size(0) > 1``)
    and runs it as a packed row; our postprocess refuses the mismatched output instead of
    unpacking wrong log-probs."""
    from megatron.bridge_thd.cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd.cpu.stack import cpu_stack

    batch = real_model["batch"]
    helpers = (verl_interop.preprocess_packed_seqs, verl_interop.postprocess_packed_seqs)
    with cpu_stack(), torch.no_grad():
        model = build_qwen3_vl(tiny_qwen3_vl_config(), seed=0)
        model.load_state_dict(real_model["state_dict"])
        logp = response_logp(vlm_path_forward(model, batch, *helpers), batch)
        assert train_vs_rollout(logp, real_model["alone"])["max"] <= DLOGP_TOLERANCE
        single = verl_vlm_batch(specs=DEFAULT_SPECS[:1])
        assert not single["attention_mask"].all()  # padding in the one row
        with pytest.raises(ValueError, match="^output"):
            vlm_path_forward(model, single, *helpers)
