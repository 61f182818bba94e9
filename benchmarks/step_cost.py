"""What the fast loop's plain step costs beyond the target's forward, piece by piece, next to ``generate``'s.

    python benchmarks/step_cost.py [--set mtbench] [--prompts 0,3] [--new-tokens 128] [--repeats 5]
                                   [--dtype fp32|bf16] [--linear-kernel auto|onednn|default]

Per prompt, per generated token, interleaved with the order rotated per repeat (medians):

- ``generate``: Transformers' greedy ``generate``;
- ``forward``: a bare loop of one-token target forwards on a ``DynamicCache`` and an argmax: the floor;
- ``+ mask``: the same with the 2-D attention mask the loop passes (``DraftContext.verify_mask``);
- ``+ taps``: and the tapped hidden states the drafter reads (``output_hidden_states``);
- ``+ context``: and the drafter's context projected and written (``DraftContext.append``);
- ``loop steps``: ``speculative_generate`` forced to plain steps (``ForcedVerifyLengths([0])``, no n-gram).

The gaps between neighbours price each piece; ``loop steps`` − ``+ context`` is the loop's own bookkeeping
(the host read, acceptance, commit, stats). Writes benchmarks/results/step_cost_<dtype>_<cpu kind>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import GREEDY, RESULTS, chart_bars, cpu_kind, save, table  # noqa: E402

from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.bench import rotated  # noqa: E402
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths  # noqa: E402
from hf_dflash2.generation import prefill  # noqa: E402
from hf_dflash2.linear_kernels import LINEAR_KERNELS, use_linear_kernel  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import tapped_features  # noqa: E402

PIECES = ("generate", "forward", "+ mask", "+ taps", "+ context", "loop steps")


def hand_loop(target, head, ids: torch.Tensor, new_tokens: int, mask: bool, taps: bool, context: bool):
    """Greedy one-token steps after the loop's own prefill, with as much of the loop's per-step work as asked."""
    layer_ids = head.config.target_layer_ids
    capture = [i + 1 for i in layer_ids] if taps else None
    cache, draft_context, logits = prefill(target, head, ids, torch.ones_like(ids), ids.shape[1] + new_tokens + 1)
    token = logits.argmax(-1, keepdim=True)
    position = torch.tensor([[ids.shape[1]]])
    out_tokens = [token]
    for _ in range(new_tokens - 1):
        extra = {"attention_mask": draft_context.verify_mask(1)} if mask else {}
        if capture:
            extra["output_hidden_states"] = capture
        out = target(input_ids=token, position_ids=position, cache=cache, use_cache=True, **extra)
        if context:
            draft_context.append(tapped_features(out.hidden_states, layer_ids), position)
        elif mask:
            draft_context.length += 1  # keep the mask as long as the cache
        token = out.logits[:, -1].float().argmax(-1, keepdim=True)
        position = position + 1
        out_tokens.append(token)
    return torch.cat(out_tokens, 1)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--set", default="mtbench", choices=("mtbench", "humaneval"))
    parser.add_argument("--prompts", default="0,3", help="comma-separated indices into the set")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    parser.add_argument("--linear-kernel", choices=LINEAR_KERNELS, default="auto")
    args = parser.parse_args()
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error(f"--new-tokens must be >= 2 and --repeats >= 1, got {args.new_tokens} and {args.repeats}")
    indices = [int(i) for i in args.prompts.split(",")]
    target, tokenizer = load_target(dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    kernel = use_linear_kernel(target, args.linear_kernel)
    head = load_head(default_head("smollm2-135m-dflash2"), target)
    prompts = load_prompt_set(args.set, max(indices) + 1)
    n = args.new_tokens

    rows = []
    with torch.no_grad():
        for index in indices:
            ids = encode_prompt(tokenizer, prompts[index], "cpu")
            calls = {
                "generate": lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                    min_new_tokens=n, **GREEDY)[0, ids.shape[1]:],
                "forward": lambda: hand_loop(target, head, ids, n, False, False, False),
                "+ mask": lambda: hand_loop(target, head, ids, n, True, False, False),
                "+ taps": lambda: hand_loop(target, head, ids, n, True, True, False),
                "+ context": lambda: hand_loop(target, head, ids, n, True, True, True),
                "loop steps": lambda: speculative_generate(
                    target, head, ids, max_new_tokens=n, min_new_tokens=n, ngram_size=0,
                    verify_policy=ForcedVerifyLengths([0])).sequences[0, ids.shape[1]:],
            }
            texts = {name: call() for name, call in calls.items()}  # warm-up, and the texts to compare
            per_token = {name: [] for name in calls}
            for repeat in range(args.repeats):
                for name in rotated(list(calls), repeat + index):
                    started = time.perf_counter()
                    tokens = calls[name]()
                    per_token[name].append((time.perf_counter() - started) / len(tokens))
            ms = {name: 1000 * statistics.median(values) for name, values in per_token.items()}
            row = {"set": args.set, "prompt": index, **{f"{name} ms": round(ms[name], 3) for name in PIECES},
                   "loop steps / generate": round(ms["loop steps"] / ms["generate"], 3),
                   "loop steps / forward": round(ms["loop steps"] / ms["forward"], 3),
                   "texts equal generate's": sum(torch.equal(t, texts["generate"]) for t in texts.values()) - 1}
            rows.append(row)
            print(table([row], list(row)), flush=True)

    command = "python benchmarks/step_cost.py " + " ".join(sys.argv[1:])
    stem = f"step_cost_{args.dtype}_{cpu_kind()}"
    path = save(stem, {"command": command, "dtype": args.dtype, "linear_kernel": kernel, "new_tokens": n,
                       "repeats": args.repeats, "prompts": rows})
    markdown = (f"`{command}` ({args.dtype}, linear kernel {kernel}; ms per generated token, medians of "
                f"{args.repeats} interleaved runs)\n\n{table(rows, list(rows[0]))}\n")
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)
    mean = {name: statistics.mean(r[f"{name} ms"] for r in rows) for name in PIECES}
    chart_bars(list(PIECES), [mean[name] for name in PIECES], "ms per token (mean over prompts)",
               f"The plain step, piece by piece ({args.dtype}, {kernel})", RESULTS / f"{stem}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
