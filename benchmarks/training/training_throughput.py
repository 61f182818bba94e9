"""Training throughput (block positions per second) and peak memory, fp32 vs bf16 autocast, and
regeneration throughput (tokens/s) at batch 1, 16 and 32, on SmolLM2-135M-Instruct (this CPU).

    python benchmarks/training/training_throughput.py [--steps 6] [--data data/smollm2_sharegpt.jsonl]

Writes benchmarks/results/<cpu kind>/training_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import save, table  # noqa: E402

from hf_dflash2 import DFlash2DraftModel  # noqa: E402
from hf_dflash2.assets import load_sharegpt_prompts, load_target  # noqa: E402
from hf_dflash2.training.regenerate import encode_prompts  # noqa: E402
from hf_dflash2.training.trainer import Trainer, TrainingConfig, load_sequences  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train_row(args) -> dict:
    # bf16 matmuls are emulated, orders of magnitude slower, on CPUs without AVX-512-BF16/AMX: time a small step.
    precision = args.precision
    steps, batch, anchors = (args.steps, 4, 16) if precision == "no" else (1, 1, 4)
    target, _ = load_target()
    sequences = load_sequences(args.data, 512)[:8]
    drafter = DFlash2DraftModel.for_target(target, num_hidden_layers=2, block_size=16, selector_rank=128,
                                           target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0)
    config = TrainingConfig(output_dir="/tmp/hf_dflash2_throughput", steps=steps + 1, batch_size=batch,
                            anchors_per_sequence=anchors, mixed_precision=precision, checkpoint_every=10**9)
    trainer = Trainer(target, drafter, sequences, config)
    for index in range(len(sequences)):
        trainer.target_features(index)  # cached features: measure the drafter's own step
    if precision == "no":
        trainer.train_step()  # warm-up
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step()
    seconds = time.perf_counter() - started
    return {"what": f"train step, {'fp32' if precision == 'no' else 'bf16 autocast'}",
            "per_s": steps * batch * anchors * 15 / seconds, "unit": "block positions/s", "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--data", default="data/smollm2_sharegpt.jsonl")
    parser.add_argument("--regen-tokens", type=int, default=32)
    parser.add_argument("--precision", choices=["no", "bf16"], default=None, help="internal: one training measurement")
    args = parser.parse_args()
    if args.precision:
        print("ROW", json.dumps(train_row(args)))
        return
    rows = []
    for precision in ("no", "bf16"):  # one process each: accelerate's state is per process
        out = subprocess.run([sys.executable, __file__, "--precision", precision, "--steps", str(args.steps),
                              "--data", args.data], capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.split("ROW", 1)[1]))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    target, tokenizer = load_target()
    prompts, _ = load_sharegpt_prompts(limit=64)
    encoded = [ids for _, ids in encode_prompts(tokenizer, prompts, 128)]
    for batch in (1, 16, 32):
        chunk = encoded[:batch]
        width = max(len(x) for x in chunk)
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        mask = torch.zeros_like(ids)
        for i, x in enumerate(chunk):
            ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        started = time.perf_counter()
        with torch.no_grad():
            target.generate(ids, attention_mask=mask, max_new_tokens=args.regen_tokens,
                            min_new_tokens=args.regen_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                            top_k=None, top_p=None, temperature=None)
        seconds = time.perf_counter() - started
        rows.append({"what": f"regeneration, batch {batch}, fp32", "per_s": batch * args.regen_tokens / seconds,
                     "unit": "tokens/s", "peak_rss_mb": peak_rss_mb()})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, ["what", "per_s", "unit", "peak_rss_mb"]))
    command = "python benchmarks/training/training_throughput.py " + " ".join(sys.argv[1:])
    print(f"written {save('training_throughput', {'command': command, 'rows': rows})}")


if __name__ == "__main__":
    main()
