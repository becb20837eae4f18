"""The CPU test bed: Megatron-Bridge 0.6.2's real models built without CUDA or Transformer Engine
(``stack``, ``model``, ``qwen35``, ``qwen25_vl``, ``attention``, ``gdn``), gloo processes
(``launcher``, ``standalone``), parity checks (``parity``, ``pipeline``, ``verl_support``), the
Hugging Face reference (``reference``), synthetic receipts (``data``), a cord_v2-shaped dataset and a
tiny Qwen3-VL processor made locally (``cord_v2``), Megatron-Bridge imported whole and its recipes,
trainer and checkpoints run on the CPU (``bridge_package``, ``hf_hub``, ``training``), op counting
(``opcount``), Megatron-Core's CUDA-graph bookkeeping run on the CPU (``graphs``) and the demo (``demo``, ``make demo``). Docs: docs/testbed.md.

Never imported by the runtime (the step, the packer, the opt-ins); nothing is patched at import.
"""
