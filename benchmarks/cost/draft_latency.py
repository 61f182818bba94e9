"""Draft-forward latency of a SmolLM2-135M-shaped head (hidden 576, 2 layers, B=16, vocab 49152, K=16),
with and without conv + selector, batch 1 and 8, fp32 and bf16, on this machine.

    python benchmarks/cost/draft_latency.py [--repeats 20]

Goal: conv + selector add <= 10 % to a draft forward. Prints a table, writes
benchmarks/results/<cpu kind>/draft_latency.json. The target is a random LlamaForCausalLM with SmolLM2's shapes
(the embedding and LM head are what the drafter borrows), so no download or GGUF is needed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import interleaved, save, table  # noqa: E402

from hf_dflash2 import DFlash2Config, DFlash2DraftModel  # noqa: E402


def smollm2_shaped_target() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    torch.nn.init.normal_(model.model.embed_tokens.weight, std=0.02)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as in SmolLM2 (and no uninitialised memory)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args()
    target = smollm2_shaped_target()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        target = target.to(dtype)
        heads = {}
        for dflash2 in (True, False):
            config = DFlash2Config.for_target(target.config, num_hidden_layers=2, block_size=16, dflash2=dflash2,
                                              selector_rank=128, target_layer_ids=[1, 7, 14, 20, 27], mask_token_id=0)
            torch.manual_seed(0)
            heads[dflash2] = DFlash2DraftModel(config).to(dtype).eval().bind_target(target)
        for batch in (1, 8):
            positions = torch.arange(args.context)[None].expand(batch, -1)
            valid = torch.ones(batch, args.context, dtype=torch.bool)
            features = torch.randn(batch, args.context, 5 * 576, dtype=dtype)
            calls = {}
            for dflash2, head in heads.items():
                kv = head.context_kv(head.project_context(features), positions)
                anchors = torch.randint(0, 49152, (batch,))
                anchor_pos = torch.full((batch,), args.context)

                def draft(head=head, kv=kv, anchors=anchors, anchor_pos=anchor_pos):
                    with torch.no_grad():
                        head.draft_block(anchors, anchor_pos, kv, valid, positions)

                calls["dflash2" if dflash2 else "dflash1"] = draft
            repeats = args.repeats if dtype == torch.float32 else max(3, args.repeats // 5)
            medians = interleaved(calls, repeats)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "batch": batch,
                         "dflash1_ms": medians["dflash1"] * 1e3, "dflash2_ms": medians["dflash2"] * 1e3,
                         "overhead_pct": 100 * (medians["dflash2"] / medians["dflash1"] - 1)})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print("\nDraft forward, SmolLM2-135M-shaped head (2 layers, B=16, K=16, r=128), context 256:\n")
    print(table(rows, ["dtype", "batch", "dflash1_ms", "dflash2_ms", "overhead_pct"]))
    print(f"\nwritten {save('draft_latency', {'command': 'python benchmarks/cost/draft_latency.py', 'rows': rows})}")


if __name__ == "__main__":
    main()
