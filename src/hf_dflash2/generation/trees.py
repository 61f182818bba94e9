"""Draft trees: the head's likeliest continuations and an n-gram draft verified in one target forward.

Rounds of the fast loop where the head drafted, greedy or sampling. The head proposes, at each of its S
positions, K candidates with a probability for each given the previous position's candidate: dFlash 2's
selector scores every pair (``P(b | a) = softmax_b S_t(a, b)``, a Markov chain over the candidates),
DFlash-1's unary distribution ranks them independently. A round verifies the ``m`` continuations of
highest path probability (best first: a node's probability is its path's product, so the ``m`` likeliest
nodes always include their parents), and the n-gram draft as a chain hanging from the deepest head node
that spells its first tokens. At equal size this beats the head's chain with runner-up first tokens in
tokens per round (``benchmarks/speed/tree_shapes.py``), and verifying 16 tokens costs a CPU in bf16 (or a
GPU) little more than verifying 8. The round keeps the path the target accepts furthest.

Slots, per row: 0 the anchor; 1..m the head's nodes in order of probability (so a parent comes before
its children); m+1..m+kg the n-gram chain. Rows differ in shape, so depth, parent and ancestry are
per row, and the target's attention mask is built from them.

After the forward, the accepted path is moved to the front of the round's slots in the drafter's
features at once and in the target's KV cache before the next verify (after the next round's host
read, which also says whether any row's path is out of place: when a row's path is already slots
0..a, nothing moves), so the caches look exactly as after a linear verify of that path and the rest of
the loop (holes, crop) is unchanged.

Sampling needs no multi-draft rejection step: every node is a fixed draft (the head drafts greedily in
a tree round), so the target draws its own token after each slot the round reaches and the round follows
the draws down the tree (``Sampler.pick_along_tree``, then ``accept_tree`` over the draws). Slots of one
depth share one uniform draw (each slot inverts its own distribution at it), so the tokens committed are
drawn one by one from the target's law given the tokens before them, exactly as plain sampling would; a
branch is accepted with the target's probability of its token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from ..cpu.attention import PACKED_GQA_SDPA

TREE_TOP_K = 16  # candidates per position a DFlash-1 head's tree ranks (dFlash 2: its selector's K)


def supports_trees(target, cache) -> bool:
    """Whether this target and cache can verify a tree: a custom 4-D mask needs SDPA (Transformers' or
    ``cpu.attention.packed_gqa_sdpa``) or eager attention and no sliding window (the mask replaces
    Transformers' own), and moving the path needs plain ``DynamicLayer`` caches."""
    config = target.config.get_text_config()
    if getattr(target.config, "_attn_implementation", None) not in ("sdpa", PACKED_GQA_SDPA, "eager"):
        return False
    if getattr(config, "sliding_window", None) is not None and any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ["sliding"])
    ):
        return False
    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


@dataclass
class HeadNodes:
    """The head's continuations ranked by path probability (best first), per row: tokens, depth (1 = the
    first drafted position), logp (the path's log-probability) and parent (rank of the parent node, -1
    for a first position): [N, M]. Any first ``m`` of them form a tree."""

    tokens: torch.Tensor
    depth: torch.Tensor
    logp: torch.Tensor
    parent: torch.Tensor


def best_first(candidate_ids: torch.Tensor, transition_logp: torch.Tensor, size: int) -> HeadNodes:
    """candidate_ids: [N, S, K] the head's candidates per position; transition_logp: [N, S, K, K] the
    log-probability of each candidate (last axis) given the previous position's candidate (third axis;
    position 0's rows all hold the distribution after the anchor) -> the ``size`` likeliest nodes.

    A beam per depth: a node among the ``size`` likeliest overall is among the ``size`` likeliest of its
    depth, and so is its parent, so keeping ``size`` per depth loses none of them."""
    n, s, k = candidate_ids.shape
    rows = torch.arange(n, device=candidate_ids.device)[:, None]
    logp, cand = transition_logp[:, 0, 0].topk(min(size, k), dim=-1)
    levels = [(logp, cand, torch.full_like(cand, -1))]
    for depth in range(1, s):
        previous_logp, previous_cand = levels[-1][0], levels[-1][1]
        step = transition_logp[:, depth].gather(1, previous_cand[..., None].expand(-1, -1, k))  # [N, b, K]
        scores = (previous_logp[..., None] + step).flatten(1)
        logp, flat = scores.topk(min(size, scores.shape[1]), dim=-1)
        levels.append((logp, flat % k, flat // k))
    widths = [level[0].shape[1] for level in levels]
    offsets = torch.tensor([0, *widths[:-1]], device=rows.device).cumsum(0)
    depth = torch.cat([torch.full((w,), d + 1, device=rows.device) for d, w in enumerate(widths)])
    logp = torch.cat([level[0] for level in levels], dim=1)  # [N, total]
    tokens = torch.cat([candidate_ids[:, d].gather(1, level[1]) for d, level in enumerate(levels)], dim=1)
    parent = torch.cat([torch.where(level[2] < 0, -1, level[2] + offsets[d - 1]) for d, level in enumerate(levels)],
                       dim=1)
    # a child never outranks its parent (shallower first when a step has probability 1)
    chosen = (logp - 1e-4 * depth).topk(min(size, logp.shape[1]), dim=-1).indices  # [N, M] by rank
    rank_of = torch.full_like(logp, -1, dtype=torch.long).scatter_(
        1, chosen, torch.arange(chosen.shape[1], device=rows.device).expand_as(chosen))
    chosen_parent = parent.gather(1, chosen)
    parent_rank = torch.where(chosen_parent < 0, -1, rank_of.gather(1, chosen_parent.clamp_min(0)))
    return HeadNodes(tokens.gather(1, chosen), depth.expand_as(logp).gather(1, chosen), logp.gather(1, chosen),
                     parent_rank)


def candidate_log_mass(draft) -> torch.Tensor:
    """[N, S] log of the unary probability a dFlash 2 draft's K selector candidates hold at each position
    (the selector's softmax is over them only).

    With the candidates' own logits (``candidate_logits``, largest first), it is the top candidate's log
    probability plus ``log sum_k exp(u_k - u_1)``: one fused pass over the vocabulary (``log_softmax``) where
    a second top-K over it would be another. Heads saved before that field draft without it."""
    log_probs = draft.logits.float().log_softmax(-1)
    top = getattr(draft, "candidate_logits", None)
    if top is None:
        return log_probs.topk(draft.q_ids.shape[-1], dim=-1).values.logsumexp(-1)
    return log_probs.amax(-1) + (top - top[..., :1]).logsumexp(-1)


def rank_continuations(drafter, draft, size: int, top_k_mass: bool = True) -> HeadNodes:
    """The head's ``size`` likeliest continuations from its ``DraftOutput``: by the selector's pair scores
    (dFlash 2) or, without them (DFlash-1), by each position's unary top ``TREE_TOP_K`` as independent.

    The selector's softmax spreads over its K candidates only, so a position whose candidates hold little
    of the unary probability looks surer than it is. ``top_k_mass`` (default) ranks by each selector step
    weighed by the unary mass its K candidates hold (``benchmarks/speed/tree_shapes.py``: more tokens per
    round at every tree size on both prompt sets). The nodes' ``logp`` stay the
    selector's own path probabilities: the planner's calibration is fitted to them, and giving it the
    weighed ones made it plan smaller trees that lost on MT-Bench (measured with ``ngram_hybrid.py``)."""
    if draft.pair_scores is None:
        logp, top = draft.logits.float().log_softmax(-1).topk(min(TREE_TOP_K, draft.logits.shape[-1]), dim=-1)
        ids = top if drafter.draft_vocab is None else drafter.draft_vocab.to(top.device)[top]
        return best_first(ids, logp[:, :, None, :].expand(-1, -1, logp.shape[-1], -1), size)
    transition_logp = draft.pair_scores.float().log_softmax(-1)
    if not top_k_mass:
        return best_first(draft.q_ids, transition_logp, size)
    mass = candidate_log_mass(draft)
    nodes = best_first(draft.q_ids, transition_logp + mass[..., None, None], size)
    # a node at depth d took one weighed step at each position up to d
    weights = mass.cumsum(-1).gather(1, nodes.depth - 1)
    return HeadNodes(nodes.tokens, nodes.depth, nodes.logp - weights, nodes.parent)


def spelling(nodes: HeadNodes, sequence: torch.Tensor) -> torch.Tensor:
    """[N, M] whether each ranked node's path spells ``sequence`` [N, L]'s first tokens."""
    n = nodes.tokens.shape[0]
    zero = nodes.depth.new_zeros(n, 1)
    depth = torch.cat([zero, nodes.depth], dim=1)
    ancestry = ancestry_of(torch.cat([zero, nodes.parent + 1], dim=1))
    return _spelled(nodes.tokens, depth, ancestry, sequence)[:, 1:]


def _spelled(tokens, depth, ancestry, sequence) -> torch.Tensor:
    """[N, W] whether each slot's path spells ``sequence``'s first tokens (slot 0, the anchor, always)."""
    index = (depth[:, 1:] - 1).clamp(0, sequence.shape[1] - 1)
    match = (tokens == sequence.gather(1, index)) & (depth[:, 1:] <= sequence.shape[1])
    match = torch.cat([match.new_ones(match.shape[0], 1), match], dim=1)
    return ~(ancestry & ~match[:, None, :]).any(-1)


def deepest_spelling(tokens: torch.Tensor, depth: torch.Tensor, ancestry: torch.Tensor,
                     sequence: torch.Tensor) -> torch.Tensor:
    """tokens: [N, W - 1] slots 1..; depth: [N, W]; ancestry: [N, W, W]; sequence: [N, L] -> [N] the
    deepest slot whose path from the anchor spells ``sequence``'s first tokens (0: the anchor)."""
    return (_spelled(tokens, depth, ancestry, sequence) * depth).argmax(-1)


def ancestry_of(parent: torch.Tensor) -> torch.Tensor:
    """parent: [N, W] (slot 0 its own parent) -> [N, W, W] bool, ``[n, s, t]``: t is s or on its path."""
    n, width = parent.shape
    ancestry = torch.eye(width, dtype=torch.bool, device=parent.device).expand(n, width, width)
    jump = parent
    for _ in range(max(1, (width - 1).bit_length())):  # pointer jumping: paths of up to W - 1 steps
        ancestry = ancestry | ancestry.gather(1, jump[..., None].expand(n, width, width))
        jump = jump.gather(1, jump)
    return ancestry


@dataclass
class DraftTree:
    """One round's tree, per row. tokens: [N, W - 1] slots 1..W-1; depth, parent: [N, W] (slot 0, the
    anchor, is its own parent); ancestry: [N, W, W] (``[n, s, t]``: slot t is s or on the path to it);
    head_nodes m (slots 1..m), ngram_slots kg (slots m+1..m+kg); ngram_attach: [N] the slot the n-gram
    chain hangs from; greedy_slot: [N] the deepest head slot on the head's own chain (its selector path)."""

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestry: torch.Tensor
    head_nodes: int
    ngram_slots: int
    ngram_attach: torch.Tensor
    greedy_slot: torch.Tensor

    @property
    def width(self) -> int:
        return self.depth.shape[1]


def build_tree(nodes: HeadNodes, head_nodes: int, head_chain: torch.Tensor, ngram_tokens: torch.Tensor | None = None,
               ngram_length: int = 0, max_width: int | None = None) -> DraftTree:
    """The first ``head_nodes`` of ``nodes`` and ``ngram_length`` tokens of ``ngram_tokens`` [N, L] as one
    tree; ``head_chain`` [N, S]: the head's own draft (to find it in the tree, for calibration)."""
    m, kg = head_nodes, ngram_length if ngram_tokens is not None else 0
    width = 1 + m + kg
    if m > nodes.tokens.shape[1]:
        raise ValueError(f"a tree of {m} head nodes, but the round ranked {nodes.tokens.shape[1]}")
    if max_width is not None and width > max_width:
        raise ValueError(f"a tree of {m} head nodes and {kg} n-gram drafts needs {width} slots, "
                         f"more than the round's block of {max_width}")
    n = nodes.tokens.shape[0]
    zero = nodes.depth.new_zeros(n, 1)
    depth = torch.cat([zero, nodes.depth[:, :m]], dim=1)
    parent = torch.cat([zero, nodes.parent[:, :m] + 1], dim=1)  # rank r is slot r + 1; -1 (anchor) -> 0
    tokens = nodes.tokens[:, :m]
    ancestry = ancestry_of(parent)
    greedy = deepest_spelling(tokens, depth, ancestry, head_chain)
    attach = torch.zeros_like(greedy)
    if kg:
        attach = deepest_spelling(tokens, depth, ancestry, ngram_tokens)
        start = depth.gather(1, attach[:, None])  # [N, 1] the n-gram tokens already in the tree
        steps = torch.arange(kg, device=depth.device)
        index = (start + steps).clamp(max=ngram_tokens.shape[1] - 1)
        tokens = torch.cat([tokens, ngram_tokens.gather(1, index)], dim=1)
        depth = torch.cat([depth, start + 1 + steps], dim=1)
        chain_parent = torch.cat([attach[:, None], (m + 1 + steps[:-1]).expand(n, kg - 1)], dim=1)
        parent = torch.cat([parent, chain_parent], dim=1)
        ancestry = ancestry_of(parent)
    return DraftTree(tokens, depth, parent, ancestry, m, kg, attach, greedy)


def tree_attention_mask(valid: torch.Tensor, tree: DraftTree, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """valid: [N, T + W] the context's visible slots (the round's W slots last) -> [N, 1, W, T + W]: each
    new slot sees the visible context and its own ancestry. Boolean for SDPA, additive for eager."""
    n, total = valid.shape
    width = tree.width
    mask = valid[:, None, None, :].expand(n, 1, width, total).clone()
    mask[:, 0, :, total - width:] = tree.ancestry
    if implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


@dataclass
class TreeAcceptance:
    """accepted: [N] drafts accepted on the best path; tokens: [N, W] the target's tokens along it (the
    first ``accepted`` are the drafts, then the bonus); order: [N, W] slots of that path by depth (what
    to move to the front); node_accepted: [N, m] whether each head node's path was accepted;
    greedy_verified / greedy_accepted, ngram_verified / ngram_accepted: [N] how far the head's own chain
    and the n-gram's were verified and accepted (for the policy's calibration); winner: [N] the branch
    the path ends in (0 the head's nodes or the anchor, 1 the n-gram chain)."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    order: torch.Tensor
    node_accepted: torch.Tensor
    greedy_verified: torch.Tensor
    greedy_accepted: torch.Tensor
    ngram_verified: torch.Tensor
    ngram_accepted: torch.Tensor
    winner: torch.Tensor


def accept_tree(tree: DraftTree, picks: torch.Tensor) -> TreeAcceptance:
    """Acceptance over the tree: ``picks`` [N, W] the target's token after each slot (its argmax, or its
    draw when sampling; a slot off the accepted path may hold ``V``, no token). A slot is accepted when every
    slot on its path is the pick of its parent."""
    n, width = picks.shape
    rows = torch.arange(n, device=picks.device)
    match = torch.cat([picks.new_ones(n, 1, dtype=torch.bool), tree.tokens == picks.gather(1, tree.parent[:, 1:])],
                      dim=1)
    ok = ~(tree.ancestry & ~match[:, None, :]).any(-1)  # [N, W]: the whole path to the slot matches
    reached = ok * tree.depth
    best = reached.argmax(-1)  # the deepest accepted slot; ties go to lower slots (the likelier head nodes)
    on_path = tree.ancestry[rows, best]
    by_depth = torch.arange(width, device=picks.device)
    order = (on_path[:, None, :] & (tree.depth[:, None, :] == by_depth[None, :, None])).int().argmax(-1)
    last = tree.width - 1 if tree.ngram_slots else tree.ngram_attach
    last = torch.as_tensor(last, device=picks.device).expand(n)
    return TreeAcceptance(
        accepted=tree.depth.gather(1, best[:, None]).squeeze(1),
        tokens=picks.gather(1, order),
        order=order,
        node_accepted=ok[:, 1 : tree.head_nodes + 1],
        greedy_verified=tree.depth.gather(1, tree.greedy_slot[:, None]).squeeze(1),
        greedy_accepted=(reached * tree.ancestry[rows, tree.greedy_slot]).amax(-1),
        ngram_verified=tree.depth.gather(1, last[:, None]).squeeze(1),
        ngram_accepted=(reached * tree.ancestry[rows, last]).amax(-1),
        winner=(best > tree.head_nodes).long(),
    )


def path_out_of_place(order: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """order: [N, W], accepted: [N] -> scalar bool: some row's path (its first ``accepted + 1`` slots) is
    not already at the front, so the cache must be reordered. The slots past a row's path are cropped or
    left as masked holes and may stay as they are."""
    by_depth = torch.arange(order.shape[1], device=order.device)
    return ((order != by_depth) & (by_depth <= accepted[:, None])).any()


def move_path_to_front(cache, order: torch.Tensor) -> None:
    """Reorder the round's last W slots of every cache layer in place by ``order`` [N, W]."""
    n, width = order.shape
    index = None  # one expanded index for every layer of the same shape (the host runs it once, not 2 x layers)
    for layer in cache.layers:
        for name in ("keys", "values"):
            buffer = getattr(layer, name)
            if index is None or index.shape[1] != buffer.shape[1] or index.shape[3] != buffer.shape[3]:
                index = order[:, None, :, None].expand(n, buffer.shape[1], width, buffer.shape[3])
            buffer[:, :, -width:] = buffer[:, :, -width:].gather(2, index)


def gather_path(features: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """features: [N, W, F] of the round's slots -> the same reordered by ``order`` [N, W]."""
    return features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
