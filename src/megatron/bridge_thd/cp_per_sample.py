"""A context-parallel group per row: Megatron-Core's hybrid context parallelism in the step (docs/cp-per-sample.md).

Under ``hybrid_context_parallel`` Megatron-Core's schedule (``pipeline_parallel/hybrid_cp_schedule.py``) runs each
row on an aligned block of DP x CP ranks and tells the step how many: it stores ``local_cp_size`` into the row's
batch dict before the step reads it. The row's group is Megatron-Core's own
(``parallel_state.get_hybrid_data_context_parallel_groups(group_size=k)``; at ``k = 1`` the model's static CP group,
of size 1). The step then

* packs the row with the alignment of ``k`` ranks (:attr:`CPPerSampleStep.alignments`),
* hands attention the group the way Transformer Engine takes it: ``PackedSeqParams.cp_group`` and
  ``local_cp_size`` (``TEDotProductAttention.forward``), and
* runs the model with the group bound where the built model keeps its CP group (:func:`bound_cp_group`): Megatron-
  Bridge's ``Qwen3VLModel`` reads ``self.pg_collection.cp`` to shard the row, split the vision tower's frames
  (``vision_dp_when_cp``) and gather their embeddings, and its modules keep the group they were built with.
  Modules that also fixed the group's size at build get the row's size for the forward too: Megatron-Core's Gated
  DeltaNet (Qwen3.5-VL) keeps ``self.cp_size = pg_collection.cp.size()`` and the head split it derives from it
  (``feat_dim_split``). The model's own CP path then runs for the row's ``k`` ranks exactly as it runs under a
  static CP group of ``k``.

Everything that can be found once (where the model keeps its group, the alignment for every ``k``) is found when
the step's plan is built; per row the step reads the plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["LOCAL_CP_SIZE_KEY", "CP_SIZE_NAMES", "CPGroupHolders", "CPPerSampleStep", "RowCP", "find_cp_group_holders",
           "bound_cp_group", "row_cp_of", "bind_row_to_params"]

# Where Megatron-Core's hybrid-CP schedule puts a row's CP size in its batch dict (``hybrid_cp_schedule.py``,
# ``sample["local_cp_size"]``, an int32 host tensor).
LOCAL_CP_SIZE_KEY = "local_cp_size"


# The attribute names under which a module that holds the CP group keeps the group's size, fixed at build
# (Megatron-Core's ``_GDNBase.__init__``: ``self.cp_size = self.pg_collection.cp.size()``).
CP_SIZE_NAMES = ("cp_size",)


@dataclass(frozen=True)
class CPGroupHolders:
    """Where a built model keeps its context-parallel group: every ``(object, attribute)`` whose value is the
    model's static CP group (module attributes such as ``cp_group``, and the ``cp`` of every
    ``ProcessGroupCollection`` a module holds), and every place that fixed the group's size at build, found once
    (:func:`find_cp_group_holders`).

    Attributes:
        places: ``(holder, attribute name)`` pairs.
        static_group: the group they hold when no row is bound.
        sizes: ``(module, attribute name)`` pairs whose value is ``static_group.size()`` (a name of
            :data:`CP_SIZE_NAMES`), on modules that also hold the group or its ``pg_collection``: Megatron-Core's
            Gated DeltaNet splits heads and sequences by it rather than by the group it reads.
        tp_cp_places, static_tp_cp: at TP = 1, every place holding the model's TP x CP group (the ``tp_cp`` of the
            ``ProcessGroupCollection``, the MoE routers' ``tp_cp_group``), which is then the CP group over one TP
            rank: the routers reduce their load-balancing statistics over it. Empty above TP = 1 (the rules refuse
            MoE there).
    """

    places: tuple[tuple[object, str], ...]
    static_group: torch.distributed.ProcessGroup
    sizes: tuple[tuple[torch.nn.Module, str], ...] = ()
    # What each (module, CP size) derives from the size, found at its first row and reused (:func:`_bind_size`).
    derived: dict[tuple[int, int], dict[str, object]] = field(default_factory=dict, compare=False, repr=False)
    tp_cp_places: tuple[tuple[object, str], ...] = ()
    static_tp_cp: torch.distributed.ProcessGroup | None = None


@dataclass(frozen=True)
class CPPerSampleStep:
    """The step's plan for a CP size per row (Megatron-Core's ``hybrid_context_parallel``), decided once.

    Attributes:
        world: the DP x CP ranks (the largest group a row may run on).
        alignments: ``(k, alignment)`` for every CP size a row may have (1, 2, 4, ... ``world``): each slot of a row
            on ``k`` ranks is aligned to it (``2k`` under CP, times TP with sequence parallelism).
        holders: where the model keeps its CP group (:class:`CPGroupHolders`).
    """

    world: int
    alignments: tuple[tuple[int, int], ...]
    holders: CPGroupHolders

    def alignment(self, cp_size: int) -> int:
        for size, align in self.alignments:
            if size == cp_size:
                return align
        raise ValueError(f"local_cp_size: {cp_size} is not a CP size of this world ({[k for k, _ in self.alignments]}); "
                         "Megatron-Core's hybrid-CP schedule gives a row 1, 2, 4, ... DP x CP ranks")


@dataclass(frozen=True)
class RowCP:
    """One row's context parallelism: its CP size and group (None at size 1: the model's own static group)."""

    size: int
    group: torch.distributed.ProcessGroup | None

    @property
    def leads(self) -> bool:
        """This rank is the group's first (the one that feeds the row's FLOPs: the trainer sums them over every
        DP x CP rank, which would count a row once per rank of its group)."""
        return self.group is None or self.group.rank() == 0


def _held(holder, name: str):
    """``holder.<name>``, or None: a ``ProcessGroupCollection`` holds only the groups it was made with, and a model
    built without process groups holds no ``pg_collection``."""
    return getattr(holder, name, None)  # duck: a collection of some groups, a model with or without one, or None


def find_cp_group_holders(core: torch.nn.Module) -> CPGroupHolders:
    """Where the built model ``core`` (unwrapped) keeps its CP group: the ``ProcessGroupCollection``'s ``cp`` of every
    module that holds one (shared objects once), every module attribute that is that group, and the group's size
    where a module holding it kept it (:attr:`CPGroupHolders.sizes`).

    The sizes are found by name (:data:`CP_SIZE_NAMES`) and only on modules that hold the group, not by value: under
    hybrid CP the static group has size 1, and any integer 1 of the model (a layer number, a TP size) would match.

    Raises:
        ValueError: the model holds no ``pg_collection`` (not a Megatron-Core model built with process groups).
    """
    static = _held(_held(core, "pg_collection"), "cp")
    if static is None:
        raise ValueError(f"model: {type(core).__name__} holds no pg_collection.cp; CP per sample rebinds the CP group "
                         "of a Megatron-Core model built with its process groups")
    places: list[tuple[object, str]] = []
    sizes: list[tuple[torch.nn.Module, str]] = []
    seen: set[int] = set()
    for module in core.modules():
        holds = False
        for name, value in vars(module).items():
            if value is static:
                places.append((module, name))
                holds = True
            elif name == "pg_collection" and _held(value, "cp") is static:
                holds = True
                if id(value) not in seen:
                    seen.add(id(value))
                    places.append((value, "cp"))
        if holds:
            sizes += [(module, name) for name in CP_SIZE_NAMES
                      if type(vars(module).get(name)) is int and vars(module)[name] == static.size()]
    tp_cp_places, static_tp_cp = _tp_cp_places(core)
    return CPGroupHolders(places=tuple(places), static_group=static, sizes=tuple(sizes), tp_cp_places=tp_cp_places,
                          static_tp_cp=static_tp_cp)


def _tp_cp_places(core: torch.nn.Module) -> tuple[tuple[tuple[object, str], ...], torch.distributed.ProcessGroup | None]:
    """At TP = 1: every place holding the model's static TP x CP group (module attributes that are it, the ``tp_cp``
    of each ``ProcessGroupCollection``), and the group; nothing above TP = 1 or without one."""
    collection = _held(core, "pg_collection")
    static, tp = _held(collection, "tp_cp"), _held(collection, "tp")
    if static is None or tp is None or tp.size() != 1:
        return (), None
    places: list[tuple[object, str]] = []
    seen: set[int] = set()
    for module in core.modules():
        for name, value in vars(module).items():
            if value is static:
                places.append((module, name))
            elif name == "pg_collection" and _held(value, "tp_cp") is static and id(value) not in seen:
                seen.add(id(value))
                places.append((value, "tp_cp"))
    return tuple(places), static


_ABSENT = object()


def _bind_size(module: torch.nn.Module, name: str, size: int, restore: list[tuple[object, str, object]],
               derived: dict[tuple[int, int], dict[str, object]]) -> None:
    """``module.<name> = size`` and what the module derived from it at build, re-derived; ``(module, attribute,
    value before)`` of every attribute changed is appended to ``restore`` (also when the re-derivation fails).

    Megatron-Core's GDN family derives its per-rank head split (``feat_dim_split``) from ``cp_size`` in
    ``_setup_variant_attrs`` ("called once from ``__init__``"): it is called again with the row's size, the first time
    a row of that size runs, and of what it sets only data is kept (in ``derived``, reused for later rows of that
    size); the callable it binds (the kernel, ``gated_delta_rule``, read from a module global that may have changed
    since) stays the one the build bound.
    """
    values = derived.get((id(module), size))
    if values is not None:
        for key, value in values.items():
            restore.append((module, key, vars(module).get(key, _ABSENT)))
            setattr(module, key, value)
        return
    before = dict(vars(module))
    changed: dict[str, object] = {}
    try:
        setattr(module, name, size)
        derive = getattr(module, "_setup_variant_attrs", None)  # offers: Megatron-Core's GDN re-derivation
        if callable(derive):
            derive()
    finally:
        for key, value in list(vars(module).items()):
            old = before.get(key, _ABSENT)
            if value is old:
                continue
            if old is not _ABSENT and (callable(old) or callable(value)):
                setattr(module, key, old)
            else:
                restore.append((module, key, old))
                changed[key] = value
    derived[(id(module), size)] = changed


@contextlib.contextmanager
def bound_cp_group(holders: CPGroupHolders, group: torch.distributed.ProcessGroup | None) -> Iterator[None]:
    """The row's group in every place the model keeps its CP group, and its size where the model fixed the static
    group's size (:attr:`CPGroupHolders.sizes`), for the forward; restored afterwards.

    Safe for the backward that follows: every collective of the model's CP path keeps the group it ran with in its
    autograd context (Megatron-Bridge's ``AllGatherVisionEmbeddings``, the CPU attention's gather, Transformer
    Engine's CP attention, Gated DeltaNet's all-to-alls), and what the sizes chose (head split, sequence
    permutation) is in the graph's index tensors, so gradients flow over the forward's group after the binding is
    undone. Activation recomputation of those modules in the backward would run at the static size.
    """
    if group is None or group is holders.static_group:
        yield
        return
    restore: list[tuple[object, str, object]] = []
    try:
        for holder, name in holders.places + holders.tp_cp_places:
            setattr(holder, name, group)
        for module, name in holders.sizes:
            _bind_size(module, name, group.size(), restore, holders.derived)
        yield
    finally:
        for holder, name in holders.places:
            setattr(holder, name, holders.static_group)
        for holder, name in holders.tp_cp_places:
            setattr(holder, name, holders.static_tp_cp)
        for holder, name, value in reversed(restore):
            if value is _ABSENT:
                delattr(holder, name)
            else:
                setattr(holder, name, value)


def row_cp_of(batch: dict, plan: CPPerSampleStep) -> RowCP:
    """The row's CP size and group, from the ``local_cp_size`` Megatron-Core's hybrid-CP schedule put in ``batch``
    (removed from it: it is not a model input). One host read of a host tensor.

    Raises:
        ValueError: the batch has no ``local_cp_size`` (an iterator that is not driven by Megatron-Core's hybrid-CP
            schedule) or one this world has no group for.
    """
    value = batch.pop(LOCAL_CP_SIZE_KEY, None)
    if value is None:
        raise ValueError(
            "batch: no 'local_cp_size'; with model.hybrid_context_parallel=True the rows come through Megatron-Core's "
            "hybrid-CP schedule (forward_backward_no_pipelining), which sets it per row; turn "
            "hybrid_context_parallel off to run rows without it")
    size = int(value)
    plan.alignment(size)  # refuses a size this world has no group for
    if size == 1:
        return RowCP(1, None)
    from megatron.core import parallel_state  # Megatron-Core's parallel state: a row of k > 1 ranks only

    return RowCP(size, parallel_state.get_hybrid_data_context_parallel_groups(group_size=size))


def bind_row_to_params(packed_seq_params, row: RowCP) -> None:
    """Tell attention the row's group as Transformer Engine reads it (``TEDotProductAttention.forward``): the group
    at ``k > 1``; ``local_cp_size = 1`` and no group at ``k = 1``, which turns CP off (TE keeps the last group it was
    given, so every row says which it runs with)."""
    if packed_seq_params is None:
        return
    packed_seq_params.local_cp_size = row.size
    packed_seq_params.cp_group = row.group
