"""What a recipe's CPU mode reads and loads: the tiny Hugging Face checkpoints that stand in for the recipes'
hub models (:func:`write_tiny_hf_checkpoint`: Qwen3-VL; :func:`write_tiny_hf_qwen35_checkpoint`: Qwen3.5-VL),
:func:`prepare_cpu_run` (those, the cord_v2-shaped dataset and the tiny processor, written once before the ranks
start) and :func:`pretrained_load_check` (the conversion loaded every tensor into every parameter).
Docs: docs/megatron-bridge-on-cpu.md.
"""

from __future__ import annotations

import os

import torch

__all__ = ["TRAINING_VISION_GEOMETRY", "TINY_QWEN35_TEXT_CONFIG", "write_tiny_hf_checkpoint",
           "write_tiny_hf_qwen35_checkpoint", "prepare_cpu_run", "pretrained_load_check"]

# Qwen3-VL's own vision geometry (patch 16, temporal patch 2, merge 2): with Megatron-Bridge's
# collate forcing min_pixels=200704, an image gives the same number of tokens as on the real model.
TRAINING_VISION_GEOMETRY = dict(patch_size=16, temporal_patch_size=2, spatial_merge_size=2)


def write_tiny_hf_checkpoint(folder, *, token_ids: dict, seed: int = 0, moe: bool = False, num_layers: int = 2) -> str:
    """Save a tiny random Hugging Face Qwen3-VL (``save_pretrained``) whose tokens agree with a processor.

    This is the "pretrained checkpoint" of the CPU runs: the recipe's ``AutoBridge.from_hf_pretrained``
    reads its config and ``finetune`` loads its weights through Megatron-Bridge's own HF conversion,
    as it does for ``Qwen/Qwen3-VL-8B-Instruct``. Language model as ``ReferenceQwen3VL.tiny`` (hidden
    64, 4 heads of 16 over 2 KV groups, MRoPE [2, 3, 3]); vision tower of ``TINY_VISION_CONFIG`` with
    Qwen3-VL's patch geometry (:data:`TRAINING_VISION_GEOMETRY`).

    Args:
        folder: created if needed.
        token_ids: ``vocab_size``, ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
            ``vision_end_token_id``, ``pad_token_id``, ``eos_token_id`` (e.g. ``cord_v2.PROCESSOR_TOKEN_IDS``).
        seed: the weights are a function of the seed.

    Returns:
        ``str(folder)``.
    """
    from megatron.bridge_thd_cpu.reference import tiny_hf_qwen3_vl_config

    ids = token_ids
    config, model_cls = tiny_hf_qwen3_vl_config(
        text=dict(vocab_size=ids["vocab_size"], num_hidden_layers=num_layers, max_position_embeddings=8192,
                  pad_token_id=ids["pad_token_id"], eos_token_id=ids["eos_token_id"],
                  **(dict(num_experts=4) if moe else {})),
        # One deepstack layer: it must sit on the first pipeline stage, which has one layer at PP=2.
        vision=dict(TRAINING_VISION_GEOMETRY, deepstack_visual_indexes=[0]),
        tokens={name: ids[name] for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                             "vision_end_token_id")},
        moe=moe,
    )
    torch.manual_seed(seed)
    model_cls(config).save_pretrained(str(folder))
    return str(folder)


# The tiny Qwen3.5-VL language model (Hugging Face ``text_config`` fields): hidden 64, 4 query heads of 32 over
# 2 KV groups with Qwen3.5's output gate and partial rotary (a quarter of each head: 8 dims, MRoPE sections
# [2, 1, 1] where the 2B has [11, 11, 10] of 64), SwiGLU 128; Gated DeltaNet with 2 key heads and 4 value
# heads of 16 (two value heads per key head, as the larger Qwen3.5 models group them; the 2B has 16 of each),
# conv kernel 4.
TINY_QWEN35_TEXT_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                     "mrope_interleaved": True, "partial_rotary_factor": 0.25},
)


def write_tiny_hf_qwen35_checkpoint(folder, *, token_ids: dict, seed: int = 0,
                                    layer_types=("linear_attention", "full_attention")) -> str:
    """Save a tiny random Hugging Face Qwen3.5-VL (``Qwen3_5ForConditionalGeneration.save_pretrained``, the
    class Megatron-Bridge's ``Qwen35VLBridge`` converts from) whose tokens agree with a processor.

    The Qwen3.5-VL recipes' stand-in for ``Qwen/Qwen3.5-2B``: ``AutoBridge.from_hf_pretrained`` reads it
    into a ``Qwen35VLModelProvider`` and ``finetune`` loads its weights through the bridge's own mappings
    (Gated DeltaNet ``in_proj`` from ``in_proj_qkv/z/b/a``, its conv, ``A_log``, ``dt_bias``, gated norm;
    the gated attention's QKV; zero-centred norms). Language model: :data:`TINY_QWEN35_TEXT_CONFIG`, the
    layers ``layer_types`` (default one Gated DeltaNet layer, then one full-attention layer: the hybrid
    pattern at its smallest); vision tower: two blocks of width 32 with Qwen3.5's patch geometry (patch
    16, temporal patch 2, merge 2: :data:`TRAINING_VISION_GEOMETRY`) and, as Qwen3.5 has, no deepstack.
    No multi-token prediction: Hugging Face's class has no MTP module (it ignores ``mtp.*`` tensors on
    load) and saves none, so the provider read from it has no MTP layer, whereas the real checkpoint
    carries ``mtp.*`` tensors and the 2B SFT recipe sets ``mtp_num_layers=1``: the CPU mode, whose model is
    this checkpoint's provider, trains without the MTP head.

    Returns:
        ``str(folder)``.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    ids = token_ids
    text = dict(TINY_QWEN35_TEXT_CONFIG, vocab_size=ids["vocab_size"], num_hidden_layers=len(layer_types),
                layer_types=list(layer_types), max_position_embeddings=8192, pad_token_id=ids["pad_token_id"],
                eos_token_id=ids["eos_token_id"])
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text["hidden_size"],
                  num_position_embeddings=64, **TRAINING_VISION_GEOMETRY)
    tokens = {name: ids[name] for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                                           "vision_end_token_id")}
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    torch.manual_seed(seed)
    Qwen3_5ForConditionalGeneration(config).save_pretrained(str(folder))
    return str(folder)



def prepare_cpu_run(workdir, *, n_train: int = 64, n_val: int = 8, seed: int = 0, qwen3_vl: bool = True,
                    qwen35: bool = False, qwen3_vl_moe: bool = False) -> dict:
    """Write what a CPU run reads: the cord_v2-shaped dataset (``workdir/naver-clova-ix/cord-v2``, where
    the recipe's ``cord_v2`` preset finds it from the working directory ``workdir``), the tiny
    processor (``workdir/processor``, Qwen3-VL's patch geometry, which Qwen3.5-VL shares: both use
    ``Qwen3VLProcessor``) and the tiny Hugging Face checkpoints: Qwen3-VL (``workdir/hf``, with
    ``qwen3_vl``), Qwen3.5-VL (``workdir/hf_qwen35``, with ``qwen35``) and the Qwen3-VL MoE (``workdir/hf_moe``,
    with ``qwen3_vl_moe``: 4 experts of 32, top-2, the stand-in for ``Qwen/Qwen3-VL-30B-A3B-Instruct``). Call once,
    before the ranks start.

    Returns:
        ``{"workdir", "dataset", "processor", "hf_checkpoint", "hf_checkpoint_qwen35", "hf_checkpoint_moe"}``
        (paths as strings; a checkpoint not written is None).
    """
    from megatron.bridge_thd_cpu.cord_v2 import PROCESSOR_TOKEN_IDS, tiny_qwen3_vl_processor, write_cord_v2_preset_layout

    workdir = os.path.abspath(str(workdir))
    dataset = write_cord_v2_preset_layout(workdir, n_train=n_train, n_val=n_val, seed=seed)
    processor = os.path.join(workdir, "processor")
    tiny_qwen3_vl_processor(processor, patch_size=TRAINING_VISION_GEOMETRY["patch_size"])
    hf_checkpoint = (write_tiny_hf_checkpoint(os.path.join(workdir, "hf"), token_ids=PROCESSOR_TOKEN_IDS, seed=seed)
                     if qwen3_vl else None)
    hf_qwen35 = (write_tiny_hf_qwen35_checkpoint(os.path.join(workdir, "hf_qwen35"), token_ids=PROCESSOR_TOKEN_IDS,
                                                 seed=seed) if qwen35 else None)
    hf_moe = (write_tiny_hf_checkpoint(os.path.join(workdir, "hf_moe"), token_ids=PROCESSOR_TOKEN_IDS, seed=seed,
                                       moe=True) if qwen3_vl_moe else None)
    return {"workdir": workdir, "dataset": str(dataset), "processor": processor, "hf_checkpoint": hf_checkpoint,
            "hf_checkpoint_qwen35": hf_qwen35, "hf_checkpoint_moe": hf_moe}



def pretrained_load_check(hf_checkpoint: str):
    """A Megatron-Bridge ``Callback`` that checks, when training starts from the Hugging Face checkpoint
    (iteration 0, not a resume), that Megatron-Bridge's conversion loaded all of it and nothing else:
    its conversion tasks for the model (``AutoBridge.get_conversion_tasks``) cover every model parameter
    and use every tensor of the checkpoint, and the bridge's own export of the model
    (``export_hf_weights``) gives those tensors back value for value. Megatron-Bridge's trainer filters
    WARNING records from every logger (``logger.filter_warnings``), so a parameter the conversion has
    no mapping or tensor for would otherwise be left at its initial value without a word.

    Its ``result`` after training: None (a resumed run) or ``{"layers", "tensors", "parameters",
    "unmapped_parameters", "unused_tensors", "exported_missing", "max_abs_diff"}``: the checkpoint's
    tensor count, the model's parameter count, parameters no conversion task covers, checkpoint tensors
    no task reads, tensors a task reads that the export does not give back (a task whose tensor the
    checkpoint lacks), and the largest difference between a checkpoint tensor and its export; ``layers``:
    the class of each language-model layer's mixer (``GatedDeltaNet``, ``Qwen3VLSelfAttention``)."""
    import glob

    from megatron.bridge.training.callbacks import Callback

    class PretrainedLoadCheck(Callback):
        result = None

        def on_train_start(self, context):
            if int(context.state.train_state.step) != 0:
                return
            from megatron.bridge import AutoBridge
            from megatron.core.utils import unwrap_model
            from safetensors.torch import load_file

            expected = {}
            for path in sorted(glob.glob(os.path.join(hf_checkpoint, "*.safetensors"))):
                expected.update(load_file(path))
            bridge = AutoBridge.from_hf_pretrained(hf_checkpoint)
            tasks = [task for task in bridge.get_conversion_tasks(context.model) if task is not None]
            used = set()
            for task in tasks:
                names = task.mapping.hf_param
                used.update([names] if isinstance(names, str) else names.values())
            parameters = [name for chunk in unwrap_model(context.model) for name, _ in chunk.named_parameters()]
            exported = {name: tensor.detach().cpu() for name, tensor in
                        bridge.export_hf_weights(context.model, cpu=True, show_progress=False)}
            self.result = {
                # What each decoder layer's mixer is (Gated DeltaNet or attention), on the first chunk.
                "layers": [type(layer.self_attention).__name__
                           for layer in unwrap_model(context.model)[0].language_model.decoder.layers],
                "tensors": len(expected),
                "parameters": len(parameters),
                "unmapped_parameters": sorted(set(parameters) - {task.param_name for task in tasks}),
                "unused_tensors": sorted(set(expected) - used),
                "max_abs_diff": max(float((expected[n].float() - exported[n].float()).abs().max())
                                    for n in expected if n in exported),
                "exported_missing": sorted(set(used) - set(exported)),
            }

    return PretrainedLoadCheck()
