"""Settings of the ``bench``, ``demo``, ``card`` and ``push`` commands as dataclasses, and the generator of
every command's flags from such dataclasses (``add_arguments``, ``from_args``).

Every ``hf-dflash2`` flag is a field of a settings dataclass beside its command (these here; ``train``,
``regenerate`` and ``store``: ``training/config.py``; ``distill``: ``training/distill/recipe.py``; ``average``:
``training/average.py``), so the command line's defaults and the Python API's cannot disagree, and the values
are checked when a settings object is built (named errors, before any model load). Only positional operands
(the head folder and repo id of ``card``/``push``, ``demo``'s prompt, ``average``'s heads) are written by hand:
they are what a command acts on, not settings, and ``add_arguments`` makes ``--flags`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from .assets import TARGET_HELP

BENCH_METHODS = ("ar", "ar_onednn", "ar_packed", "dflash2_generate", "dflash2_fast", "dflash2_fast_chains",
                 "dflash2_fast_head", "dflash2_fixed_block", "dflash1_fast", "prompt_lookup", "native_dflash",
                 "zlab_reference")


class InvalidSamplingError(ValueError):
    """A temperature, top-k or top-p outside its range."""


def validate_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """temperature >= 0 (0 = greedy), top_k >= 1 or None, 0 < top_p <= 1 or None; raises naming the value."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InvalidSamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise InvalidSamplingError(f"top_k must be an integer >= 1 (or None for no top-k), got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0):
        raise InvalidSamplingError(f"top_p must be in (0, 1] (or None for no top-p), got {top_p!r}")


@dataclass
class SamplingSettings:
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy; > 0 samples (lossless)"})
    top_k: int | None = field(default=None, metadata={"help": "sample among the k most likely tokens"})
    top_p: float | None = field(default=None, metadata={"help": "nucleus sampling mass in (0, 1]"})

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)


PRECISION_HELP_DECODE = ("auto: bf16 where a bf16 linear layer at 1 and at 8 rows (a decode step, a verify) is "
                         "clearly faster than fp32 here, else fp32; or bf16 / fp32")


LINEAR_KERNEL_HELP = ("the speculative loops' linear kernel: auto picks PyTorch's default or oneDNN with packed "
                      "weights per forward, by its width (measured once, cached); or onednn / default for every "
                      "forward. Plain greedy is timed as loaded, on oneDNN and on the packed attention; the fastest is "
                      "the baseline")


def validate_linear_kernel(value: str) -> None:
    from .cpu.linear_kernels import check_linear_kernel

    check_linear_kernel(value)


def validate_precision(value: str) -> None:
    from .cpu.precision import PRECISION_CHOICES

    if value not in PRECISION_CHOICES:
        raise ValueError(f"mixed_precision must be one of {PRECISION_CHOICES}, got {value!r}")


@dataclass
class BenchSettings(SamplingSettings):
    target: str | None = field(default=None, metadata={"help": TARGET_HELP})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside --target"})
    head: str | None = field(default=None, metadata={"help": "dFlash 2 head folder (default: the target's committed "
                                                             "head in heads/ of a checkout)"})
    dflash1_head: str | None = field(default=None, metadata={"help": "DFlash-1 head folder (same budget)"})
    sets: str = field(default="mtbench,humaneval", metadata={"help": "comma-separated prompt sets"})
    limit: int = field(default=10, metadata={"help": "prompts per set"})
    max_new_tokens: int = 256
    batch_size: int = 1
    methods: str = field(default=",".join(BENCH_METHODS), metadata={"help": "comma-separated methods"})
    chat_template: str = field(default="auto", metadata={"help": "auto | none | FILE (see hf_dflash2.prompts)"})
    mixed_precision: str = field(default="auto",
                                 metadata={"help": PRECISION_HELP_DECODE + " (every method, same dtype)"})
    linear_kernel: str = field(default="auto", metadata={"help": LINEAR_KERNEL_HELP})
    seed: int = 0
    repeats: int = field(default=1, metadata={
        "help": "runs of every method on every prompt, interleaved; per prompt the median run (by s/token) counts"})
    output: str = "benchmarks/results"

    def __post_init__(self):
        super().__post_init__()
        validate_precision(self.mixed_precision)
        validate_linear_kernel(self.linear_kernel)
        for name in ("limit", "max_new_tokens", "batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = sorted(set(self.methods.split(",")) - set(BENCH_METHODS))
        if unknown:
            raise ValueError(f"unknown methods {unknown}; choose from {list(BENCH_METHODS)}")


@dataclass
class DemoSettings(SamplingSettings):
    head: str | None = field(default=None, metadata={"help": "head folder (default: the target's committed head in "
                                                             "heads/ of a checkout)"})
    target: str | None = field(default=None, metadata={"help": TARGET_HELP})
    gguf_file: str | None = field(default=None, metadata={"help": "GGUF file inside --target"})
    max_new_tokens: int = 128
    chat_template: str = field(default="auto", metadata={"help": "auto | none | FILE (see hf_dflash2.prompts)"})
    mixed_precision: str = field(default="auto", metadata={"help": PRECISION_HELP_DECODE + " (both runs, same dtype)"})
    linear_kernel: str = field(default="auto", metadata={"help": LINEAR_KERNEL_HELP})
    repeats: int = field(default=3, metadata={"help": "timed runs of each side, interleaved; the median run counts"})
    seed: int = field(default=0, metadata={"help": "seed of the streamed answer's sampling (--temperature > 0): "
                                                   "the same seed streams the same answer"})

    def __post_init__(self):
        super().__post_init__()
        validate_precision(self.mixed_precision)
        validate_linear_kernel(self.linear_kernel)
        for name in ("max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class CardSettings:
    method: str = field(default="dflash2_fast_head",
                        metadata={"help": "with a bench report: whose numbers the card shows (default: the head's "
                                          "own drafts; dflash2_fast adds n-gram drafts)"})
    results: str | None = field(default=None, metadata={"help": "JSON written by `hf-dflash2 bench`"})
    base_model: str | None = field(default=None, metadata={
        "help": "target model id for the card, if config.json has no base_model"})

    def __post_init__(self):
        if self.method not in BENCH_METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose from {list(BENCH_METHODS)}")


@dataclass
class BenchCommand:
    """``bench``'s own switch beside the run's ``BenchSettings``: what the command does instead of a run."""

    profile: bool = field(default=False, metadata={
        "help": "print the verify and draft costs the default loop starts from at --batch-size, and exit"})


@dataclass
class PushSettings(CardSettings):
    """``push``: the card's settings and the upload's. The head folder and repo id are its positionals."""

    private: bool = field(default=False, metadata={"help": "create the repo private (ignored if it exists)"})
    revision: str | None = field(default=None, metadata={"help": "branch to commit to (default: main)"})
    create_pr: bool = field(default=False, metadata={"help": "open a pull request instead of committing to main"})
    endpoint: str | None = field(default=None, metadata={
        "help": "Hub endpoint (default: HF_ENDPOINT or https://huggingface.co)"})
    dry_run: str | None = field(default=None, metadata={
        "metavar": "DIR", "help": "write exactly what would be uploaded (weights, code, card) into the new folder "
                                  "DIR instead; no token or network needed"})


def _argument_type(field_type: str):
    for name, kind in (("int", int), ("float", float)):
        if field_type.startswith(name):
            return kind
    return str


def add_arguments(parser: argparse.ArgumentParser, settings_class, skip: tuple[str, ...] = (),
                  suppress_defaults: bool = False, only: tuple[str, ...] | None = None) -> None:
    """One ``--flag`` per dataclass field (``only`` those named, less ``skip``), with the field's default, type
    and help.

    A ``bool`` field is a switch (``store_true``); a field without a default is a required flag; ``metadata``
    may give ``choices``, a ``type`` (a parsing function) and a ``metavar``. ``suppress_defaults``: a flag not
    given leaves no attribute, so that the caller can tell it from one given with the default's value (a
    settings file under the command line)."""
    for item in dataclasses.fields(settings_class):
        if item.name in skip or (only is not None and item.name not in only):
            continue
        if item.default_factory is not dataclasses.MISSING:
            raise TypeError(f"{settings_class.__name__}.{item.name} has no flag form (a default_factory): skip it")
        flag = "--" + item.name.replace("_", "-")
        required = item.default is dataclasses.MISSING
        help_text = item.metadata.get("help", "")
        if not required and "default" not in help_text:
            help_text = f"{help_text} (default: {item.default})" if help_text else f"default: {item.default}"
        options = {"help": help_text}
        if required:
            options["required"] = True
        else:
            options["default"] = argparse.SUPPRESS if suppress_defaults else item.default
        if item.type in (bool, "bool"):
            options["action"] = "store_true"
        else:
            options["type"] = item.metadata.get("type") or _argument_type(str(item.type))
            for name in ("choices", "metavar"):
                if name in item.metadata:
                    options[name] = item.metadata[name]
        parser.add_argument(flag, **options)


def from_args(settings_class, args: argparse.Namespace):
    """The settings object of parsed arguments; a bad value becomes a command-line error naming it."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_class) if hasattr(args, f.name)}
    try:
        return settings_class(**values)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
