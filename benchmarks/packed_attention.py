"""What the packed grouped-query attention (``hf_dflash2.attention``) buys, and how much of the fast loop's
lead it accounts for.

    python benchmarks/packed_attention.py [--prompts 4] [--new-tokens 64] [--repeats 3] [--forward-repeats 25]
                                          [--dtype auto|bf16|fp32]

1. One target forward as the loop's verify runs it (``generation.verify``: the context's mask, the tapped
   features) over ``w`` = 1, 2, 4, 8, 16 new tokens after the prompt, Transformers' ``sdpa`` against
   ``packed_gqa_sdpa``, at batch 1 and batch 8 (the first HumanEval prompts, left-padded), interleaved;
   also the one-token step as ``generate`` runs it (its 2-D mask).
2. End to end at batch 1 (``--prompts`` HumanEval and as many MT-Bench prompts): plain greedy ``generate``
   on ``sdpa`` and on the packed attention, the fast loop with and without it (``packed_attention=``), and
   ``generate(assistant_model=head)``; per prompt interleaved, medians of ``--repeats``; the sums of the
   medians over the prompts. Then batch 8: batched greedy on each attention, the fast loop with and without.

The fast loop's speedup over plain greedy on ``sdpa`` is what a user who switches sees; the speedup over
greedy on the packed attention is what speculation adds on top of an attention any greedy run may use
(``model.set_attn_implementation(PACKED_GQA_SDPA)``). In the dtype ``auto`` decodes in, on the linear kernel
``auto`` picks (``--dtype``: that dtype instead). Writes
benchmarks/results/packed_attention_<cpu kind>[_<dtype>].{json,md,png} (no suffix for ``auto``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, cpu_kind, interleaved, machine, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_humaneval_prompts, load_mtbench_prompts  # noqa: E402
from hf_dflash2.attention import packed_gqa_attention  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.charts import save_chart  # noqa: E402
from hf_dflash2.cost_model_dflash2 import linear_kernel_of  # noqa: E402
from hf_dflash2.generation import prefill, verify  # noqa: E402
from hf_dflash2.linear_kernels import use_linear_kernel  # noqa: E402
from hf_dflash2.precision import load_target_for_decoding  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, left_pad, load_head  # noqa: E402

WIDTHS = (1, 2, 4, 8, 16)


def forward_costs(target, head, ids, mask, repeats: int) -> list[dict]:
    """Median ms of a verify forward of each width, and of ``generate``'s one-token step, on each attention."""
    layer_ids = head.config.target_layer_ids
    rows = ids.shape[0]
    cache, context, _ = prefill(target, head, ids, mask, ids.shape[1] + 2 * max(WIDTHS))
    positions0 = mask.long().sum(-1)
    generator = torch.Generator().manual_seed(0)
    vocab = target.config.get_text_config().vocab_size
    times: dict[tuple, list[float]] = {}
    for repeat in range(repeats + 1):  # the first pass is a warm-up
        for width in [*WIDTHS, "step"]:
            tokens = torch.randint(0, vocab, (rows, 1 if width == "step" else width), generator=generator)
            for packed in rotated([False, True], repeat):
                with packed_gqa_attention(target, packed):
                    started = time.perf_counter()
                    if width == "step":
                        grown = cache.get_seq_length() - mask.shape[1] + 1
                        step_mask = torch.cat([mask, mask.new_ones(rows, grown)], 1)
                        target(input_ids=tokens, attention_mask=step_mask, cache=cache, use_cache=True)
                    else:
                        verify(target, layer_ids, cache, context, tokens, positions0[:, None] + torch.arange(width))
                    seconds = time.perf_counter() - started
                cache.crop(-tokens.shape[1])
                if repeat:
                    times.setdefault((width, packed), []).append(seconds)
    out = []
    for width in [*WIDTHS, "step"]:
        stock, packed = (statistics.median(times[(width, p)]) * 1e3 for p in (False, True))
        out.append({"batch": rows, "forward": "generate's step" if width == "step" else f"verify w={width}",
                    "sdpa_ms": stock, "packed_ms": packed, "speedup": stock / packed})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set at batch 1")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forward-repeats", type=int, default=25)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    args = parser.parse_args()
    if min(args.prompts, args.new_tokens, args.repeats, args.forward_repeats, args.batch) < 1:
        raise SystemExit(f"every count must be >= 1, got {vars(args)}")
    target, tokenizer = load_target_for_decoding(args.dtype)
    kernel = linear_kernel_of(target)
    head = load_head(default_head("smollm2-135m-dflash2"), target).to(target.dtype).bind_target(target)
    use_linear_kernel(head, kernel)
    n, pad = args.new_tokens, tokenizer.pad_token_id
    humaneval = load_humaneval_prompts()
    batch_ids, batch_mask = left_pad([encode_prompt(tokenizer, p, "cpu") for p in humaneval[: args.batch]], pad)

    with torch.no_grad():
        first = encode_prompt(tokenizer, humaneval[0], "cpu")
        forwards = forward_costs(target, head, first, torch.ones_like(first), args.forward_repeats)
        forwards += forward_costs(target, head, batch_ids, batch_mask, args.forward_repeats)
        print(table(forwards, ["batch", "forward", "sdpa_ms", "packed_ms", "speedup"]))

        def greedy(ids, mask, packed):
            def call():
                with packed_gqa_attention(target, packed):
                    target.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **GREEDY)
            return call

        def fast(ids, mask, packed):
            return lambda: speculative_generate(target, head, ids, attention_mask=mask, max_new_tokens=n,
                                                pad_token_id=pad, packed_attention=packed)

        methods_b1 = ["greedy", "greedy_packed", "fast_unpacked", "fast", "generate_path"]
        totals = {m: 0.0 for m in methods_b1}
        per_prompt = []
        prompts = [("humaneval", p) for p in humaneval[: args.prompts]]
        prompts += [("mtbench", p) for p in load_mtbench_prompts()[: args.prompts]]
        for index, (dataset, prompt) in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt, "cpu")
            mask = torch.ones_like(ids)
            calls = {"greedy": greedy(ids, mask, False), "greedy_packed": greedy(ids, mask, True),
                     "fast_unpacked": fast(ids, mask, False), "fast": fast(ids, mask, True),
                     "generate_path": lambda ids=ids: target.generate(ids, assistant_model=head, max_new_tokens=n,
                                                                      **GREEDY)}
            medians = interleaved(calls, args.repeats)
            for method, seconds in medians.items():
                totals[method] += seconds
            per_prompt.append({"dataset": dataset, "prompt": index, **{m: round(s, 3) for m, s in medians.items()}})
            print(f"prompt {index + 1}/{len(prompts)} ({dataset}):",
                  ", ".join(f"{m} {s:.2f} s" for m, s in medians.items()), flush=True)
        batch1 = [{"method": m, "seconds": totals[m], "over_greedy": totals["greedy"] / totals[m],
                   "over_greedy_packed": totals["greedy_packed"] / totals[m],
                   "over_generate_path": totals["generate_path"] / totals[m]} for m in methods_b1]
        print(table(batch1, ["method", "seconds", "over_greedy", "over_greedy_packed", "over_generate_path"]))

        calls = {"ar": greedy(batch_ids, batch_mask, False), "ar_packed": greedy(batch_ids, batch_mask, True),
                 "fast_unpacked": fast(batch_ids, batch_mask, False), "fast": fast(batch_ids, batch_mask, True)}
        medians = interleaved(calls, args.repeats + 2)
        batch8 = [{"method": m, "seconds": s, "over_ar": medians["ar"] / s, "over_ar_packed": medians["ar_packed"] / s}
                  for m, s in medians.items()]
        print(table(batch8, ["method", "seconds", "over_ar", "over_ar_packed"]))

    name = f"packed_attention_{cpu_kind()}" + ("" if args.dtype == "auto" else f"_{args.dtype}")
    command = "python benchmarks/packed_attention.py " + " ".join(sys.argv[1:])
    payload = {"command": command.strip(), "machine": machine(), "dtype": str(target.dtype), "linear_kernel": kernel,
               "new_tokens": n, "repeats": args.repeats, "forwards": forwards, "batch1": batch1,
               "batch1_per_prompt": per_prompt, "batch": args.batch, "batch_rows": batch8}
    save(name, payload)
    text = (f"{payload['command']}\n\nSmolLM2-135M-Instruct {target.dtype}, linear kernel {kernel}, "
            f"{n} new tokens, the committed head.\n\nOne forward, medians of {args.forward_repeats}:\n\n"
            + table(forwards, ["batch", "forward", "sdpa_ms", "packed_ms", "speedup"])
            + f"\n\nBatch 1, {args.prompts} HumanEval + {args.prompts} MT-Bench prompts, sums of per-prompt medians "
            f"of {args.repeats}:\n\n"
            + table(batch1, ["method", "seconds", "over_greedy", "over_greedy_packed", "over_generate_path"])
            + f"\n\nBatch {args.batch} (the first HumanEval prompts), medians of {args.repeats + 2}:\n\n"
            + table(batch8, ["method", "seconds", "over_ar", "over_ar_packed"]))
    (RESULTS / f"{name}.md").write_text(text + "\n")
    draw(forwards, batch1, batch8, RESULTS / f"{name}.png")
    print(f"wrote {RESULTS / name}.{{json,md,png}}")


def draw(forwards: list[dict], batch1: list[dict], batch8: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide = max(r["batch"] for r in forwards)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for batch, marker in ((1, "o"), (wide, "s")):
        rows = [r for r in forwards if r["batch"] == batch and r["forward"].startswith("verify")]
        left.plot([int(r["forward"].split("=")[1]) for r in rows], [r["speedup"] for r in rows], marker=marker,
                  label=f"batch {batch}")
    left.axhline(1.0, color="grey", lw=0.8)
    left.set(xscale="log", xlabel="tokens verified per row (w)", ylabel="sdpa time / packed time",
             title="one verify forward")
    left.set_xticks(WIDTHS, [str(w) for w in WIDTHS])
    left.legend()
    labels = [f"b1 {r['method']}" for r in batch1] + [f"b{wide} {r['method']}" for r in batch8]
    values = [r["over_greedy"] for r in batch1] + [r["over_ar"] for r in batch8]
    plain = ("greedy", "greedy_packed", "ar", "ar_packed")
    right.barh(labels, values, color=["#888" if lab.split(" ")[1] in plain else "#4477aa" for lab in labels])
    right.axvline(1.0, color="grey", lw=0.8)
    right.set(xlabel="speed over plain greedy on sdpa (same batch)", title="end to end")
    fig.tight_layout()
    save_chart(fig, path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
