"""Rules on a CP size per sample: Megatron-Core's ``hybrid_context_parallel`` (docs/dynamic-cp.md, docs/rules.md)."""

from __future__ import annotations

from megatron.bridge_thd.rules.registry import CONFIGURE, STEP, rule
from megatron.bridge_thd.rules.setup import Setup

__all__: list[str] = []


@rule(CONFIGURE, STEP)
def _hybrid_cp_engine(s: Setup) -> list[str]:
    """What Megatron-Core's hybrid-CP schedule needs or lacks.

    Only ``forward_backward_no_pipelining`` dispatches to it (``pipeline_parallel/schedules.py``); it runs a
    different number of forwards on each rank, so the loss must be per token (Megatron-LM's ``arguments.py``
    asserts it, with no pipeline parallelism and no CUDA graphs); MoE EP overlap wins that dispatch
    (``overlap_moe_expert_parallel_comm`` is tested first) and would silently run the ordinary schedule.
    """
    m = s.model
    if not m.hybrid_cp:
        return []
    problems = []
    if s.pp > 1:
        problems.append(f"model.hybrid_context_parallel: pipeline_model_parallel_size={s.pp}; Megatron-Core's hybrid-CP "
                        "schedule runs without pipeline parallelism only; set pipeline_model_parallel_size=1")
    if s.cp > 1:
        problems.append(f"model.hybrid_context_parallel: context_parallel_size={s.cp}; a CP size per sample is built "
                        "on a static CP size of 1 (every rank is a DP x CP rank); set context_parallel_size=1")
    if not m.per_token_loss:
        problems.append("model.hybrid_context_parallel: calculate_per_token_loss=False; ranks run different numbers "
                        "of rows, so the loss is normalised over the step's tokens; set calculate_per_token_loss=True")
    if m.max_tokens_per_rank is None:
        problems.append("model.hybrid_context_parallel: max_seqlen_per_dp_cp_rank is not set; set the most tokens "
                        "of one sample a rank may hold")
    if s.graphs:
        problems.append(f"model.hybrid_context_parallel: CUDA graphs are on ({m.graph_setting}); a row's CP group "
                        "and shape change from row to row; turn CUDA graphs off")
    if s.moe_overlap is not None:
        problems.append(f"model.hybrid_context_parallel: {s.moe_overlap}=True takes Megatron-Core's schedule dispatch "
                        "before hybrid CP; turn it off")
    return problems


@rule(CONFIGURE, STEP)
def _hybrid_cp_rows(s: Setup) -> list[str]:
    """A row per CP group is a ``thd`` row: the static row and the padded layout have one shape for every rank,
    and Megatron-Bridge's Qwen3-VL is the family whose CP path is driven per row."""
    if not s.model.hybrid_cp or s.layout == "thd":
        return []
    return [f"model.hybrid_context_parallel: layout={s.layout!r}; rows run with a CP size each are packed 'thd' "
            "rows; set layout='thd'"]


@rule(CONFIGURE, STEP)
def _hybrid_cp_not_built(s: Setup) -> list[str]:
    """What CP per sample does not run yet (docs/dynamic-cp.md, "What is left"): MoE routers reduce their
    statistics over the static CP group (their group per row and exact token counts are not built), Gated DeltaNet
    keeps the CP size it was built with, and the MTP block is untested with it. Refused, not run wrong."""
    m = s.model
    if not m.hybrid_cp:
        return []
    problems = []
    if m.experts:
        problems.append(f"model.hybrid_context_parallel: num_moe_experts={m.experts}; the MoE routers' statistics "
                        "per CP group are not built yet; train the MoE model with a static context_parallel_size")
    if m.linear_attention:
        problems.append(f"model.hybrid_context_parallel: experimental_attention_variant={m.linear_attention!r} "
                        "(Qwen3.5-VL's Gated DeltaNet) keeps the CP size it was built with; not built yet; use a "
                        "static context_parallel_size")
    if m.mtp_layers:
        problems.append(f"model.hybrid_context_parallel: mtp_num_layers={m.mtp_layers}; multi-token prediction is "
                        "not run with a CP size per sample yet; set mtp_num_layers=None")
    return problems


@rule(CONFIGURE)
def _hybrid_cp_loaders(s: Setup) -> list[str]:
    """Megatron-Core's hybrid-CP schedule reads one item per step from the iterator: every row of the step, keyed by
    id, with the groups that run them. Megatron-Bridge's loaders yield micro-batches, and the loaders that place a
    step's samples per CP size inside ``finetune()`` are not built yet, so ``configure`` refuses the setting rather
    than let the schedule fail on the first batch. The step runs such rows from an iterator that yields them."""
    if not s.model.hybrid_cp:
        return []
    return ["model.hybrid_context_parallel: the loaders that place each step's samples on CP groups inside finetune() "
            "are not built yet (docs/dynamic-cp.md); Megatron-Bridge's loaders yield micro-batches that Megatron-Core's "
            "hybrid-CP schedule cannot run; set hybrid_context_parallel=False"]
