"""``speculative_generate`` takes its settings as ``target.generate`` does: keyword arguments, then a
``GenerationConfig``, then the target's own, then Transformers' defaults; what it cannot apply is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_dflash2 import speculative_generate
from hf_dflash2.generation import resolve_generation_config

from .conftest import tiny_drafter, tiny_target

IDS = torch.tensor([[3, 4, 5, 9, 11]])


@pytest.fixture
def pair():
    target = tiny_target()
    return target, tiny_drafter(target)


def _generated(out) -> list[int]:
    return out.sequences[0, IDS.shape[1]:IDS.shape[1] + int(out.num_generated[0])].tolist()


def test_length_follows_the_precedence(pair):
    target, drafter = pair
    assert int(speculative_generate(target, drafter, IDS).num_generated[0]) == 64  # nothing sets a length
    target.generation_config.max_new_tokens = 5
    assert int(speculative_generate(target, drafter, IDS).num_generated[0]) == 5
    config = GenerationConfig(max_new_tokens=7)
    assert int(speculative_generate(target, drafter, IDS, generation_config=config).num_generated[0]) == 7
    out = speculative_generate(target, drafter, IDS, generation_config=config, max_new_tokens=3)
    assert int(out.num_generated[0]) == 3
    target.generation_config.max_new_tokens = None
    out = speculative_generate(target, drafter, IDS, generation_config=GenerationConfig(max_length=IDS.shape[1] + 4))
    assert int(out.num_generated[0]) == 4
    with pytest.raises(ValueError, match="max_length 5 leaves no room after the prompt of 5"):
        speculative_generate(target, drafter, IDS, max_length=5)


def test_the_targets_sampling_settings_are_followed_and_overridden(pair):
    target, drafter = pair
    greedy = _generated(speculative_generate(target, drafter, IDS, max_new_tokens=24))
    target.generation_config.do_sample, target.generation_config.temperature = True, 8.0
    sampled = _generated(speculative_generate(target, drafter, IDS, max_new_tokens=24,
                                              generator=torch.Generator().manual_seed(0)))
    assert sampled != greedy  # a flat law over 96 tokens: 24 draws equal to the argmax are all but impossible
    target.generation_config.top_k = 1  # top-1 sampling is the argmax whatever the temperature
    assert _generated(speculative_generate(target, drafter, IDS, max_new_tokens=24,
                                           generator=torch.Generator().manual_seed(0))) == greedy
    target.generation_config.top_k = None
    assert _generated(speculative_generate(target, drafter, IDS, max_new_tokens=24, do_sample=False)) == greedy
    config = GenerationConfig(do_sample=False)
    assert _generated(speculative_generate(target, drafter, IDS, max_new_tokens=24, generation_config=config)) == greedy


def test_sampling_without_top_k_keeps_transformers_default_of_50(pair):
    """As ``target.generate(do_sample=True)``: top-k 50 applies unless set; top_k=0 turns it off."""
    target, drafter = pair
    assert resolve_generation_config(target, do_sample=True).top_k == 50
    with torch.no_grad():
        logits = target(IDS).logits[0, -1]
    allowed = set(logits.topk(50).indices.tolist())
    prompts = IDS.repeat(400, 1)
    generator = torch.Generator().manual_seed(1)
    first = speculative_generate(target, drafter, prompts, max_new_tokens=1, do_sample=True, temperature=50.0,
                                 generator=generator).sequences[:, IDS.shape[1]]
    assert set(first.tolist()) <= allowed
    unbounded = speculative_generate(target, drafter, prompts, max_new_tokens=1, do_sample=True, temperature=50.0,
                                     top_k=0, generator=generator).sequences[:, IDS.shape[1]]
    assert not set(unbounded.tolist()) <= allowed  # ~46 of 96 tokens are outside: 400 flat draws reach them


def test_settings_the_loop_does_not_apply_are_refused_by_name_before_any_forward(pair, monkeypatch):
    target, drafter = pair

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran before the settings were checked")

    target.generation_config.repetition_penalty = 1.1
    monkeypatch.setattr(target, "forward", no_forward)
    with pytest.raises(ValueError, match=r"repetition_penalty=1.1 \(from the target's generation_config\)"):
        speculative_generate(target, drafter, IDS)
    with pytest.raises(ValueError, match=r"num_beams=2 \(from generation_config\)"):
        speculative_generate(target, drafter, IDS, generation_config=GenerationConfig(num_beams=2),
                             repetition_penalty=1.0)
    with pytest.raises(ValueError, match=r"stop_strings=\['x'\] \(from the call\)"):
        speculative_generate(target, drafter, IDS, repetition_penalty=1.0, stop_strings=["x"])
    with pytest.raises(ValueError, match=r"unknown generation options \['not_an_option'\]"):
        speculative_generate(target, drafter, IDS, not_an_option=3)
    with pytest.raises(ValueError, match="generation_config must be a transformers.GenerationConfig, got dict"):
        speculative_generate(target, drafter, IDS, generation_config={"max_new_tokens": 3})
    monkeypatch.undo()
    out = speculative_generate(target, drafter, IDS, max_new_tokens=4, repetition_penalty=1.0)
    assert int(out.num_generated[0]) == 4
