"""Megatron-Bridge's whole package (``import megatron.bridge``: recipes, ``ConfigContainer``,
data providers, ``finetune`` / ``train``) imported on a machine without CUDA. Reasoning:
docs/megatron-bridge-on-cpu.md.

Two packages it imports cannot be installed here:

* ``transformer_engine``: CUDA-only.
* ``nvidia_resiliency_ext``: ``pretrain.py`` imports ``nvidia_resiliency_ext.inprocess.CallWrapper``
  unconditionally; the release megatron-core[dev] pins has no wheel on PyPI for this platform,
  and the older one that has one breaks ``import megatron.core`` (``dist_checkpointing`` reads its
  missing ``__version__``).

:func:`bridge_package` serves an import-time stand-in for each of them, under four rules:

1. only to a ``megatron.bridge.*`` module's *unguarded* import (one outside any ``try``), the kind
   that would otherwise fail the whole import; a guarded probe (``try: import transformer_engine``,
   ``safe_import``) and every other importer (Megatron-Core, peft, accelerate, ...) see the package
   absent, exactly as on a machine without it, so no ``HAVE_TE`` flag turns True;
2. every stand-in class or function raises :class:`StandInCalled` when called, so a code path that
   would really need the package fails loudly instead of doing something else;
3. the stand-in never stays in ``sys.modules``: it is dropped at the next unrelated import and when
   the block ends (the modules that imported it keep their reference: "replaced at import only");
4. a package that is installed is never stood in.

Megatron-Bridge must be imported whole in the process (its ``__init__`` runs): a process that has
already loaded its modules without the ``__init__`` (``upstream.load_bridge_module`` on a CPU) gets
a clear error, since the two would make two copies of every class.
"""

from __future__ import annotations

import contextlib
import dis
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["bridge_package", "StandInCalled", "ABSENT_PACKAGES", "stood_in_packages", "is_stand_in"]

# Package -> why it is stood in (the first rule of the module docstring decides who gets it).
ABSENT_PACKAGES = {
    "transformer_engine": "CUDA-only: cannot be installed without CUDA",
    "nvidia_resiliency_ext": "pretrain.py imports inprocess.CallWrapper unconditionally; the release "
                             "megatron-core[dev] pins has no wheel for this platform and the older one breaks "
                             "megatron.core's import",
}
_IMPORTER_PREFIX = "megatron.bridge."


class StandInCalled(RuntimeError):
    """A stand-in for a package that is not installed was called: this code path needs it."""


class _StandInType(type):
    """A stand-in class: any attribute is another stand-in, calling it (or a subclass) raises."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _stand_in(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise StandInCalled(
            f"{cls.__qualname__} is an import-time stand-in ({cls.__module__} is not installed on this "
            "machine); this Megatron-Bridge code path needs the real package"
        )


def _stand_in(qualified_name: str) -> type:
    module, _, name = qualified_name.rpartition(".")
    return _StandInType(name, (), {"__qualname__": qualified_name, "__module__": module.split(".")[0]})


def is_stand_in(obj) -> bool:
    """True for a stand-in class or module made by :func:`bridge_package`."""
    return isinstance(obj, (_StandInType, _StandInModule))


class _StandInModule(types.ModuleType):
    """A stand-in module: any public attribute is a stand-in class, cached on first use."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stand_in(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _importer_frame():
    """The frame of the code whose import statement is being resolved (importlib's own frames skipped)."""
    frame = sys._getframe(2)  # skip this function and find_spec
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen")
        or frame.f_globals.get("__name__", "").startswith("importlib")
    ):
        frame = frame.f_back
    return frame


def _guarded(frame) -> bool:
    """True when the frame's current instruction lies inside a ``try`` (or ``with``) block."""
    offset = frame.f_lasti
    return any(entry.start <= offset < entry.end for entry in dis.Bytecode(frame.f_code).exception_entries)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages
        self.served: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in self.packages:
            self.drop_served()  # rule 3: the import statement that took the stand-in has ended
            return None
        frame = _importer_frame()
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        if not importer.startswith(_IMPORTER_PREFIX) or _guarded(frame):
            return None
        self.served.add(fullname)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []

    def drop_served(self):
        for name in self.served:
            if is_stand_in(sys.modules.get(name)):
                del sys.modules[name]
        self.served.clear()


def stood_in_packages() -> tuple[str, ...]:
    """The packages of :data:`ABSENT_PACKAGES` that are not installed here (rule 4)."""
    return tuple(name for name in ABSENT_PACKAGES if importlib.util.find_spec(name) is None)


def _check_not_loaded_bare() -> None:
    package = sys.modules.get("megatron.bridge")
    if package is not None and getattr(package, "__file__", None) is None:
        raise RuntimeError(
            "megatron.bridge was already loaded without its __init__ in this process "
            "(megatron.bridge_thd.upstream.load_bridge_module on a machine without Transformer Engine); "
            "enter bridge_thd_cpu.bridge_package.bridge_package() before any such load, e.g. in a fresh process"
        )


@contextlib.contextmanager
def bridge_package():
    """Within the block ``import megatron.bridge`` and its submodules work on this machine.

    Yields:
        The names of the packages stood in (empty where all of them are installed).
    """
    _check_not_loaded_bare()
    packages = stood_in_packages()
    if not packages:
        yield packages
        return
    finder = _StandInFinder(packages)
    sys.meta_path.insert(0, finder)
    try:
        yield packages
    finally:
        sys.meta_path.remove(finder)
        finder.drop_served()
