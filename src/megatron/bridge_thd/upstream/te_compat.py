"""Transformer Engine run-time compatibility rules for packed THD rows.

One rule so far: context parallelism with THD rows on Hopper with cuDNN < 9.18
(TransformerEngine issue 2186, ``docs/te-cp-padding.md``).

TE's context-parallel attention (``AttnFuncWithCPAndKVP2P``) cuts every physical segment into
``2 * cp`` chunks; on the ring steps where a rank attends with its second chunk only, a segment
whose second chunk on that rank holds no real token is passed to cuDNN's ragged SDPA as a query
of length 0 against keys that do hold real tokens, and the backward's dK/dV come out huge, then
NaN. The maintainers traced it to "an issue with workspace initialization in cuDNN SDPA backward
on Hopper (Blackwell is fine)", "should be fixed in 9.18". No TE release works around it (TE
main at d0067d0 still allocates that workspace with ``at::empty``), so the rule is on the cuDNN
runtime and the GPU, not on the TE version; TE's version is named in the message only to say
which stack was inspected.

A layout cannot avoid such chunks: real tokens sit at the start of their slot, so a sample of n
real tokens in a slot of L leaves chunk ``2cp - 1`` without a real token whenever
``n <= L - L / (2cp)`` — every sample shorter than ``2 * cp`` tokens, and many short ones beyond
(see :func:`megatron.bridge_thd.context_parallel.thd_padding_chunks`). So the affected stacks
are refused up front, before any row reaches the model, instead of failing at some step.

Nothing here imports Transformer Engine: its version is read from the installed distribution's
metadata, cuDNN's from ``torch.backends.cudnn.version()`` (the library TE's fused attention
also loads: one ``libcudnn.so.9`` per process), and only when ``cp_size > 1``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

from megatron.bridge_thd.checks import check_int

__all__ = [
    "CpPaddingRule",
    "TE_CP_PADDING_RULE",
    "DETECT",
    "te_cp_padding_verdict",
    "installed_te_version",
    "cudnn_version_tuple",
]


@dataclass(frozen=True)
class CpPaddingRule:
    """When THD rows under context parallelism are refused (data: see the module docstring).

    Attributes:
        issue: the upstream report.
        affected_compute_capability_major: GPUs whose cuDNN SDPA backward is affected (9 = Hopper:
            H100, H200, H800, H20, GH200); Blackwell is not, and before cuDNN 9.18.1 cuDNN has no
            THD backward below sm90 (TE does not pick FusedAttention for THD there).
        cudnn_fixed: the first cuDNN runtime with the fix.
        te_versions: which TE releases route THD + CP through the affected kernel.
        te_checked_at: the TE sources read for this rule.
        fused_attention_env: TE's switch for its cuDNN backend; "0" means cuDNN attention is never
            used (TE then needs a flash-attention backend that takes THD with padding between
            sequences, or it refuses the call itself).
        override_env: set to "1" to accept a stack known to be patched (e.g. TE built with the
            workspace zero-fill from the issue).
    """

    issue: str
    affected_compute_capability_major: int
    cudnn_fixed: tuple[int, int, int]
    te_versions: str
    te_checked_at: str
    fused_attention_env: str
    override_env: str


TE_CP_PADDING_RULE = CpPaddingRule(
    issue="https://github.com/NVIDIA/TransformerEngine/issues/2186",
    affected_compute_capability_major=9,
    cudnn_fixed=(9, 18, 0),
    te_versions=(
        "every TE release with THD context parallelism: with padding between sequences (which "
        "packed rows always have) TE selects FusedAttention (cuDNN) for THD, and on Hopper it "
        "prefers FusedAttention over flash-attention; reported on TE 2.6, unchanged through 2.18"
    ),
    te_checked_at="v2.6 (c90a720765bc) and main d0067d0da6cb (2026-08-22)",
    fused_attention_env="NVTE_FUSED_ATTN",
    override_env="BRIDGE_THD_ALLOW_TE_CP_PADDING",
)


class _Detect:
    def __repr__(self) -> str:
        return "DETECT"


DETECT = _Detect()
"""Default of :func:`te_cp_padding_verdict`'s environment arguments: look it up (lazily)."""

# Distribution names TE is installed under (pip meta-package, framework and core wheels; a
# source build registers "transformer_engine", which metadata lookup normalises to the first).
_TE_DISTRIBUTIONS = (
    "transformer-engine",
    "transformer-engine-torch",
    "transformer-engine-cu12",
    "transformer-engine-cu13",
)


def cudnn_version_tuple(version: int) -> tuple[int, int, int]:
    """cuDNN's integer version (``cudnnGetVersion``) as ``(major, minor, patch)``.

    cuDNN 9 encodes ``major * 10000 + minor * 100 + patch`` (91800 = 9.18.0); cuDNN 8
    ``major * 1000 + minor * 100 + patch`` (8907 = 8.9.7).
    """
    if version >= 10000:
        return version // 10000, version // 100 % 100, version % 100
    return version // 1000, version // 100 % 10, version % 100


@functools.lru_cache(maxsize=1)
def installed_te_version() -> str | None:
    """The installed Transformer Engine version string, ``"unknown"`` when the package is
    importable without distribution metadata, or None when it is not installed. Never imports it."""
    for name in _TE_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    # find_spec on a top-level name locates the package without executing it.
    return "unknown" if importlib.util.find_spec("transformer_engine") is not None else None


@functools.lru_cache(maxsize=1)
def _detected_device() -> tuple[tuple[int, int] | None, tuple[int, int, int] | None]:
    """(compute capability of the current CUDA device, cuDNN runtime version), None where absent."""
    import torch

    if not torch.cuda.is_available():
        return None, None
    capability = tuple(torch.cuda.get_device_capability())
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return capability, None if version is None else cudnn_version_tuple(int(version))


def _fmt(version) -> str:
    return ".".join(str(part) for part in version)


def te_cp_padding_verdict(
    cp_size: int,
    *,
    te_version=DETECT,
    cudnn_version=DETECT,
    compute_capability=DETECT,
    fused_attention=DETECT,
    override=DETECT,
) -> tuple[bool, str]:
    """Whether THD rows under context parallelism are safe from TransformerEngine issue 2186 on this stack.

    The step's plan asks once (the environment is detected once and cached) for a model with ``cp_size > 1`` and a
    THD layout, and its rule ``te_cp_padding`` (:mod:`megatron.bridge_thd.rules`) refuses an affected stack with the
    reason given here. The BSHD layout is not concerned (no ragged attention).

    Args:
        cp_size: the context-parallel group size. 1 returns at once, detecting nothing.
        te_version: the TE version string, None when TE is not installed; detected from
            distribution metadata by default (TE is never imported).
        cudnn_version: ``(major, minor, patch)`` of the cuDNN runtime, None without cuDNN;
            ``torch.backends.cudnn.version()`` by default.
        compute_capability: ``(major, minor)`` of the GPU, None without a CUDA device;
            ``torch.cuda.get_device_capability()`` by default.
        fused_attention: whether TE may use its cuDNN backend; by default
            ``NVTE_FUSED_ATTN != "0"``.
        override: accept regardless (a patched stack); by default
            ``BRIDGE_THD_ALLOW_TE_CP_PADDING == "1"``.

    Returns:
        ``(True, why it is accepted)``, one short phrase (for a log line); or ``(False, the refusal)`` on an affected
        stack, naming the versions found, the issue and the fixes.
    """
    check_int("cp_size", cp_size, 1, "pass the context-parallel group size")
    rule = TE_CP_PADDING_RULE
    if cp_size == 1:
        return True, "cp_size=1: no context-parallel chunks"
    if te_version is DETECT:
        te_version = installed_te_version()
    if te_version is None:
        return True, "Transformer Engine is not installed (the CPU attention path does not use it)"
    if compute_capability is DETECT or cudnn_version is DETECT:
        detected_capability, detected_cudnn = _detected_device()
        compute_capability = detected_capability if compute_capability is DETECT else compute_capability
        cudnn_version = detected_cudnn if cudnn_version is DETECT else cudnn_version
    if compute_capability is None:
        return True, "no CUDA device: Transformer Engine attention does not run"
    if compute_capability[0] != rule.affected_compute_capability_major:
        return True, f"sm{compute_capability[0]}{compute_capability[1]}: cuDNN's SDPA backward is affected on Hopper only"
    if cudnn_version is None:
        return True, "no cuDNN: Transformer Engine cannot use FusedAttention"
    if tuple(cudnn_version) >= rule.cudnn_fixed:
        return True, f"cuDNN {_fmt(cudnn_version)} >= {_fmt(rule.cudnn_fixed)} has the fix"
    if fused_attention is DETECT:
        fused_attention = os.environ.get(rule.fused_attention_env, "1") != "0"
    if not fused_attention:
        return True, f"{rule.fused_attention_env}=0: TE does not use cuDNN attention"
    if override is DETECT:
        override = os.environ.get(rule.override_env, "0") == "1"
    if override:
        return True, f"{rule.override_env}=1: the stack is declared patched"
    return False, (
        f"context parallelism (cp_size={cp_size}) with packed THD rows: Transformer Engine {te_version} with cuDNN "
        f"{_fmt(cudnn_version)} on sm{compute_capability[0]}{compute_capability[1]} (Hopper) gives NaN gradients "
        "whenever a CP rank's chunk of a sequence holds only padding (TransformerEngine issue 2186, "
        f"{rule.issue}: a workspace-initialisation bug in cuDNN's SDPA backward on Hopper, fixed in cuDNN "
        f"{_fmt(rule.cudnn_fixed)}). No layout avoids such chunks: any sample shorter than 2*cp = {2 * cp_size} "
        "tokens makes one, and so does alignment padding of other short samples. Fix: install cuDNN >= "
        f"{_fmt(rule.cudnn_fixed)} (e.g. pip install 'nvidia-cudnn-cu12>=9.18', or a container that has it), or "
        "set context_parallel_size=1, or layout='bshd'; set "
        f"{rule.override_env}=1 only if your TE build zero-fills the fused-attention backward workspace (the "
        "workaround in the issue)"
    )
