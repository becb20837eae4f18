"""Qwen3-VL 8B SFT on cord_v2 with real THD packing (8xH100 or any CUDA node).

Megatron-Bridge's own recipe (DirectHFSFTDatasetConfig over CORD-v2) with our forward step.
Needs a GPU container with Transformer Engine and Hugging Face hub access; it is not run on the
CPU-only CI (there `make demo` exercises the same step on a tiny model and synthetic receipts).

    torchrun --nproc-per-node 8 recipes/qwen3_vl_8b_cord_v2_thd.py [--layout thd|thd_static|bshd]
"""

import argparse

from megatron.bridge.recipes.qwen_vl.h100.qwen3_vl import qwen3_vl_8b_sft_2gpu_h100_bf16_config
from megatron.bridge.training.finetune import finetune

from megatron.bridge_thd.configure import configure
from megatron.bridge_thd.qwen3_vl_step import forward_step


def config(layout: str, micro_batch_size: int, seq_length: int):
    cfg = qwen3_vl_8b_sft_2gpu_h100_bf16_config()
    cfg.model.seq_length = seq_length
    cfg.dataset.seq_length = seq_length
    cfg.train.micro_batch_size = micro_batch_size
    # One call sets the packing flags consistently (in-batch packing deferred to our step, the
    # dataset's 2D mask, variable_seq_lengths under PP, HybridEP padding) and refuses
    # contradictions; see megatron/bridge_thd/configure.py.
    return configure(cfg, layout=layout)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["thd", "thd_static", "bshd"], default="thd")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    args = parser.parse_args()
    finetune(config(args.layout, args.micro_batch_size, args.seq_length), forward_step_func=forward_step)
