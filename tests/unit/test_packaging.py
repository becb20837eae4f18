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


def test_only_the_scan_command_imports_the_cpu_build():
    # bridge-thd scan runs Megatron-Bridge's collate where Transformer Engine is missing (and --cpu-tiny on a
    # CPU-made dataset) in the CPU build's scan environment, which its command imports inside run(); nothing else
    # of the package imports the CPU build.
    assert list(_offenders("bridge_thd", ("megatron.bridge_thd_cpu",))) == ["plan/scan/command.py"]


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


# ---- the import floors (docs/architecture.md) ----

# Module prefix (under megatron.bridge_thd) -> its floor, lowest first: a module imports only its own floor or lower.
FLOORS = {
    # 0 primitives
    "checks": 0, "lengths": 0, "layouts": 0, "mrope": 0, "packing": 0, "context_parallel": 0, "adapters": 0,
    "upstream": 0,
    # 1 the cost model
    "cost": 1,
    # 2 the settings record and the rules
    "settings": 2, "rules": 2,
    # 3 the runtime
    "step": 3, "cp_per_sample": 3, "mtp": 3, "moe_padding": 3, "overlong": 3, "packing_log": 3, "run_log": 3,
    "reporting": 3, "batching": 3, "configure": 3, "configure_flags": 3, "qwen3_vl_step": 3, "qwen25_vl_step": 3,
    # 4 other pipelines' formats
    "interop": 4, "verl": 4,
    # 5 the planner
    "plan": 5,
}
PACKAGE = "megatron.bridge_thd"
# The package's own __init__ runs before any of its modules is imported: it stands on the lowest floor.
PACKAGE_FLOOR = 0
RUNTIME_TOP = 3  # floors 0-3: what training imports
NOT_FOR_THE_RUNTIME = ("megatron.bridge_thd_testbed", "megatron.bridge_thd_cpu", "megatron.bridge_thd.plan")


def _floor(module: str) -> int | None:
    """The floor of a module of the package: its longest prefix in :data:`FLOORS` (None: no floor)."""
    if module == PACKAGE:
        return PACKAGE_FLOOR
    relative = module.removeprefix(PACKAGE + ".")
    keys = [key for key in FLOORS if relative == key or relative.startswith(key + ".")]
    return FLOORS[max(keys, key=len)] if keys else None


def _upward_edges(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a lower floor to a higher one, and each module without a floor."""
    found = [f"{module}: no floor (add it to FLOORS and docs/architecture.md)" for module in sorted(graph)
             if _floor(module) is None]
    for module in sorted(graph):
        for target in sorted(graph[module]):
            low, high = _floor(module), _floor(target)
            if low is not None and high is not None and high > low:
                found.append(f"{module} (floor {low}) imports {target} (floor {high})")
    return found


def _absolute_imports(path: pathlib.Path) -> set[str]:
    """Every module an import statement of ``path`` names (relative ones resolved; inside functions too; not
    under ``if TYPE_CHECKING:``), with ``module.name`` for each name a ``from`` import takes."""
    import ast

    name = _module_name(path)
    package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in _runtime_imports([ast.parse(path.read_text())]):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package_of.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        names.add(base)
        names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _runtime_reaches(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    """Module of floors 0-3 -> what it imports of the test bed, the CPU build or the planner."""
    found = {}
    for module, names in sorted(imports.items()):
        floor = _floor(module)
        if floor is not None and floor <= RUNTIME_TOP:
            bad = sorted(n for n in names if any(n == role or n.startswith(role + ".") for role in NOT_FOR_THE_RUNTIME))
            if bad:
                found[module] = bad
    return found


def test_every_import_of_the_package_goes_down_the_floors():
    # Every import between modules of megatron.bridge_thd, at module level or inside a function: never from a lower
    # floor to a higher one, and every module has a floor.
    assert _upward_edges(_import_graph()) == []


def test_the_runtime_imports_neither_the_test_bed_nor_the_cpu_build_nor_the_planner():
    root = REPO / "src" / "megatron" / "bridge_thd"
    imports = {_module_name(path): _absolute_imports(path) for path in sorted(root.rglob("*.py"))}
    assert _runtime_reaches(imports) == {}


def test_the_floor_checker_catches_a_made_up_upward_edge():
    layouts, cli, rows = f"{PACKAGE}.layouts", f"{PACKAGE}.plan.cli", f"{PACKAGE}.rules.rows"
    assert _upward_edges({layouts: set(), cli: {layouts}, rows: {layouts}}) == []
    assert _upward_edges({layouts: {cli}, cli: set()}) == [f"{layouts} (floor 0) imports {cli} (floor 5)"]
    step_plan = f"{PACKAGE}.step.plan"
    assert _upward_edges({rows: {step_plan}}) == [f"{rows} (floor 2) imports {step_plan} (floor 3)"]
    assert _upward_edges({f"{PACKAGE}.newcomer": set()}) == [
        f"{PACKAGE}.newcomer: no floor (add it to FLOORS and docs/architecture.md)"]
    # a prefix is a whole name: packing_log is the runtime's, packing a primitive; cp_per_sample is the runtime's,
    # batching.cp_per_sample the batching's, plan.cp_per_sample the planner's
    assert (_floor(f"{PACKAGE}.packing"), _floor(f"{PACKAGE}.packing_log")) == (0, 3)
    assert (_floor(f"{PACKAGE}.cp_per_sample"), _floor(f"{PACKAGE}.plan.cp_per_sample")) == (3, 5)
    assert _runtime_reaches({f"{PACKAGE}.step.forward": {"megatron.bridge_thd_cpu.stack"},
                             f"{PACKAGE}.plan.scan.command": {"megatron.bridge_thd_cpu.scan_environment"},
                             f"{PACKAGE}.configure": {f"{PACKAGE}.plan.samples", f"{PACKAGE}.packing"}}) == {
        f"{PACKAGE}.step.forward": ["megatron.bridge_thd_cpu.stack"],
        f"{PACKAGE}.configure": [f"{PACKAGE}.plan.samples"]}


def test_the_floor_table_is_the_one_docs_architecture_md_gives():
    import re

    documented = {}
    for floor, modules in re.findall(r"^\| (\d) \| ([^|]+) \|", (REPO / "docs" / "architecture.md").read_text(), re.M):
        documented.update({name.removesuffix("/*"): int(floor) for name in re.findall(r"`([\w/*]+)`", modules)})
    assert documented == FLOORS


# ---- getattr / hasattr: upstream facts read once (rules/setup.py), each other read with its reason ----

ATTRIBUTE_BUDGET = 60  # getattr / hasattr calls outside rules/setup.py, package-wide
FACT_READER = "rules/setup.py"


def _attribute_reads(source: str) -> tuple[list[int], list[int]]:
    """The lines of each ``getattr`` / ``hasattr`` call of ``source`` (a call spanning lines: its first line), and
    those without a reason: a trailing ``# offers: ...``, ``# duck: ...`` or ``# optional: ...`` on that line."""
    import ast
    import re

    reason = re.compile(r"#.*\b(offers|duck|optional): \S")
    lines = source.splitlines()
    calls = sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"))
    return calls, [line for line in calls if not reason.search(lines[line - 1])]


def test_getattr_and_hasattr_outside_the_fact_reader_carry_a_reason_within_the_budget():
    root = REPO / "src" / "megatron" / "bridge_thd"
    count, unexplained = 0, []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative == FACT_READER:
            continue
        calls, bare = _attribute_reads(path.read_text())
        count += len(calls)
        unexplained += [f"{relative}:{line}" for line in bare]
    assert unexplained == [], "getattr / hasattr without '# offers:', '# duck:' or '# optional:' on its line"
    assert count <= ATTRIBUTE_BUDGET, f"{count} getattr / hasattr outside {FACT_READER}: take the facts from Setup"


def test_the_attribute_checker_tells_a_reason_from_none():
    source = ("a = getattr(x, 'y', None)  # optional: y is new\n"
              "b = hasattr(x, 'z')\n"
              "c = getattr(\n    x, 'w', None)  # duck: too late, the call starts above\n"
              "d = getattr(x, 'v')  # offers:\n"
              "e = x.getattr('u')\n")
    assert _attribute_reads(source) == ([1, 2, 3, 5], [2, 3, 5])


# ---- imports inside functions: only to defer an optional dependency, named ----

OPTIONAL_DEPENDENCIES = (r"Transformer Engine", r"transformer_engine", r"flash[-_]attn", r"Megatron-Bridge",
                         r"megatron\.bridge(?!_)", r"matplotlib", r"transformers", r"CPU build", r"bridge_thd_cpu")


def _unexplained_inner_imports(source: str) -> list[int]:
    """The lines of each import of the package's own modules inside a function of ``source`` whose comment names no
    optional dependency it defers (:data:`OPTIONAL_DEPENDENCIES`): on the statement's first line, or in the comment
    lines directly above it (over the import statements between: one comment may cover a group)."""
    import ast
    import re

    names = re.compile("|".join(OPTIONAL_DEPENDENCIES), re.IGNORECASE)
    lines = source.splitlines()
    tree = ast.parse(source)
    statements = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    import_lines = {line for node in statements for line in range(node.lineno, node.end_lineno + 1)}
    inner = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}

    def own(node) -> bool:
        if isinstance(node, ast.ImportFrom):
            return bool(node.level) or node.module == PACKAGE or (node.module or "").startswith(PACKAGE + ".")
        return any(alias.name == PACKAGE or alias.name.startswith(PACKAGE + ".") for alias in node.names)

    def explained(node) -> bool:
        comment = lines[node.lineno - 1].partition("#")[2]
        if names.search(comment):
            return True
        line = node.lineno - 1  # 1-based number of the line above
        while line >= 1:
            text = lines[line - 1].strip()
            if text.startswith("#"):
                if names.search(text):
                    return True
            elif line not in import_lines:
                return False
            line -= 1
        return False

    return sorted(node.lineno for node in statements if id(node) in inner and own(node) and not explained(node))


def test_imports_inside_functions_name_the_optional_dependency_they_defer():
    root = REPO / "src" / "megatron" / "bridge_thd"
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = _unexplained_inner_imports(path.read_text())
        found += [f"{path.relative_to(root).as_posix()}:{line}" for line in lines]
    assert found == [], "imports of the package's modules inside functions: module level, or name what they defer"


def test_the_inner_import_checker_reads_the_comments():
    source = ("import os\n"
              "from megatron.bridge_thd.layouts import LAYOUT_NAMES\n"
              "def f():\n"
              "    from megatron.bridge_thd.packing import round_up\n"
              "    import json\n"
              "    from megatron.bridge_thd.plan.plot import write_plot  # matplotlib, at call time\n"
              "    # Transformer Engine's attention, loaded when the step runs:\n"
              "    from megatron.bridge_thd.upstream.te_compat import te_cp_padding_verdict\n"
              "    from megatron.bridge_thd.upstream import te_compat\n"
              "\n"
              "    from . import checks\n"
              "    from megatron.bridge_thd_cpu.stack import cpu_stack\n")
    assert _unexplained_inner_imports(source) == [4, 11]


# ---- module size and re-exports (docs/architecture.md) ----

MAX_MODULE_LINES = 600


def _runtime_files() -> list[pathlib.Path]:
    return sorted((REPO / "src" / "megatron" / "bridge_thd").rglob("*.py"))


def _over(limit: int, files) -> list[str]:
    return [f"{path.name}: {n} lines" for path in files if (n := len(path.read_text().splitlines())) > limit]


def test_no_module_of_the_package_passes_600_lines():
    assert _over(MAX_MODULE_LINES, _runtime_files()) == []


def test_the_size_check_reports_a_long_module(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert _over(MAX_MODULE_LINES, [long]) == [f"long.py: {MAX_MODULE_LINES + 1} lines"]


def _re_exports(path: pathlib.Path) -> list[str]:
    """The names a package ``__init__`` imports from the package's modules (an ``__init__`` is its docstring)."""
    import ast

    tree = ast.parse(path.read_text())
    return [alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith("megatron.bridge_thd") for alias in node.names]


def test_no_package_init_re_exports():
    found = {str(path.relative_to(REPO)): names for path in _runtime_files()
             if path.name == "__init__.py" and (names := _re_exports(path))}
    assert found == {}


def test_the_re_export_check_reports_an_import(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('"""doc"""\nfrom megatron.bridge_thd.packing import pack_bshd_to_thd\n')
    assert _re_exports(init) == ["pack_bshd_to_thd"]
