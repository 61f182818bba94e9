"""Where a speculative round's time goes: torch.profiler over the fast loop on SmolLM2-135M-Instruct.

    python benchmarks/profile_round.py [--dtype fp32|bf16] [--block-size 16] [--new-tokens 32] [--head DIR]

Runs ``speculative_generate`` with the whole block verified every round (``adaptive=False``, so every
round has the same shape) under ``torch.profiler`` and reports, per round: the loop's phases
(``dflash2::draft`` / ``verify`` / ``accept`` / ``context``, recorded by the loop) and the operators with
the most self time. A fresh head by default (tau ~ 1: one token per round). Writes
benchmarks/results/profile_round_<dtype>_b<B>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, save, table  # noqa: E402

from hf_dflash2 import DFlash2DraftModel, speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_target  # noqa: E402
from hf_dflash2.prompts import encode_prompt  # noqa: E402

PHASES = ("dflash2::draft", "dflash2::verify", "dflash2::accept", "dflash2::context")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--head", default=None, help="a trained head folder (default: a fresh head)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tokenizer = load_target()
    target.to(dtype)
    if args.head:
        head = DFlash2DraftModel.from_pretrained(args.head).to(dtype).eval()
    else:
        head = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=args.block_size,
                                            target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0).to(dtype).eval()
    head.bind_target(target)
    ids = encode_prompt(tokenizer, load_humaneval_prompts()[0], "cpu")
    run = dict(max_new_tokens=args.new_tokens, adaptive=False, block_size=args.block_size)
    with torch.no_grad():
        speculative_generate(target, head, ids, **run)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = speculative_generate(target, head, ids, **run)
    rounds = result.stats.rounds
    events = prof.key_averages()
    phases = [{"phase": e.key, "ms_per_round": e.cpu_time_total / rounds / 1e3, "calls": e.count}
              for e in events if e.key in PHASES]
    phases.sort(key=lambda r: PHASES.index(r["phase"]))
    total = sum(r["ms_per_round"] for r in phases)
    for r in phases:
        r["share"] = r["ms_per_round"] / total
    ops = sorted((e for e in events if not e.key.startswith("dflash2::") and e.key != "ProfilerStep*"),
                 key=lambda e: -e.self_cpu_time_total)[: args.top]
    top = [{"op": e.key, "self_ms_per_round": e.self_cpu_time_total / rounds / 1e3, "calls_per_round": e.count / rounds}
           for e in ops]
    phase_table = table(phases, ["phase", "ms_per_round", "share", "calls"])
    op_table = table(top, ["op", "self_ms_per_round", "calls_per_round"])
    header = (f"One fast-loop round, SmolLM2-135M-Instruct {args.dtype}, B = {args.block_size}, "
              f"{'head ' + args.head if args.head else 'fresh head'}, tau = {result.stats.acceptance_length:.2f}, "
              f"{rounds} rounds, {torch.get_num_threads()} threads (machine shared with a training run)")
    text = f"{header}\n\n{phase_table}\n\nTop operators by self time:\n\n{op_table}\n"
    print(text)
    stem = f"profile_round_{args.dtype}_b{args.block_size}"
    (RESULTS / f"{stem}.md").write_text(text)
    command = "python benchmarks/profile_round.py " + " ".join(sys.argv[1:])
    print(f"written {save(stem, {'command': command, 'header': header, 'phases': phases, 'top_ops': top})}")


if __name__ == "__main__":
    main()
