"""``bridge-thd scan``: a Megatron-Bridge recipe's dataset, measured sample by sample through its own provider,
processor and collate, written as the planner's lengths file, with a summary. Reasoning: docs/scan.md.

Examples::

    bridge-thd scan --recipe qwen3_vl_8b_sft_2gpu_h100_bf16_config --out lengths.json
    bridge-thd scan --recipe qwen35_vl_2b_sft_1gpu_h100_bf16_config --split validation --seq-length 2048
    bridge-thd scan --recipe my.recipes.module:my_recipe_config --model qwen3-vl-8b --gpus 16
    bridge-thd scan --cpu-tiny --seq-length 1280        # this machine: local cord_v2 data, tiny processor

What runs: the recipe function builds its ``ConfigContainer``; its ``cfg.dataset`` goes, unchanged but for three
settings, to the provider Megatron-Bridge's trainer would pick (``data.utils.get_dataset_provider``) with the
sample counts the trainer would ask for (``data.loaders.get_train_valid_test_num_samples``); each **distinct**
sample of the chosen split (``batching.sizes.repeat_period``) is collated alone by the dataset's own collate in
loader worker processes (forked: never in this process, as ``batching.sizes`` scans), and read:

* its real tokens: the 2D attention mask's sum (right-padded rows);
* its supervised tokens, as spans of the collate's (shifted) loss mask, so that what a cut at any ``seq_length``
  keeps is exact;
* its image and video patch grids (``image_grid_thw`` / ``video_grid_thw``) and where its image / video
  placeholder tokens end (the processor's ``image_token_id`` / ``video_token_id``).

The three settings changed, none of which changes a sample's tokens: ``seq_length`` is set out of reach
(:data:`NO_CUT`) so that the collate cuts nothing (the lengths are the untruncated ones; what Megatron-Bridge's
collate would cut at ``--seq-length`` is computed from them, as ``pad_or_truncate_sequence_batch`` keeps each
row's first ``seq_length`` columns), ``pad_to_max_length`` is off, and in-batch packing is deferred to the step
(``defer_in_batch_packing_to_step``, as ``configure(layout=...)`` sets it: the collate then gives each row's 2D
mask). The scan is cached under the key ``batching.sizes`` computes (dataset class, size, period and the first
and last samples as the collate gives them, collated in a worker), so one scan serves every ``--seq-length``.

One module per job, every name re-exported here: ``measuring`` (one collated sample measured:
:func:`measure`, :class:`ScannedSample`, :class:`Scan`), ``cache`` (:func:`scan_dataset` in loader workers, and
its cache), ``lengths_file`` (:func:`write_lengths`), ``lengths_summary`` (:func:`summary`, :func:`histogram`,
:func:`over_length`), ``recipe`` (:func:`recipe_config`, :func:`build_split`), ``environment`` (Megatron-Bridge
whole, ``--cpu-tiny``'s local data: the one module of the runtime package that imports the CPU build) and
``command`` (:func:`build_parser`, :func:`run`, :func:`main`).
"""

from __future__ import annotations

from megatron.bridge_thd.plan.scan.cache import CACHE_SUFFIX, scan_dataset
from megatron.bridge_thd.plan.scan.command import CPU_TINY_RECIPE, build_parser, main, run
from megatron.bridge_thd.plan.scan.lengths_file import FORMAT, lengths_document, write_lengths
from megatron.bridge_thd.plan.scan.lengths_summary import OverLength, histogram, over_length, summary
from megatron.bridge_thd.plan.scan.measuring import Scan, ScannedSample, measure
from megatron.bridge_thd.plan.scan.recipe import NO_CUT, RECIPE_MODULE, SPLITS, build_split, recipe_config

__all__ = ["ScannedSample", "Scan", "OverLength", "build_parser", "main", "run", "measure", "scan_dataset",
           "recipe_config", "build_split", "lengths_document", "write_lengths", "summary", "over_length", "histogram",
           "RECIPE_MODULE", "CPU_TINY_RECIPE", "NO_CUT"]
