"""The test bed: what the tests and benchmarks need beyond running the model on a CPU
(``megatron.bridge_thd_cpu``): gloo worlds with one deadline (``launcher``, ``forkserver_preload``),
Megatron-Bridge's recipes, trainer and checkpoints run on the CPU (``training``), pipeline and VERL parity
(``pipeline``, ``verl_support``), Qwen2.5-VL built on the CPU (``qwen25_vl``), vision-language batches
(``vlm_batches``), op counting (``opcount``), the runtime's call path per micro-batch (``callpath``) and
Megatron-Core's CUDA-graph bookkeeping on the CPU (``graphs``). Docs: docs/testbed.md.

Never imported by the runtime (``megatron.bridge_thd``) nor by the CPU build; nothing is patched at import.
"""
