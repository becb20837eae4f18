"""Where ``bridge-thd scan`` runs on a machine without CUDA: Megatron-Bridge importable whole, and with ``--cpu-tiny``
the local cord_v2-shaped data and tiny processor, the hub offline (docs/scan.md).

The one entry of the CPU build the planner reaches: ``bridge-thd scan``'s command imports it inside its ``run``
(never at import, and nothing of the runtime imports it; tests/unit/test_packaging.py).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from megatron.bridge_thd_cpu.bridge_package import bridge_package
from megatron.bridge_thd_cpu.cord_v2 import tiny_qwen3_vl_processor, write_cord_v2_preset_layout
from megatron.bridge_thd_cpu.hf_hub import offline_hub

__all__ = ["scan_environment", "cpu_tiny_processor"]


def cpu_tiny_processor(workdir: Path, n_train: int) -> str:
    """The cord_v2-shaped data under ``workdir/naver-clova-ix/cord-v2`` and its tiny processor (``workdir/processor``),
    written unless already there with these settings; returns the processor path."""
    settings = {"n_train": n_train, "n_val": max(2, n_train // 8), "seed": 0, "patch_size": 16}
    marker = workdir / "cpu-tiny.json"
    if not marker.is_file() or json.loads(marker.read_text()) != settings:
        # In a child: building the processor trains and runs its fast tokenizer, which must not have run in this
        # process when the scan forks its workers (batching.sizes: a deadlock risk in the forked children).
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            pool.submit(_write_cpu_tiny_data, str(workdir), settings).result()
        marker.write_text(json.dumps(settings))
    return str(workdir / "processor")


def _write_cpu_tiny_data(workdir: str, settings: dict) -> None:
    write_cord_v2_preset_layout(workdir, n_train=settings["n_train"], n_val=settings["n_val"], seed=settings["seed"])
    tiny_qwen3_vl_processor(os.path.join(workdir, "processor"), patch_size=settings["patch_size"])


def _bridge_loaded_whole() -> bool:
    """Megatron-Bridge's package imported with its ``__init__`` (not a namespace of loose modules)."""
    bridge = sys.modules.get("megatron.bridge")
    return bridge is not None and getattr(bridge, "__file__", None) is not None  # offers: a namespace has no __file__


@contextlib.contextmanager
def scan_environment(cpu_tiny_workdir: Path | None = None):
    """Megatron-Bridge importable whole on this machine (:func:`~.bridge_package.bridge_package`: nothing is stood in
    where Transformer Engine is installed); with ``cpu_tiny_workdir`` (``--cpu-tiny``), the hub offline with the
    recipes' model configs (:func:`~.hf_hub.offline_hub`), datasets offline, and the working directory
    ``cpu_tiny_workdir`` (where the recipes' ``cord_v2`` preset finds the local copy). All restored on exit. Hugging
    Face's hub reads its environment when first imported: in a process that imported it before, the caller makes it
    offline (the tests do)."""
    with contextlib.ExitStack() as stack:
        if not _bridge_loaded_whole():
            stack.enter_context(bridge_package())
        if cpu_tiny_workdir is not None:
            stack.enter_context(offline_hub())
            saved = os.environ.get("HF_DATASETS_OFFLINE")
            os.environ["HF_DATASETS_OFFLINE"] = "1"
            stack.callback(lambda: os.environ.pop("HF_DATASETS_OFFLINE") if saved is None
                           else os.environ.__setitem__("HF_DATASETS_OFFLINE", saved))
            stack.callback(os.chdir, os.getcwd())
            cpu_tiny_workdir.mkdir(parents=True, exist_ok=True)
            os.chdir(cpu_tiny_workdir)
        yield
