"""Regeneration throughput: useful new tokens per second (each response up to its EOS) on the real workload.

Side by side in one process, on the same ShareGPT prompts (evaluation prompts removed), length-sorted as
regeneration batches them: Transformers' ``generate`` with its default dynamic cache, ``generate`` with the
static cache, and ``decode_batch`` (what ``hf-dflash2 regenerate`` runs: drops rows as they end), in the
dtype ``--mixed-precision`` resolves to. Medians of ``--repeats`` timed runs after one untimed warm-up
each; also the share of responses that equal ``generate``'s token for token.

    python benchmarks/regen_speed.py --batch-sizes 16,64 --max-new-tokens 192 \
        --output benchmarks/results/regen_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import chart_bars  # noqa: E402

from hf_dflash2.assets import load_sharegpt_prompts, load_target  # noqa: E402
from hf_dflash2.linear_kernels import KernelSwitch  # noqa: E402
from hf_dflash2.precision import resolve_dtype  # noqa: E402
from hf_dflash2.prompts import left_pad  # noqa: E402
from hf_dflash2.training.regenerate import decode_batch, encode_prompts, response_eos_ids  # noqa: E402
from hf_dflash2.training.store import drop_evaluation_prompts  # noqa: E402


def cut_at_eos(rows: list[list[int]], eos: set[int]) -> list[list[int]]:
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--methods", default="generate,generate_static,decode_batch")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mixed-precision", default="auto")
    parser.add_argument("--linear-kernels", default="default",
                        help="comma-separated from default,onednn: each method runs on each CPU linear kernel")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    kernels = args.linear_kernels.split(",")
    if not kernels or any(k not in KernelSwitch.kernels for k in kernels):
        parser.error(f"--linear-kernels takes names from {KernelSwitch.kernels}, got {args.linear_kernels!r}")

    dtype = resolve_dtype(args.mixed_precision)
    target, tokenizer = load_target(dtype=dtype)
    switch = KernelSwitch(target) if "onednn" in kernels else None
    eos = response_eos_ids(target, tokenizer)
    prompts, report = load_sharegpt_prompts()
    prompts = drop_evaluation_prompts(prompts, report)
    encoded = [ids for _, ids in encode_prompts(tokenizer, prompts[:1024], args.max_prompt_tokens)]
    encoded.sort(key=len)  # length-bucketed, as regeneration does inside its chunks
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        batch = encoded[len(encoded) // 2 : len(encoded) // 2 + batch_size]
        input_ids, attention_mask = left_pad([torch.tensor([ids]) for ids in batch], tokenizer.pad_token_id)
        width = input_ids.shape[1]

        def run(name: str) -> list[list[int]]:
            method, _, kernel = name.partition("@")
            if switch is not None:
                switch.use(kernel)
            with torch.no_grad():
                if method == "decode_batch":
                    return decode_batch(target, input_ids, attention_mask, args.max_new_tokens, eos)
                extra = {"cache_implementation": "static"} if method == "generate_static" else {}
                out = target.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                      max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **extra)
                return cut_at_eos(out[:, width:].tolist(), eos)

        methods = [f"{m}@{k}" if len(kernels) > 1 or k != "default" else m
                   for m in args.methods.split(",") for k in kernels]
        outputs = {m: run(m) for m in methods}  # warm-up, and the outputs to compare
        times = {m: [] for m in methods}
        for _ in range(args.repeats):
            for method in methods:  # interleaved, so drift hits every method alike
                started = time.perf_counter()
                run(method)
                times[method].append(time.perf_counter() - started)
        reference = outputs.get("generate", outputs.get("generate@default"))
        for method in methods:
            useful = sum(len(r) for r in outputs[method])
            seconds = statistics.median(times[method])
            same = None if reference is None else sum(a == b for a, b in zip(outputs[method], reference)) / len(batch)
            rows.append({"batch_size": batch_size, "method": method, "dtype": str(dtype), "prompt_width": width,
                         "useful_tokens": useful, "mean_response": useful / len(batch), "seconds": seconds,
                         "tokens_per_s": useful / seconds, "same_as_generate": same})
            print(f"batch {batch_size:4d}  {method:16s} {rows[-1]['tokens_per_s']:8.1f} useful tok/s  "
                  f"(mean response {useful / len(batch):.0f} tokens, same as generate: {same})", flush=True)
    print("\n| batch | method | dtype | useful new tok/s | vs generate | same as generate |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["batch_size"] == row["batch_size"] and r["method"] == rows[0]["method"])
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        print(f"| {row['batch_size']} | {row['method']} | {row['dtype']} | {row['tokens_per_s']:.0f} | "
              f"{row['speedup']:.2f}x | {row['same_as_generate']} |")
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/regen_speed.py " + " ".join(sys.argv[1:])
        payload = {"command": command, "threads": torch.get_num_threads(), "rows": rows}
        out.write_text(json.dumps(payload, indent=1) + "\n")
        chart_bars([f"b{r['batch_size']} {r['method']}" for r in rows], [r["tokens_per_s"] for r in rows],
                   "useful new tokens / s", f"Regeneration throughput ({dtype})", out.with_suffix(".png"))


if __name__ == "__main__":
    main()
