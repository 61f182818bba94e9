"""Adaptive verify length vs plain greedy and the fixed block, side by side in one process.

    python benchmarks/speed/adaptive.py --dtype fp32|bf16 [--prompts 3] [--new-tokens 48] [--batch8]
                                        [--linear-kernel auto|onednn|default] [--skip-batch1]

Batch 1, SmolLM2-135M-Instruct, per prompt and interleaved: plain greedy ``generate``, the fast loop with
the whole block (``adaptive=False``) and adaptive, and ``generate(assistant_model=head)`` adaptive, for a
fresh head (tau ~ 1: goal adaptive >= 0.95x greedy; block 16, full vocabulary), a fresh head of the shipped
head's shape (block 8, its draft vocabulary, untrained) and the committed head heads/smollm2-135m-dflash2.
``--batch8``: batched AR vs the fast loop (fixed and adaptive) on 8 prompts with the committed head
(goal >= 1.0x). Also the identity rate: the share of generated tokens equal to plain greedy's (1.0 in
fp32; bf16 may flip near-ties, every token still being the target's argmax on its own kernel path).
Every method and head runs on the same linear kernel (``--linear-kernel``, default auto, as the demo and the
bench). Writes benchmarks/results/<cpu kind>/adaptive_<dtype>[_<kernel> when not the default kernel][_b8 with
``--skip-batch1``].{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, results_dir, save, table  # noqa: E402

from hf_dflash2 import DFlash2DraftModel, speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts, load_target  # noqa: E402
from hf_dflash2.charts import save_chart  # noqa: E402
from hf_dflash2.cost_model_dflash2 import load_or_measure_cost_model  # noqa: E402
from hf_dflash2.cpu.attention import packed_gqa_attention  # noqa: E402
from hf_dflash2.cpu.linear_kernels import LINEAR_KERNELS, use_linear_kernel  # noqa: E402
from hf_dflash2.evaluation.bench import rotated  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head  # noqa: E402


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def identity(a: torch.Tensor, b: torch.Tensor) -> float:
    n = min(a.shape[-1], b.shape[-1])
    return float((a[..., :n] == b[..., :n]).float().mean())


def batch1(target, heads, prompts, n, repeats):
    rows = []
    for head_name, head in heads.items():
        runs = {m: [] for m in ("greedy", "fixed", "adaptive", "hf_adaptive")}
        same, taus, histogram = [], [], None
        for i, ids in enumerate(prompts):
            calls = {
                "greedy": lambda: target.generate(ids, max_new_tokens=n, **GREEDY),
                "fixed": lambda: speculative_generate(target, head, ids, max_new_tokens=n, adaptive=False),
                "adaptive": lambda: speculative_generate(target, head, ids, max_new_tokens=n),
                "hf_adaptive": lambda: target.generate(ids, assistant_model=head, max_new_tokens=n, **GREEDY),
            }
            if i == 0:
                for fn in calls.values():  # warm-up, once per head
                    fn()
            reference = calls["greedy"]()[0, ids.shape[1]:]  # untimed: the identity check's reference
            for repeat in range(repeats):  # the order rotates per repeat and prompt: no fixed neighbour
                for method in rotated(list(calls), repeat + i):
                    out, seconds = timed(calls[method])
                    runs[method].append(seconds)
                    if method == "adaptive":
                        same.append(identity(out.sequences[0, ids.shape[1]:], reference))
                        taus.append(out.stats.acceptance_length)
                        h = out.stats.verify_length_histogram
                        histogram = h if histogram is None else [a + b for a, b in zip(histogram, h)]
        total = {m: sum(v) for m, v in runs.items()}
        # Per prompt: the median over repeats of each method's time (runs are prompt-major, repeat-minor).
        def per_prompt_median(method):
            return [statistics.median(runs[method][i * repeats : (i + 1) * repeats]) for i in range(len(prompts))]

        per_prompt = [g / a for g, a in zip(per_prompt_median("greedy"), per_prompt_median("adaptive"))]
        rows.append({"head": head_name, "greedy_tok_s": len(runs["greedy"]) * n / total["greedy"],
                     "fixed_x": total["greedy"] / total["fixed"], "adaptive_x": total["greedy"] / total["adaptive"],
                     "hf_adaptive_x": total["greedy"] / total["hf_adaptive"],
                     "adaptive_worst_prompt_x": min(per_prompt), "adaptive_tau": statistics.mean(taus),
                     "identity_rate": statistics.mean(same), "verify_length_histogram": histogram})
        print(table(rows[-1:], [c for c in rows[-1] if c != "verify_length_histogram"]), flush=True)
    return rows


def batch8(target, head, tokenizer, prompts, n, repeats):
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    calls = {
        "ar": lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **GREEDY),
        "fixed": lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n, adaptive=False,
                                              pad_token_id=pad),
        "adaptive": lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n,
                                                 pad_token_id=pad),
        "adaptive_no_trees": lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n,
                                                          pad_token_id=pad, draft_tree=False),
    }
    for fn in calls.values():
        fn()
    seconds = {m: [] for m in calls}
    for repeat in range(repeats):
        for method in rotated(list(calls), repeat):
            seconds[method].append(timed(calls[method])[1])
    tokens = ids.shape[0] * n  # upper bound for all (no EOS handling differences in the count)
    result = {m: tokens / statistics.median(s) for m, s in seconds.items()}
    adaptive = speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad)
    return {"ar_tok_s": result["ar"], "fixed_tok_s": result["fixed"], "adaptive_tok_s": result["adaptive"],
            "adaptive_over_ar": result["adaptive"] / result["ar"], "fixed_over_ar": result["fixed"] / result["ar"],
            "adaptive_no_trees_over_ar": result["adaptive_no_trees"] / result["ar"],
            "verify_length_histogram": adaptive.stats.verify_length_histogram}


def chart(rows, b8, path: Path, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for row in rows:
        for method in ("fixed_x", "adaptive_x", "hf_adaptive_x"):
            labels.append(f"{row['head']}\n{method[:-2]}")
            values.append(row[method])
    if b8:
        labels += ["batch 8\nfixed", "batch 8\nadaptive"]
        values += [b8["fixed_over_ar"], b8["adaptive_over_ar"]]
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 3.6))
    ax.bar(range(len(values)), values, color=["#888" if "fixed" in lab else "#2a7" for lab in labels])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.95, color="r", lw=0.6, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("speed / plain greedy (same dtype)")
    ax.set_title(f"SmolLM2-135M {dtype}, batch 1 (and 8), adaptive vs fixed")
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--batch8", action="store_true")
    parser.add_argument("--skip-batch1", action="store_true")
    parser.add_argument("--shared-cpu", action="store_true", help="say in the results that another job ran")
    parser.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    target, tokenizer = load_target()
    target.to(dtype)
    kernel = use_linear_kernel(target, args.linear_kernel)
    print(f"linear kernel: {kernel}", flush=True)
    committed = load_head(default_head("smollm2-135m-dflash2"), target).to(dtype).bind_target(target)
    fresh = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=16, selector_rank=128,
                                         target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0)
    fresh.eval().bind_target(target)
    # The shipped head's shape (block 8, its 8,192-token draft vocabulary), untrained: with the full LM head a
    # fresh head's draft pass would cost several times more.
    fresh_shipped = DFlash2DraftModel.for_target(
        target, num_hidden_layers=committed.config.num_hidden_layers, block_size=committed.config.block_size,
        selector_rank=committed.config.dflash_config.get("selector_rank", 128),
        target_layer_ids=committed.config.target_layer_ids, mask_token_id=committed.config.mask_token_id,
    ).set_draft_vocab(committed.draft_vocab.tolist())
    fresh_shipped.eval().bind_target(target)
    heads = {"fresh": fresh, "fresh_shipped_shape": fresh_shipped, "committed": committed}
    for head in heads.values():
        use_linear_kernel(head, kernel)
    texts = load_humaneval_prompts()[:8]
    mixed = (load_humaneval_prompts()[: (args.prompts + 1) // 2] + load_mtbench_prompts()[: args.prompts // 2])
    prompts = [encode_prompt(tokenizer, p, "cpu") for p in mixed]
    results = {"command": "python benchmarks/speed/adaptive.py " + " ".join(sys.argv[1:]), "dtype": args.dtype,
               "linear_kernel": kernel,
               "load_average_at_start": os.getloadavg(),
               "note": ("CPU shared with another job: " if args.shared_cpu else "no other job running: ")
               + "ratios are side by side in one process; absolute tok/s are noisy"}
    with torch.no_grad():
        for name, head in heads.items():
            with packed_gqa_attention(target):  # the cost model the fast loop measures and uses
                cost_model = load_or_measure_cost_model(target, head, 1)
            results[f"cost_model_{name}"] = cost_model.as_dict()
            table_text = cost_model.table()
            print(f"cost model, {name} head, batch 1:\n{table_text}\n", flush=True)
        rows = [] if args.skip_batch1 else batch1(target, heads, prompts, args.new_tokens, args.repeats)
        b8 = None
        if args.batch8:
            b8 = batch8(target, committed, tokenizer, [encode_prompt(tokenizer, p, "cpu") for p in texts],
                        args.new_tokens, args.repeats)
            print("batch 8:", b8, flush=True)
    results["batch1"], results["batch8"] = rows, b8
    columns = ["head", "greedy_tok_s", "fixed_x", "adaptive_x", "hf_adaptive_x", "adaptive_worst_prompt_x",
               "adaptive_tau", "identity_rate"]
    text = (f"SmolLM2-135M-Instruct {args.dtype}, linear kernel {kernel}, batch 1, {len(prompts)} prompts x "
            f"{args.new_tokens} tokens\n\n")
    text += table(rows, columns)
    if b8:
        columns8 = ["ar_tok_s", "fixed_tok_s", "adaptive_tok_s", "adaptive_over_ar", "adaptive_no_trees_over_ar"]
        text += "\n\nbatch 8 (tok/s):\n\n" + table([b8], columns8)
    print("\n" + text)
    stem = f"adaptive_{args.dtype}" + ("" if kernel == "default" else f"_{kernel}")
    stem += "_b8" if args.skip_batch1 else ""
    (results_dir() / f"{stem}.md").write_text(text + "\n")
    chart(rows, b8, results_dir() / f"{stem}.png", args.dtype)
    print(f"written {save(stem, results)}")


if __name__ == "__main__":
    main()
