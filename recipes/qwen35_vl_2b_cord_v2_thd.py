"""Qwen3.5-VL 2B SFT on cord_v2 with real THD packing (8xH100: DP8), Gated DeltaNet included; ``--cpu-tiny`` on a CPU.

Megatron-Bridge's own Qwen3.5-VL recipe with our forward step, configured by
``megatron.bridge_thd.configure``. The setting of the one public measurement (Megatron-Bridge PR
3838: seq_length 2048, MBS 2 padded 363 ms/iter vs THD 342; MBS 4 padded out of memory, THD 505).
On a GPU node it needs a container with Transformer Engine, Megatron-Core >= 0.18 and
flash-linear-attention (Gated DeltaNet runs THD only through fla's kernels) and Hugging Face hub access.
``--cpu-tiny`` runs the same code path (the recipe function, ``configure``, the cord_v2 provider and
Qwen-VL collate, ``finetune()``) on a tiny Hugging Face Qwen3.5-VL (one Gated DeltaNet layer, one
attention layer, Qwen3.5's vision geometry) converted by Megatron-Bridge's ``AutoBridge``, with a local
cord_v2-shaped dataset on gloo ranks; ``tests/bridge/test_training_qwen35.py`` runs that path.

    torchrun --nproc-per-node 8 recipes/qwen35_vl_2b_cord_v2_thd.py [--layout thd|thd_static|bshd|megatron_bridge]
    python recipes/qwen35_vl_2b_cord_v2_thd.py --cpu-tiny [--layout ...] [--train-iters 4]
"""

from _thd_recipe import main  # recipes/_thd_recipe.py: our packing flags, our step, the CPU mode

if __name__ == "__main__":
    main("megatron.bridge.recipes.qwen_vl.h100.qwen35_vl", "qwen35_vl_2b_sft_1gpu_h100_bf16_config")
