"""What logits processors cost the fast loop: greedy with a repetition penalty, against generate with it.

    python benchmarks/processors_cost.py [--prompts 4] [--new-tokens 128] [--repeats 3] [--repetition-penalty 1.2]
                                         [--output STEM]

Since session 31 the fast loop applies generate's logits processors at every verified slot, on that slot's
own text; since session 34 a repetition penalty alone takes a batched path. Per prompt (MT-Bench and
HumanEval, alternating), interleaved, greedy: ``generate`` and the fast loop, each with and without the
penalty, and the fast loop with the penalty applied by one processor call per row and slot
(``TargetLogitsProcessors.batched_penalty = False``, the path before session 34). Reports each speedup over
``generate`` with the same settings, tau, and whether the two texts with the penalty are the same (in bf16
they may part at near-ties, as without it). Precision (``--dtype``, default ``auto``) and linear kernel as
the demo. Writes benchmarks/results/<--output, default processors_cost_<cpu kind>[_<dtype>]>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, chart_grouped, cpu_kind, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.generation import TargetLogitsProcessors  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402


def per_slot(call):
    """``call()`` with the penalty applied by one processor call per row and slot."""
    TargetLogitsProcessors.batched_penalty = False
    try:
        return call()
    finally:
        TargetLogitsProcessors.batched_penalty = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="per set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repetition-penalty", type=float, default=1.2)
    parser.add_argument("--dtype", default="auto", help="auto (the demo's), bf16 or fp32 (exact texts)")
    parser.add_argument("--output", default=None, help="file stem under benchmarks/results")
    args = parser.parse_args()
    if not args.repetition_penalty > 0:
        parser.error(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    target, tokenizer = load_target_for_decoding(args.dtype)
    head = load_head(default_head(), target)
    sets = list(zip(load_mtbench_prompts()[: args.prompts], load_humaneval_prompts()[: args.prompts]))
    prompts = [p for pair in sets for p in pair]
    n, penalty = args.new_tokens, {"repetition_penalty": args.repetition_penalty}
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt, target.device)
        calls = {
            "generate": lambda: target.generate(ids, max_new_tokens=n, **GREEDY),
            "fast": lambda: speculative_generate(target, head, ids, max_new_tokens=n, do_sample=False),
            "generate + penalty": lambda: target.generate(ids, max_new_tokens=n, **GREEDY, **penalty),
            "fast + penalty": lambda: speculative_generate(target, head, ids, max_new_tokens=n, do_sample=False,
                                                           **penalty),
            "fast + penalty, per slot": lambda: per_slot(
                lambda: speculative_generate(target, head, ids, max_new_tokens=n, do_sample=False, **penalty)),
        }
        if i == 0:
            for fn in calls.values():
                fn()  # warm-up
        times, tokens, texts, tau = {m: [] for m in calls}, {m: [] for m in calls}, {}, {}
        for repeat in range(args.repeats):
            for method in rotated(list(calls), repeat + i):
                started = time.perf_counter()
                out = calls[method]()
                times[method].append(time.perf_counter() - started)
                if method.startswith("generate"):
                    generated = out[0, ids.shape[1]:].tolist()
                else:
                    generated = out.sequences[0, ids.shape[1]: ids.shape[1] + int(out.num_generated[0])].tolist()
                    tau[method] = out.stats.acceptance_length
                tokens[method].append(len(generated))
                texts[method] = generated
        rate = {m: statistics.median(t / s for t, s in zip(tokens[m], times[m])) for m in calls}
        rows.append({"prompt": prompt["id"], "generate + penalty tok/s": rate["generate + penalty"],
                     "fast + penalty / generate + penalty": rate["fast + penalty"] / rate["generate + penalty"],
                     "per slot / generate + penalty": rate["fast + penalty, per slot"] / rate["generate + penalty"],
                     "fast / generate": rate["fast"] / rate["generate"],
                     "tau + penalty": tau["fast + penalty"], "tau": tau["fast"],
                     "same text + penalty": texts["fast + penalty"] == texts["generate + penalty"],
                     "same text": texts["fast"] == texts["generate"],
                     "penalty changes generate's text": texts["generate + penalty"] != texts["generate"]})
    summary = {
        "median fast + penalty / generate + penalty": statistics.median(
            r["fast + penalty / generate + penalty"] for r in rows),
        "median per slot / generate + penalty": statistics.median(r["per slot / generate + penalty"] for r in rows),
        "median fast / generate": statistics.median(r["fast / generate"] for r in rows),
        "texts with the penalty equal to generate's": f"{sum(r['same text + penalty'] for r in rows)} of {len(rows)}",
        "texts without it equal to generate's": f"{sum(r['same text'] for r in rows)} of {len(rows)}",
    }
    name = args.output or f"processors_cost_{cpu_kind()}" + ("" if args.dtype == "auto" else f"_{args.dtype}")
    command = " ".join(["python", *sys.argv])
    save(name, {"command": command, "dtype": str(target.dtype), "rows": rows, **summary})
    text = table(rows, list(rows[0])) + "\n\n" + "\n".join(
        f"- {k}: {v:.3f}" if isinstance(v, float) else f"- {k}: {v}" for k, v in summary.items())
    (RESULTS / f"{name}.md").write_text(f"`{command}` ({target.dtype})\n\n{text}\n")
    chart_grouped([r["prompt"] for r in rows],
                  {"no processor": [r["fast / generate"] for r in rows],
                   f"repetition penalty {args.repetition_penalty}": [
                       r["fast + penalty / generate + penalty"] for r in rows],
                   f"repetition penalty {args.repetition_penalty}, per slot": [
                       r["per slot / generate + penalty"] for r in rows]},
                  "fast loop / generate (same settings)", "greedy: what a logits processor costs the fast loop",
                  RESULTS / f"{name}.png")
    print(text)


if __name__ == "__main__":
    main()
