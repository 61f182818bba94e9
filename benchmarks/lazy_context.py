"""A/B of the drafter context's lazy projection against projecting on every append, in one process.

    python benchmarks/lazy_context.py [--dtype fp32|bf16] [--repeats 3]

``DraftContext.append`` defers the drafter's context projection until ``kv`` is read (``lazy``);
``eager`` reads ``kv`` after every append, which is what the loop did before. Batch 1, 2 MT-Bench and
2 HumanEval prompts x 64 tokens, adaptive fast loop, plain greedy alongside; fresh and committed head;
per prompt the median of interleaved repeats after one warm-up (``_common.interleaved``), summed over the
prompts. Prints greedy / lazy, greedy / eager and eager / lazy time ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, interleaved  # noqa: E402

from hf_dflash2 import DFlash2DraftModel, speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts, load_target  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import DraftContext  # noqa: E402


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

    def run(head, ids, append):
        def call():
            DraftContext.append = append
            speculative_generate(target, head, ids, max_new_tokens=64)
        return call

    try:
        for name, head in heads.items():
            seconds = {"greedy": 0.0, "lazy": 0.0, "eager": 0.0}
            for ids in prompts:
                medians = interleaved({"greedy": lambda: target.generate(ids, max_new_tokens=64, **GREEDY),
                                       "lazy": run(head, ids, lazy_append), "eager": run(head, ids, eager_append)},
                                      args.repeats)
                for method, median in medians.items():
                    seconds[method] += median
            print(f"{name} {args.dtype}: greedy/lazy {seconds['greedy'] / seconds['lazy']:.3f}  "
                  f"greedy/eager {seconds['greedy'] / seconds['eager']:.3f}  "
                  f"eager/lazy {seconds['eager'] / seconds['lazy']:.3f}", flush=True)
    finally:
        DraftContext.append = lazy_append
    return 0


if __name__ == "__main__":
    sys.exit(main())
