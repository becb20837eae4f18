"""Qwen3.5-VL 2B SFT on cord_v2 with real THD packing (8xH100: DP8), Gated DeltaNet included.

Megatron-Bridge's own Qwen3.5-VL recipe with our forward step, configured by
``megatron.bridge_thd.configure``. The setting of the one public measurement (Megatron-Bridge PR
3838: seq_length 2048, MBS 2 padded 363 ms/iter vs THD 342; MBS 4 padded out of memory, THD 505).
Needs a GPU container with Transformer Engine, Megatron-Core >= 0.18 and flash-linear-attention
(Gated DeltaNet runs THD only through fla's kernels) and Hugging Face hub access; not run on the
CPU-only CI (there ``tests/test_qwen35_parity.py`` runs the same step on a tiny hybrid model).

    torchrun --nproc-per-node 8 recipes/qwen35_vl_2b_cord_v2_thd.py [--layout thd|thd_static|bshd|megatron_bridge]

``--cpu-tiny`` is refused for this recipe: the CPU mode's tiny checkpoint is a Qwen3-VL, and a tiny
Qwen3.5-VL through Megatron-Bridge's HF conversion and ``finetune()`` on the CPU is not built yet
(README, limits).
"""

import sys

from _thd_recipe import main  # recipes/_thd_recipe.py: our packing flags, our step, the CPU mode

if __name__ == "__main__":
    if "--cpu-tiny" in sys.argv:
        sys.exit("--cpu-tiny: not available for the Qwen3.5-VL recipe yet (the tiny CPU checkpoint is a "
                 "Qwen3-VL); use recipes/qwen3_vl_8b_cord_v2_thd.py --cpu-tiny")
    main("megatron.bridge.recipes.qwen_vl.h100.qwen35_vl", "qwen35_vl_2b_sft_1gpu_h100_bf16_config")
