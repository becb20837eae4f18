"""``bridge-thd``: the top-level help lists every command, each command keeps its own options, arguments without
a command are ``plan``'s as before, and no command prints torch's "No CUDA runtime is found" notice on a CPU
machine."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys

import pytest

from megatron.bridge_thd.plan import cli
from megatron.bridge_thd.plan.cli import COMMANDS, main

REPO = pathlib.Path(__file__).resolve().parents[2]
NOTICE = "No CUDA runtime is found"


def _fresh(*argv: str) -> subprocess.CompletedProcess:
    """``python -m megatron.bridge_thd.plan ARGV`` in a fresh interpreter, stderr merged into stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "megatron.bridge_thd.plan", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=120)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_top_level_help_lists_every_command_one_line_each(capsys, flag):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: bridge-thd <command>")
    assert set(COMMANDS) == {"plan", "scan"}
    for name, (_, summary) in COMMANDS.items():
        assert sum(line.split()[:1] == [name] for line in out.splitlines()) == 1, name
        assert f"  {name}  {summary}" in out
    assert "bridge-thd <command> --help" in out


@pytest.mark.parametrize("name, option", [("plan", "--row-buckets"), ("scan", "--recipe")])
def test_each_command_help_gives_its_own_options(capsys, name, option):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: bridge-thd {name} ") and option in out
    assert all(other_option not in out for other_option in {"--row-buckets", "--recipe"} - {option})


@pytest.mark.parametrize("argv", [["--list-models"], ["--model", "qwen3-vl-8b", "--ep", "2"], ["--seq-length", "0x"]])
def test_arguments_without_a_command_are_plans(capsys, argv):
    # As before there were commands: bridge-thd ARGS is bridge-thd plan ARGS (test_plan.py runs plans that way).
    def run(args):
        try:
            code = main(args)
        except SystemExit as exit_:  # argparse's refusal
            code = exit_.code
        return code, capsys.readouterr()

    code, out = run(argv)
    assert (code, out) == run(["plan"] + argv)
    assert code == (0 if argv == ["--list-models"] else 2)
    assert "presets:" in out.out if code == 0 else out.err.startswith(("bridge-thd plan: error:", "usage: bridge-thd plan "))
    with pytest.raises(SystemExit):  # plan's own options help, as before
        main(["--model", "qwen3-vl-2b", "--help"])
    assert capsys.readouterr().out.startswith("usage: bridge-thd plan ")


def test_an_unknown_command_is_refused_with_the_commands(capsys):
    assert main(["sacn", "--recipe", "x"]) == 2
    err = capsys.readouterr().err
    assert "bridge-thd: error: unknown command 'sacn' (commands: plan, scan); did you mean 'scan'?" in err


def test_the_cli_drops_only_the_no_cuda_runtime_notice(caplog):
    # The record torch.utils.cpp_extension logs at import on a machine without CUDA, and another of that logger.
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING), cli._without_the_cuda_home_notice():
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        logger.warning("another notice")
        logging.getLogger("torch").warning("No CUDA runtime is found elsewhere")
    assert [record.getMessage() for record in caplog.records] == ["another notice", "No CUDA runtime is found elsewhere"]
    logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")  # the filter is gone after
    assert caplog.records[-1].getMessage().startswith(NOTICE)


def test_help_in_a_fresh_interpreter_starts_with_our_usage():
    result = _fresh("--help")
    assert result.returncode == 0, result.stdout[-2000:]
    assert result.stdout.splitlines()[0] == "usage: bridge-thd <command> [options]"
    assert NOTICE not in result.stdout


@pytest.mark.slow  # a fresh interpreter that imports Megatron-Core (the planner's FLOPs formula): about 15 s of CPU
def test_a_real_command_in_a_fresh_interpreter_prints_no_cuda_runtime_notice():
    # On a machine without CUDA, importing Megatron-Core imports torch.utils.cpp_extension, which logs the notice
    # (stderr); here it would be the first line. With CUDA there is no notice to drop, and the test checks the rest.
    result = _fresh("plan", "--model", "qwen3-vl-2b", "--num-samples", "16", "--micro-batch-size", "1")
    assert result.returncode == 0, result.stdout[-2000:]
    assert NOTICE not in result.stdout
    assert result.stdout.splitlines()[0].startswith("bridge-thd plan: qwen3-vl-2b")
