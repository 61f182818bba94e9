"""The target's token choice in a round: argmax, or a draw from ``generate``'s sampling law.

Shapes: N rows, V the target's vocabulary, k a round's drafts, W a draft tree's slots.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from ..speculative_dflash2 import Proposal, accept_greedy, accept_sampling, dense_proposal, process_logits


def tail_warpers(config: GenerationConfig, device=None) -> list:
    """Transformers' min-p / typical / epsilon / eta warpers for a sampling ``config``, as generate builds
    them (``TAIL_WARPERS``; one token always kept)."""
    from transformers.generation.logits_process import (
        EpsilonLogitsWarper,
        EtaLogitsWarper,
        MinPLogitsWarper,
        TypicalLogitsWarper,
    )

    warpers = []
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    if config.typical_p is not None and config.typical_p < 1.0:
        warpers.append(TypicalLogitsWarper(mass=config.typical_p))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        warpers.append(EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        warpers.append(EtaLogitsWarper(epsilon=config.eta_cutoff, device=device or "cpu"))
    return warpers


class Sampler:
    """The target's token choice: argmax, or a sample under temperature / top-k / top-p."""

    def __init__(self, do_sample, temperature, top_k, top_p, generator, config: GenerationConfig | None = None,
                 device=None):
        self.do_sample, self.temperature, self.top_k, self.top_p = do_sample, temperature, top_k, top_p
        self.generator = generator
        self.draft_temperature = temperature if do_sample else 0.0
        self.tail_warpers = tail_warpers(config, device) if do_sample and config is not None else []
        self.renormalize = do_sample and config is not None and bool(config.renormalize_logits)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] processed logits -> the scores ``generate`` samples from: temperature / top-k / top-p, then
        min-p / typical / epsilon / eta, then ``renormalize_logits``'s log-softmax, in generate's order
        (unchanged when greedy)."""
        if not self.do_sample:
            return logits
        logits = process_logits(logits, self.temperature, self.top_k, self.top_p)
        if self.tail_warpers:
            flat = logits.reshape(-1, logits.shape[-1])
            for warper in self.tail_warpers:  # they read the scores only
                flat = warper(None, flat)
            logits = flat.reshape(logits.shape)
        return logits.log_softmax(-1) if self.renormalize else logits

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> the target's sampling distribution (``warp``, then softmax)."""
        return self.warp(logits).softmax(-1)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]"""
        if not self.do_sample:
            return logits.argmax(-1)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator).squeeze(-1)

    def pick_per_slot(self, logits: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """The target's token after every slot of a draft tree: logits [N, W, V], depth [N, W] -> [N, W].

        Sampling inverts each slot's cumulative distribution at one uniform draw per row and depth, shared
        by the slots of that depth. The tree is fixed before the draws, and the accepted path reads one slot
        per depth, so each committed token is a fresh draw from the target's law given the tokens before
        it: plain sampling, token by token. Sharing also makes identical branches agree. (One uniform per
        depth, not V exponentials per slot: the latter cost more than a CPU forward.)"""
        if not self.do_sample:
            return logits.argmax(-1)
        # float64: float32 sums over a 49K vocabulary drop the smallest tokens
        cumulative = self.probs(logits).double().cumsum(-1)
        uniform = torch.rand(depth.shape, generator=self.generator, device=depth.device, dtype=torch.float64)
        uniform = uniform.gather(1, depth)
        at = (uniform * cumulative[..., -1])[..., None]  # the first token whose cumulative mass passes it
        return torch.searchsorted(cumulative, at, right=True).squeeze(-1).clamp_max(logits.shape[-1] - 1)

    def accept(self, draft_tokens: torch.Tensor, draft: Proposal | None, logits: torch.Tensor):
        """draft_tokens: [N, k]; logits: [N, k + 1, V] -> (accepted [N], tokens [N, k + 1])"""
        if not self.do_sample:
            return accept_greedy(draft_tokens, logits)
        k = draft_tokens.shape[1]
        p = self.probs(logits)
        if k == 0:  # a plain step (there may be no draft at all)
            tokens = torch.multinomial(p[:, 0], 1, generator=self.generator)
            return tokens.new_zeros(tokens.shape[0]), tokens
        q = dense_proposal(draft.q_ids[:, :k], draft.q_probs[:, :k], logits.shape[-1])
        return accept_sampling(draft_tokens, q, p, self.generator)
