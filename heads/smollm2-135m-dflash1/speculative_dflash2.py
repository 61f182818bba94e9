"""Device-side pieces shared by every speculative loop: tapped target features, target sampling
processors, and lossless acceptance (greedy prefix match or rejection sampling with a sparse q).

Shipped with saved heads as remote code (sibling of ``modeling_dflash2.py``).
"""

from __future__ import annotations

import torch


def tapped_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the target's hidden states after each tapped layer: [N, L, taps * H].

    ``hidden_states`` is a Transformers ``outputs.hidden_states`` tuple, where index 0 is the
    embedding output, so layer ``i`` is entry ``i + 1``.
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Temperature, top-k and top-p on [..., V] logits (batched; -inf outside the kept set)."""
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def dense_proposal(q_ids: torch.Tensor, q_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter a sparse proposal ([N, S, K] ids and probabilities) into [N, S, V]."""
    if q_ids.shape[-1] == vocab_size:
        return q_probs.float()
    dense = torch.zeros(*q_ids.shape[:-1], vocab_size, dtype=torch.float32, device=q_ids.device)
    return dense.scatter_add_(-1, q_ids, q_probs.float())


def accept_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of the drafts equal to the target's argmax, then the target's bonus token.

    draft_tokens: [N, S]; target_logits: [N, S + 1, V] -> (accepted [N] in 0..S, tokens [N, S + 1]) where
    ``tokens[:, :accepted]`` are the accepted drafts and ``tokens[:, accepted]`` is the bonus token.
    """
    target_tokens = target_logits.argmax(-1)
    matches = (draft_tokens == target_tokens[:, :-1]).int().cumprod(dim=-1)
    accepted = matches.sum(-1)
    # Accepted drafts equal the target's argmax there, so the target's own tokens are the output.
    return accepted, target_tokens


def accept_sampling(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al., Chen et al.) for a whole batch at once.

    draft_tokens: [N, S]; q: [N, S, V] proposal the drafts were sampled from; p: [N, S + 1, V] target
    probabilities (after temperature / top-k / top-p). Draft i is kept with probability
    ``min(1, p_i(x) / q_i(x))`` until the first rejection; there a token is drawn from
    ``norm(max(0, p - q))``, or from ``p`` after a fully accepted block. Returns like ``accept_greedy``.
    """
    n, s = draft_tokens.shape
    p_draft = p[:, :s].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = p_draft / q_draft.clamp_min(torch.finfo(torch.float32).tiny)
    uniform = torch.rand(ratio.shape, generator=generator, device=ratio.device)
    keep = (uniform <= ratio).int().cumprod(dim=-1)
    accepted = keep.sum(-1)
    residual = (p[:, :s] - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    # A zero residual means p == q at that position: rejection cannot happen there, any row will do.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :s])
    fallback = torch.cat([residual, p[:, s:]], dim=1)  # [N, S + 1, V]
    resampled = torch.multinomial(fallback.flatten(0, 1), 1, generator=generator).view(n, s + 1)
    positions = torch.arange(s + 1, device=draft_tokens.device)
    drafts_padded = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)
    tokens = torch.where(positions[None] < accepted[:, None], drafts_padded, resampled)
    return accepted, tokens


class SpeculativeStats:
    """Acceptance statistics of one generation call, accumulated on the device (no host sync per round).

    ``acceptance_length`` (tau) is tokens committed per verify forward, bonus included;
    ``per_position_acceptance[k]`` is P(draft k+1 accepted | drafts 1..k accepted).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._histogram = None  # [B] rounds by number of accepted drafts
        self._committed = None

    def record(self, accepted: torch.Tensor, committed: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """accepted, committed: [N] per row this round; active: [N] bool, rows that really verified."""
        if self._histogram is None:
            self._histogram = torch.zeros(self.block_size, dtype=torch.long, device=accepted.device)
            self._committed = torch.zeros((), dtype=torch.long, device=accepted.device)
        weight = torch.ones_like(accepted, dtype=torch.long) if active is None else active.long()
        self._histogram.scatter_add_(0, accepted.long().clamp(0, self.block_size - 1), weight)
        self._committed += (committed.long() * weight).sum()

    @property
    def accepted_histogram(self) -> list[int]:
        return self._histogram.tolist() if self._histogram is not None else [0] * self.block_size

    @property
    def rounds(self) -> int:
        return sum(self.accepted_histogram)

    @property
    def drafted(self) -> int:
        return self.rounds * (self.block_size - 1)

    @property
    def accepted(self) -> int:
        return sum(k * c for k, c in enumerate(self.accepted_histogram))

    @property
    def committed(self) -> int:
        return int(self._committed) if self._committed is not None else 0

    @property
    def acceptance_length(self) -> float:
        rounds = self.rounds
        return self.committed / rounds if rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        histogram = self.accepted_histogram
        rates, reached = [], sum(histogram)
        for k in range(self.block_size - 1):
            passed = sum(histogram[k + 1 :])
            rates.append(passed / reached if reached else 0.0)
            reached = passed
        return rates

    def merge(self, other: "SpeculativeStats") -> "SpeculativeStats":
        if other._histogram is not None:
            if self._histogram is None:
                self._histogram = other._histogram.clone()
                self._committed = other._committed.clone()
            else:
                self._histogram += other._histogram.to(self._histogram.device)
                self._committed += other._committed.to(self._committed.device)
        return self

    def as_dict(self) -> dict:
        return {
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "committed": self.committed,
            "accepted_histogram": self.accepted_histogram,
        }

    def __repr__(self) -> str:
        return f"SpeculativeStats(tau={self.acceptance_length:.3f}, rounds={self.rounds}, accepted={self.accepted})"
