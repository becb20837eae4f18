"""Batching policies: which samples go into which micro-batch (and DP rank). Empty for now; global-batch
packing comes next (issue 19). Contract and plans: docs/batching.md.

A policy only places the samples Megatron-Bridge's sampler drew for a step; the step, the packer
and the layout contract keep seeing one micro-batch at a time and never import this package.
"""
