"""`hf-dflash2 average`: the weighted mean of heads from one warm start, refused across architectures."""

from __future__ import annotations

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


def test_heads_of_another_architecture_or_draft_vocab_are_refused_and_nothing_is_written(two_heads, tmp_path):
    target, (a, _) = two_heads
    one_layer = save_head(tiny_drafter(target, layers=1).set_draft_vocab(list(range(0, 96, 2))), tmp_path / "one")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        average_heads([a, one_layer], tmp_path / "out")
    other_vocab = save_head(tiny_drafter(target, seed=3).set_draft_vocab(list(range(1, 96, 2))), tmp_path / "odd")
    with pytest.raises(ValueError, match="draft vocabulary"):
        average_heads([a, other_vocab], tmp_path / "out")
    with pytest.raises(ValueError, match="one of the heads"):
        average_heads([a, other_vocab], a)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("spec", "message"), [("1,x", "comma-separated"), ("1,2,3", "3 values for 2"), ("1,0", "> 0"), ("1,inf", "finite")]
)
def test_bad_weights_name_the_value(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_weights(spec, 2)
    assert parse_weights("1,3", 2) == [0.25, 0.75]
