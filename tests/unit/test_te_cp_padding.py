"""TransformerEngine issue 2186: all-padding context-parallel chunks, and the run-time gate.

``thd_padding_chunks`` is checked three ways: against hand-computed examples (the issue's own
reproducer among them), against a brute force that cuts each rank's local row out of the packed
row's padding mask with the CP partition, and on every layout the packer makes. The gate
(``te_cp_padding_verdict``, which the step's rule ``te_cp_padding`` refuses by) is checked on affected and fixed stacks, with TE absent, and for laziness
(it never imports Transformer Engine). See docs/te-cp-padding.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import random
import sys

import pytest
import torch

import megatron.bridge_thd.upstream.te_compat as te_compat
from _packing_helpers import round_up
from megatron.bridge_thd.packing import pack_bshd_to_thd, required_alignment
from megatron.bridge_thd.context_parallel import thd_local_positions, thd_padding_chunks
from megatron.bridge_thd.upstream.te_compat import (
    TE_CP_PADDING_RULE,
    te_cp_padding_verdict,
    cudnn_version_tuple,
)


def _cu(values):
    return torch.tensor(values, dtype=torch.int32)


def _pack(real_lengths, cp_size, *, seq_len=None, total_length=None, min_length=0, align_to=None):
    real_lengths = torch.tensor(real_lengths, dtype=torch.int64)
    seq_len = int(real_lengths.max()) if seq_len is None else seq_len
    ids = torch.arange(1, real_lengths.numel() * seq_len + 1).reshape(-1, seq_len)
    align = required_alignment(cp_size=cp_size) if align_to is None else align_to
    return pack_bshd_to_thd(
        ids, real_lengths=real_lengths, align_to=align, total_length=total_length, min_length=min_length
    )


def _locations(report, in_real_segment=False):
    which = report.all_padding_in_real_segment if in_real_segment else None
    return sorted(map(tuple, report.locations(which).tolist()))


def _brute_force(packed, cp_size):
    """(rank, segment, chunk) -> number of real tokens, from the packed row itself: each rank's
    local row is cut out of ``padding_mask`` by the CP partition, and every local token is
    attributed to its chunk by its offset in the segment."""
    cu_padded = packed.cu_seqlens_padded.to(torch.int64)
    total = packed.padding_mask.shape[-1]
    counts = {}
    for rank in range(cp_size):
        segment, offset = thd_local_positions(packed.cu_seqlens_padded, total, cp_size, rank)
        real = ~packed.padding_mask[0, cu_padded[segment] + offset]
        chunk_size = (cu_padded[1:] - cu_padded[:-1]) // (2 * cp_size)
        for s, o, r in zip(segment.tolist(), offset.tolist(), real.tolist()):
            key = (rank, s, o // int(chunk_size[s]))
            counts[key] = counts.get(key, 0) + int(r)
    return counts


# --------------------------------------------------------------------------------------------
# the chunk report against hand-computed layouts
# --------------------------------------------------------------------------------------------
def test_issue_reproducer_layout():
    # The reproducer of issue 2186 (CP=2): segment 0 has 9 real tokens in a slot of 12, cut into
    # 4 chunks of 3 -> chunk 3 ([9, 12)) is all padding and belongs to rank 0 (chunks 0 and 3):
    # "the second part of a cp rank consists entirely of padding data". Every other segment is
    # full (real == padded).
    report = thd_padding_chunks(_cu([0, 9, 17, 25, 37, 45, 57]), _cu([0, 12, 20, 28, 40, 48, 60]), cp_size=2)
    assert _locations(report) == [(0, 0, 3)]
    assert _locations(report, in_real_segment=True) == [(0, 0, 3)]
    assert report.chunk_ids.tolist() == [[0, 3], [1, 2]]
    assert report.chunk_size.tolist() == [3, 2, 2, 3, 2, 3]
    assert report.chunk_real[0, 0].tolist() == [3, 0] and report.chunk_real[1, 0].tolist() == [3, 3]


def test_static_row_by_hand():
    # CP=2, align 4, real lengths (5, 1, 0), static row of 16. Slots 8, 4, 0 and a tail of 4:
    # segments [0, 8) [8, 12) [12, 12) [12, 16), chunk sizes 2, 1, 0, 1.
    #   sample 0 (5 real): chunks [0,2) [2,4) [4,6) [6,8) -> chunk 3 empty (6 >= 5)
    #   sample 1 (1 real): chunk 0 real, chunks 1, 2, 3 empty
    #   sample 2 (0 real, slot 0): no chunk has a token, nothing to report
    #   tail (0 real): all four chunks empty, but no real token anywhere in the segment
    # Rank 0 holds chunks (0, 3), rank 1 holds (1, 2).
    packed = _pack([5, 1, 0], cp_size=2, seq_len=6, total_length=16)
    assert packed.cu_seqlens_padded.tolist() == [0, 8, 12, 12, 16]
    report = thd_padding_chunks(packed, cp_size=2)
    real_segment = [(0, 0, 3), (0, 1, 3), (1, 1, 1), (1, 1, 2)]
    tail = [(0, 3, 0), (0, 3, 3), (1, 3, 1), (1, 3, 2)]
    assert _locations(report) == sorted(real_segment + tail)
    assert _locations(report, in_real_segment=True) == real_segment


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["dynamic", "static", "min_length"])
def test_report_matches_brute_force(cp_size, mode):
    rng = random.Random(2186 + cp_size)
    align = required_alignment(tp_size=2, cp_size=cp_size, sequence_parallel=rng.random() < 0.5)
    for _ in range(12):
        batch, seq_len = rng.randint(1, 5), rng.randint(1, 40)
        lengths = [rng.choice([0, 1, rng.randint(0, seq_len), seq_len]) for _ in range(batch)]
        if mode == "min_length":
            lengths = [0] * batch
        total = batch * round_up(seq_len, align) + rng.choice([0, align]) if mode == "static" else None
        packed = _pack(lengths, cp_size, seq_len=seq_len, total_length=total,
                       min_length=align if mode == "min_length" else 0, align_to=align)
        report = thd_padding_chunks(packed, cp_size=cp_size)
        brute = _brute_force(packed, cp_size)
        mine = {}
        for rank in range(cp_size):
            for s in range(report.segment_real.numel()):
                if report.chunk_size[s] > 0:
                    for k in range(2):
                        mine[(rank, s, int(report.chunk_ids[rank, k]))] = int(report.chunk_real[rank, s, k])
        assert mine == brute
        assert _locations(report) == sorted(key for key, real in brute.items() if real == 0)


def test_report_accepts_boundary_pair_and_rejects_misuse():
    packed = _pack([3, 7], cp_size=2)
    a = thd_padding_chunks(packed, cp_size=2)
    b = thd_padding_chunks(packed.cu_seqlens, packed.cu_seqlens_padded, cp_size=2)
    assert torch.equal(a.chunk_real, b.chunk_real)
    with pytest.raises(ValueError, match="^cu_seqlens_padded"):
        thd_padding_chunks(packed, packed.cu_seqlens_padded, cp_size=2)
    with pytest.raises(ValueError, match="^cu_seqlens, cu_seqlens_padded"):
        thd_padding_chunks(_cu([0, 3]), _cu([0, 4, 8]), cp_size=2)
    with pytest.raises(ValueError, match="^cp_size"):
        thd_padding_chunks(packed, cp_size=0)
    with pytest.raises(RuntimeError, match="not divisible by 2 \\* cp_size"):
        thd_padding_chunks(_cu([0, 3]), _cu([0, 6]), cp_size=2)


# --------------------------------------------------------------------------------------------
# the layouts the packer makes, per rank
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_static_tail_is_a_segment_without_real_tokens(cp_size):
    align = required_alignment(cp_size=cp_size)
    packed = _pack([2 * align, align], cp_size, seq_len=2 * align, total_length=6 * align)
    report = thd_padding_chunks(packed, cp_size=cp_size)
    tail = report.segment_real.numel() - 1
    assert report.segment_real[tail] == 0
    assert report.all_padding[:, tail].all()  # every rank's both chunks of the tail
    # Full samples make no all-padding chunk: nothing of the kind of issue 2186 in this row.
    assert not report.all_padding_in_real_segment.any()


@pytest.mark.parametrize("cp_size", [2, 4])
def test_zero_length_sample_has_no_chunk(cp_size):
    align = required_alignment(cp_size=cp_size)
    packed = _pack([align, 0, align], cp_size)
    report = thd_padding_chunks(packed, cp_size=cp_size)
    assert report.chunk_size[1] == 0 and report.segment_real[1] == 0
    assert not report.all_padding[:, 1].any()
    assert not report.all_padding.any()


@pytest.mark.parametrize("cp_size", [2, 3])
def test_all_padding_micro_batch_via_min_length(cp_size):
    align = required_alignment(cp_size=cp_size)
    packed = _pack([0, 0, 0], cp_size, seq_len=5, min_length=align)
    assert packed.cu_seqlens_padded.tolist() == [0, 0, 0, 0, align]
    report = thd_padding_chunks(packed, cp_size=cp_size)
    assert report.all_padding[:, 3].all() and report.segment_real.sum() == 0
    assert not report.all_padding_in_real_segment.any()


@pytest.mark.parametrize("cp_size", [2, 3, 4])
@pytest.mark.parametrize("align_factor", [1, 2, 8])  # align = 2cp * (1 | TP=2 | FP8-ish 8)
def test_real_sample_has_all_padding_chunk_iff_short_of_its_slot(cp_size, align_factor):
    # Real tokens are a prefix of the slot, so only the last chunk (2cp - 1) can be the first
    # empty one: a sample of n real tokens in a slot of L has an all-padding chunk iff
    # n <= L - L / (2cp), i.e. 2cp * (L - n) >= L.
    align = 2 * cp_size * align_factor
    for n in range(1, 6 * align):
        report = thd_padding_chunks(_pack([n], cp_size, align_to=align), cp_size=cp_size)
        slot = round_up(n, align)
        assert bool(report.all_padding_in_real_segment.any()) == (2 * cp_size * (slot - n) >= slot), n


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_samples_shorter_than_two_cp_always_leave_an_empty_chunk(cp_size):
    # No slot avoids it: real tokens must start the slot, so n < 2cp real tokens fill at most n of
    # the 2cp chunks, whatever the (aligned) slot length. This is why no layout can fix issue
    # 2186 and affected stacks are refused instead.
    for n in range(1, 2 * cp_size):
        for slot in range(2 * cp_size, 16 * cp_size + 1, 2 * cp_size):
            report = thd_padding_chunks(_cu([0, n]), _cu([0, slot]), cp_size=cp_size)
            assert report.all_padding_in_real_segment.any(), (n, slot)


def test_folding_the_static_tail_into_the_last_slot_would_create_the_issue_case():
    # The alternative layout (the tail grows the last sample's slot instead of being its own
    # segment) turns the tail's empty chunks into empty chunks of a real segment.
    packed = _pack([16], cp_size=2, total_length=32, align_to=4)
    assert packed.cu_seqlens_padded.tolist() == [0, 16, 32]
    assert not thd_padding_chunks(packed, cp_size=2).all_padding_in_real_segment.any()
    folded = thd_padding_chunks(_cu([0, 16]), _cu([0, 32]), cp_size=2)
    assert _locations(folded, in_real_segment=True) == [(0, 0, 3), (1, 0, 2)]


# --------------------------------------------------------------------------------------------
# the version gate
# --------------------------------------------------------------------------------------------
def check_te_cp_padding(cp_size, **stack) -> str:
    """The verdict as the step's rule ``te_cp_padding`` acts on it: an affected stack's reason raised (the step's
    plan refuses with exactly that message), an accepted stack's reason returned."""
    accepted, reason = te_cp_padding_verdict(cp_size, **stack)
    if not accepted:
        raise ValueError(reason)
    return reason


AFFECTED = dict(te_version="2.6.0+c90a720", cudnn_version=(9, 7, 1), compute_capability=(9, 0),
                fused_attention=True, override=False)


@pytest.mark.parametrize("cudnn", [(9, 7, 1), (9, 10, 2), (9, 17, 1)])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_affected_stacks_are_refused(cudnn, cp_size):
    with pytest.raises(ValueError) as error:
        check_te_cp_padding(cp_size, **{**AFFECTED, "cudnn_version": cudnn})
    message = str(error.value)
    for needle in ("2.6.0+c90a720", ".".join(map(str, cudnn)), "sm90", "issues/2186", "9.18",
                   "context_parallel_size=1", "or layout='bshd'", TE_CP_PADDING_RULE.override_env):
        assert needle in message


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"cudnn_version": (9, 18, 0)}, "has the fix"),
        ({"cudnn_version": (9, 19, 1)}, "has the fix"),
        ({"compute_capability": (10, 0)}, "Hopper only"),  # Blackwell: not affected
        ({"compute_capability": (8, 0)}, "Hopper only"),
        ({"compute_capability": None}, "no CUDA device"),
        ({"cudnn_version": None}, "no cuDNN"),
        ({"fused_attention": False}, "NVTE_FUSED_ATTN=0"),
        ({"override": True}, "declared patched"),
        ({"te_version": None}, "not installed"),
    ],
)
def test_fixed_or_unaffected_stacks_are_accepted(change, reason):
    assert reason in check_te_cp_padding(2, **{**AFFECTED, **change})


def test_cp_one_is_accepted_without_detecting_anything(monkeypatch):
    def boom():
        raise AssertionError("detected the environment for cp_size=1")

    monkeypatch.setattr(te_compat, "installed_te_version", boom)
    monkeypatch.setattr(te_compat, "_detected_device", boom)
    assert "cp_size=1" in check_te_cp_padding(1)
    assert "cp_size=1" in check_te_cp_padding(1, **AFFECTED)


def test_cp_size_is_validated():
    for bad in (0, True, 2.0, "2"):
        with pytest.raises(ValueError, match="^cp_size"):
            check_te_cp_padding(bad)


def test_environment_switches_are_read(monkeypatch):
    stack = {k: v for k, v in AFFECTED.items() if k not in ("fused_attention", "override")}
    monkeypatch.delenv("NVTE_FUSED_ATTN", raising=False)
    monkeypatch.delenv(TE_CP_PADDING_RULE.override_env, raising=False)
    with pytest.raises(ValueError):
        check_te_cp_padding(2, **stack)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "0")
    assert "NVTE_FUSED_ATTN=0" in check_te_cp_padding(2, **stack)
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.setenv(TE_CP_PADDING_RULE.override_env, "1")
    assert "declared patched" in check_te_cp_padding(2, **stack)


class _ExplodingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``transformer_engine`` (so it counts as present) but fails if it is ever executed."""

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine" or name.startswith("transformer_engine."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise AssertionError("transformer_engine was imported")


def test_detection_is_lazy_and_never_imports_te(monkeypatch):
    # Installed TE (metadata), a Hopper GPU with cuDNN 9.7: refused, and TE was never imported.
    def fake_version(name):
        if name == "transformer-engine":
            return "2.6.0"
        raise importlib.metadata.PackageNotFoundError(name)

    te_compat.installed_te_version.cache_clear()
    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90701)
    monkeypatch.setattr(sys, "meta_path", [_ExplodingFinder(), *sys.meta_path])
    monkeypatch.setenv("NVTE_FUSED_ATTN", "1")
    monkeypatch.delenv(TE_CP_PADDING_RULE.override_env, raising=False)
    te_compat._detected_device.cache_clear()
    try:
        with pytest.raises(ValueError, match="Transformer Engine 2.6.0 with cuDNN 9.7.1 on sm90"):
            check_te_cp_padding(2)
        # Metadata missing but the package importable (a source tree): found, not imported.
        te_compat.installed_te_version.cache_clear()
        monkeypatch.setattr(importlib.metadata, "version", lambda name: fake_version("absent"))
        assert te_compat.installed_te_version() == "unknown"
        assert "transformer_engine" not in sys.modules
    finally:
        te_compat.installed_te_version.cache_clear()
        te_compat._detected_device.cache_clear()


def test_this_machine_without_te_is_accepted():
    # The CPU test machine has no Transformer Engine: CP > 1 runs on the CPU attention path.
    te_compat.installed_te_version.cache_clear()
    if te_compat.installed_te_version() is not None:
        pytest.skip("Transformer Engine is installed here")
    assert "not installed" in check_te_cp_padding(4)


def test_cudnn_version_decoding():
    assert cudnn_version_tuple(91800) == (9, 18, 0)
    assert cudnn_version_tuple(90701) == (9, 7, 1)
    assert cudnn_version_tuple(92400) == (9, 24, 0)
    assert cudnn_version_tuple(8907) == (8, 9, 7)
