"""Rules on a CP size per sample: Megatron-Core's ``hybrid_context_parallel`` (docs/cp-per-sample.md, docs/rules.md)."""

from __future__ import annotations

from megatron.bridge_thd.rules.registry import CONFIGURE, STEP, rule
from megatron.bridge_thd.rules.setup import Setup

__all__: list[str] = []


@rule(CONFIGURE, STEP)
def _cp_per_sample_engine(s: Setup) -> list[str]:
    """What Megatron-Core's hybrid-CP schedule needs or lacks.

    Only ``forward_backward_no_pipelining`` dispatches to it (``pipeline_parallel/schedules.py``); it runs a
    different number of forwards on each rank, so the loss must be per token (Megatron-LM's ``arguments.py``
    asserts it, with no pipeline parallelism and no CUDA graphs); MoE EP overlap wins that dispatch
    (``overlap_moe_expert_parallel_comm`` is tested first) and would silently run the ordinary schedule.
    """
    m = s.model
    if not s.cp_per_sample:
        return []
    # What configure sets for cp_per_sample is judged on the config it runs with (the step's), not before it is set.
    set_by_configure = s.settings.cp_per_sample is not None and not s.built
    problems = []
    if s.pp > 1:
        problems.append(f"model.hybrid_context_parallel: pipeline_model_parallel_size={s.pp}; Megatron-Core's hybrid-CP "
                        "schedule runs without pipeline parallelism only; set pipeline_model_parallel_size=1")
    if s.cp > 1:
        problems.append(f"model.hybrid_context_parallel: context_parallel_size={s.cp}; a CP size per sample is built "
                        "on a static CP size of 1 (every rank is a DP x CP rank); set context_parallel_size=1")
    if not m.per_token_loss and not set_by_configure:
        problems.append("model.hybrid_context_parallel: calculate_per_token_loss=False; ranks run different numbers "
                        "of rows, so the loss is normalised over the step's tokens; set calculate_per_token_loss=True")
    if m.max_tokens_per_rank is None and not set_by_configure:
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
def _cp_per_sample_rows(s: Setup) -> list[str]:
    """A row per CP group is a ``thd`` row: the static row and the padded layout have one shape for every rank,
    and Megatron-Bridge's Qwen3-VL is the family whose CP path is driven per row."""
    if not s.cp_per_sample or s.layout == "thd":
        return []
    return [f"model.hybrid_context_parallel: layout={s.layout!r}; rows run with a CP size each are packed 'thd' "
            "rows; set layout='thd'"]


@rule(CONFIGURE, STEP)
def _cp_per_sample_limits(s: Setup) -> list[str]:
    """What CP per sample does not run: MoE routers reduce their statistics over a row's group only at TP = 1 (the
    step binds the TP x CP group there); the expert dispatch under EP > 1 is a collective over ranks that run
    different numbers of rows; expert capacity drops tokens per rank; ``global_aux_loss`` averages over data-parallel
    ranks; ``seq_aux_loss`` and the MTP block are untested with it. Refused, not run wrong."""
    m = s.model
    if not s.cp_per_sample:
        return []
    problems = []
    if m.experts and s.tp > 1:
        problems.append(f"model.hybrid_context_parallel: num_moe_experts={m.experts} with "
                        f"tensor_model_parallel_size={s.tp}; the MoE routers reduce over a row's CP group only at "
                        "TP = 1; set tensor_model_parallel_size=1 or use a static context_parallel_size")
    if m.experts and s.ep > 1:
        problems.append(f"model.hybrid_context_parallel: expert_model_parallel_size={s.ep}; the expert dispatch is a "
                        "collective over ranks that run different numbers of rows; set expert_model_parallel_size=1")
    if m.experts and m.capacity_factor is not None:
        problems.append(f"model.hybrid_context_parallel: moe_expert_capacity_factor={m.capacity_factor}; expert "
                        "capacity and token dropping are per rank, so a row cut over several ranks drops other tokens "
                        "than the row on one; unset moe_expert_capacity_factor")
    if m.experts and m.seq_aux_loss:
        problems.append("model.hybrid_context_parallel: moe_router_load_balancing_type includes 'seq_aux_loss', not "
                        "proven with a CP size per row yet; use 'aux_loss'")
    if m.experts and "global_aux_loss" in m.load_balancing:
        problems.append("model.hybrid_context_parallel: moe_router_load_balancing_type includes 'global_aux_loss', "
                        "averaged over data-parallel ranks that run different rows; use 'aux_loss' or "
                        "'seq_aux_loss'")
    if m.mtp_layers:
        problems.append(f"model.hybrid_context_parallel: mtp_num_layers={m.mtp_layers}; multi-token prediction is "
                        "not run with a CP size per sample yet; set mtp_num_layers=None")
    return problems


@rule(CONFIGURE)
def _cp_per_sample_loaders(s: Setup) -> list[str]:
    """Megatron-Core's hybrid-CP schedule reads one item per step from the iterator: every row of the step, keyed by
    id, with the groups that run them. Megatron-Bridge's loaders yield micro-batches; the loaders ``cp_per_sample`` builds
    yield these items (``batching.cp_per_sample_loader``), so the model's flag is set through ``configure`` rather than alone. The
    step itself runs such rows from any iterator that yields them."""
    if not s.model.cp_per_sample or s.settings.cp_per_sample is not None:
        return []
    return ["model.hybrid_context_parallel=True without cp_per_sample: Megatron-Bridge's loaders yield micro-batches that "
            "Megatron-Core's hybrid-CP schedule cannot run; call configure with cp_per_sample=<tokens per rank> (it sets "
            "the flag and builds the loaders), or set hybrid_context_parallel=False"]


@rule(CONFIGURE, STEP)
def _cp_per_sample_placement(s: Setup) -> list[str]:
    """``cp_per_sample`` places each step itself (Megatron-Core's scheduler, or ours on the time model): rows whose length
    follows their samples and their CP group, so global-batch packing's fixed rows have nothing to apply to, nor its
    cost model to Megatron-Core's scheduler (``placement="time"`` reads it as the model it prices rows for, when
    ``cp_per_sample.model`` is unset). Its scan settings (``lengths_file``, ``sizes_cache``) are used."""
    batching = s.global_batch
    if s.settings.cp_per_sample is None or batching is None:
        return []
    values = {"row_length": batching.row_length, "row_buckets": batching.row_buckets}
    if s.settings.cp_per_sample.placement != "time":
        values["cost_model"] = batching.cost_model
    set_values = [f"global_batch_packing.{name}={value!r}" for name, value in values.items() if value is not None]
    if not set_values:
        return []
    return [f"cp_per_sample: {', '.join(set_values)}; with a CP size per sample the placement "
            f"(cp_per_sample.placement={s.settings.cp_per_sample.placement!r}) puts each step in rows that follow their "
            "samples' CP groups, so fixed rows do not apply, nor a cost model to Megatron-Core's scheduler (placement "
            "'time' reads it as its model); unset them"]


@rule(CONFIGURE, STEP)
def _cp_per_sample_recompute(s: Setup) -> list[str]:
    """Activation recomputation reruns a layer's forward inside the backward, after the step has unbound the row's CP
    group (``cp_per_sample.bound_cp_group``): the rerun would cut and exchange at the static CP size."""
    granularity = s.model.recompute_granularity
    if not s.cp_per_sample or granularity is None:
        return []
    modules = f" (recompute_modules={list(s.model.recompute_modules)})" if granularity == "selective" else ""
    return [f"model.hybrid_context_parallel: recompute_granularity={granularity!r}{modules}; the recomputed forward "
            "runs in the backward after the row's CP group is unbound; set recompute_granularity=None"]


@rule(CONFIGURE, STEP)
def _cp_per_sample_gdn_heads(s: Setup) -> list[str]:
    """Gated DeltaNet splits its key and value heads over a row's CP ranks (an all-to-all, ``feat_dim_split``): each
    head count per TP rank must divide by the largest CP size a row may get, the DP x CP world (known at the step)."""
    m = s.model
    if not s.cp_per_sample or not m.linear_attention or s.dp is None or s.dp < 2:
        return []
    problems = []
    for name, heads in zip(("linear_num_key_heads", "linear_num_value_heads"), m.linear_heads):
        if heads and (heads // max(s.tp, 1)) % s.dp:
            problems.append(f"model.{name}: {heads} heads ({heads // max(s.tp, 1)} per TP rank) do not split over the "
                            f"{s.dp} DP x CP ranks a row may run on under hybrid_context_parallel; use a world whose "
                            "size divides the heads per TP rank, or a static context_parallel_size")
    return problems
