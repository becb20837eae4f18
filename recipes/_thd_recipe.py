"""What the recipes share: a Megatron-Bridge recipe config, our packing flags, our step."""

import argparse

from megatron.bridge.training.finetune import finetune

from megatron.bridge_thd.configure import configure
from megatron.bridge_thd.qwen3_vl_step import forward_step


def config(base_config, layout: str, micro_batch_size: int, seq_length: int):
    """``base_config()`` with our sequence length and micro-batch, packing set by ``configure``
    (in-batch packing deferred to our step, the dataset's 2D mask, variable_seq_lengths under PP,
    HybridEP padding; contradictions refused)."""
    cfg = base_config()
    cfg.model.seq_length = seq_length
    cfg.dataset.seq_length = seq_length
    cfg.train.micro_batch_size = micro_batch_size
    return configure(cfg, layout=layout)


def main(base_config) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["thd", "thd_static", "bshd"], default="thd")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=2048)
    args = parser.parse_args()
    finetune(config(base_config, args.layout, args.micro_batch_size, args.seq_length), forward_step_func=forward_step)
