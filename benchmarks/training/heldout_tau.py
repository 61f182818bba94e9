"""Held-out tau of saved heads, measured exactly as the trainer's evaluation measures a run.

Same prompts (``training.commands.heldout_prompts``: HumanEval and MT-Bench alternating, never in the
training data), greedy fast loop with a fixed block (the adaptive policy would hide a weak draft) and
the head's drafts alone (``ngram_size=0``; the loop's default adds n-gram drafts), same
budget. Heads are evaluated side by side in one process, so a new head is compared with the committed
one on equal terms before it replaces it.

    python benchmarks/training/heldout_tau.py heads/smollm2-135m-dflash2 runs/flagship/head --prompts 16 --tokens 64 \\
        --prompt-slice K --output benchmarks/results/<cpu kind>/heldout_tau_sliceK.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch


def evaluate(
    target,
    tokenizer,
    head_dirs: list[str],
    prompts: list[dict],
    tokens: int,
    repetition_penalty: float = 1.0,
    block_size: int | None = None,
) -> dict:
    """``prompts``: ``training.commands.heldout_prompts``; ``repetition_penalty`` as ``generate``'s (1.0: off);
    ``block_size``: the verified block (default: each head's own), e.g. a head trained at 16 measured at 8."""
    from hf_dflash2 import DFlash2DraftModel, speculative_generate
    from hf_dflash2.generation import PLAIN_GREEDY
    from hf_dflash2.training.regenerate import encode_prompts

    encoded = encode_prompts(tokenizer, prompts, 1024)
    results = {}
    for head_dir in head_dirs:
        drafter = DFlash2DraftModel.from_pretrained(head_dir, dtype=target.dtype).eval()
        by_set: dict[str, object] = {}
        for prompt_id, ids in encoded:
            name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
            result = speculative_generate(
                target,
                drafter,
                torch.tensor([ids]),
                max_new_tokens=tokens,
                adaptive=False,
                ngram_size=0,
                block_size=block_size,
                **{**PLAIN_GREEDY, "repetition_penalty": repetition_penalty},
            )  # the head alone: every round verifies its block, no n-gram drafts (on by default)
            for key in (name, "all"):  # fresh copies: merge() accumulates into its receiver
                by_set[key] = copy.deepcopy(result.stats) if key not in by_set else by_set[key].merge(result.stats)
        results[head_dir] = {
            name: {
                "tau": round(s.acceptance_length, 3),
                "rounds": s.rounds,
                "committed": s.committed,
                "per_position": [round(x, 3) for x in s.per_position_acceptance[:6]],
            }
            for name, s in by_set.items()
        }
        print(head_dir, json.dumps(results[head_dir]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("heads", nargs="+")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=None, help="JSON file to write")
    parser.add_argument(
        "--prompt-slice",
        type=int,
        default=0,
        choices=range(10),
        help="1..9: 16 other prompts (heldout_prompts), a second opinion",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="verify blocks of this many tokens (default: each head's own)"
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="target and heads run in this dtype")
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="decode as generate(repetition_penalty=P) does, penalty applied to the drafts too (1.0: off)",
    )
    args = parser.parse_args()
    if not args.repetition_penalty > 0:
        raise SystemExit(f"--repetition-penalty {args.repetition_penalty}: must be > 0 (1.0 is off)")
    if args.block_size is not None and args.block_size < 2:
        raise SystemExit(f"--block-size {args.block_size}: must be >= 2 (the anchor and a draft)")
    for head in args.heads:
        if not (Path(head) / "config.json").exists():
            raise SystemExit(f"{head}: not a head folder (no config.json)")
    from hf_dflash2.assets import load_target
    from hf_dflash2.training.commands import heldout_prompts

    prompts = heldout_prompts(args.prompts, args.prompt_slice)
    target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    results = evaluate(target, tokenizer, args.heads, prompts, args.tokens, args.repetition_penalty, args.block_size)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": " ".join(["python", "benchmarks/training/heldout_tau.py"] + sys.argv[1:]),
            "repetition_penalty": args.repetition_penalty,
            "block_size": args.block_size,
            "prompts": [p["id"] for p in prompts],  # --prompts above 16 adds none: 8 HumanEval, 8 MT-Bench
            "results": results,
        }
        args.output.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
