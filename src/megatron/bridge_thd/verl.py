"""VERL's packed-sequence helpers, vectorised: swap one import.

    from megatron.bridge_thd.verl import preprocess_packed_seqs, postprocess_packed_seqs

The public import path users already have in their code, kept on purpose: an alias of
:mod:`megatron.bridge_thd.interop.verl`, where the implementation and its contract live
(docs/verl.md). Same objects, so either path works.
"""

from megatron.bridge_thd.interop.verl import postprocess_packed_seqs, preprocess_packed_seqs

__all__ = ["preprocess_packed_seqs", "postprocess_packed_seqs"]
