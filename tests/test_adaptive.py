"""Adaptive verify length: forced k sequences stay token-identical, the law of sampling is kept, stats."""

from __future__ import annotations

import statistics

import pytest
import torch

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, ForcedVerifyLengths
from hf_dflash2.modeling_dflash2 import DraftOutput

from .conftest import tiny_drafter, tiny_target
from .test_generation import OracleDrafter, _pair_distribution, generate_drafts_from, plain

FORCED = [0, 4, 1, 0, 0, 2, 4, 1, 0]  # includes 0 (plain steps, several in a row) and B - 1 = 4; never 3


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path_factory.getbasetemp() / "cost_models"))


def _expected_histogram(sequence, rounds, block_size):
    counts = [0] * block_size
    for r in range(rounds):
        counts[sequence[r % len(sequence)]] += 1
    return counts


@pytest.mark.parametrize("dflash2", [True, False])
@pytest.mark.parametrize("draft_when_zero", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_forced_lengths_fast_loop_greedy_identity(dflash2, draft_when_zero, batch):
    """Left-padded rows and an oracle drafter (long acceptances), every k in FORCED."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=5)
    generator = torch.Generator().manual_seed(21)
    prompts = [torch.randint(2, 64, (n,), generator=generator) for n in (6, 3, 6)][:batch]
    width = 6
    ids, mask = torch.zeros(batch, width, dtype=torch.long), torch.zeros(batch, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    alone = [plain(target, p[None], 30)[0, len(p):] for p in prompts]
    oracle = OracleDrafter(drafter, torch.stack(alone), torch.tensor([len(p) for p in prompts]))
    policy = ForcedVerifyLengths(FORCED, draft_when_zero=draft_when_zero)
    out = speculative_generate(target, oracle, ids, attention_mask=mask, max_new_tokens=30, verify_policy=policy,
                               block_size=5)
    for row in range(batch):
        assert torch.equal(out.sequences[row, width:], alone[row]), row
    histogram = out.stats.verify_length_histogram
    assert out.stats.accepted > 0  # drafts were really kept, so truncation mattered
    assert histogram[3] == 0 and all(histogram[k] > 0 for k in (0, 1, 2, 4)), histogram
    if batch == 1:
        rounds = out.stats.rounds
        # as forced, except that the last rounds verify no more drafts than the token budget has room for
        # (tests/test_generation.py::test_no_round_verifies_drafts_past_the_token_budget)
        before_the_end, asked = _expected_histogram(FORCED, rounds - 2, 5), _expected_histogram(FORCED, rounds, 5)
        assert sum(histogram) == rounds and all(h >= b for h, b in zip(histogram, before_the_end)), histogram
        assert sum(k * h for k, h in enumerate(histogram)) <= sum(k * a for k, a in enumerate(asked))
        drafted = sum(1 for r in range(rounds) if FORCED[r % len(FORCED)] or draft_when_zero)
        assert drafted <= oracle.calls <= drafted + 1  # + the draft of the round that finds every row done


@pytest.mark.parametrize("dflash2", [True, False])
def test_forced_lengths_generate_path_greedy_identity(dflash2):
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(22))
    expected = plain(target, ids, 30)
    oracle = OracleDrafter(drafter, expected[:, 6:], torch.tensor([6]))
    drafter.verify_policy = policy = ForcedVerifyLengths(FORCED)
    try:
        with generate_drafts_from(oracle):
            out = target.generate(ids, assistant_model=drafter, max_new_tokens=30, do_sample=False)
    finally:
        del drafter.verify_policy
    assert torch.equal(out, expected)
    stats = oracle.last_speculative_stats
    assert stats.accepted > 0
    history = policy.history
    assert history == [FORCED[r % len(FORCED)] for r in range(len(history))] and len(history) >= len(FORCED)
    histogram = stats.verify_length_histogram  # the last rounds may be shortened by the token budget
    assert histogram[3] == 0 and all(histogram[k] > 0 for k in (0, 1, 2, 4)), histogram


@pytest.mark.parametrize("dflash2", [True, False])
def test_adaptive_default_is_greedy_identical_on_both_paths(dflash2):
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=5)
    ids = torch.randint(2, 64, (2, 5), generator=torch.Generator().manual_seed(23))
    # cheap verifies: the policy drafts and verifies some drafts, not always all of them
    cost = CostModel([1.0, 1.05, 1.3, 1.8, 2.6], 0.05)
    out = speculative_generate(target, drafter, ids, max_new_tokens=24, cost_model=cost)
    for row in range(2):
        expected = plain(target, ids[row:row + 1], 24)
        assert torch.equal(out.sequences[row:row + 1], expected)
        drafter.verify_cost_model = cost
        try:
            assert torch.equal(target.generate(ids[row:row + 1], assistant_model=drafter, max_new_tokens=24,
                                               do_sample=False), expected)
        finally:
            del drafter.verify_cost_model
    assert out.stats.rounds > 0 and sum(out.stats.verify_length_histogram) == out.stats.rounds


def test_adaptive_policy_prefers_plain_steps_for_a_useless_draft_and_backs_off():
    """A never-accepted but confident drafter: the calibration learns it, the loop turns to AR steps."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(24))

    seen = set(plain(target, ids, 60)[0].tolist())
    unused = next(t for t in range(2, 64) if t not in seen)

    class Wrong:
        calls = 0

        def __getattr__(self, name):
            return getattr(drafter, name)

        def draft_block(self, *args, **kwargs):
            Wrong.calls += 1
            out = drafter.draft_block(*args, **kwargs)
            tokens = torch.full_like(out.tokens, unused)  # never the target's choice
            return DraftOutput(tokens, tokens[..., None], torch.ones(*tokens.shape, 1), out.logits, out.hidden,
                               torch.full(tokens.shape, 0.95))

    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    out = speculative_generate(target, Wrong(), ids, max_new_tokens=60, cost_model=cost, ngram_size=0)
    assert torch.equal(out.sequences, plain(target, ids, 60))
    histogram = out.stats.verify_length_histogram
    assert histogram[0] > 40  # most rounds are plain steps
    assert Wrong.calls < 15  # and most of those skip the draft (probes back off)


def test_adaptive_policy_choice_follows_cost_and_confidence():
    cost = CostModel([1.0, 1.0, 1.0, 1.0, 4.0], 0.1)
    policy = AdaptiveVerifyPolicy(cost, prior_strength=1e-6, pooled_prior=1e-6, probe_overhead=1.0, prior_ratio=1.0,
                                  clock=None)  # the cost model alone (rounds timed: the next test)
    policy.start(5)
    sure = torch.ones(2, 4)
    assert int(policy.choose(sure)) == 3  # k = 4 would need 5 tokens, which cost 4x
    policy.chosen(3)  # the draft paid: no back-off
    assert policy.wants_draft()
    # Once drafted, checking 3 drafts costs what a plain step does here: verify (and calibrate on) them,
    # but a draft this unsure did not pay for its own 0.1 step, so the next round skips drafting.
    assert int(policy.choose(torch.full((2, 4), 0.01))) == 3
    policy.chosen(3)
    assert [policy.wants_draft() for _ in range(2)] == [False, True]
    policy.choose(sure)
    policy.chosen(3)  # a probe that pays resets the back-off
    assert int(policy.choose(torch.tensor([[0.9, 0.9, 0.0, 0.9]]))) == 2
    # observed acceptance far below the claimed confidence shrinks what the policy expects
    policy.observe(sure, 3, torch.zeros(2, dtype=torch.long))
    assert int(policy.choose(torch.full((2, 4), 0.9))) == 0
    policy.chosen(0)
    assert [policy.wants_draft() for _ in range(2)] == [False, True]
    policy.chosen(0)
    assert [policy.wants_draft() for _ in range(3)] == [False, False, True]
    # a draft costing 10 % of a step, failed probes held near 3 %: at least 4 plain steps before the next one
    careful = AdaptiveVerifyPolicy(cost, clock=None).start(5)
    careful.chosen(0)
    assert [careful.wants_draft() for _ in range(5)] == [False] * 4 + [True]
    with pytest.raises(ValueError, match="block_size=6"):
        AdaptiveVerifyPolicy(cost).start(6)
    with pytest.raises(ValueError, match="non-empty list"):
        ForcedVerifyLengths([])
    with pytest.raises(TypeError, match="VerifyPolicy"):
        small = tiny_target(vocab_size=64)
        speculative_generate(small, tiny_drafter(small), torch.tensor([[3, 4]]), verify_policy=[1, 2])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_rounds(policy, clock, confidence, rounds, step_seconds, drafted_seconds):
    """Drive a policy as the loop does, each round taking the given (fake) time; returns the k chosen."""
    chosen = []
    for _ in range(rounds):
        if policy.wants_draft():
            k = int(policy.choose(confidence))
            policy.chosen(k)
            clock.now += drafted_seconds(k)
        else:
            k = 0
            clock.now += step_seconds
        chosen.append(k)
    return chosen


@pytest.mark.parametrize("truth", ["cheaper", "dearer"])
def test_adaptive_policy_trusts_its_own_round_times_over_a_wrong_cost_model(truth):
    """The cached cost model is one noisy measurement. A call times its rounds: a draft the cache calls
    too dear (or too cheap) is judged by what rounds really cost."""
    confidence = torch.full((1, 4), 0.45)  # calibrated below: E[committed | k = 1] = 1.45
    if truth == "cheaper":  # cache: a drafted round of k = 1 costs 1.65 steps (no pay); really 1.25 (pays)
        cost, real = CostModel([1.0, 1.45, 1.55, 1.6, 1.65], 0.2), lambda k: 1.2 + 0.05 * k
    else:  # cache: 1.1 steps (pays); really 1.8 (does not)
        cost, real = CostModel([1.0, 1.0, 1.0, 1.05, 1.1], 0.1), lambda k: 1.7 + 0.1 * k
    settings = dict(prior_strength=1e-6, pooled_prior=1e6, prior_ratio=1.0, probe_overhead=0.5, max_skip=4)
    clock = FakeClock()
    timed = AdaptiveVerifyPolicy(cost, clock=clock, **settings).start(5)
    blind = AdaptiveVerifyPolicy(cost, clock=None, **settings).start(5)
    chosen = _run_rounds(timed, clock, confidence, 200, 1.0, real)
    blind_chosen = _run_rounds(blind, FakeClock(), confidence, 200, 1.0, real)
    drafted, blind_drafted = sum(k > 0 for k in chosen[100:]), sum(k > 0 for k in blind_chosen[100:])
    if truth == "cheaper":
        assert timed.measured_cost_ratio < 0.85
        assert blind_drafted < 30 and drafted > 90  # the cache alone would keep probing and backing off
    else:
        assert timed.measured_cost_ratio > 1.4
        assert blind_drafted > 90 and drafted < 30
    assert len(timed.timed["step"]) + len(timed.timed["draft"]) > 0


def test_round_timing_skips_the_first_round_and_clock_none_turns_it_off():
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    clock = FakeClock()
    policy = AdaptiveVerifyPolicy(cost, clock=clock).start(5)
    _run_rounds(policy, clock, torch.ones(1, 4), 1, 1.0, lambda k: 100.0)  # a slow first round
    assert policy.measured_cost_ratio == 1.0 and not policy.timed["draft"]
    _run_rounds(policy, clock, torch.ones(1, 4), 3, 1.0, lambda k: 2 * (cost.verify(k + 1) + 0.1))
    assert list(policy.timed["draft"]) == pytest.approx([2.0, 2.0])  # rounds 2 and 3 (4 ends at the next)
    off = AdaptiveVerifyPolicy(cost, clock=None).start(5)
    _run_rounds(off, clock, torch.ones(1, 4), 5, 1.0, lambda k: 100.0)
    assert off.measured_cost_ratio == 1.0 and not off.timed["draft"] and not off.timed["step"]


def _pair_counts(target, drafter, prompt, runs, per_call, seed, **kwargs):
    counts = torch.zeros(target.config.vocab_size, target.config.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    histogram = 0
    for start in range(0, runs, per_call):
        n = min(per_call, runs - start)
        # 5 tokens: the first round has room for all B - 1 = 3 drafts (a round verifies no draft the budget
        # could not commit); the law is read on the first two tokens
        out = speculative_generate(target, drafter, prompt.repeat(n, 1), max_new_tokens=5, do_sample=True,
                                   temperature=1.3, top_k=8, top_p=0.95, generator=generator, **kwargs)
        pairs = out.sequences[:, prompt.shape[1]:prompt.shape[1] + 2]
        counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(n), accumulate=True)
        histogram = histogram + torch.tensor(out.stats.verify_length_histogram)  # [the call's block]
    return counts, histogram


def _tv(counts, exact):
    return float(0.5 * (counts / counts.sum() - exact).abs().sum())


@pytest.mark.parametrize("dflash2", [True, False])
def test_sampling_law_with_adaptive_and_forced_lengths(dflash2):
    """20,000 adaptive runs, then 5,000 runs for each forced k = 0..3: the law of the first two tokens is
    the target's (bounds as in test_generation's lossless test)."""
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, dflash2=dflash2, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5]])
    exact = _pair_distribution(target, prompt, 1.3, 8, 0.95)
    cost = CostModel([1.0, 1.0, 1.0, 1.0], 1e-6)  # free drafts, flat verify: any confidence pays for a draft
    counts, histogram = _pair_counts(target, drafter, prompt, 20_000, 5_000, 1234, cost_model=cost)
    assert histogram[1:].sum() > 0  # drafts were verified
    assert _tv(counts, exact) < 0.05
    for k in range(4):
        counts, histogram = _pair_counts(target, drafter, prompt, 5_000, 5_000, 99 + k,
                                         verify_policy=ForcedVerifyLengths([k], draft_when_zero=True))
        assert histogram[k] >= 5_000 and histogram[k + 1:].sum() == 0  # every first round verified k, none more
        assert _tv(counts, exact) < 0.08, (k, _tv(counts, exact))


def test_the_law_statistic_detects_a_verify_length_that_peeks_at_the_sampled_draft():
    """Negative control for the tests above. The loop shares k across rows, so a per-row rule is built
    from its acceptance step directly: 20,000 rows draft x ~ q; a rule that verifies the draft only where x
    is q's mode (so k depends on the sampled token) breaks the law of the output, and the TV statistic sees
    it; the same share of rows chosen independently of x keeps it."""
    from hf_dflash2.generation.sampling import Sampler

    p = torch.tensor([0.40, 0.20, 0.12, 0.10, 0.08, 0.05, 0.03, 0.02])
    q = torch.tensor([0.35, 0.05, 0.20, 0.15, 0.10, 0.05, 0.05, 0.05])
    n, generator = 20_000, torch.Generator().manual_seed(5)
    sampler = Sampler(True, 1.0, None, None, generator)
    x = torch.multinomial(q.expand(n, -1), 1, replacement=True, generator=generator)  # [n, 1]
    logits = p.log().expand(n, 2, -1)  # the target's law at both verified positions
    draft = DraftOutput(x, torch.arange(8).expand(n, 1, -1), q.expand(n, 1, -1), None, None)

    def output_law(verify: torch.Tensor) -> torch.Tensor:
        out = torch.empty(n, dtype=torch.long)
        keep = verify.nonzero().flatten()
        _, tokens = sampler.accept(x[keep], DraftOutput(x[keep], draft.q_ids[keep], draft.q_probs[keep], None, None),
                                   logits[keep])
        out[keep] = tokens[:, 0]
        rest = (~verify).nonzero().flatten()
        out[rest] = sampler.accept(x[rest, :0], None, logits[rest, :1])[1][:, 0]
        return torch.bincount(out, minlength=8).float() / n

    peeking = x[:, 0] == q.argmax()
    blind = torch.rand(n, generator=generator) < peeking.float().mean()
    assert float(0.5 * (output_law(blind) - p).abs().sum()) < 0.02
    assert float(0.5 * (output_law(peeking) - p).abs().sum()) > 0.1


def test_a_second_call_starts_from_what_the_first_learnt():
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    first = AdaptiveVerifyPolicy(cost, clock=None).start(5)
    sure = torch.full((1, 4), 0.9)
    for _ in range(20):  # confident drafts, none accepted
        first.choose(sure)
        first.chosen(3)
        first.observe(sure, 3, torch.zeros(1, dtype=torch.long))
    fresh = AdaptiveVerifyPolicy(cost, clock=None).start(5)
    second = AdaptiveVerifyPolicy(cost, clock=None).start(5, first)
    assert int(fresh.choose(sure)) > 0 and bool(fresh._paid)  # the prior alone trusts the draft
    second.choose(sure)
    assert not bool(second._paid)  # the carried evidence does not
    assert float(second.predicted.sum()) == pytest.approx(second.carry_mass)  # shrunk, still movable
    assert second.skip == first.skip > 0 and second.to_skip == second.min_skip
    other = AdaptiveVerifyPolicy(CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1), clock=None).start(5, first)
    assert other.predicted is None and other.skip == 0  # another cost model: nothing carried


def test_verify_policy_for_carries_the_last_call_of_the_same_target_and_head():
    from hf_dflash2.cost_model_dflash2 import verify_policy_for

    target = tiny_target(vocab_size=64)
    drafter, other = tiny_drafter(target, block_size=5), tiny_drafter(target, block_size=5)
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    first = verify_policy_for(target, drafter, 1, 5, cost_model=cost)
    first.observe(torch.ones(1, 4), 4, torch.zeros(1, dtype=torch.long))
    second = verify_policy_for(target, drafter, 1, 5, cost_model=cost)
    assert second.predicted is not None and float(second.observed.sum()) == 0.0
    assert verify_policy_for(target, other, 1, 5, cost_model=cost).predicted is None
    assert verify_policy_for(target, drafter, 2, 5, cost_model=cost).predicted is None


def test_after_a_draft_that_did_not_pay_measured_rounds_set_how_much_of_it_is_checked():
    """Once a draft is spent, k trades extra verify time for tokens. The cache says an extra verified token
    costs 0.2 steps; rounds timed at twice their prediction make it 0.4, more than a 0.3-sure token brings."""
    cost = CostModel([1.0, 1.2, 1.4, 1.6, 1.8], 0.5)
    confidence = torch.full((1, 4), 0.3)
    settings = dict(prior_strength=1e-6, pooled_prior=1e6, prior_ratio=1.0, clock=None)
    cached = AdaptiveVerifyPolicy(cost, **settings).start(5)
    assert int(cached.choose(confidence)) == 1 and not bool(cached._paid)
    timed = AdaptiveVerifyPolicy(cost, **settings).start(5)
    timed.timed["step"].extend([1.0] * 8)
    timed.timed["draft"].extend([2.0] * 8)
    assert timed.measured_cost_ratio == pytest.approx(2.0, rel=0.05)
    assert int(timed.choose(confidence)) == 0 and not bool(timed._paid)
    cheap = AdaptiveVerifyPolicy(cost, **settings).start(5)
    cheap.timed["step"].extend([1.0] * 8)
    cheap.timed["draft"].extend([0.25] * 8)
    assert int(cheap.choose(confidence)) == 2 and not bool(cheap._paid)  # extra tokens at 0.05 steps each


def test_num_assistant_tokens_caps_the_drafts_of_a_generate_round():
    """Transformers' ``num_assistant_tokens`` binds our generator too: forced to verify 4 drafts, rounds
    verify at most 2 when the user asks for 2, stay exact, and a bad value is refused before any forward."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, dflash2=True, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(23))
    expected = plain(target, ids, 30)
    oracle = OracleDrafter(drafter, expected[:, 6:], torch.tensor([6]))
    drafter.verify_policy = ForcedVerifyLengths([4])
    greedy = dict(max_new_tokens=30, do_sample=False)
    try:
        with generate_drafts_from(oracle):
            out = target.generate(ids, assistant_model=drafter, num_assistant_tokens=2, **greedy)
            histogram = list(oracle.last_speculative_stats.verify_length_histogram)
            with pytest.raises(ValueError, match="num_assistant_tokens must be an integer >= 0, got -1"):
                target.generate(ids, assistant_model=drafter, num_assistant_tokens=-1, **greedy)
            target.generate(ids, assistant_model=drafter, **greedy)
            uncapped = list(oracle.last_speculative_stats.verify_length_histogram)
            calls = oracle.calls
            none = target.generate(ids, assistant_model=drafter, num_assistant_tokens=0, **greedy)
            plain_steps = list(oracle.last_speculative_stats.verify_length_histogram)
    finally:
        del drafter.verify_policy
    assert torch.equal(out, expected)
    assert histogram[2] > 0 and sum(histogram[3:]) == 0, histogram
    assert uncapped[4] > 0, uncapped  # without the setting the forced 4 drafts are verified
    # 0: plain steps only, and the head is not even asked to draft
    assert torch.equal(none, expected) and sum(plain_steps[1:]) == 0 < plain_steps[0] and oracle.calls == calls


def test_calls_under_other_logits_processors_calibrate_apart():
    """A repetition penalty rejects the repeats a call without it accepts: the next call carries over the
    calibration of the last call with the same processors only, on both paths' key."""
    from hf_dflash2 import speculative_generate
    from hf_dflash2.cost_model_dflash2 import _LAST_POLICY, verify_policy_for

    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    first = verify_policy_for(target, drafter, 1, 5, cost_model=cost, settings_key=("penalty",))
    first.observe(torch.ones(1, 4), 4, torch.zeros(1, dtype=torch.long))
    assert verify_policy_for(target, drafter, 1, 5, cost_model=cost).predicted is None
    assert verify_policy_for(target, drafter, 1, 5, cost_model=cost, settings_key=("penalty",)).predicted is not None

    ids = torch.tensor([[3, 4, 5, 3, 4]])
    for settings in ({}, {"repetition_penalty": 1.3}, {}):
        speculative_generate(target, drafter, ids, max_new_tokens=6, cost_model=cost, block_size=5, **settings)
    keys = [key for key, entry in _LAST_POLICY.items() if entry[0]() is target and entry[1]() is drafter
            and key[2] == 1 and key[3] == 5 and len(key[6]) == 3]  # the fast loop's keys
    assert len(keys) == 2  # one per setting, the two plain calls sharing theirs


def test_rounds_at_the_end_of_the_token_budget_leave_the_back_off_alone():
    """A round whose drafts the token budget left no room for (k capped to 0 after the host read) says nothing
    of the draft: it must not back the policy off (the next call inherits its back-off). Knowing there is no
    room, the policy asks for neither a draft pass nor an n-gram draft."""
    from hf_dflash2.cost_model_dflash2 import _LAST_POLICY

    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.5)
    policy = AdaptiveVerifyPolicy(cost, clock=None).start(5)
    policy.room = 3  # an upper bound before the round
    assert policy.wants_draft()
    assert int(policy.choose(torch.full((1, 4), 0.9))) > 0
    policy.room = 0  # the host read: no row has room, k capped to 0
    policy.chosen(0)
    assert policy.skip == policy.to_skip == 0
    assert not policy.wants_draft() and not policy.wants_ngram()
    policy.room = 4  # a weak draft with the whole block in reach: back off
    assert policy.wants_draft()
    policy.chosen(int(policy.choose(torch.full((1, 4), 0.05))))
    assert policy.skip >= policy.min_skip and policy.to_skip == policy.skip

    # End to end: an always-right drafter fills a block of 5 per round, so a budget of 7 leaves the second
    # round no room; the policy the next call inherits has not backed off.
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    alone = plain(target, ids, 7)[0, 6:]
    oracle = OracleDrafter(drafter, alone[None], torch.tensor([6]), corrupt_every=10**9)
    out = speculative_generate(target, oracle, ids, max_new_tokens=7, cost_model=CostModel([1.0] * 5, 0.01),
                               ngram_size=0, draft_tree=False)
    assert torch.equal(out.sequences[0, 6:], alone) and out.stats.verify_length_histogram[4] == 1
    carried = [entry[2] for entry in _LAST_POLICY.values() if entry[1]() is oracle]
    assert len(carried) == 1 and carried[0].skip == carried[0].to_skip == 0


@pytest.mark.parametrize("draft_tree", [True, False])
def test_no_draft_pass_when_no_row_has_room_and_trees_stay_greedy_near_the_budget(draft_tree):
    """With 2 new tokens the only round after the first token can commit no draft: the default policy runs
    no draft pass at all. Budgets ending inside a block keep the text plain greedy's, trees or chains."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.randint(2, 64, (1, 6), generator=torch.Generator().manual_seed(8))
    alone = plain(target, ids, 12)[0, 6:]
    cost = CostModel([1.0] * 5, 0.01)
    for budget in (2, 3, 7, 9, 12):
        oracle = OracleDrafter(drafter, alone[None], torch.tensor([6]), corrupt_every=4)
        out = speculative_generate(target, oracle, ids, max_new_tokens=budget, cost_model=cost, ngram_size=0,
                                   draft_tree=draft_tree)
        assert torch.equal(out.sequences[0, 6:], alone[:budget]), budget
        if budget == 2:
            assert oracle.calls == 0 and out.stats.verify_length_histogram[0] == out.stats.rounds == 1


def test_the_drafters_context_is_projected_once_when_a_draft_reads_it():
    """Rounds of plain steps add no drafter work: appended features wait until a draft pass reads ``kv``, then
    every pending slot is projected in one call, a cropped (rejected) tail never is, and the K/V equal those of
    projecting each round's kept slots as it came."""
    from hf_dflash2.speculative_dflash2 import DraftContext

    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=4)
    features_size = len(drafter.config.target_layer_ids) * target.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    rounds = [torch.randn(2, width, features_size, generator=generator) for width in (5, 1, 3, 1, 2)]
    calls = []
    project = drafter.project_context
    drafter.project_context = lambda features: calls.append(features.shape[1]) or project(features)
    context = DraftContext(drafter, 2, 8, "cpu")
    kept, position = [], 0
    for index, features in enumerate(rounds):
        width = features.shape[1]
        context.append(features, torch.arange(position, position + width).expand(2, -1))
        position += width
        if index == 2:  # the verify's last two slots were rejected
            context.crop(2)
            position -= 2
            features = features[:, :1]
        kept.append(features)
    assert calls == []  # plain steps: nothing projected yet
    lazy = context.kv
    assert calls == [position] and context.length == position == 10
    assert context.kv is not None and calls == [position]  # read again: nothing more to project
    eager = drafter.context_kv(project(torch.cat(kept, dim=1)), torch.arange(position).expand(2, -1))
    for (k, v), (k_ref, v_ref) in zip(lazy, eager):
        torch.testing.assert_close(k, k_ref)
        torch.testing.assert_close(v, v_ref)
    context.crop(3)  # a crop of projected slots, then new ones: only the new ones are projected
    context.append(rounds[0][:, :2], torch.arange(7, 9).expand(2, -1))
    assert context.kv[0][0].shape[2] == 9 and calls == [position, 2]


def test_ngram_rounds_are_timed_apart_from_the_rounds_the_head_drafted():
    """A round the head drafted may run far over the cost model while n-gram rounds run as predicted. Pooled,
    the one ratio called n-gram rounds dear; apart, a sure n-gram match is still verified."""
    cost = CostModel([1.0, 1.2, 1.4, 1.6, 1.8], 0.2)
    clock = FakeClock()
    policy = AdaptiveVerifyPolicy(cost, clock=clock, prior_strength=1e-6, pooled_prior=1e6, prior_ratio=1.0,
                                  probe_overhead=1.0).start(5)
    kinds = ["step"] * 4 + ["draft", "ngram"] * 6
    for kind in ["step"] + kinds:  # the first round is not timed
        policy.wants_draft()
        if kind == "step":
            clock.now += 1.0
            continue
        policy._head_drafted, policy._paid = kind == "draft", torch.tensor(True)
        policy.chosen(1)
        clock.now += 3.0 * (1.2 + 0.2) if kind == "draft" else 1.2  # three times the prediction, or as predicted
    policy.wants_draft()
    assert policy.cost_ratio("draft") > 2.5  # each kind's median, shrunk a little towards all rounds'
    assert policy.cost_ratio("ngram") < 1.1
    pooled = statistics.median([*policy.timed["draft"], *policy.timed["ngram"]])
    # one row, an n-gram match as sure as the head's calibration makes it: 0.5 a token, 1.5 tokens for 1.2 steps
    match = torch.tensor([[0.5, 0.0, 0.0, 0.0]])
    assert 1.5 / (1.2 * pooled) < 1.0 < 1.5 / 1.2 / (1 + policy.pay_margin)
    assert int(policy.choose(match, torch.tensor([1]), drafted=False)) == 1


@pytest.mark.parametrize("margin", [0.0, 0.05])
def test_near_break_even_drafts_go_to_the_plain_step(margin):
    """An n-gram round expected to commit 3 % faster than plain steps is verified only without a margin."""
    cost = CostModel([1.0, 1.2, 1.4, 1.6, 1.8], 0.2)
    policy = AdaptiveVerifyPolicy(cost, clock=None, prior_strength=1e-6, pooled_prior=1e6, prior_ratio=1.0,
                                  pay_margin=margin).start(5)
    match = torch.tensor([[0.236, 0.0, 0.0, 0.0]])  # 1.236 tokens for 1.2 steps: 1.03 times a plain step's rate
    k = int(policy.choose(match, torch.tensor([1]), drafted=False))
    assert k == (1 if margin == 0.0 else 0)


def test_the_ngram_lookup_backs_off_while_matches_alone_do_not_pay():
    cost = CostModel([1.0, 1.2, 1.4, 1.6, 1.8], 0.2)
    policy = AdaptiveVerifyPolicy(cost, clock=None, ngram_backoff=4).start(5)

    def ngram_round(paid):
        policy._head_drafted, policy._paid = False, torch.tensor(paid)
        policy.chosen(1 if paid else 0)

    assert policy.wants_ngram()
    gaps = []
    for _ in range(4):
        ngram_round(False)
        skipped = 0
        while not policy.wants_ngram():
            skipped += 1
        gaps.append(skipped)
    assert gaps == [1, 2, 4, 4]  # doubling, capped at ngram_backoff
    ngram_round(True)
    ngram_round(False)
    assert [policy.wants_ngram() for _ in range(2)] == [False, True]  # a match that paid reset it: 1, not 4
    # An n-gram that wins a round the head drafted ends a pending lookup back-off: the next rounds skip the draft
    # pass for the n-gram (ngram_streak), so they must look it up.
    for _ in range(3):
        ngram_round(False)
    policy._head_drafted, policy._paid = True, torch.tensor(True)
    policy.chosen(2, head_used=False)
    assert not policy.wants_draft() and policy.wants_ngram()


def test_rounds_without_a_draft_pass_look_up_ngrams_only_when_the_policy_may_verify_one(monkeypatch):
    import hf_dflash2.speculative_dflash2 as speculative

    class NeverNgram(AdaptiveVerifyPolicy):
        def wants_draft(self):
            return False

        def wants_ngram(self):
            return False

    class NgramOnly(AdaptiveVerifyPolicy):
        def wants_draft(self):
            return False

    lookups = []
    original = speculative.ngram_draft
    monkeypatch.setattr(speculative, "ngram_draft", lambda *a, **k: lookups.append(1) or original(*a, **k))
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    ids = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    cost = CostModel([1.0, 1.1, 1.2, 1.3, 1.4], 0.1)
    out = speculative_generate(target, drafter, ids, max_new_tokens=12, verify_policy=NeverNgram(cost, clock=None))
    assert torch.equal(out.sequences, plain(target, ids, 12)) and not lookups
    speculative_generate(target, drafter, ids, max_new_tokens=12, verify_policy=NgramOnly(cost, clock=None))
    assert lookups  # without a draft pass, a policy that may verify a match alone does look up
