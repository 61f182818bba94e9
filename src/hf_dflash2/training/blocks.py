"""How a training sequence becomes the head's blocks: anchors, block inputs, the target's labels for each
drafted position, and where the fast loop's rounds would start.

Shapes: T a sequence's tokens, n its anchors, B the block size (the anchor and B - 1 drafted positions),
H the target's hidden size.
"""

from __future__ import annotations

import torch

from ..speculative_dflash2 import DEFAULT_NGRAM_SIZE, ngram_draft


def sample_anchors(num_tokens: int, response_start: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct random anchor positions in [response_start, num_tokens - 2], sorted."""
    candidates = num_tokens - 1 - response_start
    picks = torch.randperm(candidates, generator=generator)[: min(count, candidates)]
    return (picks + response_start).sort().values


def loop_round_starts(accepted: torch.Tensor, first: int) -> torch.Tensor:
    """Where the loop's rounds start when a round from anchor ``first + i`` commits ``accepted[i]`` drafts and
    the target's own next token: [first, first + accepted[0] + 1, ...], up to ``first + len(accepted) - 1``.
    accepted: [W] drafts the target accepts from each anchor of a window of W consecutive positions."""
    starts, position, end = [], first, first + len(accepted)
    while position < end:
        starts.append(position)
        position += int(accepted[position - first]) + 1
    return torch.tensor(starts, dtype=torch.long)


def accepted_drafts(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """tokens, labels: [n, B-1] drafts and the target's argmax (-100 past the end) -> [n] leading matches."""
    return (tokens == labels).int().cumprod(-1).sum(-1)


def sequence_blocks(ids: torch.Tensor, block_size: int, anchors: torch.Tensor, mask_token_id: int):
    """ids: [T] tokens -> block ids [n, B], labels [n, B-1] (-100 past the end), predecessors [n, B-1]."""
    offsets = torch.arange(block_size)
    index = anchors[:, None] + offsets[None]  # [n, B]
    inside = index < len(ids)
    tokens = torch.where(inside, ids[index.clamp(max=len(ids) - 1)], torch.full_like(index, -100))
    block_ids = torch.full_like(index, mask_token_id)
    block_ids[:, 0] = ids[anchors]
    labels = tokens[:, 1:]
    predecessors = tokens[:, :-1].clamp_min(0)
    return block_ids, labels, predecessors


def predicting_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, B-1]: the text position at which the target predicts block token k after anchor a (a + k - 1)."""
    return anchors[:, None] + torch.arange(block_size - 1)


def final_hidden_for_blocks(item: dict, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[n, B-1, H] the target's LM-head input where it predicts each block token, the distillation target
    of the head's own LM-head input there. Positions past the end repeat the last one; their labels are
    -100, so they carry no loss."""
    return item["final_hidden"][predicting_positions(anchors, block_size).clamp(max=len(item["input_ids"]) - 1)]


def target_labels_for_blocks(item: dict, anchors: torch.Tensor, block_size: int, label_source: str):
    """Labels from the target's own next-token distribution at each block position.

    Position k of the block after anchor a is predicted by the target at a + k - 1. Returns labels
    [n, B-1] (its argmax; -100 past the end), predecessors [n, B-1] (the anchor, then the previous
    label, so the selector learns the target's chain) and, for ``"kl"``, (topk_ids, topk_logprobs)
    [n, B-1, k] soft targets.
    """
    length = len(item["input_ids"])
    index = predicting_positions(anchors, block_size)
    inside = index + 1 < length
    safe = index.clamp(max=length - 1)
    labels = torch.where(inside, item["topk_ids"][safe, 0], torch.full_like(index, -100))
    predecessors = torch.cat([item["input_ids"][anchors][:, None], labels[:, :-1].clamp_min(0)], dim=1)
    soft = None
    if label_source == "kl":
        soft = (item["topk_ids"][safe], torch.where(inside[..., None], item["topk_logprobs"][safe], float("-inf")))
    return labels, predecessors, soft


def ngram_copied_positions(ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                           ngram_size: int = DEFAULT_NGRAM_SIZE) -> torch.Tensor:
    """ids: [T] the sequence; anchors: [n]; labels: [n, B-1] (-100 past the end) -> [n, B-1] bool: the block
    positions that the fast loop's n-gram chain, looked up from the text up to each anchor as the loop does
    (``ngram_draft``), drafts correctly and in a row from the first, i.e. the positions it would have had
    accepted."""
    history = ids[None].expand(len(anchors), len(ids))
    drafted, size = ngram_draft(history, anchors + 1, labels.shape[1], ngram_size)
    return ((drafted == labels) & (labels >= 0) & (size[:, None] > 0)).long().cumprod(-1).bool()
