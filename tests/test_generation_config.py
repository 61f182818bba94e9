"""``speculative_generate`` takes its settings as ``target.generate`` does: keyword arguments, then a
``GenerationConfig``, then the target's own, then Transformers' defaults; what it cannot apply is refused."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import FixedVerifyLength
from hf_dflash2.generation import PLAIN_GREEDY, resolve_generation_config

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
    for off in (0, None):  # an explicit None overrides the default, as in generate
        unbounded = speculative_generate(target, drafter, prompts, max_new_tokens=1, do_sample=True,
                                         temperature=50.0, top_k=off, generator=generator).sequences[:, IDS.shape[1]]
        assert not set(unbounded.tolist()) <= allowed  # ~46 of 96 tokens are outside: 400 flat draws reach them


def test_settings_refused_only_where_generate_would_apply_them(pair):
    target, drafter = pair
    target.generation_config.top_h = 0.2
    out = speculative_generate(target, drafter, IDS, max_new_tokens=4)  # top_h acts only when sampling
    assert int(out.num_generated[0]) == 4
    with pytest.raises(ValueError, match=r"top_h=0.2 \(from the target's generation_config\)"):
        speculative_generate(target, drafter, IDS, max_new_tokens=4, do_sample=True)
    target.generation_config.do_sample = True
    assert int(speculative_generate(target, drafter, IDS, max_new_tokens=4, **PLAIN_GREEDY).num_generated[0]) <= 4
    speculative_generate(target, drafter, IDS, max_new_tokens=4, top_h=None)  # explicit None clears it
    target.generation_config.do_sample, target.generation_config.top_h = False, None
    speculative_generate(target, drafter, IDS, max_new_tokens=4, guidance_scale=1.0)  # 1 is no guidance
    with pytest.raises(ValueError, match=r"guidance_scale=2.0 \(from the call\)"):
        speculative_generate(target, drafter, IDS, max_new_tokens=4, guidance_scale=2.0)


def test_plain_greedy_turns_every_processor_off(pair):
    """The trainer's evaluation and held-out tau pass PLAIN_GREEDY: a target config with a repetition
    penalty, a minimum length and min-p still decodes plain greedy."""
    target, drafter = pair
    plain = _generated(speculative_generate(target, drafter, IDS, max_new_tokens=12, eos_token_id=None))
    config = target.generation_config
    absent = next(token for token in range(2, 96) if token not in plain)
    config.repetition_penalty, config.min_new_tokens, config.eos_token_id = 4.0, 12, absent
    config.no_repeat_ngram_size, config.min_p = 1, 0.5
    assert _generated(speculative_generate(target, drafter, IDS, max_new_tokens=12)) != plain
    assert _generated(speculative_generate(target, drafter, IDS, max_new_tokens=12, **PLAIN_GREEDY)) == plain


def test_a_max_length_as_long_as_the_context_leaves_room_for_a_block(pair):
    target, drafter = pair
    context = target.config.max_position_embeddings
    target.generation_config.max_length = context
    out = speculative_generate(target, drafter, IDS, ngram_size=0)
    assert int(out.num_generated[0]) == context - IDS.shape[1] - drafter.config.block_size


def test_settings_the_loop_does_not_apply_are_refused_by_name_before_any_forward(pair, monkeypatch):
    target, drafter = pair

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran before the settings were checked")

    target.generation_config.num_beams = 2
    monkeypatch.setattr(target, "forward", no_forward)
    with pytest.raises(ValueError, match=r"num_beams=2 \(from the target's generation_config\)"):
        speculative_generate(target, drafter, IDS)
    with pytest.raises(ValueError, match=r"penalty_alpha=0.6 \(from generation_config\)"):
        speculative_generate(target, drafter, IDS, generation_config=GenerationConfig(penalty_alpha=0.6, top_k=4),
                             num_beams=1)
    with pytest.raises(ValueError, match=r"output_hidden_states=True \(from the call\)"):
        speculative_generate(target, drafter, IDS, num_beams=1, return_dict_in_generate=True,
                             output_hidden_states=True)
    with pytest.raises(ValueError, match=r"num_return_sequences.*\(got 2\)"):
        speculative_generate(target, drafter, IDS, num_beams=1, num_return_sequences=2)
    with pytest.raises(ValueError, match=r"unknown generation options \['not_an_option'\]"):
        speculative_generate(target, drafter, IDS, not_an_option=3)
    with pytest.raises(ValueError, match="generation_config must be a transformers.GenerationConfig, got dict"):
        speculative_generate(target, drafter, IDS, generation_config={"max_new_tokens": 3})
    with pytest.raises(ValueError, match=r"bad_words_ids.*\[\[-1\]\]"):  # Transformers' check, before the prefill
        speculative_generate(target, drafter, IDS, num_beams=1, bad_words_ids=[[-1]])
    monkeypatch.undo()
    out = speculative_generate(target, drafter, IDS, max_new_tokens=4, num_beams=1)
    assert int(out.num_generated[0]) == 4


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from hf_dflash2.assets import smollm2_location

    folder, gguf_file = smollm2_location()
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


def test_stop_strings_end_rows_where_generate_ends_them(smollm2_tokenizer):
    """A stop string taken from the middle of the target's own text (spanning two tokens) ends each row at
    the token generate ends it at: inside a round of several accepted drafts (an oracle head), and per row of
    a left-padded batch."""
    from .test_generation import OracleDrafter

    tokenizer = smollm2_tokenizer
    target = tiny_target(vocab_size=len(tokenizer), seed=4)
    drafter = tiny_drafter(target)
    ids = torch.tensor([[504, 3458, 314, 260, 1345, 28]])
    free = target.generate(ids, max_new_tokens=40, do_sample=False)
    stop = tokenizer.decode(free[0, ids.shape[1] + 13: ids.shape[1] + 15])
    expected = target.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
    assert ids.shape[1] < expected.shape[1] < free.shape[1]  # the stop string ended generation early
    oracle = OracleDrafter(drafter, free[:, ids.shape[1]:], torch.tensor([ids.shape[1]]), corrupt_every=1000)
    out = speculative_generate(target, oracle, ids, max_new_tokens=40, adaptive=False, stop_strings=[stop],
                               tokenizer=tokenizer)
    assert torch.equal(out.sequences, expected)
    assert out.stats.acceptance_length > 2  # rounds committed several tokens, so the stop fell inside one

    rows = torch.tensor([[0, 0, 504, 3458, 314, 28], [711, 88, 504, 3458, 314, 260]])
    mask = (torch.arange(6) >= torch.tensor([[2], [0]])).long()
    batch_free = target.generate(rows, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    stop = tokenizer.decode(batch_free[1, 6 + 9: 6 + 11])
    # generate pads a finished row only when an EOS id is set (else it keeps writing that row's tokens)
    eos = sorted(set(range(2, 10)) - set(batch_free.flatten().tolist()))[0]
    expected = target.generate(rows, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                               eos_token_id=eos, stop_strings=stop, tokenizer=tokenizer)
    out = speculative_generate(target, drafter, rows, attention_mask=mask, max_new_tokens=30, pad_token_id=0,
                               eos_token_id=eos, stop_strings=stop, tokenizer=tokenizer)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])
    assert (expected[:, out.sequences.shape[1]:] == 0).all()
    assert int(out.num_generated[1]) < 30
    with pytest.raises(ValueError, match=r"stop_strings=\['x'\] needs the tokenizer"):
        speculative_generate(target, drafter, ids, stop_strings=["x"])


def test_transformers_path_stops_at_stop_strings_as_generate_does(smollm2_tokenizer):
    """Transformers checks stopping criteria once per assisted step, at the sequence's end: with several
    drafts accepted a step, a stop string completed mid-step went unseen and the text ran to the budget.
    Greedy, the generator cuts drafts before the token completing one, so the text ends where generate's does."""
    from .test_generation import OracleDrafter, generate_drafts_from

    tokenizer = smollm2_tokenizer
    target = tiny_target(vocab_size=len(tokenizer), seed=4)
    drafter = tiny_drafter(target)
    ids = torch.tensor([[504, 3458, 314, 260, 1345, 28]])
    free = target.generate(ids, max_new_tokens=40, do_sample=False)
    drafter.adaptive_verify = False
    drafter.verify_policy = policy = RoomRecordingPolicy()
    try:
        for start in (5, 13, 21):
            stop = tokenizer.decode(free[0, ids.shape[1] + start: ids.shape[1] + start + 2])
            expected = target.generate(ids, max_new_tokens=40, do_sample=False, stop_strings=[stop],
                                       tokenizer=tokenizer)
            oracle = OracleDrafter(drafter, free[:, ids.shape[1]:], torch.tensor([ids.shape[1]]), corrupt_every=1000)
            with generate_drafts_from(oracle):
                out = target.generate(ids, assistant_model=drafter, max_new_tokens=40, do_sample=False,
                                      stop_strings=[stop], tokenizer=tokenizer)
            assert torch.equal(out, expected), (start, stop)
            assert oracle.last_speculative_stats.acceptance_length > 1.5
            # the round the stop cut told the policy its room was the cut, as the budget's end does: the
            # adaptive policy then leaves its back-off (and the n-gram lookup's) as it was
            assert any(k == room for k, room in policy.rounds), policy.rounds
            policy.rounds.clear()
    finally:
        del drafter.adaptive_verify, drafter.verify_policy


class RoomRecordingPolicy(FixedVerifyLength):
    """Verifies the whole block; records each round's (drafts verified, room the policy was told of)."""

    def __init__(self):
        self.rounds = []

    def chosen(self, k: int, head_used: bool = True) -> None:
        self.rounds.append((k, self.room))


def test_transformers_path_warns_that_sampled_text_may_run_past_a_stop_string(smollm2_tokenizer):
    target = tiny_target(vocab_size=len(smollm2_tokenizer), seed=4)
    drafter = tiny_drafter(target)
    with pytest.warns(UserWarning, match="checks stop_strings once per assisted step"):
        target.generate(IDS, assistant_model=drafter, max_new_tokens=4, do_sample=True, stop_strings=["x"],
                        tokenizer=smollm2_tokenizer)
