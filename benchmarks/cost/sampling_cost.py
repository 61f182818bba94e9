"""What the target's draws cost in a sampled round on this CPU: a round's [1, W, V] logits, the loop's threads.

    python benchmarks/cost/sampling_cost.py [--vocab 49152] [--slots 16] [--depth 2] [--repeats 30]

Median milliseconds (each includes the softmax) of one draw by ``torch.multinomial`` (what ``generate`` does
at a step, V exponentials) and by ``speculative_dflash2.draw`` (the loop's: one uniform, inverse CDF); then, for
a draft tree of ``--slots`` slots whose accepted path is ``--depth`` deep, drawing at every slot at once (what
``Sampler.pick_along_tree`` does on a GPU) against walking down the path (on a CPU). Logits are random and
peaked (x 8), as a model's are; the tree is a chain whose tokens are the draws, so the walk goes exactly
``--depth`` deep. Writes benchmarks/results/<cpu kind>/sampling_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for _common
from _common import results_dir, save, table  # noqa: E402

from hf_dflash2.generation.sampling import Sampler  # noqa: E402
from hf_dflash2.generation.trees import DraftTree, ancestry_of  # noqa: E402
from hf_dflash2.speculative_dflash2 import draw  # noqa: E402


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
    parser.add_argument("--slots", type=int, default=16, help="a tree's slots, the anchor's included")
    parser.add_argument("--depth", type=int, default=2, help="drafts accepted on the tree's path")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if min(args.vocab, args.slots, args.repeats, args.threads) < 1 or not 0 <= args.depth < args.slots:
        parser.error(f"--vocab, --slots, --repeats and --threads must be >= 1 and --depth in 0..slots - 1, "
                     f"got {vars(args)}")
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, args.slots, args.vocab, generator=generator) * 8
    sampler = Sampler(True, 1.0, None, None, generator)
    # A chain whose slot d + 1 spells the token drawn after slot d (argmax: the peaked logits' draw, nearly
    # always) for the first --depth slots, then tokens no draw makes.
    spelled = logits[0].argmax(-1)
    tokens = torch.where(torch.arange(1, args.slots) <= args.depth, spelled[:-1], (spelled[:-1] + 1) % args.vocab)
    parent = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(args.slots - 1)])[None]
    depth = torch.arange(args.slots)[None]
    tree = DraftTree(tokens[None], depth, parent, ancestry_of(parent), args.slots - 1, 0,
                     torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    one_row = logits[:, 0]
    uniform = torch.rand(1, dtype=torch.float64)

    def every_slot():
        every = sampler.uniforms(1, args.slots).gather(1, depth)
        return draw(sampler.probs(logits).flatten(0, 1), every.flatten())

    rows = [
        {"step": "one draw: torch.multinomial (generate's step)",
         "ms": median_ms(lambda: torch.multinomial(sampler.probs(one_row), 1, generator=generator), args.repeats)},
        {"step": "one draw: inverse CDF at one uniform (the loop)",
         "ms": median_ms(lambda: draw(sampler.probs(one_row), uniform), args.repeats)},
        {"step": f"a tree of {args.slots} slots: a draw at every slot (the loop on a GPU)",
         "ms": median_ms(every_slot, args.repeats)},
        {"step": f"a tree of {args.slots} slots: the walk down a path of {args.depth} accepted (the loop on a CPU)",
         "ms": median_ms(lambda: sampler.pick_along_tree(logits, tree), args.repeats)},
    ]
    command = "python benchmarks/cost/sampling_cost.py " + " ".join(sys.argv[1:])
    header = (f"Sampling cost on this CPU, {args.threads} threads: [1, {args.slots}, {args.vocab}] peaked logits, "
              f"median of {args.repeats} ms, softmax included. Command: `{command}`")
    body = table(rows, ["step", "ms"])
    print(header + "\n\n" + body)
    (results_dir() / "sampling_cost.md").write_text(header + "\n\n" + body + "\n")
    print(f"written {save('sampling_cost', {'command': command, 'rows': rows})}")


if __name__ == "__main__":
    main()
