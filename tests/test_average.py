"""`hf-dflash2 average`: the weighted mean of heads from one warm start, refused across architectures."""

from __future__ import annotations

import json

import pytest
import torch

from hf_dflash2 import DFlash2DraftModel
from hf_dflash2.cli import main
from hf_dflash2.hub import save_head
from hf_dflash2.training.average import average_heads, parse_weights

from .conftest import tiny_drafter, tiny_target


@pytest.fixture
def two_heads(tmp_path):
    target = tiny_target("llama")
    heads = []
    for seed in (1, 2):
        drafter = tiny_drafter(target, seed=seed).set_draft_vocab(list(range(0, 96, 2)))
        heads.append(save_head(drafter, tmp_path / f"head{seed}"))
    return target, heads


def test_the_average_is_the_weighted_mean_of_every_tensor_and_keeps_the_draft_vocab(two_heads, tmp_path):
    _, (a, b) = two_heads
    out = main(["average", str(a), str(b), "--output", str(tmp_path / "mean"), "--weights", "3,1"])
    assert out == 0
    first, second, mean = (DFlash2DraftModel.from_pretrained(p, dtype=torch.float32) for p in (a, b, tmp_path / "mean"))
    states = first.state_dict(), second.state_dict(), mean.state_dict()
    differing = 0
    for name, tensor in states[2].items():
        expected = 0.75 * states[0][name].float() + 0.25 * states[1][name].float()
        torch.testing.assert_close(tensor.float(), expected, rtol=1e-5, atol=1e-6, msg=name)
        differing += not torch.equal(states[0][name], states[1][name])
    assert differing > 0  # the heads really differ, so a copy of either would fail above
    assert torch.equal(mean.draft_vocab, first.draft_vocab)
    # a saved head is world-readable, its folders searchable (custom_generate/ holds the remote code)
    for path in [tmp_path / "mean", *(tmp_path / "mean").rglob("*")]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


def test_bf16_heads_average_in_fp32_stay_bf16_and_python_weights_are_normalised(tmp_path):
    target = tiny_target("llama")
    heads = [save_head(tiny_drafter(target, seed=s), tmp_path / f"h{s}", dtype=torch.bfloat16) for s in (1, 2)]
    folder = average_heads(heads, tmp_path / "mean", [3, 1])  # not summing to 1: normalised, as on the CLI
    loaded = [DFlash2DraftModel.from_pretrained(p, dtype=torch.float32).state_dict() for p in (*heads, folder)]
    name = "fc.weight"
    expected = (0.75 * loaded[0][name] + 0.25 * loaded[1][name]).to(torch.bfloat16).float()
    torch.testing.assert_close(loaded[2][name], expected, rtol=0, atol=0)
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", framework="pt") as weights:
        assert weights.get_slice(name).get_dtype() == "BF16"
    recipe = json.loads((folder / "training_recipe.json").read_text())
    assert [e["weight"] for e in recipe["averaged_from"]] == [0.75, 0.25]


def test_heads_of_another_architecture_or_draft_vocab_are_refused_and_nothing_is_written(two_heads, tmp_path):
    target, (a, b) = two_heads
    one_layer = save_head(tiny_drafter(target, layers=1).set_draft_vocab(list(range(0, 96, 2))), tmp_path / "one")
    with pytest.raises(ValueError, match=r"num_hidden_layers.*\(2, 1\)"):
        average_heads([a, one_layer], tmp_path / "out")
    other_layers = save_head(
        tiny_drafter(target, target_layer_ids=[0, 2, 4]).set_draft_vocab(list(range(0, 96, 2))), tmp_path / "taps"
    )
    with pytest.raises(ValueError, match=r"dflash_config\.target_layer_ids"):
        average_heads([a, other_layers], tmp_path / "out")
    other_vocab = save_head(tiny_drafter(target, seed=3).set_draft_vocab(list(range(1, 96, 2))), tmp_path / "odd")
    with pytest.raises(ValueError, match="draft vocabulary.*48 against 48"):
        average_heads([a, other_vocab], tmp_path / "out")
    no_vocab = save_head(tiny_drafter(target, seed=4), tmp_path / "novocab")
    with pytest.raises(ValueError, match="only one of"):
        average_heads([a, no_vocab], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # the save replaces its folder: never one that is or holds an input, nor a folder that is not a head
    with pytest.raises(ValueError, match="is or holds"):
        average_heads([a, b], a)
    with pytest.raises(ValueError, match="is or holds"):
        average_heads([a, b], tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a saved head"):
        average_heads([a, b], tmp_path / "notes")
    with pytest.raises(ValueError, match="not a saved head"):  # every save_head caller (export too)
        save_head(tiny_drafter(target), tmp_path / "notes")
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine" and (a / "model.safetensors").exists()


def test_the_command_reports_a_bad_input_without_a_traceback(two_heads, tmp_path):
    _, (a, _) = two_heads
    with pytest.raises(SystemExit, match=f"hf-dflash2 average: {tmp_path / 'missing'} is not a saved head"):
        main(["average", str(a), str(tmp_path / "missing"), "--output", str(tmp_path / "out")])


@pytest.mark.parametrize(
    ("spec", "message"), [("1,x", "comma-separated"), ("1,2,3", "3 values for 2"), ("1,0", "> 0"), ("1,inf", "finite")]
)
def test_bad_weights_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_weights(spec, 2)
    assert repr(spec) in str(error.value)
    assert parse_weights("1,3", 2) == [0.25, 0.75]
