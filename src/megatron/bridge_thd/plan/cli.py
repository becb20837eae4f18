"""``bridge-thd``: the console script, which dispatches to its commands.

``bridge-thd <command> [options]`` runs a command of :data:`COMMANDS` (``bridge-thd <command> --help``: its
options); ``bridge-thd --help`` lists them. Without a command the arguments are ``plan``'s, as they always were
(``bridge-thd --lengths lengths.json ...`` is ``bridge-thd plan --lengths lengths.json ...``; ``python -m
megatron.bridge_thd.plan`` is the same entry point).

Examples::

    bridge-thd --help
    bridge-thd plan --model qwen3-vl-8b --seq-length 8192 --micro-batch-size 4 --tp 2
    bridge-thd scan --recipe qwen3_vl_8b_sft_2gpu_h100_bf16_config --out lengths.json
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import sys

from megatron.bridge_thd.plan import plan_command
from megatron.bridge_thd.plan.scan import command as scan_command

__all__ = ["COMMANDS", "DEFAULT_COMMAND", "build_parser", "usage", "main"]

# name: (the module whose main(argv) runs it, its line in bridge-thd --help)
COMMANDS = {
    "plan": (plan_command,
             "what packing buys for a model, a length distribution and a parallel layout (docs/planner.md)"),
    "scan": (scan_command,
             "a Megatron-Bridge recipe's dataset measured sample by sample, written as plan's lengths file "
             "(docs/scan.md)"),
}
DEFAULT_COMMAND = "plan"  # what arguments without a command word run


def build_parser():
    """``plan``'s parser (this module's name for it before ``bridge-thd`` had several commands)."""
    return plan_command.build_parser()


def usage() -> str:
    """``bridge-thd --help``: every command, one line each."""
    width = max(map(len, COMMANDS))
    lines = ["usage: bridge-thd <command> [options]", "       bridge-thd [plan's options]      (no command: plan)",
             "", "Real THD sequence packing for Megatron-Bridge: plan a run, measure a recipe's data.", "",
             "commands:"]
    lines += [f"  {name:{width}s}  {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "bridge-thd <command> --help: that command's options."]
    return "\n".join(lines)


class _NoCudaRuntimeNotice(logging.Filter):
    """Drops the one record ``torch.utils.cpp_extension`` logs when it is imported on a machine without CUDA
    ("No CUDA runtime is found, using CUDA_HOME=..."). The planner's FLOPs are Megatron-Bridge's own formula,
    whose module imports Megatron-Core, which imports ``torch.utils.cpp_extension``: on a CPU machine every
    command would print it first. Every other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


@contextlib.contextmanager
def _without_the_cuda_home_notice():
    logger = logging.getLogger("torch.utils.cpp_extension")
    notice = _NoCudaRuntimeNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def main(argv: list[str] | None = None) -> int:
    """Entry point (``bridge-thd``); returns the exit status (0 ok, 2 bad input with a one-line error on stderr;
    argparse's own 2 for options it refuses)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if argv[:1] and argv[0] in COMMANDS:
        command, argv = argv[0], argv[1:]
    elif argv[:1] and not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        print(f"bridge-thd: error: unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)}){hint}\n"
              "bridge-thd --help: every command", file=sys.stderr)
        return 2
    else:
        command = DEFAULT_COMMAND
    module, _ = COMMANDS[command]
    with _without_the_cuda_home_notice():
        return module.main(argv)
