"""N-gram (prompt lookup) drafts next to the head's: the device-side match, greedy identity on both
paths, the law of sampling, and the policy's per-source calibration."""

from __future__ import annotations

import pytest
import torch

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, ForcedVerifyLengths
from hf_dflash2.speculative_dflash2 import make_proposal, ngram_draft

from .conftest import tiny_drafter, tiny_target
from .test_adaptive import _pair_counts, _tv
from .test_generation import _pair_distribution, plain


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path_factory.getbasetemp() / "cost_models"))


def reference_ngram(row: list[int], length: int, num_tokens: int, ngram_size: int):
    """The rule in plain Python: longest n first, most recent earlier match, continuation cycled."""
    history = row[:length]
    for n in range(ngram_size, 0, -1):
        suffix = history[length - n:] if length >= n else None
        if suffix is None or any(t < 0 for t in suffix):
            continue
        for begin in range(length - n - 1, -1, -1):
            if history[begin:begin + n] == suffix:
                start = begin + n
                return [history[start + i % (length - start)] for i in range(num_tokens)], n
    return None, 0


def test_ngram_draft_equals_the_plain_python_rule():
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        n_rows, width = 5, 24
        history = torch.randint(0, 3 + trial % 4, (n_rows, width), generator=generator)
        pad = torch.randint(0, 6, (n_rows,), generator=generator)
        history[torch.arange(width)[None] < pad[:, None]] = -1  # left padding
        length = torch.randint(1, width + 1, (n_rows,), generator=generator).maximum(pad + 1)
        size_limit = 1 + trial % 4
        tokens, size = ngram_draft(history, length, 6, size_limit)
        assert (tokens >= 0).all()  # never the padding marker, matched or not (it would index q)
        for r in range(n_rows):
            expected, n = reference_ngram(history[r].tolist(), int(length[r]), 6, size_limit)
            assert int(size[r]) == n, (trial, r)
            if n:
                assert tokens[r].tolist() == expected, (trial, r)


def test_ngram_draft_continues_a_loop_and_ignores_padding():
    history = torch.tensor([[-1, -1, 5, 6, 7, 5, 6, 7, 5, 0, 0], [-1, -1, -1, -1, -1, -1, 4, 9, 4, 0, 0]])
    tokens, size = ngram_draft(history, torch.tensor([9, 9]), 7, 3)
    assert size.tolist() == [3, 1]
    assert tokens[0].tolist() == [6, 7, 5, 6, 7, 5, 6]  # "7 5" then a 3-token loop
    assert tokens[1].tolist() == [9, 4, 9, 4, 9, 4, 9]  # the padding (-1) never matches


def _left_padded(prompts):
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = torch.as_tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("dflash2", [True, False])
def test_ngram_drafts_keep_greedy_identity_on_both_paths(dflash2):
    """Prompts that repeat a span, so n-gram drafts are verified (forced k = 4) next to the head's, at
    batch 3 with left padding, and through generate(assistant_model=...)."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=5)
    generator = torch.Generator().manual_seed(3)
    spans = [torch.randint(2, 64, (n,), generator=generator) for n in (4, 3, 5)]
    prompts = [torch.cat([s, s, s[:2]]) for s in spans]
    ids, mask = _left_padded(prompts)
    alone = [plain(target, p[None], 30) for p in prompts]
    for policy in (ForcedVerifyLengths([4]), None):
        out = speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=30, verify_policy=policy,
                                   cost_model=CostModel([1.0] * 5, 1e-6))
        for row, p in enumerate(prompts):
            assert torch.equal(out.sequences[row, ids.shape[1]:], alone[row][0, len(p):]), (policy, row)
        assert out.stats.ngram_rounds > 0
    drafter.verify_policy = ForcedVerifyLengths([4])
    try:
        for p, expected in zip(prompts, alone):
            assert torch.equal(target.generate(p[None], assistant_model=drafter, max_new_tokens=30, do_sample=False),
                               expected)
            assert drafter.last_speculative_stats.ngram_rounds > 0
        drafter.ngram_size = 0
        target.generate(prompts[0][None], assistant_model=drafter, max_new_tokens=30, do_sample=False)
        assert drafter.last_speculative_stats.ngram_rounds == 0
    finally:
        del drafter.verify_policy, drafter.ngram_size


def test_the_loop_hands_the_lookup_every_row_whole_and_no_more(monkeypatch):
    """The fast loop reads only as much history as the longest row can hold (a bound kept on the host, grown
    by each round's width): every row's text still fits, and the lookup's drafts equal those over the whole
    buffer. A text the tiny target loops on gets most drafts accepted, so rows run up against the bound, in
    chain rounds and in tree rounds."""
    import hf_dflash2.generation.loop as loop
    import hf_dflash2.speculative_dflash2 as speculative

    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    looping = plain(target, torch.tensor([[5, 9, 13]]), 40)[0]
    other = plain(target, torch.tensor([[7, 2]]), 30)[0]
    original, original_tree = speculative.ngram_draft, loop.build_tree
    headroom, trees = [], []

    def checked(history, length, num_tokens, ngram_size=3):
        headroom.append(history.shape[1] - int(length.max()))
        assert headroom[-1] >= 0, (history.shape, length)
        padded = torch.cat([history, history.new_full((history.shape[0], 40), 7)], 1)  # more buffer after the text
        full, mine = original(padded, length, num_tokens, ngram_size), original(history, length, num_tokens, ngram_size)
        assert torch.equal(mine[0], full[0]) and torch.equal(mine[1], full[1])
        return mine

    def counted_tree(*args, **kwargs):
        trees.append(1)
        return original_tree(*args, **kwargs)

    monkeypatch.setattr(speculative, "ngram_draft", checked)
    monkeypatch.setattr(loop, "build_tree", counted_tree)
    cost = CostModel([1.0, 1.0, 1.05, 1.1, 1.15], 0.1)
    for prompts in ([looping], [looping, other]):
        ids, mask = _left_padded([p.tolist() for p in prompts])
        for policy in (None, ForcedVerifyLengths([4, 0, 1, 2], draft_when_zero=True)):
            speculative_generate(target, drafter, ids, attention_mask=mask, max_new_tokens=60, verify_policy=policy,
                                 cost_model=cost)
    assert trees and min(headroom) == 0  # tree rounds ran, and some lookup needed every token of its bound


def test_ngram_drafts_are_accepted_where_the_target_repeats_itself():
    """The target's own greedy output fed back as a prompt: the text goes on as before, so the n-gram
    drafts are accepted and the adaptive policy lets them carry most rounds."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    first = plain(target, torch.tensor([[5, 9, 13]]), 40)
    looped = first[0, -12:].tolist()
    assert len(set(looped)) < len(looped)  # this tiny model loops, as small models do
    cost = CostModel([1.0, 1.0, 1.05, 1.1, 1.15], 0.1)
    out = speculative_generate(target, drafter, first, max_new_tokens=40, cost_model=cost)
    # token 0 is also the pad token: generate would mask it out of a prompt without an explicit mask
    assert torch.equal(out.sequences, plain(target, first, 40, attention_mask=torch.ones_like(first)))
    assert out.stats.ngram_accepted > 20 and out.stats.acceptance_length > 2.5
    alone = speculative_generate(target, drafter, first, max_new_tokens=40, ngram_size=0, cost_model=cost)
    assert alone.stats.ngram_rounds == 0 and alone.stats.acceptance_length < out.stats.acceptance_length


@pytest.mark.parametrize("dflash2", [True, False])
def test_sampling_law_with_ngram_drafts(dflash2):
    """20,000 runs whose prompt holds every token, so most first tokens have a unigram match and the second
    token is verified against a one-hot n-gram proposal in some rows and the head's in others."""
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5, 9, 2, 11, 4, 0, 6, 10, 8]])
    exact = _pair_distribution(target, prompt, 1.3, 8, 0.95)
    cost = CostModel([1.0, 1.0, 1.0, 1.0], 1e-6)
    counts, histogram = _pair_counts(target, drafter, prompt, 20_000, 5_000, 4321, cost_model=cost)
    assert histogram[1:].sum() > 0
    assert _tv(counts, exact) < 0.05
    counts, histogram = _pair_counts(target, drafter, prompt, 5_000, 5_000, 77,
                                     verify_policy=ForcedVerifyLengths([3], draft_when_zero=True))
    assert _tv(counts, exact) < 0.08


def test_sampling_law_counts_ngram_rows():
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5, 9, 2, 11, 4, 0, 6, 10, 8]])
    out = speculative_generate(target, drafter, prompt.repeat(200, 1), max_new_tokens=3, do_sample=True,
                               generator=torch.Generator().manual_seed(1), cost_model=CostModel([1.0] * 4, 1e-6))
    assert 0 < out.stats.ngram_rounds < 200 * out.stats.rounds


def test_policy_calibrates_each_source_and_lets_the_head_compete():
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    policy = AdaptiveVerifyPolicy(cost, clock=None, ngram_streak=3).start(5)
    ones = torch.ones(2, 4)
    # unigram drafts never accepted, trigram drafts always: the calibration learns both apart
    for _ in range(10):
        policy.observe(ones, 4, torch.tensor([0, 4]), torch.tensor([1, 3]))
    head = torch.full((3, 4), 0.6)
    use = policy.use_ngram(head, torch.tensor([1, 3, 0]))
    assert use.tolist() == [False, True, False]
    proposal = make_proposal(None, torch.ones(3, 4, dtype=torch.long), torch.tensor([1, 3, 0]), None,
                             torch.zeros(3, dtype=torch.long), 64)
    assert proposal.source.tolist() == [1, 3, -1] and proposal.confidence[2].sum() == 0
    # the head drafted, an n-gram won: the next rounds skip the draft pass while n-grams keep paying
    assert policy.wants_draft()
    k = policy.choose(torch.ones(1, 4), torch.tensor([3]), drafted=True)
    policy.chosen(int(k), head_used=False)
    assert int(k) == 4
    assert not policy.wants_draft() and policy.wants_ngram()
    k = policy.choose(torch.ones(1, 4), torch.tensor([3]), drafted=False)
    policy.chosen(int(k), head_used=False)
    assert not policy.wants_draft()
    policy.chosen(int(policy.choose(torch.ones(1, 4), torch.tensor([3]), drafted=False)), head_used=False)
    assert policy.wants_draft()  # every ngram_streak rounds the head drafts again
    # an n-gram alone that would not pay is not verified, and the head is back next round
    assert int(policy.choose(torch.ones(1, 4), torch.tensor([1]), drafted=False)) == 0


def test_bad_ngram_size_is_refused_before_any_forward():
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    with pytest.raises(ValueError, match="ngram_size must be an integer in 0..4.*got 7"):
        speculative_generate(target, drafter, torch.tensor([[3, 4]]), ngram_size=7)
    drafter.ngram_size = -1
    with pytest.raises(ValueError, match="got -1"):
        target.generate(torch.tensor([[3, 4]]), assistant_model=drafter, max_new_tokens=4)


def test_rounds_widen_for_ngram_drafts_only_under_the_adaptive_policy():
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.tensor([[3, 4, 5, 3, 4]])
    block = lambda **kw: speculative_generate(target, drafter, ids, max_new_tokens=4, **kw).stats.block_size  # noqa: E731
    assert block() == 16
    assert block(ngram_size=0) == block(adaptive=False) == block(verify_policy=ForcedVerifyLengths([2])) == 5
    assert block(cost_model=CostModel([1.0] * 8, 0.1)) == 8  # never past what a given cost model covers
    assert block(block_size=7) == 7
    widths = []
    original = drafter.draft_block

    def recording(*args, **kwargs):
        out = original(*args, **kwargs)
        widths.append(out.tokens.shape[1])
        return out

    drafter.draft_block = recording
    block(verify_policy=ForcedVerifyLengths([4]), block_size=16)
    assert widths and set(widths) == {4}  # the head drafts within its own block of 5
