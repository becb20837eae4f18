"""The call-path counter (``bridge_thd_testbed.callpath``) on a toy call graph: two modules under a root and
one outside it, every call known, so each figure's definition is checked against a hand count."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from megatron.bridge_thd_testbed.callpath import Call, CallPath, trace_calls

TOY_A = """
    import toy_b
    import toy_out


    def entry():
        helper()
        toy_b.one()
        with toy_b.ctx():  # a generator: started once (a call), resumed at the exit (no call)
            pass
        toy_b.two()
        sum(helper() for _ in range(2))  # the generator expression is no function; helper's caller is entry
        (lambda: toy_b.one())()
        toy_out.call(toy_b.one)  # through code outside the root: the caller is still toy_a
        toy_b.back(helper)


    def helper():
        return 0
"""

TOY_B = """
    import contextlib


    def one():
        return 1


    @contextlib.contextmanager
    def ctx():
        yield


    def two():
        return one()


    def back(fn):
        return fn()
"""

TOY_OUT = """
    def call(fn):
        return fn()
"""

# (caller module, module, function) of every call entry() makes, in order, by hand.
EXPECTED = [
    (None, "toy_a", "entry"),
    ("toy_a", "toy_a", "helper"),
    ("toy_a", "toy_b", "one"),
    ("toy_a", "toy_b", "ctx"),
    ("toy_a", "toy_b", "two"),
    ("toy_b", "toy_b", "one"),
    ("toy_a", "toy_a", "helper"),
    ("toy_a", "toy_a", "helper"),
    ("toy_a", "toy_a", "entry.<locals>.<lambda>"),
    ("toy_a", "toy_b", "one"),
    ("toy_a", "toy_b", "one"),
    ("toy_a", "toy_b", "back"),
    ("toy_b", "toy_a", "helper"),
]


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """``(root, toy_a)``: toy_a and toy_b under ``root``, toy_out beside it (outside)."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "toy_a.py").write_text(textwrap.dedent(TOY_A))
    (root / "toy_b.py").write_text(textwrap.dedent(TOY_B))
    (tmp_path / "toy_out.py").write_text(textwrap.dedent(TOY_OUT))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("toy_a", "toy_b", "toy_out"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield root, importlib.import_module("toy_a")
    for name in ("toy_a", "toy_b", "toy_out"):
        sys.modules.pop(name, None)


def test_every_call_under_the_root_is_recorded_in_order_with_its_caller(toy):
    root, toy_a = toy
    with trace_calls(root) as tracing:
        toy_a.entry()
    assert [(c.caller, c.module, c.function) for c in tracing.path().calls] == EXPECTED


def test_each_figure_is_its_definition(toy):
    root, toy_a = toy
    with trace_calls(root) as tracing:
        toy_a.entry()
    path = tracing.path()
    # distinct functions: entry, helper, the lambda (toy_a); one, ctx, two, back (toy_b)
    assert path.functions == 7
    assert path.modules == 2 and path.module_names() == ["toy_a", "toy_b"]
    # a -> a, a -> b, b, b, b, b -> a, a, a, a -> b, b, b, b -> a: four changes of module between consecutive calls
    assert path.module_changes == 4
    # caller != callee: one, ctx, two (from a), one from the lambda, one through toy_out, back, helper from b
    assert path.cross_module_calls == 7
    assert path.figures() == {"functions": 7, "modules": 2, "module_changes": 4, "cross_module_calls": 7}


def test_figures_on_a_record_written_by_hand():
    """Module changes count consecutive calls, whoever made them; cross-module calls count callers; an entry from
    outside the root (caller None) is neither; a function called twice is one function."""
    calls = (Call(None, "a", "f", 1), Call("a", "b", "g", 1), Call("a", "a", "h", 5), Call("a", "b", "g", 1),
             Call("b", "b", "k", 9), Call(None, "c", "f", 1))
    path = CallPath(calls)
    assert (path.functions, path.modules, path.module_changes, path.cross_module_calls) == (5, 3, 4, 2)
    assert CallPath(()).figures() == {"functions": 0, "modules": 0, "module_changes": 0, "cross_module_calls": 0}


def test_stop_ends_the_record_and_the_previous_profiler_comes_back(toy):
    root, toy_a = toy
    toy_b = sys.modules["toy_b"]
    before = sys.getprofile()
    with trace_calls(root) as tracing:
        toy_b.one()
        tracing.stop()
        toy_a.entry()
    assert [c.function for c in tracing.path().calls] == ["one"]
    assert sys.getprofile() is before
