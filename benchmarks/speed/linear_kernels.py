"""Decode setups side by side in one process: dtype x CPU linear kernel (PyTorch's default, oneDNN packed).

    python benchmarks/speed/linear_kernels.py [--dtypes fp32,bf16] [--prompts 4] [--new-tokens 128] [--repeats 3]

SmolLM2-135M-Instruct with the committed head, batch 1, greedy. For each setup (a dtype of
``--dtypes`` on each kernel): the verify cost model (seconds of a target forward over k new tokens, over
that setup's plain step), then per prompt (the first ``--prompts`` of MT-Bench and of HumanEval) plain
greedy ``generate`` and the fast loop in every setup, interleaved with the order rotated per repeat; the
median run per prompt counts. Every speedup is over plain greedy in the *first* setup (fp32 on the default
kernel unless ``--dtypes`` says otherwise), so setups compare on one yardstick; ``fast/AR <setup>`` is the
same-setup ratio. Kernels are switched by swapping the layers' forwards (packed once), so switching costs
nothing in the timed runs. Also prints what ``--mixed-precision auto --linear-kernel auto`` picks here.
Writes benchmarks/results/<cpu kind>/linear_kernels_<dtypes>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, chart_grouped, cpu_kind, results_dir, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.cost_model_dflash2 import load_or_measure_cost_model  # noqa: E402
from hf_dflash2.cpu.linear_kernels import KernelSwitch, decode_probe_kernels  # noqa: E402
from hf_dflash2.cpu.precision import DECODE_ROWS, decode_bf16_is_faster, time_decode_speedups  # noqa: E402
from hf_dflash2.evaluation.bench import rotated  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from fp32, bf16")
    parser.add_argument("--prompts", type=int, default=4, help="per set (MT-Bench, HumanEval)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype_names = args.dtypes.split(",")
    unknown = [d for d in dtype_names if d not in DTYPES]
    if unknown or not dtype_names:
        parser.error(f"--dtypes takes names from {sorted(DTYPES)}, got {args.dtypes!r}")

    # What `auto` decides here, from the same probe demo and bench run (not cached: measured now).
    probe = time_decode_speedups(kernels=decode_probe_kernels("auto"))
    auto_dtype = "bf16" if decode_bf16_is_faster(probe) else "fp32"
    print(f"decode probe, bf16 over fp32 at rows {list(DECODE_ROWS)}, each dtype on its faster kernel: "
          f"{[round(x, 2) for x in probe]} -> auto decodes in {auto_dtype}", flush=True)

    setups, models = [], {}
    for name in dtype_names:
        target, tokenizer = load_target(dtype=DTYPES[name])
        head = load_head(default_head("smollm2-135m-dflash2"), target)
        switch = KernelSwitch(target, head)
        for kernel in KernelSwitch.kernels:
            setups.append(f"{name}-{kernel}")
            models[setups[-1]] = (target, head, switch, kernel)

    costs, cost_rows = {}, []
    with torch.no_grad():
        for setup in setups:
            target, head, switch, kernel = models[setup]
            switch.use(kernel)
            costs[setup] = load_or_measure_cost_model(target, head, 1, 16, context_length=256, refresh=True)
            step = costs[setup].verify(1)
            cost_rows.append({"setup": setup, "plain step (ms)": round(step * 1000, 1),
                              **{f"k={k} / step": round(costs[setup].verify(k + 1) / step, 2) for k in (1, 3, 7, 15)},
                              "draft pass / step": round(costs[setup].draft_seconds / step, 2)})
    print(table(cost_rows, list(cost_rows[0])), flush=True)

    def runner(kind, setup, ids):
        target, head, switch, kernel = models[setup]

        def run():
            switch.use(kernel)
            if kind == "ar":
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                      **GREEDY)
                return out[0, ids.shape[1]:], None
            result = speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, cost_model=costs[setup])
            return result.sequences[0, ids.shape[1]:], result.stats.acceptance_length
        return run

    base = setups[0]
    names = [f"{kind} {setup}" for setup in setups for kind in ("ar", "fast")]
    rows = []
    prompts = [(name, number, prompt) for name in ("mtbench", "humaneval")
               for number, prompt in enumerate(load_prompt_set(name, args.prompts))]
    with torch.no_grad():
        for index, (set_name, number, prompt) in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt, "cpu")
            runs = {n: runner(*n.split(" "), ids) for n in names}
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
            row = {"set": set_name, "prompt": number, f"AR {base} tok/s": round(1 / per_token[f"ar {base}"], 2)}
            for setup in setups:
                row[f"AR {setup}"] = round(per_token[f"ar {base}"] / per_token[f"ar {setup}"], 3)
                row[f"fast {setup}"] = round(per_token[f"ar {base}"] / per_token[f"fast {setup}"], 3)
                row[f"fast/AR {setup}"] = round(per_token[f"ar {setup}"] / per_token[f"fast {setup}"], 3)
                row[f"tau {setup}"] = round(taus[f"fast {setup}"], 2)
            ar_text = texts[f"ar {base}"]
            row[f"texts = AR {base}'s"] = sum(
                int(len(texts[n]) == len(ar_text) and bool((texts[n] == ar_text).all())) for n in names)
            rows.append(row)
            print(table([row], list(row)), flush=True)

    ratio_columns = [f"{kind} {setup}" for setup in setups for kind in ("AR", "fast", "fast/AR")]
    summary = {}
    for set_name in ("mtbench", "humaneval", "all"):
        chosen = [r for r in rows if set_name in ("all", r["set"])]
        summary[set_name] = {c: round(statistics.median(r[c] for r in chosen), 3) for c in ratio_columns}
    command = "python benchmarks/speed/linear_kernels.py " + " ".join(sys.argv[1:])
    stem = f"linear_kernels_{'_'.join(dtype_names)}"
    path = save(stem, {"command": command, "dtypes": dtype_names, "new_tokens": args.new_tokens,
                       "repeats": args.repeats, "decode_probe": {"rows": list(DECODE_ROWS), "speedups": probe,
                                                                  "auto_dtype": auto_dtype},
                       "cost_models": {k: costs[k].as_dict() for k in setups},
                       "cost_table": cost_rows, "prompts": rows, "summary": summary})
    summary_rows = [{"set": s, **v} for s, v in summary.items()]
    markdown = (f"`{command}`. Decode probe (bf16 over fp32 at rows {list(DECODE_ROWS)}, each dtype on its faster "
                f"kernel): {[round(x, 2) for x in probe]}, so `auto` decodes in {auto_dtype}.\n\n"
                f"Verify cost:\n\n{table(cost_rows, list(cost_rows[0]))}\n\n"
                f"Per prompt (median of {args.repeats} interleaved runs, {args.new_tokens} new tokens; "
                f"`AR x` / `fast x`: speed over plain greedy in {base}):\n\n"
                f"{table(rows, list(rows[0]))}\n\nMedians over prompts:\n\n"
                f"{table(summary_rows, list(summary_rows[0]))}\n")
    (results_dir() / f"{stem}.md").write_text(markdown)
    print(markdown)
    series = {f"{kind} {setup}": [r[f"{kind} {setup}"] for r in rows] for setup in setups for kind in ("AR", "fast")}
    chart_grouped([f"{r['set'][:2]}{r['prompt']}" for r in rows], series,
                  f"speed over plain greedy, {base}",
                  f"Decode setups, SmolLM2-135M + committed head, batch 1, {cpu_kind()}", results_dir() / f"{stem}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
