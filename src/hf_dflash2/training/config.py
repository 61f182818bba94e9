"""The training commands' settings as dataclasses, and recipe files of ``train``'s.

Each of ``hf-dflash2 train``, ``regenerate`` and ``store`` has one dataclass here that is the single statement
of its flags, defaults and help (the command line is generated from it by ``settings.add_arguments``) and of
the checks its values alone decide (named errors in ``__post_init__``, before any model loads).

``TrainSettings`` also defines recipe files: ``hf-dflash2 train --config FILE`` (YAML or JSON) sets its fields
by name. A recipe may list ``phases``: runs made in order, each the file's top-level settings with its own
changes, in its own folder ``<output>/<name>`` (a long run's trunk, then a cool-down of a copy of its
checkpoint: ``fork_from: trunk``). Flags given on the command line override the file, in every phase.
Unknown keys and values of the wrong type are refused by name before anything is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..assets import TARGET_HELP
from ..prompts import CHAT_TEMPLATE_HELP, chat_template_argument
from .regenerate import RegenerationConfig
from .trainer import TrainingConfig

PRECISION_HELP = "auto (default): bf16 where this machine's bf16 matmul is fast, else fp32; or bf16 / fp32 / fp16"
GGUF_FILE_HELP = "GGUF file inside --target"
PHASE_KEYS = ("name",)  # a phase's own keys, beside TrainSettings' fields
RECIPE_KEYS = ("phases",)  # a recipe's own keys, beside TrainSettings' fields


def _help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


def parse_layer_ids(text: str | None) -> list[int] | None:
    """``--target-layer-ids``' comma-separated integers (None when not given); a ValueError naming the flag."""
    if not text:
        return None
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise ValueError(f"--target-layer-ids {text!r}: expected comma-separated integers, e.g. 1,7,14,20,27") from None


def _check_precision(value: str) -> None:
    from ..cpu.precision import PRECISION_CHOICES

    if value not in PRECISION_CHOICES:
        raise ValueError(f"--mixed-precision {value!r}: choose one of {PRECISION_CHOICES}")


@dataclass
class TargetSettings:
    """The target model every training command runs: its folder or Hub id, GGUF file and chat template."""

    target: str | None = field(default=None, metadata=_help(TARGET_HELP))
    gguf_file: str | None = field(default=None, metadata=_help(GGUF_FILE_HELP))
    chat_template: str = field(default="auto", metadata=_help(CHAT_TEMPLATE_HELP, type=chat_template_argument))


_REGENERATION = {item.name: item.default for item in dataclasses.fields(RegenerationConfig)}


@dataclass
class RegenerateSettings(TargetSettings):
    """Everything ``hf-dflash2 regenerate`` takes; the decoding's defaults are ``RegenerationConfig``'s."""

    prompts: str = field(default="sharegpt", metadata=_help(
        "'sharegpt' (offline package); 'python-functions' (documented functions of the standard library and "
        "installed packages, as HumanEval-style completions; 'python-functions:DIR,DIR' for other source); "
        "'sharegpt-followups:FILE,FILE' (the next turn of the ShareGPT conversations whose turns these "
        "regenerated files answer, after the target's own answers: first-turn files give second turns, adding "
        "the second turns' file gives third turns); or a JSONL of chats/prompts"))
    output: str = field(kw_only=True, metadata=_help(
        "the regenerated JSONL, appended to (a file already there is continued)"))
    limit: int | None = field(default=None, metadata=_help("stop after this many records in the file"))
    skip: int = field(default=0, metadata=_help("leave out the first N prompts of the (seeded) order"))
    max_prompt_tokens: int = _REGENERATION["max_prompt_tokens"]
    max_new_tokens: int = _REGENERATION["max_new_tokens"]
    batch_size: int = _REGENERATION["batch_size"]
    do_sample: bool = _REGENERATION["do_sample"]
    temperature: float = _REGENERATION["temperature"]
    seed: int = _REGENERATION["seed"]
    repetition_penalty: float = field(default=_REGENERATION["repetition_penalty"], metadata=_help(
        "decode as generate(repetition_penalty=...) does (1.0: none), for a head that will serve penalized "
        "decoding; recorded in every record, and a file is never resumed under another value"))
    mixed_precision: str = field(default="auto", metadata=_help(PRECISION_HELP))
    linear_kernel: str = field(default="auto", metadata=_help(
        "CPU linear layers: oneDNN with packed weights, PyTorch's default, or auto (timed once at --batch-size "
        "rows and cached; oneDNN where it is clearly faster)"))

    def __post_init__(self):
        from ..cpu.linear_kernels import check_linear_kernel

        try:
            check_linear_kernel(self.linear_kernel)
        except ValueError as error:
            raise ValueError(f"--linear-kernel: {error}") from None
        _check_precision(self.mixed_precision)
        if self.batch_size < 1 or self.max_new_tokens < 1:
            raise ValueError(f"--batch-size {self.batch_size} and --max-new-tokens {self.max_new_tokens} must be >= 1")
        if not self.repetition_penalty > 0:
            raise ValueError(f"--repetition-penalty {self.repetition_penalty} must be > 0 (1.0: none)")
        if self.skip < 0:
            raise ValueError(f"--skip {self.skip} must be >= 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit {self.limit} must be >= 1 (or left out: every prompt)")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"--max-prompt-tokens {self.max_prompt_tokens} must be >= 1")
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"--temperature {self.temperature} must be a finite number > 0 with --do-sample")

    def regeneration_config(self) -> RegenerationConfig:
        return RegenerationConfig(**{name: getattr(self, name) for name in _REGENERATION})


@dataclass
class StoreSettings(TargetSettings):
    """Everything ``hf-dflash2 store`` takes."""

    output: str = field(kw_only=True, metadata=_help("store folder (created, or appended to)"))
    source: str = field(default="sharegpt", metadata=_help(
        "comma-separated: 'sharegpt' and/or regenerated JSONL files"))
    max_tokens: int = field(default=1_000_000, metadata=_help("stop when the store holds this many tokens"))
    max_length: int = field(default=TrainingConfig.max_length, metadata=_help(
        "tokens per sequence (prompt + response), as train reads them"))
    top_k: int = field(default=32, metadata=_help("target log-probabilities kept per position"))
    target_layer_ids: str | None = field(default=None, metadata=_help(
        "comma-separated tapped layers (default: 5 evenly spaced)"))
    tokens_per_batch: int = field(default=4096, metadata=_help("tokens per target forward (memory)"))
    final_hidden: bool = field(default=False, metadata=_help(
        "also keep the target's LM-head input per token (bf16, 2*H bytes), for `train --hidden-weight`"))
    mixed_precision: str = field(default="auto", metadata=_help(PRECISION_HELP))
    seed: int = field(default=0, metadata=_help("order of the ShareGPT exchanges"))

    def __post_init__(self):
        _check_precision(self.mixed_precision)
        parse_layer_ids(self.target_layer_ids)
        for name in ("max_tokens", "max_length", "top_k", "tokens_per_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    @property
    def layer_ids(self) -> list[int] | None:
        return parse_layer_ids(self.target_layer_ids)


@dataclass
class TrainCommand:
    """``train``'s own options beside a run's ``TrainSettings``: where the settings come from, and whether to
    train. Not recipe keys."""

    config: str | None = field(default=None, metadata=_help(
        "a recipe: YAML or JSON whose keys are this command's flags (with _ for -), and optionally phases, runs "
        "made in order (e.g. recipes/smollm2-135m-dflash2.yaml); flags given here override it"))
    plan: bool = field(default=False, metadata=_help(
        "print each run's settings (--config and flags merged, phase by phase) as JSON and stop"))


@dataclass
class TrainSettings(TargetSettings):
    """Everything ``hf-dflash2 train`` takes (beside ``TrainCommand``'s --config and --plan). Defaults shared
    with ``TrainingConfig`` are read from it; the head's shape and the command's own (a damped fresh head,
    no logit ramp: see ``TrainingConfig.logit_ramp_steps``) are stated here."""

    store: str | None = field(default=None, metadata=_help(
        "feature store folder from `hf-dflash2 store` (recommended)"))
    data: str | None = field(default=None, metadata=_help(
        "regenerated JSONL from `hf-dflash2 regenerate` (target runs online)"))
    output: str | None = field(default=None, metadata=_help(
        "run folder: checkpoint.pt, head/, history.json (required; with --config, the file may give it; "
        "a recipe's phases run in <output>/<phase name>)"))
    layers: int = field(default=2, metadata=_help("the head's transformer layers"))
    block_size: int = field(default=8, metadata=_help(
        "tokens per drafted block (anchor + B-1 drafts)"))
    selector_rank: int = field(default=128, metadata=_help("rank of the path selector's K x K pair scores"))
    selector_top_k: int = field(default=16, metadata=_help(
        "candidates per position the selector chooses among (K)"))
    target_layer_ids: str | None = field(default=None, metadata=_help(
        "comma-separated tapped layers (default: evenly spaced; with --store, the store's, or some of them; with "
        "--init-from a head tapping a subset, its new taps start at zero)"))
    mask_token_id: int | None = field(default=None, metadata=_help("default: the target's pad token"))
    dflash1: bool = field(default=False, metadata=_help("ablation: no conv, no selector"))
    steps: int = field(default=TrainingConfig.steps, metadata=_help("optimizer steps (the schedule's length)"))
    stop_after: int | None = field(default=None, metadata=_help(
        "run at most this many steps now (resume later)"))
    stop_at: int | None = field(default=None, metadata=_help(
        "stop at this step, whatever step a resume starts from (the schedule still plans --steps): a trunk's "
        "length in a recipe"))
    init_from: str | None = field(default=None, metadata=_help(
        "start from trained weights: a run (its folder or checkpoint.pt) or a saved head folder "
        "(e.g. heads/smollm2-135m-dflash2); weights only, fresh schedule"))
    fork_from: str | None = field(default=None, metadata=_help(
        "start --output as a copy of this run's checkpoint (its folder or checkpoint.pt) and resume the copy "
        "under these settings: e.g. a wsd trunk's copy cooled down with --steps NOW+DECAY --decay-steps DECAY "
        "while the trunk goes on; once --output holds a checkpoint, that one is resumed. In a recipe, the "
        "name of an earlier phase"))
    init_layers_from_target: str | None = field(default=None, metadata=_help(
        "comma-separated target layers, one per head layer, or 'last' (the target's last --layers layers): a "
        "fresh head whose layers start as copies of them; not with --init-from"))
    init_context_from_target: bool = field(default=False, metadata=_help(
        "with --init-layers-from-target: fc passes the tap the first copied layer reads (its input) and zeroes "
        "the other taps, and hidden_norm takes that layer's input norm, so the copied layer starts attending "
        "over the context with the target's own keys and values"))
    stop_after_minutes: float | None = field(default=None, metadata=_help("checkpoint and stop after this long"))
    batch_size: int = field(default=TrainingConfig.batch_size, metadata=_help("sequences per step"))
    anchors: int = field(default=TrainingConfig.anchors_per_sequence, metadata=_help(
        "blocks drafted per sequence and step, at random anchor positions in its response"))
    loss_positions: int | None = field(default=TrainingConfig.loss_positions, metadata=_help(
        "drafted positions with a loss (default: all B-1)"))
    max_length: int = field(default=TrainingConfig.max_length, metadata=_help(
        "tokens per sequence read from the data"))
    max_sequences: int | None = field(default=None, metadata=_help("train on the first N sequences only"))
    records: str | None = field(default=None, metadata=_help(
        "with --store: train only on records whose id starts with one of these comma-separated prefixes "
        "(regen/: the target's own responses; sharegpt/: ShareGPT's text); PREFIX=N repeats its records N "
        "times per epoch (the longest matching prefix counts), e.g. regen/python/=3,regen/"))
    lr: float = field(default=TrainingConfig.learning_rate, metadata=_help(
        "peak learning rate (AdamW; see --lr-schedule)"))
    warmup_steps: int | None = field(default=TrainingConfig.warmup_steps, metadata=_help(
        "default: 4%% of --steps"))
    lr_schedule: str = field(default=TrainingConfig.lr_schedule, metadata=_help(
        "after the warmup: cosine decay over --steps, or wsd: constant until the last --decay-steps, then down "
        "to 0 (a long run's trunk at a constant rate; resume a copy of its checkpoint with --steps NOW+DECAY "
        "to cool it down into a head while the trunk goes on)", choices=("cosine", "wsd")))
    decay_steps: int | None = field(default=TrainingConfig.decay_steps, metadata=_help(
        "with --lr-schedule wsd: the cool-down's length (default: 20%% of the steps after warmup)"))
    output_scale: float = field(default=0.1, metadata=_help(
        "a fresh head's output norm starts at this fraction of the target's final-norm scale"))
    logit_ramp_steps: int = field(default=0, metadata=_help(
        "steps over which a fresh head's logit scale grows to 1 (capped at the warmup; 0: none)"))
    ema_decay: float = field(default=TrainingConfig.ema_decay, metadata=_help(
        "keep a moving average of the weights with this decay (e.g. 0.998; 0: none), checkpointed beside "
        "them; export it with `python -m hf_dflash2.training.export RUN DIR --ema`"))
    release_freed_memory: bool = field(default=False, metadata=_help(
        "leave glibc's defaults, which give freed memory back to the kernel (by default the trainer keeps it "
        "mapped: each step's temporaries then reuse pages instead of faulting in fresh ones; see "
        "hf_dflash2/cpu/allocator.py)"))
    gradient_checkpointing: bool = field(default=False, metadata=_help(
        "recompute each head layer in the backward pass instead of keeping its activations (less memory, more "
        "time: large targets on a GPU)"))
    hidden_weight: float = field(default=TrainingConfig.hidden_weight, metadata=_help(
        "weight of a loss pulling the head's LM-head input towards the target's at each drafted position "
        "(relative squared error; needs a store built with --final-hidden; 0: off)"))
    loss_gamma: float | None = field(default=TrainingConfig.loss_gamma, metadata=_help(
        "decay of the loss over block positions, weight exp(-(k-1)/gamma) (default: the DFlash paper's for "
        "the block size, 4 at B = 8)"))
    copy_weight: float = field(default=TrainingConfig.copy_weight, metadata=_help(
        "weight of the block positions the fast loop's n-gram chain would draft and have accepted from the "
        "same anchor (1: off; below 1 the head learns more of the text no copy drafts)"))
    loop_anchor_share: float = field(default=TrainingConfig.loop_anchor_share, metadata=_help(
        "share of each sequence's anchors placed where the loop's rounds start under the head being trained "
        "(on-policy: found by drafting a window of twice --anchors positions without gradient; 0: off)"))
    selector_weight: float = field(default=TrainingConfig.selector_weight, metadata=_help(
        "weight of the selector's loss beside the per-position loss"))
    vocab_subset: str = field(default=TrainingConfig.vocab_subset, metadata=_help(
        "draft over the tokens in the data, or the whole vocabulary", choices=("data", "full")))
    draft_vocab_size: int | None = field(default=TrainingConfig.draft_vocab_size, metadata=_help(
        "with --store: train and draft over the N most frequent label tokens only"))
    label_source: str = field(default=TrainingConfig.label_source, metadata=_help(
        "data tokens, the target's argmax, or sparse KL to the target's top-k (the last two need --store)",
        choices=("data", "argmax", "kl")))
    mixed_precision: str = field(default="auto", metadata=_help(PRECISION_HELP))
    seed: int = field(default=TrainingConfig.seed, metadata=_help("initialisation, data order and anchors"))
    checkpoint_every: int = field(default=TrainingConfig.checkpoint_every, metadata=_help(
        "steps between checkpoints (atomic; --resume continues)"))
    eval_every: int = field(default=TrainingConfig.eval_every, metadata=_help(
        "steps between held-out tau evaluations"))
    eval_prompts: int = field(default=TrainingConfig.eval_prompts, metadata=_help(
        "held-out prompts per evaluation (HumanEval and MT-Bench alternating, never trained on; at most 16)"))
    eval_max_new_tokens: int = field(default=TrainingConfig.eval_max_new_tokens, metadata=_help(
        "tokens generated per evaluation prompt"))
    log_every: int = field(default=TrainingConfig.log_every, metadata=_help("steps between log lines"))
    raw_features: bool = field(default=False, metadata=_help(
        "ablation: train fc on the raw tapped features instead of per-channel standardized ones"))
    threads: int | None = field(default=None, metadata=_help("torch threads (default: torch's)"))
    resume: bool = field(default=False, metadata=_help("continue the run in --output from its checkpoint"))

    def __post_init__(self):
        for item in dataclasses.fields(self):
            choices = item.metadata.get("choices")
            if choices and getattr(self, item.name) not in choices:
                raise ValueError(f"{item.name} must be one of {list(choices)}, got {getattr(self, item.name)!r}")


FIELDS = {item.name: item for item in dataclasses.fields(TrainSettings)}


class RecipeError(ValueError):
    """A recipe file that cannot be read, or holds a key or value ``hf-dflash2 train`` does not take."""


def _value(name: str, value, where: str):
    """A recipe's value as the field's type: YAML's ``1e-3`` (a string to YAML 1.1) becomes a float, a list of
    layers a comma-separated string; anything else of another type is refused, naming the key."""
    item = FIELDS[name]
    kind = str(item.type)
    if value is None:
        if "None" in kind:
            return None
    elif kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind.startswith("int"):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind.startswith("float"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return ",".join(str(v) for v in value)
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
        value = str(value)
        parse = item.metadata.get("type")
        if parse is not None:
            try:
                value = parse(value)
            except (argparse.ArgumentTypeError, ValueError) as error:
                raise RecipeError(f"{where}: {name}: {error}") from None
        return value
    raise RecipeError(f"{where}: {name} must be {kind}, got {value!r}")


def _unknown(keys, allowed, where: str) -> None:
    import difflib

    unknown = [k for k in keys if k not in allowed]
    if unknown:
        hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(str(k), allowed, 1))
                 else repr(k) for k in unknown]
        raise RecipeError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(hints)}; "
                          f"the keys are TrainSettings' fields (`hf-dflash2 train --help`)"
                          + (f" and {', '.join(k for k in allowed if k not in FIELDS)}"
                             if any(k not in FIELDS for k in allowed) else ""))


def read_recipe(path: str | Path) -> dict:
    """A recipe file's contents, checked: ``{"settings": {field: value}, "phases": [{"name", field: value}]}``
    (``phases`` empty for a one-run recipe). YAML (``.yaml``/``.yml``, through PyYAML) or JSON."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise RecipeError(f"--config {path}: {error.strerror or error}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise RecipeError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); "
                              "or give the recipe as JSON") from None
        try:
            contents = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise RecipeError(f"--config {path}: not valid YAML: {error}") from None
    else:
        try:
            contents = json.loads(text)
        except json.JSONDecodeError as error:
            raise RecipeError(f"--config {path}: not valid JSON: {error}") from None
    if contents is None:
        contents = {}
    if not isinstance(contents, dict):
        raise RecipeError(f"--config {path}: a recipe is a mapping of settings, got {type(contents).__name__}")
    where = f"--config {path}"
    _unknown(contents, (*FIELDS, *RECIPE_KEYS), where)
    settings = {name: _value(name, value, where) for name, value in contents.items() if name != "phases"}
    phases = contents.get("phases") or []
    if not isinstance(phases, list) or not all(isinstance(p, dict) for p in phases):
        raise RecipeError(f"{where}: phases must be a list of mappings, one per run")
    checked, names = [], []
    for index, phase in enumerate(phases):
        name = phase.get("name")
        where_phase = f"{where}, phase {name or index + 1}"
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise RecipeError(f"{where_phase}: every phase needs a name (a folder name under output)")
        if name in names:
            raise RecipeError(f"{where_phase}: two phases are named {name!r}")
        _unknown(phase, (*FIELDS, *PHASE_KEYS), where_phase)
        if "output" in phase:
            raise RecipeError(f"{where_phase}: a phase runs in <output>/{name}; set output at the top level")
        fork = phase.get("fork_from")
        if isinstance(fork, str) and fork not in names and fork in [p.get("name") for p in phases]:
            raise RecipeError(f"{where_phase}: fork_from {fork!r} names a later phase")
        checked.append({"name": name, **{k: _value(k, v, where_phase) for k, v in phase.items() if k != "name"}})
        names.append(name)
    return {"settings": settings, "phases": checked}


def plan_runs(recipe: dict | None, given: dict) -> list[tuple[str | None, dict]]:
    """The runs a recipe (``read_recipe``'s) and the flags given on the command line make, in order: for each
    its phase name (None without phases) and its settings' values (fields not set keep their defaults).
    A phase's output is ``<output>/<name>``, and a ``fork_from`` naming an earlier phase is that phase's folder."""
    if recipe is None:
        return [(None, dict(given))]
    top = {**recipe["settings"], **given}
    if not recipe["phases"]:
        return [(None, top)]
    root = top.get("output")
    runs, folders = [], {}
    for phase in recipe["phases"]:
        name = phase["name"]
        values = {**recipe["settings"], **{k: v for k, v in phase.items() if k != "name"}, **given}
        if root is not None:
            folders[name] = values["output"] = str(Path(root) / name)
        if values.get("fork_from") in folders:
            values["fork_from"] = folders[values["fork_from"]]
        runs.append((name, values))
    return runs
