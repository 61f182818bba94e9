"""What reproducible sampling costs: the adaptive policy with and without timing its own rounds.

    python benchmarks/sampling_policy.py [--prompts 4] [--new-tokens 128] [--repeats 3] [--temperature 0.7]

Since session 30 a sampled call's adaptive policy decides from the cached cost model and the call's own
acceptances only (``verify_policy_for(reproducible=True)``), so that the same seed gives the same text; before,
it also timed its rounds and corrected the cost model by what it measured (``clock=time.perf_counter``),
which made the number of random draws per round, and so the text, depend on wall-clock noise. Per prompt
(MT-Bench and HumanEval, alternating) and interleaved: plain sampling with ``generate``, the fast loop with the
reproducible policy (the default), and with the timed one, same seed. Precision and linear kernel as the demo
(``auto``). Writes benchmarks/results/sampling_policy_<cpu kind>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, chart_grouped, cpu_kind, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, load_or_measure_cost_model  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import round_block_size  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="per set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    target, tokenizer = load_target_for_decoding("auto")
    head = load_head(default_head(), target)
    sets = list(zip(load_mtbench_prompts()[: args.prompts], load_humaneval_prompts()[: args.prompts]))
    prompts = [p for pair in sets for p in pair]
    n, sampling = args.new_tokens, {"do_sample": True, "temperature": args.temperature}
    block = round_block_size(head, 3, None, 1 << 30, None)
    cost = load_or_measure_cost_model(target, head, 1, block, context_length=256)
    rows = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt, target.device)
        calls = {
            "generate": lambda: target.generate(ids, max_new_tokens=n, **sampling),
            "reproducible": lambda: speculative_generate(target, head, ids, max_new_tokens=n, **sampling,
                                                         generator=torch.Generator().manual_seed(i)),
            "timed": lambda: speculative_generate(target, head, ids, max_new_tokens=n, **sampling,
                                                  generator=torch.Generator().manual_seed(i),
                                                  verify_policy=AdaptiveVerifyPolicy(cost)),
        }
        if i == 0:
            for fn in calls.values():
                fn()  # warm-up
        times = {m: [] for m in calls}
        tokens = {m: [] for m in calls}
        for repeat in range(args.repeats):
            for method in rotated(list(calls), repeat + i):
                started = time.perf_counter()
                out = calls[method]()
                times[method].append(time.perf_counter() - started)
                generated = out.shape[1] - ids.shape[1] if method == "generate" else int(out.num_generated[0])
                tokens[method].append(generated)
        rate = {m: statistics.median(t / s for t, s in zip(tokens[m], times[m])) for m in calls}
        rows.append({"prompt": prompt["id"], "generate tok/s": rate["generate"],
                     "reproducible / generate": rate["reproducible"] / rate["generate"],
                     "timed / generate": rate["timed"] / rate["generate"],
                     "reproducible / timed": rate["reproducible"] / rate["timed"]})
    ratios = [r["reproducible / timed"] for r in rows]
    summary = {"median reproducible / timed": statistics.median(ratios),
               "median reproducible / generate": statistics.median(r["reproducible / generate"] for r in rows),
               "median timed / generate": statistics.median(r["timed / generate"] for r in rows)}
    name = f"sampling_policy_{cpu_kind()}"
    save(name, {"command": " ".join(["python", *sys.argv]), "dtype": str(target.dtype), "rows": rows, **summary})
    text = table(rows, list(rows[0])) + "\n\n" + "\n".join(f"- {k}: {v:.3f}" for k, v in summary.items())
    (RESULTS / f"{name}.md").write_text(f"`{' '.join(['python', *sys.argv])}` ({target.dtype})\n\n{text}\n")
    chart_grouped([r["prompt"] for r in rows], {"reproducible": [r["reproducible / generate"] for r in rows],
                                                "timed": [r["timed / generate"] for r in rows]},
                  "speed / plain sampling", f"sampling at T = {args.temperature}: the fast loop's policy",
                  RESULTS / f"{name}.png")
    print(text)


if __name__ == "__main__":
    main()
