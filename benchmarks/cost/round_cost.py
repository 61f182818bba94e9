"""Cost of speculative rounds on SmolLM2-135M-Instruct (this CPU), measured side by side.

    python benchmarks/cost/round_cost.py [--new-tokens 96] [--repeats 3] [--dtype auto|bf16|fp32]

1. One draft+verify round vs one plain AR decode step, with an untrained head and no n-gram drafts (tau ~ 1,
   so this is pure overhead), every round verifying the whole block (``adaptive=False``), block size 16 and
   8, with the full vocabulary and with the committed head's 8,192-token draft vocabulary (the shape heads
   trained here ship in). Goals: <= 2.0x (B=16) and <= 1.8x (B=8) an AR step. Each method runs
   ``--new-tokens`` and a third of it; the difference in time over the difference in rounds (steps) is
   the cost of a round (a step), with the prefill and the last rounds, which verify only the drafts the
   budget has room for, cancelled out.
   The AR step is plain ``generate``'s on the target's own attention (``sdpa``); since the fast loop runs
   the packed grouped-query attention (``hf_dflash2.cpu.attention``), the round is also given over
   ``generate``'s step on that attention, so the ratio does not bank the attention's gain.
2. Tokens/s of plain AR, `generate(assistant_model=head)` and the fast loop with the same head, batch 1
   (goal: fast loop >= 1.15x the Transformers path), and AR vs fast loop at batch 8.
In the dtype ``auto`` decodes in, on the linear kernel ``auto`` picks (``--dtype``: that dtype instead).
Writes benchmarks/results/<cpu kind>/round_cost[_<dtype>].json (no suffix for ``auto``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, interleaved, save, table  # noqa: E402

from hf_dflash2 import DFlash2DraftModel, speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts  # noqa: E402
from hf_dflash2.cost_model_dflash2 import linear_kernel_of  # noqa: E402
from hf_dflash2.cpu.attention import packed_gqa_attention  # noqa: E402
from hf_dflash2.cpu.linear_kernels import use_linear_kernel  # noqa: E402
from hf_dflash2.cpu.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, left_pad, load_head  # noqa: E402
from hf_dflash2.prompts import encode_prompt as encode  # noqa: E402

# Fixed-block rounds (every round verifies the whole block): benchmarks/speed/adaptive.py measures adaptive ones.
FIXED = dict(adaptive=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=96, help="also timed at a third of it; the difference")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    args = parser.parse_args()
    target, tokenizer = load_target_for_decoding(args.dtype)
    kernel = linear_kernel_of(target)

    def packed_greedy(*inputs, **options):
        with packed_gqa_attention(target):
            return target.generate(*inputs, **options)

    def fresh_head(block: int, vocab: list[int] | None = None):
        """An untrained head of the committed head's layers and taps, on the target's dtype and kernel."""
        head = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=block, selector_rank=128,
                                            target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0).eval()
        if vocab is not None:
            head.set_draft_vocab(vocab)
        head = head.to(target.dtype).bind_target(target)
        use_linear_kernel(head, kernel)
        return head

    prompts = load_humaneval_prompts()[:8]
    single = encode(tokenizer, prompts[0], "cpu")
    n = args.new_tokens
    rows = []
    results = {"command": "python benchmarks/cost/round_cost.py " + " ".join(sys.argv[1:]), "dtype": str(target.dtype),
               "linear_kernel": kernel}
    short = max(1, n // 3)
    # The committed head's 8,192-token draft vocabulary on an untrained head of each block: the shape every
    # head trained here ships in (its draft pass's LM head is a sixth of the full vocabulary's).
    draft_vocab = load_head(default_head("smollm2-135m-dflash2"), target).draft_vocab.tolist()
    for block, vocab in ((16, None), (16, draft_vocab), (8, None), (8, draft_vocab)):
        head = fresh_head(block, vocab)
        head.adaptive_verify = False  # the Transformers path verifies the whole block too
        head.ngram_size = 0  # the head's drafts alone: tau ~ 1, every round is overhead
        calls, rounds = {}, {}
        for length in (short, n):
            calls[("ar", length)] = lambda m=length: target.generate(single, max_new_tokens=m, **GREEDY)
            calls[("ar_packed", length)] = lambda m=length: packed_greedy(single, max_new_tokens=m, **GREEDY)
            calls[("fast", length)] = lambda m=length: speculative_generate(target, head, single, max_new_tokens=m,
                                                                           ngram_size=0, **FIXED)
            calls[("hf", length)] = lambda m=length: target.generate(single, assistant_model=head, max_new_tokens=m,
                                                                     **GREEDY)
        with torch.no_grad():
            medians = interleaved(calls, args.repeats)
            for length in (short, n):
                rounds[("fast", length)] = calls[("fast", length)]().stats.rounds
                calls[("hf", length)]()
                rounds[("hf", length)] = head.last_speculative_stats.rounds
        # The difference between the two lengths: the prefill, and the last rounds, which verify no more
        # drafts than the budget has room for, cancel out; what is left is full-block rounds and AR steps.
        step = {m: (medians[(m, n)] - medians[(m, short)]) / (n - short) for m in ("ar", "ar_packed")}
        round_s = {m: (medians[(m, n)] - medians[(m, short)]) / (rounds[(m, n)] - rounds[(m, short)])
                   for m in ("fast", "hf")}
        tau = (n - short) / (rounds[("fast", n)] - rounds[("fast", short)])
        rows.append({"block_size": block, "draft_vocab": len(vocab) if vocab else "full", "tau": tau,
                     "ar_step_ms": step["ar"] * 1e3, "fast_round_ms": round_s["fast"] * 1e3,
                     "hf_round_ms": round_s["hf"] * 1e3,
                     "fast_round_over_ar_step": round_s["fast"] / step["ar"],
                     "over_packed_ar_step": round_s["fast"] / step["ar_packed"],
                     "fast_tokens_per_s_over_hf": (medians[("hf", n)] - medians[("hf", short)])
                     / (medians[("fast", n)] - medians[("fast", short)])})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    results["rounds"] = rows
    head = fresh_head(16)
    ids, mask = left_pad([encode(tokenizer, p, "cpu") for p in prompts], tokenizer.pad_token_id)
    with torch.no_grad():
        medians = interleaved({
            "ar_b8": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                             pad_token_id=tokenizer.pad_token_id, **GREEDY),
            "fast_b8": lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n, **FIXED),
        }, max(1, args.repeats - 1))
    results["batch8"] = {"ar_tokens_per_s": 8 * n / medians["ar_b8"], "fast_tokens_per_s": 8 * n / medians["fast_b8"]}
    print(f"\nOne round vs one AR step (untrained head, tau ~ 1), SmolLM2-135M-Instruct {target.dtype}, "
          f"linear kernel {kernel}:\n")
    print(table(rows, ["block_size", "draft_vocab", "tau", "ar_step_ms", "fast_round_ms", "hf_round_ms",
                       "fast_round_over_ar_step", "over_packed_ar_step", "fast_tokens_per_s_over_hf"]))
    print(f"\nbatch 8 (upper bound: every row runs {n} tokens): {results['batch8']}")
    suffix = "" if args.dtype == "auto" else f"_{args.dtype}"
    print(f"written {save(f'round_cost{suffix}', results)}")


if __name__ == "__main__":
    main()
