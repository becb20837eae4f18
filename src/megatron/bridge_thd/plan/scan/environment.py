"""Where ``bridge-thd scan`` runs: Megatron-Bridge importable whole on this machine, and with ``--cpu-tiny`` the
CPU build's local cord_v2-shaped data and tiny processor, the hub offline. The one module of the runtime package
that imports the CPU build (``megatron.bridge_thd_cpu``; tests/unit/test_packaging.py). Reasoning: docs/scan.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

__all__: list[str] = []


def _cpu_tiny_data(workdir: Path, n_train: int) -> str:
    """The test bed's cord_v2-shaped data under ``workdir/naver-clova-ix/cord-v2`` and its tiny processor
    (``workdir/processor``), written unless already there with these settings; returns the processor path."""
    settings = {"n_train": n_train, "n_val": max(2, n_train // 8), "seed": 0, "patch_size": 16}
    marker = workdir / "cpu-tiny.json"
    if not marker.is_file() or json.loads(marker.read_text()) != settings:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # In a child: building the processor trains and runs its fast tokenizer, which must not have run in this
        # process when the scan forks its workers (batching.sizes: a deadlock risk in the forked children).
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
            pool.submit(_write_cpu_tiny_data, str(workdir), settings).result()
        marker.write_text(json.dumps(settings))
    return str(workdir / "processor")


def _write_cpu_tiny_data(workdir: str, settings: dict) -> None:
    from megatron.bridge_thd_cpu.cord_v2 import tiny_qwen3_vl_processor, write_cord_v2_preset_layout

    write_cord_v2_preset_layout(workdir, n_train=settings["n_train"], n_val=settings["n_val"], seed=settings["seed"])
    tiny_qwen3_vl_processor(os.path.join(workdir, "processor"), patch_size=settings["patch_size"])


@contextlib.contextmanager
def _environment(args):
    """Megatron-Bridge importable whole on this machine (``bridge_thd_cpu.bridge_package``: nothing is stood in where
    Transformer Engine is installed); with ``--cpu-tiny``, the hub offline with the recipes' model configs
    (``bridge_thd_cpu.hf_hub.offline_hub``), datasets offline, and the working directory ``workdir`` (where the
    recipes' ``cord_v2`` preset finds the local copy). All restored on exit. Hugging Face's hub reads its environment
    when first imported: in a process that imported it before, the caller makes it offline (the tests do)."""
    with contextlib.ExitStack() as stack:
        if "megatron.bridge" not in sys.modules or getattr(sys.modules["megatron.bridge"], "__file__", None) is None:
            from megatron.bridge_thd_cpu.bridge_package import bridge_package

            stack.enter_context(bridge_package())
        if args.cpu_tiny:
            from megatron.bridge_thd_cpu.hf_hub import offline_hub

            stack.enter_context(offline_hub())
            saved = os.environ.get("HF_DATASETS_OFFLINE")
            os.environ["HF_DATASETS_OFFLINE"] = "1"
            stack.callback(lambda: os.environ.pop("HF_DATASETS_OFFLINE") if saved is None
                           else os.environ.__setitem__("HF_DATASETS_OFFLINE", saved))
            stack.callback(os.chdir, os.getcwd())
            args.workdir.mkdir(parents=True, exist_ok=True)
            os.chdir(args.workdir)
        yield
