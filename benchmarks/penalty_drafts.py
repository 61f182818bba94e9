"""Why a repetition penalty leaves the fast loop little to accept: how often the head's drafts match the target.

    python benchmarks/penalty_drafts.py [--prompts 2] [--new-tokens 72] [--stride 3] [--penalty 1.2]
                                        [--head HEAD_FOLDER] [--output STEM]

Per prompt (HumanEval and MT-Bench, the first ``--prompts`` of each), fp32: the target's greedy text with
and without ``repetition_penalty``. At every ``--stride``-th position of each text, the head drafts a block
from the true prefix (the drafter's context from a prefill, as the loop holds it), and we count the drafts
that match the text from there (the accepted run of a fixed chain of B − 1) and whether position 1 matches:

- ``plain text, no hook``: the unpenalized text, the head as it is (what it was trained for);
- ``penalized text, no hook``: the penalized text, the head's logits untouched;
- ``penalized text, penalty on drafts``: the same, the penalty applied to the head's logits on the committed
  text before the path selector, as the fast loop does (``TargetLogitsProcessors.for_drafts``);
- ``penalized text, penalty at the target's scale``: the same, on the head's log-probabilities plus the target's
  log-normaliser where it chose the anchor (the penalty scales a logit by its own size).

If the last two are alike and both far below the first, a penalty costs acceptance because the head never
saw penalized text, not because the loop drafts without the penalty. The plain arm drafts on its own text (the
unpenalized one), so its blocks are other positions; the two penalized arms share theirs. Only the penalty is
applied (the target's generation_config enables no other processor).
``--head`` (default: the committed head) compares a head fine-tuned on penalized text (``hf-dflash2 regenerate
--repetition-penalty``). Writes benchmarks/results/<--output, default penalty_drafts_<cpu kind>>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, cpu_kind, save, table  # noqa: E402

from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts, load_target  # noqa: E402
from hf_dflash2.generation import prefill  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402

ARMS = ("plain text, no hook", "penalized text, no hook", "penalized text, penalty on drafts",
        "penalized text, penalty at the target's scale")


def penalty_hook(penalty: RepetitionPenaltyLogitsProcessor, text: torch.Tensor, vocab_size: int,
                 target_logsumexp: torch.Tensor | None = None):
    """A ``draft_block`` logits hook: the penalty on the committed ``text`` [1, t], at every drafted position.
    ``target_logsumexp`` [1]: first move the head's logits to the target's scale (its log-probabilities plus
    the target's log-normaliser where it chose the anchor), since the penalty divides or multiplies logits
    by their own size."""

    def hook(logits: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        if target_logsumexp is not None:
            logits = logits.float().log_softmax(-1) + target_logsumexp[:, None, None]
        out = logits.clone()
        for position in range(logits.shape[1]):
            scores = logits[:, position].float()
            if vocab is not None:
                scores = scores.new_full((1, vocab_size), float("-inf")).index_copy(1, vocab, scores)
            scores = penalty(text, scores)
            out[:, position] = (scores if vocab is None else scores[:, vocab]).to(out.dtype)
        return out

    return hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=2, help="prompts per set")
    parser.add_argument("--new-tokens", type=int, default=72)
    parser.add_argument("--stride", type=int, default=3)
    parser.add_argument("--penalty", type=float, default=1.2)
    parser.add_argument("--head", default=None, help="head folder (default: heads/smollm2-135m-dflash2)")
    parser.add_argument("--output", default=None, help="file stem under benchmarks/results")
    args = parser.parse_args()
    if args.prompts < 1 or args.new_tokens < 16 or args.stride < 1 or not args.penalty > 0:
        parser.error(f"need --prompts >= 1, --new-tokens >= 16, --stride >= 1, --penalty > 0; got {vars(args)}")
    target, tokenizer = load_target(dtype=torch.float32)
    head = load_head(args.head or default_head("smollm2-135m-dflash2"), target)
    head.bind_target(target)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    drafts = head.config.block_size - 1
    penalty = RepetitionPenaltyLogitsProcessor(args.penalty)
    prompts = load_humaneval_prompts()[: args.prompts] + load_mtbench_prompts()[: args.prompts]
    counts = {arm: {"blocks": 0, "accepted": 0, "first": 0} for arm in ARMS}
    with torch.no_grad():
        for prompt in prompts:
            ids = encode_prompt(tokenizer, prompt, "cpu")
            for penalized in (False, True):
                text = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                       **GREEDY, **({"repetition_penalty": args.penalty} if penalized else {}))
                arms = ARMS[1:] if penalized else ARMS[:1]
                for t in range(ids.shape[1], text.shape[1] - drafts - 1, args.stride):
                    _, context, last = prefill(target, head, text[:, :t], torch.ones_like(text[:, :t]), t + drafts + 1)
                    truth = text[0, t + 1 : t + 1 + drafts]
                    for arm in arms:
                        hook = None
                        if arm.endswith("drafts"):
                            hook = penalty_hook(penalty, text[:, : t + 1], vocab_size)
                        elif arm.endswith("scale"):
                            hook = penalty_hook(penalty, text[:, : t + 1], vocab_size, last.logsumexp(-1))
                        draft = head.draft_block(text[:, t], torch.tensor([t]), context.kv, context.valid,
                                                 context.positions, 0.0, None, drafts + 1, logits_processor=hook)
                        same = (draft.tokens[0] == truth).long()
                        counts[arm]["blocks"] += 1
                        counts[arm]["accepted"] += int(same.cumprod(0).sum())
                        counts[arm]["first"] += int(same[0])
    if any(c["blocks"] == 0 for c in counts.values()):
        raise SystemExit(f"no block to draft: --new-tokens {args.new_tokens} leaves no position past a prompt")
    rows = [{"arm": arm, "blocks": c["blocks"], "mean accepted drafts": round(c["accepted"] / c["blocks"], 3),
             "position 1 matches": round(c["first"] / c["blocks"], 3)} for arm, c in counts.items()]
    command = " ".join(["python benchmarks/penalty_drafts.py", *sys.argv[1:]])
    stem = args.output or f"penalty_drafts_{cpu_kind()}"
    markdown = (f"`{command}` (fp32, repetition_penalty {args.penalty}, {len(prompts)} prompts, a chain of {drafts} "
                f"drafts every {args.stride} tokens; head {args.head or 'committed'})\n\n"
                f"{table(rows, list(rows[0]))}\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {save(stem, {'command': command, 'penalty': args.penalty, 'head': str(args.head), 'rows': rows})}")


if __name__ == "__main__":
    main()
