"""Rules on CUDA graphs with the packed layouts (docs/cuda-graphs.md, docs/rules.md)."""

from __future__ import annotations

from megatron.bridge_thd.rules.registry import CONFIGURE, STEP, rule
from megatron.bridge_thd.rules.setup import Setup


@rule(CONFIGURE)
def _cuda_graphs_argument(s: Setup) -> list[str]:
    """``cuda_graphs=False`` passed for a model config that enables CUDA graphs."""
    if not (s.cuda_graphs is False and s.model.graphs):
        return []
    return [
        f"cuda_graphs: False was passed, but the model config enables CUDA graphs ({s.model.graph_switches}); turn "
        "them off in model, or pass cuda_graphs=None to follow the model config"
    ]


@rule(CONFIGURE, STEP)
def _cuda_graphs_pipeline(s: Setup) -> list[str]:
    """CUDA graphs in the model config with PP>1 and variable sequence lengths: Qwen3VLModel asserts at build."""
    # Megatron-Bridge's models/qwen_vl/modelling_qwen3_vl/model.py, in
    # Qwen3VLModel._expose_language_model_for_cuda_graph_helper (called by __init__): when the
    # language model config's cuda_graph_impl != "none" it asserts `not config.variable_seq_lengths`.
    # With Megatron-Bridge's in-batch packing flag on (every layout configure sets up, except with micro-batch
    # size 1: bridge_packing_flag) ConfigContainer.validate (training/config.py) sets
    # transformer_config._enable_in_batch_packing, and TransformerConfig.finalize (models/transformer_config.py)
    # turns that into variable_seq_lengths=True when pipeline_model_parallel_size > 1 (docs/compatibility.md);
    # configure sets the same hook for "thd" with PP>1 itself.
    # Any cuda_graph_impl counts ("local", "transformer_engine", "full_iteration", or the deprecated
    # switches mapped to them), dense or MoE; PP=1 leaves variable_seq_lengths alone.
    if not s.pipeline_graphs:
        return []
    if s.model.variable_seq_lengths:
        why = "model.variable_seq_lengths=True is set"
        fix = "set model.variable_seq_lengths=False with a static layout, or "
    elif s.bridge_packing_flag:
        why = ("for in-batch packing with PP>1 its ConfigContainer.validate() and TransformerConfig.finalize() set "
               f"variable_seq_lengths=True whatever the layout ({s.layout!r} included)")
        fix = ""
    else:
        why = "layout 'thd' with PP>1 needs variable_seq_lengths=True (its row length changes every micro-batch)"
        fix = "use layout='thd_static' or 'bshd' (with train.micro_batch_size=1 they keep fixed p2p shapes), or "
    return [
        f"{s.model.graph_setting} with model.pipeline_model_parallel_size={s.pp}: Megatron-Bridge's "
        "Qwen3VLModel asserts at build that CUDA graphs run without model.variable_seq_lengths "
        f"(Qwen3VLModel._expose_language_model_for_cuda_graph_helper), and {why}; {fix}set "
        "model.cuda_graph_impl='none' (and enable_cuda_graph / external_cuda_graph False) or "
        "model.pipeline_model_parallel_size=1"
    ]


@rule(CONFIGURE, STEP)
def _hybridep_graphs(s: Setup) -> list[str]:
    """HybridEP with CUDA graphs and a layout other than ``"bshd"``: dispatch inputs must match across ranks."""
    layout = s.layout
    # With PP>1, cuda_graphs_pipeline already refuses every layout (one problem, not two).
    if not (s.graphs and s.model.hybridep and layout != "bshd") or s.pipeline_graphs:
        return []
    reason = (
        "'thd' rows differ in length per rank, so HybridEP dispatch inputs would be uneven"
        if layout == "thd"
        else "'thd_static' rows are equal in length, but packed attention with HybridEP inside CUDA graphs is not "
        "supported by this package"
    )
    return [
        f"layout: {layout!r} with HybridEP (moe_token_dispatcher_type='flex', moe_flex_dispatcher_backend="
        f"'hybridep') and CUDA graphs: the dispatch must see equal token counts on every rank without a host "
        f"sync (Megatron-Bridge pads uneven HybridEP inputs only when CUDA graphs are off); {reason}. Use "
        "layout='bshd', or turn CUDA graphs off to keep a THD layout"
    ]


@rule(CONFIGURE, STEP)
def _cuda_graphs_layout(s: Setup) -> list[str]:
    """``"thd"`` with CUDA graphs, which cannot replay a row whose length changes."""
    # With HybridEP, hybridep_graphs already reports "thd"; with PP>1, cuda_graphs_pipeline.
    if not (s.graphs and s.layout == "thd" and not s.model.hybridep) or s.pipeline_graphs:
        return []
    return [
        "layout: 'thd' gives a row whose length changes every micro-batch, which CUDA graphs cannot replay; use "
        "layout='thd_static' (row padded to micro_batch_size * seq_length) or turn CUDA graphs off"
    ]


@rule(CONFIGURE, STEP)
def _cuda_graphs_scope(s: Setup) -> list[str]:
    """``thd_static`` with a CUDA-graph implementation or scope that cannot replay a THD row (docs/cuda-graphs.md).

    Megatron-Core's Transformer-Engine path asserts ``packed_seq_params is None`` when attention is inside the
    graph (``transformer_layer.py``, ``_te_cuda_graph_replay``); with attention outside it captures the hidden
    states as ``(seq_length, micro_batch_size, H)``, which a THD row ``(N, 1, H)`` matches only for one sample of
    ``seq_length``. ``full_iteration`` replays the whole iteration without comparing any argument (and captures
    the vision tower, which reads the host). ``"local"`` compares every argument and takes the static row.
    """
    # "thd" with graphs and PP>1 with graphs are refused by their own rules.
    if not s.graphs or s.layout != "thd_static" or s.pipeline_graphs:
        return []
    impl, modules = s.model.graph_impl, s.model.graph_modules
    if impl == "full_iteration":
        return ["model.cuda_graph_impl='full_iteration' with layout 'thd_static': the full-iteration graph replays "
                "without comparing its arguments, so a micro-batch's THD metadata would not be its own, and it "
                "captures the vision tower, which reads the host; set model.cuda_graph_impl='local' (it compares "
                "every argument and replays the static row), or layout='bshd'"]
    if impl != "transformer_engine":
        return []
    if not modules or "attn" in modules:
        return [f"model.cuda_graph_impl='transformer_engine' with cuda_graph_modules={sorted(modules) or 'full'} and "
                "layout 'thd_static': Megatron-Core's Transformer-Engine graph path asserts packed_seq_params is None "
                "when attention is inside the graph (transformer_layer.py _te_cuda_graph_replay); set "
                "model.cuda_graph_impl='local', or model.cuda_graph_modules=['mlp'] with train.micro_batch_size=1, "
                "or layout='bshd'"]
    if s.micro_batch_size not in (None, 1) or s.global_batch is not None or s.row_length is not None:
        return [f"model.cuda_graph_impl='transformer_engine' with cuda_graph_modules={sorted(modules)} and layout "
                "'thd_static': the graphs capture the hidden states as (seq_length, micro_batch_size, hidden), which "
                "a THD row (N, 1, hidden) matches only for one sample of seq_length; set train.micro_batch_size=1 "
                "(without global-batch packing), or model.cuda_graph_impl='local', or layout='bshd'"]
    return []


def variable_lengths_set_by_bridge(s: Setup) -> bool:
    """``variable_seq_lengths=True`` with CUDA graphs was set by Megatron-Bridge's ``finalize()`` for in-batch packing
    with PP>1 (its hook): the static layout keeps the row fixed, so it is allowed (``configure`` notes it)."""
    return s.graphs and s.model.variable_seq_lengths and s.pp > 1 and s.model.in_batch_packing_hook \
        and not s.pipeline_graphs


@rule(CONFIGURE, STEP)
def _cuda_graphs_variable_lengths(s: Setup) -> list[str]:
    """``variable_seq_lengths=True`` with CUDA graphs, unless Megatron-Bridge's hook set it."""
    if not (s.graphs and s.model.variable_seq_lengths) or s.pipeline_graphs or variable_lengths_set_by_bridge(s):
        return []
    return [
        "model.variable_seq_lengths=True with CUDA graphs: variable sequence lengths contradict the static "
        "shapes CUDA graphs replay; set model.variable_seq_lengths=False (the static layouts do not need it)"
    ]
