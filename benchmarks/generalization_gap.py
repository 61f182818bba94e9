"""Training-style accuracy of a head on regenerated records: seen in training vs held out.

Every response position is an anchor; labels are the target's own argmax (as ``--label-source kl``
trains on). A large gap between records the head trained on and records it never saw means the head
memorises, so more data, not more steps, is what pays next. With ``--eval-prompts N`` it also scores the
evaluation prompts (HumanEval / MT-Bench, as the held-out tau uses them) on the target's own greedy
continuations: unseen data of another distribution. A gap between held-out records and these is
distribution shift; a gap between these and the loop's acceptance would be a train/inference mismatch.

    python benchmarks/generalization_gap.py heads/smollm2-135m-dflash2 --seen 0:16 --heldout 2300:2316
    python benchmarks/generalization_gap.py heads/smollm2-135m-dflash2 --seen 0:16 --heldout 7000:7016 \
        --eval-prompts 16
"""

from __future__ import annotations

import argparse
import sys

import torch


def accuracy(target, drafter, records) -> tuple[list[float], int]:
    from hf_dflash2.speculative_dflash2 import tapped_features
    from hf_dflash2.training.trainer import sequence_blocks

    cfg = drafter.config
    hits, count = torch.zeros(cfg.block_size - 1), 0
    for record in records:
        ids = torch.tensor([record["prompt_ids"] + record["response_ids"]])
        out = target(input_ids=ids, output_hidden_states=True)
        features = tapped_features(out.hidden_states, cfg.target_layer_ids)
        labels_all = out.logits[0].argmax(-1)  # the label of position t + 1 is the target's argmax at t
        length, start = ids.shape[1], len(record["prompt_ids"])
        anchors = torch.arange(start, length - cfg.block_size)
        if len(anchors) == 0:
            continue
        positions = torch.arange(length)[None]
        mask = drafter.block_attention_mask(torch.ones_like(positions, dtype=torch.bool), positions, anchors[None],
                                            cfg.block_size)
        block, _, _ = sequence_blocks(ids[0], cfg.block_size, anchors, cfg.mask_token_id)
        block_positions = (anchors[:, None] + torch.arange(cfg.block_size)).flatten()[None]
        hidden = drafter(drafter.embed(block)[None], block_positions, mask, context_features=features,
                         context_positions=positions)[0, :, 1:]
        logits, vocab = drafter.unary_logits(hidden)
        predicted = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
        labels = labels_all[anchors[:, None] + torch.arange(cfg.block_size - 1)]
        hits += (predicted == labels).float().sum(0)
        count += len(anchors)
    return [round(x, 3) for x in (hits / max(count, 1)).tolist()], count


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("head")
    parser.add_argument("--records", default="data/regen_sharegpt.jsonl")
    parser.add_argument("--seen", default="0:16", help="record range the head trained on (start:end)")
    parser.add_argument("--heldout", default="2300:2316", help="record range it never saw (start:end)")
    parser.add_argument("--eval-prompts", type=int, default=0, help="also score this many evaluation prompts")
    parser.add_argument("--eval-tokens", type=int, default=96, help="greedy continuation length per prompt")
    args = parser.parse_args()
    ranges = {}
    for name in ("seen", "heldout"):
        try:
            start, end = (int(x) for x in getattr(args, name).split(":"))
        except ValueError:
            raise SystemExit(f"--{name} must be start:end, got {getattr(args, name)!r}") from None
        ranges[name] = (start, end)
    from hf_dflash2 import DFlash2DraftModel
    from hf_dflash2.assets import load_target
    from hf_dflash2.training.regenerate import read_regenerated

    records = read_regenerated(args.records)
    target, tokenizer = load_target(dtype=torch.float32)
    drafter = DFlash2DraftModel.from_pretrained(args.head, dtype=torch.float32).eval()
    drafter.bind_target(target)
    for name, (start, end) in ranges.items():
        per_position, anchors = accuracy(target, drafter, records[start:end])
        print(f"{name} records {start}:{end}: {anchors} anchors, unary top-1 accuracy by position {per_position}")
    if args.eval_prompts:
        from hf_dflash2.training.commands import heldout_prompts
        from hf_dflash2.training.regenerate import encode_prompts

        by_set: dict[str, list[dict]] = {}
        for prompt_id, ids in encode_prompts(tokenizer, heldout_prompts(args.eval_prompts), 1024):
            out = target.generate(torch.tensor([ids]), max_new_tokens=args.eval_tokens, do_sample=False)
            name = "humaneval" if prompt_id.startswith("HumanEval") else "mtbench"
            by_set.setdefault(name, []).append({"prompt_ids": ids, "response_ids": out[0, len(ids) :].tolist()})
        for name, records in by_set.items():
            per_position, anchors = accuracy(target, drafter, records)
            print(f"{name} ({len(records)} evaluation prompts, greedy continuations): {anchors} anchors, "
                  f"unary top-1 accuracy by position {per_position}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
