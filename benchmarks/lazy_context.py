"""A/B of the drafter context's lazy projection against projecting on every append, in one process.

    python benchmarks/lazy_context.py [--dtype fp32|bf16] [--repeats 3]

``DraftContext.append`` defers the drafter's context projection until ``kv`` is read (``lazy``);
``eager`` reads ``kv`` after every append, which is what the loop did before. Batch 1, 2 MT-Bench and
2 HumanEval prompts x 64 tokens, adaptive fast loop, plain greedy alongside; fresh and committed head;
interleaved repeats after one warm-up. Prints greedy / lazy, greedy / eager and eager / lazy time ratios.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from hf_dflash2 import DFlash2DraftModel, speculative_generate
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts, load_target
from hf_dflash2.prompts import default_head, encode_prompt, load_head
from hf_dflash2.speculative_dflash2 import DraftContext

GREEDY = dict(do_sample=False, top_k=None, top_p=None, temperature=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tokenizer = load_target(dtype=dtype)
    lazy_append = DraftContext.append

    def eager_append(self, *a, **k):
        lazy_append(self, *a, **k)
        self.kv  # noqa: B018 - reading kv projects what is pending

    fresh = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=16, selector_rank=128,
                                         target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0)
    heads = {"fresh": fresh.eval().bind_target(target),
             "committed": load_head(default_head("smollm2-135m-dflash2"), target).to(dtype).bind_target(target)}
    texts = load_mtbench_prompts()[:2] + load_humaneval_prompts()[:2]
    prompts = [encode_prompt(tokenizer, text, "cpu") for text in texts]
    try:
        for name, head in heads.items():
            seconds = {"greedy": 0.0, "lazy": 0.0, "eager": 0.0}
            for ids in prompts:
                for repeat in range(args.repeats + 1):
                    for method in seconds:
                        DraftContext.append = eager_append if method == "eager" else lazy_append
                        started = time.perf_counter()
                        if method == "greedy":
                            target.generate(ids, max_new_tokens=64, **GREEDY)
                        else:
                            speculative_generate(target, head, ids, max_new_tokens=64)
                        if repeat:  # the first pass warms up
                            seconds[method] += time.perf_counter() - started
            print(f"{name} {args.dtype}: greedy/lazy {seconds['greedy'] / seconds['lazy']:.3f}  "
                  f"greedy/eager {seconds['greedy'] / seconds['eager']:.3f}  "
                  f"eager/lazy {seconds['eager'] / seconds['lazy']:.3f}", flush=True)
    finally:
        DraftContext.append = lazy_append
    return 0


if __name__ == "__main__":
    sys.exit(main())
