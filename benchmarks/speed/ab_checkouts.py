"""The fast loop of this checkout against another checkout's, in alternating processes.

    python benchmarks/speed/ab_checkouts.py --other PATH [--new-tokens 64] [--pairs 4] [--batch 1] [--output NAME]

PATH is another checkout of this repository (e.g. ``git worktree add /tmp/old COMMIT``). Each process loads
SmolLM2-135M-Instruct and the committed head as ``make bench`` does (``auto`` dtype and linear kernel), runs
``speculative_generate`` on 4 HumanEval and 4 MT-Bench prompts (greedy, ``--new-tokens`` each, one call after
another, as a user's calls carry over), and prints tokens per second and tau; with ``--batch N`` > 1, one call
on the first N HumanEval prompts left-padded (as ``adaptive.py --batch8``), twice, the second timed (tokens per second:
the call's budget, N x new tokens, over its seconds). The processes alternate, this checkout first in odd
pairs and second in even ones, so drift hits both alike. Both sides get the same cost
model (measured once here and handed to both as ``cost_model=``), so a difference is the loop's code, not
two noisy measurements. Writes benchmarks/results/<cpu kind>/NAME.{json,md} (default ``ab_checkouts``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import REPO, results_dir, save, table  # noqa: E402

CHILD = """
import json, sys, time, torch
from hf_dflash2 import speculative_generate
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts
from hf_dflash2.cost_model_dflash2 import CostModel
try:
    from hf_dflash2.cpu.precision import load_target_for_decoding
except ImportError:  # a checkout from before the cpu/ package
    from hf_dflash2.precision import load_target_for_decoding
from hf_dflash2.prompts import default_head, encode_prompt, load_head
target, tokenizer = load_target_for_decoding("auto")
head = load_head(default_head(), target)
cost = CostModel.from_dict(json.load(open(sys.argv[2])), 16)
n, batch = int(sys.argv[1]), int(sys.argv[3])
if batch > 1:
    from hf_dflash2.prompts import left_pad  # older checkouts may have none; --batch 1 needs none
    ids, mask = left_pad([encode_prompt(tokenizer, p, "cpu") for p in load_humaneval_prompts()[:batch]],
                         tokenizer.pad_token_id)
    with torch.no_grad():
        for _ in range(2):  # the first call warms up (kernels, the policy)
            started = time.perf_counter()
            out = speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n, cost_model=cost,
                                       pad_token_id=tokenizer.pad_token_id)
            seconds = time.perf_counter() - started
    print("RESULT " + json.dumps({"tokens_per_s": batch * n / seconds, "tau": out.stats.acceptance_length,
                                  "seconds": seconds}))
    sys.exit(0)
prompts = [encode_prompt(tokenizer, p, "cpu") for p in load_humaneval_prompts()[:4] + load_mtbench_prompts()[:4]]
with torch.no_grad():
    speculative_generate(target, head, prompts[0], max_new_tokens=16, cost_model=cost)
    seconds = tokens = rounds = 0
    for ids in prompts:
        started = time.perf_counter()
        out = speculative_generate(target, head, ids, max_new_tokens=n, cost_model=cost)
        seconds += time.perf_counter() - started
        tokens += int(out.sequences.shape[1] - ids.shape[1])
        rounds += out.stats.rounds
print("RESULT " + json.dumps({"tokens_per_s": tokens / seconds, "tau": tokens / rounds, "seconds": seconds}))
"""


def run(src: Path, new_tokens: int, cost_file: str, batch: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(new_tokens), cost_file, str(batch)], env=env,
                          capture_output=True, text=True, check=True)
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", required=True, help="another checkout of this repository")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1, help="rows per call (> 1: the first HumanEval prompts)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    here, other = REPO / "src", Path(args.other).resolve() / "src"
    if not (other / "hf_dflash2").is_dir():
        raise SystemExit(f"--other {args.other}: no src/hf_dflash2 there")
    if args.new_tokens < 1 or args.pairs < 1 or args.batch < 1:
        raise SystemExit(f"--new-tokens, --pairs and --batch must be >= 1, got {args.new_tokens}, {args.pairs} "
                         f"and {args.batch}")
    import torch

    from hf_dflash2.cost_model_dflash2 import measure_cost_model
    from hf_dflash2.cpu.attention import packed_gqa_attention
    from hf_dflash2.cpu.precision import load_target_for_decoding
    from hf_dflash2.prompts import default_head, load_head

    target, _ = load_target_for_decoding("auto")
    head = load_head(default_head(), target)
    with torch.no_grad(), packed_gqa_attention(target):
        cost = measure_cost_model(target, head, batch_size=args.batch, block_size=16,
                                  context_length=min(256, max(16, 4096 // args.batch)))
    del target, head
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(cost.as_dict(), handle)
    results = {"this": [], "other": []}
    for pair in range(args.pairs):
        order = [("this", here), ("other", other)] if pair % 2 == 0 else [("other", other), ("this", here)]
        for name, src in order:
            results[name].append(run(src, args.new_tokens, handle.name, args.batch))
            print(name, results[name][-1], flush=True)
    os.unlink(handle.name)
    rows = [{"checkout": name, "path": str(src.parent),
             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
             "tau": statistics.median(r["tau"] for r in runs), "per_pair": [round(r["tokens_per_s"], 2) for r in runs]}
            for (name, runs), src in zip(results.items(), (here, other))]
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    name = args.output or "ab_checkouts"
    command = "python benchmarks/speed/ab_checkouts.py " + " ".join(sys.argv[1:])
    save(name, {"command": command, "new_tokens": args.new_tokens, "pairs": args.pairs, "batch": args.batch,
                "rows": rows, "this_over_other": ratio})
    workload = (f"4 HumanEval + 4 MT-Bench prompts x {args.new_tokens} tokens" if args.batch == 1 else
                f"the first {args.batch} HumanEval prompts in one call x {args.new_tokens} tokens")
    text = (f"{command}\n\nThe fast loop, {workload} per process, "
            f"medians over {args.pairs} alternating pairs, one cost model for both; this ÷ other: {ratio:.3f}\n\n"
            + table(rows, ["checkout", "path", "tokens_per_s", "tau", "per_pair"]))
    (results_dir() / f"{name}.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
