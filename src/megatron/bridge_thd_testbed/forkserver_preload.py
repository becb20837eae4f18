"""What the gloo launcher's forkserver imports once, before it forks any rank
(``multiprocessing``'s ``set_forkserver_preload``; :mod:`megatron.bridge_thd_testbed.launcher`).

A rank needs torch, Megatron-Core and the third-party packages Megatron-Bridge's modules import
before it can run its first line: 5-10 s of imports per process on a two-core machine when each rank
is spawned. Imported here once, every rank forked from the forkserver starts with them.

Nothing here imports Megatron-Bridge, Megatron's training package or NVIDIA ModelOpt: each rank
imports those itself, under the patches its kind of rank needs (``launcher._worker``). Nor anything
that reads the environment when it is imported: Hugging Face's ``transformers`` / ``huggingface_hub``
fix their cache and offline settings then (``huggingface_hub.constants``), and a rank must see the
caller's environment as it is when the world starts (``bridge_thd_cpu.hf_hub.offline_hub`` sets them), not as
it was when the forkserver started.

One thing differs from a spawned rank and is kept from leaking: on a machine without an NVIDIA
driver, torch asks the CUDA runtime for the device count (``torch.cuda.is_available``, called while
Megatron-Core and torch.distributed import), and that call marks every later fork as a "bad fork",
where any CUDA initialisation raises "Cannot re-initialize CUDA in forked subprocess" instead of the
"no NVIDIA driver" a spawned rank meets. While these modules import, the device-count query answers
0, what the runtime answers on such a machine, without asking it; nothing caches it (torch caches
the count only once CUDA is initialised). On a machine with a driver nothing is replaced.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import torch

__all__ = ["PRELOADED_MODULES", "device_count_without_the_runtime"]

PRELOADED_MODULES = (
    "torch.distributed",
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.models.gpt",
    "megatron.core.pipeline_parallel",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "megatron.core.ssm",
    "megatron.bridge_thd_cpu.stack",
    # Third-party packages Megatron-Bridge's modules import that read no environment variable at import.
    "omegaconf",
    "PIL.Image",
)


@contextlib.contextmanager
def device_count_without_the_runtime():
    """While the block imports, torch's device-count query answers 0 without asking the CUDA runtime (module
    docstring); also what the launcher's bridge zygote imports Megatron-Bridge under."""
    has_driver = os.path.exists("/proc/driver/nvidia/version")
    if has_driver or not hasattr(torch._C, "_cuda_getDeviceCount"):
        yield
        return
    original = torch._C._cuda_getDeviceCount
    torch._C._cuda_getDeviceCount = lambda: 0
    try:
        yield
    finally:
        torch._C._cuda_getDeviceCount = original


with device_count_without_the_runtime():
    for _name in PRELOADED_MODULES:
        importlib.import_module(_name)
