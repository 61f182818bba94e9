"""Draft trees: the head's draft, an n-gram draft and the head's runner-up first tokens verified in one
target forward.

Greedy rounds of the fast loop only. When the head drafted and a row's text also matched an earlier
n-gram, the two drafts usually disagree, and either may be the one the target accepts; and when the
head's first token is wrong, one of its next likeliest often is (on held-out prompts the committed
head's first draft is right in 33 % / 49 % of rounds on MT-Bench / HumanEval, and one of its 6
runner-ups in another 27 % / 26 %: ``benchmarks/runner_ups.py``). Verifying all of them costs one
forward over ``1 + kh + kg - shared + ka`` tokens, which on a CPU in bf16 (or a GPU) costs little
more than verifying one chain; the round keeps the path the target accepts furthest.

Slot layout, the same for every row of the batch (so one ``[W, W]`` ancestry serves them all)::

    slot 0                 the anchor (depth 0)
    slots 1 .. kh          the head's first kh drafts, a chain (depth 1 .. kh)
    next kg - shared       the n-gram's drafts shared+1 .. kg, a chain hanging from slot ``shared``
                           (depth shared+1 .. kg)
    last ka                the head's runner-up first tokens, each hanging from the anchor (depth 1)

``shared`` is the batch's shortest common prefix of the two drafts (capped by kh and kg), so a row
whose drafts agree on their first tokens verifies them once. A row whose drafts agree for longer simply
verifies a few tokens twice; a row without an n-gram match verifies filler there. Neither can change
the output: every committed token is the target's own argmax on its path.

After the forward, the accepted path is moved to the front of the round's slots in the drafter's
features at once and in the target's KV cache before the next verify (after the next round's host
read, which also says whether any row's path is out of place: when the head's chain wins, nothing
moves), so the caches look exactly as after a linear verify of that path and the rest of the loop
(holes, crop) is unchanged.

Sampling keeps linear rounds: lossless acceptance over several branches needs multi-draft rejection
sampling, which greedy decoding does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

RUNNER_UPS = 6  # the head's runner-up first tokens a tree may verify


def supports_trees(target, cache) -> bool:
    """Whether this target and cache can verify a tree: a custom 4-D mask needs SDPA or eager attention
    and no sliding window (the mask replaces Transformers' own), and moving the path needs plain
    ``DynamicLayer`` caches."""
    config = target.config.get_text_config()
    if getattr(target.config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if getattr(config, "sliding_window", None) is not None and any(
        kind != "full_attention" for kind in (getattr(config, "layer_types", None) or ["sliding"])
    ):
        return False
    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N, S] x [N, S] -> [N] length of the common prefix per row."""
    return (a == b).int().cumprod(-1).sum(-1)


@dataclass
class DraftTree:
    """tokens: [N, W - 1] the drafts in slots 1..W-1; depth, parent: [W] (slot 0, the anchor, is its own
    parent); ancestry: [W, W] bool, ``ancestry[s, t]``: slot ``t`` is ``s`` or on the path to it;
    head_length, shared, ngram_slots, alternatives: kh, the n-gram branch's attachment depth, its slots
    (kg - shared) and ka (the slot layout in the module docstring)."""

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestry: torch.Tensor
    path_order: torch.Tensor
    head_length: int
    shared: int
    ngram_slots: int
    alternatives: int

    @property
    def width(self) -> int:
        return self.depth.shape[0]


def tree_size(head_length: int, ngram_length: int, shared: int, alternatives: int) -> int:
    """Drafted slots of a tree (its width minus the anchor)."""
    return head_length + ngram_length - min(shared, head_length, ngram_length) + alternatives


def build_tree(head_tokens: torch.Tensor, head_length: int, ngram_tokens: torch.Tensor | None, ngram_length: int,
               shared: int, alternative_tokens: torch.Tensor | None = None, alternatives: int = 0,
               max_width: int | None = None) -> DraftTree:
    """head_tokens: [N, >= kh]; ngram_tokens: [N, >= kg] (None when kg = 0); alternative_tokens: [N, >= ka];
    shared: the batch's common prefix of the two drafts (any value; it is capped by kh and kg here). The
    tree has at most ``max_width`` slots; one with neither an n-gram slot nor an alternative is refused
    (that round is a linear head verify)."""
    kh, kg, ka = head_length, ngram_length, alternatives
    shared = min(shared, kh, kg)
    width = 1 + tree_size(kh, kg, shared, ka)
    if width == 1 + kh:
        raise ValueError(f"a tree of kh={kh}, kg={kg} (shared {shared}), ka={ka} has no branch besides the head's")
    if max_width is not None and width > max_width:
        raise ValueError(f"a tree of kh={kh}, kg={kg} (shared {shared}), ka={ka} needs {width} slots, "
                         f"more than the round's block of {max_width}")
    parts = [head_tokens[:, :kh]]
    if kg > shared:
        parts.append(ngram_tokens[:, shared:kg])
    if ka:
        parts.append(alternative_tokens[:, :ka])
    depth, parent, ancestry, path_order = tree_layout(kh, kg, shared, ka, head_tokens.device)
    return DraftTree(torch.cat(parts, dim=1), depth, parent, ancestry, path_order, kh, shared, kg - shared, ka)


@functools.lru_cache(maxsize=256)
def tree_layout(kh: int, kg: int, shared: int, ka: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(depth [W], parent [W], ancestry [W, W], path_order [W, W]) of the slot layout, built once per
    shape and device: rounds share them read-only instead of paying a few dozen small ops each."""
    region = kg - shared
    depth = torch.cat([torch.arange(kh + 1), torch.arange(shared + 1, kg + 1), torch.ones(ka, dtype=torch.long)])
    parent = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(kh),
                        torch.tensor([shared] if region else [], dtype=torch.long),
                        torch.arange(kh + 1, kh + max(region, 1)), torch.zeros(ka, dtype=torch.long)])
    ancestry = torch.eye(depth.shape[0], dtype=torch.bool)
    for _ in range(max(kh, kg, 1)):  # each pass adds the parent's ancestry: the deepest path needs kg passes
        ancestry = ancestry | ancestry[parent]
    # path_order[s, d]: the slot at depth d on the path to s (slot 0 past the path's end)
    at_depth = ancestry[:, None, :] & (depth[None, None, :] == torch.arange(depth.shape[0])[None, :, None])
    path_order = at_depth.int().argmax(-1)
    return tuple(t.to(device) for t in (depth, parent, ancestry, path_order))


def tree_attention_mask(valid: torch.Tensor, tree: DraftTree, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """valid: [N, T + W] the context's visible slots (the round's W slots last) -> [N, 1, W, T + W]: each
    new slot sees the visible context and its own ancestry. Boolean for SDPA, additive for eager."""
    n, total = valid.shape
    width = tree.width
    mask = valid[:, None, None, :].expand(n, 1, width, total).clone()
    mask[..., total - width:] = tree.ancestry
    if implementation == "eager":
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


@dataclass
class TreeAcceptance:
    """accepted: [N] drafts accepted on the best path; tokens: [N, W] the target's tokens along it (the
    first ``accepted`` are the drafts, then the bonus); order: [N, W] slots of that path by depth (what
    to move to the front); head_accepted, ngram_accepted: [N] each chain's own accepted run, and
    alternative_accepted: [N, ka] bool (for the policy's calibration); winner: [N] the branch the path
    ends in (0 the head's chain or the anchor, 1 the n-gram's, 2 a runner-up)."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    order: torch.Tensor
    head_accepted: torch.Tensor
    ngram_accepted: torch.Tensor
    alternative_accepted: torch.Tensor
    winner: torch.Tensor


def accept_tree(tree: DraftTree, logits: torch.Tensor) -> TreeAcceptance:
    """Greedy acceptance over the tree: logits [N, W, V] of the verify forward."""
    argmax = logits.argmax(-1)  # [N, W]
    n = argmax.shape[0]
    match = torch.cat([argmax.new_ones(n, 1, dtype=torch.bool), tree.tokens == argmax[:, tree.parent[1:]]], dim=1)
    ok = ~(tree.ancestry[None] & ~match[:, None, :]).any(-1)  # [N, W]: the whole path to the slot matches
    best = (ok * tree.depth[None]).argmax(-1)  # the deepest accepted slot; ties go to lower slots (the head)
    accepted = tree.depth[best]
    order = tree.path_order[best]
    kh, shared, ngram_end = tree.head_length, tree.shared, tree.head_length + 1 + tree.ngram_slots
    return TreeAcceptance(
        accepted=accepted,
        tokens=argmax.gather(1, order),
        order=order,
        head_accepted=ok[:, 1 : kh + 1].sum(-1),
        ngram_accepted=ok[:, 1 : shared + 1].sum(-1) + ok[:, kh + 1 : ngram_end].sum(-1),
        alternative_accepted=ok[:, ngram_end:],
        winner=(best > kh).long() + (best >= ngram_end).long(),
    )


def path_out_of_place(order: torch.Tensor, accepted: torch.Tensor) -> torch.Tensor:
    """order: [N, W], accepted: [N] -> scalar bool: some row's path (its first ``accepted + 1`` slots) is
    not already at the front, so the cache must be reordered. It is in place whenever the head's chain
    won; the slots past a row's path are cropped or left as masked holes and may stay as they are."""
    by_depth = torch.arange(order.shape[1], device=order.device)
    return ((order != by_depth) & (by_depth <= accepted[:, None])).any()


def move_path_to_front(cache, order: torch.Tensor) -> None:
    """Reorder the round's last W slots of every cache layer in place by ``order`` [N, W]."""
    n, width = order.shape
    for layer in cache.layers:
        for name in ("keys", "values"):
            buffer = getattr(layer, name)
            index = order[:, None, :, None].expand(n, buffer.shape[1], width, buffer.shape[3])
            buffer[:, :, -width:] = buffer[:, :, -width:].gather(2, index)


def gather_path(features: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """features: [N, W, F] of the round's slots -> the same reordered by ``order`` [N, W]."""
    return features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
