"""``bridge-thd scan``'s recipe glue: the recipe function by name (:func:`recipe_config`), its split built as the
trainer's provider builds it with the scan's settings (:func:`build_split`), and what the scan reads from the
recipe (its processor's placeholder ids and merge size, its GPU count, the planner preset of its processor).
Reasoning: docs/scan.md.
"""

from __future__ import annotations

import difflib
import importlib
import re

__all__ = ["RECIPE_MODULE", "NO_CUT", "SPLITS", "recipe_config", "build_split"]

RECIPE_MODULE = "megatron.bridge.recipes.qwen_vl.h100"  # where a bare recipe name is looked up
NO_CUT = 2**31 - 1  # the scan's dataset seq_length: no sample is cut
SPLITS = ("train", "validation", "test")


def recipe_config(name: str):
    """The recipe function ``name`` (in :data:`RECIPE_MODULE`, or ``module:function``) called: its
    ``ConfigContainer``.

    Raises:
        ValueError: naming ``--recipe``, with close names, when there is no such function.
    """
    module_name, _, function = name.rpartition(":") if ":" in name else (RECIPE_MODULE, ":", name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--recipe {name!r}: cannot import {module_name!r} ({error})") from None
    recipe = getattr(module, function, None)
    if not callable(recipe):
        known = [n for n in getattr(module, "__all__", dir(module)) if n.endswith("_config")]
        close = difflib.get_close_matches(function, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(sorted(known)[:3])}"
        raise ValueError(f"--recipe {name!r}: {module_name} has no recipe function {function!r}{hint} "
                         "(another module's: --recipe package.module:function)")
    return recipe()


def _gpus_of(recipe: str) -> int | None:
    match = re.search(r"_(\d+)gpu_", recipe)
    return int(match.group(1)) if match else None


def _preset_for(path: str | None) -> str | None:
    """The planner preset whose Hugging Face repository is ``path`` (the recipe's processor path), if any."""
    from megatron.bridge_thd.cost.presets import PRESETS

    return next((name for name, spec in PRESETS.items() if path and spec.hf_repo == path), None)


def build_split(cfg, split: str):
    """``cfg.dataset``'s ``split`` as the trainer's provider builds it, with the scan's settings
    (:mod:`megatron.bridge_thd.plan.scan`'s docstring); the other splits are not built.

    Raises:
        ValueError: naming ``--split`` when the recipe asks for no samples of it.
    """
    from megatron.bridge.data.loaders import get_train_valid_test_num_samples
    from megatron.bridge.data.utils import get_dataset_provider

    dataset_config = cfg.dataset
    counts = list(get_train_valid_test_num_samples(cfg))
    which = SPLITS.index(split)
    if counts[which] <= 0:
        raise ValueError(f"--split {split}: the recipe asks for no {split} samples (train_iters, eval_iters, "
                         "eval_interval and the batch sizes decide how many); scan another split")
    counts = [count if k == which else 0 for k, count in enumerate(counts)]
    dataset_config.seq_length = NO_CUT
    for name, value in (("pad_to_max_length", False), ("defer_in_batch_packing_to_step", True)):
        if hasattr(dataset_config, name):
            setattr(dataset_config, name, value)
    if hasattr(dataset_config, "finalize"):
        dataset_config.finalize()
    tokenizer = None
    if getattr(dataset_config, "hf_processor_path", None) is None and getattr(cfg, "tokenizer", None) is not None:
        from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(cfg.tokenizer)
        if hasattr(dataset_config, "tokenizer"):
            dataset_config.tokenizer = tokenizer
    built = get_dataset_provider(dataset_config)(counts, dataset_config, tokenizer=tokenizer, pg_collection=None)
    dataset = built[which]
    if dataset is None:
        raise ValueError(f"--split {split}: the provider built no {split} dataset for {type(dataset_config).__name__}")
    return dataset


def _processor_facts(dataset) -> tuple[tuple[int, ...], int | None]:
    """The dataset's processor's image / video placeholder token ids and spatial merge size, where it has them
    (attributes only: the tokenizer is not run in this process)."""
    processor = getattr(dataset, "_processor", None) or getattr(dataset, "processor", None)
    ids = tuple(int(v) for v in (getattr(processor, "image_token_id", None), getattr(processor, "video_token_id", None))
                if isinstance(v, int))
    merge = None
    for part in ("image_processor", "video_processor"):
        value = getattr(getattr(processor, part, None), "merge_size", None)
        if isinstance(value, int):
            merge = value
            break
    return ids, merge
