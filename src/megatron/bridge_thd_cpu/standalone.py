"""Run the forward step outside Megatron-Bridge's trainer: one process, gloo, CPU.

Used by the demo, the tests and users checking packing on their own data on a laptop: it sets
up real Megatron-Core process groups of world size 1 and the few parts of Megatron-Bridge's
``GlobalState`` that the step reads.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from types import SimpleNamespace

import torch

__all__ = ["init_single_process_groups", "minimal_state"]


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a gloo rendezvous."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that are free now and stay free: one rendezvous per
    process group a world creates in turn, possibly minutes later.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, where every outgoing
    connection (gloo's own, between the ranks of an earlier group) also takes its port: a port chosen
    that way at the start of a long run may be taken by the time its group listens on it (the
    ``EADDRINUSE`` a CI run met on its sixth ``finetune()``). So the ports are drawn below the ephemeral
    range (``/proc/sys/net/ipv4/ip_local_port_range``), which no outgoing connection uses, and each is
    checked by binding it (held together while they are chosen).
    """
    low = _ephemeral_range_start()
    candidates = random.Random().sample(range(_LOWEST_PORT, low), k=min(low - _LOWEST_PORT, 64 * count + 64))
    with contextlib.ExitStack() as stack:
        ports = []
        for port in candidates:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == count:
                return ports
    raise RuntimeError(f"free_ports: found {len(ports)} of {count} free ports in [{_LOWEST_PORT}, {low})")


_LOWEST_PORT = 20000


def _ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            return max(int(handle.read().split()[0]), _LOWEST_PORT + 1024)
    except (OSError, ValueError, IndexError):
        return 32768


def init_single_process_groups():
    """Initialise torch.distributed (gloo, world size 1) and Megatron-Core's model-parallel groups.

    Returns:
        ``megatron.core.process_groups_config.ProcessGroupCollection`` (all sizes 1).
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    return ProcessGroupCollection.use_mpu_process_groups()


def minimal_state(
    *,
    seq_length: int,
    micro_batch_size: int,
    packing: bool = True,
    packing_layout: str | None = None,
    skip_getting_attention_mask_from_dataset: bool = False,
    tokenizer=None,
    global_batch_packing=None,
    static_rows=(),
    **model_settings,
) -> SimpleNamespace:
    """The parts of Megatron-Bridge's ``GlobalState`` the step reads.

    Args:
        seq_length: ``model.seq_length``.
        micro_batch_size: ``train.micro_batch_size``.
        packing: ``dataset.pack_sequences_in_batch``.
        packing_layout: the settings' ``layout`` (None = the default, ``"thd"``).
        global_batch_packing: the settings' ``global_batch_packing`` (a ``settings.GlobalBatchPacking``).
        static_rows: ``step_plan.StaticRow``s (ascending length) recorded as global-batch packing records its
            run's rows (``train_state.bridge_thd_rows``), where the step's plan reads them; empty: none recorded.
        model_settings: extra ``cfg.model`` attributes (``variable_seq_lengths``, ``fp8``,
            ``sequence_parallel``).

    Returns:
        A namespace with ``cfg.dataset``, ``cfg.model``, ``cfg.train``, ``cfg.rerun_state_machine``,
        ``tokenizer`` and an empty ``bridge_thd_stats`` list the step appends to.
    """
    dataset = SimpleNamespace(
        pack_sequences_in_batch=packing,
        skip_getting_attention_mask_from_dataset=skip_getting_attention_mask_from_dataset,
        packing_layout=packing_layout,
        seq_length=seq_length,
        global_batch_packing=global_batch_packing,
    )
    model = SimpleNamespace(seq_length=seq_length, **model_settings)
    cfg = SimpleNamespace(
        dataset=dataset,
        model=model,
        train=SimpleNamespace(micro_batch_size=micro_batch_size),
        rerun_state_machine=SimpleNamespace(check_for_nan_in_loss=True, check_for_spiky_loss=False),
    )
    train_state = SimpleNamespace()
    if static_rows:
        from megatron.bridge_thd.step.plan import ROWS_ATTRIBUTE, GlobalBatchRows

        setattr(train_state, ROWS_ATTRIBUTE, GlobalBatchRows(tuple(static_rows)))
    return SimpleNamespace(cfg=cfg, tokenizer=tokenizer, timers=None, bridge_thd_stats=[], train_state=train_state)
