"""The speculative loop on an accelerator, in under 5 minutes: ``make gpu-check``.

    python scripts/gpu_check.py [--device cuda] [--dtype bf16] [--tiny] [--output FILE]

1. Greedy identity against ``generate`` on a tiny random target (fp32): the fast loop (adaptive, the
   whole block, a forced k sequence with 0 and B - 1) at batch 1 and 4, and ``generate(assistant_model=)``.
2. The sampling law on a tiny target: total variation between 20,000 speculative samples of the first two
   tokens and their exact law (the test suite's bound: < 0.05).
3. Tokens/s in ``--dtype`` (bf16 by default) of plain AR, the fast loop (fixed and adaptive) and the
   Transformers path, at batch 1 and 8 (the Transformers path is batch 1 only): SmolLM2-135M when its
   asset package is installed, else a random Llama of about that size.
4. The draft pass under ``torch.compile`` against eager: same tokens, time per pass.

``--tiny`` shrinks every step (CI runs ``--device cpu --tiny``, so the script cannot rot). Writes JSON
(default ``benchmarks/results/gpu_check_<device>.json``) and prints it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_dflash2 import DFlash2DraftModel, speculative_generate
from hf_dflash2.cost_model_dflash2 import ForcedVerifyLengths, load_or_measure_cost_model
from hf_dflash2.speculative_dflash2 import DraftContext, process_logits, tapped_features

GREEDY = dict(do_sample=False, top_k=None, top_p=None, temperature=None)


def random_llama(device, dtype, vocab=96, hidden=64, layers=4, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, pad_token_id=0,
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def head_for(target, block_size=8, seed=1):
    layers = target.config.num_hidden_layers
    taps = sorted({1, layers // 2, layers - 1})
    head = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=block_size, target_layer_ids=taps,
                                        mask_token_id=1, selector_rank=16, selector_top_k=4, seed=seed)
    return head.eval().bind_target(target)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_identity(device, tiny):
    target = random_llama(device, torch.float32)
    head = head_for(target, block_size=5)
    n = 16 if tiny else 48
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 96, (4, 7), generator=generator).to(device)
    expected = [target.generate(ids[r:r + 1], max_new_tokens=n, **GREEDY)[0, 7:] for r in range(4)]
    checks = {}
    for name, kwargs in {"adaptive": {}, "fixed": {"adaptive": False},
                         "forced": {"verify_policy": ForcedVerifyLengths([0, 4, 1, 0, 2, 3])}}.items():
        one = speculative_generate(target, head, ids[:1], max_new_tokens=n, **kwargs).sequences[0, 7:]
        four = speculative_generate(target, head, ids, max_new_tokens=n, **kwargs).sequences[:, 7:]
        checks[f"fast_{name}_batch1"] = bool(torch.equal(one, expected[0]))
        checks[f"fast_{name}_batch4"] = all(torch.equal(four[r], expected[r]) for r in range(4))
    hf = target.generate(ids[:1], assistant_model=head, max_new_tokens=n, **GREEDY)[0, 7:]
    checks["generate_assistant"] = bool(torch.equal(hf, expected[0]))
    return {"identical": all(checks.values()), "checks": checks}


@torch.no_grad()
def sampling_law(device, tiny):
    target = random_llama(device, torch.float32, vocab=12, hidden=32, layers=2, seed=3)
    head = head_for(target, block_size=4)
    prompt = torch.tensor([[3, 7, 1, 5]], device=device)
    temperature, top_k, top_p = 1.3, 8, 0.95
    p1 = process_logits(target(prompt).logits[0, -1], temperature, top_k, top_p).softmax(-1)
    seqs = torch.cat([prompt.expand(12, -1), torch.arange(12, device=device)[:, None]], dim=1)
    exact = p1[:, None] * process_logits(target(seqs).logits[:, -1], temperature, top_k, top_p).softmax(-1)
    runs = 4000 if tiny else 20_000
    generator = torch.Generator(device=device).manual_seed(1234)
    counts = torch.zeros_like(exact)
    for start in range(0, runs, 5000):
        rows = min(5000, runs - start)
        out = speculative_generate(target, head, prompt.repeat(rows, 1), max_new_tokens=2, do_sample=True,
                                   temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        pairs = out.sequences[:, 4:6]
        counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(rows, device=device), accumulate=True)
    tv = float(0.5 * (counts / counts.sum() - exact).abs().sum())
    bound = 0.05 if runs >= 20_000 else 0.1
    return {"runs": runs, "total_variation": tv, "bound": bound, "ok": tv < bound}


def load_speed_target(device, dtype, tiny):
    if tiny:
        return random_llama(device, dtype, vocab=256, hidden=64, layers=4), "random tiny Llama"
    try:
        from hf_dflash2.assets import load_target

        target, _ = load_target()
        return target.to(device=device, dtype=dtype).eval(), "SmolLM2-135M-Instruct"
    except Exception as error:  # no asset package on this machine
        print(f"SmolLM2 unavailable ({error}); using a random Llama of its size", flush=True)
        return random_llama(device, dtype, vocab=49152, hidden=576, layers=30), "random Llama, SmolLM2-135M shape"


@torch.no_grad()
def speed(device, dtype, tiny):
    target, name = load_speed_target(device, dtype, tiny)
    head = head_for(target, block_size=8 if tiny else 16)
    n, prompt_len = (8, 16) if tiny else (64, 128)
    vocab = target.config.vocab_size
    result = {"target": name, "dtype": str(dtype), "new_tokens": n}
    for batch in (1, 8):
        ids = torch.randint(2, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
        load_or_measure_cost_model(target, head, batch)  # once per shape, outside the timing
        calls = {"ar": lambda: target.generate(ids, max_new_tokens=n, **GREEDY),
                 "fast_fixed": lambda: speculative_generate(target, head, ids, max_new_tokens=n, adaptive=False),
                 "fast_adaptive": lambda: speculative_generate(target, head, ids, max_new_tokens=n)}
        if batch == 1:
            calls["generate_assistant"] = lambda: target.generate(ids, assistant_model=head, max_new_tokens=n, **GREEDY)
        for method, fn in calls.items():
            fn()  # warm-up
            sync(device)
            started = time.perf_counter()
            fn()
            sync(device)
            result[f"b{batch}_{method}_tok_s"] = batch * n / (time.perf_counter() - started)
    return result


@torch.no_grad()
def compiled_draft(device, dtype, tiny, backend):
    target = random_llama(device, dtype, vocab=256 if tiny else 49152, hidden=64 if tiny else 576, layers=4)
    head = head_for(target, block_size=8 if tiny else 16)
    length = 32 if tiny else 256
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, target.config.vocab_size, (1, length + 1), generator=generator).to(device)
    positions = torch.arange(length, device=device)[None]
    out = target(ids[:, :length], output_hidden_states=True)
    context = DraftContext(head, 1, length + 16, device)
    context.append(tapped_features(out.hidden_states, head.config.target_layer_ids), positions)
    anchor, anchor_pos = ids[:, length], torch.tensor([length], device=device)

    def draft(fn):
        return fn(anchor, anchor_pos, context.kv, context.valid, context.positions)

    def timing(fn, repeats=3 if tiny else 20):
        draft(fn)
        sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            result = draft(fn)
        sync(device)
        return result, (time.perf_counter() - started) / repeats

    eager, eager_s = timing(head.draft_block)
    try:
        compiled = torch.compile(head.draft_block, backend=backend, dynamic=True)
        draft(compiled)  # compilation, not timed
        fast, compiled_s = timing(compiled)
    except Exception as error:  # reported, so the JSON says why
        reason = f"{type(error).__name__}: {error}"[:500]
        return {"backend": backend, "ok": False, "error": reason, "eager_ms": eager_s * 1e3}
    return {"backend": backend, "ok": bool(torch.equal(fast.tokens, eager.tokens)), "eager_ms": eager_s * 1e3,
            "compiled_ms": compiled_s * 1e3, "speedup": eager_s / compiled_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="tiny models and budgets (CI on CPU)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor; "
                        "dynamo with the eager backend on CPU with --tiny: no C++ toolchain, quick)")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here (torch {torch.__version__}); "
                         "run with --device cpu --tiny for the CPU check")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    backend = args.compile_backend or ("eager" if device.type == "cpu" and args.tiny else "inductor")
    started = time.perf_counter()
    report = {"command": "python scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "tiny": args.tiny}
    for step, fn in (("greedy_identity", lambda: greedy_identity(device, args.tiny)),
                     ("sampling_law", lambda: sampling_law(device, args.tiny)),
                     ("speed", lambda: speed(device, dtype, args.tiny)),
                     ("compiled_draft", lambda: compiled_draft(device, dtype, args.tiny, backend))):
        step_started = time.perf_counter()
        report[step] = fn()
        report[step]["seconds"] = time.perf_counter() - step_started
        print(step, json.dumps(report[step]), flush=True)
    report["seconds"] = time.perf_counter() - started
    report["ok"] = bool(report["greedy_identity"]["identical"] and report["sampling_law"]["ok"]
                        and report["compiled_draft"]["ok"])
    output = Path(args.output or f"benchmarks/results/gpu_check_{device.type}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"ok={report['ok']} in {report['seconds']:.0f} s; written {output}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
