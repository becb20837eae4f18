"""megatron-bridge-thd on a CPU: Megatron-Bridge's real Qwen3-VL / Qwen3.5-VL built and run without CUDA,
Transformer Engine or flash-attn, for the demo (``demo``, ``make demo``), the CPU modes of the recipe
scripts and ``bridge-thd scan --cpu-tiny``, and a user checking packing on a laptop.

* ``stack`` (``cpu_stack()``: the scoped CPU stand-ins), ``attention`` (TE's attention on the CPU),
  ``gdn`` (Gated DeltaNet kernels on the CPU), ``standalone`` (world-size-1 process groups);
* ``model``, ``qwen35``, ``reference`` (tiny real models, and Hugging Face's Qwen3-VL as the reference);
* ``data`` (synthetic receipts), ``cord_v2`` (a cord_v2-shaped dataset and a tiny processor made locally);
* ``bridge_package``, ``hf_hub`` (Megatron-Bridge imported whole, its hub configs offline);
* ``parity`` (per-sample losses, packed against unpacked).

Beside the runtime (``megatron.bridge_thd``), which never imports it; nothing is patched at import.
The test bed (``megatron.bridge_thd_testbed``) builds on it. Docs: docs/testbed.md,
docs/megatron-bridge-on-cpu.md.
"""
