"""Does a round that drafts nothing cost what a plain step costs? One prompt, three methods, interleaved.

    python benchmarks/speed/plain_steps.py [--prompt 0] [--set mtbench] [--temperature 0] [--tokens 128]

``ar_onednn`` (plain ``generate`` on oneDNN, the fastest plain greedy on short prompts here), the default loop
(``dflash2_fast``) and the loop forced to plain steps (``ForcedVerifyLengths([0])``: no draft pass, one token
per round through the loop's verify path), each run once to warm up and then 5 times in rotation; prints the
median milliseconds per token and each one's speedup over ``ar_onednn``. At ``--temperature`` above 0 all three
sample, each repeat under its own seed (the same for the three methods), so a plain round's sampling is compared
with ``generate``'s; sampled texts may end at different lengths, hence the tokens printed per method.
Prints only.
"""

import argparse
import statistics
import time

import torch

from hf_dflash2 import speculative_generate
from hf_dflash2.assets import load_prompt_set, load_target
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths
from hf_dflash2.evaluation.bench import Runner
from hf_dflash2.prompts import default_head, encode_prompt, load_head

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompt", type=int, default=0, help="index in the set")
parser.add_argument("--set", default="mtbench", choices=("mtbench", "humaneval", "longctx"))
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--tokens", type=int, default=128, help="new tokens per run")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()
if args.prompt < 0 or args.temperature < 0 or args.tokens < 1 or args.repeats < 1:
    parser.error(f"--prompt {args.prompt}, --temperature {args.temperature}, --tokens {args.tokens} and "
                 f"--repeats {args.repeats}: the first two must be >= 0, the others >= 1")

torch.set_num_threads(2)
target, tokenizer = load_target()
head = load_head(default_head(), target)
runner = Runner(target, tokenizer, {"dflash2": head}, args.tokens, args.temperature)
prompt = load_prompt_set(args.set, args.prompt + 1)[args.prompt]
ids = encode_prompt(tokenizer, prompt, target.device)
mask = torch.ones_like(ids)


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


seconds_per_token = {method: [] for method in ("ar_onednn", "dflash2_fast", "plain_only")}
tokens = {method: [] for method in seconds_per_token}
for method in seconds_per_token:  # warm-up
    run(method, 0)
for repeat in range(args.repeats):
    for method in seconds_per_token:
        generated, seconds, stats = run(method, repeat)
        seconds_per_token[method].append(seconds / generated)
        tokens[method].append(generated)
        if stats is not None and repeat == 0:
            print(method, "rounds", stats.rounds, "draft passes", stats.draft_passes,
                  "tau", round(stats.acceptance_length, 2), "n-gram rounds", stats.ngram_rounds,
                  "tree rounds", stats.tree_rounds)

baseline = statistics.median(seconds_per_token["ar_onednn"])
for method, values in seconds_per_token.items():
    median = statistics.median(values)
    print(f"{method:14s} ms/token median {1000 * median:.2f}  speedup {baseline / median:.3f}  "
          f"all {[round(1000 * value, 1) for value in values]}  tokens {tokens[method]}")
