"""Does a round that drafts nothing cost what a plain step costs? One prompt (or batch), interleaved.

    python benchmarks/speed/plain_steps.py [--prompt 0] [--set mtbench] [--temperature 0] [--tokens 128]
    python benchmarks/speed/plain_steps.py --batch-size 8 --set humaneval [--dtype bf16]

Plain ``generate`` in each baseline configuration (``ar``: as loaded, ``ar_onednn``: oneDNN with packed weights,
``ar_packed``: the packed grouped-query attention, kernels chosen per forward), the
default loop (``dflash2_fast``) and the loop forced to plain steps (``ForcedVerifyLengths([0])``: no draft pass,
one token per round through the loop's verify path), each run once to warm up and then ``--repeats`` times in
rotation; prints the median milliseconds per token and each one's speedup over the fastest plain ``generate``
(the bench's baseline rule). With ``--batch-size B``, prompts ``--prompt`` .. ``--prompt + B - 1``, left-padded.
At ``--temperature`` above 0 every method samples, each repeat under its own seed (the same for all), so a
plain round's sampling is compared with ``generate``'s; sampled texts may end at different lengths, hence the
tokens printed per method. Prints only.
"""

import argparse
import statistics
import time

import torch

from hf_dflash2 import speculative_generate
from hf_dflash2.assets import load_prompt_set, load_target
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths
from hf_dflash2.evaluation.bench import BASELINE_METHODS, Runner, fastest_baseline, seconds_per_token
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompt", type=int, default=0, help="index in the set")
parser.add_argument("--set", default="mtbench", choices=("mtbench", "humaneval", "longctx"))
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
parser.add_argument("--repeats", type=int, default=5)
parser.add_argument("--batch-size", type=int, default=1, help="rows: this many prompts from --prompt on")
parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the target's and the head's")
args = parser.parse_args()
if args.prompt < 0 or args.temperature < 0 or args.tokens < 1 or args.repeats < 1 or args.batch_size < 1:
    parser.error(f"--prompt {args.prompt}, --temperature {args.temperature}, --tokens {args.tokens}, --repeats "
                 f"{args.repeats} and --batch-size {args.batch_size}: the first two must be >= 0, the others >= 1")

torch.set_num_threads(2)
target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
head = load_head(default_head(), target)
runner = Runner(target, tokenizer, {"dflash2": head}, args.tokens, args.temperature)
prompts = load_prompt_set(args.set, args.prompt + args.batch_size)[args.prompt :]
if len(prompts) < args.batch_size:
    parser.error(f"--prompt {args.prompt} --batch-size {args.batch_size}: the {args.set} set has "
                 f"{len(load_prompt_set(args.set))} prompts")
ids, mask = left_pad([encode_prompt(tokenizer, p, target.device) for p in prompts], tokenizer.pad_token_id)


def plain_only():
    started = time.perf_counter()
    result = speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=args.tokens,
                                  pad_token_id=tokenizer.pad_token_id, verify_policy=ForcedVerifyLengths([0]),
                                  **runner.sampling_kwargs())
    return int(result.num_generated.sum()), time.perf_counter() - started, result.stats


def run(method: str, seed: int):
    torch.manual_seed(seed)
    if method == "plain_only":
        return plain_only()
    generated, seconds, stats, _ = runner.run(method, ids, mask)
    return generated, seconds, stats


methods = [m for m in BASELINE_METHODS if runner.supports(m, args.batch_size) is None] + ["dflash2_fast", "plain_only"]
records = {method: {"seconds": [], "tokens": []} for method in methods}  # the bench's own record shape
for method in records:  # warm-up
    run(method, 0)
for repeat in range(args.repeats):
    for method in records:
        generated, seconds, stats = run(method, repeat)
        records[method]["seconds"].append(seconds)
        records[method]["tokens"].append(generated)
        if stats is not None and repeat == 0:
            print(method, "rounds", stats.rounds, "draft passes", stats.draft_passes,
                  "tau", round(stats.acceptance_length, 2), "n-gram rounds", stats.ngram_rounds,
                  "tree rounds", stats.tree_rounds)

fastest = fastest_baseline(records)
baseline = statistics.median(seconds_per_token(records[fastest]))
print(f"baseline: {fastest}, the fastest plain generate here; ms per generated token (a batch step over its rows)")
for method, record in records.items():
    values = seconds_per_token(record)
    median = statistics.median(values)
    print(f"{method:14s} ms/token median {1000 * median:.2f}  speedup {baseline / median:.3f}  "
          f"all {[round(1000 * value, 1) for value in values]}  tokens {record['tokens']}")
