"""VERL's packed-sequence helpers, vectorised: swap one import.

    from megatron.bridge_thd.verl import preprocess_packed_seqs, postprocess_packed_seqs

An alias of :mod:`megatron.bridge_thd.interop.verl` (see there for the contract).
"""

from megatron.bridge_thd.interop.verl import postprocess_packed_seqs, preprocess_packed_seqs

__all__ = ["preprocess_packed_seqs", "postprocess_packed_seqs"]
