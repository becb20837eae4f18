"""Qwen3-VL 8B SFT on cord_v2 with real THD packing (8xH100 or any CUDA node).

Megatron-Bridge's own recipe (DirectHFSFTDatasetConfig over CORD-v2) with our forward step.
Needs a GPU container with Transformer Engine and Hugging Face hub access; it is not run on the
CPU-only CI (there `make demo` exercises the same step on a tiny model and synthetic receipts).

    torchrun --nproc-per-node 8 recipes/qwen3_vl_8b_cord_v2_thd.py [--layout thd|thd_static|bshd]
"""

from megatron.bridge.recipes.qwen_vl.h100.qwen3_vl import qwen3_vl_8b_sft_2gpu_h100_bf16_config

from _thd_recipe import main  # recipes/_thd_recipe.py: our packing flags and step

if __name__ == "__main__":
    main(qwen3_vl_8b_sft_2gpu_h100_bf16_config)
