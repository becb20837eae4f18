"""Every figure block of README.md and docs/*.md is what its script produces now
(scripts/readme_figures.py).

Computed blocks (op and host-sync counts, the planner's tables) are recomputed here, so a stale
figure fails. Each block stands in one document. Results blocks (timings, real-model parity) must
equal the rendering of the committed
JSON under benchmarks/results/ (no hand edits); the op / sync counts in the committed benchmark
results must still be what the code dispatches. Fix a failure with
``.venv/bin/python scripts/readme_figures.py`` (after ``make bench`` for results blocks).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

from megatron.bridge_thd.upstream.line import upstream_line

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
warnings.filterwarnings("ignore", category=UserWarning)

import readme_figures as rf  # noqa: E402

FIX = "run `.venv/bin/python scripts/readme_figures.py` (after `make bench` for results blocks)"


# Every block of README.md and docs/*.md (each name known, in one document, used once, markers
# paired: else this raises), plus the registered ones; a block by convention
# (benchmarks/NAME_report.py) is a results block.
NAMES = list(dict.fromkeys([*rf.BLOCKS, *rf.all_blocks()]))


@pytest.fixture(scope="module")
def readme_blocks():
    """``{name: (document, body)}`` over README.md and docs/*.md."""
    return rf.all_blocks()


def test_every_registered_block_is_in_a_document(readme_blocks):
    missing = [name for name in rf.BLOCKS if name not in readme_blocks]
    assert not missing, (f"neither README.md nor docs/*.md holds the figure blocks {missing} "
                         "(<!-- figures:NAME --> ... <!-- /figures:NAME -->)")


def test_the_readme_keeps_its_figure_blocks(readme_blocks):
    """The README's own figure, the demo's report; the packer's op count stands in the table of claims."""
    in_readme = {name for name, (path, _) in readme_blocks.items() if path == rf.README}
    assert "demo" in in_readme
    assert readme_blocks["packer-ops-short"][0].name == "claims.md"


# Computed blocks whose figures differ on the line whose Qwen3VLModel declares padding_mask (docs/compatibility.md).
LINE_DEPENDENT_BLOCKS = {
    "step-host-syncs": "where Qwen3VLModel declares padding_mask the step hands it one more tensor, so one more "
                       "copy per micro-batch (host syncs unchanged: model/test_step_host_syncs.py runs on both lines)",
}


def _assert_current(name, readme_blocks):
    path, body = readme_blocks[name]
    rendered = rf.render_block(name, path)
    where = path.relative_to(rf.ROOT)
    assert f"<!-- figures:{name} -->{body}<!-- /figures:{name} -->" == rendered, f"{where} block {name!r} is stale: {FIX}"


@pytest.mark.parametrize("name", [n for n in NAMES if rf.get_block(n).kind == "computed"])
def test_computed_block_is_current(name, readme_blocks):
    if name in LINE_DEPENDENT_BLOCKS and upstream_line().model_takes_padding_mask:
        pytest.skip(f"block {name!r} is rendered on the line `make test` proves: {LINE_DEPENDENT_BLOCKS[name]}")
    _assert_current(name, readme_blocks)


@pytest.mark.parametrize("name", [n for n in NAMES if rf.get_block(n).kind == "results"])
def test_results_block_equals_the_committed_results(name, readme_blocks):
    _assert_current(name, readme_blocks)


def test_committed_benchmark_counts_are_what_the_code_dispatches():
    """Ops and host syncs per call are deterministic: recount them for every row of the committed
    bench_pack results (no timing)."""
    import bench_pack

    results = rf.load_results("bench_pack")
    for table in results["tables"]:
        configs = sorted({(r["B"], r["T"]) for r in table["rows"]})
        impls = list(dict.fromkeys(r["impl"] for r in table["rows"]))
        now = {(r["B"], r["T"], r["impl"]): (r["ops"], r["host_syncs"])
               for r in bench_pack.counted_rows(configs, table["layout"], impls)}
        committed = {(r["B"], r["T"], r["impl"]): (r["ops"], r["host_syncs"]) for r in table["rows"]}
        assert committed == now, f"benchmarks/results/bench_pack.json ({table['layout']}) has stale op counts: run `make bench`, then {FIX}"


def test_update_rewrites_only_block_bodies(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("intro 1\n\n<!-- figures:plan-gpu -->\n\nold\n\n<!-- /figures:plan-gpu -->\n\nkeep 2\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "page.md"
    page.write_text("text\n<!-- figures:configure-flags -->stale<!-- /figures:configure-flags -->\nmore\n")
    monkeypatch.setattr(rf, "README", readme)
    monkeypatch.setattr(rf, "DOCS", docs)
    assert rf.documents() == [readme, page]
    assert rf.update_readme(["plan-gpu", "configure-flags"], check=True) == ["plan-gpu", "configure-flags"]
    assert "old" in readme.read_text() and "stale" in page.read_text()
    assert rf.update_readme() == ["plan-gpu", "configure-flags"]  # every block, each in its own document
    assert readme.read_text() == f"intro 1\n\n<!-- figures:plan-gpu -->{rf.plan_gpu()}<!-- /figures:plan-gpu -->\n\nkeep 2\n"
    assert page.read_text() == f"text\n{rf.render_block('configure-flags', page)}\nmore\n"
    assert rf.update_readme() == []
    page.write_text("<!-- figures:plan-gpu -->x<!-- /figures:plan-gpu -->")
    with pytest.raises(ValueError, match="stands in both .*README.md and .*page.md"):
        rf.all_blocks()
    readme.write_text("<!-- figures:plan-gpu -->x\n")
    with pytest.raises(ValueError, match="no partner"):
        rf.readme_blocks(readme.read_text())
    readme.write_text("<!-- figures:nope -->x<!-- /figures:nope -->")
    with pytest.raises(ValueError, match="unknown figure block 'nope'.*benchmarks/nope_report.py"):
        rf.readme_blocks(readme.read_text())


def test_links_are_relative_to_the_document():
    """The planner's plots are linked from wherever the block stands."""
    assert "](docs/plan/qwen3-vl-8b_2048.png)" in rf.plan_tables(base=rf.ROOT)
    assert "](plan/qwen3-vl-8b_2048.png)" in rf.plan_tables(base=rf.DOCS)


def test_readme_examples_are_what_the_code_gives():
    """Worked examples quoted in the prose and code comments of README.md and docs/*.md, computed
    (cheap)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.bridge_thd.packing import required_alignment
    from megatron.bridge_thd.interop.energon import packed_batch_from_sample_ids
    from megatron.bridge_thd.lengths import cu_seqlens_from_sample_ids
    from megatron.bridge_thd.mtp import roll_packed_left

    text = "\n".join(path.read_text() for path in rf.documents())

    def quoted(snippet):
        assert snippet in " ".join(text.split()), f"README.md / docs/*.md no longer quote {snippet!r}: update this test"

    quoted("required_alignment(tp_size=2, cp_size=2, sequence_parallel=True, fp8=False) # -> 8")
    assert required_alignment(tp_size=2, cp_size=2, sequence_parallel=True, fp8=False) == 8
    ids = torch.tensor([[1, 1, 2, 2, 2, 3, 3, 4, 5, 5, 5, 0, 0]])
    quoted("(`[[1,1,2,2,2,3,3,4,5,5,5,0,0]]` -> `[0,2,5,7,8,11,13]`")
    assert cu_seqlens_from_sample_ids(ids).tolist() == [0, 2, 5, 7, 8, 11, 13]
    quoted("`cu_seqlens_padded = [0,2,5,7,8,11,13]` and real `cu_seqlens = [0,2,5,7,8,11,11]`")
    packed = packed_batch_from_sample_ids(torch.arange(1, 14)[None], ids)
    assert packed.cu_seqlens_padded.tolist() == [0, 2, 5, 7, 8, 11, 13]
    assert packed.cu_seqlens.tolist() == [0, 2, 5, 7, 8, 11, 11]
    quoted("(`[1,2,3 | 4,5] -> [2,3,0 | 5,0]`)")
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu)
    assert roll_packed_left(torch.tensor([1, 2, 3, 4, 5]), params).tolist() == [2, 3, 0, 5, 0]
