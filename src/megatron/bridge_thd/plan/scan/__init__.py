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
(:data:`~.recipe.NO_CUT`) so that the collate cuts nothing (the lengths are the untruncated ones; what Megatron-Bridge's
collate would cut at ``--seq-length`` is computed from them, as ``pad_or_truncate_sequence_batch`` keeps each
row's first ``seq_length`` columns), ``pad_to_max_length`` is off, and in-batch packing is deferred to the step
(``defer_in_batch_packing_to_step``, as ``configure(layout=...)`` sets it: the collate then gives each row's 2D
mask). The scan is cached under the key ``batching.sizes`` computes (dataset class, size, period and the first
and last samples as the collate gives them, collated in a worker), so one scan serves every ``--seq-length``.

One module per job (import from them; this package exports nothing): ``measuring`` (one collated sample
measured: :func:`~.measuring.measure`, :class:`~.measuring.ScannedSample`, :class:`~.measuring.Scan`), ``cache``
(:func:`~.cache.scan_dataset` in loader workers, and its cache), ``lengths_file``
(:func:`~.lengths_file.write_lengths`), ``lengths_summary`` (:func:`~.lengths_summary.summary`,
:func:`~.lengths_summary.histogram`, :func:`~.lengths_summary.over_length`), ``recipe`` (:func:`~.recipe.recipe_config`, :func:`~.recipe.recipe_setup`,
:func:`~.recipe.build_split`) and ``command`` (:func:`~.command.build_parser`, :func:`~.command.run`,
:func:`~.command.main`). Where the scan runs (Megatron-Bridge whole on a machine without Transformer Engine,
``--cpu-tiny``'s local data) is the CPU build's ``megatron.bridge_thd_cpu.scan_environment``, which the command
imports inside ``run``: the one place the planner reaches the CPU build.
"""
