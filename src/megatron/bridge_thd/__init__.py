"""Real THD sequence packing for Qwen3-VL training in Megatron-Bridge.

Data flows one way: batch -> lengths -> packed row -> model -> loss. The entry points (README.md):
:mod:`megatron.bridge_thd.qwen3_vl_step` (the drop-in ``forward_step``), :mod:`megatron.bridge_thd.qwen25_vl_step`,
:mod:`megatron.bridge_thd.configure`, :mod:`megatron.bridge_thd.settings`, :mod:`megatron.bridge_thd.verl`; the
packer itself is :mod:`megatron.bridge_thd.packing`. Each module is imported from where it is defined: the package
re-exports nothing (docs/architecture.md).
"""
