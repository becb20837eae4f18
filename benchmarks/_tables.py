"""Markdown tables for the benchmark reports."""


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table with padded columns."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``) and the logical CPU count, for the benchmarks' tables."""
    import os
    import platform
    from pathlib import Path

    count = os.cpu_count()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {count} logical CPUs"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {count} logical CPUs"


def report_main(doc: str, default_json, measure, render, argv=None) -> None:
    """A report's command line: ``--json PATH`` (default ``default_json``), run ``measure()``, write its results there,
    print ``render(results)``."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path(default_json))
    args = parser.parse_args(argv)
    results = measure()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
