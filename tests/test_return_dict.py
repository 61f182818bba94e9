"""What ``generate`` returns beyond the text, from the fast loop: ``return_dict_in_generate`` with
``output_scores`` / ``output_logits`` (the logits that chose each token, raw and processed, as generate's),
and ``num_return_sequences`` samples per prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria
from transformers.generation.logits_process import (
    LogitNormalization,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_dflash2 import speculative_generate

from .conftest import tiny_drafter
from .test_draft_tree import ForcedTrees
from .test_logits_processors import _oracle
from .test_logits_processors import target as target  # noqa: F401 (the module's sharp float64 target)
from .test_ngram import _left_padded

PROMPTS = [list(range(20, 30)) + [20, 21], [9, 10, 11], [3, 4, 3, 4]]
RETURN = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.mark.parametrize("rounds", ["chains", "trees"])
def test_scores_and_logits_are_generates_token_by_token(target, rounds):
    """Batch 3, left-padded, a repetition penalty (so processed scores differ from raw logits), rows that end
    at EOS at different lengths: every generated column's scores and logits equal ``generate``'s for rows
    still running, zeros past a row's end; on oracle-drafted chains and on forced tree rounds (where the
    committed path's slots are not the first ones)."""
    ids, mask = _left_padded(PROMPTS)
    common = dict(max_new_tokens=24, do_sample=False, pad_token_id=0, repetition_penalty=1.3, eos_token_id=None)
    reference = target.generate(ids, attention_mask=mask, **common, **RETURN)
    eos = int(reference.sequences[1, ids.shape[1] + 9])  # row 1 ends at its 10th token, the others later or never
    common["eos_token_id"] = eos
    reference = target.generate(ids, attention_mask=mask, **common, **RETURN)
    if rounds == "chains":
        drafter = _oracle(target, reference.sequences, ids, mask)
        policy = dict(adaptive=False)
    else:
        drafter = tiny_drafter(target, block_size=5).to(torch.float64)
        policy = dict(verify_policy=ForcedTrees([(3, 6), (2, 4)]), block_size=12)
    out = speculative_generate(target, drafter, ids, mask, **common, **policy, **RETURN)
    assert out.stats.accepted > 5
    if rounds == "trees":
        assert out.stats.tree_rounds > 0
    assert torch.equal(out.sequences, reference.sequences)
    columns = out.sequences.shape[1] - ids.shape[1]
    assert len(out.scores) == len(out.logits) == columns == len(reference.scores)
    ended = out.num_generated.tolist()
    assert min(ended) < columns  # some row ended before the others
    for t in range(columns):
        for row in range(len(PROMPTS)):
            if t < ended[row]:
                torch.testing.assert_close(out.logits[t][row], reference.logits[t][row], rtol=1e-4, atol=1e-3)
                torch.testing.assert_close(out.scores[t][row], reference.scores[t][row], rtol=1e-4, atol=1e-3)
                assert not torch.equal(out.scores[t][row], out.logits[t][row]) or t == 0
            else:
                assert not out.scores[t][row].any() and not out.logits[t][row].any()
    transition = target.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    expected = target.compute_transition_scores(reference.sequences, reference.scores, normalize_logits=True)
    running = torch.arange(columns)[None] < out.num_generated[:, None]
    torch.testing.assert_close(transition[running], expected[running], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("renormalize", [False, True])
def test_sampled_scores_are_the_warped_logits_of_the_text_so_far(target, renormalize):
    """Sampling with ``num_return_sequences=3`` from two prompts, forced tree rounds, a repetition penalty,
    temperature, top-k and min-p (and ``renormalize_logits``, which generate applies after the warpers):
    rows come three per prompt, in generate's order; each token's ``logits`` are a fresh target forward on
    the text before it, and its ``scores`` are generate's processors and warpers applied to them on that text."""
    prompts = torch.tensor([[20, 21, 22, 23, 20, 21], [5, 6, 7, 5, 6, 7]])
    settings = dict(temperature=1.5, top_k=12, min_p=0.05, repetition_penalty=1.3, renormalize_logits=renormalize)
    drafter = tiny_drafter(target, block_size=5).to(torch.float64)
    out = speculative_generate(target, drafter, prompts, max_new_tokens=12, do_sample=True, num_return_sequences=3,
                               generator=torch.Generator().manual_seed(0), eos_token_id=None, block_size=10,
                               verify_policy=ForcedTrees([(3, 4), (2, 2)]), **settings, **RETURN)
    assert out.sequences.shape == (6, 6 + 12) and out.stats.tree_rounds > 0
    assert torch.equal(out.sequences[:, :6], prompts.repeat_interleave(3, dim=0))
    assert len({tuple(row) for row in out.sequences[:, 6:].tolist()}) > 2  # samples, not copies
    chain = [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(1.5), TopKLogitsWarper(12),
             MinPLogitsWarper(0.05), *([LogitNormalization()] if renormalize else [])]
    with torch.no_grad():
        fresh = target(out.sequences).logits.float()  # no padding: one forward covers every prefix
    for t in range(12):
        text = out.sequences[:, : 6 + t]
        torch.testing.assert_close(out.logits[t], fresh[:, 5 + t], rtol=1e-4, atol=1e-3)
        expected = out.logits[t]
        for step in chain:
            expected = step(text, expected)
        torch.testing.assert_close(out.scores[t], expected, rtol=1e-4, atol=1e-3)
        chosen = out.sequences[:, 6 + t]
        assert bool(out.scores[t].gather(1, chosen[:, None]).isfinite().all())  # each token was allowed


def test_what_is_not_returned_is_refused_or_empty(target):
    drafter = tiny_drafter(target).to(torch.float64)
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(ValueError, match=r"output_attentions=True \(from the call\)"):
        speculative_generate(target, drafter, ids, return_dict_in_generate=True, output_attentions=True)
    with pytest.raises(ValueError, match=r"num_return_sequences.*\(got 3\)"):
        speculative_generate(target, drafter, ids, num_return_sequences=3)
    with pytest.raises(ValueError, match=r"num_return_sequences must be a positive integer, got 0"):
        speculative_generate(target, drafter, ids, num_return_sequences=0, do_sample=True)
    # as generate: without return_dict_in_generate these ask for nothing
    out = speculative_generate(target, drafter, ids, max_new_tokens=3, output_hidden_states=True, output_scores=True)
    assert out.scores is None and out.logits is None
    out = speculative_generate(target, drafter, ids, max_new_tokens=0, **RETURN)
    assert out.scores == () and out.logits == ()
    out = speculative_generate(target, drafter, ids, max_new_tokens=3, return_dict_in_generate=True,
                               output_logits=True)
    assert out.scores is None and len(out.logits) == 3


def test_the_output_reads_like_generates(target):
    """A ``ModelOutput``, as ``generate``'s dict output: by key or attribute, unset fields left out."""
    drafter = tiny_drafter(target).to(torch.float64)
    out = speculative_generate(target, drafter, torch.tensor([[3, 4, 5]]), max_new_tokens=3, **RETURN)
    assert out["sequences"] is out.sequences and out["scores"] is out.scores
    assert list(out.keys()) == ["sequences", "num_generated", "stats", "scores", "logits"]
    plain = speculative_generate(target, drafter, torch.tensor([[3, 4, 5]]), max_new_tokens=3)
    assert "scores" not in plain and plain.scores is None
    assert torch.equal(plain.sequences, out.sequences)


class StopOnCloseCall(StoppingCriteria):
    """Reads the scores: stop once the chosen token led the runner-up by less than ``margin``."""

    def __init__(self, margin: float):
        self.margin, self.lengths = margin, []

    def __call__(self, input_ids, scores, **kwargs):
        self.lengths.append(len(scores))
        top2 = scores[-1].topk(2, dim=-1).values
        return (top2[:, 0] - top2[:, 1]) < self.margin


def test_stopping_criteria_read_the_scores_when_they_are_collected(target):
    """With ``output_scores``, ``generate`` hands stopping criteria the scores so far; a criterion that reads
    them stops the fast loop's rows where it stops ``generate``'s (mid-round, on oracle-drafted chains), and
    sees one score per generated column."""
    ids = torch.tensor([[20, 21, 22, 23, 24, 25, 20, 21]])
    common = dict(max_new_tokens=40, do_sample=False, eos_token_id=None, **RETURN)
    reference = target.generate(ids, **common)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in reference.scores]
    margin = sorted(gaps[8:])[0] + 1e-3  # fires late enough for drafts to run past it
    stop_at = next(t for t, gap in enumerate(gaps) if gap < margin)
    expected = target.generate(ids, stopping_criteria=[StopOnCloseCall(margin)], **common)
    assert expected.sequences.shape[1] == ids.shape[1] + stop_at + 1
    drafter = _oracle(target, reference.sequences, ids, torch.ones_like(ids))
    criterion = StopOnCloseCall(margin)
    out = speculative_generate(target, drafter, ids, adaptive=False, stopping_criteria=[criterion], **common)
    assert torch.equal(out.sequences, expected.sequences) and len(out.scores) == stop_at + 1
    assert criterion.lengths == list(range(1, stop_at + 2))


def test_score_buffers_grow_with_what_is_written_not_the_budget(target):
    drafter = tiny_drafter(target).to(torch.float64)
    ids = torch.tensor([[3, 4, 5]])
    eos = int(target.generate(ids, max_new_tokens=3, do_sample=False)[0, -1])
    out = speculative_generate(target, drafter, ids, max_new_tokens=400, eos_token_id=eos, **RETURN)
    vocab = target.config.vocab_size
    assert len(out.scores) == 3
    assert out.scores[0].untyped_storage().nbytes() <= 64 * vocab * 4  # not 400 columns
