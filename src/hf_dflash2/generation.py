"""The fast speculative loop: batch > 1, acceptance on the device, one small host read per round.

Reading order, as gpt-fast: ``prefill`` -> ``verify`` (one target forward over the anchor and ``k``
drafts) -> ``speculative_decode`` (the round loop) -> ``speculative_generate`` (validation, policy,
output). Per round: the drafter proposes a block of tokens per row in one pass (skipped on rounds the
verify policy turns into plain AR steps), and rows whose text repeats may take an n-gram draft instead
(``speculative_dflash2.propose``); the policy picks how many of them to verify
(``cost_model_dflash2``); the target verifies ``[anchor, drafts[:k]]`` (on greedy rounds where the head
drafted: possibly a tree of its likeliest continuations and the n-gram's chain, ``draft_tree``);
acceptance (greedy match or
lossless rejection sampling), EOS and budget handling, output writes and the drafter's context
(``DraftContext``, shared with the Transformers path) all stay on the device. The host reads one small
tensor per round, after the draft: any row still running, all rows running, how many trailing cache
slots no running row needs, and the chosen ``k``; and, only when rows finish, which rows to drop.

Rows accept different numbers of tokens, so slots rejected by one row but kept by another stay in the
caches as masked holes; the trailing slots that no row needs are cropped every round (at batch 1 there
are never holes). Finished rows are removed from the batch so they stop costing compute.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
from transformers.utils import ModelOutput

from .attention import packed_gqa_attention
from .cost_model_dflash2 import CostModel, VerifyPolicy, verify_policy_for
from .draft_tree import (
    DraftTree,
    HeadNodes,
    accept_tree,
    build_tree,
    gather_path,
    move_path_to_front,
    path_out_of_place,
    rank_continuations,
    spelling,
    supports_trees,
    tree_attention_mask,
)
from .kernels_dflash2 import ForwardKernels
from .speculative_dflash2 import (
    DEFAULT_NGRAM_SIZE,
    DraftContext,
    Proposal,
    SpeculativeStats,
    accept_greedy,
    accept_sampling,
    check_ngram_size,
    dense_proposal,
    grown,
    last_position,
    make_proposal,
    process_logits,
    propose,
    round_block_size,
    takes_logits_processor,
    tapped_features,
)


@dataclass
class SpeculativeOutput(ModelOutput):
    """sequences: [N, prompt + generated] (prompt as given, right-padded with ``pad_token_id`` after
    each row's end); num_generated: [N]; stats: acceptance statistics over all rows and rounds. A
    ``ModelOutput``, as ``generate``'s: fields by attribute or key (``out["sequences"]``), unset ones left out.

    With ``return_dict_in_generate`` and ``output_scores`` / ``output_logits``, as ``generate``'s output:
    ``scores`` / ``logits``, one [N, V] float tensor per generated column (``sequences.shape[1] - P`` of
    them). ``logits[t][i]`` holds the target's raw logits that chose row i's token t, and ``scores[t][i]`` the
    same after the logits processors (and, when sampling, the warpers), so ``target.compute_transition_scores``
    works on them. Columns past a row's end are zeros (``generate`` would hold the logits of the padding it
    kept feeding a finished row)."""

    sequences: torch.Tensor | None = None
    num_generated: torch.Tensor | None = None
    stats: SpeculativeStats | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


# When neither the call, its generation config nor the target's sets a length (Transformers would stop at
# max_length = 20 tokens in all, prompt included).
DEFAULT_MAX_NEW_TOKENS = 64

# A keyword argument the caller did not give; an explicit None overrides, as in ``target.generate``.
UNSET = object()

# Transformers' values for the sampling settings no config sets (GenerationConfig._get_default_generation_params).
TRANSFORMERS_SAMPLING_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}

# Generation settings the fast loop does not apply, with the value that turns each off. Each changes which
# tokens the target would emit (or what generate returns), so a call in which one would act is refused rather
# than silently decoding another law; ``generate(assistant_model=drafter)`` applies every logits processor,
# since Transformers verifies there. Those in SAMPLING_ONLY act only when sampling, as in ``generate``.
UNSUPPORTED_GENERATION_SETTINGS = {
    "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "guidance_scale": None,
    "watermarking_config": None, "dola_layers": None, "top_h": None, "output_attentions": False,
    "output_hidden_states": False,
}
SAMPLING_ONLY = ("top_h",)
# What generate returns these only with return_dict_in_generate (the target's per-token attentions and hidden
# states; a verify forward holds them for drafts that were rejected too, and the cache has holes at batch > 1).
DICT_ONLY = ("output_attentions", "output_hidden_states")

# What the call returns, and how many samples per prompt (``num_return_sequences``: rows repeated, as generate
# expands them; sampling only, as generate). ``SpeculativeOutput.scores`` / ``.logits`` with
# return_dict_in_generate: the values that chose each generated token, as generate's (``_TokenScores``).
RETURN_SETTINGS = {"num_return_sequences": 1, "return_dict_in_generate": False, "output_scores": False,
                   "output_logits": False}

# Settings ``generate`` applies through logits processors that read the text so far. The fast loop runs
# Transformers' own processors at every verified slot on that slot's prefix (``TargetLogitsProcessors``);
# the values are the ones that turn each off.
PROCESSED_SETTINGS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "min_length": 0,
    "min_new_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "remove_invalid_values": False, "renormalize_logits": False,
}
# Sampling warpers that come after top-p in generate's order and read only the scores: applied batched,
# after temperature / top-k / top-p (``_Sampler``).
TAIL_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}

# Plain greedy decoding whatever the target's generation_config asks (sampling, a repetition penalty):
# what the trainer's evaluation and held-out tau measure a head on.
PLAIN_GREEDY = {"do_sample": False, "max_time": None, **UNSUPPORTED_GENERATION_SETTINGS, **PROCESSED_SETTINGS,
                **TAIL_WARPERS, **RETURN_SETTINGS}


def _acts(name: str, value, config: GenerationConfig) -> bool:
    """Whether ``generate`` would apply this setting's value (its processors' own conditions)."""
    off = UNSUPPORTED_GENERATION_SETTINGS[name]
    if value is None or value == off or (off is None and not value):
        return False
    if name in SAMPLING_ONLY and not config.do_sample:
        return False
    if name in DICT_ONLY and not config.return_dict_in_generate:
        return False
    if name == "guidance_scale":
        return value != 1
    return True


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``RepetitionPenaltyLogitsProcessor``'s arithmetic on the tokens ``seen`` marks (a bool mask that
    broadcasts to ``logits``): a logit is divided by ``penalty``, or multiplied where it is negative."""
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


class TargetLogitsProcessors:
    """``generate``'s logits processors that read the text so far (repetition penalty, no-repeat n-grams,
    bad words, minimum lengths, suppressed or forced tokens, a caller's ``logits_processor`` list), applied
    to the target's logits at every verified slot, each on its own prefix: the prompt as given (padding
    included, as ``generate`` passes it), the row's committed tokens, and the drafts on the path to the
    slot. That is the text ``generate`` would hold before that token, so greedy output stays token-identical
    and sampling draws ``generate``'s law.

    Transformers builds them (``_get_logits_processor``), once per row: built-in processors keep per-row
    state (the repetition penalty's padding length), and rows advance by different amounts, so a caller's
    own processors are called with one row at a time. A round costs one small call per row and slot and
    one host read, only when some processor is on (``active``).

    A repetition penalty alone (the one processor users set most) takes a batched path instead: which
    tokens each slot's text holds is one [n, w, V + 1] mask (the row's prompt and committed tokens, and the
    drafts on the slot's path), and the penalty is the processor's own arithmetic on it, so the logits
    are bit for bit the processor's, in a few tensor operations per round and no host read."""

    batched_penalty = True  # False: the per-slot calls for a penalty too (benchmarks/processors_cost.py's A/B)

    def __init__(self, target, config: GenerationConfig, input_ids, attention_mask, max_new_tokens: int,
                 logits_processor=None, prefix_allowed_tokens_fn=None):
        plain = copy.deepcopy(config)
        # the warpers stay with _Sampler, batched over slots; when sampling, so does renormalize_logits, which
        # generate applies after them (_Sampler.warp)
        plain.renormalize_logits = config.renormalize_logits and not config.do_sample
        plain.do_sample = False
        # Rows arrive one at a time: prefix_allowed_tokens_fn gets the prompt's index that generate would pass
        # it (a row's index over num_return_sequences) from a wrapper, and sees a batch of one.
        copies, plain.num_return_sequences, plain.num_beams = max(1, config.num_return_sequences or 1), 1, 1
        plain.max_length = input_ids.shape[1] + max_new_tokens  # where forced_eos_token_id counts to
        device = input_ids.device
        target._prepare_special_tokens(plain, kwargs_has_attention_mask=True, device=device)
        self.vocab_size = target.get_output_embeddings().weight.shape[0]

        def for_row(i: int) -> LogitsProcessorList:
            allowed = None
            if prefix_allowed_tokens_fn is not None:
                def allowed(_, text, prompt=i // copies):
                    return prefix_allowed_tokens_fn(prompt, text)
            return target._get_logits_processor(
                plain, input_ids.shape[1], encoder_input_ids=input_ids[i : i + 1],
                logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
                device=device, model_kwargs={"attention_mask": attention_mask[i : i + 1]},
                prefix_allowed_tokens_fn=allowed,
            )

        first = for_row(0)
        self.active = len(first) > 0  # the same settings give every row the same processors, or none
        self.per_row = [first, *(for_row(i) for i in range(1, input_ids.shape[0]))] if self.active else []
        self.penalty, self._prompt_seen = (self._repetition_penalty_alone(input_ids) if self.batched_penalty
                                           else (None, None))

    def _repetition_penalty_alone(self, input_ids) -> tuple[float | None, torch.Tensor | None]:
        """(penalty, [N, V + 1] bool: the tokens of each row's prompt that the penalty counts) when every
        row's processors are exactly one ``RepetitionPenaltyLogitsProcessor`` of the same penalty, with a
        padding length per row; else (None, None) and the general path. Column V absorbs what the
        processor drops: ids past the vocabulary, and the ignored padding."""
        vocab = self.vocab_size
        if not self.per_row or any(len(row) != 1 or type(row[0]) is not RepetitionPenaltyLogitsProcessor
                                   for row in self.per_row):
            return None, None
        penalty = self.per_row[0][0].penalty
        ignore = []
        for row in self.per_row:
            processor = row[0]
            length = processor.prompt_ignore_length
            if torch.is_tensor(length) and length.numel() == 1 and not length.is_floating_point():
                length = int(length)
            # Only a padding length within the prompt is a set of prompt columns; the processor reads any
            # other value (longer, or of another type) against the whole text, so the per-slot path keeps it.
            if length is None:
                length = 0
            if (processor.penalty != penalty or getattr(processor, "logits_indices", None) is not None
                    or type(length) is not int or not 0 <= length <= input_ids.shape[1]):
                return None, None
            ignore.append(length)
        columns = torch.arange(input_ids.shape[1], device=input_ids.device)
        ignored = columns[None] < torch.tensor(ignore, device=input_ids.device)[:, None]
        ids = torch.where(ignored, vocab, input_ids.clamp(max=vocab))
        seen = torch.zeros(input_ids.shape[0], vocab + 1, dtype=torch.bool, device=input_ids.device)
        return penalty, seen.scatter_(1, ids, True)

    def _seen(self, output: "_Output", rows: "_Rows") -> torch.Tensor:
        """[n, V + 1] bool: the tokens of each running row's prompt and committed text (column V: none)."""
        tokens = output.tokens[rows.index]
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        unwritten = columns[None] >= output.count[rows.index][:, None]
        ids = torch.where(unwritten, self.vocab_size, tokens.clamp(max=self.vocab_size))
        return self._prompt_seen[rows.index].scatter(1, ids, True)

    def first(self, output: "_Output", logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] after the prompts -> processed."""
        return torch.cat([processors(output.text(i, 0)[None], logits[i : i + 1])
                          for i, processors in enumerate(self.per_row)])

    def for_drafts(self, output: "_Output", rows: "_Rows"):
        """A ``draft_block`` logits hook: each row's processors on the head's unary logits at every drafted
        position, on the row's committed text. The drafts before a position are not known yet, so deeper
        positions see a shorter text than the target will: this only shapes the draft (a repetition
        penalty lowers the same tokens for both), never the output."""

        def process(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
            if self.penalty is not None:
                seen = self._seen(output, rows)
                seen = seen[:, : self.vocab_size] if vocab is None else seen[:, vocab]
                return apply_repetition_penalty(logits, seen[:, None], self.penalty).clamp_min(floor(logits))
            logits = logits.clone()
            full_vocab = self.vocab_size
            counts = output.count[rows.index].tolist()
            for r, (row, count) in enumerate(zip(rows.index.tolist(), counts)):
                text = output.text(row, count)[None]
                for position in range(logits.shape[1]):
                    scores = logits[r, position : position + 1]
                    if vocab is not None:  # a draft vocabulary: out-of-vocabulary tokens cannot be drafted
                        scores = scores.new_full((1, full_vocab), float("-inf")).index_copy(1, vocab, scores)
                    scores = self.per_row[row](text, scores)
                    logits[r, position] = scores[0] if vocab is None else scores[0, vocab]
            return logits.clamp_min(floor(logits))

        def floor(logits: torch.Tensor) -> float:
            # A position the processors ban entirely (a draft vocabulary outside what they allow) must still
            # rank candidates: banned tokens keep a finite floor, far below every allowed one.
            return max(torch.finfo(torch.float32).min, torch.finfo(logits.dtype).min) / 2

        return process

    def round(self, output: "_Output", rows: "_Rows", ids: torch.Tensor, logits: torch.Tensor,
              tree: DraftTree | None = None) -> torch.Tensor:
        """ids [n, w]: the anchor and this round's drafts (a chain, or the slots of ``tree``); logits
        [n, w, V], slot j's the target's after ids[:, j] -> processed, slot by slot on its own prefix."""
        if self.penalty is not None:
            n, w = ids.shape
            # slot j's text ends with the slots on its path: 0..j of a chain, a tree slot's ancestors and itself;
            # slot 0, the anchor, is the last committed token, so marking it again changes nothing
            on_path = (torch.ones(w, w, dtype=torch.bool, device=ids.device).tril().expand(n, w, w)
                       if tree is None else tree.ancestry)
            path_ids = torch.where(on_path, ids.clamp(max=self.vocab_size)[:, None, :], self.vocab_size)
            seen = self._seen(output, rows)[:, None, :].expand(n, w, -1).scatter(2, path_ids, True)
            return apply_repetition_penalty(logits, seen[..., : self.vocab_size], self.penalty)
        logits = logits.clone()
        counts = output.count[rows.index].tolist()  # the committed tokens end with the anchor
        for r, (row, count) in enumerate(zip(rows.index.tolist(), counts)):
            committed = output.text(row, count)
            for slot in range(ids.shape[1]):
                if tree is None:
                    path = ids[r, 1 : slot + 1]
                else:  # the slots from the anchor to this one, by depth, less the anchor
                    on_path = tree.ancestry[r, slot].nonzero().flatten()
                    path = ids[r, on_path[tree.depth[r, on_path].argsort()][1:]]
                prefix = torch.cat([committed, path])[None]
                logits[r, slot : slot + 1] = self.per_row[row](prefix, logits[r, slot : slot + 1])
        return logits


def resolve_generation_config(target, generation_config: GenerationConfig | None = None,
                              **overrides) -> GenerationConfig:
    """The settings a ``speculative_generate`` call decodes with, by ``target.generate``'s precedence: the
    call's keyword arguments (``UNSET`` = not given; an explicit ``None`` overrides), then
    ``generation_config``, then ``target.generation_config``, then Transformers' defaults (greedy; when
    sampling: temperature 1, top-k 50, top-p 1), so that a call samples the law ``target.generate`` would.
    Raises ``ValueError`` naming the setting and where it came from, for unknown options and for settings the
    fast loop does not apply (``UNSUPPORTED_GENERATION_SETTINGS``) where ``generate`` would apply them."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError("generation_config must be a transformers.GenerationConfig, "
                         f"got {type(generation_config).__name__}")
    given = {name: value for name, value in overrides.items() if value is not UNSET}
    config = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    config.update(defaults_only=True, **target.generation_config.to_dict())
    config.update(defaults_only=True, **TRANSFORMERS_SAMPLING_DEFAULTS)
    unknown = config.update(**given)
    if unknown:
        raise ValueError(f"speculative_generate got unknown generation options {sorted(unknown)}: its model inputs "
                         "are input_ids and attention_mask (drop other tokenizer outputs, e.g. "
                         "return_token_type_ids=False), its options GenerationConfig fields")
    for name in UNSUPPORTED_GENERATION_SETTINGS:
        value = getattr(config, name, None)
        if not _acts(name, value, config):
            continue
        if name in given:
            origin = "the call"
        elif generation_config is not None and getattr(generation_config, name, None) is not None:
            origin = "generation_config"
        else:
            origin = "the target's generation_config"
        raise ValueError(
            f"{name}={value!r} (from {origin}) is not applied by speculative_generate, so its output would not "
            f"be the target's; pass {name}={UNSUPPORTED_GENERATION_SETTINGS[name]!r} to decode without it, or "
            "use target.generate(**inputs, assistant_model=drafter), which applies every logits processor"
        )
    return config


def _new_token_budget(config: GenerationConfig, prompt_length: int, context: int | None, block_size: int) -> int:
    """``max_new_tokens``, else ``max_length`` minus the prompt (capped so that a round's block still fits
    the context: some checkpoints set max_length to the context itself), else ``DEFAULT_MAX_NEW_TOKENS``."""
    if config.max_new_tokens is not None:
        return config.max_new_tokens
    if config.max_length is not None:
        budget = config.max_length - prompt_length
        if context is not None:
            budget = min(budget, context - prompt_length - block_size)
        if budget <= 0:
            raise ValueError(f"max_length {config.max_length} leaves no room after the prompt of {prompt_length} "
                             "tokens; set max_new_tokens instead")
        return budget
    return DEFAULT_MAX_NEW_TOKENS


def _eos_tensor(eos_token_id, device) -> torch.Tensor:
    if eos_token_id is None:
        return torch.empty(0, dtype=torch.long, device=device)
    if isinstance(eos_token_id, torch.Tensor):
        return eos_token_id.flatten().to(device=device, dtype=torch.long)
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    return torch.tensor(ids, dtype=torch.long, device=device)


def _pad_id(config) -> int | None:
    """The config's pad token as one id (a list's first), or None."""
    pad = config.pad_token_id
    if isinstance(pad, (list, tuple)):
        pad = pad[0] if pad else None
    return None if pad is None else int(pad)


def check_input_ids(input_ids) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = getattr(input_ids, "shape", type(input_ids))
        raise ValueError(f"input_ids must be a 2-D LongTensor [batch, length], got {got}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a prompt needs at least one token")


def mask_from_padding(input_ids: torch.Tensor, config) -> torch.Tensor | None:
    """``generate``'s inference when no attention mask is given, for left padding: where a row starts with
    the pad token (and it is not an EOS id), those leading positions are padding. A pad id after a row's
    first other token stays text: ``generate`` would mask it too, leaving a hole the loop's positions (left
    padding) do not model, and a real prompt may hold that id. -> [N, L] long, or None (all text)."""
    pad = _pad_id(config)
    if pad is None or pad in _eos_tensor(config.eos_token_id, "cpu").tolist():
        return None
    leading = (input_ids == pad).long().cumprod(dim=1).bool()
    return (~leading).long() if bool(leading.any()) else None


def validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size) -> None:
    """Raise a clear ``ValueError`` before any forward pass."""
    check_input_ids(input_ids)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        empty_rows = (attention_mask.sum(-1) == 0).nonzero().flatten().tolist()
        if empty_rows:
            raise ValueError(f"rows {empty_rows} of the batch have an empty prompt (attention_mask all zero)")
        right_padded = (attention_mask[:, -1] == 0).nonzero().flatten().tolist()
        if right_padded:
            raise ValueError(f"rows {right_padded} of the batch end in padding: speculative_generate continues each "
                             "row after its last column, so pad on the left (tokenizer.padding_side = 'left')")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if not 2 <= block_size:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    limit = target.config.get_text_config().max_position_embeddings
    needed = input_ids.shape[1] + max_new_tokens + block_size
    if limit is not None and needed > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} + block_size {block_size} "
            f"= {needed} "
            f"exceeds the target's context of {limit} positions"
        )


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


class _Sampler:
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


@dataclass
class _Rows:
    """The running rows: output row index, anchor token and position, finished flag (all [n])."""

    index: torch.Tensor
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    finished: torch.Tensor

    def select(self, keep: torch.Tensor) -> "_Rows":
        return _Rows(self.index[keep], self.anchor[keep], self.anchor_pos[keep], self.finished[keep])


class _Output:
    """Generated tokens per output row, with EOS and token-budget stops inside a block.

    ``history`` [N, P + max_new_tokens + B] holds each row's prompt (-1 on left padding) followed by its
    generated ``tokens`` (a view), which is what n-gram drafts are matched against. ``stop_strings`` (a
    ``StopStringCriteria``) and a caller's ``stopping_criteria`` end a row at the token where they fire."""

    def __init__(self, input_ids, attention_mask, max_new_tokens, block_size, pad_token_id, eos, stop_strings=None,
                 stopping_criteria=None):
        n_rows, prompt = input_ids.shape
        device = input_ids.device
        self.stop_strings, self.pad_token_id = stop_strings, pad_token_id
        self.stopping_criteria, self.prompt_ids = stopping_criteria, input_ids
        self.token_scores: _TokenScores | None = None  # set when scores are collected (the criteria read them)
        self.history = torch.full((n_rows, prompt + max_new_tokens + block_size), pad_token_id, dtype=torch.long,
                                  device=device)
        self.history[:, :prompt] = torch.where(attention_mask.bool(), input_ids, -1)
        self.tokens = self.history[:, prompt:]
        self.prompt_length = prompt
        self.count = torch.zeros(n_rows, dtype=torch.long, device=device)
        self.max_new_tokens, self.eos = max_new_tokens, eos
        self.offsets = torch.arange(block_size, device=device)

    def text(self, row: int, generated: int) -> torch.Tensor:
        """[P + generated]: output row ``row``'s prompt as given (padding included) and its first ``generated``
        tokens, the text ``generate`` holds there (what processors and stopping criteria read)."""
        return torch.cat([self.prompt_ids[row], self.tokens[row, :generated]])

    def commit(self, rows: _Rows, tokens: torch.Tensor, commit: torch.Tensor):
        """tokens: [n, w] this round's target tokens, of which the first ``commit`` [n] are valid.
        Writes them up to EOS / budget / a stop -> (written [n], within [n, w] the valid slots, finished [n])."""
        offsets = self.offsets[: tokens.shape[1]]
        within = offsets[None] < commit[:, None]
        is_eos = torch.isin(tokens, self.eos) & within
        eos_cut = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, commit)
        written = torch.minimum(eos_cut, self.max_new_tokens - self.count[rows.index])
        at = self.count[rows.index][:, None] + offsets
        current = self.tokens[rows.index[:, None], at]
        self.tokens[rows.index[:, None], at] = torch.where(offsets[None] < written[:, None], tokens, current)
        stopped = torch.zeros_like(is_eos[:, 0])
        cuts = []
        if self.stop_strings is not None:
            cuts.append(lambda written: self._stop_string_cut(rows, written, tokens.shape[1]))
        if self.stopping_criteria is not None:
            cuts.append(lambda written: self._criteria_cut(rows, written))
        for cut in cuts:  # each sees the text the one before left
            stop_cut, stops = cut(written)
            self.tokens[rows.index[:, None], at] = torch.where(offsets[None] < stop_cut[:, None],
                                                               self.tokens[rows.index[:, None], at], current)
            written, stopped = stop_cut, stopped | stops
        self.count[rows.index] += written
        finished = is_eos.any(-1) | stopped | (self.count[rows.index] >= self.max_new_tokens)
        return written, within, finished

    def _criteria_cut(self, rows: _Rows, written: torch.Tensor):
        """The caller's ``stopping_criteria`` after each of this round's written tokens, called as ``generate``
        calls them: on the row's whole text up to that token (the prompt as given), with the row's scores so
        far when they are collected (``return_dict_in_generate`` and ``output_scores``: a tuple of [1, V], one
        per generated column), else ``scores=None``; one row at a time, since rows hold different lengths
        -> (tokens to keep [n], stopped [n])."""
        cut, stopped = written.clone(), torch.zeros_like(written, dtype=torch.bool)
        counts = self.count[rows.index].tolist()  # before this round's tokens
        for r, (row, count, n) in enumerate(zip(rows.index.tolist(), counts, written.tolist())):
            text = self.text(row, count + n)[None]
            for slot in range(n):
                length = self.prompt_length + count + slot + 1
                collected = self.token_scores is not None and self.token_scores.scores is not None
                scores = self.token_scores.row_scores(row, count + slot + 1) if collected else None
                if bool(self.stopping_criteria(text[:, :length], scores).any()):
                    cut[r], stopped[r] = slot + 1, True
                    break
        return cut, stopped

    def _stop_string_cut(self, rows: _Rows, written: torch.Tensor, width: int):
        """Transformers' ``StopStringCriteria`` after each of this round's written tokens, on the text up to it
        (prompt included, as ``generate`` checks after every token) -> (tokens to keep [n], stopped [n]).

        Each check sees the last ``maximum_token_len`` tokens ending at that slot; slots before a row's
        history start as a token no stop string contains, left padding as ``pad_token_id``, as in ``generate``."""
        criteria = self.stop_strings
        span = criteria.maximum_token_len
        ends = self.prompt_length + self.count[rows.index]  # history index of this round's first token
        cut, stopped = written.clone(), torch.zeros_like(written, dtype=torch.bool)
        window_start = ends[:, None] - span + 1 + torch.arange(span, device=ends.device)  # slot 0's window
        for slot in range(width):
            index = window_start + slot
            window = self.history[rows.index[:, None], index.clamp_min(0)]
            window = torch.where(window < 0, self.pad_token_id, window)
            window = torch.where(index < 0, torch.iinfo(torch.long).max, window)  # past the vocabulary: no match
            fires = criteria(window, None) & (slot < written) & ~stopped
            cut = torch.where(fires, slot + 1, cut)
            stopped = stopped | fires
        return cut, stopped


class _TokenScores:
    """``output_scores`` / ``output_logits``: per output row and generated token, the logits that chose it.

    Buffers [N, columns, V] (float32), only when asked, grown by doubling up to ``max_new_tokens`` columns
    (a budget taken from ``max_length`` may be far more than a call writes). A round writes, for each row,
    the slots on the path it may commit (linear rounds: slots 0, 1, ...; tree rounds: the path's slots in
    depth order), before the commit, so that stopping criteria read this round's scores as ``generate``
    passes them; ``trim`` then clears what the commit cut. A token's entry is the target's logits after
    exactly the text ``generate`` holds before it (processed on that text, ``TargetLogitsProcessors``).
    Two small host reads per round (what to record, then what the commit kept)."""

    def __init__(self, n_rows: int, max_new_tokens: int, vocab_size: int, device, scores: bool, logits: bool):
        self.max_new_tokens = max_new_tokens
        width = min(max_new_tokens, 64)

        def buffer(wanted: bool):
            return torch.zeros(n_rows, width, vocab_size, device=device) if wanted else None

        self.scores, self.logits = buffer(scores), buffer(logits)

    def _reserve(self, end: int) -> None:
        buffers = [b for b in (self.scores, self.logits) if b is not None]
        if end <= buffers[0].shape[1]:
            return
        width = min(self.max_new_tokens, max(end, 2 * buffers[0].shape[1]))
        self.scores = None if self.scores is None else grown(self.scores, 1, width)
        self.logits = None if self.logits is None else grown(self.logits, 1, width)

    def record(self, rows: "_Rows", start: torch.Tensor, count: torch.Tensor, logits: torch.Tensor,
               scores: torch.Tensor | None) -> list[tuple[int, int, int]]:
        """start, count: [n] each row's tokens before the round and the tokens it may commit; logits, scores:
        [n, w, V] raw and processed (None when not asked), slot j the one that chose the round's token j.
        -> (row, start, columns written) per row, for ``trim``."""
        spans = []
        for r, (row, begin, n) in enumerate(torch.stack([rows.index, start, count]).T.tolist()):
            n = min(n, self.max_new_tokens - begin)
            self._reserve(begin + n)
            for buffer, values in ((self.logits, logits), (self.scores, scores)):
                if buffer is not None:
                    buffer[row, begin : begin + n] = values[r, :n]
            spans.append((row, begin, n))
        return spans

    def trim(self, spans: list[tuple[int, int, int]], written: torch.Tensor) -> None:
        """Clear the columns recorded for tokens the commit did not write (EOS, budget, a stop)."""
        for (row, begin, n), kept in zip(spans, written.tolist()):
            for buffer in (self.logits, self.scores):
                if buffer is not None and kept < n:
                    buffer[row, begin + kept : begin + n] = 0.0

    def row_scores(self, row: int, columns: int) -> tuple[torch.Tensor, ...]:
        """What ``generate`` hands stopping criteria after ``columns`` tokens: one [1, V] score per column."""
        return tuple(self.scores[row : row + 1, t] for t in range(columns))

    def columns(self, width: int) -> tuple[tuple | None, tuple | None]:
        """(scores, logits) as generate returns them: one [N, V] tensor per generated column."""
        def split(buffer):
            return None if buffer is None else tuple(buffer[:, t] for t in range(width))

        return split(self.scores), split(self.logits)


def prefill(target, drafter, input_ids, attention_mask, capacity: int):
    """One target forward over the prompts: fills its KV cache and the drafter's context.

    input_ids, attention_mask: [N, P] -> (cache, DraftContext with P slots, last logits [N, V])."""
    layer_ids = drafter.config.target_layer_ids
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=target.config)
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()  # lets sliding-window layers be cropped
    out = target(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache,
                 use_cache=True, output_hidden_states=[i + 1 for i in layer_ids],
                 logits_to_keep=last_position(input_ids.shape[1], input_ids.device))
    context = DraftContext(drafter, input_ids.shape[0], capacity, input_ids.device)
    context.append(tapped_features(out.hidden_states, layer_ids), positions, attention_mask.bool())
    return cache, context, out.logits[:, -1].float()


def verify(target, layer_ids, cache, context: DraftContext, ids: torch.Tensor, positions: torch.Tensor,
           tree: DraftTree | None = None):
    """One target forward over ``ids`` [N, w] (anchor + drafts) at ``positions`` [N, w], seeing the
    context's valid slots (and, for a ``tree``, each slot its own branch only) -> (float logits
    [N, w, V], tapped features [N, w, taps * H])."""
    mask = context.verify_mask(ids.shape[1])
    if tree is not None:
        mask = tree_attention_mask(mask, tree, target.config._attn_implementation, target.dtype)
    out = target(input_ids=ids, attention_mask=mask, position_ids=positions,
                 cache=cache, use_cache=True, output_hidden_states=[i + 1 for i in layer_ids])
    return out.logits.float(), tapped_features(out.hidden_states, layer_ids)


def observe_tree_round(policy: VerifyPolicy, draft: Proposal, tree: DraftTree, result) -> None:
    """A tree round calibrates the tree's head nodes by depth, and the head's chain and the n-gram's as
    far as each was in the tree."""
    m = tree.head_nodes
    policy.observe_tree(draft.node_logp[:, :m], draft.node_depth[:, :m], result.node_accepted)
    policy.observe(draft.head_confidence, result.greedy_verified, result.greedy_accepted,
                   torch.zeros_like(result.accepted))
    if tree.ngram_slots:
        ngram_source = torch.where(draft.ngram_size > 0, draft.ngram_size, -1)
        policy.observe(torch.ones_like(draft.head_confidence), result.ngram_verified, result.ngram_accepted,
                       ngram_source)


def speculative_decode(target, drafter, cache, context: DraftContext, rows: _Rows, output: _Output,
                       policy: VerifyPolicy, sampler: _Sampler, stats: SpeculativeStats, block_size: int,
                       streamer=None, ngram_size: int = 0, trees: bool = False,
                       processors: TargetLogitsProcessors | None = None, deadline: float | None = None,
                       token_scores: _TokenScores | None = None) -> None:
    """Rounds of draft -> host read -> verify -> accept until every row has finished. With ``trees``, a
    round where the head drafted may verify a tree: its likeliest continuations and the n-gram's chain
    (``draft_tree``), as the policy plans. Tree nodes are fixed drafts (the head drafts greedily), so the
    target's token at every slot is its argmax or, when sampling, a draw (``_Sampler.pick_per_slot``).
    ``processors`` process the verified logits slot by slot first; past ``deadline`` (``time.monotonic``)
    every row stops after its round, as ``max_time`` stops ``generate``; ``token_scores`` records the logits
    that chose each committed token."""
    layer_ids, offsets = drafter.config.target_layer_ids, output.offsets
    unused_tail = torch.zeros((), dtype=torch.long, device=rows.anchor.device)
    no = torch.zeros((), dtype=torch.bool, device=rows.anchor.device)
    path_order, path_moves = None, no  # last round's tree path, moved to the cache's front after the host read
    rank_nodes = (lambda out: rank_continuations(drafter, out, block_size - 1)) if trees else None
    # with trees the head's q never meets the target (tree nodes and n-gram chains are fixed drafts)
    draft_temperature = 0.0 if trees else sampler.draft_temperature
    vocab = drafter.bound_target.lm_head_weight.shape[0]
    draft_hook = processors is not None and takes_logits_processor(drafter)
    longest = int(output.count.max())  # tokens generated by any row, at most (a bound kept on the host)
    policy.room = output.max_new_tokens - 2  # every row has written its first token
    while True:
        history = length = None
        if ngram_size:  # no row's text is longer than ``longest``: the lookup reads no further
            history = output.history[rows.index, : output.prompt_length + longest]
            length = output.prompt_length + output.count[rows.index]
        draft, head_drafted = propose(drafter, policy, context, rows.anchor, rows.anchor_pos, block_size,
                                      draft_temperature, sampler.generator, ngram_size, history, length,
                                      rank_nodes, processors.for_drafts(output, rows) if draft_hook else None)
        stats.draft_passes += head_drafted
        tree_round = trees and head_drafted
        with record_function("dflash2::plan"):
            if tree_round:  # (m, kg): the head's m likeliest continuations and the n-gram's first kg drafts
                nodes = HeadNodes(draft.node_tokens, draft.node_depth, draft.node_logp, draft.node_parent)
                if draft.ngram_tokens is None:
                    draft.ngram_size = torch.zeros_like(rows.anchor)
                    spells = torch.zeros_like(draft.node_tokens, dtype=torch.bool)
                else:
                    spells = spelling(nodes, draft.ngram_tokens)
                plan = [*policy.choose_tree(draft.node_logp, draft.node_depth, draft.ngram_size, spells)]
            else:  # (k, -)
                plan = [0 if draft is None else policy.choose(draft.confidence, draft.source, head_drafted), 0]
        # The one host read per round: any row running, all rows running, trailing slots no row needs, the
        # plan, whether any row took the head's draft, whether last round's tree path must move, and the
        # most drafts a running row can still commit: a round writes a row's accepted drafts and one token
        # more, so with r tokens of its budget left a row can use r - 1 drafts.
        room = output.max_new_tokens - 1 - output.count[rows.index]
        any_running, all_running, crop, k, k_ngram, head_used, move, most_room = torch.stack([
            (~rows.finished).any().long(), (~rows.finished).all().long(), unused_tail.long(),
            *(torch.as_tensor(x, device=no.device).long() for x in plan),
            (no if draft is None else draft.uses_head).long(), path_moves.long(),
            torch.where(rows.finished, 0, room).max()]).tolist()
        if not any_running:
            return
        stats.verify_forwards += 1
        # a tree's m counts its nodes, not their depth: the tree is kept unless no row has room
        k, k_ngram = min(k, most_room) if not tree_round or most_room == 0 else k, min(k_ngram, most_room)
        policy.room = most_room
        if move:  # before the crop: the path's slots are among the cache's last W
            move_path_to_front(cache, path_order)
        path_order, path_moves = None, no
        if crop > 0:
            cache.crop(-crop)
            context.crop(crop)
        if not all_running:
            keep = (~rows.finished).nonzero().flatten()  # rows finished: drop them, they stop costing
            cache.batch_select_indices(keep)
            context.select(keep)
            rows = rows.select(keep)
            if draft is not None:
                draft = draft.select(keep)

        tree = None
        if tree_round:
            k_ngram = k_ngram if draft.ngram_tokens is not None else 0
            head_used = k > 0
            if k == 0:  # the n-gram's chain alone (a linear round), or a plain step
                if k_ngram:
                    draft = make_proposal(None, draft.ngram_tokens, draft.ngram_size, None, rows.anchor, vocab)
                k = k_ngram
            else:
                nodes = HeadNodes(draft.node_tokens, draft.node_depth, draft.node_logp, draft.node_parent)
                tree = build_tree(nodes, k, draft.head_tokens, draft.ngram_tokens, k_ngram, block_size)
        if draft is not None:
            policy.chosen(k if tree is None else tree.width - 1, bool(head_used))
        longest += (k if tree is None else tree.width - 1) + 1

        if tree is None:
            drafts = draft.tokens[:, :k] if k else rows.anchor[:, None][:, :0]
            ids = torch.cat([rows.anchor[:, None], drafts], dim=1)
            positions = rows.anchor_pos[:, None] + offsets[: k + 1]
            with record_function("dflash2::verify"):
                logits, features = verify(target, layer_ids, cache, context, ids, positions)
            with record_function("dflash2::accept"):
                raw_path = logits
                if processors is not None:
                    logits = processors.round(output, rows, ids, logits)
                processed_path = logits
                accepted, tokens = sampler.accept(drafts, draft, logits)
                source = None if draft is None else draft.source
                policy.observe(None if draft is None else draft.confidence, k, accepted, source)
        else:
            k = tree.width - 1
            ids = torch.cat([rows.anchor[:, None], tree.tokens], dim=1)
            with record_function("dflash2::verify"):
                logits, features = verify(target, layer_ids, cache, context, ids,
                                          rows.anchor_pos[:, None] + tree.depth, tree)
            with record_function("dflash2::accept"):
                raw = logits
                if processors is not None:
                    logits = processors.round(output, rows, ids, logits, tree)
                result = accept_tree(tree, sampler.pick_per_slot(logits, tree.depth))
                # as if the path was verified alone: the features now, the cache after the next host read
                features = gather_path(features, result.order)
                if token_scores is not None:
                    raw_path, processed_path = gather_path(raw, result.order), gather_path(logits, result.order)
                path_order, path_moves = result.order, path_out_of_place(result.order, result.accepted)
                positions = rows.anchor_pos[:, None] + offsets[: k + 1]
                accepted, tokens = result.accepted, result.tokens
                observe_tree_round(policy, draft, tree, result)
                source = torch.where(result.winner == 1, draft.ngram_size, 0)
        with record_function("dflash2::accept"):
            spans = None
            if token_scores is not None:  # before the commit: stopping criteria read this round's scores
                spans = token_scores.record(rows, output.count[rows.index], accepted + 1, raw_path,
                                            sampler.warp(processed_path) if token_scores.scores is not None else None)
            written, within, rows.finished = output.commit(rows, tokens, accepted + 1)
            if spans is not None:
                token_scores.trim(spans, written)
            stats.record(accepted, written, verified=k, source=source, tree=tree is not None)
            if deadline is not None and time.monotonic() > deadline:
                rows.finished = torch.ones_like(rows.finished)
        if streamer is not None:
            streamer.put(tokens[0, : int(written[0])].cpu())

        # The anchor and the accepted drafts become the drafter's context; the bonus is the next anchor.
        with record_function("dflash2::context"):
            context.append(features, positions, within)
        rows.anchor = tokens.gather(1, accepted[:, None]).squeeze(1)
        rows.anchor_pos = rows.anchor_pos + accepted + 1
        unused_tail = torch.where(rows.finished, k + 1, k - accepted).min()
        policy.room = most_room - 1  # every running row commits at least one token a round


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids: torch.LongTensor,
    attention_mask: torch.LongTensor | None = None,
    max_new_tokens: int | None = None,
    do_sample: bool | None = UNSET,
    temperature: float | None = UNSET,
    top_k: int | None = UNSET,
    top_p: float | None = UNSET,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
    streamer=None,
    adaptive: bool = True,
    verify_policy: VerifyPolicy | None = None,
    cost_model: CostModel | None = None,
    ngram_size: int = DEFAULT_NGRAM_SIZE,
    draft_tree: bool = True,
    generation_config: GenerationConfig | None = None,
    tokenizer=None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    packed_attention: bool = True,
    linear_kernel: str | None = "auto",
    **generation_kwargs,
) -> SpeculativeOutput:
    """Generate with the target, drafted by a dFlash 2 / DFlash 1 head. Output equals the target's own.

    input_ids / attention_mask: [N, P], left-padded for N > 1. The generation settings follow
    ``target.generate``'s precedence (``resolve_generation_config``): keyword arguments (an explicit
    ``None`` overrides, e.g. ``top_k=None`` is no top-k, as in ``generate``; ``max_new_tokens``,
    ``eos_token_id`` and ``pad_token_id`` at None are not given; other ``GenerationConfig`` fields go in
    ``generation_kwargs``), then ``generation_config``, then ``target.generation_config``, then
    Transformers' defaults; so a call samples the law ``target.generate`` would with the same arguments.
    Greedy unless ``do_sample``; ``temperature`` / ``top_k`` / ``top_p``
    sample losslessly: linear rounds by speculative sampling with the drafter's q, tree rounds by the
    target's own draw at every slot (``draft_tree``). The length is ``max_new_tokens``, else
    ``max_length`` minus the prompt (at most the context less a block), else 64 tokens. ``stop_strings``
    (with ``tokenizer``, as ``generate``) end a row at the token that completes one, checked after every
    token as ``generate`` does. Logits processors (repetition penalty, no-repeat n-grams, bad words, minimum
    lengths, ..., a ``logits_processor`` list and ``prefix_allowed_tokens_fn``, called with the prompt's index
    as ``generate`` calls it) run at every verified slot on that slot's own text
    (``TargetLogitsProcessors``: one small call per row and slot, only when one is on); ``max_time`` stops
    every row after the round that passes it; a ``stopping_criteria`` list is called after every committed
    token on the row's text up to it (one row at a time; the row's scores so far with ``output_scores``,
    else ``scores=None``, as ``generate``) and ends the row where it fires. Settings the loop does not apply
    (beams, guidance, top-h, ...) are refused by name where ``generate`` would apply them, before the prefill.
    ``return_dict_in_generate`` with ``output_scores`` / ``output_logits`` fills the output's ``scores`` /
    ``logits`` as ``generate``'s (``SpeculativeOutput``); ``num_return_sequences`` (sampling) repeats each
    prompt's row, as ``generate`` expands them.
    ``streamer`` (batch 1; a Transformers ``TextStreamer`` or anything with ``put``/``end``) receives the
    prompt, then each round's committed tokens - one extra host read per round, only when streaming.
    ``adaptive`` (default) verifies, each round, the number of drafts that maximises expected tokens per
    second under the measured ``cost_model`` (measured once per machine / dtype / shape and cached when
    not given); ``adaptive=False`` verifies the whole block; ``verify_policy`` overrides both
    (e.g. ``ForcedVerifyLengths([0, 3, 1])``). ``stats.verify_length_histogram`` reports the choices.
    ``ngram_size`` (default 3, at most 4; 0 turns it off): rows may draft by prompt lookup instead, from
    the most recent earlier occurrence of their last ``n <= ngram_size`` tokens in the prompt or output,
    when the policy expects that to be accepted further than the head's draft (``stats.ngram_rounds``).
    ``block_size`` (the anchor plus the most drafts a round verifies) defaults to the head's, widened to
    16 when n-gram drafts are on with the adaptive policy; the head always drafts within its own block.
    ``draft_tree`` (with the adaptive policy; not on sliding-window targets): a round may verify the
    head's likeliest continuations and the n-gram's chain as branches of one forward and keep
    the path accepted furthest (``stats.tree_rounds``; ``draft_tree=False``: one chain per row). When
    sampling, the target draws its token at every slot and the path follows the draws (still lossless).
    ``packed_attention`` (default): a target on ``sdpa`` with grouped-query attention runs
    ``attention.packed_gqa_sdpa`` during the call (the same attention without copying keys and values per
    query head; its cost model is measured and cached under it), and is put back on ``sdpa`` after.
    ``linear_kernel`` (CPU): "auto" (default) runs each forward's linear layers on the kernel measured
    fastest for its width (PyTorch's default or oneDNN with packed weights: the plain step, the verify and
    the draft pass each on their own; ``kernels_dflash2.ForwardKernels``), "default" / "onednn" one kernel
    for every forward, None the model as loaded. The layers are put back as they were when the call returns.
    """
    check_ngram_size(ngram_size)
    check_input_ids(input_ids)
    # eos / pad ids: None = not given (the configs' ids), as before session 30
    config = resolve_generation_config(
        target, generation_config, do_sample=do_sample, temperature=temperature, top_k=top_k,
        top_p=top_p, eos_token_id=UNSET if eos_token_id is None else eos_token_id,
        pad_token_id=UNSET if pad_token_id is None else pad_token_id, **generation_kwargs,
    )
    # Given here, max_new_tokens bypasses GenerationConfig's check, which refuses 0 (a no-op call to us).
    if max_new_tokens is None:
        max_new_tokens = _new_token_budget(config, input_ids.shape[1],
                                           target.config.get_text_config().max_position_embeddings,
                                           block_size or drafter.config.block_size)
    stop_strings = None
    if config.stop_strings:
        if tokenizer is None:
            raise ValueError(f"stop_strings={config.stop_strings!r} needs the tokenizer: pass tokenizer=... "
                             "(as with target.generate)")
        from transformers.generation.stopping_criteria import StopStringCriteria

        stop_strings = StopStringCriteria(tokenizer, config.stop_strings)
    do_sample, top_k, top_p = bool(config.do_sample), config.top_k, config.top_p
    temperature = 1.0 if config.temperature is None else config.temperature
    room = (target.config.get_text_config().max_position_embeddings or 1 << 30) - input_ids.shape[1] - max_new_tokens
    # Only the adaptive policy chooses how far to verify, so only it gets the wider n-gram rounds.
    widen = adaptive and verify_policy is None
    block_size = round_block_size(drafter, ngram_size if widen else 0, block_size, room, cost_model)
    if attention_mask is None:  # as generate: leading pad tokens are padding (then checked as a given mask)
        attention_mask = mask_from_padding(input_ids, config)
    validate_generation_inputs(target, drafter, input_ids, attention_mask, max_new_tokens, block_size)
    if do_sample and not temperature > 0:
        raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
    copies = config.num_return_sequences if config.num_return_sequences is not None else 1
    if not isinstance(copies, int) or copies < 1:
        raise ValueError(f"num_return_sequences must be a positive integer, got {copies!r}")
    if copies > 1:  # greedy is refused by GenerationConfig's validation, as in generate
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
    n_rows = input_ids.shape[0]
    if streamer is not None and n_rows != 1:
        copies_note = f" ({n_rows // copies} prompts x num_return_sequences={copies})" if copies > 1 else ""
        raise ValueError(f"streamer needs batch size 1, got {n_rows} rows{copies_note}")
    drafter.bind_target(target)
    device = input_ids.device
    # generate's fallback: with no pad token, finished rows are filled with the first EOS id (0 is a real token)
    pad_token_id, eos_ids = _pad_id(config), _eos_tensor(config.eos_token_id, "cpu")
    if pad_token_id is None:
        pad_token_id = int(eos_ids[0]) if len(eos_ids) else 0
    stats = SpeculativeStats(block_size)
    returned = bool(config.return_dict_in_generate)
    want_scores, want_logits = returned and bool(config.output_scores), returned and bool(config.output_logits)
    if max_new_tokens == 0:
        return SpeculativeOutput(input_ids.clone(), torch.zeros(n_rows, dtype=torch.long, device=device), stats,
                                 () if want_scores else None, () if want_logits else None)
    # the processors in force change which drafts pass: calls under other processors calibrate apart
    settings_key = (repr([getattr(config, name, None) for name in PROCESSED_SETTINGS]),
                    tuple(type(p).__qualname__ for p in logits_processor or ()), prefix_allowed_tokens_fn is not None)
    kernels = ForwardKernels(target, drafter, n_rows, block_size, linear_kernel)
    with packed_gqa_attention(target, packed_attention), kernels:
        running_attention = target.config._attn_implementation
        if cost_model is not None and cost_model.key.get("attention", running_attention) != running_attention:
            warnings.warn(f"cost_model was measured under {cost_model.key['attention']!r} attention, the call runs "
                          f"{running_attention!r} (packed_attention={packed_attention}): its verify costs may be off",
                          stacklevel=2)
        policy = verify_policy_for(target, drafter, n_rows, block_size, adaptive, verify_policy, cost_model,
                                   reproducible=do_sample, settings_key=settings_key)
        stats.costs = policy.cost.as_dict() if isinstance(getattr(policy, "cost", None), CostModel) else None

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        processors = TargetLogitsProcessors(target, config, input_ids, attention_mask, max_new_tokens, logits_processor,
                                            prefix_allowed_tokens_fn)
        processors = processors if processors.active else None
        sampler = _Sampler(do_sample, temperature, top_k, top_p, generator, config, device)
        token_scores = None
        if want_scores or want_logits:
            token_scores = _TokenScores(n_rows, max_new_tokens, target.get_output_embeddings().weight.shape[0], device,
                                        want_scores, want_logits)
        deadline = time.monotonic() + config.max_time if config.max_time is not None else None
        cache, context, last_logits = prefill(target, drafter, input_ids, attention_mask,
                                              input_ids.shape[1] + max_new_tokens + 2 * block_size)
        eos = _eos_tensor(config.eos_token_id, device)
        criteria = StoppingCriteriaList(stopping_criteria) if stopping_criteria else None  # a plain list too
        output = _Output(input_ids, attention_mask, max_new_tokens, block_size, pad_token_id, eos, stop_strings,
                         criteria)
        output.token_scores = token_scores
        raw_logits = last_logits
        if processors is not None:
            last_logits = processors.first(output, last_logits)
        anchor = sampler.pick(last_logits)
        running = torch.zeros(n_rows, dtype=torch.bool, device=device)
        rows = _Rows(torch.arange(n_rows, device=device), anchor, attention_mask.long().sum(-1), running)
        first = torch.ones_like(anchor)
        if token_scores is not None:  # before the commit, as in every round
            spans = token_scores.record(rows, torch.zeros_like(anchor), first, raw_logits[:, None],
                                        sampler.warp(last_logits)[:, None] if want_scores else None)
        written, _, rows.finished = output.commit(rows, anchor[:, None], first)
        if token_scores is not None:
            token_scores.trim(spans, written)
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
            streamer.put(anchor.cpu())
        trees = draft_tree and policy.plans_trees and supports_trees(target, cache)
        speculative_decode(target, drafter, cache, context, rows, output, policy, sampler, stats, block_size, streamer,
                           ngram_size, trees, processors, deadline, token_scores)
        if streamer is not None:
            streamer.end()
    width = int(output.count.max())
    scores, logits = token_scores.columns(width) if token_scores is not None else (None, None)
    return SpeculativeOutput(torch.cat([input_ids, output.tokens[:, :width]], dim=1), output.count, stats,
                             scores, logits)
