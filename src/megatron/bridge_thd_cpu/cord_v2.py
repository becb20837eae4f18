"""A small cord_v2-shaped dataset and a tiny Qwen3-VL processor, both made on this machine.

The hub dataset ``naver-clova-ix/cord-v2`` (receipt photos with JSON parses) and Qwen's
processors cannot be downloaded here, so this module writes stand-ins that Megatron-Bridge's
own data path reads unmodified (docs/cord-v2-data-path.md):

* :func:`write_cord_v2` draws receipts with PIL and writes them as the hub dataset stores them:
  parquet shards ``data/{train,validation,test}-00000-of-00001.parquet`` with the columns ``image``
  (a ``datasets.Image`` feature) and ``ground_truth`` (a JSON string in cord-v2's schema:
  ``gt_parse`` with ``menu`` / ``sub_total`` / ``total``, ``meta``, ``valid_line``, ``roi``,
  ``repeating_symbol``, ``dontcare``). ``load_dataset(folder)`` reads it with no hub access; so
  does Megatron-Bridge's ``HFDatasetSourceConfig(path_or_dataset=folder, schema_adapter="cord_v2")``
  and, from a working directory holding ``naver-clova-ix/cord-v2``, the recipe's own preset
  ``HFDatasetSourceConfig(dataset_name="cord_v2")`` (:func:`write_cord_v2_preset_layout`).
* :func:`tiny_qwen3_vl_processor` builds a Hugging Face ``Qwen3VLProcessor``: a byte-level BPE
  tokenizer trained with ``tokenizers`` on receipt text plus Qwen's special tokens and a Qwen3-VL
  style chat template, and image / video processors for the tiny vision tower of
  :data:`~megatron.bridge_thd_cpu.reference.TINY_VISION_CONFIG` (patch 4, temporal patch 2,
  merge 2). Saved to a folder, ``AutoProcessor.from_pretrained(folder)`` loads it offline.
  :data:`PROCESSOR_TOKEN_IDS` holds the ids the tiny model must be built with.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

__all__ = [
    "write_cord_v2",
    "write_cord_v2_preset_layout",
    "tiny_qwen3_vl_processor",
    "model_token_settings",
    "PROCESSOR_TOKEN_IDS",
    "SPECIAL_TOKENS",
    "CORD_V2_HUB_PATH",
    "SPLITS",
]

CORD_V2_HUB_PATH = "naver-clova-ix/cord-v2"
"""The hub path Megatron-Bridge's ``cord_v2`` preset loads (``data/sources/hf.py``)."""

SPLITS = ("train", "validation", "test")

# Qwen's special tokens, in Qwen's order (their ids follow the BPE vocabulary, as in Qwen's).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

BPE_VOCAB_SIZE = 498
"""Byte-level BPE vocabulary (256 bytes + merges); the special tokens follow it."""

PROCESSOR_TOKEN_IDS = {
    "pad_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|endoftext|>"),
    "eos_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|im_end|>"),
    "im_start_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|im_start|>"),
    "vision_start_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|vision_start|>"),
    "vision_end_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|vision_end|>"),
    "image_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|image_pad|>"),
    "video_token_id": BPE_VOCAB_SIZE + SPECIAL_TOKENS.index("<|video_pad|>"),
    "vocab_size": 512,  # BPE_VOCAB_SIZE + 14 special tokens
}
"""Token ids of :func:`tiny_qwen3_vl_processor` (checked against the built tokenizer when it is built)."""

# Qwen3-VL (Instruct) chat template: ChatML turns, images / videos as
# <|vision_start|><|image_pad|><|vision_end|> in place, no default system prompt.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) -%}"
    "{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for content in message['content'] -%}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content['type'] == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}"
    "{{- content['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_ITEMS = (
    "AMERICANO", "CAFE LATTE", "ICED TEA", "CROISSANT", "BAGEL", "CHEESE CAKE", "MOCHA", "GREEN TEA",
    "NASI GORENG", "MIE AYAM", "ES JERUK", "TEH MANIS", "AYAM BAKAR", "KENTANG", "ROTI BAKAR", "SUSU",
)


def _price(rng: random.Random) -> int:
    return rng.randrange(5, 120) * 500


def _fmt(value: int) -> str:
    return f"{value:,}"


def receipt_ground_truth(rng: random.Random, n_items: int, split: str, image_id: int, size: tuple[int, int]) -> dict:
    """One receipt's ground truth in cord-v2's schema (``gt_parse``, ``meta``, ``valid_line``, ...)."""
    menu, lines, subtotal = [], [], 0
    for row in range(n_items):
        name = rng.choice(_ITEMS)
        count = rng.randrange(1, 4)
        unit = _price(rng)
        subtotal += unit * count
        item = {"nm": name, "cnt": str(count), "price": _fmt(unit * count)}
        if rng.random() < 0.4:
            item["unitprice"] = _fmt(unit)
        menu.append(item)
        for key, text in item.items():
            lines.append({
                "words": [{"quad": {"x1": 0, "y1": row, "x2": 1, "y2": row, "x3": 1, "y3": row + 1, "x4": 0, "y4": row + 1},
                           "is_key": 0, "row_id": row, "text": text}],
                "category": f"menu.{key}", "group_id": row, "sub_group_id": 0,
            })
    tax = subtotal // 10
    total = subtotal + tax
    cash = (total // 10000 + 1) * 10000
    gt_parse = {
        "menu": menu if len(menu) > 1 else menu[0],  # cord-v2 stores a single item as a dict
        "sub_total": {"subtotal_price": _fmt(subtotal), "tax_price": _fmt(tax)},
        "total": {"total_price": _fmt(total), "cashprice": _fmt(cash), "changeprice": _fmt(cash - total)},
    }
    width, height = size
    return {
        "gt_parse": gt_parse,
        "meta": {"version": "2.0.0", "split": split, "image_id": image_id,
                 "image_size": {"width": width, "height": height}},
        "valid_line": lines,
        "roi": {"x1": 0, "y1": 0, "x2": width, "y2": 0, "x3": width, "y3": height, "x4": 0, "y4": height},
        "repeating_symbol": [],
        "dontcare": [],
    }


def receipt_image(rng: random.Random, ground_truth: dict):
    """A small receipt drawn with PIL: a white slip, one dark line per menu item and the totals."""
    from PIL import Image, ImageDraw

    width = rng.randrange(32, 97)
    height = rng.randrange(48, 97)
    image = Image.new("RGB", (width, height), (rng.randrange(220, 256),) * 3)
    draw = ImageDraw.Draw(image)
    menu = ground_truth["gt_parse"]["menu"]
    rows = len(menu) if isinstance(menu, list) else 1
    for row in range(rows + 3):
        y = 2 + row * max(1, (height - 4) // (rows + 3))
        draw.line([(2, y), (2 + rng.randrange(width // 3, width - 2), y)], fill=(rng.randrange(0, 80),) * 3)
    draw.text((1, height - 12), "TOTAL", fill=(0, 0, 0))
    return image


def _split_rows(split: str, count: int, rng: random.Random, long_every: int, max_items: tuple[int, int]):
    rows = {"image": [], "ground_truth": []}
    for i in range(count):
        # Most receipts are short; every long_every-th one is long (a long menu: a long answer).
        n_items = rng.randrange(*max_items) if long_every and i % long_every == long_every - 1 else rng.randrange(1, 7)
        truth = receipt_ground_truth(rng, n_items, split, i, (0, 0))
        image = receipt_image(rng, truth)
        truth["meta"]["image_size"] = {"width": image.width, "height": image.height}
        truth["roi"].update(x2=image.width, x3=image.width, y3=image.height, y4=image.height)
        rows["image"].append(image)
        rows["ground_truth"].append(json.dumps(truth))
    return rows


def write_cord_v2(folder, n_train: int = 8, n_val: int = 4, seed: int = 0, *, n_test: int | None = None,
                  long_every: int = 4, long_items: tuple[int, int] = (40, 56)) -> dict[str, int]:
    """Write a cord_v2-shaped dataset: ``folder/data/{split}-00000-of-00001.parquet``.

    Args:
        folder: the dataset folder (created); ``load_dataset(folder)`` finds the three splits by
            their file names, as for the hub repository.
        n_train, n_val: rows of ``train`` and ``validation``; ``n_test`` defaults to ``n_val``.
        seed: the rows are a pure function of the seed.
        long_every: every ``long_every``-th row of each split has ``long_items`` menu items (its
            answer alone is about 15 tokens per item with :func:`tiny_qwen3_vl_processor`); the
            others have 1-6. 0: no long rows.
        long_items: ``[low, high)`` menu items of a long row.

    Returns:
        ``{split: rows}``.
    """
    from datasets import Dataset, Features, Image, Value

    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    features = Features({"image": Image(), "ground_truth": Value("string")})
    counts = {"train": n_train, "validation": n_val, "test": n_val if n_test is None else n_test}
    for index, split in enumerate(SPLITS):
        rng = random.Random(seed * 1000 + index)
        rows = _split_rows(split, counts[split], rng, long_every, long_items)
        Dataset.from_dict(rows, features=features).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return counts


def write_cord_v2_preset_layout(root, **kwargs) -> Path:
    """Write the dataset at ``root/naver-clova-ix/cord-v2``: from the working directory ``root``,
    ``datasets.load_dataset("naver-clova-ix/cord-v2")`` (what the ``cord_v2`` preset calls) takes
    the local folder, which ``datasets`` prefers to the hub for a path that exists on disk.

    Returns:
        The dataset folder.
    """
    folder = Path(root) / CORD_V2_HUB_PATH
    write_cord_v2(folder, **kwargs)
    return folder


def _receipt_corpus(seed: int = 0, rows: int = 400) -> list[str]:
    """Text the tokenizer is trained on: json2token-style receipt answers, prompts and chat roles."""
    rng = random.Random(seed)
    corpus = ["Describe this image.", "user\n", "assistant\n", "system\n", "Picture 1: ", "Video 1: "]
    for i in range(rows):
        gt = receipt_ground_truth(rng, rng.randrange(1, 8), "train", i, (64, 64))["gt_parse"]
        corpus.append(_json2token(gt))
        corpus.append(json.dumps(gt))
    return corpus


def _json2token(obj) -> str:
    # The target text Megatron-Bridge's cord_v2 adapter builds (data/token_utils.json2token, sorted keys).
    if isinstance(obj, dict):
        return "".join(f"<s_{k}>" + _json2token(obj[k]) + f"</s_{k}>" for k in sorted(obj, reverse=True))
    if isinstance(obj, list):
        return "<sep/>".join(_json2token(item) for item in obj)
    return str(obj)


def _build_tokenizer():
    """A byte-level BPE (``tokenizers``) over receipt text, Qwen's special tokens after it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator(_receipt_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE vocabulary: {tokenizer.get_vocab_size()} tokens, expected {BPE_VOCAB_SIZE}")
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))  # in Qwen's order, after the BPE vocabulary
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=131072,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_end|>")]})
    if len(fast) != BPE_VOCAB_SIZE + len(SPECIAL_TOKENS):
        raise RuntimeError(f"tokenizer: {len(fast)} tokens, expected {BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)}")
    fast.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return fast


def tiny_qwen3_vl_processor(folder=None, *, min_pixels: int = 32 * 32, max_pixels: int = 128 * 128,
                            patch_size: int | None = None):
    """A Hugging Face ``Qwen3VLProcessor`` for the tiny Qwen3-VL of the test bed, built locally.

    Tokenizer: byte-level BPE of :data:`BPE_VOCAB_SIZE` trained on receipt text, then Qwen's
    special tokens (:data:`SPECIAL_TOKENS`; ids in :data:`PROCESSOR_TOKEN_IDS`), pad
    ``<|endoftext|>``, eos ``<|im_end|>``, Qwen3-VL's chat template. Image and video processors:
    patch / temporal patch / merge of ``TINY_VISION_CONFIG`` (4 / 2 / 2), Qwen's normalisation, and
    ``min_pixels`` / ``max_pixels`` as the processor's own ``size`` (note: Megatron-Bridge's
    Qwen collate passes its own ``min_pixels=200704, max_pixels=1003520`` on every call, which
    override these; docs/cord-v2-data-path.md).

    Args:
        folder: where to save it (``AutoProcessor.from_pretrained(folder)`` then loads it offline);
            None: not saved.
        patch_size: the vision patch (default ``TINY_VISION_CONFIG``'s 4). The training runs use
            Qwen3-VL's own 16 (``bridge_thd_testbed.training``): Megatron-Bridge's collate resizes every image
            to at least 200704 pixels, 196 tokens at patch 16 as on the real model, 3136 at patch 4.

    Returns:
        The processor.
    """
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from megatron.bridge_thd_cpu.reference import TINY_VISION_CONFIG

    geometry = dict(patch_size=patch_size or TINY_VISION_CONFIG["patch_size"], temporal_patch_size=TINY_VISION_CONFIG["temporal_patch_size"],
                    merge_size=TINY_VISION_CONFIG["spatial_merge_size"])
    mean, std = [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]  # Qwen3-VL's
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
                                            image_mean=mean, image_std=std, **geometry)
    video_processor = Qwen3VLVideoProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels * 8},
                                            image_mean=mean, image_std=std, **geometry)
    tokenizer = _build_tokenizer()
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor,
                                 chat_template=QWEN3_VL_CHAT_TEMPLATE)
    _check_token_ids(processor)
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
        processor.save_pretrained(str(folder))
    return processor


def _check_token_ids(processor) -> None:
    tokenizer = processor.tokenizer
    got = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "im_start_token_id": tokenizer.convert_tokens_to_ids("<|im_start|>"),
        "vision_start_token_id": processor.vision_start_token_id,
        "vision_end_token_id": processor.vision_end_token_id,
        "image_token_id": processor.image_token_id,
        "video_token_id": processor.video_token_id,
        "vocab_size": len(tokenizer),
    }
    if got != PROCESSOR_TOKEN_IDS:
        raise RuntimeError(f"tiny processor: token ids {got} differ from PROCESSOR_TOKEN_IDS {PROCESSOR_TOKEN_IDS}")


def model_token_settings() -> dict:
    """``tiny_qwen3_vl_config`` overrides that make the tiny model agree with the processor."""
    ids = PROCESSOR_TOKEN_IDS
    return dict(vocab_size=ids["vocab_size"], image_token_id=ids["image_token_id"],
                video_token_id=ids["video_token_id"], vision_start_token_id=ids["vision_start_token_id"])
