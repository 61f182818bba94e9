"""``generate``'s logits processors on the target's logits at every verified slot, each on its own text.

Shapes: N rows of the call, n rows still running, P the prompt length, V the target's vocabulary, w a
round's verified slots (the anchor and its drafts).
"""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from .outputs import OutputBuffer, Rows
from .trees import DraftTree


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

    batched_penalty = True  # False: the per-slot calls for a penalty too (an A/B in docs/benchmarks.md)

    def __init__(self, target, config: GenerationConfig, input_ids, attention_mask, max_new_tokens: int,
                 logits_processor=None, prefix_allowed_tokens_fn=None):
        plain = copy.deepcopy(config)
        # the warpers stay with Sampler, batched over slots; when sampling, so does renormalize_logits, which
        # generate applies after them (Sampler.warp)
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

    def _seen(self, output: OutputBuffer, rows: Rows) -> torch.Tensor:
        """[n, V + 1] bool: the tokens of each running row's prompt and committed text (column V: none)."""
        tokens = output.tokens[rows.index]
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        unwritten = columns[None] >= output.count[rows.index][:, None]
        ids = torch.where(unwritten, self.vocab_size, tokens.clamp(max=self.vocab_size))
        return self._prompt_seen[rows.index].scatter(1, ids, True)

    def first(self, output: OutputBuffer, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] after the prompts -> processed."""
        return torch.cat([processors(output.text(i, 0)[None], logits[i : i + 1])
                          for i, processors in enumerate(self.per_row)])

    def for_drafts(self, output: OutputBuffer, rows: Rows):
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

    def round(self, output: OutputBuffer, rows: Rows, ids: torch.Tensor, logits: torch.Tensor,
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
