"""Batch 8: the adaptive policy against fixed verify lengths and batched AR, wall clock.

    python benchmarks/batch_lengths.py [--batch 8] [--new-tokens 64] [--repeats 5] [--lengths 1,2,3] [--output NAME]

Issue 9 asks that batch-8 speculation never fall below batched AR (``generate`` on the same left-padded
batch). ``benchmarks/adaptive.py --batch8`` gives the policy's ratio; this script asks what the policy
leaves on the table: every round a chain of exactly ``k`` drafts (``ForcedVerifyLengths``, one source: the
head, n-gram drafts on as in the default loop), the adaptive policy with and without trees, and AR,
interleaved (the order rotated each repeat), in the dtype ``auto`` decodes in, on the linear kernel ``auto``
picks. Also per arm: tau, and the share of the call spent in the prefill (the same for every arm, so the
decode phase's ratio is larger than the call's). The first HumanEval prompts, as ``adaptive.py --batch8``.
Writes benchmarks/results/batch_lengths_<cpu kind>_b<batch>.{json,md} (``--output``: NAME.{json,md} there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, cpu_kind, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths, linear_kernel_of  # noqa: E402
from hf_dflash2.generation import prefill  # noqa: E402
from hf_dflash2.linear_kernels import use_linear_kernel  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", default="1,2,3", help="fixed chain lengths to try (drafts per round)")
    parser.add_argument("--output", default=None, help="results file name (default: batch_lengths_<cpu>_b<batch>)")
    args = parser.parse_args()
    lengths = [int(k) for k in args.lengths.split(",")]
    if args.batch < 1 or args.new_tokens < 1 or args.repeats < 1 or any(k < 1 for k in lengths):
        raise SystemExit(f"--batch, --new-tokens, --repeats and --lengths must be >= 1, got {vars(args)}")
    target, tokenizer = load_target_for_decoding("auto")  # its linear layers on the kernel auto picks
    dtype = target.dtype
    kernel = linear_kernel_of(target)
    head = load_head(default_head("smollm2-135m-dflash2"), target).to(target.dtype).bind_target(target)
    use_linear_kernel(head, kernel)
    prompts = load_humaneval_prompts()[: args.batch]
    ids, mask = left_pad([encode_prompt(tokenizer, p, "cpu") for p in prompts], tokenizer.pad_token_id)
    n, pad = args.new_tokens, tokenizer.pad_token_id

    def loop(**options):
        return lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n,
                                            pad_token_id=pad, **options)

    calls = {"ar": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **GREEDY),
             "adaptive": loop(), "adaptive_chains": loop(draft_tree=False),
             "prefill": lambda: prefill(target, head, ids, mask, ids.shape[1] + n + 16)}
    for k in lengths:
        calls[f"chain_{k}"] = loop(draft_tree=False, verify_policy=ForcedVerifyLengths([k], draft_when_zero=True))
    seconds, tau = {m: [] for m in calls}, {}
    with torch.no_grad():
        for fn in calls.values():  # warm-up: kernels, cost model, the policy's first call
            fn()
        for repeat in range(args.repeats):
            for method in rotated(list(calls), repeat):
                started = time.perf_counter()
                out = calls[method]()
                seconds[method].append(time.perf_counter() - started)
                if method not in ("ar", "prefill"):
                    tau.setdefault(method, []).append(out.stats.acceptance_length)
    ar, pre = statistics.median(seconds["ar"]), statistics.median(seconds["prefill"])
    rows = []
    for method in calls:
        if method == "prefill":
            continue
        median = statistics.median(seconds[method])
        rows.append({"method": method, "seconds": median, "over_ar": ar / median,
                     "decode_over_ar": (ar - pre) / (median - pre),
                     "per_repeat_over_ar": [round(ar / s, 3) for s in seconds[method]],
                     "tau": statistics.median(tau[method]) if method in tau else None})
    name = args.output or f"batch_lengths_{cpu_kind()}_b{args.batch}"
    payload = {"command": "python benchmarks/batch_lengths.py " + " ".join(sys.argv[1:]), "dtype": str(dtype),
               "linear_kernel": kernel, "batch": args.batch, "new_tokens": n, "repeats": args.repeats,
               "prefill_seconds": pre, "rows": rows}
    save(name, payload)
    text = (f"{payload['command']}\n\nSmolLM2-135M-Instruct {dtype}, linear kernel {kernel}, batch {args.batch} "
            f"(the first HumanEval prompts) x {n} tokens, medians of {args.repeats} interleaved repeats; the "
            f"prefill alone: {pre:.2f} s of AR's {ar:.2f} s\n\n"
            + table(rows, ["method", "seconds", "over_ar", "decode_over_ar", "tau", "per_repeat_over_ar"]))
    (RESULTS / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
