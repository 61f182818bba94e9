"""The target's token choice in a round: argmax, or a draw from ``generate``'s sampling law.

Shapes: N rows, V the target's vocabulary, k a round's drafts, W a draft tree's slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import GenerationConfig

from ..speculative_dflash2 import Proposal, accept_greedy, accept_sampling, dense_proposal, draw, process_logits

if TYPE_CHECKING:
    from .trees import DraftTree


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

    def uniforms(self, *shape: int, device=None) -> torch.Tensor:
        """Float64 uniforms in [0, 1) of ``shape``, from the call's generator."""
        return torch.rand(shape, generator=self.generator, device=device, dtype=torch.float64)

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]"""
        if not self.do_sample:
            return logits.argmax(-1)
        return draw(self.probs(logits), self.uniforms(logits.shape[0], device=logits.device))

    def pick_along_tree(self, logits: torch.Tensor, tree: "DraftTree") -> torch.Tensor:
        """The target's token after the slots of a draft tree: logits [N, W, V] -> [N, W], enough for
        ``accept_tree``. Greedy: every slot's argmax.

        Sampling draws at one uniform per row and depth, shared by that depth's slots; the tree is fixed
        before the draws and the accepted path reads one slot per depth, so each committed token is a fresh
        draw from the target's law given the tokens before it: plain sampling, token by token. On a CPU the
        draws walk down from the anchor: after the slot accepted at depth d, then at its children that spell
        the draw, ending where the path does. Slots off the path get no draw (``V`` there): each draw is a
        softmax and a cumulative sum over the vocabulary, and a tree's other slots would take most of a
        round's sampling time. Accepted slots of one depth spell the same text, so they share its draw. On a
        GPU, where the walk's steps would run one after another, every slot draws at once.
        """
        if not self.do_sample:
            return logits.argmax(-1)
        if logits.device.type != "cpu":
            return self.pick_every_slot(logits, tree)
        n, width, vocab = logits.shape
        uniform = self.uniforms(n, width, device=logits.device)  # column d: the draw at depth d
        picks = torch.full((n, width), vocab, dtype=torch.long, device=logits.device)
        tokens = torch.cat([picks[:, :1], tree.tokens], dim=1)  # slot 0, the anchor, is no child
        accepted = torch.zeros(n, width, dtype=torch.bool, device=logits.device)
        accepted[:, 0] = True
        rows = torch.arange(n, device=logits.device)
        for depth in range(width):
            here = accepted & (tree.depth == depth)  # [N, W]
            token = draw(self.probs(logits[rows, here.int().argmax(-1)]), uniform[:, depth])
            picks = torch.where(here, token[:, None], picks)
            children = (tree.depth == depth + 1) & accepted.gather(1, tree.parent) & (tokens == token[:, None])
            if not children.any():
                break
            accepted |= children
        return picks

    def pick_every_slot(self, logits: torch.Tensor, tree: "DraftTree") -> torch.Tensor:
        """Sampling, a draw after every slot of a draft tree at its depth's uniform: logits [N, W, V] -> [N, W],
        in one batched call (``pick_along_tree`` on a GPU; on a path it draws what the walk draws)."""
        n, width, _ = logits.shape
        uniform = self.uniforms(n, width, device=logits.device).gather(1, tree.depth)
        return draw(self.probs(logits).flatten(0, 1), uniform.flatten()).view(n, width)

    def accept(self, draft_tokens: torch.Tensor, draft: Proposal | None, logits: torch.Tensor):
        """draft_tokens: [N, k]; logits: [N, k + 1, V] -> (accepted [N], tokens [N, k + 1])"""
        if not self.do_sample:
            return accept_greedy(draft_tokens, logits)
        k = draft_tokens.shape[1]
        p = self.probs(logits)
        if k == 0:  # a plain step (there may be no draft at all)
            tokens = draw(p[:, 0], self.uniforms(p.shape[0], device=p.device))[:, None]
            return tokens.new_zeros(tokens.shape[0]), tokens
        q = dense_proposal(draft.q_ids[:, :k], draft.q_probs[:, :k], logits.shape[-1])
        return accept_sampling(draft_tokens, q, p, self.generator)
