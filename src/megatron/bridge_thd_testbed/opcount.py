"""Count torch ops dispatched and host synchronisations, without timing anything.

On a GPU every dispatched op is a kernel launch and every read of device data on the host is
a synchronisation. Counting them on the CPU (where both are cheap) shows what a call would
cost on the GPU: a packer whose op count grows with the batch size launches one kernel per
sample, and one that reads a tensor on the host stalls the stream.

What counts as one host synchronisation (each stall once, however it is reached):

* a host-read method of a tensor (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``,
  ``bool(t)``, ``int(t)``, ``float(t)``, ``operator.index(t)``, ...), seen at the torch-function
  level; whatever it dispatches underneath (``aten._local_scalar_dense``, a copy) is part of
  that one read;
* ``aten._local_scalar_dense`` reached any other way: a tensor turned into a Python number inside
  a torch function (``torch.arange(t)``, ``torch.full(size, t)``, ``x[:t]``, ``x.split(t)``,
  ``format(t)``, ...), where no host-read method is called at the Python level;
* an aten op whose output size (or host result) depends on the data: ``nonzero``,
  ``masked_select``, the ``unique`` family, ``bincount``, ``equal``, boolean-mask ``index`` /
  ``index_put``, ``repeat_interleave`` without ``output_size``;
* a blocking copy between devices: ``aten._to_copy`` / ``aten.copy_`` / ``aten._copy_from``
  whose source and destination devices differ and ``non_blocking`` is False; and
  ``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray`` from host data (a list, a number,
  an array) onto a device other than the CPU (the copy happens inside the constructor, which the
  dispatch level does not see), plus one read per tensor found inside such host data
  (``torch.tensor([t0, t1])`` reads ``t0`` and ``t1``).

On the CPU test bed every tensor stands for a device tensor, but a copy between devices can only
be seen where the devices really differ (``"meta"`` serves as a stand-in in the tests). A
constructor given host data and an explicit ``device=`` that is the CPU here would be a blocking
host-to-device copy on a GPU: those are listed in :attr:`OpCounts.device_constructors` (not in
``host_syncs``), so a caller can see them.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounts", "count_ops"]

# Tensor methods that copy device data to the host (counted once each, with everything beneath).
_HOST_READ_METHODS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__complex__", "__index__", "__array__",
}
# Aten ops whose output size (or host result) depends on the data, so the host must wait for the device.
_SYNCING_ATEN_OPS = {
    "nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive", "unique_dim_consecutive",
    "bincount", "equal",
}
# Aten copies that block the host when they cross devices without non_blocking.
_COPY_OPS = {"_to_copy", "copy_", "_copy_from"}
# Aten ops that launch no kernel on a GPU: views and other metadata-only ops, allocations without a
# fill, reads (counted as syncs), and Python numbers wrapped as 0-dim CPU tensors (``scalar_tensor``).
_NO_KERNEL_OPS = {
    "view", "_unsafe_view", "_reshape_alias", "expand", "slice", "select", "unsqueeze", "squeeze", "permute",
    "transpose", "t", "as_strided", "alias", "detach", "unbind", "split", "split_with_sizes", "chunk", "narrow",
    "diagonal", "unfold", "view_as_real", "view_as_complex", "lift_fresh", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "set_", "resize_", "_local_scalar_dense", "scalar_tensor",
}
# Tensor constructors that take host data and may copy it to a device.
_CONSTRUCTORS = {"tensor", "as_tensor", "asarray"}
# How deep to look into nested lists for tensors inside constructor data.
_MAX_NESTING = 4


@dataclass
class OpCounts:
    """What one call dispatched.

    Attributes:
        ops: total aten ops dispatched.
        kernels: the ops that would launch a kernel on a GPU: ``ops`` less views and other
            metadata-only ops, allocations without a fill, scalar reads and Python numbers wrapped
            as 0-dim CPU tensors (an estimate: a composite op may launch several).
        host_syncs: host synchronisations (module docstring), each counted once.
        by_op: aten op name -> count.
        sync_sites: what each counted synchronisation was, in order: a method name (``"item"``),
            an aten op (``"nonzero"``), ``"_local_scalar_dense in arange"`` (an implicit read and
            the torch function it happened in), ``"_to_copy cpu->meta"`` (a blocking copy) or
            ``"tensor host->meta"`` (a constructor's copy).
        device_constructors: ``torch.tensor`` / ``as_tensor`` / ``asarray`` calls from host data
            with an explicit CPU ``device=``: each one a blocking host-to-device copy when that
            device is a GPU (not in ``host_syncs``: on the CPU nothing is copied).
        sync_locations: where each counted synchronisation was made, parallel to ``sync_sites``:
            ``"path:line (function)"`` of the innermost caller outside torch.
    """

    ops: int = 0
    kernels: int = 0
    host_syncs: int = 0
    by_op: Counter = field(default_factory=Counter)
    sync_sites: list[str] = field(default_factory=list)
    device_constructors: int = 0
    sync_locations: list[str] = field(default_factory=list)


class _State:
    """Shared by the two modes: the counts, how many counted host reads are running now (what they
    dispatch is part of them) and the torch function running at the top level (for the sites)."""

    def __init__(self, counts: OpCounts):
        self.counts = counts
        self.depth = 0
        self.function = ""

    def sync(self, site: str, n: int = 1) -> None:
        self.counts.host_syncs += n
        self.counts.sync_sites.extend([site] * n)
        self.counts.sync_locations.extend([_caller()] * n)


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _short_path(path: str) -> str:
    for marker in ("site-packages" + os.sep, os.sep + "src" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _caller() -> str:
    """``"path:line (function)"`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _device_of(value) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.device
    return torch.device(value)


def _copy_crosses_devices(name: str, args, kwargs) -> tuple[torch.device, torch.device] | None:
    """``(source, destination)`` devices of a blocking copy between devices, else None."""
    if name == "_to_copy":
        src, dst = args[0].device, _device_of(kwargs.get("device"))
        non_blocking = kwargs.get("non_blocking", False)
    elif name == "copy_":  # copy_(self, src, non_blocking=False)
        dst, src = args[0].device, args[1].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:  # _copy_from(self, dst, non_blocking=False)
        src, dst = args[0].device, args[1].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if dst is None or non_blocking or src == dst:
        return None
    return src, dst


def _tensors_in(data, depth: int = 0) -> int:
    """Tensors inside nested lists / tuples of constructor data (each one read on the host)."""
    if isinstance(data, torch.Tensor):
        return 1
    if depth < _MAX_NESTING and isinstance(data, (list, tuple)):
        return sum(_tensors_in(item, depth + 1) for item in data)
    return 0


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counts = self.state.counts
        name = func.overloadpacket.__name__
        counts.ops += 1
        counts.kernels += name not in _NO_KERNEL_OPS
        counts.by_op[name] += 1
        if self.state.depth == 0:  # underneath a counted read: part of that read
            site = self._sync_site(name, args, kwargs)
            if site is not None:
                self.state.sync(site)
        return func(*args, **kwargs)

    def _sync_site(self, name: str, args, kwargs) -> str | None:
        if name == "_local_scalar_dense":
            return f"_local_scalar_dense in {self.state.function}" if self.state.function else name
        if name in _SYNCING_ATEN_OPS:
            return name
        # Boolean-mask indexing sizes its output from the data.
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
            if i is not None
        ):
            return name
        # repeat_interleave without output_size sizes its output from the data.
        if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            return name
        if name in _COPY_OPS:
            devices = _copy_crosses_devices(name, args, kwargs)
            if devices is not None:
                return f"{name} {devices[0].type}->{devices[1].type}"
        return None


class _HostReadCounter(TorchFunctionMode):
    """Torch-function level: host-read methods and constructors from host data. While such a call
    runs, ``state.depth`` is raised so that what it dispatches is not counted again."""

    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        sites: list[str] = []
        if name in _HOST_READ_METHODS:
            sites = [name]
        elif name in _CONSTRUCTORS:
            sites = self._constructor_sites(name, args, kwargs)
        if not sites:
            return self._run(func, args, kwargs, name)
        if self.state.depth == 0:
            for site in sites:
                self.state.sync(site)
        self.state.depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.state.depth -= 1

    def _constructor_sites(self, name: str, args, kwargs) -> list[str]:
        """The syncs of ``torch.tensor`` / ``as_tensor`` / ``asarray`` from host data: one read per
        tensor inside the data, one blocking copy onto a device other than the CPU. A tensor given
        as the data is copied by an aten op the dispatch level counts."""
        data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
        if isinstance(data, torch.Tensor):
            return []
        sites = [f"{name} reads a tensor"] * _tensors_in(data)
        device = kwargs.get("device", args[2] if name == "as_tensor" and len(args) > 2 else None)
        if device is not None:
            device = _device_of(device)
            if device.type != "cpu":
                sites.append(f"{name} host->{device.type}")
            else:
                self.state.counts.device_constructors += 1
        return sites

    def _run(self, func, args, kwargs, name: str):
        outermost = not self.state.function
        if outermost:
            self.state.function = name
        try:
            return func(*args, **kwargs)
        finally:
            if outermost:
                self.state.function = ""


class count_ops:
    """Context manager: ``with count_ops() as counts: fn()`` fills an :class:`OpCounts`.

    A host read (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ...) counts once, however many
    aten ops it dispatches underneath; a read that no Python-level method makes (a tensor turned
    into a number inside a torch function) counts once at the dispatch level.
    """

    def __init__(self):
        self.counts = OpCounts()
        state = _State(self.counts)
        self._modes = (_HostReadCounter(state), _DispatchCounter(state))

    def __enter__(self) -> OpCounts:
        for mode in self._modes:
            mode.__enter__()
        return self.counts

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
