"""The dFlash 2 training objective: position-decayed CE on the unary logits + the selector's K-way CE
(+ optionally a distillation of the target's LM-head input)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..configuration_dflash2 import LOSS_DECAY_BY_BLOCK_SIZE


def decay_gamma(block_size: int, chosen: float | None = None) -> float:
    """The loss's position decay: ``chosen`` (``train --loss-gamma``), else the DFlash paper's for the block size."""
    if chosen is not None:
        return chosen
    if block_size in LOSS_DECAY_BY_BLOCK_SIZE:
        return LOSS_DECAY_BY_BLOCK_SIZE[block_size]
    return max(1.0, 7.0 * block_size / 16)


def position_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k - 1) / gamma) for drafted positions k = 1..num_positions."""
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / gamma)


def sparse_cross_entropy(
    logits: torch.Tensor, target_ids: torch.Tensor, target_logprobs: torch.Tensor, vocab_subset: torch.Tensor | None
) -> torch.Tensor:
    """-sum_j p_j log q(j) over the target's top-k: logits [M, P, V'] (V' = subset), target_* [M, P, k] -> [M, P].

    p is the target's top-k distribution renormalised over the ids present in the subset; with k = V and
    no subset this is the full cross-entropy to the target, i.e. KL(p || q) + H(p).
    """
    log_q = logits.float().log_softmax(-1)
    if vocab_subset is None:
        local, present = target_ids, torch.ones_like(target_ids, dtype=torch.bool)
    else:
        local = torch.searchsorted(vocab_subset, target_ids).clamp(max=len(vocab_subset) - 1)
        present = vocab_subset[local] == target_ids
    weights = torch.where(present, target_logprobs.float(), float("-inf")).softmax(-1).nan_to_num(0.0)
    return -(weights * log_q.gather(-1, local)).sum(-1)


def training_logits(drafter, hidden: torch.Tensor, vocab_subset: torch.Tensor | None = None,
                    head_weight: torch.Tensor | None = None) -> torch.Tensor:
    """hidden: [..., H] final-normed drafter states -> the head's unary logits [..., V'] over ``vocab_subset``
    (None: the whole vocabulary), through the frozen LM head (``head_weight``: its rows for the subset, as
    ``block_loss`` takes it) and its bias, then the head's ``finish_logits``."""
    bound = drafter.bound_target
    head = head_weight
    if head is None:
        head = bound.lm_head_weight if vocab_subset is None else bound.lm_head_weight[vocab_subset]
    bias = bound.lm_head_bias
    if bias is not None and vocab_subset is not None:
        bias = bias[vocab_subset]
    # 2-D, so a non-contiguous hidden never makes F.linear copy the LM head (see ``unary_logits``).
    flat_logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), head.to(hidden.dtype), bias)
    return drafter.finish_logits(flat_logits.view(*hidden.shape[:-1], head.shape[0]))


def block_loss(
    drafter,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor,
    gamma: float,
    vocab_subset: torch.Tensor | None = None,
    selector_weight: float = 1.0,
    soft_targets: tuple[torch.Tensor, torch.Tensor] | None = None,
    head_weight: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    hidden_targets: torch.Tensor | None = None,
    hidden_weight: float = 0.0,
    label_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Loss of a set of blocks.

    hidden: [M, P, H] final-normed drafter states at drafted positions 1..P; labels: [M, P] target tokens
    (-100 = ignore); predecessors: [M, P] true previous token (the anchor at position 1).
    ``vocab_subset`` ([V'] sorted token ids containing every label) restricts the softmax to the tokens
    that occur in the data, which is what makes CPU training affordable; None = full vocabulary.
    ``soft_targets`` = (ids, logprobs) [M, P, k]: the target's top-k distribution; the unary loss is then
    the cross-entropy to it renormalised over the top-k (KL to the target up to a constant); ids outside
    ``vocab_subset`` are dropped. The selector keeps the hard ``labels``. ``head_weight`` ([V', H], already
    restricted to the subset and in the compute dtype) saves re-gathering the frozen LM head every call.
    ``logit_scale`` multiplies the unary logits (the trainer's warmup of a fresh head's output scale).
    ``hidden_targets`` [M, P, H]: the target's LM-head input where it predicts each label. The head feeds
    the same LM head, so matching it matches the target's logits over the whole vocabulary, a signal
    beyond its top-k; the term is the squared error relative to the target state's mean square, decayed
    like the CE and weighted by ``hidden_weight``. ``label_weights`` [M, P] multiply the position weights of
    every term (the trainer's ``copy_weight``); the loss stays normalised by the weights' sum.
    """
    valid = labels >= 0
    weights = position_weights(labels.shape[1], gamma, hidden.device)[None].expand_as(labels) * valid
    if label_weights is not None:
        weights = weights * label_weights
    norm = weights.sum().clamp_min(1e-6)
    logits = training_logits(drafter, hidden, vocab_subset, head_weight)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    safe_labels = labels.clamp_min(0)
    local_labels = safe_labels if vocab_subset is None else torch.searchsorted(vocab_subset, safe_labels)
    if soft_targets is None:
        ce = F.cross_entropy(logits.flatten(0, 1).float(), local_labels.flatten(), reduction="none").view_as(labels)
    else:
        ce = sparse_cross_entropy(logits, *soft_targets, vocab_subset)
    unary_loss = (ce * weights).sum() / norm
    selector = drafter.candidate_selector
    use_selector = selector is not None and selector_weight > 0
    with torch.no_grad():
        if use_selector:  # one fp32 copy of the logits serves all below
            detached = logits.detach().float()
            unary, candidates = detached.topk(min(selector.top_k, logits.shape[-1]), dim=-1)  # [M, P, K] local ids
            predicted = candidates[..., 0]
        else:
            predicted = logits.argmax(-1)
        top1 = predicted == local_labels
        metrics = {
            "unary_loss": float(unary_loss.detach()),
            "top1_by_position": ((top1 & valid).sum(0).float() / valid.sum(0).clamp_min(1)).tolist(),
        }
    loss = unary_loss
    if hidden_targets is not None and hidden_weight > 0:
        goal = hidden_targets.float()
        relative_error = (hidden.float() - goal).pow(2).mean(-1) / goal.pow(2).mean(-1).clamp_min(1e-6)
        hidden_loss = (relative_error * weights).sum() / norm
        loss = loss + hidden_weight * hidden_loss
        metrics["hidden_loss"] = float(hidden_loss.detach())
    if use_selector:
        k = unary.shape[-1]
        # The unary part of the tables is detached: U is trained by its own CE, the selector loss trains
        # the pairwise term (codebooks, hidden projection and, through it, the backbone).
        in_top = candidates == local_labels[..., None]
        found = in_top.any(-1)
        # Published choice 2: when the true token is outside the top-K it replaces the K-th candidate.
        last = torch.zeros_like(in_top)
        last[..., -1] = True
        candidates = torch.where(~found[..., None] & last, local_labels[..., None], candidates)
        true_logit = detached.gather(-1, local_labels[..., None])
        unary = torch.where(~found[..., None] & last, true_logit, unary)
        target_index = torch.where(found, in_top.float().argmax(-1), torch.full_like(labels, k - 1))
        global_candidates = candidates if vocab_subset is None else vocab_subset[candidates]
        tables = selector.pair_tables(hidden, unary, global_candidates, predecessors[..., None])[..., 0, :]
        sel_ce = F.cross_entropy(tables.flatten(0, 1).float(), target_index.flatten(), reduction="none").view_as(labels)
        selector_loss = (sel_ce * weights).sum() / norm
        loss = loss + selector_weight * selector_loss
        with torch.no_grad():
            metrics["selector_loss"] = float(selector_loss.detach())
            picked = tables.argmax(-1) == target_index
            metrics["selector_top1_by_position"] = (
                (picked & valid).sum(0).float() / valid.sum(0).clamp_min(1)
            ).tolist()
            metrics["label_in_topk"] = float((found & valid).sum() / valid.sum().clamp_min(1))
    metrics["loss"] = float(loss.detach())
    if not math.isfinite(metrics["loss"]):
        raise FloatingPointError(f"non-finite training loss {metrics['loss']}")
    return loss, metrics
