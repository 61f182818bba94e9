"""The README's usage, runnable offline: SmolLM2-135M-Instruct with the committed dFlash 2 head.

    python examples/quickstart.py [--max-new-tokens 96]

1. ``target.generate(**inputs, assistant_model=drafter)``: Transformers' own loop, greedy, token-identical
   to plain ``generate`` (checked here, in fp32).
2. ``speculative_generate``: the fast loop on a left-padded batch of two chats, with a stop string, then
   sampled twice from one seed (the same text both times).
3. The fast loop's ``output_scores``: each generated token's log-probability, as ``generate`` returns it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hf_dflash2 import DFlash2DraftModel, speculative_generate
from hf_dflash2.assets import load_target

HEAD = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-dflash2"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    target, tokenizer = load_target()  # fp32: greedy text equal to plain generate's, token for token
    drafter = DFlash2DraftModel.from_pretrained(HEAD, dtype=target.dtype).eval()  # saved in bf16

    chat = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        plain = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        assisted = target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens,
                                   do_sample=False)
    stats = drafter.last_speculative_stats
    print(f"generate(assistant_model=...): identical to plain generate: {torch.equal(plain, assisted)}, "
          f"tau {stats.acceptance_length:.2f} tokens per target forward")

    chats = [chat, [{"role": "user", "content": "Name three rivers in Europe, one per line."}]]
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    tokenizer.padding_side = "left"  # the fast loop continues every row after its last column
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        result = speculative_generate(target, drafter, **batch, max_new_tokens=args.max_new_tokens,
                                      stop_strings=["\n\n"], tokenizer=tokenizer)
        for row, count in enumerate(result.num_generated.tolist()):
            reply = result.sequences[row, batch["input_ids"].shape[1]:][:count]
            print(f"--- row {row} ({count} tokens, stopped at a blank line or the budget):")
            print(tokenizer.decode(reply, skip_special_tokens=True))
        print(f"fast loop: tau {result.stats.acceptance_length:.2f}")
        samples = [speculative_generate(target, drafter, **batch, max_new_tokens=32, do_sample=True,
                                        temperature=0.8, generator=torch.Generator().manual_seed(0)).sequences
                   for _ in range(2)]
    print(f"sampled twice from seed 0: the same text both times: {torch.equal(*samples)}")

    scored_options = dict(max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True,
                          output_scores=True)
    with torch.no_grad():
        fast = speculative_generate(target, drafter, **inputs, **scored_options)
        reference = target.generate(**inputs, **scored_options)
    log_probs = target.compute_transition_scores(fast.sequences, fast.scores, normalize_logits=True)
    expected = target.compute_transition_scores(reference.sequences, reference.scores, normalize_logits=True)
    same_scores = torch.equal(fast.sequences, reference.sequences) and torch.allclose(log_probs, expected, atol=1e-3)
    print(f"fast loop with output_scores: log-probabilities equal generate's: {same_scores} "
          f"(mean {float(log_probs.mean()):.2f} nats per token)")
    return 0 if torch.equal(plain, assisted) and torch.equal(*samples) and same_scores else 1


if __name__ == "__main__":
    sys.exit(main())
