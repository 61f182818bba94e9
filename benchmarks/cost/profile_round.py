"""Where a speculative round's time goes: torch.profiler over the fast loop on SmolLM2-135M-Instruct.

    python benchmarks/cost/profile_round.py [--dtype fp32|bf16] [--block-size 16] [--new-tokens 32] [--head DIR]
    python benchmarks/cost/profile_round.py --trees --dtype bf16 --head heads/smollm2-135m-dflash2 --new-tokens 128

Runs ``speculative_generate`` with the whole block verified every round (``adaptive=False``, so every
round has the same shape) under ``torch.profiler`` and reports, per round: the loop's phases
(``dflash2::draft`` / ``verify`` / ``accept`` / ``commit`` / ..., recorded by the loop) and the operators with
the most self time. A fresh head by default (tau ~ 1: one token per round). Writes
benchmarks/results/<cpu kind>/profile_round_<dtype>_b<B>.{json,md}.

``--bound SET``: the default loop as a user calls it (kernels chosen per forward, the committed head) on the
prompts of SET (humaneval, mtbench, longctx; ``--limit``), where it runs below its bound: per prompt, the
wall time per round beside what the cost model predicts for the forwards it ran (the bound's own
arithmetic), and, under the profiler, the time in the draft pass, the verify forward and everything else
(plan, accept, commit, context, and what no phase covers; the wall includes the prefill). With
``--temperature T`` it samples, each call seeded alike. Writes profile_round_bound_<set>[_t<T>].{json,md}.

``--trees``: the default loop instead (adaptive policy, n-gram drafts, block widened to 16), profiled
once with draft trees and once without (``draft_tree=False``), phases per round side by side (plus
``dflash2::plan``, the policy's choice); writes benchmarks/results/<cpu kind>/profile_round_<dtype>_trees.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import results_dir, save, table  # noqa: E402

from hf_dflash2 import DFlash2DraftModel, speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_target  # noqa: E402
from hf_dflash2.prompts import encode_prompt  # noqa: E402

PHASES = ("dflash2::ngram", "dflash2::draft", "dflash2::plan", "dflash2::host_read", "dflash2::cache",
          "dflash2::tree", "dflash2::verify", "dflash2::accept", "dflash2::commit", "dflash2::context")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--head", default=None, help="a trained head folder (default: a fresh head)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--trees", action="store_true", help="the default loop with and without draft trees")
    parser.add_argument("--bound", metavar="SET", help="the default loop against its bound on this prompt set")
    parser.add_argument("--limit", type=int, default=6, help="with --bound: prompts of the set")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="with --bound: sample at this temperature (each call seeded alike); 0: greedy")
    args = parser.parse_args()
    if args.bound:
        return against_bound(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tokenizer = load_target()
    target.to(dtype)
    if args.head:
        head = DFlash2DraftModel.from_pretrained(args.head).to(dtype).eval()
    else:
        head = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=args.block_size,
                                            target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0).to(dtype).eval()
    head.bind_target(target)
    ids = encode_prompt(tokenizer, load_humaneval_prompts()[0], "cpu")
    if args.trees:
        return compare_trees(target, head, ids, args)
    run = dict(max_new_tokens=args.new_tokens, adaptive=False, block_size=args.block_size)
    with torch.no_grad():
        speculative_generate(target, head, ids, **run)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            result = speculative_generate(target, head, ids, **run)
    rounds = result.stats.rounds
    events = prof.key_averages()
    phases = [{"phase": e.key, "ms_per_round": e.cpu_time_total / rounds / 1e3, "calls": e.count}
              for e in events if e.key in PHASES]
    phases.sort(key=lambda r: PHASES.index(r["phase"]))
    total = sum(r["ms_per_round"] for r in phases)
    for r in phases:
        r["share"] = r["ms_per_round"] / total
    ops = sorted((e for e in events if not e.key.startswith("dflash2::") and e.key != "ProfilerStep*"),
                 key=lambda e: -e.self_cpu_time_total)[: args.top]
    top = [{"op": e.key, "self_ms_per_round": e.self_cpu_time_total / rounds / 1e3, "calls_per_round": e.count / rounds}
           for e in ops]
    phase_table = table(phases, ["phase", "ms_per_round", "share", "calls"])
    op_table = table(top, ["op", "self_ms_per_round", "calls_per_round"])
    header = (f"One fast-loop round, SmolLM2-135M-Instruct {args.dtype}, B = {args.block_size}, "
              f"{'head ' + args.head if args.head else 'fresh head'}, tau = {result.stats.acceptance_length:.2f}, "
              f"{rounds} rounds, {torch.get_num_threads()} threads")
    write_results(f"profile_round_{args.dtype}_b{args.block_size}", header,
                  f"{phase_table}\n\nTop operators by self time:\n\n{op_table}", {"phases": phases, "top_ops": top})


def write_results(stem: str, header: str, body: str, payload: dict) -> None:
    """Print and write ``<stem>.md`` (header, body) and ``<stem>.json`` (the command, header, payload)."""
    text = f"{header}\n\n{body}\n"
    print(text)
    (results_dir() / f"{stem}.md").write_text(text)
    command = "python benchmarks/cost/profile_round.py " + " ".join(sys.argv[1:])
    print(f"written {save(stem, {'command': command, 'header': header, **payload})}")


def against_bound(args) -> None:
    import time

    from hf_dflash2.assets import load_prompt_set
    from hf_dflash2.prompts import default_head, load_head

    target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    head = load_head(args.head or default_head(), target)
    rows = []
    for index, prompt in enumerate(load_prompt_set(args.bound, args.limit)):
        ids = encode_prompt(tokenizer, prompt, "cpu")
        run = dict(max_new_tokens=args.new_tokens, do_sample=args.temperature > 0)
        if args.temperature > 0:
            run.update(temperature=args.temperature, top_k=None, top_p=None)
        def call():
            torch.manual_seed(0)  # sampled calls draw alike, so the timed and the profiled call run the same rounds
            return speculative_generate(target, head, ids, **run)

        with torch.no_grad():
            call()  # warm-up: kernels probed, cost model cached
            started = time.perf_counter()
            plain = call()
            wall = time.perf_counter() - started
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                started = time.perf_counter()
                profiled = call()
                profiled_wall = time.perf_counter() - started
        if args.top:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        stats = plain.stats
        costs = stats.costs
        modeled = stats.draft_passes * costs["draft_seconds"] + sum(
            n * costs["verify_seconds"][min(k, len(costs["verify_seconds"]) - 1)]
            for k, n in enumerate(stats.verify_length_histogram))
        phases = {e.key.removeprefix("dflash2::"): e.cpu_time_total / 1e6 for e in prof.key_averages()
                  if e.key in PHASES}
        forwards = profiled.stats.verify_forwards
        row = {"prompt": index, "prompt_tokens": ids.shape[1], "tau": round(stats.acceptance_length, 2),
               "rounds": stats.verify_forwards, "draft_passes": stats.draft_passes,
               "ms_per_round": round(1e3 * wall / stats.verify_forwards, 1),
               "modeled_ms_per_round": round(1e3 * modeled / stats.verify_forwards, 1),
               "modeled_share": round(modeled / wall, 2)}
        for phase in (name.removeprefix("dflash2::") for name in PHASES):
            row[f"{phase}_ms"] = round(1e3 * phases.get(phase, 0.0) / forwards, 1)
        row["unlabelled_ms"] = round(1e3 * (profiled_wall - sum(phases.values())) / forwards, 1)
        row["outside_forwards"] = round(1 - (phases.get("draft", 0) + phases.get("verify", 0)) / profiled_wall, 2)
        rows.append(row)
        print(row, flush=True)
    decoding = f"sampled at T = {args.temperature:g}" if args.temperature > 0 else "greedy"
    header = (f"The default loop against its bound: SmolLM2-135M-Instruct, the committed head, {args.bound} "
              f"(first {args.limit}), {args.new_tokens} new tokens, {decoding}, {args.dtype}, "
              f"{torch.get_num_threads()} threads. "
              "ms_per_round: the whole call's wall clock (its prefill included) a round, without the profiler; "
              "modeled: the cost model's draft and verify seconds "
              "for the forwards the call ran (the bound's arithmetic); the phase columns: under the profiler, "
              "ms per round; outside_forwards: the profiled wall's share not in a draft pass or a verify forward.")
    suffix = (f"_t{args.temperature:g}" if args.temperature > 0 else "") + ("_bf16" if args.dtype == "bf16" else "")
    write_results(f"profile_round_bound_{args.bound}{suffix}", header, table(rows, list(rows[0])), {"rows": rows})


def compare_trees(target, head, ids, args) -> None:
    rows = []
    for trees in (True, False):
        with torch.no_grad():
            speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, draft_tree=trees)  # warm-up
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                result = speculative_generate(target, head, ids, max_new_tokens=args.new_tokens, draft_tree=trees)
        rounds = result.stats.rounds
        times = {e.key: e.cpu_time_total / rounds / 1e3 for e in prof.key_averages() if e.key in PHASES}
        row = {"loop": "trees" if trees else "chains", "rounds": rounds,
               "tau": round(result.stats.acceptance_length, 2), "tree_rounds": result.stats.tree_rounds}
        row.update({phase.removeprefix("dflash2::"): round(times.get(phase, 0.0), 2) for phase in PHASES})
        row["ms_per_round"] = round(sum(times.values()), 2)
        row["ms_per_token"] = round(row["ms_per_round"] / max(result.stats.acceptance_length, 1e-9), 2)
        rows.append(row)
    columns = list(rows[0])
    header = (f"The default loop with and without draft trees, SmolLM2-135M-Instruct {args.dtype}, "
              f"{'head ' + args.head if args.head else 'fresh head'}, one HumanEval prompt, {args.new_tokens} tokens, "
              f"{torch.get_num_threads()} threads; ms per round by phase (record_function totals)")
    write_results(f"profile_round_{args.dtype}_trees", header, table(rows, columns), {"rows": rows})


if __name__ == "__main__":
    main()
