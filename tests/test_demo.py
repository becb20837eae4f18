"""The main job's report says true things: equal losses, per-sample parity, real savings."""

from __future__ import annotations

import pytest

from megatron.bridge_thd.testbed import demo


def _table(report: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in report.splitlines() if line.startswith("| ") and "---" not in line]
    header, *body = rows
    assert header[0].strip() == "layout"
    return {cells[0].strip(): [c.strip() for c in cells] for cells in body}


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
    assert f"plot: {path}" in capsys.readouterr().out


def test_the_demo_screen_is_its_report_without_warning_lines(tmp_path):
    """``make demo``'s command (the Makefile's interpreter flags) in a fresh interpreter: every line on the screen,
    stdout and stderr, is the demo's own; no library warning (Megatron's, ModelOpt's, torch's) comes first."""
    import os
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    makefile = (root / "Makefile").read_text()
    flags = shlex.split(re.search(r"^QUIET_IMPORTS := (.*)$", makefile, re.M).group(1))
    command = [sys.executable, *flags, "-m", "megatron.bridge_thd.testbed.demo", "--micro-batches", "1", "--micro-batch-size", "2",
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
    assert not [line for line in screen if re.search(r"warn", line, re.I)], screen
