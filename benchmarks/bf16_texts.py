"""Which text each method decodes in bf16, and how repetitive it is: plain greedy, prompt lookup, the fast loop.

    python benchmarks/bf16_texts.py [--set mtbench] [--prompts 7,8,1] [--new-tokens 256]

In bf16 each method's forward runs on its own kernel path, so near-ties flip and texts part from plain
greedy's. A repetitive text is cheap for prompt lookup (it drafts repeats for free), so a method's
wall-clock speed on one prompt mixes its own cost with the text it happened to decode. Per prompt
(1-based numbers of the set), after one warm-up call each: tokens/s of one timed run, how many leading
tokens equal plain greedy's, and the share of the text's 4-grams seen earlier in it. Prints a table.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import apply_chat_template_option, default_head, encode_prompt, load_head  # noqa: E402


def repeated_4grams(tokens: list[int]) -> float:
    seen, repeats = set(), 0
    for i in range(len(tokens) - 3):
        gram = tuple(tokens[i : i + 4])
        repeats += gram in seen
        seen.add(gram)
    return repeats / max(1, len(tokens) - 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="mtbench")
    parser.add_argument("--prompts", default="7,8,1", help="1-based prompt numbers of the set")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    args = parser.parse_args()
    try:
        numbers = [int(n) for n in args.prompts.split(",")]
    except ValueError:
        numbers = [0]
    if not all(n >= 1 for n in numbers) or args.new_tokens < 1:
        parser.error(f"--prompts takes 1-based numbers and --new-tokens >= 1, got {args.prompts!r}, {args.new_tokens}")
    target, tokenizer = load_target_for_decoding(args.dtype)
    apply_chat_template_option(tokenizer, "auto")
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    prompts = load_prompt_set(args.set, max(numbers))
    n = args.new_tokens
    rows = []
    for number in numbers:
        ids = encode_prompt(tokenizer, prompts[number - 1], target.device)
        calls = {
            "plain greedy": lambda: target.generate(ids, max_new_tokens=n, **GREEDY),
            "prompt lookup": lambda: target.generate(ids, max_new_tokens=n, prompt_lookup_num_tokens=10, **GREEDY),
            "fast loop": lambda: speculative_generate(target, head, ids, max_new_tokens=n).sequences,
        }
        texts = {}
        for method, fn in calls.items():
            fn()  # warm-up
            started = time.perf_counter()
            text = fn()[0, ids.shape[1] :]
            seconds = time.perf_counter() - started
            texts[method] = text
            reference = texts["plain greedy"]
            width = min(len(text), len(reference))
            same = int((text[:width] == reference[:width]).int().cumprod(0).sum())
            rows.append({"prompt": number, "method": method, "tokens": len(text), "tokens_per_s": len(text) / seconds,
                         "same_prefix_as_plain": same, "repeated_4grams": repeated_4grams(text.tolist())})
    print(f"{args.set}, {str(target.dtype).removeprefix('torch.')}, {n} tokens\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
