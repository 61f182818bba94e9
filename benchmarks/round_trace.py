"""Where the fast loop's time goes on single prompts, round by round, next to plain greedy.

    python benchmarks/round_trace.py [--set mtbench] [--prompts 0,5] [--new-tokens 128] [--repeats 3]
                                     [--dtype fp32|bf16] [--linear-kernel auto|onednn|default]
                                     [--repetition-penalty 1.2]

Per prompt, interleaved with the order rotated per repeat (the median run counts): plain greedy
``generate``, the fast loop as shipped, the fast loop without n-gram drafts (``ngram_size=0``), and the
fast loop forced to plain steps (``ForcedVerifyLengths([0])``) with and without the n-gram lookup that
runs every round. The forced-step variants price the loop's own plain step against ``generate``'s.
The shipped loop's median run is traced: each round's kind (plain step, head chain, draft tree, n-gram
chain), wall time, and tokens committed; per kind, tokens committed per greedy token time (above 1 a kind
of round pays, below 1 it costs). The trace line writes a plain step as ".", a chain round as the drafts it
accepted (0-9), a tree round as a letter (a = 0 accepted, b = 1, ...).
``--repetition-penalty`` runs every method with it (``generate`` too), to see which rounds a penalty turns
into losses. Writes benchmarks/results/round_trace_<set>_<dtype>[_penalty<value>].{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, chart_grouped, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths, load_or_measure_cost_model  # noqa: E402
from hf_dflash2.linear_kernels import LINEAR_KERNELS, use_linear_kernel  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import SpeculativeStats  # noqa: E402

VARIANTS = ("greedy", "fast", "fast_no_ngram", "steps", "steps_with_ngram_lookup")


@contextmanager
def recording_rounds(rounds: list):
    """Append (time, drafts verified, accepted, committed, tree, n-gram source) of row 0 for every round the
    loop records (instrumentation only: one host read per round, which the loop makes anyway)."""
    original = SpeculativeStats.record

    def record(self, accepted, committed, active=None, verified=None, source=None, tree=False):
        original(self, accepted, committed, active, verified, source, tree)
        ngram = source is not None and int(source[0]) > 0
        rounds.append((time.perf_counter(), int(verified or 0), int(accepted[0]), int(committed[0]), tree, ngram))

    SpeculativeStats.record = record
    try:
        yield
    finally:
        SpeculativeStats.record = original


def round_kinds(started: float, rounds: list, greedy_token_seconds: float) -> tuple[dict, str]:
    kinds, line, previous = {}, [], started
    for now, verified, accepted, committed, tree, ngram in rounds:
        kind = "step" if verified == 0 else "tree" if tree else "ngram" if ngram else "chain"
        entry = kinds.setdefault(kind, {"rounds": 0, "seconds": 0.0, "tokens": 0})
        entry["rounds"] += 1
        entry["seconds"] += now - previous
        entry["tokens"] += committed
        previous = now
        line.append("." if verified == 0 else chr(ord("a") + min(accepted, 25)) if tree else str(min(accepted, 9)))
    for entry in kinds.values():
        entry["tokens per greedy token time"] = round(entry["tokens"] * greedy_token_seconds / entry["seconds"], 3)
        entry["seconds"] = round(entry["seconds"], 3)
    return kinds, "".join(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", default="mtbench", choices=("mtbench", "humaneval"))
    parser.add_argument("--prompts", default="0,5", help="comma-separated indices into the set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0: off")
    args = parser.parse_args()
    if not args.repetition_penalty > 0:
        parser.error(f"--repetition-penalty must be > 0, got {args.repetition_penalty}")
    penalty = {} if args.repetition_penalty == 1.0 else {"repetition_penalty": args.repetition_penalty}
    indices = [int(i) for i in args.prompts.split(",")]
    target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    kernel = use_linear_kernel(target, args.linear_kernel)
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    cost = load_or_measure_cost_model(target, head, 1, 16, context_length=256)
    prompts = load_prompt_set(args.set, max(indices) + 1)
    print(f"linear kernel {kernel}; cost model (x plain step):\n{cost.table()}", flush=True)

    rows, traces = [], {}
    with torch.no_grad():
        for index in indices:
            ids = encode_prompt(tokenizer, prompts[index], "cpu")

            def loop(**options):
                return lambda: speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, cost_model=cost,
                                                    **penalty, **options).sequences[0, ids.shape[1]:]

            calls = {"greedy": lambda: target.generate(ids, attention_mask=torch.ones_like(ids),
                                                       max_new_tokens=args.new_tokens, **GREEDY,
                                                       **penalty)[0, ids.shape[1]:],
                     "fast": loop(), "fast_no_ngram": loop(ngram_size=0),
                     "steps": loop(ngram_size=0, verify_policy=ForcedVerifyLengths([0])),
                     "steps_with_ngram_lookup": loop(verify_policy=ForcedVerifyLengths([0]))}
            for call in calls.values():  # warm-up
                call()
            per_token = {name: [] for name in calls}
            fast_runs = []
            for repeat in range(args.repeats):
                for name in rotated(list(calls), repeat + index):
                    rounds = []
                    with recording_rounds(rounds):
                        started = time.perf_counter()
                        tokens = calls[name]()
                    seconds = time.perf_counter() - started
                    per_token[name].append(seconds / len(tokens))
                    if name == "fast":
                        fast_runs.append((seconds / len(tokens), started, rounds))
            median = {name: statistics.median(values) for name, values in per_token.items()}
            greedy = median["greedy"]
            _, started, rounds = sorted(fast_runs)[len(fast_runs) // 2]
            kinds, line = round_kinds(started, rounds, greedy)
            row = {"set": args.set, "prompt": index, "greedy tok/s": round(1 / greedy, 2),
                   **{f"{name} / greedy": round(greedy / median[name], 3) for name in VARIANTS[1:]}}
            rows.append(row)
            traces[f"{args.set}{index}"] = {"kinds": kinds, "rounds": line}
            print(table([row], list(row)), flush=True)
            print(f"  {kinds}\n  {line}", flush=True)

    command = "python benchmarks/round_trace.py " + " ".join(sys.argv[1:])
    stem = f"round_trace_{args.set}_{args.dtype}" + (f"_penalty{args.repetition_penalty}" if penalty else "")
    path = save(stem, {"command": command, "dtype": args.dtype, "linear_kernel": kernel, "cost_model": cost.as_dict(),
                       "new_tokens": args.new_tokens, "repeats": args.repeats, "prompts": rows, "traces": traces})
    kind_rows = [{"prompt": name, "kind": kind, **entry} for name, trace in traces.items()
                 for kind, entry in trace["kinds"].items()]
    markdown = (f"`{command}` ({args.dtype}, linear kernel {kernel}; medians of {args.repeats} interleaved runs)\n\n"
                f"{table(rows, list(rows[0]))}\n\nThe fast loop's median run by kind of round:\n\n"
                f"{table(kind_rows, list(kind_rows[0]))}\n\n"
                + "\n".join(f"- {name}: `{trace['rounds']}`" for name, trace in traces.items()) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)
    draw(rows, RESULTS / f"{stem}.png", f"{args.set}, {args.dtype}, linear kernel {kernel}")
    print(f"wrote {path}")


def draw(rows: list[dict], path: Path, title: str) -> None:
    chart_grouped([f"{r['set']} {r['prompt']}" for r in rows],
                  {name: [r[f"{name} / greedy"] for r in rows] for name in VARIANTS[1:]},
                  "speed / plain greedy", f"The fast loop round by round: {title}", path)


if __name__ == "__main__":
    main()
