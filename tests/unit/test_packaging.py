"""The package lives in the shared ``megatron`` namespace without shadowing its neighbours."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

import megatron
import megatron.bridge_thd
import megatron.core

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_no_megatron_init_file():
    # An __init__.py here would turn 'megatron' into a regular package and hide megatron.core.
    assert not (REPO / "src" / "megatron" / "__init__.py").exists()


def test_megatron_is_a_namespace_spanning_both_installations():
    # A namespace package has no __file__; megatron.core still comes from its own installation.
    assert getattr(megatron, "__file__", None) is None
    core_dir = pathlib.Path(megatron.core.__file__).resolve().parent
    assert core_dir.parent in [pathlib.Path(p).resolve() for p in megatron.__path__]
    assert not core_dir.is_relative_to(REPO / "src")
    assert pathlib.Path(megatron.bridge_thd.__file__).resolve().parent.name == "bridge_thd"


def test_megatron_bridge_resolves_to_the_installed_package():
    spec = importlib.util.find_spec("megatron.bridge")
    assert spec is not None
    assert not pathlib.Path(list(spec.submodule_search_locations)[0]).resolve().is_relative_to(REPO / "src")


@pytest.mark.slow  # a fresh interpreter importing Megatron-Bridge's helpers
def test_bridge_helpers_load_without_transformer_engine():
    # In a fresh interpreter: the loader must reach Megatron-Bridge's real loss module without
    # running megatron/bridge/__init__.py (which imports Transformer Engine).
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('transformer_engine') is None\n"
        "from megatron.bridge_thd.upstream.loading import load_bridge_module\n"
        "losses = load_bridge_module('training.losses')\n"
        "assert hasattr(losses, 'create_masked_next_token_loss_function')\n"
        "assert 'megatron.bridge.models' not in sys.modules\n"
        "print(losses.__file__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("megatron/bridge/training/losses.py")


def _run_in_a_fresh_interpreter(code: str) -> None:
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


RUNTIME_ENTRY_POINTS = (
    "megatron.bridge_thd.qwen3_vl_step",
    "megatron.bridge_thd.qwen25_vl_step",
    "megatron.bridge_thd.step",
    "megatron.bridge_thd.packing",
)
NOT_RUNTIME = ("megatron.bridge_thd_testbed", "megatron.bridge_thd_cpu", "megatron.bridge_thd.plan", "megatron.bridge_thd.interop",
               "megatron.bridge_thd.batching")


def test_the_runtime_never_imports_the_test_bed_the_cpu_build_the_planner_interop_or_batching():
    # In a fresh interpreter: what training imports pulls in none of the other roles.
    code = (
        "import sys\n"
        f"for name in {RUNTIME_ENTRY_POINTS!r}:\n"
        "    __import__(name)\n"
        f"roles = {NOT_RUNTIME!r}\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(roles))\n"
        "assert not loaded, loaded\n"
    )
    _run_in_a_fresh_interpreter(code)


@pytest.mark.slow  # a fresh interpreter importing the public names
def test_the_public_names_users_import_keep_working():
    code = (
        "from megatron.bridge_thd.qwen3_vl_step import forward_step\n"
        "from megatron.bridge_thd.qwen25_vl_step import forward_step as qwen25_forward_step\n"
        "from megatron.bridge_thd.packing import pack_bshd_to_thd\n"
        "from megatron.bridge_thd.verl import preprocess_packed_seqs, postprocess_packed_seqs\n"
        "from megatron.bridge_thd.configure import configure\n"
        "import megatron.bridge_thd.interop.verl as interop_verl\n"
        "assert callable(forward_step) and callable(qwen25_forward_step) and forward_step is not qwen25_forward_step\n"
        "assert callable(pack_bshd_to_thd) and callable(configure)\n"
        "assert preprocess_packed_seqs is interop_verl.preprocess_packed_seqs\n"
        "assert postprocess_packed_seqs is interop_verl.postprocess_packed_seqs\n"
    )
    _run_in_a_fresh_interpreter(code)


def test_batching_never_imports_the_test_bed_or_interop():
    # In a fresh interpreter: the placement policy and its Megatron-Bridge wiring stand on the runtime
    # (layouts, packing) and the planner's model presets only.
    code = (
        "import sys\n"
        "for name in ('policy', 'sizes', 'sampler', 'bridge'):\n"
        "    __import__(f'megatron.bridge_thd.batching.{name}')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('megatron.bridge_thd_testbed', 'megatron.bridge_thd.interop')))\n"
        "assert not loaded, loaded\n"
    )
    _run_in_a_fresh_interpreter(code)


def _imported_modules(path) -> set[str]:
    """Every module an ``import`` / ``from ... import`` statement of ``path`` names, at any depth (a function's
    lazy import included): what a fresh interpreter's ``sys.modules`` cannot show until that function runs."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(package: str, forbidden: tuple[str, ...], *, skip: tuple[str, ...] = ()) -> dict:
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "src" / "megatron" / package
    found = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith(skip):
            continue
        bad = sorted(name for name in _imported_modules(path) if name.startswith(forbidden))
        if bad:
            found[relative] = bad
    return found


def test_no_module_of_the_runtime_package_imports_the_test_bed_even_lazily():
    # The package users install never reaches for test support, not even inside a function (the planner's
    # synthetic receipts and the recipes' reporting once did); the CPU build does not either.
    assert _offenders("bridge_thd", ("megatron.bridge_thd_testbed",)) == {}
    assert _offenders("bridge_thd_cpu", ("megatron.bridge_thd_testbed",)) == {}


def test_only_the_planners_cpu_mode_imports_the_cpu_build():
    # bridge-thd scan --cpu-tiny runs Megatron-Bridge's collate on a CPU-made dataset; nothing else of the
    # runtime package imports the CPU build's stand-ins.
    assert list(_offenders("bridge_thd", ("megatron.bridge_thd_cpu",))) == ["plan/scan/environment.py"]


def test_upstream_versions_and_line_numbers_live_in_the_docs_not_in_the_code():
    # Code and its messages say what is wrong and what to set; which upstream release and line a fact comes
    # from is docs/compatibility.md's. A version pin the code acts on (the VERL wheel it fetches) is data.
    import re

    pattern = re.compile(r"\b0\.6\.2\b|\b0\.19\.2\b|\b0\.7\.0\b|\b0\.20\.0\b|\b067f987\b|\b[A-Za-z_]\w*\.py:\d+")
    found = []
    for package in ("bridge_thd", "bridge_thd_cpu", "bridge_thd_testbed"):
        for path in sorted((REPO / "src" / "megatron" / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []
    assert "0.6.2" in (REPO / "docs" / "compatibility.md").read_text()


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO / "src").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(nodes):
    """The import statements among ``nodes`` at any depth (inside functions too), less those under ``if
    TYPE_CHECKING:`` (never run)."""
    import ast

    for node in nodes:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _runtime_imports(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(ast.iter_child_nodes(node))


def _import_graph(package: str = "bridge_thd") -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a function's lazy import included; ``from pkg import
    name`` counts as importing ``pkg.name`` where that is a module, else ``pkg``)."""
    import ast

    modules = {_module_name(path): path for path in sorted((REPO / "src" / "megatron" / package).rglob("*.py"))}

    def ours(name: str) -> str | None:  # the longest prefix of name that is a module of the package
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in _runtime_imports([ast.parse(path.read_text())]):
            if isinstance(node, ast.Import):
                targets = [ours(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    anchor = package_of.split(".")[: len(package_of.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [ours(f"{base}.{alias.name}") for alias in node.names]
            edges.update(target for target in targets if target and target != name)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


# Edges excused from the no-cycle rule (none: rules tells moe_padding's hook by a mark, not by importing it).
KNOWN_CYCLE_EDGES: set[tuple[str, str]] = set()


def test_the_import_graph_of_the_package_has_no_cycle():
    # Every import, module level or inside a function, between modules of megatron.bridge_thd: no module reaches
    # itself (a lazy import hides a cycle only until the function runs).
    graph = _import_graph()
    # lazy imports are edges: scan's planner run (inside a function) reaches the plan command, not the CLI
    assert "megatron.bridge_thd.plan.plan_command" in graph["megatron.bridge_thd.plan.scan.command"]
    assert "megatron.bridge_thd.plan.cli" not in graph["megatron.bridge_thd.plan.scan.command"]
    for source, target in KNOWN_CYCLE_EDGES:
        assert target in graph[source], f"{source} -> {target} is gone: drop it from KNOWN_CYCLE_EDGES"
        graph[source].discard(target)
    assert _cycles(graph) == []


def test_the_cycle_finder_reports_each_cycle_once():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
