"""The fast loop applies ``generate``'s logits processors (repetition penalty, no-repeat n-grams, bad words,
minimum lengths, a caller's ``logits_processor`` list, min-p, ...) at every verified slot on that slot's own
text, so its output is what ``target.generate`` decodes with the same settings: token-identical greedy,
on chains and trees, per row of a left-padded batch, and the same law when sampling."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import CostModel
from hf_dflash2.generation import loop
from hf_dflash2.generation.outputs import OutputBuffer, Rows
from hf_dflash2.generation.processors import TargetLogitsProcessors
from hf_dflash2.generation.trees import DraftTree, ancestry_of

from .conftest import tiny_drafter, tiny_target
from .test_draft_tree import ForcedTrees
from .test_fuzz_identity import VOCAB, NoisyOracleDrafter
from .test_ngram import _left_padded

PROMPTS = [[5, 6, 7, 5, 6], [9, 10, 11], [3]]


@pytest.fixture(scope="module")
def target():
    target = tiny_target("llama", vocab_size=VOCAB, seed=0).to(torch.float64)
    with torch.no_grad():  # sharp logits: no near-ties between a verify and a plain step
        target.get_output_embeddings().weight.mul_(8.0)
    return target


def _oracle(target, reference, ids, mask, seed=0):
    """A drafter that proposes ``reference``'s rows (the processed continuation) up to random cuts."""
    base = tiny_drafter(target).to(torch.float64)
    drafter = NoisyOracleDrafter(base.config).to(torch.float64)
    drafter.load_state_dict(base.state_dict())
    drafter.rng, drafter.continuations = random.Random(seed), {}
    for row in range(len(ids)):
        start = int((mask[row] == 0).sum())
        sequence = reference[row].tolist()
        for i in range(ids.shape[1] - 1, len(sequence)):
            drafter.continuations[(i - start, sequence[i])] = sequence[i + 1:]
    return drafter


class BanRecentTokens(LogitsProcessor):
    """A caller's own processor that reads the text: the last three tokens may not come again."""

    def __call__(self, input_ids, scores):
        return scores.scatter(1, input_ids[:, -3:], float("-inf"))


SETTINGS = {
    "repetition": dict(repetition_penalty=1.5, no_repeat_ngram_size=2),
    "lengths and words": dict(min_new_tokens=20, eos_token_id=17, bad_words_ids=[[40, 41], [52]],
                              suppress_tokens=[30, 31], sequence_bias={(44,): 3.0}, forced_eos_token_id=17,
                              begin_suppress_tokens=[1, 2], exponential_decay_length_penalty=(22, 1.05)),
    "own processor": dict(logits_processor=LogitsProcessorList([BanRecentTokens()]), encoder_repetition_penalty=1.3),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_processors_keep_greedy_identity_with_drafts_accepted(target, name):
    """Batch 3, left-padded, fixed blocks of 4 drafted by an oracle of the processed continuation, so most
    drafts pass and every acceptance length occurs: each row equals batched ``generate`` with the same
    settings, which differs from plain greedy (the settings act)."""
    settings = SETTINGS[name]
    ids, mask = _left_padded(PROMPTS)
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, **{"eos_token_id": None, **settings})
    reference = target.generate(ids, attention_mask=mask, **common)
    plain = {k: v for k, v in common.items() if k not in settings or k == "eos_token_id"}
    assert not torch.equal(reference, target.generate(ids, attention_mask=mask, **plain))
    drafter = _oracle(target, reference, ids, mask)
    out = speculative_generate(target, drafter, ids, mask, adaptive=False, **common)
    assert out.stats.accepted > 20
    width = reference.shape[1]
    assert torch.equal(out.sequences[:, :width], reference)


def test_drafted_slots_see_their_drafts(target, monkeypatch):
    """Negative control: processors that read only the committed text at every slot (the drafts before the
    slot left out) decode another text with the same oracle."""
    ids, mask = _left_padded(PROMPTS)
    settings = SETTINGS["repetition"]
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None, **settings)
    reference = target.generate(ids, attention_mask=mask, **common)
    drafter = _oracle(target, reference, ids, mask)
    per_slot = TargetLogitsProcessors.round

    def committed_only(self, output, rows, ids, logits, tree=None):
        return per_slot(self, output, rows, ids[:, :1].expand_as(ids).clone(), logits, tree)

    monkeypatch.setattr(TargetLogitsProcessors, "round", committed_only)
    out = speculative_generate(target, drafter, ids, mask, adaptive=False, **common)
    assert not torch.equal(out.sequences[:, : reference.shape[1]], reference)


class CountUp(LogitsProcessor):
    """The next token is strongly the last one plus one: text that counts, so n-gram drafts copied from a
    counting prompt are accepted."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, (input_ids[:, -1:] + 1) % scores.shape[-1],
                                  torch.full_like(scores[:, :1], 50.0))


def test_tree_rounds_keep_greedy_identity_with_processors(target):
    """Forced tree rounds (the head's nodes and the n-gram's chain as branches) with a text-reading processor
    and a repetition penalty: the accepted paths run through n-gram branches, and the output equals
    ``generate``'s."""
    prompts = [list(range(20, 34)) + [20, 21, 22], list(range(50, 60)) + [50, 51]]
    ids, mask = _left_padded(prompts)
    common = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None, repetition_penalty=1.2,
                  logits_processor=LogitsProcessorList([CountUp()]))
    reference = target.generate(ids, attention_mask=mask, **common)
    drafter = tiny_drafter(target, block_size=5).to(torch.float64)
    out = speculative_generate(target, drafter, ids, mask, verify_policy=ForcedTrees([(3, 6), (2, 4)]),
                               block_size=12, **common)
    assert out.stats.tree_rounds > 0 and out.stats.accepted > 10
    assert torch.equal(out.sequences[:, : reference.shape[1]], reference)


class RecordPrefixes(LogitsProcessor):
    def __init__(self):
        self.prefixes = []

    def __call__(self, input_ids, scores):
        self.prefixes.append(input_ids[0].tolist())
        return scores


def test_each_tree_slot_is_processed_on_its_own_branch():
    """A tree whose slots are not in path order (two branches from the anchor, one hanging from a middle
    slot): every slot's processors see the prompt, the committed tokens and exactly its own branch."""

    committed_row = [7, 8]
    parent = torch.tensor([[0, 0, 1, 0, 2, 3]])  # slots 1, 3 hang from the anchor; 2 from 1; 4 from 2; 5 from 3
    depth = torch.tensor([[0, 1, 2, 1, 3, 2]])
    tokens = torch.tensor([[11, 12, 13, 14, 15]])
    tree = DraftTree(tokens, depth, parent, ancestry_of(parent), 5, 0, torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, dtype=torch.long))
    recorder = RecordPrefixes()
    prompt = torch.tensor([[0, 3, 4]])
    processors = TargetLogitsProcessors(
        tiny_target(vocab_size=16), GenerationConfig(), prompt, torch.tensor([[0, 1, 1]]), 8,
        LogitsProcessorList([recorder]))

    rows = Rows(torch.tensor([0]), torch.tensor([8]), torch.tensor([4]), torch.tensor([False]))
    output = OutputBuffer(prompt, torch.tensor([[0, 1, 1]]), 8, 6, 0, torch.empty(0, dtype=torch.long))
    output.commit(rows, torch.tensor([committed_row]), torch.tensor([2]))
    ids = torch.cat([torch.tensor([[8]]), tokens], dim=1)
    processors.round(output, rows, ids, torch.zeros(1, 6, 16), tree)
    base = [0, 3, 4, 7, 8]  # the prompt as given (padding too) and the committed tokens, ending in the anchor
    assert recorder.prefixes == [base, base + [11], base + [11, 12], base + [13], base + [11, 12, 14],
                                 base + [13, 15]]


def _law_under_generate(target, prompt, settings, tokens=2, logits_processor=None):
    """Exact law of the first ``tokens`` tokens under Transformers' own processors and warpers."""
    config = GenerationConfig(do_sample=True, **settings)
    target._prepare_special_tokens(config, kwargs_has_attention_mask=False, device="cpu")
    processors = target._get_logits_processor(config, prompt.shape[1], encoder_input_ids=prompt, device="cpu",
                                              logits_processor=logits_processor or LogitsProcessorList())
    vocab = target.config.vocab_size
    with torch.no_grad():
        law, prefixes = torch.ones(()), prompt
        for step in range(tokens):
            following = processors(prefixes, target(prefixes).logits[:, -1].float()).softmax(-1)
            law = law[..., None] * following.view(*law.shape, vocab)
            if step + 1 < tokens:
                prefixes = torch.cat([prefixes.repeat_interleave(vocab, 0),
                                      torch.arange(vocab).repeat(len(prefixes))[:, None]], dim=1)
    return law


def test_sampling_with_processors_and_min_p_keeps_generates_law():
    """20,000 sampled runs with drafts verified (free drafts in the cost model): the law of the first two
    tokens under a repetition penalty, temperature / top-k / top-p and min-p is ``generate``'s (total
    variation < 0.05, as the loop's lossless test), and far from the law without the penalty or min-p."""
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    with torch.no_grad():  # a law peaked enough for min-p to act
        target.get_output_embeddings().weight.mul_(6.0)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5]])
    settings = dict(temperature=1.3, top_k=8, top_p=0.95, min_p=0.4, repetition_penalty=3.0)
    exact = _law_under_generate(target, prompt, settings)
    without = _law_under_generate(target, prompt, {**settings, "repetition_penalty": 1.0})
    assert 0.5 * float((exact - without).abs().sum()) > 0.15
    without_min_p = _law_under_generate(target, prompt, {**settings, "min_p": None})
    assert 0.5 * float((exact - without_min_p).abs().sum()) > 0.15
    counts, generator, drafted = torch.zeros(12, 12), torch.Generator().manual_seed(7), 0
    for _ in range(4):
        out = speculative_generate(target, drafter, prompt.repeat(5000, 1), max_new_tokens=3, do_sample=True,
                                   generator=generator, cost_model=CostModel([1.0] * 4, 1e-6), ngram_size=0,
                                   draft_tree=False, **settings)
        pairs = out.sequences[:, 4:6]
        counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs)), accumulate=True)
        drafted += sum(out.stats.verify_length_histogram[1:])
    assert drafted > 0
    assert 0.5 * float((counts / counts.sum() - exact).abs().sum()) < 0.05


def test_max_time_stops_every_row_after_the_round_that_passes_it(target):
    ids, mask = _left_padded(PROMPTS)
    drafter = tiny_drafter(target).to(torch.float64)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=40, max_time=1e-9, adaptive=False)
    assert 1 <= int(out.num_generated.max()) <= drafter.config.block_size + 1  # the first token and one round
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=40, max_time=600.0, eos_token_id=None)
    assert out.num_generated.tolist() == [40, 40, 40]


def test_settings_still_refused_name_themselves(target):
    drafter = tiny_drafter(target).to(torch.float64)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"num_beams=2 \(from the call\)"):
        speculative_generate(target, drafter, ids, num_beams=2)
    with pytest.raises(ValueError, match=r"top_h=0.5 \(from the call\)"):
        speculative_generate(target, drafter, ids, do_sample=True, top_h=0.5)
    speculative_generate(target, drafter, ids, max_new_tokens=2, top_h=0.5)  # top-h acts only when sampling


class StopAfter(StoppingCriteria):
    """A caller's criterion that reads the whole text: stop once the generated tokens (past the prompt of
    ``prompt`` columns) sum past ``limit``; records the scores it was given."""

    def __init__(self, prompt: int, limit: int):
        self.prompt, self.limit, self.scores = prompt, limit, set()

    def __call__(self, input_ids, scores, **kwargs):
        self.scores.add(None if scores is None else tuple(scores.shape))
        return input_ids[:, self.prompt:].sum(-1) > self.limit


@pytest.mark.parametrize("trees", [False, True])
def test_stopping_criteria_end_each_row_where_generate_stops_it(target, trees):
    """Batch 3, left-padded, drafts accepted (oracle chains, or forced trees with n-gram branches): each
    row ends at the token where ``generate`` with the same criterion stops it, mid-round."""
    ids, mask = _left_padded(PROMPTS)
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference_criterion = StopAfter(ids.shape[1], 600)
    full = target.generate(ids, attention_mask=mask, **common)
    policy = dict(verify_policy=ForcedTrees([(3, 6)]), block_size=12) if trees else dict(adaptive=False)
    drafter = _oracle(target, full, ids, mask) if not trees else tiny_drafter(target, block_size=5).to(torch.float64)
    criterion = StopAfter(ids.shape[1], 600)
    out = speculative_generate(target, drafter, ids, mask, stopping_criteria=StoppingCriteriaList([criterion]),
                               **policy, **common)
    for row in range(len(PROMPTS)):  # generate pads a row that stopped while others go on
        alone = target.generate(ids[row : row + 1], attention_mask=mask[row : row + 1],
                                stopping_criteria=StoppingCriteriaList([reference_criterion]), **common)
        expected = alone[0, ids.shape[1]:].tolist()
        assert 0 < len(expected) < 30  # the criterion fires inside the budget
        assert out.sequences[row, ids.shape[1] : ids.shape[1] + int(out.num_generated[row])].tolist() == expected
    assert criterion.scores == {None}  # as generate calls them without output_scores


def test_the_transformers_path_applies_them_too(target):
    """``generate(assistant_model=head)`` with the same settings: Transformers applies the processors at
    every verified position, with our generator's drafts (an oracle, so they are accepted)."""
    ids = torch.tensor([PROMPTS[0]])
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None, **SETTINGS["repetition"])
    reference = target.generate(ids, **common)
    drafter = _oracle(target, reference, ids, torch.ones_like(ids))
    drafter.adaptive_verify = False  # whole blocks: the random head's confidence would verify nothing
    assert torch.equal(target.generate(ids, assistant_model=drafter, **common), reference)
    assert drafter.last_speculative_stats.accepted > 10


def test_drafts_follow_the_processors(target, monkeypatch):
    """The head drafts on logits the row's processors have seen (on its committed text), so it does not
    spend a round's slots on tokens the target's decoding bans: with most of the vocabulary suppressed, no
    head draft holds a suppressed token (without the hook, a random head drafts them nearly everywhere)."""
    banned = list(range(2, 80))
    drafted = []
    propose = loop.propose

    def spy(*args, **kwargs):
        proposal, head_drafted = propose(*args, **kwargs)
        if head_drafted:
            drafted.append(proposal.head_tokens.flatten())
        return proposal, head_drafted

    monkeypatch.setattr(loop, "propose", spy)
    ids, mask = _left_padded(PROMPTS)
    drafter = tiny_drafter(target).to(torch.float64)
    common = dict(max_new_tokens=12, eos_token_id=None, pad_token_id=0, adaptive=False, ngram_size=0)
    speculative_generate(target, drafter, ids, mask, **common)
    assert torch.isin(torch.cat(drafted), torch.tensor(banned)).float().mean() > 0.5
    drafted.clear()
    out = speculative_generate(target, drafter, ids, mask, suppress_tokens=banned, **common)
    assert not torch.isin(torch.cat(drafted), torch.tensor(banned)).any()
    assert not torch.isin(out.sequences[:, ids.shape[1]:], torch.tensor(banned)).any()


def test_a_draft_vocabulary_the_processors_ban_entirely_still_drafts(target):
    """A head drafting over a sub-vocabulary that the processors ban as a whole: every drafted position is
    all -inf after them (the selector's log-softmax gave NaN and the tree builder failed); the loop keeps
    going, on the default adaptive policy with trees and on forced trees, and stays generate's."""
    ids, mask = _left_padded([[5, 6, 7, 5, 6, 20, 21, 22, 5, 6], [9, 10, 11]])
    drafter = tiny_drafter(target, block_size=5).to(torch.float64)
    drafter.set_draft_vocab(list(range(2, 30)))
    common = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None,
                  suppress_tokens=list(range(2, 30)))
    reference = target.generate(ids, attention_mask=mask, **common)
    for policy in ({}, dict(verify_policy=ForcedTrees([(3, 4)]), block_size=10)):
        out = speculative_generate(target, drafter, ids, mask, **policy, **common)
        assert torch.equal(out.sequences[:, : reference.shape[1]], reference)
    sampling = {**common, "do_sample": True, "generator": torch.Generator().manual_seed(0)}
    sampled = speculative_generate(target, drafter, ids, mask, **sampling)
    assert not torch.isin(sampled.sequences[:, ids.shape[1]:], torch.arange(2, 30)).any()


def test_heads_whose_draft_block_predates_the_hook_still_decode(target):
    """Remote code saved by 0.1.0 may have no ``logits_processor`` in ``draft_block``: with a processor
    on, such a head drafts without it (the output is the target's either way) instead of a TypeError."""
    from hf_dflash2 import DFlash2DraftModel

    class OldHead(DFlash2DraftModel):
        def draft_block(self, anchor_ids, anchor_positions, context_kv, context_valid, context_positions,
                        temperature=0.0, generator=None, block_size=None):
            return super().draft_block(anchor_ids, anchor_positions, context_kv, context_valid, context_positions,
                                       temperature, generator, block_size)

    base = tiny_drafter(target).to(torch.float64)
    old = OldHead(base.config).to(torch.float64)
    old.load_state_dict(base.state_dict())
    ids = torch.tensor([[5, 6, 7, 8]])
    common = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None, repetition_penalty=1.3)
    out = speculative_generate(target, old, ids, adaptive=False, **common)
    assert torch.equal(out.sequences, target.generate(ids, **common))


def test_stopping_criteria_may_be_a_plain_list(target):
    """As ``generate`` takes them (it merges a list into a ``StoppingCriteriaList``)."""
    ids = torch.tensor([[5, 6, 7, 8]])
    drafter = tiny_drafter(target).to(torch.float64)
    out = speculative_generate(target, drafter, ids, max_new_tokens=30, eos_token_id=None,
                               stopping_criteria=[StopAfter(ids.shape[1], 300)])
    expected = target.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None,
                               stopping_criteria=[StopAfter(ids.shape[1], 300)])
    assert out.sequences[0, : int(out.num_generated[0]) + 4].tolist() == expected[0].tolist()
    assert int(out.num_generated[0]) < 30


def test_sampled_tree_rounds_with_processors_keep_generates_law():
    """20,000 sampled runs of three tokens through forced tree rounds (head nodes and the n-gram chain; the
    prompt holds every token so n-grams match) with a processor that reads the generated text (the last
    three tokens may not come again) and a repetition penalty: the laws of tokens (1, 2) and (2, 3) equal
    ``generate``'s under its own processors (bound as the loop's tree law test)."""
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5, 9, 2, 11, 4, 0, 6, 10, 8]])
    settings = dict(temperature=1.3, top_k=8, top_p=0.95, repetition_penalty=1.5)
    ban = LogitsProcessorList([BanRecentTokens()])
    exact = _law_under_generate(target, prompt, settings, tokens=3, logits_processor=ban)
    without = _law_under_generate(target, prompt, {**settings, "repetition_penalty": 1.0}, tokens=3)
    counts, generator, tree_rounds = torch.zeros(12, 12, 12), torch.Generator().manual_seed(5), 0
    for _ in range(4):
        out = speculative_generate(target, drafter, prompt.repeat(5000, 1), max_new_tokens=3, do_sample=True,
                                   generator=generator, verify_policy=ForcedTrees([(2, 3), (3, 0)]), block_size=8,
                                   logits_processor=ban, **settings)
        t = out.sequences[:, prompt.shape[1]: prompt.shape[1] + 3]
        counts.index_put_(tuple(t.T), torch.ones(len(t)), accumulate=True)
        tree_rounds += out.stats.tree_rounds
    assert tree_rounds > 0
    empirical = counts / counts.sum()

    def pair_tvs(law):
        return [0.5 * float((empirical.sum(2) - law.sum(2)).abs().sum()),
                0.5 * float((empirical.sum(0) - law.sum(0)).abs().sum())]

    assert max(pair_tvs(without)) > 0.1  # the processors move the law far more than the bound
    assert max(pair_tvs(exact)) < 0.05, pair_tvs(exact)


def test_the_transformers_path_stops_where_generate_stops(target):
    """Transformers checks stopping criteria once per assisted step; greedy, the generator cuts each draft
    before the token where generate's criteria would fire (read from ``_assisted_decoding``), so a
    caller's criterion ends the text where plain ``generate`` ends it (it ran 2 tokens on before)."""
    ids = torch.tensor([PROMPTS[0]])
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None)
    drafter = _oracle(target, target.generate(ids, **common), ids, torch.ones_like(ids))
    drafter.adaptive_verify = False
    expected = target.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], 600)]), **common)
    assert ids.shape[1] < expected.shape[1] < ids.shape[1] + 30
    out = target.generate(ids, assistant_model=drafter,
                          stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1], 600)]), **common)
    assert torch.equal(out, expected)
    assert drafter.last_speculative_stats.accepted > 3


def _parity_by_prompt(batch_id, text):
    """Prompt 0 writes even tokens, prompt 1 odd ones; after a 40, only 41 or 42 (the rule reads the text)."""
    if int(text[-1]) == 40:
        return [41, 42]
    return list(range(batch_id % 2, VOCAB, 2))


@pytest.mark.parametrize("trees", [False, True])
def test_prefix_allowed_tokens_fn_is_called_as_generate_calls_it(target, trees):
    """``prefix_allowed_tokens_fn`` (constrained decoding): greedy at batch 2, left-padded, each row decodes
    what batched ``generate`` decodes with the same function, which gets the prompt's index and the text."""
    ids, mask = _left_padded([[40, 7, 9, 40], [5, 6, 7]])
    common = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, prefix_allowed_tokens_fn=_parity_by_prompt, **common)
    assert not torch.equal(reference, target.generate(ids, attention_mask=mask, **common))
    if trees:
        drafter = tiny_drafter(target, block_size=5).to(torch.float64)
        policy = dict(verify_policy=ForcedTrees([(3, 4), (2, 2)]), block_size=10)
    else:
        drafter, policy = _oracle(target, reference, ids, mask), dict(adaptive=False)
    out = speculative_generate(target, drafter, ids, mask, prefix_allowed_tokens_fn=_parity_by_prompt, **policy,
                               **common)
    assert out.stats.accepted > 3
    assert torch.equal(out.sequences[:, : reference.shape[1]], reference)


def test_prefix_allowed_tokens_fn_gets_the_prompts_index_with_several_samples(target):
    """With ``num_return_sequences=2``, rows 0-1 are prompt 0's samples and rows 2-3 prompt 1's: the function
    gets the prompt's index, as in ``generate``, so rows keep their prompt's parity."""
    ids = torch.tensor([[3, 5, 7], [4, 6, 8]])
    out = speculative_generate(target, tiny_drafter(target).to(torch.float64), ids, max_new_tokens=12,
                               do_sample=True, num_return_sequences=2, eos_token_id=None,
                               generator=torch.Generator().manual_seed(1),
                               prefix_allowed_tokens_fn=lambda b, text: list(range(b % 2, VOCAB, 2)))
    generated = out.sequences[:, 3:]
    assert bool((generated[:2] % 2 == 0).all()) and bool((generated[2:] % 2 == 1).all())


@pytest.mark.parametrize("mode", ["chains", "trees", "sampled trees", "draft vocabulary"])
def test_a_repetition_penalty_alone_is_batched_and_bit_for_bit_the_processors(target, monkeypatch, mode):
    """With a repetition penalty as the only processor, rounds take the batched path; on every round of a
    left-padded batch of 3 (chains of an oracle's drafts, forced trees with n-gram branches, sampled trees,
    a head with a draft vocabulary) its logits, at the verified slots and at the head's drafted positions,
    equal the per-slot processor calls' bit for bit; greedy output equals ``generate``'s."""
    calls = {"round": 0, "drafts": 0}
    round_of, for_drafts_of = TargetLogitsProcessors.round, TargetLogitsProcessors.for_drafts

    def per_slot_too(call):
        def compare(self, *args):
            assert self.penalty is not None
            batched = call(self, *args)
            self.penalty, penalty = None, self.penalty
            try:
                assert torch.equal(batched, call(self, *args))
            finally:
                self.penalty = penalty
            return batched
        return compare

    def checked_round(self, output, rows, ids, logits, tree=None):
        calls["round"] += 1
        return per_slot_too(round_of)(self, output, rows, ids, logits, tree)

    def checked_drafts(self, output, rows):
        process = for_drafts_of(self, output, rows)

        def both(this, logits, vocab):
            calls["drafts"] += 1
            return process(logits, vocab)
        return lambda logits, vocab: per_slot_too(both)(self, logits, vocab)

    monkeypatch.setattr(TargetLogitsProcessors, "round", checked_round)
    monkeypatch.setattr(TargetLogitsProcessors, "for_drafts", checked_drafts)
    prompts = [[5, 6, 7, 5, 6, 20, 21, 5, 6], [9, 10, 11, 9, 10], [3]]
    ids, mask = _left_padded(prompts)
    common = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, eos_token_id=None, repetition_penalty=1.5)
    reference = target.generate(ids, attention_mask=mask, **common)
    unpenalized = target.generate(ids, attention_mask=mask, **{**common, "repetition_penalty": 1.0})
    assert not torch.equal(reference, unpenalized)
    drafter = tiny_drafter(target, block_size=5).to(torch.float64)
    policy = dict(verify_policy=ForcedTrees([(3, 4), (2, 2)]), block_size=10)
    if mode == "chains":
        drafter, policy = _oracle(target, reference, ids, mask), dict(adaptive=False)
    elif mode == "draft vocabulary":
        drafter.set_draft_vocab(list(range(0, VOCAB, 2)))
    elif mode == "sampled trees":
        common = {**common, "do_sample": True, "temperature": 1.5, "generator": torch.Generator().manual_seed(0)}
    out = speculative_generate(target, drafter, ids, mask, **policy, **common)
    assert calls["round"] > 3 and calls["drafts"] > (0 if mode == "chains" else 3)
    if mode == "chains":
        assert out.stats.accepted > 20
    elif mode != "sampled trees":
        assert out.stats.tree_rounds > 0
    if not common["do_sample"]:
        assert torch.equal(out.sequences[:, : reference.shape[1]], reference)


class PenaltySubclass(RepetitionPenaltyLogitsProcessor):
    """A caller's variant of the penalty: not the processor the batched path reproduces."""


@pytest.mark.parametrize("ignore, batched", [
    (None, True), (4, True), (torch.tensor([2]), True), (0, True),
    (6, False),  # past the prompt: the processor also ignores committed tokens
    (torch.tensor([6]), False), (np.int64(3), False),  # np.int64: the processor ignores nothing
    ("subclass", False),
])
def test_the_batched_penalty_is_taken_only_where_it_equals_the_processor(ignore, batched):
    """A caller's own ``RepetitionPenaltyLogitsProcessor`` (shared by the rows) with ``prompt_ignore_length``
    values the processor reads otherwise than as prompt columns, or a subclass, keeps the per-slot path; the
    rest take the batched one. Either way, a chain round, a tree round and the drafts' hook on running row 1
    alone of a batch of 2 give the per-slot logits bit for bit."""

    target = tiny_target(vocab_size=48)
    prompts = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.ones_like(prompts)
    processor = (PenaltySubclass(1.4) if ignore == "subclass"
                 else RepetitionPenaltyLogitsProcessor(1.4, prompt_ignore_length=ignore))
    processors = TargetLogitsProcessors(target, GenerationConfig(), prompts, mask, 16,
                                        LogitsProcessorList([processor]))
    assert (processors.penalty is not None) == batched
    output = OutputBuffer(prompts, mask, 16, 6, 0, torch.empty(0, dtype=torch.long))
    everyone = Rows(torch.arange(2), torch.tensor([3, 4]), torch.tensor([4, 4]), torch.zeros(2, dtype=bool))
    output.commit(everyone, torch.tensor([[20, 21, 9], [30, 10, 31]]), torch.tensor([3, 3]))
    row_1 = everyone.select(torch.tensor([1]))
    parent = torch.tensor([[0, 0, 1, 0, 2]])
    tree = DraftTree(torch.tensor([[32, 10, 33, 11]]), torch.tensor([[0, 1, 2, 1, 3]]), parent,
                     ancestry_of(parent), 4, 0, torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, dtype=torch.long))
    chain = torch.tensor([[31, 12, 30, 40]])
    tree_ids = torch.cat([torch.tensor([[31]]), tree.tokens], dim=1)
    logits = torch.randn(1, 4, 48, generator=torch.Generator().manual_seed(0))
    drafts = torch.randn(1, 3, 48, generator=torch.Generator().manual_seed(1))
    penalty = processors.penalty

    def both(call):
        processors.penalty = penalty
        first = call()
        processors.penalty = None
        return first, call()

    tree_logits = torch.cat([logits, logits[:, :1]], 1)
    calls = [(lambda: processors.round(output, row_1, chain, logits), logits),
             (lambda: processors.round(output, row_1, tree_ids, tree_logits, tree), tree_logits),
             (lambda: processors.for_drafts(output, row_1)(drafts, None), drafts)]
    for call, raw in calls:
        first, second = both(call)
        assert torch.equal(first, second)
        assert not torch.equal(first, raw)  # the penalty acted
