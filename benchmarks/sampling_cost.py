"""What sampling at every slot of a round costs on this CPU: a round's [1, 16, V] logits, one thread.

    python benchmarks/sampling_cost.py [--vocab 49152] [--slots 16] [--repeats 20]

Median milliseconds (each draw includes the temperature and softmax) of: an exponential race per slot
(argmax p / E, V exponentials per slot; the first version of tree sampling), the loop's draw
(``_Sampler.pick_per_slot``: one uniform per depth, inverse CDF), top-p by a full sort
(``_outside_nucleus_sorted``) and by the top 256 (``outside_nucleus``). Logits are random and peaked (x
8), so that top-p nuclei are small, as SmolLM2's are. Prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import table  # noqa: E402

from hf_dflash2.generation import _Sampler  # noqa: E402
from hf_dflash2.speculative_dflash2 import _outside_nucleus_sorted, outside_nucleus  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if min(args.vocab, args.slots, args.repeats) < 1:
        parser.error(f"--vocab, --slots and --repeats must be >= 1, got {vars(args)}")
    torch.set_num_threads(1)
    logits = torch.randn(1, args.slots, args.vocab, generator=torch.Generator().manual_seed(0)) * 8
    depth = torch.arange(args.slots)[None]
    sampler = _Sampler(True, 0.7, None, None, None)

    def exponential_race():
        probs = sampler.probs(logits)
        noise = torch.empty_like(probs).exponential_().gather(1, depth[..., None].expand_as(probs))
        return (probs / noise).argmax(-1)

    rows = [
        {"step": "draw per slot: exponential race (first version)", "ms": median_ms(exponential_race, args.repeats)},
        {"step": "draw per slot: one uniform per depth (the loop)",
         "ms": median_ms(lambda: sampler.pick_per_slot(logits, depth), args.repeats)},
        {"step": "top-p 0.9: full sort", "ms": median_ms(lambda: _outside_nucleus_sorted(logits, 0.9), args.repeats)},
        {"step": "top-p 0.9: top 256 (the loop)", "ms": median_ms(lambda: outside_nucleus(logits, 0.9), args.repeats)},
    ]
    print(f"[1, {args.slots}, {args.vocab}] logits, 1 thread, median of {args.repeats}\n")
    print(table(rows, ["step", "ms"]))


if __name__ == "__main__":
    main()
