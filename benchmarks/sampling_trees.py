"""Sampling (T > 0) with draft trees against one chain per round, and plain sampling, side by side.

    python benchmarks/sampling_trees.py [--dtype auto|fp32|bf16] [--prompts 6] [--new-tokens 128]
        [--temperatures 0.7,1.0] [--top-p 0.9] [--repeats 2] [--output sampling_trees]

Batch 1, SmolLM2-135M-Instruct with the committed head, ``--prompts`` MT-Bench and as many HumanEval
prompts, top-p 0.9 by default (SmolLM2's card samples with it; 1 turns it off). Per prompt, temperature
and repeat (seed), interleaved in rotated order: Transformers' sampling
``generate``, the fast loop with one chain per round (``draft_tree=False``: the head's draft sampled from
its q, or an n-gram chain, accepted by speculative sampling) and with draft trees (the head's likeliest
continuations and the n-gram chain; the target draws at every slot and the path follows its draws).
Outputs are random, so each method is measured by its tokens per second over all its runs (total tokens /
total seconds) and by tau (tokens committed per round). Writes benchmarks/results/<output>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.charts import save_chart  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402

METHODS = ("sample", "chain", "tree")


def run_once(method, target, head, ids, n, temperature, top_p, seed):
    """-> (seconds, new tokens, speculative stats or None)"""
    started = time.perf_counter()
    if method == "sample":
        torch.manual_seed(seed)
        out = target.generate(ids, max_new_tokens=n, do_sample=True, temperature=temperature, top_k=None,
                              top_p=top_p)
        return time.perf_counter() - started, out.shape[1] - ids.shape[1], None
    out = speculative_generate(target, head, ids, max_new_tokens=n, do_sample=True, temperature=temperature,
                               top_k=None, top_p=top_p, generator=torch.Generator(device=ids.device).manual_seed(seed),
                               draft_tree=method == "tree")
    return time.perf_counter() - started, int(out.num_generated[0]), out.stats


def measure(target, head, prompts, n, temperature, top_p, repeats):
    seconds, tokens = dict.fromkeys(METHODS, 0.0), dict.fromkeys(METHODS, 0)
    rounds, committed, tree_rounds = dict.fromkeys(METHODS, 0), dict.fromkeys(METHODS, 0), 0
    for i, ids in enumerate(tqdm(prompts, desc=f"T={temperature}", unit="prompt")):
        for repeat in range(repeats):
            for method in rotated(list(METHODS), i * repeats + repeat):
                s, t, stats = run_once(method, target, head, ids, n, temperature, top_p, seed=1000 * i + repeat)
                seconds[method] += s
                tokens[method] += t
                if stats is not None:
                    rounds[method] += stats.rounds
                    committed[method] += stats.committed
                    tree_rounds += stats.tree_rounds if method == "tree" else 0
    rows = []
    for method in METHODS:
        speed = tokens[method] / seconds[method]
        rows.append({"method": method, "temperature": temperature, "tokens": tokens[method],
                     "seconds": seconds[method], "tokens_per_s": speed,
                     "tau": committed[method] / rounds[method] if rounds[method] else None,
                     "speedup_vs_sampling": speed / (tokens["sample"] / seconds["sample"])})
    rows[-1]["tree_rounds"] = tree_rounds
    rows[-1]["tree_vs_chain"] = rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"]
    return rows


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(name, t) for name, by_t in results.items() for t in by_t]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.38
    for j, method in enumerate(("chain", "tree")):
        values = [next(r for r in results[name][t] if r["method"] == method)["speedup_vs_sampling"]
                  for name, t in groups]
        ax.bar([x + (j - 0.5) * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(groups)), [f"{name}\nT={t}" for name, t in groups], fontsize=8)
    ax.set_ylabel("tokens/s / plain sampling")
    ax.set_title("SmolLM2-135M sampling, batch 1: one chain vs draft trees")
    ax.legend()
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument("--prompts", type=int, default=6, help="per set (MT-Bench, HumanEval)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=2, help="seeds per prompt and temperature")
    parser.add_argument("--output", default="sampling_trees")
    args = parser.parse_args()
    temperatures = [float(t) for t in args.temperatures.split(",")]
    if args.prompts < 1 or args.new_tokens < 1 or args.repeats < 1 or not all(t > 0 for t in temperatures):
        parser.error(f"need --prompts, --new-tokens, --repeats >= 1 and temperatures > 0, got {vars(args)}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    target, tokenizer = load_target_for_decoding(args.dtype)
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    sets = {"mtbench": load_mtbench_prompts()[: args.prompts], "humaneval": load_humaneval_prompts()[: args.prompts]}
    warm = encode_prompt(tokenizer, sets["mtbench"][0], target.device)
    for method in METHODS:  # warm-up (and the cost model, measured once and cached)
        run_once(method, target, head, warm, 16, temperatures[0], args.top_p, 0)
    results = {}
    for name, texts in sets.items():
        prompts = [encode_prompt(tokenizer, p, target.device) for p in texts]
        results[name] = {t: measure(target, head, prompts, args.new_tokens, t, args.top_p, args.repeats)
                         for t in temperatures}
        for t in temperatures:
            print(name, t, table(results[name][t], ["method", "tau", "tokens_per_s", "speedup_vs_sampling"]),
                  flush=True)
    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    command = "python benchmarks/sampling_trees.py " + " ".join(sys.argv[1:])
    text = (f"SmolLM2-135M-Instruct {dtype}, batch 1, {args.prompts} prompts per set x {args.new_tokens} tokens, "
            f"top-p {args.top_p}, {args.repeats} seeds each; tokens/s over all runs\n\n")
    for name, by_t in results.items():
        for t, rows in by_t.items():
            text += f"**{name}, T = {t}** (tree / chain: {rows[-1]['tree_vs_chain']:.3f}x)\n\n"
            text += table(rows, ["method", "tau", "tokens", "seconds", "tokens_per_s", "speedup_vs_sampling"])
            text += "\n\n"
    text += f"Command: `{command}`\n"
    save(args.output, {"command": command, "dtype": dtype, "top_p": args.top_p,
                       "load_average_at_start": os.getloadavg(),
                       "results": {name: {str(t): rows for t, rows in by_t.items()} for name, by_t in results.items()}})
    (RESULTS / f"{args.output}.md").write_text(text)
    chart(results, RESULTS / f"{args.output}.png")
    print(text)


if __name__ == "__main__":
    main()
