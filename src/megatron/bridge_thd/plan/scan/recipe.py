"""``bridge-thd scan``'s recipe glue: the recipe function by name (:func:`recipe_config`), the recipe's facts as the
rules read them (:func:`recipe_setup`), its split built as the trainer's provider builds it with the scan's settings
(:func:`build_split`), and what the scan reads from the recipe (its processor's placeholder ids and merge size, its
GPU count, the planner preset of its processor). Reasoning: docs/scan.md.
"""

from __future__ import annotations

import difflib
import importlib
import re

from megatron.bridge_thd.cost.presets import PRESETS
from megatron.bridge_thd.rules.setup import Setup, read_setup
from megatron.bridge_thd.settings import PackingSettings

__all__ = ["RECIPE_MODULE", "NO_CUT", "SPLITS", "recipe_config", "recipe_setup", "build_split"]

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
    recipe = getattr(module, function, None)  # offers: the recipe function --recipe names, if the module has it
    if not callable(recipe):
        known = [n for n in getattr(module, "__all__", dir(module)) if n.endswith("_config")]  # optional: else dir()
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
    return next((name for name, spec in PRESETS.items() if path and spec.hf_repo == path), None)


def recipe_setup(cfg) -> Setup:
    """The rules' facts of the recipe's ``ConfigContainer`` (:func:`~megatron.bridge_thd.rules.setup.read_setup`): its
    parallel sizes, sequence lengths, batch sizes and processor path. No layout or packing setting is judged here
    (the run's packing settings are not read: the defaults stand in)."""
    return read_setup(cfg, "thd", settings=PackingSettings())


def build_split(cfg, split: str):
    """``cfg.dataset``'s ``split`` as the trainer's provider builds it, with the scan's settings
    (:mod:`megatron.bridge_thd.plan.scan`'s docstring); the other splits are not built.

    Raises:
        ValueError: naming ``--split`` when the recipe asks for no samples of it.
    """
    # Megatron-Bridge's data modules: the scan's caller made Megatron-Bridge importable whole (the CPU build's
    # environment on a machine without Transformer Engine).
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
        if hasattr(dataset_config, name):  # duck: dataset configs of several classes; set where the class has it
            setattr(dataset_config, name, value)
    if hasattr(dataset_config, "finalize"):  # duck: dataset configs of several classes; some finalize their fields
        dataset_config.finalize()
    tokenizer = None
    if recipe_setup(cfg).processor_path is None and cfg.tokenizer is not None:
        from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer  # Megatron-Bridge's tokenizers

        tokenizer = build_tokenizer(cfg.tokenizer)
        if hasattr(dataset_config, "tokenizer"):  # duck: a dataset config that takes the built tokenizer
            dataset_config.tokenizer = tokenizer
    built = get_dataset_provider(dataset_config)(counts, dataset_config, tokenizer=tokenizer, pg_collection=None)
    dataset = built[which]
    if dataset is None:
        raise ValueError(f"--split {split}: the provider built no {split} dataset for {type(dataset_config).__name__}")
    return dataset


def _processor_facts(dataset) -> tuple[tuple[int, ...], int | None]:
    """The dataset's processor's image / video placeholder token ids and spatial merge size, where it has them
    (attributes only: the tokenizer is not run in this process)."""
    held = (getattr(dataset, name, None) for name in ("_processor", "processor"))  # duck: datasets of several classes
    processor = next((p for p in held if p), None)
    ids = tuple(int(v) for v in (getattr(processor, name, None)  # optional: a processor without placeholder ids
                                 for name in ("image_token_id", "video_token_id")) if isinstance(v, int))
    parts = (getattr(processor, name, None) for name in ("image_processor", "video_processor"))  # optional: per kind
    merges = (getattr(part, "merge_size", None) for part in parts)  # optional: a processor without a merge size
    return ids, next((m for m in merges if isinstance(m, int)), None)
