"""VERL on the CPU stack: VERL's own helpers (the release ``VERL_VERSION`` names), VERL-layout
Qwen3-VL batches, the two ways VERL calls a Qwen-VL model, and the train-vs-rollout figures.

Shared by ``tests/parallel/test_interop_verl.py`` (which asserts on them) and ``benchmarks/bench_verl.py``
(which prints them), so that the benchmark measures exactly what the tests prove.

* :func:`find_verl_util` / :func:`load_verl_util`: VERL's ``verl/models/mcore/util.py``, run as a
  stand-alone module by file path (never the ``verl`` package, whose ``__init__`` needs ray).
* :func:`verl_vlm_batch`: samples in VERL's layout (left-padded prompt with images,
  right-padded response).
* :func:`packed_forward`: VERL's text-model call (``model_forward_gen(vision_model=False)``):
  packed ids, packed 3D MRoPE positions, ``packed_seq_params``.
* :func:`vlm_path_forward`: VERL's vision-model call (``model_forward_gen(vision_model=True)``):
  metadata only, the padded ``(B, T)`` batch goes to the model, which packs it itself.
* :func:`real_model_worker`: all of it on one CP rank of Megatron-Bridge's real
  ``Qwen3VLModel`` (run it in-process at CP = 1 or on gloo with
  :func:`~megatron.bridge_thd_testbed.launcher.run_on_gloo`).

Run model calls inside :func:`~megatron.bridge_thd_cpu.stack.cpu_stack`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import torch

from megatron.bridge_thd_cpu.parity import gradients, worst_relative_gradient_error

__all__ = [
    "VERL_VERSION",
    "IMAGE",
    "VIDEO",
    "VISION_START",
    "VISION_END",
    "PATCH_FEATURES",
    "DEFAULT_SPECS",
    "verl_cache_dir",
    "find_verl_util",
    "load_verl_util",
    "load_with_stand_ins",
    "verl_vlm_batch",
    "response_logp",
    "per_sample_response_logp",
    "packed_forward",
    "vlm_path_forward",
    "loss_gradients",
    "train_vs_rollout",
    "summed_gradient_error",
    "real_model_worker",
]

# The VERL release whose util.py the tests and benchmarks compare against (docs/compatibility.md).
VERL_VERSION = "0.9.1"
IMAGE, VIDEO, VISION_START, VISION_END = 250, 251, 252, 253
PATCH_FEATURES = 3 * 2 * 4 * 4  # channels * temporal patch * patch * patch of the tiny model


# ---------------------------------------------------------------------------------------------
# VERL's own util.py, loaded by file path


def verl_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/bridge_thd/verl-<version>`` (``~/.cache`` by default)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridge_thd" / f"verl-{VERL_VERSION}"


@functools.lru_cache(maxsize=None)
def find_verl_util(download: bool = True) -> tuple[str | None, str]:
    """Path of VERL's ``verl/models/mcore/util.py`` and how it was found (or why not).

    Looks at ``BRIDGE_THD_VERL_UTIL``, an installed ``verl`` (``find_spec`` of the top-level
    package does not execute it), the cache, then tries ``pip download --no-deps`` of the wheel
    (only ``util.py`` is extracted; nothing is installed).
    """
    env = os.environ.get("BRIDGE_THD_VERL_UTIL")
    if env:
        return (env, "BRIDGE_THD_VERL_UTIL") if Path(env).is_file() else (None, f"BRIDGE_THD_VERL_UTIL={env} is not a file")
    spec = importlib.util.find_spec("verl")
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "models" / "mcore" / "util.py"
        if path.is_file():
            return str(path), "installed verl"
    cached = verl_cache_dir() / "util.py"
    if cached.is_file():
        return str(cached), "cache"
    if not download:
        return None, "verl is not installed and not cached"
    wheels = verl_cache_dir() / "wheel"
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--timeout", "5", "--retries", "0",
             f"verl=={VERL_VERSION}", "-d", str(wheels)],
            check=True, timeout=30, capture_output=True,
        )
        wheel = next(wheels.glob("verl-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            cached.write_bytes(archive.read("verl/models/mcore/util.py"))
        return str(cached), "downloaded"
    except (subprocess.SubprocessError, OSError, StopIteration, KeyError) as error:
        return None, f"verl {VERL_VERSION} is not installed and could not be downloaded ({type(error).__name__})"


def load_with_stand_ins(path, module_name: str, stand_ins: dict[str, dict]):
    """Execute one of VERL's files as a stand-alone module ``module_name``: each ``verl.*`` package it
    imports is an empty module with the given attributes for the duration of the load (``sys.modules``
    restored afterwards, so no ``verl`` package is left behind)."""
    saved = {name: sys.modules.get(name) for name in stand_ins}
    for name, attributes in stand_ins.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__path__ = []
        for attribute, value in attributes.items():
            setattr(sys.modules[name], attribute, value)
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, module_before in saved.items():
            if module_before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_before
    return module


def load_verl_util(path: str):
    """Execute VERL's util.py as a stand-alone module; the two ``verl.utils`` names it imports are
    stubbed for the duration of the load (``sys.modules`` restored afterwards)."""
    return load_with_stand_ins(path, "verl_mcore_util", {
        "verl": {}, "verl.utils": {}, "verl.utils.device": {"is_npu_available": False},
        "verl.utils.model": {"CausalLMOutputForPPO": object}})


# ---------------------------------------------------------------------------------------------
# VERL-layout batches


DEFAULT_SPECS = (  # (text before, image grids (h, w), text after, response length)
    (3, ((4, 8),), 2, 11),
    (6, (), 3, 17),
    (2, ((8, 8), (4, 4)), 1, 1),
    (4, ((4, 4),), 5, 8),
)


def verl_vlm_batch(seed: int = 0, specs=DEFAULT_SPECS) -> dict:
    """Samples in VERL's layout: left-padded prompt (text, images after a vision-start token) +
    right-padded response. Images of grids (1, h, w), h and w even: h * w / 4 tokens each. The
    default: four samples, one prompt without image, one with two, one response of a single token.

    Returns a dict: ``input_ids`` / ``attention_mask`` ``(B, P + R)``, ``prompt_width`` P,
    ``pixel_values`` ``(sum h * w, 96)``, ``image_grid_thw`` ``(I, 3)`` in order of appearance,
    ``prompt_lengths`` / ``response_lengths``."""
    gen = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(1, 240, (n,), generator=gen).tolist()

    prompts, responses, grids = [], [], []
    for before, images, after, response_length in specs:
        prompt = text(before)
        for h, w in images:
            prompt += [VISION_START] + [IMAGE] * (h * w // 4) + [VISION_END] + text(1)
            grids.append((1, h, w))
        prompts.append(prompt + text(after))
        responses.append(text(response_length))
    prompt_width = max(map(len, prompts)) + 3
    response_width = max(map(len, responses)) + 2
    batch = len(specs)
    ids = torch.zeros(batch, prompt_width + response_width, dtype=torch.long)
    keep = torch.zeros(batch, prompt_width + response_width, dtype=torch.bool)
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        ids[i, prompt_width - len(prompt) : prompt_width] = torch.tensor(prompt)
        ids[i, prompt_width : prompt_width + len(response)] = torch.tensor(response)
        keep[i, prompt_width - len(prompt) : prompt_width + len(response)] = True
    grid = torch.tensor(grids)
    return dict(
        input_ids=ids, attention_mask=keep, prompt_width=prompt_width,
        pixel_values=torch.randn(int(grid.prod(-1).sum()), PATCH_FEATURES, generator=gen), image_grid_thw=grid,
        prompt_lengths=[len(p) for p in prompts], response_lengths=[len(r) for r in responses],
    )


# ---------------------------------------------------------------------------------------------
# The model, called as VERL calls it, and each sample alone


def response_logp(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    """VERL's log-probs of the response tokens from (B, T, V) logits: position t - 1 predicts t.

    Returns ``(B, R)``; entries past a response's length are 0."""
    width = batch["prompt_width"]
    targets = batch["input_ids"][:, width:]
    logp = torch.log_softmax(logits[:, width - 1 : -1].float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    return logp * batch["attention_mask"][:, width:]


def per_sample_response_logp(model, batch: dict) -> list[torch.Tensor]:
    """Each sample alone and unpadded (the model computes its own MRoPE positions): ``(r_i,)`` each."""
    grids, pixels = batch["image_grid_thw"], batch["pixel_values"]
    patch_ends = [0] + grids.prod(-1).cumsum(0).tolist()
    out, images_before = [], 0
    for i in range(batch["input_ids"].shape[0]):
        ids = batch["input_ids"][i][batch["attention_mask"][i]]
        n_images = int((ids == VISION_START).sum())
        kwargs = {}
        if n_images:
            first, last = images_before, images_before + n_images
            kwargs = dict(pixel_values=pixels[patch_ends[first] : patch_ends[last]], image_grid_thw=grids[first:last])
        images_before += n_images
        logits = model(input_ids=ids[None], **kwargs)[0]
        p = batch["prompt_lengths"][i]
        logp = torch.log_softmax(logits[p - 1 : -1].float(), dim=-1).gather(-1, ids[p:, None])[:, 0]
        out.append(logp)
    return out


def packed_forward(model, batch: dict, pre, post, use_fp8_padding: bool = False) -> tuple[torch.Tensor, object]:
    """VERL's text-model call (``model_forward_gen(vision_model=False)``): packed ids, packed 3D
    MRoPE positions (computed on the padded batch, packed with the same call), packed_seq_params,
    no labels; logits unpacked.

    Returns ``(B, T, V)`` logits and the ``PackedSeqParams`` the model got."""
    from megatron.bridge_thd.mrope import qwen3_vl_position_ids

    ids, keep = batch["input_ids"], batch["attention_mask"]
    positions = qwen3_vl_position_ids(
        ids, keep, batch["image_grid_thw"], image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START
    )
    input_ids_rmpad, params = pre(ids, keep, True, use_fp8_padding)
    position_ids = pre(positions.permute(1, 2, 0), keep, True, use_fp8_padding)[0].permute(2, 0, 1).contiguous()
    output = model(input_ids=input_ids_rmpad, position_ids=position_ids, packed_seq_params=params,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return post(output, params, keep, *keep.shape), params


def vlm_path_forward(model, batch: dict, pre, post, use_fp8_padding: bool = False) -> torch.Tensor:
    """VERL's vision-model call (``model_forward_gen(vision_model=True)``): metadata only
    (``pre_process=False``), the padded ``(B, T)`` ids and mask go to the model, which packs them
    itself after the vision embedding (Megatron-Bridge's ``legacy_packed_bshd`` path, B > 1) and
    computes its MRoPE positions (``position_ids=None``). Returns ``(B, T, V)`` logits."""
    ids, keep = batch["input_ids"], batch["attention_mask"]
    _, params = pre(ids, keep, False, use_fp8_padding)
    output = model(input_ids=ids, attention_mask=keep, position_ids=None, packed_seq_params=params,
                   pixel_values=batch["pixel_values"], image_grid_thw=batch["image_grid_thw"])
    return post(output, params, keep, *keep.shape)


def loss_gradients(model, logp: torch.Tensor) -> dict:
    """Gradients of the summed response log-probs (what a policy-gradient loss differentiates)."""
    model.zero_grad(set_to_none=True)
    logp.sum().backward()
    return gradients(model)


def train_vs_rollout(packed: torch.Tensor, alone: list[torch.Tensor]) -> dict:
    """mean / max |dlogp| and ``token_mult_prob_error`` (mean of exp(|dlogp|)) over the response
    tokens: ``packed`` ``(B, R)`` from :func:`response_logp`, ``alone`` from
    :func:`per_sample_response_logp`."""
    diffs = torch.cat([(packed[i, : a.numel()] - a).abs() for i, a in enumerate(alone)]).double()
    return dict(mean=float(diffs.mean()), max=float(diffs.max()), mult=float(diffs.exp().mean()))


def summed_gradient_error(ranks: list[dict], key: tuple[str, str], reference: dict) -> tuple[float, str]:
    """Relative gradient error of ``result[helpers][call]["grads"]`` summed over the CP ranks (as
    Megatron's gradient reduction sums them) against the per-sample reference."""
    helpers, call = key
    summed = {name: sum(r[helpers][call]["grads"][name] for r in ranks) for name in reference}
    return worst_relative_gradient_error(summed, reference)


def _run(model, batch: dict, forward, pre, post, fp8: bool) -> dict:
    out = forward(model, batch, pre, post, use_fp8_padding=fp8)
    logits, params = out if isinstance(out, tuple) else (out, None)
    logp = response_logp(logits, batch)
    entry = dict(logp=logp.detach(), grads=loss_gradients(model, logp))
    if params is not None:
        # What attention (and a MoE router) is told is real: the last real boundary.
        entry.update(tokens_as_real=int(params.cu_seqlens_q[-1]), row_length=int(params.cu_seqlens_q_padded[-1]))
    return entry


def _outcome(fn) -> dict:
    """``{"error": type, "message": text}`` of a call expected to fail, or its log-probs."""
    try:
        return dict(logp=fn().detach())
    except (ValueError, IndexError, RuntimeError) as error:
        return dict(error=type(error).__name__, message=str(error))


def real_model_worker(state_dict: dict, batch: dict, verl_path: str | None, cp: int, vision: bool = True,
                      fp8: bool = True, extra=None) -> dict:
    """One CP rank (or the calling process at CP = 1) of Megatron-Bridge's real Qwen3VLModel with
    ``state_dict``: our helpers and, if ``verl_path`` is given, VERL's own, on ``batch``.

    Per helpers (``"ours"`` / ``"verl"``), each ``{"logp": (B, R), "grads": {...}}`` (grads of the
    summed response log-probs on this rank):

    * ``"packed"``: VERL's text-model call (:func:`packed_forward`), plus ``tokens_as_real`` and
      ``row_length``; ``"packed_fp8"`` the same with ``use_fp8_padding=True`` (when ``fp8``);
    * ``"vision"``: VERL's vision-model call (:func:`vlm_path_forward`, when ``vision``);
    * ``"vision_fp8"``: that call with ``use_fp8_padding=True`` (when ``vision`` and ``fp8``):
      ``{"error", "message"}`` or ``{"logp"}``. VERL's helpers are tried at CP = 1 only (at CP = 1
      they crash inside the model's attention; under CP such a crash could leave the other ranks
      waiting in a collective).

    ``extra``: a module-level callable (pickled by reference for spawn) whose result is stored
    under ``"extra"``. ``"same_row_as_verl"``: our packed ids and padded boundaries equal VERL's.
    Module level: pickled by reference for spawn.
    """
    from megatron.bridge_thd_cpu.model import build_qwen3_vl, tiny_qwen3_vl_config
    from megatron.bridge_thd.verl import postprocess_packed_seqs, preprocess_packed_seqs

    model = build_qwen3_vl(tiny_qwen3_vl_config(cp=cp), seed=0)
    model.load_state_dict(state_dict)
    helpers = {"ours": (preprocess_packed_seqs, postprocess_packed_seqs)}
    if verl_path is not None:
        verl_util = load_verl_util(verl_path)
        helpers["verl"] = (verl_util.preprocess_packed_seqs, verl_util.postprocess_packed_seqs)
    result = {}
    for name, (pre, post) in helpers.items():
        entry = result[name] = {"packed": _run(model, batch, packed_forward, pre, post, False)}
        if fp8:
            entry["packed_fp8"] = _run(model, batch, packed_forward, pre, post, True)
        if vision:
            entry["vision"] = _run(model, batch, vlm_path_forward, pre, post, False)
            if fp8 and (name == "ours" or cp == 1):
                with torch.no_grad():
                    entry["vision_fp8"] = _outcome(lambda: response_logp(
                        vlm_path_forward(model, batch, pre, post, use_fp8_padding=True), batch))
    if verl_path is not None:
        ids, keep = batch["input_ids"], batch["attention_mask"]
        ours_row, ours = helpers["ours"][0](ids, keep)
        theirs_row, theirs = helpers["verl"][0](ids, keep)
        result["same_row_as_verl"] = torch.equal(ours_row, theirs_row) and torch.equal(
            ours.cu_seqlens_q_padded, theirs.cu_seqlens_q_padded
        )
    result["extra"] = extra(cp) if extra is not None else None
    return result
