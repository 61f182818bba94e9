"""Recipes as data: ``hf-dflash2 train --config FILE`` and the recipe files in recipes/."""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
from pathlib import Path

import pytest
import torch

from hf_dflash2.cli import build_parser, main
from hf_dflash2.training.config import FIELDS, TrainSettings, read_recipe

from .conftest import tiny_target

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
HEAD = REPO / "heads" / "smollm2-135m-dflash2"


def plan(capsys, *argv) -> list[dict]:
    capsys.readouterr()
    assert main(["train", *argv, "--plan"]) == 0
    return json.loads(capsys.readouterr().out)


def test_there_are_recipes_and_no_makefile_targets_per_experiment():
    names = {p.name for p in RECIPES}
    assert {"smollm2-135m-dflash2.yaml", "smollm2-135m-dflash1.yaml"} <= names
    assert not list((REPO / "recipes").glob("*.mk"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_key_is_a_setting(path):
    import yaml

    raw = yaml.safe_load(path.read_text())
    for key in raw:
        assert key in FIELDS or key == "phases", key
    for phase in raw.get("phases", []):
        for key in phase:
            assert key in FIELDS or key == "name", (phase.get("name"), key)
    recipe = read_recipe(path)  # types checked too
    assert recipe["settings"]["output"] and recipe["settings"]["store"]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_command_in_a_recipe_header_parses(path):
    """The header's "# $ " lines are what `make recipe-NAME` runs: each hf-dflash2 command must parse, and the
    stores the recipe trains on must be built there."""
    commands = [line[4:] for line in path.read_text().splitlines() if line.startswith("# $ ")]
    assert any(c.startswith("hf-dflash2 train --config " + f"recipes/{path.name}") for c in commands)
    built = set()
    for command in commands:
        words = shlex.split(command)
        if words[0] != "hf-dflash2":
            continue
        args = build_parser().parse_args(words[1:])
        if args.command == "store":
            built.add(args.output)
            for source in args.source.split(","):  # each source is written by an earlier command
                assert source in built, (source, command)
        elif args.command == "regenerate":
            built.add(args.output)
        elif args.command == "distill":  # its store is <output>/store
            built.add(f"{args.output}/store")
    assert read_recipe(path)["settings"]["store"] in built


def test_the_committed_heads_recipe_is_what_made_it(capsys):
    runs = plan(capsys, "--config", "recipes/smollm2-135m-dflash2.yaml")
    assert [r["phase"] for r in runs] == ["trunk", "cooldown"]
    trunk, cooldown = runs
    made = json.loads((HEAD / "training_recipe.json").read_text())
    config = json.loads((HEAD / "config.json").read_text())
    dflash = config["dflash_config"]
    for run in runs:
        assert run["block_size"] == dflash["block_size"] == 8
        assert run["selector_rank"] == dflash["selector_rank"]
        assert run["selector_top_k"] == dflash["selector_top_k"]
        assert run["mask_token_id"] == dflash["mask_token_id"]
        assert [int(i) for i in run["target_layer_ids"].split(",")] == dflash["target_layer_ids"]
        assert run["layers"] == config["num_hidden_layers"]
        assert run["draft_vocab_size"] == made["draft_vocab_size"]
        assert run["batch_size"] == made["sequences_per_step"]
        assert run["anchors"] == made["anchors_per_sequence"]
        assert run["lr"] == made["learning_rate"]
        assert run["warmup_steps"] == made["warmup_steps"]
        assert run["logit_ramp_steps"] == made["logit_ramp_steps"]
        assert run["output_scale"] == made["output_scale"]
        assert run["label_source"] == made["label_source"]
        assert run["seed"] == made["seed"]
        assert run["hidden_weight"] == made["hidden_weight"] and run["loss_gamma"] is None  # 4 at B = 8
        assert run["mixed_precision"] == made["mixed_precision"]
        assert run["init_layers_from_target"] == "last" and made["initialized_from"]["target_layers"] == [28, 29]
        assert run["lr_schedule"] == "wsd" and not run["dflash1"]
        assert not run["store"].startswith("heads/") and run["init_from"] is None  # pinned inputs, no head
    assert trunk["stop_at"] == 14129 and trunk["steps"] > 10 * trunk["stop_at"]  # a constant rate throughout
    assert cooldown["fork_from"] == trunk["output"] == "runs/smollm2-135m-dflash2/trunk"
    assert cooldown["steps"] == made["steps"] == trunk["stop_at"] + cooldown["decay_steps"]
    assert "recipes/smollm2-135m-dflash2.yaml" in made["made_with"]


def test_the_ablation_recipe_pairs_two_arms_that_differ_only_in_dflash1(capsys):
    runs = {r["phase"]: r for r in plan(capsys, "--config", "recipes/smollm2-135m-dflash1.yaml")}
    assert list(runs) == ["dflash2-start", "dflash2", "dflash1-start", "dflash1"]
    assert runs["dflash1"]["dflash1"] and not runs["dflash2"]["dflash1"]
    for arm in ("dflash2", "dflash1"):
        a, b = runs[arm], runs["dflash2"]
        differ = {k for k in a if a[k] != b[k]} - {"phase", "output", "fork_from", "threads"}
        assert differ == ({"dflash1"} if arm == "dflash1" else set()), differ
        assert a["steps"] == 6000 and a["block_size"] == 8
        assert runs[f"{arm}-start"]["stop_at"] == 1800 and runs[f"{arm}-start"]["steps"] == 7000
        assert a["fork_from"] == runs[f"{arm}-start"]["output"]


def test_flags_override_the_file_in_every_phase(capsys):
    runs = plan(capsys, "--config", "recipes/smollm2-135m-dflash2.yaml", "--threads", "1", "--output", "runs/x",
                "--block-size", "8", "--lr", "3e-4")
    assert [r["threads"] for r in runs] == [1, 1]
    assert [r["lr"] for r in runs] == [3e-4, 3e-4]
    assert [r["output"] for r in runs] == ["runs/x/trunk", "runs/x/cooldown"]
    assert runs[1]["fork_from"] == "runs/x/trunk"
    # A flag given with its default's value still overrides the file (the file says bf16 and resume).
    assert [r["mixed_precision"] for r in plan(capsys, "--config", "recipes/smollm2-135m-dflash2.yaml",
                                               "--mixed-precision", "auto")] == ["auto", "auto"]


def test_without_a_config_the_defaults_are_the_dataclass_defaults(capsys):
    (run,) = plan(capsys, "--output", "runs/x")
    expected = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    assert {k: v for k, v in run.items() if k != "phase"} == {**expected, "output": "runs/x"}
    # the committed head's shape and rate, as its recipe and `distill` state them
    assert (expected["block_size"], expected["selector_rank"], expected["lr"], expected["batch_size"],
            expected["output_scale"]) == (8, 128, 1e-3, 2, 0.1)


def test_an_unknown_key_is_refused_by_name_before_anything_loads(tmp_path, monkeypatch):
    from hf_dflash2 import assets

    monkeypatch.setattr(assets, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    recipe = tmp_path / "r.yaml"
    recipe.write_text("store: s\noutput: o\nblok_size: 8\nlearning_rate: 1.0e-3\n")
    with pytest.raises(SystemExit, match=r"unknown keys 'blok_size' \(did you mean 'block_size'\?\), "
                                         r"'learning_rate'"):
        main(["train", "--config", str(recipe)])
    recipe.write_text("store: s\noutput: o\nphases:\n  - name: a\n    steps: 5\n    warmup: 1\n")
    with pytest.raises(SystemExit, match=r"phase a: unknown key 'warmup'"):
        main(["train", "--config", str(recipe), "--plan"])
    recipe.write_text("store: s\noutput: o\nsteps: many\n")
    with pytest.raises(SystemExit, match=r"steps must be int, got 'many'"):
        main(["train", "--config", str(recipe), "--plan"])
    recipe.write_text("store: s\noutput: o\nlabel_source: logits\n")
    with pytest.raises(SystemExit, match=r"label_source must be one of \['data', 'argmax', 'kl'\], got 'logits'"):
        main(["train", "--config", str(recipe), "--plan"])
    recipe.write_text("store: s\noutput: o\nphases:\n  - name: a\n    fork_from: b\n  - name: b\n")
    with pytest.raises(SystemExit, match=r"fork_from 'b' names a later phase"):
        main(["train", "--config", str(recipe), "--plan"])
    recipe.write_text("store: s\nlr: 1e-3\n")  # YAML 1.1 reads 1e-3 as a string: taken as the float it says
    with pytest.raises(SystemExit) as error:  # no output anywhere: argparse's own error
        main(["train", "--config", str(recipe)])
    assert error.value.code == 2
    json_recipe = tmp_path / "r.json"
    json_recipe.write_text(json.dumps({"store": "s", "output": "o", "lr": "1e-3", "target_layer_ids": [1, 2]}))
    assert read_recipe(json_recipe)["settings"] == {"store": "s", "output": "o", "lr": 1e-3,
                                                    "target_layer_ids": "1,2"}


def test_phases_run_in_order_and_a_forked_cooldown_equals_a_run_planned_to_its_length(tmp_path, monkeypatch):
    """The committed head's recipe on a tiny target: a wsd trunk stopped at a step, its copy cooled down, gives
    the weights of one run planned to that length; the trunk is left where it stopped."""
    from .test_conventions import tiny_base_tokenizer

    target = tiny_target(vocab_size=96)
    target.save_pretrained(tmp_path / "base")
    tiny_base_tokenizer().save_pretrained(tmp_path / "base")
    rng = random.Random(0)
    records = [{"prompt_ids": [1] + [rng.randrange(4, 96) for _ in range(6)],
                "response_ids": [rng.randrange(4, 96) for _ in range(20)]} for _ in range(4)]
    (tmp_path / "regen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    common = {"target": str(tmp_path / "base"), "data": str(tmp_path / "regen.jsonl"), "layers": 1,
              "block_size": 4, "selector_rank": 8, "mask_token_id": 3, "eval_prompts": 0,
              "mixed_precision": "fp32", "vocab_subset": "full", "lr_schedule": "wsd", "warmup_steps": 2,
              "checkpoint_every": 100, "log_every": 100, "resume": True}
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({**common, "output": str(tmp_path / "phased"), "phases": [
        {"name": "trunk", "steps": 1000, "stop_at": 5},
        {"name": "cooldown", "fork_from": "trunk", "steps": 8, "decay_steps": 3}]}))
    assert main(["train", "--config", str(recipe)]) == 0
    planned = tmp_path / "planned.json"
    planned.write_text(json.dumps({**common, "output": str(tmp_path / "planned"), "steps": 8, "decay_steps": 3}))
    assert main(["train", "--config", str(planned)]) == 0

    def state(run):
        return torch.load(tmp_path / run / "checkpoint.pt", map_location="cpu", weights_only=False)

    trunk, cooled, reference = state("phased/trunk"), state("phased/cooldown"), state("planned")
    assert trunk["step"] == 5 and cooled["step"] == reference["step"] == 8
    for name, tensor in reference["drafter"].items():
        assert torch.equal(cooled["drafter"][name], tensor), name
    # Again: every phase resumes where it ended (no step is added, the trunk is not forked anew).
    assert main(["train", "--config", str(recipe)]) == 0
    assert state("phased/trunk")["step"] == 5 and state("phased/cooldown")["step"] == 8


def test_train_refuses_settings_that_would_only_fail_or_save_an_untrained_head_later(tmp_path, monkeypatch):
    """A run that would stop before its first step, evaluations of no tokens, and a missing --init-from are
    refused by name before the target loads."""
    from hf_dflash2 import assets

    monkeypatch.setattr(assets, "load_target", lambda *a, **k: pytest.fail("the target loaded"))
    store = tmp_path / "store"
    store.mkdir()
    base = ["train", "--store", str(store), "--output", str(tmp_path / "run")]
    for extra, message in ((["--stop-after", "0"], "--stop-after must be >= 1 .*got 0"),
                           (["--stop-at", "-3"], "--stop-at must be >= 1 .*got -3"),
                           (["--stop-after-minutes", "0"], "--stop-after-minutes must be > 0"),
                           (["--eval-every", "5", "--eval-max-new-tokens", "0"],
                            "eval_max_new_tokens must be >= 1, got 0"),
                           (["--eval-every", "-1"], "eval_every must be >= 0"),
                           (["--init-from", str(tmp_path / "nowhere")], "--init-from .*nowhere: no such run folder"),
                           (["--threads", "-2"], "--threads must be >= 0, got -2"),
                           (["--eval-prompts", "17"], "--eval-prompts must be at most 16 .*got 17"),
                           (["--selector-weight", "-1"], "selector_weight must be a finite number >= 0, got -1"),
                           (["--selector-weight", "nan"], "selector_weight must be a finite number >= 0, got nan")):
        with pytest.raises(SystemExit, match=message):
            main([*base, *extra])
    assert not (tmp_path / "run").exists()


def test_plan_refuses_what_the_run_would_refuse(capsys):
    """``--plan`` prints settings only when the run itself would accept them."""
    for extra, message in ((["--layers", "0"], "--layers must be >= 1, got 0"),
                           (["--block-size", "1"], "--block-size must be >= 2, got 1"),
                           (["--mixed-precision", "fp8"], "--mixed-precision 'fp8'"),
                           (["--threads", "-1"], "--threads must be >= 0, got -1")):
        with pytest.raises(SystemExit, match=message):
            plan(capsys, "--config", "recipes/smollm2-135m-dflash2.yaml", *extra)
