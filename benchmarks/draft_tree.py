"""Draft trees on the wall clock: the fast loop with and without draft trees, side by side.

    python benchmarks/draft_tree.py [--prompts 6] [--new-tokens 192] [--repeats 3] [--dtype auto]

Batch 1, T = 0, SmolLM2-135M-Instruct with the committed head, decoding in the dtype ``auto`` picks here
(bf16 on a CPU with fast bf16). Per prompt, interleaved with the order rotated every repeat: plain greedy
``generate``, the fast loop with head + n-gram drafts verified one source per row (``draft_tree=False``),
the fast loop with trees (the default), and ``generate(assistant_model=head)`` (Transformers' assisted
loop, which verifies one linear candidate per round). Speeds are tokens / median seconds per prompt,
summed over the set; in bf16 each method may decode a slightly different text (near-tie flips), so
tokens are counted per method, and a text that parts into a loop (long, easy to draft) or ends early
moves the sums: the median over prompts of the per-prompt tokens/s ratio is the robust figure.
Writes benchmarks/results/<--output, default draft_tree>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, chart_bars, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import apply_chat_template_option, default_head, encode_prompt, load_head  # noqa: E402

METHODS = ("greedy", "linear", "trees", "generate_path")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto")
    parser.add_argument("--sets", default="mtbench,humaneval")
    parser.add_argument("--output", default="draft_tree", help="file stem under benchmarks/results")
    args = parser.parse_args()
    target, tokenizer = load_target_for_decoding(args.dtype, None, None)
    apply_chat_template_option(tokenizer, "auto")
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    n = args.new_tokens
    rows, prompts_detail = [], []
    for name in args.sets.split(","):
        seconds = {m: 0.0 for m in METHODS}
        tokens = {m: 0 for m in METHODS}
        taus, tree_share, per_prompt = {"linear": [], "trees": []}, [], []
        for i, prompt in enumerate(tqdm(load_prompt_set(name, args.prompts), desc=name, unit="prompt")):
            ids = encode_prompt(tokenizer, prompt, target.device)
            calls = {
                "greedy": lambda: target.generate(ids, max_new_tokens=n, **GREEDY),
                "linear": lambda: speculative_generate(target, head, ids, max_new_tokens=n, draft_tree=False),
                "trees": lambda: speculative_generate(target, head, ids, max_new_tokens=n),
                "generate_path": lambda: target.generate(ids, assistant_model=head, max_new_tokens=n, **GREEDY),
            }
            if i == 0:
                for fn in calls.values():
                    fn()  # warm-up (kernels, cost model)
            times, counts = {m: [] for m in METHODS}, {}
            for repeat in range(args.repeats):
                for method in rotated(list(METHODS), repeat + i):
                    started = time.perf_counter()
                    out = calls[method]()
                    times[method].append(time.perf_counter() - started)
                    if repeat == 0:
                        if method in ("greedy", "generate_path"):
                            counts[method] = out.shape[1] - ids.shape[1]
                        else:
                            counts[method] = int(out.num_generated[0])
                            taus[method].append(out.stats.acceptance_length)
                            if method == "trees":
                                tree_share.append(out.stats.tree_rounds / max(1, out.stats.rounds))
            medians = {m: statistics.median(t) for m, t in times.items()}
            for m in METHODS:
                seconds[m] += medians[m]
                tokens[m] += counts[m]
            # bf16 texts may part (one method's text ends early), so per prompt compare tokens per second
            per_prompt.append(counts["trees"] / medians["trees"] / (counts["linear"] / medians["linear"]))
            prompts_detail.append({"set": name, "prompt": i, "seconds": {m: round(v, 3) for m, v in medians.items()},
                                   "tokens": counts,
                                   "tau_linear": taus["linear"][-1], "tau_trees": taus["trees"][-1]})
        speed = {m: tokens[m] / seconds[m] for m in METHODS}
        rows.append({
            "set": name, "greedy_tok_s": round(speed["greedy"], 1),
            "linear_x": round(speed["linear"] / speed["greedy"], 3),
            "trees_x": round(speed["trees"] / speed["greedy"], 3),
            "generate_path_x": round(speed["generate_path"] / speed["greedy"], 3),
            "trees_over_linear": round(speed["trees"] / speed["linear"], 3),
            "trees_over_generate_path": round(speed["trees"] / speed["generate_path"], 3),
            "tau_linear": round(statistics.mean(taus["linear"]), 3),
            "tau_trees": round(statistics.mean(taus["trees"]), 3),
            "tree_round_share": round(statistics.mean(tree_share), 3),
            "median_prompt_trees_over_linear": round(statistics.median(per_prompt), 3),
            "worst_prompt_trees_over_linear": round(min(per_prompt), 3),
        })
    columns = list(rows[0])
    print(table(rows, columns))
    command = "python benchmarks/draft_tree.py " + " ".join(sys.argv[1:])
    save(args.output, {"command": command, "dtype": str(target.dtype).removeprefix("torch."),
                        "prompts_per_set": args.prompts, "new_tokens": n, "repeats": args.repeats, "rows": rows,
                        "per_prompt": prompts_detail})
    (RESULTS / f"{args.output}.md").write_text(table(rows, columns) + f"\n\nCommand: `{command}`\n")
    labels, values = [], []
    for row in rows:
        for key, label in (("linear_x", "one source per row"), ("trees_x", "trees"),
                           ("generate_path_x", "generate(assistant_model=)")):
            labels.append(f"{row['set']}\n{label}")
            values.append(row[key])
    dtype = str(target.dtype).removeprefix("torch.")
    chart_bars(labels, values, "speed / plain greedy", f"draft trees, wall clock ({dtype})",
               RESULTS / f"{args.output}.png")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
