"""Device-side pieces shared by every speculative loop: tapped target features, target sampling
processors, and lossless acceptance (greedy prefix match or rejection sampling with a sparse q).

Shipped with saved heads as remote code (sibling of ``modeling_dflash2.py``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch.profiler import record_function


def tapped_features(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the target's hidden states after each tapped layer: [N, L, taps * H].

    ``hidden_states`` is a Transformers ``outputs.hidden_states`` tuple, where index 0 is the
    embedding output, so layer ``i`` is entry ``i + 1``.
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def last_position(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``logits_to_keep`` for a prefill of ``length`` positions that needs only the last one's logits.

    As an index tensor, not the integer 1: Transformers slices ``hidden[:, -1:, :]`` for an integer, and
    ``F.linear`` on that non-contiguous 3-D slice copies the LM head weight once per row, which dominates a
    batched prefill; indexing gives a contiguous slice."""
    return torch.tensor([length - 1], device=device)


def process_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, top-k and top-p on [..., V] logits (batched; -inf outside the kept set)."""
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:  # 0 keeps the likeliest token only, as generate's top-p
        logits = logits.masked_fill(outside_nucleus(logits, top_p), float("-inf"))
    return logits


# A CPU sorts a 49K vocabulary for each of a round's 16 slots in longer than the target's forward takes;
# the top 256 hold the top-p nucleus in almost every row, and the full sort stays as the fallback.
NUCLEUS_SEARCH = 256


def outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] float logits -> [..., V] bool: the tokens top-p removes. A token stays when the tokens
    likelier than it hold less than ``top_p`` of the mass (so the most likely token always stays)."""
    if logits.device.type != "cpu" or NUCLEUS_SEARCH >= logits.shape[-1]:
        return _outside_nucleus_sorted(logits, top_p)
    values, order = logits.topk(NUCLEUS_SEARCH, dim=-1)
    probs = (values - logits.logsumexp(-1, keepdim=True)).exp()
    before = probs.cumsum(-1) - probs
    removed = before >= top_p
    removed[..., 0] = False  # the likeliest token stays, even at top_p = 0
    outside = torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, removed)
    wide = before[..., -1] < top_p  # rows whose nucleus goes past their top NUCLEUS_SEARCH
    if wide.any():  # a host read: free on a CPU
        outside[wide] = _outside_nucleus_sorted(logits[wide], top_p)
    return outside


def _outside_nucleus_sorted(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    return remove_sorted.scatter(-1, order, remove_sorted)


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


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [N, V] (non-negative, any total) at ``uniform`` [N] in [0, 1): the first
    token whose cumulative weight passes ``uniform`` times the row's total, an exact draw from the normalised
    weights. It reads one uniform per row; ``torch.multinomial`` draws V exponentials, which on a CPU take
    longer than the cumulative sum."""
    cumulative = weights.double().cumsum(-1)  # float64: float32 sums over a 49K vocabulary drop the smallest tokens
    total = cumulative[:, -1]
    drawable = (total > 0) & total.isfinite()
    if weights.device.type == "cpu" and not bool(drawable.all()):  # a host read: free on a CPU only
        row = int((~drawable).nonzero()[0])
        raise ValueError(f"no token can be drawn in row {row}: its sampling weights sum to {float(total[row])} "
                         "(every token's probability is 0 or NaN; a logits processor may have removed every token)")
    at = (uniform.double() * total)[:, None]
    return torch.searchsorted(cumulative, at, right=True).squeeze(-1).clamp_max(weights.shape[-1] - 1)


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
    ``norm(max(0, p - q))``, or from ``p`` after a fully accepted block (one draw per row, at that position
    only). Returns like ``accept_greedy`` (``tokens`` after the bonus repeat it).
    """
    n, s = draft_tokens.shape
    p_draft = p[:, :s].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_draft = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    ratio = p_draft / q_draft.clamp_min(torch.finfo(torch.float32).tiny)
    uniform = torch.rand(ratio.shape, generator=generator, device=ratio.device)
    keep = (uniform <= ratio).int().cumprod(dim=-1)
    accepted = keep.sum(-1)
    rows = torch.arange(n, device=draft_tokens.device)
    p_next = p[rows, accepted]  # [N, V]
    weights = p_next
    if s:
        residual = (p_next - q[rows, accepted.clamp_max(s - 1)]).clamp_min(0.0)
        # A zero residual means p == q at that position: rejection cannot happen there, any row will do.
        rejected = (accepted < s)[:, None] & (residual.sum(-1, keepdim=True) > 0)
        weights = torch.where(rejected, residual, p_next)
    resampled = draw(weights, torch.rand(n, generator=generator, device=p.device, dtype=torch.float64))
    positions = torch.arange(s + 1, device=draft_tokens.device)
    drafts_padded = torch.cat([draft_tokens, resampled[:, None]], dim=1)
    tokens = torch.where(positions[None] < accepted[:, None], drafts_padded, resampled[:, None])
    return accepted, tokens


NGRAM_MAX = 4  # longest n-gram a draft may be matched on (the policy keeps one calibration per size)
DEFAULT_NGRAM_SIZE = 3
NGRAM_BLOCK = 16  # a round may verify up to 15 n-gram drafts, even after a head trained on shorter blocks


def check_ngram_size(value, name: str = "ngram_size") -> None:
    """A clear error before any forward pass for an n-gram size outside 0..NGRAM_MAX."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= NGRAM_MAX:
        raise ValueError(f"{name} must be an integer in 0..{NGRAM_MAX} (0: no n-gram drafts), got {value!r}")


def round_block_size(drafter, ngram_size: int, block_size: int | None = None, room: int | None = None,
                     cost_model=None) -> int:
    """The loop's block (anchor + most drafts a round verifies): ``block_size`` if given; else the head's,
    widened to ``NGRAM_BLOCK`` when n-gram drafts are on (a long n-gram match can run past the head's
    block, and a verify of 16 tokens costs little more than one of 8), but never past ``room`` positions or
    the blocks a given ``cost_model`` covers."""
    if block_size:
        return block_size
    head = drafter.config.block_size
    if not ngram_size:
        return head
    widest = min(NGRAM_BLOCK, room if room is not None else NGRAM_BLOCK,
                 cost_model.block_size if cost_model is not None else NGRAM_BLOCK)
    return max(head, widest)


def ngram_draft(history: torch.Tensor, length: torch.Tensor, num_tokens: int, ngram_size: int = 3):
    """Prompt-lookup drafts on the device: per row, the most recent earlier occurrence of the row's last
    ``n`` tokens (the longest ``n <= ngram_size`` that occurs) and the tokens that followed it.

    history: [N, T] token ids, -1 where a row has none (left padding); length: [N] tokens in use per row
    (``history[:, :length]``, the anchor last). -> (tokens [N, num_tokens], size [N]: the matched ``n``,
    0 where nothing matched). A continuation that runs into the row's end repeats the span between the
    match and the end, which is what a row caught in a loop will say next.
    """
    n_rows, width = history.shape
    device = history.device
    size = torch.zeros(n_rows, dtype=torch.long, device=device)
    start = torch.zeros(n_rows, dtype=torch.long, device=device)  # where the continuation begins
    largest = min(ngram_size, NGRAM_MAX, width - 1)
    if largest >= 1:
        # Matches are found by where they end: the match ending at e is as long as the run of suffix tokens
        # the text before e repeats. suffix[:, j]: the token j places before the row's last one. A match ends
        # before that last token, so it is an earlier occurrence.
        suffix = history.gather(1, (length[:, None] - 1 - torch.arange(largest, device=device)).clamp_min(0))
        ends = torch.arange(width, device=device)
        run = (history == suffix[:, :1]) & (ends[None] + 1 < length[:, None])  # [N, T] a 1-gram ends at e
        reach = run.long()
        for j in range(1, largest):
            earlier = torch.zeros_like(run)
            earlier[:, j:] = history[:, :-j] == suffix[:, j : j + 1]
            run = run & earlier
            reach += run
        real = (suffix >= 0).long().cumprod(-1).sum(-1, keepdim=True)  # [N, 1] suffix tokens that are not padding
        reach = torch.minimum(reach, real)
        # the longest match first, then the most recent: one max over (length, end)
        best = torch.where(reach > 0, reach * width + ends[None], -1).amax(-1)
        size = torch.where(best >= 0, best // width, 0)
        start = torch.where(best >= 0, best % width + 1, 0)
    period = (length - start).clamp_min(1)
    offsets = torch.arange(num_tokens, device=device)
    index = (start[:, None] + offsets[None] % period[:, None]).clamp(0, width - 1)
    final_token = history.gather(1, (length[:, None] - 1).clamp_min(0))  # rows without a match: a real token
    return torch.where(size[:, None] > 0, history.gather(1, index), final_token), size


@dataclass
class Proposal:
    """One round's drafts, each row from the head or from an n-gram match.

    tokens: [N, S]; confidence: [N, S] (the head's, 1 for n-gram tokens, 0 where a row has no draft);
    source: [N] 0 = the head, n >= 1 = an n-gram match of n tokens, -1 = no draft; q_ids / q_probs:
    [N, S, K] the proposal distribution as ``DraftOutput`` (one-hot on n-gram rows), None when greedy
    without a head draft. When the head drafted, its draft also comes as it was before the per-row choice
    (head_tokens / head_confidence [N, S]), with the n-gram lookup (ngram_tokens [N, S], ngram_size [N])
    when there was one and the head's continuations ranked by path probability (node_tokens / node_depth /
    node_logp / node_parent [N, M], ``generation.trees.HeadNodes``) when asked for, so that a round may verify
    them as a tree (``generation.trees``).
    """

    tokens: torch.Tensor
    confidence: torch.Tensor
    source: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None
    head_tokens: torch.Tensor | None = None
    head_confidence: torch.Tensor | None = None
    ngram_tokens: torch.Tensor | None = None
    ngram_size: torch.Tensor | None = None
    node_tokens: torch.Tensor | None = None
    node_depth: torch.Tensor | None = None
    node_logp: torch.Tensor | None = None
    node_parent: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "Proposal":
        return Proposal(*(None if t is None else t[rows] for t in vars(self).values()))

    @property
    def uses_head(self) -> torch.Tensor:
        return (self.source == 0).any()


def one_hot_proposal(tokens: torch.Tensor, like_ids: torch.Tensor | None, vocab_size: int):
    """q for deterministic drafts ([N, S] tokens) in the layout of ``like_ids`` [N, S, K] (None: K = 1)."""
    if like_ids is None or like_ids.shape[-1] == 1:
        return tokens[..., None], torch.ones(*tokens.shape, 1, dtype=torch.float32, device=tokens.device)
    if like_ids.shape[-1] == vocab_size:  # dense ids (0..V-1): the probabilities carry the token
        probs = torch.zeros(like_ids.shape, dtype=torch.float32, device=tokens.device)
        return like_ids, probs.scatter_(-1, tokens[..., None], 1.0)
    probs = torch.zeros(like_ids.shape, dtype=torch.float32, device=tokens.device)
    probs[..., 0] = 1.0
    return tokens[..., None].expand_as(like_ids), probs


def make_proposal(draft, ngram_tokens: torch.Tensor | None, ngram_size: torch.Tensor | None,
                  use_ngram: torch.Tensor | None, anchor: torch.Tensor, vocab_size: int) -> Proposal:
    """Merge the head's ``DraftOutput`` (or None) with n-gram drafts (or None), per row: ``use_ngram`` [N]
    picks the n-gram where it matched. Rows with neither get the anchor as filler and confidence 0."""
    if ngram_tokens is None:
        source = torch.zeros_like(anchor)
        return Proposal(draft.tokens, draft.confidence, source, draft.q_ids, draft.q_probs)
    s = ngram_tokens.shape[1]
    matched = ngram_size > 0
    if draft is None:
        tokens = torch.where(matched[:, None], ngram_tokens, anchor[:, None])
        confidence = matched[:, None].float().expand(-1, s)
        q_ids, q_probs = one_hot_proposal(tokens, None, vocab_size)
        return Proposal(tokens, confidence, torch.where(matched, ngram_size, -1), q_ids, q_probs)
    use = (use_ngram & matched)[:, None]
    tokens = torch.where(use, ngram_tokens, draft.tokens)
    confidence = torch.where(use, 1.0, draft.confidence.float())
    q_ids, q_probs = draft.q_ids, draft.q_probs
    if q_ids is not None:
        ngram_ids, ngram_probs = one_hot_proposal(ngram_tokens, q_ids, vocab_size)
        q_ids = torch.where(use[..., None], ngram_ids, q_ids)
        q_probs = torch.where(use[..., None], ngram_probs, q_probs.float())
    return Proposal(tokens, confidence, torch.where(use[:, 0], ngram_size, 0), q_ids, q_probs)


def _padded(draft, width: int, anchor: torch.Tensor, vocab_size: int):
    """A head's draft widened to ``width`` positions: the anchor as filler, confidence 0 (never verified
    for a head row, since acceptance there is expected to be 0), a one-hot q."""
    extra = width - draft.tokens.shape[1]
    filler = anchor[:, None].expand(-1, extra)
    q_ids = q_probs = None
    if draft.q_ids is not None:
        filler_ids, filler_probs = one_hot_proposal(filler, draft.q_ids[:, :1].expand(-1, extra, -1), vocab_size)
        q_ids = torch.cat([draft.q_ids, filler_ids], dim=1)
        q_probs = torch.cat([draft.q_probs.float(), filler_probs], dim=1)
    confidence = torch.cat([draft.confidence.float(), draft.confidence.new_zeros(anchor.shape[0], extra).float()], 1)
    return Proposal(torch.cat([draft.tokens, filler], dim=1), confidence, torch.zeros_like(anchor), q_ids, q_probs)


def takes_logits_processor(drafter) -> bool:
    """Whether the head's ``draft_block`` takes a ``logits_processor`` (heads saved with remote code by
    0.1.0 before processors reached the draft do not; they draft without it, and the output is the target's
    either way)."""
    parameters = inspect.signature(drafter.draft_block).parameters.values()
    return any(p.name == "logits_processor" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def propose(drafter, policy, context, anchor: torch.Tensor, anchor_pos: torch.Tensor, block_size: int,
            temperature: float = 0.0, generator: torch.Generator | None = None, ngram_size: int = 0,
            history: torch.Tensor | None = None, length: torch.Tensor | None = None,
            rank_nodes=None, draft_logits_processor=None) -> tuple[Proposal | None, bool]:
    """One round's drafts after ``anchor`` / ``anchor_pos`` [N]: the head's draft pass if the policy wants
    it, n-gram matches against ``history`` [N, T] / ``length`` [N] if ``ngram_size``, each row from the
    source the policy prefers, and, for draft trees, the head's continuations ranked by ``rank_nodes``
    (``DraftOutput`` -> ``HeadNodes``) -> (proposal, or None for a plain step; whether the head drafted).
    With ``rank_nodes`` (a tree round) and a head draft, no per-row choice is made: the tree's plan
    weighs the sources as they are. ``draft_logits_processor``: see ``DFlash2DraftModel.draft_block`` (pass
    one only to a head that takes it, ``takes_logits_processor``)."""
    vocab = drafter.bound_target.lm_head_weight.shape[0]
    head_drafts = policy.wants_draft()
    ngram_tokens = ngram_sizes = None
    # a lookup whose match the policy would not verify alone is time a plain round need not spend
    if ngram_size and (head_drafts or policy.wants_ngram()):
        with record_function("dflash2::ngram"):
            ngram_tokens, ngram_sizes = ngram_draft(history, length, block_size - 1, ngram_size)
    draft = nodes = None
    if head_drafts:
        with record_function("dflash2::draft"):
            hook = {} if draft_logits_processor is None else {"logits_processor": draft_logits_processor}
            draft = drafter.draft_block(anchor, anchor_pos, context.kv, context.valid, context.positions,
                                        temperature, generator, min(block_size, drafter.config.block_size), **hook)
            if rank_nodes is not None:
                nodes = rank_nodes(draft)
        if draft.tokens.shape[1] < block_size - 1:  # the round is wider than the head's own block
            draft = _padded(draft, block_size - 1, anchor, vocab)
    elif ngram_tokens is None:
        return None, False
    if draft is not None and rank_nodes is not None:
        proposal = make_proposal(draft, None, None, None, anchor, vocab)  # the head's draft as it is
    else:
        use_ngram = None
        if ngram_tokens is not None:
            use_ngram = policy.use_ngram(None if draft is None else draft.confidence, ngram_sizes)
        proposal = make_proposal(draft, ngram_tokens, ngram_sizes, use_ngram, anchor, vocab)
    if draft is not None:
        proposal.head_tokens, proposal.head_confidence = draft.tokens, draft.confidence.float()
        proposal.ngram_tokens, proposal.ngram_size = ngram_tokens, ngram_sizes
        if nodes is not None:
            proposal.node_tokens, proposal.node_depth = nodes.tokens, nodes.depth
            proposal.node_logp, proposal.node_parent = nodes.logp, nodes.parent
    return proposal, draft is not None


def grown(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` copied into zeros ``size`` long along ``dim`` (buffers that double instead of growing per write)."""
    shape = list(t.shape)
    shape[dim] = size
    bigger = t.new_zeros(shape)
    bigger.narrow(dim, 0, t.shape[dim]).copy_(t)
    return bigger


class DraftContext:
    """The drafter's context: per-layer K/V of the target's tapped features, slot validity and positions.

    Slots line up one-to-one with the target's KV-cache slots: a draft rejected by one row but kept by
    another stays as a masked hole (``valid`` False). Buffers are preallocated for ``capacity`` slots
    (doubled only if a call outgrows them), so a round writes in place instead of concatenating.

    The K/V of appended features are projected when a draft pass next reads ``kv``, all pending slots in
    one projection: rounds that run plain steps (a head that does not pay) add no drafter work, and a
    verify's rejected tail, cropped before the next draft, is never projected.

    kv: per drafter layer (k, v) [N, kv_heads, T, head_dim]; valid: [N, T] bool; positions: [N, T] long.
    """

    def __init__(self, drafter, n_rows: int, capacity: int, device: torch.device | str):
        self.drafter = drafter
        self.length = 0
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # allocated on the first projection
        self._projected = 0  # slots [0, _projected) hold their K/V; the rest are in _pending
        self._pending: list[torch.Tensor] = []  # features [N, L, taps * H] of slots _projected.., in order
        self._valid = torch.zeros(n_rows, capacity, dtype=torch.bool, device=device)
        self._positions = torch.zeros(n_rows, capacity, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self._valid.shape[1]

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        self._project_pending()
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self._kv]

    @property
    def valid(self) -> torch.Tensor:
        return self._valid[:, : self.length]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[:, : self.length]

    def _reserve(self, end: int) -> None:
        if end <= self.capacity:
            return
        size = max(end, 2 * self.capacity)
        self._valid, self._positions = grown(self._valid, 1, size), grown(self._positions, 1, size)
        if self._kv is not None:
            self._kv = [(grown(k, 2, size), grown(v, 2, size)) for k, v in self._kv]

    def verify_mask(self, width: int) -> torch.Tensor:
        """[N, T + width] attention mask for a target forward over ``width`` new slots (all visible).

        The new slots are marked valid in place; ``append`` then overwrites them with what was accepted.
        """
        self._reserve(self.length + width)
        self._valid[:, self.length : self.length + width] = True
        return self._valid[:, : self.length + width]

    def append(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """features: [N, L, taps * H] tapped target features; positions: [N, L]; valid: [N, L] bool (None: all)."""
        start, end = self.length, self.length + features.shape[1]
        self._reserve(end)
        self._pending.append(features)
        self._valid[:, start:end] = True if valid is None else valid
        self._positions[:, start:end] = positions
        self.length = end

    def _project_pending(self) -> None:
        if not self._pending:
            return
        features = self._pending[0] if len(self._pending) == 1 else torch.cat(self._pending, dim=1)
        start, end = self._projected, self._projected + features.shape[1]
        new_kv = self.drafter.context_kv(self.drafter.project_context(features), self._positions[:, start:end])
        if self._kv is None:
            self._kv = [(k.new_zeros(*k.shape[:2], self.capacity, k.shape[3]),
                         v.new_zeros(*v.shape[:2], self.capacity, v.shape[3])) for k, v in new_kv]
        for (k_buffer, v_buffer), (k, v) in zip(self._kv, new_kv):
            k_buffer[:, :, start:end] = k
            v_buffer[:, :, start:end] = v
        self._pending, self._projected = [], end

    def crop(self, drop: int) -> None:
        """Forget the last ``drop`` slots (as ``DynamicCache.crop(-drop)`` does for the target)."""
        self.length -= drop
        if self._projected > self.length:
            self._projected = self.length
        excess = self._projected + sum(f.shape[1] for f in self._pending) - self.length
        while excess > 0:  # the dropped slots that were never projected
            last = self._pending.pop()
            if last.shape[1] > excess:
                self._pending.append(last[:, : last.shape[1] - excess])
            excess -= last.shape[1]

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows ([n] indices), e.g. once other rows have finished."""
        self._valid, self._positions = self._valid[rows], self._positions[rows]
        self._pending = [features[rows] for features in self._pending]
        if self._kv is not None:
            self._kv = [(k[rows], v[rows]) for k, v in self._kv]


class SpeculativeStats:
    """Acceptance statistics of one generation call, accumulated on the device (no host sync per round).

    Counted per row and round: ``verify_length_histogram[k]`` rounds that verified ``k`` drafted tokens
    (0 = a plain AR step through the verify path); ``accepted_histogram[a]`` rounds that accepted ``a``.
    ``acceptance_length`` (tau) is tokens committed per verify forward, bonus included;
    ``per_position_acceptance[j]`` is P(draft j+1 accepted | drafts 1..j accepted and draft j+1 verified).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._joint = None  # [B, B] rounds by (drafts verified, drafts accepted)
        self._committed = None
        # [3] rows x rounds: that verified n-gram drafts, n-gram drafts accepted, that verified a draft tree
        self._source_counts = None
        self.draft_passes = 0  # forwards of the head (one per round that drafted, whatever the batch)
        self.verify_forwards = 0  # forwards of the target after the prefill (a plain step is one too)
        self.costs: dict | None = None  # the adaptive policy's cost model (seconds per verify width, per draft)

    def record(
        self,
        accepted: torch.Tensor,
        committed: torch.Tensor,
        active: torch.Tensor | None = None,
        verified: int | None = None,
        source: torch.Tensor | None = None,
        tree: bool = False,
    ) -> None:
        """accepted, committed: [N] per row this round; active: [N] bool, rows that really verified;
        verified: drafted tokens verified this round (``B - 1`` when not given); source: [N] where each
        row's drafts came from (``Proposal.source``: n >= 1 an n-gram match; for a tree, the branch that
        was accepted further); tree: the round verified a draft tree (``generation.trees``)."""
        b = self.block_size
        if self._joint is None:
            self._joint = torch.zeros(b * b, dtype=torch.long, device=accepted.device)
            self._committed = torch.zeros((), dtype=torch.long, device=accepted.device)
            self._source_counts = torch.zeros(3, dtype=torch.long, device=accepted.device)
        weight = torch.ones_like(accepted, dtype=torch.long) if active is None else active.long()
        verified = b - 1 if verified is None else min(max(int(verified), 0), b - 1)
        accepted = accepted.long().clamp(0, verified)
        self._joint.scatter_add_(0, verified * b + accepted, weight)
        self._committed += (committed.long() * weight).sum()
        if source is not None and verified > 0:
            ngram = (source > 0).long() * weight
            self._source_counts += torch.stack([ngram.sum(), (ngram * accepted).sum(), weight.sum() * tree])

    def _joint_table(self) -> list[list[int]]:
        b = self.block_size
        if self._joint is None:
            return [[0] * b for _ in range(b)]
        flat = self._joint.tolist()
        return [flat[k * b : (k + 1) * b] for k in range(b)]

    @property
    def accepted_histogram(self) -> list[int]:
        return [sum(column) for column in zip(*self._joint_table())]

    @property
    def verify_length_histogram(self) -> list[int]:
        return [sum(row) for row in self._joint_table()]

    @property
    def rounds(self) -> int:
        return sum(self.verify_length_histogram)

    @property
    def drafted(self) -> int:
        """Drafted tokens that were verified."""
        return sum(k * c for k, c in enumerate(self.verify_length_histogram))

    @property
    def accepted(self) -> int:
        return sum(k * c for k, c in enumerate(self.accepted_histogram))

    @property
    def committed(self) -> int:
        return int(self._committed) if self._committed is not None else 0

    @property
    def ngram_rounds(self) -> int:
        """Rows x rounds whose verified drafts came from an n-gram match rather than the head."""
        return int(self._source_counts[0]) if self._source_counts is not None else 0

    @property
    def ngram_accepted(self) -> int:
        return int(self._source_counts[1]) if self._source_counts is not None else 0

    @property
    def tree_rounds(self) -> int:
        """Rows x rounds that verified a draft tree (``generation.trees``) rather than one chain."""
        return int(self._source_counts[2]) if self._source_counts is not None else 0

    @property
    def acceptance_length(self) -> float:
        rounds = self.rounds
        return self.committed / rounds if rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return self.acceptance_by_position(self._joint_table())

    @staticmethod
    def acceptance_by_position(joint: list[list[int]]) -> list[float]:
        """Per position j: P(draft j+1 accepted | drafts 1..j accepted and draft j+1 verified), from a
        ``joint[verified][accepted]`` round count table (``as_dict()["verified_accepted"]``, summed over
        calls). Rounds that verified fewer than j+1 drafts (plain steps above all) say nothing about it."""
        block_size, rates = len(joint), []
        for j in range(block_size - 1):
            reached = sum(joint[k][a] for k in range(j + 1, block_size) for a in range(j, k + 1))
            passed = sum(joint[k][a] for k in range(j + 1, block_size) for a in range(j + 1, k + 1))
            rates.append(passed / reached if reached else 0.0)
        return rates

    def merge(self, other: "SpeculativeStats") -> "SpeculativeStats":
        if other._joint is not None:
            if self._joint is None:
                self._joint = other._joint.clone()
                self._committed = other._committed.clone()
                self._source_counts = other._source_counts.clone()
            else:
                self._joint += other._joint.to(self._joint.device)
                self._committed += other._committed.to(self._committed.device)
                self._source_counts += other._source_counts.to(self._source_counts.device)
        self.draft_passes += other.draft_passes
        self.verify_forwards += other.verify_forwards
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
            "verify_length_histogram": self.verify_length_histogram,
            "verified_accepted": self._joint_table(),
            "ngram_rounds": self.ngram_rounds,
            "ngram_accepted": self.ngram_accepted,
            "tree_rounds": self.tree_rounds,
            "draft_passes": self.draft_passes,
            "verify_forwards": self.verify_forwards,
            **({"costs": {k: self.costs[k] for k in ("verify_seconds", "draft_seconds")}} if self.costs else {}),
        }

    def __repr__(self) -> str:
        return (
            f"SpeculativeStats(tau={self.acceptance_length:.3f}, rounds={self.rounds}, accepted={self.accepted}, "
            f"ngram_rounds={self.ngram_rounds}, tree_rounds={self.tree_rounds}, draft_passes={self.draft_passes}, "
            f"verify_lengths={self.verify_length_histogram})"
        )
