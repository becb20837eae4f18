"""The CPU stack: Megatron-Bridge 0.6.2's real Qwen3-VL with pure-torch THD attention, the
scoped patches it needs without CUDA or Transformer Engine, and a gloo process launcher.

Never imported by the step or the packer; nothing is patched at import.
"""
