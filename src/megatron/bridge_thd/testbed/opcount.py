"""Count torch ops dispatched and host synchronisations, without timing anything.

On a GPU every dispatched op is a kernel launch and every read of device data on the host is
a synchronisation. Counting them on the CPU (where both are cheap) shows what a call would
cost on the GPU: a packer whose op count grows with the batch size launches one kernel per
sample, and one that reads a tensor on the host stalls the stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounts", "count_ops"]

# Tensor methods that copy device data to the host.
_HOST_READ_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "cpu"}
# Aten ops whose output size depends on the data, so the host must wait for the device.
_SYNCING_ATEN_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2", "unique_consecutive"}


@dataclass
class OpCounts:
    """What one call dispatched.

    Attributes:
        ops: total aten ops dispatched.
        host_syncs: host reads of tensor data plus data-dependent-shape ops.
        by_op: aten op name -> count.
        sync_sites: the names of the methods / ops counted as host syncs, in order.
    """

    ops: int = 0
    host_syncs: int = 0
    by_op: Counter = field(default_factory=Counter)
    sync_sites: list[str] = field(default_factory=list)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts.ops += 1
        self.counts.by_op[name] += 1
        syncing = name in _SYNCING_ATEN_OPS
        # Boolean-mask indexing and repeat_interleave without output_size size their output
        # from the data.
        if name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ())
            if i is not None
        ):
            syncing = True
        if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) < 4:
            syncing = True
        if syncing and name != "_local_scalar_dense":
            self.counts.host_syncs += 1
            self.counts.sync_sites.append(name)
        return func(*args, **(kwargs or {}))


class _HostReadCounter(TorchFunctionMode):
    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS:
            self.counts.host_syncs += 1
            self.counts.sync_sites.append(name)
        return func(*args, **(kwargs or {}))


class count_ops:
    """Context manager: ``with count_ops() as counts: fn()`` fills an :class:`OpCounts`.

    A host read (``.item()``, ``.tolist()``, ``bool(t)``, ...) counts once, however many aten
    ops it dispatches underneath.
    """

    def __init__(self):
        self.counts = OpCounts()
        self._modes = (_HostReadCounter(self.counts), _DispatchCounter(self.counts))

    def __enter__(self) -> OpCounts:
        for mode in self._modes:
            mode.__enter__()
        return self.counts

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
