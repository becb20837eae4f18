"""The flags ``configure`` sets, each listed once: :data:`FLAGS` (docs/configure.md, "Flags it sets").

A :class:`Flag` is one attribute of the config and everything about it: where it lives, when ``configure`` sets it
and to what, why (what the refusal of a different explicit value says) and the other way out, the log notes that
explain it, and its row of the flag table in docs/configure.md (rendered from :data:`FLAGS` by
``scripts/readme_figures.py``, block ``configure-flags``). ``configure`` evaluates them in this order on the
:class:`~megatron.bridge_thd.rules.setup.Setup` it judges. Refusing combinations is the rules' job
(:mod:`megatron.bridge_thd.rules`), not the flags'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from megatron.bridge_thd.rules.graphs import variable_lengths_set_by_bridge
from megatron.bridge_thd.rules.setup import HYBRIDEP_PADDING_FIELDS, Setup
from megatron.bridge_thd.settings import SETTINGS_ATTRIBUTE
from megatron.bridge_thd.upstream.line import upstream_line

__all__ = ["Flag", "FLAGS", "FLAGS_NOTE", "ONE_SAMPLE"]

Text = str | Callable[[Setup], str]  # a fixed text, or one made from the setup


def _always(s: Setup) -> bool:
    return True


def _no_notes(s: Setup) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One attribute ``configure`` sets.

    Attributes:
        section: where it lives: ``"dataset"``, ``"model"`` (the transformer config: a provider's ``.transformer``
            where it has one) or ``"ddp"``.
        name: the attribute, as the pinned Megatron-Bridge line names it.
        value: what ``configure`` sets it to: a value, or a function of the setup.
        when: whether ``configure`` sets it for the setup.
        why, alternative: what the refusal of a different explicit value says: why the setup needs ``value``, and
            another way out (``", or ..."``).
        required: False (or a function of the setup saying so): an object that does not take the attribute is
            skipped instead of refused.
        guarded: False: it may overwrite anything, explicit or not (Megatron-Bridge's private hook, our record).
        notes: the log notes that explain what the flag does, or does not do, for the setup.
        purpose, pinned, main, set_to: its row of the table: what it is for, what follows its name in the pinned
            line's column (``*``: not a field of Megatron-Bridge's dataset config dataclasses, :data:`FLAGS_NOTE`),
            its name on Megatron-Bridge main, and what ``configure`` sets it to.
    """

    section: str
    name: str
    value: Any = True
    when: Callable[[Setup], bool] = _always
    why: Text = ""
    alternative: Text = ""
    required: bool | Callable[[Setup], bool] = True
    guarded: bool = True
    notes: Callable[[Setup], list[str]] = _no_notes
    purpose: str
    pinned: str = ""
    main: str = "same"
    set_to: str

    def evaluated(self, s: Setup) -> tuple[Any, bool, str, str]:
        """``value``, ``required``, ``why`` and ``alternative`` for the setup."""
        return tuple(item(s) if callable(item) else item  # type: ignore[return-value]
                     for item in (self.value, self.required, self.why, self.alternative))

    def row(self) -> tuple[str, str, str, str]:
        """The table's cells (Markdown)."""
        return self.purpose, f"`{self.section}.{self.name}`" + (f" {self.pinned}" if self.pinned else ""), \
            self.main, self.set_to


FLAGS_NOTE = (
    "`*` not a field of Megatron-Bridge's dataset config dataclasses: set as a plain attribute, so it is lost "
    "when the config is written to YAML and read back (re-run `configure` after loading)."
)


# ---- in-batch packing, left to the step ----

def _packing_on(s: Setup) -> str:
    return ("configure turns in-batch packing on for every layout, and megatron.bridge_thd's step reads "
            "dataset.enable_in_batch_packing and dataset.pack_sequences_in_batch as one switch, so False contradicts "
            f"layout {s.layout!r}")


_UNPACKED = ", or do not call configure (train unpacked with Megatron-Bridge's own step)"
# A micro-batch of one sample: Megatron-Bridge's validate() refuses its flag, and the step needs only its own switch
# (rules.bridge_packing_flag; docs/configure.md "A micro-batch of one sample").
_BRIDGE_REFUSES_ONE_SAMPLE = (
    "with train.micro_batch_size=1 Megatron-Bridge's ConfigContainer.validate() refuses enable_in_batch_packing=True "
    "(it wants two samples to pack), and megatron.bridge_thd's step does not need it: its own switch "
    "dataset.pack_sequences_in_batch turns the layout on")
# What one sample per micro-batch gives each layout (docs/configure.md, "A micro-batch of one sample").
ONE_SAMPLE = {
    "thd": "a row of the one sample's real tokens: the collate's pad tail (up to seq_length where pad_to_max_length "
           "is on, as for PP>1 or EP>1) is not computed",
    "thd_static": "a row of seq_length slots, the sample and a padding tail: the same slots as 'bshd', with THD "
                  "attention and a fixed shape",
    "bshd": "the padded (1, width) layout Megatron-Bridge's own step runs",
}


def _one_sample_notes(s: Setup) -> list[str]:
    """What ``train.micro_batch_size=1`` means for the layout (and for global-batch packing)."""
    if s.bridge_packing_flag:
        return []
    notes = [f"train.micro_batch_size=1: dataset.enable_in_batch_packing stays False (Megatron-Bridge refuses it with "
             f"one sample); the step's switch dataset.pack_sequences_in_batch runs layout {s.layout!r}: "
             f"{ONE_SAMPLE[s.layout]}"]
    if s.global_batch is not None:
        notes.append("global-batch packing with train.micro_batch_size=1: every micro-batch holds one sample (a step "
                     "has as many micro-batches as samples), so it packs nothing and only balances the DP ranks")
    return notes


def _fixed_width_reasons(s: Setup) -> list[str]:
    reasons = []
    # Megatron-Bridge's ConfigContainer.validate() (training/config.py): pad_to_max_length forced for PP>1 or EP>1.
    if s.has_pad_to_max_length and (s.pp > 1 or s.ep > 1):
        reasons.append(f"Megatron-Bridge's validate() forces it True for PP>1 or EP>1 (PP={s.pp}, EP={s.ep}; "
                       "training/config.py)")
    if s.graphs:  # every training graph needs a static token width (Bridge's comment for offline packing)
        reasons.append("CUDA graphs replay fixed shapes, so the collate must pad every micro-batch to seq_length")
    return reasons


_PACKING = (
    Flag(section="dataset", name="enable_in_batch_packing", value=lambda s: s.bridge_packing_flag,
         why=lambda s: _packing_on(s) if s.bridge_packing_flag else _BRIDGE_REFUSES_ONE_SAMPLE,
         alternative=lambda s: _UNPACKED if s.bridge_packing_flag else ", or raise train.micro_batch_size to 2 or more",
         notes=_one_sample_notes,
         purpose="in-batch packing on",
         set_to="`True`; `False` with `train.micro_batch_size=1` (Bridge's `validate()` refuses it there; "
                "[one sample](#a-micro-batch-of-one-sample))"),
    # The step's own switch: with Megatron-Bridge's flag off (micro-batch size 1) the only one, so required for the
    # packed layouts (the step reads "bshd" when neither name is on).
    Flag(section="dataset", name="pack_sequences_in_batch", why=_packing_on, alternative=_UNPACKED,
         required=lambda s: not s.bridge_packing_flag and s.layout != "bshd",
         purpose="same switch, design name (alias)", pinned="*", main="gone",
         set_to="`True` (where the object takes it; required with `train.micro_batch_size=1`, where it is the step's "
                "only switch)"),
    Flag(section="dataset", name="defer_in_batch_packing_to_step",
         why="with in-batch packing on, the collate then packs the micro-batch itself (cu_seqlens in the batch; "
             "Megatron-Bridge's data/datasets/direct_sft.py), and megatron.bridge_thd's step rejects packed batches",
         alternative=", or use Megatron-Bridge's vlm_step for collate-time packing",
         purpose="collate leaves packing to the step", set_to="`True`"),
    Flag(section="dataset", name="skip_getting_attention_mask_from_dataset", value=False,
         why="the step takes each sample's real tokens from the dataset's 2D attention mask, which this flag asks the "
             "data path to leave out (a dataset that honours it gives the step no mask, and the step then fails at "
             "the first micro-batch)",
         purpose="the dataset's 2D mask reaches the step", set_to="`False`"),
    Flag(section="dataset", name="pad_to_max_length", when=lambda s: bool(_fixed_width_reasons(s)),
         why=lambda s: "; and ".join(_fixed_width_reasons(s)),
         purpose="fixed collate width", main="same (forced for PP>1 or EP>1)",
         set_to="`True` for PP>1 or EP>1 (Bridge's rule, where the field exists) and with CUDA graphs"),
    Flag(section="dataset", name=SETTINGS_ATTRIBUTE, value=lambda s: s.settings, guarded=False,
         purpose="megatron.bridge_thd's settings: the layout, the over-long policy, global-batch packing, the length "
                 "fallback, a CP size per sample, the packing logs",
         pinned="* (ours: a `settings.PackingSettings`)", main="(ours)",
         set_to="a record of `layout` and the other arguments ([settings.md](settings.md)); the hand-set attributes "
                "it takes values from (`dataset.packing_layout`, ...) are cleared"),
)


# ---- pipeline parallelism ----

def _thd_pipeline(s: Setup) -> bool:
    return s.layout == "thd" and s.pp > 1


def _hook_sets_lengths(s: Setup) -> bool:
    """``variable_seq_lengths`` is left to the model config's ``finalize()``: set before it, it trips Megatron-Core's
    allgather-dispatcher check."""
    return _thd_pipeline(s) and s.model.finalizes and s.model.dispatcher == "allgather"


def _pipeline_notes(s: Setup) -> list[str]:
    """Why a static layout keeps (or not) fixed p2p shapes under PP, and why ``variable_seq_lengths=True`` with CUDA
    graphs is accepted where Megatron-Bridge set it."""
    notes = []
    if variable_lengths_set_by_bridge(s):
        notes.append("model.variable_seq_lengths=True was set by Megatron-Bridge's finalize() for in-batch packing "
                     "with PP>1; the static layout keeps the row length fixed, p2p only exchanges shapes")
    if _thd_pipeline(s) or s.pp == 1:
        return notes
    if s.bridge_packing_flag:
        notes.append(f"layout {s.layout!r} keeps a fixed row length; Megatron-Bridge's validate() still sets "
                     "variable_seq_lengths=True for in-batch packing with PP>1 (p2p then exchanges shapes)")
    elif not s.model.variable_seq_lengths:
        notes.append(f"layout {s.layout!r} with train.micro_batch_size=1 keeps variable_seq_lengths off: the pipeline "
                     "stages exchange fixed (seq_length, 1, hidden) buffers, which the row fills exactly")
    return notes


_PIPELINE = (
    # Bridge's validate() sets this private hook itself whenever in-batch packing is on.
    Flag(section="model", name="_enable_in_batch_packing", when=lambda s: _thd_pipeline(s) and s.model.finalizes,
         guarded=False,
         notes=lambda s: ["model.variable_seq_lengths is set to True by the model config's finalize() (hook "
                          "_enable_in_batch_packing): setting it before finalize() trips Megatron-Core's "
                          "allgather-dispatcher check"] if _hook_sets_lengths(s) else [],
         purpose="pipeline p2p exchanges shapes, through Bridge's hook (its `finalize()` sets `variable_seq_lengths`)",
         pinned="(Bridge's, private)",
         set_to='`True` for `"thd"` with PP>1 on a config with a deferred `finalize()` (as Bridge\'s `validate()` '
                "sets it for in-batch packing)"),
    Flag(section="model", name="variable_seq_lengths", when=lambda s: _thd_pipeline(s) and not _hook_sets_lengths(s),
         why=lambda s: f"layout 'thd' with pipeline_model_parallel_size={s.pp} sends a row whose length changes every "
                       "micro-batch, so the pipeline stages must exchange shapes",
         alternative=", or use layout='thd_static' (fixed row length, no shape exchange)", notes=_pipeline_notes,
         purpose="pipeline p2p exchanges shapes",
         set_to='`True` for `"thd"` with PP>1, unless the hook above sets it (a deferred `finalize()` with the '
                "`allgather` dispatcher); not set for the static layouts"),
    # A dense model whose config will hold variable_seq_lengths=True ("thd" or Bridge's in-batch flag, with PP>1)
    # leaves the 'allgather' dispatcher it never uses (with experts: the rule moe_allgather refuses).
    Flag(section="model", name="moe_token_dispatcher_type", value="alltoall", required=False,
         when=lambda s: (s.pp > 1 and (s.layout == "thd" or s.bridge_packing_flag) and s.model.finalizes
                         and s.model.dispatcher == "allgather" and not s.model.experts),
         why="Megatron-Core's config check refuses variable_seq_lengths=True with the 'allgather' dispatcher even "
             "for a model without experts, and Megatron-Bridge's setup finalizes the model config again after validate() "
             "turned variable_seq_lengths on (in-batch packing with PP>1); a dense model dispatches no token, so "
             "nothing else changes",
         alternative=", or set pipeline_model_parallel_size=1",
         purpose="a dense model leaves the `'allgather'` dispatcher it never uses",
         set_to="`'alltoall'` for a model without experts with PP>1 and a deferred `finalize()` whose config will "
                "hold `variable_seq_lengths=True`, which Megatron-Core refuses with `'allgather'`"),
)


# ---- HybridEP ----

def _hybridep_padding(s: Setup) -> bool:
    return s.model.hybridep and not s.graphs


def _padding_fields(s: Setup) -> tuple[str, ...]:
    """The padding names the config has (the first where it has neither)."""
    return s.model.hybridep_padding_fields or HYBRIDEP_PADDING_FIELDS[:1]


def _hybridep_notes(s: Setup) -> list[str]:
    if not _hybridep_padding(s):
        return []
    return ["HybridEP without CUDA graphs: per-rank token counts may differ; Megatron-Bridge pads uneven HybridEP "
            f"dispatch inputs ({', '.join(_padding_fields(s))}=True), so layout {s.layout!r} is allowed"]


# Where Megatron-Bridge's _enable_safe_hybridep_dispatch is called from, and for which configs, by whether the
# installed line's validate() calls it (None: no Megatron-Bridge installed, what either line does).
_BRIDGE_PADS = {
    None: ("", "without CUDA graphs"),
    True: (", called by ConfigContainer.validate()", "for in-batch packing without CUDA graphs"),
    False: (", called by TransformerConfig.finalize()", "for every HybridEP config without CUDA graphs"),
}


def _hybridep_why(s: Setup) -> str:
    """Where the installed Megatron-Bridge turns HybridEP's padding on itself (``upstream_line``'s seam)."""
    try:
        from_validate = upstream_line().hybridep_dispatch_takes_uses_thd
    except ImportError:  # no Megatron-Bridge installed
        from_validate = None
    where, which = _BRIDGE_PADS[from_validate]
    return ("packed rows give HybridEP different token counts per rank, and Megatron-Bridge's "
            f"_enable_safe_hybridep_dispatch (models/transformer_config.py{where}) sets it True itself {which}")


_HYBRIDEP = (
    Flag(section="model", name=HYBRIDEP_PADDING_FIELDS[0], required=False, why=_hybridep_why, notes=_hybridep_notes,
         when=lambda s: _hybridep_padding(s) and HYBRIDEP_PADDING_FIELDS[0] in _padding_fields(s),
         purpose="HybridEP pads uneven dispatch inputs", pinned="(Megatron-Core)",
         main="same, or the next row's name in Core versions that name it so (Bridge lists both)",
         set_to="`True` for HybridEP without CUDA graphs (what Bridge sets itself: in `validate()` for in-batch "
                "packing, or in the model config's `finalize()` for every HybridEP config, by line)"),
    Flag(section="model", name=HYBRIDEP_PADDING_FIELDS[1], required=False, why=_hybridep_why,
         when=lambda s: _hybridep_padding(s) and HYBRIDEP_PADDING_FIELDS[1] in _padding_fields(s),
         purpose="the same, its later name", pinned="(not in the pinned Megatron-Core)",
         main="in Core versions that name it so", set_to="`True` as the row above, where the config has it"),
)


# ---- global-batch packing and a CP size per sample ----

def _cp_per_sample(s: Setup) -> bool:
    return s.settings.cp_per_sample is not None


def _turn_off(s: Setup) -> str:
    return ", or turn cp_per_sample off" if _cp_per_sample(s) else ", or turn global-batch packing off"


_GLOBAL_BATCH = (
    Flag(section="model", name="calculate_per_token_loss", when=lambda s: s.global_batch is not None,
         why=lambda s: ("cp_per_sample places each step with global-batch packing, " if _cp_per_sample(s) else "") + (
             "global-batch packing gives micro-batches and DP ranks different token counts; Megatron-Core divides "
             "each micro-batch's loss by its own tokens and the number of micro-batches unless "
             "calculate_per_token_loss is set (pipeline_parallel/schedules.py forward_step), which would weigh a "
             "token by where it was placed; per-token normalisation over the whole step keeps loss and gradients "
             "those of Megatron-Bridge's own placement"),
         alternative=_turn_off,
         purpose="loss normalised per token over the whole step", set_to="`True` with global-batch packing"),
    Flag(section="ddp", name="average_in_collective", value=False,
         when=lambda s: s.global_batch is not None and s.has_average_in_collective,
         why=lambda s: ("cp_per_sample needs per-token loss, and " if _cp_per_sample(s) else "") + (
             "Megatron-Core's DistributedDataParallel refuses average_in_collective with calculate_per_token_loss "
             "(distributed/distributed_data_parallel.py)"),
         alternative=_turn_off,
         purpose="DDP sums gradients (required with per-token loss)",
         set_to="`False` with global-batch packing (where the config has a `ddp` section)"),
    Flag(section="model", name="hybrid_context_parallel", when=_cp_per_sample,
         why="cp_per_sample runs each step through Megatron-Core's hybrid-CP schedule, which Megatron-Bridge's "
             "initialize builds the hybrid groups for from this flag",
         alternative=", or turn cp_per_sample off",
         purpose="a CP size per sample (Megatron-Core's hybrid context parallelism)",
         set_to="`True` with `cp_per_sample` (global-batch packing is on with it)"),
    Flag(section="model", name="max_seqlen_per_dp_cp_rank", when=_cp_per_sample,
         value=lambda s: s.settings.cp_per_sample.max_tokens_per_rank,
         why=lambda s: f"cp_per_sample places samples at {s.settings.cp_per_sample.max_tokens_per_rank} tokens per "
                       "rank, the limit this setting names",
         alternative=lambda s: f", or call configure with cp_per_sample={s.model.max_tokens_per_rank!r}",
         purpose="the most tokens of one sample a rank holds", set_to="`cp_per_sample.max_tokens_per_rank`"),
    Flag(section="model", name="vision_dp_when_cp", required=False,
         when=lambda s: _cp_per_sample(s) and s.model.has_vision_dp_when_cp,
         why="a row's ranks split the vision tower's frames instead of each running all of them",
         purpose="the vision tower's frames split over a row's ranks",
         set_to="`True` with `cp_per_sample`, where the provider has it (Qwen3-VL's)"),
)

# In the order configure sets them (and lists its changes in the log).
FLAGS: tuple[Flag, ...] = (*_PACKING, *_PIPELINE, *_HYBRIDEP, *_GLOBAL_BATCH)
