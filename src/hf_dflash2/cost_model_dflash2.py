"""How many drafted tokens to verify: a measured cost model and the verify-length policies.

A round drafts ``S = B - 1`` tokens, then verifies the anchor and the first ``k`` drafts in one target
forward (``k = 0`` is exactly a plain AR step, which still hands the drafter its context features).
``AdaptiveVerifyPolicy`` picks ``k`` to maximise expected committed tokens per second::

    E[committed | k] = 1 + sum_{j <= k} prod_{i <= j} a_i,   rate(k) = E[committed | k] / (verify(k + 1) + draft)

``a_i`` is the drafter's own confidence at position ``i`` (``DraftOutput.confidence``) times a calibration
ratio learnt during the call: per position, (accepted + c * g) / (predicted + c), shrunk towards the pooled
ratio ``g`` of all positions, which itself starts at ``prior_ratio`` = 0.5 (heads, fresh ones above all,
tend to be over-confident) with ``c0`` pseudo-counts.

The draft paid when the best ``rate(k)``, ``k >= 1``, beats a plain step's ``1 / verify(1)`` by
``pay_margin`` (near-ties go to the plain step: a noisy estimate loses there more often than it gains); that
``k`` is verified. When it did not pay, the draft's time is spent anyway, so ``k`` then trades verify time only:
``gain(k) = E[committed | k] - verify(k + 1) / verify(1)`` (tokens beyond what plain steps would commit in
the same time; ``gain(0) = 0``). Because a verify of 2 tokens costs about one of 1 on a CPU, a weak draft
is still checked once made, and each check feeds the calibration: a head whose confidence is calibrated
too low is not locked out.

The cost model is one measurement, taken once and cached; on a shared CPU one noisy entry (a verify of
two timed as cheap as a plain step) flips the decision for every later call. So each call also times its own
rounds, from one ``wants_draft`` to the next (a plain step, or a drafted round of ``k``), as a ratio to
what the cost model predicts for that round (the call's first round, which pays one-off set-up, is not
counted). The median ratios of the last rounds of each kind (plain steps, rounds the head drafted, rounds
that verified n-gram drafts without a draft pass), each shrunk towards the median of all, give ``rho`` per
kind, that kind's cost relative to steps' as measured, over the cost model's own view; a drafted round then
costs ``rho * (verify(k + 1) + draft)``, never less than ``verify(1) + draft``
(threads that wait on a shared CPU can make a plain step time slower than a drafted round), and an n-gram
round ``rho * verify(k + 1)`` with its own ``rho``, since the two kinds' ratios differ (docs/design.md).
N-gram rounds are timed only when chosen, so their median is shrunk harder (``NGRAM_TIMING_PRIOR``): one slow
round must not price them out for good. A round's
measured time is what the round really costs: the accept, the bookkeeping and the context append
included. On CUDA, where the verify runs asynchronously, a round's time partly lands in the next
round's (the host read waits for both); the kinds come in runs, so the medians hardly move. A call that
keeps drafting would never time a plain step, so after ``explore_every`` drafted rounds in a row (4
until two steps are timed) one round is a plain step: it costs a fraction of a percent and keeps
``rho`` honest when the cache calls a losing draft cheap.

When the draft did not pay, the next rounds skip drafting (plain AR steps through the same verify path;
the drafter's context keeps growing, so a later draft is exact) and probe again after m, 2m, 4m, ... up
to ``max_skip`` rounds, where ``m`` keeps the cost of failed probes near 3 % (``probe_overhead``); a probe
that pays resets the backoff.

What a call learnt carries over to the next call with the same target, head, batch, block and cost
model (a user's second ``generate`` is rarely the first): the calibration counts, shrunk to at most
``carry_mass`` predicted acceptances so that the new call still moves them quickly, the round timings,
and the back-off level (a head that did not pay at the end of one call starts the next one with a
few plain steps, and a failed first probe backs off from where the last call stood).

N-gram drafts (prompt lookup, ``speculative_dflash2.ngram_draft``) are a second source: per row, the most
recent earlier occurrence of the row's last n tokens proposes what followed it, at no draft cost. Their
raw confidence is 1 at every position, and each match size n keeps its own calibration (row n of the
[sources, S] counts; row 0 is the head's), so ``a_i`` becomes the acceptance rate observed for n-gram
drafts of that size at that position. Each row takes the source with the longer expected accepted run.
On rounds the head does not draft (back-off, or n-gram drafts won the last round), a matched n-gram is
verified alone when its rate beats a plain step by ``pay_margin``; after matches alone did not pay, the
lookup itself is skipped for 1, 2, 4, ... up to ``ngram_backoff`` rounds (reset by an n-gram that pays, or at
the next call). Where n-gram drafts keep winning the head's draft pass is skipped, except every
``ngram_streak`` rounds, so that the head can win back.

Draft trees (rounds of the fast loop where the head drafted, greedy or sampling; ``generation.trees``): ``choose_tree``
plans ``(m, kg)``: verify the head's ``m`` likeliest continuations (nodes ranked by the path probability
the head gives them) and ``kg`` tokens of the n-gram's chain. A node is accepted with its path
probability times a calibration rate for its depth (row ``TREE_ROW``: accepted nodes over predicted, so
the rate absorbs how far the head's probabilities are from the truth); nodes add up, since each is its
own event. The n-gram chain hangs from the deepest of those m nodes that spells its first tokens
(depth a), so its ``kg`` drafts add its calibrated reach at depths a+1..a+kg, and the nodes it shares
with the head count once, with the likelier of the two estimates. The cost is that of verifying
``m + kg`` drafts. ``(0, kg)`` is a linear n-gram round, ``(0, 0)`` a plain step. A tree
round calibrates the tree row, and the head's chain and the n-gram's as far as each was in the tree.

Lossless sampling: the law of the output is the target's for any proposal and any verify length chosen
from the past alone. ``k`` must therefore not depend on the sampled draft tokens themselves; at
temperature > 0 the drafter's confidence is the per-position max probability of its unary distribution,
which the draft pass computes before any token is sampled (the selector's q along the sampled path would
depend on the sampled tokens). Greedy output is the target's argmax whatever ``k`` is.

Shipped with saved heads as remote code (sibling of ``candidate_generator_dflash2.py``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
import warnings
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from .speculative_dflash2 import NGRAM_MAX, DraftContext, last_position, tapped_features

TREE_ROW = 1 + NGRAM_MAX  # calibration row of draft-tree head nodes, by depth

# Cached cost models of another version are measured again: bump it when what a measurement means changes
# (what each version changed: CHANGELOG.md).
COST_MODEL_VERSION = 6


def monotone_repair(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators): a longer verify never costs less."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, weight = blocks.pop()
            previous_mean, previous_weight = blocks[-1]
            total = previous_weight + weight
            blocks[-1] = [(previous_mean * previous_weight + mean * weight) / total, total]
    return [mean for mean, weight in blocks for _ in range(int(weight))]


def cost_cache_dir() -> Path:
    return Path(os.environ.get("HF_DFLASH2_CACHE") or Path.home() / ".cache" / "hf_dflash2")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def linear_kernel_of(model) -> str:
    """The kernel ``model``'s linear layers run on: "onednn" when some layer's forward was packed by
    ``hf_dflash2.cpu.linear_kernels`` (it marks its forwards with ``kernel``), else "default"; during a generation
    call that chooses the kernel per forward (``kernels_dflash2.ForwardKernels``), that call's choices."""
    per_forward = model.__dict__.get("_dflash2_forward_kernels")
    if per_forward is not None:
        return per_forward
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and getattr(module.__dict__.get("forward"), "kernel", None):
            return module.__dict__["forward"].kernel
    return "default"


def _config_hash(config) -> str:
    return hashlib.sha256(config.to_json_string(use_diff=False).encode()).hexdigest()[:16]


def cost_key(target, drafter, batch_size: int, block_size: int, context_length: int) -> dict:
    """What a measurement depends on: machine, dtype, threads, the target's and the drafter's shapes, and
    the target's attention implementation."""
    device = next(target.parameters()).device
    vocab = drafter.draft_vocab
    return {
        "version": COST_MODEL_VERSION,
        "device": f"{device.type}:{_device_name(device)}",
        "dtype": str(next(target.parameters()).dtype),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "target": getattr(target.config, "_name_or_path", "") or type(target).__name__,
        "target_config": _config_hash(target.config),
        "drafter_config": _config_hash(drafter.config),
        "draft_vocab": None if vocab is None else int(vocab.numel()),
        "linear_kernel": f"{linear_kernel_of(target)}/{linear_kernel_of(drafter)}",
        "attention": getattr(target.config, "_attn_implementation", None),
        "batch_size": int(batch_size),
        "block_size": int(block_size),
        "context_length": int(context_length),
    }


@dataclass
class CostModel:
    """Seconds per target verify forward of ``k`` new tokens per row (``verify_seconds[k - 1]``, k = 1..B,
    non-decreasing) and per draft pass, for one (machine, dtype, target, drafter, batch, block) key."""

    verify_seconds: list[float]
    draft_seconds: float
    key: dict = field(default_factory=dict)

    def __post_init__(self):
        values = [*self.verify_seconds, self.draft_seconds]
        positive = all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)
        if not self.verify_seconds or not positive:
            raise ValueError(
                f"cost model needs positive finite seconds, got verify={self.verify_seconds} draft={self.draft_seconds}"
            )
        self.verify_seconds = monotone_repair(self.verify_seconds)

    @property
    def block_size(self) -> int:
        return len(self.verify_seconds)

    def verify(self, tokens: int) -> float:
        return self.verify_seconds[tokens - 1]

    def as_dict(self) -> dict:
        return {"key": self.key, "verify_seconds": self.verify_seconds, "draft_seconds": self.draft_seconds}

    def table(self) -> str:
        step = self.verify(1)
        lines = ["| verified tokens | ms | x AR step |", "|---|---|---|"]
        lines += [f"| {k} | {s * 1e3:.2f} | {s / step:.2f} |" for k, s in enumerate(self.verify_seconds, 1)]
        lines.append(f"| draft pass | {self.draft_seconds * 1e3:.2f} | {self.draft_seconds / step:.2f} |")
        return "\n".join(lines)

    @classmethod
    def from_dict(cls, data: dict, block_size: int) -> "CostModel":
        verify, draft = data["verify_seconds"], data["draft_seconds"]
        if not isinstance(verify, list) or len(verify) != block_size:
            raise ValueError(f"verify_seconds must list {block_size} values, got {verify!r}")
        return cls([float(v) for v in verify], float(draft), data.get("key", {}))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_cost_model(target, drafter, batch_size: int = 1, block_size: int | None = None,
                       context_length: int = 256, repeats: int = 3, padded: bool | None = None) -> CostModel:
    """Time the target's verify forward for k = 1..B new tokens after ``context_length`` cached tokens,
    and one draft pass (medians of ``repeats``, round-robin over k so drift hits every k alike).

    ``padded`` (None: at batch > 1): the forwards carry a 2-D mask with a padded slot, as the loop's do at
    batch > 1 (left-padded prompts, and holes where rows accepted less). Without one, Transformers builds no
    mask for a one-token forward, and an unpacked grouped-query target then runs SDPA's ``enable_gqa`` path,
    which on a CPU is slower than the masked path the loop runs (``docs/benchmarks.md``), so every ratio to
    ``verify(1)`` would shrink."""
    block_size = block_size or drafter.config.block_size
    device = next(target.parameters()).device
    limit = target.config.get_text_config().max_position_embeddings or context_length + block_size
    context_length = max(1, min(context_length, limit - 2 * block_size))
    drafter.bind_target(target)
    layer_ids = drafter.config.target_layer_ids
    capture = [i + 1 for i in layer_ids]
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, context_length + block_size), generator=generator).to(device)
    positions = torch.arange(context_length + block_size, device=device).expand(batch_size, -1)
    mask = None
    if padded if padded is not None else batch_size > 1:
        mask = torch.ones(batch_size, context_length + block_size, dtype=torch.long, device=device)
        mask[-1, 0] = 0

    def mask_upto(length: int) -> torch.Tensor | None:
        return None if mask is None else mask[:, :length]

    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # sliding-window layers past their window can then be cropped
    out = target(input_ids=ids[:, :context_length], attention_mask=mask_upto(context_length),
                 position_ids=positions[:, :context_length], cache=cache, use_cache=True,
                 output_hidden_states=capture, logits_to_keep=last_position(context_length, device))
    context = DraftContext(drafter, batch_size, context_length + block_size, device)
    context.append(tapped_features(out.hidden_states, layer_ids), positions[:, :context_length],
                   None if mask is None else mask_upto(context_length).bool())
    anchor_pos = torch.full((batch_size,), context_length, device=device)

    def verify(k):
        target(input_ids=ids[:, context_length : context_length + k],
               attention_mask=mask_upto(context_length + k),
               position_ids=positions[:, context_length : context_length + k], cache=cache, use_cache=True,
               output_hidden_states=capture)
        cache.crop(-k)

    def draft():
        drafter.draft_block(ids[:, context_length], anchor_pos, context.kv, context.valid, context.positions,
                            0.0, None, min(block_size, drafter.config.block_size))  # as the loops draft

    runs = {k: (lambda k=k: verify(k)) for k in range(1, block_size + 1)}
    runs[0] = draft
    times = {k: [] for k in runs}
    for repeat in range(repeats + 1):  # the first pass warms kernels up and is not counted
        for k, fn in runs.items():
            _synchronize(device)
            started = time.perf_counter()
            fn()
            _synchronize(device)
            if repeat:
                times[k].append(time.perf_counter() - started)
    verify_seconds = [statistics.median(times[k]) for k in range(1, block_size + 1)]
    key = cost_key(target, drafter, batch_size, block_size, context_length)
    return CostModel(verify_seconds, statistics.median(times[0]), key)


_COST_MODEL_MEMO: dict[tuple, tuple] = {}  # memo key -> (weakref target, weakref drafter, CostModel)


def _recall(memory: dict, key: tuple, target, drafter):
    """What ``_remember`` stored under ``key`` for these very objects (``id``s can be reused), or None."""
    entry = memory.get(key)
    if entry is not None and entry[0]() is target and entry[1]() is drafter:
        return entry[2]
    return None


def _remember(memory: dict, key: tuple, target, drafter, value) -> None:
    memory[key] = (weakref.ref(target), weakref.ref(drafter), value)


def load_or_measure_cost_model(target, drafter, batch_size: int = 1, block_size: int | None = None,
                               context_length: int = 256, cache_dir: str | Path | None = None,
                               refresh: bool = False) -> CostModel:
    """The cached cost model for this key (memory, then ``cache_dir``), measured and stored when missing.

    A cache file that is unreadable, for another key, or holds non-positive / non-finite seconds is
    ignored with a warning and measured again (never trusted).
    """
    block_size = block_size or drafter.config.block_size
    parameter = next(target.parameters())
    vocab = drafter.draft_vocab
    # Per-call fast path, without hashing configs: the same objects, dtype, device and shape.
    memo_key = (id(target), id(drafter), parameter.dtype, parameter.device, torch.get_num_threads(), batch_size,
             block_size, context_length, None if vocab is None else vocab.numel(), str(cache_dir or cost_cache_dir()),
             linear_kernel_of(target), linear_kernel_of(drafter), getattr(target.config, "_attn_implementation", None))
    remembered = None if refresh else _recall(_COST_MODEL_MEMO, memo_key, target, drafter)
    if remembered is not None:
        return remembered
    key = cost_key(target, drafter, batch_size, block_size, context_length)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = Path(cache_dir or cost_cache_dir()) / f"cost_model-{digest}.json"
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") != key:
                raise ValueError("it was measured for another key")
            model = CostModel.from_dict(data, block_size)
            _remember(_COST_MODEL_MEMO, memo_key, target, drafter, model)
            return model
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            warnings.warn(f"ignoring the cost-model cache file {path}: {error}; measuring again", stacklevel=2)
    model = measure_cost_model(target, drafter, batch_size, block_size, context_length)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(model.as_dict(), indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as error:  # a read-only home still generates, only slower to start next time
        warnings.warn(f"could not write the cost-model cache {path}: {error}", stacklevel=2)
    _remember(_COST_MODEL_MEMO, memo_key, target, drafter, model)
    return model


# Pseudo-rounds shrinking the n-gram rounds' timing median towards all rounds': nothing forces an n-gram round
# (drafts have probes, steps have explore_every), so a kind timed once must not lock itself out.
NGRAM_TIMING_PRIOR = 4.0


# ---------------------------------------------------------------------------------------------- policies
class VerifyPolicy:
    """How many of a round's drafted tokens to verify. One instance serves one generation call.

    The loop asks ``wants_draft()`` (host, before drafting: run the head's draft pass?) and, when not,
    ``wants_ngram()`` (may n-gram matches be looked up and one verified alone this round?); ``use_ngram(head_confidence,
    ngram_size)`` picks each row's source; then ``choose(confidence, source, drafted)`` (a device scalar or
    an int; it rides on the loop's one host read) gives ``k``, told back with ``chosen(k, head_used)``;
    the outcome comes with ``observe(confidence, k, accepted, source)`` (device tensors, no host read).

    ``room``: set by the loop each round, the most drafts any running row could still commit before its
    token budget ends (an upper bound before the round's host read, exact from ``chosen`` on; None:
    unknown). The loop caps a chain's ``k`` (and a tree's n-gram branch) at it, whatever ``choose`` says.
    """

    room: int | None = None

    def start(self, block_size: int) -> "VerifyPolicy":
        self.block_size = block_size
        return self

    @property
    def out_of_room(self) -> bool:
        """No running row can commit a draft before its token budget ends (as far as ``room`` says)."""
        return self.room is not None and self.room <= 0

    def wants_draft(self) -> bool:
        return True

    def wants_ngram(self) -> bool:
        return True

    def use_ngram(self, head_confidence: torch.Tensor | None, ngram_size: torch.Tensor) -> torch.Tensor:
        """[N] bool: rows whose draft comes from their n-gram match: here, a match of at least 2 tokens
        (prompt lookup's usual trigger), or any match when the head did not draft."""
        return ngram_size > (0 if head_confidence is None else 1)

    def choose(self, confidence: torch.Tensor | None, source: torch.Tensor | None = None,
               drafted: bool = True) -> torch.Tensor | int:
        return self.block_size - 1

    def chosen(self, k: int, head_used: bool = True) -> None:
        pass

    def observe(self, confidence: torch.Tensor | None, k: "int | torch.Tensor", accepted: torch.Tensor,
                source: torch.Tensor | None = None) -> None:
        """A round verified ``k`` drafts (one count, or [N] per row) and ``accepted`` [N] of them."""

    #: Whether ``choose_tree`` may be asked, on greedy rounds where the head drafted.
    plans_trees = False

    def choose_tree(self, node_logp: torch.Tensor, node_depth: torch.Tensor, ngram_size: torch.Tensor,
                    spells_ngram: torch.Tensor) -> torch.Tensor:
        """[2] (m, kg): verify the head's ``m`` likeliest continuations and ``kg`` more n-gram drafts as
        one tree (``generation.trees``); (0, kg) is a linear n-gram round, (0, 0) a plain step. node_logp,
        node_depth: [N, M] the ranked nodes' path log-probabilities and depths; ngram_size: [N] (0: no
        match); spells_ngram: [N, M] whether each node's path spells the n-gram draft's first tokens."""
        raise NotImplementedError

    def observe_tree(self, node_logp: torch.Tensor, node_depth: torch.Tensor, accepted: torch.Tensor) -> None:
        pass


class FixedVerifyLength(VerifyPolicy):
    """Verify every drafted token, every round (``adaptive=False``)."""


class ForcedVerifyLengths(VerifyPolicy):
    """Verify ``lengths[r]`` drafts in round ``r`` (cycled), or ``lengths(r)`` for a callable (tests,
    experiments). Values are clipped to 0..B-1. With ``draft_when_zero=False`` a 0 round skips drafting."""

    def __init__(self, lengths: Sequence[int] | Callable[[int], int], draft_when_zero: bool = False):
        if not callable(lengths) and (len(lengths) == 0 or any(int(k) < 0 for k in lengths)):
            raise ValueError(f"forced verify lengths must be a non-empty list of integers >= 0, got {lengths!r}")
        self.lengths, self.draft_when_zero = lengths, draft_when_zero

    def start(self, block_size: int) -> "ForcedVerifyLengths":
        self.round, self.history = 0, []  # history: the k handed out, round by round
        return super().start(block_size)

    def _next(self) -> int:
        k = self.lengths(self.round) if callable(self.lengths) else self.lengths[self.round % len(self.lengths)]
        return min(max(int(k), 0), self.block_size - 1)

    def wants_draft(self) -> bool:
        if self._next() == 0 and not self.draft_when_zero:
            self.choose(None)  # an AR step: this round needs no draft
            return False
        return True

    def wants_ngram(self) -> bool:
        return False  # a forced 0 is a plain step

    def choose(self, confidence, source=None, drafted=True):
        k = self._next()
        self.round += 1
        self.history.append(k)
        return k


class AdaptiveVerifyPolicy(VerifyPolicy):
    """Maximise expected committed tokens per second (see the module docstring).

    cost: the ``CostModel`` for this batch size and block; prior_strength ``c`` (per position) and
    pooled_prior ``c0``: pseudo-counts of the calibration; max_skip: longest run of AR steps between probes;
    probe_overhead: a failed probe is followed by at least draft / (probe_overhead * step) plain steps, so
    that probing a draft that does not pay costs about that share of the time. clock: what times the call's
    own rounds (``None``: trust the cost model alone); timing_window: rounds of each kind kept;
    timing_prior: pseudo-rounds shrinking each kind's median towards the pooled one; explore_every: drafted
    rounds in a row before a plain step is timed; carry_mass: most calibration evidence (sum of predicted
    acceptances) a new call inherits from the previous one (``start(block_size, previous)``); ngram_streak:
    rounds in a row n-gram drafts may win before the head drafts again to compete; pay_margin: how much faster
    than plain steps a round must be expected to commit tokens before its drafts count as paying (a draft pass
    is made, n-gram drafts are verified, the back-off is reset); ngram_backoff: most rounds without an n-gram
    lookup after n-gram matches alone did not pay (1, 2, 4, ... rounds while they keep failing).
    """

    plans_trees = True

    def __init__(self, cost: CostModel, prior_strength: float = 2.0, pooled_prior: float = 1.0, max_skip: int = 32,
                 probe_overhead: float = 0.03, prior_ratio: float = 0.5,
                 clock: Callable[[], float] | None = time.perf_counter, timing_window: int = 32,
                 timing_prior: float = 0.5, explore_every: int = 16, carry_mass: float = 8.0, ngram_streak: int = 4,
                 pay_margin: float = 0.05, ngram_backoff: int = 8):
        self.cost, self.prior_strength, self.pooled_prior, self.max_skip = cost, prior_strength, pooled_prior, max_skip
        self.prior_ratio = prior_ratio
        self.min_skip = max(1, math.ceil(cost.draft_seconds / cost.verify(1) / probe_overhead))
        self.clock, self.timing_window, self.timing_prior = clock, timing_window, timing_prior
        self.explore_every, self.carry_mass, self.ngram_streak = explore_every, carry_mass, ngram_streak
        self.pay_margin, self.ngram_backoff = pay_margin, ngram_backoff

    def start(self, block_size: int, previous: "AdaptiveVerifyPolicy | None" = None) -> "AdaptiveVerifyPolicy":
        if block_size > self.cost.block_size:
            raise ValueError(
                f"cost model covers blocks up to {self.cost.block_size}, the call uses block_size={block_size}"
            )
        self.observed = self.predicted = None  # [sources, S] device accumulators, allocated on first use
        self.skip, self.to_skip, self._paid = 0, 0, False
        self._exploring, self._head_drafted = False, True  # this round: a timed plain step; the head drafted
        self._ngram_streak = 0  # rounds in a row that n-gram drafts won
        self._ngram_skip, self._ngram_to_skip = 0, 0  # the n-gram lookup's back-off, as the head's
        # measured / predicted seconds of the call's recent rounds: plain steps, rounds the head drafted, rounds
        # that verified n-gram drafts without a draft pass
        self.timed = {kind: deque(maxlen=self.timing_window) for kind in ("step", "draft", "ngram")}
        self._round, self._round_started, self._rounds_timed, self._drafted_in_a_row = None, None, 0, 0
        if previous is not None and previous.block_size == block_size and previous.cost is self.cost:
            if previous.predicted is not None:
                # per source (the head, each n-gram size); one host read per call, before the first round
                mass = previous.predicted.sum(-1, keepdim=True)
                shrink = (self.carry_mass / mass.clamp_min(1e-9)).clamp(max=1.0)
                self.observed, self.predicted = previous.observed * shrink, previous.predicted * shrink
                self._verify_cost, self._step_cost = previous._verify_cost, previous._step_cost
            for kind, values in previous.timed.items():
                self.timed[kind].extend(values)
            # the back-off level carries over; the first probe still comes soon (this prompt may pay)
            self.skip, self.to_skip = previous.skip, min(previous.skip, self.min_skip)
        return super().start(block_size)

    def _time_last_round(self) -> None:
        if self.clock is None:
            return
        now = self.clock()
        if self._round is not None and self._round_started is not None:
            self._rounds_timed += 1
            if self._rounds_timed > 1:  # the first round pays one-off set-up (kernels, allocations)
                kind, k = self._round
                predicted = self.cost.verify(1) if kind == "step" else self.cost.verify(k + 1)
                if kind == "draft":
                    predicted += self.cost.draft_seconds
                self.timed[kind].append((now - self._round_started) / predicted)
        self._round, self._round_started = None, now

    def cost_ratio(self, kind: str = "draft") -> float:
        """``rho``: a round of ``kind`` ("draft": the head drafted; "ngram": n-gram drafts without a draft pass)
        over a plain step, as measured in this call, relative to the cost model's prediction (1.0 until rounds
        are timed)."""
        pooled = [value for values in self.timed.values() for value in values]
        if not pooled:
            return 1.0
        overall = statistics.median(pooled)

        def scale(kind):
            n = len(self.timed[kind])
            median = statistics.median(self.timed[kind]) if n else overall
            prior = max(self.timing_prior, NGRAM_TIMING_PRIOR) if kind == "ngram" else self.timing_prior
            return (n * median + prior * overall) / (n + prior)

        return scale(kind) / scale("step")

    @property
    def measured_cost_ratio(self) -> float:
        """``rho`` of the rounds the head drafted (``cost_ratio("draft")``)."""
        return self.cost_ratio("draft")

    def wants_draft(self) -> bool:
        self._time_last_round()
        # until two steps are timed, sooner: one step's noise is what rho leans on then
        explore_after = self.explore_every if len(self.timed["step"]) >= 2 else min(4, self.explore_every)
        self._exploring = self.clock is not None and self._drafted_in_a_row >= explore_after
        self._round = ("step", 0)
        if self.out_of_room:  # the back-off is untouched
            return False
        if self.to_skip > 0 or self._exploring:
            self.to_skip = max(0, self.to_skip - 1)
            self._drafted_in_a_row = 0
            return False
        # While n-gram drafts keep winning, the head's draft pass would be spent for nothing; the head gets
        # another look every ``ngram_streak`` rounds, in case it has become the better source.
        return not 0 < self._ngram_streak < self.ngram_streak

    def wants_ngram(self) -> bool:
        """On a round without a draft pass: whether to look up n-gram matches that may be verified alone.
        After such matches did not pay, the lookup itself is skipped for a while: on text that does not
        repeat, every plain round would pay for it and get nothing."""
        if self._exploring or self.out_of_room:
            return False
        if self._ngram_to_skip > 0:
            self._ngram_to_skip -= 1
            return False
        return True

    def _ratio(self, like: torch.Tensor) -> torch.Tensor:
        """[sources, S] calibration ratios: row 0 the head, row n an n-gram match of n tokens, row
        ``TREE_ROW`` draft-tree head nodes by depth (column d: depth d + 1)."""
        s = self.block_size - 1
        if self.observed is None:
            self.observed = torch.zeros(TREE_ROW + 1, s, dtype=torch.float32, device=like.device)
            self.predicted = torch.zeros(TREE_ROW + 1, s, dtype=torch.float32, device=like.device)
            # [S + 1]: verifying the anchor and k drafts
            self._verify_cost = torch.tensor(self.cost.verify_seconds[: s + 1], dtype=torch.float32, device=like.device)
            self._step_cost = self.cost.verify(1)
        pooled_observed = self.observed.sum(-1, keepdim=True) + self.pooled_prior * self.prior_ratio
        pooled = pooled_observed / (self.predicted.sum(-1, keepdim=True) + self.pooled_prior)
        return (self.observed + self.prior_strength * pooled) / (self.predicted + self.prior_strength)

    def _acceptance(self, confidence: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
        """[N, S] calibrated acceptance probability of each drafted position."""
        ratio = self._ratio(confidence)
        rows = ratio[0].expand_as(confidence) if source is None else ratio[source.clamp_min(0)]
        return (confidence.float() * rows).clamp(0.0, 1.0)

    def use_ngram(self, head_confidence, ngram_size):
        """Per row, the source with the longer expected accepted run (n-gram: its size's calibration)."""
        ngram = self._acceptance(torch.ones(ngram_size.shape[0], self.block_size - 1, device=ngram_size.device),
                                 ngram_size).cumprod(-1).sum(-1)
        if head_confidence is None:
            return ngram_size > 0
        head = self._acceptance(head_confidence, None).cumprod(-1).sum(-1)
        return (ngram_size > 0) & (ngram > head)

    def choose(self, confidence, source=None, drafted=True):
        self._head_drafted = drafted
        if confidence is None:
            self._paid = True  # nothing to judge the draft by: keep drafting
            return self.block_size - 1
        a = self._acceptance(confidence, source)  # [N, S]
        reach = a.cumprod(dim=-1)
        expected = (1.0 + torch.cat([reach.new_zeros(reach.shape[0], 1), reach.cumsum(dim=-1)], dim=-1)).sum(0)
        size = torch.arange(self.block_size, device=expected.device)
        return self._best_plan(expected, size, confidence.shape[0], drafted)

    def choose_tree(self, node_logp, node_depth, ngram_size, spells_ngram):
        """Expected committed tokens of each (m, kg), summed over rows: the first m nodes' calibrated
        probabilities, and the n-gram chain's calibrated reach. The chain hangs from the deepest of the
        first m nodes that spell the n-gram's first tokens (depth a), so it reaches depth a + kg; the
        nodes it shares with the head are one event each, counted once with the likelier estimate."""
        self._head_drafted = True
        s = self.block_size - 1
        rows, ranked = node_logp.shape[0], min(node_logp.shape[1], s)
        ones = torch.ones(rows, s, device=node_logp.device)
        depth = node_depth[:, :ranked]
        rate = self._ratio(ones)[TREE_ROW][(depth - 1).clamp(0, s - 1)]
        node = (node_logp[:, :ranked].float().exp() * rate).clamp(0.0, 1.0)  # [N, ranked]
        ngram_reach = self._acceptance(ones, ngram_size).cumprod(-1) * (ngram_size > 0)[:, None].float()
        reach_to = torch.cat([ones.new_zeros(rows, 1), ngram_reach.cumsum(-1)], dim=1)  # [N, S + 1]
        spells = spells_ngram[:, :ranked]
        upgrade = spells * (ngram_reach.gather(1, (depth - 1).clamp(0, s - 1)) - node).clamp_min(0.0)
        zero = node.new_zeros(rows, 1)
        head = torch.cat([zero, (node + upgrade).cumsum(-1)], dim=1)  # [N, m + 1]
        attach = torch.cat([zero.long(), (spells * depth).cummax(-1).values], dim=1)  # [N, m + 1]
        lengths = torch.arange(s + 1, device=ones.device)
        end = (attach[:, :, None] + lengths).clamp(max=s)  # [N, m + 1, kg + 1]
        chain = reach_to.gather(1, end.flatten(1)).view_as(end) - reach_to.gather(1, attach)[:, :, None]
        expected = (1.0 + head[:, :, None] + chain).sum(0)  # [m + 1, kg + 1]
        size = lengths[: ranked + 1, None] + lengths[None, :]
        plan = self._best_plan(expected.flatten(), size.flatten(), rows, True)
        return torch.stack([plan // (s + 1), plan % (s + 1)])

    def _best_plan(self, expected: torch.Tensor, size: torch.Tensor, rows: int, drafted: bool) -> torch.Tensor:
        """Index of the best plan among candidates with ``expected`` committed tokens (summed over rows) and
        ``size`` drafted tokens verified (plans wider than the block are out; a size-0 plan is a step)."""
        s = self.block_size - 1
        fits = size <= s
        size = size.clamp(max=s)
        # Drafting pays when some k commits tokens faster than plain steps, draft time included; then the
        # best such rate picks k. When it does not pay, the draft is spent anyway: k then only trades verify
        # time for tokens beyond what plain steps would commit in it (k = 0 gains nothing), so a weak draft
        # is still checked where checking is cheap, and every checked draft calibrates the next choice.
        # A drafted round does a step's work and a draft pass, whatever timings taken under contention say.
        # The call's own round times (rho) scale the drafted rounds, and also what each extra verified token
        # costs when the draft is already spent, so the cache's verify curve does not decide k alone.
        # N-gram drafts without a draft pass cost their verify only, and are checked only when they pay.
        # "Pay" means beating plain steps by ``pay_margin``: a round near break-even gains nothing when right
        # and loses when its estimate is off (the calibration, the costs and the timings are all noisy), so
        # near-ties go to the plain step, which is never slower than ``generate``'s.
        rho = self.cost_ratio("draft" if drafted else "ngram")
        draft_seconds = self.cost.draft_seconds if drafted else 0.0
        drafted_cost = ((self._verify_cost + draft_seconds) * rho).clamp(min=self._step_cost + draft_seconds)
        rate = torch.where((size > 0) & fits, expected / drafted_cost[size], 0.0)
        best_rate = rate.argmax()
        self._paid = rate[best_rate] > (1.0 + self.pay_margin) * rows / self._step_cost
        if not drafted:
            return torch.where(self._paid, best_rate, 0)
        extra_verify = (self._verify_cost - self._step_cost) * rho / self._step_cost  # >= 0: costs are monotone
        gain = torch.where(fits, expected - rows * (1.0 + extra_verify[size]), -torch.inf)
        return torch.where(self._paid, best_rate, gain.argmax())

    def chosen(self, k: int, head_used: bool = True) -> None:
        paid = k > 0 and bool(self._paid)  # computed before the loop's host read: the device is idle by now
        # A round whose drafts the token budget left no room for says nothing of the draft: it leaves the
        # back-off (which the next call inherits) as it was.
        budget_bound = self.out_of_room
        if not self._head_drafted:  # n-gram drafts alone: the head's back-off is untouched
            if k > 0:
                self._round = ("ngram", k)
                self._drafted_in_a_row += 1
            if not budget_bound:
                self._ngram_streak = self._ngram_streak + 1 if paid else 0
                self._ngram_skip = 0 if paid else min(max(1, 2 * self._ngram_skip), self.ngram_backoff)
                self._ngram_to_skip = self._ngram_skip
            return
        self._round = ("draft", k)
        self._drafted_in_a_row += 1
        if budget_bound:
            return
        self._ngram_streak = 1 if paid and not head_used else 0
        if paid and not head_used:  # an n-gram won: the rounds that skip the draft pass may look it up again
            self._ngram_skip = self._ngram_to_skip = 0
        if not paid:  # drafting did not pay: back off, probe again later
            self.skip = min(max(self.min_skip, 2 * self.skip), max(self.max_skip, self.min_skip))
            self.to_skip = self.skip
        elif head_used:
            self.skip = 0

    def observe_tree(self, node_logp, node_depth, accepted) -> None:
        """node_logp, node_depth, accepted: [N, m] the verified head nodes and whether each was accepted."""
        if node_logp.shape[1] == 0:
            return
        self._ratio(node_logp)
        column = (node_depth - 1).clamp(0, self.block_size - 2).flatten()
        self.observed[TREE_ROW].index_add_(0, column, accepted.float().flatten())
        self.predicted[TREE_ROW].index_add_(0, column, node_logp.float().exp().flatten())

    def observe(self, confidence, k, accepted, source=None) -> None:
        if confidence is None or (not torch.is_tensor(k) and k == 0):
            return
        self._ratio(confidence)
        position = torch.arange(self.block_size - 1, device=accepted.device)
        verified = position < (k[:, None] if torch.is_tensor(k) else k)  # k: one length, or one per row
        weight = 1.0 if source is None else (source >= 0).float()[:, None]  # rows without a draft say nothing
        reached = ((accepted[:, None] >= position) & verified) * weight
        passed = ((accepted[:, None] > position) & verified) * weight
        index = torch.zeros_like(accepted) if source is None else source.clamp_min(0)
        self.observed.index_add_(0, index, passed.float())
        self.predicted.index_add_(0, index, confidence.float() * reached)


# The contexts a cost model is measured at: a verify's cost grows with the cache it attends to, so a call on a
# 2K-token prompt decides (and the bench's bound is computed) with costs timed near 2K tokens, not 256.
COST_CONTEXT_LENGTHS = (256, 512, 1024, 2048, 4096)


def cost_context_length(batch_size: int, expected_context: int = 256) -> int:
    """The context a call's cost model is measured at: of ``COST_CONTEXT_LENGTHS``, the nearest (by ratio) to
    ``expected_context`` (the prompt plus half the new tokens), the measurement's prefill kept at about 4k
    tokens whatever the batch."""
    expected = max(1, int(expected_context))
    nearest = min(COST_CONTEXT_LENGTHS, key=lambda length: abs(math.log(length / expected)))
    return max(16, min(nearest, 4096 // batch_size))


def starting_cost_model(target, drafter, batch_size: int, block_size: int, expected_context: int = 256) -> CostModel:
    """The cost model an adaptive call starts from: measured (or read from the cache) for the target and drafter
    as they run now, at the context ``cost_context_length`` picks for about ``expected_context`` tokens."""
    context = cost_context_length(batch_size, expected_context)
    return load_or_measure_cost_model(target, drafter, batch_size, block_size, context_length=context)


def check_verify_policy(policy) -> None:
    """A caller's ``verify_policy`` is a ``VerifyPolicy`` (None is not given here)."""
    if not isinstance(policy, VerifyPolicy):
        raise TypeError(f"verify_policy must be a VerifyPolicy (e.g. ForcedVerifyLengths), got {policy!r}")


def verify_policy_for(target, drafter, batch_size: int, block_size: int, adaptive: bool = True,
                      policy: VerifyPolicy | None = None, cost_model: CostModel | None = None,
                      reproducible: bool = False, settings_key: tuple = (),
                      expected_context: int = 256) -> VerifyPolicy:
    """The policy of one call: ``policy`` if given, else adaptive (cost model measured or cached, at the context
    ``cost_context_length`` picks for ``expected_context`` tokens) or fixed.

    ``reproducible`` (sampling): the adaptive policy then decides from the cost model and this call's own
    acceptances only; timed rounds and the previous call's calibration would change how many random draws a
    round makes, so the same seed would not give the same text, as it does with ``target.generate``.
    ``settings_key``: what else decides how often drafts are accepted (the logits processors in force); the
    calibration, timings and back-off carry over only between calls with the same key, since a repetition
    penalty rejects the very repeats a call without it accepts."""
    if policy is not None:
        check_verify_policy(policy)
        return policy.start(block_size)
    if not adaptive:
        return FixedVerifyLength().start(block_size)
    if cost_model is None:
        cost_model = starting_cost_model(target, drafter, batch_size, block_size, expected_context)
    if reproducible:
        return AdaptiveVerifyPolicy(cost_model, clock=None).start(block_size)
    parameter = next(target.parameters())
    key = (id(target), id(drafter), batch_size, block_size, parameter.dtype, parameter.device, settings_key)
    policy = AdaptiveVerifyPolicy(cost_model).start(block_size, _recall(_LAST_POLICY, key, target, drafter))
    _remember(_LAST_POLICY, key, target, drafter, policy)
    return policy


# (id target, id drafter, batch, block, dtype, device, settings key) -> (weakref target, weakref drafter, the last
# call's policy)
_LAST_POLICY: dict[tuple, tuple] = {}
