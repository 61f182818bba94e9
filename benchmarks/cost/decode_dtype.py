"""Is bf16 faster than fp32 for *decoding* on this CPU? Plain greedy and decode-shaped matmuls, side by side.

    python benchmarks/cost/decode_dtype.py [--new-tokens 64] [--repeats 4]

``precision auto`` decides training with a training-shaped matmul (512 x 1536 x 512), the right question for
``store``, ``regenerate`` and ``train``. Batch-1 decoding multiplies one row at a time, where a CPU's bf16
kernels can be slower than fp32 even with AMX; so demo and bench ask a decode probe (one decoder step's
weight reads at 1 and 8 rows, ``precision.time_decode_speedups``). This prints all three: Transformers'
plain greedy ``generate`` (SmolLM2-135M, one MT-Bench prompt, medians of interleaved fp32 / bf16 repeats
after one warm-up each), the probes, and ``F.linear`` at M = 1, 16 and 512 rows with the target's own shapes. Writes
``benchmarks/results/<cpu kind>/decode_dtype.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import GREEDY, interleaved, save  # noqa: E402

from hf_dflash2.assets import load_mtbench_prompts, load_target  # noqa: E402
from hf_dflash2.cpu.precision import DECODE_ROWS, time_decode_speedups, time_matmul_speedup  # noqa: E402
from hf_dflash2.prompts import encode_prompt  # noqa: E402


def linear_speedup(rows: int, in_features: int, out_features: int, repeats: int = 200) -> float:
    """fp32 time / bf16 time of ``F.linear`` on [rows, in] x [out, in]."""
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(rows, in_features, dtype=dtype), torch.randn(out_features, in_features, dtype=dtype)
        for _ in range(10):
            torch.nn.functional.linear(x, w)
        started = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(x, w)
        seconds[dtype] = (time.perf_counter() - started) / repeats
    return seconds[torch.float32] / seconds[torch.bfloat16]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    models = {"fp32": load_target(dtype=torch.float32), "bf16": load_target(dtype=torch.bfloat16)}
    tokenizer = models["fp32"][1]
    ids = encode_prompt(tokenizer, load_mtbench_prompts()[0], "cpu")
    greedy = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **GREEDY)
    calls = {name: (lambda model=model: model.generate(ids, **greedy)) for name, (model, _) in models.items()}
    seconds = interleaved(calls, args.repeats)
    config = models["fp32"][0].config
    h, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {f"M={m} {name}": linear_speedup(m, i, o) for m in (1, 16, 512)
              for name, (i, o) in {"mlp_up": (h, inner), "lm_head": (h, vocab)}.items()}
    report = {
        "command": " ".join(["python", "benchmarks/cost/decode_dtype.py"] + sys.argv[1:]),
        "greedy_tok_s": {name: round(args.new_tokens / s, 2) for name, s in seconds.items()},
        "greedy_bf16_over_fp32": seconds["fp32"] / seconds["bf16"],
        "precision_probe_fp32_over_bf16": time_matmul_speedup(),
        # What `precision auto` asks for demo and bench: one decoder step's weight reads at 1 and 8 rows.
        "decode_probe_fp32_over_bf16": dict(zip((f"M={m}" for m in DECODE_ROWS), time_decode_speedups(config))),
        "linear_fp32_over_bf16": shapes,
    }
    for key, value in report.items():
        print(f"{key}: {value}")
    save("decode_dtype", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
