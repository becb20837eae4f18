"""The main job's report says true things: equal losses, per-sample parity, real savings."""

from __future__ import annotations

import pytest
import torch

from megatron.bridge_thd_cpu import demo


def _tables(report: str) -> list[dict[str, list[str]]]:
    """Every Markdown table of the report, in order: ``{first cell: cells}`` per body row, the header under ``""``."""
    tables, current = [], None
    for line in report.splitlines() + [""]:
        if line.startswith("|"):
            current = current if current is not None else []
            if "---" not in line:
                current.append([c.strip() for c in line.strip("|").split("|")])
        elif current is not None:
            header, *body = current
            tables.append({"": header, **{cells[0]: cells for cells in body}})
            current = None
    return tables


def _table(report: str) -> dict[str, list[str]]:
    """The layouts' table (the report's first)."""
    table = dict(_tables(report)[0])
    assert table.pop("")[0] == "layout"
    return table


@pytest.fixture(scope="module", params=["bridge", "hf"])
def report(request):
    text = demo.run_demo(micro_batches=1, micro_batch_size=3, seq_length=2048, seed=3, progress=False,
                        model_kind=request.param)
    assert demo.MODELS[request.param] in text.splitlines()[0]
    return text


def test_report_lists_every_layout(report):
    assert set(_table(report)) == {"thd", "thd_static", "bshd"}


def test_losses_and_token_counts_agree_across_layouts(report):
    table = _table(report)
    losses = {layout: float(cells[1]) for layout, cells in table.items()}
    supervised = {cells[2] for cells in table.values()}
    assert len(supervised) == 1
    assert max(losses.values()) - min(losses.values()) <= 1e-3 * abs(losses["bshd"])


def test_every_layout_matches_the_per_sample_run(report):
    for cells in _table(report).values():
        assert float(cells[3]) <= 1e-4


def test_thd_processes_only_real_tokens_and_less_attention_work(report):
    table = _table(report)
    real_tokens = int(report.split("real tokens ")[1].split(",")[0])
    assert int(table["thd"][4]) == real_tokens  # align 1 on one process: no slot padding
    assert int(table["thd_static"][4]) == 3 * 2048
    work = {layout: int(cells[5].replace(",", "")) for layout, cells in table.items()}
    assert work["thd"] == work["thd_static"] < work["bshd"]


def test_report_compares_global_batch_packing_with_in_batch_placement(report):
    """The second table: five placements of the same samples, its figures those of placement_comparison."""
    tables = _tables(report)
    assert len(tables) == 2 and tables[1][""][0] == "placement"
    comparison = demo.placement_comparison(torch.cat([b["attention_mask"].sum(1) for b in demo.demo_batches(1, 3, 3)]),
                                           micro_batch_size=3, seq_length=2048)
    assert [r["label"] for r in comparison["rows"]] == list(tables[1])[1:]
    for r in comparison["rows"]:
        cells = tables[1][r["label"]]
        assert (int(cells[2]), cells[3], cells[4]) == (r["slots"], f"{r['padding']:.1%}", f"{r['rank_imbalance']:.3f}")


def _cost(s: int) -> float:
    return s + s * s / 24576  # GlobalBatchPacking's default proxy, written out


def test_placement_comparison_measures_its_placements():
    """``make demo``'s own samples (2 micro-batches x 8, seed 0, seq_length 2048) as DP 2 x 2 micro-batches of 4: each
    placement is valid, its figures recomputed here by hand from its micro-batches, its rows chosen by the runtime's
    functions; what holds by construction (the global-batch static row never longer than the in-batch row, more rows
    never more slots) and, for these samples, less padding than Megatron-Bridge's placement in thd_static."""
    from megatron.bridge_thd.batching.sampler import row_length_for_steps
    from megatron.bridge_thd.batching.sizes import SampleSizes

    lengths = torch.cat([b["attention_mask"].sum(1) for b in demo.demo_batches(2, 8, 0)])
    comparison = demo.placement_comparison(lengths, micro_batch_size=8, seq_length=2048)
    assert (comparison["dp_size"], comparison["num_micro_batches"], comparison["micro_batch_size"]) == (2, 2, 4)
    s = lengths.tolist()
    rows = {r["label"]: r for r in comparison["rows"]}
    assert len(rows) == 5
    for r in rows.values():
        placement = r["assignment"]
        assert len(placement) == 2 and all(len(rank) == 2 and all(rank) for rank in placement)
        assert sorted(i for rank in placement for micro in rank for i in micro) == list(range(16))
        tokens = [sum(s[i] for i in micro) for rank in placement for micro in rank]
        if r["row_lengths"] is None:
            slots = sum(tokens)
        else:
            assert list(r["row_lengths"]) == sorted(r["row_lengths"]) and max(tokens) <= r["row_lengths"][-1]
            slots = sum(min(n for n in r["row_lengths"] if n >= t) for t in tokens)
        rank_cost = [sum(_cost(s[i]) for micro in rank for i in micro) for rank in placement]
        assert r["slots"] == slots
        assert r["padding"] == pytest.approx(1 - sum(s) / slots)
        assert r["rank_imbalance"] == pytest.approx(max(rank_cost) / (sum(rank_cost) / 2))
    in_batch = rows["Megatron-Bridge in-batch, thd_static"]
    assert in_batch["assignment"] == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert in_batch["row_lengths"] == (4 * 2048,) and rows["Megatron-Bridge in-batch, thd"]["padding"] == 0
    one, many = rows["global-batch packing, thd_static, 1 row"], rows["global-batch packing, thd_static, up to 4 rows"]
    sizes = SampleSizes(lengths, torch.zeros_like(lengths), torch.zeros(16, dtype=torch.float64))
    row = row_length_for_steps(torch.arange(16)[None], sizes=sizes, dp_size=2, num_micro_batches=2, upper=4 * 2048)
    assert one["row_lengths"] == (row,) and many["row_lengths"][-1] == row and len(many["row_lengths"]) <= 4
    assert one["assignment"] == many["assignment"]  # the rows only change what each micro-batch is padded to
    assert many["slots"] <= one["slots"] <= in_batch["slots"]
    assert one["padding"] < in_batch["padding"] / 10  # these samples: a row far shorter than 4 * seq_length


def test_run_demo_rejects_an_unknown_model():
    with pytest.raises(ValueError, match="model_kind"):
        demo.run_demo(1, 1, 2048, 0, False, model_kind="llava")


def test_main_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--micro-batch-size", "0"])
    assert "--micro-batch-size" in capsys.readouterr().err


def test_main_writes_the_plot_and_says_where(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert demo.main(["--micro-batches", "1", "--micro-batch-size", "2", "--progress", "off", "--plot", str(path)]) == 0
    assert path.stat().st_size > 1000
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"plot: {path}" in out and "| global-batch packing, thd_static, 1 row |" in out


@pytest.mark.slow  # the demo run whole in a fresh interpreter
def test_the_demo_screen_is_its_report_without_warning_lines(tmp_path):
    """``make demo``'s command (the Makefile's interpreter flags) in a fresh interpreter: every line on the screen,
    stdout and stderr, is the demo's own; no library warning (Megatron's, ModelOpt's, torch's) comes first."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    makefile = (root / "Makefile").read_text()
    flags = shlex.split(re.search(r"^QUIET_IMPORTS := (.*)$", makefile, re.M).group(1))
    command = [sys.executable, *flags, "-m", "megatron.bridge_thd_cpu.demo", "--micro-batches", "1", "--micro-batch-size", "2",
               "--progress", "off", "--plot", str(tmp_path / "demo.png")]
    # A user's shell: no rendezvous variables (an earlier test of this process may have set MASTER_PORT to a port
    # its own process group still listens on).
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    environment = {name: value for name, value in os.environ.items() if name not in rendezvous}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(environment, PYTHONPATH=str(root / "src")))
    assert done.returncode == 0, done.stderr[-2000:]
    screen = (done.stdout + done.stderr).splitlines()
    assert screen[0].startswith("megatron-bridge-thd demo:"), screen[:3]
    assert any(line.startswith("| global-batch packing, thd_static, up to 4 rows |") for line in screen), screen
    assert not [line for line in screen if re.search(r"warn", line, re.I)], screen
