"""Load Megatron-Bridge's pure-torch helpers, with or without Transformer Engine.

``import megatron.bridge`` imports Transformer Engine, which cannot be installed without CUDA.
The helper modules we reuse (the masked next-token loss, the packed-sequence utilities, the
Qwen3-VL rope) import fine on their own. Where the real package can be imported (a GPU
container) it is used as is; otherwise its parent packages are registered as bare namespace
modules that point at the installed folders, so a submodule loads without the ``__init__``
chain (a ``sys.meta_path`` finder, installed once; listed in :mod:`megatron.bridge_thd.upstream.patches`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

from megatron.bridge_thd.upstream.patches import Patch, applied

__all__ = ["load_bridge_module", "bridge_available", "load_flop_utils", "load_theoretical_memory_utils"]

_BRIDGE = "megatron.bridge"


def bridge_available() -> bool:
    """True when a megatron-bridge installation is present (importable or not)."""
    return importlib.util.find_spec(_BRIDGE) is not None


def _full_package_importable() -> bool:
    module = sys.modules.get(_BRIDGE)
    if module is not None:
        # The real package has its __init__ file; the bare namespace our finder makes has none.
        return getattr(module, "__file__", None) is not None  # offers: the real package (a file) or our bare one
    return importlib.util.find_spec("transformer_engine") is not None


class _BarePackageFinder(importlib.abc.MetaPathFinder):
    """Resolves ``megatron.bridge`` and its sub-packages to namespace packages over the
    installed folders, so no ``__init__.py`` (and so no Transformer Engine import) runs; plain
    modules are left to the normal finders."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _BRIDGE and not fullname.startswith(_BRIDGE + "."):
            return None
        folder = os.path.join(self.root, *fullname.split(".")[2:])
        if not os.path.isdir(folder):
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [folder]
        return spec


def _install_bare_package_finder() -> None:
    if any(isinstance(finder, _BarePackageFinder) for finder in sys.meta_path):
        return
    root_spec = importlib.util.find_spec(_BRIDGE)
    if root_spec is None or not root_spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "megatron.bridge is not installed; install it with scripts/setup_venv.sh or 'pip install --no-deps "
            "megatron-bridge==<the version docs/compatibility.md names>' (CPU) or 'pip install megatron-bridge' (GPU container)"
        )
    sys.meta_path.insert(0, _BarePackageFinder(list(root_spec.submodule_search_locations)[0]))


def load_bridge_module(relative_name: str) -> types.ModuleType:
    """Import ``megatron.bridge.<relative_name>``.

    Args:
        relative_name: dotted path below ``megatron.bridge``, e.g. ``"training.losses"``.

    Returns:
        The module. In a CPU-only environment its parents are bare namespace modules, so only
        submodules whose own imports avoid Transformer Engine can be loaded this way.
    """
    module_name = f"{_BRIDGE}.{relative_name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not _full_package_importable():
        _install_bare_package_finder()
    return importlib.import_module(module_name)


class _Placeholder:
    """Stands for a Megatron-Bridge class that cannot be imported without Transformer Engine."""


# Names flop_utils imports but uses only in an isinstance test (LoRA) or annotations (ConfigContainer).
_FLOP_UTILS_PLACEHOLDERS = {"peft.lora": "LoRA", "training.config": "ConfigContainer"}
# The name theoretical_memory_utils imports that needs TE, used in annotations only.
_MEMORY_UTILS_PLACEHOLDERS = {"training.config": "ConfigContainer"}


def load_flop_utils() -> types.ModuleType:
    """Megatron-Bridge's ``training/utils/flop_utils.py`` (the trainer's FLOPs accounting).

    The module imports ``peft.lora.LoRA`` (Transformer Engine) and ``training.config.ConfigContainer``
    (Energon, ``datasets``, ...). Only when Transformer Engine is absent, and only for the
    duration of this import, those two modules resolve to placeholders; ``LoRA`` is used in an
    ``isinstance`` test (no LoRA can exist without TE) and ``ConfigContainer`` in annotations.
    """
    return _load_with_placeholders("training.utils.flop_utils", _FLOP_UTILS_PLACEHOLDERS)


def load_theoretical_memory_utils() -> types.ModuleType:
    """Megatron-Bridge's ``training/utils/theoretical_memory_utils.py`` (its per-GPU memory estimator).

    The module imports ``training.config.ConfigContainer`` (Energon, ``datasets``, ...) for annotations only;
    only when Transformer Engine is absent, and only for the duration of this import, that module resolves to
    a placeholder. Its other import, ``utils.vocab_utils`` (Megatron-LM's vocabulary padding), loads as is.
    """
    return _load_with_placeholders("training.utils.theoretical_memory_utils", _MEMORY_UTILS_PLACEHOLDERS)


def _load_with_placeholders(relative_name: str, placeholders: dict[str, str]) -> types.ModuleType:
    name = f"{_BRIDGE}.{relative_name}"
    if name in sys.modules or _full_package_importable():
        return load_bridge_module(relative_name)
    _install_bare_package_finder()
    with applied(_placeholders(relative_name, placeholders)):
        return importlib.import_module(name)


def _flop_utils_placeholders() -> list[Patch]:
    """``sys.modules`` placeholders for the two modules ``flop_utils`` imports that need TE."""
    return _placeholders("training.utils.flop_utils", _FLOP_UTILS_PLACEHOLDERS)


def _theoretical_memory_utils_placeholders() -> list[Patch]:
    """``sys.modules`` placeholder for the module ``theoretical_memory_utils`` imports that needs TE."""
    return _placeholders("training.utils.theoretical_memory_utils", _MEMORY_UTILS_PLACEHOLDERS)


def _placeholders(relative_name: str, placeholders: dict[str, str]) -> list[Patch]:
    """``sys.modules`` placeholders for the modules ``relative_name`` imports that need TE."""
    patches = []
    short = relative_name.rsplit(".", 1)[-1]
    for relative, attribute in placeholders.items():
        full = f"{_BRIDGE}.{relative}"
        placeholder = types.ModuleType(full)
        setattr(placeholder, attribute, type(attribute, (_Placeholder,), {}))
        patches.append(Patch(sys.modules, full, placeholder,
                             f"{short} imports {attribute} from it, whose import chain needs Transformer Engine"))
    return patches
