"""Qwen3-VL 8B SFT on cord_v2 with real THD packing (8xH100 or any CUDA node; ``--cpu-tiny`` on a CPU).

Megatron-Bridge's own recipe (DirectHFSFTDatasetConfig over CORD-v2) with our forward step. On a
GPU node it needs a container with Transformer Engine and Hugging Face hub access; ``--cpu-tiny``
runs the same code path (the recipe function, ``configure``, the cord_v2 provider and Qwen3-VL
collate, ``finetune()``) on a tiny Qwen3-VL with a local cord_v2-shaped dataset, and is run by
``tests/bridge/test_recipe_scripts.py``.

    torchrun --nproc-per-node 8 recipes/qwen3_vl_8b_cord_v2_thd.py [--layout thd|thd_static|bshd|megatron_bridge] [--global-batch-packing qwen3-vl-8b] [--cp-per-sample 16384]
    python recipes/qwen3_vl_8b_cord_v2_thd.py --cpu-tiny [--layout ...] [--train-iters 4]
"""

from _thd_recipe import main  # recipes/_thd_recipe.py: our packing flags, our step, the CPU mode

if __name__ == "__main__":
    main("megatron.bridge.recipes.qwen_vl.h100.qwen3_vl", "qwen3_vl_8b_sft_2gpu_h100_bf16_config")
