"""A yardstick for block position 1: n-gram counts of the target's own argmax, from the feature store.

For each response position t the store holds the token x_t and the target's argmax for x_{t+1}. A drafter's
position 1 predicts exactly that from the context and the anchor x_t. Counting (x_t -> argmax) over the
first sequences and scoring on the last ones gives what a bigram table, and a trigram table with back-off
to it, would get. A trained head should beat both (results: docs/training.md).

    python benchmarks/training/ngram_baseline.py --store data/store_sharegpt \\
        --output benchmarks/results/<cpu kind>/ngram_baseline.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from hf_dflash2.training.store import FeatureStore


def positions(store: FeatureStore, indices):
    """(previous token, anchor token, the target's argmax after the anchor) over response positions."""
    for i in indices:
        item = store[i]
        tokens = np.asarray(item["input_ids"])
        argmax = np.asarray(item["topk_ids"][:, 0])
        for t in range(max(item["response_start"], 1), len(tokens) - 1):
            yield int(tokens[t - 1]), int(tokens[t]), int(argmax[t])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default="data/store_sharegpt")
    parser.add_argument("--heldout", type=int, default=423, help="the last N sequences are scored, the rest counted")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    store = FeatureStore(args.store)
    split = len(store) - args.heldout
    if split < 1:
        raise SystemExit(f"--heldout {args.heldout}: the store has only {len(store)} sequences")
    bigram: dict[int, Counter] = defaultdict(Counter)
    trigram: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for previous, anchor, label in positions(store, range(split)):
        bigram[anchor][label] += 1
        trigram[previous, anchor][label] += 1
    best_bigram = {k: c.most_common(1)[0][0] for k, c in bigram.items()}
    best_trigram = {k: c.most_common(1)[0][0] for k, c in trigram.items()}
    total = right_bigram = right_trigram = 0
    for previous, anchor, label in positions(store, range(split, len(store))):
        total += 1
        guess = best_bigram.get(anchor, -1)
        right_bigram += guess == label
        right_trigram += best_trigram.get((previous, anchor), guess) == label
    result = {
        "command": "python benchmarks/training/ngram_baseline.py --store " + args.store + f" --heldout {args.heldout}",
        "counted_sequences": split,
        "scored_positions": total,
        "bigram_position1_accuracy": round(right_bigram / total, 4),
        "trigram_backoff_position1_accuracy": round(right_trigram / total, 4),
    }
    print(json.dumps(result, indent=1))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
