"""How much of a store's training text would the fast loop's n-gram chain already draft?

    python benchmarks/copy_share.py [--store data/store_s38] [--sequences 400] [--block-size 8]

Sequences drawn at random from the store, anchors drawn as the trainer draws them (64 per sequence), labels
the target's argmax (``--label-source argmax``). Per block, the positions the loop's own prompt lookup
(``ngram_draft``, size 3, from the text up to the anchor) drafts and has accepted
(``trainer.ngram_copied_positions``, what ``train --copy-weight`` weights). Prints the share of all block
positions, and per drafted position. No time is measured; one thread.
"""

from __future__ import annotations

import argparse

import torch
from tqdm.auto import tqdm

from hf_dflash2.training.store import FeatureStore
from hf_dflash2.training.trainer import (
    ngram_copied_positions,
    sample_anchors,
    store_sequences,
    target_labels_for_blocks,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="data/store_s38")
    parser.add_argument("--sequences", type=int, default=400)
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=832)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.sequences < 1 or args.block_size < 2:
        parser.error(f"--sequences must be >= 1 and --block-size >= 2, got {args.sequences}, {args.block_size}")
    torch.set_num_threads(1)
    store = FeatureStore(args.store)
    sequences = store_sequences(store, args.max_length)
    generator = torch.Generator().manual_seed(args.seed)
    picked = torch.randperm(len(sequences), generator=generator)[: args.sequences].tolist()
    copied_by_position = torch.zeros(args.block_size - 1)
    labelled_by_position = torch.zeros(args.block_size - 1)
    for index in tqdm(picked, desc="sequences", unit="seq"):
        sequence = sequences[index]
        length = sequence["num_tokens"]
        record = store[sequence["store_index"]]
        item = {"input_ids": record["input_ids"][:length], "topk_ids": record["topk_ids"][:length]}
        anchors = sample_anchors(length, sequence["response_start"], 64, generator)
        labels, _, _ = target_labels_for_blocks(item, anchors, args.block_size, "argmax")
        copied = ngram_copied_positions(item["input_ids"], anchors, labels)
        copied_by_position += copied.float().sum(0)
        labelled_by_position += (labels >= 0).float().sum(0)
    share = copied_by_position.sum() / labelled_by_position.sum()
    print(f"{args.store}: {int(labelled_by_position.sum()):,} block positions from {len(picked)} sequences")
    print(f"copied (the n-gram chain drafts them and has them accepted): {share:.3f}")
    print("per drafted position:", [round(float(c / n), 3) for c, n in zip(copied_by_position, labelled_by_position)])


if __name__ == "__main__":
    main()
