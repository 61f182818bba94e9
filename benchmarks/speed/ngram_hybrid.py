"""Head alone vs head + n-gram drafts, deterministically: the same text, the same cost model.

    python benchmarks/speed/ngram_hybrid.py [--prompts 16] [--new-tokens 192] [--cost-dtype bf16] [--variants 1,5,6]
        [--output NAME]

Wall-clock ratios in bf16 mix two effects: speculation, and bf16 near-ties that flip when a verify runs
on another kernel path, after which the texts part (so each method decodes a different text). Here the
target decodes in fp32, where every variant's output equals plain greedy, and each call's time is
*modelled* from the cost model of ``--cost-dtype`` (measured or cached on this machine): every round costs
verify(k + 1), every draft pass its measured time. The policy runs without a clock (``clock=None``), so
nothing depends on timing noise. Variants: the head's chain alone (block 8, what engines verify), the
head's likeliest continuations as a tree (blocks 8 and 16), head + n-gram drafts at block 16 with one
source per row, and the default: the head's tree and the n-gram's chain verified as one (``draft_tree``);
then the default with its tree nodes ranked without the top-K mass (the default's ranking undone), the
head's chain with its confidence times that mass (lowered the chain's tau: docs/benchmarks.md), and ``make bench``'s
prompt lookup (Transformers' ``generate(prompt_lookup_num_tokens=10)``, no head: each target call after the
first costs a verify of its length, the first, like the loop's prefill, nothing).
``--variants`` picks some by number (1-based, in this order; the first picked is the reference text).
Speedup = tokens x verify(1) / modelled time.
Writes benchmarks/results/<cpu kind>/<output, default ngram_hybrid>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from unittest import mock

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, chart_bars, results_dir, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set  # noqa: E402
from hf_dflash2.cost_model_dflash2 import AdaptiveVerifyPolicy, CostModel, load_or_measure_cost_model  # noqa: E402
from hf_dflash2.cpu.attention import packed_gqa_attention  # noqa: E402
from hf_dflash2.cpu.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.generation import loop  # noqa: E402
from hf_dflash2.generation.trees import candidate_log_mass, rank_continuations  # noqa: E402
from hf_dflash2.prompts import apply_chat_template_option, default_head, encode_prompt, load_head  # noqa: E402

VARIANTS = {
    "head alone, block 8": {"ngram_size": 0, "block_size": 8, "draft_tree": False},
    "head's tree, block 8": {"ngram_size": 0, "block_size": 8, "draft_tree": True},
    "head's tree, block 16": {"ngram_size": 0, "block_size": 16, "draft_tree": True},
    "head + n-gram, block 16": {"ngram_size": 3, "block_size": 16, "draft_tree": False},
    "head's tree + n-gram (default), block 16": {"ngram_size": 3, "block_size": 16, "draft_tree": True},
    # the default's ranking undone: tree nodes ranked by the selector's softmax alone (rank_continuations)
    "the default, trees ranked without the top-K mass": {"ngram_size": 3, "block_size": 16, "draft_tree": True,
                                                         "top_k_mass": False},
    # a chain's confidence (the selector's softmax over K) times its candidates' unary mass; it lowered the
    # head's own chain's tau (docs/benchmarks.md)
    "head alone, block 8, confidence x top-K mass": {"ngram_size": 0, "block_size": 8, "draft_tree": False,
                                                     "confidence_mass": True},
    # make bench's prompt_lookup: Transformers' generate(prompt_lookup_num_tokens=10), no head
    "prompt lookup (Transformers, 10 tokens)": {"prompt_lookup": 10, "block_size": 11},
}


def prompt_lookup_calls(target, ids, new_tokens, num_tokens):
    """Transformers' prompt-lookup decoding -> (sequences, slots of each target call after the first).

    The first call runs the prompt with any candidates found in it; like the fast loop's prefill, it is
    not counted. Each later call verifies its last token and its candidates (``num_tokens`` at most)."""
    lengths = []

    def record(module, args, kwargs):
        lengths.append(kwargs["input_ids"].shape[1])

    hook = target.register_forward_pre_hook(record, with_kwargs=True)
    try:
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              prompt_lookup_num_tokens=num_tokens, **GREEDY)
    finally:
        hook.remove()
    return out, lengths[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--cost-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--head", default=None)
    parser.add_argument("--variants", default=None, help="comma-separated variant numbers (1-based; default all)")
    parser.add_argument("--output", default="ngram_hybrid", help="results name under benchmarks/results/<cpu kind>/")
    args = parser.parse_args()
    if Path(args.output).name != args.output:
        parser.error(f"--output is a name under benchmarks/results/<cpu kind>/, not a path: {args.output!r}")
    names = list(VARIANTS)
    try:
        numbers = [int(i) for i in args.variants.split(",")] if args.variants else range(1, len(names) + 1)
    except ValueError:
        numbers = [0]
    if not all(1 <= n <= len(names) for n in numbers):
        parser.error(f"--variants takes numbers 1..{len(names)}, got {args.variants!r}")
    variants = {names[n - 1]: VARIANTS[names[n - 1]] for n in numbers}
    head_folder = args.head or default_head("smollm2-135m-dflash2")

    timing_target, _ = load_target_for_decoding(args.cost_dtype, None, None)
    widest = max(v["block_size"] for v in variants.values())
    with packed_gqa_attention(timing_target):  # the verify the fast loop runs
        cost = load_or_measure_cost_model(timing_target, load_head(head_folder, timing_target), 1, widest)
    del timing_target
    target, tokenizer = load_target_for_decoding("fp32", None, None)
    apply_chat_template_option(tokenizer, "auto")
    head = load_head(head_folder, target)
    draft_passes = [0]
    draft_block = head.draft_block

    confidence_mass = [False]

    def counted(*a, **k):
        draft_passes[0] += 1
        out = draft_block(*a, **k)
        if confidence_mass[0] and out.pair_scores is not None:
            out.confidence = out.confidence * candidate_log_mass(out).exp()
        return out

    head.draft_block = counted
    verify = cost.verify_seconds
    rows = []
    for name in ("mtbench", "humaneval"):
        prompts = load_prompt_set(name, args.prompts)
        totals = {label: {"tokens": 0, "seconds": 0.0, "rounds": 0, "ngram_rounds": 0, "tree_rounds": 0}
                  for label in variants}
        reference = None
        for prompt in tqdm(prompts, desc=name, unit="prompt"):
            ids = encode_prompt(tokenizer, prompt, target.device)
            for label, settings in variants.items():
                block = settings["block_size"]
                policy = AdaptiveVerifyPolicy(CostModel(verify[:block], cost.draft_seconds), clock=None)
                draft_passes[0] = 0
                confidence_mass[0] = settings.get("confidence_mass", False)
                total = totals[label]
                if settings.get("prompt_lookup"):
                    sequences, calls = prompt_lookup_calls(target, ids, args.new_tokens, settings["prompt_lookup"])
                    total["tokens"] += sequences.shape[1] - ids.shape[1]
                    total["seconds"] += sum(verify[slots - 1] for slots in calls)
                    total["rounds"] += len(calls)
                else:
                    ranking = partial(rank_continuations, top_k_mass=settings.get("top_k_mass", True))
                    with mock.patch.object(loop, "rank_continuations", ranking):
                        out = speculative_generate(target, head, ids, max_new_tokens=args.new_tokens,
                                                   verify_policy=policy, block_size=block,
                                                   ngram_size=settings["ngram_size"],
                                                   draft_tree=settings["draft_tree"])
                    sequences = out.sequences
                    histogram = out.stats.verify_length_histogram
                    total["tokens"] += int(out.num_generated.sum())
                    verifies = sum(c * verify[k] for k, c in enumerate(histogram))
                    total["seconds"] += verifies + draft_passes[0] * cost.draft_seconds
                    total["rounds"] += out.stats.rounds
                    total["ngram_rounds"] += out.stats.ngram_rounds
                    total["tree_rounds"] += out.stats.tree_rounds
                if label == next(iter(variants)):
                    reference = sequences
                elif not torch.equal(sequences, reference):
                    raise AssertionError(f"{label}: fp32 output differs from the first variant's output on {name}")
        for label, total in totals.items():
            rows.append({"set": name, "variant": label, "tau": round(total["tokens"] / total["rounds"], 3),
                         "modelled_speedup": round(total["tokens"] * verify[0] / total["seconds"], 3),
                         "ngram_rounds": f"{total['ngram_rounds']}/{total['rounds']}",
                         "tree_rounds": f"{total['tree_rounds']}/{total['rounds']}"})
    columns = ["set", "variant", "tau", "modelled_speedup", "ngram_rounds", "tree_rounds"]
    print(table(rows, columns))
    command = "python benchmarks/speed/ngram_hybrid.py " + " ".join(sys.argv[1:])
    costs = [round(v / verify[0], 3) for v in verify] + [round(cost.draft_seconds / verify[0], 3)]
    save(args.output, {"command": command, "prompts_per_set": args.prompts, "new_tokens": args.new_tokens,
                          "cost_dtype": args.cost_dtype, "cost_in_steps_verify_1_to_16_then_draft": costs,
                          "rows": rows})
    (results_dir() / f"{args.output}.md").write_text(table(rows, columns) + f"\n\nCommand: `{command}`\n")
    labels = [f"{r['set']}\n{r['variant'].replace(', ', chr(10))}" for r in rows]
    chart_bars(labels, [r["modelled_speedup"] for r in rows], "modelled speed / plain greedy",
               f"head alone vs head + n-gram drafts ({args.cost_dtype} cost model, fp32 text)",
               results_dir() / f"{args.output}.png")


if __name__ == "__main__":
    main()
