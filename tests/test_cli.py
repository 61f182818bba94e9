"""The ``hf-dflash2`` command line is generated from settings dataclasses, for every command.

Each subcommand's ``--flags`` are fields of the dataclasses listed in ``SETTINGS`` (its defaults, help and checks
are stated once there); only the positional operands in ``POSITIONALS`` are written by hand. A flag added with
a hand-written ``add_argument`` has no field behind it, or another default, and fails here.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from hf_dflash2.cli import build_parser
from hf_dflash2.settings import (
    BenchCommand,
    BenchSettings,
    CardSettings,
    DemoSettings,
    PushSettings,
    add_arguments,
    from_args,
)
from hf_dflash2.training.average import AverageSettings
from hf_dflash2.training.config import (
    RegenerateSettings,
    StoreSettings,
    TrainCommand,
    TrainSettings,
)
from hf_dflash2.training.distill import DistillError, DistillRecipe, DistillSettings

SETTINGS = {
    "regenerate": (RegenerateSettings,),
    "store": (StoreSettings,),
    "train": (TrainCommand, TrainSettings),
    "average": (AverageSettings,),
    "distill": (DistillSettings, DistillRecipe),
    "bench": (BenchSettings, BenchCommand),
    "demo": (DemoSettings,),
    "card": (CardSettings,),
    "push": (PushSettings,),
}
# what a command acts on, not settings with defaults: add_arguments makes --flags only
POSITIONALS = {"demo": ["prompt"], "card": ["head_folder", "repo_id"], "push": ["head_folder", "repo_id"],
               "average": ["heads"]}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def mismatches(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of every subcommand that is not a field of its settings dataclasses, as generated."""
    problems = []
    commands = subcommands(parser)
    if set(commands) != set(SETTINGS):
        problems.append(f"subcommands {sorted(commands)} != the commands with settings {sorted(SETTINGS)}")
    for command, sub in commands.items():
        fields = {}
        for settings_class in SETTINGS.get(command, ()):
            for item in dataclasses.fields(settings_class):
                assert item.name not in fields, (command, item.name)  # one field per flag
                fields[item.name] = item
        positionals = []
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.option_strings:
                positionals.append(action.dest)
                continue
            where = f"{command} {'/'.join(action.option_strings)}"
            item = fields.get(action.dest)
            if item is None or action.option_strings != ["--" + item.name.replace("_", "-")]:
                problems.append(f"{where}: no settings field {action.dest!r} behind it")
                continue
            required = item.default is dataclasses.MISSING
            if action.required != required:
                problems.append(f"{where}: required={action.required}, the field {'has no' if required else 'has a'} "
                                "default")
            elif not required and action.default is not argparse.SUPPRESS and action.default != item.default:
                problems.append(f"{where}: default {action.default!r}, the field's {item.default!r}")
            if isinstance(action, argparse._StoreTrueAction) != (str(item.type) == "bool"):
                problems.append(f"{where}: a switch iff the field is a bool")
            if tuple(action.choices or ()) != tuple(item.metadata.get("choices", ())):
                problems.append(f"{where}: choices {action.choices}, the field's {item.metadata.get('choices')}")
            if not action.help:
                problems.append(f"{where}: no help")
        if positionals != POSITIONALS.get(command, []):
            problems.append(f"{command}: positionals {positionals}, expected {POSITIONALS.get(command, [])}")
    return problems


def test_every_flag_of_every_command_is_a_settings_field_with_its_default():
    assert mismatches(build_parser()) == []


def test_a_hand_written_flag_or_default_is_caught():
    parser = build_parser()
    subcommands(parser)["store"].add_argument("--extra", type=int, default=3, help="written by hand")
    assert mismatches(parser) == ["store --extra: no settings field 'extra' behind it"]
    parser = build_parser()
    subcommands(parser)["push"].set_defaults(private=True)  # a default stated a second time, differently
    assert mismatches(parser) == ["push --private: default True, the field's False"]


@pytest.mark.parametrize("command", sorted(SETTINGS))
def test_every_commands_help_renders(command):
    help_text = subcommands(build_parser())[command].format_help()
    assert "--" in help_text and "%(" not in help_text


def test_generated_flags_required_switches_and_metavars():
    @dataclasses.dataclass
    class Example:
        output: str = dataclasses.field(metadata={"help": "where"})
        count: int = 3
        fast: bool = False
        mode: str = dataclasses.field(default="a", metadata={"choices": ("a", "b")})
        folder: str | None = dataclasses.field(default=None, metadata={"metavar": "DIR"})

    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --output is required
    args = parser.parse_args(["--output", "o", "--count", "4", "--fast", "--mode", "b"])
    assert from_args(Example, args) == Example(output="o", count=4, fast=True, mode="b")
    assert "DIR" in parser.format_help() and "default: 3" in parser.format_help()

    @dataclasses.dataclass
    class Nested:
        inner: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="default_factory"):
        add_arguments(argparse.ArgumentParser(), Nested)


@pytest.mark.parametrize(
    "settings_class, values, match",
    [
        (RegenerateSettings, {"skip": -1}, "--skip -1 must be >= 0"),
        (RegenerateSettings, {"repetition_penalty": 0.0}, "--repetition-penalty 0.0 must be > 0"),
        (RegenerateSettings, {"batch_size": 0}, "--batch-size 0 and --max-new-tokens 192 must be >= 1"),
        (RegenerateSettings, {"linear_kernel": "mkl"}, "--linear-kernel: .*'mkl'"),
        (RegenerateSettings, {"mixed_precision": "fp8"}, "--mixed-precision 'fp8'"),
        (RegenerateSettings, {"limit": 0}, "--limit 0 must be >= 1"),
        (RegenerateSettings, {"max_prompt_tokens": 0}, "--max-prompt-tokens 0 must be >= 1"),
        (RegenerateSettings, {"do_sample": True, "temperature": 0.0}, "--temperature 0.0 must be a finite number > 0"),
        (StoreSettings, {"top_k": 0}, "--top-k must be >= 1, got 0"),
        (StoreSettings, {"target_layer_ids": "1,x"}, "--target-layer-ids '1,x': expected comma-separated"),
        (StoreSettings, {"mixed_precision": "fp8"}, "--mixed-precision 'fp8'"),
    ],
)
def test_training_command_settings_refuse_bad_values_by_name(settings_class, values, match):
    with pytest.raises(ValueError, match=match):
        settings_class(output="out", **values)


@pytest.mark.parametrize(
    "values, match",
    [({"budget": "soon"}, "--budget 'soon'"), ({"stop_after": "lunch"}, "--stop-after 'lunch'"),
     ({"recipe": DistillRecipe(layers=0)}, "layers must be >= 1"), ({"push": "not a/repo/id"}, "--push"),
     ({"recipe": DistillRecipe(learning_rate=0.0)}, "learning_rate must be a finite number > 0, got 0.0"),
     ({"recipe": DistillRecipe(learning_rate=float("nan"))}, "learning_rate must be a finite number > 0, got nan"),
     ({"recipe": DistillRecipe(output_scale=2.0)}, r"output_scale must be in \(0, 1\], got 2.0"),
     ({"recipe": DistillRecipe(checks=-1)}, "checks must be >= 0 .*got -1"),
     ({"recipe": DistillRecipe(min_store_tokens=0)}, "min_store_tokens must be >= 1, got 0"),
     ({"recipe": DistillRecipe(eval_prompts=20)}, "at most 16 .*got 20 and 4")],
)
def test_distill_settings_refuse_bad_values_when_built(values, match):
    with pytest.raises(DistillError, match=match):
        DistillSettings(output="run", **values)


def test_defaults_shared_with_the_python_api_are_read_from_it():
    from hf_dflash2.training.config import TrainSettings
    from hf_dflash2.training.regenerate import RegenerationConfig
    from hf_dflash2.training.trainer import TrainingConfig

    settings = RegenerateSettings(output="out")
    assert settings.regeneration_config() == RegenerationConfig()
    # two pairs: `train` damps a fresh head and ramps nothing; the Python API's undamped for_target head is
    # ramped (tests/test_conventions.py: its first loss stays near a uniform guess's)
    assert (TrainSettings().output_scale, TrainSettings().logit_ramp_steps) == (0.1, 0)
    assert (TrainingConfig().output_scale, TrainingConfig().logit_ramp_steps) == (1.0, 20)
    args = build_parser().parse_args(["distill", "--output", "run"])
    assert {name: getattr(args, name) for name in ("seed", "layers", "block_size", "precision")} == {
        name: getattr(DistillRecipe(), name) for name in ("seed", "layers", "block_size", "precision")}
