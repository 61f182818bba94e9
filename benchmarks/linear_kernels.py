"""PyTorch's default linear kernel vs oneDNN with packed weights, side by side in one process.

    python benchmarks/linear_kernels.py [--dtype fp32|bf16] [--prompts 4] [--new-tokens 128] [--repeats 3]

SmolLM2-135M-Instruct with the committed head, batch 1, greedy. For each kernel: the verify cost model
(seconds of a target forward over k new tokens, over a plain step's), then per prompt (the first
``--prompts`` of MT-Bench and of HumanEval) plain greedy ``generate`` and the fast loop on each kernel,
interleaved with the order rotated per repeat; the median run per prompt counts. Kernels are switched by
swapping the layers' forwards (packed once), so switching costs nothing in the timed runs.
Writes benchmarks/results/linear_kernels_<dtype>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, chart_grouped, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import load_or_measure_cost_model  # noqa: E402
from hf_dflash2.linear_kernels import KernelSwitch  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402

KERNELS = KernelSwitch.kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--prompts", type=int, default=4, help="per set (MT-Bench, HumanEval)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tokenizer = load_target(dtype=dtype)
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    switch = KernelSwitch(target, head)

    costs, cost_rows = {}, []
    with torch.no_grad():
        for kernel in KERNELS:
            switch.use(kernel)
            costs[kernel] = load_or_measure_cost_model(target, head, 1, 16, context_length=256, refresh=True)
            step = costs[kernel].verify(1)
            cost_rows.append({"kernel": kernel, "plain step (ms)": round(step * 1000, 1),
                              **{f"k={k} / step": round(costs[kernel].verify(k + 1) / step, 2) for k in (1, 3, 7, 15)},
                              "draft pass / step": round(costs[kernel].draft_seconds / step, 2)})
    print(table(cost_rows, list(cost_rows[0])), flush=True)

    def runner(kind, kernel, ids):
        def run():
            switch.use(kernel)
            if kind == "ar":
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                      **GREEDY)
                return out[0, ids.shape[1]:], None
            result = speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, cost_model=costs[kernel])
            return result.sequences[0, ids.shape[1]:], result.stats.acceptance_length
        return run

    names = [f"{kind}_{kernel}" for kernel in KERNELS for kind in ("ar", "fast")]
    rows = []
    prompts = [(name, number, prompt) for name in ("mtbench", "humaneval")
               for number, prompt in enumerate(load_prompt_set(name, args.prompts))]
    with torch.no_grad():
        for index, (set_name, number, prompt) in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt, "cpu")
            runs = {n: runner(*n.split("_"), ids) for n in names}
            for run in runs.values():  # warm-up (kernels, allocations)
                run()
            seconds = {n: [] for n in names}
            texts, taus = {}, {}
            for repeat in range(args.repeats):
                for n in rotated(names, index + repeat):
                    started = time.perf_counter()
                    tokens, tau = runs[n]()
                    seconds[n].append((time.perf_counter() - started) / len(tokens))
                    texts[n], taus[n] = tokens, tau
            per_token = {n: statistics.median(s) for n, s in seconds.items()}
            row = {"set": set_name, "prompt": number, **{f"{n} tok/s": round(1 / per_token[n], 2) for n in names}}
            for kernel in KERNELS:
                row[f"fast/AR {kernel}"] = round(per_token[f"ar_{kernel}"] / per_token[f"fast_{kernel}"], 3)
                row[f"tau {kernel}"] = round(taus[f"fast_{kernel}"], 2)
            row["AR onednn/default"] = round(per_token["ar_default"] / per_token["ar_onednn"], 3)
            row["fast onednn / AR default"] = round(per_token["ar_default"] / per_token["fast_onednn"], 3)
            ar_text = texts["ar_default"]
            row["texts = AR default's"] = sum(
                int(len(texts[n]) == len(ar_text) and bool((texts[n] == ar_text).all())) for n in names)
            rows.append(row)
            print(table([row], list(row)), flush=True)

    ratio_columns = ["fast/AR default", "fast/AR onednn", "AR onednn/default", "fast onednn / AR default"]
    summary = {}
    for set_name in ("mtbench", "humaneval", "all"):
        chosen = [r for r in rows if set_name in ("all", r["set"])]
        summary[set_name] = {c: round(statistics.median(r[c] for r in chosen), 3) for c in ratio_columns}
        summary[set_name]["worst fast/AR onednn"] = min(r["fast/AR onednn"] for r in chosen)
        summary[set_name]["worst fast/AR default"] = min(r["fast/AR default"] for r in chosen)
    command = "python benchmarks/linear_kernels.py " + " ".join(sys.argv[1:])
    stem = f"linear_kernels_{args.dtype}"
    path = save(stem, {"command": command, "dtype": args.dtype, "new_tokens": args.new_tokens,
                       "repeats": args.repeats, "cost_models": {k: costs[k].as_dict() for k in KERNELS},
                       "cost_table": cost_rows, "prompts": rows, "summary": summary})
    summary_rows = [{"set": s, **v} for s, v in summary.items()]
    markdown = (f"Verify cost, {args.dtype} (`{command}`):\n\n{table(cost_rows, list(cost_rows[0]))}\n\n"
                f"Per prompt (median of {args.repeats} interleaved runs, {args.new_tokens} new tokens):\n\n"
                f"{table(rows, list(rows[0]))}\n\nMedians over prompts:\n\n"
                f"{table(summary_rows, list(summary_rows[0]))}\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)
    draw(rows, RESULTS / f"{stem}.png", args.dtype)
    print(f"wrote {path}")


def draw(rows: list[dict], path: Path, dtype: str) -> None:
    series = {"fast loop / AR, default kernel": "fast/AR default", "fast loop / AR, oneDNN": "fast/AR onednn",
              "fast loop oneDNN / AR default": "fast onednn / AR default"}
    chart_grouped([f"{r['set'][:2]}{r['prompt']}" for r in rows],
                  {label: [r[column] for r in rows] for label, column in series.items()},
                  "speedup over plain greedy", f"Linear kernels, SmolLM2-135M + committed head, {dtype}, batch 1", path)


if __name__ == "__main__":
    main()
