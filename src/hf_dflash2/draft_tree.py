"""Two-branch draft trees: the head's draft and an n-gram draft verified in one target forward.

Greedy rounds of the fast loop only. When the head drafted and a row's text also matched an earlier
n-gram, the two drafts usually disagree, and either may be the one the target accepts. Verifying both
costs one forward over ``1 + kh + kg - shared`` tokens, which on a CPU in bf16 (or a GPU) costs little
more than verifying one of them; the round keeps whichever branch the target accepts further.

Slot layout, the same for every row of the batch (so one ``[W, W]`` ancestry serves them all)::

    slot 0            the anchor (depth 0)
    slots 1 .. kh     the head's first kh drafts, a chain (depth 1 .. kh)
    slots kh+1 .. W-1 the n-gram's drafts shared+1 .. kg, a chain hanging from slot ``shared``
                      (depth shared+1 .. kg)

``shared`` is the batch's shortest common prefix of the two drafts (capped by kh and kg), so a row
whose drafts agree on their first tokens verifies them once. A row whose drafts agree for longer simply
verifies a few tokens twice; a row without an n-gram match verifies filler there. Neither can change
the output: every committed token is the target's own argmax on its path.

After the forward, the accepted path is moved to the front of the round's slots in the target's KV
cache and in the drafter's features (``gather``), so the caches look exactly as after a linear verify
of that path and the rest of the loop (holes, crop) is unchanged.

Sampling keeps linear rounds: lossless acceptance over several branches needs multi-draft rejection
sampling, which greedy decoding does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


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
    head_length, shared: kh and the n-gram branch's attachment depth."""

    tokens: torch.Tensor
    depth: torch.Tensor
    parent: torch.Tensor
    ancestry: torch.Tensor
    head_length: int
    shared: int

    @property
    def width(self) -> int:
        return self.depth.shape[0]


def build_tree(head_tokens: torch.Tensor, head_length: int, ngram_tokens: torch.Tensor, ngram_length: int,
               shared: int, max_width: int | None = None) -> DraftTree:
    """head_tokens, ngram_tokens: [N, >= kh], [N, >= kg]; shared: the batch's common prefix (any value;
    it is capped by both lengths here). Needs ``ngram_length > shared`` after the cap (else the n-gram
    branch adds nothing and the round is a linear head verify) and at most ``max_width`` slots."""
    kh, kg = head_length, ngram_length
    shared = min(shared, kh, kg)
    if kg <= shared:
        raise ValueError(f"the n-gram branch is empty: kg={kg} <= shared prefix {shared}")
    if max_width is not None and 1 + kh + kg - shared > max_width:
        raise ValueError(f"a tree of kh={kh}, kg={kg} (shared {shared}) needs {1 + kh + kg - shared} slots, "
                         f"more than the round's block of {max_width}")
    device = head_tokens.device
    tokens = torch.cat([head_tokens[:, :kh], ngram_tokens[:, shared:kg]], dim=1)
    region = kg - shared
    depth = torch.cat([torch.arange(kh + 1), torch.arange(shared + 1, kg + 1)]).to(device)
    parent = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(kh), torch.tensor([shared]),
                        torch.arange(kh + 1, kh + region)]).to(device)
    ancestry = torch.eye(1 + kh + region, dtype=torch.bool, device=device)
    for _ in range(max(kh, kg)):  # each pass adds the parent's ancestry: the deepest path needs kg passes
        ancestry = ancestry | ancestry[parent]
    return DraftTree(tokens, depth, parent, ancestry, kh, shared)


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
    to move to the front); head_accepted, ngram_accepted: [N] each branch's own accepted run (for the
    policy's calibration); ngram_won: [N] bool, the path ends in the n-gram branch."""

    accepted: torch.Tensor
    tokens: torch.Tensor
    order: torch.Tensor
    head_accepted: torch.Tensor
    ngram_accepted: torch.Tensor
    ngram_won: torch.Tensor


def accept_tree(tree: DraftTree, logits: torch.Tensor) -> TreeAcceptance:
    """Greedy acceptance over the tree: logits [N, W, V] of the verify forward."""
    argmax = logits.argmax(-1)  # [N, W]
    n, width = argmax.shape
    match = torch.cat([argmax.new_ones(n, 1, dtype=torch.bool), tree.tokens == argmax[:, tree.parent[1:]]], dim=1)
    ok = ~(tree.ancestry[None] & ~match[:, None, :]).any(-1)  # [N, W]: the whole path to the slot matches
    best = (ok * tree.depth[None]).argmax(-1)  # the deepest accepted slot; ties go to the head (lower slots)
    accepted = tree.depth[best]
    on_path = tree.ancestry[best]  # [N, W]
    by_depth = torch.arange(width, device=argmax.device)
    order = (on_path[:, None, :] & (tree.depth[None, None, :] == by_depth[None, :, None])).int().argmax(-1)
    kh, shared = tree.head_length, tree.shared
    return TreeAcceptance(
        accepted=accepted,
        tokens=argmax.gather(1, order),
        order=order,
        head_accepted=ok[:, 1 : kh + 1].sum(-1),
        ngram_accepted=ok[:, 1 : shared + 1].sum(-1) + ok[:, kh + 1 :].sum(-1),
        ngram_won=best > kh,
    )


def move_path_to_front(cache, features: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Reorder the round's last W slots of every cache layer (in place) and ``features`` [N, W, F] by
    ``order`` [N, W] -> the reordered features."""
    n, width = order.shape
    for layer in cache.layers:
        for name in ("keys", "values"):
            buffer = getattr(layer, name)
            index = order[:, None, :, None].expand(n, buffer.shape[1], width, buffer.shape[3])
            buffer[:, :, -width:] = buffer[:, :, -width:].gather(2, index)
    return features.gather(1, order[..., None].expand(-1, -1, features.shape[-1]))
