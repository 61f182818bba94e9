"""What the fast loop's plain step costs beyond the target's forward, piece by piece, next to ``generate``'s.

    python benchmarks/cost/step_cost.py [--set mtbench] [--prompts 0,3] [--new-tokens 128] [--repeats 5]
                                   [--dtype fp32|bf16] [--linear-kernel auto|onednn|default]

Per prompt, per generated token, interleaved with the order rotated per repeat (medians):

- ``generate``: Transformers' greedy ``generate``;
- ``forward``: a bare loop of one-token target forwards on a ``DynamicCache`` and an argmax: the floor;
- ``+ mask``: the same with the 2-D attention mask the loop passes (``DraftContext.verify_mask``);
- ``+ taps``: and the tapped hidden states the drafter reads (``output_hidden_states``);
- ``+ context``: and the drafter's context projected and written (``DraftContext.append``);
- ``loop steps``: ``speculative_generate`` forced to plain steps (``ForcedVerifyLengths([0])``, no n-gram);
- ``loop steps + lookup``: the same with the n-gram lookup the shipped loop runs every round.

The gaps between neighbours price each piece; ``loop steps`` − ``+ context`` is the loop's own bookkeeping
(the host read, acceptance, commit, stats). Every variant stops at EOS, as ``generate`` does (no
``min_new_tokens``: its processor would be priced too). Then one more ``loop steps + lookup`` run per prompt
with timers on its parts (the target's forwards, the context append, the lookup, the commit; the rest is
the loop's own bookkeeping), in ms per generated token (the call's prefill and set-up are in it too, spread
over the tokens).
Writes benchmarks/results/<cpu kind>/step_cost_<dtype>.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, chart_bars, results_dir, save, table  # noqa: E402

import hf_dflash2.speculative_dflash2 as speculative  # noqa: E402
from hf_dflash2 import speculative_generate  # noqa: E402
from hf_dflash2.assets import load_prompt_set, load_target  # noqa: E402
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths  # noqa: E402
from hf_dflash2.cpu.linear_kernels import LINEAR_KERNELS, use_linear_kernel  # noqa: E402
from hf_dflash2.evaluation.bench import rotated  # noqa: E402
from hf_dflash2.generation import prefill  # noqa: E402
from hf_dflash2.generation.outputs import OutputBuffer  # noqa: E402
from hf_dflash2.prompts import default_head, encode_prompt, load_head  # noqa: E402
from hf_dflash2.speculative_dflash2 import DEFAULT_NGRAM_SIZE, tapped_features  # noqa: E402

PIECES = ("generate", "forward", "+ mask", "+ taps", "+ context", "loop steps", "loop steps + lookup")


@contextmanager
def timers(target, spent: Counter):
    """Seconds spent in the loop's parts, added up in ``spent`` (instrumentation: wraps, then restores)."""
    parts = [(type(target), "__call__", "target forward"), (speculative, "ngram_draft", "n-gram lookup"),
             (speculative.DraftContext, "append", "context append"), (OutputBuffer, "commit", "commit")]
    originals = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in parts]
    try:
        for owner, name, label in parts:
            def timed(*args, _original=getattr(owner, name), _label=label, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_label] += time.perf_counter() - started
            setattr(owner, name, timed)
        yield
    finally:
        for owner, name, original in originals:
            if original is None:  # inherited (nn.Module.__call__): drop the wrapper
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def hand_loop(target, head, ids: torch.Tensor, new_tokens: int, eos: int, mask: bool, taps: bool, context: bool):
    """Greedy one-token steps after the loop's own prefill, with as much of the loop's per-step work as asked,
    up to ``new_tokens`` or EOS (one host read per step, as ``generate`` makes)."""
    layer_ids = head.config.target_layer_ids
    capture = [i + 1 for i in layer_ids] if taps else None
    cache, draft_context, logits = prefill(target, head, ids, torch.ones_like(ids), ids.shape[1] + new_tokens + 1)
    token = logits.argmax(-1, keepdim=True)
    position = torch.tensor([[ids.shape[1]]])
    out_tokens = [token]
    for _ in range(new_tokens - 1):
        if int(token) == eos:
            break
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
    eos = tokenizer.eos_token_id

    rows, part_rows = [], []
    with torch.no_grad():
        for index in indices:
            ids = encode_prompt(tokenizer, prompts[index], "cpu")
            def steps(ngram_size):
                return lambda: speculative_generate(target, head, ids, max_new_tokens=n, ngram_size=ngram_size,
                                                    verify_policy=ForcedVerifyLengths([0])).sequences[0, ids.shape[1]:]

            calls = {
                "generate": lambda: target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                                    **GREEDY)[0, ids.shape[1]:],
                "forward": lambda: hand_loop(target, head, ids, n, eos, False, False, False),
                "+ mask": lambda: hand_loop(target, head, ids, n, eos, True, False, False),
                "+ taps": lambda: hand_loop(target, head, ids, n, eos, True, True, False),
                "+ context": lambda: hand_loop(target, head, ids, n, eos, True, True, True),
                "loop steps": steps(0),
                "loop steps + lookup": steps(DEFAULT_NGRAM_SIZE),
            }
            texts = {name: call() for name, call in calls.items()}  # warm-up, and the texts to compare
            per_token = {name: [] for name in calls}
            for repeat in range(args.repeats):
                for name in rotated(list(calls), repeat + index):
                    started = time.perf_counter()
                    tokens = calls[name]()
                    per_token[name].append((time.perf_counter() - started) / len(tokens))
            ms = {name: 1000 * statistics.median(values) for name, values in per_token.items()}
            spent = Counter()
            with timers(target, spent):
                started = time.perf_counter()
                generated = len(calls["loop steps + lookup"]())
                spent["total"] = time.perf_counter() - started
            spent["bookkeeping (the rest)"] = spent["total"] - sum(v for k, v in spent.items() if k != "total")
            parts = {"set": args.set, "prompt": index,
                     **{f"{name} ms": round(1000 * seconds / generated, 3) for name, seconds in spent.items()}}
            part_rows.append(parts)
            row = {"set": args.set, "prompt": index, **{f"{name} ms": round(ms[name], 3) for name in PIECES},
                   "loop steps / generate": round(ms["loop steps"] / ms["generate"], 3),
                   "loop steps / forward": round(ms["loop steps"] / ms["forward"], 3),
                   "texts equal generate's": sum(torch.equal(t, texts["generate"]) for t in texts.values()) - 1}
            rows.append(row)
            print(table([row], list(row)), table([parts], list(parts)), sep="\n", flush=True)

    command = "python benchmarks/cost/step_cost.py " + " ".join(sys.argv[1:])
    stem = f"step_cost_{args.dtype}"
    path = save(stem, {"command": command, "dtype": args.dtype, "linear_kernel": kernel, "new_tokens": n,
                       "repeats": args.repeats, "prompts": rows, "loop_parts": part_rows})
    markdown = (f"`{command}` ({args.dtype}, linear kernel {kernel}; ms per generated token, medians of "
                f"{args.repeats} interleaved runs)\n\n{table(rows, list(rows[0]))}\n\n"
                f"One more run of `loop steps + lookup` per prompt, timed by part (ms per generated token):\n\n"
                f"{table(part_rows, list(part_rows[0]))}\n")
    (results_dir() / f"{stem}.md").write_text(markdown)
    print(markdown)
    mean = {name: statistics.mean(r[f"{name} ms"] for r in rows) for name in PIECES}
    chart_bars(list(PIECES), [mean[name] for name in PIECES], "ms per token (mean over prompts)",
               f"The plain step, piece by piece ({args.dtype}, {kernel})", results_dir() / f"{stem}.png")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
