"""Two-branch draft trees (``draft_tree``): acceptance against a plain-Python walk, the mask, the caches
after moving the path to the front, greedy identity with forced tree plans, and the policy's plan."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_dflash2 import generation, speculative_generate
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, VerifyPolicy
from hf_dflash2.draft_tree import (
    accept_tree,
    build_tree,
    common_prefix,
    gather_path,
    move_path_to_front,
    path_out_of_place,
    supports_trees,
    tree_attention_mask,
)
from hf_dflash2.generation import prefill, verify

from .conftest import tiny_drafter, tiny_target
from .test_ngram import _left_padded


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path_factory.getbasetemp() / "cost_models"))


def walk(drafts: list[int], argmax_along: list[int]) -> int:
    """Accepted drafts of one branch: argmax_along[i] is the target's token after the branch's first i."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == argmax_along[accepted]:
        accepted += 1
    return accepted


def test_accept_tree_equals_walking_each_branch():
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(90):
        n, vocab = 4, 3 + trial % 3  # a small vocabulary, so that drafts often match
        kh, kg, ka = trial % 5, (trial // 5) % 7, trial % 3
        head = torch.randint(0, vocab, (n, 7), generator=generator)
        ngram = torch.randint(0, vocab, (n, 9), generator=generator)
        # runner-ups differ from both first tokens, as ``runner_up_tokens`` makes them
        runner_ups = torch.stack([torch.tensor([t for t in range(vocab) if t not in (int(head[r, 0]), int(ngram[r, 0]))]
                                               [:1] * 2) for r in range(n)])
        shared = int(common_prefix(head[:, :kh], ngram[:, :kh]).min()) if trial % 2 else 0
        c = min(shared, kh, kg)
        if kg <= c and ka == 0:
            continue
        tree = build_tree(head, kh, ngram, kg, shared, runner_ups, ka)
        logits = torch.randn(n, tree.width, vocab, generator=generator)
        result = accept_tree(tree, logits)
        argmax = logits.argmax(-1)
        ngram_end = kh + 1 + kg - c
        out_of_place = []
        for r in range(n):
            head_slots = list(range(kh + 1))  # slot of the head branch's i-th draft is i
            ngram_slots = list(range(c + 1)) + list(range(kh + 1, ngram_end))  # the n-gram's i-th: shared, then its own
            a_head = walk(head[r, :kh].tolist(), [int(argmax[r, s]) for s in head_slots])
            ngram_drafts = head[r, :c].tolist() + ngram[r, c:kg].tolist()
            a_ngram = walk(ngram_drafts, [int(argmax[r, s]) for s in ngram_slots])
            a_runner = [int(runner_ups[r, i]) == int(argmax[r, 0]) for i in range(ka)]
            assert int(result.head_accepted[r]) == a_head, (trial, r)
            assert int(result.ngram_accepted[r]) == a_ngram, (trial, r)
            assert result.alternative_accepted[r].tolist() == a_runner, (trial, r)
            candidates = [(a_head, 0, head_slots), (a_ngram, 1, ngram_slots)]
            candidates += [(1, 2, [0, ngram_end + i]) for i in range(ka) if a_runner[i]]
            accepted, winner, slots = max(candidates, key=lambda c: c[0])  # ties: the first (the head)
            assert int(result.accepted[r]) == accepted and int(result.winner[r]) == winner, (trial, r)
            assert result.order[r, : accepted + 1].tolist() == slots[: accepted + 1], (trial, r)
            assert result.tokens[r, : accepted + 1].tolist() == [int(argmax[r, s]) for s in slots[: accepted + 1]]
            out_of_place.append(slots[: accepted + 1] != list(range(accepted + 1)))
            checked += 1
        assert bool(path_out_of_place(result.order, result.accepted)) == any(out_of_place), trial
    assert checked > 200


def test_tree_mask_shows_each_slot_its_own_branch():
    head, ngram = torch.tensor([[5, 6, 7]]), torch.tensor([[5, 9, 9, 9]])
    tree = build_tree(head, 3, ngram, 4, shared=1)  # slots: anchor, 5 6 7, then 9 9 9 hanging from "5"
    assert tree.tokens.tolist() == [[5, 6, 7, 9, 9, 9]] and tree.depth.tolist() == [0, 1, 2, 3, 2, 3, 4]
    valid = torch.tensor([[False, True, True] + [True] * tree.width])
    mask = tree_attention_mask(valid, tree, "sdpa", torch.float32)
    assert mask.shape == (1, 1, 7, 10) and mask.dtype == torch.bool
    assert not mask[0, 0, :, 0].any() and mask[0, 0, :, 1:3].all()  # the context's hole stays hidden
    # the first "9": the anchor, "5" and itself
    assert mask[0, 0, 4, 3:].tolist() == [True, True, False, False, True, False, False]
    assert mask[0, 0, 3, 3:].tolist() == [True, True, True, True, False, False, False]  # "7": the head's chain
    additive = tree_attention_mask(valid, tree, "eager", torch.float32)
    assert torch.equal(additive == 0, mask)


def test_cache_after_a_tree_equals_a_linear_verify_of_the_accepted_path():
    target = tiny_target(vocab_size=48)
    drafter = tiny_drafter(target, block_size=5)
    layer_ids = drafter.config.target_layer_ids
    prompt = torch.randint(2, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    cache, context, last = prefill(target, drafter, prompt, mask, 64)
    anchor, anchor_pos = last.argmax(-1), torch.full((2,), 9)
    # Drafts that follow the target for a while: row 0 on the n-gram branch, row 1 on the head's.
    truth = [anchor]
    ref_cache = DynamicCache(config=target.config)
    ids = torch.cat([prompt, anchor[:, None]], 1)
    for _ in range(6):
        out = target(ids)
        truth.append(out.logits[:, -1].argmax(-1))
        ids = torch.cat([ids, truth[-1][:, None]], 1)
    follow = torch.stack(truth[1:], 1)  # [2, 6] the target's next tokens
    head = follow.clone()
    ngram = follow.clone()
    head[0, 1:] = (follow[0, 1:] + 1) % 48  # row 0: the head is wrong after one token
    ngram[1, 2:] = (follow[1, 2:] + 1) % 48  # row 1: the n-gram is wrong after two
    head[1, 4:] = (follow[1, 4:] + 1) % 48
    tree = build_tree(head, 5, ngram, 6, int(common_prefix(head, ngram).min()))
    logits, features = verify(target, layer_ids, cache, context, torch.cat([anchor[:, None], tree.tokens], 1),
                              anchor_pos[:, None] + tree.depth[None], tree)
    result = accept_tree(tree, logits)
    assert result.accepted.tolist() == [6, 4] and result.winner.tolist() == [1, 0]
    assert bool(path_out_of_place(result.order, result.accepted))  # row 0's path is the n-gram branch
    move_path_to_front(cache, result.order)
    moved = gather_path(features, result.order)
    # The reference: a linear verify of the path (anchor + accepted drafts) on a fresh prefill.
    ref_cache, ref_context, _ = prefill(target, drafter, prompt, mask, 64)
    path = torch.cat([anchor[:, None], result.tokens[:, :4]], 1)  # both rows accepted >= 4
    _, ref_features = verify(target, layer_ids, ref_cache, ref_context, path, anchor_pos[:, None] + torch.arange(5))
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        start = ref_layer.keys.shape[2] - 5
        torch.testing.assert_close(layer.keys[:, :, start : start + 5], ref_layer.keys[:, :, start:])
        torch.testing.assert_close(layer.values[:, :, start : start + 5], ref_layer.values[:, :, start:])
    torch.testing.assert_close(moved[:, :5], ref_features)
    assert torch.equal(result.tokens[:, :4], follow[:, :4])
    del ref_cache


class ForcedTrees(VerifyPolicy):
    """Tree plans (kh, kg) cycled round by round (tests)."""

    plans_trees = True

    def __init__(self, plans):
        self.plans = plans

    def start(self, block_size):
        self.round = 0
        return super().start(block_size)

    def choose_tree(self, head_confidence, ngram_size, shared, alternative_probs=None):
        kh, kg, ka = self.plans[self.round % len(self.plans)]
        self.round += 1
        kh = min(kh, self.block_size - 1)
        ka = min(ka, self.block_size - 1 - kh)
        kg = min(kg, self.block_size - 1 - kh - ka + min(int(shared.min()), kh, kg))  # the tree fits the block
        return torch.tensor([kh, kg, ka])


@pytest.mark.parametrize("plans", [[(3, 4, 0)], [(2, 6, 1), (0, 5, 0), (4, 0, 0), (0, 0, 0), (1, 1, 3), (0, 0, 2)],
                                   [(4, 9, 2)], [(3, 0, 3)]])
def test_forced_tree_rounds_keep_greedy_identity(plans, monkeypatch):
    """Batch 3, left padded, prompts that repeat so n-gram drafts exist; plans (kh, kg, ka) include a
    linear n-gram round (0, kg, 0), a linear head round (kh, 0, 0), a plain step, runner-ups alone and
    trees whose chains share a prefix. Paths off the head's chain are moved in the cache (counted)."""
    moves = []
    monkeypatch.setattr(generation, "move_path_to_front", lambda cache, order: moves.append(
        move_path_to_front(cache, order)))
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    generator = torch.Generator().manual_seed(3)
    spans = [torch.randint(2, 64, (n,), generator=generator) for n in (4, 3, 5)]
    prompts = [torch.cat([s, s, s[:2]]) for s in spans]
    ids, mask = _left_padded(prompts)
    out = speculative_generate(target, drafter, ids, mask, max_new_tokens=40, verify_policy=ForcedTrees(plans),
                               block_size=12)
    assert out.stats.tree_rounds > 0
    assert 0 < len(moves) < out.stats.tree_rounds  # some paths moved, and not those already in front
    for row, prompt in enumerate(prompts):
        reference = target.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=40, do_sample=False)
        assert out.sequences[row, ids.shape[1] : ids.shape[1] + 40].tolist() == reference[0, len(prompt):].tolist()


def test_trees_only_where_they_are_exact():
    """Sampling, ``draft_tree=False`` and a sliding-window target keep linear rounds; without n-gram drafts
    a tree holds the head's chain and its runner-ups."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    forced = dict(verify_policy=ForcedTrees([(3, 4, 1)]), block_size=12, max_new_tokens=24)
    assert speculative_generate(target, drafter, prompt, **forced).stats.tree_rounds > 0
    assert speculative_generate(target, drafter, prompt, draft_tree=False, **forced).stats.tree_rounds == 0
    assert speculative_generate(target, drafter, prompt, ngram_size=0, **forced).stats.tree_rounds > 0
    sampled = speculative_generate(target, drafter, prompt, do_sample=True, generator=torch.Generator().manual_seed(0),
                                   **forced)
    assert sampled.stats.tree_rounds == 0
    gemma = tiny_target("gemma3", vocab_size=64)
    assert not supports_trees(gemma, DynamicCache(config=gemma.config))
    gemma_drafter = tiny_drafter(gemma, block_size=5)
    out = speculative_generate(gemma, gemma_drafter, prompt, **forced)
    assert out.stats.tree_rounds == 0
    reference = gemma.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences, reference)


def _cost(verify_steps, draft=0.1):
    return CostModel(verify_seconds=[0.05 * v for v in verify_steps], draft_seconds=0.05 * draft)


def test_policy_plans_both_branches_only_when_verifying_is_cheap():
    flat = _cost([1.0] + [1.1] * 15)  # a verify of 16 costs 1.1 steps: checking both branches is cheap
    steep = _cost([1.0 + 1.0 * k for k in range(16)])  # each verified token costs a step more
    head_confidence = torch.full((1, 15), 0.9)
    head_confidence[:, 7:] = 0.0  # the head drafts 7
    ngram_size, shared = torch.tensor([3]), torch.tensor([0])
    for cost, both in ((flat, True), (steep, False)):
        policy = AdaptiveVerifyPolicy(cost, clock=None, prior_ratio=0.7).start(16)
        kh, kg, ka = policy.choose_tree(head_confidence, ngram_size, shared).tolist()
        assert (kh > 0 and kg > 0) == both and ka == 0, (kh, kg, ka)
        assert kh + kg <= 15
    # A head whose drafts never pass, calibrated so: the plan drops its branch.
    policy = AdaptiveVerifyPolicy(flat, clock=None).start(16)
    for _ in range(30):
        policy.choose_tree(head_confidence, ngram_size, shared)
        policy.observe(head_confidence, 7, torch.tensor([0]), torch.tensor([0]))
        policy.observe(torch.ones(1, 15), 8, torch.tensor([6]), ngram_size)
    kh, kg, _ = policy.choose_tree(head_confidence, ngram_size, shared).tolist()
    assert kh == 0 and kg >= 6
    # Drafts that agree on their first 4 tokens share those slots: a plan of (7, 9) then costs 12 drafts.
    policy = AdaptiveVerifyPolicy(flat, clock=None, prior_ratio=0.7).start(16)
    kh, kg, _ = policy.choose_tree(head_confidence, ngram_size, torch.tensor([4])).tolist()
    assert kh + kg - min(4, kh, kg) <= 15 and kh > 0 and kg > 4


def test_policy_verifies_runner_ups_that_pay_and_learns_when_they_do_not():
    flat = _cost([1.0] + [1.05 + 0.01 * k for k in range(15)])  # each slot costs 1 % of a step
    head_confidence = torch.full((1, 15), 0.5)
    head_confidence[:, 7:] = 0.0
    none, shared = torch.tensor([0]), torch.tensor([0])
    likely = torch.tensor([[0.3, 0.2, 0.1]])
    policy = AdaptiveVerifyPolicy(flat, clock=None, prior_ratio=0.7).start(16)
    assert policy.choose_tree(head_confidence, none, shared, likely).tolist()[2] == 3
    for _ in range(40):  # runner-ups that are never right
        policy.observe_runner_ups(likely, torch.zeros(1, 3, dtype=torch.bool))
    assert policy.choose_tree(head_confidence, none, shared, likely).tolist()[2] == 0
