"""``target.generate(**inputs, assistant_model=drafter)`` for dFlash 2 / DFlash 1 heads.

How it is hooked in: Transformers picks a candidate generator in the private
``GenerationMixin._get_candidate_generator``, and nothing there asks the assistant for its own. We wrap
that method once (idempotently, on import of the drafter's modeling file, remote code included) with one
rule: if the assistant has a ``get_candidate_generator`` method and no other speculation mode was
requested (prompt lookup, early exit, MTP, ``speculation_type``), use it; otherwise call the original.
Every other assistant, and ``generate`` without an assistant, behaves exactly as before.

Shipped with saved heads as remote code (sibling of ``modeling_dflash2.py``).
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from typing import Any

import torch
from transformers.generation.candidate_generator import CandidateGenerator

from .cost_model_dflash2 import verify_policy_for
from .kernels_dflash2 import ForwardKernels
from .speculative_dflash2 import (
    DEFAULT_NGRAM_SIZE,
    DraftContext,
    SpeculativeStats,
    check_ngram_size,
    dense_proposal,
    propose,
    round_block_size,
    tapped_features,
)


class DFlash2CandidateGenerator(CandidateGenerator):
    """Drafts a block per round from the target's tapped hidden states (batch size 1, as the HF loop).

    The first call only lets the target prefill (no candidates). Each later call turns the hidden states
    of the tokens the target just accepted into drafter context (``DraftContext``, as the fast loop),
    asks the verify policy how many drafts to return (``adaptive`` by default, see
    ``cost_model_dflash2``; none at all on plain-step rounds), drafts after the bonus token, and returns
    them with, when sampling, ``log q`` as candidate logits (-inf outside the selector's K candidates),
    which Transformers' lossless ``_speculative_sampling`` turns back into q exactly.

    The policy comes from the drafter: ``drafter.verify_policy`` (a ``VerifyPolicy``, e.g.
    ``ForcedVerifyLengths``) if set, else adaptive unless ``drafter.adaptive_verify`` is False; a cost
    model can be given as ``drafter.verify_cost_model``. Rows may draft by prompt lookup instead (as
    ``speculative_generate``'s ``ngram_size``): ``drafter.ngram_size`` (default 3, 0 turns it off).
    Of Transformers' assisted-generation settings, ``num_assistant_tokens`` of the ``generate`` call caps the
    drafts a round returns (Transformers' own assisted loop reads it from the assistant's generation config,
    which a head does not have; the default, 20, binds only blocks wider than 21, and no published head's is);
    ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` are left to the verify policy,
    which already sets each round's length from the head's confidence and the measured costs.
    Statistics of the call are left on ``drafter.last_speculative_stats``.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target, generation_config, logits_processor=None, tokenizer=None,
                 stopping_criteria=None, prompt_length: int | None = None):
        self.drafter = drafter
        self.target = target
        self.layer_ids = drafter.config.target_layer_ids
        # Only the tapped layers are captured by the verify forward (Transformers takes a list of indices),
        # unless the caller asked generate for every layer's hidden states: a list would leave the others None.
        self.model_kwargs_overrides = (
            {} if generation_config.output_hidden_states else {"output_hidden_states": [i + 1 for i in self.layer_ids]}
        )
        self.ngram_size = getattr(drafter, "ngram_size", DEFAULT_NGRAM_SIZE)
        widen = getattr(drafter, "adaptive_verify", True) and getattr(drafter, "verify_policy", None) is None
        self.block_size = round_block_size(drafter, self.ngram_size if widen else 0, None, generation_config.max_length,
                                           getattr(drafter, "verify_cost_model", None))
        self.max_length = generation_config.max_length
        cap = getattr(generation_config, "num_assistant_tokens", None)
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"num_assistant_tokens must be an integer >= 0, got {cap!r}")
        self.max_drafts = self.block_size - 1 if cap is None else min(cap, self.block_size - 1)
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = float(generation_config.temperature or 1.0) if self.do_sample else 0.0
        self.logits_processor = logits_processor
        # The kernel of each target forward and draft pass, by its width, for as long as this generate call
        # holds the generator (Transformers drops it when the call returns; the layers are then restored).
        kernels = ForwardKernels(target, drafter, 1, self.block_size, getattr(drafter, "linear_kernel", "auto"))
        weakref.finalize(self, kernels.__exit__, None, None, None)
        kernels.__enter__()
        self.policy = verify_policy_for(
            target, drafter, 1, self.block_size, getattr(drafter, "adaptive_verify", True),
            getattr(drafter, "verify_policy", None), getattr(drafter, "verify_cost_model", None),
            reproducible=self.do_sample,
            # calls under other logits processors (a repetition penalty, ...) calibrate apart
            settings_key=tuple(type(p).__qualname__ for p in logits_processor or ()),
            expected_context=((prompt_length or 0) + (self.max_length or prompt_length or 0)) // 2,  # mid-call
        )
        # Transformers checks stopping criteria once per assisted step, on the sequence's end, so a stop
        # (a stop string, a caller's criterion) reached before a step's last new token goes unseen and the
        # text runs on past it. Greedy, we cut each draft before the token where generate's criteria would
        # fire: the stop can then only fall on a step's last token. Sampling cannot cut on the drafted
        # tokens' values without changing the law. Where generate's criteria do not reach us (a Transformers
        # that builds the generator elsewhere), stop strings alone are rebuilt from the tokenizer.
        self.stop_criteria = None
        if stopping_criteria is not None and not self.do_sample:
            from transformers.generation.stopping_criteria import (
                EosTokenCriteria,
                MaxLengthCriteria,
                StoppingCriteriaList,
            )

            # Transformers crops each step at EOS and at the length itself; the rest it does not.
            others = [c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))]
            self.stop_criteria = StoppingCriteriaList(others) if others else None
        elif generation_config.stop_strings and tokenizer is not None:
            if self.do_sample:
                warnings.warn("with a dFlash 2 assistant and do_sample=True, Transformers checks stop_strings once "
                              "per assisted step, so a text may run past one; hf_dflash2.speculative_generate "
                              "checks every token", stacklevel=2)
            else:
                from transformers.generation.stopping_criteria import StopStringCriteria

                self.stop_criteria = StopStringCriteria(tokenizer, generation_config.stop_strings)
        self.context = DraftContext(drafter, 1, self.max_length + self.block_size, drafter.device)
        self.stats = SpeculativeStats(self.block_size)
        cost = getattr(self.policy, "cost", None)
        self.stats.costs = cost.as_dict() if hasattr(cost, "as_dict") else None
        self.draft, self.verified_last = None, 0
        drafter.last_speculative_stats = self.stats

    @property
    def num_drafting_tokens(self) -> int:
        # Transformers >= 5.25 sizes the target cache's rollback record by this (most candidates per round).
        return max(1, self.max_drafts)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        if is_first_iteration:
            return input_ids, None  # the target prefills and picks the first token itself
        if model_outputs is None or getattr(model_outputs, "hidden_states", None) is None:
            raise ValueError("DFlash2CandidateGenerator needs the target's hidden states from the previous forward")
        cur_len = input_ids.shape[1]
        device = self.drafter.device
        new_context = cur_len - 1 - self.context.length  # the prompt, then the anchor and accepted drafts
        features = tapped_features(model_outputs.hidden_states, self.layer_ids)[:, :new_context]
        positions = torch.arange(self.context.length, cur_len - 1, device=device)[None]
        self.context.append(features.to(device), positions)

        self.draft, self.verified_last = None, 0
        room = self.max_length - cur_len - 1
        if room <= 0 or self.max_drafts == 0:
            return input_ids, None  # a plain step: the target verifies the anchor alone
        self.policy.room = room
        anchor = input_ids[:, -1].to(device)
        anchor_pos = torch.tensor([cur_len - 1], device=device)
        history = input_ids.to(device) if self.ngram_size else None
        with torch.no_grad():
            draft, head_drafted = propose(
                self.drafter, self.policy, self.context, anchor, anchor_pos, self.block_size, self.temperature,
                None, self.ngram_size, history, torch.tensor([cur_len], device=device),
            )
        self.stats.draft_passes += head_drafted
        if draft is None:
            return input_ids, None
        # Capped before the policy hears it: it times each round against the verify it was told of.
        length = min(int(self.policy.choose(draft.confidence, draft.source, head_drafted)), room, self.max_drafts)
        tokens = draft.tokens[:, :length].to(input_ids.device)
        if self.stop_criteria is not None:
            before_stop = self._before_stop(torch.cat([input_ids, tokens], dim=1), cur_len, length)
            # The text ends there: the room is the cut, as at the budget's end, so a cut to no drafts leaves the
            # policy's back-off as it was (a partial cut is judged on what the policy chose).
            if before_stop < length:
                self.policy.room = before_stop
            length, tokens = before_stop, tokens[:, :before_stop]
        self.policy.chosen(length, bool(draft.uses_head))
        if length == 0:
            return input_ids, None
        self.draft, self.verified_last = draft, length
        candidate_logits = None
        if self.do_sample:
            vocab = self.target.config.get_text_config().vocab_size
            q = dense_proposal(draft.q_ids[:, :length], draft.q_probs[:, :length], vocab)
            candidate_logits = q.log().to(input_ids.device)
        return torch.cat([input_ids, tokens], dim=1), candidate_logits

    def _before_stop(self, sequence: torch.Tensor, cur_len: int, length: int) -> int:
        """How many of the ``length`` drafts at the end of ``sequence`` [1, cur_len + length] come before the
        first one after which a stopping criterion fires (a stop string completes)."""
        for index in range(length):
            if bool(self.stop_criteria(sequence[:, : cur_len + index + 1], None)[0]):
                return index
        return length

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        accepted = torch.as_tensor([int(num_matches)], device=self.drafter.device)
        draft = self.draft
        confidence, source = (None, None) if draft is None else (draft.confidence, draft.source)
        self.policy.observe(confidence, self.verified_last, accepted, source)
        self.stats.record(accepted, accepted + 1, verified=self.verified_last, source=source)
        self.stats.verify_forwards += 1


def candidate_generator_for(drafter, target, generation_config, *, logits_processor=None, input_ids=None,
                            tokenizer=None, stopping_criteria=None):
    """Validate and build the generator (called from the hook before any target forward)."""
    if input_ids is not None and input_ids.shape[0] != 1:
        raise ValueError(
            f"generate(assistant_model=<dFlash 2 drafter>) runs at batch size 1 (got {input_ids.shape[0]} rows), like "
            "every Transformers assisted loop; use hf_dflash2.speculative_generate(target, drafter, input_ids, "
            "attention_mask=...) for batched speculative decoding"
        )
    if generation_config.num_return_sequences and generation_config.num_return_sequences > 1:
        raise ValueError(
            f"num_return_sequences={generation_config.num_return_sequences} is not supported with a dFlash 2 assistant; "
            "call generate once per sequence or batch the prompt with hf_dflash2.speculative_generate"
        )
    if getattr(generation_config, "num_beams", 1) and generation_config.num_beams > 1:
        raise ValueError(f"num_beams={generation_config.num_beams}: beam search cannot be combined with a dFlash 2 assistant")
    check_ngram_size(getattr(drafter, "ngram_size", DEFAULT_NGRAM_SIZE), "drafter.ngram_size")
    drafter.bind_target(target)
    return DFlash2CandidateGenerator(drafter, target, generation_config, logits_processor, tokenizer, stopping_criteria,
                                     prompt_length=None if input_ids is None else input_ids.shape[1])


SUPPORTED_TRANSFORMERS = "transformers>=5.20,<6"
HOOKED_PARAMETERS = ("self", "generation_config", "input_ids", "inputs_tensor", "logits_processor", "model_kwargs",
                     "assistant_model")


def check_hooked_signature(method) -> None:
    """The wrapper relies on the private method's leading parameters; refuse a Transformers that changed them."""
    import transformers

    names = tuple(inspect.signature(method).parameters)[: len(HOOKED_PARAMETERS)]
    if names != HOOKED_PARAMETERS:
        raise ImportError(
            f"hf_dflash2 supports {SUPPORTED_TRANSFORMERS}: transformers {transformers.__version__} has "
            f"GenerationMixin._get_candidate_generator{names}, expected the leading parameters {HOOKED_PARAMETERS}. "
            f"Install a supported version (pip install '{SUPPORTED_TRANSFORMERS}') or use "
            "hf_dflash2.speculative_generate, which does not go through generate()."
        )


def _callers_stopping_criteria():
    """generate's prepared stopping criteria, read from ``_assisted_decoding``, which builds the candidate
    generator and holds them (Transformers passes them to no candidate generator); None elsewhere."""
    from transformers import StoppingCriteriaList

    frame = sys._getframe(2)  # the wrapper's caller
    if frame.f_code.co_name != "_assisted_decoding":
        return None
    criteria = frame.f_locals.get("stopping_criteria")
    return criteria if isinstance(criteria, StoppingCriteriaList) else None


def install_generate_hook() -> None:
    """Let ``generate`` ask an assistant for its own candidate generator (idempotent, see module doc)."""
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._get_candidate_generator
    if getattr(original, "_dflash2_hook", False):
        return
    check_hooked_signature(original)

    def _get_candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model=None, *args, **kwargs):
        factory = getattr(assistant_model, "get_candidate_generator", None)
        other_mode = (
            generation_config.prompt_lookup_num_tokens is not None
            or generation_config.assistant_early_exit is not None
            or getattr(generation_config, "use_mtp", False)
            or getattr(generation_config, "speculation_type", None) is not None
        )
        if factory is not None and not other_mode:
            extra = {}
            tokenizer = kwargs.get("target_tokenizer", args[0] if args else None)
            accepted = inspect.signature(factory).parameters
            if tokenizer is not None and "tokenizer" in accepted:
                extra["tokenizer"] = tokenizer  # heads saved by early 0.1.0 take no tokenizer
            criteria = _callers_stopping_criteria()
            if criteria is not None and "stopping_criteria" in accepted:
                extra["stopping_criteria"] = criteria  # nor do some heads saved by 0.1.0
            return factory(
                target=self,
                generation_config=generation_config,
                logits_processor=logits_processor,
                model_kwargs=model_kwargs,
                input_ids=input_ids,
                **extra,
            )
        return original(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, assistant_model, *args, **kwargs)

    _get_candidate_generator._dflash2_hook = True
    _get_candidate_generator.__wrapped__ = original
    GenerationMixin._get_candidate_generator = _get_candidate_generator
