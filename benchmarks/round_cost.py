"""Cost of speculative rounds on SmolLM2-135M-Instruct (fp32, this CPU), measured side by side.

    python benchmarks/round_cost.py [--new-tokens 48] [--repeats 3]

1. One draft+verify round vs one plain AR decode step, with an untrained head (tau ~ 1, so this is pure
   overhead), block size 16 and 8. Goals: <= 2.0x (B=16) and <= 1.8x (B=8) an AR step.
2. Tokens/s of plain AR, `generate(assistant_model=head)` and the fast loop with the same head, batch 1
   (goal: fast loop >= 1.15x the Transformers path), and AR vs fast loop at batch 8.
Writes benchmarks/results/round_cost.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, interleaved, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_target  # noqa: E402
from hf_dflash2.prompts import encode_prompt as encode  # noqa: E402
from hf_dflash2.prompts import left_pad  # noqa: E402
from hf_dflash2.training.trainer import new_drafter_for  # noqa: E402

# Fixed-block rounds (every round verifies the whole block): benchmarks/adaptive.py measures adaptive ones.
FIXED = dict(adaptive=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target, tokenizer = load_target()
    prompts = load_humaneval_prompts()[:8]
    single = encode(tokenizer, prompts[0], "cpu")
    n = args.new_tokens
    rows = []
    results = {"command": "python benchmarks/round_cost.py " + " ".join(sys.argv[1:])}
    for block in (16, 8):
        head = new_drafter_for(target, num_hidden_layers=2, block_size=block, selector_rank=128,
                               target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0).eval().bind_target(target)
        head.adaptive_verify = False  # the Transformers path verifies the whole block too
        with torch.no_grad():
            medians = interleaved({
                "ar": lambda: target.generate(single, max_new_tokens=n, **GREEDY),
                "fast": lambda: speculative_generate(target, head, single, max_new_tokens=n, **FIXED),
                "hf": lambda: target.generate(single, assistant_model=head, max_new_tokens=n, **GREEDY),
            }, args.repeats)
            tau = speculative_generate(target, head, single, max_new_tokens=n, **FIXED).stats.acceptance_length
        # With tau ~ 1 every token is one round: seconds per token of the loop = cost of a round.
        rows.append({"block_size": block, "tau": tau, "ar_step_ms": medians["ar"] / n * 1e3,
                     "fast_round_ms": medians["fast"] / n * tau * 1e3, "hf_round_ms": medians["hf"] / n * tau * 1e3,
                     "fast_round_over_ar_step": medians["fast"] * tau / medians["ar"],
                     "fast_tokens_per_s_over_hf": medians["hf"] / medians["fast"]})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    results["rounds"] = rows
    head = new_drafter_for(target, num_hidden_layers=2, block_size=16, selector_rank=128,
                           target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0).eval().bind_target(target)
    ids, mask = left_pad([encode(tokenizer, p, "cpu") for p in prompts], tokenizer.pad_token_id)
    with torch.no_grad():
        medians = interleaved({
            "ar_b8": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=tokenizer.pad_token_id, **GREEDY),
            "fast_b8": lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n, **FIXED),
        }, max(1, args.repeats - 1))
    results["batch8"] = {"ar_tokens_per_s": 8 * n / medians["ar_b8"], "fast_tokens_per_s": 8 * n / medians["fast_b8"]}
    print("\nOne round vs one AR step (untrained head, tau ~ 1), SmolLM2-135M-Instruct fp32:\n")
    print(table(rows, ["block_size", "tau", "ar_step_ms", "fast_round_ms", "hf_round_ms", "fast_round_over_ar_step", "fast_tokens_per_s_over_hf"]))
    print(f"\nbatch 8 (upper bound: every row runs {n} tokens): {results['batch8']}")
    print(f"written {save('round_cost', results)}")


if __name__ == "__main__":
    main()
