"""Regeneration throughput: new tokens per second of the target's batched greedy generation.

Side by side in one process, on the same ShareGPT prompts (evaluation prompts removed): batch sizes x
cache kinds ("dynamic", Transformers' default, and "static", preallocated), in the dtype that
``--mixed-precision`` resolves to. Medians of ``--repeats`` timed runs after one warm-up run each.

    python benchmarks/regen_speed.py --batch-sizes 16,64 --new-tokens 64 --output benchmarks/results/regen_speed.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_dflash2.assets import load_sharegpt_prompts, load_target
from hf_dflash2.precision import resolve_dtype
from hf_dflash2.prompts import left_pad
from hf_dflash2.training.regenerate import encode_prompts
from hf_dflash2.training.store import drop_evaluation_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="16,64")
    parser.add_argument("--caches", default="dynamic,static")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mixed-precision", default="auto")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    dtype = resolve_dtype(args.mixed_precision)
    target, tokenizer = load_target(dtype=dtype)
    prompts, report = load_sharegpt_prompts()
    prompts = drop_evaluation_prompts(prompts, report)
    encoded = [ids for _, ids in encode_prompts(tokenizer, prompts[:512], args.max_prompt_tokens)]
    encoded.sort(key=len)  # length-bucketed, as regeneration does inside its chunks
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        batch = encoded[len(encoded) // 2 : len(encoded) // 2 + batch_size]
        input_ids, attention_mask = left_pad([torch.tensor([ids]) for ids in batch], tokenizer.pad_token_id)
        for cache in args.caches.split(","):
            kwargs = {} if cache == "dynamic" else {"cache_implementation": cache}
            times = []
            for repeat in range(args.repeats + 1):
                started = time.perf_counter()
                with torch.no_grad():
                    target.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                    max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                    pad_token_id=tokenizer.pad_token_id, **kwargs)
                if repeat:
                    times.append(time.perf_counter() - started)
            seconds = statistics.median(times)
            rows.append({"batch_size": batch_size, "cache": cache, "dtype": str(dtype),
                         "prompt_width": input_ids.shape[1], "new_tokens": args.new_tokens,
                         "seconds": seconds, "tokens_per_s": batch_size * args.new_tokens / seconds})
            print(f"batch {batch_size:4d}  cache {cache:8s}  {rows[-1]['tokens_per_s']:8.1f} new tok/s", flush=True)
    print("\n| batch | cache | dtype | new tok/s |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch_size']} | {row['cache']} | {row['dtype']} | {row['tokens_per_s']:.0f} |")
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
