"""Draft trees (``generation/trees.py``): best-first ranking against a heap walk, acceptance against walking each
slot's path in plain Python, the mask, the caches after moving the path to the front, greedy identity
with forced tree plans, and the policy's plan."""

from __future__ import annotations

import heapq

import pytest
import torch
from transformers import DynamicCache

from hf_dflash2 import speculative_generate
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, VerifyPolicy
from hf_dflash2.generation import loop, prefill, verify
from hf_dflash2.generation.sampling import Sampler
from hf_dflash2.generation.trees import (
    HeadNodes,
    accept_tree,
    best_first,
    build_tree,
    gather_path,
    move_path_to_front,
    path_out_of_place,
    rank_continuations,
    spelling,
    supports_trees,
    tree_attention_mask,
)

from .conftest import tiny_drafter, tiny_target
from .test_generation import _sequence_law
from .test_ngram import _left_padded


@pytest.fixture(autouse=True)
def _cost_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("HF_DFLASH2_CACHE", str(tmp_path_factory.getbasetemp() / "cost_models"))


def heap_best_first(candidates, transitions, size):
    """Plain-Python best-first: [(path as tokens, probability)] of the ``size`` likeliest nodes."""
    s = len(candidates)
    frontier = [(-transitions[0][0][j], (j,)) for j in range(len(candidates[0]))]
    heapq.heapify(frontier)
    out = []
    while frontier and len(out) < size:
        neg, path = heapq.heappop(frontier)
        out.append((tuple(candidates[d][c] for d, c in enumerate(path)), -neg))
        if len(path) < s:
            for j, p in enumerate(transitions[len(path)][path[-1]]):
                heapq.heappush(frontier, (neg * p, path + (j,)))
    return out


def paths_of(nodes: HeadNodes, row: int) -> list[tuple[int, ...]]:
    paths = []
    for tok, parent in zip(nodes.tokens[row].tolist(), nodes.parent[row].tolist()):
        assert parent < len(paths)  # parents come first
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return paths


def test_best_first_ranks_like_a_heap_walk():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        n, s, k, size = 3, 2 + trial % 4, 2 + trial % 5, 1 + trial % 15
        candidates = torch.stack([torch.randperm(40, generator=generator)[:k] for _ in range(n * s)]).view(n, s, k)
        logp = torch.randn(n, s, k, k, generator=generator).log_softmax(-1)
        logp[:, 0] = logp[:, 0, :1]  # position 0: one distribution, after the anchor
        nodes = best_first(candidates, logp, size)
        for r in range(n):
            expected = heap_best_first(candidates[r].tolist(), logp[r].exp().tolist(), size)
            assert paths_of(nodes, r) == [path for path, _ in expected], (trial, r)
            torch.testing.assert_close(nodes.logp[r].exp(), torch.tensor([p for _, p in expected]))
            assert nodes.depth[r].tolist() == [len(path) for path, _ in expected]


def test_selector_steps_are_weighed_by_the_unary_mass_of_their_candidates():
    """Depth 2's two candidates hold 5 % of its unary mass (the rest is spread outside them): with the
    weighting, depth 1's runner-up (p = 0.2) outranks the depth-2 node under the best first token
    (0.8 x 0.99 within the candidates, but x 0.05 of the mass); without it, the deep node ranks second.
    Either way the nodes carry the selector's own path probabilities."""
    from hf_dflash2.modeling_dflash2 import DraftOutput

    vocab = 50
    logits = torch.full((1, 2, vocab), -30.0)
    logits[0, 0, :2] = torch.tensor([4.0, 3.0])  # depth 1: the two candidates hold ~all of the mass
    logits[0, 1, 2:] = 0.0  # depth 2: 48 tokens at equal weight ...
    logits[0, 1, :2] = torch.tensor([0.55, 0.45]).log() + torch.tensor(48 * 0.05 / 0.95).log()  # ... 5 % on these
    q_ids = logits.topk(2, dim=-1).indices  # [1, 2, K = 2]
    pair = torch.zeros(1, 2, 2, 2)
    pair[0, 0, :, 0] = torch.tensor(0.8 / 0.2).log()  # the selector: 0.8 / 0.2 after the anchor
    pair[0, 1, :, 0] = torch.tensor(0.99 / 0.01).log()  # then 0.99 / 0.01, whatever came first
    draft = DraftOutput(tokens=q_ids[..., 0], q_ids=q_ids, q_probs=None, logits=logits, hidden=torch.zeros(1, 2, 4),
                        pair_scores=pair)
    weighed = rank_continuations(None, draft, 3)
    plain = rank_continuations(None, draft, 3, top_k_mass=False)
    ids = q_ids[0].tolist()
    first, runner_up, deep = (ids[0][0],), (ids[0][1],), (ids[0][0], ids[1][0])
    assert paths_of(plain, 0) == [first, deep, runner_up]
    assert paths_of(weighed, 0) == [first, runner_up, deep]
    # the planner still sees the selector's own path probabilities (its calibration is fitted to them)
    torch.testing.assert_close(weighed.logp[0].exp(), torch.tensor([0.8, 0.2, 0.8 * 0.99]), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(plain.logp[0].exp(), torch.tensor([0.8, 0.8 * 0.99, 0.2]), rtol=1e-3, atol=1e-4)


def test_candidate_mass_from_the_selectors_logits_equals_the_full_computation():
    """The mass a dFlash 2 draft's K candidates hold, from their own unary logits (one pass over the
    vocabulary), equals the log of their summed softmax probabilities; also where a processor has masked
    tokens to -inf, the top candidate's among them at one position."""
    from hf_dflash2.generation.trees import candidate_log_mass
    from hf_dflash2.modeling_dflash2 import DraftOutput

    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(2, 3, 300, generator=generator)
    logits[0, 1, ::2] = -torch.inf
    logits[1, 2, logits[1, 2].argmax()] = -torch.inf
    unary, q_ids = logits.topk(16, dim=-1)
    expected = logits.softmax(-1).gather(-1, q_ids).sum(-1).log()
    draft = DraftOutput(tokens=q_ids[..., 0], q_ids=q_ids, q_probs=None, logits=logits, hidden=torch.zeros(2, 3, 4))
    without = candidate_log_mass(draft)
    draft.candidate_logits = unary
    with_logits = candidate_log_mass(draft)
    torch.testing.assert_close(with_logits, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(without, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(with_logits).all()


def random_tree(generator, n, vocab, m, kg, s=4, k=3):
    candidates = torch.randint(0, vocab, (n, s, k), generator=generator)
    logp = torch.randn(n, s, k, k, generator=generator).log_softmax(-1)
    nodes = best_first(candidates, logp, 12)
    chain = torch.randint(0, vocab, (n, s), generator=generator)
    ngram = torch.randint(0, vocab, (n, 9), generator=generator)
    # some rows' n-gram and chain start like a ranked node, so they hang deeper
    first = nodes.tokens[:, 0]
    ngram[::2, 0], chain[1::2, 0] = first[::2], first[1::2]
    nodes_of[0] = nodes
    return build_tree(nodes, m, chain, ngram if kg else None, kg), chain, ngram


nodes_of = [None]  # the last random_tree's ranked nodes


def test_accept_tree_equals_walking_each_path():
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(60):
        n, vocab = 4, 2 + trial % 3  # a small vocabulary, so that drafts often match
        m, kg = 1 + trial % 7, (trial // 7) % 5
        tree, chain, ngram = random_tree(generator, n, vocab, m, kg)
        logits = torch.randn(n, tree.width, vocab, generator=generator)
        result = accept_tree(tree, logits.argmax(-1))
        argmax = logits.argmax(-1)
        out_of_place = []
        for r in range(n):
            parent, tokens = tree.parent[r].tolist(), [None] + tree.tokens[r].tolist()
            paths = [[0]]
            for slot in range(1, tree.width):
                assert parent[slot] < slot
                paths.append(paths[parent[slot]] + [slot])
            ok = [all(tokens[t] == int(argmax[r, parent[t]]) for t in path[1:]) for path in paths]
            depth = [len(path) - 1 for path in paths]
            assert tree.depth[r].tolist() == depth
            best = max(range(tree.width), key=lambda t: (ok[t] * depth[t], -t))
            assert int(result.accepted[r]) == depth[best], (trial, r)
            assert result.order[r, : depth[best] + 1].tolist() == paths[best], (trial, r)
            assert result.tokens[r, : depth[best] + 1].tolist() == [int(argmax[r, t]) for t in paths[best]]
            assert result.node_accepted[r].tolist() == ok[1 : m + 1]
            assert int(result.winner[r]) == int(best > m)
            # the n-gram chain spells the n-gram draft from the root, and hangs from the deepest such node
            if kg:
                last = paths[-1]
                assert [tokens[t] for t in last[1:]] == ngram[r, : len(last) - 1].tolist()
                assert int(result.ngram_verified[r]) == len(last) - 1
                assert int(result.ngram_accepted[r]) == max(depth[t] * ok[t] for t in last)
            ngram_paths = [[tokens[t] for t in paths[t][1:]] == ngram[r, : depth[t]].tolist() for t in range(m + 1)]
            assert spelling(nodes_of[0], ngram)[r, :m].tolist() == ngram_paths[1:]
            if kg:  # the chain hangs from the deepest head node spelling the n-gram (the first such)
                spelled = [t for t in range(m + 1) if ngram_paths[t]]
                assert int(tree.ngram_attach[r]) == max(spelled, key=lambda t: (depth[t], -t))
            greedy = paths[int(tree.greedy_slot[r])]
            assert [tokens[t] for t in greedy[1:]] == chain[r, : len(greedy) - 1].tolist()
            assert not any(len(paths[t]) > len(greedy) and [tokens[u] for u in paths[t][1:]]
                           == chain[r, : len(paths[t]) - 1].tolist() for t in range(1, m + 1))
            assert int(result.greedy_accepted[r]) == max(depth[t] * ok[t] for t in greedy)
            out_of_place.append(paths[best] != list(range(depth[best] + 1)))
            checked += 1
        assert bool(path_out_of_place(result.order, result.accepted)) == any(out_of_place), trial
    assert checked == 240


def manual_nodes(paths: list[tuple[int, ...]]) -> HeadNodes:
    """HeadNodes of one row from token paths listed parents first."""
    parent = [paths.index(p[:-1]) if len(p) > 1 else -1 for p in paths]
    return HeadNodes(torch.tensor([[p[-1] for p in paths]]), torch.tensor([[len(p) for p in paths]]),
                     torch.zeros(1, len(paths)), torch.tensor([parent]))


def test_tree_mask_shows_each_slot_its_own_branch():
    nodes = manual_nodes([(5,), (5, 6), (8,), (5, 6, 7)])
    ngram = torch.tensor([[5, 9, 9, 9]])
    tree = build_tree(nodes, 4, torch.tensor([[5, 6, 7]]), ngram, 3)  # the n-gram hangs from "5"
    assert tree.tokens.tolist() == [[5, 6, 8, 7, 9, 9, 9]] and tree.depth.tolist() == [[0, 1, 2, 1, 3, 2, 3, 4]]
    assert tree.parent.tolist() == [[0, 0, 1, 0, 2, 1, 5, 6]] and tree.greedy_slot.tolist() == [4]
    valid = torch.tensor([[False, True, True] + [True] * tree.width])
    mask = tree_attention_mask(valid, tree, "sdpa", torch.float32)
    assert mask.shape == (1, 1, 8, 11) and mask.dtype == torch.bool
    assert not mask[0, 0, :, 0].any() and mask[0, 0, :, 1:3].all()  # the context's hole stays hidden
    # the first "9": the anchor, "5" and itself
    assert mask[0, 0, 5, 3:].tolist() == [True, True, False, False, False, True, False, False]
    assert mask[0, 0, 4, 3:].tolist() == [True, True, True, False, True, False, False, False]  # "7"
    additive = tree_attention_mask(valid, tree, "eager", torch.float32)
    assert torch.equal(additive == 0, mask)


def test_tree_round_leaves_the_caches_of_a_linear_verify_of_its_path():
    target = tiny_target(vocab_size=48)
    drafter = tiny_drafter(target, block_size=8)
    layer_ids = drafter.config.target_layer_ids
    prompt = torch.randint(2, 48, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    cache, context, last = prefill(target, drafter, prompt, mask, 64)
    anchor, anchor_pos = last.argmax(-1), torch.full((2,), 9)
    truth = [anchor]
    ids = torch.cat([prompt, anchor[:, None]], 1)
    for _ in range(6):
        out = target(ids)
        truth.append(out.logits[:, -1].argmax(-1))
        ids = torch.cat([ids, truth[-1][:, None]], 1)
    follow = torch.stack(truth[1:], 1)  # [2, 6] the target's next tokens
    wrong = (follow + 1) % 48
    # Row 0: the head's likeliest node is wrong and its second-ranked is right for two tokens, then the
    # n-gram goes on. Row 1: the head's nodes are right for three tokens.
    rows = []
    for r in range(2):
        f, w = follow[r].tolist(), wrong[r].tolist()
        paths = [(w[0],), (f[0],), (f[0], f[1]), (w[0], w[1])] if r == 0 else \
            [(f[0],), (f[0], f[1]), (w[0],), (f[0], f[1], f[2])]
        rows.append(manual_nodes(paths))
    nodes = HeadNodes(*(torch.cat([getattr(x, name) for x in rows]) for name in ("tokens", "depth", "logp", "parent")))
    ngram = torch.stack([follow[0], torch.cat([wrong[1, :1], follow[1, 1:]])])
    tree = build_tree(nodes, 4, follow[:, :3], ngram, 4)
    logits, features = verify(target, layer_ids, cache, context, torch.cat([anchor[:, None], tree.tokens], 1),
                              anchor_pos[:, None] + tree.depth, tree)
    result = accept_tree(tree, logits.argmax(-1))
    assert result.accepted.tolist() == [6, 3] and result.winner.tolist() == [1, 0]
    assert bool(path_out_of_place(result.order, result.accepted))  # row 0's path is not slots 0..6
    move_path_to_front(cache, result.order)
    moved = gather_path(features, result.order)
    # The reference: a linear verify of the path (anchor + accepted drafts) on a fresh prefill.
    ref_cache, ref_context, _ = prefill(target, drafter, prompt, mask, 64)
    path = torch.cat([anchor[:, None], result.tokens[:, :3]], 1)  # both rows accepted >= 3
    _, ref_features = verify(target, layer_ids, ref_cache, ref_context, path, anchor_pos[:, None] + torch.arange(4))
    for layer, ref_layer in zip(cache.layers, ref_cache.layers):
        start = ref_layer.keys.shape[2] - 4
        torch.testing.assert_close(layer.keys[:, :, start : start + 4], ref_layer.keys[:, :, start:])
        torch.testing.assert_close(layer.values[:, :, start : start + 4], ref_layer.values[:, :, start:])
    torch.testing.assert_close(moved[:, :4], ref_features)
    assert torch.equal(result.tokens[:, :3], follow[:, :3])
    assert result.tokens[0, :6].tolist() == follow[0].tolist()


class ForcedTrees(VerifyPolicy):
    """Tree plans (m, kg) cycled round by round (tests)."""

    plans_trees = True

    def __init__(self, plans):
        self.plans = plans

    def start(self, block_size):
        self.round = 0
        return super().start(block_size)

    def choose_tree(self, node_logp, node_depth, ngram_size, spells_ngram):
        m, kg = self.plans[self.round % len(self.plans)]
        self.round += 1
        m = min(m, self.block_size - 1, node_logp.shape[1])
        kg = min(kg, self.block_size - 1 - m)  # the tree fits the block
        return torch.tensor([m, kg])


@pytest.mark.parametrize("plans", [[(3, 4)], [(2, 6), (0, 5), (4, 0), (0, 0), (1, 1), (9, 2)], [(7, 4)], [(11, 0)]])
def test_forced_tree_rounds_keep_greedy_identity(plans, monkeypatch):
    """Batch 3, left padded, prompts that repeat so n-gram drafts exist; plans (m, kg) include a linear
    n-gram round (0, kg), head nodes alone (m, 0), a plain step and trees with both. Paths that are not
    already in front are moved in the cache (counted)."""
    moves = []
    monkeypatch.setattr(loop, "move_path_to_front", lambda cache, order: moves.append(
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
    """``draft_tree=False`` and a sliding-window target keep linear rounds; without n-gram drafts
    a tree holds the head's nodes alone; a DFlash-1 head (no selector) ranks its nodes by unary scores."""
    target = tiny_target(vocab_size=64)
    drafter = tiny_drafter(target, block_size=5)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    forced = dict(verify_policy=ForcedTrees([(5, 4)]), block_size=12, max_new_tokens=24)
    assert speculative_generate(target, drafter, prompt, **forced).stats.tree_rounds > 0
    dflash1 = tiny_drafter(target, block_size=5, dflash2=False)
    out = speculative_generate(target, dflash1, prompt, **forced)
    assert out.stats.tree_rounds > 0
    assert torch.equal(out.sequences, target.generate(prompt, max_new_tokens=24, do_sample=False))
    assert speculative_generate(target, drafter, prompt, draft_tree=False, **forced).stats.tree_rounds == 0
    assert speculative_generate(target, drafter, prompt, ngram_size=0, **forced).stats.tree_rounds > 0
    sampled = speculative_generate(target, drafter, prompt, do_sample=True, generator=torch.Generator().manual_seed(0),
                                   **forced)
    assert sampled.stats.tree_rounds > 0  # sampling verifies trees too (its law: the tests below)
    gemma = tiny_target("gemma3", vocab_size=64)
    assert not supports_trees(gemma, DynamicCache(config=gemma.config))
    gemma_drafter = tiny_drafter(gemma, block_size=5)
    out = speculative_generate(gemma, gemma_drafter, prompt, **forced)
    assert out.stats.tree_rounds == 0
    reference = gemma.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(out.sequences, reference)


def _cost(verify_steps, draft=0.1):
    return CostModel(verify_seconds=[0.05 * v for v in verify_steps], draft_seconds=0.05 * draft)


def _nodes(probabilities, depths):
    return torch.tensor([probabilities]).log(), torch.tensor([depths])


def test_policy_plans_both_branches_only_when_verifying_is_cheap():
    flat = _cost([1.0] + [1.1] * 15)  # a verify of 16 costs 1.1 steps: checking both branches is cheap
    steep = _cost([1.0 + 1.0 * k for k in range(16)])  # each verified token costs a step more
    # a confident chain of 4, then a few unlikely alternatives
    logp, depth = _nodes([0.9, 0.8, 0.7, 0.6, 0.05, 0.04, 0.03], [1, 2, 3, 4, 1, 2, 1])
    ngram_size, shared = torch.tensor([3]), torch.zeros(1, 7, dtype=torch.bool)  # no node spells the n-gram
    for cost, both in ((flat, True), (steep, False)):
        policy = AdaptiveVerifyPolicy(cost, clock=None, prior_ratio=0.9).start(16)
        m, kg = policy.choose_tree(logp, depth, ngram_size, shared).tolist()
        assert (m > 0 and kg > 0) == both, (m, kg)
        assert m + kg <= 15 and m <= 7
    moderate = _cost([1.0 + 0.2 * k for k in range(16)])  # each verified token costs a fifth of a step
    policy = AdaptiveVerifyPolicy(moderate, clock=None, prior_ratio=0.9).start(16)
    m, _ = policy.choose_tree(logp, depth, torch.tensor([0]), shared).tolist()
    assert m == 4  # the likely chain, not the unlikely alternatives
    # A head whose nodes never pass, calibrated so: the plan drops them for the n-gram's chain.
    policy = AdaptiveVerifyPolicy(flat, clock=None).start(16)
    for _ in range(30):
        policy.choose_tree(logp, depth, ngram_size, shared)
        policy.observe_tree(logp, depth, torch.zeros(1, 7, dtype=torch.bool))
        policy.observe(torch.ones(1, 15), 8, torch.tensor([6]), ngram_size)
    m, kg = policy.choose_tree(logp, depth, ngram_size, shared).tolist()
    assert m == 0 and kg >= 6
    # ...and nodes that always pass, beyond what their probabilities say, are all verified.
    policy = AdaptiveVerifyPolicy(flat, clock=None).start(16)
    for _ in range(30):
        policy.observe_tree(logp, depth, torch.ones(1, 7, dtype=torch.bool))
    assert policy.choose_tree(logp, depth, torch.tensor([0]), shared).tolist() == [7, 0]


def test_policy_counts_a_shared_prefix_once_and_hangs_the_ngram_below_it():
    """The n-gram draft (right for 9 tokens) spells the head's first 2 nodes and then leaves its chain:
    the plan verifies the head's 4 likely nodes and hangs 7 n-gram drafts below depth 2 (reaching depth
    9), rather than the n-gram alone (9 drafts from the anchor) or the shared nodes twice."""
    flat = _cost([1.0] + [1.05 + 0.01 * k for k in range(15)])
    logp, depth = _nodes([0.9, 0.85, 0.8, 0.75, 0.02], [1, 2, 3, 4, 1])
    policy = AdaptiveVerifyPolicy(flat, clock=None, prior_ratio=0.9).start(16)
    for _ in range(20):
        policy.observe(torch.ones(1, 15), 10, torch.tensor([9]), torch.tensor([3]))
    spells = torch.tensor([[True, True, False, False, False]])
    m, kg = policy.choose_tree(logp, depth, torch.tensor([3]), spells).tolist()
    assert m == 4 and 6 <= kg <= 8, (m, kg)


def _sampled_sequences(target, drafter, prompt, runs, seed, plans, tokens=4):
    counts = torch.zeros(*(tokens * [target.config.vocab_size]))
    generator, tree_rounds, accepted = torch.Generator().manual_seed(seed), 0, 0
    for _ in range(runs // 5000):
        out = speculative_generate(target, drafter, prompt.repeat(5000, 1), max_new_tokens=tokens, do_sample=True,
                                   temperature=1.3, top_k=8, top_p=0.95, generator=generator,
                                   verify_policy=ForcedTrees(plans), block_size=8)
        t = out.sequences[:, prompt.shape[1]:prompt.shape[1] + tokens]
        counts.index_put_(tuple(t.T), torch.ones(len(t)), accumulate=True)
        tree_rounds, accepted = tree_rounds + out.stats.tree_rounds, accepted + out.stats.accepted
    return counts / counts.sum(), tree_rounds, accepted


def _pair_tvs(empirical, exact):
    """Total variation of the laws of tokens (1, 2), (2, 3), (3, 4), ...: each pair's marginal."""
    dims = range(empirical.dim())
    return [float(0.5 * (empirical.sum([d for d in dims if d not in (i, i + 1)])
                         - exact.sum([d for d in dims if d not in (i, i + 1)])).abs().sum())
            for i in range(empirical.dim() - 1)]


@pytest.mark.parametrize("plans", [[(3, 0)], [(2, 3), (0, 3), (4, 2), (1, 0)]])
def test_sampled_tree_rounds_keep_the_targets_law(plans):
    """20,000 sampled runs of four tokens through forced tree rounds (head nodes alone, and trees with the
    n-gram chain; the prompt holds every token so n-grams match): the laws of tokens (1, 2), (2, 3) and
    (3, 4) equal the target's, so the draws at depths 0, 1 and 2 of a tree (tokens 2, 3, 4 after the
    prefill's token 1) are exact. Bound as in test_generation's lossless test (< 0.05 over ~30-60 effective
    cells at 20,000 runs)."""
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5, 9, 2, 11, 4, 0, 6, 10, 8]])
    exact = _sequence_law(target, prompt, 4, 1.3, 8, 0.95)
    empirical, tree_rounds, accepted = _sampled_sequences(target, drafter, prompt, 20_000, 11, plans)
    assert tree_rounds > 0 and accepted > 0  # tokens 2 to 4 really came through trees' slots
    assert max(_pair_tvs(empirical, exact)) < 0.05, _pair_tvs(empirical, exact)


def test_the_tree_law_statistic_detects_one_draw_for_every_depth(monkeypatch):
    """Negative control: slots of all depths sharing one uniform draw (instead of one per depth) make the
    draws along a path dependent, and the statistics of tokens (2, 3) and (3, 4) above see it."""

    per_depth = Sampler.uniforms

    def one_draw(self, *shape, device=None):  # a tree's [N, W] uniforms: column 0 for every depth
        if len(shape) == 1:
            return per_depth(self, *shape, device=device)
        return per_depth(self, shape[0], 1, device=device).expand(*shape)

    monkeypatch.setattr(Sampler, "uniforms", one_draw)
    target = tiny_target(vocab_size=12, hidden_size=32, seed=3)
    drafter = tiny_drafter(target, block_size=4, selector_top_k=4, mask_token_id=1)
    prompt = torch.tensor([[3, 7, 1, 5, 9, 2, 11, 4, 0, 6, 10, 8]])
    exact = _sequence_law(target, prompt, 4, 1.3, 8, 0.95)
    empirical, _, _ = _sampled_sequences(target, drafter, prompt, 20_000, 11, [(3, 0)])
    assert max(_pair_tvs(empirical, exact)[1:]) > 0.08, _pair_tvs(empirical, exact)


def test_sampled_tree_picks_walk_the_accepted_path_only(monkeypatch):
    """Sampling picks the target's tokens down the tree one depth at a time (on a CPU): the accepted path and its
    tokens equal those of drawing at every slot at its depth's uniform (``pick_every_slot``, on a GPU), and the
    walk's draws number the deepest accepted depth plus one, not the tree's slots. Children spell their
    parent's likeliest tokens, so paths are accepted several deep."""
    from hf_dflash2.generation import sampling
    from hf_dflash2.generation.trees import DraftTree, ancestry_of

    parent = torch.tensor([0, 0, 0, 1, 1, 3, 5, 2]).expand(3, -1)  # slots 0..7, slot 0 the anchor
    depth = torch.tensor([0, 1, 1, 2, 2, 3, 4, 2]).expand(3, -1)
    draws, deepest = [], 0
    real_draw = sampling.draw
    monkeypatch.setattr(sampling, "draw", lambda *a: draws.append(1) or real_draw(*a))
    for seed in range(6):
        generator = torch.Generator().manual_seed(seed)
        logits = torch.randn(3, 8, 6, generator=generator)
        tokens = torch.randint(0, 6, (3, 7), generator=generator)
        favoured = tokens.new_zeros(3, 8).scatter_(1, parent[:, 1:], tokens)  # a child's token, per parent
        logits = logits + 4.0 * torch.nn.functional.one_hot(favoured, 6)
        tree = DraftTree(tokens, depth, parent, ancestry_of(parent), 7, 0, torch.zeros(3, dtype=torch.long),
                         torch.zeros(3, dtype=torch.long))
        sampler = Sampler(True, 1.0, None, None, torch.Generator().manual_seed(seed))
        draws.clear()
        walked = accept_tree(tree, sampler.pick_along_tree(logits, tree))
        walk_draws = len(draws)
        every_slot = accept_tree(tree, Sampler(True, 1.0, None, None, torch.Generator().manual_seed(seed))
                                 .pick_every_slot(logits, tree))  # what a GPU draws
        assert torch.equal(walked.accepted, every_slot.accepted)
        for row in range(3):
            span = int(walked.accepted[row]) + 1
            assert torch.equal(walked.tokens[row, :span], every_slot.tokens[row, :span])
        assert walk_draws == int(walked.accepted.max()) + 1 < 8
        deepest = max(deepest, int(walked.accepted.max()))
    assert deepest >= 2
