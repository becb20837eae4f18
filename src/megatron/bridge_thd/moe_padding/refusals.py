"""What :func:`~megatron.bridge_thd.moe_padding.hook.with_padding_mask` refuses: the registry's rules for the hook
(:mod:`megatron.bridge_thd.rules`, place ``hook``), run when the hook installs and on every forward."""

from __future__ import annotations

from megatron.bridge_thd.rules.registry import HOOK
from megatron.bridge_thd.rules.run import refuse
from megatron.bridge_thd.rules.setup import read_hook_setup


def fail_if_unsupported(config) -> None:
    """Refuse (``ValueError`` listing every problem) settings under which the mask cannot reach every router
    (docs/moe-padding-mask.md)."""
    refuse(read_hook_setup(config), HOOK, "with_padding_mask: the MoE routers cannot see real tokens only")
