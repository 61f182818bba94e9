"""What a call returns and the buffers a round writes into.

``SpeculativeOutput`` is the call's result. ``Rows`` are the rows still running, ``OutputBuffer`` their
generated text with the stops inside a block (EOS, the token budget, stop strings, stopping criteria), and
``TokenScores`` the logits that chose each token, kept only when ``output_scores`` / ``output_logits`` ask.

Shapes: N rows of the call, n rows still running, P the prompt length, V the target's vocabulary, w a
round's verified slots (the anchor and its drafts), B the block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..speculative_dflash2 import SpeculativeStats, grown


@dataclass
class SpeculativeOutput(ModelOutput):
    """What ``speculative_generate`` returns. A ``ModelOutput``, as ``generate``'s: fields by attribute or key
    (``out["sequences"]``), unset ones left out.

    Args:
        sequences (`torch.LongTensor` of shape `(N, P + G)`):
            Each row's prompt as given, then its generated tokens, right-padded with ``pad_token_id`` after the
            row's end (G: the most tokens any row generated).
        num_generated (`torch.LongTensor` of shape `(N,)`):
            The tokens each row generated.
        stats (`SpeculativeStats`):
            Acceptance statistics over all rows and rounds.
        scores (`tuple(torch.FloatTensor)`, *optional*, one of shape `(N, V)` per generated column):
            With ``return_dict_in_generate`` and ``output_scores``, as ``generate``'s: ``scores[t][i]`` holds the
            target's logits that chose row i's token t after the logits processors (and, when sampling, the
            warpers), so ``target.compute_transition_scores`` works on them. Columns past a row's end are zeros
            (``generate`` would hold the logits of the padding it kept feeding a finished row).
        logits (`tuple(torch.FloatTensor)`, *optional*, one of shape `(N, V)` per generated column):
            With ``return_dict_in_generate`` and ``output_logits``: the same before any processor, the target's
            raw logits.
    """

    sequences: torch.Tensor | None = None
    num_generated: torch.Tensor | None = None
    stats: SpeculativeStats | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class Rows:
    """The running rows: output row index, anchor token and position, finished flag (all [n])."""

    index: torch.Tensor
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    finished: torch.Tensor

    def select(self, keep: torch.Tensor) -> Rows:
        return Rows(self.index[keep], self.anchor[keep], self.anchor_pos[keep], self.finished[keep])


class OutputBuffer:
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
        self.token_scores: TokenScores | None = None  # set when scores are collected (the criteria read them)
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

    def commit(self, rows: Rows, tokens: torch.Tensor, commit: torch.Tensor):
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

    def _criteria_cut(self, rows: Rows, written: torch.Tensor):
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

    def _stop_string_cut(self, rows: Rows, written: torch.Tensor, width: int):
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


class TokenScores:
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

    def record(self, rows: Rows, start: torch.Tensor, count: torch.Tensor, logits: torch.Tensor,
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
